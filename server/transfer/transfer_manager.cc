#include "server/transfer/transfer_manager.h"

#include <sys/random.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <limits>
#include <optional>
#include <random>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "spdlog/spdlog.h"

namespace kvhost {
namespace {

absl::Status CheckRange(absl::Span<const int64_t> indices, uint64_t limit, const char* field,
                        const std::string& what) {
  for (size_t i = 0; i < indices.size(); ++i) {
    if (indices[i] < 0 || static_cast<uint64_t>(indices[i]) >= limit) {
      return absl::InvalidArgumentError(absl::StrCat(field, "[", i, "] = ", indices[i],
                                                     " out of range [0, ", limit, ") for ", what));
    }
  }
  return absl::OkStatus();
}

// "pool 'x' (MHA/PAGE_FIRST)" for messages.
std::string PoolWhat(const Pool& pool) {
  return absl::StrCat("pool '", pool.name(), "' (", PoolKindName(pool.spec().kind), "/",
                      LayoutName(pool.spec().layout), ")");
}

// Kinds whose component 0 may come as k_layers, and component 1 as v_layers.
bool TakesKLayers(PoolKind kind) {
  return kind == PoolKind::kMha || kind == PoolKind::kMla || kind == PoolKind::kMhaAsymmetric ||
         kind == PoolKind::kKOnly || kind == PoolKind::kDsa;
}
bool TakesVLayers(PoolKind kind) {
  return kind == PoolKind::kMha || kind == PoolKind::kMhaAsymmetric;
}

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

// A request's load_event_sets: 0 means the default; above the limit is
// INVALID_ARGUMENT.
absl::StatusOr<uint32_t> ResolveLoadEventSets(uint32_t sets) {
  if (sets > kMaxLoadEventSets) {
    return absl::InvalidArgumentError(
        absl::StrCat("load_event_sets ", sets, " is above the limit of ", kMaxLoadEventSets));
  }
  return sets == 0 ? kDefaultLoadEventSets : sets;
}

}  // namespace

absl::StatusOr<AttachRequest> ResolveAttachRequest(const Pool& pool, AttachRequest request) {
  const std::string what = PoolWhat(pool);
  const PoolKind kind = pool.spec().kind;
  const std::vector<Component>& components = pool.components();
  if (request.start_layer == 0 && request.end_layer == 0) {
    request.start_layer = pool.start_layer();
    request.end_layer = pool.end_layer();
  } else if (request.start_layer >= request.end_layer) {
    return absl::InvalidArgumentError(absl::StrCat(
        "start_layer ", request.start_layer, " must be below end_layer ", request.end_layer,
        " (both 0: the layers of ", what, ", [", pool.start_layer(), ", ", pool.end_layer(), "))"));
  }
  const uint32_t layers = request.layer_num();
  const std::string range = absl::StrCat("one per attached layer of [", request.start_layer, ", ",
                                         request.end_layer, ")");
  if (components.empty() &&
      (!request.k_layers.empty() || !request.v_layers.empty() || !request.named.empty())) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " has no components and takes no device buffers"));
  }
  // Gather each component's buffers from whichever field names it.
  std::vector<std::optional<ComponentBuffers>> given(components.size());
  auto put = [&](size_t c, ComponentBuffers buffers) -> absl::Status {
    if (given[c].has_value()) {
      return absl::InvalidArgumentError(absl::StrCat("component '", components[c].name, "' of ",
                                                     what, " is given twice: in ", given[c]->field,
                                                     " and in ", buffers.field));
    }
    given[c] = std::move(buffers);
    return absl::OkStatus();
  };
  if (!request.k_layers.empty()) {
    if (!TakesKLayers(kind)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "k_layers has ", request.k_layers.size(), " buffers, but ", what,
          " takes its buffers in components, by name (k_layers names component 0 of MHA, MLA, "
          "MHA_ASYMMETRIC, K_ONLY and DSA)"));
    }
    if (absl::Status s = put(0, {components[0].name, "k_layers", std::move(request.k_layers)});
        !s.ok()) {
      return s;
    }
  }
  if (!request.v_layers.empty()) {
    if (!TakesVLayers(kind)) {
      return absl::InvalidArgumentError(
          absl::StrCat("v_layers has ", request.v_layers.size(), " buffers but ", what,
                       " needs 0 (v_layers names the V component of MHA and MHA_ASYMMETRIC)"));
    }
    if (absl::Status s = put(1, {components[1].name, "v_layers", std::move(request.v_layers)});
        !s.ok()) {
      return s;
    }
  }
  for (size_t i = 0; i < request.named.size(); ++i) {
    ComponentBuffers& named = request.named[i];
    size_t c = 0;
    while (c < components.size() && components[c].name != named.name) ++c;
    if (c == components.size()) {
      std::vector<std::string> names;
      for (const Component& component : components) names.push_back(component.name);
      return absl::InvalidArgumentError(
          absl::StrCat("components[", i, "] names component '", named.name, "', but ", what,
                       " has components ", absl::StrJoin(names, ", ")));
    }
    if (named.field.empty()) named.field = absl::StrCat("components[", i, "].layers");
    if (absl::Status s = put(c, std::move(named)); !s.ok()) return s;
  }
  request.named.clear();
  request.k_layers.clear();
  request.v_layers.clear();
  request.components.clear();
  for (size_t c = 0; c < components.size(); ++c) {
    if (!given[c].has_value()) {
      const char* field = c == 0 && TakesKLayers(kind)   ? "k_layers"
                          : c == 1 && TakesVLayers(kind) ? "v_layers"
                                                         : "components";
      return absl::InvalidArgumentError(absl::StrCat(field, " has 0 buffers for component '",
                                                     components[c].name, "' but ", what, " needs ",
                                                     layers, " (", range, ")"));
    }
    if (given[c]->layers.size() != layers) {
      return absl::InvalidArgumentError(absl::StrCat(
          given[c]->field, " has ", given[c]->layers.size(), " buffers for component '",
          components[c].name, "' but ", what, " needs ", layers, " (", range, ")"));
    }
    given[c]->name = components[c].name;
    request.components.push_back(*std::move(given[c]));
  }
  if (request.device_size_tokens == 0) {
    return absl::InvalidArgumentError("device_size_tokens must be >= 1");
  }
  if (request.device_size_tokens > (uint64_t{1} << 40)) {
    return absl::InvalidArgumentError(
        absl::StrCat("device_size_tokens ", request.device_size_tokens, " is too large"));
  }
  for (const Component& c : components) {
    if (request.device_size_tokens % c.row_tokens != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "device_size_tokens ", request.device_size_tokens, " is not a multiple of ", c.row_tokens,
          ": component '", c.name, "' of ", what, " has a device row per page of that many slots"));
    }
    // A layer buffer's size (rows x row bytes) must not wrap, or the engine's
    // size check passes for any file and device offsets run past its end.
    const uint64_t rows = request.device_size_tokens / c.row_tokens;
    if (rows > std::numeric_limits<uint64_t>::max() / c.row_bytes()) {
      return absl::InvalidArgumentError(
          absl::StrCat("device_size_tokens ", request.device_size_tokens, ": ", rows, " rows x ",
                       c.row_bytes(), " bytes of component '", c.name, "' is too large"));
    }
  }
  absl::StatusOr<uint32_t> sets = ResolveLoadEventSets(request.load_event_sets);
  if (!sets.ok()) return sets.status();
  request.load_event_sets = *sets;
  return request;
}

