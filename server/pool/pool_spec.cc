#include "server/pool/pool_spec.h"

#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace kvhost {

const char* PoolKindName(PoolKind kind) {
  switch (kind) {
    case PoolKind::kMha:
      return "MHA";
    case PoolKind::kMla:
      return "MLA";
    case PoolKind::kMhaAsymmetric:
      return "MHA_ASYMMETRIC";
    case PoolKind::kKOnly:
      return "K_ONLY";
    case PoolKind::kDsa:
      return "DSA";
    case PoolKind::kDsaIndexer:
      return "DSA_INDEXER";
    case PoolKind::kMamba:
      return "MAMBA";
    case PoolKind::kV4Paged:
      return "V4_PAGED";
    case PoolKind::kV4State:
      return "V4_STATE";
    case PoolKind::kLogical:
      return "LOGICAL";
  }
  return "?";
}

const char* LayoutName(LayoutKind layout) {
  switch (layout) {
    case LayoutKind::kLayerFirst:
      return "LAYER_FIRST";
    case LayoutKind::kPageFirst:
      return "PAGE_FIRST";
    case LayoutKind::kPageFirstDirect:
      return "PAGE_FIRST_DIRECT";
    case LayoutKind::kPageHead:
      return "PAGE_HEAD";
    case LayoutKind::kPageUnified:
      return "PAGE_UNIFIED";
  }
  return "?";
}

const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kBf16:
      return "BF16";
    case DType::kFp16:
      return "FP16";
    case DType::kFp32:
      return "FP32";
    case DType::kFp8E4m3:
      return "FP8_E4M3";
    case DType::kFp8E5m2:
      return "FP8_E5M2";
    case DType::kUint8:
      return "UINT8";
  }
  return "?";
}

uint32_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kFp32:
      return 4;
    case DType::kBf16:
    case DType::kFp16:
      return 2;
    case DType::kFp8E4m3:
    case DType::kFp8E5m2:
    case DType::kUint8:
      return 1;
  }
  return 0;
}

