#include "server/pool/pool.h"

#include <sys/random.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/constant_time.h"

namespace kvhost {

absl::Status WithPool(const std::string& pool, const absl::Status& status) {
  if (status.ok()) return status;
  return absl::Status(status.code(), absl::StrCat("pool '", pool, "': ", status.message()));
}

bool Pool::OwnerTokenMatches(absl::string_view given) const {
  if (owner_token_.empty()) return true;
  return SecretEquals(given, owner_token_);
}

namespace {

// Tries at one region file: a collision of 64 random bits means someone
// copies names, not chance, and a few new draws are enough.
constexpr int kRegionNameAttempts = 4;

// 16 hex digits from the kernel's random source (getrandom: no descriptor,
// so it works when the process is out of them).
absl::StatusOr<std::string> RandomNamePart() {
  uint64_t bits = 0;
  if (::getrandom(&bits, sizeof(bits), 0) != static_cast<ssize_t>(sizeof(bits))) {
    return absl::UnavailableError(
        absl::StrCat("no random bits for a region file name: ", std::strerror(errno)));
  }
  return absl::StrCat(absl::Hex(bits, absl::kZeroPad16));
}

// Region file `suffix` of pool `name`, as `files` says.
absl::StatusOr<std::unique_ptr<ShmRegion>> CreateRegion(const std::string& name,
                                                        const std::string& suffix, uint64_t bytes,
                                                        const RegionFiles& files) {
  if (!files.random_names) {
    return ShmRegion::Create(files.dir, absl::StrCat(files.name_prefix, name, suffix), bytes,
                             files.file);
  }
  absl::Status last;
  for (int attempt = 0; attempt < kRegionNameAttempts; ++attempt) {
    absl::StatusOr<std::string> random = RandomNamePart();
    if (!random.ok()) return random.status();
    absl::StatusOr<std::unique_ptr<ShmRegion>> region = ShmRegion::Create(
        files.dir, absl::StrCat(files.name_prefix, *random, ".", name, suffix), bytes, files.file);
    if (!absl::IsAlreadyExists(region.status())) return region;
    last = region.status();
  }
  // Not ALREADY_EXISTS: no pool has the name; someone is filling the
  // directory with names.
  return absl::UnavailableError(absl::StrCat("no free region file name after ", kRegionNameAttempts,
                                             " random tries (last: ", last.message(), ")"));
}

}  // namespace

absl::StatusOr<std::shared_ptr<Pool>> Pool::Create(const std::string& name, const PoolSpec& spec,
                                                   uint64_t size_tokens, const RegionFiles& files,
                                                   std::shared_ptr<Pool> follows) {
  // One file per distinct suffix, in the seeds' exact shapes: MHA (2, ...)
  // with V at V_OFF in ".kv" (PAGE_UNIFIED: K and V interleaved there);
  // MHA_ASYMMETRIC ".k" and ".v"; DSA the latent and ".index_k"; MAMBA
  // ".temporal" and ".conv<j>"; LOGICAL none.
  std::vector<Component> components = MakeComponents(spec, size_tokens);
  const std::vector<std::string> suffixes = RegionSuffixes(spec);
  std::vector<uint64_t> sizes(suffixes.size(), 0);
  for (const Component& c : components) {
    sizes[c.region] = std::max(sizes[c.region], c.region_offset + c.extent_bytes());
  }
  std::vector<std::unique_ptr<ShmRegion>> regions;
  for (size_t r = 0; r < suffixes.size(); ++r) {
    absl::StatusOr<std::unique_ptr<ShmRegion>> region =
        CreateRegion(name, suffixes[r], sizes[r], files);
    // The regions made so far go with `regions`: their files are removed.
    if (!region.ok()) return WithPool(name, region.status());
    regions.push_back(*std::move(region));
  }
  Pool* pool = new Pool(name, spec, size_tokens, std::move(components), std::move(regions),
                        std::move(follows));
  if (!files.releaser) return std::shared_ptr<Pool>(pool);
  return std::shared_ptr<Pool>(
      pool, [releaser = files.releaser](Pool* p) { releaser->Post([p] { delete p; }); });
}

absl::StatusOr<std::shared_ptr<Pool>> Pool::Create(const std::string& name, const PoolSpec& spec,
                                                   uint64_t size_tokens,
                                                   const std::string& region_prefix,
                                                   std::shared_ptr<Pool> follows) {
  RegionFiles files;
  files.random_names = false;
  if (!RegionSuffixes(spec).empty()) {
    const size_t slash = region_prefix.rfind('/');
    const std::string dir =
        slash == std::string::npos ? "." : (slash == 0 ? "/" : region_prefix.substr(0, slash));
    absl::StatusOr<DirFd> dir_fd = DirFd::Open(dir, "directory");
    if (!dir_fd.ok()) return WithPool(name, dir_fd.status());
    files.dir = std::make_shared<const DirFd>(*std::move(dir_fd));
    files.name_prefix =
        slash == std::string::npos ? region_prefix : region_prefix.substr(slash + 1);
  }
  return Create(name, spec, size_tokens, files, std::move(follows));
}

namespace {

uint64_t SumSizes(const std::vector<std::unique_ptr<ShmRegion>>& regions) {
  uint64_t bytes = 0;
  for (const auto& r : regions) bytes += r->size();
  return bytes;
}

bool AnyPageRow(const std::vector<Component>& components) {
  for (const Component& c : components) {
    if (c.row_tokens > 1) return true;
  }
  return false;
}

}  // namespace

Pool::Pool(std::string name, const PoolSpec& spec, uint64_t size_tokens,
           std::vector<Component> components, std::vector<std::unique_ptr<ShmRegion>> regions,
           std::shared_ptr<Pool> follows)
    : name_(std::move(name)),
      spec_(spec),
      layout_(MakeKvLayout(spec, size_tokens)),
      regions_(std::move(regions)),
      components_(std::move(components)),
      whole_pages_(MovesWholePages(spec.kind) || AnyPageRow(components_)),
      follows_(std::move(follows)),
      bytes_(SumSizes(regions_)),
      allocator_(follows_ ? 0 : size_tokens / spec.page_size, spec.page_size) {}

std::string Pool::Label() const {
  return absl::StrCat("pool '", name_, "' (", PoolKindName(spec_.kind), "/",
                      LayoutName(spec_.layout), ")");
}

std::vector<std::string> Pool::region_paths() const {
  std::vector<std::string> paths;
  for (const auto& region : regions_) paths.push_back(region->path());
  return paths;
}

std::vector<std::string> Pool::followers() const {
  absl::MutexLock lock(&mu_);
  return followers_;
}

absl::Status Pool::AddFollower(const std::string& name) {
  absl::MutexLock lock(&mu_);
  if (retired_) {
    return absl::FailedPreconditionError(
        absl::StrCat("pool '", name_, "' is being deleted; '", name, "' cannot follow it"));
  }
  followers_.insert(std::upper_bound(followers_.begin(), followers_.end(), name), name);
  return absl::OkStatus();
}

void Pool::RemoveFollower(const std::string& name) {
  absl::MutexLock lock(&mu_);
  followers_.erase(std::remove(followers_.begin(), followers_.end(), name), followers_.end());
}

std::string Pool::group() const {
  absl::MutexLock lock(&mu_);
  return group_;
}

absl::Status Pool::JoinGroup(const std::string& group) {
  absl::MutexLock lock(&mu_);
  if (retired_) {
    return absl::FailedPreconditionError(
        absl::StrCat("pool '", name_, "' is being deleted; group '", group, "' cannot use it"));
  }
  if (!group_.empty()) {
    return absl::FailedPreconditionError(absl::StrCat("pool '", name_, "' is in group '", group_,
                                                      "' already; a pool is in one "
                                                      "group at most"));
  }
  group_ = group;
  return absl::OkStatus();
}

void Pool::LeaveGroup() {
  absl::MutexLock lock(&mu_);
  group_.clear();
}

absl::StatusOr<std::vector<uint64_t>> Pool::AllocPages(uint64_t num_tokens) {
  if (follows_) {
    return absl::FailedPreconditionError(absl::StrCat(
        Label(), " follows '", follows_->name(), "' and has no allocator",
        spec_.kind == PoolKind::kV4State ? " (\"reuses SWA transfer indices and has no allocator\")"
                                         : "",
        "; Alloc on '", allocator_owner()->name(), "'"));
  }
  std::vector<uint64_t> pages;
  absl::Status s = allocator_.Alloc(num_tokens, &pages);
  if (!s.ok()) return WithPool(name_, s);
  return pages;
}

absl::StatusOr<uint64_t> Pool::Free(absl::Span<const int64_t> slots) {
  if (follows_) {
    return absl::FailedPreconditionError(absl::StrCat(
        Label(), " follows '", follows_->name(), "' and has no allocator",
        spec_.kind == PoolKind::kV4State ? " (\"reuses SWA transfer indices and has no free list\")"
                                         : "",
        "; Free on '", allocator_owner()->name(), "'"));
  }
  absl::StatusOr<std::vector<uint64_t>> pages =
      ParsePages(slots, layout_.page_size, layout_.tokens);
  if (!pages.ok()) return WithPool(name_, pages.status());
  absl::Status s = allocator_.FreePages(*pages);
  if (!s.ok()) return WithPool(name_, s);
  return static_cast<uint64_t>(slots.size());
}

absl::StatusOr<std::vector<uint64_t>> Pool::Pages(absl::Span<const int64_t> slots) const {
  absl::StatusOr<std::vector<uint64_t>> pages =
      ParsePages(slots, layout_.page_size, layout_.tokens);
  if (!pages.ok()) return WithPool(name_, pages.status());
  return pages;
}

RegionRange Pool::PageMetaRange(const Component& c, uint64_t first_slot, uint64_t layer) const {
  // KvLayout's page-metadata math over the component's rows: a page is
  // ps token rows, or one page row (layout.page_size 1).
  const uint64_t row = c.row_of(first_slot);
  return RegionRange{c.region, c.region_offset + c.layout.MetaRangeOffset(0, row, layer),
                     c.layout.MetaRangeBytes()};
}

RegionRange Pool::PageBlockRange(uint64_t first_slot) const {
  // The planes of a PAGE_UNIFIED pool are the components of one region
  // (MHA's K and V), the first at the pool layout's byte 0.
  const Component& c = components_.front();
  return RegionRange{c.region, c.region_offset + layout_.Offset(0, first_slot, 0, 0),
                     layout_.head_groups * layout_.MetaRangeBytes()};
}

template <typename Fn>
void Pool::ForEachFlatRange(uint64_t first_slot, Fn&& fn) const {
  if (PageIsOneBlock()) {
    // PAGE_UNIFIED: the page's block as it lies in the buffer, planes
    // interleaved (what sglang's page_unified stores for a page).
    fn(PageBlockRange(first_slot));
    return;
  }
  for (const Component& c : components_) {
    if (c.layout.MetaPerLayer()) {
      for (uint64_t l = 0; l < c.layout.layers; ++l) {
        if (!fn(PageMetaRange(c, first_slot, l))) return;
      }
    } else if (!fn(PageMetaRange(c, first_slot, 0))) {
      return;
    }
  }
}

template <typename Fn>
void Pool::ForEachFlatPiece(uint64_t first_slot, uint64_t offset, uint64_t length, Fn&& fn) const {
  const uint64_t end = offset + length;
  uint64_t at = 0;  // flat-page offset of the range's first byte
  ForEachFlatRange(first_slot, [&](const RegionRange& range) {
    const uint64_t range_end = at + range.length;
    if (range_end > offset && at < end) {
      const uint64_t from = std::max(at, offset), to = std::min(range_end, end);
      fn(regions_[range.region]->data() + range.offset + (from - at), from - offset, to - from);
    }
    at = range_end;
    return at < end;
  });
}

uint64_t Pool::MetaRangesPerPage() const {
  // LAYER_FIRST: per layer, per component; PAGE_UNIFIED: per head group;
  // else per component.
  if (PageIsOneBlock()) return layout_.head_groups;
  const uint64_t meta_layers = layout_.MetaPerLayer() ? layout_.layers : 1;
  return meta_layers * components_.size();
}

uint64_t Pool::SplitRangesPerPage(uint32_t split_factor) const {
  // A valid split_factor divides head_num, so it is at most head_num.
  return std::min<uint64_t>(split_factor, layout_.heads) * components_.size();
}

uint64_t Pool::PagesOf(uint64_t slots) const {
  return slots / layout_.page_size + (slots % layout_.page_size != 0 ? 1 : 0);
}

uint64_t Pool::PageBufferMetaEntries(uint64_t slots) const {
  return PagesOf(slots) * MetaRangesPerPage();
}

uint64_t Pool::SplitHeadsMetaEntries(uint64_t slots, uint32_t split_factor) const {
  return PagesOf(slots) * SplitRangesPerPage(split_factor);
}

uint64_t Pool::ContiguousBufferInfoEntries() const {
  if (spec_.layout != LayoutKind::kLayerFirst) return 0;
  uint64_t entries = 0;
  for (const Component& c : components_) entries += c.layout.layers;
  return entries;
}

absl::StatusOr<std::vector<RegionRange>> Pool::PageBufferMeta(
    absl::Span<const int64_t> slots) const {
  // The seeds raise for these (ValueError "Unsupported layout").
  if (spec_.layout == LayoutKind::kLayerFirst &&
      (spec_.kind == PoolKind::kKOnly || spec_.kind == PoolKind::kDsaIndexer)) {
    return absl::FailedPreconditionError(
        absl::StrCat(Label(),
                     " has no page buffer metadata: the seeds describe its pages only in "
                     "PAGE_FIRST and PAGE_FIRST_DIRECT (\"Unsupported layout: layer_first\")"));
  }
  absl::StatusOr<std::vector<uint64_t>> pages = Pages(slots);
  if (!pages.ok()) return pages.status();
  const uint64_t meta_layers = layout_.MetaPerLayer() ? layout_.layers : 1;
  std::vector<RegionRange> ranges;
  ranges.reserve(pages->size() * MetaRangesPerPage());
  for (uint64_t page : *pages) {
    const uint64_t first = page * layout_.page_size;
    if (PageIsOneBlock()) {
      // PAGE_UNIFIED: per page, per head group, one range of the group's K
      // and V rows of all layers (one tensor-parallel partition's chunk).
      const RegionRange block = PageBlockRange(first);
      const uint64_t group_bytes = layout_.MetaRangeBytes();
      for (uint64_t g = 0; g < layout_.head_groups; ++g) {
        ranges.push_back({block.region, block.offset + g * group_bytes, group_bytes});
      }
      continue;
    }
    // LAYER_FIRST: per page, per layer, per component; else per page, per
    // component.
    for (uint64_t layer = 0; layer < meta_layers; ++layer) {
      for (const Component& c : components_) ranges.push_back(PageMetaRange(c, first, layer));
    }
  }
  return ranges;
}

absl::Status Pool::CheckPage(int64_t first_slot) const {
  if (spec_.kind == PoolKind::kMhaAsymmetric) {  // S1:1142-1149
    return absl::FailedPreconditionError(absl::StrCat(
        Label(),
        " has no flat page: K and V have different head dims and the seeds raise "
        "NotImplementedError for the flat-page APIs; use GetPageBufferMeta (zero copy)"));
  }
  const uint64_t ps = layout_.page_size;
  if (first_slot < 0 || static_cast<uint64_t>(first_slot) >= layout_.tokens ||
      static_cast<uint64_t>(first_slot) % ps != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(Label(), ": index ", first_slot, " is not the first slot of a page in [0, ",
                     layout_.tokens, ") (a multiple of page_size ", ps, ")"));
  }
  const int64_t slot[1] = {first_slot};
  absl::Status s = allocator().CheckAllocated(slot);
  if (!s.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat(Label(), ": the page at index ", first_slot, " is not allocated",
                     follows_ ? absl::StrCat(" in '", allocator_owner()->name(), "'") : "", " (",
                     s.message(), ")"));
  }
  return absl::OkStatus();
}