// A mapping of no buffers, for pools without components (LOGICAL): their
// transfers never reach an engine.
class EmptyMapping : public DeviceMapping {
 public:
  EmptyMapping(const Pool& pool, const AttachRequest& request) : DeviceMapping(pool, request) {}
};

namespace {

// The ticket layers of group entry `entry` attached at device layers
// [start, ...): model layer l copies device layer layer_map[l].
// REQUIRES: every mapped layer attached.
std::vector<JobLayer> MapEntryLayers(const GroupEntry& entry, uint32_t start) {
  std::vector<JobLayer> layers;
  for (int32_t d : entry.layer_map) layers.push_back(LayerOf(*entry.pool, d, start));
  return layers;
}

// Validates one pool's rows of a transfer and fills `part` (runs, page runs,
// tokens). `prefix` starts the field names ("", "pool_transfers[1]."),
// `device_what` names the attachment (and entry) for device ranges.
absl::Status BuildPart(Direction direction, absl::Span<const int64_t> host,
                       absl::Span<const int64_t> device, const std::string& prefix,
                       const std::string& device_what, JobPart* part) {
  const Pool& pool = *part->pool;
  const std::string host_field = absl::StrCat(prefix, "host_indices");
  const std::string device_field = absl::StrCat(prefix, "device_indices");
  if (host.size() != device.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        host_field, " has ", host.size(), " entries but ", device_field, " has ", device.size()));
  }
  const std::string pool_what = absl::StrCat("pool '", pool.name(), "'");
  if (absl::Status s = CheckRange(host, pool.size_tokens(), host_field.c_str(), pool_what);
      !s.ok()) {
    return s;
  }
  if (absl::Status s =
          CheckRange(device, part->device->device_size_tokens(), device_field.c_str(), device_what);
      !s.ok()) {
    return s;
  }
  // Page-row components copy whole page rows, so both sides must name whole
  // pages; kinds may also require it.
  uint64_t page_rows = 0;
  for (const Component& c : pool.components()) {
    if (c.row_tokens > 1) page_rows = c.row_tokens;
  }
  const uint64_t page_size =
      page_rows > 0 ? page_rows : pool.allocator_owner()->allocator().page_size();
  if (pool.whole_pages() || page_rows > 0) {
    const std::string what = PoolWhat(pool);
    if (absl::Status s = CheckWholePages(host, page_size, host_field.c_str(), what); !s.ok()) {
      return s;
    }
    if (absl::Status s = CheckWholePages(device, page_size, device_field.c_str(), what); !s.ok()) {
      return s;
    }
  }
  part->runs = CoalesceRuns(host, device);
  if (page_rows > 0) part->page_runs = PageRuns(part->runs, page_rows);
  const bool backup = direction == Direction::kBackup;
  if (absl::Status s =
          CheckNoOverlap(part->runs, /*host_side=*/backup, backup ? "host slot" : "device row");
      !s.ok()) {
    return absl::Status(s.code(), absl::StrCat(pool_what, ": ", s.message()));
  }
  const Pool& owner = *pool.allocator_owner();
  if (absl::Status s = owner.allocator().CheckAllocated(host); !s.ok()) {
    if (&owner == &pool) return WithPool(pool.name(), s);
    return WithPool(
        pool.name(),
        absl::Status(s.code(), absl::StrCat(s.message(), " (its slots are allocated in '",
                                            owner.name(), "', which it follows)")));
  }
  part->tokens = host.size();
  return absl::OkStatus();
}

}  // namespace

