// FastPathChannel: the client's end of one fast-path mailbox
// (proto/kvhost/v1/fast_path.proto): asked for on the handoff socket,
// mapped, and rung once per call. Internal to the client library; Client
// (kvhost/client.h) decides which calls take it.
//
// Thread safety: Call is not reentrant; Client serialises its callers.
#ifndef KVHOST_CLIENT_FAST_PATH_CHANNEL_H_
#define KVHOST_CLIENT_FAST_PATH_CHANNEL_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/fast_path_mailbox.h"
#include "common/unique_fd.h"
#include "kvhost/v1/fast_path.pb.h"

namespace kvhost {

class FastPathChannel {
 public:
  // Asks kvhostd's handoff socket `handoff_socket` for a mailbox and maps
  // it; `session_ids` (the client's worker sessions, if any) let kvhostd
  // count the mailbox against the session's share rather than the uid's.
  // The daemon's refusal keeps its code (FAILED_PRECONDITION: the fast
  // path is off; RESOURCE_EXHAUSTED: it serves its limit or this client's
  // share already);
  // UNAVAILABLE when the socket cannot be reached; INTERNAL for a mailbox
  // that does not match what the reply says.
  static absl::StatusOr<std::unique_ptr<FastPathChannel>> Open(
      const std::string& handoff_socket, absl::Duration timeout,
      const std::vector<std::string>& session_ids = {});
  ~FastPathChannel();
  FastPathChannel(const FastPathChannel&) = delete;
  FastPathChannel& operator=(const FastPathChannel&) = delete;

  // One call: `request` written to the mailbox, the daemon rung, its reply
  // parsed into `reply` by `deadline` and acknowledged (reply_read). Transport failures only (the
  // call's own status is in `reply`): INVALID_ARGUMENT for a request over the capacity (nothing
  // sent: make it over gRPC); UNAVAILABLE when the daemon's end closed; DEADLINE_EXCEEDED at the
  // deadline; INTERNAL for a reply that does not parse. After any of the last three the channel is
  // broken() and must be dropped (a late reply would answer the next call).
  absl::Status Call(const v1::FastPathRequest& request, v1::FastPathReply* reply,
                    absl::Time deadline);

  bool broken() const { return broken_; }
  // Bytes a request frame may have.
  uint32_t capacity() const { return mailbox_.capacity; }

 private:
  FastPathChannel() = default;

  // The handoff connection: kvhostd serves the mailbox as long as it is open.
  UniqueFd connection_;
  void* mapping_ = nullptr;
  uint64_t bytes_ = 0;
  FastPathMailbox mailbox_;
  uint32_t seq_ = 0;
  bool broken_ = false;
};

}  // namespace kvhost

#endif  // KVHOST_CLIENT_FAST_PATH_CHANNEL_H_