uint64_t Pool::flat_page_bytes() const { return bytes_per_page(); }

absl::Status Pool::ReadPage(int64_t first_slot, absl::Span<uint8_t> out) const {
  if (absl::Status s = CheckPage(first_slot); !s.ok()) return s;
  if (out.size() != flat_page_bytes()) {
    return absl::InvalidArgumentError(absl::StrCat("a buffer of ", out.size(), " bytes; a page of ",
                                                   Label(), " has ", flat_page_bytes()));
  }
  return ReadPageRange(first_slot, 0, out);
}

absl::Status Pool::WritePage(int64_t first_slot, absl::Span<const uint8_t> data) {
  if (absl::Status s = CheckPage(first_slot); !s.ok()) return s;
  if (data.size() != flat_page_bytes()) {
    return absl::InvalidArgumentError(absl::StrCat("data has ", data.size(), " bytes; a page of ",
                                                   Label(), " has ", flat_page_bytes()));
  }
  return WritePageRange(first_slot, 0, data);
}

absl::Status Pool::CheckPageRange(int64_t first_slot, uint64_t offset, uint64_t length,
                                  const char* what) const {
  if (absl::Status s = CheckPage(first_slot); !s.ok()) return s;
  const uint64_t page = flat_page_bytes();
  if (offset > page || length > page - offset) {
    return absl::InvalidArgumentError(absl::StrCat(Label(), ": ", what, " bytes [", offset, ", ",
                                                   offset, " + ", length, ") of page ", first_slot,
                                                   " pass its end (", page, " bytes)"));
  }
  return absl::OkStatus();
}

