// TransferManager: attachments, worker sessions and tickets — the domain
// behind TransferService and DaemonService's sessions.
//
// It resolves an attach request (server/transfer/attach.h), holds the pools
// and the engine's mappings for as long as the attachment lives, and
// validates every transfer against the pool and the attachment (lengths,
// ranges, repeated destinations, host slots allocated) before it coalesces
// the indices into runs and hands the job to the engine. Tickets stay
// queryable while in flight and after, finished ones kept by per-attachment
// retention (server/tickets/retention.h; TicketTable says which go first);
// sessions and the attachments made within them are a SessionTable.
//
// Its rooms, each a file named for what it holds:
//   attachment.h      one attachment's record (pools, mappings, owner);
//   attachment_table  the attachments by id, found for a permitted caller;
//   attachments.cc    Attach (plain and group), Detach, lookups by id;
//   submission.h      the pure steps of a transfer (AssignRows, BuildJob);
//   transfer_manager  Submit's other steps, tickets, Drain, lifetime;
//   worker_copies.cc  copies a worker runs itself (worker_copy.h's plans);
//   pool_copy         copies between two host pools (SubmitPoolCopy);
//   session_reaper.cc worker sessions, closed and reaped (session_table.h).
//
// Thread safety: all methods may be called concurrently. One mutex guards
// the attachments and the sessions (AttachmentTable and SessionTable have
// none of their own), so that a session and its attachments change in one
// step; the TicketTable has its own, always taken after this one (lock
// order: TransferManager, TicketTable, Ticket). Engine calls (Open,
// Prepare, Submit, Drain) and ticket callbacks run without the manager's
// mutex.
// Ownership: the manager owns the engine; attachments share their pools and
// mappings with the jobs in flight on them, so a detach or a deleted pool
// frees nothing a running job still uses.
#ifndef KVHOST_SERVER_TRANSFER_TRANSFER_MANAGER_H_
#define KVHOST_SERVER_TRANSFER_TRANSFER_MANAGER_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "server/access/caller.h"
#include "server/ids.h"  // RandomHex, ShortId: the ids the manager makes and shows
#include "server/metrics/kvhost_metrics.h"
#include "server/pool/registry.h"
#include "server/tickets/ticket_table.h"
#include "server/transfer/attach.h"
#include "server/transfer/attachment.h"
#include "server/transfer/attachment_table.h"
#include "server/transfer/engine.h"
#include "server/transfer/pool_copy.h"
#include "server/transfer/session_table.h"
#include "server/transfer/submission.h"
#include "server/transfer/worker_copy.h"

namespace kvhost {

// A worker copy's ticket and the plan its worker runs (null when it copies
// nothing: the ticket is finished already).
struct WorkerCopyTicket {
  std::shared_ptr<Ticket> ticket;
  std::shared_ptr<const WorkerCopyPlan> plan;
};

class TransferManager {
 public:
  // `metrics`, if given, counts every finished ticket; it must outlive this.
  explicit TransferManager(std::unique_ptr<TransferEngine> engine,
                           KvhostMetrics* metrics = nullptr);
  ~TransferManager();

  const char* backend() const { return engine_->name(); }

