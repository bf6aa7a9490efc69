// Tests of index runs (server/transfer/runs.h): CoalesceRuns merges only
// where both sides step by one and covers the request exactly, in order;
// CheckNoOverlap finds a repeated destination.
#include "server/transfer/runs.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <ostream>
#include <random>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "domain_test_util.h"

namespace kvhost {

// For gtest (found by ADL, so in IndexRun's namespace).
bool operator==(const IndexRun& a, const IndexRun& b) {
  return a.host == b.host && a.device == b.device && a.count == b.count;
}
void PrintTo(const IndexRun& r, std::ostream* os) {
  *os << "{host " << r.host << ", device " << r.device << ", count " << r.count << "}";
}

namespace {

using ::kvhost::testing::Msg;
using ::testing::HasSubstr;

TEST(CoalesceRunsTest, MergesOnlyWhereBothSidesStepByOne) {
  using R = std::vector<IndexRun>;
  EXPECT_EQ(CoalesceRuns({}, {}), R{});
  EXPECT_EQ(CoalesceRuns({7}, {3}), (R{{7, 3, 1}}));
  EXPECT_EQ(CoalesceRuns({0, 1, 2, 3}, {10, 11, 12, 13}), (R{{0, 10, 4}}));
  // Host steps, device does not (and the other way round).
  EXPECT_EQ(CoalesceRuns({0, 1, 2}, {10, 11, 13}), (R{{0, 10, 2}, {2, 13, 1}}));
  EXPECT_EQ(CoalesceRuns({0, 2, 3}, {10, 11, 12}), (R{{0, 10, 1}, {2, 11, 2}}));
  // Same index twice, or descending: no merge.
  EXPECT_EQ(CoalesceRuns({5, 5}, {1, 2}), (R{{5, 1, 1}, {5, 2, 1}}));
  EXPECT_EQ(CoalesceRuns({3, 2, 1}, {3, 2, 1}), (R{{3, 3, 1}, {2, 2, 1}, {1, 1, 1}}));
  // Request order is kept, even where sorting would merge.
  EXPECT_EQ(CoalesceRuns({4, 5, 0, 1, 2, 6}, {4, 5, 0, 1, 2, 6}),
            (R{{4, 4, 2}, {0, 0, 3}, {6, 6, 1}}));
  EXPECT_EQ(CoalesceRuns({100, 101, 102, 50, 51}, {0, 1, 2, 3, 4}), (R{{100, 0, 3}, {50, 3, 2}}));
}

TEST(CoalesceRunsTest, RunsCoverTheRequestExactly) {
  std::mt19937_64 rng(5);
  for (int round = 0; round < 200; ++round) {
    std::vector<int64_t> host, device;
    int64_t h = static_cast<int64_t>(rng() % 100), d = static_cast<int64_t>(rng() % 100);
    for (int i = 0; i < 50; ++i) {
      if (rng() % 3 == 0) h = static_cast<int64_t>(rng() % 100);
      if (rng() % 3 == 0) d = static_cast<int64_t>(rng() % 100);
      host.push_back(h++);
      device.push_back(d++);
    }
    std::vector<IndexRun> runs = CoalesceRuns(host, device);
    size_t i = 0;
    for (size_t r = 0; r < runs.size(); ++r) {
      ASSERT_GE(runs[r].count, 1u);
      for (uint64_t k = 0; k < runs[r].count; ++k, ++i) {
        ASSERT_LT(i, host.size());
        ASSERT_EQ(static_cast<int64_t>(runs[r].host + k), host[i]);
        ASSERT_EQ(static_cast<int64_t>(runs[r].device + k), device[i]);
      }
      // Maximal: the next run could not have been appended.
      if (r + 1 < runs.size()) {
        ASSERT_FALSE(runs[r].host + runs[r].count == runs[r + 1].host &&
                     runs[r].device + runs[r].count == runs[r + 1].device);
      }
    }
    ASSERT_EQ(i, host.size());
  }
}

TEST(CheckNoOverlapTest, FindsRepeatedDestinations) {
  // Host side: 5..7 and 7..8 share slot 7; the device side does not repeat.
  std::vector<IndexRun> runs = {{5, 0, 3}, {20, 3, 1}, {7, 10, 2}};
  absl::Status s = CheckNoOverlap(runs, /*host_side=*/true, "host slot");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Msg(s), HasSubstr("host slot 7"));
  EXPECT_TRUE(CheckNoOverlap(runs, /*host_side=*/false, "device row").ok());
  // Adjacent is not overlapping.
  EXPECT_TRUE(CheckNoOverlap({{0, 0, 4}, {4, 9, 4}, {8, 4, 1}}, true, "host slot").ok());
  EXPECT_TRUE(CheckNoOverlap({}, true, "host slot").ok());
  // Device side, a run inside another.
  s = CheckNoOverlap({{0, 10, 8}, {50, 12, 2}}, false, "device row");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Msg(s), HasSubstr("device row 12"));
  // Exactly the same slot twice.
  s = CheckNoOverlap({{3, 0, 1}, {3, 1, 1}}, true, "host slot");
  EXPECT_THAT(Msg(s), HasSubstr("host slot 3"));
}

TEST(CheckNoOverlapTest, EveryStrategyFindsTheSameSlot) {
  // In order (one pass), scattered over a small range (bitmap), scattered
  // over a range far larger than the slots written (sort).
  EXPECT_THAT(Msg(CheckNoOverlap({{0, 0, 4}, {3, 9, 2}}, true, "host slot")),
              HasSubstr("host slot 3 "));
  EXPECT_THAT(Msg(CheckNoOverlap({{10, 0, 4}, {2, 4, 4}, {12, 8, 1}}, true, "host slot")),
              HasSubstr("host slot 12 "));
  EXPECT_THAT(Msg(CheckNoOverlap({{1000000, 0, 2}, {5, 2, 1}, {1000001, 3, 1}}, true, "host slot")),
              HasSubstr("host slot 1000001 "));
  EXPECT_TRUE(
      CheckNoOverlap({{1000000, 0, 2}, {5, 2, 1}, {1000002, 3, 1}}, true, "host slot").ok());
  EXPECT_TRUE(CheckNoOverlap({{10, 0, 4}, {2, 4, 4}, {14, 8, 1}}, true, "host slot").ok());
  // A page-1 load's device rows: every row of a range once, shuffled.
  std::vector<IndexRun> rows;
  for (uint64_t i = 0; i < 4096; ++i) rows.push_back({i, (i * 2654435761u) % 4096, 1});
  EXPECT_TRUE(CheckNoOverlap(rows, false, "device row").ok());
  rows.push_back({4096, rows[77].device, 1});
  EXPECT_THAT(Msg(CheckNoOverlap(rows, false, "device row")),
              HasSubstr(absl::StrCat("device row ", rows[77].device, " ")));
}

}  // namespace
}  // namespace kvhost