namespace {

// A token row past this is a request no host can hold; refusing it early
// keeps every later multiplication free of overflow.
constexpr uint64_t kMaxRowBytes = uint64_t{1} << 32;
// A page row (ps token rows' worth, V4 items) is allowed up to this.
constexpr uint64_t kMaxPageRowBytes = uint64_t{1} << 48;
// Component slots of a pool: Mamba's temporal state plus up to 7 conv states.
constexpr size_t kMaxConvStates = 7;
// Dimensions of one Mamba state shape: the seeds' have 2 (conv) or 3
// (temporal); the cap bounds what a spec (and so GetPool) carries.
constexpr size_t kMaxStateDims = 8;

uint32_t Bit(PoolKind kind) { return 1u << static_cast<uint32_t>(kind); }
uint32_t Bit(LayoutKind layout) { return 1u << static_cast<uint32_t>(layout); }

constexpr uint32_t kLf = 1u << 1, kPf = 1u << 2, kPfd = 1u << 3, kPh = 1u << 4, kPu = 1u << 5;

// Layouts each kind supports (the union of the seeds' backends, and sglang's
// page_unified for the token-row kinds of one region).
uint32_t AllowedLayouts(PoolKind kind) {
  switch (kind) {
    case PoolKind::kMha:
    case PoolKind::kLogical:
      return kLf | kPf | kPfd | kPh | kPu;
    case PoolKind::kMla:
    case PoolKind::kKOnly:
      return kLf | kPf | kPfd | kPu;
    case PoolKind::kDsaIndexer:
    case PoolKind::kV4Paged:
    case PoolKind::kV4State:
      return kLf | kPf | kPfd;
    case PoolKind::kMhaAsymmetric:
      return kPf | kPfd;
    case PoolKind::kDsa:
      return kLf;
    case PoolKind::kMamba:
      return kPfd;
  }
  return 0;
}

bool KnownKind(PoolKind kind) { return kind >= PoolKind::kMha && kind <= PoolKind::kLogical; }

// "LAYER_FIRST, PAGE_FIRST or PAGE_FIRST_DIRECT": the layouts `kind` takes.
std::string AllowedLayoutNames(PoolKind kind) {
  std::vector<const char*> names;
  for (LayoutKind l :
       {LayoutKind::kLayerFirst, LayoutKind::kPageFirst, LayoutKind::kPageFirstDirect,
        LayoutKind::kPageHead, LayoutKind::kPageUnified}) {
    if ((AllowedLayouts(kind) & Bit(l)) != 0) names.push_back(LayoutName(l));
  }
  std::string out;
  for (size_t i = 0; i < names.size(); ++i) {
    absl::StrAppend(&out, i == 0 ? "" : i + 1 == names.size() ? " or " : ", ", names[i]);
  }
  return out;
}

// Kinds whose every row is a page row (no token-row component).
bool PageRowsOnly(PoolKind kind) {
  return kind == PoolKind::kDsaIndexer || kind == PoolKind::kV4Paged || kind == PoolKind::kV4State;
}

// Saturating at 2^64 - 1, so a product too large for any host stays too
// large instead of wrapping into a plausible size.
uint64_t SatMul(uint64_t a, uint64_t b) {
  uint64_t p = 0;
  return __builtin_mul_overflow(a, b, &p) ? std::numeric_limits<uint64_t>::max() : p;
}

uint64_t SatAdd(uint64_t a, uint64_t b) {
  uint64_t s = 0;
  return __builtin_add_overflow(a, b, &s) ? std::numeric_limits<uint64_t>::max() : s;
}

uint64_t Elements(const std::vector<uint32_t>& dims) {
  uint64_t n = 1;
  for (uint32_t d : dims) n = SatMul(n, d);
  return n;
}

// MLA / DSA latent elements (sglang's kv_cache_dim).
uint64_t LatentDim(const PoolSpec& s) {
  return s.kv_cache_dim != 0 ? s.kv_cache_dim : uint64_t{s.kv_lora_rank} + s.qk_rope_head_dim;
}

// DSA_INDEXER / DSA: bytes of one token's index-K entry (FP8 values, then an
// fp32 scale per quant block).
uint64_t IndexTokenBytes(const PoolSpec& s) {
  if (s.index_row_bytes != 0) return s.index_row_bytes;
  if (s.index_quant_block_size == 0) return 0;
  return uint64_t{s.index_head_dim} + uint64_t{s.index_head_dim} / s.index_quant_block_size * 4;
}

// One host buffer before it is placed: name, file, row size, rows per page.
struct RowPlan {
  const char* name;
  std::string suffix;  // region file suffix; one region per distinct suffix
  uint64_t row_bytes;  // saturated at 2^64 - 1 (ValidateSpec refuses it)
  bool page_row;       // a row per page instead of per token
  uint64_t heads;      // token rows split in heads (PAGE_HEAD, PAGE_UNIFIED math)
};

std::vector<RowPlan> PlanRows(const PoolSpec& s) {
  const uint64_t b = DTypeSize(s.dtype);
  const uint64_t ps = s.page_size;
  std::vector<RowPlan> rows;
  switch (s.kind) {
    case PoolKind::kMha:
      rows.push_back({"k", ".kv", SatMul(SatMul(s.head_num, s.head_dim), b), false, s.head_num});
      rows.push_back({"v", ".kv", SatMul(SatMul(s.head_num, s.head_dim), b), false, s.head_num});
      break;
    case PoolKind::kMla:
      rows.push_back({"latent", ".kv", SatMul(LatentDim(s), b), false, 1});
      break;
    case PoolKind::kMhaAsymmetric:
      rows.push_back({"k", ".k", SatMul(SatMul(s.head_num, s.head_dim), b), false, s.head_num});
      rows.push_back({"v", ".v", SatMul(SatMul(s.head_num, s.v_head_dim), b), false, s.head_num});
      break;
    case PoolKind::kKOnly:
      rows.push_back({"k", ".kv", SatMul(SatMul(s.head_num, s.head_dim), b), false, s.head_num});
      break;
    case PoolKind::kDsa:
      rows.push_back({"latent", ".kv", SatMul(LatentDim(s), b), false, 1});
      rows.push_back({"index_k", ".index_k", SatMul(ps, IndexTokenBytes(s)), true, 1});
      break;
    case PoolKind::kDsaIndexer:
      rows.push_back({"index_k", ".kv", SatMul(ps, IndexTokenBytes(s)), true, 1});
      break;
    case PoolKind::kMamba: {
      const uint64_t bt = DTypeSize(s.mamba.temporal_dtype);
      rows.push_back({"temporal", ".temporal", SatMul(Elements(s.mamba.temporal), bt), false, 1});
      static const char* const kConv[kMaxConvStates] = {"conv0", "conv1", "conv2", "conv3",
                                                        "conv4", "conv5", "conv6"};
      for (size_t j = 0; j < s.mamba.conv.size() && j < kMaxConvStates; ++j) {
        rows.push_back({kConv[j], absl::StrCat(".", kConv[j]), SatMul(Elements(s.mamba.conv[j]), b),
                        false, 1});
      }
      break;
    }
    case PoolKind::kV4Paged:
      rows.push_back({"rows", ".kv", s.item_bytes, true, 1});
      break;
    case PoolKind::kV4State:
      rows.push_back({"rows", ".kv", SatMul(s.ring_size, s.state_slot_bytes), true, 1});
      break;
    case PoolKind::kLogical:
      break;
  }
  return rows;
}

std::string Where(const PoolSpec& s) {
  return absl::StrCat(PoolKindName(s.kind), "/", LayoutName(s.layout));
}

absl::Status NeedPositive(uint64_t value, const char* field, const PoolSpec& spec) {
  if (value == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("spec.", field, " must be >= 1 for ", Where(spec)));
  }
  return absl::OkStatus();
}

