// Integration tests of every pool kind through kvhostd (host backend) and
// kvhost::Client: Pool.components and sizes, backup / load round trips
// through ShmDevicePool, the page RPCs, followers, layer sharding, replicated
// pools with several TP ranks, and the seeds' spec errors per kind.
//
// The expected components, offsets and flat pages are computed here from the
// seeds' C-contiguous tensor shapes (SEED_INVENTORY.md §2, issue-4 plan §2),
// independently of kernels/kvhost/host_layout.h and server/pool: a wrong
// stride in the daemon cannot hide behind a shared one. Each test runs its own
// kvhostd (TestDaemon).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "api_test_util.h"
#include "daemon_fixture.h"
#include "gtest/gtest.h"
#include "kvhost/client.h"
#include "seed_offsets.h"

namespace kvhost {
namespace {

using ::kvhost::testing::IsError;
using ::kvhost::testing::StatusOf;
using ::kvhost::testing::TestDaemon;

// ---------------------------------------------------------------------------
// The seeds' buffers, written out per kind.

// One host buffer: a C-contiguous tensor whose leading dimensions are the
// layout's (L, S, ...) / (S, L, ...) / (P, L, ps, ...) / (P, H, ps, L, ...)
// for token rows, or (L, P, R) / (P, L, R) / (P, L, 1, R) for page rows;
// or one plane of sglang's page_unified (P, G, L, 2, ps, H / G, D), whose K
// and V interleave (planes 2: the part is plane `offset / chunk` of it).
struct Part {
  std::string name;
  std::string suffix;  // region file suffix, "" when not pinned by the design
  uint32_t region = 0;
  uint64_t offset = 0;      // of its first byte in the region file
  bool page_rows = false;   // a row per page (row_tokens = ps)
  uint64_t heads = 1;       // token rows: heads per row
  uint64_t head_bytes = 0;  // token rows: bytes per head; page rows: row bytes
  v1::Layout layout = v1::LAYOUT_UNSPECIFIED;
  uint64_t L = 0, S = 0, ps = 0;
  uint64_t planes = 1;  // PAGE_UNIFIED MHA: 2 planes interleaved in one tensor
  uint64_t groups = 1;  // PAGE_UNIFIED head groups

  uint64_t P() const { return S / ps; }
  uint64_t row_bytes() const { return heads * head_bytes; }
  uint64_t row_tokens() const { return page_rows ? ps : 1; }
  uint64_t rows() const { return page_rows ? P() : S; }
  uint64_t bytes() const { return L * rows() * row_bytes(); }
  // The end of the buffer in the region file: the tensor's end, which for
  // interleaved planes is past the part's last byte.
  uint64_t end() const { return planes > 1 ? bytes() * planes : offset + bytes(); }

