// StorageTier: the L3 tier of a kvhostd: pages of its host pools stored in
// and fetched from a StorageBackend (a distributed cache shared by many
// nodes) by the scheduler's page keys, as sglang HiCache's HiCacheStorage
// does (batch_set / batch_get / batch_exists).
//
// Store / Fetch / Exist validate at once (a refused call runs nothing), then
// run on the tier's own threads (WorkQueue), a call cut into jobs of about
// job_bytes of pages so that its pages travel to several servers at once;
// `done` runs once, on a tier thread, with one result per page. A page is
// read from the pool as it is when its job runs (the caller keeps it
// allocated and unchanged meanwhile); a fetched page is written to the pool
// only when CheckPage found it whole, of the pool's shape and authenticated
// by its MAC under the fleet secret (server/storage/page_record.h,
// l3_secret.h). Every call names a namespace (L3Secret::PublicNamespace or
// TokenNamespace; the caller has checked the pool's owner token), and a
// call sees and writes only the pages of its namespace.
//
// Shares: at most max_pages_in_flight pages (keys, for Exist) are accepted
// and not yet done over all calls, and at most max_pages_in_flight_per_pool
// of them for one pool (a group's pools and followers count as the pool
// whose token protects them), so one client's flood leaves the rest of the
// bound to the others. A Store names one page under at most
// kMaxKeysPerPage keys.
//
// Thread safety: all methods may be called concurrently. The destructor
// finishes every accepted call (its `done` runs) before it returns. No
// exception leaves a tier thread: a job that throws fails its pages
// (kUnavailable) and its call finishes as any other.
// Lifetime: a call holds its pool (shared_ptr) until its `done` ran.
#ifndef KVHOST_SERVER_STORAGE_STORAGE_TIER_H_
#define KVHOST_SERVER_STORAGE_STORAGE_TIER_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "server/metrics/kvhost_metrics.h"
#include "server/pool/pool.h"
#include "server/storage/backend.h"
#include "server/storage/l3_secret.h"
#include "server/storage/page_record.h"
#include "server/storage/work_queue.h"

namespace kvhost {

// Keys one page may be stored under in one Store call: a page stored under
// thousands of keys costs the cache thousands of items for one page of the
// pool (a client that means it makes several calls).
inline constexpr int kMaxKeysPerPage = 4;

struct StorageTierOptions {
  int threads = 4;
  uint64_t max_pages_in_flight = 4096;
  // One pool's share of max_pages_in_flight (the smaller of the two holds).
  uint64_t max_pages_in_flight_per_pool = 1024;
  // A job takes pages up to job_bytes of them (at least one page, at most
  // max_pages_per_job): small enough that one call's pages spread over the
  // threads (and so over servers), large enough that a batch get of small
  // pages is one round trip. 512 KiB: on the 2-core dev VM, 256 KiB pages
  // moved at 1.4 GB/s two to a job and 0.4 GB/s eight to a job (PERF.md,
  // run L3-1).
  uint64_t job_bytes = uint64_t{512} << 10;
  uint32_t max_pages_per_job = 8;
};

class StorageTier {
 public:
  using PagesDone = std::function<void(std::vector<PageResult>)>;
  using PrefixDone = std::function<void(uint64_t prefix_pages)>;

  // `metrics` (null: none) must outlive this.
  StorageTier(std::unique_ptr<StorageBackend> backend, const StorageTierOptions& options,
              L3Secret secret, KvhostMetrics* metrics = nullptr);
  ~StorageTier();
  StorageTier(const StorageTier&) = delete;
  StorageTier& operator=(const StorageTier&) = delete;

  // Writes the pages at `indices` of `pool` under `keys` of namespace `ns`
  // (kStored or kUnavailable per page). Refused, with nothing run:
  // INVALID_ARGUMENT for counts that differ, a bad key or index, an index
  // given more than kMaxKeysPerPage times; FAILED_PRECONDITION for a page
  // not allocated or a pool without flat pages; RESOURCE_EXHAUSTED over the
  // pages-in-flight bound or the pool's share of it (the message names it).
  absl::Status Store(std::shared_ptr<Pool> pool, std::string ns, std::vector<int64_t> indices,
                     std::vector<std::string> keys, PagesDone done);
  // Reads the pages under `keys` of namespace `ns` into the pages at
  // `indices` (kHit, kMiss, kCorrupt, kShapeMismatch per page). Refused as
  // Store, and for an index given twice.
  absl::Status Fetch(std::shared_ptr<Pool> pool, std::string ns, std::vector<std::string> keys,
                     std::vector<int64_t> indices, PagesDone done);
  // The longest prefix of `keys` of namespace `ns` whose pages are stored
  // (part 0 present), for `pool`'s share. Refused for a bad key or over the
  // bound.
  absl::Status Exist(std::shared_ptr<Pool> pool, std::string ns, std::vector<std::string> keys,
                     PrefixDone done);

  uint64_t pages_in_flight() const { return in_flight_.load(); }
  uint64_t max_pages_in_flight() const { return options_.max_pages_in_flight; }
  const StorageBackend& backend() const { return *backend_; }
  const L3Secret& secret() const { return secret_; }
  // Fetched records refused for their MAC so far.
  uint64_t unauthenticated() const { return unauthenticated_.load(); }

 private:
  struct Call;

  // The checks Store and Fetch share; fills `tag`.
  absl::Status CheckPages(const Pool& pool, absl::Span<const int64_t> indices,
                          absl::Span<const std::string> keys, PageShapeTag* tag) const;
  // Takes `n` pages of the bound and of `pool`'s share, or
  // RESOURCE_EXHAUSTED naming the one passed.
  absl::Status Reserve(const Pool& pool, uint64_t n);
  // Gives back what Reserve took.
  void Release(const Pool& pool, uint64_t n);
  // Runs `job` of `call` on a tier thread; what it throws fails the pages
  // [begin, end) (or the Exist call) instead of the process.
  void RunJob(const std::shared_ptr<Call>& call, size_t begin, size_t end);
  // Counts and logs (1st, 2nd, 4th, ...) a record whose MAC failed.
  void NoteUnauthenticated(const Call& call, size_t page);
  // Queues `call`'s jobs (or finishes it at once when it has no pages).
  void Launch(std::shared_ptr<Call> call);
  void StoreJob(Call& call, size_t begin, size_t end);
  void FetchJob(Call& call, size_t begin, size_t end);
  // One job's end: the last one releases the call's pages and runs `done`.
  void JobDone(const std::shared_ptr<Call>& call);

  const std::unique_ptr<StorageBackend> backend_;
  const StorageTierOptions options_;
  const L3Secret secret_;
  KvhostMetrics* const metrics_;
  std::atomic<uint64_t> in_flight_{0};
  std::atomic<uint64_t> unauthenticated_{0};
  absl::Mutex shares_mu_;
  // Pages in flight per pool (Pool::token_owner), present while not 0.
  absl::flat_hash_map<const Pool*, uint64_t> shares_ ABSL_GUARDED_BY(shares_mu_);
  // Last: its destructor runs the queued jobs, which use the members above.
  WorkQueue queue_;
};

}  // namespace kvhost

#endif  // KVHOST_SERVER_STORAGE_STORAGE_TIER_H_
