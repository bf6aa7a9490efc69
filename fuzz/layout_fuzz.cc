// layout_fuzz: the address math of small valid pools of every kind and
// layout, checked byte by byte.
//
// For a spec drawn small enough to enumerate (at most kMaxPoolBytes), every
// (component, row, layer, head, byte) is mapped through the component's
// KvLayout and checked:
//   * the offset lies inside the component's region;
//   * no two of them map to the same byte, and together they cover every
//     byte of every region (the layout is a bijection);
//   * it equals the row-major offset in the seeds' tensor shape for the
//     layout (SEED_INVENTORY.md §2: LAYER_FIRST (L, S, H, D), PAGE_FIRST
//     (S, L, H, D), PAGE_FIRST_DIRECT (P, L, ps, H, D), PAGE_HEAD
//     (P, H, ps, L, D); sglang's PAGE_UNIFIED (P, G, L, planes, ps, H / G, D),
//     a component being plane 0 of it at its region offset), computed here
//     from the shape alone;
//   * MHA / MLA / K_ONLY: the pool's one-region layout agrees with the
//     components.
// Then on a real Pool (regions in a scratch directory):
//   * GetPageBufferMeta of one page gives ranges inside the regions that do
//     not overlap and cover exactly the bytes of that page's slots; a list
//     of pages gives the pages' ranges one after the other;
//   * a flat page written with WritePage changes exactly that page's bytes
//     and reads back the same.
#include <fuzzer/FuzzedDataProvider.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "fuzz/fuzz_check.h"
#include "server/pool/pool.h"
#include "server/pool/pool_spec.h"