  // Attaches `target`, what the caller resolved and owner-checked
  // (PoolRegistry::Resolve); no name is looked up again, so what is attached
  // is what was checked. ResolveAttachRequest, then
  // Pool::AcquireAttachment(tp_rank) (a second rank on a kind that is not
  // replicated is FAILED_PRECONDITION; a pool deleted since it was resolved
  // is too), then the engine's Open.
  // `target` may be a pool group (target.group): then
  // request.entries gives exactly the group's entries, each resolved like a
  // plain attachment of that entry's pool, whose device layer range must
  // include every layer the entry's layer_map names (INVALID_ARGUMENT
  // naming the entry otherwise, or for buffers outside entries); every
  // entry's pool and the group are acquired, each entry opened, and the
  // engine's OpenGroup makes the one mapping with the load events per model
  // layer. entries on a plain pool's name is INVALID_ARGUMENT. With
  // request.layer_progress the attachment gets LayerCounters of its
  // load_event_sets sets (INTERNAL if they cannot be made). A failed
  // Attach holds nothing.
  absl::StatusOr<AttachmentInfo> Attach(const PoolTarget& target, const AttachRequest& request);
  // Transfers already accepted still complete; the buffers close after them.
  // A group attachment releases the group and every entry's pool.
  // Detach, Submit and FindTicket are NOT_FOUND for an id `caller` may not
  // use (see Caller), with the message of an unknown id.
  absl::Status Detach(const Caller& caller, const std::string& attachment_id);
  // Validates and queues a backup or load; returns its ticket (naming its
  // event set, if it took one). Validation: equal lengths, ranges, whole pages
  // where the pool needs them (Pool::whole_pages()), no destination twice,
  // host slots allocated in the pool's allocator owner (followers: the pool
  // they follow); FAILED_PRECONDITION for a backup on a load_only
  // attachment. The ticket has one layer per attached layer; a LOGICAL pool's
  // finishes at once with 0 bytes. `wait_event_handle`: the worker's event the copies
  // wait on (see TransferJob). Errors beyond validation come from the engine's Prepare:
  // RESOURCE_EXHAUSTED when every load event set is busy, FAILED_PRECONDITION
  // for a wait event on an engine without events.
  // On a group attachment `host` / `device` are the anchor entry's rows (may
  // be empty) and `pool_transfers` the other entries', each validated as
  // above against its own pool; INVALID_ARGUMENT for an unknown name, the
  // anchor's or a name twice, and for pool_transfers on a plain attachment.
  // All is validated before anything is submitted. The ticket has the
  // group's layer_num layers; model layer l copies, in every entry with
  // rows, the device layer its layer_map gives (nothing for -1).
  // On an attachment with layer progress, a backup or load with rows takes
  // an event set (RESOURCE_EXHAUSTED when every set is held) and gets its
  // base in the layer counters (Ticket::layer_base, TransferJob); the
  // counter reaches base + layers when its ticket finishes, whatever the end.
  absl::StatusOr<std::shared_ptr<Ticket>> Submit(
      const Caller& caller, const std::string& attachment_id, Direction direction,
      absl::Span<const int64_t> host, absl::Span<const int64_t> device,
      const std::string& wait_event_handle = "", absl::Span<const EntryRows> pool_transfers = {});
  // A copy between two host pools inside kvhostd (pool_copy.h: the node
  // cache's Store from and Restore to a pool), run on the manager's
  // PoolCopier whatever the engine. REQUIRES: job.from / job.to / the slots
  // checked (CheckPoolCopyShape, CheckPoolCopySlots), job.ticket unset. Its
  // ticket (path "host-pool-copy", one layer per pool layer; `direction` as
  // the caller counts it) is owned by worker session `session_id` and both
  // pools (FindTicket: a caller naming that session), is counted and kept
  // as any, and holds both pools until it ends. UNAVAILABLE while draining.
  absl::StatusOr<std::shared_ptr<Ticket>> SubmitPoolCopy(const std::string& session_id,
                                                         Direction direction, PoolCopyJob job);
  // NOT_FOUND for an unknown or expired ticket, or one of an attachment
  // `caller` may not use (its ownership is the attachment's, remembered).
  // Ticket ids are random (see TicketTable), so an id from before a restart
  // names no ticket of this daemon.
  absl::StatusOr<std::shared_ptr<Ticket>> FindTicket(const Caller& caller, uint64_t id) const;
  // The layer counters of attachment `attachment_id`, for the handoff to its
  // worker (server/service/handoff_server.h). NOT_FOUND as Detach;
  // FAILED_PRECONDITION for an attachment made without layer_progress.
  absl::StatusOr<std::shared_ptr<LayerCounters>> FindLayerCounters(
      const Caller& caller, const std::string& attachment_id) const;

  // The pool of plain attachment `attachment_id`, for AllocBackup. NOT_FOUND
  // as Detach; INVALID_ARGUMENT for a pool group's attachment.
  absl::StatusOr<std::shared_ptr<Pool>> FindAttachedPool(const Caller& caller,
                                                         const std::string& attachment_id) const;