  // Offset in the region file of head h of row r (a token slot, or a page
  // for page rows) of host layer l: the C-contiguous index of the seed's
  // tensor.
  uint64_t At(uint64_t r, uint64_t l, uint64_t h = 0) const {
    // Page rows: (L, P, R), (P, L, R), (P, L, 1, R), the token shapes with a
    // row per page; token rows: the MHA / MLA token shapes of one plane.
    testing::SeedBuffer b;
    b.layout = testing::SeedLayoutOf(layout);
    b.layers = L;
    b.rows = rows();
    b.page_size = page_rows ? 1 : ps;
    b.heads = heads;
    b.dim = head_bytes;
    b.planes = planes;  // the offset places plane 1 (one (ps, H / G, D) chunk on)
    b.groups = groups;
    return offset + testing::SeedOffset(b, /*kv=*/0, r, l, h);
  }
};

uint64_t Prod(const v1::Shape& shape) {
  uint64_t n = 1;
  for (uint32_t d : shape.dims()) n *= d;
  return n;
}

// The buffers of a pool of `spec` with S slots of page size ps (a follower's
// spec leaves both to the pool it follows).
std::vector<Part> ExpectedParts(const v1::PoolSpec& spec, uint64_t S, uint64_t ps) {
  const uint64_t b = testing::ElemBytes(spec.dtype());
  const uint64_t L = spec.layer_num();
  const uint64_t latent = spec.kv_cache_dim() != 0
                              ? spec.kv_cache_dim()
                              : uint64_t{spec.kv_lora_rank()} + spec.qk_rope_head_dim();
  const uint64_t index_bytes =  // IS = d + d / q * 4
      spec.index_quant_block_size() == 0
          ? 0
          : spec.index_head_dim() + spec.index_head_dim() / spec.index_quant_block_size() * 4;
  auto token = [&](std::string name, std::string suffix, uint32_t region, uint64_t offset,
                   uint64_t heads, uint64_t head_bytes) {
    return Part{std::move(name), std::move(suffix), region, offset, false, heads,
                head_bytes,      spec.layout(),     L,      S,      ps};
  };
  auto page = [&](std::string name, std::string suffix, uint32_t region, uint64_t row) {
    return Part{
        std::move(name), std::move(suffix), region, 0, true, 1, row, spec.layout(), L, S, ps};
  };
  const uint64_t H = spec.head_num(), D = spec.head_dim();
  if (spec.layout() == v1::PAGE_UNIFIED && (spec.kind() == v1::MHA || spec.kind() == v1::K_ONLY)) {
    // sglang's page_unified: (P, G, L, 2, ps, H / G, D), K = 0, V = 1; K_ONLY
    // without the 2.
    const uint64_t G = std::max<uint32_t>(spec.head_groups(), 1);
    const uint64_t planes = spec.kind() == v1::MHA ? 2 : 1;
    std::vector<Part> parts = {token("k", ".kv", 0, 0, H, D * b)};
    if (planes == 2) parts.push_back(token("v", ".kv", 0, ps * (H / G) * D * b, H, D * b));
    for (Part& part : parts) part.planes = planes, part.groups = G;
    return parts;
  }
  switch (spec.kind()) {
    case v1::MHA:
      return {token("k", ".kv", 0, 0, H, D * b), token("v", ".kv", 0, L * S * H * D * b, H, D * b)};
    case v1::MLA:
      return {token("latent", ".kv", 0, 0, 1, latent * b)};
    case v1::MHA_ASYMMETRIC:
      return {token("k", ".k", 0, 0, H, D * b), token("v", ".v", 1, 0, H, spec.v_head_dim() * b)};
    case v1::K_ONLY:
      return {token("k", ".kv", 0, 0, H, D * b)};
    case v1::DSA: {
      const uint64_t ikr = spec.index_row_bytes() != 0 ? spec.index_row_bytes() : index_bytes;
      return {token("latent", ".kv", 0, 0, 1, latent * b),
              page("index_k", ".index_k", 1, ps * ikr)};
    }
    case v1::DSA_INDEXER:
      return {page("index_k", "", 0, ps * index_bytes)};
    case v1::MAMBA: {
      const v1::DType td = spec.mamba().temporal_dtype() == v1::DTYPE_UNSPECIFIED
                               ? spec.dtype()
                               : spec.mamba().temporal_dtype();
      std::vector<Part> parts = {token("temporal", ".temporal", 0, 0, 1,
                                       Prod(spec.mamba().temporal()) * testing::ElemBytes(td))};
      for (int j = 0; j < spec.mamba().conv_size(); ++j) {
        parts.push_back(token(absl::StrCat("conv", j), absl::StrCat(".conv", j),
                              static_cast<uint32_t>(j + 1), 0, 1, Prod(spec.mamba().conv(j)) * b));
      }
      return parts;
    }
    case v1::V4_PAGED:
      return {page("rows", "", 0, spec.item_bytes())};
    case v1::V4_STATE:
      return {page("rows", "", 0, uint64_t{spec.ring_size()} * spec.state_slot_bytes())};
    default:  // LOGICAL
      return {};
  }
}

// The flat page at page p (component after component; LAYER_FIRST: each
// layer's page rows in layer order; page-major layouts: the page's block;
// PAGE_UNIFIED's interleaved planes: the tensor's page block, once), read
// from the mapped region files.
std::string ExpectedFlatPage(const std::vector<Part>& parts,
                             const std::vector<std::unique_ptr<testing::MappedFile>>& files,
                             uint64_t p) {
  std::string flat;
  for (const Part& part : parts) {
    const uint8_t* base = files[part.region]->data() + part.offset;
    const uint64_t B = part.bytes(), L = part.L, P = part.P();
    if (part.layout == v1::LAYER_FIRST) {
      for (uint64_t l = 0; l < L; ++l) {
        flat.append(reinterpret_cast<const char*>(base + l * (B / L) + p * (B / L / P)), B / L / P);
      }
    } else if (part.planes > 1) {
      if (part.offset != 0) continue;  // plane 0 appends the block of every plane
      const uint64_t block = part.planes * B / P;
      flat.append(reinterpret_cast<const char*>(base + p * block), block);
    } else {
      flat.append(reinterpret_cast<const char*>(base + p * (B / P)), B / P);
    }
  }
  return flat;
}

// ---------------------------------------------------------------------------
// The cases: every kind x allowed layout.

struct KindCase {
  std::string name;
  v1::PoolSpec spec;                   // follows "anchor" when anchor is set
  std::optional<v1::PoolSpec> anchor;  // the pool it follows
  uint64_t S = 0, ps = 0;              // slots and page size the pool gets
};

v1::PoolSpec Base(v1::PoolKind kind, v1::Layout layout, uint32_t ps, uint32_t layers,
                  uint64_t size_tokens, v1::DType dtype = v1::BF16) {
  v1::PoolSpec s;
  s.set_kind(kind);
  s.set_layout(layout);
  s.set_dtype(dtype);
  s.set_page_size(ps);
  s.set_layer_num(layers);
  s.set_size_tokens(size_tokens);
  return s;
}

v1::PoolSpec Mha(v1::Layout layout) {
  v1::PoolSpec s = Base(v1::MHA, layout, 4, 3, 64);
  s.set_head_num(2);
  s.set_head_dim(8);
  return s;
}

v1::PoolSpec Mla(v1::Layout layout) {
  v1::PoolSpec s = Base(v1::MLA, layout, 4, 3, 64);
  s.set_kv_lora_rank(12);
  s.set_qk_rope_head_dim(4);
  return s;
}

v1::PoolSpec V4Paged(v1::Layout layout) {
  v1::PoolSpec s = Base(v1::V4_PAGED, layout, 4, 2, 64, v1::UINT8);
  s.set_item_bytes(40);
  return s;
}

// An index space without buffers: no layers.
v1::PoolSpec Logical() { return Base(v1::LOGICAL, v1::LAYER_FIRST, 4, 0, 64, v1::UINT8); }

// A follower's spec: no size, no page size (it takes the followed pool's).
v1::PoolSpec Follower(v1::PoolSpec s) {
  s.set_follows("anchor");
  s.clear_size_tokens();
  s.clear_page_size();
  return s;
}

std::string LayoutShort(v1::Layout layout) {
  switch (layout) {
    case v1::LAYER_FIRST:
      return "LF";
    case v1::PAGE_FIRST:
      return "PF";
    case v1::PAGE_FIRST_DIRECT:
      return "PFD";
    case v1::PAGE_UNIFIED:
      return "PU";
    default:
      return "PH";
  }
}

std::vector<KindCase> AllCases() {
  std::vector<KindCase> cases;
  const v1::Layout kPageMajor[] = {v1::PAGE_FIRST, v1::PAGE_FIRST_DIRECT};
  const v1::Layout kThree[] = {v1::LAYER_FIRST, v1::PAGE_FIRST, v1::PAGE_FIRST_DIRECT};
  // MLA and K_ONLY take PAGE_UNIFIED too.
  const v1::Layout kFour[] = {v1::LAYER_FIRST, v1::PAGE_FIRST, v1::PAGE_FIRST_DIRECT,
                              v1::PAGE_UNIFIED};
  for (v1::Layout l :
       {v1::LAYER_FIRST, v1::PAGE_FIRST, v1::PAGE_FIRST_DIRECT, v1::PAGE_HEAD, v1::PAGE_UNIFIED}) {
    cases.push_back({"MHA_" + LayoutShort(l), Mha(l), std::nullopt, 64, 4});
  }
  {
    v1::PoolSpec s = Mha(v1::PAGE_UNIFIED);
    s.set_head_groups(2);  // a head group per head: rows split in two
    cases.push_back({"MHA_PU_head_groups", s, std::nullopt, 64, 4});
  }
  for (v1::Layout l : kFour)
    cases.push_back({"MLA_" + LayoutShort(l), Mla(l), std::nullopt, 64, 4});
  {
    v1::PoolSpec s = Mla(v1::PAGE_FIRST);
    s.set_kv_cache_dim(20);
    cases.push_back({"MLA_PF_kv_cache_dim", s, std::nullopt, 64, 4});
  }
  for (v1::Layout l : kPageMajor) {
    v1::PoolSpec s = Base(v1::MHA_ASYMMETRIC, l, 4, 3, 64);
    s.set_head_num(2);
    s.set_head_dim(8);
    s.set_v_head_dim(4);
    cases.push_back({"MHA_ASYMMETRIC_" + LayoutShort(l), s, std::nullopt, 64, 4});
  }
  for (v1::Layout l : kFour) {
    v1::PoolSpec s = Base(v1::K_ONLY, l, 4, 2, 0, v1::FP16);
    s.set_head_num(2);
    s.set_head_dim(6);
    if (l == v1::PAGE_UNIFIED) s.set_head_groups(2);
    cases.push_back({"K_ONLY_" + LayoutShort(l), Follower(s), Mha(v1::PAGE_FIRST), 64, 4});
  }
  {
    v1::PoolSpec s = Base(v1::DSA, v1::LAYER_FIRST, 4, 3, 64);
    s.set_kv_lora_rank(12);
    s.set_qk_rope_head_dim(4);
    s.set_index_head_dim(16);
    s.set_index_quant_block_size(8);
    cases.push_back({"DSA_LF", s, std::nullopt, 64, 4});
    s.clear_index_head_dim();  // one or the other
    s.clear_index_quant_block_size();
    s.set_index_row_bytes(21);  // odd
    cases.push_back({"DSA_LF_index_row_bytes", s, std::nullopt, 64, 4});
  }
  for (v1::Layout l : kThree) {
    v1::PoolSpec s = Base(v1::DSA_INDEXER, l, 4, 2, 0, v1::UINT8);
    s.set_index_head_dim(16);
    s.set_index_quant_block_size(8);
    cases.push_back({"DSA_INDEXER_" + LayoutShort(l), Follower(s), Mla(v1::LAYER_FIRST), 64, 4});
  }
  {
    v1::PoolSpec s = Base(v1::MAMBA, v1::PAGE_FIRST_DIRECT, 1, 2, 16);
    v1::MambaStates* m = s.mutable_mamba();
    m->mutable_temporal()->add_dims(2);
    m->mutable_temporal()->add_dims(3);
    m->set_temporal_dtype(v1::FP32);
    m->add_conv()->add_dims(5);  // 5 bf16 = 10 bytes, an odd row of 5 elements
    m->add_conv()->add_dims(2);
    m->mutable_conv(1)->add_dims(3);
    cases.push_back({"MAMBA_PFD", s, std::nullopt, 16, 1});
  }
  for (v1::Layout l : kThree) {
    cases.push_back({"V4_PAGED_" + LayoutShort(l), V4Paged(l), std::nullopt, 64, 4});
  }
  for (v1::Layout l : kThree) {
    v1::PoolSpec s = Base(v1::V4_STATE, l, 4, 2, 0, v1::UINT8);
    s.set_ring_size(3);
    s.set_state_slot_bytes(8);
    cases.push_back({"V4_STATE_" + LayoutShort(l), Follower(s), V4Paged(v1::PAGE_FIRST), 64, 4});
    if (l == v1::LAYER_FIRST) {
      cases.push_back({"V4_STATE_LF_follows_LOGICAL", Follower(s), Logical(), 64, 4});
    }
  }
  cases.push_back({"LOGICAL", Logical(), std::nullopt, 64, 4});
  return cases;
}

const std::vector<KindCase>& Cases() {
  static const std::vector<KindCase> cases = AllCases();
  return cases;
}

// ---------------------------------------------------------------------------
// Fixture.

class KindsTest : public testing::WithDaemon<::testing::Test> {
 protected:
  // Creates the case's anchor (if any) and pool "p"; returns the pool.
  absl::StatusOr<v1::Pool> CreateCase(const KindCase& c) {
    if (c.anchor.has_value()) {
      absl::StatusOr<v1::Pool> anchor = client().CreatePool("anchor", *c.anchor);
      if (!anchor.ok()) return anchor.status();
    }
    return client().CreatePool("p", c.spec);
  }
  // The pool that allocates p's slots.
  static std::string Owner(const KindCase& c) { return c.anchor.has_value() ? "anchor" : "p"; }

