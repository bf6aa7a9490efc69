#include "server/transfer/transfer_manager.h"

#include <algorithm>
#include <optional>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "server/transfer/job_part.h"
#include "spdlog/spdlog.h"

namespace kvhost {
namespace {

// What a ticket layer copies for device layer `d` of `pool` attached from
// device layer `start`: attached layer d - start, held as host layer
// d - pool.start_layer() when inside the pool's range (d < 0: nothing).
JobLayer LayerOf(const Pool& pool, int64_t d, uint32_t start) {
  JobLayer layer;
  if (d < 0) return layer;
  layer.device_layer = static_cast<uint32_t>(d - start);
  if (d >= pool.start_layer() && d < pool.end_layer()) {
    layer.host_layer = static_cast<int32_t>(d - pool.start_layer());
  }
  return layer;
}

// The ticket layers of an attachment of device layers [start, end) on
// `pool`: attached layer i is device layer start + i.
std::vector<JobLayer> MapLayers(const Pool& pool, uint32_t start, uint32_t end) {
  std::vector<JobLayer> layers;
  for (uint32_t d = start; d < end; ++d) layers.push_back(LayerOf(pool, d, start));
  return layers;
}

// A mapping of no buffers, for pools without components (LOGICAL): their
// transfers never reach an engine.
class EmptyMapping : public DeviceMapping {
 public:
  EmptyMapping(const Pool& pool, const ResolvedAttach& attach) : DeviceMapping(pool, attach) {}
};

// The ticket layers of group entry `entry` attached at device layers
// [start, ...): model layer l copies device layer layer_map[l].
// REQUIRES: every mapped layer attached.
std::vector<JobLayer> MapEntryLayers(const GroupEntry& entry, uint32_t start) {
  std::vector<JobLayer> layers;
  for (int32_t d : entry.layer_map) layers.push_back(LayerOf(*entry.pool, d, start));
  return layers;
}

// The message of an attachment id the caller may not use, the same as for
// one that does not exist: the answer tells nothing about other sessions.
absl::Status AttachmentNotFound(const std::string& id) {
  return absl::NotFoundError(
      absl::StrCat("attachment '", ShortId(id), "' not found (or not this session's)"));
}

// "a, b, c": a group's entry names, for messages.
std::string EntryNames(const PoolGroup& group) {
  std::string names;
  for (const GroupEntry& e : group.entries()) {
    absl::StrAppend(&names, names.empty() ? "" : ", ", e.name);
  }
  return names;
}

}  // namespace

TransferManager::TransferManager(std::unique_ptr<TransferEngine> engine, KvhostMetrics* metrics)
    : metrics_(metrics), engine_(std::move(engine)), tickets_(TicketTable::kRetained, metrics) {}

// ------------------------------------------------------------------ attach

absl::StatusOr<AttachmentInfo> TransferManager::Attach(const PoolTarget& target,
                                                       const AttachRequest& request) {
  if (!request.session_id.empty()) {
    absl::MutexLock lock(&mu_);
    if (!sessions_.IsOpen(request.session_id)) {
      return absl::NotFoundError(absl::StrCat("session '", ShortId(request.session_id),
                                              "' is not open (open one with OpenSession)"));
    }
  }
  if (target.group != nullptr) return AttachGroup(target.group, request);
  const std::shared_ptr<Pool>& pool = target.pool;
  const std::string& pool_name = pool->name();
  if (!request.entries.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "entries has ", request.entries.size(), " entries, but '", pool_name,
        "' is a pool, not a pool group; give its buffers in k_layers, v_layers or components"));
  }
  absl::StatusOr<ResolvedAttach> resolved = ResolveAttachRequest(*pool, request);
  if (!resolved.ok()) return resolved.status();
  if (absl::Status s = pool->AcquireAttachment(request.tp_rank); !s.ok()) return s;
  absl::StatusOr<std::unique_ptr<DeviceMapping>> device = OpenMapping(*pool, *resolved);
  if (!device.ok()) {
    pool->ReleaseAttachment(request.tp_rank);
    return WithPool(pool_name, device.status());
  }
  Attachment attachment;
  attachment.info.pool = pool_name;
  attachment.info.device_size_tokens = resolved->device_size_tokens;
  attachment.info.start_layer = resolved->start_layer;
  attachment.info.end_layer = resolved->end_layer;
  attachment.info.tp_rank = request.tp_rank;
  attachment.info.load_only = request.load_only;
  attachment.info.session_id = request.session_id;
  attachment.mapping = std::shared_ptr<const DeviceMapping>(*std::move(device));
  attachment.pools.push_back(
      {"", pool, attachment.mapping, MapLayers(*pool, resolved->start_layer, resolved->end_layer)});
  attachment.info.layer_progress = request.layer_progress;
  return Register(std::move(attachment), resolved->load_event_sets);
}

