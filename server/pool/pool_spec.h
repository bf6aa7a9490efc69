// PoolSpec: the shape and size of a host pool, in the domain's terms (no
// protobuf), with the validation and sizing rules of the seeds
// (SEED_INVENTORY.md §1, §4).
//
// Values only; every function here is pure and thread-safe.
#ifndef KVHOST_SERVER_POOL_POOL_SPEC_H_
#define KVHOST_SERVER_POOL_POOL_SPEC_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvhost/layout.h"

namespace kvhost {

// Same numbering as kvhost.v1.PoolKind.
enum class PoolKind : uint8_t {
  kMha = 1,
  kMla = 2,
  kMhaAsymmetric = 3,
  kKOnly = 4,
  kDsa = 5,
  kDsaIndexer = 6,
  kMamba = 7,
  kV4Paged = 8,
  kV4State = 9,
  kLogical = 10,
};
// Same numbering as kvhost.v1.DType.
enum class DType : uint8_t {
  kBf16 = 1,
  kFp16 = 2,
  kFp32 = 3,
  kFp8E4m3 = 4,
  kFp8E5m2 = 5,
  kUint8 = 6,
};

const char* PoolKindName(PoolKind kind);
const char* LayoutName(LayoutKind layout);
const char* DTypeName(DType dtype);
uint32_t DTypeSize(DType dtype);

// MAMBA state shapes per slot and layer (kvhost.v1.MambaStates).
struct MambaShapes {
  std::vector<uint32_t> temporal;
  DType temporal_dtype = DType::kBf16;  // the proto's UNSPECIFIED becomes spec.dtype
  std::vector<std::vector<uint32_t>> conv;
};

struct PoolSpec {
  PoolKind kind = PoolKind::kMha;
  LayoutKind layout = LayoutKind::kLayerFirst;
  DType dtype = DType::kBf16;
  uint32_t page_size = 0;
  uint32_t layer_num = 0;
  uint32_t head_num = 0;            // MHA
  uint32_t head_dim = 0;            // MHA
  uint32_t v_head_dim = 0;          // MHA; 0 = head_dim
  uint32_t kv_lora_rank = 0;        // MLA
  uint32_t qk_rope_head_dim = 0;    // MLA
  uint64_t size_tokens = 0;         // sizing rule 1
  uint64_t size_bytes = 0;          // sizing rule 2
  double host_to_device_ratio = 0;  // sizing rule 3
  uint64_t device_size_tokens = 0;  // sizing rule 3
  std::string follows;              // K_ONLY, DSA_INDEXER, V4_STATE
  uint32_t start_layer = 0;         // layer sharding
  uint32_t index_head_dim = 0;      // DSA, DSA_INDEXER
  uint32_t index_quant_block_size = 0;  // DSA, DSA_INDEXER
  uint32_t index_row_bytes = 0;     // DSA
  uint32_t kv_cache_dim = 0;        // MLA, DSA
  MambaShapes mamba;                // MAMBA
  uint64_t item_bytes = 0;          // V4_PAGED
  uint32_t ring_size = 0;           // V4_STATE
  uint64_t state_slot_bytes = 0;    // V4_STATE
};

// Checks dims, dtype and that the kind supports the layout. Errors are
// INVALID_ARGUMENT naming the field ("spec.head_dim must be >= 1 for MHA").
absl::Status ValidateSpec(const PoolSpec& spec);

// Planes of the host buffer: 2 (K, V) for MHA, 1 for MLA.
uint32_t PlaneCount(const PoolSpec& spec);
// Bytes of one token's row of one layer in one plane (the device row size).
// REQUIRES: ValidateSpec(spec).ok().
uint64_t RowBytes(const PoolSpec& spec);
// Bytes one token slot takes over all layers and planes (size_per_token).
uint64_t BytesPerToken(const PoolSpec& spec);

// Token slots of the pool: the first sizing rule that applies, rounded up to
// whole pages. INVALID_ARGUMENT when no rule applies or the size is zero.
// REQUIRES: ValidateSpec(spec).ok().
absl::StatusOr<uint64_t> ResolveSizeTokens(const PoolSpec& spec);

// The host buffer's address math for a pool of `size_tokens` slots.
// REQUIRES: ValidateSpec(spec).ok(), size_tokens % page_size == 0.
KvLayout MakeKvLayout(const PoolSpec& spec, uint64_t size_tokens);

// "MHA/PAGE_FIRST bf16 L=32 H=8 D=128 ps=16" for logs and kvhostctl.
std::string DescribeSpec(const PoolSpec& spec);

}  // namespace kvhost

#endif  // KVHOST_SERVER_POOL_POOL_SPEC_H_