  // Worker copies (server/transfer/worker_copy.h; kvhostd --worker-copy).
  // EnableWorkerCopy: REQUIRES before any other call.
  void EnableWorkerCopy() { worker_copy_ = true; }
  bool worker_copy() const { return worker_copy_; }
  // Whether attachments like `info` are served worker copies: enabled, an
  // engine other than host, a plain pool.
  bool ServesWorkerCopy(const AttachmentInfo& info) const;
  // A backup or load the calling worker copies itself: validated exactly as
  // Submit (without a wait event or pool_transfers), planned
  // (PlanWorkerCopy), and its ticket (path "worker") left in flight until
  // FinishWorkerCopy, or failed when the attachment or its session closes
  // first or the drain's timeout passes. No load event set or layer counter
  // is taken. FAILED_PRECONDITION without EnableWorkerCopy, on the host
  // engine and for a group attachment; RESOURCE_EXHAUSTED when the
  // attachment has kMaxWorkerCopiesPerAttachment in flight or the plan's
  // encoding (WorkerCopyPlanBytes) would exceed `max_plan_bytes`. A ticket
  // that copies nothing (no rows, a LOGICAL pool) is finished at once,
  // without a plan.
  absl::StatusOr<WorkerCopyTicket> SubmitWorkerCopy(
      const Caller& caller, const std::string& attachment_id, Direction direction,
      absl::Span<const int64_t> host, absl::Span<const int64_t> device, uint64_t max_plan_bytes);
  // The worker's end of its copy: an empty `error` finishes the ticket OK
  // (every layer's bytes counted), any other fails it with INTERNAL naming
  // the error. NOT_FOUND as FindTicket; FAILED_PRECONDITION for a ticket
  // that is not a worker copy or has finished.
  absl::Status FinishWorkerCopy(const Caller& caller, uint64_t ticket_id, const std::string& error);
  // The pool of `attachment_id` whose regions the caller maps itself, for
  // the handoff: a worker copy's (RegionUse::kWorkerCopy,
  // HANDOFF_KIND_POOL_REGIONS) or the caller's own view of the pool
  // (RegionUse::kMap, HANDOFF_KIND_POOL_MAP: either backend, no
  // --worker-copy). The descriptors handed out outlive the attachment (the
  // caller keeps its mapping), so the pool is held for the attachment's
  // session until that session ends: deleted meanwhile, its bytes stay
  // releasing (PoolRegistry::releasing_bytes). NOT_FOUND as Detach;
  // FAILED_PRECONDITION where a worker copy is asked and ServesWorkerCopy is
  // false, for a pool-group attachment, for an attachment made without a
  // session (nothing would end the hold), or when the pool has no regions
  // (LOGICAL).
  enum class RegionUse { kWorkerCopy, kMap };
  absl::StatusOr<WorkerRegions> FindPoolRegions(const Caller& caller,
                                                const std::string& attachment_id, RegionUse use);

  // Refuses new transfers from now on (UNAVAILABLE), then waits up to
  // `timeout` for the ones accepted to finish; cancels what is left then
  // (loads and backups the engine has not started; see
  // Ticket::RequestCancel) and waits for the engine to stop. Returns
  // the tickets cancelled.
  uint64_t Drain(absl::Duration timeout = absl::InfiniteDuration());

  // Worker sessions (kvhost.v1.DaemonService.OpenSession). OpenSession
  // returns the new session's id. An attachment whose AttachRequest names a
  // session belongs to it: Attach is NOT_FOUND for a session that is not
  // open (or closes while it attaches). CloseSession (a session id not open
  // is ignored) returns at once after detaching the session's attachments
  // (new transfers on them are NOT_FOUND) and asking the engine to cancel
  // their loads not yet started; a thread of its own then waits up to
  // `timeout` for their other tickets, cancels whatever is still queued,
  // and logs the outcome. Mappings close when their last job ends.
  std::string OpenSession(const std::string& worker, int64_t pid, const std::string& peer);
  void CloseSession(const std::string& session_id, const std::string& reason,
                    absl::Duration timeout);
  std::vector<SessionSnapshot> ListSessions() const;
  bool IsSessionOpen(const std::string& session_id) const;

  std::vector<AttachmentInfo> ListAttachments() const;
  TransferCounters counters() const;

