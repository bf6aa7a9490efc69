#include "client/kvhostctl/spec_flags.h"

#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "client/kvhostctl/errors.h"
#include "client/kvhostctl/parse.h"
#include "google/protobuf/util/json_util.h"

ABSL_FLAG(std::string, kind, "mha",
          "create-pool: what a token stores: mha, mla, mha_asymmetric, k_only, dsa, dsa_indexer, "
          "mamba, v4_paged, v4_state or logical.");
ABSL_FLAG(std::string, layout, "page_first",
          "create-pool: layer_first, page_first, page_first_direct, page_head (mha only) or "
          "page_unified (mha, mla, k_only; --head-groups).");
ABSL_FLAG(std::string, dtype, "bf16",
          "create-pool: element type: bf16, fp16, fp32, fp8_e4m3, fp8_e5m2 or uint8 (dsa_indexer, "
          "v4_paged, v4_state and logical default to uint8).");
ABSL_FLAG(uint32_t, page_size, 16,
          "create-pool: token slots per page (mamba: 1; a follower takes its pool's).");
ABSL_FLAG(uint32_t, layers, 0,
          "create-pool: layers held on the host; create-group: model layers (both required).");
ABSL_FLAG(uint32_t, heads, 0, "create-pool: MHA KV heads (required for mha).");
ABSL_FLAG(uint32_t, head_dim, 0, "create-pool: MHA head dimension (required for mha).");
ABSL_FLAG(uint32_t, head_groups, 0,
          "create-pool: page_unified head groups per page, dividing --heads (0: one group).");
ABSL_FLAG(uint32_t, kv_lora_rank, 0, "create-pool: MLA latent rank.");
ABSL_FLAG(uint32_t, qk_rope_head_dim, 0, "create-pool: MLA rotary dimension.");
ABSL_FLAG(uint64_t, size_tokens, 0, "create-pool: pool size in tokens (first sizing rule).");
ABSL_FLAG(std::string, size_bytes, "0",
          "create-pool: pool size in host bytes, e.g. 10G; K/M/G/T are powers of 1024 (second "
          "sizing rule).");
ABSL_FLAG(double, ratio, 0,
          "create-pool: host slots per device slot, with --device-size-tokens (third sizing "
          "rule).");
ABSL_FLAG(uint64_t, device_size_tokens, 0, "create-pool: the device pool's size in tokens.");
ABSL_FLAG(std::string, spec, "",
          "create-pool: a whole kvhost.v1.PoolSpec in protobuf JSON, e.g. "
          "'{\"kind\":\"MLA\",\"layout\":\"LAYER_FIRST\",...}'; flags given override its fields.");
ABSL_FLAG(uint32_t, v_head_dim, 0, "create-pool: mha_asymmetric V head dimension.");
ABSL_FLAG(std::string, follows, "",
          "create-pool: the pool whose page space this one shares (k_only, dsa_indexer, "
          "v4_state).");
ABSL_FLAG(uint32_t, start_layer, 0, "create-pool: first device layer held (layer sharding).");
ABSL_FLAG(uint32_t, index_head_dim, 0, "create-pool: dsa, dsa_indexer index head dimension.");
ABSL_FLAG(uint32_t, index_quant_block, 0, "create-pool: dsa, dsa_indexer elements per fp32 scale.");
ABSL_FLAG(uint32_t, index_row_bytes, 0, "create-pool: dsa index-K bytes per token, if explicit.");
ABSL_FLAG(uint32_t, kv_cache_dim, 0,
          "create-pool: mla, dsa latent elements when not kv_lora_rank + qk_rope_head_dim.");
ABSL_FLAG(uint64_t, item_bytes, 0, "create-pool: v4_paged bytes per slot page and layer.");
ABSL_FLAG(uint32_t, ring_size, 0, "create-pool: v4_state ring slots per page.");
ABSL_FLAG(uint64_t, state_slot_bytes, 0, "create-pool: v4_state bytes per ring slot.");
ABSL_FLAG(std::string, mamba_temporal, "",
          "create-pool: mamba temporal state shape and optional dtype, e.g. 8x64x128:fp32.");
