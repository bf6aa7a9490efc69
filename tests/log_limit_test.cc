// LogLimit (server/log_limit.h): the 1st, 2nd, 4th, 8th ... occurrence of a
// run gets a line, a run ends after kLogLimitQuiet without one, each status
// code counts on its own, and the note names the count.
#include "server/log_limit.h"

#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"

namespace kvhost {
namespace {

TEST(LogLimitTest, PowersOfTwoOfARun) {
  LogLimit limit;
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  std::vector<uint64_t> logged;
  for (int i = 0; i < 100000; ++i) {
    if (const uint64_t n = limit.Tick(t0 + absl::Microseconds(i)); n != 0) logged.push_back(n);
  }
  EXPECT_EQ(logged, (std::vector<uint64_t>{1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096,
                                           8192, 16384, 32768, 65536}));
  EXPECT_EQ(limit.total(), 100000u);
  // A quiet minute ends the run: the next is a 1st again.
  const absl::Time later = t0 + absl::Seconds(1) + kLogLimitQuiet;
  EXPECT_EQ(limit.Tick(later), 1u);
  EXPECT_EQ(limit.Tick(later + absl::Seconds(59)), 2u);
  EXPECT_EQ(limit.Tick(later + absl::Seconds(60)), 0u);  // 3rd: still the same run
  EXPECT_EQ(limit.total(), 100003u);
}

TEST(LogLimitTest, EachCodeCountsOnItsOwn) {
  LogLimitByCode limits;
  const absl::Time t = absl::FromUnixSeconds(1000);
  for (int i = 0; i < 5; ++i) limits.Tick(absl::StatusCode::kNotFound, t);
  EXPECT_EQ(limits.Tick(absl::StatusCode::kInvalidArgument, t), 1u);
  EXPECT_EQ(limits.Tick(absl::StatusCode::kNotFound, t), 0u);          // the 6th
  EXPECT_EQ(limits.Tick(static_cast<absl::StatusCode>(1234), t), 1u);  // as UNKNOWN
}

TEST(LogLimitTest, TheNoteNamesTheCount) {
  EXPECT_EQ(LogLimitNote(1), "");
  EXPECT_TRUE(absl::StrContains(LogLimitNote(64), "64 so far")) << LogLimitNote(64);
  EXPECT_FALSE(IsLoggedOccurrence(0));
  EXPECT_TRUE(IsLoggedOccurrence(1));
  EXPECT_FALSE(IsLoggedOccurrence(6));
  EXPECT_TRUE(IsLoggedOccurrence(uint64_t{1} << 63));
}

}  // namespace
}  // namespace kvhost