// A field the kind does not read must be left 0 / empty, so a spec written
// for another kind is refused instead of silently sized differently.
absl::Status CheckUnusedFields(const PoolSpec& s) {
  const uint32_t heads =
      Bit(PoolKind::kMha) | Bit(PoolKind::kMhaAsymmetric) | Bit(PoolKind::kKOnly);
  const uint32_t latent = Bit(PoolKind::kMla) | Bit(PoolKind::kDsa);
  const uint32_t index = Bit(PoolKind::kDsa) | Bit(PoolKind::kDsaIndexer);
  const uint32_t followers =
      Bit(PoolKind::kKOnly) | Bit(PoolKind::kDsaIndexer) | Bit(PoolKind::kV4State);
  const uint32_t all_but_logical = ~Bit(PoolKind::kLogical);
  struct Use {
    const char* field;
    bool set;
    uint32_t kinds;
  };
  const Use uses[] = {
      {"layer_num", s.layer_num != 0, all_but_logical},
      {"start_layer", s.start_layer != 0, all_but_logical},
      {"head_num", s.head_num != 0, heads},
      {"head_dim", s.head_dim != 0, heads},
      {"v_head_dim", s.v_head_dim != 0, Bit(PoolKind::kMha) | Bit(PoolKind::kMhaAsymmetric)},
      {"kv_lora_rank", s.kv_lora_rank != 0, latent},
      {"qk_rope_head_dim", s.qk_rope_head_dim != 0, latent},
      {"kv_cache_dim", s.kv_cache_dim != 0, latent},
      {"index_head_dim", s.index_head_dim != 0, index},
      {"index_quant_block_size", s.index_quant_block_size != 0, index},
      {"index_row_bytes", s.index_row_bytes != 0, Bit(PoolKind::kDsa)},
      {"mamba", !s.mamba.temporal.empty() || !s.mamba.conv.empty(), Bit(PoolKind::kMamba)},
      {"item_bytes", s.item_bytes != 0, Bit(PoolKind::kV4Paged)},
      {"ring_size", s.ring_size != 0, Bit(PoolKind::kV4State)},
      {"state_slot_bytes", s.state_slot_bytes != 0, Bit(PoolKind::kV4State)},
      {"follows", !s.follows.empty(), followers},
      {"size_bytes", s.size_bytes != 0, all_but_logical},
      {"head_groups", s.head_groups != 0, Bit(PoolKind::kMha) | Bit(PoolKind::kKOnly)},
  };
  for (const Use& u : uses) {
    if (u.set && (u.kinds & Bit(s.kind)) == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("spec.", u.field, " is not used by ", Where(s), "; leave it unset"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckLayout(const PoolSpec& s) {
  if ((AllowedLayouts(s.kind) & Bit(s.layout)) != 0) return absl::OkStatus();
  switch (s.kind) {
    case PoolKind::kMla:
      return absl::InvalidArgumentError(
          absl::StrCat("spec.layout PAGE_HEAD is not supported for MLA (it has no heads to split); "
                       "use ",
                       AllowedLayoutNames(s.kind)));
    case PoolKind::kMhaAsymmetric:  // S1:981
      return absl::InvalidArgumentError(
          absl::StrCat("spec.layout ", LayoutName(s.layout), " is not supported for ", Where(s),
                       ": \"Unsupported layout for models with head_dim != v_head_dim\"; use ",
                       AllowedLayoutNames(s.kind)));
    case PoolKind::kDsa:  // S2:881-884
      return absl::InvalidArgumentError(absl::StrCat(
          "spec.layout ", LayoutName(s.layout), " is not supported for ", Where(s),
          ": \"DSA KVStore supports only the layer_first host layout\"; use LAYER_FIRST"));
    case PoolKind::kMamba:  // S0:616
      return absl::InvalidArgumentError(absl::StrCat(
          "spec.layout ", LayoutName(s.layout), " is not supported for ", Where(s),
          ": \"MambaPoolHost only supports layout='page_first_direct'\"; use PAGE_FIRST_DIRECT"));
    default:
      return absl::InvalidArgumentError(absl::StrCat("spec.layout ", LayoutName(s.layout),
                                                     " is not supported for ", Where(s), "; use ",
                                                     AllowedLayoutNames(s.kind)));
  }
}

// PAGE_UNIFIED's head groups: unset (one group) or a divisor of head_num;
// no other layout reads them.
absl::Status CheckHeadGroups(const PoolSpec& s) {
  if (s.head_groups == 0) return absl::OkStatus();
  if (s.layout != LayoutKind::kPageUnified) {
    return absl::InvalidArgumentError(absl::StrCat(
        "spec.head_groups ", s.head_groups, " is only used by the PAGE_UNIFIED layout, not by ",
        Where(s), "; leave it unset"));
  }
  if (s.head_groups > kMaxHeadGroups) {
    return absl::InvalidArgumentError(absl::StrCat("spec.head_groups ", s.head_groups,
                                                   " is over the limit of ", kMaxHeadGroups,
                                                   " for ", Where(s)));
  }
  if (s.head_num % s.head_groups != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "spec.head_groups ", s.head_groups, " does not divide spec.head_num ", s.head_num, " for ",
        Where(s), " (every head group holds the same number of heads)"));
  }
  return absl::OkStatus();
}

absl::Status CheckIndexDims(const PoolSpec& s) {
  if (s.kind == PoolKind::kDsa && s.index_row_bytes != 0) {
    if (s.index_head_dim != 0 || s.index_quant_block_size != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "spec.index_row_bytes and spec.index_head_dim / spec.index_quant_block_size are both "
          "set for ",
          Where(s), "; set one (index_row_bytes overrides the derived size)"));
    }
    return absl::OkStatus();
  }
  if (absl::Status st = NeedPositive(s.index_head_dim, "index_head_dim", s); !st.ok()) return st;
  if (absl::Status st = NeedPositive(s.index_quant_block_size, "index_quant_block_size", s);
      !st.ok()) {
    return st;
  }
  if (s.index_head_dim % s.index_quant_block_size != 0) {
    return absl::InvalidArgumentError(absl::StrCat("spec.index_head_dim ", s.index_head_dim,
                                                   " is not a multiple of "
                                                   "spec.index_quant_block_size ",
                                                   s.index_quant_block_size, " for ", Where(s)));
  }
  return absl::OkStatus();
}