namespace {

// `n` bytes from the kernel's random source (getrandom; std::random_device
// where that fails, e.g. a sandbox without the call).
void FillRandom(void* out, size_t n) {
  auto* p = static_cast<uint8_t*>(out);
  while (n > 0) {
    const ssize_t got = ::getrandom(p, n, 0);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) break;
    p += got;
    n -= static_cast<size_t>(got);
  }
  if (n == 0) return;
  std::random_device random;
  for (; n > 0; --n) *p++ = static_cast<uint8_t>(random());
}

// Equality in time that depends only on the lengths (as Pool's token check).
bool SameSecret(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

// The message of an attachment id the caller may not use, the same as for
// one that does not exist: the answer tells nothing about other sessions.
absl::Status AttachmentNotFound(const std::string& id) {
  return absl::NotFoundError(
      absl::StrCat("attachment '", ShortId(id), "' not found (or not this session's)"));
}

}  // namespace

std::string RandomHex() {
  uint64_t bits[2] = {0, 0};
  FillRandom(bits, sizeof(bits));
  return absl::StrCat(absl::Hex(bits[0], absl::kZeroPad16), absl::Hex(bits[1], absl::kZeroPad16));
}

std::string ShortId(const std::string& id) {
  // "att-<n>-" / "ses-<n>-" stay whole (they are no secret), then 4 digits.
  constexpr size_t kMaxPrefix = 24;
  constexpr size_t kShownDigits = 4;
  size_t keep = 0;
  if (const size_t dash = id.rfind('-'); dash != std::string::npos && dash < kMaxPrefix) {
    keep = dash + 1;
  }
  keep = std::min(id.size(), keep + kShownDigits);
  return absl::StrCat(id.substr(0, keep), "...");  // ASCII: status messages are ASCII
}

