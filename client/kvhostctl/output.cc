#include "client/kvhostctl/output.h"

#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace kvhost::ctl {
namespace {

std::string ShapeText(const v1::Shape& shape) { return absl::StrJoin(shape.dims(), "x"); }

std::string MambaDims(const v1::PoolSpec& spec) {
  std::vector<std::string> conv;
  for (const v1::Shape& c : spec.mamba().conv()) conv.push_back(ShapeText(c));
  const v1::DType temporal_dtype = spec.mamba().temporal_dtype() == v1::DTYPE_UNSPECIFIED
                                       ? spec.dtype()
                                       : spec.mamba().temporal_dtype();
  return absl::StrCat("temporal ", ShapeText(spec.mamba().temporal()), " ",
                      absl::AsciiStrToLower(v1::DType_Name(temporal_dtype)), ", conv ",
                      absl::StrJoin(conv, ", "));
}

}  // namespace

std::string Gib(uint64_t bytes) {
  return absl::StrFormat("%.2f", static_cast<double>(bytes) / (uint64_t{1} << 30));
}

std::string ShapeOf(const v1::PoolSpec& spec) {
  return absl::StrCat(v1::PoolKind_Name(spec.kind()), "/", v1::Layout_Name(spec.layout()), "/",
                      v1::DType_Name(spec.dtype()));
}

std::string DimsOf(const v1::PoolSpec& spec) {
  const std::string latent =
      spec.kv_cache_dim() != 0
          ? absl::StrCat(spec.kv_cache_dim(), " latent dims")
          : absl::StrCat(spec.kv_lora_rank(), " + ", spec.qk_rope_head_dim(), " latent dims");
  const std::string index = spec.index_row_bytes() != 0
                                ? absl::StrCat("index row ", spec.index_row_bytes(), " bytes")
                                : absl::StrCat("index dim ", spec.index_head_dim(), " / block ",
                                               spec.index_quant_block_size());
  switch (spec.kind()) {
    case v1::MLA:
      return latent;
    case v1::MHA_ASYMMETRIC:
      return absl::StrCat(spec.head_num(), " heads x ", spec.head_dim(), " (K) / ",
                          spec.v_head_dim(), " (V) dims");
    case v1::DSA:
      return absl::StrCat(latent, ", ", index);
    case v1::DSA_INDEXER:
      return index;
    case v1::MAMBA:
      return MambaDims(spec);
    case v1::V4_PAGED:
      return absl::StrCat("item ", spec.item_bytes(), " bytes");
    case v1::V4_STATE:
      return absl::StrCat("ring ", spec.ring_size(), " x ", spec.state_slot_bytes(), " bytes");
    case v1::LOGICAL:
      return "no buffers";
    default:
      return absl::StrCat(spec.head_num(), " heads x ", spec.head_dim(), " dims",
                          spec.head_groups() > 1
                              ? absl::StrCat(" in ", spec.head_groups(), " head groups")
                              : std::string());
  }
}

std::string LayersOf(const v1::Pool& pool) {
  if (pool.spec().start_layer() == 0) return absl::StrCat(pool.spec().layer_num());
  return absl::StrCat("[", pool.spec().start_layer(), ",",
                      pool.spec().start_layer() + pool.spec().layer_num(), ")");
}

std::string StateOf(const v1::Pool& pool) {
  if (pool.state() != v1::CREATING) return v1::PoolState_Name(pool.state());
  const int percent =
      pool.bytes() == 0 ? 0 : static_cast<int>(100.0 * pool.populated_bytes() / pool.bytes());
  return absl::StrCat(v1::PoolState_Name(pool.state()), " ", percent, "%");
}

uint64_t UsedTokens(const v1::Pool& pool) {
  if (pool.state() == v1::CREATING) return 0;  // available_tokens is not filled in
  return pool.size_tokens() > pool.available_tokens() ? pool.size_tokens() - pool.available_tokens()
                                                      : 0;
}

std::string UsedPercentText(const v1::Pool& pool) {
  return pool.state() == v1::CREATING ? std::string("-")
                                      : absl::StrFormat("%.1f", UsedPercent(pool));
}

double UsedPercent(const v1::Pool& pool) {
  return pool.size_tokens() == 0 ? 0.0 : 100.0 * UsedTokens(pool) / pool.size_tokens();
}

JsonObject PoolUsageJson(const v1::Pool& pool) {
  JsonObject usage;
  usage.Str("name", pool.name())
      .Str("state", v1::PoolState_Name(pool.state()))
      .Uint("populated_bytes", pool.populated_bytes())
      .Uint("size_tokens", pool.size_tokens())
      .Uint("used_tokens", UsedTokens(pool))
      .Uint("available_tokens", pool.available_tokens())
      .Num("used_percent", UsedPercent(pool), 2)
      .Uint("bytes", pool.bytes())
      .Uint("attachments", pool.attachments());
  return usage;
}

void PrintRegions(const google::protobuf::RepeatedPtrField<std::string>& paths) {
  for (int r = 0; r < paths.size(); ++r) PrintLine(absl::StrFormat("  region %d: %s", r, paths[r]));
}

}  // namespace kvhost::ctl