absl::Status CheckByteDtype(const PoolSpec& s) {
  if (DTypeSize(s.dtype) != 1) {
    return absl::InvalidArgumentError(absl::StrCat("spec.dtype ", DTypeName(s.dtype),
                                                   " is not a byte type; ", Where(s),
                                                   " rows are bytes (use UINT8)"));
  }
  return absl::OkStatus();
}

absl::Status CheckMamba(const PoolSpec& s) {
  if (s.page_size != 1) {  // S0:611: page_size is fixed at 1
    return absl::InvalidArgumentError(absl::StrCat(
        "spec.page_size ", s.page_size, " must be 1 for ", Where(s), " (a page is one slot)"));
  }
  if (DTypeSize(s.mamba.temporal_dtype) == 0) {
    return absl::InvalidArgumentError(absl::StrCat("spec.mamba.temporal_dtype ",
                                                   static_cast<int>(s.mamba.temporal_dtype),
                                                   " is not a known dtype for ", Where(s)));
  }
  auto check_shape = [&](const std::vector<uint32_t>& dims, const std::string& field) {
    if (dims.empty() || dims.size() > kMaxStateDims) {
      return absl::InvalidArgumentError(absl::StrCat("spec.", field, " has ", dims.size(),
                                                     " dimensions; ", Where(s), " needs 1 to ",
                                                     kMaxStateDims));
    }
    for (size_t i = 0; i < dims.size(); ++i) {
      if (dims[i] == 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("spec.", field, ".dims[", i, "] must be >= 1 for ", Where(s)));
      }
    }
    return absl::OkStatus();
  };
  if (absl::Status st = check_shape(s.mamba.temporal, "mamba.temporal"); !st.ok()) return st;
  if (s.mamba.conv.empty() || s.mamba.conv.size() > kMaxConvStates) {
    return absl::InvalidArgumentError(absl::StrCat("spec.mamba.conv has ", s.mamba.conv.size(),
                                                   " shapes; ", Where(s), " needs 1 to ",
                                                   kMaxConvStates));
  }
  for (size_t j = 0; j < s.mamba.conv.size(); ++j) {
    if (absl::Status st = check_shape(s.mamba.conv[j], absl::StrCat("mamba.conv[", j, "]"));
        !st.ok()) {
      return st;
    }
  }
  return absl::OkStatus();
}

