// Tests of kvhost::PageAllocator and kvhost::ParsePages (server/pool/allocator.h).
//
// The allocator's documented invariants are checked against an independent
// model: a FIFO deque of free pages (the seeds' `free_slots` order, SEED_INVENTORY.md
// §4: alloc pops from the front, free appends to the back) plus a std::set of
// allocated pages. Long randomized sequences of good and bad calls run for
// several page sizes; after every call the allocator must agree with the model:
//   * no page is handed out twice,
//   * free pages + allocated pages == page_num,
//   * a call that returns an error changes nothing (the next allocations still
//     come out in exactly the model's order).
#include "server/pool/allocator.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <numeric>
#include <ostream>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"

namespace kvhost {
namespace {

using ::testing::HasSubstr;

// Slots of the given pages, in order (the list form Free / ParsePages take).
std::vector<int64_t> SlotsOf(const std::vector<uint64_t>& pages, uint64_t page_size) {
  std::vector<int64_t> slots;
  for (uint64_t p : pages) {
    for (uint64_t j = 0; j < page_size; ++j)
      slots.push_back(static_cast<int64_t>(p * page_size + j));
  }
  return slots;
}

// The independent model: FIFO free order and the allocated set.
struct Model {
  std::deque<uint64_t> free;
  std::set<uint64_t> allocated;