absl::Status Pool::ReadPageRange(int64_t first_slot, uint64_t offset,
                                 absl::Span<uint8_t> out) const {
  if (absl::Status s = CheckPageRange(first_slot, offset, out.size(), "reading"); !s.ok()) {
    return s;
  }
  ForEachFlatPiece(first_slot, offset, out.size(),
                   [&](const uint8_t* region, uint64_t at, uint64_t n) {
                     std::memcpy(out.data() + at, region, n);
                   });
  return absl::OkStatus();
}

absl::Status Pool::WritePageRange(int64_t first_slot, uint64_t offset,
                                  absl::Span<const uint8_t> data) {
  if (absl::Status s = CheckPageRange(first_slot, offset, data.size(), "writing"); !s.ok()) {
    return s;
  }
  ForEachFlatPiece(first_slot, offset, data.size(), [&](uint8_t* region, uint64_t at, uint64_t n) {
    std::memcpy(region, data.data() + at, n);
  });
  return absl::OkStatus();
}

absl::StatusOr<std::vector<PagePart>> Pool::PageShape() const {
  if (spec_.kind == PoolKind::kMhaAsymmetric) {  // S1:1145-1146
    return absl::FailedPreconditionError(
        absl::StrCat(Label(),
                     " has no flat page shape: the seeds raise NotImplementedError for "
                     "get_dummy_flat_data_page; use GetPageBufferMeta (zero copy)"));
  }
  // The seeds' dummy flat page, one part per component; the parts
  // concatenated are the seeds' tensor (MHA's k and v stack to
  // (2, L, ps, H, D)), except DSA, whose index_k the seeds leave out.
  const uint64_t L = spec_.layer_num;
  const uint64_t ps = layout_.page_size;
  std::vector<PagePart> parts;
  if (PageIsOneBlock() && layout_.planes > 1) {
    // PAGE_UNIFIED MHA: one part, the page's block (G, L, 2, ps, H / G, D)
    // with K and V interleaved (the flat page is that block).
    const uint64_t G = layout_.head_groups;
    parts.push_back({"kv",
                     {G, L, layout_.planes, ps, spec_.head_num / G, spec_.head_dim},
                     spec_.dtype,
                     PageBlockRange(0).length});
    return parts;
  }
  for (const Component& c : components_) {
    PagePart part;
    part.component = c.name;
    part.bytes = c.layout.MetaRangeBytes() * (c.layout.MetaPerLayer()       ? L
                                              : c.layout.MetaPerHeadGroup() ? c.layout.head_groups
                                                                            : 1);
    switch (spec_.kind) {
      case PoolKind::kMha:
      case PoolKind::kKOnly:
        part.dims = {L, ps, spec_.head_num, spec_.head_dim};
        if (layout_.MetaPerHeadGroup()) {  // K_ONLY's one plane: (G, L, ps, H / G, D)
          const uint64_t G = layout_.head_groups;
          part.dims = {G, L, ps, spec_.head_num / G, spec_.head_dim};
        }
        part.dtype = spec_.dtype;
        break;
      case PoolKind::kMla:
      case PoolKind::kDsa:
        if (c.row_tokens == 1) {
          part.dims = {L, ps, 1, c.row_bytes() / DTypeSize(spec_.dtype)};
          part.dtype = spec_.dtype;
        } else {
          part.dims = {L, c.row_bytes()};
        }
        break;
      case PoolKind::kMamba:
        part.dims = {part.bytes};  // (ps * size_per_token,) uint8 over the parts
        break;
      default:  // DSA_INDEXER (L, G), V4 (L, R): uint8
        part.dims = {L, c.row_bytes()};
        break;
    }
    parts.push_back(std::move(part));
  }
  return parts;
}

