// Tests of PoolSpec validation and sizing (server/pool/pool_spec.h): every
// bad field named, the three size rules, every kind's valid spec, its errors
// (naming kind, layout and field) and its bytes per page and token.
//
// Expected values are computed here from the formulas of SEED_INVENTORY.md §2
// and §4, not from the code under test.
#include "server/pool/pool_spec.h"

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

namespace kvhost {
namespace {

using ::kvhost::testing::KindSpec;
using ::kvhost::testing::kKinds;
using ::kvhost::testing::MhaSpec;
using ::kvhost::testing::Msg;
using ::testing::HasSubstr;

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
        Mutate("Layout6", MhaSpec(), "spec.layout 6",
               [](PoolSpec& s) { s.layout = static_cast<LayoutKind>(6); }),
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
  for (LayoutKind l :
       {LayoutKind::kLayerFirst, LayoutKind::kPageFirst, LayoutKind::kPageFirstDirect,
        LayoutKind::kPageHead, LayoutKind::kPageUnified}) {
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

TEST(ValidateSpecTest, AcceptsPageUnifiedHeadGroupsDividingHeadNum) {
  PoolSpec s = MhaSpec();  // 8 heads
  s.layout = LayoutKind::kPageUnified;
  for (uint32_t g : {0u, 1u, 2u, 4u, 8u}) {
    s.head_groups = g;
    EXPECT_TRUE(ValidateSpec(s).ok()) << "head_groups " << g << ": " << ValidateSpec(s);
    EXPECT_EQ(HeadGroups(s), g == 0 ? 1u : g);
  }
  s.kind = PoolKind::kKOnly, s.follows = "anchor", s.head_groups = 4;
  EXPECT_TRUE(ValidateSpec(s).ok()) << ValidateSpec(s);
  // The layout sizes a page as the other layouts do: only the order differs.
  PoolSpec pf = MhaSpec();
  s = MhaSpec();
  s.layout = LayoutKind::kPageUnified, s.head_groups = 2;
  EXPECT_EQ(BytesPerPage(s), BytesPerPage(pf));
  EXPECT_EQ(BytesPerToken(s), BytesPerToken(pf));
  EXPECT_THAT(DescribeSpec(s), HasSubstr("MHA/PAGE_UNIFIED"));
  EXPECT_THAT(DescribeSpec(s), HasSubstr("G=2"));
}

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
            }),
        // PAGE_UNIFIED (sglang's page_unified): MHA, MLA and K_ONLY only; head
        // groups dividing head_num, for PAGE_UNIFIED's heads only.
        Bad("UnifiedHeadGroupsNotDividing", PoolKind::kMha,
            {"MHA/PAGE_UNIFIED", "spec.head_groups 3", "spec.head_num 2"},
            [](PoolSpec& s) { s.layout = LayoutKind::kPageUnified, s.head_groups = 3; }),
        Bad("UnifiedHeadGroupsOverHeads", PoolKind::kKOnly,
            {"K_ONLY/PAGE_UNIFIED", "spec.head_groups 4", "spec.head_num 2"},
            [](PoolSpec& s) { s.layout = LayoutKind::kPageUnified, s.head_groups = 4; }),
        Bad("UnifiedHeadGroupsOverCap", PoolKind::kMha,
            {"MHA/PAGE_UNIFIED", "spec.head_groups 8192", "limit of 4096"},
            [](PoolSpec& s) {
              s.layout = LayoutKind::kPageUnified, s.head_num = 8192, s.head_dim = 1;
              s.head_groups = 8192;
            }),
        Bad("HeadGroupsWithoutUnified", PoolKind::kMha,
            {"MHA/PAGE_FIRST", "spec.head_groups 2", "PAGE_UNIFIED"},
            [](PoolSpec& s) { s.head_groups = 2; }),
        Bad("HeadGroupsOnMla", PoolKind::kMla, {"MLA/PAGE_UNIFIED", "spec.head_groups", "not used"},
            [](PoolSpec& s) { s.layout = LayoutKind::kPageUnified, s.head_groups = 1; }),
        Bad("AsymPageUnified", PoolKind::kMhaAsymmetric,
            {"MHA_ASYMMETRIC/PAGE_UNIFIED", "spec.layout", "PAGE_FIRST or PAGE_FIRST_DIRECT"},
            [](PoolSpec& s) { s.layout = LayoutKind::kPageUnified; }),
        Bad("AsymHeadGroups", PoolKind::kMhaAsymmetric,
            {"MHA_ASYMMETRIC/PAGE_FIRST", "spec.head_groups", "not used"},
            [](PoolSpec& s) { s.head_groups = 2; }),
        Bad("DsaPageUnified", PoolKind::kDsa, {"DSA/PAGE_UNIFIED", "spec.layout"},
            [](PoolSpec& s) { s.layout = LayoutKind::kPageUnified; }),
        Bad("IndexerPageUnified", PoolKind::kDsaIndexer,
            {"DSA_INDEXER/PAGE_UNIFIED", "spec.layout", "PAGE_FIRST_DIRECT"},
            [](PoolSpec& s) { s.layout = LayoutKind::kPageUnified; }),
        Bad("MambaPageUnified", PoolKind::kMamba, {"MAMBA/PAGE_UNIFIED", "spec.layout"},
            [](PoolSpec& s) { s.layout = LayoutKind::kPageUnified; }),
        Bad("V4PagedPageUnified", PoolKind::kV4Paged, {"V4_PAGED/PAGE_UNIFIED", "spec.layout"},
            [](PoolSpec& s) { s.layout = LayoutKind::kPageUnified; }),
        Bad("V4StatePageUnified", PoolKind::kV4State, {"V4_STATE/PAGE_UNIFIED", "spec.layout"},
            [](PoolSpec& s) { s.layout = LayoutKind::kPageUnified; })),
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

}  // namespace
}  // namespace kvhost
