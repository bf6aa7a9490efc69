// PoolGroup: pools one worker moves together (the seeds' HostPoolGroup and
// PoolEntry), for example a hybrid model's attention KV pool and its Mamba
// state pool. The group counts model layers; each entry maps them to its
// pool's device layers. The anchor entry's allocator serves the group's
// Alloc / Free. See kvhost.v1.PoolGroup for the semantics of transfers.
//
// Thread safety: entries and layer maps are fixed at creation; the
// attachment count carries its own lock.
#ifndef KVHOST_SERVER_POOL_POOL_GROUP_H_
#define KVHOST_SERVER_POOL_POOL_GROUP_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/pool/pool.h"

namespace kvhost {

// As kvhost.v1.PoolEntry, with the pool resolved and the layer map spelled
// out (exactly layer_num values: a device layer of the pool, or -1).
struct GroupEntry {
  std::string name;
  std::shared_ptr<Pool> pool;
  std::vector<int32_t> layer_map;
};

// A CreatePoolGroup request before resolution (kvhost.v1.PoolEntry).
struct GroupEntrySpec {
  std::string name;
  std::string pool;
  std::vector<int32_t> layer_map;  // empty: the identity over the pool's layers
  bool anchor = false;
};

inline constexpr size_t kMaxGroupEntries = 8;

class PoolGroup {
 public:
  // The checks that need no pool: the group's name, layer_num in [1,
  // kMaxLayers] (checked first, so no check walks a huge layer count), 1 to
  // kMaxGroupEntries entries with unique valid names, each pool in one entry
  // only, layer maps empty or of layer_num values, at most one anchor.
  // INVALID_ARGUMENT naming the group, the entry and the value.
  static absl::Status CheckShape(const std::string& name, uint32_t layer_num,
                                 const std::vector<GroupEntrySpec>& entries);
  // CheckShape, then each layer map against its pool: every value -1 or a
  // device layer the pool holds, none twice (INVALID_ARGUMENT naming the
  // entry, the index and the value). REQUIRES: pools[i] is entries[i].pool.
  static absl::StatusOr<std::shared_ptr<PoolGroup>> Create(
      const std::string& name, uint32_t layer_num, const std::vector<GroupEntrySpec>& entries,
      const std::vector<std::shared_ptr<Pool>>& pools);

  const std::string& name() const { return name_; }
  uint32_t layer_num() const { return layer_num_; }
  const std::vector<GroupEntry>& entries() const { return entries_; }
  size_t anchor_index() const { return anchor_; }
  const GroupEntry& anchor() const { return entries_[anchor_]; }
  // The entry named `name`, or null.
  const GroupEntry* Find(const std::string& name) const;
  // The layer-map values a group of this shape spells out (and its
  // kvhost.v1.PoolGroup reply carries): layer_num per entry. Computed from
  // the request alone, so a reply can be bounded before the group exists.
  static uint64_t LayerMapValues(uint32_t layer_num, size_t entries) {
    return uint64_t{layer_num} * entries;
  }
  uint64_t layer_map_values() const { return LayerMapValues(layer_num_, entries_.size()); }

  // As Pool's: FAILED_PRECONDITION once retired; TryRetire succeeds only
  // with no attachments.
  absl::Status AcquireAttachment();
  void ReleaseAttachment();
  uint32_t attachments() const;
  absl::Status TryRetire();

 private:
  PoolGroup(std::string name, uint32_t layer_num, std::vector<GroupEntry> entries, size_t anchor)
      : name_(std::move(name)),
        layer_num_(layer_num),
        entries_(std::move(entries)),
        anchor_(anchor) {}

  const std::string name_;
  const uint32_t layer_num_;
  const std::vector<GroupEntry> entries_;
  const size_t anchor_;
  mutable absl::Mutex mu_;
  uint32_t attachments_ ABSL_GUARDED_BY(mu_) = 0;
  bool retired_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace kvhost

#endif  // KVHOST_SERVER_POOL_POOL_GROUP_H_