absl::StatusOr<std::unique_ptr<DeviceMapping>> TransferManager::OpenMapping(
    const Pool& pool, const ResolvedAttach& resolved) {
  if (pool.components().empty()) return std::make_unique<EmptyMapping>(pool, resolved);
  return engine_->Open(pool, resolved);
}

absl::StatusOr<AttachmentInfo> TransferManager::AttachGroup(const std::shared_ptr<PoolGroup>& group,
                                                            const AttachRequest& request) {
  absl::StatusOr<std::vector<ResolvedAttach>> resolved = ResolveGroupEntries(*group, request);
  if (!resolved.ok()) return resolved.status();
  const std::optional<uint32_t> tp_rank = request.tp_rank;
  if (absl::Status s = AcquireGroup(*group, tp_rank); !s.ok()) return s;
  Attachment attachment;
  attachment.group = group;
  if (absl::Status s = OpenGroupMappings(*group, *resolved, request.load_event_sets, &attachment);
      !s.ok()) {
    group->ReleaseAttachment();
    for (const GroupEntry& entry : group->entries()) entry.pool->ReleaseAttachment(tp_rank);
    return s;
  }
  const ResolvedAttach& anchor = (*resolved)[group->anchor_index()];
  attachment.info.pool = group->anchor().pool->name();
  attachment.info.group = group->name();
  attachment.info.device_size_tokens = anchor.device_size_tokens;
  attachment.info.start_layer = 0;
  attachment.info.end_layer = group->layer_num();
  attachment.info.tp_rank = tp_rank;
  attachment.info.load_only = request.load_only;
  attachment.info.session_id = request.session_id;
  attachment.info.layer_progress = request.layer_progress;
  // Valid: OpenGroupMappings resolved the same value.
  return Register(std::move(attachment), *ResolveLoadEventSets(request.load_event_sets));
}

absl::StatusOr<std::vector<ResolvedAttach>> TransferManager::ResolveGroupEntries(
    const PoolGroup& group, const AttachRequest& request) {
  const std::string what = absl::StrCat("pool group '", group.name(), "'");
  const std::vector<GroupEntry>& entries = group.entries();
  const std::string names = EntryNames(group);
  if (!request.k_layers.empty() || !request.v_layers.empty() || !request.named.empty() ||
      request.device_size_tokens != 0 || request.start_layer != 0 || request.end_layer != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "'", group.name(), "' is a pool group: give its buffers in entries, one per group entry (",
        names,
        "); k_layers, v_layers, components, device_size_tokens, start_layer and end_layer "
        "must be empty / 0"));
  }
  // Each group entry's request, in the group's order, resolved like a plain
  // attachment of that entry's pool.
  std::vector<std::optional<ResolvedAttach>> resolved(entries.size());
  for (size_t i = 0; i < request.entries.size(); ++i) {
    const AttachEntry& given = request.entries[i];
    size_t e = 0;
    while (e < entries.size() && entries[e].name != given.entry) ++e;
    if (e == entries.size()) {
      return absl::InvalidArgumentError(absl::StrCat("entries[", i, "] names entry '", given.entry,
                                                     "', but ", what, " has entries ", names));
    }
    if (resolved[e].has_value()) {
      return absl::InvalidArgumentError(
          absl::StrCat("entries[", i, "]: entry '", given.entry, "' of ", what, " is given twice"));
    }
    const GroupEntry& entry = entries[e];
    AttachRequest one = given.request;
    // The events a load records are the group mapping's; the entries' own
    // go unused, so take the fewest.
    one.load_event_sets = 1;
    const std::string where =
        absl::StrCat("entries[", i, "] (entry '", entry.name, "' of ", what, "): ");
    absl::StatusOr<ResolvedAttach> r = ResolveAttachRequest(*entry.pool, std::move(one));
    if (!r.ok()) {
      return absl::Status(r.status().code(), absl::StrCat(where, r.status().message()));
    }
    for (size_t l = 0; l < entry.layer_map.size(); ++l) {
      const int32_t d = entry.layer_map[l];
      if (d >= 0 &&
          (static_cast<uint32_t>(d) < r->start_layer || static_cast<uint32_t>(d) >= r->end_layer)) {
        return absl::InvalidArgumentError(absl::StrCat(
            where, "device layers [", r->start_layer, ", ", r->end_layer,
            ") do not include device layer ", d, ", which model layer ", l, " maps to (layer_map[",
            l, "]); attach a range holding every mapped layer"));
      }
    }
    resolved[e] = *std::move(r);
  }
  std::vector<ResolvedAttach> out;
  for (size_t e = 0; e < entries.size(); ++e) {
    if (!resolved[e].has_value()) {
      return absl::InvalidArgumentError(
          absl::StrCat("entries has no buffers for entry '", entries[e].name, "' of ", what,
                       ", which needs one per group entry (", names, ")"));
    }
    out.push_back(*std::move(resolved[e]));
  }
  return out;
}