namespace kvhost::fuzz {
namespace {

// Small enough that a byte map per region costs microseconds.
constexpr uint64_t kMaxPoolBytes = 1 << 16;
constexpr int64_t kNoPage = -1;

const std::string& ScratchPrefix() {
  static const std::string prefix = [] {
    char dir[] = "/dev/shm/kvhost-layout-fuzz.XXXXXX";
    if (mkdtemp(dir) == nullptr) Fail(__FILE__, __LINE__, "mkdtemp in /dev/shm failed");
    static std::string keep = dir;
    atexit([] { rmdir(keep.c_str()); });
    return absl::StrCat(dir, "/kvhost.", getpid(), ".");
  }();
  return prefix;
}

uint32_t Small(FuzzedDataProvider& in, uint32_t lo, uint32_t hi) {
  return in.ConsumeIntegralInRange<uint32_t>(lo, hi);
}

PoolSpec DrawSpec(FuzzedDataProvider& in) {
  PoolSpec s;
  s.kind = static_cast<PoolKind>(Small(in, 1, 10));
  s.layout = static_cast<LayoutKind>(Small(in, 1, 5));
  s.dtype = static_cast<DType>(Small(in, 1, 6));
  s.page_size = Small(in, 1, 4);
  s.layer_num = Small(in, 1, 3);
  s.start_layer = in.ConsumeBool() ? 0 : Small(in, 1, 5);
  switch (s.kind) {
    case PoolKind::kMha:
    case PoolKind::kKOnly:
    case PoolKind::kMhaAsymmetric:
      s.head_num = Small(in, 1, 4);
      s.head_dim = Small(in, 1, 4);
      if (s.kind == PoolKind::kMhaAsymmetric) s.v_head_dim = s.head_dim + Small(in, 1, 3);
      if (s.kind == PoolKind::kKOnly) s.follows = "anchor";
      // PAGE_UNIFIED head groups; one that does not divide head_num is
      // refused (and the draw skipped).
      if (s.layout == LayoutKind::kPageUnified && in.ConsumeBool()) {
        s.head_groups = Small(in, 1, s.head_num);
      }
      break;
    case PoolKind::kMla:
    case PoolKind::kDsa:
      if (in.ConsumeBool()) {
        s.kv_cache_dim = Small(in, 1, 8);
      } else {
        s.kv_lora_rank = Small(in, 1, 6);
        s.qk_rope_head_dim = Small(in, 0, 3);
      }
      if (s.kind == PoolKind::kDsa) {
        if (in.ConsumeBool()) {
          s.index_row_bytes = Small(in, 1, 12);
        } else {
          s.index_quant_block_size = Small(in, 1, 4);
          s.index_head_dim = s.index_quant_block_size * Small(in, 1, 3);
        }
      }
      break;
    case PoolKind::kDsaIndexer:
      s.follows = "anchor";
      s.index_quant_block_size = Small(in, 1, 4);
      s.index_head_dim = s.index_quant_block_size * Small(in, 1, 3);
      break;
    case PoolKind::kMamba: {
      s.page_size = 1;
      s.mamba.temporal_dtype = static_cast<DType>(Small(in, 1, 6));
      const uint32_t dims = Small(in, 1, 2);
      for (uint32_t d = 0; d < dims; ++d) s.mamba.temporal.push_back(Small(in, 1, 3));
      const uint32_t convs = Small(in, 1, 3);
      for (uint32_t j = 0; j < convs; ++j)
        s.mamba.conv.push_back({Small(in, 1, 3), Small(in, 1, 2)});
      break;
    }
    case PoolKind::kV4Paged:
      s.item_bytes = Small(in, 1, 16);
      break;
    case PoolKind::kV4State:
      s.follows = "anchor";
      s.ring_size = Small(in, 1, 3);
      s.state_slot_bytes = Small(in, 1, 8);
      break;
    case PoolKind::kLogical:
      s.layer_num = 0;
      s.start_layer = 0;
      break;
  }
  return s;
}

// Row-major offset of `index` in a tensor of `shape` (elements of 1 byte:
// the last dimension is bytes).
uint64_t RowMajor(const std::vector<uint64_t>& shape, const std::vector<uint64_t>& index) {
  uint64_t off = 0;
  for (size_t i = 0; i < shape.size(); ++i) off = off * shape[i] + index[i];
  return off;
}

// The seeds' shape of one plane for the layout, and the index of
// (row, layer, head, byte) in it.
uint64_t SeedOffset(const KvLayout& l, uint64_t row, uint64_t layer, uint64_t head, uint64_t byte) {
  const uint64_t P = l.tokens / l.page_size, ps = l.page_size;
  const uint64_t p = row / ps, o = row % ps;
  switch (l.kind) {
    case LayoutKind::kLayerFirst:
      return RowMajor({l.layers, l.tokens, l.heads, l.head_bytes}, {layer, row, head, byte});
    case LayoutKind::kPageFirst:
      return RowMajor({l.tokens, l.layers, l.heads, l.head_bytes}, {row, layer, head, byte});
    case LayoutKind::kPageFirstDirect:
      return RowMajor({P, l.layers, ps, l.heads, l.head_bytes}, {p, layer, o, head, byte});
    case LayoutKind::kPageHead:
      return RowMajor({P, l.heads, ps, l.layers, l.head_bytes}, {p, head, o, layer, byte});
    case LayoutKind::kPageUnified: {  // plane 0 of (P, G, L, planes, ps, H / G, D)
      const uint64_t G = l.head_groups, hg = l.heads / G;
      return RowMajor({P, G, l.layers, l.interleaved_planes, ps, hg, l.head_bytes},
                      {p, head / hg, layer, 0, o, head % hg, byte});
    }
  }
  Fail(__FILE__, __LINE__, "unknown layout");
}

// owner[r][b]: the page whose slot byte b of region r holds.
using Owners = std::vector<std::vector<int64_t>>;

Owners CheckComponents(const PoolSpec& spec, uint64_t tokens, const std::vector<Component>& comps,
                       const std::vector<uint64_t>& sizes) {
  const std::string what = DescribeSpec(spec);
  Owners owner(sizes.size());
  for (size_t r = 0; r < sizes.size(); ++r) owner[r].assign(sizes[r], kNoPage);
  for (const Component& c : comps) {
    const KvLayout& l = c.layout;
    for (uint64_t row = 0; row < l.tokens; ++row) {
      const int64_t page = static_cast<int64_t>(row * c.row_tokens / spec.page_size);
      for (uint64_t layer = 0; layer < l.layers; ++layer) {
        for (uint64_t h = 0; h < l.heads; ++h) {
          const uint64_t at = l.Offset(0, row, layer, h);
          FUZZ_CHECK(at == SeedOffset(l, row, layer, h, 0), what, " ", c.name, " row ", row,
                     " layer ", layer, " head ", h, ": offset ", at, ", seed shape gives ",
                     SeedOffset(l, row, layer, h, 0));
          for (uint64_t b = 0; b < l.head_bytes; ++b) {
            const uint64_t off = c.region_offset + at + b;
            FUZZ_CHECK(off < sizes[c.region], what, " ", c.name, " row ", row, " layer ", layer,
                       " head ", h, " byte ", b, " at ", off, " past region ", c.region, " of ",
                       sizes[c.region]);
            FUZZ_CHECK(owner[c.region][off] == kNoPage, what, " ", c.name, " row ", row, " layer ",
                       layer, " head ", h, " byte ", b, " reuses byte ", off);
            owner[c.region][off] = page;
          }
        }
      }
    }
  }
  for (size_t r = 0; r < sizes.size(); ++r) {
    for (uint64_t b = 0; b < sizes[r]; ++b) {
      FUZZ_CHECK(owner[r][b] != kNoPage, what, " region ", r, " byte ", b, " of ", sizes[r],
                 " belongs to no slot");
    }
  }
  if (PlaneCount(spec) != 0) {
    const KvLayout kv = MakeKvLayout(spec, tokens);
    for (uint64_t p = 0; p < kv.planes; ++p) {
      const Component& c = comps[p];
      for (uint64_t t = 0; t < tokens; ++t) {
        for (uint64_t layer = 0; layer < kv.layers; ++layer) {
          for (uint64_t h = 0; h < kv.heads; ++h) {
            FUZZ_CHECK(
                kv.Offset(p, t, layer, h) == c.region_offset + c.layout.Offset(0, t, layer, h),
                what, " plane ", p, " token ", t, " layer ", layer, " head ", h);
          }
        }
      }
    }
  }
  return owner;
}

void CheckPool(const PoolSpec& spec, uint64_t tokens, const Owners& owner, FuzzedDataProvider& in) {
  const std::string what = DescribeSpec(spec);
  absl::StatusOr<std::shared_ptr<Pool>> made =
      Pool::Create("layout", spec, tokens, ScratchPrefix(), nullptr);
  FUZZ_CHECK(made.ok(), what, ": ", made.status().ToString());
  Pool& pool = **made;
  const uint64_t ps = spec.page_size;
  const uint64_t pages = tokens / ps;
  auto page_slots = [&](uint64_t page) {
    std::vector<int64_t> slots;
    for (uint64_t j = 0; j < ps; ++j) slots.push_back(static_cast<int64_t>(page * ps + j));
    return slots;
  };

  const bool no_meta = spec.layout == LayoutKind::kLayerFirst &&
                       (spec.kind == PoolKind::kKOnly || spec.kind == PoolKind::kDsaIndexer);
  std::vector<RegionRange> each;
  std::vector<int64_t> all_slots;
  for (uint64_t page = 0; page < pages; ++page) {
    const std::vector<int64_t> slots = page_slots(page);
    all_slots.insert(all_slots.end(), slots.begin(), slots.end());
    absl::StatusOr<std::vector<RegionRange>> meta = pool.PageBufferMeta(slots);
    if (no_meta) {
      FUZZ_CHECK(IsErrorOf(meta.status(), {absl::StatusCode::kFailedPrecondition}), what, ": ",
                 meta.status().ToString());
      break;
    }
    FUZZ_CHECK(meta.ok(), what, " page ", page, ": ", meta.status().ToString());
    std::vector<std::vector<bool>> seen(owner.size());
    for (size_t r = 0; r < owner.size(); ++r) seen[r].assign(owner[r].size(), false);
    uint64_t covered = 0;
    for (const RegionRange& s : *meta) {
      FUZZ_CHECK(
          s.region < owner.size() && s.length > 0 && s.offset + s.length <= owner[s.region].size(),
          what, " page ", page, ": range region ", s.region, " [", s.offset, ", +", s.length, ")");
      for (uint64_t b = s.offset; b < s.offset + s.length; ++b) {
        FUZZ_CHECK(owner[s.region][b] == static_cast<int64_t>(page) && !seen[s.region][b], what,
                   " page ", page, ": range byte ", b, " of region ", s.region, " belongs to page ",
                   owner[s.region][b], seen[s.region][b] ? " (twice)" : "");
        seen[s.region][b] = true;
      }
      covered += s.length;
    }
    FUZZ_CHECK(covered == pool.bytes_per_page(), what, " page ", page, ": ranges cover ", covered,
               " bytes of ", pool.bytes_per_page());
    each.insert(each.end(), meta->begin(), meta->end());
  }
  if (!no_meta && pages > 1) {
    // Pages of a list in list order: every page's block the same as alone.
    absl::StatusOr<std::vector<RegionRange>> meta = pool.PageBufferMeta(all_slots);
    FUZZ_CHECK(meta.ok() && meta->size() == each.size(), what, ": all pages ",
               meta.status().ToString());
    const size_t per_page = each.size() / pages;
    for (size_t i = 0; i < each.size(); ++i) {
      const RegionRange& a = (*meta)[i];
      const RegionRange& b = each[i];
      FUZZ_CHECK(a.region == b.region && a.offset == b.offset && a.length == b.length, what,
                 ": range ", i, " (page ", i / per_page, ") differs between one call and ",
                 "a call per page");
    }
  }

  if (spec.kind == PoolKind::kMhaAsymmetric || spec.kind == PoolKind::kLogical) return;
  // A flat page written lands on exactly that page's bytes and reads back.
  FUZZ_CHECK(pool.AllocPages(tokens).ok(), what);
  const uint64_t page = in.ConsumeIntegralInRange<uint64_t>(0, pages - 1);
  std::vector<uint8_t> data(pool.flat_page_bytes());
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint8_t>(i % 251 + 1);
  const int64_t first = static_cast<int64_t>(page * ps);
  FUZZ_CHECK(pool.WritePage(first, data).ok(), what);
  for (size_t r = 0; r < owner.size(); ++r) {
    const uint8_t* base = pool.region_base(r);
    for (uint64_t b = 0; b < owner[r].size(); ++b) {
      FUZZ_CHECK((base[b] != 0) == (owner[r][b] == static_cast<int64_t>(page)), what,
                 ": WritePage of page ", page, " left byte ", b, " of region ", r, " at ",
                 int{base[b]}, " (it belongs to page ", owner[r][b], ")");
    }
  }
  std::vector<uint8_t> back(data.size());
  FUZZ_CHECK(pool.ReadPage(first, absl::MakeSpan(back)).ok() && back == data, what,
             ": ReadPage of page ", page, " differs from what was written");
}

void Run(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  const PoolSpec spec = DrawSpec(in);
  if (!ValidateSpec(spec).ok()) return;  // the few draws that break a rule
  const uint64_t pages = in.ConsumeIntegralInRange<uint64_t>(1, 6);
  const uint64_t tokens = pages * spec.page_size;
  const std::vector<Component> comps = MakeComponents(spec, tokens);
  const std::vector<std::string> suffixes = RegionSuffixes(spec);
  std::vector<uint64_t> sizes(suffixes.size(), 0);
  uint64_t total = 0;
  for (const Component& c : comps) {
    sizes[c.region] = std::max(sizes[c.region], c.region_offset + c.extent_bytes());
    total += c.bytes();
  }
  if (total > kMaxPoolBytes) return;
  const Owners owner = CheckComponents(spec, tokens, comps, sizes);
  CheckPool(spec, tokens, owner, in);
}

}  // namespace
}  // namespace kvhost::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kvhost::fuzz::Run(data, size);
  return 0;
}