absl::Status CheckKindFields(const PoolSpec& s) {
  switch (s.kind) {
    case PoolKind::kMha:
    case PoolKind::kKOnly:
    case PoolKind::kMhaAsymmetric:
      if (absl::Status st = NeedPositive(s.head_num, "head_num", s); !st.ok()) return st;
      if (absl::Status st = NeedPositive(s.head_dim, "head_dim", s); !st.ok()) return st;
      if (s.kind == PoolKind::kMha && s.v_head_dim != 0 && s.v_head_dim != s.head_dim) {
        return absl::InvalidArgumentError(absl::StrCat(
            "spec.v_head_dim ", s.v_head_dim, " differs from spec.head_dim ", s.head_dim, " for ",
            Where(s), "; MHA pools need equal K and V head dims (use kind MHA_ASYMMETRIC)"));
      }
      if (s.kind == PoolKind::kMhaAsymmetric && (s.v_head_dim == 0 || s.v_head_dim == s.head_dim)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "spec.v_head_dim ", s.v_head_dim, " must differ from spec.head_dim ", s.head_dim,
            " (and be >= 1) for ", Where(s), "; equal K and V head dims are kind MHA"));
      }
      return CheckHeadGroups(s);
    case PoolKind::kMla:
      if (LatentDim(s) == 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "spec.kv_lora_rank + spec.qk_rope_head_dim (or spec.kv_cache_dim) must be >= 1 for ",
            Where(s)));
      }
      return absl::OkStatus();
    case PoolKind::kDsa:
      if (LatentDim(s) == 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "spec.kv_lora_rank + spec.qk_rope_head_dim (or spec.kv_cache_dim) must be >= 1 for ",
            Where(s)));
      }
      return CheckIndexDims(s);
    case PoolKind::kDsaIndexer:
      if (absl::Status st = CheckByteDtype(s); !st.ok()) return st;
      return CheckIndexDims(s);
    case PoolKind::kMamba:
      return CheckMamba(s);
    case PoolKind::kV4Paged:
      if (absl::Status st = CheckByteDtype(s); !st.ok()) return st;
      return NeedPositive(s.item_bytes, "item_bytes", s);
    case PoolKind::kV4State:
      if (absl::Status st = CheckByteDtype(s); !st.ok()) return st;
      if (absl::Status st = NeedPositive(s.ring_size, "ring_size", s); !st.ok()) return st;
      return NeedPositive(s.state_slot_bytes, "state_slot_bytes", s);
    case PoolKind::kLogical:
      return absl::OkStatus();
  }
  return absl::OkStatus();
}

}  // namespace

bool IsReplicated(PoolKind kind) {
  return kind == PoolKind::kMla || kind == PoolKind::kDsa || kind == PoolKind::kDsaIndexer ||
         kind == PoolKind::kV4Paged || kind == PoolKind::kV4State;
}

bool NeedsFollows(PoolKind kind) {
  return kind == PoolKind::kKOnly || kind == PoolKind::kDsaIndexer || kind == PoolKind::kV4State;
}

bool CanFollow(PoolKind follower, PoolKind followed) {
  switch (follower) {
    case PoolKind::kKOnly:
      return followed == PoolKind::kMha || followed == PoolKind::kMhaAsymmetric ||
             followed == PoolKind::kKOnly;
    case PoolKind::kDsaIndexer:
      return followed == PoolKind::kMla || followed == PoolKind::kDsa;
    case PoolKind::kV4State:
      return followed == PoolKind::kV4Paged || followed == PoolKind::kLogical;
    default:
      return false;
  }
}

const char* FollowableKinds(PoolKind follower) {
  switch (follower) {
    case PoolKind::kKOnly:
      return "MHA, MHA_ASYMMETRIC or K_ONLY";
    case PoolKind::kDsaIndexer:
      return "MLA or DSA";
    case PoolKind::kV4State:
      return "V4_PAGED or LOGICAL";
    default:
      return "no kind";
  }
}

