// Tests of kvhost::KvLayout and kvhost::DeviceRows (kernels/kvhost/layout.h).
//
// Every expectation here is derived independently of the header, from
// SEED_INVENTORY.md §2 (buffer shapes and byte offsets) and §5
// (get_page_buffer_meta), i.e. from the seeds' `init_kv_buffer` dims and
// their pointer arithmetic:
//   - MHA: sglang pool_host/mha.py (S1:132-160, 536-597).
//   - MLA: sglang memory_pool_host.py (S0:141-213, 483-575).
//   - PAGE_UNIFIED (not in the seeds): sglang's page_unified as PRs 39606 and
//     39727 give its dims, MHA (page, head_group, layer, 2, page_size,
//     head_in_group, dim) and MLA (page, layer, page_size, dim).
// Two independent oracles are used for offsets (tests/seed_offsets.h, the one
// every test shares): the hand formulas of the §2 tables, and a generic
// C-contiguous offset computed from the seeds' shape tuples, so that a wrong
// formula in one oracle cannot hide a header bug.
#include "kvhost/layout.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "seed_offsets.h"

namespace kvhost {
namespace {

using Dims = testing::SeedShape;
using testing::CContiguousOffset;
using testing::Product;

// The host pool families whose layouts KvLayout covers.
enum class Model { kMha, kMla };

// A pool shape in the seeds' own terms (element counts and itemsize apart),
// so the oracles never see KvLayout's derived byte quantities.
struct Shape {
  const char* name;
  uint64_t layers;     // L
  uint64_t pages;      // P; S = P * ps
  uint64_t page_size;  // ps
  uint64_t heads;      // H (MHA only: an MLA pool has one latent "head")
  uint64_t dim;        // D for MHA, C (kv_cache_dim) for MLA, in elements
  uint64_t itemsize;   // b
};

struct Case {
  Model model;
  LayoutKind layout;
  Shape shape;
  uint64_t groups = 1;  // PAGE_UNIFIED's head groups G
};

const char* ModelName(Model m) { return m == Model::kMha ? "Mha" : "Mla"; }

const char* LayoutName(LayoutKind k) {
  switch (k) {
    case LayoutKind::kLayerFirst:
      return "LayerFirst";
    case LayoutKind::kPageFirst:
      return "PageFirst";
    case LayoutKind::kPageFirstDirect:
      return "PageFirstDirect";
    case LayoutKind::kPageHead:
      return "PageHead";
    case LayoutKind::kPageUnified:
      return "PageUnified";
  }
  return "Unknown";
}

// gtest prints parameters on failure; the default would dump raw bytes.
void PrintTo(const Case& c, std::ostream* os) {
  const Shape& s = c.shape;
  *os << ModelName(c.model) << "/" << LayoutName(c.layout) << "/" << s.name << "{L=" << s.layers
      << " P=" << s.pages << " ps=" << s.page_size << " H=" << s.heads << " D=" << s.dim
      << " b=" << s.itemsize << " G=" << c.groups << "}";
}

// Seed quantities of a case. MLA forces H = 1 and has no V plane.
uint64_t NumLayers(const Case& c) { return c.shape.layers; }
uint64_t NumTokens(const Case& c) { return c.shape.pages * c.shape.page_size; }
uint64_t NumHeads(const Case& c) { return c.model == Model::kMla ? 1 : c.shape.heads; }
uint64_t NumPlanes(const Case& c) { return c.model == Model::kMla ? 1 : 2; }

// The case as one of the seeds' buffers (tests/seed_offsets.h).
testing::SeedBuffer SeedOf(const Case& c) {
  testing::SeedBuffer b;
  b.layout = testing::SeedLayoutNamed(c.layout);
  b.planes = NumPlanes(c);
  b.layers = NumLayers(c);
  b.rows = NumTokens(c);
  b.page_size = c.shape.page_size;
  b.heads = NumHeads(c);
  b.dim = c.shape.dim;  // C for MLA
  b.itemsize = c.shape.itemsize;
  b.groups = c.groups;
  return b;
}

// The seeds' V_OFF = L*S*H*D*b (S1:545-551); unused by MLA.
uint64_t SeedVOff(const Case& c) { return SeedOf(c).v_off(); }

KvLayout MakeLayout(const Case& c) {
  // head_bytes is D*b for MHA and C*b for MLA (a single latent head).
  return KvLayout(c.layout, NumPlanes(c), NumLayers(c), NumTokens(c), c.shape.page_size,
                  NumHeads(c), c.shape.dim * c.shape.itemsize, c.groups);
}

// Oracle 1: the per-layout byte-offset rows of the §2 tables. The seeds'
// MLA pools have no page_head layout.
uint64_t SeedOffset(const Case& c, uint64_t kv, uint64_t t, uint64_t l, uint64_t h) {
  if (c.model == Model::kMla && c.layout == LayoutKind::kPageHead) {
    ADD_FAILURE() << "no MLA seed formula for " << LayoutName(c.layout);
    return 0;
  }
  return testing::SeedOffset(SeedOf(c), kv, t, l, h);
}

// Oracle 2a: the seeds' `init_kv_buffer` dims tuple of each layout.
Dims SeedDims(const Case& c) { return testing::SeedDims(SeedOf(c)); }

// Oracle 2b: the numpy index of element `d` of (kv, t, l, h) in SeedDims.
Dims SeedIndex(const Case& c, uint64_t kv, uint64_t t, uint64_t l, uint64_t h, uint64_t d) {
  return testing::SeedIndex(SeedOf(c), kv, t, l, h, d);
}

// Calls fn(kv, t, l, h) for every head-row of the buffer.
template <typename Fn>
void ForEachRow(const Case& c, Fn fn) {
  for (uint64_t kv = 0; kv < NumPlanes(c); ++kv)
    for (uint64_t t = 0; t < NumTokens(c); ++t)
      for (uint64_t l = 0; l < NumLayers(c); ++l)
        for (uint64_t h = 0; h < NumHeads(c); ++h) fn(kv, t, l, h);
}

// Small shapes (so exhaustive loops and byte maps stay cheap) covering the
// edge cases: ps 1, odd ps, one layer, one head, one page, itemsize 1/2/4.
const Shape kShapes[] = {
    // name       L  P  ps H   D  b
    {"Ps1", 3, 4, 1, 2, 4, 2},         {"Ps3", 2, 3, 3, 3, 2, 1},
    {"Ps5B4", 4, 2, 5, 2, 3, 4},       {"OneLayer", 1, 3, 4, 2, 2, 2},
    {"OneHead", 3, 3, 2, 1, 8, 2},     {"OneLayerOneHead", 1, 2, 3, 1, 4, 4},
    {"OneLayerPs1", 1, 5, 1, 3, 2, 1}, {"OnePage", 2, 1, 4, 2, 2, 2},
    {"Wide", 4, 2, 8, 4, 16, 2},
};

std::vector<Case> AllCases() {
  std::vector<Case> cases;
  for (const Shape& s : kShapes) {
    for (LayoutKind k :
         {LayoutKind::kLayerFirst, LayoutKind::kPageFirst, LayoutKind::kPageFirstDirect,
          LayoutKind::kPageHead, LayoutKind::kPageUnified}) {
      cases.push_back({Model::kMha, k, s});
    }
    // PAGE_UNIFIED with a head group per head, and with groups of 2 heads.
    if (s.heads > 1) cases.push_back({Model::kMha, LayoutKind::kPageUnified, s, s.heads});
    if (s.heads > 2 && s.heads % 2 == 0) {
      cases.push_back({Model::kMha, LayoutKind::kPageUnified, s, s.heads / 2});
    }
    // The seeds' MLA pools have no page_head layout (S0:141-201); sglang's
    // page_unified MLA has no head groups.
    for (LayoutKind k : {LayoutKind::kLayerFirst, LayoutKind::kPageFirst,
                         LayoutKind::kPageFirstDirect, LayoutKind::kPageUnified}) {
      cases.push_back({Model::kMla, k, s});
    }
  }
  return cases;
}

std::string CaseName(const ::testing::TestParamInfo<Case>& info) {
  return std::string(ModelName(info.param.model)) + "_" + LayoutName(info.param.layout) + "_" +
         info.param.shape.name +
         (info.param.groups > 1 ? "_G" + std::to_string(info.param.groups) : std::string());
}

// Heads per row piece of a case, from the seeds' shapes alone: a PAGE_HEAD
// row splits per head, a PAGE_UNIFIED row per head group.
uint64_t PieceHeads(const Case& c) {
  if (c.layout == LayoutKind::kPageHead) return 1;
  if (c.layout == LayoutKind::kPageUnified) return NumHeads(c) / c.groups;
  return NumHeads(c);
}

class KvLayoutTest : public ::testing::TestWithParam<Case> {
 protected:
  const Case& c() const { return GetParam(); }
  KvLayout layout() const { return MakeLayout(GetParam()); }