 private:
  // Attach's steps for a pool group: the group's entries resolved (in the
  // group's order), their pools and the group held, the mappings opened.
  absl::StatusOr<AttachmentInfo> AttachGroup(const std::shared_ptr<PoolGroup>& group,
                                             const AttachRequest& request);
  static absl::StatusOr<std::vector<ResolvedAttach>> ResolveGroupEntries(
      const PoolGroup& group, const AttachRequest& request);
  // Holds every entry's pool and the group; on failure holds nothing.
  static absl::Status AcquireGroup(PoolGroup& group, std::optional<uint32_t> tp_rank);
  absl::Status OpenGroupMappings(const PoolGroup& group,
                                 const std::vector<ResolvedAttach>& resolved,
                                 uint32_t load_event_sets, Attachment* attachment);
  // The engine's mapping of `resolved` on `pool`, or an empty one for a pool
  // without components.
  absl::StatusOr<std::unique_ptr<DeviceMapping>> OpenMapping(const Pool& pool,
                                                             const ResolvedAttach& resolved);
  // Gives the attachment its id, owner and (with layer progress) layer
  // counters of `load_event_sets` sets, and records it (in its session).
  absl::StatusOr<AttachmentInfo> Register(Attachment attachment, uint32_t load_event_sets);

  // Submit's steps that need the manager (submission.h has the order and
  // the pure steps between them, AssignRows and BuildJob): the attachment
  // checked and copied, the engine's resources and the ticket reserved, the
  // job handed to the engine.
  absl::StatusOr<SubmitTarget> FindTarget(const Caller& caller, const std::string& attachment_id,
                                          Direction direction) const;
  absl::StatusOr<std::shared_ptr<Ticket>> Reserve(const std::string& attachment_id,
                                                  const SubmitTarget& target, bool components,
                                                  TransferJob* job);
  void Launch(TransferJob job, const std::shared_ptr<Ticket>& ticket, bool copies,
              const std::string& label);
  // A finished ticket: logged, counted in the metrics and the ticket table.
  void Retire(const std::shared_ptr<Ticket>& ticket, uint64_t bytes, Direction direction,
              const std::string& pool);

  // The session's closing, on a detached thread counted in reapers_:
  // waits for `tickets` up to `timeout`, cancels what is left, logs.
  void ReapSession(std::string session_id, std::string worker, std::string reason,
                   std::vector<std::shared_ptr<Ticket>> tickets, absl::Duration timeout);

  // Worker copies: FAILED_PRECONDITION unless served (ServesWorkerCopy's
  // first two conditions).
  absl::Status CheckWorkerCopy() const;
  // Removes from worker_copies_ those on `attachment_ids` (every one with
  // `all`) and returns their jobs, to be failed without mu_: CANCELLED,
  // saying that `what` happened before the worker finished.
  std::vector<TransferJob> TakeWorkerCopies(absl::Span<const std::string> attachment_ids,
                                            bool all = false) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  static void FailWorkerCopies(std::vector<TransferJob> jobs, const std::string& what);
  // Drain's end: the worker copies still in flight after `timeout` fail.
  void FailWorkerCopiesLeft(absl::Duration timeout);

  KvhostMetrics* const metrics_;
  const std::unique_ptr<TransferEngine> engine_;
  std::atomic<uint64_t> next_attachment_{1};

  mutable absl::Mutex mu_;
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  AttachmentTable attachments_ ABSL_GUARDED_BY(mu_);
  SessionTable sessions_ ABSL_GUARDED_BY(mu_);
  // Session reapers still running; Drain waits for them.
  int reapers_ ABSL_GUARDED_BY(mu_) = 0;
  bool worker_copy_ = false;
  // Worker copies in flight, by ticket id: the attachment each is on, and
  // its job (which holds the pool and the mapping, as a running job does).
  struct WorkerCopy {
    std::string attachment_id;
    TransferJob job;
  };
  std::map<uint64_t, WorkerCopy> worker_copies_ ABSL_GUARDED_BY(mu_);
  // Pools whose region descriptors a caller fetched (FindPoolRegions), by
  // its session: held until CloseSession, each pool once.
  std::map<std::string, std::vector<std::shared_ptr<const Pool>>> worker_regions_
      ABSL_GUARDED_BY(mu_);
  // Its own mutex, taken after mu_ (see the header's lock order).
  TicketTable tickets_;
  // After tickets_: its jobs' ends retire tickets there, so it stops first.
  PoolCopier pool_copier_;
};

}  // namespace kvhost

#endif  // KVHOST_SERVER_TRANSFER_TRANSFER_MANAGER_H_