bool MovesWholePages(PoolKind kind) { return kind == PoolKind::kDsa || PageRowsOnly(kind); }

absl::Status ValidateSpec(const PoolSpec& spec) {
  if (!KnownKind(spec.kind)) {
    return absl::InvalidArgumentError(
        absl::StrCat("spec.kind ", static_cast<int>(spec.kind), " is not a supported pool kind"));
  }
  if (spec.layout < LayoutKind::kLayerFirst || spec.layout > LayoutKind::kPageUnified) {
    return absl::InvalidArgumentError(absl::StrCat("spec.layout ", static_cast<int>(spec.layout),
                                                   " is not a known layout for ",
                                                   PoolKindName(spec.kind)));
  }
  if (DTypeSize(spec.dtype) == 0) {
    return absl::InvalidArgumentError(absl::StrCat("spec.dtype ", static_cast<int>(spec.dtype),
                                                   " is not a known dtype for ", Where(spec)));
  }
  if (absl::Status s = CheckLayout(spec); !s.ok()) return s;
  if (absl::Status s = CheckUnusedFields(spec); !s.ok()) return s;
  if (NeedsFollows(spec.kind) && spec.follows.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("spec.follows is required for ", Where(spec),
                     ": it shares the page space and allocator of the pool it follows (",
                     FollowableKinds(spec.kind), ")"));
  }
  if (spec.node_cache && (!spec.follows.empty() || spec.kind == PoolKind::kLogical)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "spec.node_cache is set for ", Where(spec),
        ": a node cache holds its own pages (no follows) with bytes in them (not LOGICAL)"));
  }
  if (absl::Status s = NeedPositive(spec.page_size, "page_size", spec); !s.ok()) return s;
  if (spec.kind != PoolKind::kLogical) {
    if (absl::Status s = NeedPositive(spec.layer_num, "layer_num", spec); !s.ok()) return s;
    if (spec.layer_num > kMaxLayers) {
      return absl::InvalidArgumentError(absl::StrCat("spec.layer_num ", spec.layer_num,
                                                     " is over the limit of ", kMaxLayers,
                                                     " layers for ", Where(spec)));
    }
    if (uint64_t{spec.start_layer} + spec.layer_num > std::numeric_limits<uint32_t>::max()) {
      return absl::InvalidArgumentError(absl::StrCat("spec.start_layer ", spec.start_layer,
                                                     " + spec.layer_num ", spec.layer_num,
                                                     " exceeds 2^32 - 1 for ", Where(spec)));
    }
  }
  if (absl::Status s = CheckKindFields(spec); !s.ok()) return s;
  // Every row, then the bytes of a page over all rows and layers, must stay
  // far from 2^64 so that sizes and offsets computed later cannot wrap.
  uint64_t page_bytes = 0;  // saturating
  for (const RowPlan& row : PlanRows(spec)) {
    const uint64_t limit = row.page_row ? kMaxPageRowBytes : kMaxRowBytes;
    if (row.row_bytes >= limit) {
      return absl::InvalidArgumentError(absl::StrCat("spec gives component '", row.name,
                                                     "' a row of ", row.row_bytes,
                                                     " bytes; too large a row for ", Where(spec)));
    }
    page_bytes = SatAdd(page_bytes, SatMul(SatMul(row.row_bytes, spec.layer_num),
                                           row.page_row ? 1 : spec.page_size));
  }
  if (page_bytes / spec.page_size >= kMaxRowBytes) {
    return absl::InvalidArgumentError(absl::StrCat("spec needs ", page_bytes / spec.page_size,
                                                   " bytes per token for ", Where(spec),
                                                   "; too large"));
  }
  if (spec.host_to_device_ratio < 0 || std::isnan(spec.host_to_device_ratio)) {
    return absl::InvalidArgumentError(
        absl::StrCat("spec.host_to_device_ratio ", spec.host_to_device_ratio, " must be >= 0"));
  }
  return absl::OkStatus();
}

uint32_t PlaneCount(const PoolSpec& spec) {
  switch (spec.kind) {
    case PoolKind::kMha:
      return 2;
    case PoolKind::kMla:
    case PoolKind::kKOnly:
      return 1;
    default:
      return 0;
  }
}

uint32_t HeadGroups(const PoolSpec& spec) {
  return spec.layout == LayoutKind::kPageUnified && spec.head_groups != 0 ? spec.head_groups : 1;
}

uint64_t RowBytes(const PoolSpec& spec) {
  if (PlaneCount(spec) == 0) return 0;
  return PlanRows(spec)[0].row_bytes;
}

