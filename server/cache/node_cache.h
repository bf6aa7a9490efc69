// NodeCache: one key-addressed cache of the node (issue 33). It joins a pool
// of the registry (the cache's shape: kind, layout, dtype, dims, page size,
// and its pages), a CacheIndex over that pool's allocator (which key holds
// which page), and the moves between keys and an attachment's device rows,
// which it submits to the TransferManager as ordinary backups and loads of
// that pool: Store is a backup into pages the index reserved, published when
// its ticket ends well; Restore is a load from pinned pages, unpinned when
// its ticket ends. So a cache page moves by the same copy paths, per-layer
// counters and fences as any pool page. StoreFromPool and RestoreToPool move
// pages between the cache and an index-addressed pool's slots instead (no
// attachment: host memory to host memory inside kvhostd, TransferManager::
// SubmitPoolCopy), by the same plan, pins, publish and events.
//
// Callers: every call is made within a session (Caller::sessions; the first
// one names the holder of its pins and stores), so that a dead worker's pins
// and stores end with it (SessionEnded). Engine instances sharing the cache
// attach their device KV to the cache's pool, each its own attachment; a page
// one stored is a hit for every other.
//
// A store whose worker dies publishes nothing: SessionEnded abandons its
// stores in flight, whose pages are freed only when their tickets end (a copy
// may still be writing them), never handed to another store before.
// Likewise a restore's pin lasts until its ticket ends, whatever happens to
// its session, so no page is evicted while a copy reads it.
//
// The L3 tier behind the cache (per call, opt-in, CacheL3): a store may write
// its published keys through to the tier, each page pinned (a holder of the
// cache's own) until the tier read it; a lookup may fetch the keys it misses
// from the tier into pages the index reserved (one tentative store a key,
// a holder of the cache's own), each published when its record was written
// and verified (a hit) or dropped (a miss, a bad record). A failed L3 write
// leaves the page published. The tier's callbacks hold the cache by
// shared_ptr, and the tier itself only weakly (it goes with the daemon).
//
// Thread safety: all methods may be called concurrently. Lock order: this
// cache's mutex, then the index's; the TransferManager is called outside the
// mutex, and ticket callbacks (on engine threads) take it last.
// Ownership: always held by a shared_ptr (Create): a ticket it submitted
// keeps it alive until the ticket ends, so a cache dropped with stores in
// flight still publishes or frees their pages. It shares its pool; the
// TransferManager must outlive it.
#ifndef KVHOST_SERVER_CACHE_NODE_CACHE_H_
#define KVHOST_SERVER_CACHE_NODE_CACHE_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "server/access/caller.h"
#include "server/cache/cache_index.h"
#include "server/pool/pool.h"
#include "server/storage/storage_tier.h"
#include "server/tickets/ticket.h"
#include "server/transfer/transfer_manager.h"

namespace kvhost {

// The L3 tier behind a cache, for one call: the tier (weak: a callback that
// outlives the daemon's tier finds it gone and writes nothing) and the
// namespace of the cache's pool's keys there (as StorePages of that pool).
struct CacheL3 {
  std::weak_ptr<StorageTier> tier;
  std::string ns;
};

class NodeCache : public std::enable_shared_from_this<NodeCache> {
 public:
  // REQUIRES: `pool` is the cache's own: nothing else allocates from it.
  static std::shared_ptr<NodeCache> Create(std::shared_ptr<Pool> pool, TransferManager* transfers,
                                           CacheLimits limits);

  NodeCache(const NodeCache&) = delete;
  NodeCache& operator=(const NodeCache&) = delete;

  const std::shared_ptr<Pool>& pool() const { return pool_; }
  const std::string& name() const { return pool_->name(); }

  // Which keys are present (CacheIndex::Lookup); with `pin`, pins the present
  // prefix for the caller's session until ReleasePin or the session's end (a
  // Restore takes a pin of its own; this one keeps pages for a later call).
  // FAILED_PRECONDITION for a caller without an open session; the index's
  // errors.
  absl::StatusOr<CacheLookup> Lookup(const Caller& caller, absl::Span<const std::string> keys,
                                     bool pin);
  absl::Status ReleasePin(const Caller& caller, uint64_t pin_id);

