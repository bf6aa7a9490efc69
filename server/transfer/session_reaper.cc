// TransferManager's worker sessions (transfer_manager.h) beside its
// SessionTable (session_table.h): OpenSession, CloseSession (the session's
// attachments detached at once, its loads not started cancelled) and the
// reaper thread it starts for the transfers still in flight.
#include <optional>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "server/transfer/transfer_manager.h"
#include "spdlog/spdlog.h"

namespace kvhost {

std::string TransferManager::OpenSession(const std::string& worker, int64_t pid,
                                         const std::string& peer) {
  std::string id;
  {
    absl::MutexLock lock(&mu_);
    id = sessions_.Open(worker, pid, peer).id;
  }
  spdlog::info("session {} opened by worker '{}' (pid {}, {})", ShortId(id), worker, pid, peer);
  return id;
}

void TransferManager::CloseSession(const std::string& session_id, const std::string& reason,
                                   absl::Duration timeout) {
  std::vector<Attachment> closed;
  std::vector<std::shared_ptr<Ticket>> tickets;
  SessionSnapshot session;
  std::vector<TransferJob> worker_copies;
  std::vector<std::shared_ptr<const Pool>> handed_regions;
  {
    absl::MutexLock lock(&mu_);
    std::optional<SessionSnapshot> open = sessions_.Close(session_id);
    if (!open.has_value()) return;
    session = *std::move(open);
    for (const std::string& id : session.attachments) {
      std::optional<Attachment> attachment = attachments_.Take(id);
      if (attachment.has_value()) closed.push_back(*std::move(attachment));
    }
    tickets = tickets_.InFlightOn(session.attachments);
    worker_copies = TakeWorkerCopies(session.attachments);
    if (auto held = worker_regions_.find(session_id); held != worker_regions_.end()) {
      handed_regions = std::move(held->second);  // dropped below, outside mu_
      worker_regions_.erase(held);
    }
  }
  FailWorkerCopies(std::move(worker_copies),
                   absl::StrCat("worker session ", ShortId(session_id), " ended (", reason, ")"));
  for (const Attachment& attachment : closed) ReleaseAttachment(attachment);
  // Nobody will read what a load would write: stop the ones not started.
  for (const std::shared_ptr<Ticket>& ticket : tickets) {
    if (ticket->direction() == Direction::kLoad) {
      ticket->RequestCancel(
          absl::CancelledError(absl::StrCat("worker session ", ShortId(session_id), " of '",
                                            session.worker, "' ended (", reason, ")")));
    }
  }
  if (tickets.empty()) {
    // A worker that detached and closed its session (a normal exit) left
    // nothing behind: no warning.
    spdlog::log(closed.empty() ? spdlog::level::info : spdlog::level::warn,
                "session {} of worker '{}' (pid {}) ended: {}; closed {} attachment(s), no "
                "transfer in flight",
                ShortId(session_id), session.worker, session.pid, reason, closed.size());
    return;
  }
  spdlog::warn(
      "session {} of worker '{}' (pid {}) ended: {}; closed {} attachment(s), {} transfer(s) in "
      "flight (loads cancelled, backups get {} to finish)",
      ShortId(session_id), session.worker, session.pid, reason, closed.size(), tickets.size(),
      absl::FormatDuration(timeout));
  {
    absl::MutexLock lock(&mu_);
    ++reapers_;
  }
  std::thread(&TransferManager::ReapSession, this, session_id, session.worker, reason,
              std::move(tickets), timeout)
      .detach();
}

void TransferManager::ReapSession(std::string session_id, std::string worker, std::string reason,
                                  std::vector<std::shared_ptr<Ticket>> tickets,
                                  absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  uint64_t ok = 0;
  uint64_t failed = 0;
  uint64_t late = 0;
  for (const std::shared_ptr<Ticket>& ticket : tickets) {
    if (!ticket->WaitUntil(deadline)) {
      ticket->RequestCancel(absl::CancelledError(absl::StrCat(
          "worker session ", ShortId(session_id), " of '", worker, "' ended (", reason,
          ") and the transfer did not finish within ", absl::FormatDuration(timeout))));
      ++late;
      continue;
    }
    (ticket->Snapshot().status.ok() ? ok : failed) += 1;
  }
  if (late > 0) {
    spdlog::warn(
        "session {}: {} transfer(s) still running {} after the session ended; cancelled where the "
        "engine can, their attachments close when they stop",
        ShortId(session_id), late, absl::FormatDuration(timeout));
  }
  spdlog::info(
      "session {} closed: of its {} transfer(s) in flight {} finished, {} failed or "
      "were cancelled, {} outlived the timeout",
      ShortId(session_id), tickets.size(), ok, failed, late);
  absl::MutexLock lock(&mu_);
  --reapers_;
}

bool TransferManager::IsSessionOpen(const std::string& session_id) const {
  absl::MutexLock lock(&mu_);
  return sessions_.IsOpen(session_id);
}

std::vector<SessionSnapshot> TransferManager::ListSessions() const {
  absl::MutexLock lock(&mu_);
  return sessions_.List();
}

}  // namespace kvhost
