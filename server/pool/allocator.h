// PageAllocator: hands out a pool's token slots in whole pages, keeping runs
// of consecutive pages together.
//
// A pool of `page_num` pages of `page_size` slots; page p owns slots
// [p * page_size, (p + 1) * page_size). Free space is kept as extents:
// maximal runs of consecutive free pages (two extents never touch; a freed run
// joins its free neighbours). Alloc of k pages takes
//   * best fit: the smallest extent of at least k pages (ties: the lowest
//     start), carved from its start; or, when no extent is that large,
//   * the fewest runs: whole extents, largest first (ties: the lowest start),
//     until the pages still wanted fit in one extent, which is then carved by
//     best fit as above.
// The ids come out ascending within each run, runs in the order taken. A
// fresh or cleared pool is one extent, so it hands out 0, 1, 2, ... in order.
// Why not the seeds' FIFO free list (freed pages to the back): after churn it
// hands out pages one here, one there, and a transfer's copy pieces are only
// as long as the runs of its host slots (issue 15: ~1-page runs kept the copy
// engine at 2 KiB pieces, 4 GB/s instead of ~50; bench/allocator_bench.cc
// measures the runs both give).
//
// Cost: O(pages of the call) plus O(log extents) per extent touched (or per
// run of consecutive ids in a FreePages list); free_pages() is O(1). Only the
// constructor and Clear() are O(page_num).
//
// Invariants, checked by tests/allocator_test.cc:
//   * no page is handed out twice: a page is either in exactly one extent or
//     marked allocated, never both;
//   * conservation: free pages + allocated pages == page_num at all times;
//   * extents are maximal: no two free extents are adjacent;
//   * all or nothing: a call that returns an error changes nothing.
//
// Thread safety: every method may be called concurrently; one mutex guards
// the state.
#ifndef KVHOST_SERVER_POOL_ALLOCATOR_H_
#define KVHOST_SERVER_POOL_ALLOCATOR_H_

#include <cstdint>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/btree_map.h"
#include "absl/container/btree_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"

namespace kvhost {

class PageAllocator {
 public:
  // Host memory the bookkeeping may reach, per page of the pool, at its worst:
  // every other page free makes page_num / 2 extents, each a 16-byte entry in
  // two b-trees, plus one state byte per page. Measured by
  // tests/allocator_test.cc (BookkeepingStaysWithinItsBound, 2^20 pages):
  // 19.7 bytes a page with the extents made in order, 23.7 in random order.
  // Erase keeps b-tree nodes at least half full (absl's
  // rebalance_after_delete), which caps it near 40. The registry counts this
  // against host memory.
  static constexpr uint64_t kMaxBookkeepingBytesPerPage = 48;

  // REQUIRES: page_size >= 1.
  PageAllocator(uint64_t page_num, uint64_t page_size);

  PageAllocator(const PageAllocator&) = delete;
  PageAllocator& operator=(const PageAllocator&) = delete;

  // Allocates num_tokens / page_size pages (order above) and appends their ids
  // to *pages. INVALID_ARGUMENT when num_tokens is 0 or not a multiple of
  // page_size; RESOURCE_EXHAUSTED when fewer pages are free.
  absl::Status Alloc(uint64_t num_tokens, std::vector<uint64_t>* pages);

  // Returns pages to the free extents. FAILED_PRECONDITION, naming the first
  // such page's slots, when a page is not allocated now; INVALID_ARGUMENT when
  // an id is >= page_num or appears twice. Nothing is freed on an error.
  absl::Status FreePages(absl::Span<const uint64_t> pages);

  // OK when every token slot lies in an allocated page; otherwise
  // FAILED_PRECONDITION naming the first slot that does not.
  // REQUIRES: every slot in [0, page_num * page_size).
  absl::Status CheckAllocated(absl::Span<const int64_t> slots) const;

  // Frees every page (the seeds' clear()): the pool is one extent again.
  void Clear();

  uint64_t page_num() const { return page_num_; }
  uint64_t page_size() const { return page_size_; }
  uint64_t free_pages() const;
  uint64_t available_tokens() const { return free_pages() * page_size_; }

 private:
  enum PageState : uint8_t { kFree = 0, kAllocated = 1, kFreeing = 2 };

  // Hands out `take` pages from the start of the extent (length, start) and
  // keeps the rest as an extent.
  void TakeFrom(std::pair<uint64_t, uint64_t> extent, uint64_t take, std::vector<uint64_t>* pages)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Adds the free run [start, start + length), joined with the extents that
  // end at start or begin at its end. REQUIRES: no page of it is free now.
  void AddRun(uint64_t start, uint64_t length) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ResetLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const uint64_t page_num_;
  const uint64_t page_size_;
  mutable absl::Mutex mu_;
  // The extents twice: start -> length (to find neighbours) and
  // (length, start) (for best fit and largest first).
  absl::btree_map<uint64_t, uint64_t> by_start_ ABSL_GUARDED_BY(mu_);
  absl::btree_set<std::pair<uint64_t, uint64_t>> by_length_ ABSL_GUARDED_BY(mu_);
  uint64_t free_count_ ABSL_GUARDED_BY(mu_) = 0;
  // kFreeing only inside FreePages, to see a repeated id.
  std::vector<PageState> state_ ABSL_GUARDED_BY(mu_);
};

// Checks a list of token slots that must be whole pages of a pool of
// `size_tokens` slots (the form Alloc returns and Free / page metadata take):
// length a positive multiple of page_size, each group of page_size entries one
// page's slots in order starting at a multiple of page_size, in range, no page
// twice. Returns the page ids in list order, or INVALID_ARGUMENT naming the
// first offending position and value.
absl::StatusOr<std::vector<uint64_t>> ParsePages(absl::Span<const int64_t> slots,
                                                 uint64_t page_size, uint64_t size_tokens);

}  // namespace kvhost

#endif  // KVHOST_SERVER_POOL_ALLOCATOR_H_