  struct Stored {
    CacheStorePlan plan;
    // The backup of the written keys (nullptr when every key was skipped).
    std::shared_ptr<Ticket> ticket;
  };
  // Backs up key i's page from device rows device[i * page_size, (i + 1) *
  // page_size) of `attachment_id` (an attachment of the cache's pool), for
  // the keys not yet present; `ready_fence` as Submit's wait_event_handle.
  // The keys become present when the ticket ends OK; with `write_through`,
  // each is then stored to that L3 tier under its key (a refused or failed
  // L3 write is logged and leaves the key published).
  // Errors (nothing reserved, nothing submitted): FAILED_PRECONDITION for a
  // caller without an open session; INVALID_ARGUMENT for a bad key list or a device
  // row count that is not keys * page_size, and for an attachment of another
  // pool; the index's RESOURCE_EXHAUSTED; Submit's errors.
  absl::StatusOr<Stored> Store(const Caller& caller, const std::string& attachment_id,
                               absl::Span<const std::string> keys, absl::Span<const int64_t> device,
                               const std::string& ready_fence,
                               const CacheL3* write_through = nullptr);

  // Reserves a page for each of `keys` that is absent and fetches it from
  // `l3` (StorageTier::Fetch); the keys read PENDING until the fetch ends,
  // then a hit is published (a STORED event) and a miss or a record the
  // tier refused (CRC, MAC, shape) is dropped. Returns the indices of the
  // keys it fetches (present and pending ones are skipped). Errors, nothing
  // reserved: FAILED_PRECONDITION when the tier is gone; the index's
  // (INVALID_ARGUMENT, RESOURCE_EXHAUSTED without room) and the tier's
  // (INVALID_ARGUMENT for a key over its bound, RESOURCE_EXHAUSTED over its
  // pages in flight).
  absl::StatusOr<std::vector<size_t>> FetchMissing(const CacheL3& l3,
                                                   absl::Span<const std::string> keys);

  // Loads every key's page into its device rows (as Store's), `wait_fence`
  // as Submit's wait_event_handle; the ticket has per-layer progress as any
  // load. FAILED_PRECONDITION naming the first key not present (then nothing
  // is pinned or submitted); otherwise Store's errors.
  absl::StatusOr<std::shared_ptr<Ticket>> Restore(const Caller& caller,
                                                  const std::string& attachment_id,
                                                  absl::Span<const std::string> keys,
                                                  absl::Span<const int64_t> device,
                                                  const std::string& wait_fence);

  // An index-addressed pool's slots as the source of StoreFromPool or the
  // destination of RestoreToPool: the pool as the caller resolved and
  // owner-checked it (PoolRegistry::Resolve, once), page_size slots a key.
  struct PoolSlots {
    std::shared_ptr<Pool> pool;
    absl::Span<const int64_t> slots;
  };
  // Store with key i's page copied from source.slots[i * page_size, (i + 1)
  // * page_size) inside kvhostd; the same plan, skips, evictions, publish,
  // events and write-through. The ticket counts as a backup. Errors
  // (nothing reserved or submitted): Store's for the session and the keys;
  // INVALID_ARGUMENT for the cache's own pool, a pool of another shape
  // (CheckPoolCopyShape), a slot count other than keys * page_size and
  // CheckPoolCopySlots' (FAILED_PRECONDITION for a slot not allocated);
  // FAILED_PRECONDITION when a live session of another instance holds the
  // cache's pool (ClaimPool), as a Backup into it is; SubmitPoolCopy's.
  absl::StatusOr<Stored> StoreFromPool(const Caller& caller, const PoolSlots& source,
                                       absl::Span<const std::string> keys,
                                       const CacheL3* write_through = nullptr);
  // Restore into target.slots (as StoreFromPool's), the pages pinned until
  // the ticket (a load) ends. Errors: StoreFromPool's, the claim checked on
  // `target` (which the copy writes), and Restore's FAILED_PRECONDITION for
  // a key not present.
  absl::StatusOr<std::shared_ptr<Ticket>> RestoreToPool(const Caller& caller,
                                                        const PoolSlots& target,
                                                        absl::Span<const std::string> keys);

