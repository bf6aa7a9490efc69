// Host layout of every pool kind: the components Pool::Create makes
// (server/pool/pool_spec.h MakeComponents, server/pool/pool.h) checked
// against the seeds' host tensors, written out here independently as
// C-contiguous shapes (SEED_INVENTORY.md §2, issue-4 plan §2):
//   * each component's bytes, region file and offset in it;
//   * Offset(row, layer) of every row and layer = the seed tensor's offset of
//     that row's first element;
//   * GetPageBufferMeta = the seeds' get_page_buffer_meta pointer formulas,
//     typed out per kind;
//   * the flat page = the seeds' flatten() of the page slice, gathered here
//     element by element from region bytes that encode their own offset;
//   * bytes_per_page.
// PAGE_UNIFIED is not in the seeds: its tensors are sglang's page_unified
// as PRs 39606 / 39727 give them, MHA (P, G, L, 2, ps, H / G, D) with K and V
// the two planes of one tensor, MLA (P, L, ps, C), K_ONLY MHA's without the
// 2; get_page_buffer_meta per page and head group, the flat page the page's
// slice of the tensor.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/pool/pool.h"
#include "server/pool/pool_spec.h"

namespace kvhost {
namespace {

namespace fs = std::filesystem;
using Dims = std::vector<uint64_t>;

// ------------------------------------------------------------------ oracle

uint64_t Prod(const Dims& d) {
  uint64_t n = 1;
  for (uint64_t x : d) n *= x;
  return n;
}

// C-contiguous element index of `idx` in `shape`.
uint64_t CIndex(const Dims& shape, const Dims& idx) {
  uint64_t e = 0;
  for (size_t i = 0; i < shape.size(); ++i) e = e * shape[i] + idx[i];
  return e;
}

// One seed host tensor.
struct SeedTensor {
  std::string name;
  std::string suffix;    // region file suffix the tensor lives in
  uint64_t file_offset;  // byte offset in that file
  Dims shape;
  uint64_t itemsize;
  // Seed index of the first element of row `row` in layer `layer`.
  std::function<Dims(uint64_t row, uint64_t layer)> row_index;
  // Elements of the page `p` (first slot t0) in the seeds' get_data_page
  // slice, tested on the full index.
  std::function<bool(const Dims& idx, uint64_t p, uint64_t t0)> in_page;
  // Pool components the tensor holds: 1, or PAGE_UNIFIED MHA's K and V,
  // index `plane_dim` of row_index selecting the plane.
  uint64_t planes = 1;
  size_t plane_dim = 0;
};

// What the seeds allocate for `spec` with S slots.
std::vector<SeedTensor> SeedTensors(const PoolSpec& s, uint64_t S) {
  const uint64_t ps = s.page_size, L = s.layer_num, P = S / ps, b = DTypeSize(s.dtype);
  const LayoutKind lay = s.layout;
  auto token_slice = [](size_t dim, uint64_t ps) {  // slots [t0, t0 + ps) on `dim`
    return [dim, ps](const Dims& i, uint64_t, uint64_t t0) {
      return i[dim] >= t0 && i[dim] < t0 + ps;
    };
  };
  auto page_slice = [](size_t dim) {  // page p on `dim`
    return [dim](const Dims& i, uint64_t p, uint64_t) { return i[dim] == p; };
  };
  // The MHA family's one-plane tensor of `heads` x `dim` elements per row
  // (PAGE_UNIFIED: of `planes` planes).
  const uint64_t G = s.head_groups == 0 ? 1 : s.head_groups;
  auto heads_tensor = [&](std::string name, std::string suffix, uint64_t off, uint64_t H,
                          uint64_t D, uint64_t planes = 1) {
    SeedTensor t{name, suffix, off, {}, b, nullptr, nullptr};
    switch (lay) {
      case LayoutKind::kPageUnified:
        t.in_page = page_slice(0);
        if (s.kind == PoolKind::kMla) {  // sglang's MLA (page, layer, page_size, dim)
          t.shape = {P, L, ps, D};
          t.row_index = [ps](uint64_t r, uint64_t l) { return Dims{r / ps, l, r % ps, 0}; };
        } else if (planes == 2) {  // (page, head_group, layer, 2, ps, head_in_group, dim)
          t.shape = {P, G, L, 2, ps, H / G, D};
          t.row_index = [ps](uint64_t r, uint64_t l) {
            return Dims{r / ps, 0, l, 0, r % ps, 0, 0};
          };
          t.planes = 2;
          t.plane_dim = 3;
        } else {
          t.shape = {P, G, L, ps, H / G, D};
          t.row_index = [ps](uint64_t r, uint64_t l) { return Dims{r / ps, 0, l, r % ps, 0, 0}; };
        }
        break;
      case LayoutKind::kLayerFirst:
        t.shape = {L, S, H, D};
        t.row_index = [](uint64_t r, uint64_t l) { return Dims{l, r, 0, 0}; };
        t.in_page = token_slice(1, ps);
        break;
      case LayoutKind::kPageFirst:
        t.shape = {S, L, H, D};
        t.row_index = [](uint64_t r, uint64_t l) { return Dims{r, l, 0, 0}; };
        t.in_page = token_slice(0, ps);
        break;
      case LayoutKind::kPageFirstDirect:
        t.shape = {P, L, ps, H, D};
        t.row_index = [ps](uint64_t r, uint64_t l) { return Dims{r / ps, l, r % ps, 0, 0}; };
        t.in_page = page_slice(0);
        break;
      case LayoutKind::kPageHead:
        t.shape = {P, H, ps, L, D};
        t.row_index = [ps](uint64_t r, uint64_t l) { return Dims{r / ps, 0, r % ps, l, 0}; };
        t.in_page = page_slice(0);
        break;
    }
    return t;
  };
  // Page-row tensors: (L, P, R) / (P, L, R) / (P, L, 1, R) uint8.
  auto page_rows = [&](std::string name, std::string suffix, uint64_t R, bool pfd_has_one) {
    SeedTensor t{name, suffix, 0, {}, 1, nullptr, nullptr};
    if (lay == LayoutKind::kLayerFirst) {
      t.shape = {L, P, R};
      t.row_index = [](uint64_t r, uint64_t l) { return Dims{l, r, 0}; };
      t.in_page = page_slice(1);
    } else if (lay == LayoutKind::kPageFirst && !pfd_has_one) {
      t.shape = {P, L, R};
      t.row_index = [](uint64_t r, uint64_t l) { return Dims{r, l, 0}; };
      t.in_page = page_slice(0);
    } else {
      t.shape = {P, L, 1, R};
      t.row_index = [](uint64_t r, uint64_t l) { return Dims{r, l, 0, 0}; };
      t.in_page = page_slice(0);
    }
    return t;
  };
  const uint64_t C = s.kv_cache_dim ? s.kv_cache_dim : s.kv_lora_rank + s.qk_rope_head_dim;
  const uint64_t IS =
      s.index_head_dim +
      (s.index_quant_block_size ? s.index_head_dim / s.index_quant_block_size * 4 : 0);
  std::vector<SeedTensor> out;
  switch (s.kind) {
    case PoolKind::kMha:
      if (lay == LayoutKind::kPageUnified) {
        out.push_back(heads_tensor("kv", ".kv", 0, s.head_num, s.head_dim, 2));
        break;
      }
      out.push_back(heads_tensor("k", ".kv", 0, s.head_num, s.head_dim));
      out.push_back(
          heads_tensor("v", ".kv", L * S * s.head_num * s.head_dim * b, s.head_num, s.head_dim));
      break;
    case PoolKind::kKOnly:
      out.push_back(heads_tensor("k", ".kv", 0, s.head_num, s.head_dim));
      break;
    case PoolKind::kMhaAsymmetric:
      out.push_back(heads_tensor("k", ".k", 0, s.head_num, s.head_dim));
      out.push_back(heads_tensor("v", ".v", 0, s.head_num, s.v_head_dim));
      break;
    case PoolKind::kMla:
    case PoolKind::kDsa:
      out.push_back(heads_tensor("latent", ".kv", 0, 1, C));
      if (s.kind == PoolKind::kDsa) {  // tokenspeed (L, S, IKR) uint8
        const uint64_t ikr = s.index_row_bytes ? s.index_row_bytes : IS;
        SeedTensor t{"index_k", ".index_k", 0, {L, S, ikr}, 1, nullptr, token_slice(1, ps)};
        t.row_index = [ps](uint64_t r, uint64_t l) { return Dims{l, r * ps, 0}; };
        out.push_back(t);
      }
      break;
    case PoolKind::kDsaIndexer:  // (L, PN, G) / (PN, L, 1, G), PN = P (decided)
      out.push_back(page_rows("index_k", ".kv", IS * ps, true));
      break;
    case PoolKind::kMamba: {  // (S, Lm, 1, *shape), ps = 1
      auto state = [&](std::string name, const std::vector<uint32_t>& dims, uint64_t item) {
        SeedTensor t{name, "." + name, 0, {S, L, 1}, item, nullptr, token_slice(0, 1)};
        for (uint32_t d : dims) t.shape.push_back(d);
        const size_t rank = t.shape.size();
        t.row_index = [rank](uint64_t r, uint64_t l) {
          Dims i(rank, 0);
          i[0] = r, i[1] = l;
          return i;
        };
        return t;
      };
      out.push_back(state("temporal", s.mamba.temporal, DTypeSize(s.mamba.temporal_dtype)));
      for (size_t j = 0; j < s.mamba.conv.size(); ++j) {
        out.push_back(state(absl::StrCat("conv", j), s.mamba.conv[j], b));
      }
      break;
    }
    case PoolKind::kV4Paged:  // lf: L tensors (P, R) = one file (L, P, R)
      out.push_back(page_rows("rows", ".kv", s.item_bytes, false));
      break;
    case PoolKind::kV4State:
      out.push_back(page_rows("rows", ".kv", uint64_t{s.ring_size} * s.state_slot_bytes, false));
      break;
    case PoolKind::kLogical:
      break;
  }
  return out;
}

// Seeds' get_page_buffer_meta of page `p` (first slot t0), typed out per kind
// as (file suffix, offset, length), in their order. Empty for LOGICAL.
struct Ptr {
  std::string suffix;
  uint64_t offset, length;
};
std::vector<Ptr> SeedMeta(const PoolSpec& s, uint64_t S, uint64_t t0) {
  const uint64_t ps = s.page_size, L = s.layer_num, b = DTypeSize(s.dtype), p = t0 / ps;
  const uint64_t H = s.head_num, D = s.head_dim, Dv = s.v_head_dim;
  const uint64_t C = s.kv_cache_dim ? s.kv_cache_dim : s.kv_lora_rank + s.qk_rope_head_dim;
  const bool lf = s.layout == LayoutKind::kLayerFirst;
  std::vector<Ptr> out;
  if (s.layout == LayoutKind::kPageUnified &&
      (s.kind == PoolKind::kMha || s.kind == PoolKind::kKOnly)) {
    // Per head group g: its (L, [2,] ps, H / G, D) block of the page.
    const uint64_t G = s.head_groups == 0 ? 1 : s.head_groups;
    const uint64_t planes = s.kind == PoolKind::kMha ? 2 : 1;
    const uint64_t group = L * planes * ps * (H / G) * D * b;
    for (uint64_t g = 0; g < G; ++g) out.push_back({".kv", (p * G + g) * group, group});
    return out;
  }
  switch (s.kind) {
    case PoolKind::kMha: {
      const uint64_t v_off = L * S * H * D * b;
      if (lf) {
        for (uint64_t l = 0; l < L; ++l) {
          const uint64_t k = t0 * H * D * b + l * S * H * D * b;
          out.push_back({".kv", k, b * ps * H * D});
          out.push_back({".kv", k + v_off, b * ps * H * D});
        }
      } else {
        const uint64_t k = t0 * L * H * D * b;
        out.push_back({".kv", k, L * b * ps * H * D});
        out.push_back({".kv", k + v_off, L * b * ps * H * D});
      }
      break;
    }
    case PoolKind::kKOnly:
      out.push_back({".kv", t0 * L * H * D * b, L * b * ps * H * D});
      break;
    case PoolKind::kMhaAsymmetric: {
      const bool pfd = s.layout == LayoutKind::kPageFirstDirect;
      const uint64_t row = pfd ? t0 / ps : t0;
      const uint64_t ks = pfd ? L * ps * H * D : L * H * D, vs = pfd ? L * ps * H * Dv : L * H * Dv;
      out.push_back({".k", row * ks * b, L * b * ps * H * D});
      out.push_back({".v", row * vs * b, L * b * ps * H * Dv});
      break;
    }
    case PoolKind::kMla:
      if (lf) {
        for (uint64_t l = 0; l < L; ++l)
          out.push_back({".kv", t0 * C * b + l * S * C * b, ps * C * b});
      } else {
        out.push_back({".kv", t0 * L * C * b, L * ps * C * b});
      }
      break;
    case PoolKind::kDsa: {  // MLA lf, plus index_k after the latent (decided)
      const uint64_t ikr = s.index_row_bytes
                               ? s.index_row_bytes
                               : s.index_head_dim + s.index_head_dim / s.index_quant_block_size * 4;
      for (uint64_t l = 0; l < L; ++l) {
        out.push_back({".kv", t0 * C * b + l * S * C * b, ps * C * b});
        out.push_back({".index_k", (l * S + t0) * ikr, ps * ikr});
      }
      break;
    }
    case PoolKind::kDsaIndexer: {
      const uint64_t G = (s.index_head_dim + s.index_head_dim / s.index_quant_block_size * 4) * ps;
      out.push_back({".kv", p * L * G, L * G});
      break;
    }
    case PoolKind::kMamba: {
      const uint64_t et = Prod(Dims(s.mamba.temporal.begin(), s.mamba.temporal.end()));
      const uint64_t bt = DTypeSize(s.mamba.temporal_dtype);
      out.push_back({".temporal", t0 * L * et * bt, ps * L * bt * et});
      for (size_t j = 0; j < s.mamba.conv.size(); ++j) {
        const uint64_t ec = Prod(Dims(s.mamba.conv[j].begin(), s.mamba.conv[j].end()));
        out.push_back({absl::StrCat(".conv", j), t0 * L * ec * b, ps * L * b * ec});
      }
      break;
    }
    case PoolKind::kV4Paged:
    case PoolKind::kV4State: {
      const uint64_t R =
          s.kind == PoolKind::kV4Paged ? s.item_bytes : uint64_t{s.ring_size} * s.state_slot_bytes;
      const uint64_t P = S / ps;
      if (lf) {
        for (uint64_t l = 0; l < L; ++l) out.push_back({".kv", l * P * R + p * R, R});
      } else {
        out.push_back({".kv", p * L * R, L * R});
      }
      break;
    }
    case PoolKind::kLogical:
      break;
  }
  return out;
}

// ------------------------------------------------------------------ cases

struct Case {
  std::string name;
  PoolSpec spec;
  uint64_t tokens;
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

std::vector<Case> AllCases() {
  std::vector<Case> cases;
  auto add = [&](std::string name, PoolSpec s, uint64_t pages) {
    for (LayoutKind l :
         {LayoutKind::kLayerFirst, LayoutKind::kPageFirst, LayoutKind::kPageFirstDirect,
          LayoutKind::kPageHead, LayoutKind::kPageUnified}) {
      s.layout = l;
      if (!ValidateSpec(s).ok()) continue;  // not a layout of the kind
      cases.push_back({absl::StrCat(name, "_", LayoutName(l)), s, pages * s.page_size});
      if (l == LayoutKind::kPageUnified && s.head_num > 1) {  // a head group per head
        PoolSpec g = s;
        g.head_groups = s.head_num;
        if (ValidateSpec(g).ok()) {
          cases.push_back(
              {absl::StrCat(name, "_", LayoutName(l), "_G", s.head_num), g, pages * s.page_size});
        }
      }
    }
  };
  auto base = [](PoolKind k, DType d, uint32_t ps, uint32_t L) {
    PoolSpec s;
    s.kind = k, s.dtype = d, s.page_size = ps, s.layer_num = L;
    return s;
  };
  for (int shape = 0; shape < 2; ++shape) {
    // Shape 0: ps 1, one layer, odd rows. Shape 1: ps 4, 3 layers.
    const uint32_t ps = shape == 0 ? 1 : 4, L = shape == 0 ? 1 : 3, pages = shape == 0 ? 5 : 3;
    const std::string tag = shape == 0 ? "ps1L1" : "ps4L3";
    PoolSpec s = base(PoolKind::kMha, DType::kBf16, ps, L);
    s.head_num = shape == 0 ? 1 : 3, s.head_dim = shape == 0 ? 3 : 5;
    add("MHA_" + tag, s, pages);
    s.kind = PoolKind::kKOnly, s.follows = "anchor";
    add("K_ONLY_" + tag, s, pages);
    s.follows.clear();
    s.kind = PoolKind::kMhaAsymmetric, s.v_head_dim = shape == 0 ? 7 : 2;
    add("MHA_ASYMMETRIC_" + tag, s, pages);
    s = base(PoolKind::kMla, shape == 0 ? DType::kFp8E4m3 : DType::kFp16, ps, L);
    s.kv_lora_rank = 5, s.qk_rope_head_dim = shape == 0 ? 2 : 3;
    add("MLA_" + tag, s, pages);
    s.kv_cache_dim = 9;
    add("MLA_override_" + tag, s, pages);
    s = base(PoolKind::kDsa, DType::kBf16, ps, L);
    s.kv_lora_rank = 3, s.qk_rope_head_dim = 2;
    if (shape == 0) {
      s.index_row_bytes = 13;
    } else {
      s.index_head_dim = 8, s.index_quant_block_size = 4;  // IKR 8 + 2*4 = 16
    }
    add("DSA_" + tag, s, pages);
    s = base(PoolKind::kDsaIndexer, DType::kUint8, ps, L);
    s.index_head_dim = shape == 0 ? 6 : 16, s.index_quant_block_size = shape == 0 ? 3 : 8;
    s.follows = "anchor";
    add("DSA_INDEXER_" + tag, s, pages);
    s = base(PoolKind::kMamba, DType::kBf16, 1, L);
    s.mamba.temporal = shape == 0 ? std::vector<uint32_t>{3} : std::vector<uint32_t>{2, 3};
    s.mamba.temporal_dtype = DType::kFp32;  // different from the conv dtype
    s.mamba.conv = shape == 0 ? std::vector<std::vector<uint32_t>>{{5}}
                              : std::vector<std::vector<uint32_t>>{{2, 3}, {7}};
    add("MAMBA_" + tag, s, pages * ps);
    s = base(PoolKind::kV4Paged, DType::kUint8, ps, L);
    s.item_bytes = shape == 0 ? 11 : 24;
    add("V4_PAGED_" + tag, s, pages);
    s = base(PoolKind::kV4State, DType::kUint8, ps, L);
    s.ring_size = 3, s.state_slot_bytes = shape == 0 ? 5 : 8, s.follows = "anchor";
    add("V4_STATE_" + tag, s, pages);
    s = base(PoolKind::kLogical, DType::kUint8, ps, 0);
    add("LOGICAL_" + tag, s, pages);
  }
  return cases;
}

class ShmDir {
 public:
  ShmDir() {
    char tmpl[] = "/dev/shm/kvhost-layout-test-XXXXXX";
    if (::mkdtemp(tmpl) != nullptr) path_ = tmpl;
  }
  ~ShmDir() {
    std::error_code ec;
    if (!path_.empty()) fs::remove_all(path_, ec);
  }
  std::string prefix() const { return path_ + "/kvhost.1."; }

