// The client of kvhostd's handoff socket (Attachment.handoff_socket,
// DaemonStatus.handoff_socket): one connection, one kvhost.v1.HandoffRequest,
// one reply with the descriptors it hands over. Internal to the client
// library, which serves four features with it: layer counters
// (LayerProgress), pool regions (worker copies), deposits and the fast-path
// mailbox.
//
// Thread safety: FetchHandoff may be called concurrently (each call has its
// own connection). Ownership: the descriptors a Handoff names are the
// caller's to close.
#ifndef KVHOST_CLIENT_HANDOFF_H_
#define KVHOST_CLIENT_HANDOFF_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kvhost/v1/handoff.pb.h"

namespace kvhost {

// What kvhostd handed over (FetchHandoff): the descriptors, in order, each
// the caller's to close (`fd` is the first, the only one of layer
// counters); `bytes` their files' size and `count` its items, and for
// HANDOFF_KIND_POOL_REGIONS the regions' description (HandoffReply).
struct Handoff {
  int fd = -1;
  std::vector<int> fds;
  uint64_t bytes = 0;
  uint32_t count = 0;
  v1::PoolRegions pool_regions;
  std::string deposit_id;  // HANDOFF_KIND_DEPOSIT
  // HANDOFF_KIND_FAST_PATH: the connection, kept open since the mailbox
  // lives as long as it (the caller closes it); -1 for other kinds.
  int connection = -1;
};

// One fetch from the handoff socket at `socket_path` (one connection, one
// request, one reply; the protocol is in kvhost.v1.HandoffRequest). The
// daemon's refusal comes back with its code and message (NOT_FOUND for an
// attachment the credentials do not open, FAILED_PRECONDITION for one
// without the kind asked, INVALID_ARGUMENT for a malformed request);
// UNAVAILABLE when the socket cannot be reached, DEADLINE_EXCEEDED after
// `timeout`, INTERNAL for a reply that is not one. `send_fds` (at most
// kMaxDepositDescriptors) travel with the request (HANDOFF_KIND_DEPOSIT,
// whose reply carries no descriptor); they stay the caller's.
absl::StatusOr<Handoff> FetchHandoff(const std::string& socket_path,
                                     const v1::HandoffRequest& request, absl::Duration timeout,
                                     absl::Span<const int> send_fds = {});

}  // namespace kvhost

#endif  // KVHOST_CLIENT_HANDOFF_H_
