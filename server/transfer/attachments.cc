// TransferManager's attachments (transfer_manager.h, attachment.h): Attach
// (a plain pool's, or a pool group's entries resolved, held and opened),
// Register into the AttachmentTable and the attachment's session, Detach,
// and the lookups by attachment id that other rooms serve from: the
// handoff's (layer counters, pool regions) and AllocBackup's (an
// attachment's pool).
#include <algorithm>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/transfer/transfer_manager.h"
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

}  // namespace

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
  const std::string names = GroupEntryNames(group);
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
      ReleaseAttachment(attachment);
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
      ReleaseAttachment(attachment);
      return absl::NotFoundError(
          absl::StrCat("session '", ShortId(info.session_id), "' closed while attaching"));
    }
    attachments_.Add(std::move(attachment));
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

absl::Status TransferManager::Detach(const Caller& caller, const std::string& attachment_id) {
  Attachment attachment;
  std::vector<TransferJob> worker_copies;
  {
    absl::MutexLock lock(&mu_);
    if (attachments_.Find(caller, attachment_id) == nullptr) {
      return AttachmentNotFound(attachment_id);
    }
    attachment = *attachments_.Take(attachment_id);
    sessions_.RemoveAttachment(attachment.info.session_id, attachment_id);
    worker_copies = TakeWorkerCopies({attachment_id});
  }
  FailWorkerCopies(std::move(worker_copies),
                   absl::StrCat("attachment '", ShortId(attachment_id), "' was detached"));
  ReleaseAttachment(attachment);
  if (attachment.group != nullptr) {
    spdlog::info("detached {} from pool group '{}'", ShortId(attachment_id), attachment.info.group);
  } else {
    spdlog::info("detached {} from pool '{}'", ShortId(attachment_id), attachment.info.pool);
  }
  return absl::OkStatus();
}

std::vector<AttachmentInfo> TransferManager::ListAttachments() const {
  absl::MutexLock lock(&mu_);
  return attachments_.List();
}

absl::StatusOr<std::shared_ptr<LayerCounters>> TransferManager::FindLayerCounters(
    const Caller& caller, const std::string& attachment_id) const {
  absl::MutexLock lock(&mu_);
  const Attachment* attachment = attachments_.Find(caller, attachment_id);
  if (attachment == nullptr) return AttachmentNotFound(attachment_id);
  if (attachment->layer_counters == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("attachment '", ShortId(attachment_id),
                     "' was made without layer_progress, so it has no layer counters (attach "
                     "with AttachDeviceRequest.layer_progress set)"));
  }
  return attachment->layer_counters;
}

absl::StatusOr<std::shared_ptr<Pool>> TransferManager::FindAttachedPool(
    const Caller& caller, const std::string& attachment_id) const {
  absl::MutexLock lock(&mu_);
  const Attachment* attachment = attachments_.Find(caller, attachment_id);
  if (attachment == nullptr) return AttachmentNotFound(attachment_id);
  if (attachment->group != nullptr || attachment->pools.size() != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "attachment '", ShortId(attachment_id), "' is on pool group '", attachment->info.group,
        "': AllocBackup serves a plain pool's attachment (use Alloc, then Backup with "
        "pool_transfers)"));
  }
  return attachment->pools[0].pool;
}

absl::StatusOr<WorkerRegions> TransferManager::FindPoolRegions(const Caller& caller,
                                                               const std::string& attachment_id,
                                                               RegionUse use) {
  absl::MutexLock lock(&mu_);
  const Attachment* found = attachments_.Find(caller, attachment_id);
  if (found == nullptr) return AttachmentNotFound(attachment_id);
  if (use == RegionUse::kWorkerCopy) {
    if (absl::Status s = CheckWorkerCopy(); !s.ok()) return s;
  }
  const Attachment& attachment = *found;
  if (attachment.group != nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "attachment '", ShortId(attachment_id), "' is of pool group '", attachment.info.group,
        use == RegionUse::kWorkerCopy
            ? "': worker copies serve plain pools only (the daemon copies a group's transfers)"
            : "': its entries' regions are mapped through an attachment of each entry's pool"));
  }
  const std::shared_ptr<Pool>& pool = attachment.pools[0].pool;
  if (pool->region_count() == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("pool '", pool->name(), "' has no regions to map (a LOGICAL pool)"));
  }
  if (attachment.info.session_id.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "attachment '", ShortId(attachment_id),
        "' was made without a session: the pool's region descriptors stay with the "
        "caller after it detaches, and only a session's end gives them back (attach within "
        "a session)"));
  }
  // The worker keeps its mapping past DetachDevice and DeletePool: the pool
  // stays held, its bytes counted, until the session ends.
  std::vector<std::shared_ptr<const Pool>>& held = worker_regions_[attachment.info.session_id];
  if (std::find(held.begin(), held.end(), pool) == held.end()) held.push_back(pool);
  WorkerRegions regions;
  regions.pool = pool;
  regions.groups = GroupComponents(pool->components());
  return regions;
}

}  // namespace kvhost