absl::Status TransferManager::AcquireGroup(PoolGroup& group, std::optional<uint32_t> tp_rank) {
  const std::vector<GroupEntry>& entries = group.entries();
  size_t acquired = 0;
  auto release = [&entries, &acquired, tp_rank]() {
    for (size_t e = 0; e < acquired; ++e) entries[e].pool->ReleaseAttachment(tp_rank);
  };
  for (; acquired < entries.size(); ++acquired) {
    if (absl::Status s = entries[acquired].pool->AcquireAttachment(tp_rank); !s.ok()) {
      release();
      return absl::Status(s.code(),
                          absl::StrCat("entry '", entries[acquired].name, "' of pool group '",
                                       group.name(), "': ", s.message()));
    }
  }
  if (absl::Status s = group.AcquireAttachment(); !s.ok()) {
    release();
    return s;
  }
  return absl::OkStatus();
}

absl::Status TransferManager::OpenGroupMappings(const PoolGroup& group,
                                                const std::vector<ResolvedAttach>& resolved,
                                                uint32_t load_event_sets, Attachment* attachment) {
  const std::string what = absl::StrCat("pool group '", group.name(), "'");
  const std::vector<GroupEntry>& entries = group.entries();
  std::vector<std::shared_ptr<const DeviceMapping>> mappings;
  for (size_t e = 0; e < entries.size(); ++e) {
    const Pool& pool = *entries[e].pool;
    absl::StatusOr<std::unique_ptr<DeviceMapping>> device = OpenMapping(pool, resolved[e]);
    if (!device.ok()) {
      return absl::Status(device.status().code(),
                          absl::StrCat("entry '", entries[e].name, "' of ", what, " (pool '",
                                       pool.name(), "'): ", device.status().message()));
    }
    mappings.push_back(*std::move(device));
    attachment->pools.push_back({entries[e].name, entries[e].pool, mappings.back(),
                                 MapEntryLayers(entries[e], resolved[e].start_layer)});
  }
  absl::StatusOr<uint32_t> sets = ResolveLoadEventSets(load_event_sets);
  if (!sets.ok()) return sets.status();
  absl::StatusOr<std::unique_ptr<DeviceMapping>> device =
      engine_->OpenGroup(mappings, group.layer_num(), *sets);
  if (!device.ok()) {
    return absl::Status(device.status().code(),
                        absl::StrCat(what, ": ", device.status().message()));
  }
  attachment->mapping = std::shared_ptr<const DeviceMapping>(*std::move(device));
  return absl::OkStatus();
}