  std::vector<std::unique_ptr<testing::MappedFile>> MapRegions(const v1::Pool& pool) {
    std::vector<std::unique_ptr<testing::MappedFile>> files;
    for (const std::string& path : pool.region_paths()) {
      files.push_back(testing::MappedFile::Open(path));
      EXPECT_NE(files.back(), nullptr) << path;
    }
    return files;
  }

  std::string Snapshot(const std::vector<std::unique_ptr<testing::MappedFile>>& files) {
    std::string all;
    for (const auto& f : files) {
      if (f != nullptr) all.append(reinterpret_cast<const char*>(f->data()), f->size());
    }
    return all;
  }

  uint64_t Wait(absl::StatusOr<uint64_t> ticket) {
    EXPECT_TRUE(ticket.ok()) << ticket.status();
    if (!ticket.ok()) return 0;
    absl::StatusOr<v1::TransferStatus> st = client().WaitTransfer(*ticket, absl::Seconds(30));
    EXPECT_TRUE(st.ok()) << st.status();
    return st.ok() ? st->layer_num() : 0;
  }
};

class KindCaseTest : public KindsTest, public ::testing::WithParamInterface<size_t> {
 protected:
  const KindCase& kind_case() const { return Cases()[GetParam()]; }
};

std::string CaseName(const ::testing::TestParamInfo<size_t>& info) {
  return Cases()[info.param].name;
}

// ---------------------------------------------------------------------------
// 1. Create, Get, List: components and sizes against the formulas.

TEST_P(KindCaseTest, CreateGetListShowTheSeedBuffers) {
  const KindCase& c = kind_case();
  absl::StatusOr<v1::Pool> created = CreateCase(c);
  ASSERT_TRUE(created.ok()) << created.status();
  absl::StatusOr<v1::Pool> got = client().GetPool("p");
  ASSERT_TRUE(got.ok()) << got.status();
  absl::StatusOr<std::vector<v1::Pool>> listed = client().ListPools();
  ASSERT_TRUE(listed.ok()) << listed.status();
  const v1::Pool* in_list = nullptr;
  for (const v1::Pool& p : *listed) {
    if (p.name() == "p") in_list = &p;
  }
  ASSERT_NE(in_list, nullptr);
  for (const v1::Pool* pool : std::vector<const v1::Pool*>{&*created, &*got, in_list}) {
    SCOPED_TRACE(pool == &*created ? "CreatePool" : pool == &*got ? "GetPool" : "ListPools");
    const std::vector<Part> parts = ExpectedParts(c.spec, c.S, c.ps);
    EXPECT_EQ(pool->size_tokens(), c.S);
    EXPECT_EQ(pool->page_num(), c.S / c.ps);
    ASSERT_EQ(pool->components_size(), static_cast<int>(parts.size())) << pool->DebugString();
    uint64_t bytes = 0, per_page = 0;
    std::set<uint32_t> regions;
    for (size_t i = 0; i < parts.size(); ++i) {
      const Part& e = parts[i];
      const v1::PoolComponent& got_c = pool->components(static_cast<int>(i));
      SCOPED_TRACE(e.name);
      EXPECT_EQ(got_c.name(), e.name);
      EXPECT_EQ(got_c.region_index(), e.region);
      EXPECT_EQ(got_c.offset(), e.offset);
      EXPECT_EQ(got_c.bytes(), e.bytes());
      EXPECT_EQ(got_c.row_bytes(), e.row_bytes());
      EXPECT_EQ(got_c.row_tokens(), e.row_tokens());
      ASSERT_LT(e.region, static_cast<uint32_t>(pool->region_paths_size()));
      if (!e.suffix.empty()) {
        EXPECT_TRUE(absl::EndsWith(pool->region_paths(static_cast<int>(e.region)), e.suffix))
            << pool->region_paths(static_cast<int>(e.region)) << " should end with " << e.suffix;
      }
      bytes += e.bytes();
      per_page += e.bytes() / e.P();
      regions.insert(e.region);
    }
    EXPECT_EQ(pool->region_paths_size(), static_cast<int>(regions.size()));
    EXPECT_EQ(pool->bytes(), bytes);
    EXPECT_EQ(pool->bytes_per_page(), per_page);
    EXPECT_EQ(pool->bytes_per_token(), per_page / c.ps);
    EXPECT_EQ(pool->follows(), c.anchor.has_value() ? "anchor" : "");
    EXPECT_EQ(pool->start_layer(), 0u);
    EXPECT_EQ(pool->end_layer(), c.spec.layer_num());
    // The region files have exactly the components' bytes.
    for (int r = 0; r < pool->region_paths_size(); ++r) {
      std::unique_ptr<testing::MappedFile> f = testing::MappedFile::Open(pool->region_paths(r));
      ASSERT_NE(f, nullptr) << pool->region_paths(r);
      uint64_t end = 0;
      for (const Part& e : parts) {
        if (e.region == static_cast<uint32_t>(r)) end = std::max(end, e.end());
      }
      EXPECT_EQ(f->size(), end) << pool->region_paths(r);
    }
  }
  if (c.anchor.has_value()) {
    absl::StatusOr<v1::Pool> anchor = client().GetPool("anchor");
    ASSERT_TRUE(anchor.ok()) << anchor.status();
    ASSERT_EQ(anchor->followers_size(), 1);
    EXPECT_EQ(anchor->followers(0), "p");
  }
  ASSERT_TRUE(client().DeletePool("p").ok());
  if (c.anchor.has_value()) {
    ASSERT_TRUE(client().DeletePool("anchor").ok());
  }
}

// ---------------------------------------------------------------------------
// 2. Backup then load through ShmDevicePool, byte-exact, with the host bytes
// checked in the region files.

TEST_P(KindCaseTest, BackupThenLoadIsByteExactAndLandsAtTheSeedOffsets) {
  const KindCase& c = kind_case();
  absl::StatusOr<v1::Pool> pool = CreateCase(c);
  ASSERT_TRUE(pool.ok()) << pool.status();
  const std::vector<Part> parts = ExpectedParts(c.spec, c.S, c.ps);
  const uint64_t ps = c.ps;
  const uint64_t device_tokens = 8 * ps;
  absl::StatusOr<std::unique_ptr<ShmDevicePool>> dev_or =
      ShmDevicePool::Create(*pool, device_tokens, shm_dir());
  ASSERT_TRUE(dev_or.ok()) << dev_or.status();
  ShmDevicePool& dev = **dev_or;
  ASSERT_EQ(dev.components(), parts.size());
  std::mt19937 rng(7);
  for (uint32_t k = 0; k < dev.components(); ++k) {
    EXPECT_EQ(dev.component_name(k), parts[k].name);
    EXPECT_EQ(dev.rows(k), parts[k].page_rows ? device_tokens / ps : device_tokens);
    for (uint32_t l = 0; l < dev.layers(); ++l) {
      testing::FillRandomNonZero(dev.layer(k, l), dev.rows(k) * dev.row_bytes(k), rng);
    }
  }
  absl::StatusOr<v1::Attachment> att = client().AttachDevice(dev.MakeAttachRequest("p"));
  ASSERT_TRUE(att.ok()) << att.status();

  // Three whole pages each way; device pages out of order.
  absl::StatusOr<std::vector<int64_t>> host = client().Alloc(Owner(c), 3 * ps);
  ASSERT_TRUE(host.ok()) << host.status();
  const std::vector<int64_t> src = testing::PageSlots({5, 1, 6}, ps);
  const std::vector<int64_t> dst = testing::PageSlots({2, 7, 0}, ps);
  EXPECT_EQ(Wait(client().Backup(att->id(), *host, src)), c.spec.layer_num());

  const std::vector<std::unique_ptr<testing::MappedFile>> files = MapRegions(*pool);
  for (size_t k = 0; k < parts.size(); ++k) {
    const Part& e = parts[k];
    for (uint64_t l = 0; l < e.L; ++l) {
      for (size_t i = 0; i < host->size(); ++i) {
        if (e.page_rows && (*host)[i] % ps != 0) continue;  // one row per page
        const uint64_t hr = e.page_rows ? (*host)[i] / ps : (*host)[i];
        const uint64_t dr = e.page_rows ? src[i] / ps : src[i];
        for (uint64_t h = 0; h < e.heads; ++h) {
          ASSERT_EQ(std::memcmp(files[e.region]->data() + e.At(hr, l, h),
                                dev.row(static_cast<uint32_t>(k), static_cast<uint32_t>(l), dr) +
                                    h * e.head_bytes,
                                e.head_bytes),
                    0)
              << e.name << " layer " << l << " host row " << hr << " head " << h;
        }
      }
    }
  }

  EXPECT_EQ(Wait(client().Load(att->id(), *host, dst)), c.spec.layer_num());
  for (uint32_t k = 0; k < dev.components(); ++k) {
    for (uint32_t l = 0; l < dev.layers(); ++l) {
      for (size_t i = 0; i < dst.size(); ++i) {
        if (parts[k].page_rows && dst[i] % ps != 0) continue;
        const uint64_t from = parts[k].page_rows ? src[i] / ps : src[i];
        const uint64_t to = parts[k].page_rows ? dst[i] / ps : dst[i];
        ASSERT_EQ(std::memcmp(dev.row(k, l, to), dev.row(k, l, from), dev.row_bytes(k)), 0)
            << parts[k].name << " layer " << l << " device row " << to;
      }
    }
  }
  EXPECT_TRUE(client().DetachDevice(att->id()).ok());
}

// ---------------------------------------------------------------------------
// 3. Page RPCs.

TEST_P(KindCaseTest, PageRpcsRoundTripInTheSeedByteOrder) {
  const KindCase& c = kind_case();
  absl::StatusOr<v1::Pool> pool = CreateCase(c);
  ASSERT_TRUE(pool.ok()) << pool.status();
  const std::vector<Part> parts = ExpectedParts(c.spec, c.S, c.ps);
  const uint64_t ps = c.ps;
  absl::StatusOr<std::vector<int64_t>> slots = client().Alloc(Owner(c), 3 * ps);
  ASSERT_TRUE(slots.ok()) << slots.status();
  const int64_t p0 = (*slots)[0], p1 = (*slots)[ps], p2 = (*slots)[2 * ps];
  const std::vector<std::unique_ptr<testing::MappedFile>> files = MapRegions(*pool);

  if (c.spec.kind() == v1::MHA_ASYMMETRIC) {  // the seed's NotImplementedError
    EXPECT_ERROR(client().GetDataPage("p", p0), kFailedPrecondition, "MHA_ASYMMETRIC");
    EXPECT_ERROR(client().SetFromFlatDataPage("p", p0, "x"), kFailedPrecondition, "MHA_ASYMMETRIC");
    EXPECT_ERROR(client().ReadPages("p", {p0}), kFailedPrecondition, "MHA_ASYMMETRIC");
    EXPECT_ERROR(client().GetPageShape("p"), kFailedPrecondition, "MHA_ASYMMETRIC");
    return;
  }
  uint64_t page_bytes = 0;
  for (const Part& e : parts) page_bytes += e.bytes() / e.P();

  // Get: the region bytes in the flat order (the region is zero so far, so
  // write the page first through Set, then read it back both ways).
  std::mt19937 rng(11);
  std::string data(page_bytes, '\0');
  testing::FillRandomNonZero(reinterpret_cast<uint8_t*>(data.data()), data.size(), rng);
  ASSERT_TRUE(client().SetFromFlatDataPage("p", p1, data).ok());
  EXPECT_EQ(ExpectedFlatPage(parts, files, static_cast<uint64_t>(p1) / ps), data);
  absl::StatusOr<std::string> got = client().GetDataPage("p", p1);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, data);
  // Page p0 was never written: zeros, as the file holds.
  got = client().GetDataPage("p", p0);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, std::string(page_bytes, '\0'));

