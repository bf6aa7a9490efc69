// StorageTicketTable: the tickets of detached StorageService calls
// (StorePages / FetchPages with `detach`), from the call's acceptance until
// per-pool retention pushes them out (proto/kvhost/v1/storage.proto).
//
// A done ticket stays: WaitStorage may return it any number of times, so a
// client whose wait reply was lost (its deadline passed as the pages
// finished) asks again and gets it. Finished tickets are kept by per-pool
// retention (retention.h): a pool keeps its newest within its limits (its
// oldest dropped past them; a pool's flood drops only its own); a deleted
// pool's tickets go once its object is gone. A ticket belongs to the Pool
// object its call named: Wait finds it only for that object, never through
// another pool nor a pool made again under the same name.
//
// Memory: a ticket reserves kBytesPerPage for each of its pages (through
// the Reserve function: PoolRegistry::ReserveTransient, against
// --memory-limit) from Open until it is dropped, so kept results are paid
// for by the memory budget like page-stream buffers.
//
// The table knows no protobuf: a ticket's status is StorageTicketStatus,
// its pages' results the tier's PageResults; StorageServiceImpl converts.
//
// Thread safety: all methods may be called concurrently. Waiters run
// outside the lock, on the thread of Finish (a tier thread) or of Wait.
#ifndef KVHOST_SERVER_TICKETS_STORAGE_TICKET_TABLE_H_
#define KVHOST_SERVER_TICKETS_STORAGE_TICKET_TABLE_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/metrics/kvhost_metrics.h"
#include "server/pool/pool.h"
#include "server/pool/registry.h"
#include "server/storage/page_record.h"
#include "server/tickets/retention.h"

namespace kvhost {

// Which call a storage ticket is of.
enum class StorageCall : uint8_t { kStore, kFetch };

// A storage ticket as Wait gives it: running (a poll's answer) or done with
// its call's results.
struct StorageTicketStatus {
  uint64_t id = 0;
  // False only for a poll of a ticket whose pages are still in flight.
  bool done = false;
  // Once done: the call, one result per page in the call's order (each
  // detail cut by the caller to what a reply carries), and the pool's flat
  // page bytes (for the byte counts a reply gives).
  StorageCall call = StorageCall::kStore;
  std::vector<PageResult> pages;
  uint64_t page_bytes = 0;
};

class StorageTicketTable {
 public:
  // Heap a kept result takes per page: up to 240 bytes of detail
  // (StorageServiceImpl::kMaxDetailBytes) and the PageResult around it
  // (measured with the results as protobuf: 65536 kept pages took 20.6 MiB,
  // 330 bytes each; the domain PageResult is no larger).
  static constexpr uint64_t kBytesPerPage = 384;
  // Reserves `bytes` for `what` (a message's words), or RESOURCE_EXHAUSTED.
  using Reserve =
      std::function<absl::StatusOr<TransientReservation>(uint64_t bytes, const std::string& what)>;
  // Called once with the ticket's status: done with its result, or (a
  // poll of a running ticket) not done. Returns whether it delivered the
  // status to its caller (false: its call was cancelled meanwhile).
  using Waiter = std::function<bool(const StorageTicketStatus&)>;

  StorageTicketTable() : StorageTicketTable(PerPoolRetention{}) {}
  // `metrics` (null: none) must outlive this. `reserve` null: nothing is
  // reserved.
  explicit StorageTicketTable(const PerPoolRetention& retention, KvhostMetrics* metrics = nullptr,
                              Reserve reserve = nullptr)
      : retention_(retention), metrics_(metrics), reserve_(std::move(reserve)) {}
  StorageTicketTable(const StorageTicketTable&) = delete;
  StorageTicketTable& operator=(const StorageTicketTable&) = delete;

  // A new running ticket of `pool` for a call of `pages` pages; its id
  // (never 0, never reused). RESOURCE_EXHAUSTED (Reserve's message) when
  // its results do not fit the memory budget.
  absl::StatusOr<uint64_t> Open(const std::shared_ptr<Pool>& pool, uint64_t pages);
  // Forgets a ticket whose call was refused (never shown to anyone).
  void Discard(uint64_t id);
  // The ticket's call is done with `status` (its call, results and page
  // bytes set; id and done are set here), covering `pages` pages: kept (by
  // per-pool retention), and given to its waiters.
  void Finish(uint64_t id, StorageTicketStatus status, uint64_t pages);
  // Has `waiter` called with ticket `id` of `pool` once it is done (at once
  // when it is, or with `poll`). NOT_FOUND naming the id when `pool` has no
  // such ticket. Else returns a number for Unwait.
  absl::StatusOr<uint64_t> Wait(const std::shared_ptr<Pool>& pool, uint64_t id, bool poll,
                                Waiter waiter);
  // Forgets a waiter Wait registered (its call was cancelled); a no-op when
  // it ran or the ticket is gone.
  void Unwait(uint64_t id, uint64_t waiter);

  // Tickets held now, running or finished.
  size_t size() const;
  // Finished tickets dropped by retention before any wait delivered them.
  uint64_t dropped() const;

 private:
  struct Ticket {
    std::weak_ptr<Pool> pool;
    bool done = false;
    bool delivered = false;  // a waiter returned it
    uint64_t pages = 0;
    StorageTicketStatus status;
    std::vector<std::pair<uint64_t, Waiter>> waiters;
    TransientReservation memory;  // its results' bytes, until it is dropped
  };
  // A pool's finished tickets, oldest first, and their pages.
  struct Kept {
    std::deque<uint64_t> ids;
    uint64_t pages = 0;
  };
  using KeptByPool = std::map<std::weak_ptr<Pool>, Kept, std::owner_less<std::weak_ptr<Pool>>>;

  // Puts a done ticket on its pool's kept list, dropping the pool's oldest
  // past per-pool retention's limits.
  void Keep(uint64_t id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Marks a ticket delivered (a waiter returned it), if it is still held.
  void Delivered(uint64_t id) ABSL_LOCKS_EXCLUDED(mu_);
  // Drops the kept tickets of pools whose object is gone.
  void SweepGonePools() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const PerPoolRetention retention_;
  KvhostMetrics* const metrics_;
  const Reserve reserve_;
  mutable absl::Mutex mu_;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t next_waiter_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t dropped_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<uint64_t, Ticket> tickets_ ABSL_GUARDED_BY(mu_);
  KeptByPool kept_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvhost

#endif  // KVHOST_SERVER_TICKETS_STORAGE_TICKET_TABLE_H_
