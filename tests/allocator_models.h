// Reference models of page allocation for tests/allocator_test.cc and
// bench/allocator_bench.cc, written apart from server/pool/allocator.cc:
//   * ExtentModel: PageAllocator's documented order (best fit, else the
//     fewest runs, largest first), computed by scanning a bitmap of the pool
//     on every call, O(page_num) a call, so it shares no structure with the
//     b-trees it checks;
//   * FifoRing: the allocator before issue 15 (the seeds' free_slots order:
//     lowest first at start, freed pages to the back), the baseline for run
//     lengths;
//   * RunLengths: the runs of consecutive ids in a list of pages;
//   * Churn: the random alloc / free workload both measure runs under.
//
// Header only; single-threaded; no errors: callers check sizes first.
#ifndef KVHOST_TESTS_ALLOCATOR_MODELS_H_
#define KVHOST_TESTS_ALLOCATOR_MODELS_H_

#include <chrono>
#include <cstdint>
#include <deque>
#include <random>
#include <utility>
#include <vector>

namespace kvhost::alloc_model {

// Lengths of the maximal runs of consecutive ascending ids, in list order.
inline std::vector<uint64_t> RunLengths(const std::vector<uint64_t>& pages) {
  std::vector<uint64_t> runs;
  for (size_t i = 0; i < pages.size(); ++i) {
    if (i > 0 && pages[i] == pages[i - 1] + 1) {
      ++runs.back();
    } else {
      runs.push_back(1);
    }
  }
  return runs;
}

class ExtentModel {
 public:
  explicit ExtentModel(uint64_t page_num) : allocated_(page_num, false) {}

  uint64_t page_num() const { return allocated_.size(); }
  uint64_t free_pages() const { return page_num() - allocated_count_; }
  bool allocated(uint64_t page) const { return allocated_[page]; }

  // The free extents as (start, length), ascending.
  std::vector<std::pair<uint64_t, uint64_t>> Extents() const {
    std::vector<std::pair<uint64_t, uint64_t>> out;
    for (uint64_t p = 0; p < page_num(); ++p) {
      if (allocated_[p]) continue;
      if (p > 0 && !allocated_[p - 1]) {
        ++out.back().second;
      } else {
        out.push_back({p, 1});
      }
    }
    return out;
  }

  // REQUIRES: 0 < want <= free_pages().
  std::vector<uint64_t> Alloc(uint64_t want) {
    std::vector<uint64_t> pages;
    while (want > 0) {
      const std::vector<std::pair<uint64_t, uint64_t>> extents = Extents();
      // Best fit for what is still wanted; else the largest (both: first in
      // address order among equals).
      const std::pair<uint64_t, uint64_t>* fit = nullptr;
      const std::pair<uint64_t, uint64_t>* largest = nullptr;
      for (const auto& e : extents) {
        if (e.second >= want && (fit == nullptr || e.second < fit->second)) fit = &e;
        if (largest == nullptr || e.second > largest->second) largest = &e;
      }
      const auto& [start, length] = fit != nullptr ? *fit : *largest;
      const uint64_t take = fit != nullptr ? want : length;
      for (uint64_t p = start; p < start + take; ++p) {
        allocated_[p] = true;
        pages.push_back(p);
      }
      allocated_count_ += take;
      want -= take;
    }
    return pages;
  }

  // REQUIRES: every page allocated, none twice.
  void Free(const std::vector<uint64_t>& pages) {
    for (uint64_t p : pages) allocated_[p] = false;
    allocated_count_ -= pages.size();
  }

  void Clear() {
    allocated_.assign(page_num(), false);
    allocated_count_ = 0;
  }

 private:
  std::vector<bool> allocated_;
  uint64_t allocated_count_ = 0;
};

class FifoRing {
 public:
  explicit FifoRing(uint64_t page_num) {
    for (uint64_t p = 0; p < page_num; ++p) free_.push_back(p);
  }

  uint64_t free_pages() const { return free_.size(); }