  // The shape's parts add up to the page.
  absl::StatusOr<v1::PageShape> shape = client().GetPageShape("p");
  ASSERT_TRUE(shape.ok()) << shape.status();
  EXPECT_EQ(shape->bytes(), page_bytes);
  uint64_t part_bytes = 0;
  for (const v1::PageShape::Part& part : shape->parts()) part_bytes += part.bytes();
  EXPECT_EQ(part_bytes, page_bytes);

  // Streams with chunks smaller than a page.
  const uint32_t chunk = static_cast<uint32_t>(std::max<uint64_t>(1, page_bytes / 3));
  std::vector<std::string> pages = {std::string(page_bytes, '\0'), std::string(page_bytes, '\0')};
  for (std::string& page : pages) {
    testing::FillRandomNonZero(reinterpret_cast<uint8_t*>(page.data()), page.size(), rng);
  }
  const std::vector<int64_t> two = {p2, p0};
  absl::StatusOr<uint64_t> written = client().WritePages("p", two, pages, chunk);
  ASSERT_TRUE(written.ok()) << written.status();
  EXPECT_EQ(*written, 2u);
  absl::StatusOr<std::vector<std::string>> read = client().ReadPages("p", {p0, p1, p2}, chunk);
  ASSERT_TRUE(read.ok()) << read.status();
  ASSERT_EQ(read->size(), 3u);
  EXPECT_EQ((*read)[0], pages[1]);
  EXPECT_EQ((*read)[1], data);
  EXPECT_EQ((*read)[2], pages[0]);
  EXPECT_EQ(ExpectedFlatPage(parts, files, static_cast<uint64_t>(p2) / ps), pages[0]);

  // Errors change nothing.
  const std::string before = Snapshot(files);
  absl::StatusOr<v1::Pool> owner = client().GetPool(Owner(c));
  ASSERT_TRUE(owner.ok());
  std::set<int64_t> allocated(slots->begin(), slots->end());
  int64_t free_page = -1;
  for (uint64_t p = 0; p < c.S / ps && free_page < 0; ++p) {
    if (!allocated.count(static_cast<int64_t>(p * ps))) free_page = static_cast<int64_t>(p * ps);
  }
  ASSERT_GE(free_page, 0);
  const std::string kind = v1::PoolKind_Name(c.spec.kind());
  if (ps > 1) {
    EXPECT_ERROR(client().GetDataPage("p", p1 + 1), kInvalidArgument, absl::StrCat(p1 + 1));
    EXPECT_ERROR(client().SetFromFlatDataPage("p", p1 + 1, data), kInvalidArgument,
                 absl::StrCat(p1 + 1));
    EXPECT_ERROR(client().ReadPages("p", {p0, p1 + 1}), kInvalidArgument, absl::StrCat(p1 + 1));
  }
  EXPECT_ERROR(client().GetDataPage("p", static_cast<int64_t>(c.S)), kInvalidArgument,
               absl::StrCat(c.S));
  EXPECT_ERROR(client().GetDataPage("p", free_page), kFailedPrecondition, absl::StrCat(free_page));
  EXPECT_ERROR(client().SetFromFlatDataPage("p", free_page, data), kFailedPrecondition,
               absl::StrCat(free_page));
  EXPECT_ERROR(client().ReadPages("p", {p0, p0}), kInvalidArgument, absl::StrCat(p0));
  EXPECT_ERROR(client().SetFromFlatDataPage("p", p1, data + "x"), kInvalidArgument,
               absl::StrCat(page_bytes + 1), absl::StrCat(page_bytes));
  if (page_bytes > 0) {
    EXPECT_ERROR(client().SetFromFlatDataPage("p", p1, data.substr(1)), kInvalidArgument,
                 absl::StrCat(page_bytes - 1), absl::StrCat(page_bytes));
  }
  EXPECT_EQ(Snapshot(files), before) << "a failed page call changed host bytes";
  if (page_bytes > 0) {
    // A stream cut short inside its first page completes none; the daemon
    // holds one chunk, not a page, so that page may be partly written.
    const std::vector<std::string> short_page = {data.substr(1)};
    const std::vector<int64_t> one = {p0};
    EXPECT_ERROR(client().WritePages("p", one, short_page, chunk), kInvalidArgument,
                 "0 pages written", "incomplete");
  }

