// TransferManager's lifetime and its submission path (transfer_manager.h):
// Submit's steps that need the manager (FindTarget, Reserve, Launch,
// Retire; the pure ones are submission.h's), ticket lookups, Drain and the
// destructor. Attach and Detach are in attachments.cc, sessions in
// session_reaper.cc, worker copies in worker_copies.cc.
#include "server/transfer/transfer_manager.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "server/transfer/submission.h"
#include "spdlog/spdlog.h"

namespace kvhost {

TransferManager::TransferManager(std::unique_ptr<TransferEngine> engine, KvhostMetrics* metrics)
    : metrics_(metrics), engine_(std::move(engine)), tickets_(PerAttachmentRetention{}, metrics) {}

// Its first step is the worker copies': nobody finishes them once the
// manager goes, so the drain must not wait for them.
TransferManager::~TransferManager() {
  std::vector<TransferJob> left;
  {
    absl::MutexLock lock(&mu_);
    left = TakeWorkerCopies({}, /*all=*/true);
  }
  FailWorkerCopies(std::move(left), "the transfer manager was destroyed");
  Drain();
}

absl::StatusOr<std::shared_ptr<Ticket>> TransferManager::Submit(
    const Caller& caller, const std::string& attachment_id, Direction direction,
    absl::Span<const int64_t> host, absl::Span<const int64_t> device,
    const std::string& wait_event_handle, absl::Span<const EntryRows> pool_transfers) {
  const absl::Time received = absl::Now();
  const std::string short_id = ShortId(attachment_id);
  absl::StatusOr<SubmitTarget> target = FindTarget(caller, attachment_id, direction);
  if (!target.ok()) return target.status();
  if (direction == Direction::kBackup) {
    // A backup writes its pools' slots: refused into a pool another live
    // session holds (ClaimPool), as that session's Alloc is.
    for (const AttachedPool& attached : target->pools) {
      if (absl::Status s = attached.pool->ChangeAllocation(
              caller.sessions, [this](const std::string& id) { return IsSessionOpen(id); },
              "Backup", [] { return absl::OkStatus(); });
          !s.ok()) {
        return s;
      }
    }
  }
  absl::StatusOr<std::vector<PartRows>> rows =
      AssignRows(*target, short_id, host, device, pool_transfers);
  if (!rows.ok()) return rows.status();
  // Every pool's rows validated before anything is reserved or submitted.
  absl::StatusOr<TransferJob> job = BuildJob(*target, short_id, direction, *rows);
  if (!job.ok()) return job.status();
  const absl::Time validated = absl::Now();
  job->wait_event_handle = wait_event_handle;
  bool components = false;  // some pool of the attachment has buffers to copy
  for (const AttachedPool& attached : target->pools) {
    components = components || !attached.pool->components().empty();
  }
  // The only part without components left is a plain LOGICAL pool's.
  const bool copies = components && job->tokens() > 0;
  uint64_t bytes = 0;
  for (size_t i = 0; i < job->layer_num(); ++i) bytes += TicketLayerBytes(*job, i);
  absl::StatusOr<std::shared_ptr<Ticket>> reserved =
      Reserve(attachment_id, *target, components, &*job);
  if (!reserved.ok()) return reserved.status();
  const std::shared_ptr<Ticket> ticket = *std::move(reserved);
  const absl::Time prepared = absl::Now();
  if (job->layer_counters != nullptr) {
    // Whatever the engine did, a worker waiting on this transfer is released.
    ticket->OnDone([counters = job->layer_counters, set = static_cast<uint32_t>(job->event_set),
                    base = job->layer_base, layers = static_cast<uint32_t>(job->layer_num())] {
      counters->Release(set, base, layers);
    });
  }
  ticket->OnDone([this, ticket, bytes, direction, label = target->label] {
    Retire(ticket, bytes, direction, label);
  });
  const uint64_t tokens = job->tokens();
  Launch(*std::move(job), ticket, copies, target->label);
  // Where a transfer call's time goes (the time to a load's first layer
  // includes all of it).
  auto us = [](absl::Duration d) { return absl::ToInt64Microseconds(d); };
  spdlog::debug(
      "ticket {}: {} of {} tokens accepted in {} us (rows {} us, plan {} us, queue {} us)",
      ticket->id(), DirectionName(direction), tokens, us(absl::Now() - received),
      us(validated - received), us(prepared - validated), us(absl::Now() - prepared));
  return ticket;
}

absl::StatusOr<SubmitTarget> TransferManager::FindTarget(const Caller& caller,
                                                         const std::string& attachment_id,
                                                         Direction direction) const {
  SubmitTarget target;
  {
    absl::MutexLock lock(&mu_);
    if (draining_) return absl::UnavailableError("kvhostd is shutting down; transfer refused");
    const Attachment* found = attachments_.Find(caller, attachment_id);
    if (found == nullptr) return AttachmentNotFound(attachment_id);
    const Attachment& attachment = *found;
    if (direction == Direction::kBackup && attachment.info.load_only) {
      return absl::FailedPreconditionError(absl::StrCat(
          "attachment '", ShortId(attachment_id), "' of pool '", attachment.info.pool,
          "' is load_only: Backup is refused (back up through the rank's attachment that is "
          "not load_only)"));
    }
    target.owner = attachment.owner;
    target.group = attachment.group;
    target.mapping = attachment.mapping;
    target.pools = attachment.pools;
    target.label = attachment.info.group.empty() ? attachment.info.pool : attachment.info.group;
    target.layer_counters = attachment.layer_counters;
  }
  return target;
}

absl::StatusOr<std::shared_ptr<Ticket>> TransferManager::Reserve(const std::string& attachment_id,
                                                                 const SubmitTarget& target,
                                                                 bool components,
                                                                 TransferJob* job) {
  // Last, since what it reserves is released only by the job's end. Either
  // direction: a backup's worker waits on its last layer (TransferJob).
  job->layer_counters = target.layer_counters;
  if (components) {
    if (absl::Status s = engine_->Prepare(job); !s.ok()) {
      return absl::Status(s.code(),
                          absl::StrCat("attachment '", ShortId(attachment_id), "': ", s.message()));
    }
  }
  // The set is this job's until it ends: the base follows (LayerCounters::Reserve).
  if (job->event_set < 0) job->layer_counters = nullptr;
  if (job->layer_counters != nullptr) {
    job->layer_base = job->layer_counters->Reserve(static_cast<uint32_t>(job->event_set),
                                                   static_cast<uint32_t>(job->layer_num()));
  }
  std::string path = components ? engine_->PathFor(*job) : std::string("none");
  absl::MutexLock lock(&mu_);
  std::shared_ptr<Ticket> ticket = tickets_.Open(attachment_id, target.owner, job->direction,
                                                 static_cast<uint32_t>(job->layer_num()),
                                                 std::move(path), job->event_set, job->layer_base);
  job->ticket = ticket;
  // Detached (its session closed) since FindTarget: the ticket runs, but an
  // engine that can stops it before its first layer. The check and the
  // ticket's entry are one step under mu_, so CloseSession either finds the
  // ticket in flight or the ticket finds its attachment gone.
  if (!attachments_.Contains(attachment_id)) {
    ticket->RequestCancel(absl::CancelledError(
        absl::StrCat("attachment '", ShortId(attachment_id), "' was detached while this ",
                     DirectionName(job->direction), " was submitted")));
  }
  return ticket;
}

void TransferManager::Launch(TransferJob job, const std::shared_ptr<Ticket>& ticket, bool copies,
                             const std::string& label) {
  if (!copies) {
    for (size_t l = 0; l < job.layer_num(); ++l) ticket->LayerFinished(0);
    ticket->Finish(absl::OkStatus());
    return;
  }
  spdlog::debug("ticket {}: {} of {} tokens in {} parts, '{}', {}", ticket->id(),
                DirectionName(job.direction), job.tokens(), job.parts.size(), label,
                ticket->Snapshot().path);
  engine_->Submit(std::move(job));
  ticket->Enqueued();
}

void TransferManager::Retire(const std::shared_ptr<Ticket>& ticket, uint64_t bytes,
                             Direction direction, const std::string& pool) {
  const TicketStatus status = ticket->Snapshot();
  if (!status.status.ok()) {
    spdlog::warn("ticket {} ({}) failed: {}", ticket->id(), DirectionName(direction),
                 status.status.ToString());
  }
  if (metrics_ != nullptr) {
    const LabelValues labels = {pool, DirectionName(direction), status.path};
    if (status.status.ok()) {
      metrics_->transfer_bytes->WithLabels(labels)->Increment(bytes);
      metrics_->transfer_tickets_done->WithLabels(labels)->Increment();
    } else {
      metrics_->transfer_tickets_failed->WithLabels(labels)->Increment();
    }
    metrics_->transfer_seconds->WithLabels(labels)->Observe(status.duration_us / 1e6);
  }
  tickets_.Retire(ticket->id(), direction, status.status.ok(), bytes);
}

absl::StatusOr<std::shared_ptr<Ticket>> TransferManager::SubmitPoolCopy(
    const std::string& session_id, Direction direction, PoolCopyJob job) {
  Owner owner;
  owner.session_id = session_id;
  owner.pools = {job.from, job.to};
  const std::string label = (direction == Direction::kBackup ? job.to : job.from)->name();
  uint64_t bytes = 0;
  for (uint32_t l = 0; l < job.from->spec().layer_num; ++l) {
    bytes += HeldLayerBytes(*job.from, job.from_slots.size());
  }
  std::shared_ptr<Ticket> ticket;
  {
    absl::MutexLock lock(&mu_);
    if (draining_) return absl::UnavailableError("kvhostd is shutting down; transfer refused");
    // Kept with the session's other pool copies (the retention's key is
    // never shown).
    ticket = tickets_.Open(absl::StrCat("pool-copy/", session_id),
                           std::make_shared<const Owner>(std::move(owner)), direction,
                           job.from->spec().layer_num, "host-pool-copy", /*event_set=*/-1);
  }
  ticket->OnDone(
      [this, ticket, bytes, direction, label] { Retire(ticket, bytes, direction, label); });
  job.ticket = ticket;
  pool_copier_.Submit(std::move(job));
  ticket->Enqueued();
  return ticket;
}

absl::StatusOr<std::shared_ptr<Ticket>> TransferManager::FindTicket(const Caller& caller,
                                                                    uint64_t id) const {
  return tickets_.Find(caller, id);
}

uint64_t TransferManager::Drain(absl::Duration timeout) {
  std::vector<std::shared_ptr<Ticket>> in_flight;
  {
    absl::MutexLock lock(&mu_);
    draining_ = true;
    in_flight = tickets_.InFlight();
  }
  const absl::Time deadline = absl::Now() + timeout;
  uint64_t cancelled = 0;
  for (const std::shared_ptr<Ticket>& ticket : in_flight) {
    if (ticket->WaitUntil(deadline)) continue;
    ticket->RequestCancel(absl::CancelledError(absl::StrCat(
        "kvhostd is shutting down and the drain timeout (", absl::FormatDuration(timeout),
        ") passed before this ", DirectionName(ticket->direction()), " finished")));
    ++cancelled;
  }
  FailWorkerCopiesLeft(timeout);
  pool_copier_.Drain();
  if (cancelled > 0) {
    spdlog::warn("drain: {} transfer(s) unfinished after {}; cancelled the ones not yet copied",
                 cancelled, absl::FormatDuration(timeout));
  }
  engine_->Drain();
  absl::MutexLock lock(&mu_);
  auto reaped = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return reapers_ == 0; };
  mu_.Await(absl::Condition(&reaped));
  return cancelled;
}

TransferCounters TransferManager::counters() const { return tickets_.counters(); }

}  // namespace kvhost
