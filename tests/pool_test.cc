// Tests of the pool domain: PoolSpec validation and sizing
// (server/pool/pool_spec.h), Pool (server/pool/pool.h) and PoolRegistry
// (server/pool/registry.h), with host memory figures faked through
// RegistryOptions::read_memory and region files in a private directory under
// /dev/shm.
//
// Expected values are computed here from the formulas of SEED_INVENTORY.md §2
// and §4, not from the code under test.
#include "server/pool/pool.h"

#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

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
#include "server/pool/host_memory.h"
#include "server/pool/pool_group.h"
#include "server/pool/pool_spec.h"
#include "server/pool/registry.h"
#include "server/pool/shm_region.h"

namespace kvhost {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
namespace fs = std::filesystem;

std::string Msg(const absl::Status& s) { return std::string(s.message()); }

PoolSpec MhaSpec() {
  PoolSpec s;
  s.kind = PoolKind::kMha;
  s.layout = LayoutKind::kLayerFirst;
  s.dtype = DType::kBf16;
  s.page_size = 16;
  s.layer_num = 4;
  s.head_num = 8;
  s.head_dim = 128;
  s.size_tokens = 1024;
  return s;
}

PoolSpec MlaSpec() {
  PoolSpec s;
  s.kind = PoolKind::kMla;
  s.layout = LayoutKind::kLayerFirst;
  s.dtype = DType::kBf16;
  s.page_size = 64;
  s.layer_num = 61;
  s.kv_lora_rank = 512;
  s.qk_rope_head_dim = 64;
  s.size_tokens = 1024;
  return s;
}

// A private directory under /dev/shm, removed with everything in it.
class ShmDir {
 public:
  ShmDir() {
    char tmpl[] = "/dev/shm/kvhost-pool-test-XXXXXX";
    if (::mkdtemp(tmpl) != nullptr) path_ = tmpl;
  }
  ~ShmDir() {
    std::error_code ec;
    if (!path_.empty()) fs::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }
  std::vector<std::string> Files() const {
    std::vector<std::string> out;
    for (const auto& e : fs::directory_iterator(path_)) out.push_back(e.path().filename());
    return out;
  }

 private:
  std::string path_;
};

// ============================================================ ValidateSpec

struct BadSpec {
  const char* name;
  PoolSpec spec;
  const char* field;  // the message must name it
};

void PrintTo(const BadSpec& c, std::ostream* os) { *os << c.name; }

BadSpec Mutate(const char* name, PoolSpec spec, const char* field, void (*f)(PoolSpec&)) {
  f(spec);
  return {name, spec, field};
}

class ValidateSpecTest : public ::testing::TestWithParam<BadSpec> {};

TEST_P(ValidateSpecTest, NamesTheField) {
  const BadSpec& c = GetParam();
  absl::Status s = ValidateSpec(c.spec);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Msg(s), HasSubstr(c.field));
}

INSTANTIATE_TEST_SUITE_P(
    Fields, ValidateSpecTest,
    ::testing::Values(
        Mutate("Kind", MhaSpec(), "spec.kind",
               [](PoolSpec& s) { s.kind = static_cast<PoolKind>(0); }),
        Mutate("Kind11", MhaSpec(), "spec.kind",
               [](PoolSpec& s) { s.kind = static_cast<PoolKind>(11); }),
        Mutate("Layout0", MhaSpec(), "spec.layout",
               [](PoolSpec& s) { s.layout = static_cast<LayoutKind>(0); }),
        Mutate("Layout5", MhaSpec(), "spec.layout",
               [](PoolSpec& s) { s.layout = static_cast<LayoutKind>(5); }),
        Mutate("Dtype0", MhaSpec(), "spec.dtype",
               [](PoolSpec& s) { s.dtype = static_cast<DType>(0); }),
        Mutate("Dtype7", MhaSpec(), "spec.dtype",
               [](PoolSpec& s) { s.dtype = static_cast<DType>(7); }),
        Mutate("PageSize", MhaSpec(), "spec.page_size", [](PoolSpec& s) { s.page_size = 0; }),
        Mutate("LayerNum", MhaSpec(), "spec.layer_num", [](PoolSpec& s) { s.layer_num = 0; }),
        Mutate("MlaLayerNum", MlaSpec(), "spec.layer_num", [](PoolSpec& s) { s.layer_num = 0; }),
        Mutate("HeadNum", MhaSpec(), "spec.head_num", [](PoolSpec& s) { s.head_num = 0; }),
        Mutate("HeadDim", MhaSpec(), "spec.head_dim", [](PoolSpec& s) { s.head_dim = 0; }),
        Mutate("VHeadDim", MhaSpec(), "spec.v_head_dim", [](PoolSpec& s) { s.v_head_dim = 64; }),
        Mutate("MlaDims", MlaSpec(), "spec.kv_lora_rank",
               [](PoolSpec& s) { s.kv_lora_rank = 0, s.qk_rope_head_dim = 0; }),
        Mutate("MlaPageHead", MlaSpec(), "spec.layout",
               [](PoolSpec& s) { s.layout = LayoutKind::kPageHead; }),
        Mutate("RatioNegative", MhaSpec(), "spec.host_to_device_ratio",
               [](PoolSpec& s) { s.host_to_device_ratio = -1; }),
        Mutate("RatioNan", MhaSpec(), "spec.host_to_device_ratio",
               [](PoolSpec& s) { s.host_to_device_ratio = std::nan(""); }),
        // Rows beyond 4 GiB are refused before any multiplication can overflow.
        Mutate("RowTooLarge", MhaSpec(), "row",
               [](PoolSpec& s) { s.head_num = 1u << 16, s.head_dim = 1u << 16; }),
        Mutate("TokenTooLarge", MhaSpec(), "bytes per token",
               [](PoolSpec& s) {
                 s.head_num = 1u << 10, s.head_dim = 1u << 10, s.layer_num = 1024;
               }),
        // RowBytes = 3 * 715827883 = 2^31 + 1, layer_num = kMaxLayers and
        // page_size = 2^32 - 1: a page's true bytes (~2^76) wrap in 64 bits.
        Mutate("TokenBytesWrap", MhaSpec(), "bytes per token",
               [](PoolSpec& s) {
                 s.dtype = DType::kUint8, s.head_num = 3, s.head_dim = 715827883,
                 s.layer_num = kMaxLayers, s.page_size = 4294967295u;
               }),
        // The layer cap comes before any size arithmetic.
        Mutate("LayerNumOverCap", MhaSpec(), "spec.layer_num 4097 is over the limit of 4096",
               [](PoolSpec& s) { s.layer_num = kMaxLayers + 1; }),
        Mutate("LayerNumMax", MlaSpec(), "spec.layer_num 4294967295 is over the limit",
               [](PoolSpec& s) { s.layer_num = 4294967295u; }),
        Mutate("MambaTooManyDims", MhaSpec(), "spec.mamba.temporal has 9 dimensions",
               [](PoolSpec& s) {
                 s.kind = PoolKind::kMamba, s.layout = LayoutKind::kPageFirstDirect;
                 s.page_size = 1, s.head_num = 0, s.head_dim = 0;
                 s.mamba.temporal = std::vector<uint32_t>(9, 1), s.mamba.conv = {{2}};
               })),
    [](const ::testing::TestParamInfo<BadSpec>& info) { return info.param.name; });

TEST(ValidateSpecTest, AcceptsLayerNumUpToTheCap) {
  PoolSpec s = MhaSpec();
  s.layer_num = kMaxLayers;
  EXPECT_TRUE(ValidateSpec(s).ok()) << ValidateSpec(s);
}

TEST(ValidateSpecTest, AcceptsEveryLayoutItSupports) {
  for (LayoutKind l : {LayoutKind::kLayerFirst, LayoutKind::kPageFirst,
                       LayoutKind::kPageFirstDirect, LayoutKind::kPageHead}) {
    PoolSpec mha = MhaSpec();
    mha.layout = l;
    EXPECT_TRUE(ValidateSpec(mha).ok()) << LayoutName(l);
    mha.v_head_dim = mha.head_dim;  // equal V dim is fine
    EXPECT_TRUE(ValidateSpec(mha).ok()) << LayoutName(l);
    PoolSpec mla = MlaSpec();
    mla.layout = l;
    EXPECT_EQ(ValidateSpec(mla).ok(), l != LayoutKind::kPageHead) << LayoutName(l);
  }
  PoolSpec rope_only = MlaSpec();
  rope_only.kv_lora_rank = 0;
  EXPECT_TRUE(ValidateSpec(rope_only).ok());
}

// ============================================================ sizing

TEST(BytesPerTokenTest, MhaIsHeadsTimesDimTimesLayersTimesDtypeTimesTwo) {
  struct {
    DType dtype;
    uint64_t b;
  } dtypes[] = {{DType::kBf16, 2},    {DType::kFp16, 2},    {DType::kFp32, 4},
                {DType::kFp8E4m3, 1}, {DType::kFp8E5m2, 1}, {DType::kUint8, 1}};
  for (const auto& d : dtypes) {
    PoolSpec s = MhaSpec();
    s.dtype = d.dtype;
    s.head_num = 8;
    s.head_dim = 128;
    s.layer_num = 32;
    ASSERT_TRUE(ValidateSpec(s).ok());
    EXPECT_EQ(PlaneCount(s), 2u);
    EXPECT_EQ(RowBytes(s), 8u * 128 * d.b);
    EXPECT_EQ(BytesPerToken(s), 8u * 128 * 32 * d.b * 2) << DTypeName(d.dtype);
  }
}

TEST(BytesPerTokenTest, MlaIsLatentPlusRopeTimesDtypeTimesLayers) {
  PoolSpec s = MlaSpec();  // DeepSeek-V3: 512 + 64, 61 layers, bf16
  EXPECT_EQ(PlaneCount(s), 1u);
  EXPECT_EQ(RowBytes(s), (512u + 64) * 2);
  EXPECT_EQ(BytesPerToken(s), (512u + 64) * 2 * 61);
  s.dtype = DType::kFp8E4m3;
  s.qk_rope_head_dim = 0;
  EXPECT_EQ(BytesPerToken(s), 512u * 1 * 61);
}

// kvhost rounds a size up to whole pages and adds nothing more. The seeds
// compute `page_num = size // ps + 1; size = page_num * ps`
// (SEED_INVENTORY.md §4), which always adds a page, a whole extra page even
// when size is already a multiple of ps. kvhost deliberately does not (see
// docs/SEEDS.md): the pool holds exactly the requested slots, rounded up to
// whole pages, so 1024 tokens at page 16 is 1024 slots, not 1040.
TEST(ResolveSizeTokensTest, TokensRuleRoundsUpWithoutExtraPage) {
  PoolSpec s = MhaSpec();  // ps 16
  s.size_tokens = 1024;
  EXPECT_EQ(*ResolveSizeTokens(s), 1024u);  // seeds: 1040
  s.size_tokens = 1000;
  EXPECT_EQ(*ResolveSizeTokens(s), 1008u);  // seeds: 1008 as well
  s.size_tokens = 1;
  EXPECT_EQ(*ResolveSizeTokens(s), 16u);
  s.size_tokens = 17;
  EXPECT_EQ(*ResolveSizeTokens(s), 32u);
  s.page_size = 1;
  s.size_tokens = 12345;
  EXPECT_EQ(*ResolveSizeTokens(s), 12345u);
}