  // WritePages: the first page lands, the second fails and says so.
  const std::vector<int64_t> good_then_bad = {p0, free_page};
  absl::StatusOr<uint64_t> partial = client().WritePages("p", good_then_bad, pages, chunk);
  EXPECT_ERROR(partial, kFailedPrecondition, "1 page written");
  got = client().GetDataPage("p", p0);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, pages[0]);
}

// A page over the 64 MiB message limit: GetDataPage refuses it, ReadPages and
// WritePages stream it.
TEST_F(KindsTest, PageOverTheMessageLimitStreams) {
  v1::PoolSpec spec = Base(v1::MHA, v1::PAGE_FIRST, 64, 64, 64);
  spec.set_head_num(32);
  spec.set_head_dim(128);
  const uint64_t page_bytes = 2ull * 64 * 64 * 32 * 128 * 2;  // K and V: 64 MiB
  ASSERT_GT(page_bytes + 1024, uint64_t{64} << 20);
  ASSERT_TRUE(client().CreatePool("big", spec).ok());
  ASSERT_TRUE(client().Alloc("big", 64).ok());
  EXPECT_ERROR(client().GetDataPage("big", 0), kResourceExhausted, "ReadPages",
               absl::StrCat(page_bytes));
  std::vector<std::string> pages = {std::string(page_bytes, '\0')};
  std::mt19937 rng(13);
  testing::FillRandomNonZero(reinterpret_cast<uint8_t*>(pages[0].data()), page_bytes, rng);
  const std::vector<int64_t> first = {0};
  absl::StatusOr<uint64_t> written = client().WritePages("big", first, pages);
  ASSERT_TRUE(written.ok()) << written.status();
  EXPECT_EQ(*written, 1u);
  absl::StatusOr<std::vector<std::string>> read = client().ReadPages("big", first);
  ASSERT_TRUE(read.ok()) << read.status();
  ASSERT_EQ(read->size(), 1u);
  EXPECT_TRUE((*read)[0] == pages[0]);
}

INSTANTIATE_TEST_SUITE_P(EveryKind, KindCaseTest, ::testing::Range<size_t>(0, Cases().size()),
                         CaseName);

// ---------------------------------------------------------------------------
// 4. Followers.

TEST_F(KindsTest, FollowerSharesThePageSpaceAndAllocator) {
  ASSERT_TRUE(client().CreatePool("anchor", Mla(v1::LAYER_FIRST)).ok());
  v1::PoolSpec indexer = Base(v1::DSA_INDEXER, v1::PAGE_FIRST, 0, 2, 0, v1::UINT8);
  indexer.set_index_head_dim(16);
  indexer.set_index_quant_block_size(8);
  indexer.set_follows("anchor");
  absl::StatusOr<v1::Pool> p = client().CreatePool("p", indexer);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->size_tokens(), 64u);
  EXPECT_EQ(p->spec().page_size() == 0 ? 4u : p->spec().page_size(), 4u);
  EXPECT_EQ(p->follows(), "anchor");
  // No allocator of its own: Alloc / Free name both pools.
  EXPECT_ERROR(client().Alloc("p", 4), kFailedPrecondition, "'p'", "anchor");
  EXPECT_ERROR(client().Free("p", testing::Range(0, 4)), kFailedPrecondition, "'p'", "anchor");
  // Its pages are the anchor's: allocated there, readable here.
  absl::StatusOr<std::vector<int64_t>> slots = client().Alloc("anchor", 4);
  ASSERT_TRUE(slots.ok());
  EXPECT_TRUE(client().GetDataPage("p", (*slots)[0]).ok());
  // A page page-size agreeing spec is fine, another is refused.
  indexer.set_page_size(8);
  EXPECT_ERROR(client().CreatePool("p2", indexer), kInvalidArgument, "page_size");
  // The anchor stays while it has followers.
  EXPECT_ERROR(client().DeletePool("anchor"), kFailedPrecondition, "anchor", "followed by p");
  EXPECT_TRUE(client().GetPool("anchor").ok());
  ASSERT_TRUE(client().DeletePool("p").ok());
  absl::StatusOr<v1::Pool> anchor = client().GetPool("anchor");
  ASSERT_TRUE(anchor.ok());
  EXPECT_EQ(anchor->followers_size(), 0);
  EXPECT_TRUE(client().DeletePool("anchor").ok());
}

// ---------------------------------------------------------------------------
// 5. Layer sharding: the pool holds device layers [2, 5), the attachment
// [1, 6); only layers 2-4 move and the ticket counts all five.

TEST_F(KindsTest, ShardedPoolMovesOnlyItsLayers) {
  v1::PoolSpec spec = Mha(v1::PAGE_FIRST_DIRECT);
  spec.set_start_layer(2);
  absl::StatusOr<v1::Pool> pool = client().CreatePool("p", spec);
  ASSERT_TRUE(pool.ok()) << pool.status();
  EXPECT_EQ(pool->start_layer(), 2u);
  EXPECT_EQ(pool->end_layer(), 5u);
  const uint64_t ps = 4;
  absl::StatusOr<std::unique_ptr<ShmDevicePool>> dev_or =
      ShmDevicePool::Create(*pool, 8 * ps, shm_dir(), 1, 6);
  ASSERT_TRUE(dev_or.ok()) << dev_or.status();
  ShmDevicePool& dev = **dev_or;
  ASSERT_EQ(dev.layers(), 5u);
  std::mt19937 rng(3);
  for (uint32_t k = 0; k < dev.components(); ++k) {
    for (uint32_t l = 0; l < dev.layers(); ++l) {
      testing::FillRandomNonZero(dev.layer(k, l), dev.rows(k) * dev.row_bytes(k), rng);
    }
  }
  absl::StatusOr<v1::Attachment> att = client().AttachDevice(dev.MakeAttachRequest("p"));
  ASSERT_TRUE(att.ok()) << att.status();
  EXPECT_EQ(att->start_layer(), 1u);
  EXPECT_EQ(att->end_layer(), 6u);
  absl::StatusOr<std::vector<int64_t>> host = client().Alloc("p", 2 * ps);
  ASSERT_TRUE(host.ok());
  const std::vector<int64_t> src = testing::PageSlots({3, 0}, ps);
  const std::vector<int64_t> dst = testing::PageSlots({6, 4}, ps);
  EXPECT_EQ(Wait(client().Backup(att->id(), *host, src)), 5u);
  const std::vector<Part> parts = ExpectedParts(spec, 64, ps);
  const std::vector<std::unique_ptr<testing::MappedFile>> files = MapRegions(*pool);
  for (size_t k = 0; k < parts.size(); ++k) {
    for (uint64_t hl = 0; hl < 3; ++hl) {                     // host layer hl = device layer hl + 2
      const uint32_t dl = static_cast<uint32_t>(hl + 2 - 1);  // attached layer index
      for (size_t i = 0; i < host->size(); ++i) {
        ASSERT_EQ(std::memcmp(files[0]->data() + parts[k].At((*host)[i], hl),
                              dev.row(static_cast<uint32_t>(k), dl, src[i]), parts[k].row_bytes()),
                  0)
            << parts[k].name << " host layer " << hl;
      }
    }
  }
  // Load into rows that are zero: layers 1 and 5 stay zero.
  for (uint32_t k = 0; k < dev.components(); ++k) {
    for (uint32_t l = 0; l < dev.layers(); ++l) {
      for (int64_t r : dst) std::memset(dev.row(k, l, r), 0, dev.row_bytes(k));
    }
  }
  EXPECT_EQ(Wait(client().Load(att->id(), *host, dst)), 5u);
  const std::string zero(dev.row_bytes(0), '\0');
  for (uint32_t k = 0; k < dev.components(); ++k) {
    for (uint32_t l = 0; l < dev.layers(); ++l) {
      const bool held = l + 1 >= 2 && l + 1 < 5;
      for (size_t i = 0; i < dst.size(); ++i) {
        const uint8_t* want =
            held ? dev.row(k, l, src[i]) : reinterpret_cast<const uint8_t*>(zero.data());
        EXPECT_EQ(std::memcmp(dev.row(k, l, dst[i]), want, dev.row_bytes(k)), 0)
            << "component " << k << " device layer " << l + 1 << (held ? " (held)" : " (not held)");
      }
    }
  }
  EXPECT_TRUE(client().DetachDevice(att->id()).ok());
}

