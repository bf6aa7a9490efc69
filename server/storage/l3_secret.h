// L3Secret: the fleet secret of the L3 tier (--l3-secret-file), and what is
// derived from it: the MAC that authenticates every stored page, the
// namespace a pool's pages are stored in, and the cache keys they live
// under.
//
// memcached is shared with every local user (and every node of the fleet),
// so what comes back from it is hostile until authenticated: a page record
// carries an HMAC-SHA256 under a key derived from the secret over its
// namespace, key, shape, part count, store id and every byte of the page
// (server/storage/page_record.h). Keys are scoped by a namespace: a
// protected pool's is derived from its owner token (HMAC under the secret,
// so not guessable from the token's hash), an unprotected pool's is the
// fleet's public namespace. The cache key of a page is an HMAC of
// (namespace, key), so a reader of memcached learns neither the namespace
// nor the scheduler's page hash, and cannot aim a write at a victim's key.
//
// Rotation: every derived value changes with the secret, so a new secret
// starts an empty tier (pages stored under the old one are misses and age
// out of memcached). Roll the new file out to every node and restart them;
// until all have it, nodes on different secrets share no pages (misses,
// never wrong bytes). docs/OPERATIONS.md, L3 tier.
//
// Thread safety: immutable after Load; every method may be called from
// many threads at once.
#ifndef KVHOST_SERVER_STORAGE_L3_SECRET_H_
#define KVHOST_SERVER_STORAGE_L3_SECRET_H_

#include <array>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace kvhost {

inline constexpr size_t kL3MacBytes = 32;
inline constexpr size_t kL3NamespaceBytes = 16;
// A secret file holds at least this many bytes (trailing whitespace aside),
// at most kMaxL3SecretFileBytes.
inline constexpr size_t kMinL3SecretBytes = 32;
inline constexpr size_t kMaxL3SecretFileBytes = 4096;

using L3Mac = std::array<uint8_t, kL3MacBytes>;

class L3Secret {
 public:
  // Incremental HMAC-SHA256 under the record key.
  class Mac {
   public:
    explicit Mac(const L3Secret& secret);
    ~Mac();
    Mac(const Mac&) = delete;
    Mac& operator=(const Mac&) = delete;
    void Update(absl::Span<const uint8_t> bytes);
    void Update(absl::string_view bytes);
    void UpdateU64(uint64_t v);  // little-endian
    L3Mac Final();

   private:
    void* ctx_;  // HMAC state (OpenSSL EVP_MAC_CTX)
  };

  // Reads the secret from `path`: a regular file (not a symlink), owned by
  // kvhostd's user or root, not readable or writable by group or others,
  // of kMinL3SecretBytes to kMaxL3SecretFileBytes bytes. INVALID_ARGUMENT
  // naming the path and what is wrong, with how to make a good one.
  static absl::StatusOr<L3Secret> Load(const std::string& path);
  // A secret from bytes (tests, the fuzz target, the benchmark).
  static L3Secret FromBytes(absl::string_view secret);

  // The public namespace (unprotected pools) and a protected pool's, from
  // its owner token; kL3NamespaceBytes bytes each, never equal.
  std::string PublicNamespace() const;
  std::string TokenNamespace(absl::string_view owner_token) const;
  // The cache key of the page under `key` in namespace `ns`:
  // "kvh3:" + 64 hex digits (PartKey appends the part).
  std::string CacheKey(absl::string_view ns, absl::string_view key) const;

  // Whether two MACs are equal, in time independent of where they differ.
  static bool MacEquals(const L3Mac& a, const L3Mac& b);

  // How to make a secret file, for messages.
  static const char* HowToMake();

 private:
  using Key = std::array<uint8_t, 32>;
  L3Secret() = default;

  Key record_key_{};     // the records' MAC
  Key namespace_key_{};  // namespaces from owner tokens
  Key cache_key_key_{};  // cache keys from (namespace, key)
};

}  // namespace kvhost

#endif  // KVHOST_SERVER_STORAGE_L3_SECRET_H_