absl::StatusOr<AttachmentInfo> TransferManager::Register(Attachment attachment,
                                                         uint32_t load_event_sets) {
  if (attachment.info.layer_progress) {
    absl::StatusOr<std::shared_ptr<LayerCounters>> counters = LayerCounters::Create(
        attachment.mapping->load_event_sets() > 0 ? attachment.mapping->load_event_sets()
                                                  : load_event_sets);
    if (!counters.ok()) {
      Release(attachment);
      return counters.status();
    }
    attachment.layer_counters = *std::move(counters);
  }
  attachment.info.id = CapabilityId("att", next_attachment_++);
  {
    Owner owner;
    owner.session_id = attachment.info.session_id;
    for (const AttachedPool& attached : attachment.pools) owner.pools.push_back(attached.pool);
    attachment.owner = std::make_shared<const Owner>(std::move(owner));
  }
  attachment.info.load_event_handles = attachment.mapping->load_event_handles();
  attachment.info.load_event_sets = attachment.layer_counters != nullptr
                                        ? attachment.layer_counters->sets()
                                        : attachment.mapping->load_event_sets();
  AttachmentInfo info = attachment.info;
  {
    absl::MutexLock lock(&mu_);
    if (!info.session_id.empty() && !sessions_.AddAttachment(info.session_id, info.id)) {
      Release(attachment);
      return absl::NotFoundError(
          absl::StrCat("session '", ShortId(info.session_id), "' closed while attaching"));
    }
    attachments_.emplace(info.id, std::move(attachment));
  }
  if (info.group.empty()) {
    spdlog::info("attached {} to pool '{}' (device layers [{}, {}), {} device slots, {} backend)",
                 ShortId(info.id), info.pool, info.start_layer, info.end_layer,
                 info.device_size_tokens, engine_->name());
  } else {
    spdlog::info("attached {} to pool group '{}' ({} model layers, anchor pool '{}', {} backend)",
                 ShortId(info.id), info.group, info.end_layer, info.pool, engine_->name());
  }
  return info;
}

TransferManager::Attachment* TransferManager::FindAttachment(const Caller& caller,
                                                             const std::string& id) {
  auto it = attachments_.find(id);
  if (it == attachments_.end() || !Permits(caller, *it->second.owner)) return nullptr;
  return &it->second;
}

absl::Status TransferManager::Detach(const Caller& caller, const std::string& attachment_id) {
  Attachment attachment;
  std::vector<TransferJob> worker_copies;
  {
    absl::MutexLock lock(&mu_);
    if (FindAttachment(caller, attachment_id) == nullptr) return AttachmentNotFound(attachment_id);
    auto it = attachments_.find(attachment_id);
    attachment = std::move(it->second);
    attachments_.erase(it);
    sessions_.RemoveAttachment(attachment.info.session_id, attachment_id);
    worker_copies = TakeWorkerCopies({attachment_id});
  }
  FailWorkerCopies(std::move(worker_copies),
                   absl::StrCat("attachment '", ShortId(attachment_id), "' was detached"));
  Release(attachment);
  if (attachment.group != nullptr) {
    spdlog::info("detached {} from pool group '{}'", ShortId(attachment_id), attachment.info.group);
  } else {
    spdlog::info("detached {} from pool '{}'", ShortId(attachment_id), attachment.info.pool);
  }
  return absl::OkStatus();
}

void TransferManager::Release(const Attachment& attachment) {
  // Jobs in flight hold the pools and the mappings; the pools can be deleted
  // now and their memory goes when they finish.
  if (attachment.group != nullptr) attachment.group->ReleaseAttachment();
  for (const AttachedPool& attached : attachment.pools) {
    attached.pool->ReleaseAttachment(attachment.info.tp_rank);
  }
}

// ---------------------------------------------------------------- transfer

