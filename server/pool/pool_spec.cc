#include "server/pool/pool_spec.h"

#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

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

// One dimension product past this is a request no host can hold; refusing it
// early keeps every later multiplication free of overflow.
constexpr uint64_t kMaxRowBytes = uint64_t{1} << 32;

absl::Status NeedPositive(uint32_t value, const char* field, const PoolSpec& spec) {
  if (value == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("spec.", field, " must be >= 1 for ", PoolKindName(spec.kind)));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateSpec(const PoolSpec& spec) {
  if (spec.kind != PoolKind::kMha && spec.kind != PoolKind::kMla) {
    return absl::InvalidArgumentError(
        absl::StrCat("spec.kind ", static_cast<int>(spec.kind), " is not a supported pool kind"));
  }
  if (spec.layout < LayoutKind::kLayerFirst || spec.layout > LayoutKind::kPageHead) {
    return absl::InvalidArgumentError(
        absl::StrCat("spec.layout ", static_cast<int>(spec.layout), " is not a known layout"));
  }
  if (DTypeSize(spec.dtype) == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("spec.dtype ", static_cast<int>(spec.dtype), " is not a known dtype"));
  }
  if (absl::Status s = NeedPositive(spec.page_size, "page_size", spec); !s.ok()) return s;
  if (absl::Status s = NeedPositive(spec.layer_num, "layer_num", spec); !s.ok()) return s;
  if (spec.kind == PoolKind::kMha) {
    if (absl::Status s = NeedPositive(spec.head_num, "head_num", spec); !s.ok()) return s;
    if (absl::Status s = NeedPositive(spec.head_dim, "head_dim", spec); !s.ok()) return s;
    if (spec.v_head_dim != 0 && spec.v_head_dim != spec.head_dim) {
      return absl::InvalidArgumentError(absl::StrCat(
          "spec.v_head_dim ", spec.v_head_dim, " differs from spec.head_dim ", spec.head_dim,
          "; MHA pools need equal K and V head dims (asymmetric MHA is a separate kind)"));
    }
    // head_num x head_dim < 2^64, but RowBytes (x the dtype size) can wrap and
    // then pass the row-size check below.
    if (uint64_t{spec.head_num} * spec.head_dim >= kMaxRowBytes / DTypeSize(spec.dtype)) {
      return absl::InvalidArgumentError(
          absl::StrCat("spec.head_num ", spec.head_num, " x spec.head_dim ", spec.head_dim, " x ",
                       DTypeSize(spec.dtype), " bytes per element is too large a row"));
    }
  } else {
    if (uint64_t{spec.kv_lora_rank} + spec.qk_rope_head_dim == 0) {
      return absl::InvalidArgumentError(
          "spec.kv_lora_rank + spec.qk_rope_head_dim must be >= 1 for MLA");
    }
    if (spec.layout == LayoutKind::kPageHead) {
      return absl::InvalidArgumentError(
          "spec.layout PAGE_HEAD is not supported for MLA (it has no heads to split); use "
          "LAYER_FIRST, PAGE_FIRST or PAGE_FIRST_DIRECT");
    }
  }
  if (RowBytes(spec) >= kMaxRowBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("spec row of ", RowBytes(spec), " bytes per token and layer is too large"));
  }
  // RowBytes < 2^32 and layer_num < 2^32, so this product cannot wrap; the
  // full BytesPerToken (x planes) could, and then pass the check.
  const uint64_t layer_bytes = RowBytes(spec) * spec.layer_num;
  if (layer_bytes >= kMaxRowBytes / PlaneCount(spec)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "spec needs ", layer_bytes, " x ", PlaneCount(spec), " bytes per token; too large"));
  }
  if (spec.host_to_device_ratio < 0 || std::isnan(spec.host_to_device_ratio)) {
    return absl::InvalidArgumentError(
        absl::StrCat("spec.host_to_device_ratio ", spec.host_to_device_ratio, " must be >= 0"));
  }
  return absl::OkStatus();
}

uint32_t PlaneCount(const PoolSpec& spec) { return spec.kind == PoolKind::kMha ? 2 : 1; }

uint64_t RowBytes(const PoolSpec& spec) {
  const uint64_t b = DTypeSize(spec.dtype);
  if (spec.kind == PoolKind::kMha) return uint64_t{spec.head_num} * spec.head_dim * b;
  return (uint64_t{spec.kv_lora_rank} + spec.qk_rope_head_dim) * b;
}

uint64_t BytesPerToken(const PoolSpec& spec) {
  return RowBytes(spec) * spec.layer_num * PlaneCount(spec);
}

absl::StatusOr<uint64_t> ResolveSizeTokens(const PoolSpec& spec) {
  uint64_t tokens = 0;
  const char* rule = "";
  if (spec.size_tokens > 0) {
    tokens = spec.size_tokens;
    rule = "spec.size_tokens";
  } else if (spec.size_bytes > 0) {
    tokens = spec.size_bytes / BytesPerToken(spec);
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
    return absl::InvalidArgumentError(
        "spec gives no size: set size_tokens, size_bytes, or host_to_device_ratio with "
        "device_size_tokens");
  }
  if (tokens == 0) {
    return absl::InvalidArgumentError(absl::StrCat(rule, " gives a pool of 0 tokens (",
                                                   BytesPerToken(spec), " bytes per token)"));
  }
  const uint64_t ps = spec.page_size;
  // Overflow guard: a pool this large could never be backed by memory anyway.
  if (tokens > (uint64_t{1} << 48)) {
    return absl::InvalidArgumentError(absl::StrCat(rule, " gives ", tokens, " tokens; too large"));
  }
  const uint64_t rounded = (tokens + ps - 1) / ps * ps;
  // The pool's bytes must fit in 64 bits, or the layout's offsets wrap past
  // the end of a buffer sized by the wrapped product.
  if (rounded > std::numeric_limits<uint64_t>::max() / BytesPerToken(spec)) {
    return absl::InvalidArgumentError(absl::StrCat(rule, " gives ", rounded, " tokens of ",
                                                   BytesPerToken(spec), " bytes; too large"));
  }
  return rounded;
}

KvLayout MakeKvLayout(const PoolSpec& spec, uint64_t size_tokens) {
  const uint64_t b = DTypeSize(spec.dtype);
  if (spec.kind == PoolKind::kMha) {
    return KvLayout(spec.layout, 2, spec.layer_num, size_tokens, spec.page_size, spec.head_num,
                    uint64_t{spec.head_dim} * b);
  }
  return KvLayout(spec.layout, 1, spec.layer_num, size_tokens, spec.page_size, 1,
                  (uint64_t{spec.kv_lora_rank} + spec.qk_rope_head_dim) * b);
}

std::string DescribeSpec(const PoolSpec& spec) {
  std::string dims = spec.kind == PoolKind::kMha
                         ? absl::StrFormat("H=%u D=%u", spec.head_num, spec.head_dim)
                         : absl::StrFormat("C=%u+%u", spec.kv_lora_rank, spec.qk_rope_head_dim);
  return absl::StrFormat("%s/%s %s L=%u %s ps=%u", PoolKindName(spec.kind), LayoutName(spec.layout),
                         DTypeName(spec.dtype), spec.layer_num, dims, spec.page_size);
}

}  // namespace kvhost
