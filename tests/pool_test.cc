// Tests of Pool (server/pool/pool.h): page buffer metadata, Alloc / Free with
// the pool's name in errors, page methods that change nothing when refused,
// split heads, strides and buffer infos, the reply bounds the service checks
// before building a reply, and page ranges as slices of the flat
// page. Region files live in a private directory under /dev/shm.
//
// Expected values are computed here from the formulas of SEED_INVENTORY.md §2
// and §4, not from the code under test.
#include "server/pool/pool.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "domain_test_util.h"
#include "pool_test_util.h"
#include "server/pool/registry.h"

namespace kvhost {
namespace {

using ::kvhost::testing::KindRegistryTest;
using ::kvhost::testing::KindSpec;
using ::kvhost::testing::kKinds;
using ::kvhost::testing::MhaSpec;
using ::kvhost::testing::Msg;
using ::kvhost::testing::Options;
using ::testing::HasSubstr;
using ShmDir = ::kvhost::testing::PoolShmDir;

TEST(PoolTest, PageBufferMetaMhaLayerFirst) {
  ShmDir dir;
  ASSERT_FALSE(dir.path().empty());
  PoolSpec s = MhaSpec();
  s.layout = LayoutKind::kLayerFirst;
  s.layer_num = 3, s.head_num = 2, s.head_dim = 4, s.page_size = 4;  // bf16
  const uint64_t S = 32, L = 3, ps = 4, row = 2 * 4 * 2;             // token row: H*D*b = 16
  absl::StatusOr<std::shared_ptr<Pool>> pool = Pool::Create("p", s, S, dir.path() + "/x.");
  ASSERT_TRUE(pool.ok()) << pool.status();
  const uint64_t v_off = L * S * row;  // the seeds' V_OFF
  EXPECT_EQ((*pool)->bytes(), 2 * v_off);
  // Pages 5 then 2, in list order.
  std::vector<int64_t> slots = {20, 21, 22, 23, 8, 9, 10, 11};
  absl::StatusOr<std::vector<RegionRange>> meta = (*pool)->PageBufferMeta(slots);
  ASSERT_TRUE(meta.ok()) << meta.status();
  ASSERT_EQ(meta->size(), 2 * L * 2);
  size_t i = 0;
  for (uint64_t page : {5, 2}) {
    for (uint64_t layer = 0; layer < L; ++layer) {
      for (uint64_t plane = 0; plane < 2; ++plane, ++i) {
        // (2, L, S, H, D): row block of `ps` tokens of one layer.
        EXPECT_EQ((*meta)[i].region, 0u);
        EXPECT_EQ((*meta)[i].offset, plane * v_off + (layer * S + page * ps) * row)
            << "page " << page << " layer " << layer << " plane " << plane;
        EXPECT_EQ((*meta)[i].length, ps * row);
      }
    }
  }
}

TEST(PoolTest, PageBufferMetaMhaPageFirst) {
  ShmDir dir;
  PoolSpec s = MhaSpec();
  s.layout = LayoutKind::kPageFirst;
  s.layer_num = 3, s.head_num = 2, s.head_dim = 4, s.page_size = 4;
  const uint64_t S = 32, L = 3, ps = 4, row = 16;
  absl::StatusOr<std::shared_ptr<Pool>> pool = Pool::Create("p", s, S, dir.path() + "/x.");
  ASSERT_TRUE(pool.ok()) << pool.status();
  const uint64_t v_off = L * S * row;
  absl::StatusOr<std::vector<RegionRange>> meta =
      (*pool)->PageBufferMeta({28, 29, 30, 31, 0, 1, 2, 3});
  ASSERT_TRUE(meta.ok()) << meta.status();
  ASSERT_EQ(meta->size(), 2u * 2);
  size_t i = 0;
  for (uint64_t page : {7, 0}) {
    for (uint64_t plane = 0; plane < 2; ++plane, ++i) {
      // (2, S, L, H, D): a page is ps tokens of all layers, contiguous.
      EXPECT_EQ((*meta)[i].offset, plane * v_off + page * ps * L * row);
      EXPECT_EQ((*meta)[i].length, ps * L * row);
    }
  }
  // Malformed lists are refused with the pool's name.
  absl::StatusOr<std::vector<RegionRange>> bad = (*pool)->PageBufferMeta({1, 2, 3, 4});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Msg(bad.status()), HasSubstr("pool 'p'"));
}

TEST(PoolTest, AllocFreeWithPoolName) {
  ShmDir dir;
  PoolSpec s = MhaSpec();
  s.head_num = 1, s.head_dim = 8, s.layer_num = 1, s.page_size = 4;
  absl::StatusOr<std::shared_ptr<Pool>> pool = Pool::Create("llama", s, 16, dir.path() + "/x.");
  ASSERT_TRUE(pool.ok()) << pool.status();
  EXPECT_EQ((*pool)->page_num(), 4u);
  absl::StatusOr<std::vector<uint64_t>> pages = (*pool)->AllocPages(8);
  ASSERT_TRUE(pages.ok());
  EXPECT_EQ(*pages, (std::vector<uint64_t>{0, 1}));
  absl::StatusOr<std::vector<uint64_t>> too_many = (*pool)->AllocPages(16);
  EXPECT_EQ(too_many.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(Msg(too_many.status()), HasSubstr("pool 'llama'"));
  absl::StatusOr<uint64_t> freed = (*pool)->Free({4, 5, 6, 7});
  ASSERT_TRUE(freed.ok());
  EXPECT_EQ(*freed, 4u);
  absl::StatusOr<uint64_t> again = (*pool)->Free({4, 5, 6, 7});
  EXPECT_EQ(again.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(Msg(again.status()), HasSubstr("pool 'llama'"));
  EXPECT_EQ((*pool)->allocator().free_pages(), 3u);
}

TEST_F(KindRegistryTest, PageMethodErrorsChangeNothing) {
  PoolRegistry reg(Options(dir_.path(), &mem_));
  std::shared_ptr<Pool> mha = Make(reg, "mha", KindSpec(PoolKind::kMha));
  ASSERT_NE(mha, nullptr);
  ASSERT_TRUE(mha->AllocPages(4).ok());  // page 0
  const uint64_t n = mha->flat_page_bytes();
  EXPECT_EQ(n, 4u * 2 * 2 * 8 * 2 * 2);
  std::vector<uint8_t> page(n, 7), zeros(n, 0), out(n, 1);
  struct C {
    int64_t index;
    size_t bytes;
    absl::StatusCode code;
    const char* needle;
  };
  const C cases[] = {
      {2, n, absl::StatusCode::kInvalidArgument, "index 2 is not the first slot of a page"},
      {64, n, absl::StatusCode::kInvalidArgument, "index 64"},
      {-4, n, absl::StatusCode::kInvalidArgument, "index -4"},
      {4, n, absl::StatusCode::kFailedPrecondition, "not allocated"},
      {0, n - 1, absl::StatusCode::kInvalidArgument, "a page of pool 'mha' (MHA/PAGE_FIRST) has"},
  };
  for (const C& c : cases) {
    absl::Status w = mha->WritePage(c.index, absl::MakeConstSpan(page.data(), c.bytes));
    EXPECT_EQ(w.code(), c.code) << w;
    EXPECT_THAT(Msg(w), HasSubstr(c.needle));
    absl::Status r = mha->ReadPage(c.index, absl::MakeSpan(out.data(), c.bytes));
    EXPECT_EQ(r.code(), c.code) << r;
  }
  EXPECT_EQ(out, std::vector<uint8_t>(n, 1));  // nothing read into it
  for (size_t r = 0; r < mha->region_count(); ++r) {
    for (uint64_t x = 0; x < mha->region_bytes(r); ++x) ASSERT_EQ(mha->region_base(r)[x], 0);
  }
  // Asymmetric: no flat page, no shape, no split heads (the seeds raise).
  std::shared_ptr<Pool> asym = Make(reg, "asym", KindSpec(PoolKind::kMhaAsymmetric));
  ASSERT_NE(asym, nullptr);
  ASSERT_TRUE(asym->AllocPages(4).ok());
  absl::Status a = asym->CheckPage(0);
  EXPECT_EQ(a.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(Msg(a), HasSubstr("NotImplementedError"));
  EXPECT_EQ(asym->PageShape().status().code(), absl::StatusCode::kFailedPrecondition);
  const int64_t slots[4] = {0, 1, 2, 3};
  EXPECT_EQ(asym->SplitHeadsMeta(slots, 1).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(asym->PageBufferMeta(slots).ok());
}

TEST_F(KindRegistryTest, SplitHeadsStrideAndBufferInfos) {
  PoolRegistry reg(Options(dir_.path(), &mem_));
  PoolSpec s = KindSpec(PoolKind::kMha);
  s.layout = LayoutKind::kPageHead, s.head_num = 4;
  std::shared_ptr<Pool> ph = Make(reg, "ph", s);
  ASSERT_NE(ph, nullptr);
  const int64_t slots[4] = {4, 5, 6, 7};  // page 1
  const uint64_t L = 2, ps = 4, H = 4, D = 8, b = 2, S = 64, v_off = L * S * H * D * b;
  for (uint32_t f : {0u, 3u, 8u}) {
    absl::StatusOr<std::vector<RegionRange>> m = ph->SplitHeadsMeta(slots, f);
    EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument) << f;
    EXPECT_THAT(Msg(m.status()), HasSubstr("split_factor"));
  }
  absl::StatusOr<std::vector<RegionRange>> m = ph->SplitHeadsMeta(slots, 2);
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_EQ(m->size(), 4u);
  for (uint64_t g = 0; g < 2; ++g) {  // S1:489-535
    const uint64_t k = 4 * L * H * D * b + g * 2 * ps * L * D * b;
    EXPECT_EQ((*m)[2 * g].offset, k);
    EXPECT_EQ((*m)[2 * g + 1].offset, k + v_off);
    EXPECT_EQ((*m)[2 * g].length, L * b * ps * H * D / 2);
  }
  absl::StatusOr<StrideCheck> st = ph->StrideAlignment(0);
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->page_strides, (std::vector<uint64_t>{ps * L * H * D * b, ps * L * H * D * b}));
  EXPECT_EQ(st->aligned, (ps * L * H * D * b) % 4096 == 0);
  EXPECT_TRUE(ph->StrideAlignment(512)->aligned);  // 512-byte strides, mmap'd bases
  EXPECT_FALSE(ph->StrideAlignment(1024)->aligned);
  EXPECT_EQ(ph->StrideAlignment(3).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ph->ContiguousBufferInfos().status().code(), absl::StatusCode::kFailedPrecondition);
  // LAYER_FIRST: never page aligned; per component, per layer buffers.
  std::shared_ptr<Pool> mla = Make(reg, "mla", KindSpec(PoolKind::kMla));
  ASSERT_NE(mla, nullptr);
  EXPECT_FALSE(mla->StrideAlignment(1)->aligned);
  EXPECT_EQ(mla->SplitHeadsMeta(slots, 1).status().code(), absl::StatusCode::kFailedPrecondition);
  absl::StatusOr<std::vector<BufferInfo>> infos = mla->ContiguousBufferInfos();
  ASSERT_TRUE(infos.ok());
  ASSERT_EQ(infos->size(), 2u);
  const uint64_t C = 12 * 2;
  for (uint32_t l = 0; l < 2; ++l) {  // S0:121-127
    EXPECT_EQ((*infos)[l].layer, l);
    EXPECT_EQ((*infos)[l].range.offset, l * S * C);
    EXPECT_EQ((*infos)[l].range.length, S * C);
    EXPECT_EQ((*infos)[l].item_bytes, C * 4);
  }
  absl::StatusOr<std::vector<PagePart>> shape = mla->PageShape();
  ASSERT_TRUE(shape.ok());
  ASSERT_EQ(shape->size(), 1u);
  EXPECT_EQ((*shape)[0].dims, (std::vector<uint64_t>{2, 4, 1, 12}));
  EXPECT_EQ((*shape)[0].bytes, mla->flat_page_bytes());
}

TEST_F(KindRegistryTest, MetaRefusedWhereTheSeedsRaise) {
  PoolRegistry reg(Options(dir_.path(), &mem_));
  ASSERT_NE(Make(reg, "anchor", KindSpec(PoolKind::kMla)), nullptr);
  PoolSpec s = KindSpec(PoolKind::kDsaIndexer);
  s.layout = LayoutKind::kLayerFirst;
  std::shared_ptr<Pool> idx = Make(reg, "idx", s);
  ASSERT_NE(idx, nullptr);
  const int64_t slots[4] = {0, 1, 2, 3};
  absl::StatusOr<std::vector<RegionRange>> m = idx->PageBufferMeta(slots);
  EXPECT_EQ(m.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(Msg(m.status()), HasSubstr("DSA_INDEXER/LAYER_FIRST"));
}

// ---------------------------------------------------------------------------
// Reply bounds: the estimates the service checks before building a
// reply are never below what the builders return.

// A valid pool of `kind` in `layout` (null when the kind has no such layout),
// its anchor created first for followers.
std::shared_ptr<Pool> MakeIn(PoolRegistry& reg, PoolKind kind, LayoutKind layout) {
  PoolSpec s = KindSpec(kind);
  s.layout = layout;
  if (kind == PoolKind::kMamba && layout != LayoutKind::kPageFirstDirect) return nullptr;
  if (!s.follows.empty()) {
    PoolSpec a = KindSpec(kind == PoolKind::kKOnly        ? PoolKind::kMha
                          : kind == PoolKind::kDsaIndexer ? PoolKind::kMla
                                                          : PoolKind::kLogical);
    if (!reg.Get("anchor").ok() && !reg.Create("anchor", a).ok()) return nullptr;
    s.page_size = 0;
  }
  PoolSpec check = s;
  if (check.page_size == 0) check.page_size = 4;
  if (!ValidateSpec(check).ok()) return nullptr;
  absl::StatusOr<std::shared_ptr<Pool>> p = reg.Create(PoolKindName(kind), s);
  return p.ok() ? *p : nullptr;
}

class ReplyBoundTest : public KindRegistryTest {};

TEST_F(ReplyBoundTest, EstimatesAreAtLeastWhatIsBuiltForEveryKindAndLayout) {
  int pools = 0;
  for (LayoutKind layout :
       {LayoutKind::kLayerFirst, LayoutKind::kPageFirst, LayoutKind::kPageFirstDirect,
        LayoutKind::kPageHead, LayoutKind::kPageUnified}) {
    ShmDir dir;
    PoolRegistry reg(Options(dir.path(), &mem_));
    for (PoolKind kind : kKinds) {
      std::shared_ptr<Pool> pool = MakeIn(reg, kind, layout);
      if (pool == nullptr) continue;
      ++pools;
      SCOPED_TRACE(pool->Label());
      const uint64_t ps = pool->page_size();
      // Whole pages: 1, 2 and every page (all of them allocated, so CheckPage
      // passes too).
      for (uint64_t pages : {uint64_t{1}, uint64_t{2}, pool->page_num()}) {
        std::vector<int64_t> slots;
        for (uint64_t i = 0; i < pages * ps; ++i) slots.push_back(static_cast<int64_t>(i));
        absl::StatusOr<std::vector<RegionRange>> meta = pool->PageBufferMeta(slots);
        if (meta.ok()) {
          EXPECT_GE(pool->PageBufferMetaEntries(slots.size()), meta->size()) << pages;
          // Exact for whole pages: the bound is not loose by a factor.
          EXPECT_EQ(pool->PageBufferMetaEntries(slots.size()), meta->size()) << pages;
        }
        for (uint32_t split : {1u, 2u, 4u}) {
          absl::StatusOr<std::vector<RegionRange>> heads = pool->SplitHeadsMeta(slots, split);
          if (heads.ok()) {
            EXPECT_GE(pool->SplitHeadsMetaEntries(slots.size(), split), heads->size())
                << pages << " pages, split " << split;
          }
        }
      }
      // Slot lists that are not whole pages still get a bound (rounded up).
      EXPECT_GE(pool->PageBufferMetaEntries(ps + 1), 2 * pool->PageBufferMetaEntries(ps) / 1);
      absl::StatusOr<std::vector<BufferInfo>> infos = pool->ContiguousBufferInfos();
      if (infos.ok()) {
        EXPECT_EQ(pool->ContiguousBufferInfoEntries(), infos->size());
      }
      absl::StatusOr<std::vector<PagePart>> parts = pool->PageShape();
      if (parts.ok()) {
        // One part per component, but PAGE_UNIFIED MHA's one interleaved "kv".
        const bool one_part = layout == LayoutKind::kPageUnified && kind == PoolKind::kMha;
        EXPECT_EQ(parts->size(), one_part ? 1u : pool->components().size());
        uint64_t bytes = 0;
        for (const PagePart& part : *parts) {
          EXPECT_LE(part.dims.size(), kMaxPagePartDims);
          bytes += part.bytes;
        }
        EXPECT_EQ(bytes, pool->flat_page_bytes());
      }
    }
  }
  EXPECT_GE(pools, 15);  // every kind in at least one layout
}

TEST_F(ReplyBoundTest, LayerFirstEstimateGrowsWithLayersBeforeAnythingIsBuilt) {
  PoolRegistry reg(Options(dir_.path(), &mem_));
  PoolSpec s = KindSpec(PoolKind::kMha);
  s.layout = LayoutKind::kLayerFirst, s.layer_num = kMaxLayers, s.size_tokens = 16;
  std::shared_ptr<Pool> pool = Make(reg, "deep", s);
  ASSERT_NE(pool, nullptr);
  // 4M indices of 4-slot pages: 2^20 pages x 4096 layers x 2 components.
  EXPECT_EQ(pool->PageBufferMetaEntries(uint64_t{1} << 22), (uint64_t{1} << 20) * 4096 * 2);
  EXPECT_EQ(pool->ContiguousBufferInfoEntries(), uint64_t{2} * kMaxLayers);
}

// ---------------------------------------------------------------------------
// Page ranges: a chunk copied straight to / from the pool is the same bytes
// as the whole flat page.

TEST_F(KindRegistryTest, PageRangesAreSlicesOfTheFlatPage) {
  PoolRegistry reg(Options(dir_.path(), &mem_));
  PoolSpec s = KindSpec(PoolKind::kMha);
  s.layout = LayoutKind::kLayerFirst, s.layer_num = 3;
  std::shared_ptr<Pool> pool = Make(reg, "p", s);
  ASSERT_NE(pool, nullptr);
  ASSERT_TRUE(pool->AllocPages(8).ok());
  const uint64_t n = pool->flat_page_bytes();
  std::vector<uint8_t> page(n);
  for (uint64_t i = 0; i < n; ++i) page[i] = static_cast<uint8_t>(i * 7 + 1);
  // Written in odd chunks that straddle the per-layer ranges.
  for (uint64_t at = 0; at < n; at += 37) {
    const uint64_t len = std::min<uint64_t>(37, n - at);
    ASSERT_TRUE(pool->WritePageRange(4, at, absl::MakeConstSpan(page.data() + at, len)).ok());
  }
  std::vector<uint8_t> whole(n);
  ASSERT_TRUE(pool->ReadPage(4, absl::MakeSpan(whole)).ok());
  EXPECT_EQ(whole, page);
  std::vector<uint8_t> slice(50);
  ASSERT_TRUE(pool->ReadPageRange(4, 30, absl::MakeSpan(slice)).ok());
  EXPECT_EQ(slice, std::vector<uint8_t>(page.begin() + 30, page.begin() + 80));
  // Past the end: refused, nothing copied.
  std::vector<uint8_t> tail(2);
  absl::Status past = pool->ReadPageRange(4, n - 1, absl::MakeSpan(tail));
  EXPECT_EQ(past.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Msg(past), HasSubstr("pass its end"));
  EXPECT_EQ(pool->WritePageRange(4, n + 1, {}).code(), absl::StatusCode::kInvalidArgument);
  // Not allocated: as CheckPage.
  EXPECT_EQ(pool->ReadPageRange(8, 0, absl::MakeSpan(slice)).code(),
            absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace kvhost
