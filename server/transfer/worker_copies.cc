// TransferManager's worker copies (transfer_manager.h, worker_copy.h): the
// daemon validates and plans, the worker launches and says when it is done.
// In flight they sit in the manager's worker_copies_, counted on their
// attachment; a detach, a session's end, the drain or the destructor fails
// the ones left (FailWorkerCopies).
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/transfer/submission.h"
#include "server/transfer/transfer_manager.h"
#include "spdlog/spdlog.h"

namespace kvhost {

absl::Status TransferManager::CheckWorkerCopy() const {
  if (!worker_copy_) {
    return absl::FailedPreconditionError(
        "worker copies are off: kvhostd runs without --worker-copy (its own copy paths cost a "
        "worker less on the measured nodes; docs/PERF.md)");
  }
  if (std::strcmp(engine_->name(), "host") == 0) {
    return absl::FailedPreconditionError(
        "worker copies need the cuda backend; this kvhostd runs the host backend, whose own "
        "copies serve every transfer (leave worker_copy unset)");
  }
  return absl::OkStatus();
}

bool TransferManager::ServesWorkerCopy(const AttachmentInfo& info) const {
  return CheckWorkerCopy().ok() && info.group.empty();
}

absl::StatusOr<WorkerCopyTicket> TransferManager::SubmitWorkerCopy(
    const Caller& caller, const std::string& attachment_id, Direction direction,
    absl::Span<const int64_t> host, absl::Span<const int64_t> device, uint64_t max_plan_bytes) {
  if (absl::Status s = CheckWorkerCopy(); !s.ok()) return s;
  const std::string short_id = ShortId(attachment_id);
  absl::StatusOr<SubmitTarget> target = FindTarget(caller, attachment_id, direction);
  if (!target.ok()) return target.status();
  if (target->group != nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "attachment '", short_id, "' is of pool group '", target->group->name(),
        "': worker copies serve plain pools only (leave worker_copy unset for groups)"));
  }
  absl::StatusOr<std::vector<PartRows>> rows = AssignRows(*target, short_id, host, device, {});
  if (!rows.ok()) return rows.status();
  absl::StatusOr<TransferJob> job = BuildJob(*target, short_id, direction, *rows);
  if (!job.ok()) return job.status();
  const bool copies = !job->parts[0].pool->components().empty() && job->tokens() > 0;
  std::shared_ptr<WorkerCopyPlan> plan;
  if (copies) {
    plan = std::make_shared<WorkerCopyPlan>(PlanWorkerCopy(*job));
    const uint64_t bytes = WorkerCopyPlanBytes(*plan);
    if (bytes > max_plan_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "the worker copy plan of ", plan->sm.tiles.size(), " tiles (up to ", bytes,
          " bytes) exceeds the reply limit of ", max_plan_bytes,
          " bytes (--max-message-bytes); split the transfer or leave worker_copy unset"));
    }
  }
  uint64_t bytes = 0;
  for (size_t i = 0; i < job->layer_num(); ++i) bytes += TicketLayerBytes(*job, i);
  const auto layers = static_cast<uint32_t>(job->layer_num());
  std::shared_ptr<Ticket> ticket;
  {
    absl::MutexLock lock(&mu_);
    Attachment* attachment = attachments_.Get(attachment_id);
    if (attachment == nullptr) {
      // Detached (its session closed) since FindTarget.
      return AttachmentNotFound(attachment_id);
    }
    if (copies && attachment->worker_copies >= kMaxWorkerCopiesPerAttachment) {
      return absl::ResourceExhaustedError(
          absl::StrCat("attachment '", short_id, "' has ", attachment->worker_copies,
                       " worker copies in flight, the limit (", kMaxWorkerCopiesPerAttachment,
                       "); finish one (FinishWorkerCopy) first"));
    }
    ticket = tickets_.Open(attachment_id, target->owner, direction, layers,
                           copies ? kWorkerCopyPath : "none", /*event_set=*/-1);
    job->ticket = ticket;
    if (copies) {
      ++attachment->worker_copies;
      worker_copies_.emplace(ticket->id(), WorkerCopy{attachment_id, *std::move(job)});
    }
  }
  ticket->OnDone([this, ticket, bytes, direction, label = target->label] {
    Retire(ticket, bytes, direction, label);
  });
  if (!copies) {
    for (uint32_t l = 0; l < layers; ++l) ticket->LayerFinished(0);
    ticket->Finish(absl::OkStatus());
    return WorkerCopyTicket{ticket, nullptr};
  }
  ticket->Enqueued();
  spdlog::debug("ticket {}: {} of {} tokens in 1 parts, '{}', {} ({} tiles, {} launches per layer)",
                ticket->id(), DirectionName(direction), host.size(), target->label, kWorkerCopyPath,
                plan->sm.tiles.size(), plan->sm.launches.size());
  return WorkerCopyTicket{ticket, std::move(plan)};
}