TEST(ResolveSizeTokensTest, BytesRuleIsFloorOfBytesOverBytesPerToken) {
  PoolSpec s = MhaSpec();
  s.size_tokens = 0;
  const uint64_t bpt = 8u * 128 * 2 * 4 * 2;  // 16384
  ASSERT_EQ(BytesPerToken(s), bpt);
  s.size_bytes = 100 * bpt + bpt - 1;  // floor -> 100 tokens -> 112 at page 16
  EXPECT_EQ(*ResolveSizeTokens(s), 112u);
  s.size_bytes = 96 * bpt;  // exactly 6 pages
  EXPECT_EQ(*ResolveSizeTokens(s), 96u);
  s.size_bytes = bpt;  // one token -> one page
  EXPECT_EQ(*ResolveSizeTokens(s), 16u);
  s.size_bytes = bpt - 1;  // not even one token
  absl::StatusOr<uint64_t> t = ResolveSizeTokens(s);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Msg(t.status()), HasSubstr("size_bytes"));
}

TEST(ResolveSizeTokensTest, RatioRuleIsFloorOfRatioTimesDevice) {
  PoolSpec s = MhaSpec();
  s.size_tokens = 0;
  s.host_to_device_ratio = 2.5;
  s.device_size_tokens = 1000;
  EXPECT_EQ(*ResolveSizeTokens(s), 2512u);  // 2500 -> 157 pages
  s.host_to_device_ratio = 4;
  s.device_size_tokens = 4096;
  EXPECT_EQ(*ResolveSizeTokens(s), 16384u);
  s.host_to_device_ratio = 0.5;
  s.device_size_tokens = 3;  // floor(1.5) = 1 -> one page
  EXPECT_EQ(*ResolveSizeTokens(s), 16u);
  s.host_to_device_ratio = 0.1;
  s.device_size_tokens = 5;  // floor(0.5) = 0
  EXPECT_EQ(ResolveSizeTokens(s).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ResolveSizeTokensTest, FirstApplicableRuleWins) {
  PoolSpec s = MhaSpec();
  s.size_tokens = 32;
  s.size_bytes = uint64_t{1} << 30;
  s.host_to_device_ratio = 2;
  s.device_size_tokens = 1 << 20;
  EXPECT_EQ(*ResolveSizeTokens(s), 32u);
  s.size_tokens = 0;
  EXPECT_EQ(*ResolveSizeTokens(s), (uint64_t{1} << 30) / 16384);
  s.size_bytes = 0;
  EXPECT_EQ(*ResolveSizeTokens(s), uint64_t{2} << 20);
}

TEST(ResolveSizeTokensTest, NoRuleIsAnError) {
  PoolSpec s = MhaSpec();
  s.size_tokens = 0;
  EXPECT_EQ(ResolveSizeTokens(s).status().code(), absl::StatusCode::kInvalidArgument);
  s.host_to_device_ratio = 2;  // without device_size_tokens
  EXPECT_EQ(ResolveSizeTokens(s).status().code(), absl::StatusCode::kInvalidArgument);
  s.host_to_device_ratio = 0;
  s.device_size_tokens = 100;  // without a ratio
  absl::StatusOr<uint64_t> t = ResolveSizeTokens(s);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Msg(t.status()), HasSubstr("size_tokens"));
}

TEST(ResolveSizeTokensTest, RefusesSizesWhoseBytesOverflow) {
  PoolSpec s = MhaSpec();
  s.size_tokens = uint64_t{1} << 50;
  EXPECT_EQ(ResolveSizeTokens(s).status().code(), absl::StatusCode::kInvalidArgument);
  // 2^31 bytes per token (rows of 2^30) x (2^33 + 1) tokens = 2^64 + 2^31:
  // the pool's byte size would wrap to 2 GiB while its layout spans 2^64.
  s.head_num = 1u << 14;
  s.head_dim = 1u << 15;
  s.layer_num = 1;
  s.page_size = 1;
  ASSERT_TRUE(ValidateSpec(s).ok());
  ASSERT_EQ(BytesPerToken(s), uint64_t{1} << 31);
  s.size_tokens = (uint64_t{1} << 33) + 1;
  absl::StatusOr<uint64_t> t = ResolveSizeTokens(s);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << t.status();
  if (t.ok()) {
    EXPECT_LE(*t, std::numeric_limits<uint64_t>::max() / BytesPerToken(s));
  }
}

// ============================================================ Pool

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
  absl::StatusOr<std::vector<RegionSegment>> meta = (*pool)->PageBufferMeta(slots);
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
  absl::StatusOr<std::vector<RegionSegment>> meta =
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
  absl::StatusOr<std::vector<RegionSegment>> bad = (*pool)->PageBufferMeta({1, 2, 3, 4});
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

// ============================================================ registry

// Memory figures a test controls.
struct FakeMemory {
  MemorySnapshot snapshot;
  absl::Status error;
  int reads = 0;
  // The shm file system's free bytes (RegistryOptions::read_fs_free).
  uint64_t fs_free = UINT64_MAX;
};

RegistryOptions Options(const std::string& dir, FakeMemory* mem) {
  RegistryOptions o;
  o.shm_dir = dir;
  o.read_memory = [mem]() -> absl::StatusOr<MemorySnapshot> {
    ++mem->reads;
    if (!mem->error.ok()) return mem->error;
    return mem->snapshot;
  };
  o.read_fs_free = [mem](const DirFd&) -> absl::StatusOr<uint64_t> { return mem->fs_free; };
  return o;
}

// 1,000,000 bytes per token (MLA, uint8, 1000 x 1000), so sizes read in
// round GB: N tokens are N MB.
PoolSpec MegabyteTokenSpec(uint64_t tokens) {
  PoolSpec s;
  s.kind = PoolKind::kMla;
  s.layout = LayoutKind::kPageFirst;
  s.dtype = DType::kUint8;
  s.page_size = 16;
  s.layer_num = 1000;
  s.kv_lora_rank = 1000;
  s.size_tokens = tokens;
  return s;
}

constexpr uint64_t kGB = 1000000000;

class RegistryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_FALSE(dir_.path().empty());
    mem_.snapshot.mem_total = 1000 * kGB;
    mem_.snapshot.mem_available = 500 * kGB;
    ASSERT_EQ(BytesPerToken(MegabyteTokenSpec(16)), 1000000u);
  }
  ShmDir dir_;
  FakeMemory mem_;
};

// Deleted pools are unmapped on the registry's releaser thread: true once
// every deleted pool's bytes are back (within 10 s).
bool WaitForReleases(const PoolRegistry& reg) {
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (reg.releasing_bytes() != 0) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(1));
  }
  return true;
}

TEST_F(RegistryTest, RefusesWhenMemAvailableIsShort) {
  mem_.snapshot.mem_available = 10 * kGB;
  RegistryOptions o = Options(dir_.path(), &mem_);
  o.memory_reserve = 1 * kGB;
  PoolRegistry reg(o);
  absl::StatusOr<std::shared_ptr<Pool>> p = reg.Create("big", MegabyteTokenSpec(12000));
  ASSERT_EQ(p.status().code(), absl::StatusCode::kResourceExhausted) << p.status();
  EXPECT_THAT(Msg(p.status()), HasSubstr("12000000000 bytes"));             // requested
  EXPECT_THAT(Msg(p.status()), HasSubstr("(9000000000 bytes) available"));  // 10 - 1 reserve
  EXPECT_THAT(Msg(p.status()), HasSubstr("'big'"));
  EXPECT_EQ(mem_.reads, 1);
  EXPECT_TRUE(reg.List().empty());
  EXPECT_EQ(reg.used_bytes(), 0u);
  EXPECT_TRUE(dir_.Files().empty());
  // 9 GB is the limit: a 16 MB pool fits.
  EXPECT_TRUE(reg.Create("small", MegabyteTokenSpec(16)).ok());
}

TEST_F(RegistryTest, CgroupLimitIsCounted) {
  mem_.snapshot.cgroup_limit = 5 * kGB;
  mem_.snapshot.cgroup_usage = 1 * kGB;
  mem_.snapshot.cgroup_source = "v2";
  PoolRegistry reg(Options(dir_.path(), &mem_));
  absl::StatusOr<std::shared_ptr<Pool>> p = reg.Create("big", MegabyteTokenSpec(4512));
  ASSERT_EQ(p.status().code(), absl::StatusCode::kResourceExhausted) << p.status();
  EXPECT_THAT(Msg(p.status()), HasSubstr("4512000000 bytes"));
  EXPECT_THAT(Msg(p.status()), HasSubstr("(4000000000 bytes) available"));  // 5 GB - 1 GB used
  // The cgroup's usage counts: 10 MB left cannot hold 16 MB.
  mem_.snapshot.cgroup_usage = 5 * kGB - 10000000;
  p = reg.Create("small", MegabyteTokenSpec(16));
  ASSERT_EQ(p.status().code(), absl::StatusCode::kResourceExhausted) << p.status();
  EXPECT_THAT(Msg(p.status()), HasSubstr("(16000000 bytes: 1 pages"));    // 16 MB requested
  EXPECT_THAT(Msg(p.status()), HasSubstr("(10000000 bytes) available"));  // 10 MB free
  mem_.snapshot.cgroup_usage = 1 * kGB;
  EXPECT_TRUE(reg.Create("small", MegabyteTokenSpec(16)).ok());
}

// The region files live on the shm dir's file system: a tmpfs smaller than
// the memory holds only what it has free (issue 12: 4 GiB reported on a 64 MiB
// tmpfs).
TEST_F(RegistryTest, ShmFilesystemFreeSpaceIsCounted) {
  mem_.fs_free = 20000000;  // 20 MB free on the tmpfs, 500 GB of memory
  PoolRegistry reg(Options(dir_.path(), &mem_));
  std::string why;
  absl::StatusOr<uint64_t> available = reg.Available(&why);
  ASSERT_TRUE(available.ok()) << available.status();
  EXPECT_EQ(*available, 20000000u);
  EXPECT_THAT(why, HasSubstr(absl::StrCat("shm filesystem ", dir_.path(), " has 19.07 MiB free")));
  absl::StatusOr<std::shared_ptr<Pool>> p = reg.Create("big", MegabyteTokenSpec(32));
  ASSERT_EQ(p.status().code(), absl::StatusCode::kResourceExhausted) << p.status();
  EXPECT_THAT(Msg(p.status()), HasSubstr("shm filesystem"));
  EXPECT_TRUE(dir_.Files().empty());
  EXPECT_TRUE(reg.Create("small", MegabyteTokenSpec(16)).ok());
  // The default reads the directory's own file system.
  RegistryOptions real = Options(dir_.path(), &mem_);
  real.read_fs_free = RegistryOptions().read_fs_free;
  struct statvfs vfs;
  ASSERT_EQ(::statvfs(dir_.path().c_str(), &vfs), 0);
  absl::StatusOr<uint64_t> real_free = real.read_fs_free(*DirFd::Open(dir_.path()));
  ASSERT_TRUE(real_free.ok()) << real_free.status();
  const uint64_t expected = uint64_t{vfs.f_bavail} * vfs.f_frsize;
  EXPECT_NEAR(static_cast<double>(*real_free), static_cast<double>(expected), 64.0 * 1048576);
}