ABSL_FLAG(std::string, mamba_conv, "",
          "create-pool: mamba conv state shapes, comma separated, e.g. 2x4x1024,2x4x256.");

namespace kvhost::ctl {
namespace {

// Which flags set a field: with --spec only those given, else all of them.
struct FlagUse {
  const std::set<std::string>& given;
  bool from_json;

  bool Given(absl::string_view name) const { return given.count(std::string(name)) > 0; }
  bool Use(absl::string_view name) const { return !from_json || Given(name); }
};

absl::Status SetEnum(absl::string_view flag, const std::string& text,
                     const google::protobuf::EnumDescriptor* type, int* value) {
  absl::StatusOr<int> parsed = ParseEnumFlag(flag, text, type);
  if (!parsed.ok()) return parsed.status();
  *value = *parsed;
  return absl::OkStatus();
}

// --kind, --layout, --dtype.
absl::Status SetEnumFields(const FlagUse& flags, v1::PoolSpec* spec) {
  int value = 0;
  if (flags.Use("kind")) {
    absl::Status s = SetEnum("kind", absl::GetFlag(FLAGS_kind), v1::PoolKind_descriptor(), &value);
    if (!s.ok()) return s;
    spec->set_kind(static_cast<v1::PoolKind>(value));
  }
  if (flags.Use("layout")) {
    absl::Status s =
        SetEnum("layout", absl::GetFlag(FLAGS_layout), v1::Layout_descriptor(), &value);
    if (!s.ok()) return s;
    spec->set_layout(static_cast<v1::Layout>(value));
  }
  if (flags.Given("dtype")) {
    absl::Status s = SetEnum("dtype", absl::GetFlag(FLAGS_dtype), v1::DType_descriptor(), &value);
    if (!s.ok()) return s;
    spec->set_dtype(static_cast<v1::DType>(value));
  } else if (!flags.from_json) {
    // Kinds whose rows are plain bytes default to uint8.
    const bool bytes = spec->kind() == v1::DSA_INDEXER || spec->kind() == v1::V4_PAGED ||
                       spec->kind() == v1::V4_STATE || spec->kind() == v1::LOGICAL;
    absl::Status s = SetEnum("dtype", bytes ? std::string("uint8") : absl::GetFlag(FLAGS_dtype),
                             v1::DType_descriptor(), &value);
    if (!s.ok()) return s;
    spec->set_dtype(static_cast<v1::DType>(value));
  }
  return absl::OkStatus();
}

// The flags that set one number each.
void SetNumberFields(const FlagUse& flags, v1::PoolSpec* spec) {
#define KVHOST_FLAG_FIELD(flag, setter) \
  if (flags.Use(#flag)) spec->setter(absl::GetFlag(FLAGS_##flag))
  KVHOST_FLAG_FIELD(layers, set_layer_num);
  KVHOST_FLAG_FIELD(heads, set_head_num);
  KVHOST_FLAG_FIELD(head_dim, set_head_dim);
  KVHOST_FLAG_FIELD(head_groups, set_head_groups);
  KVHOST_FLAG_FIELD(v_head_dim, set_v_head_dim);
  KVHOST_FLAG_FIELD(kv_lora_rank, set_kv_lora_rank);
  KVHOST_FLAG_FIELD(qk_rope_head_dim, set_qk_rope_head_dim);
  KVHOST_FLAG_FIELD(size_tokens, set_size_tokens);
  KVHOST_FLAG_FIELD(ratio, set_host_to_device_ratio);
  KVHOST_FLAG_FIELD(device_size_tokens, set_device_size_tokens);
  KVHOST_FLAG_FIELD(start_layer, set_start_layer);
  KVHOST_FLAG_FIELD(index_head_dim, set_index_head_dim);
  KVHOST_FLAG_FIELD(index_quant_block, set_index_quant_block_size);
  KVHOST_FLAG_FIELD(index_row_bytes, set_index_row_bytes);
  KVHOST_FLAG_FIELD(kv_cache_dim, set_kv_cache_dim);
  KVHOST_FLAG_FIELD(item_bytes, set_item_bytes);
  KVHOST_FLAG_FIELD(ring_size, set_ring_size);
  KVHOST_FLAG_FIELD(state_slot_bytes, set_state_slot_bytes);
#undef KVHOST_FLAG_FIELD
}

// "8x64x128" -> dims; "8x64x128:fp32" also sets *dtype.
absl::Status ParseShape(absl::string_view flag, absl::string_view text, v1::Shape* shape,
                        v1::DType* dtype) {
  const size_t colon = text.find(':');
  if (colon != absl::string_view::npos) {
    if (dtype == nullptr) {
      return UsageError(absl::StrCat(FlagName(flag), " '", text, "' takes no dtype"));
    }
    absl::StatusOr<int> parsed =
        ParseEnumFlag(flag, std::string(text.substr(colon + 1)), v1::DType_descriptor());
    if (!parsed.ok()) return parsed.status();
    *dtype = static_cast<v1::DType>(*parsed);
    text = text.substr(0, colon);
  }
  shape->clear_dims();
  for (absl::string_view part : absl::StrSplit(text, 'x')) {
    uint32_t dim = 0;
    if (!absl::SimpleAtoi(part, &dim) || dim == 0) {
      return UsageError(absl::StrCat(FlagName(flag), " '", text,
                                     "' is not a shape like 8x64x128 (positive dims)"));
    }
    shape->add_dims(dim);
  }
  return absl::OkStatus();
}

// --mamba-temporal, --mamba-conv: set where given, with or without --spec.
absl::Status SetMambaFields(v1::PoolSpec* spec) {
  if (const std::string temporal = absl::GetFlag(FLAGS_mamba_temporal); !temporal.empty()) {
    v1::DType dtype = spec->mamba().temporal_dtype();
    if (absl::Status s = ParseShape("mamba_temporal", temporal,
                                    spec->mutable_mamba()->mutable_temporal(), &dtype);
        !s.ok()) {
      return s;
    }
    spec->mutable_mamba()->set_temporal_dtype(dtype);
  }
  if (const std::string conv = absl::GetFlag(FLAGS_mamba_conv); !conv.empty()) {
    spec->mutable_mamba()->clear_conv();
    for (absl::string_view shape : absl::StrSplit(conv, ',')) {
      if (absl::Status s =
              ParseShape("mamba_conv", shape, spec->mutable_mamba()->add_conv(), nullptr);
          !s.ok()) {
        return s;
      }
    }
  }
  return absl::OkStatus();
}

// What each kind needs besides layers and a size: a flag given or a spec
// field set; kvhostd judges the values.
struct Requirement {
  v1::PoolKind kind;
  const char* flags;  // for the message
  bool (*present)(const v1::PoolSpec&);
};

constexpr Requirement kRequirements[] = {
    {v1::MHA, "--heads and --head-dim",
     [](const v1::PoolSpec& s) { return s.head_num() != 0 && s.head_dim() != 0; }},
    {v1::MHA_ASYMMETRIC, "--heads, --head-dim and --v-head-dim",
     [](const v1::PoolSpec& s) {
       return s.head_num() != 0 && s.head_dim() != 0 && s.v_head_dim() != 0;
     }},
    {v1::K_ONLY, "--heads, --head-dim and --follows",
     [](const v1::PoolSpec& s) {
       return s.head_num() != 0 && s.head_dim() != 0 && !s.follows().empty();
     }},
    {v1::MLA, "--kv-lora-rank and/or --qk-rope-head-dim (or --kv-cache-dim)",
     [](const v1::PoolSpec& s) {
       return s.kv_lora_rank() + s.qk_rope_head_dim() + s.kv_cache_dim() != 0;
     }},
    {v1::DSA,
     "--kv-lora-rank and/or --qk-rope-head-dim (or --kv-cache-dim), and --index-head-dim with "
     "--index-quant-block (or --index-row-bytes)",
     [](const v1::PoolSpec& s) {
       return s.kv_lora_rank() + s.qk_rope_head_dim() + s.kv_cache_dim() != 0 &&
              (s.index_row_bytes() != 0 ||
               (s.index_head_dim() != 0 && s.index_quant_block_size() != 0));
     }},
    {v1::DSA_INDEXER, "--index-head-dim, --index-quant-block and --follows",
     [](const v1::PoolSpec& s) {
       return s.index_head_dim() != 0 && s.index_quant_block_size() != 0 && !s.follows().empty();
     }},
    {v1::MAMBA, "--mamba-temporal and --mamba-conv",
     [](const v1::PoolSpec& s) {
       return s.mamba().temporal().dims_size() > 0 && s.mamba().conv_size() > 0;
     }},
    {v1::V4_PAGED, "--item-bytes", [](const v1::PoolSpec& s) { return s.item_bytes() != 0; }},
    {v1::V4_STATE, "--ring-size, --state-slot-bytes and --follows",
     [](const v1::PoolSpec& s) {
       return s.ring_size() != 0 && s.state_slot_bytes() != 0 && !s.follows().empty();
     }},
};

}  // namespace

absl::StatusOr<v1::PoolSpec> SpecFromFlags(const std::set<std::string>& given) {
  v1::PoolSpec spec;
  const std::string json = absl::GetFlag(FLAGS_spec);
  const FlagUse flags{given, /*from_json=*/!json.empty()};
  if (flags.from_json) {
    if (auto s = google::protobuf::util::JsonStringToMessage(json, &spec); !s.ok()) {
      return UsageError(absl::StrCat("--spec is not a kvhost.v1.PoolSpec in protobuf JSON: ",
                                     std::string(s.message())));
    }
  }
  if (absl::Status s = SetEnumFields(flags, &spec); !s.ok()) return s;
  if (flags.Use("size_bytes")) {
    absl::StatusOr<uint64_t> size_bytes =
        ParseByteSize("size_bytes", absl::GetFlag(FLAGS_size_bytes));
    if (!size_bytes.ok()) return size_bytes.status();
    spec.set_size_bytes(*size_bytes);
  }
  if (flags.Use("follows")) spec.set_follows(absl::GetFlag(FLAGS_follows));
  if (flags.Given("page_size")) {
    spec.set_page_size(absl::GetFlag(FLAGS_page_size));
  } else if (!flags.from_json && spec.follows().empty()) {
    // A follower takes its pool's page size; mamba's is 1.
    spec.set_page_size(spec.kind() == v1::MAMBA ? 1 : absl::GetFlag(FLAGS_page_size));
  }
  SetNumberFields(flags, &spec);
  if (absl::Status s = SetMambaFields(&spec); !s.ok()) return s;
  return spec;
}

absl::Status CheckSpecComplete(const v1::PoolSpec& spec) {
  const std::string kind = absl::AsciiStrToLower(v1::PoolKind_Name(spec.kind()));
  if (spec.layer_num() == 0 && spec.kind() != v1::LOGICAL) {
    return UsageError("create-pool needs --layers");
  }
  for (const Requirement& r : kRequirements) {
    if (r.kind == spec.kind() && !r.present(spec)) {
      return UsageError(absl::StrCat("create-pool --kind=", kind, " needs ", r.flags));
    }
  }
  if (spec.follows().empty() && spec.size_tokens() == 0 && spec.size_bytes() == 0 &&
      (spec.host_to_device_ratio() <= 0 || spec.device_size_tokens() == 0)) {
    return UsageError(
        "create-pool needs a size: --size-tokens, --size-bytes, or --ratio with "
        "--device-size-tokens");
  }
  return absl::OkStatus();
}

}  // namespace kvhost::ctl