  // REQUIRES: 0 < want <= free_pages().
  std::vector<uint64_t> Alloc(uint64_t want) {
    std::vector<uint64_t> pages(free_.begin(), free_.begin() + static_cast<ptrdiff_t>(want));
    free_.erase(free_.begin(), free_.begin() + static_cast<ptrdiff_t>(want));
    return pages;
  }

  void Free(const std::vector<uint64_t>& pages) {
    free_.insert(free_.end(), pages.begin(), pages.end());
  }

 private:
  std::deque<uint64_t> free_;
};

// The workload: each step draws a request (every `large_every`-th one
// max_request pages, the long transfers whose runs matter; the others uniform
// in [1, max_request]) and allocates it while that keeps the pool at most
// `occupancy` full, else frees a live allocation chosen uniformly, in the
// order Alloc gave its pages. The steps depend only on page counts, so every
// allocator sees the same sequence of calls for the same seed.
struct ChurnOptions {
  uint64_t pages = 65536;
  uint64_t ops = 20000;  // Alloc and Free calls
  uint64_t max_request = 4096;
  uint64_t large_every = 8;
  double occupancy = 0.85;
  uint64_t seed = 1;
};

struct ChurnStats {
  std::vector<uint64_t> runs;        // of every allocation, in order
  std::vector<uint64_t> large_runs;  // of the max_request allocations only
  uint64_t allocs = 0;
  uint64_t large_allocs = 0;
  uint64_t frees = 0;
  double call_seconds = 0;    // inside Alloc and Free only
  double mean_occupancy = 0;  // allocated / pages, averaged over the steps
};

// Allocator: std::vector<uint64_t> Alloc(uint64_t pages), void
// Free(const std::vector<uint64_t>&), called only with enough pages free.
template <typename Allocator>
ChurnStats Churn(Allocator& a, const ChurnOptions& o) {
  using Clock = std::chrono::steady_clock;
  std::mt19937_64 rng(o.seed);
  std::vector<std::vector<uint64_t>> live;
  uint64_t allocated = 0;
  uint64_t draws = 0;
  double occupancy_sum = 0;
  ChurnStats st;
  const auto limit = static_cast<uint64_t>(o.occupancy * static_cast<double>(o.pages));
  uint64_t request = 0;
  for (uint64_t op = 0; op < o.ops; ++op) {
    if (request == 0) {
      const bool large = ++draws % o.large_every == 0;
      request =
          large ? o.max_request : std::uniform_int_distribution<uint64_t>(1, o.max_request)(rng);
    }
    if (allocated + request <= limit || live.empty()) {
      if (allocated + request > o.pages) break;  // occupancy >= 1 and the pool is full
      const auto start = Clock::now();
      std::vector<uint64_t> pages = a.Alloc(request);
      st.call_seconds += std::chrono::duration<double>(Clock::now() - start).count();
      const std::vector<uint64_t> runs = RunLengths(pages);
      st.runs.insert(st.runs.end(), runs.begin(), runs.end());
      if (request == o.max_request) {
        st.large_runs.insert(st.large_runs.end(), runs.begin(), runs.end());
        ++st.large_allocs;
      }
      allocated += request;
      live.push_back(std::move(pages));
      ++st.allocs;
      request = 0;
    } else {
      const size_t k = std::uniform_int_distribution<size_t>(0, live.size() - 1)(rng);
      std::swap(live[k], live.back());
      const auto start = Clock::now();
      a.Free(live.back());
      st.call_seconds += std::chrono::duration<double>(Clock::now() - start).count();
      allocated -= live.back().size();
      live.pop_back();
      ++st.frees;
    }
    occupancy_sum += static_cast<double>(allocated) / static_cast<double>(o.pages);
  }
  st.mean_occupancy = o.ops > 0 ? occupancy_sum / static_cast<double>(o.ops) : 0;
  return st;
}

// Pages per run.
inline double MeanRun(const std::vector<uint64_t>& runs) {
  uint64_t pages = 0;
  for (uint64_t r : runs) pages += r;
  return runs.empty() ? 0 : static_cast<double>(pages) / static_cast<double>(runs.size());
}

}  // namespace kvhost::alloc_model

#endif  // KVHOST_TESTS_ALLOCATOR_MODELS_H_
