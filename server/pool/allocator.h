// PageAllocator: hands out a pool's token slots in whole pages.
//
// A pool of `page_num` pages of `page_size` slots; page p owns slots
// [p * page_size, (p + 1) * page_size). Alloc pops pages from a FIFO free
// ring (the seeds' free_slots order: lowest first at start, freed pages go to
// the back), so the cost of a call is O(pages), never O(tokens).
//
// Invariants, checked by tests/allocator_test.cc:
//   * no page is handed out twice: a page is either in the free ring or
//     marked allocated, never both;
//   * conservation: free pages + allocated pages == page_num at all times;
//   * all or nothing: a call that returns an error changes nothing.
//
// Thread safety: every method may be called concurrently; one mutex guards
// the state.
#ifndef KVHOST_SERVER_POOL_ALLOCATOR_H_
#define KVHOST_SERVER_POOL_ALLOCATOR_H_

#include <cstdint>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"

namespace kvhost {

class PageAllocator {
 public:
  // REQUIRES: page_size >= 1.
  PageAllocator(uint64_t page_num, uint64_t page_size);

  PageAllocator(const PageAllocator&) = delete;
  PageAllocator& operator=(const PageAllocator&) = delete;

  // Allocates num_tokens / page_size pages and appends their ids to *pages.
  // INVALID_ARGUMENT when num_tokens is 0 or not a multiple of page_size;
  // RESOURCE_EXHAUSTED when fewer pages are free.
  absl::Status Alloc(uint64_t num_tokens, std::vector<uint64_t>* pages);

  // Returns pages to the free ring. FAILED_PRECONDITION, naming the first
  // page's slots, when any page is not allocated now; nothing is freed then.
  // REQUIRES: every id < page_num and no id twice (see ParsePages).
  absl::Status FreePages(absl::Span<const uint64_t> pages);

  // OK when every token slot lies in an allocated page; otherwise
  // FAILED_PRECONDITION naming the first slot that does not.
  // REQUIRES: every slot in [0, page_num * page_size).
  absl::Status CheckAllocated(absl::Span<const int64_t> slots) const;

  // Frees every page (the seeds' clear()).
  void Clear();

  uint64_t page_num() const { return page_num_; }
  uint64_t page_size() const { return page_size_; }
  uint64_t free_pages() const;
  uint64_t available_tokens() const { return free_pages() * page_size_; }

 private:
  const uint64_t page_num_;
  const uint64_t page_size_;
  mutable absl::Mutex mu_;
  // Ring of free page ids: free_[(head_ + i) % page_num_] for i < free_count_.
  std::vector<uint64_t> free_ ABSL_GUARDED_BY(mu_);
  uint64_t head_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t free_count_ ABSL_GUARDED_BY(mu_) = 0;
  // 1 while a page is allocated.
  std::vector<uint8_t> allocated_ ABSL_GUARDED_BY(mu_);
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
