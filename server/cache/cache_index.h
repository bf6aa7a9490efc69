// CacheIndex: a node cache's map from keys to the pages that hold them (issue
// 33's key-addressed cache). A key is an engine's block hash (opaque bytes);
// each key holds one page of the cache's pool, whose PageAllocator the index
// allocates from and returns pages to. The index is bookkeeping only: the
// bytes are moved by the transfer path into and out of the pages it names.
//
// A key's life: BeginStore reserves a page for it (the key is WRITING, seen by
// Lookup as PENDING, never as present). The store is tentative until
// CommitStore (its copies were submitted) or CancelStore (they were refused:
// the index is as before BeginStore, but for the order of use). Then
// FinishStore(ok) publishes it (PRESENT:
// a reader never sees a page before all its bytes landed), FinishStore(failed)
// or the writer's holder ending (ReleaseHolder) drops it and frees its page.
// A published key stays until it is evicted: by Evict, or by a BeginStore that
// needs its page, least recently used first (Lookup and a restore's Unpin use
// a key); a store's victims read as absent from BeginStore on, and are
// evicted (logged, counted, their pages the store's) at CommitStore, or are
// published again, bytes untouched, at CancelStore. A pinned key (Lookup with a holder, for a
// following restore) and a WRITING key are never evicted.
//
// Bounds, per call and per holder (a holder is the session a pin or a store
// belongs to; ReleaseHolder drops everything it holds when it ends): a key's
// bytes, the keys of a call, the pages a holder may keep pinned or reserved
// for writing at once (CacheLimits). Every entry owns a page, so the index's
// memory is bounded by the pool's pages. The event log (stored / evicted keys,
// for cache-aware routers) keeps the newest `max_events`; a reader resumes
// from a sequence number and is told when events it asked for were dropped.
//
// Errors change nothing: a call that fails (a bad key, not enough pages even
// after eviction, a holder over its bound) leaves the index, the allocator
// and the event log as they were.
//
// Thread safety: every method may be called concurrently; one mutex guards the
// state, and the allocator's own lock is taken under it (lock order: this
// index, then the PageAllocator). Ownership: the index borrows the allocator,
// which must outlive it, and is the only one that allocates from it.
#ifndef KVHOST_SERVER_CACHE_CACHE_INDEX_H_
#define KVHOST_SERVER_CACHE_CACHE_INDEX_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <list>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/node_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "server/pool/allocator.h"