  explicit Model(uint64_t page_num) {
    for (uint64_t p = 0; p < page_num; ++p) free.push_back(p);
  }
};

// Checks every observable of `a` against `m`.
void ExpectAgrees(const PageAllocator& a, const Model& m) {
  ASSERT_EQ(a.free_pages(), m.free.size());
  ASSERT_EQ(a.free_pages() + m.allocated.size(), a.page_num());
  ASSERT_EQ(a.available_tokens(), m.free.size() * a.page_size());
  // Every allocated slot checks out; every free page's first and last slot do not.
  std::vector<uint64_t> alloc_pages(m.allocated.begin(), m.allocated.end());
  if (!alloc_pages.empty()) {
    ASSERT_TRUE(a.CheckAllocated(SlotsOf(alloc_pages, a.page_size())).ok());
  }
  for (uint64_t p : m.free) {
    const int64_t first = static_cast<int64_t>(p * a.page_size());
    const int64_t last = first + static_cast<int64_t>(a.page_size()) - 1;
    ASSERT_EQ(a.CheckAllocated({first}).code(), absl::StatusCode::kFailedPrecondition) << p;
    ASSERT_EQ(a.CheckAllocated({last}).code(), absl::StatusCode::kFailedPrecondition) << p;
  }
}

class AllocatorRandomTest : public ::testing::TestWithParam<uint64_t> {};

TEST_P(AllocatorRandomTest, MatchesModelOverLongSequences) {
  const uint64_t ps = GetParam();
  const uint64_t page_num = 48;
  PageAllocator a(page_num, ps);
  Model m(page_num);
  std::mt19937_64 rng(1234 + ps);
  auto uniform = [&rng](uint64_t lo, uint64_t hi) {  // [lo, hi]
    return std::uniform_int_distribution<uint64_t>(lo, hi)(rng);
  };
  std::set<uint64_t> ever_freed;  // for double frees
  int ok_allocs = 0, exhausted = 0, bad_sizes = 0, ok_frees = 0, bad_frees = 0;

  for (int step = 0; step < 6000; ++step) {
    const uint64_t op = uniform(0, 9);
    if (op <= 3) {
      // Alloc of a whole number of pages, sometimes more than are free.
      const uint64_t want = uniform(1, page_num / 3);
      std::vector<uint64_t> pages = {999999};  // Alloc appends; the prefix must survive
      absl::Status s = a.Alloc(want * ps, &pages);
      if (want <= m.free.size()) {
        ASSERT_TRUE(s.ok()) << s;
        ASSERT_EQ(pages.size(), want + 1);
        ASSERT_EQ(pages[0], 999999u);
        for (uint64_t i = 0; i < want; ++i) {
          // FIFO: exactly the model's front, in order.
          ASSERT_EQ(pages[i + 1], m.free.front()) << "step " << step;
          ASSERT_TRUE(m.allocated.insert(m.free.front()).second)
              << "page " << m.free.front() << " handed out twice";
          m.free.pop_front();
        }
        ++ok_allocs;
      } else {
        ASSERT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
        EXPECT_THAT(std::string(s.message()), HasSubstr(std::to_string(want * ps)));
        ASSERT_EQ(pages.size(), 1u) << "failed Alloc touched *pages";
        ++exhausted;
      }
    } else if (op == 4) {
      // Zero tokens, or a non-multiple of the page size (ps > 1 only).
      uint64_t tokens = 0;
      if (ps > 1 && uniform(0, 1) == 1) tokens = uniform(1, 4 * ps) * ps + uniform(1, ps - 1);
      std::vector<uint64_t> pages;
      absl::Status s = a.Alloc(tokens, &pages);
      ASSERT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
      EXPECT_THAT(std::string(s.message()), HasSubstr(std::to_string(tokens)));
      ASSERT_TRUE(pages.empty());
      ++bad_sizes;
    } else if (op <= 7) {
      // Free a random subset of the allocated pages, in random order.
      if (m.allocated.empty()) continue;
      std::vector<uint64_t> held(m.allocated.begin(), m.allocated.end());
      std::shuffle(held.begin(), held.end(), rng);
      held.resize(uniform(1, held.size()));
      ASSERT_TRUE(a.FreePages(held).ok());
      for (uint64_t p : held) {
        m.allocated.erase(p);
        m.free.push_back(p);
        ever_freed.insert(p);
      }
      ++ok_frees;
    } else {
      // A bad free: allocated pages plus one page that is not allocated now
      // (freed before = a double free, or never allocated yet). All or nothing.
      std::vector<uint64_t> list(m.allocated.begin(), m.allocated.end());
      std::shuffle(list.begin(), list.end(), rng);
      list.resize(std::min<size_t>(list.size(), uniform(0, 4)));
      std::vector<uint64_t> not_allocated;
      for (uint64_t p : m.free) {
        if (op == 8 ? ever_freed.count(p) != 0 : ever_freed.count(p) == 0)
          not_allocated.push_back(p);
      }
      if (not_allocated.empty()) not_allocated.assign(m.free.begin(), m.free.end());
      if (not_allocated.empty()) continue;
      const uint64_t bad = not_allocated[uniform(0, not_allocated.size() - 1)];
      list.insert(list.begin() + static_cast<ptrdiff_t>(uniform(0, list.size())), bad);
      absl::Status s = a.FreePages(list);
      ASSERT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
      // Names the page's slots.
      EXPECT_THAT(std::string(s.message()), HasSubstr(std::to_string(bad * ps)));
      ++bad_frees;
    }
    ASSERT_NO_FATAL_FAILURE(ExpectAgrees(a, m)) << "after step " << step << " (op " << op << ")";
  }
  // The sequence exercised every branch.
  EXPECT_GT(ok_allocs, 100);
  EXPECT_GT(exhausted, 10);
  EXPECT_GT(bad_sizes, 100);
  EXPECT_GT(ok_frees, 100);
  EXPECT_GT(bad_frees, 100);

  // Drain everything: the remaining pages come out in the model's order.
  std::vector<uint64_t> rest;
  const uint64_t left = m.free.size();
  if (left > 0) {
    ASSERT_TRUE(a.Alloc(left * ps, &rest).ok());
    EXPECT_EQ(rest, std::vector<uint64_t>(m.free.begin(), m.free.end()));
  }
  EXPECT_EQ(a.free_pages(), 0u);
  std::vector<uint64_t> none;
  EXPECT_EQ(a.Alloc(ps, &none).code(), absl::StatusCode::kResourceExhausted);
}

INSTANTIATE_TEST_SUITE_P(PageSizes, AllocatorRandomTest, ::testing::Values(1, 16, 5),
                         [](const ::testing::TestParamInfo<uint64_t>& info) {
                           return "ps" + std::to_string(info.param);
                         });

TEST(AllocatorTest, FifoOrderLikeTheSeeds) {
  PageAllocator a(8, 4);
  std::vector<uint64_t> first;
  ASSERT_TRUE(a.Alloc(12, &first).ok());
  EXPECT_EQ(first, (std::vector<uint64_t>{0, 1, 2}));  // lowest pages first
  ASSERT_TRUE(a.FreePages({1}).ok());
  ASSERT_TRUE(a.FreePages({0}).ok());
  std::vector<uint64_t> rest;
  ASSERT_TRUE(a.Alloc(7 * 4, &rest).ok());
  // Never-used pages first, then the freed ones in the order they were freed.
  EXPECT_EQ(rest, (std::vector<uint64_t>{3, 4, 5, 6, 7, 1, 0}));
  EXPECT_EQ(a.free_pages(), 0u);
}

TEST(AllocatorTest, AllocErrorsNameTheNumbers) {
  PageAllocator a(4, 16);
  std::vector<uint64_t> pages;
  absl::Status s = a.Alloc(24, &pages);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("24"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("16"));
  EXPECT_EQ(a.Alloc(0, &pages).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(a.Alloc(32, &pages).ok());
  s = a.Alloc(48, &pages);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(s.message()), HasSubstr("48"));  // requested
  EXPECT_THAT(std::string(s.message()), HasSubstr("32"));  // free
  EXPECT_THAT(std::string(s.message()), HasSubstr("64"));  // of the pool
  EXPECT_EQ(pages.size(), 2u);
  EXPECT_EQ(a.free_pages(), 2u);
}

TEST(AllocatorTest, FreeIsAllOrNothing) {
  PageAllocator a(6, 5);
  std::vector<uint64_t> pages;
  ASSERT_TRUE(a.Alloc(15, &pages).ok());  // 0, 1, 2
  // Page 4 was never allocated; pages 0 and 1 must stay allocated.
  absl::Status s = a.FreePages({0, 1, 4});
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.message()), HasSubstr("page 4"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("20..24"));
  EXPECT_EQ(a.free_pages(), 3u);
  EXPECT_TRUE(a.CheckAllocated({0, 5, 14}).ok());
  // Double free.
  ASSERT_TRUE(a.FreePages({1}).ok());
  s = a.FreePages({2, 1});
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.message()), HasSubstr("page 1"));
  EXPECT_EQ(a.free_pages(), 4u);
  EXPECT_TRUE(a.CheckAllocated({10, 14}).ok());
}

