#include "server/pool/allocator.h"

#include <algorithm>
#include <iterator>
#include <numeric>
#include <utility>

#include "absl/strings/str_cat.h"

namespace kvhost {

PageAllocator::PageAllocator(uint64_t page_num, uint64_t page_size)
    : page_num_(page_num), page_size_(page_size), state_(page_num, kFree) {
  absl::MutexLock lock(&mu_);
  ResetLocked();
}

void PageAllocator::ResetLocked() {
  by_start_.clear();
  by_length_.clear();
  if (page_num_ > 0) {
    by_start_.emplace(0, page_num_);
    by_length_.emplace(page_num_, 0);
  }
  free_count_ = page_num_;
}

void PageAllocator::TakeFrom(std::pair<uint64_t, uint64_t> extent, uint64_t take,
                             std::vector<uint64_t>* pages) {
  const auto [length, start] = extent;
  std::fill(state_.begin() + start, state_.begin() + start + take, kAllocated);
  const size_t at = pages->size();
  pages->resize(at + take);
  std::iota(pages->begin() + at, pages->end(), start);
  by_length_.erase(extent);
  auto it = by_start_.erase(by_start_.find(start));
  if (take < length) {
    by_start_.emplace_hint(it, start + take, length - take);
    by_length_.emplace(length - take, start + take);
  }
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
  uint64_t rest = want;
  for (;;) {
    // (rest, 0) sorts before every extent of rest pages: the lowest start wins ties.
    auto fit = by_length_.lower_bound({rest, 0});
    if (fit != by_length_.end()) {
      TakeFrom(*fit, rest, pages);
      break;
    }
    // No extent holds the rest, and the free pages do (checked above), so
    // extents remain: take the largest whole, the lowest start of that length.
    const uint64_t largest = std::prev(by_length_.end())->first;
    const std::pair<uint64_t, uint64_t> extent = *by_length_.lower_bound({largest, 0});
    TakeFrom(extent, largest, pages);
    rest -= largest;
  }
  free_count_ -= want;
  return absl::OkStatus();
}

void PageAllocator::AddRun(uint64_t start, uint64_t length) {
  // Extents neither overlap the run (its pages were allocated) nor touch each
  // other, so at most one ends at `start` and one begins at `start + length`.
  auto next = by_start_.lower_bound(start);
  if (next != by_start_.end() && next->first == start + length) {
    length += next->second;
    by_length_.erase({next->second, next->first});
    next = by_start_.erase(next);
  }
  if (next != by_start_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == start) {
      by_length_.erase({prev->second, prev->first});
      prev->second += length;
      by_length_.emplace(prev->second, prev->first);
      return;
    }
  }
  by_start_.emplace_hint(next, start, length);
  by_length_.emplace(length, start);
}

absl::Status PageAllocator::FreePages(absl::Span<const uint64_t> pages) {
  absl::MutexLock lock(&mu_);
  // Check every id first, marking the good ones kFreeing so that a repeat is
  // seen; on an error the marks are undone and nothing has changed.
  for (size_t i = 0; i < pages.size(); ++i) {
    const uint64_t page = pages[i];
    absl::Status bad;
    if (page >= page_num_) {
      bad = absl::InvalidArgumentError(
          absl::StrCat("page ", page, " at position ", i, " out of range [0, ", page_num_, ")"));
    } else if (state_[page] == kFreeing) {
      bad = absl::InvalidArgumentError(
          absl::StrCat("page ", page, " at position ", i, " appears more than once"));
    } else if (state_[page] != kAllocated) {
      bad = absl::FailedPreconditionError(absl::StrCat("page ", page, " (slots ", page * page_size_,
                                                       "..", (page + 1) * page_size_ - 1,
                                                       ") is not allocated"));
    }
    if (!bad.ok()) {
      for (size_t j = 0; j < i; ++j) state_[pages[j]] = kAllocated;
      return bad;
    }
    state_[page] = kFreeing;
  }
  // Each run of consecutive ids in the list (an Alloc's runs come back so)
  // joins the extents in one step.
  for (size_t i = 0; i < pages.size();) {
    size_t j = i + 1;
    while (j < pages.size() && pages[j] == pages[j - 1] + 1) ++j;
    for (size_t k = i; k < j; ++k) state_[pages[k]] = kFree;
    AddRun(pages[i], j - i);
    i = j;
  }
  free_count_ += pages.size();
  return absl::OkStatus();
}

absl::Status PageAllocator::CheckAllocated(absl::Span<const int64_t> slots) const {
  absl::MutexLock lock(&mu_);
  for (int64_t slot : slots) {
    if (state_[static_cast<uint64_t>(slot) / page_size_] != kAllocated) {
      return absl::FailedPreconditionError(
          absl::StrCat("host slot ", slot, " is not allocated (page ",
                       static_cast<uint64_t>(slot) / page_size_, ")"));
    }
  }
  return absl::OkStatus();
}

void PageAllocator::Clear() {
  absl::MutexLock lock(&mu_);
  std::fill(state_.begin(), state_.end(), kFree);
  ResetLocked();
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