  // True when tokens t..t+n-1 of (plane, layer) are back to back: as whole
  // rows when the layout claims RowContiguous(), else head by head.
  bool BackToBack(const KvLayout& kl, uint64_t plane, uint64_t layer, uint64_t t,
                  uint64_t n) const {
    const bool rows = kl.RowContiguous();
    const uint64_t stride = rows ? NumHeads(c()) * c().shape.dim * c().shape.itemsize
                                 : c().shape.dim * c().shape.itemsize;
    const uint64_t heads = rows ? 1 : NumHeads(c());
    for (uint64_t h = 0; h < heads; ++h) {
      const uint64_t base = kl.Offset(plane, t, layer, h);
      for (uint64_t i = 1; i < n; ++i) {
        if (kl.Offset(plane, t + i, layer, h) != base + i * stride) return false;
      }
    }
    return true;
  }
};

TEST_P(KvLayoutTest, FieldsMatchSeedSizes) {
  const KvLayout kl = layout();
  const uint64_t b = c().shape.itemsize;
  const uint64_t D = c().shape.dim;
  EXPECT_EQ(kl.kind, c().layout);
  EXPECT_EQ(kl.planes, NumPlanes(c()));
  EXPECT_EQ(kl.layers, NumLayers(c()));
  EXPECT_EQ(kl.tokens, NumTokens(c()));
  EXPECT_EQ(kl.page_size, c().shape.page_size);
  EXPECT_EQ(kl.heads, NumHeads(c()));
  EXPECT_EQ(kl.head_bytes, D * b);
  EXPECT_EQ(kl.token_bytes, NumHeads(c()) * D * b);  // the seeds' token_stride_size
  EXPECT_EQ(kl.page_bytes, c().shape.page_size * NumHeads(c()) * D * b);
  EXPECT_EQ(kl.page_num(), c().shape.pages);
  // A plane holds V_OFF bytes in every MHA layout (S = P * ps); V starts
  // there, except in PAGE_UNIFIED, where it starts one (ps, H / G, D) chunk
  // after K.
  EXPECT_EQ(kl.plane_bytes, SeedVOff(c()));
  const uint64_t chunk = c().shape.page_size * NumHeads(c()) / c().groups * D * b;
  EXPECT_EQ(kl.plane_stride, c().layout == LayoutKind::kPageUnified ? chunk : SeedVOff(c()));
  EXPECT_EQ(kl.head_groups, c().groups);
  EXPECT_EQ(kl.extent_bytes(), kl.total_bytes());
  // The whole buffer is exactly the seed tensor's nbytes.
  EXPECT_EQ(kl.total_bytes(), Product(SeedDims(c())) * b);
}

TEST_P(KvLayoutTest, OffsetMatchesSeedFormula) {
  const KvLayout kl = layout();
  ForEachRow(c(), [&](uint64_t kv, uint64_t t, uint64_t l, uint64_t h) {
    ASSERT_EQ(kl.Offset(kv, t, l, h), SeedOffset(c(), kv, t, l, h))
        << "kv=" << kv << " t=" << t << " l=" << l << " h=" << h;
  });
}

TEST_P(KvLayoutTest, OffsetMatchesCContiguousSeedShape) {
  const KvLayout kl = layout();
  const Dims dims = SeedDims(c());
  const uint64_t b = c().shape.itemsize;
  const uint64_t D = c().shape.dim;
  ForEachRow(c(), [&](uint64_t kv, uint64_t t, uint64_t l, uint64_t h) {
    // The head's first and last elements bound its bytes: checking both pins
    // the row's start and that its D elements are the innermost dimension.
    const uint64_t first = CContiguousOffset(dims, SeedIndex(c(), kv, t, l, h, 0)) * b;
    const uint64_t last = CContiguousOffset(dims, SeedIndex(c(), kv, t, l, h, D - 1)) * b;
    ASSERT_EQ(kl.Offset(kv, t, l, h), first)
        << "kv=" << kv << " t=" << t << " l=" << l << " h=" << h;
    ASSERT_EQ(first + (D - 1) * b, last);
  });
}

TEST_P(KvLayoutTest, RowsPartitionTheBuffer) {
  const KvLayout kl = layout();
  // How many head-rows claim each byte; a partition claims every byte once.
  std::vector<int> owners(kl.total_bytes(), 0);
  ForEachRow(c(), [&](uint64_t kv, uint64_t t, uint64_t l, uint64_t h) {
    const uint64_t off = kl.Offset(kv, t, l, h);
    ASSERT_LE(off + kl.head_bytes, kl.total_bytes())
        << "kv=" << kv << " t=" << t << " l=" << l << " h=" << h;
    for (uint64_t i = 0; i < kl.head_bytes; ++i) ++owners[off + i];
  });
  for (uint64_t i = 0; i < owners.size(); ++i) {
    ASSERT_EQ(owners[i], 1) << "byte " << i << (owners[i] == 0 ? " is a gap" : " overlaps");
  }
}

TEST_P(KvLayoutTest, RowPiecesAreTheContiguousPartsOfARow) {
  const KvLayout kl = layout();
  // page_head puts head h of a page in its own (ps, L, D) block, page_unified
  // head group g in its own (L, planes, ps, H / G, D) block; inside a piece
  // the heads are adjacent.
  const uint64_t heads = PieceHeads(c());
  const uint64_t pieces = NumHeads(c()) / heads;
  ASSERT_EQ(kl.RowPieces(), pieces);
  EXPECT_EQ(kl.RowPieceBytes(), heads * c().shape.dim * c().shape.itemsize);
  ForEachRow(c(), [&](uint64_t kv, uint64_t t, uint64_t l, uint64_t h) {
    const uint64_t piece = h / heads;
    ASSERT_EQ(kl.PieceHead(piece), piece * heads);
    ASSERT_EQ(kl.Offset(kv, t, l, h),
              kl.Offset(kv, t, l, piece * heads) + (h % heads) * kl.head_bytes)
        << "kv=" << kv << " t=" << t << " l=" << l << " h=" << h;
  });
}

TEST_P(KvLayoutTest, RowContiguousUnlessSplitInPieces) {
  const KvLayout kl = layout();
  // page_head puts head h of a page in its own (ps, L, D) block, so a token's
  // heads are ps*L*D*b apart; page_unified with G > 1 does the same per head
  // group; every other layout keeps H*D contiguous.
  const bool expected = !(c().layout == LayoutKind::kPageHead && NumHeads(c()) > 1) &&
                        !(c().layout == LayoutKind::kPageUnified && c().groups > 1);
  EXPECT_EQ(kl.RowContiguous(), expected);
  if (!expected) return;
  ForEachRow(c(), [&](uint64_t kv, uint64_t t, uint64_t l, uint64_t h) {
    ASSERT_EQ(kl.Offset(kv, t, l, h), kl.Offset(kv, t, l, 0) + h * kl.head_bytes)
        << "kv=" << kv << " t=" << t << " l=" << l << " h=" << h;
  });
}

TEST_P(KvLayoutTest, ContiguousTokensAreBackToBackAndMaximal) {
  const KvLayout kl = layout();
  const uint64_t S = NumTokens(c());
  for (uint64_t t = 0; t < S; ++t) {
    const uint64_t n = kl.ContiguousTokens(t);
    ASSERT_GE(n, 1u) << "t=" << t;
    ASSERT_LE(t + n, S) << "t=" << t;
    for (uint64_t kv = 0; kv < NumPlanes(c()); ++kv) {
      for (uint64_t l = 0; l < NumLayers(c()); ++l) {
        ASSERT_TRUE(BackToBack(kl, kv, l, t, n))
            << "t=" << t << " n=" << n << " kv=" << kv << " l=" << l;
      }
    }
    if (!kl.RowContiguous()) {
      // A split row cannot form one range matching n device rows, whatever
      // each head's run; the header documents n == 1 there.
      EXPECT_EQ(n, 1u) << "t=" << t;
      continue;
    }
    // Maximal: the copy engines rely on runs being as long as possible, so
    // one more token must break contiguity in some plane / layer.
    if (t + n < S) {
      bool extends_everywhere = true;
      for (uint64_t kv = 0; kv < NumPlanes(c()); ++kv) {
        for (uint64_t l = 0; l < NumLayers(c()); ++l) {
          extends_everywhere = extends_everywhere && BackToBack(kl, kv, l, t, n + 1);
        }
      }
      EXPECT_FALSE(extends_everywhere) << "run at t=" << t << " could be longer than " << n;
    }
  }
}

TEST_P(KvLayoutTest, ContiguousTokensMatchObviousSeedRuns) {
  const KvLayout kl = layout();
  const uint64_t S = NumTokens(c());
  const uint64_t ps = c().shape.page_size;
  const uint64_t L = NumLayers(c());
  for (uint64_t t = 0; t < S; ++t) {
    switch (c().layout) {
      case LayoutKind::kLayerFirst:
        // (.., L, S, H, D): a layer's S rows are one block.
        EXPECT_EQ(kl.ContiguousTokens(t), S - t) << "t=" << t;
        break;
      case LayoutKind::kPageFirst:
        // (.., S, L, H, D): rows of one layer are L rows apart unless L == 1.
        EXPECT_EQ(kl.ContiguousTokens(t), L == 1 ? S - t : 1) << "t=" << t;
        break;
      case LayoutKind::kPageFirstDirect:
        // (.., P, L, ps, H, D): a layer's rows are one block per page; with
        // L == 1 the pages themselves are back to back.
        EXPECT_EQ(kl.ContiguousTokens(t), L == 1 ? S - t : ps - t % ps) << "t=" << t;
        break;
      case LayoutKind::kPageHead:
        // (.., P, H, ps, L, D): consecutive tokens are L*D*b apart per head;
        // with H == 1 and L == 1 it is (P, 1, ps, 1, D), plain token order.
        if (L > 1) {
          EXPECT_EQ(kl.ContiguousTokens(t), 1u) << "t=" << t;
        } else if (NumHeads(c()) == 1) {
          EXPECT_EQ(kl.ContiguousTokens(t), S - t) << "t=" << t;
        }
        break;
      case LayoutKind::kPageUnified:
        // (P, G, L, 2, ps, H / G, D): a split row is one piece per group; with
        // G == 1 a layer's rows of one plane are a page's ps rows, and with
        // one layer and one plane (MLA) the pages follow each other.
        if (c().groups > 1) {
          EXPECT_EQ(kl.ContiguousTokens(t), 1u) << "t=" << t;
        } else {
          EXPECT_EQ(kl.ContiguousTokens(t), L == 1 && NumPlanes(c()) == 1 ? S - t : ps - t % ps)
              << "t=" << t;
        }
        break;
    }
  }
}

TEST_P(KvLayoutTest, MetaGranularityMatchesGetPageBufferMeta) {
  const KvLayout kl = layout();
  const uint64_t L = NumLayers(c());
  const uint64_t ps = c().shape.page_size;
  const uint64_t b = c().shape.itemsize;
  // MHA sizes are ps*H*D*b / L*ps*H*D*b; MLA's are ps*C*b / L*ps*C*b, which
  // the same expressions give with H = 1 and D = C.
  const uint64_t per_layer = ps * NumHeads(c()) * c().shape.dim * b;
  EXPECT_EQ(kl.MetaPerHeadGroup(), c().layout == LayoutKind::kPageUnified);
  if (c().layout == LayoutKind::kLayerFirst) {
    EXPECT_TRUE(kl.MetaPerLayer());
    EXPECT_EQ(kl.MetaRangeBytes(), per_layer);
  } else if (c().layout == LayoutKind::kPageUnified) {
    // One head group of a page: its (L, planes, ps, H / G, D) block.
    EXPECT_FALSE(kl.MetaPerLayer());
    EXPECT_EQ(kl.MetaRangeBytes(), L * NumPlanes(c()) * per_layer / c().groups);
  } else {
    EXPECT_FALSE(kl.MetaPerLayer());
    EXPECT_EQ(kl.MetaRangeBytes(), L * per_layer);
  }
}

TEST_P(KvLayoutTest, MetaRangeOffsetMatchesSeedPointers) {
  const KvLayout kl = layout();
  const uint64_t L = NumLayers(c());
  const uint64_t S = NumTokens(c());
  const uint64_t H = NumHeads(c());
  const uint64_t D = c().shape.dim;
  const uint64_t b = c().shape.itemsize;
  const uint64_t v_off = SeedVOff(c());
  if (c().layout == LayoutKind::kPageUnified) {
    // A page is one (G, L, planes, ps, H / G, D) block; group g's range is
    // the g-th G-th of it.
    const uint64_t G = c().groups;
    const uint64_t block = L * NumPlanes(c()) * c().shape.page_size * H * D * b;
    for (uint64_t i0 = 0; i0 < S; i0 += c().shape.page_size) {
      for (uint64_t g = 0; g < G; ++g) {
        EXPECT_EQ(kl.MetaRangeOffset(0, i0, 0, g), i0 / c().shape.page_size * block + g * block / G)
            << "i0=" << i0 << " g=" << g;
      }
    }
    return;
  }
  for (uint64_t i0 = 0; i0 < S; i0 += c().shape.page_size) {
    for (uint64_t kv = 0; kv < NumPlanes(c()); ++kv) {
      for (uint64_t l = 0; l < L; ++l) {
        // S1:552-573 (MHA lf), S0:545-555 (MLA lf): k_ptr per page and layer;
        // S1:574-594, S0:556-572: one k_ptr per page whatever the layer, so
        // the layer argument must be ignored there. v_ptr = k_ptr + V_OFF.
        const uint64_t expected = kl.MetaPerLayer()
                                      ? i0 * H * D * b + l * S * H * D * b + kv * v_off
                                      : i0 * L * H * D * b + kv * v_off;
        EXPECT_EQ(kl.MetaRangeOffset(kv, i0, l), expected)
            << "i0=" << i0 << " kv=" << kv << " l=" << l;
      }
    }
  }
}

// PAGE_UNIFIED's page metadata: a range per page and head group.
void ExpectRangesCoverTheirHeadGroups(const Case& c, const KvLayout& kl) {
  const uint64_t ps = c.shape.page_size;
  const uint64_t seg_len = kl.MetaRangeBytes();
  const uint64_t heads = NumHeads(c) / c.groups;
  // A storage backend reads a range as one tensor-parallel partition's chunk:
  // every plane, layer and slot of the page for the group's heads, nothing
  // else.
  for (uint64_t i0 = 0; i0 < NumTokens(c); i0 += ps) {
    for (uint64_t g = 0; g < c.groups; ++g) {
      const uint64_t seg = kl.MetaRangeOffset(0, i0, 0, g);
      ASSERT_LE(seg + seg_len, kl.total_bytes());
      std::vector<int> owners(seg_len, 0);
      for (uint64_t kv = 0; kv < NumPlanes(c); ++kv) {
        for (uint64_t t = i0; t < i0 + ps; ++t) {
          for (uint64_t l = 0; l < NumLayers(c); ++l) {
            for (uint64_t h = g * heads; h < (g + 1) * heads; ++h) {
              const uint64_t off = kl.Offset(kv, t, l, h);
              ASSERT_GE(off, seg) << "i0=" << i0 << " g=" << g << " t=" << t << " h=" << h;
              ASSERT_LE(off + kl.head_bytes, seg + seg_len) << "i0=" << i0 << " g=" << g;
              for (uint64_t i = 0; i < kl.head_bytes; ++i) ++owners[off - seg + i];
            }
          }
        }
      }
      for (uint64_t i = 0; i < seg_len; ++i) {
        ASSERT_EQ(owners[i], 1) << "range byte " << i << " of i0=" << i0 << " g=" << g;
      }
    }
  }
}

TEST_P(KvLayoutTest, OnePlaneLayoutsAddressThePoolsPlanes) {
  // A pool component is one plane of the buffer: a one-plane layout (with the
  // pool's interleaved planes in PAGE_UNIFIED), starting plane_stride * p on.
  const KvLayout kl = layout();
  const uint64_t interleaved = c().layout == LayoutKind::kPageUnified ? kl.planes : 0;
  for (uint64_t kv = 0; kv < NumPlanes(c()); ++kv) {
    const KvLayout one(kl.kind, 1, kl.layers, kl.tokens, kl.page_size, kl.heads, kl.head_bytes,
                       kl.head_groups, interleaved);
    EXPECT_EQ(one.total_bytes(), kl.plane_bytes);
    // The plane's last byte is the buffer's last byte of that plane.
    EXPECT_EQ(
        kv * kl.plane_stride + one.extent_bytes(),
        kl.Offset(kv, NumTokens(c()) - 1, NumLayers(c()) - 1, NumHeads(c()) - 1) + kl.head_bytes);
    ForEachRow(c(), [&](uint64_t plane, uint64_t t, uint64_t l, uint64_t h) {
      if (plane != kv) return;
      ASSERT_EQ(kv * kl.plane_stride + one.Offset(0, t, l, h), kl.Offset(kv, t, l, h))
          << "kv=" << kv << " t=" << t << " l=" << l << " h=" << h;
    });
  }
}

TEST_P(KvLayoutTest, MetaRangeCoversExactlyItsPage) {
  const KvLayout kl = layout();
  if (c().layout == LayoutKind::kPageUnified) {
    ExpectRangesCoverTheirHeadGroups(c(), kl);
    return;
  }
  const uint64_t ps = c().shape.page_size;
  const uint64_t seg_len = kl.MetaRangeBytes();
  // A storage backend reads the range as the page's bytes, so each range
  // must hold every row of its page (of its layer for layer_first) and
  // nothing else.
  for (uint64_t i0 = 0; i0 < NumTokens(c()); i0 += ps) {
    for (uint64_t kv = 0; kv < NumPlanes(c()); ++kv) {
      const uint64_t seg_layers = kl.MetaPerLayer() ? NumLayers(c()) : 1;
      for (uint64_t seg_l = 0; seg_l < seg_layers; ++seg_l) {
        const uint64_t seg = kl.MetaRangeOffset(kv, i0, seg_l);
        ASSERT_LE(seg + seg_len, kl.total_bytes());
        std::vector<int> owners(seg_len, 0);
        uint64_t covered = 0;
        const uint64_t l_begin = kl.MetaPerLayer() ? seg_l : 0;
        const uint64_t l_end = kl.MetaPerLayer() ? seg_l + 1 : NumLayers(c());
        for (uint64_t t = i0; t < i0 + ps; ++t) {
          for (uint64_t l = l_begin; l < l_end; ++l) {
            for (uint64_t h = 0; h < NumHeads(c()); ++h) {
              const uint64_t off = kl.Offset(kv, t, l, h);
              ASSERT_GE(off, seg) << "i0=" << i0 << " t=" << t << " l=" << l << " h=" << h;
              ASSERT_LE(off + kl.head_bytes, seg + seg_len)
                  << "i0=" << i0 << " t=" << t << " l=" << l << " h=" << h;
              for (uint64_t i = 0; i < kl.head_bytes; ++i) ++owners[off - seg + i];
              covered += kl.head_bytes;
            }
          }
        }
        EXPECT_EQ(covered, seg_len) << "i0=" << i0 << " kv=" << kv << " l=" << seg_l;
        for (uint64_t i = 0; i < seg_len; ++i) {
          ASSERT_EQ(owners[i], 1) << "range byte " << i << " of i0=" << i0 << " kv=" << kv
                                  << " l=" << seg_l;
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllSeedLayouts, KvLayoutTest, ::testing::ValuesIn(AllCases()), CaseName);

// Production-sized pools exceed 4 GiB per plane; offsets must not wrap at
// 32 bits. Spot-check the extremes against the seed formula.
TEST(KvLayoutLargeTest, SixtyFourBitOffsets) {
  // DeepSeek-like MLA (L=61, C=576, bf16) and a large MHA pool, 2^20 tokens.
  const Shape big = {"Big", 61, (1u << 20) / 64, 64, 32, 128, 2};
  for (Model m : {Model::kMha, Model::kMla}) {
    for (LayoutKind k :
         {LayoutKind::kLayerFirst, LayoutKind::kPageFirst, LayoutKind::kPageFirstDirect,
          LayoutKind::kPageHead, LayoutKind::kPageUnified}) {
      if (m == Model::kMla && k == LayoutKind::kPageHead) continue;
      Shape s = big;
      if (m == Model::kMla) s.dim = 576;
      // MHA PAGE_UNIFIED in 4 head groups of 8 heads.
      const Case c = {m, k, s, m == Model::kMha && k == LayoutKind::kPageUnified ? 4u : 1u};
      SCOPED_TRACE(::testing::PrintToString(c));
      const KvLayout kl = MakeLayout(c);
      ASSERT_GT(kl.plane_bytes, uint64_t{1} << 32);
      EXPECT_EQ(kl.total_bytes(), Product(SeedDims(c)) * s.itemsize);
      const uint64_t kv = NumPlanes(c) - 1;
      const uint64_t t = NumTokens(c) - 1;
      const uint64_t l = NumLayers(c) - 1;
      const uint64_t h = NumHeads(c) - 1;
      // The last row in C order ends the buffer in every layout.
      EXPECT_EQ(kl.Offset(kv, t, l, h), SeedOffset(c, kv, t, l, h));
      EXPECT_EQ(kl.Offset(kv, t, l, h) + kl.head_bytes, kl.total_bytes());
      const uint64_t mid_t = NumTokens(c) / 2 + 3;
      EXPECT_EQ(kl.Offset(kv, mid_t, l / 2, h / 2), SeedOffset(c, kv, mid_t, l / 2, h / 2));
      EXPECT_EQ(
          kl.Offset(kv, mid_t, l / 2, h / 2),
          CContiguousOffset(SeedDims(c), SeedIndex(c, kv, mid_t, l / 2, h / 2, 0)) * s.itemsize);
      const uint64_t last_page = NumTokens(c) - s.page_size;
      EXPECT_EQ(kl.MetaRangeOffset(kv, last_page, l, c.groups - 1) + kl.MetaRangeBytes(),
                kl.MetaPerLayer() ? kl.Offset(kv, NumTokens(c) - 1, l, 0) + kl.token_bytes
                                  : kl.total_bytes());
    }
  }
}

TEST(DeviceRowsTest, DefaultIsEmpty) {
  const DeviceRows rows;
  EXPECT_EQ(rows.rows, 0u);
  EXPECT_EQ(rows.row_bytes, 0u);
  EXPECT_EQ(rows.total_bytes(), 0u);
  EXPECT_EQ(rows.Offset(0), 0u);
}

TEST(DeviceRowsTest, RowsAreBackToBack) {
  DeviceRows rows;
  rows.rows = 7;
  rows.row_bytes = 3 * 128 * 2;  // H=3 heads of D=128 bf16
  for (uint64_t r = 0; r < rows.rows; ++r) EXPECT_EQ(rows.Offset(r), r * 768);
  EXPECT_EQ(rows.total_bytes(), 7u * 768);
  EXPECT_EQ(rows.Offset(rows.rows - 1) + rows.row_bytes, rows.total_bytes());
}

TEST(DeviceRowsTest, SixtyFourBitSizes) {
  DeviceRows rows;
  rows.rows = uint64_t{1} << 22;
  rows.row_bytes = uint64_t{1} << 14;
  EXPECT_EQ(rows.total_bytes(), uint64_t{1} << 36);
  EXPECT_EQ(rows.Offset(rows.rows - 1), (uint64_t{1} << 36) - (uint64_t{1} << 14));
}

// A device pool's per-layer K (or V) buffer is the engines' (S, H, D) layer
// tensor; the host layer_first layout stores the same rows at the same
// relative offsets, which is why lf load/backup can copy rows 1:1.
TEST(DeviceRowsTest, MatchesHostLayerFirstLayerRows) {
  const Case c = {Model::kMha, LayoutKind::kLayerFirst, {"Lf", 3, 4, 2, 2, 4, 2}};
  const KvLayout kl = MakeLayout(c);
  DeviceRows dev;
  dev.rows = NumTokens(c);
  dev.row_bytes = NumHeads(c) * c.shape.dim * c.shape.itemsize;
  EXPECT_EQ(dev.total_bytes() * NumLayers(c) * NumPlanes(c), kl.total_bytes());
  for (uint64_t kv = 0; kv < NumPlanes(c); ++kv) {
    for (uint64_t l = 0; l < NumLayers(c); ++l) {
      const uint64_t layer_base = kl.Offset(kv, 0, l, 0);
      for (uint64_t t = 0; t < dev.rows; ++t) {
        EXPECT_EQ(kl.Offset(kv, t, l, 0), layer_base + dev.Offset(t));
      }
    }
  }
}

}  // namespace
}  // namespace kvhost