absl::StatusOr<std::vector<RegionRange>> Pool::SplitHeadsMeta(absl::Span<const int64_t> slots,
                                                              uint32_t split_factor) const {
  if (spec_.kind == PoolKind::kMhaAsymmetric) {  // S1:1151-1157
    return absl::FailedPreconditionError(
        absl::StrCat(Label(),
                     " has no split-heads metadata (\"get_split_heads_page_buffer_meta requires "
                     "layout='page_head', which is not supported for models with head_dim != "
                     "v_head_dim\")"));
  }
  if (spec_.layout != LayoutKind::kPageHead) {
    return absl::FailedPreconditionError(absl::StrCat(
        Label(), " has no split-heads metadata: it needs layout PAGE_HEAD (seed assert)",
        spec_.layout == LayoutKind::kPageUnified
            ? "; GetPageBufferMeta gives a PAGE_UNIFIED pool's pages per head group already"
            : ""));
  }
  const uint64_t heads = layout_.heads;
  if (split_factor == 0 || heads % split_factor != 0) {
    return absl::InvalidArgumentError(absl::StrCat(Label(), ": split_factor ", split_factor,
                                                   " must be >= 1 and divide head_num ", heads));
  }
  absl::StatusOr<std::vector<uint64_t>> pages = Pages(slots);
  if (!pages.ok()) return pages.status();
  const uint64_t group = heads / split_factor;
  std::vector<RegionRange> ranges;
  ranges.reserve(pages->size() * SplitRangesPerPage(split_factor));
  for (uint64_t page : *pages) {
    const uint64_t first = page * layout_.page_size;
    for (uint64_t h = 0; h < heads; h += group) {
      for (const Component& c : components_) {
        // The group's heads are adjacent in (P, H, ps, L, D): ps * L rows of
        // head_bytes per head.
        ranges.push_back({c.region, c.region_offset + c.layout.Offset(0, first, 0, h),
                          c.layout.MetaRangeBytes() / split_factor});
      }
    }
  }
  return ranges;
}

