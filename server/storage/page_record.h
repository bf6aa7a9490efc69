// A page as the L3 tier stores it: the pool's flat page (Pool::ReadPage's
// bytes) cut into parts of at most the cache's item size, each part one
// cache item of a fixed header followed by its slice of the page.
//
//   part 0 under PartKey(base, 0), part i under PartKey(base, i), base =
//   L3Secret::CacheKey(namespace, key)
//   header (kPartHeaderBytes, little-endian):
//     0 magic "KVL3"   4 version 2 (u16)   6 header bytes (u16)
//     8 shape fingerprint (u64)   16 store id (u64, random per store)
//    24 page bytes (u64)   32 this part's offset in the page (u64)
//    40 part index (u32)   44 part count (u32)
//    48 CRC32C of this part's payload   52 CRC32C of the whole page
//    56 kind, layout, dtype (u8 each, the proto's numbers), 0
//    60 page_size (u32)   64 layer_num (u32)
//    68 the page's MAC (32 bytes, the same in every part)
//   100 CRC32C of bytes [0, 100)
//
// The MAC (HMAC-SHA256 under the fleet secret, server/storage/l3_secret.h)
// covers the namespace, the key, the shape (fingerprint, page bytes, kind,
// layout, dtype, page size, layers), the part count, the store id and every
// byte of the page: memcached is writable by anyone who reaches it, so a
// page is written into a pool only when its MAC is right. The CRCs tell a
// damaged part (PAGE_CORRUPT) from a forged one, which is a miss.
//
// The fingerprint hashes everything that fixes a page's bytes (kind, layout,
// dtype, dims, page size, layers, the page's parts): a page is written only
// into a pool of the same shape. The store id ties the parts of one store
// together, so parts of two stores of one key (a torn overwrite) or a part
// evicted in between are told apart from a whole page. The part count must
// be the one the page's size and the fleet's item size give, checked before
// any further part is asked for. CheckPage checks all of it before a byte
// reaches the pool.
//
// Thread safety: pure functions over their arguments (the pool's own rules
// for its bytes).
#ifndef KVHOST_SERVER_STORAGE_PAGE_RECORD_H_
#define KVHOST_SERVER_STORAGE_PAGE_RECORD_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "server/pool/pool.h"
#include "server/storage/l3_secret.h"

namespace kvhost {

inline constexpr uint64_t kPartHeaderBytes = 104;
// Longest key a caller may give (bytes); cache keys are a hash of it
// (L3Secret::CacheKey), so this is the API's bound, not memcached's.
inline constexpr size_t kMaxStorageKeyBytes = 112;

// What became of one page (kvhost.v1.PageOutcome, same numbering).
enum class PageOutcome : uint8_t {
  kStored = 1,
  kHit = 2,
  kMiss = 3,
  kCorrupt = 4,
  kShapeMismatch = 5,
  kUnavailable = 6,
};
const char* PageOutcomeName(PageOutcome outcome);

struct PageResult {
  PageOutcome outcome = PageOutcome::kMiss;
  std::string detail;  // why, for anything but kStored / kHit
  // A kMiss because the record's MAC failed (forged, or stored under
  // another secret): counted and logged apart.
  bool unauthenticated = false;
};

// What a record is bound to besides its bytes: the fleet secret, and the
// namespace and key it is stored under.
struct RecordScope {
  const L3Secret* secret = nullptr;
  absl::string_view ns;
  absl::string_view key;
};

// The shape of a pool's pages, as every stored page carries it.
struct PageShapeTag {
  uint64_t fingerprint = 0;
  uint8_t kind = 0;    // PoolKind
  uint8_t layout = 0;  // LayoutKind
  uint8_t dtype = 0;   // DType
  uint32_t page_size = 0;
  uint32_t layer_num = 0;
  uint64_t page_bytes = 0;
  // "MHA/PAGE_FIRST bf16 ps=16 L=3, 1536-byte pages (shape 0123...)".
  std::string Describe() const;
};

// The tag of `pool`'s pages. FAILED_PRECONDITION for a pool without flat
// pages (MHA_ASYMMETRIC: Pool::CheckPage's message).
absl::StatusOr<PageShapeTag> ShapeTagOf(const Pool& pool);

// The cache key of part `part` of the page whose cache key is `base`
// (L3Secret::CacheKey).
std::string PartKey(absl::string_view base, uint32_t part);
// INVALID_ARGUMENT naming `what` (e.g. "keys[3]") for an empty key or one
// over kMaxStorageKeyBytes.
absl::Status CheckStorageKey(absl::string_view key, const std::string& what);

// Parts of a page of `page_bytes` for items of at most `max_item_bytes`.
// REQUIRES: max_item_bytes > kPartHeaderBytes.
uint32_t PartCount(uint64_t page_bytes, uint64_t max_item_bytes);

// The page starting at `first_slot` of `pool` as its items (part 0 first),
// each at most `max_item_bytes`, MAC'd for `scope`. Errors are
// Pool::ReadPageRange's.
// REQUIRES: tag == ShapeTagOf(pool), max_item_bytes > kPartHeaderBytes.
absl::StatusOr<std::vector<std::string>> EncodePage(const Pool& pool, int64_t first_slot,
                                                    const PageShapeTag& tag,
                                                    const RecordScope& scope, uint64_t store_id,
                                                    uint64_t max_item_bytes);

// The header of one item (its first kPartHeaderBytes), or why it is not one
// (DATA_LOSS: too short, bad magic / version, header checksum).
struct PartHeader {
  uint64_t fingerprint = 0;
  uint64_t store_id = 0;
  uint64_t page_bytes = 0;
  uint64_t offset = 0;
  uint32_t index = 0;
  uint32_t count = 0;
  uint32_t part_crc = 0;
  uint32_t page_crc = 0;
  uint8_t kind = 0;
  uint8_t layout = 0;
  uint8_t dtype = 0;
  uint32_t page_size = 0;
  uint32_t layer_num = 0;
  L3Mac mac{};
};
absl::StatusOr<PartHeader> DecodePartHeader(absl::string_view item);

// Whether part 0's header (`first`) may start a page of `want`'s shape in
// items of `max_item_bytes`: its fingerprint and page bytes are the pool's
// and its part count is exactly PartCount's. What to fetch is decided by
// this, before anything is allocated for the other parts.
bool PlausibleFirstPart(const PartHeader& first, const PageShapeTag& want, uint64_t max_item_bytes);

// Checks a fetched page against `want`: `parts` are the items fetched
// under PartKey(base, 0 .. n) (nullopt: not found), n = part 0's count.
// kHit when the page is whole, of `want`'s shape, in the part count items
// of `max_item_bytes` give, and its MAC for `scope` is right; else kMiss
// (part 0 or a later part not found: evicted, or its server died; or the
// MAC fails: `unauthenticated`), kShapeMismatch (detail names both shapes)
// or kCorrupt (a part of another store of the key, a checksum that fails,
// a header that lies; detail says which part and what is wrong).
PageResult CheckPage(const PageShapeTag& want, const RecordScope& scope, uint64_t max_item_bytes,
                     absl::Span<const std::optional<std::string>> parts);

// Writes a page that CheckPage found kHit into the page at `first_slot`.
absl::Status WriteCheckedPage(Pool& pool, int64_t first_slot,
                              absl::Span<const std::optional<std::string>> parts);

}  // namespace kvhost

#endif  // KVHOST_SERVER_STORAGE_PAGE_RECORD_H_