 private:
  std::string path_;
};

// Byte at `offset` of region r after Fill: encodes both.
uint8_t Code(uint32_t r, uint64_t offset) {
  return static_cast<uint8_t>((offset * 131 + offset / 256 * 7 + r * 53 + 1) & 0xff);
}

class HostLayoutTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    const Case& c = GetParam();
    absl::StatusOr<std::shared_ptr<Pool>> p = Pool::Create("p", c.spec, c.tokens, dir_.prefix());
    ASSERT_TRUE(p.ok()) << p.status();
    pool_ = *p;
    seeds_ = SeedTensors(c.spec, c.tokens);
    for (const std::string& path : pool_->region_paths()) {
      suffixes_.push_back(path.substr(dir_.prefix().size() + 1));  // "p" + suffix
    }
  }
  uint32_t RegionOf(const std::string& suffix) const {
    for (uint32_t r = 0; r < suffixes_.size(); ++r) {
      if (suffixes_[r] == suffix) return r;
    }
    ADD_FAILURE() << "no region " << suffix;
    return 0;
  }
  ShmDir dir_;
  std::shared_ptr<Pool> pool_;
  std::vector<SeedTensor> seeds_;
  std::vector<std::string> suffixes_;
};

TEST_P(HostLayoutTest, ComponentsAreTheSeedTensors) {
  const Case& c = GetParam();
  const std::vector<Component>& comps = pool_->components();
  uint64_t total = 0;
  size_t i = 0;  // component: tensor after tensor, plane after plane
  for (const SeedTensor& t : seeds_) {
    total += Prod(t.shape) * t.itemsize;
    for (uint64_t q = 0; q < t.planes; ++q, ++i) {
      ASSERT_LT(i, comps.size());
      // Row r of layer l of the component's plane q: its seed index.
      auto index = [&](uint64_t r, uint64_t l) {
        Dims idx = t.row_index(r, l);
        if (t.planes > 1) idx[t.plane_dim] = q;
        return idx;
      };
      SCOPED_TRACE(absl::StrCat(t.name, " plane ", q));
      EXPECT_EQ(comps[i].name, t.planes > 1 ? (q == 0 ? "k" : "v") : t.name);
      EXPECT_EQ(comps[i].bytes(), Prod(t.shape) / t.planes * t.itemsize);
      EXPECT_EQ(comps[i].region, RegionOf(t.suffix));
      EXPECT_EQ(comps[i].region_offset, t.file_offset + CIndex(t.shape, index(0, 0)) * t.itemsize);
      // Every row of every layer starts where the seed tensor's row does.
      const uint64_t rows = comps[i].layout.tokens;
      const uint64_t row_tokens = comps[i].row_tokens;
      EXPECT_EQ(rows * row_tokens, c.tokens);
      for (uint64_t r = 0; r < rows; ++r) {
        for (uint64_t l = 0; l < c.spec.layer_num; ++l) {
          ASSERT_EQ(comps[i].region_offset + comps[i].layout.Offset(0, r, l, 0),
                    t.file_offset + CIndex(t.shape, index(r, l)) * t.itemsize)
              << "row " << r << " layer " << l;
        }
      }
    }
  }
  EXPECT_EQ(i, comps.size());
  EXPECT_EQ(pool_->bytes(), total);
  std::vector<std::string> suffixes;
  for (const SeedTensor& t : seeds_) {
    if (suffixes.empty() || suffixes.back() != t.suffix) suffixes.push_back(t.suffix);
  }
  EXPECT_EQ(suffixes_, suffixes);
}

TEST_P(HostLayoutTest, PageBufferMetaIsTheSeedsPointers) {
  const Case& c = GetParam();
  const uint64_t ps = c.spec.page_size;
  const bool refused = c.spec.layout == LayoutKind::kLayerFirst &&
                       (c.spec.kind == PoolKind::kKOnly || c.spec.kind == PoolKind::kDsaIndexer);
  // Page 1 and the last page, in that order.
  std::vector<int64_t> slots;
  std::vector<uint64_t> firsts = {ps, c.tokens - ps};
  for (uint64_t t0 : firsts) {
    for (uint64_t o = 0; o < ps; ++o) slots.push_back(static_cast<int64_t>(t0 + o));
  }
  absl::StatusOr<std::vector<RegionRange>> meta = pool_->PageBufferMeta(slots);
  if (refused) {
    ASSERT_FALSE(meta.ok());
    EXPECT_EQ(meta.status().code(), absl::StatusCode::kFailedPrecondition) << meta.status();
    return;
  }
  ASSERT_TRUE(meta.ok()) << meta.status();
  std::vector<Ptr> want;
  for (uint64_t t0 : firsts) {
    for (const Ptr& p : SeedMeta(c.spec, c.tokens, t0)) want.push_back(p);
  }
  ASSERT_EQ(meta->size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ((*meta)[i].region, RegionOf(want[i].suffix)) << i;
    EXPECT_EQ((*meta)[i].offset, want[i].offset) << i;
    EXPECT_EQ((*meta)[i].length, want[i].length) << i;
  }
}

TEST_P(HostLayoutTest, FlatPageIsTheSeedsFlattenedSlice) {
  const Case& c = GetParam();
  const uint64_t ps = c.spec.page_size;
  for (size_t r = 0; r < pool_->region_count(); ++r) {
    for (uint64_t x = 0; x < pool_->region_bytes(r); ++x) {
      pool_->region_base(r)[x] = Code(static_cast<uint32_t>(r), x);
    }
  }
  ASSERT_TRUE(pool_->AllocPages(c.tokens).ok());
  for (uint64_t p : {uint64_t{0}, c.tokens / ps - 1}) {
    const uint64_t t0 = p * ps;
    // flatten(slice) per tensor, in the tensors' order: every element of the
    // tensor in C order that lies in the page.
    std::vector<uint8_t> want;
    for (const SeedTensor& t : seeds_) {
      const uint32_t r = RegionOf(t.suffix);
      Dims idx(t.shape.size(), 0);
      for (uint64_t e = 0; e < Prod(t.shape); ++e) {
        uint64_t rest = e;
        for (size_t d = t.shape.size(); d-- > 0;) idx[d] = rest % t.shape[d], rest /= t.shape[d];
        if (!t.in_page(idx, p, t0)) continue;
        for (uint64_t k = 0; k < t.itemsize; ++k) {
          want.push_back(Code(r, t.file_offset + e * t.itemsize + k));
        }
      }
    }
    EXPECT_EQ(pool_->flat_page_bytes(), want.size());
    EXPECT_EQ(pool_->bytes_per_page(), want.size());
    EXPECT_EQ(BytesPerPage(c.spec), want.size());
    std::vector<uint8_t> got(pool_->flat_page_bytes(), 0);
    absl::Status s = pool_->ReadPage(static_cast<int64_t>(t0), absl::MakeSpan(got));
    if (c.spec.kind == PoolKind::kMhaAsymmetric) {  // the seeds raise NotImplementedError
      EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
      continue;
    }
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(got, want) << "page " << p;
    // Writing it back with every byte changed changes exactly the slice.
    for (uint8_t& x : got) x = static_cast<uint8_t>(x ^ 0x5a);
    ASSERT_TRUE(pool_->WritePage(static_cast<int64_t>(t0), got).ok());
    std::vector<uint8_t> again(got.size());
    ASSERT_TRUE(pool_->ReadPage(static_cast<int64_t>(t0), absl::MakeSpan(again)).ok());
    EXPECT_EQ(again, got);
    uint64_t changed = 0;
    for (size_t r = 0; r < pool_->region_count(); ++r) {
      for (uint64_t x = 0; x < pool_->region_bytes(r); ++x) {
        changed += pool_->region_base(r)[x] != Code(static_cast<uint32_t>(r), x);
      }
    }
    EXPECT_EQ(changed, want.size());
    ASSERT_TRUE(pool_->WritePage(static_cast<int64_t>(t0), want).ok());
  }
}

INSTANTIATE_TEST_SUITE_P(EveryKind, HostLayoutTest, ::testing::ValuesIn(AllCases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return info.param.name;
                         });

TEST(HostLayoutCasesTest, CoverEveryKindAndLayout) {
  // Allowed layouts per kind, from the seeds (plan §2) and PAGE_UNIFIED's
  // MHA, MLA and K-only: 5 MHA, 4 MLA (x2 variants), 2 asymmetric, 4 K-only,
  // 1 DSA, 3 indexer, 1 Mamba, 3+3 V4, 5 logical; each with 2 shapes; and
  // PAGE_UNIFIED MHA and K-only with a head group per head (3 heads, shape 1).
  EXPECT_EQ(AllCases().size(), 2u * (5 + 4 + 4 + 2 + 4 + 1 + 3 + 1 + 3 + 3 + 5) + 2);
}

}  // namespace
}  // namespace kvhost