absl::StatusOr<std::shared_ptr<Ticket>> TransferManager::Submit(
    const Caller& caller, const std::string& attachment_id, Direction direction,
    absl::Span<const int64_t> host, absl::Span<const int64_t> device,
    const std::string& wait_event_handle, absl::Span<const EntryRows> pool_transfers) {
  const absl::Time received = absl::Now();
  const std::string short_id = ShortId(attachment_id);
  absl::StatusOr<Target> target = FindTarget(caller, attachment_id, direction);
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
  absl::StatusOr<std::vector<Rows>> rows =
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

absl::StatusOr<TransferManager::Target> TransferManager::FindTarget(
    const Caller& caller, const std::string& attachment_id, Direction direction) const {
  Target target;
  {
    absl::MutexLock lock(&mu_);
    if (draining_) return absl::UnavailableError("kvhostd is shutting down; transfer refused");
    auto it = attachments_.find(attachment_id);
    if (it == attachments_.end() || !Permits(caller, *it->second.owner)) {
      return AttachmentNotFound(attachment_id);
    }
    const Attachment& attachment = it->second;
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

absl::StatusOr<std::vector<TransferManager::Rows>> TransferManager::AssignRows(
    const Target& target, const std::string& short_id, absl::Span<const int64_t> host,
    absl::Span<const int64_t> device, absl::Span<const EntryRows> pool_transfers) {
  const std::shared_ptr<PoolGroup>& group = target.group;
  const std::vector<AttachedPool>& pools = target.pools;
  if (group == nullptr && !pool_transfers.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("pool_transfers has ", pool_transfers.size(), " entries, but attachment '",
                     short_id, "' is of pool '", pools[0].pool->name(), "', not of a pool group"));
  }
  // The request's rows for a plain attachment or the group's anchor, each
  // pool_transfers entry's for the others.
  std::vector<Rows> rows(pools.size());
  const size_t anchor = group == nullptr ? 0 : group->anchor_index();
  rows[anchor] = {host, device, "", true};
  for (size_t i = 0; i < pool_transfers.size(); ++i) {
    const EntryRows& t = pool_transfers[i];
    size_t e = 0;
    while (e < pools.size() && pools[e].entry != t.name) ++e;
    if (e == pools.size()) {
      return absl::InvalidArgumentError(absl::StrCat("pool_transfers[", i, "] names entry '",
                                                     t.name, "', but pool group '", group->name(),
                                                     "' has entries ", EntryNames(*group)));
    }
    if (e == anchor) {
      return absl::InvalidArgumentError(absl::StrCat(
          "pool_transfers[", i, "] names entry '", t.name, "', the anchor of pool group '",
          group->name(), "'; its rows go in host_indices / device_indices"));
    }
    if (rows[e].given) {
      return absl::InvalidArgumentError(
          absl::StrCat("pool_transfers[", i, "] names entry '", t.name, "' a second time"));
    }
    rows[e] = {t.host, t.device, absl::StrCat("pool_transfers[", i, "]."), true};
  }
  return rows;
}

absl::StatusOr<TransferJob> TransferManager::BuildJob(const Target& target,
                                                      const std::string& short_id,
                                                      Direction direction,
                                                      const std::vector<Rows>& rows) {
  const std::shared_ptr<PoolGroup>& group = target.group;
  std::vector<JobPart> parts(target.pools.size());
  for (size_t e = 0; e < target.pools.size(); ++e) {
    const AttachedPool& attached = target.pools[e];
    JobPart& part = parts[e];
    part.pool = attached.pool;
    part.slot_use = attached.pool->UseSlots();
    part.mapping = attached.mapping;
    part.layers = attached.layers;
    const std::string device_what =
        group == nullptr
            ? absl::StrCat("attachment '", short_id, "'")
            : absl::StrCat("attachment '", short_id, "' (entry '", attached.entry, "')");
    if (absl::Status s =
            BuildPart(direction, rows[e].host, rows[e].device, rows[e].prefix, device_what, &part);
        !s.ok()) {
      return s;
    }
  }
  TransferJob job;
  job.direction = direction;
  job.mapping = target.mapping;
  job.group = group;
  // A plain attachment's job has its one part; a group's, the parts with
  // rows to copy.
  for (JobPart& part : parts) {
    if (group == nullptr || (part.tokens > 0 && !part.pool->components().empty())) {
      job.parts.push_back(std::move(part));
    }
  }
  return job;
}

absl::StatusOr<std::shared_ptr<Ticket>> TransferManager::Reserve(const std::string& attachment_id,
                                                                 const Target& target,
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
  if (attachments_.count(attachment_id) == 0) {
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

// ---------------------------------------------------------------- sessions

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
      auto attachment = attachments_.find(id);
      if (attachment == attachments_.end()) continue;
      closed.push_back(std::move(attachment->second));
      attachments_.erase(attachment);
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
  for (const Attachment& attachment : closed) Release(attachment);
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

std::vector<AttachmentInfo> TransferManager::ListAttachments() const {
  absl::MutexLock lock(&mu_);
  std::vector<AttachmentInfo> out;
  for (const auto& [id, attachment] : attachments_) out.push_back(attachment.info);
  return out;
}

TransferCounters TransferManager::counters() const { return tickets_.counters(); }

}  // namespace kvhost
