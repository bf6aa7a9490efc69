// PoolCopy: whole pages copied between two host pools of one shape inside
// kvhostd, with no attachment and no device: the node cache's Store from and
// Restore to an index-addressed pool (server/cache/node_cache.h). The two
// pools' host layouts may differ: each layer of each component is gathered
// from the source's layout into a buffer of rows and scattered into the
// destination's, both through ForEachPiece (engine.h), the one home of the
// address math.
//
// CheckPoolCopyShape and CheckPoolCopySlots are the checks a copy needs
// before it is submitted; PoolCopier runs the copies, in submission order,
// on a thread of its own (the same on either backend: both pools are host
// memory). A job holds both pools and their slots (Pool::UseSlots) until it
// ends, so a DeletePool meanwhile frees nothing under it.
//
// Thread safety: the checks are pure; PoolCopier's methods may be called
// concurrently.
#ifndef KVHOST_SERVER_TRANSFER_POOL_COPY_H_
#define KVHOST_SERVER_TRANSFER_POOL_COPY_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "server/pool/pool.h"
#include "server/tickets/ticket.h"

namespace kvhost {

// One copy: from_slots[i] of `from` to to_slots[i] of `to`, whole pages.
struct PoolCopyJob {
  std::shared_ptr<Pool> from;
  std::shared_ptr<Pool> to;
  std::vector<int64_t> from_slots;
  std::vector<int64_t> to_slots;
  // Pool::UseSlots of each while the job lives (taken by PoolCopier::Submit
  // where the caller did not, before it checked the slots).
  std::shared_ptr<void> from_use;
  std::shared_ptr<void> to_use;
  // One ticket layer per pool layer; finished by the copier.
  std::shared_ptr<Ticket> ticket;
};

// INVALID_ARGUMENT naming both pools and the first difference unless `pool`
// has `cache`'s shape: kind, dtype, page size, layers (start and count), and
// the same components with the same row bytes and row tokens (the host
// layout may differ). A LOGICAL pool (no bytes) is refused.
absl::Status CheckPoolCopyShape(const Pool& pool, const Pool& cache);

// `slots` of `pool` as one side of a copy, `field` naming them in messages
// ("pool.host_indices"): each in range (INVALID_ARGUMENT), whole pages
// (INVALID_ARGUMENT, runs.h's CheckWholePages), no page twice
// (INVALID_ARGUMENT), allocated in the pool's allocator owner
// (FAILED_PRECONDITION, naming the pool).
absl::Status CheckPoolCopySlots(const Pool& pool, absl::Span<const int64_t> slots,
                                const char* field);

// Copies `job` layer by layer, each layer reported to its ticket; stops
// between layers when the ticket is cancelled. The ticket is not finished
// here. REQUIRES: the checks above passed.
absl::Status RunPoolCopy(const PoolCopyJob& job);

class PoolCopier {
 public:
  PoolCopier();
  // Drains, then stops the thread.
  ~PoolCopier();
  PoolCopier(const PoolCopier&) = delete;
  PoolCopier& operator=(const PoolCopier&) = delete;

  // Queues `job` (its ticket in flight); the copier finishes the ticket
  // exactly once, with RunPoolCopy's end.
  void Submit(PoolCopyJob job);
  // Blocks until every job submitted so far has finished.
  void Drain();

 private:
  void Loop();

  absl::Mutex mu_;
  std::deque<PoolCopyJob> queue_ ABSL_GUARDED_BY(mu_);
  bool busy_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace kvhost

#endif  // KVHOST_SERVER_TRANSFER_POOL_COPY_H_