TEST_F(RegistryTest, MemoryLimitSpansAllPools) {
  RegistryOptions o = Options(dir_.path(), &mem_);
  o.memory_limit = 40000000;  // 40 MB for all pools
  PoolRegistry reg(o);
  ASSERT_TRUE(reg.Create("a", MegabyteTokenSpec(16)).ok());
  ASSERT_TRUE(reg.Create("b", MegabyteTokenSpec(16)).ok());
  EXPECT_EQ(reg.used_bytes(), 32000000u);
  absl::StatusOr<std::shared_ptr<Pool>> c = reg.Create("c", MegabyteTokenSpec(16));
  ASSERT_EQ(c.status().code(), absl::StatusCode::kResourceExhausted) << c.status();
  EXPECT_THAT(Msg(c.status()), HasSubstr("--memory-limit"));
  EXPECT_THAT(Msg(c.status()), HasSubstr("(8000000 bytes) available"));  // 8 MB left
  absl::StatusOr<uint64_t> freed = reg.Delete("a");
  ASSERT_TRUE(freed.ok());
  EXPECT_EQ(*freed, 16000000u);
  EXPECT_EQ(reg.used_bytes(), 16000000u);
  // Its memory counts until the releaser thread has unmapped it.
  ASSERT_TRUE(WaitForReleases(reg));
  EXPECT_TRUE(reg.Create("c", MegabyteTokenSpec(16)).ok());
  EXPECT_EQ(reg.used_bytes(), 32000000u);
}

