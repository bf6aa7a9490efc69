#include "server/pool/pool_group.h"

#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/pool/names.h"

namespace kvhost {

namespace {

absl::Status Invalid(const std::string& group, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("group '", group, "': ", what));
}

std::string EntryLabel(size_t i, const GroupEntrySpec& entry) {
  return absl::StrCat("entries[", i, "] '", entry.name, "'");
}

}  // namespace

absl::Status PoolGroup::CheckShape(const std::string& name, uint32_t layer_num,
                                   const std::vector<GroupEntrySpec>& entries) {
  if (absl::Status s = ValidatePoolName(name); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("group ", s.message()));
  }
  if (layer_num == 0) return Invalid(name, "layer_num must be >= 1 (the model's layers)");
  if (layer_num > kMaxLayers) {
    return Invalid(name, absl::StrCat("layer_num ", layer_num, " is over the limit of ", kMaxLayers,
                                      " layers"));
  }
  if (entries.empty() || entries.size() > kMaxGroupEntries) {
    return Invalid(name, absl::StrCat("has ", entries.size(), " entries; a group has 1 to ",
                                      kMaxGroupEntries));
  }
  std::set<std::string> names, pools;
  int anchors = 0;
  for (size_t i = 0; i < entries.size(); ++i) {
    const GroupEntrySpec& e = entries[i];
    if (absl::Status s = ValidatePoolName(e.name); !s.ok()) {
      return Invalid(name, absl::StrCat("entries[", i, "] ", s.message()));
    }
    if (!names.insert(e.name).second) {
      return Invalid(name,
                     absl::StrCat(EntryLabel(i, e), ": the name is used by an earlier entry"));
    }
    if (e.pool.empty()) return Invalid(name, absl::StrCat(EntryLabel(i, e), " names no pool"));
    if (!pools.insert(e.pool).second) {
      return Invalid(name, absl::StrCat(EntryLabel(i, e), ": pool '", e.pool,
                                        "' is in an earlier entry; a pool is in one entry only"));
    }
    if (!e.layer_map.empty() && e.layer_map.size() != layer_num) {
      return Invalid(name, absl::StrCat(EntryLabel(i, e), ": layer_map has ", e.layer_map.size(),
                                        " values; give layer_num ", layer_num,
                                        " (one per model layer) or none for the identity"));
    }
    if (e.anchor && ++anchors > 1) {
      return Invalid(name, absl::StrCat(EntryLabel(i, e),
                                        " is a second anchor; at most one entry is the anchor"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<PoolGroup>> PoolGroup::Create(
    const std::string& name, uint32_t layer_num, const std::vector<GroupEntrySpec>& entries,
    const std::vector<std::shared_ptr<Pool>>& pools) {
  if (absl::Status s = CheckShape(name, layer_num, entries); !s.ok()) return s;
  std::vector<GroupEntry> resolved;
  size_t anchor = 0;
  for (size_t i = 0; i < entries.size(); ++i) {
    const GroupEntrySpec& e = entries[i];
    const Pool& pool = *pools[i];
    const int64_t start = pool.start_layer(), end = pool.end_layer();
    std::vector<int32_t> map = e.layer_map;
    if (map.empty()) {  // the identity over the layers the pool holds
      map.resize(layer_num);
      for (uint32_t l = 0; l < layer_num; ++l) {
        map[l] = l >= start && l < end ? static_cast<int32_t>(l) : -1;
      }
    }
    std::set<int32_t> used;
    for (uint32_t l = 0; l < layer_num; ++l) {
      const int32_t v = map[l];
      if (v == -1) continue;
      if (v < start || v >= end) {
        return Invalid(
            name, absl::StrCat(EntryLabel(i, e), ": layer_map[", l, "] = ", v,
                               " is not a device layer of ", pool.Label(), ", which holds [", start,
                               ", ", end, "); use -1 for none"));
      }
      if (!used.insert(v).second) {
        return Invalid(name, absl::StrCat(EntryLabel(i, e), ": layer_map[", l, "] = ", v,
                                          " maps a device layer an earlier model layer maps"));
      }
    }
    if (e.anchor) anchor = i;
    resolved.push_back(GroupEntry{e.name, pools[i], std::move(map)});
  }
  return std::shared_ptr<PoolGroup>(new PoolGroup(name, layer_num, std::move(resolved), anchor));
}

const GroupEntry* PoolGroup::Find(const std::string& name) const {
  for (const GroupEntry& e : entries_) {
    if (e.name == name) return &e;
  }
  return nullptr;
}

absl::Status PoolGroup::AcquireAttachment() {
  absl::MutexLock lock(&mu_);
  if (retired_) {
    return absl::FailedPreconditionError(absl::StrCat("group '", name_, "' is being deleted"));
  }
  ++attachments_;
  return absl::OkStatus();
}

void PoolGroup::ReleaseAttachment() {
  absl::MutexLock lock(&mu_);
  --attachments_;
}

uint32_t PoolGroup::attachments() const {
  absl::MutexLock lock(&mu_);
  return attachments_;
}

absl::Status PoolGroup::TryRetire() {
  absl::MutexLock lock(&mu_);
  if (attachments_ > 0) {
    return absl::FailedPreconditionError(absl::StrCat("group '", name_, "' has ", attachments_,
                                                      " device attachment(s); detach them first"));
  }
  retired_ = true;
  return absl::OkStatus();
}

}  // namespace kvhost
