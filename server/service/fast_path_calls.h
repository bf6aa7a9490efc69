// FastPathCalls: the fast path's request decoding and dispatch
// (proto/kvhost/v1/fast_path.proto). One request frame in, one reply frame
// out; the calls are the gRPC services' own Do* functions with the frame's
// credentials, so both paths validate alike and answer with the same codes
// and messages. Knows nothing of mailboxes or sockets
// (server/service/fast_path_server.h carries the frames).
//
// Bounds: a frame is at most the mailbox's capacity (the caller checks);
// every reply is bounded before it is built by `reply_limit` (the mailbox's
// capacity less the reply frame's own framing), RESOURCE_EXHAUSTED
// otherwise, as gRPC refuses above --max-message-bytes. The node cache's
// replies need no such bound: at most a state per key of the request (whose
// keys take 3 bytes or more each) and a ticket.
//
// Thread safety: Handle may be called concurrently (each mailbox's thread);
// the services synchronise themselves.
#ifndef KVHOST_SERVER_SERVICE_FAST_PATH_CALLS_H_
#define KVHOST_SERVER_SERVICE_FAST_PATH_CALLS_H_

#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/fast_path_mailbox.h"
#include "kvhost/v1/fast_path.pb.h"
#include "server/metrics/kvhost_metrics.h"
#include "server/service/cache_service.h"
#include "server/service/pool_service.h"
#include "server/service/transfer_service.h"

namespace kvhost {

// The longest WAIT_TRANSFER wait a frame may ask for, and its default.
inline constexpr uint32_t kFastPathMaxWaitMs = 60000;
inline constexpr uint32_t kFastPathDefaultWaitMs = 30000;
// A reply frame's bytes besides its body: code, message (an error has no
// body; its message is bounded by the services), tags and lengths.
inline constexpr uint64_t kFastPathReplyFraming = 64;

// The full name of the gRPC method a fast-path method mirrors
// ("kvhost.v1.PoolService/Alloc"), as the RPC metrics' `method` label spells
// it for both transports; "unknown" for a frame that names none.
const char* FastPathGrpcMethod(v1::FastPathMethod method);
// Its last part ("Alloc", "Backup" ...), "unknown method" otherwise: for
// messages.
const char* FastPathMethodName(v1::FastPathMethod method);

class FastPathCalls {
 public:
  // The services must outlive this. Without `caches` the node cache's
  // methods are refused as methods kvhostd does not serve there.
  FastPathCalls(PoolServiceImpl* pools, TransferServiceImpl* transfers,
                CacheServiceImpl* caches = nullptr)
      : pools_(pools), transfers_(transfers), caches_(caches) {}

  // Decodes `frame` (a FastPathRequest), runs its call and returns the
  // serialized FastPathReply, whose length is at most `capacity` (an
  // error reply, when the call's own would not fit). INVALID_ARGUMENT for a
  // frame that does not parse, names no known method, or whose body is not
  // the method's request, or that names more than kMaxCallerSessions
  // session ids (the message names the count and the bound). Sets `*method` (when not null) to the
  // frame's method (UNSPECIFIED if it did not parse) and `*code` to the reply's.
  std::string Handle(absl::string_view frame, uint32_t capacity,
                     v1::FastPathMethod* method = nullptr, absl::StatusCode* code = nullptr);

 private:
  absl::Status Dispatch(const v1::FastPathRequest& request, uint64_t reply_limit,
                        std::string* body);

  PoolServiceImpl* const pools_;
  TransferServiceImpl* const transfers_;
  CacheServiceImpl* const caches_;  // null: no node cache calls
};

}  // namespace kvhost

#endif  // KVHOST_SERVER_SERVICE_FAST_PATH_CALLS_H_
