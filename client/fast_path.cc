// Client's fast path (ClientOptions::fast_path): when a call takes the
// mailbox, and when it goes over gRPC instead (client.cc's calls ask
// TryFastPath first).
#include "client/fast_path.h"

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "kvhost/v1/cache.pb.h"
#include "kvhost/v1/fast_path.pb.h"

namespace kvhost {
namespace {

// How long after a failed open the fast path is tried again.
constexpr absl::Duration kRetryOpen = absl::Seconds(5);
// The longest wait a WaitTransfer frame may carry (kvhostd's limit).
constexpr absl::Duration kMaxFastWait = absl::Seconds(60);
// Margin over a WaitTransfer's own wait for its reply to come back.
constexpr absl::Duration kWaitReplyMargin = absl::Seconds(1);

// The largest reply `method` may send for `request`, counted as kvhostd
// bounds it (an index is at most a 10-byte varint): a call whose reply
// could outgrow the mailbox goes over gRPC, whose limit is larger. A worker
// copy's plan has no bound known here: gRPC.
uint64_t ReplyBound(int method, const google::protobuf::MessageLite& request) {
  constexpr uint64_t kIndex = 10;
  constexpr uint64_t kFixed = 128;
  switch (method) {
    case v1::FAST_PATH_METHOD_ALLOC:
      return kIndex * static_cast<const v1::AllocRequest&>(request).num_tokens() + kFixed;
    case v1::FAST_PATH_METHOD_ALLOC_BATCH: {
      const auto& batch = static_cast<const v1::AllocBatchRequest&>(request);
      uint64_t bytes = kFixed;
      for (uint64_t n : batch.num_tokens()) {
        if (n > (uint64_t{1} << 40)) return UINT64_MAX;  // kvhostd refuses it anyway
        bytes += kIndex * n + 12;
      }
      return bytes;
    }
    case v1::FAST_PATH_METHOD_ALLOC_BACKUP:
      return kIndex * static_cast<uint64_t>(static_cast<const v1::AllocBackupRequest&>(request)
                                                .backup()
                                                .device_indices_size()) +
             kFixed;
    case v1::FAST_PATH_METHOD_BACKUP:
      return static_cast<const v1::BackupRequest&>(request).worker_copy() ? UINT64_MAX : kFixed;
    case v1::FAST_PATH_METHOD_LOAD:
      return static_cast<const v1::LoadRequest&>(request).worker_copy() ? UINT64_MAX : kFixed;
    // A key's state is one byte of a packed list.
    case v1::FAST_PATH_METHOD_CACHE_LOOKUP:
      return static_cast<uint64_t>(
                 static_cast<const v1::CacheLookupRequest&>(request).keys_size()) +
             kFixed;
    case v1::FAST_PATH_METHOD_CACHE_STORE:
      return static_cast<uint64_t>(static_cast<const v1::CacheStoreRequest&>(request).keys_size()) +
             kFixed;
    default:
      return kFixed;
  }
}

}  // namespace

bool Client::fast_path_open() const { return fast_path_->open.load(); }

uint64_t Client::fast_path_calls() const { return fast_path_->calls.load(); }

bool Client::TryFastPath(int method, const google::protobuf::MessageLite& request,
                         google::protobuf::MessageLite* response, bool transfer,
                         absl::Duration timeout, absl::Status* status, absl::Duration wait) {
  if (!options_.fast_path || !absl::StartsWith(options_.address, "unix:")) return false;
  if (wait > kMaxFastWait) return false;
  FastPath& fp = *fast_path_;
  if (!fp.mu.TryLock()) return false;  // another thread's call holds the mailbox
  struct Unlock {
    absl::Mutex* mu;
    ~Unlock() { mu->Unlock(); }
  } unlock{&fp.mu};
  const absl::Time now = absl::Now();
  if (fp.channel == nullptr) {
    if (now < fp.retry_after) return false;
    fp.retry_after = now + kRetryOpen;
    std::string socket = options_.handoff_socket;
    if (socket.empty()) {
      absl::StatusOr<v1::DaemonStatus> daemon = GetStatus();
      if (!daemon.ok() || daemon->fast_path_max_connections() == 0) return false;
      socket = daemon->handoff_socket();
    }
    absl::StatusOr<std::unique_ptr<FastPathChannel>> opened =
        FastPathChannel::Open(socket, options_.timeout, SessionIds());
    if (!opened.ok()) return false;
    fp.channel = *std::move(opened);
    fp.open.store(true);
  }
  v1::FastPathRequest frame;
  frame.set_method(static_cast<v1::FastPathMethod>(method));
  request.SerializeToString(frame.mutable_body());
  frame.set_owner_token(options_.owner_token);
  if (transfer) {
    for (std::string& id : SessionIds()) frame.add_session_ids(std::move(id));
  }
  if (wait > absl::ZeroDuration()) {
    frame.set_timeout_ms(
        static_cast<uint32_t>(std::max<int64_t>(1, absl::ToInt64Milliseconds(wait))));
  }
  // Kvhostd keeps kFastPathReplyFraming (64) bytes of the area for the
  // reply frame's own fields.
  const uint64_t room = fp.channel->capacity() - 64;
  if (frame.ByteSizeLong() > fp.channel->capacity() || ReplyBound(method, request) > room) {
    return false;
  }
  v1::FastPathReply reply;
  const absl::Status sent =
      fp.channel->Call(frame, &reply, now + std::max(timeout, wait + kWaitReplyMargin));
  if (!sent.ok()) {
    if (fp.channel->broken()) {
      // Opened again at the next call (a restarted daemon offers a new one).
      fp.channel.reset();
      fp.open.store(false);
      fp.retry_after = absl::InfinitePast();
    }
    // The mailbox closed without a reply: kvhostd's thread answers every
    // request it takes before it lets go of the connection, so this one was
    // never run (or died with its daemon). gRPC makes it, against whatever
    // daemon serves now. A deadline, by contrast, may have passed while it
    // ran: that is the call's answer, as gRPC's would be.
    if (sent.code() == absl::StatusCode::kUnavailable ||
        sent.code() == absl::StatusCode::kInvalidArgument) {
      return false;
    }
    *status = sent;
    return true;
  }
  fp.calls.fetch_add(1);
  if (reply.code() != 0) {
    *status = absl::Status(static_cast<absl::StatusCode>(reply.code()), reply.message());
  } else if (!response->ParseFromString(reply.body())) {
    *status = absl::InternalError("a fast-path reply's body is not the call's response");
  } else {
    *status = absl::OkStatus();
  }
  return true;
}

}  // namespace kvhost