namespace kvhost {

struct CacheLimits {
  // A key's bytes: engines' block hashes are 8 (vLLM's int hash) to 64 bytes
  // (sglang's hex SHA-256); 256 leaves room for a namespace prefix.
  size_t max_key_bytes = 256;
  // Keys of one call: a 128k-token prompt in 32-token pages is 4096.
  size_t max_keys_per_call = 4096;
  // Pages one holder keeps pinned or reserved for writing at once.
  uint64_t max_held_pages_per_holder = 65536;
  // Events the log keeps, and the most one EventsSince returns.
  size_t max_events = 65536;
  size_t max_events_per_call = 4096;
};

// A key as a call sees it.
enum class CacheKeyState : uint8_t {
  kAbsent = 0,   // not in the cache
  kPresent = 1,  // published: its page holds all its bytes
  kPending = 2,  // a store is writing it: not readable yet
};

struct CacheLookup {
  // The keys present from the first on (a prefix's restorable length).
  size_t prefix = 0;
  std::vector<CacheKeyState> states;  // per key
  // The pages of the first `prefix` keys, in order.
  std::vector<uint64_t> pages;
  // Nonzero when the prefix was pinned for the holder (Unpin releases it).
  uint64_t pin_id = 0;
};

struct CacheStorePlan {
  uint64_t store_id = 0;
  // Per key: kAbsent for a key this store writes, else why it is skipped
  // (kPresent: stored already; kPending: another store writes it).
  std::vector<CacheKeyState> states;
  // The keys this store writes (indices into the call's keys) and their
  // pages, in the same order. Empty when every key was skipped (store_id is
  // then 0 and there is nothing to finish).
  std::vector<size_t> written;
  std::vector<uint64_t> pages;
  // Published pages this call evicted to make room.
  uint64_t evicted = 0;
};

enum class CacheEvictOutcome : uint8_t {
  kEvicted = 0,
  kAbsent = 1,
  kBusy = 2,  // pinned or being written: kept
};

struct CacheEvent {
  enum class Kind : uint8_t { kStored = 0, kEvicted = 1 };
  uint64_t seq = 0;
  Kind kind = Kind::kStored;
  std::string key;
};

struct CacheEvents {
  std::vector<CacheEvent> events;
  // Ask again with after_seq = next_after to resume.
  uint64_t next_after = 0;
  // Events after the asked sequence number were dropped from the log before
  // this call (the reader must resynchronise from a full listing).
  bool gap = false;
};

struct CacheStats {
  uint64_t page_num = 0;
  uint64_t free_pages = 0;
  uint64_t published = 0;  // keys
  uint64_t writing = 0;    // keys
  uint64_t pinned = 0;     // keys with at least one pin
  uint64_t hits = 0;       // keys found present by Lookup
  uint64_t misses = 0;     // keys Lookup did not find present
  uint64_t stored = 0;     // keys published
  uint64_t skipped = 0;    // keys a store skipped (present or pending)
  uint64_t evicted = 0;    // keys evicted (by Evict or to make room)
  uint64_t aborted = 0;    // keys a failed or abandoned store dropped
  // The L3 tier behind the cache (NodeCache fills them; the index leaves 0):
  // keys written through to it, fetched from it and published, asked of it
  // and not found (or refused by its checks).
  uint64_t l3_written = 0;
  uint64_t l3_fetched = 0;
  uint64_t l3_missed = 0;
};

class CacheIndex {
 public:
  // REQUIRES: `pages` outlives the index and nothing else allocates from it.
  CacheIndex(PageAllocator* pages, CacheLimits limits);

  CacheIndex(const CacheIndex&) = delete;
  CacheIndex& operator=(const CacheIndex&) = delete;

  // Which keys are present, and the longest present prefix's pages. With a
  // holder, pins that prefix (nothing when it is empty) until Unpin or
  // ReleaseHolder. Present keys of the prefix become the most recently used.
  // INVALID_ARGUMENT for a bad key list (CheckKeys); RESOURCE_EXHAUSTED when
  // the pin would take the holder past max_held_pages_per_holder. `count`
  // false: the daemon's own look (a pin for an L3 write), not counted in
  // hits and misses nor a use of the keys.
  absl::StatusOr<CacheLookup> Lookup(absl::Span<const std::string> keys,
                                     const std::string* pin_holder, bool count = true);
  // Counts a use of `keys` found present by an uncounted Lookup (a
  // restore, once its copies were accepted): their hits, and present keys
  // not pinned become the most recently used; absent keys are not counted
  // (the caller refused the call for them).
  void CountUse(absl::Span<const std::string> keys);
  // Releases a Lookup's pin. NOT_FOUND for an unknown (or released) id and
  // for another holder's pin (ids are small numbers: the holder is the check).
  absl::Status Unpin(uint64_t pin_id, const std::string& holder);

  // Reserves a page for every absent key, evicting least recently used
  // published pages as needed; present and pending keys are skipped. The
  // reserved keys are WRITING until FinishStore or ReleaseHolder(holder).
  // INVALID_ARGUMENT for a bad key list; RESOURCE_EXHAUSTED when the free
  // and evictable pages together are too few, or the holder would pass
  // max_held_pages_per_holder (nothing evicted then).
  absl::StatusOr<CacheStorePlan> BeginStore(absl::Span<const std::string> keys,
                                            const std::string& holder);
  // The store's copies were submitted: its victims are evicted for good.
  // CancelStore: they were refused: everything BeginStore did is undone
  // (victims published again, pages freed, counters back), as if the call
  // had not been made. NOT_FOUND (both) for an unknown or committed store id
  // and for another holder's store.
  absl::Status CommitStore(uint64_t store_id, const std::string& holder);
  absl::Status CancelStore(uint64_t store_id, const std::string& holder);
  // Publishes a committed store's keys (ok) or drops them and frees their
  // pages. NOT_FOUND for an unknown (finished, abandoned) or uncommitted
  // store id and for another holder's store.
  absl::Status FinishStore(uint64_t store_id, const std::string& holder, bool ok);

