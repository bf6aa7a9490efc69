#include "server/pool/pool.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace kvhost {

absl::Status WithPool(const std::string& pool, const absl::Status& status) {
  if (status.ok()) return status;
  return absl::Status(status.code(), absl::StrCat("pool '", pool, "': ", status.message()));
}

absl::StatusOr<std::shared_ptr<Pool>> Pool::Create(const std::string& name, const PoolSpec& spec,
                                                   uint64_t size_tokens,
                                                   const std::string& region_prefix) {
  const KvLayout layout = MakeKvLayout(spec, size_tokens);
  // One file holding every plane, in the seeds' shapes: MHA (2, ...) with V at
  // plane_bytes, MLA (...) alone.
  std::vector<std::unique_ptr<ShmRegion>> regions;
  absl::StatusOr<std::unique_ptr<ShmRegion>> kv =
      ShmRegion::Create(absl::StrCat(region_prefix, name, ".kv"), layout.total_bytes());
  if (!kv.ok()) return WithPool(name, kv.status());
  regions.push_back(*std::move(kv));
  std::shared_ptr<Pool> pool(new Pool(name, spec, layout, std::move(regions)));
  // One component per plane: K at 0 and V at plane_bytes (MHA), or the latent.
  KvLayout plane = layout;
  plane.planes = 1;
  const char* names[2] = {spec.kind == PoolKind::kMha ? "k" : "latent", "v"};
  for (uint64_t p = 0; p < layout.planes; ++p) {
    pool->components_.push_back(Component{names[p], plane, 0, p * layout.plane_bytes, 1});
  }
  return pool;
}

Pool::Pool(std::string name, const PoolSpec& spec, const KvLayout& layout,
           std::vector<std::unique_ptr<ShmRegion>> regions)
    : name_(std::move(name)),
      spec_(spec),
      layout_(layout),
      regions_(std::move(regions)),
      allocator_(layout.page_num(), layout.page_size) {}

std::vector<std::string> Pool::region_paths() const {
  std::vector<std::string> paths;
  for (const auto& region : regions_) paths.push_back(region->path());
  return paths;
}

absl::StatusOr<std::vector<uint64_t>> Pool::AllocPages(uint64_t num_tokens) {
  std::vector<uint64_t> pages;
  absl::Status s = allocator_.Alloc(num_tokens, &pages);
  if (!s.ok()) return WithPool(name_, s);
  return pages;
}

absl::StatusOr<uint64_t> Pool::Free(absl::Span<const int64_t> slots) {
  absl::StatusOr<std::vector<uint64_t>> pages =
      ParsePages(slots, layout_.page_size, layout_.tokens);
  if (!pages.ok()) return WithPool(name_, pages.status());
  absl::Status s = allocator_.FreePages(*pages);
  if (!s.ok()) return WithPool(name_, s);
  return static_cast<uint64_t>(slots.size());
}

absl::StatusOr<std::vector<RegionSegment>> Pool::PageBufferMeta(
    absl::Span<const int64_t> slots) const {
  absl::StatusOr<std::vector<uint64_t>> pages =
      ParsePages(slots, layout_.page_size, layout_.tokens);
  if (!pages.ok()) return WithPool(name_, pages.status());
  const uint64_t meta_layers = layout_.MetaPerLayer() ? layout_.layers : 1;
  const uint64_t length = layout_.MetaSegmentBytes();
  std::vector<RegionSegment> segments;
  segments.reserve(pages->size() * meta_layers * layout_.planes);
  for (uint64_t page : *pages) {
    const uint64_t first = page * layout_.page_size;
    for (uint64_t layer = 0; layer < meta_layers; ++layer) {
      for (uint64_t plane = 0; plane < layout_.planes; ++plane) {
        segments.push_back({0, layout_.MetaSegmentOffset(plane, first, layer), length});
      }
    }
  }
  return segments;
}

absl::Status Pool::AcquireAttachment() {
  absl::MutexLock lock(&mu_);
  if (retired_) {
    return absl::FailedPreconditionError(absl::StrCat("pool '", name_, "' is being deleted"));
  }
  ++attachments_;
  return absl::OkStatus();
}

void Pool::ReleaseAttachment() {
  absl::MutexLock lock(&mu_);
  --attachments_;
}

uint32_t Pool::attachments() const {
  absl::MutexLock lock(&mu_);
  return attachments_;
}

absl::Status Pool::TryRetire() {
  absl::MutexLock lock(&mu_);
  if (attachments_ > 0) {
    return absl::FailedPreconditionError(absl::StrCat("pool '", name_, "' has ", attachments_,
                                                      " device attachment(s); detach them first"));
  }
  retired_ = true;
  // Jobs still in flight keep the mappings (and the memory) until they end,
  // but the name must be free now: a new pool of the same name reuses the path.
  for (const auto& region : regions_) region->Unlink();
  return absl::OkStatus();
}

// Page APIs: bodies come with the pool-kinds work (issue 4).
absl::Status Pool::CheckPage(int64_t) const { return absl::UnimplementedError("CheckPage"); }
uint64_t Pool::flat_page_bytes() const { return 0; }
absl::Status Pool::ReadPage(int64_t, absl::Span<uint8_t>) const {
  return absl::UnimplementedError("ReadPage");
}
absl::Status Pool::WritePage(int64_t, absl::Span<const uint8_t>) {
  return absl::UnimplementedError("WritePage");
}
absl::StatusOr<std::vector<PagePart>> Pool::PageShape() const {
  return absl::UnimplementedError("PageShape");
}
absl::StatusOr<std::vector<RegionSegment>> Pool::SplitHeadsMeta(absl::Span<const int64_t>,
                                                                uint32_t) const {
  return absl::UnimplementedError("SplitHeadsMeta");
}
absl::StatusOr<StrideCheck> Pool::StrideAlignment(uint64_t) const {
  return absl::UnimplementedError("StrideAlignment");
}
absl::StatusOr<std::vector<BufferInfo>> Pool::ContiguousBufferInfos() const {
  return absl::UnimplementedError("ContiguousBufferInfos");
}

}  // namespace kvhost