// ---------------------------------------------------------------------------
// 6. Replicated pools: MLA shared by two TP ranks.

TEST_F(KindsTest, MlaServesTwoTpRanksFromOneCopy) {
  absl::StatusOr<v1::Pool> pool = client().CreatePool("p", Mla(v1::PAGE_FIRST));
  ASSERT_TRUE(pool.ok()) << pool.status();
  const uint64_t ps = 4;
  absl::StatusOr<std::unique_ptr<ShmDevicePool>> d0 = ShmDevicePool::Create(*pool, 32, shm_dir());
  absl::StatusOr<std::unique_ptr<ShmDevicePool>> d1 = ShmDevicePool::Create(*pool, 32, shm_dir());
  ASSERT_TRUE(d0.ok() && d1.ok());
  std::mt19937 rng(5);
  for (uint32_t l = 0; l < (*d0)->layers(); ++l) {
    testing::FillRandomNonZero((*d0)->layer(0, l), 32 * (*d0)->row_bytes(0), rng);
    testing::FillRandomNonZero((*d1)->layer(0, l), 32 * (*d1)->row_bytes(0), rng);
  }
  AttachOptions rank0;
  rank0.tp_rank = 0;
  AttachOptions rank1;
  rank1.tp_rank = 1;
  rank1.load_only = true;
  absl::StatusOr<v1::Attachment> a0 = client().AttachDevice((*d0)->MakeAttachRequest("p", rank0));
  ASSERT_TRUE(a0.ok()) << a0.status();
  absl::StatusOr<v1::Attachment> a1 = client().AttachDevice((*d1)->MakeAttachRequest("p", rank1));
  ASSERT_TRUE(a1.ok()) << a1.status();
  EXPECT_TRUE(a1->load_only());
  absl::StatusOr<v1::Pool> now = client().GetPool("p");
  ASSERT_TRUE(now.ok());
  EXPECT_EQ(now->replica_ranks(), 2u);
  EXPECT_EQ(now->bytes_saved(), now->bytes());

  absl::StatusOr<std::vector<int64_t>> host = client().Alloc("p", 2 * ps);
  ASSERT_TRUE(host.ok());
  const std::vector<int64_t> rows = testing::PageSlots({5, 2}, ps);
  EXPECT_ERROR(client().Backup(a1->id(), *host, rows), kFailedPrecondition, "load");
  Wait(client().Backup(a0->id(), *host, rows));
  Wait(client().Load(a1->id(), *host, rows));
  for (uint32_t l = 0; l < (*d0)->layers(); ++l) {
    for (int64_t r : rows) {
      ASSERT_EQ(std::memcmp((*d1)->row(0, l, r), (*d0)->row(0, l, r), (*d0)->row_bytes(0)), 0)
          << "layer " << l << " row " << r;
    }
  }
  EXPECT_TRUE(client().DetachDevice(a1->id()).ok());
  now = client().GetPool("p");
  ASSERT_TRUE(now.ok());
  EXPECT_EQ(now->replica_ranks(), 1u);
  EXPECT_EQ(now->bytes_saved(), 0u);
  EXPECT_TRUE(client().DetachDevice(a0->id()).ok());
}

TEST_F(KindsTest, MhaRefusesASecondTpRank) {
  absl::StatusOr<v1::Pool> pool = client().CreatePool("p", Mha(v1::PAGE_FIRST));
  ASSERT_TRUE(pool.ok()) << pool.status();
  absl::StatusOr<std::unique_ptr<ShmDevicePool>> d0 = ShmDevicePool::Create(*pool, 16, shm_dir());
  absl::StatusOr<std::unique_ptr<ShmDevicePool>> d1 = ShmDevicePool::Create(*pool, 16, shm_dir());
  ASSERT_TRUE(d0.ok() && d1.ok());
  AttachOptions rank0;
  rank0.tp_rank = 0;
  AttachOptions rank1;
  rank1.tp_rank = 1;
  absl::StatusOr<v1::Attachment> a0 = client().AttachDevice((*d0)->MakeAttachRequest("p", rank0));
  ASSERT_TRUE(a0.ok()) << a0.status();
  EXPECT_ERROR(client().AttachDevice((*d1)->MakeAttachRequest("p", rank1)), kFailedPrecondition,
               "MHA");
  absl::StatusOr<v1::Pool> now = client().GetPool("p");
  ASSERT_TRUE(now.ok());
  EXPECT_EQ(now->attachments(), 1u);
  EXPECT_EQ(now->bytes_saved(), 0u);
  EXPECT_TRUE(client().DetachDevice(a0->id()).ok());
}

// ---------------------------------------------------------------------------
// 7. Split heads, stride alignment and buffer infos for MHA.