absl::StatusOr<StrideCheck> Pool::StrideAlignment(uint64_t alignment) const {
  if (alignment == 0) alignment = kDefaultStrideAlignment;
  if ((alignment & (alignment - 1)) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(Label(), ": alignment ", alignment, " is not a power of two"));
  }
  StrideCheck out;
  // Page-major layouts only: a LAYER_FIRST page is one range per layer.
  out.aligned = spec_.layout != LayoutKind::kLayerFirst && !components_.empty();
  if (PageIsOneBlock()) {
    // PAGE_UNIFIED: a page is one block of every component (planes
    // interleaved), described per head group: aligned when the buffer and
    // a head group's range are.
    const RegionRange block = PageBlockRange(0);
    const uintptr_t base = reinterpret_cast<uintptr_t>(region_base(block.region) + block.offset);
    out.aligned = base % alignment == 0 && layout_.MetaRangeBytes() % alignment == 0;
    out.page_strides.assign(components_.size(), block.length);
    return out;
  }
  for (size_t i = 0; i < components_.size(); ++i) {
    const Component& c = components_[i];
    // From one page's range to the next: a page's block (page-major), or a
    // page of one layer (LAYER_FIRST).
    const uint64_t stride = c.layout.MetaRangeBytes();
    out.page_strides.push_back(stride);
    const uintptr_t base = reinterpret_cast<uintptr_t>(component_base(i));
    out.aligned = out.aligned && base % alignment == 0 && stride % alignment == 0;
  }
  return out;
}

