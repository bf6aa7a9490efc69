// Client::DepositDescriptors: a worker's cuMem descriptors handed to kvhostd
// over its handoff socket (HANDOFF_KIND_DEPOSIT), in deposits of at most
// kMaxDepositDescriptors, before the AttachDevice call that names them.
// A worker's deposits name its session (opened first, as AttachDevice would
// open it), so kvhostd counts them against the session's own share rather
// than against everything its uid deposits.
#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/handoff.h"
#include "kvhost/client.h"
#include "kvhost/layer_progress.h"

namespace kvhost {

absl::StatusOr<std::vector<std::string>> Client::DepositDescriptors(absl::Span<const int> fds) {
  if (fds.empty()) return std::vector<std::string>{};
  absl::StatusOr<v1::DaemonStatus> status = GetStatus();
  if (!status.ok()) return status.status();
  const std::string& socket = status->handoff_socket();
  if (socket.empty()) {
    return absl::FailedPreconditionError(
        "kvhostd has no handoff socket (--handoff-socket='', or TCP listeners only), so it "
        "cannot take cuMem memory; attach cudaMalloc memory, or run kvhostd with a unix socket");
  }
  if (options_.worker_session) {
    if (absl::Status s = OpenSession(options_.timeout); !s.ok()) return s;
  }
  const std::vector<std::string> sessions = SessionIds();
  std::vector<std::string> ids;
  for (size_t first = 0; first < fds.size(); first += kMaxDepositDescriptors) {
    const size_t n = std::min(kMaxDepositDescriptors, fds.size() - first);
    v1::HandoffRequest request;
    request.set_kind(v1::HANDOFF_KIND_DEPOSIT);
    for (const std::string& id : sessions) request.add_session_ids(id);
    absl::StatusOr<Handoff> reply =
        FetchHandoff(socket, request, options_.timeout, fds.subspan(first, n));
    if (!reply.ok()) return reply.status();
    if (reply->deposit_id.empty() || reply->count != n) {
      return absl::InternalError(absl::StrCat("handoff socket ", socket, ": a deposit of ", n,
                                              " descriptors answered with ", reply->count,
                                              " and no id"));
    }
    ids.push_back(reply->deposit_id);
  }
  return ids;
}

}  // namespace kvhost