TEST_F(KindsTest, SplitHeadsStrideAndBufferInfosFollowTheSeedFormulas) {
  const uint64_t L = 3, S = 64, ps = 4, H = 2, Db = 16, P = S / ps;
  const uint64_t v_off = L * S * H * Db;
  ASSERT_TRUE(client().CreatePool("ph", Mha(v1::PAGE_HEAD)).ok());
  // Per page, per head group, per component: the group's rows of all layers.
  absl::StatusOr<v1::PageBufferMeta> split =
      client().GetSplitHeadsPageBufferMeta("ph", testing::PageSlots({3, 1}, ps), 2);
  ASSERT_TRUE(split.ok()) << split.status();
  ASSERT_EQ(split->segments_size(), 2 * 2 * 2);
  int i = 0;
  for (uint64_t p : {3, 1}) {
    for (uint64_t g = 0; g < 2; ++g) {
      for (uint64_t kv = 0; kv < 2; ++kv, ++i) {
        EXPECT_EQ(split->segments(i).offset(), kv * v_off + (p * H + g) * ps * L * Db) << i;
        EXPECT_EQ(split->segments(i).length(), ps * L * Db) << i;
      }
    }
  }
  EXPECT_ERROR(client().GetSplitHeadsPageBufferMeta("ph", testing::PageSlots({0}, ps), 3),
               kInvalidArgument, "3");
  EXPECT_ERROR(client().GetSplitHeadsPageBufferMeta("ph", testing::PageSlots({0}, ps), 0),
               kInvalidArgument, "split_factor");

  ASSERT_TRUE(client().CreatePool("pf", Mha(v1::PAGE_FIRST)).ok());
  EXPECT_ERROR(client().GetSplitHeadsPageBufferMeta("pf", testing::PageSlots({0}, ps), 2),
               kFailedPrecondition, "PAGE_FIRST");
  absl::StatusOr<v1::StrideAlignment> stride = client().IsStridePageAligned("pf", 256);
  ASSERT_TRUE(stride.ok()) << stride.status();
  ASSERT_EQ(stride->page_strides_size(), 2);
  EXPECT_EQ(stride->page_strides(0), ps * L * H * Db);  // 384: not a multiple of 256
  EXPECT_FALSE(stride->aligned());
  stride = client().IsStridePageAligned("pf", 128);
  ASSERT_TRUE(stride.ok());
  EXPECT_TRUE(stride->aligned());  // V_OFF = 6144 and 384 are multiples of 128

  ASSERT_TRUE(client().CreatePool("lf", Mha(v1::LAYER_FIRST)).ok());
  stride = client().IsStridePageAligned("lf", 0);
  ASSERT_TRUE(stride.ok());
  EXPECT_FALSE(stride->aligned());
  absl::StatusOr<v1::ContiguousBufferInfos> infos = client().GetContiguousBufferInfos("lf");
  ASSERT_TRUE(infos.ok()) << infos.status();
  ASSERT_EQ(infos->infos_size(), static_cast<int>(2 * L));
  std::map<std::pair<std::string, uint32_t>, v1::ContiguousBufferInfo> by_key;
  for (const v1::ContiguousBufferInfo& info : infos->infos()) {
    by_key[{info.component(), info.layer()}] = info;
  }
  for (uint64_t kv = 0; kv < 2; ++kv) {
    for (uint32_t l = 0; l < L; ++l) {
      const auto it = by_key.find({kv == 0 ? "k" : "v", l});
      ASSERT_NE(it, by_key.end()) << kv << " " << l;
      EXPECT_EQ(it->second.offset(), kv * v_off + l * S * H * Db);
      EXPECT_EQ(it->second.length(), S * H * Db);
      EXPECT_EQ(it->second.item_bytes(), ps * H * Db);
    }
  }
  (void)P;
  EXPECT_ERROR(client().GetContiguousBufferInfos("pf"), kFailedPrecondition, "PAGE_FIRST");
}

// PAGE_UNIFIED (sglang's page_unified, (P, G, L, 2, ps, H / G, D)): page
// metadata per page and head group, each one range of the group's K and V;
// no split-heads call (the metadata is split already); strides of a page.
TEST_F(KindsTest, UnifiedMetaIsOneRangePerPageAndHeadGroup) {
  const uint64_t L = 3, ps = 4, H = 2, G = 2, Db = 16;
  v1::PoolSpec spec = Mha(v1::PAGE_UNIFIED);
  spec.set_head_groups(G);
  ASSERT_TRUE(client().CreatePool("pu", spec).ok());
  absl::StatusOr<v1::PageBufferMeta> meta =
      client().GetPageBufferMeta("pu", testing::PageSlots({3, 1}, ps));
  ASSERT_TRUE(meta.ok()) << meta.status();
  ASSERT_EQ(meta->segments_size(), 2 * 2);
  const uint64_t group = L * 2 * ps * (H / G) * Db;  // (L, 2, ps, H / G, D)
  int i = 0;
  for (uint64_t p : {3, 1}) {
    for (uint64_t g = 0; g < G; ++g, ++i) {
      EXPECT_EQ(meta->segments(i).offset(), (p * G + g) * group) << i;
      EXPECT_EQ(meta->segments(i).length(), group) << i;
    }
  }
  EXPECT_ERROR(client().GetSplitHeadsPageBufferMeta("pu", testing::PageSlots({0}, ps), 2),
               kFailedPrecondition, "PAGE_UNIFIED", "GetPageBufferMeta");
  absl::StatusOr<v1::StrideAlignment> stride = client().IsStridePageAligned("pu", 128);
  ASSERT_TRUE(stride.ok()) << stride.status();
  ASSERT_EQ(stride->page_strides_size(), 2);
  EXPECT_EQ(stride->page_strides(0), G * group);
  EXPECT_EQ(stride->page_strides(1), G * group);
  EXPECT_TRUE(stride->aligned());  // groups of 384 bytes: multiples of 128
  stride = client().IsStridePageAligned("pu", 256);
  ASSERT_TRUE(stride.ok());
  EXPECT_FALSE(stride->aligned());
  EXPECT_ERROR(client().GetContiguousBufferInfos("pu"), kFailedPrecondition, "PAGE_UNIFIED");
  absl::StatusOr<v1::PageShape> shape = client().GetPageShape("pu");
  ASSERT_TRUE(shape.ok()) << shape.status();
  ASSERT_EQ(shape->parts_size(), 1);
  EXPECT_EQ(shape->parts(0).component(), "kv");
  EXPECT_EQ(std::vector<uint64_t>(shape->parts(0).dims().begin(), shape->parts(0).dims().end()),
            (std::vector<uint64_t>{G, L, 2, ps, H / G, Db / 2}));
  EXPECT_EQ(shape->bytes(), G * group);
}

// ---------------------------------------------------------------------------
// 8. The seeds' spec errors, per kind, through CreatePool.

struct SpecError {
  const char* what;
  v1::PoolSpec spec;
  std::vector<std::string> needles;
  bool needs_anchors = false;  // follows one of the pools made first
  // Refusing a follows of the wrong kind may be read as a malformed spec or
  // as the other pool forbidding it.
  bool either_code = false;
};