absl::StatusOr<std::vector<BufferInfo>> Pool::ContiguousBufferInfos() const {
  if (spec_.layout != LayoutKind::kLayerFirst) {
    return absl::FailedPreconditionError(
        absl::StrCat(Label(),
                     " has no contiguous per-layer buffers: only LAYER_FIRST keeps a layer's rows "
                     "in one range"));
  }
  std::vector<BufferInfo> infos;
  infos.reserve(ContiguousBufferInfoEntries());
  // Per component, per layer (the device pools' k layers, then v layers).
  for (const Component& c : components_) {
    const uint64_t layer_bytes = c.layout.tokens * c.row_bytes();
    for (uint32_t l = 0; l < c.layout.layers; ++l) {
      infos.push_back(
          {c.name, l,
           RegionRange{c.region, c.region_offset + c.layout.Offset(0, 0, l, 0), layer_bytes},
           c.layout.MetaRangeBytes()});
    }
  }
  return infos;
}

absl::Status Pool::AcquireAttachment(std::optional<uint32_t> tp_rank) {
  const uint32_t rank = tp_rank.value_or(0);
  absl::MutexLock lock(&mu_);
  if (retired_) {
    return absl::FailedPreconditionError(absl::StrCat("pool '", name_, "' is being deleted"));
  }
  if (!IsReplicated(spec_.kind) && !ranks_.empty() && ranks_.count(rank) == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(Label(), " holds one TP rank's rows (rank ", ranks_.begin()->first,
                     " is attached); tp_rank ", rank,
                     " needs a pool of its own (only MLA, DSA, DSA_INDEXER, "
                     "V4_PAGED and V4_STATE pools are shared by ranks)"));
  }
  ++attachments_;
  ++ranks_[rank];
  return absl::OkStatus();
}

