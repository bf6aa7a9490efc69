#include "server/pool/allocator.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace kvhost {

PageAllocator::PageAllocator(uint64_t page_num, uint64_t page_size)
    : page_num_(page_num), page_size_(page_size), free_(page_num), allocated_(page_num, 0) {
  for (uint64_t p = 0; p < page_num_; ++p) free_[p] = p;
  free_count_ = page_num_;
}

absl::Status PageAllocator::Alloc(uint64_t num_tokens, std::vector<uint64_t>* pages) {
  if (num_tokens == 0 || num_tokens % page_size_ != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "num_tokens ", num_tokens, " is not a positive multiple of page_size ", page_size_));
  }
  const uint64_t want = num_tokens / page_size_;
  absl::MutexLock lock(&mu_);
  if (want > free_count_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("num_tokens ", num_tokens, " requested but only ", free_count_ * page_size_,
                     " of ", page_num_ * page_size_, " slots are free"));
  }
  pages->reserve(pages->size() + want);
  for (uint64_t i = 0; i < want; ++i) {
    const uint64_t page = free_[head_];
    head_ = head_ + 1 == page_num_ ? 0 : head_ + 1;
    allocated_[page] = 1;
    pages->push_back(page);
  }
  free_count_ -= want;
  return absl::OkStatus();
}

absl::Status PageAllocator::FreePages(absl::Span<const uint64_t> pages) {
  absl::MutexLock lock(&mu_);
  for (uint64_t page : pages) {
    if (!allocated_[page]) {
      return absl::FailedPreconditionError(
          absl::StrCat("page ", page, " (slots ", page * page_size_, "..",
                       (page + 1) * page_size_ - 1, ") is not allocated"));
    }
  }
  for (uint64_t page : pages) {
    allocated_[page] = 0;
    uint64_t tail = head_ + free_count_;
    if (tail >= page_num_) tail -= page_num_;
    free_[tail] = page;
    ++free_count_;
  }
  return absl::OkStatus();
}

absl::Status PageAllocator::CheckAllocated(absl::Span<const int64_t> slots) const {
  absl::MutexLock lock(&mu_);
  for (int64_t slot : slots) {
    if (!allocated_[static_cast<uint64_t>(slot) / page_size_]) {
      return absl::FailedPreconditionError(
          absl::StrCat("host slot ", slot, " is not allocated (page ",
                       static_cast<uint64_t>(slot) / page_size_, ")"));
    }
  }
  return absl::OkStatus();
}

void PageAllocator::Clear() {
  absl::MutexLock lock(&mu_);
  for (uint64_t p = 0; p < page_num_; ++p) free_[p] = p;
  std::fill(allocated_.begin(), allocated_.end(), 0);
  head_ = 0;
  free_count_ = page_num_;
}

uint64_t PageAllocator::free_pages() const {
  absl::MutexLock lock(&mu_);
  return free_count_;
}

absl::StatusOr<std::vector<uint64_t>> ParsePages(absl::Span<const int64_t> slots,
                                                 uint64_t page_size, uint64_t size_tokens) {
  if (slots.empty() || slots.size() % page_size != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "indices length ", slots.size(), " is not a positive multiple of page_size ", page_size));
  }
  std::vector<uint64_t> pages;
  pages.reserve(slots.size() / page_size);
  for (size_t i = 0; i < slots.size(); i += page_size) {
    const int64_t first = slots[i];
    if (first < 0 || static_cast<uint64_t>(first) >= size_tokens) {
      return absl::InvalidArgumentError(absl::StrCat("index ", first, " at position ", i,
                                                     " out of range [0, ", size_tokens, ")"));
    }
    if (static_cast<uint64_t>(first) % page_size != 0) {
      return absl::InvalidArgumentError(absl::StrCat("index ", first, " at position ", i,
                                                     " does not start a page (page_size ",
                                                     page_size, ")"));
    }
    for (uint64_t j = 1; j < page_size; ++j) {
      if (slots[i + j] != first + static_cast<int64_t>(j)) {
        return absl::InvalidArgumentError(
            absl::StrCat("index ", slots[i + j], " at position ", i + j, " breaks the page run ",
                         first, "..", first + static_cast<int64_t>(page_size) - 1));
      }
    }
    pages.push_back(static_cast<uint64_t>(first) / page_size);
  }
  // (page, list position) sorted: a repeat sits right after an earlier entry
  // of its page; report the repeat that comes first in the list.
  std::vector<std::pair<uint64_t, size_t>> sorted(pages.size());
  for (size_t k = 0; k < pages.size(); ++k) sorted[k] = {pages[k], k};
  std::sort(sorted.begin(), sorted.end());
  size_t repeat = pages.size();
  for (size_t k = 1; k < sorted.size(); ++k) {
    if (sorted[k].first == sorted[k - 1].first) repeat = std::min(repeat, sorted[k].second);
  }
  if (repeat < pages.size()) {
    return absl::InvalidArgumentError(absl::StrCat("index ", pages[repeat] * page_size,
                                                   " at position ", repeat * page_size,
                                                   " starts a page that appears more than once"));
  }
  return pages;
}

}  // namespace kvhost