uint64_t BytesPerPage(const PoolSpec& spec) {
  uint64_t bytes = 0;
  for (const RowPlan& row : PlanRows(spec)) {
    bytes += row.row_bytes * spec.layer_num * (row.page_row ? 1 : spec.page_size);
  }
  return bytes;
}

uint64_t BytesPerToken(const PoolSpec& spec) {
  return spec.page_size == 0 ? 0 : BytesPerPage(spec) / spec.page_size;
}

absl::StatusOr<uint64_t> ResolveSizeTokens(const PoolSpec& spec) {
  const uint64_t ps = spec.page_size;
  const uint64_t page_bytes = BytesPerPage(spec);
  uint64_t tokens = 0;
  const char* rule = "";
  if (spec.size_tokens > 0) {
    tokens = spec.size_tokens;
    rule = "spec.size_tokens";
  } else if (spec.size_bytes > 0 && page_bytes > 0) {
    // Page-row kinds have no exact bytes per token: whole pages that fit.
    tokens = PageRowsOnly(spec.kind) ? spec.size_bytes / page_bytes * ps
                                     : spec.size_bytes / BytesPerToken(spec);
    rule = "spec.size_bytes";
  } else if (spec.host_to_device_ratio > 0 && spec.device_size_tokens > 0) {
    const double t =
        std::floor(static_cast<double>(spec.device_size_tokens) * spec.host_to_device_ratio);
    if (t >= 9.0e18) {
      return absl::InvalidArgumentError(
          absl::StrCat("spec.host_to_device_ratio ", spec.host_to_device_ratio,
                       " x spec.device_size_tokens ", spec.device_size_tokens, " overflows"));
    }
    tokens = static_cast<uint64_t>(t);
    rule = "spec.host_to_device_ratio x spec.device_size_tokens";
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "spec gives no size for ", Where(spec),
        spec.kind == PoolKind::kLogical
            ? ": set size_tokens, or host_to_device_ratio with device_size_tokens"
            : ": set size_tokens, size_bytes, or host_to_device_ratio with device_size_tokens"));
  }
  if (tokens == 0) {
    return absl::InvalidArgumentError(absl::StrCat(rule, " gives a pool of 0 tokens (",
                                                   BytesPerToken(spec), " bytes per token)"));
  }
  // Overflow guard: a pool this large could never be backed by memory anyway.
  if (tokens > (uint64_t{1} << 48)) {
    return absl::InvalidArgumentError(absl::StrCat(rule, " gives ", tokens, " tokens; too large"));
  }
  if (spec.kind == PoolKind::kLogical) {
    // S0:1179-1183: the logical anchor is never rounded.
    if (tokens % ps != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(rule, " gives ", tokens, " tokens, not a multiple of spec.page_size ", ps,
                       " for ", Where(spec), " (\"LogicalHostPool size must be page-aligned\")"));
    }
    return tokens;
  }
  const uint64_t pages = (tokens + ps - 1) / ps;
  // The pool's bytes must fit in 64 bits, or the layout's offsets wrap past
  // the end of a buffer sized by the wrapped product.
  if (page_bytes > 0 && pages > std::numeric_limits<uint64_t>::max() / page_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(rule, " gives ", pages * ps, " tokens of ",
                                                   BytesPerToken(spec), " bytes; too large"));
  }
  return pages * ps;
}

KvLayout MakeKvLayout(const PoolSpec& spec, uint64_t size_tokens) {
  const uint32_t planes = PlaneCount(spec);
  if (planes == 0) {
    KvLayout index_space(spec.layout, 0, spec.layer_num, size_tokens, spec.page_size, 1, 0);
    return index_space;
  }
  const RowPlan row = PlanRows(spec)[0];
  return KvLayout(spec.layout, planes, spec.layer_num, size_tokens, spec.page_size, row.heads,
                  row.row_bytes / row.heads, HeadGroups(spec));
}