void Pool::ReleaseAttachment(std::optional<uint32_t> tp_rank) {
  const uint32_t rank = tp_rank.value_or(0);
  absl::MutexLock lock(&mu_);
  --attachments_;
  auto it = ranks_.find(rank);
  if (it != ranks_.end() && --it->second == 0) ranks_.erase(it);
}

uint32_t Pool::attachments() const {
  absl::MutexLock lock(&mu_);
  return attachments_;
}

uint32_t Pool::replica_ranks() const {
  absl::MutexLock lock(&mu_);
  return static_cast<uint32_t>(ranks_.size());
}

uint64_t Pool::bytes_saved() const {
  const uint32_t ranks = replica_ranks();
  return IsReplicated(spec_.kind) && ranks > 1 ? bytes_ * (ranks - 1) : 0;
}

bool Pool::retired() const {
  absl::MutexLock lock(&mu_);
  return retired_;
}

absl::Status Pool::TryRetire() {
  absl::MutexLock lock(&mu_);
  if (attachments_ > 0) {
    return absl::FailedPreconditionError(absl::StrCat("pool '", name_, "' has ", attachments_,
                                                      " device attachment(s); detach them first"));
  }
  if (!followers_.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(Label(), " is followed by ",
                                                      absl::StrJoin(followers_, ", "),
                                                      "; delete the following pools first"));
  }
  if (!group_.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat(Label(), " is an entry of group '", group_, "'; delete the group first"));
  }
  retired_ = true;
  // Jobs still in flight keep the mappings (and the memory) until they end,
  // but the name must be free now: a new pool of the same name reuses the path.
  for (const auto& region : regions_) region->Unlink();
  return absl::OkStatus();
}

}  // namespace kvhost