std::vector<SpecError> SpecErrors() {
  std::vector<SpecError> errors;
  auto with = [](v1::PoolSpec s, auto&& change) {
    change(s);
    return s;
  };
  v1::PoolSpec asym = Base(v1::MHA_ASYMMETRIC, v1::PAGE_FIRST, 4, 2, 64);
  asym.set_head_num(2);
  asym.set_head_dim(8);
  asym.set_v_head_dim(4);
  errors.push_back({"asym equal dims",
                    with(asym, [](auto& s) { s.set_v_head_dim(8); }),
                    {"MHA_ASYMMETRIC", "v_head_dim"}});
  errors.push_back({"asym no v dim",
                    with(asym, [](auto& s) { s.set_v_head_dim(0); }),
                    {"MHA_ASYMMETRIC", "v_head_dim"}});
  errors.push_back({"asym layer first",
                    with(asym, [](auto& s) { s.set_layout(v1::LAYER_FIRST); }),
                    {"MHA_ASYMMETRIC", "LAYER_FIRST"}});
  errors.push_back({"asym page head",
                    with(asym, [](auto& s) { s.set_layout(v1::PAGE_HEAD); }),
                    {"MHA_ASYMMETRIC", "PAGE_HEAD"}});
  errors.push_back({"mha asymmetric dims",
                    with(Mha(v1::PAGE_FIRST), [](auto& s) { s.set_v_head_dim(4); }),
                    {"MHA", "v_head_dim"}});
  errors.push_back({"mha follows",
                    with(Mha(v1::PAGE_FIRST), [](auto& s) { s.set_follows("mha_anchor"); }),
                    {"MHA", "follows"},
                    true});
  errors.push_back({"mla page head",
                    with(Mla(v1::PAGE_FIRST), [](auto& s) { s.set_layout(v1::PAGE_HEAD); }),
                    {"MLA", "PAGE_HEAD"}});
  errors.push_back({"mha head groups not dividing",
                    with(Mha(v1::PAGE_UNIFIED), [](auto& s) { s.set_head_groups(3); }),
                    {"MHA/PAGE_UNIFIED", "head_groups 3", "head_num 2"}});
  errors.push_back({"mha head groups without page_unified",
                    with(Mha(v1::PAGE_FIRST), [](auto& s) { s.set_head_groups(2); }),
                    {"MHA/PAGE_FIRST", "head_groups 2", "PAGE_UNIFIED"}});
  errors.push_back({"mla head groups",
                    with(Mla(v1::PAGE_UNIFIED), [](auto& s) { s.set_head_groups(2); }),
                    {"MLA/PAGE_UNIFIED", "head_groups"}});
  errors.push_back({"asym page unified",
                    with(asym, [](auto& s) { s.set_layout(v1::PAGE_UNIFIED); }),
                    {"MHA_ASYMMETRIC", "PAGE_UNIFIED"}});

  v1::PoolSpec k_only = Base(v1::K_ONLY, v1::PAGE_FIRST, 0, 2, 0);
  k_only.set_head_num(2);
  k_only.set_head_dim(8);
  errors.push_back({"k_only without follows", k_only, {"K_ONLY", "follows"}});
  errors.push_back({"k_only page head",
                    with(k_only,
                         [](auto& s) {
                           s.set_layout(v1::PAGE_HEAD);
                           s.set_follows("mha_anchor");
                         }),
                    {"K_ONLY", "PAGE_HEAD"},
                    true});
  errors.push_back({"k_only follows mla",
                    with(k_only, [](auto& s) { s.set_follows("mla_anchor"); }),
                    {"K_ONLY", "mla_anchor"},
                    true,
                    true});

  v1::PoolSpec dsa = Base(v1::DSA, v1::LAYER_FIRST, 4, 2, 64);
  dsa.set_kv_lora_rank(12);
  dsa.set_qk_rope_head_dim(4);
  dsa.set_index_head_dim(16);
  dsa.set_index_quant_block_size(8);
  errors.push_back({"dsa page first",
                    with(dsa, [](auto& s) { s.set_layout(v1::PAGE_FIRST); }),
                    {"DSA", "PAGE_FIRST"}});
  errors.push_back({"dsa block does not divide",
                    with(dsa, [](auto& s) { s.set_index_quant_block_size(5); }),
                    {"DSA", "index_head_dim"}});
  errors.push_back({"dsa no index dims",
                    with(dsa,
                         [](auto& s) {
                           s.clear_index_head_dim();
                           s.clear_index_quant_block_size();
                         }),
                    {"DSA", "index_head_dim"}});

  v1::PoolSpec indexer = Base(v1::DSA_INDEXER, v1::PAGE_FIRST, 0, 2, 0, v1::UINT8);
  indexer.set_index_head_dim(16);
  indexer.set_index_quant_block_size(8);
  errors.push_back({"indexer without follows", indexer, {"DSA_INDEXER", "follows"}});
  errors.push_back({"indexer page head",
                    with(indexer,
                         [](auto& s) {
                           s.set_layout(v1::PAGE_HEAD);
                           s.set_follows("mla_anchor");
                         }),
                    {"DSA_INDEXER", "PAGE_HEAD"},
                    true});
  errors.push_back({"indexer follows mha",
                    with(indexer, [](auto& s) { s.set_follows("mha_anchor"); }),
                    {"DSA_INDEXER", "mha_anchor"},
                    true,
                    true});
  errors.push_back({"indexer block does not divide",
                    with(indexer,
                         [](auto& s) {
                           s.set_index_quant_block_size(3);
                           s.set_follows("mla_anchor");
                         }),
                    {"DSA_INDEXER", "index_head_dim"},
                    true});

  v1::PoolSpec mamba = Base(v1::MAMBA, v1::PAGE_FIRST_DIRECT, 1, 2, 16);
  mamba.mutable_mamba()->mutable_temporal()->add_dims(4);
  mamba.mutable_mamba()->add_conv()->add_dims(4);
  errors.push_back({"mamba page first",
                    with(mamba, [](auto& s) { s.set_layout(v1::PAGE_FIRST); }),
                    {"MAMBA", "PAGE_FIRST"}});
  errors.push_back({"mamba page unified",
                    with(mamba, [](auto& s) { s.set_layout(v1::PAGE_UNIFIED); }),
                    {"MAMBA", "PAGE_UNIFIED"}});
  errors.push_back({"mamba page size",
                    with(mamba, [](auto& s) { s.set_page_size(4); }),
                    {"MAMBA", "page_size"}});
  errors.push_back({"mamba no conv",
                    with(mamba, [](auto& s) { s.mutable_mamba()->clear_conv(); }),
                    {"MAMBA", "conv"}});
  errors.push_back({"mamba eight convs",
                    with(mamba,
                         [](auto& s) {
                           for (int j = 0; j < 7; ++j) s.mutable_mamba()->add_conv()->add_dims(2);
                         }),
                    {"MAMBA", "conv"}});
  errors.push_back({"mamba no temporal",
                    with(mamba, [](auto& s) { s.mutable_mamba()->clear_temporal(); }),
                    {"MAMBA", "temporal"}});

  errors.push_back({"v4 paged no item bytes",
                    with(V4Paged(v1::PAGE_FIRST), [](auto& s) { s.clear_item_bytes(); }),
                    {"V4_PAGED", "item_bytes"}});
  errors.push_back({"v4 paged page head",
                    with(V4Paged(v1::PAGE_FIRST), [](auto& s) { s.set_layout(v1::PAGE_HEAD); }),
                    {"V4_PAGED", "PAGE_HEAD"}});
  errors.push_back({"v4 paged page unified",
                    with(V4Paged(v1::PAGE_FIRST), [](auto& s) { s.set_layout(v1::PAGE_UNIFIED); }),
                    {"V4_PAGED", "PAGE_UNIFIED"}});
  v1::PoolSpec state = Base(v1::V4_STATE, v1::PAGE_FIRST, 0, 2, 0, v1::UINT8);
  state.set_ring_size(3);
  state.set_state_slot_bytes(8);
  errors.push_back({"v4 state without follows", state, {"V4_STATE", "follows"}});
  errors.push_back({"v4 state no ring",
                    with(state,
                         [](auto& s) {
                           s.clear_ring_size();
                           s.set_follows("v4_anchor");
                         }),
                    {"V4_STATE", "ring_size"},
                    true});
  errors.push_back({"v4 state no slot bytes",
                    with(state,
                         [](auto& s) {
                           s.clear_state_slot_bytes();
                           s.set_follows("v4_anchor");
                         }),
                    {"V4_STATE", "state_slot_bytes"},
                    true});
  errors.push_back({"v4 state follows mha",
                    with(state, [](auto& s) { s.set_follows("mha_anchor"); }),
                    {"V4_STATE", "mha_anchor"},
                    true,
                    true});

  errors.push_back({"logical unaligned size",
                    with(Logical(), [](auto& s) { s.set_size_tokens(62); }),
                    {"LOGICAL", "62"}});
  errors.push_back({"logical size bytes",
                    with(Logical(),
                         [](auto& s) {
                           s.clear_size_tokens();
                           s.set_size_bytes(1 << 20);
                         }),
                    {"LOGICAL", "size_bytes"}});
  return errors;
}

TEST_F(KindsTest, SeedSpecErrorsAreRefusedNamingKindLayoutOrField) {
  ASSERT_TRUE(client().CreatePool("mha_anchor", Mha(v1::PAGE_FIRST)).ok());
  ASSERT_TRUE(client().CreatePool("mla_anchor", Mla(v1::LAYER_FIRST)).ok());
  ASSERT_TRUE(client().CreatePool("v4_anchor", V4Paged(v1::PAGE_FIRST)).ok());
  for (const SpecError& e : SpecErrors()) {
    SCOPED_TRACE(e.what);
    absl::StatusOr<v1::Pool> pool = client().CreatePool("bad", e.spec);
    if (e.either_code && pool.status().code() == absl::StatusCode::kFailedPrecondition) {
      EXPECT_ERROR(pool, kFailedPrecondition, e.needles[0], e.needles[1]);
    } else {
      EXPECT_TRUE(testing::IsError(pool.status(), absl::StatusCode::kInvalidArgument, e.needles))
          << e.what;
    }
    EXPECT_ERROR(client().GetPool("bad"), kNotFound, "bad");
  }
  // Nothing was made and the anchors have no followers.
  absl::StatusOr<std::vector<v1::Pool>> pools = client().ListPools();
  ASSERT_TRUE(pools.ok());
  EXPECT_EQ(pools->size(), 3u);
  for (const v1::Pool& p : *pools) EXPECT_EQ(p.followers_size(), 0) << p.name();
}

}  // namespace
}  // namespace kvhost