bool TransferManager::Permits(const Caller& caller, const Owner& owner) {
  if (owner.session_id.empty()) return true;
  for (const std::string& session : caller.sessions) {
    if (SameSecret(session, owner.session_id)) return true;
  }
  if (!caller.token.has_value()) return false;
  // The token of every protected pool of the attachment, and one at least.
  bool opened = false;
  for (const std::weak_ptr<const Pool>& weak : owner.pools) {
    const std::shared_ptr<const Pool> pool = weak.lock();
    if (pool == nullptr) return false;  // deleted: no token opens it any more
    if (!pool->owner_protected()) continue;
    if (!CheckPoolOwner(*pool, &*caller.token).ok()) return false;
    opened = true;
  }
  return opened;
}

TransferManager::Attachment* TransferManager::FindAttachment(const Caller& caller,
                                                             const std::string& id) {
  auto it = attachments_.find(id);
  if (it == attachments_.end() || !Permits(caller, *it->second.owner)) return nullptr;
  return &it->second;
}

uint64_t TransferManager::NewTicketId() const {
  // Random rather than counted: an id from before a restart (or of another
  // client) names no ticket of this daemon but by a 2^-64 chance, and within
  // one daemon no ticket id says anything about the next one. 64 bits keep
  // TransferTicket.id's wire type.
  uint64_t id = 0;
  while (id == 0 || tickets_.count(id) != 0) FillRandom(&id, sizeof(id));
  return id;
}

TransferManager::TransferManager(PoolRegistry* registry, std::unique_ptr<TransferEngine> engine,
                                 KvhostMetrics* metrics)
    : registry_(registry), metrics_(metrics), engine_(std::move(engine)) {}

TransferManager::~TransferManager() { Drain(); }

absl::StatusOr<AttachmentInfo> TransferManager::Attach(const std::string& pool_name,
                                                       const AttachRequest& request) {
  if (!request.session_id.empty()) {
    absl::MutexLock lock(&mu_);
    if (sessions_.count(request.session_id) == 0) {
      return absl::NotFoundError(absl::StrCat("session '", ShortId(request.session_id),
                                              "' is not open (open one with OpenSession)"));
    }
  }
  absl::StatusOr<std::shared_ptr<Pool>> pool = registry_->Get(pool_name);
  if (!pool.ok()) {
    absl::StatusOr<std::shared_ptr<PoolGroup>> group = registry_->GetGroup(pool_name);
    if (group.ok()) return AttachGroup(*group, request);
    return pool.status();
  }
  if (!request.entries.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "entries has ", request.entries.size(), " entries, but '", pool_name,
        "' is a pool, not a pool group; give its buffers in k_layers, v_layers or components"));
  }
  absl::StatusOr<AttachRequest> resolved = ResolveAttachRequest(**pool, request);
  if (!resolved.ok()) return resolved.status();
  if (absl::Status s = (*pool)->AcquireAttachment(resolved->tp_rank); !s.ok()) return s;
  absl::StatusOr<std::unique_ptr<DeviceMapping>> device =
      (*pool)->components().empty() ? std::make_unique<EmptyMapping>(**pool, *resolved)
                                    : engine_->Open(**pool, *resolved);
  if (!device.ok()) {
    (*pool)->ReleaseAttachment(resolved->tp_rank);
    return WithPool(pool_name, device.status());
  }
  Attachment attachment;
  attachment.info.pool = pool_name;
  attachment.info.device_size_tokens = resolved->device_size_tokens;
  attachment.info.start_layer = resolved->start_layer;
  attachment.info.end_layer = resolved->end_layer;
  attachment.info.tp_rank = resolved->tp_rank;
  attachment.info.load_only = resolved->load_only;
  attachment.info.session_id = request.session_id;
  attachment.device = std::shared_ptr<const DeviceMapping>(*std::move(device));
  attachment.pools.push_back({"", *pool, attachment.device,
                              MapLayers(**pool, resolved->start_layer, resolved->end_layer)});
  return Register(std::move(attachment));
}