  absl::StatusOr<std::vector<CacheEvictOutcome>> Evict(absl::Span<const std::string> keys) {
    return index_.Evict(keys);
  }
  CacheEvents EventsSince(uint64_t after_seq, size_t max) const {
    return index_.EventsSince(after_seq, max);
  }
  // The index's figures and the L3 tier's keys.
  CacheStats stats() const;
  const CacheLimits& limits() const { return index_.limits(); }

  // The session ended (its worker closed it or died): its loose pins are
  // released, its stores in flight abandoned (they publish nothing).
  void SessionEnded(const std::string& session_id);

 private:
  struct InFlightStore {
    std::string holder;
    bool abandoned = false;
    // With write-through: the tier and the keys the store writes.
    std::optional<CacheL3> write_through;
    std::vector<std::string> keys;
  };
  struct L3Fetch;

  NodeCache(std::shared_ptr<Pool> pool, TransferManager* transfers, CacheLimits limits);

  absl::StatusOr<std::string> Holder(const Caller& caller) const;
  // INVALID_ARGUMENT unless `attachment_id` is an attachment of this cache's
  // pool that `caller` may use, and `device` has page_size rows per key.
  absl::Status CheckTarget(const Caller& caller, const std::string& attachment_id, size_t keys,
                           absl::Span<const int64_t> device) const;
  // Store's and Restore's checks, in order (Holder, the keys, CheckTarget):
  // the holder's session, or the first refusal.
  absl::StatusOr<std::string> OpenMove(const Caller& caller, const std::string& attachment_id,
                                       absl::Span<const std::string> keys,
                                       absl::Span<const int64_t> device) const;
  // StoreFromPool's and RestoreToPool's checks (Holder, the keys, the pool,
  // its slots, the claim on `written`): the holder's session, or the first
  // refusal.
  absl::StatusOr<std::string> OpenPoolMove(const Caller& caller, const PoolSlots& pool,
                                           absl::Span<const std::string> keys, Pool& written) const;
  // Store's and Restore's steps after their checks, whatever copies: the
  // index's plan (or pin), `submit` with the cache pages' slots and the
  // other side's rows (page_size a key: `rows`' for the written keys), and
  // the ticket's end (publish, unpin). A refused submit leaves the cache as
  // it was.
  using SubmitCopy = std::function<absl::StatusOr<std::shared_ptr<Ticket>>(
      std::vector<int64_t> cache_slots, std::vector<int64_t> rows)>;
  absl::StatusOr<Stored> StoreWith(const std::string& holder, absl::Span<const std::string> keys,
                                   absl::Span<const int64_t> rows, const CacheL3* write_through,
                                   const SubmitCopy& submit);
  absl::StatusOr<std::shared_ptr<Ticket>> RestoreWith(const std::string& holder,
                                                      absl::Span<const std::string> keys,
                                                      absl::Span<const int64_t> rows,
                                                      const SubmitCopy& submit);
  // The token slots of `pages`, in order.
  std::vector<int64_t> Slots(absl::Span<const uint64_t> pages) const;
  // The first token slot of each of `pages` (the L3 tier's page indices).
  std::vector<int64_t> FirstSlots(absl::Span<const uint64_t> pages) const;
  void StoreEnded(uint64_t store_id, const absl::Status& status);
  // A holder of the cache's own for an L3 call (`what`: write, fetch),
  // never a session's id.
  std::string L3Holder(const char* what);
  // Pins the published ones of `keys` and stores them to the tier, unpinned
  // when the tier is done.
  void WriteThrough(const CacheL3& l3, std::vector<std::string> keys);
  // The fetch's end: each hit published, each miss dropped.
  void FetchEnded(const L3Fetch& fetch, const std::vector<PageResult>& results);

  const std::shared_ptr<Pool> pool_;
  TransferManager* const transfers_;
  CacheIndex index_;
  mutable absl::Mutex mu_;
  // Lookup pins not yet taken by a Restore, by id: their holder.
  absl::flat_hash_map<uint64_t, std::string> loose_pins_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, InFlightStore> stores_ ABSL_GUARDED_BY(mu_);
  std::atomic<uint64_t> next_l3_call_{1};
  std::atomic<uint64_t> l3_written_{0};
  std::atomic<uint64_t> l3_fetched_{0};
  std::atomic<uint64_t> l3_missed_{0};
};

}  // namespace kvhost

#endif  // KVHOST_SERVER_CACHE_NODE_CACHE_H_
