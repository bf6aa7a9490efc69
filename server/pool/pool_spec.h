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

// The most layers a pool (PoolSpec.layer_num) or a pool group
// (PoolGroup.layer_num) may hold. The seeds' models have at most 200; the cap
// keeps every reply and ticket that walks layers (page metadata, contiguous
// buffer infos, a group's layer maps) small whatever a request asks for.
inline constexpr uint32_t kMaxLayers = 4096;

// The most head groups a PAGE_UNIFIED pool (PoolSpec.head_groups) may have:
// a group is a tensor-parallel partition's heads, and the copy kernel's tiles
// count a row's pieces in 16 bits (kernels/kvhost/copy_tile.h).
inline constexpr uint32_t kMaxHeadGroups = 4096;

struct PoolSpec {
  PoolKind kind = PoolKind::kMha;
  LayoutKind layout = LayoutKind::kLayerFirst;
  DType dtype = DType::kBf16;
  uint32_t page_size = 0;
  uint32_t layer_num = 0;
  uint32_t head_num = 0;                // MHA
  uint32_t head_dim = 0;                // MHA
  uint32_t v_head_dim = 0;              // MHA; 0 = head_dim
  uint32_t kv_lora_rank = 0;            // MLA
  uint32_t qk_rope_head_dim = 0;        // MLA
  uint64_t size_tokens = 0;             // sizing rule 1
  uint64_t size_bytes = 0;              // sizing rule 2
  double host_to_device_ratio = 0;      // sizing rule 3
  uint64_t device_size_tokens = 0;      // sizing rule 3
  std::string follows;                  // K_ONLY, DSA_INDEXER, V4_STATE
  uint32_t start_layer = 0;             // layer sharding
  uint32_t index_head_dim = 0;          // DSA, DSA_INDEXER
  uint32_t index_quant_block_size = 0;  // DSA, DSA_INDEXER
  uint32_t index_row_bytes = 0;         // DSA
  uint32_t kv_cache_dim = 0;            // MLA, DSA
  MambaShapes mamba;                    // MAMBA
  uint64_t item_bytes = 0;              // V4_PAGED
  uint32_t ring_size = 0;               // V4_STATE
  uint64_t state_slot_bytes = 0;        // V4_STATE
  uint32_t head_groups = 0;             // MHA, K_ONLY in PAGE_UNIFIED; 0 = 1
  bool node_cache = false;              // pages addressed by key (server/cache/)
};

// One host buffer of a pool: a seed tensor, or one K/V plane of one
// (kvhost.v1.PoolComponent). Its rows are addressed by `layout`, a one-plane
// KvLayout whose token rows are either token slots (row_tokens 1) or whole
// pages (row_tokens = page_size: then layout.page_size is 1, layout.tokens
// the page count and layout.token_bytes the page row). Byte 0 of `layout`
// is byte `region_offset` of region `region`; in PAGE_UNIFIED the pool's
// planes interleave, so a plane's bytes lie between the others' in
// [region_offset, region_offset + layout.extent_bytes()). Device buffers of
// the component have the same row_bytes.
struct Component {
  std::string name;
  KvLayout layout;
  uint32_t region = 0;
  uint64_t region_offset = 0;
  uint64_t row_tokens = 1;
  uint64_t row_bytes() const { return layout.token_bytes; }
  uint64_t bytes() const { return layout.total_bytes(); }
  uint64_t extent_bytes() const { return layout.extent_bytes(); }
  // Rows of one page in one layer: page_size token rows, or one page row.
  uint64_t rows_per_page() const { return row_tokens == 1 ? layout.page_size : 1; }
  // Row holding token slot `slot`.
  uint64_t row_of(uint64_t slot) const { return slot / row_tokens; }
};

