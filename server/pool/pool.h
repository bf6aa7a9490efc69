// Pool: one host index space of token slots with its memory, layout and
// allocator (the seeds' HostKVCache).
//
// The bytes live in shared-memory regions created with the pool and removed
// with it; `layout()` says where each (plane, token, layer, head) lies in
// region 0. The pool counts the device attachments that use it so it is never
// deleted under a transfer.
//
// Thread safety: all methods may be called concurrently. Spec, layout and
// regions are fixed at creation; the allocator and attachment count carry
// their own locks.
#ifndef KVHOST_SERVER_POOL_POOL_H_
#define KVHOST_SERVER_POOL_POOL_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "kvhost/layout.h"
#include "server/pool/allocator.h"
#include "server/pool/pool_spec.h"
#include "server/pool/shm_region.h"

namespace kvhost {

// A byte range of one of a pool's regions (Pool::region_paths()).
struct RegionSegment {
  uint32_t region = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
};

// One host buffer of a pool: a seed tensor, or one K/V plane of one
// (kvhost.v1.PoolComponent). Its rows are addressed by `layout`, a one-plane
// KvLayout whose token rows are either token slots (row_tokens 1) or whole
// pages (row_tokens = page_size: then layout.page_size is 1, layout.tokens
// the page count and layout.token_bytes the page row). Byte 0 of `layout`
// is byte `region_offset` of region `region`. Device buffers of the
// component have the same row_bytes.
struct Component {
  std::string name;
  KvLayout layout;
  uint32_t region = 0;
  uint64_t region_offset = 0;
  uint64_t row_tokens = 1;
  uint64_t row_bytes() const { return layout.token_bytes; }
  uint64_t bytes() const { return layout.total_bytes(); }
};

// One part of the seeds' dummy flat page (kvhost.v1.PageShape.Part).
struct PagePart {
  std::string component;
  std::vector<uint64_t> dims;
  DType dtype = DType::kUint8;
  uint64_t bytes = 0;
};

// The seeds' is_stride_page_aligned (kvhost.v1.StrideAlignment).
struct StrideCheck {
  bool aligned = false;
  std::vector<uint64_t> page_strides;  // per component
};

// One layer's contiguous range of one component (kvhost.v1.ContiguousBufferInfo).
struct BufferInfo {
  std::string component;
  uint32_t layer = 0;
  RegionSegment range;
  uint64_t item_bytes = 0;
};

class Pool {
 public:
  // Creates the pool's region files under `region_prefix` ("<dir>/kvhost.<pid>.")
  // and maps them. REQUIRES: ValidateSpec(spec).ok(), size_tokens a positive
  // multiple of spec.page_size.
  static absl::StatusOr<std::shared_ptr<Pool>> Create(const std::string& name, const PoolSpec& spec,
                                                      uint64_t size_tokens,
                                                      const std::string& region_prefix);

  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  const std::string& name() const { return name_; }
  const PoolSpec& spec() const { return spec_; }
  const KvLayout& layout() const { return layout_; }
  uint64_t size_tokens() const { return layout_.tokens; }
  uint64_t page_num() const { return layout_.page_num(); }
  uint64_t bytes() const { return layout_.total_bytes(); }
  uint8_t* base() const { return regions_[0]->data(); }
  std::vector<std::string> region_paths() const;
  PageAllocator& allocator() { return allocator_; }
  const PageAllocator& allocator() const { return allocator_; }

  // The host buffers in flat-page / metadata order (empty for LOGICAL).
  const std::vector<Component>& components() const { return components_; }
  // Host address of byte 0 of component i's layout.
  uint8_t* component_base(size_t i) const {
    return regions_[components_[i].region]->data() + components_[i].region_offset;
  }
  // Device layers held: [start_layer(), end_layer()); host layer = device
  // layer - start_layer().
  uint32_t start_layer() const { return spec_.start_layer; }
  uint32_t end_layer() const { return spec_.start_layer + spec_.layer_num; }
  // Transfers and page calls must cover whole pages (a page-row component,
  // or a kind that requires it).
  bool whole_pages() const { return whole_pages_; }
  // The pool whose page space and allocator this one shares (spec.follows),
  // or null. Host slots of a transfer must be allocated in
  // allocator_owner()->allocator().
  const std::shared_ptr<Pool>& follows() const { return follows_; }
  Pool* allocator_owner() { return follows_ ? follows_->allocator_owner() : this; }
  const Pool* allocator_owner() const { return follows_ ? follows_->allocator_owner() : this; }

  // Alloc / Free in token slots, with messages naming the pool.
  absl::StatusOr<std::vector<uint64_t>> AllocPages(uint64_t num_tokens);
  absl::StatusOr<uint64_t> Free(absl::Span<const int64_t> slots);

  // The seeds' get_page_buffer_meta: region ranges of whole pages, in the
  // seeds' order (see PageBufferMeta in proto/kvhost/v1/pool.proto).
  absl::StatusOr<std::vector<RegionSegment>> PageBufferMeta(absl::Span<const int64_t> slots) const;

  // Page APIs (the seeds' get_data_page / set_from_flat_data_page and
  // friends); see the RPCs of the same names in proto/kvhost/v1/pool.proto
  // for the byte order and the errors. `first_slot` is a page start.
  // Validation only (no bytes touched): INVALID_ARGUMENT / FAILED_PRECONDITION
  // as GetDataPage.
  absl::Status CheckPage(int64_t first_slot) const;
  uint64_t flat_page_bytes() const;
  // Copies the flat page into / out of `out` / `data` (flat_page_bytes()).
  absl::Status ReadPage(int64_t first_slot, absl::Span<uint8_t> out) const;
  absl::Status WritePage(int64_t first_slot, absl::Span<const uint8_t> data);
  absl::StatusOr<std::vector<PagePart>> PageShape() const;
  absl::StatusOr<std::vector<RegionSegment>> SplitHeadsMeta(absl::Span<const int64_t> slots,
                                                           uint32_t split_factor) const;
  absl::StatusOr<StrideCheck> StrideAlignment(uint64_t alignment) const;
  absl::StatusOr<std::vector<BufferInfo>> ContiguousBufferInfos() const;

  // Attachment accounting. AcquireAttachment fails with FAILED_PRECONDITION
  // once the pool is being deleted; TryRetire succeeds only with no
  // attachments, makes every later AcquireAttachment fail and removes the
  // region files (jobs in flight keep their mappings).
  absl::Status AcquireAttachment();
  void ReleaseAttachment();
  uint32_t attachments() const;
  absl::Status TryRetire();

 private:
  Pool(std::string name, const PoolSpec& spec, const KvLayout& layout,
       std::vector<std::unique_ptr<ShmRegion>> regions);

  const std::string name_;
  const PoolSpec spec_;
  const KvLayout layout_;
  const std::vector<std::unique_ptr<ShmRegion>> regions_;
  std::vector<Component> components_;  // fixed after Create
  bool whole_pages_ = false;           // fixed after Create
  std::shared_ptr<Pool> follows_;      // fixed after Create
  PageAllocator allocator_;

  mutable absl::Mutex mu_;
  uint32_t attachments_ ABSL_GUARDED_BY(mu_) = 0;
  bool retired_ ABSL_GUARDED_BY(mu_) = false;
};

// Prefixes a status message with "pool 'name': ", keeping the code.
absl::Status WithPool(const std::string& pool, const absl::Status& status);

}  // namespace kvhost

#endif  // KVHOST_SERVER_POOL_POOL_H_
