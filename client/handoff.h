// The client of kvhostd's handoff socket (Attachment.handoff_socket,
// DaemonStatus.handoff_socket): one connection, one kvhost.v1.HandoffRequest,
// one reply with the descriptors it hands over. Internal to the client
// library, which serves four features with it: layer counters
// (LayerProgress), pool regions (worker copies), deposits and the fast-path
// mailbox.
//
// Thread safety: FetchHandoff may be called concurrently (each call has its
// own connection). Ownership: a Handoff owns the descriptors it holds and
// closes them when it goes.
#ifndef KVHOST_CLIENT_HANDOFF_H_
#define KVHOST_CLIENT_HANDOFF_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/unique_fd.h"
#include "kvhost/v1/handoff.pb.h"

namespace kvhost {

// What kvhostd handed over (FetchHandoff): the descriptors, in order, owned
// here (a caller that keeps one past the Handoff takes it with Release());
// `bytes` their files' size and `count` its items, and for
// HANDOFF_KIND_POOL_REGIONS the regions' description (HandoffReply).
struct Handoff {
  std::vector<UniqueFd> fds;
  uint64_t bytes = 0;
  uint32_t count = 0;
  v1::PoolRegions pool_regions;
  std::string deposit_id;  // HANDOFF_KIND_DEPOSIT
  // HANDOFF_KIND_FAST_PATH: the connection, kept open since the mailbox
  // lives as long as it; none for other kinds.
  UniqueFd connection;

  // The first descriptor (the only one of layer counters and of the fast
  // path's mailbox), still owned here; -1 for none.
  int fd() const { return fds.empty() ? -1 : fds.front().get(); }
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