absl::StatusOr<AttachmentInfo> TransferManager::AttachGroup(const std::shared_ptr<PoolGroup>& group,
                                                            const AttachRequest& request) {
  const std::string what = absl::StrCat("pool group '", group->name(), "'");
  const std::vector<GroupEntry>& entries = group->entries();
  std::string names;
  for (const GroupEntry& e : entries) absl::StrAppend(&names, names.empty() ? "" : ", ", e.name);
  if (!request.k_layers.empty() || !request.v_layers.empty() || !request.named.empty() ||
      request.device_size_tokens != 0 || request.start_layer != 0 || request.end_layer != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "'", group->name(), "' is a pool group: give its buffers in entries, one per group entry (",
        names,
        "); k_layers, v_layers, components, device_size_tokens, start_layer and end_layer "
        "must be empty / 0"));
  }
  // Each group entry's request, in the group's order, resolved like a plain
  // attachment of that entry's pool.
  std::vector<std::optional<AttachRequest>> resolved(entries.size());
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
    one.entries.clear();
    one.tp_rank = request.tp_rank;
    one.load_only = request.load_only;
    // The events a load records are the group mapping's; the entries' own
    // go unused, so take the fewest.
    one.load_event_sets = 1;
    const std::string where =
        absl::StrCat("entries[", i, "] (entry '", entry.name, "' of ", what, "): ");
    absl::StatusOr<AttachRequest> r = ResolveAttachRequest(*entry.pool, std::move(one));
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
  for (size_t e = 0; e < entries.size(); ++e) {
    if (!resolved[e].has_value()) {
      return absl::InvalidArgumentError(
          absl::StrCat("entries has no buffers for entry '", entries[e].name, "' of ", what,
                       ", which needs one per group entry (", names, ")"));
    }
  }
  // Hold every pool and the group; on any failure release what was taken.
  const std::optional<uint32_t> tp_rank = request.tp_rank;
  size_t acquired = 0;
  auto release = [&entries, &acquired, tp_rank]() {
    for (size_t e = 0; e < acquired; ++e) entries[e].pool->ReleaseAttachment(tp_rank);
  };
  for (; acquired < entries.size(); ++acquired) {
    if (absl::Status s = entries[acquired].pool->AcquireAttachment(tp_rank); !s.ok()) {
      release();
      return absl::Status(s.code(), absl::StrCat("entry '", entries[acquired].name, "' of ", what,
                                                 ": ", s.message()));
    }
  }
  if (absl::Status s = group->AcquireAttachment(); !s.ok()) {
    release();
    return s;
  }
  auto fail = [&](const absl::Status& s) {
    group->ReleaseAttachment();
    release();
    return s;
  };
  Attachment attachment;
  attachment.group = group;
  std::vector<std::shared_ptr<const DeviceMapping>> mappings;
  for (size_t e = 0; e < entries.size(); ++e) {
    const Pool& pool = *entries[e].pool;
    absl::StatusOr<std::unique_ptr<DeviceMapping>> device =
        pool.components().empty() ? std::make_unique<EmptyMapping>(pool, *resolved[e])
                                  : engine_->Open(pool, *resolved[e]);
    if (!device.ok()) {
      return fail(absl::Status(device.status().code(),
                               absl::StrCat("entry '", entries[e].name, "' of ", what, " (pool '",
                                            pool.name(), "'): ", device.status().message())));
    }
    mappings.push_back(*std::move(device));
    attachment.pools.push_back({entries[e].name, entries[e].pool, mappings.back(),
                                MapEntryLayers(entries[e], resolved[e]->start_layer)});
  }
  absl::StatusOr<uint32_t> sets = ResolveLoadEventSets(request.load_event_sets);
  if (!sets.ok()) return fail(sets.status());
  absl::StatusOr<std::unique_ptr<DeviceMapping>> device =
      engine_->OpenGroup(mappings, group->layer_num(), *sets);
  if (!device.ok()) {
    return fail(
        absl::Status(device.status().code(), absl::StrCat(what, ": ", device.status().message())));
  }
  const AttachRequest& anchor = *resolved[group->anchor_index()];
  attachment.info.pool = group->anchor().pool->name();
  attachment.info.group = group->name();
  attachment.info.device_size_tokens = anchor.device_size_tokens;
  attachment.info.start_layer = 0;
  attachment.info.end_layer = group->layer_num();
  attachment.info.tp_rank = tp_rank;
  attachment.info.load_only = request.load_only;
  attachment.info.session_id = request.session_id;
  attachment.device = std::shared_ptr<const DeviceMapping>(*std::move(device));
  return Register(std::move(attachment));
}