// Per-kind facts (the seeds' class differences that are not address math).
// Kinds whose rows are the same on every tensor-parallel rank: one pool
// serves many ranks (Pool::replica_ranks).
bool IsReplicated(PoolKind kind);
// Kinds that share another pool's page space (spec.follows required).
bool NeedsFollows(PoolKind kind);
// Whether a `follower` pool may follow a `followed` one (the seeds' anchors),
// and the followable kinds spelled out for messages ("MLA or DSA").
bool CanFollow(PoolKind follower, PoolKind followed);
const char* FollowableKinds(PoolKind follower);
// Kinds whose transfers and page calls move whole pages only.
bool MovesWholePages(PoolKind kind);

// Checks dims, dtype, that the kind supports the layout, layer_num <=
// kMaxLayers, that head_groups divides head_num (PAGE_UNIFIED), and that
// the fields the kind (and layout) does not use are 0 / empty.
// Errors are INVALID_ARGUMENT naming the kind, the layout and the field
// ("spec.head_dim must be >= 1 for MHA/PAGE_FIRST"). A follower
// (spec.follows) is checked with the page_size it inherits filled in
// (PoolRegistry::Create does that first).
absl::Status ValidateSpec(const PoolSpec& spec);

// MHA, MLA, K_ONLY only (the kinds with one region of `PlaneCount` planes of
// equal token rows): 2 for MHA, 1 for MLA and K_ONLY; 0 for the other
// kinds, whose buffers MakeComponents describes.
uint32_t PlaneCount(const PoolSpec& spec);
// PAGE_UNIFIED's head groups (spec.head_groups, 0 read as 1); 1 for the
// other layouts.
uint32_t HeadGroups(const PoolSpec& spec);
// Bytes of one token's row of one layer in one plane (the device row size)
// for MHA, MLA and K_ONLY; 0 for the other kinds (see MakeComponents).
// REQUIRES: ValidateSpec(spec).ok().
uint64_t RowBytes(const PoolSpec& spec);
// Host bytes of one page over all layers and components (0 for LOGICAL).
// REQUIRES: ValidateSpec(spec).ok().
uint64_t BytesPerPage(const PoolSpec& spec);
// BytesPerPage / page_size: the seeds' size_per_token. Exact for every kind
// but V4_PAGED and V4_STATE, whose rows are per page (floored there).
uint64_t BytesPerToken(const PoolSpec& spec);

// Token slots of the pool: the first sizing rule that applies, rounded up to
// whole pages (size_bytes gives whole pages that fit for page-row kinds).
// LOGICAL takes no size_bytes and is not rounded: its size must be a
// multiple of page_size, as in the seeds. INVALID_ARGUMENT when no rule
// applies or the size is zero. Followers are sized by the pool they follow
// (PoolRegistry::Create), not here.
// REQUIRES: ValidateSpec(spec).ok().
absl::StatusOr<uint64_t> ResolveSizeTokens(const PoolSpec& spec);

// MHA, MLA, K_ONLY: the one region's address math for a pool of
// `size_tokens` slots. Other kinds: the index space only (tokens,
// page_size, layers; planes 0, so it addresses no bytes); their buffers are
// MakeComponents'.
// REQUIRES: ValidateSpec(spec).ok(), size_tokens % page_size == 0.
KvLayout MakeKvLayout(const PoolSpec& spec, uint64_t size_tokens);

// The host buffers of a pool of `size_tokens` slots, in flat-page and
// metadata order, with their region index and offset (empty for LOGICAL).
// REQUIRES: ValidateSpec(spec).ok(), size_tokens % page_size == 0.
std::vector<Component> MakeComponents(const PoolSpec& spec, uint64_t size_tokens);
// The region files' name suffixes, indexed by Component::region (".kv",
// ".k", ".v", ".index_k", ".temporal", ".conv0", ...; none for LOGICAL).
std::vector<std::string> RegionSuffixes(const PoolSpec& spec);

// "MHA/PAGE_FIRST bf16 L=32 H=8 D=128 ps=16" for logs and kvhostctl.
std::string DescribeSpec(const PoolSpec& spec);

}  // namespace kvhost

#endif  // KVHOST_SERVER_POOL_POOL_SPEC_H_