TEST_F(RegistryTest, MemoryReadErrorIsReturned) {
  mem_.error = absl::FailedPreconditionError("cannot read /proc/meminfo");
  PoolRegistry reg(Options(dir_.path(), &mem_));
  absl::StatusOr<std::shared_ptr<Pool>> p = reg.Create("a", MegabyteTokenSpec(16));
  EXPECT_EQ(p.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(Msg(p.status()), HasSubstr("/proc/meminfo"));
  EXPECT_TRUE(dir_.Files().empty());
}

TEST_F(RegistryTest, OverflowingSizeIsRefusedNotWrapped) {
  // See ResolveSizeTokensTest.RefusesSizesWhoseBytesOverflow: the wrapped
  // size (2 GiB) would fit in memory; the pool must be refused as a bad spec.
  mem_.snapshot.mem_available = 1 * kGB;
  PoolRegistry reg(Options(dir_.path(), &mem_));
  PoolSpec s = MhaSpec();
  s.head_num = 1u << 14, s.head_dim = 1u << 15, s.layer_num = 1, s.page_size = 1;
  s.size_tokens = (uint64_t{1} << 33) + 1;
  EXPECT_EQ(reg.Create("huge", s).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(dir_.Files().empty());
}

TEST_F(RegistryTest, AlreadyExistsAndNotFound) {
  PoolRegistry reg(Options(dir_.path(), &mem_));
  absl::StatusOr<std::shared_ptr<Pool>> a = reg.Create("a", MegabyteTokenSpec(16));
  ASSERT_TRUE(a.ok()) << a.status();
  absl::StatusOr<std::shared_ptr<Pool>> dup = reg.Create("a", MegabyteTokenSpec(32));
  EXPECT_EQ(dup.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(Msg(dup.status()), HasSubstr("'a'"));
  EXPECT_EQ(reg.List().size(), 1u);
  EXPECT_EQ((*reg.Get("a"))->size_tokens(), 16u);  // the first one stays
  EXPECT_EQ(reg.used_bytes(), 16000000u);

  absl::StatusOr<std::shared_ptr<Pool>> missing = reg.Get("nope");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(Msg(missing.status()), HasSubstr("'nope'"));
  absl::StatusOr<uint64_t> del = reg.Delete("nope");
  EXPECT_EQ(del.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(Msg(del.status()), HasSubstr("'nope'"));
  ASSERT_TRUE(reg.Delete("a").ok());
  EXPECT_EQ(reg.Delete("a").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(reg.Get("a").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(RegistryTest, ListIsByName) {
  PoolRegistry reg(Options(dir_.path(), &mem_));
  for (const char* n : {"c", "a", "b"}) ASSERT_TRUE(reg.Create(n, MegabyteTokenSpec(16)).ok());
  std::vector<std::string> names;
  for (const auto& p : reg.List()) names.push_back(p->name());
  EXPECT_EQ(names, (std::vector<std::string>{"a", "b", "c"}));
}

TEST_F(RegistryTest, DeleteRefusedWhileAttached) {
  PoolRegistry reg(Options(dir_.path(), &mem_));
  absl::StatusOr<std::shared_ptr<Pool>> p = reg.Create("a", MegabyteTokenSpec(16));
  ASSERT_TRUE(p.ok());
  ASSERT_TRUE((*p)->AcquireAttachment().ok());
  ASSERT_TRUE((*p)->AcquireAttachment().ok());
  EXPECT_EQ((*p)->attachments(), 2u);
  absl::StatusOr<uint64_t> del = reg.Delete("a");
  EXPECT_EQ(del.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(Msg(del.status()), HasSubstr("2 device attachment"));
  EXPECT_TRUE(reg.Get("a").ok());
  EXPECT_EQ(reg.used_bytes(), 16000000u);
  (*p)->ReleaseAttachment();
  EXPECT_EQ(reg.Delete("a").status().code(), absl::StatusCode::kFailedPrecondition);
  (*p)->ReleaseAttachment();
  absl::StatusOr<uint64_t> ok = reg.Delete("a");
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(*ok, 16000000u);
  EXPECT_EQ(reg.used_bytes(), 0u);
  // A deleted pool takes no new attachments.
  absl::Status late = (*p)->AcquireAttachment();
  EXPECT_EQ(late.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*p)->attachments(), 0u);
}

TEST(PoolNameTest, Validation) {
  for (const std::string& good : {std::string("a"), std::string("llama-70b_v2.kv"),
                                  std::string("A9"), std::string(64, 'x')}) {
    EXPECT_TRUE(ValidatePoolName(good).ok()) << good;
  }
  for (const std::string& bad : {std::string(""), std::string(65, 'x'), std::string(".hidden"),
                                 std::string("a/b"), std::string("a b"), std::string(".."),
                                 std::string("naïve"), std::string("a\nb"), std::string("x*")}) {
    absl::Status s = ValidatePoolName(bad);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

TEST_F(RegistryTest, BadNameOrSpecCreatesNothing) {
  PoolRegistry reg(Options(dir_.path(), &mem_));
  EXPECT_EQ(reg.Create("../evil", MegabyteTokenSpec(16)).status().code(),
            absl::StatusCode::kInvalidArgument);
  PoolSpec bad = MegabyteTokenSpec(16);
  bad.page_size = 0;
  absl::StatusOr<std::shared_ptr<Pool>> p = reg.Create("ok", bad);
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Msg(p.status()), HasSubstr("spec.page_size"));
  EXPECT_THAT(Msg(p.status()), HasSubstr("pool 'ok'"));
  EXPECT_TRUE(dir_.Files().empty());
  EXPECT_TRUE(reg.List().empty());
}

TEST_F(RegistryTest, RegionFileHasExactSizeAndGoesWithThePool) {
  PoolRegistry reg(Options(dir_.path(), &mem_));
  EXPECT_EQ(reg.region_prefix(), absl::StrCat(dir_.path(), "/kvhost.", ::getpid(), "."));
  PoolSpec s = MhaSpec();  // 16384 bytes per token
  s.size_tokens = 1000;    // -> 1008 tokens
  absl::StatusOr<std::shared_ptr<Pool>> p = reg.Create("llama", s);
  ASSERT_TRUE(p.ok()) << p.status();
  const uint64_t bytes = 1008u * 16384;
  EXPECT_EQ((*p)->bytes(), bytes);
  EXPECT_EQ(reg.used_bytes(), bytes);
  std::vector<std::string> paths = (*p)->region_paths();
  ASSERT_EQ(paths.size(), 1u);
  EXPECT_EQ(fs::path(paths[0]).parent_path(), fs::path(dir_.path()));
  EXPECT_EQ(paths[0].rfind(reg.region_prefix(), 0), 0u) << paths[0];
  struct stat st;
  ASSERT_EQ(::stat(paths[0].c_str(), &st), 0);
  EXPECT_TRUE(S_ISREG(st.st_mode));
  EXPECT_EQ(static_cast<uint64_t>(st.st_size), bytes);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  // The bytes are mapped and writable end to end.
  (*p)->base()[0] = 1;
  (*p)->base()[bytes - 1] = 2;

  // Deleted: the file goes at once, though a user still holds the pool and
  // its mapping stays valid...
  ASSERT_TRUE(reg.Delete("llama").ok());
  EXPECT_FALSE(fs::exists(paths[0]));
  EXPECT_TRUE(dir_.Files().empty());
  EXPECT_EQ((*p)->base()[bytes - 1], 2);
  // ...so the name can be reused at once, with a fresh file (a new random
  // name part: names cannot be squatted) that the old pool's end leaves alone.
  absl::StatusOr<std::shared_ptr<Pool>> again = reg.Create("llama", s);
  ASSERT_TRUE(again.ok()) << again.status();
  const std::vector<std::string> fresh = (*again)->region_paths();
  ASSERT_EQ(fresh.size(), 1u);
  EXPECT_NE(fresh, paths);
  EXPECT_EQ(fresh[0].rfind(reg.region_prefix(), 0), 0u) << fresh[0];
  p = absl::NotFoundError("dropped");
  EXPECT_TRUE(fs::exists(fresh[0]));
  ASSERT_TRUE(reg.Delete("llama").ok());
  EXPECT_FALSE(fs::exists(fresh[0]));
}

// A caller that gives up while the memory is being reserved (its deadline
// passed) was told the call failed: no pool, no file, no bytes counted, and the
// name is free. While a creation is under way, its name is taken.
TEST_F(RegistryTest, AbandonedCreationLeavesNothing) {
  PoolRegistry reg(Options(dir_.path(), &mem_));
  PoolSpec s = MhaSpec();
  s.size_tokens = 1024;
  bool asked = false;
  absl::StatusOr<std::shared_ptr<Pool>> p = reg.Create("late", s, [&] {
    asked = true;
    // Still being created: the name is taken meanwhile.
    EXPECT_EQ(reg.Create("late", s).status().code(), absl::StatusCode::kAlreadyExists);
    return true;
  });
  EXPECT_TRUE(asked);
  ASSERT_EQ(p.status().code(), absl::StatusCode::kCancelled) << p.status();
  EXPECT_THAT(Msg(p.status()), HasSubstr("'late'"));
  EXPECT_TRUE(reg.List().empty());
  EXPECT_EQ(reg.used_bytes(), 0u);
  EXPECT_TRUE(dir_.Files().empty());
  absl::StatusOr<std::shared_ptr<Pool>> again = reg.Create("late", s, [] { return false; });
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(reg.used_bytes(), (*again)->bytes());
}

TEST_F(RegistryTest, RegionFilesGoWithTheRegistry) {
  std::string path;
  {
    PoolRegistry reg(Options(dir_.path(), &mem_));
    absl::StatusOr<std::shared_ptr<Pool>> p = reg.Create("a", MegabyteTokenSpec(16));
    ASSERT_TRUE(p.ok());
    path = (*p)->region_paths()[0];
    EXPECT_TRUE(fs::exists(path));
  }
  EXPECT_FALSE(fs::exists(path));
}

// A pid that no longer runs: a child that exited and was reaped.
pid_t DeadPid() {
  pid_t pid = ::fork();
  if (pid == 0) ::_exit(0);
  int status = 0;
  ::waitpid(pid, &status, 0);
  return pid;
}

void Touch(const std::string& path) {
  const int fd = ::open(path.c_str(), O_CREAT | O_WRONLY, 0600);
  ASSERT_GE(fd, 0) << path;
  ASSERT_EQ(::write(fd, "x", 1), 1);
  ::close(fd);
}

TEST_F(RegistryTest, RemoveStaleRegionsOnlyRemovesDeadDaemonsFiles) {
  const pid_t dead = DeadPid();
  ASSERT_GT(dead, 0);
  ASSERT_NE(::kill(dead, 0), 0);
  // A live process other than this one: a child that waits.
  int pipefd[2];
  ASSERT_EQ(::pipe(pipefd), 0);
  const pid_t live = ::fork();
  if (live == 0) {
    char c;
    ::close(pipefd[1]);
    (void)::read(pipefd[0], &c, 1);
    ::_exit(0);
  }
  ::close(pipefd[0]);

  const std::string d = dir_.path() + "/";
  const std::vector<std::string> stale = {
      absl::StrCat("kvhost.", dead, ".llama.kv"),
      absl::StrCat("kvhost.", dead, ".other-pool.v2.kv"),
      // A predecessor with this process's pid (pid 1 again in a container).
      absl::StrCat("kvhost.", ::getpid(), ".before-restart.kv"),
  };
  const std::vector<std::string> kept = {
      absl::StrCat("kvhost.", live, ".theirs.kv"),  // a running process
      "kvhost.1.init.kv",                           // pid 1 runs
      "unrelated.txt",
      absl::StrCat("kvhostx.", dead, ".a.kv"),
      "kvhost.notapid.a.kv",
      absl::StrCat("kvhost.", dead),  // not <prefix>.<pid>.<rest>
      "kvhost.-5.a.kv",
      "kvhost.0.a.kv",
  };
  for (const auto& f : stale) ASSERT_NO_FATAL_FAILURE(Touch(d + f));
  for (const auto& f : kept) ASSERT_NO_FATAL_FAILURE(Touch(d + f));
  // Live regions hold their file's lock, whatever pid the name says: one
  // named like this process's, one like a dead pid's (a daemon in another
  // pid namespace sharing the directory).
  absl::StatusOr<std::unique_ptr<ShmRegion>> mine =
      ShmRegion::Create(d + absl::StrCat("kvhost.", ::getpid(), ".mine.kv"), 4096);
  ASSERT_TRUE(mine.ok()) << mine.status();
  absl::StatusOr<std::unique_ptr<ShmRegion>> other_namespace =
      ShmRegion::Create(d + absl::StrCat("kvhost.", dead, ".elsewhere.kv"), 4096);
  ASSERT_TRUE(other_namespace.ok()) << other_namespace.status();

  PoolRegistry reg(Options(dir_.path(), &mem_));
  EXPECT_EQ(reg.RemoveStaleRegions(), 3);
  for (const auto& f : stale) EXPECT_FALSE(fs::exists(d + f)) << f;
  for (const auto& f : kept) EXPECT_TRUE(fs::exists(d + f)) << f;
  EXPECT_TRUE(fs::exists((*mine)->path()));
  EXPECT_TRUE(fs::exists((*other_namespace)->path()));
  EXPECT_EQ(reg.RemoveStaleRegions(), 0);

  ::close(pipefd[1]);
  int status = 0;
  ::waitpid(live, &status, 0);
}

TEST(RegistryNoDirTest, RemoveStaleRegionsWithoutDirectory) {
  FakeMemory mem;
  PoolRegistry reg(Options("/nonexistent/kvhost-test-dir", &mem));
  EXPECT_EQ(reg.RemoveStaleRegions(), 0);
}

// ============================================================ every kind

// Valid specs of each kind (followers name "anchor").
PoolSpec KindSpec(PoolKind kind) {
  PoolSpec s;
  s.kind = kind;
  s.dtype = DType::kBf16;
  s.page_size = 4;
  s.layer_num = 2;
  s.size_tokens = 64;
  switch (kind) {
    case PoolKind::kMha:
      s.layout = LayoutKind::kPageFirst, s.head_num = 2, s.head_dim = 8;
      break;
    case PoolKind::kMhaAsymmetric:
      s.layout = LayoutKind::kPageFirst, s.head_num = 2, s.head_dim = 8, s.v_head_dim = 4;
      break;
    case PoolKind::kKOnly:
      s.layout = LayoutKind::kPageFirst, s.head_num = 2, s.head_dim = 8, s.follows = "anchor";
      s.size_tokens = 0;
      break;
    case PoolKind::kMla:
      s.layout = LayoutKind::kLayerFirst, s.kv_lora_rank = 8, s.qk_rope_head_dim = 4;
      break;
    case PoolKind::kDsa:
      s.layout = LayoutKind::kLayerFirst, s.kv_lora_rank = 8, s.qk_rope_head_dim = 4;
      s.index_head_dim = 16, s.index_quant_block_size = 8;
      break;
    case PoolKind::kDsaIndexer:
      s.layout = LayoutKind::kPageFirst, s.dtype = DType::kUint8, s.index_head_dim = 16;
      s.index_quant_block_size = 8, s.follows = "anchor", s.size_tokens = 0;
      break;
    case PoolKind::kMamba:
      s.layout = LayoutKind::kPageFirstDirect, s.page_size = 1;
      s.mamba.temporal = {2, 3}, s.mamba.temporal_dtype = DType::kFp32,
      s.mamba.conv = {{4}, {2, 2}};
      break;
    case PoolKind::kV4Paged:
      s.layout = LayoutKind::kPageFirst, s.dtype = DType::kUint8, s.item_bytes = 24;
      break;
    case PoolKind::kV4State:
      s.layout = LayoutKind::kPageFirst, s.dtype = DType::kUint8, s.ring_size = 3;
      s.state_slot_bytes = 8, s.follows = "anchor", s.size_tokens = 0;
      break;
    case PoolKind::kLogical:
      s.layout = LayoutKind::kLayerFirst, s.dtype = DType::kUint8, s.layer_num = 0;
      break;
  }
  return s;
}

const PoolKind kKinds[] = {PoolKind::kMha,    PoolKind::kMla,     PoolKind::kMhaAsymmetric,
                           PoolKind::kKOnly,  PoolKind::kDsa,     PoolKind::kDsaIndexer,
                           PoolKind::kMamba,  PoolKind::kV4Paged, PoolKind::kV4State,
                           PoolKind::kLogical};

TEST(KindSpecTest, EveryKindSpecIsValid) {
  for (PoolKind k : kKinds)
    EXPECT_TRUE(ValidateSpec(KindSpec(k)).ok()) << PoolKindName(k) << ValidateSpec(KindSpec(k));
}

struct KindError {
  const char* name;
  PoolSpec spec;
  std::vector<const char*> needles;  // kind, layout and field, as the message must name them
};

void PrintTo(const KindError& c, std::ostream* os) { *os << c.name; }

KindError Bad(const char* name, PoolKind kind, std::vector<const char*> needles,
              void (*f)(PoolSpec&)) {
  PoolSpec s = KindSpec(kind);
  f(s);
  return {name, s, std::move(needles)};
}

class KindErrorTest : public ::testing::TestWithParam<KindError> {};

TEST_P(KindErrorTest, IsInvalidArgumentNamingKindLayoutField) {
  const KindError& c = GetParam();
  absl::Status s = ValidateSpec(c.spec);
  ASSERT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  for (const char* needle : c.needles) EXPECT_THAT(Msg(s), HasSubstr(needle));
}

INSTANTIATE_TEST_SUITE_P(
    EverySeedError, KindErrorTest,
    ::testing::Values(
        // MHA_ASYMMETRIC: lf / ph raise ValueError (S1:981); equal dims are MHA.
        Bad("AsymLayerFirst", PoolKind::kMhaAsymmetric,
            {"MHA_ASYMMETRIC/LAYER_FIRST", "spec.layout", "head_dim != v_head_dim"},
            [](PoolSpec& s) { s.layout = LayoutKind::kLayerFirst; }),
        Bad("AsymPageHead", PoolKind::kMhaAsymmetric, {"MHA_ASYMMETRIC/PAGE_HEAD", "spec.layout"},
            [](PoolSpec& s) { s.layout = LayoutKind::kPageHead; }),
        Bad("AsymEqualDims", PoolKind::kMhaAsymmetric,
            {"MHA_ASYMMETRIC/PAGE_FIRST", "spec.v_head_dim", "kind MHA"},
            [](PoolSpec& s) { s.v_head_dim = s.head_dim; }),
        Bad("AsymNoVDim", PoolKind::kMhaAsymmetric,
            {"MHA_ASYMMETRIC/PAGE_FIRST", "spec.v_head_dim"},
            [](PoolSpec& s) { s.v_head_dim = 0; }),
        Bad("MhaUnequalDims", PoolKind::kMha,
            {"MHA/PAGE_FIRST", "spec.v_head_dim", "MHA_ASYMMETRIC"},
            [](PoolSpec& s) { s.v_head_dim = 3; }),
        // K_ONLY: follows required; ph raises.
        Bad("KOnlyNoFollows", PoolKind::kKOnly, {"K_ONLY/PAGE_FIRST", "spec.follows", "required"},
            [](PoolSpec& s) { s.follows.clear(); }),
        Bad("KOnlyPageHead", PoolKind::kKOnly, {"K_ONLY/PAGE_HEAD", "spec.layout"},
            [](PoolSpec& s) { s.layout = LayoutKind::kPageHead; }),
        Bad("KOnlyVDim", PoolKind::kKOnly, {"K_ONLY/PAGE_FIRST", "spec.v_head_dim", "not used"},
            [](PoolSpec& s) { s.v_head_dim = 8; }),
        Bad("KOnlyHeads", PoolKind::kKOnly, {"K_ONLY/PAGE_FIRST", "spec.head_num"},
            [](PoolSpec& s) { s.head_num = 0; }),
        // DSA: layer_first only (NotImplementedError S2:881-884).
        Bad("DsaPageFirst", PoolKind::kDsa, {"DSA/PAGE_FIRST", "spec.layout", "layer_first"},
            [](PoolSpec& s) { s.layout = LayoutKind::kPageFirst; }),
        Bad("DsaIndexNotMultiple", PoolKind::kDsa,
            {"DSA/LAYER_FIRST", "spec.index_head_dim", "spec.index_quant_block_size"},
            [](PoolSpec& s) { s.index_head_dim = 12; }),
        Bad("DsaIndexBoth", PoolKind::kDsa, {"DSA/LAYER_FIRST", "spec.index_row_bytes"},
            [](PoolSpec& s) { s.index_row_bytes = 20; }),
        Bad("DsaNoIndex", PoolKind::kDsa, {"DSA/LAYER_FIRST", "spec.index_head_dim"},
            [](PoolSpec& s) { s.index_head_dim = 0, s.index_quant_block_size = 0; }),
        Bad("DsaNoLatent", PoolKind::kDsa, {"DSA/LAYER_FIRST", "spec.kv_lora_rank"},
            [](PoolSpec& s) { s.kv_lora_rank = 0, s.qk_rope_head_dim = 0; }),
        Bad("DsaHeads", PoolKind::kDsa, {"DSA/LAYER_FIRST", "spec.head_num", "not used"},
            [](PoolSpec& s) { s.head_num = 1; }),
        // DSA_INDEXER.
        Bad("IndexerNoFollows", PoolKind::kDsaIndexer, {"DSA_INDEXER/PAGE_FIRST", "spec.follows"},
            [](PoolSpec& s) { s.follows.clear(); }),
        Bad("IndexerPageHead", PoolKind::kDsaIndexer, {"DSA_INDEXER/PAGE_HEAD", "spec.layout"},
            [](PoolSpec& s) { s.layout = LayoutKind::kPageHead; }),
        Bad("IndexerRowBytes", PoolKind::kDsaIndexer,
            {"DSA_INDEXER/PAGE_FIRST", "spec.index_row_bytes", "not used"},
            [](PoolSpec& s) { s.index_row_bytes = 4; }),
        Bad("IndexerBlock0", PoolKind::kDsaIndexer,
            {"DSA_INDEXER/PAGE_FIRST", "spec.index_quant_block_size"},
            [](PoolSpec& s) { s.index_quant_block_size = 0; }),
        Bad("IndexerDtype", PoolKind::kDsaIndexer, {"DSA_INDEXER/PAGE_FIRST", "spec.dtype"},
            [](PoolSpec& s) { s.dtype = DType::kBf16; }),
        // MAMBA: pfd only (S0:616), ps 1 (S0:611), 1..7 convs.
        Bad("MambaPageFirst", PoolKind::kMamba,
            {"MAMBA/PAGE_FIRST", "spec.layout", "page_first_direct"},
            [](PoolSpec& s) { s.layout = LayoutKind::kPageFirst; }),
        Bad("MambaPageSize", PoolKind::kMamba, {"MAMBA/PAGE_FIRST_DIRECT", "spec.page_size"},
            [](PoolSpec& s) { s.page_size = 2; }),
        Bad("MambaNoConv", PoolKind::kMamba, {"MAMBA/PAGE_FIRST_DIRECT", "spec.mamba.conv"},
            [](PoolSpec& s) { s.mamba.conv.clear(); }),
        Bad("MambaEightConvs", PoolKind::kMamba, {"MAMBA/PAGE_FIRST_DIRECT", "spec.mamba.conv"},
            [](PoolSpec& s) { s.mamba.conv.assign(8, {2}); }),
        Bad("MambaNoTemporal", PoolKind::kMamba, {"MAMBA/PAGE_FIRST_DIRECT", "spec.mamba.temporal"},
            [](PoolSpec& s) { s.mamba.temporal.clear(); }),
        Bad("MambaZeroDim", PoolKind::kMamba,
            {"MAMBA/PAGE_FIRST_DIRECT", "spec.mamba.conv[1].dims[0]"},
            [](PoolSpec& s) { s.mamba.conv[1][0] = 0; }),
        Bad("MambaOnMha", PoolKind::kMha, {"MHA/PAGE_FIRST", "spec.mamba", "not used"},
            [](PoolSpec& s) { s.mamba.conv = {{2}}; }),
        // V4.
        Bad("V4PagedNoItem", PoolKind::kV4Paged, {"V4_PAGED/PAGE_FIRST", "spec.item_bytes"},
            [](PoolSpec& s) { s.item_bytes = 0; }),
        Bad("V4PagedHeadDim", PoolKind::kV4Paged,
            {"V4_PAGED/PAGE_FIRST", "spec.head_dim", "not used"},
            [](PoolSpec& s) { s.head_dim = 128; }),
        Bad("V4PagedFollows", PoolKind::kV4Paged,
            {"V4_PAGED/PAGE_FIRST", "spec.follows", "not used"},
            [](PoolSpec& s) { s.follows = "x"; }),
        Bad("V4PagedPageHead", PoolKind::kV4Paged, {"V4_PAGED/PAGE_HEAD", "spec.layout"},
            [](PoolSpec& s) { s.layout = LayoutKind::kPageHead; }),
        Bad("V4StateNoFollows", PoolKind::kV4State, {"V4_STATE/PAGE_FIRST", "spec.follows"},
            [](PoolSpec& s) { s.follows.clear(); }),
        Bad("V4StateRing0", PoolKind::kV4State, {"V4_STATE/PAGE_FIRST", "spec.ring_size"},
            [](PoolSpec& s) { s.ring_size = 0; }),
        Bad("V4StateSlot0", PoolKind::kV4State, {"V4_STATE/PAGE_FIRST", "spec.state_slot_bytes"},
            [](PoolSpec& s) { s.state_slot_bytes = 0; }),
        Bad("V4StateItem", PoolKind::kV4State, {"V4_STATE/PAGE_FIRST", "spec.item_bytes"},
            [](PoolSpec& s) { s.item_bytes = 3; }),
        // LOGICAL: no layers, no bytes.
        Bad("LogicalLayers", PoolKind::kLogical, {"LOGICAL/LAYER_FIRST", "spec.layer_num"},
            [](PoolSpec& s) { s.layer_num = 2; }),
        Bad("LogicalSizeBytes", PoolKind::kLogical, {"LOGICAL/LAYER_FIRST", "spec.size_bytes"},
            [](PoolSpec& s) { s.size_tokens = 0, s.size_bytes = 1000; }),
        Bad("MlaIndex", PoolKind::kMla, {"MLA/LAYER_FIRST", "spec.index_head_dim", "not used"},
            [](PoolSpec& s) { s.index_head_dim = 8; }),
        Bad("StartLayerWraps", PoolKind::kMla, {"MLA/LAYER_FIRST", "spec.start_layer"},
            [](PoolSpec& s) { s.start_layer = 4294967295u; }),
        Bad("PageRowTooLarge", PoolKind::kV4Paged, {"V4_PAGED/PAGE_FIRST", "row"},
            [](PoolSpec& s) { s.item_bytes = uint64_t{1} << 50; }),
        Bad("MambaTooLarge", PoolKind::kMamba, {"MAMBA/PAGE_FIRST_DIRECT", "row"},
            [](PoolSpec& s) {
              s.mamba.conv[0] = {65536, 65536, 65536};
            })),
    [](const ::testing::TestParamInfo<KindError>& info) { return info.param.name; });

TEST(KindSizingTest, BytesPerPageAndTokenPerKind) {
  // Formulas of plan §2, typed out: (D+Dv)·H·L·b; C·b·L + IKR·L; IS·L;
  // (E_t·b_t + Σ E_c·b)·L; V4 L·R per page.
  EXPECT_EQ(BytesPerPage(KindSpec(PoolKind::kMhaAsymmetric)), 4u * (8 + 4) * 2 * 2 * 2);
  EXPECT_EQ(BytesPerToken(KindSpec(PoolKind::kDsa)), (8u + 4) * 2 * 2 + (16 + 16 / 8 * 4) * 2);
  EXPECT_EQ(BytesPerToken(KindSpec(PoolKind::kDsaIndexer)), (16u + 8) * 2);
  EXPECT_EQ(BytesPerToken(KindSpec(PoolKind::kMamba)), (6u * 4 + 4 * 2 + 4 * 2) * 2);
  EXPECT_EQ(BytesPerPage(KindSpec(PoolKind::kV4Paged)), 2u * 24);
  EXPECT_EQ(BytesPerToken(KindSpec(PoolKind::kV4Paged)), 2u * 24 / 4);
  PoolSpec v4 = KindSpec(PoolKind::kV4Paged);
  v4.item_bytes = 25;  // 50 bytes per page: 12.5 per token, floored
  EXPECT_EQ(BytesPerToken(v4), 12u);
  EXPECT_EQ(BytesPerPage(KindSpec(PoolKind::kV4State)), 2u * 3 * 8);
  EXPECT_EQ(BytesPerPage(KindSpec(PoolKind::kLogical)), 0u);
}

TEST(KindSizingTest, PageRowKindsSizeBytesInWholePages) {
  PoolSpec v4 = KindSpec(PoolKind::kV4Paged);
  v4.item_bytes = 25, v4.size_tokens = 0, v4.size_bytes = 50 * 7 + 49;  // 7 pages fit
  ASSERT_TRUE(ResolveSizeTokens(v4).ok());
  EXPECT_EQ(*ResolveSizeTokens(v4), 7u * 4);
}

TEST(KindSizingTest, LogicalSizeMustBePageAligned) {
  PoolSpec s = KindSpec(PoolKind::kLogical);
  s.size_tokens = 66;  // not rounded up, as in the seeds (S0:1179)
  absl::StatusOr<uint64_t> t = ResolveSizeTokens(s);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Msg(t.status()), HasSubstr("page-aligned"));
  s.size_tokens = 0, s.host_to_device_ratio = 2, s.device_size_tokens = 32;
  ASSERT_TRUE(ResolveSizeTokens(s).ok());
  EXPECT_EQ(*ResolveSizeTokens(s), 64u);
  s.device_size_tokens = 33;  // 66
  EXPECT_EQ(ResolveSizeTokens(s).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(KindSizingTest, MambaIsOneSlotPages) {
  PoolSpec s = KindSpec(PoolKind::kMamba);
  s.size_tokens = 7;
  ASSERT_TRUE(ResolveSizeTokens(s).ok());
  EXPECT_EQ(*ResolveSizeTokens(s), 7u);
}

// ============================================================ followers, replicas, pages

class KindRegistryTest : public RegistryTest {
 protected:
  std::shared_ptr<Pool> Make(PoolRegistry& reg, const std::string& name, PoolSpec s) {
    absl::StatusOr<std::shared_ptr<Pool>> p = reg.Create(name, s);
    EXPECT_TRUE(p.ok()) << p.status();
    return p.ok() ? *p : nullptr;
  }
};

TEST_F(KindRegistryTest, FollowerTakesSizeAndAllocatorOfTheFollowed) {
  PoolRegistry reg(Options(dir_.path(), &mem_));
  std::shared_ptr<Pool> anchor = Make(reg, "anchor", KindSpec(PoolKind::kMha));
  ASSERT_NE(anchor, nullptr);
  PoolSpec k = KindSpec(PoolKind::kKOnly);
  k.page_size = 0;  // inherited
  std::shared_ptr<Pool> follower = Make(reg, "idx", k);
  ASSERT_NE(follower, nullptr);
  EXPECT_EQ(follower->size_tokens(), 64u);
  EXPECT_EQ(follower->spec().page_size, 4u);
  EXPECT_EQ(follower->follows(), anchor);
  EXPECT_EQ(follower->allocator_owner(), anchor.get());
  EXPECT_EQ(anchor->followers(), std::vector<std::string>{"idx"});
  EXPECT_EQ(follower->bytes(), 64u * 2 * 2 * 8 * 2);
  EXPECT_EQ(reg.used_bytes(), anchor->bytes() + follower->bytes());
  // No allocator of its own: Alloc / Free name both pools; nothing changes.
  absl::StatusOr<std::vector<uint64_t>> a = follower->AllocPages(4);
  EXPECT_EQ(a.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(Msg(a.status()), HasSubstr("'idx' (K_ONLY/PAGE_FIRST) follows 'anchor'"));
  const int64_t page[4] = {0, 1, 2, 3};
  EXPECT_EQ(follower->Free(page).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(anchor->allocator().available_tokens(), 64u);
  // Slots allocated in the followed pool are the follower's too.
  ASSERT_TRUE(anchor->AllocPages(4).ok());
  EXPECT_EQ(follower->allocator().available_tokens(), 60u);
  EXPECT_TRUE(follower->allocator().CheckAllocated(page).ok());
  EXPECT_TRUE(follower->CheckPage(0).ok());
  EXPECT_EQ(follower->CheckPage(4).code(), absl::StatusCode::kFailedPrecondition);
  // The followed pool stays while followed.
  absl::StatusOr<uint64_t> del = reg.Delete("anchor");
  EXPECT_EQ(del.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(Msg(del.status()), HasSubstr("followed by idx"));
  EXPECT_TRUE(reg.Get("anchor").ok());
  EXPECT_TRUE(anchor->AcquireAttachment().ok());  // not retired by the refusal
  anchor->ReleaseAttachment();
  ASSERT_TRUE(reg.Delete("idx").ok());
  EXPECT_TRUE(anchor->followers().empty());
  EXPECT_TRUE(reg.Delete("anchor").ok());
}

TEST_F(KindRegistryTest, FollowerErrorsCreateNothing) {
  PoolRegistry reg(Options(dir_.path(), &mem_));
  ASSERT_NE(Make(reg, "anchor", KindSpec(PoolKind::kMha)), nullptr);
  ASSERT_NE(Make(reg, "mla", KindSpec(PoolKind::kMla)), nullptr);
  const uint64_t used = reg.used_bytes();
  const size_t files = dir_.Files().size();
  struct C {
    PoolSpec spec;
    absl::StatusCode code;
    const char* needle;
  };
  std::vector<C> cases;
  PoolSpec s = KindSpec(PoolKind::kKOnly);
  s.follows = "nope";
  cases.push_back({s, absl::StatusCode::kNotFound, "'nope' not found"});
  s = KindSpec(PoolKind::kKOnly);
  s.follows = "mla";
  cases.push_back({s, absl::StatusCode::kInvalidArgument, "is a MLA pool"});
  s = KindSpec(PoolKind::kDsaIndexer);
  cases.push_back({s, absl::StatusCode::kInvalidArgument, "MLA or DSA"});
  s = KindSpec(PoolKind::kKOnly);
  s.page_size = 8;
  cases.push_back({s, absl::StatusCode::kInvalidArgument, "spec.page_size 8"});
  s = KindSpec(PoolKind::kKOnly);
  s.size_tokens = 128;
  cases.push_back({s, absl::StatusCode::kInvalidArgument, "128 tokens"});
  s = KindSpec(PoolKind::kKOnly);
  s.follows.clear();
  cases.push_back({s, absl::StatusCode::kInvalidArgument, "spec.follows is required"});
  for (const C& c : cases) {
    absl::StatusOr<std::shared_ptr<Pool>> p = reg.Create("f", c.spec);
    EXPECT_EQ(p.status().code(), c.code) << p.status();
    EXPECT_THAT(Msg(p.status()), HasSubstr(c.needle));
  }
  s = KindSpec(PoolKind::kKOnly);
  s.size_tokens = 64;  // agreeing sizing is fine
  EXPECT_TRUE(reg.Create("agree", s).ok());
  ASSERT_TRUE(reg.Delete("agree").ok());
  EXPECT_EQ(reg.used_bytes(), used);
  EXPECT_EQ(dir_.Files().size(), files);
  EXPECT_TRUE((*reg.Get("anchor"))->followers().empty());
}

// Issue 12, finding 9: followers of a protected pool were open to anyone.
TEST_F(KindRegistryTest, FollowerIsProtectedByTheFollowedPoolsToken) {
  PoolRegistry reg(Options(dir_.path(), &mem_));
  const std::string token = "s3cret";
  const std::string wrong = "wr0ng";
  ASSERT_TRUE(reg.Create("anchor", KindSpec(PoolKind::kMha), {}, token).ok());
  // Creating one needs the followed pool's token.
  EXPECT_EQ(reg.Create("idx", KindSpec(PoolKind::kKOnly)).status().code(),
            absl::StatusCode::kPermissionDenied);
  absl::StatusOr<std::shared_ptr<Pool>> idx =
      reg.Create("idx", KindSpec(PoolKind::kKOnly), {}, "", &token);
  ASSERT_TRUE(idx.ok()) << idx.status();
  EXPECT_TRUE((*idx)->owner_protected());
  EXPECT_EQ(&(*idx)->token_owner(), reg.Get("anchor")->get());
  // Every protected call checks the followed pool's token.
  absl::Status none = CheckPoolOwner(**idx, nullptr);
  EXPECT_EQ(none.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(Msg(none), HasSubstr("'idx'"));
  EXPECT_THAT(Msg(none), HasSubstr("'anchor'"));
  EXPECT_EQ(CheckPoolOwner(**idx, &wrong).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(CheckPoolOwner(**idx, &token).ok());
  const std::vector<std::string> names = {"idx"};
  EXPECT_EQ(reg.CheckOwner(names, nullptr).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(reg.CheckOwner(names, &wrong).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(reg.CheckOwner(names, &token).ok());
  // Its own owner_token may only be the followed pool's.
  absl::StatusOr<std::shared_ptr<Pool>> same =
      reg.Create("same", KindSpec(PoolKind::kKOnly), {}, token, &token);
  ASSERT_TRUE(same.ok()) << same.status();
  EXPECT_TRUE(CheckPoolOwner(**same, &token).ok());
  EXPECT_EQ(CheckPoolOwner(**same, nullptr).code(), absl::StatusCode::kPermissionDenied);
  const size_t files = dir_.Files().size();
  const uint64_t used = reg.used_bytes();
  absl::StatusOr<std::shared_ptr<Pool>> other =
      reg.Create("other", KindSpec(PoolKind::kKOnly), {}, wrong, &token);
  EXPECT_EQ(other.status().code(), absl::StatusCode::kInvalidArgument) << other.status();
  EXPECT_THAT(Msg(other.status()), HasSubstr("'anchor'"));
  EXPECT_THAT(Msg(other.status()), Not(HasSubstr(wrong)));
  EXPECT_THAT(Msg(other.status()), Not(HasSubstr(token)));
  // A follower of an unprotected pool takes no token of its own either.
  ASSERT_TRUE(reg.Create("open", KindSpec(PoolKind::kMha)).ok());
  PoolSpec f = KindSpec(PoolKind::kKOnly);
  f.follows = "open";
  absl::StatusOr<std::shared_ptr<Pool>> own = reg.Create("own", f, {}, token);
  EXPECT_EQ(own.status().code(), absl::StatusCode::kInvalidArgument) << own.status();
  EXPECT_THAT(Msg(own.status()), HasSubstr("which has none"));
  EXPECT_TRUE(reg.Get("other").status().code() == absl::StatusCode::kNotFound &&
              reg.Get("own").status().code() == absl::StatusCode::kNotFound);
  EXPECT_EQ(dir_.Files().size(), files + (*reg.Get("open"))->region_paths().size());
  EXPECT_EQ(reg.used_bytes(), used + (*reg.Get("open"))->bytes());
}

// Issue 12, finding 10: tokens gRPC metadata cannot carry made a pool that
// nobody could ever open again.
TEST_F(RegistryTest, OwnerTokenOutsidePrintableAsciiIsRefused) {
  PoolRegistry reg(Options(dir_.path(), &mem_));
  const std::string bad[] = {
      std::string("nul\0byte", 8), "caf\xc3\xa9", "with space", "tab\there", "del\x7f", "\n"};
  for (const std::string& token : bad) {
    absl::StatusOr<std::shared_ptr<Pool>> p = reg.Create("p", MegabyteTokenSpec(16), {}, token);
    EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument) << p.status();
    EXPECT_THAT(Msg(p.status()), HasSubstr("printable ASCII"));
    EXPECT_THAT(Msg(p.status()), HasSubstr("'p'"));
    EXPECT_THAT(Msg(p.status()), Not(HasSubstr(token)));
  }
  EXPECT_TRUE(reg.List().empty());
  EXPECT_TRUE(dir_.Files().empty());
  EXPECT_EQ(reg.used_bytes(), 0u);
  EXPECT_TRUE(reg.Create("p", MegabyteTokenSpec(16), {}, "!Az09~").ok());
}

TEST_F(KindRegistryTest, V4StateFollowsLogicalAndQuotesTheSeed) {
  PoolRegistry reg(Options(dir_.path(), &mem_));
  std::shared_ptr<Pool> logical = Make(reg, "anchor", KindSpec(PoolKind::kLogical));
  ASSERT_NE(logical, nullptr);
  EXPECT_EQ(logical->bytes(), 0u);
  EXPECT_TRUE(logical->region_paths().empty());
  std::shared_ptr<Pool> state = Make(reg, "swa", KindSpec(PoolKind::kV4State));
  ASSERT_NE(state, nullptr);
  EXPECT_EQ(state->bytes(), 64u / 4 * 2 * 3 * 8);
  absl::StatusOr<std::vector<uint64_t>> a = state->AllocPages(4);
  EXPECT_EQ(a.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(Msg(a.status()), HasSubstr("reuses SWA transfer indices"));
  EXPECT_TRUE(state->whole_pages());
  EXPECT_FALSE(logical->whole_pages());
}

TEST_F(KindRegistryTest, ReplicatedKindsCountRanksOthersRefuseASecond) {
  PoolRegistry reg(Options(dir_.path(), &mem_));
  std::shared_ptr<Pool> mla = Make(reg, "mla", KindSpec(PoolKind::kMla));
  std::shared_ptr<Pool> mha = Make(reg, "mha", KindSpec(PoolKind::kMha));
  ASSERT_TRUE(mla && mha);
  ASSERT_TRUE(mla->AcquireAttachment(0).ok());
  ASSERT_TRUE(mla->AcquireAttachment(1).ok());
  ASSERT_TRUE(mla->AcquireAttachment(1).ok());
  EXPECT_EQ(mla->replica_ranks(), 2u);
  EXPECT_EQ(mla->bytes_saved(), mla->bytes());
  mla->ReleaseAttachment(1);
  EXPECT_EQ(mla->replica_ranks(), 2u);
  mla->ReleaseAttachment(1);
  EXPECT_EQ(mla->replica_ranks(), 1u);
  EXPECT_EQ(mla->bytes_saved(), 0u);
  ASSERT_TRUE(mha->AcquireAttachment().ok());  // no rank = rank 0
  ASSERT_TRUE(mha->AcquireAttachment(0).ok());
  absl::Status second = mha->AcquireAttachment(1);
  EXPECT_EQ(second.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(Msg(second), HasSubstr("MHA/PAGE_FIRST"));
  EXPECT_THAT(Msg(second), HasSubstr("tp_rank 1"));
  EXPECT_EQ(mha->attachments(), 2u);  // the refusal changed nothing
  EXPECT_EQ(mha->replica_ranks(), 1u);
  EXPECT_EQ(mha->bytes_saved(), 0u);
  mha->ReleaseAttachment();
  mha->ReleaseAttachment(0);
  EXPECT_TRUE(mha->AcquireAttachment(1).ok());  // rank 0 gone: rank 1 may attach
  mha->ReleaseAttachment(1);
  mla->ReleaseAttachment(0);
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
    absl::StatusOr<std::vector<RegionSegment>> m = ph->SplitHeadsMeta(slots, f);
    EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument) << f;
    EXPECT_THAT(Msg(m.status()), HasSubstr("split_factor"));
  }
  absl::StatusOr<std::vector<RegionSegment>> m = ph->SplitHeadsMeta(slots, 2);
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
  absl::StatusOr<std::vector<RegionSegment>> m = idx->PageBufferMeta(slots);
  EXPECT_EQ(m.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(Msg(m.status()), HasSubstr("DSA_INDEXER/LAYER_FIRST"));
}

// ---------------------------------------------------------------------------
// Pool groups (server/pool/pool_group.h, the registry's group methods).

GroupEntrySpec Entry(std::string name, std::string pool, std::vector<int32_t> map = {},
                     bool anchor = false) {
  return GroupEntrySpec{std::move(name), std::move(pool), std::move(map), anchor};
}

// Pools of a hybrid model: "attn" MHA holding device layers [0, 4), "ssm"
// MAMBA holding [0, 2), "shard" MHA holding [2, 4), "lat" MLA holding [0, 2).
class GroupRegistryTest : public KindRegistryTest {
 protected:
  void SetUp() override {
    KindRegistryTest::SetUp();
    PoolSpec attn = KindSpec(PoolKind::kMha);
    attn.layer_num = 4;
    ASSERT_NE(Make(reg_, "attn", attn), nullptr);
    ASSERT_NE(Make(reg_, "ssm", KindSpec(PoolKind::kMamba)), nullptr);
    PoolSpec shard = KindSpec(PoolKind::kMha);
    shard.start_layer = 2;
    ASSERT_NE(Make(reg_, "shard", shard), nullptr);
    ASSERT_NE(Make(reg_, "lat", KindSpec(PoolKind::kMla)), nullptr);
  }
  // No group exists and no pool is in one.
  void ExpectNoGroups() {
    EXPECT_TRUE(reg_.ListGroups().empty());
    for (const std::shared_ptr<Pool>& p : reg_.List()) EXPECT_EQ(p->group(), "") << p->name();
  }
  PoolRegistry reg_{Options(dir_.path(), &mem_)};
};

struct BadGroup {
  std::string label;
  std::string name;
  uint32_t layer_num;
  std::vector<GroupEntrySpec> entries;
  absl::StatusCode code;
  std::vector<std::string> needles;
};

std::ostream& operator<<(std::ostream& os, const BadGroup& b) { return os << b.label; }

std::vector<GroupEntrySpec> NineEntries() {
  std::vector<GroupEntrySpec> e;
  for (int i = 0; i < 9; ++i) e.push_back(Entry(absl::StrCat("e", i), absl::StrCat("p", i)));
  return e;
}

const BadGroup kBadGroups[] = {
    {"bad_group_name",
     "a b",
     4,
     {Entry("kv", "attn")},
     absl::StatusCode::kInvalidArgument,
     {"group name 'a b'"}},
    {"layer_num_0",
     "g",
     0,
     {Entry("kv", "attn")},
     absl::StatusCode::kInvalidArgument,
     {"group 'g'", "layer_num"}},
    {"layer_num_over_cap",
     "g",
     kMaxLayers + 1,
     {Entry("kv", "attn")},
     absl::StatusCode::kInvalidArgument,
     {"group 'g'", "layer_num 4097 is over the limit of 4096"}},
    // 2^32 - 1 with a map of one value: the cap is checked before the map.
    {"layer_num_max",
     "g",
     4294967295u,
     {Entry("kv", "attn", {0})},
     absl::StatusCode::kInvalidArgument,
     {"layer_num 4294967295 is over the limit"}},
    {"no_entries", "g", 4, {}, absl::StatusCode::kInvalidArgument, {"group 'g'", "0 entries"}},
    {"nine_entries",
     "g",
     4,
     NineEntries(),
     absl::StatusCode::kInvalidArgument,
     {"9 entries", "1 to 8"}},
    {"bad_entry_name",
     "g",
     4,
     {Entry("kv", "attn"), Entry(".x", "ssm")},
     absl::StatusCode::kInvalidArgument,
     {"entries[1]", "'.x'"}},
    {"entry_name_twice",
     "g",
     4,
     {Entry("kv", "attn"), Entry("kv", "ssm")},
     absl::StatusCode::kInvalidArgument,
     {"entries[1] 'kv'", "earlier entry"}},
    {"no_pool",
     "g",
     4,
     {Entry("kv", "")},
     absl::StatusCode::kInvalidArgument,
     {"entries[0] 'kv'", "no pool"}},
    {"pool_twice",
     "g",
     4,
     {Entry("kv", "attn"), Entry("again", "attn")},
     absl::StatusCode::kInvalidArgument,
     {"entries[1] 'again'", "pool 'attn'"}},
    {"map_too_short",
     "g",
     4,
     {Entry("kv", "attn", {0, 1, 2})},
     absl::StatusCode::kInvalidArgument,
     {"entries[0] 'kv'", "3 values", "layer_num 4"}},
    {"two_anchors",
     "g",
     4,
     {Entry("kv", "attn", {}, true), Entry("ssm", "ssm", {}, true)},
     absl::StatusCode::kInvalidArgument,
     {"entries[1] 'ssm'", "second anchor"}},
    {"map_past_the_pool",
     "g",
     4,
     {Entry("kv", "attn"), Entry("ssm", "ssm", {0, 1, 2, -1})},
     absl::StatusCode::kInvalidArgument,
     {"entries[1] 'ssm'", "layer_map[2] = 2", "pool 'ssm'", "MAMBA", "[0, 2)"}},
    {"map_below_minus_one",
     "g",
     4,
     {Entry("kv", "attn", {-2, 1, 2, 3})},
     absl::StatusCode::kInvalidArgument,
     {"entries[0] 'kv'", "layer_map[0] = -2"}},
    {"map_layer_twice",
     "g",
     4,
     {Entry("kv", "attn", {0, -1, 0, -1})},
     absl::StatusCode::kInvalidArgument,
     {"entries[0] 'kv'", "layer_map[2] = 0"}},
    {"map_below_the_shard",
     "g",
     4,
     {Entry("kv", "shard", {0, 1, 2, 3})},
     absl::StatusCode::kInvalidArgument,
     {"layer_map[0] = 0", "pool 'shard'", "[2, 4)"}},
    {"unknown_pool",
     "g",
     4,
     {Entry("kv", "attn"), Entry("x", "nope")},
     absl::StatusCode::kNotFound,
     {"entries[1] 'x'", "pool 'nope'"}},
    {"name_of_a_pool",
     "attn",
     4,
     {Entry("kv", "ssm")},
     absl::StatusCode::kAlreadyExists,
     {"'attn'", "pool"}},
};

class GroupValidationTest : public GroupRegistryTest,
                            public ::testing::WithParamInterface<BadGroup> {};

TEST_P(GroupValidationTest, RefusesNamingEntryAndValueAndCreatesNothing) {
  const BadGroup& b = GetParam();
  absl::StatusOr<std::shared_ptr<PoolGroup>> g = reg_.CreateGroup(b.name, b.layer_num, b.entries);
  ASSERT_FALSE(g.ok());
  EXPECT_EQ(g.status().code(), b.code) << g.status();
  for (const std::string& needle : b.needles) EXPECT_THAT(Msg(g.status()), HasSubstr(needle));
  ExpectNoGroups();
  EXPECT_EQ(reg_.GetGroup(b.name).status().code(), absl::StatusCode::kNotFound);
}

INSTANTIATE_TEST_SUITE_P(Groups, GroupValidationTest, ::testing::ValuesIn(kBadGroups),
                         [](const ::testing::TestParamInfo<BadGroup>& info) {
                           return info.param.label;
                         });

TEST_F(GroupRegistryTest, EmptyMapsAreTheIdentityOverTheHeldLayers) {
  absl::StatusOr<std::shared_ptr<PoolGroup>> g = reg_.CreateGroup(
      "hybrid", 4, {Entry("kv", "attn"), Entry("ssm", "ssm"), Entry("upper", "shard")});
  ASSERT_TRUE(g.ok()) << g.status();
  const std::vector<GroupEntry>& e = (*g)->entries();
  ASSERT_EQ(e.size(), 3u);
  EXPECT_EQ(e[0].layer_map, (std::vector<int32_t>{0, 1, 2, 3}));
  EXPECT_EQ(e[1].layer_map, (std::vector<int32_t>{0, 1, -1, -1}));  // holds [0, 2)
  EXPECT_EQ(e[2].layer_map, (std::vector<int32_t>{-1, -1, 2, 3}));  // holds [2, 4)
  EXPECT_EQ((*g)->anchor_index(), 0u);                              // none flagged: the first
  EXPECT_EQ((*g)->anchor().pool->name(), "attn");
  EXPECT_EQ((*g)->layer_num(), 4u);
  ASSERT_NE((*g)->Find("ssm"), nullptr);
  EXPECT_EQ((*g)->Find("ssm")->pool->name(), "ssm");
  EXPECT_EQ((*g)->Find("nope"), nullptr);
  for (const char* pool : {"attn", "ssm", "shard"}) EXPECT_EQ((*reg_.Get(pool))->group(), "hybrid");
  EXPECT_EQ((*reg_.Get("lat"))->group(), "");
}

TEST_F(GroupRegistryTest, AGivenMapAndAnchorAreKept) {
  // A hybrid model: MHA on model layers 1 and 3, Mamba on 0 and 2.
  absl::StatusOr<std::shared_ptr<PoolGroup>> g = reg_.CreateGroup(
      "hybrid", 4,
      {Entry("kv", "attn", {-1, 0, -1, 1}), Entry("ssm", "ssm", {1, -1, 0, -1}, true)});
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ((*g)->entries()[0].layer_map, (std::vector<int32_t>{-1, 0, -1, 1}));
  EXPECT_EQ((*g)->entries()[1].layer_map, (std::vector<int32_t>{1, -1, 0, -1}));
  EXPECT_EQ((*g)->anchor_index(), 1u);
  EXPECT_EQ((*g)->anchor().name, "ssm");
}

TEST_F(GroupRegistryTest, NamesAreSharedWithPoolsAndAPoolIsInOneGroup) {
  ASSERT_TRUE(reg_.CreateGroup("g1", 4, {Entry("kv", "attn")}).ok());
  absl::StatusOr<std::shared_ptr<PoolGroup>> again = reg_.CreateGroup("g1", 2, {Entry("x", "lat")});
  EXPECT_EQ(again.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(Msg(again.status()), HasSubstr("group 'g1' already exists"));
  absl::StatusOr<std::shared_ptr<Pool>> pool = reg_.Create("g1", KindSpec(PoolKind::kMla));
  EXPECT_EQ(pool.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(Msg(pool.status()), HasSubstr("'g1'"));
  absl::StatusOr<std::shared_ptr<PoolGroup>> taken =
      reg_.CreateGroup("g2", 4, {Entry("s", "ssm"), Entry("kv", "attn")});
  EXPECT_EQ(taken.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(Msg(taken.status()), HasSubstr("entries[1] 'kv'"));
  EXPECT_THAT(Msg(taken.status()), HasSubstr("group 'g1'"));
  // Nothing of g2 stayed: ssm is free for another group.
  EXPECT_EQ((*reg_.Get("ssm"))->group(), "");
  EXPECT_EQ(reg_.GetGroup("g2").status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(reg_.CreateGroup("g3", 2, {Entry("s", "ssm")}).ok());
  std::vector<std::string> names;
  for (const auto& g : reg_.ListGroups()) names.push_back(g->name());
  EXPECT_EQ(names, (std::vector<std::string>{"g1", "g3"}));
}

TEST_F(GroupRegistryTest, DeletesAreRefusedWhileInUse) {
  absl::StatusOr<std::shared_ptr<PoolGroup>> g =
      reg_.CreateGroup("hybrid", 4, {Entry("kv", "attn"), Entry("ssm", "ssm")});
  ASSERT_TRUE(g.ok()) << g.status();
  absl::StatusOr<uint64_t> del = reg_.Delete("ssm");
  EXPECT_EQ(del.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(Msg(del.status()), HasSubstr("group 'hybrid'"));
  EXPECT_TRUE(reg_.Get("ssm").ok());
  ASSERT_TRUE((*g)->AcquireAttachment().ok());
  EXPECT_EQ((*g)->attachments(), 1u);
  absl::Status busy = reg_.DeleteGroup("hybrid");
  EXPECT_EQ(busy.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(Msg(busy), HasSubstr("1 device attachment"));
  EXPECT_TRUE(reg_.GetGroup("hybrid").ok());
  EXPECT_EQ((*reg_.Get("attn"))->group(), "hybrid");
  (*g)->ReleaseAttachment();
  EXPECT_EQ((*g)->attachments(), 0u);
  ASSERT_TRUE(reg_.DeleteGroup("hybrid").ok());
  // A retired group takes no new attachment (a caller still holding it).
  EXPECT_EQ((*g)->AcquireAttachment().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(reg_.DeleteGroup("hybrid").code(), absl::StatusCode::kNotFound);
  ExpectNoGroups();
  EXPECT_TRUE(reg_.Delete("ssm").ok());
  // The name is free for a pool now.
  EXPECT_TRUE(reg_.Create("hybrid", KindSpec(PoolKind::kMla)).ok());
}

TEST_F(GroupRegistryTest, GetPoolOrAnchorResolvesGroupsToTheirAnchor) {
  ASSERT_TRUE(
      reg_.CreateGroup("hybrid", 4, {Entry("kv", "attn"), Entry("ssm", "ssm", {}, true)}).ok());
  absl::StatusOr<std::shared_ptr<Pool>> anchor = reg_.GetPoolOrAnchor("hybrid");
  ASSERT_TRUE(anchor.ok()) << anchor.status();
  EXPECT_EQ((*anchor)->name(), "ssm");
  EXPECT_EQ(*anchor, *reg_.Get("ssm"));
  EXPECT_EQ((*reg_.GetPoolOrAnchor("attn"))->name(), "attn");
  absl::StatusOr<std::shared_ptr<Pool>> none = reg_.GetPoolOrAnchor("nope");
  EXPECT_EQ(none.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(Msg(none.status()), HasSubstr("'nope'"));
  // Get is for pools only.
  EXPECT_EQ(reg_.Get("hybrid").status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(reg_.DeleteGroup("hybrid").ok());
  EXPECT_EQ(reg_.GetPoolOrAnchor("hybrid").status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace kvhost

namespace kvhost {
namespace {

// ---------------------------------------------------------------------------
// Reply bounds (issue 12): the estimates the service checks before building a
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
  for (LayoutKind layout : {LayoutKind::kLayerFirst, LayoutKind::kPageFirst,
                            LayoutKind::kPageFirstDirect, LayoutKind::kPageHead}) {
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
        absl::StatusOr<std::vector<RegionSegment>> meta = pool->PageBufferMeta(slots);
        if (meta.ok()) {
          EXPECT_GE(pool->PageBufferMetaEntries(slots.size()), meta->size()) << pages;
          // Exact for whole pages: the bound is not loose by a factor.
          EXPECT_EQ(pool->PageBufferMetaEntries(slots.size()), meta->size()) << pages;
        }
        for (uint32_t split : {1u, 2u, 4u}) {
          absl::StatusOr<std::vector<RegionSegment>> heads = pool->SplitHeadsMeta(slots, split);
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
        EXPECT_EQ(parts->size(), pool->components().size());
        for (const PagePart& part : *parts) EXPECT_LE(part.dims.size(), kMaxPagePartDims);
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
  // Written in odd chunks that straddle the per-layer segments.
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

// ---------------------------------------------------------------------------
// Releasing bytes: a deleted pool's memory counts until it is unmapped.

TEST_F(RegistryTest, DeletedPoolCountsAsReleasingUntilItsLastReferenceGoes) {
  RegistryOptions o = Options(dir_.path(), &mem_);
  o.memory_limit = 40000000;  // 40 MB: two 16 MB pools
  PoolRegistry reg(o);
  absl::StatusOr<std::shared_ptr<Pool>> a = reg.Create("a", MegabyteTokenSpec(16));
  ASSERT_TRUE(a.ok());
  std::shared_ptr<Pool> held = *a;  // a stream's reference
  a = absl::UnknownError("dropped");
  ASSERT_TRUE(reg.Create("b", MegabyteTokenSpec(16)).ok());
  ASSERT_TRUE(reg.Delete("a").ok());
  EXPECT_TRUE(held->retired());
  EXPECT_EQ(reg.used_bytes(), 16000000u);
  EXPECT_EQ(reg.releasing_bytes(), 16000000u);
  std::string why;
  absl::StatusOr<uint64_t> avail = reg.Available(&why);
  ASSERT_TRUE(avail.ok());
  EXPECT_EQ(*avail, 8000000u);
  EXPECT_THAT(why, HasSubstr("of deleted pools still mapped"));
  absl::StatusOr<std::shared_ptr<Pool>> c = reg.Create("c", MegabyteTokenSpec(16));
  EXPECT_EQ(c.status().code(), absl::StatusCode::kResourceExhausted) << c.status();
  EXPECT_THAT(Msg(c.status()), HasSubstr("still mapped"));
  held.reset();  // handed to the releaser thread, which unmaps it
  ASSERT_TRUE(WaitForReleases(reg));
  EXPECT_EQ(reg.releasing_bytes(), 0u);
  EXPECT_TRUE(reg.Create("c", MegabyteTokenSpec(16)).ok());
}

TEST_F(RegistryTest, ADeletedPoolMayOutliveTheRegistry) {
  std::shared_ptr<Pool> held;
  {
    PoolRegistry reg(Options(dir_.path(), &mem_));
    absl::StatusOr<std::shared_ptr<Pool>> a = reg.Create("a", MegabyteTokenSpec(16));
    ASSERT_TRUE(a.ok());
    held = *a;
    ASSERT_TRUE(reg.Delete("a").ok());
  }
  held.reset();  // its notice finds no registry: nothing to credit, no crash
  SUCCEED();
}

TEST_F(RegistryTest, TransientReservationsCountAgainstTheMemoryLimit) {
  RegistryOptions o = Options(dir_.path(), &mem_);
  o.memory_limit = 20000000;
  PoolRegistry reg(o);
  ASSERT_TRUE(reg.Create("a", MegabyteTokenSpec(16)).ok());
  absl::StatusOr<TransientReservation> r = reg.ReserveTransient(3000000, "ReadPages of pool 'a'");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(reg.transient_bytes(), 3000000u);
  absl::StatusOr<TransientReservation> over = reg.ReserveTransient(2000000, "WritePages");
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(Msg(over.status()), HasSubstr("--memory-limit"));
  EXPECT_EQ(reg.transient_bytes(), 3000000u);
  EXPECT_EQ(*reg.Available(), 1000000u);
  TransientReservation moved = *std::move(r);
  EXPECT_EQ(reg.transient_bytes(), 3000000u);
  moved = TransientReservation();
  EXPECT_EQ(reg.transient_bytes(), 0u);
  EXPECT_TRUE(reg.ReserveTransient(4000000, "x").ok());  // given back at once
  EXPECT_EQ(reg.transient_bytes(), 0u);
}

// A group's layer maps are bounded before the group exists.
TEST_F(GroupRegistryTest, GroupWhoseRepliesCannotBeSentIsNotCreated) {
  absl::StatusOr<std::shared_ptr<PoolGroup>> g =
      reg_.CreateGroup("g", 4, {Entry("kv", "attn"), Entry("ssm", "ssm")}, 7);
  EXPECT_EQ(g.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(Msg(g.status()), HasSubstr("8 layer-map values, over the 7"));
  ExpectNoGroups();
  EXPECT_TRUE(reg_.CreateGroup("g", 4, {Entry("kv", "attn"), Entry("ssm", "ssm")}, 8).ok());
}

}  // namespace
}  // namespace kvhost