absl::StatusOr<AttachmentInfo> TransferManager::Register(Attachment attachment) {
  attachment.info.id = absl::StrCat("att-", next_attachment_++, "-", RandomHex());
  {
    Owner owner;
    owner.session_id = attachment.info.session_id;
    for (const AttachedPool& attached : attachment.pools) owner.pools.push_back(attached.pool);
    attachment.owner = std::make_shared<const Owner>(std::move(owner));
  }
  attachment.info.load_event_handles = attachment.device->load_event_handles();
  attachment.info.load_event_sets = attachment.device->load_event_sets();
  AttachmentInfo info = attachment.info;
  {
    absl::MutexLock lock(&mu_);
    if (!info.session_id.empty()) {
      auto session = sessions_.find(info.session_id);
      if (session == sessions_.end()) {
        Release(attachment);
        return absl::NotFoundError(
            absl::StrCat("session '", ShortId(info.session_id), "' closed while attaching"));
      }
      session->second.attachments.push_back(info.id);
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

absl::Status TransferManager::Detach(const Caller& caller, const std::string& attachment_id) {
  Attachment attachment;
  {
    absl::MutexLock lock(&mu_);
    if (FindAttachment(caller, attachment_id) == nullptr) return AttachmentNotFound(attachment_id);
    auto it = attachments_.find(attachment_id);
    attachment = std::move(it->second);
    attachments_.erase(it);
    if (auto session = sessions_.find(attachment.info.session_id); session != sessions_.end()) {
      std::vector<std::string>& ids = session->second.attachments;
      ids.erase(std::remove(ids.begin(), ids.end(), attachment_id), ids.end());
    }
  }
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

absl::StatusOr<std::shared_ptr<TransferTicket>> TransferManager::Submit(
    const Caller& caller, const std::string& attachment_id, Direction direction,
    absl::Span<const int64_t> host, absl::Span<const int64_t> device,
    const std::string& wait_event_handle, absl::Span<const EntryRows> pool_transfers) {
  TransferJob job;
  job.direction = direction;
  job.wait_event_handle = wait_event_handle;
  std::shared_ptr<PoolGroup> group;
  std::vector<AttachedPool> pools;
  std::string label;  // the metrics' pool label
  std::shared_ptr<const Owner> owner;
  const std::string short_id = ShortId(attachment_id);
  {
    absl::MutexLock lock(&mu_);
    if (draining_) return absl::UnavailableError("kvhostd is shutting down; transfer refused");
    const Attachment* found = FindAttachment(caller, attachment_id);
    if (found == nullptr) return AttachmentNotFound(attachment_id);
    const Attachment& attachment = *found;
    owner = attachment.owner;
    if (direction == Direction::kBackup && attachment.info.load_only) {
      return absl::FailedPreconditionError(absl::StrCat(
          "attachment '", short_id, "' of pool '", attachment.info.pool,
          "' is load_only: Backup is refused (back up through the rank's attachment that is "
          "not load_only)"));
    }
    group = attachment.group;
    pools = attachment.pools;
    job.device = attachment.device;
    label = attachment.info.group.empty() ? attachment.info.pool : attachment.info.group;
  }
  if (group == nullptr && !pool_transfers.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("pool_transfers has ", pool_transfers.size(), " entries, but attachment '",
                     short_id, "' is of pool '", pools[0].pool->name(), "', not of a pool group"));
  }
  // Each pool's rows: the request's for a plain attachment or the group's
  // anchor, each pool_transfers entry's for the others.
  struct Rows {
    absl::Span<const int64_t> host, device;
    std::string prefix;
    bool given = false;
  };
  std::vector<Rows> rows(pools.size());
  const size_t anchor = group == nullptr ? 0 : group->anchor_index();
  rows[anchor] = {host, device, "", true};
  for (size_t i = 0; i < pool_transfers.size(); ++i) {
    const EntryRows& t = pool_transfers[i];
    size_t e = 0;
    while (e < pools.size() && pools[e].entry != t.name) ++e;
    if (e == pools.size()) {
      std::string names;
      for (const AttachedPool& p : pools)
        absl::StrAppend(&names, names.empty() ? "" : ", ", p.entry);
      return absl::InvalidArgumentError(absl::StrCat("pool_transfers[", i, "] names entry '",
                                                     t.name, "', but pool group '", group->name(),
                                                     "' has entries ", names));
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
  // Every pool's rows validated before anything is reserved or submitted.
  std::vector<JobPart> parts(pools.size());
  bool components = false;  // some pool of the attachment has buffers to copy
  for (size_t e = 0; e < pools.size(); ++e) {
    JobPart& part = parts[e];
    part.pool = pools[e].pool;
    part.device = pools[e].device;
    part.layers = pools[e].layers;
    components = components || !part.pool->components().empty();
    const std::string device_what =
        group == nullptr
            ? absl::StrCat("attachment '", short_id, "'")
            : absl::StrCat("attachment '", short_id, "' (entry '", pools[e].entry, "')");
    if (absl::Status s =
            BuildPart(direction, rows[e].host, rows[e].device, rows[e].prefix, device_what, &part);
        !s.ok()) {
      return s;
    }
  }
  // A plain attachment's job has its one part; a group's, the parts with
  // rows to copy.
  job.group = group;
  for (JobPart& part : parts) {
    if (group == nullptr || (part.tokens > 0 && !part.pool->components().empty())) {
      job.parts.push_back(std::move(part));
    }
  }
  // The only part without components left is a plain LOGICAL pool's.
  const bool copies = components && job.tokens() > 0;
  uint64_t bytes = 0;
  for (size_t i = 0; i < job.layer_num(); ++i) bytes += TicketLayerBytes(job, i);
  // Last, since what it reserves is released only by the job's end.
  if (components) {
    if (absl::Status s = engine_->Prepare(&job); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("attachment '", short_id, "': ", s.message()));
    }
  }
  std::string path = components ? engine_->PathFor(job) : std::string("none");
  std::shared_ptr<TransferTicket> ticket;
  {
    absl::MutexLock lock(&mu_);
    ticket = std::make_shared<TransferTicket>(NewTicketId(), direction,
                                              static_cast<uint32_t>(job.layer_num()),
                                              std::move(path), job.event_set);
    job.ticket = ticket;
    tickets_[ticket->id()] = Ticket{ticket, owner};
    ticket_attachment_[ticket->id()] = attachment_id;
    ++counters_.tickets_in_flight;
    // Detached (its session closed) since validation: the ticket runs, but
    // an engine that can stops it before its first layer.
    if (attachments_.count(attachment_id) == 0) {
      ticket->RequestCancel(
          absl::CancelledError(absl::StrCat("attachment '", short_id, "' was detached while this ",
                                            DirectionName(direction), " was submitted")));
    }
  }
  ticket->OnDone(
      [this, ticket, bytes, direction, label] { Retire(ticket, bytes, direction, label); });
  if (!copies) {
    for (size_t l = 0; l < job.layer_num(); ++l) ticket->LayerDone(0);
    ticket->Finish(absl::OkStatus());
    return ticket;
  }
  spdlog::debug("ticket {}: {} of {} tokens in {} parts, '{}', {}", ticket->id(),
                DirectionName(direction), job.tokens(), job.parts.size(), label,
                ticket->Snapshot().path);
  engine_->Submit(std::move(job));
  ticket->Enqueued();
  return ticket;
}

void TransferManager::Retire(const std::shared_ptr<TransferTicket>& ticket, uint64_t bytes,
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
  absl::MutexLock lock(&mu_);
  --counters_.tickets_in_flight;
  ticket_attachment_.erase(ticket->id());
  if (status.status.ok()) {
    ++counters_.tickets_done;
    counters_.bytes[static_cast<int>(direction)] += bytes;
  } else {
    ++counters_.tickets_failed;
  }
  finished_.push_back(ticket->id());
  while (finished_.size() > kRetainedTickets) {
    tickets_.erase(finished_.front());
    finished_.pop_front();
  }
}

absl::StatusOr<std::shared_ptr<TransferTicket>> TransferManager::FindTicket(const Caller& caller,
                                                                            uint64_t id) const {
  absl::MutexLock lock(&mu_);
  auto it = tickets_.find(id);
  if (it == tickets_.end() || !Permits(caller, *it->second.owner)) {
    return absl::NotFoundError(absl::StrCat("ticket ", id, " is unknown or expired (the last ",
                                            kRetainedTickets,
                                            " finished tickets are kept) or not this session's"));
  }
  return it->second.ticket;
}

uint64_t TransferManager::Drain(absl::Duration timeout) {
  std::vector<std::shared_ptr<TransferTicket>> in_flight;
  {
    absl::MutexLock lock(&mu_);
    draining_ = true;
    for (const auto& [id, attachment] : ticket_attachment_) {
      in_flight.push_back(tickets_.at(id).ticket);
    }
  }
  const absl::Time deadline = absl::Now() + timeout;
  uint64_t cancelled = 0;
  for (const std::shared_ptr<TransferTicket>& ticket : in_flight) {
    if (ticket->WaitUntil(deadline)) continue;
    ticket->RequestCancel(absl::CancelledError(absl::StrCat(
        "kvhostd is shutting down and the drain timeout (", absl::FormatDuration(timeout),
        ") passed before this ", DirectionName(ticket->direction()), " finished")));
    ++cancelled;
  }
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

std::string TransferManager::OpenSession(const std::string& worker, int64_t pid,
                                         const std::string& peer) {
  SessionSnapshot session;
  session.id = absl::StrCat("ses-", next_session_++, "-", RandomHex());
  session.worker = worker;
  session.pid = pid;
  session.peer = peer;
  session.opened = absl::Now();
  {
    absl::MutexLock lock(&mu_);
    sessions_[session.id] = session;
  }
  spdlog::info("session {} opened by worker '{}' (pid {}, {})", ShortId(session.id), worker, pid,
               peer);
  return session.id;
}

void TransferManager::CloseSession(const std::string& session_id, const std::string& reason,
                                   absl::Duration timeout) {
  std::vector<Attachment> closed;
  std::vector<std::shared_ptr<TransferTicket>> tickets;
  SessionSnapshot session;
  {
    absl::MutexLock lock(&mu_);
    auto it = sessions_.find(session_id);
    if (it == sessions_.end()) return;
    session = std::move(it->second);
    sessions_.erase(it);
    for (const std::string& id : session.attachments) {
      auto attachment = attachments_.find(id);
      if (attachment == attachments_.end()) continue;
      closed.push_back(std::move(attachment->second));
      attachments_.erase(attachment);
    }
    for (const auto& [ticket_id, attachment_id] : ticket_attachment_) {
      if (std::find(session.attachments.begin(), session.attachments.end(), attachment_id) !=
          session.attachments.end()) {
        tickets.push_back(tickets_.at(ticket_id).ticket);
      }
    }
  }
  for (const Attachment& attachment : closed) Release(attachment);
  // Nobody will read what a load would write: stop the ones not started.
  for (const std::shared_ptr<TransferTicket>& ticket : tickets) {
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
                                  std::vector<std::shared_ptr<TransferTicket>> tickets,
                                  absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  uint64_t ok = 0;
  uint64_t failed = 0;
  uint64_t late = 0;
  for (const std::shared_ptr<TransferTicket>& ticket : tickets) {
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

std::vector<SessionSnapshot> TransferManager::ListSessions() const {
  absl::MutexLock lock(&mu_);
  std::vector<SessionSnapshot> out;
  for (const auto& [id, session] : sessions_) out.push_back(session);
  return out;
}

std::vector<AttachmentInfo> TransferManager::ListAttachments() const {
  absl::MutexLock lock(&mu_);
  std::vector<AttachmentInfo> out;
  for (const auto& [id, attachment] : attachments_) out.push_back(attachment.info);
  return out;
}

TransferCounters TransferManager::counters() const {
  absl::MutexLock lock(&mu_);
  return counters_;
}

}  // namespace kvhost