absl::Status TransferManager::FinishWorkerCopy(const Caller& caller, uint64_t ticket_id,
                                               const std::string& error) {
  absl::StatusOr<std::shared_ptr<Ticket>> ticket = tickets_.Find(caller, ticket_id);
  if (!ticket.ok()) return ticket.status();
  TransferJob job;
  {
    absl::MutexLock lock(&mu_);
    auto it = worker_copies_.find(ticket_id);
    if (it == worker_copies_.end()) {
      const TicketStatus now = (*ticket)->Snapshot();
      if (now.done) {
        return absl::FailedPreconditionError(
            absl::StrCat("ticket ", ticket_id, " has already finished",
                         now.path == kWorkerCopyPath ? "" : absl::StrCat(" (path ", now.path, ")"),
                         "; FinishWorkerCopy ends a worker copy in flight once"));
      }
      return absl::FailedPreconditionError(absl::StrCat(
          "ticket ", ticket_id, " is not a worker copy (path ", now.path,
          "): kvhostd copies it and finishes it itself; wait for it with WaitTransfer"));
    }
    job = std::move(it->second.job);
    if (Attachment* attachment = attachments_.Get(it->second.attachment_id)) {
      --attachment->worker_copies;
    }
    worker_copies_.erase(it);
  }
  if (!error.empty()) {
    job.ticket->Finish(absl::InternalError(absl::StrCat("the worker's copy failed: ", error)));
    return absl::OkStatus();
  }
  for (size_t l = 0; l < job.layer_num(); ++l) job.ticket->LayerFinished(TicketLayerBytes(job, l));
  job.ticket->Finish(absl::OkStatus());
  return absl::OkStatus();
}

std::vector<TransferJob> TransferManager::TakeWorkerCopies(
    absl::Span<const std::string> attachment_ids, bool all) {
  std::vector<TransferJob> taken;
  for (auto it = worker_copies_.begin(); it != worker_copies_.end();) {
    const std::string& id = it->second.attachment_id;
    bool match = all;
    for (size_t i = 0; !match && i < attachment_ids.size(); ++i) match = attachment_ids[i] == id;
    if (!match) {
      ++it;
      continue;
    }
    if (Attachment* attachment = attachments_.Get(id)) --attachment->worker_copies;
    taken.push_back(std::move(it->second.job));
    it = worker_copies_.erase(it);
  }
  return taken;
}

void TransferManager::FailWorkerCopies(std::vector<TransferJob> jobs, const std::string& what) {
  if (jobs.empty()) return;
  // Nobody is left to finish them, and the worker's stream may still be
  // copying: the ticket says the bytes are not known to be there.
  const absl::Status status = absl::CancelledError(absl::StrCat(
      what,
      " before the worker finished this worker copy (FinishWorkerCopy); its rows may be "
      "incomplete"));
  spdlog::warn("{} worker cop{} failed: {}", jobs.size(), jobs.size() == 1 ? "y" : "ies",
               std::string(status.message()));
  for (TransferJob& job : jobs) job.ticket->Finish(status);
}

void TransferManager::FailWorkerCopiesLeft(absl::Duration timeout) {
  std::vector<TransferJob> left;
  {
    absl::MutexLock lock(&mu_);
    left = TakeWorkerCopies({}, /*all=*/true);
  }
  FailWorkerCopies(std::move(left), absl::StrCat("kvhostd is shutting down and the drain timeout (",
                                                 absl::FormatDuration(timeout), ") passed"));
}

}  // namespace kvhost