  // Evicts published, unpinned keys; says per key what happened.
  // INVALID_ARGUMENT for a bad key list.
  absl::StatusOr<std::vector<CacheEvictOutcome>> Evict(absl::Span<const std::string> keys);

  // Drops the holder's pins and abandons its unfinished stores (their keys
  // are dropped, their pages freed; an uncommitted one is cancelled): the
  // holder's session ended.
  void ReleaseHolder(const std::string& holder);

  // Events with a sequence number above after_seq, oldest first, at most
  // min(max, max_events_per_call).
  CacheEvents EventsSince(uint64_t after_seq, size_t max) const;

  CacheStats stats() const;
  const CacheLimits& limits() const { return limits_; }

  // INVALID_ARGUMENT naming the first offence: no keys, more than
  // max_keys_per_call, an empty key or one over max_key_bytes, a key twice.
  absl::Status CheckKeys(absl::Span<const std::string> keys) const;

 private:
  // kEvicting: a tentative store's victim, read as absent until its store
  // commits (the entry goes) or cancels (published again).
  enum class EntryState : uint8_t { kWriting, kPublished, kEvicting };
  struct Entry {
    uint64_t page = 0;
    EntryState state = EntryState::kWriting;
    uint32_t pins = 0;
    // Position in lru_ while published and unpinned (evictable).
    std::list<const std::string*>::iterator lru;
    bool in_lru = false;
  };
  struct Pin {
    std::string holder;
    std::vector<const std::string*> keys;
  };
  struct Store {
    std::string holder;
    std::vector<const std::string*> keys;
    // Until CommitStore: the victims whose pages the last keys took (in
    // order), and the keys the call skipped.
    std::vector<const std::string*> victims;
    uint64_t skipped = 0;
    bool committed = false;
  };
  using Entries = absl::node_hash_map<std::string, Entry>;

  void MakeEvictable(const std::string* key, Entry* entry) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void MakeUnevictable(Entry* entry) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Removes a published, unpinned entry, frees its page, logs the eviction.
  void EvictEntry(Entries::iterator it) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops a writing entry and frees its page (a store that did not finish).
  void DropWriting(const std::string* key) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Release(const Pin& pin) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // CancelStore's work on a found, uncommitted store.
  void Undo(const Store& store) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The store of `store_id` held by `holder`, with `committed` as asked.
  absl::flat_hash_map<uint64_t, Store>::iterator FindStore(uint64_t store_id,
                                                           const std::string& holder,
                                                           bool committed)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Publish(const std::string* key) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Log(CacheEvent::Kind kind, const std::string& key) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FreePage(uint64_t page) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status CheckHeld(const std::string& holder, uint64_t more) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  PageAllocator* const pages_;
  const CacheLimits limits_;
  mutable absl::Mutex mu_;
  Entries entries_ ABSL_GUARDED_BY(mu_);
  // Evictable keys, least recently used first.
  std::list<const std::string*> lru_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, Pin> pins_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, Store> stores_ ABSL_GUARDED_BY(mu_);
  // Pages each holder keeps pinned or reserved (a pinned key counts once per
  // pin).
  absl::flat_hash_map<std::string, uint64_t> held_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  std::deque<CacheEvent> events_ ABSL_GUARDED_BY(mu_);
  uint64_t last_seq_ ABSL_GUARDED_BY(mu_) = 0;
  CacheStats counters_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvhost

#endif  // KVHOST_SERVER_CACHE_CACHE_INDEX_H_