TEST(AllocatorTest, CheckAllocatedNamesFirstBadSlot) {
  PageAllocator a(4, 16);
  std::vector<uint64_t> pages;
  ASSERT_TRUE(a.Alloc(32, &pages).ok());  // slots 0..31
  EXPECT_TRUE(a.CheckAllocated({}).ok());
  EXPECT_TRUE(a.CheckAllocated({0, 31, 17}).ok());
  absl::Status s = a.CheckAllocated({0, 40, 50});
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.message()), HasSubstr("40"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("page 2"));
  EXPECT_THAT(std::string(s.message()), ::testing::Not(HasSubstr("50")));
  s = a.CheckAllocated({63});
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.message()), HasSubstr("63"));
}

TEST(AllocatorTest, ClearFreesEverythingAndRestartsOrder) {
  PageAllocator a(5, 2);
  std::vector<uint64_t> pages;
  ASSERT_TRUE(a.Alloc(6, &pages).ok());  // 0, 1, 2
  ASSERT_TRUE(a.FreePages({0}).ok());
  a.Clear();
  EXPECT_EQ(a.free_pages(), 5u);
  EXPECT_EQ(a.CheckAllocated({2}).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(a.FreePages({1}).code(), absl::StatusCode::kFailedPrecondition);  // no longer held
  std::vector<uint64_t> all;
  ASSERT_TRUE(a.Alloc(10, &all).ok());
  EXPECT_EQ(all, (std::vector<uint64_t>{0, 1, 2, 3, 4}));
}

TEST(AllocatorTest, EmptyPool) {
  PageAllocator a(0, 16);
  std::vector<uint64_t> pages;
  EXPECT_EQ(a.free_pages(), 0u);
  EXPECT_EQ(a.Alloc(16, &pages).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(a.FreePages({}).ok());
  a.Clear();
  EXPECT_EQ(a.free_pages(), 0u);
}

// ---------------------------------------------------------------- ParsePages

TEST(ParsePagesTest, AcceptsWholePagesInListOrder) {
  absl::StatusOr<std::vector<uint64_t>> pages =
      ParsePages({8, 9, 10, 11, 0, 1, 2, 3, 60, 61, 62, 63}, 4, 64);
  ASSERT_TRUE(pages.ok()) << pages.status();
  EXPECT_EQ(*pages, (std::vector<uint64_t>{2, 0, 15}));
  pages = ParsePages({7, 3}, 1, 8);
  ASSERT_TRUE(pages.ok());
  EXPECT_EQ(*pages, (std::vector<uint64_t>{7, 3}));
}

struct BadList {
  const char* name;
  std::vector<int64_t> slots;
  uint64_t page_size;
  // Substrings the message must hold (position and value).
  std::vector<std::string> want;
};

void PrintTo(const BadList& c, std::ostream* os) { *os << c.name; }

class ParsePagesErrorTest : public ::testing::TestWithParam<BadList> {};

TEST_P(ParsePagesErrorTest, NamesPositionAndValue) {
  const BadList& c = GetParam();
  absl::StatusOr<std::vector<uint64_t>> pages = ParsePages(c.slots, c.page_size, 64);
  ASSERT_FALSE(pages.ok());
  EXPECT_EQ(pages.status().code(), absl::StatusCode::kInvalidArgument);
  for (const std::string& w : c.want) {
    EXPECT_THAT(std::string(pages.status().message()), HasSubstr(w));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, ParsePagesErrorTest,
    ::testing::Values(
        BadList{"Empty", {}, 4, {"length 0", "page_size 4"}},
        BadList{"NotMultiple", {0, 1, 2, 3, 4, 5}, 4, {"length 6", "page_size 4"}},
        BadList{"Negative", {0, 1, 2, 3, -4, -3, -2, -1}, 4, {"-4", "position 4", "[0, 64)"}},
        BadList{"TooLarge", {64, 65, 66, 67}, 4, {"64", "position 0", "[0, 64)"}},
        BadList{"NotPageStart", {4, 5, 6, 7, 9, 10, 11, 12}, 4, {"index 9", "position 4"}},
        BadList{"BrokenRun", {0, 1, 3, 2}, 4, {"index 3", "position 2"}},
        BadList{"RunPastPage", {8, 9, 10, 11, 12, 13, 14, 16}, 4, {"index 16", "position 7"}},
        BadList{
            "DuplicatePage", {0, 1, 2, 3, 8, 9, 10, 11, 0, 1, 2, 3}, 4, {"index 0", "position 8"}},
        BadList{"DuplicateSingle", {5, 6, 7, 6}, 1, {"index 6", "position 3"}}),
    [](const ::testing::TestParamInfo<BadList>& info) { return info.param.name; });

// ---------------------------------------------------------------- concurrency

TEST(AllocatorConcurrencyTest, EightThreadsConserveAndNeverShare) {
  constexpr int kThreads = 8;
  constexpr uint64_t kPageNum = 64;
  constexpr uint64_t kPs = 4;
  constexpr int kIterations = 20000;
  PageAllocator a(kPageNum, kPs);
  // owner[p] = thread + 1 while a thread holds p; a grab of a held page is a violation.
  std::vector<std::atomic<int>> owner(kPageNum);
  for (auto& o : owner) o.store(0);
  std::atomic<int> violations{0};
  std::vector<std::vector<uint64_t>> held(kThreads);
  std::vector<std::vector<uint64_t>> log(kThreads);  // every page each thread was given
  std::vector<int> exhausted(kThreads, 0);

  std::atomic<int> ready{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      ready.fetch_add(1);
      while (ready.load() < kThreads) std::this_thread::yield();  // start together
      std::mt19937_64 rng(77 + t);
      std::vector<uint64_t>& mine = held[t];
      for (int i = 0; i < kIterations; ++i) {
        // Allocating twice as often as freeing, and freeing few pages at a
        // time, keeps the pool near empty so threads compete for the last pages.
        if (mine.empty() || rng() % 3 != 0) {
          std::vector<uint64_t> got;
          absl::Status s = a.Alloc((1 + rng() % 12) * kPs, &got);
          if (!s.ok()) {
            if (s.code() != absl::StatusCode::kResourceExhausted) violations++;
            ++exhausted[t];
            continue;
          }
          for (uint64_t p : got) {
            if (p >= kPageNum || owner[p].exchange(t + 1) != 0) violations++;
            mine.push_back(p);
            log[t].push_back(p);
          }
        } else {
          std::shuffle(mine.begin(), mine.end(), rng);
          const size_t n = 1 + rng() % std::min<size_t>(mine.size(), 4);
          std::vector<uint64_t> give(mine.end() - static_cast<ptrdiff_t>(n), mine.end());
          mine.resize(mine.size() - n);
          // Release ownership before the pages go back: once freed, another
          // thread may be handed them at once.
          for (uint64_t p : give) {
            if (owner[p].exchange(0) != t + 1) violations++;
          }
          if (!a.FreePages(give).ok()) violations++;
        }
      }
    });
  }
  for (std::thread& th : threads) th.join();

  EXPECT_EQ(violations.load(), 0);
  std::set<uint64_t> all;
  size_t held_count = 0;
  size_t allocations = 0;
  int exhausted_total = 0;
  for (int t = 0; t < kThreads; ++t) {
    held_count += held[t].size();
    allocations += log[t].size();
    exhausted_total += exhausted[t];
    for (uint64_t p : held[t]) {
      EXPECT_TRUE(all.insert(p).second) << "page " << p << " held by two threads";
      EXPECT_EQ(owner[p].load(), t + 1);
    }
  }
  EXPECT_EQ(a.free_pages() + held_count, kPageNum);  // conservation
  std::vector<uint64_t> held_pages(all.begin(), all.end());
  if (!held_pages.empty()) {
    EXPECT_TRUE(a.CheckAllocated(SlotsOf(held_pages, kPs)).ok());
  }
  // The threads really contended: many allocations, and the pool ran dry at times.
  EXPECT_GT(allocations, 5000u);
  EXPECT_GT(exhausted_total, 0);
  // Everything held can be returned and the pool is whole again.
  for (int t = 0; t < kThreads; ++t) ASSERT_TRUE(a.FreePages(held[t]).ok());
  EXPECT_EQ(a.free_pages(), kPageNum);
}

// ---------------------------------------------------------------- cost

// Alloc and free cost O(pages), not O(tokens) and not quadratic. The bounds
// are loose (seconds) so a slow, loaded or sanitized build passes; they are
// still far below what a per-call cost linear in the pool would take for the
// 1M-page churn (~10^12 steps).
TEST(AllocatorCostTest, LargePoolsAreLinear) {
  using Clock = std::chrono::steady_clock;
  {
    // 1M tokens at page 64 in one call.
    PageAllocator a(16384, 64);
    std::vector<uint64_t> pages;
    const auto start = Clock::now();
    ASSERT_TRUE(a.Alloc(1 << 20, &pages).ok());
    EXPECT_EQ(pages.size(), 16384u);
    ASSERT_TRUE(a.FreePages(pages).ok());
    EXPECT_LT(Clock::now() - start, std::chrono::seconds(5));
  }
  {
    // A 16M-token pool with page 256, all in one call, then page by page.
    PageAllocator a(65536, 256);
    std::vector<uint64_t> pages;
    auto start = Clock::now();
    ASSERT_TRUE(a.Alloc(uint64_t{1} << 24, &pages).ok());
    EXPECT_EQ(a.free_pages(), 0u);
    ASSERT_TRUE(a.FreePages(pages).ok());
    EXPECT_LT(Clock::now() - start, std::chrono::seconds(5));
  }
  {
    // 1M pages taken one call at a time, then returned one at a time.
    constexpr uint64_t kPages = uint64_t{1} << 20;
    PageAllocator a(kPages, 16);
    const auto start = Clock::now();
    std::vector<uint64_t> one;
    one.reserve(kPages);
    for (uint64_t i = 0; i < kPages; ++i) ASSERT_TRUE(a.Alloc(16, &one).ok());
    EXPECT_EQ(one.back(), kPages - 1);
    for (uint64_t p : one) ASSERT_TRUE(a.FreePages({p}).ok());
    EXPECT_EQ(a.free_pages(), kPages);
    EXPECT_LT(Clock::now() - start, std::chrono::seconds(15));
  }
}

}  // namespace
}  // namespace kvhost