std::vector<Component> MakeComponents(const PoolSpec& spec, uint64_t size_tokens) {
  const std::vector<RowPlan> rows = PlanRows(spec);
  const std::vector<std::string> suffixes = RegionSuffixes(spec);
  // Where the next component of each region starts: after the last one's
  // bytes, or in PAGE_UNIFIED, whose planes interleave, one plane chunk on
  // (the planes of one region are the pool's planes: MHA's K and V).
  std::vector<uint64_t> region_next(suffixes.size(), 0);
  std::vector<Component> out;
  for (const RowPlan& row : rows) {
    Component c;
    c.name = row.name;
    if (row.page_row) {
      // (L, P, R) / (P, L, R) / (P, L, 1, R): the token-row math with ps 1
      // over pages gives exactly these.
      c.layout = KvLayout(spec.layout, 1, spec.layer_num, size_tokens / spec.page_size, 1, 1,
                          row.row_bytes);
      c.row_tokens = spec.page_size;
    } else {
      c.layout = KvLayout(spec.layout, 1, spec.layer_num, size_tokens, spec.page_size, row.heads,
                          row.row_bytes / row.heads, HeadGroups(spec), PlaneCount(spec));
      c.row_tokens = 1;
    }
    for (uint32_t r = 0; r < suffixes.size(); ++r) {
      if (suffixes[r] == row.suffix) c.region = r;
    }
    // Components sharing a file follow each other (MHA: V at V_OFF).
    c.region_offset = region_next[c.region];
    region_next[c.region] +=
        spec.layout == LayoutKind::kPageUnified ? c.layout.plane_stride : c.bytes();
    out.push_back(std::move(c));
  }
  return out;
}

std::vector<std::string> RegionSuffixes(const PoolSpec& spec) {
  std::vector<std::string> out;
  for (const RowPlan& row : PlanRows(spec)) {
    bool seen = false;
    for (const std::string& s : out) seen = seen || s == row.suffix;
    if (!seen) out.push_back(row.suffix);
  }
  return out;
}

std::string DescribeSpec(const PoolSpec& spec) {
  std::string dims;
  switch (spec.kind) {
    case PoolKind::kMha:
    case PoolKind::kKOnly:
      dims = absl::StrFormat("H=%u D=%u", spec.head_num, spec.head_dim);
      break;
    case PoolKind::kMhaAsymmetric:
      dims = absl::StrFormat("H=%u D=%u Dv=%u", spec.head_num, spec.head_dim, spec.v_head_dim);
      break;
    case PoolKind::kMla:
      dims = spec.kv_cache_dim != 0
                 ? absl::StrFormat("C=%u", spec.kv_cache_dim)
                 : absl::StrFormat("C=%u+%u", spec.kv_lora_rank, spec.qk_rope_head_dim);
      break;
    case PoolKind::kDsa:
      dims = absl::StrFormat("%s index_k=%u B/token",
                             spec.kv_cache_dim != 0 ? absl::StrFormat("C=%u", spec.kv_cache_dim)
                                                    : absl::StrFormat("C=%u+%u", spec.kv_lora_rank,
                                                                      spec.qk_rope_head_dim),
                             IndexTokenBytes(spec));
      break;
    case PoolKind::kDsaIndexer:
      dims = absl::StrFormat("index=%u/%u (%u B/token)", spec.index_head_dim,
                             spec.index_quant_block_size, IndexTokenBytes(spec));
      break;
    case PoolKind::kMamba: {
      auto shape = [](const std::vector<uint32_t>& d) {
        return absl::StrCat("[", absl::StrJoin(d, ","), "]");
      };
      dims = absl::StrCat("temporal=", shape(spec.mamba.temporal), "x",
                          DTypeName(spec.mamba.temporal_dtype), " conv=");
      for (size_t j = 0; j < spec.mamba.conv.size(); ++j) {
        absl::StrAppend(&dims, j == 0 ? "" : ",", shape(spec.mamba.conv[j]));
      }
      break;
    }
    case PoolKind::kV4Paged:
      dims = absl::StrFormat("item=%u B", spec.item_bytes);
      break;
    case PoolKind::kV4State:
      dims = absl::StrFormat("ring=%u x %u B", spec.ring_size, spec.state_slot_bytes);
      break;
    case PoolKind::kLogical:
      return absl::StrFormat("%s ps=%u", PoolKindName(spec.kind), spec.page_size);
  }
  if (HeadGroups(spec) > 1) absl::StrAppend(&dims, " G=", HeadGroups(spec));
  std::string out =
      absl::StrFormat("%s/%s %s L=%u %s ps=%u", PoolKindName(spec.kind), LayoutName(spec.layout),
                      DTypeName(spec.dtype), spec.layer_num, dims, spec.page_size);
  if (spec.start_layer != 0) {
    absl::StrAppend(&out, " layers=[", spec.start_layer, ",", spec.start_layer + spec.layer_num,
                    ")");
  }
  if (!spec.follows.empty()) absl::StrAppend(&out, " follows=", spec.follows);
  if (spec.node_cache) absl::StrAppend(&out, " node_cache");
  return out;
}

}  // namespace kvhost
