#include "server/pool/host_memory.h"

#include <stdlib.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <system_error>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace kvhost {
namespace {

constexpr uint64_t kMiB = uint64_t{1} << 20;
constexpr uint64_t kGiB = uint64_t{1} << 30;

constexpr char kV2Max[] = "sys/fs/cgroup/memory.max";
constexpr char kV2Current[] = "sys/fs/cgroup/memory.current";
constexpr char kV1Limit[] = "sys/fs/cgroup/memory/memory.limit_in_bytes";
constexpr char kV1Usage[] = "sys/fs/cgroup/memory/memory.usage_in_bytes";

// A fake root directory with the relative paths ReadMemorySnapshot reads.
class FakeRootTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = std::filesystem::path(::testing::TempDir()) / "host_memory_XXXXXX";
    ASSERT_NE(mkdtemp(pattern.data()), nullptr);
    root_ = pattern;
  }
  void TearDown() override {
    std::error_code ec;
    std::filesystem::remove_all(root_, ec);
  }

  void Write(const std::string& rel, const std::string& content) {
    const std::filesystem::path path = std::filesystem::path(root_) / rel;
    std::filesystem::create_directories(path.parent_path());
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out << content;
    ASSERT_TRUE(out.good()) << path;
  }

  // /proc/meminfo as the kernel writes it, sizes in kB.
  void WriteMeminfo(uint64_t total_kb, uint64_t available_kb) {
    Write("proc/meminfo", absl::StrCat("MemTotal:       ", total_kb,
                                       " kB\n"
                                       "MemFree:        1234 kB\n"
                                       "MemAvailable:   ",
                                       available_kb,
                                       " kB\n"
                                       "Buffers:        100 kB\n"
                                       "HugePages_Total:       0\n"
                                       "Hugepagesize:       2048 kB\n"));
  }

  MemorySnapshot Read() {
    absl::StatusOr<MemorySnapshot> s = ReadMemorySnapshot(root_);
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? *s : MemorySnapshot();
  }

  std::string root_;
};

TEST_F(FakeRootTest, MeminfoOnly) {
  WriteMeminfo(64 * kMiB, 48 * kMiB);  // 64 GiB total, 48 GiB available
  MemorySnapshot s = Read();
  EXPECT_EQ(s.mem_total, 64 * kGiB);
  EXPECT_EQ(s.mem_available, 48 * kGiB);
  EXPECT_FALSE(s.cgroup_limit.has_value());
  EXPECT_EQ(s.cgroup_source, "");
  EXPECT_EQ(DefaultMemoryReserve(s.mem_total), 64 * kGiB / 10);
  EXPECT_EQ(AvailableForPools(s, 10 * kGiB), 38 * kGiB);
}

TEST_F(FakeRootTest, RootWithTrailingSlash) {
  WriteMeminfo(64 * kMiB, 48 * kMiB);
  absl::StatusOr<MemorySnapshot> s = ReadMemorySnapshot(root_ + "/");
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->mem_total, 64 * kGiB);
}

TEST_F(FakeRootTest, CgroupV2LimitSmallerThanRam) {
  WriteMeminfo(64 * kMiB, 48 * kMiB);
  Write(kV2Max, absl::StrCat(32 * kGiB, "\n"));
  Write(kV2Current, absl::StrCat(4 * kGiB, "\n"));
  MemorySnapshot s = Read();
  ASSERT_TRUE(s.cgroup_limit.has_value());
  EXPECT_EQ(*s.cgroup_limit, 32 * kGiB);
  EXPECT_EQ(s.cgroup_usage, 4 * kGiB);
  EXPECT_EQ(s.cgroup_source, "v2");
  // min(48 - 2, 32 - 4 - 2) GiB.
  EXPECT_EQ(AvailableForPools(s, 2 * kGiB), 26 * kGiB);
}

TEST_F(FakeRootTest, CgroupLimitAboveMemAvailableLeavesMeminfoTerm) {
  WriteMeminfo(64 * kMiB, 8 * kMiB);
  Write(kV2Max, absl::StrCat(32 * kGiB, "\n"));
  Write(kV2Current, absl::StrCat(1 * kGiB, "\n"));
  MemorySnapshot s = Read();
  ASSERT_TRUE(s.cgroup_limit.has_value());
  // min(8 - 1, 32 - 1 - 1) GiB.
  EXPECT_EQ(AvailableForPools(s, 1 * kGiB), 7 * kGiB);
}

TEST_F(FakeRootTest, CgroupV2Max) {
  WriteMeminfo(64 * kMiB, 48 * kMiB);
  Write(kV2Max, "max\n");
  Write(kV2Current, absl::StrCat(4 * kGiB, "\n"));
  MemorySnapshot s = Read();
  EXPECT_FALSE(s.cgroup_limit.has_value());
  EXPECT_EQ(s.cgroup_source, "");
  EXPECT_EQ(AvailableForPools(s, 0), 48 * kGiB);
}

TEST_F(FakeRootTest, CgroupV2LimitAtOrAboveMemTotalIgnored) {
  WriteMeminfo(64 * kMiB, 48 * kMiB);
  Write(kV2Max, absl::StrCat(64 * kGiB, "\n"));  // == MemTotal
  Write(kV2Current, absl::StrCat(60 * kGiB, "\n"));
  EXPECT_FALSE(Read().cgroup_limit.has_value());

  Write(kV2Max, absl::StrCat(100 * kGiB, "\n"));  // > MemTotal
  MemorySnapshot s = Read();
  EXPECT_FALSE(s.cgroup_limit.has_value());
  EXPECT_EQ(AvailableForPools(s, 0), 48 * kGiB);
}

TEST_F(FakeRootTest, CgroupV1Fallback) {
  WriteMeminfo(64 * kMiB, 48 * kMiB);
  Write(kV1Limit, absl::StrCat(16 * kGiB, "\n"));
  Write(kV1Usage, absl::StrCat(6 * kGiB, "\n"));
  MemorySnapshot s = Read();
  ASSERT_TRUE(s.cgroup_limit.has_value());
  EXPECT_EQ(*s.cgroup_limit, 16 * kGiB);
  EXPECT_EQ(s.cgroup_usage, 6 * kGiB);
  EXPECT_EQ(s.cgroup_source, "v1");
  EXPECT_EQ(AvailableForPools(s, 1 * kGiB), 9 * kGiB);
}

TEST_F(FakeRootTest, CgroupV1UnlimitedSentinel) {
  WriteMeminfo(64 * kMiB, 48 * kMiB);
  Write(kV1Limit, "9223372036854771712\n");  // what v1 reports for no limit
  Write(kV1Usage, absl::StrCat(6 * kGiB, "\n"));
  EXPECT_FALSE(Read().cgroup_limit.has_value());
}

TEST_F(FakeRootTest, CgroupV2PreferredOverV1) {
  WriteMeminfo(64 * kMiB, 48 * kMiB);
  Write(kV2Max, absl::StrCat(32 * kGiB, "\n"));
  Write(kV2Current, absl::StrCat(2 * kGiB, "\n"));
  Write(kV1Limit, absl::StrCat(16 * kGiB, "\n"));
  Write(kV1Usage, absl::StrCat(6 * kGiB, "\n"));
  MemorySnapshot s = Read();
  EXPECT_EQ(s.cgroup_source, "v2");
  EXPECT_EQ(s.cgroup_limit.value_or(0), 32 * kGiB);
}

TEST_F(FakeRootTest, CgroupV1UsedWhenV2HasNoLimit) {
  WriteMeminfo(64 * kMiB, 48 * kMiB);
  Write(kV2Max, "max\n");
  Write(kV1Limit, absl::StrCat(16 * kGiB, "\n"));
  Write(kV1Usage, absl::StrCat(6 * kGiB, "\n"));
  MemorySnapshot s = Read();
  EXPECT_EQ(s.cgroup_source, "v1");
  EXPECT_EQ(s.cgroup_limit.value_or(0), 16 * kGiB);
}

TEST_F(FakeRootTest, BadCgroupLimitsCountAsNone) {
  WriteMeminfo(64 * kMiB, 48 * kMiB);
  Write(kV2Current, absl::StrCat(4 * kGiB, "\n"));
  const std::string bad_values[] = {
      "",                        // empty
      "\n",                      // blank
      "garbage\n",               // not an integer
      "12abc\n",                 // trailing junk
      "1.5\n",                   // not an integer
      "0\n",                     // zero
      "-1\n",                    // negative
      "-4294967296\n",           // negative
      "1152921504606846976\n",   // 2^60
      "9223372036854775807\n",   // INT64_MAX
      "18446744073709551615\n",  // does not fit int64
      "99999999999999999999999\n",
  };
  for (const std::string& value : bad_values) {
    Write(kV2Max, value);
    MemorySnapshot s = Read();
    EXPECT_FALSE(s.cgroup_limit.has_value()) << "memory.max = \"" << value << "\"";
    EXPECT_EQ(s.cgroup_source, "") << "memory.max = \"" << value << "\"";
  }
}

TEST_F(FakeRootTest, UnreadableCgroupLimitCountsAsNone) {
  WriteMeminfo(64 * kMiB, 48 * kMiB);
  std::filesystem::create_directories(std::filesystem::path(root_) / kV2Max);  // a directory
  EXPECT_FALSE(Read().cgroup_limit.has_value());
}

TEST_F(FakeRootTest, BadUsageCountsAsZero) {
  WriteMeminfo(64 * kMiB, 48 * kMiB);
  Write(kV2Max, absl::StrCat(32 * kGiB, "\n"));
  for (const char* usage : {"", "garbage", "-5", "1152921504606846976"}) {
    Write(kV2Current, usage);
    MemorySnapshot s = Read();
    EXPECT_EQ(s.cgroup_limit.value_or(0), 32 * kGiB) << usage;
    EXPECT_EQ(s.cgroup_usage, 0u) << usage;
  }
  // Missing usage file.
  std::filesystem::remove(std::filesystem::path(root_) / kV2Current);
  MemorySnapshot s = Read();
  EXPECT_EQ(s.cgroup_limit.value_or(0), 32 * kGiB);
  EXPECT_EQ(s.cgroup_usage, 0u);
}

TEST_F(FakeRootTest, MissingMeminfo) {
  absl::StatusOr<MemorySnapshot> s = ReadMemorySnapshot(root_);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(s.status().message(), root_ + "/proc/meminfo")) << s.status();
}

TEST_F(FakeRootTest, MeminfoLacksFields) {
  Write("proc/meminfo", "MemTotal:       1000 kB\nMemFree:        500 kB\n");
  absl::StatusOr<MemorySnapshot> s = ReadMemorySnapshot(root_);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(s.status().message(), "MemAvailable")) << s.status();
  EXPECT_TRUE(absl::StrContains(s.status().message(), "/proc/meminfo")) << s.status();

  Write("proc/meminfo", "MemFree:        500 kB\nMemAvailable:   700 kB\n");
  s = ReadMemorySnapshot(root_);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(s.status().message(), "MemTotal")) << s.status();

  Write("proc/meminfo", "");
  s = ReadMemorySnapshot(root_);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(FakeRootTest, MeminfoMalformedValue) {
  Write("proc/meminfo", "MemTotal:       lots kB\nMemAvailable:   700 kB\n");
  absl::StatusOr<MemorySnapshot> s = ReadMemorySnapshot(root_);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(s.status().message(), "/proc/meminfo")) << s.status();
}

TEST(AvailableForPoolsTest, ReserveLargerThanAvailableGivesZero) {
  MemorySnapshot s;
  s.mem_total = 64 * kGiB;
  s.mem_available = 5 * kGiB;
  EXPECT_EQ(AvailableForPools(s, 10 * kGiB), 0u);
  EXPECT_EQ(AvailableForPools(s, 5 * kGiB), 0u);

  // Plenty of RAM, but the cgroup is nearly full.
  s.mem_available = 50 * kGiB;
  s.cgroup_limit = 16 * kGiB;
  s.cgroup_usage = 12 * kGiB;
  EXPECT_EQ(AvailableForPools(s, 10 * kGiB), 0u);
  EXPECT_EQ(AvailableForPools(s, 1 * kGiB), 3 * kGiB);

  // Usage above the limit (possible momentarily) does not wrap around.
  s.cgroup_usage = 17 * kGiB;
  EXPECT_EQ(AvailableForPools(s, 0), 0u);
}

TEST(DefaultMemoryReserveTest, SmallAndLargeMachines) {
  EXPECT_EQ(DefaultMemoryReserve(8 * kGiB), 8 * kGiB / 10);  // 0.8 GiB
  EXPECT_EQ(DefaultMemoryReserve(8 * kGiB), uint64_t{858993459});
  EXPECT_EQ(DefaultMemoryReserve(100 * kGiB), 10 * kGiB);  // the crossover
  EXPECT_EQ(DefaultMemoryReserve(512 * kGiB), 10 * kGiB);
  EXPECT_EQ(DefaultMemoryReserve(0), 0u);
}

TEST(ReadMemorySnapshotTest, RealMachine) {
  absl::StatusOr<MemorySnapshot> s = ReadMemorySnapshot("/");
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_GT(s->mem_total, 0u);
  EXPECT_LE(s->mem_available, s->mem_total);
  if (s->cgroup_limit.has_value()) {
    EXPECT_LT(*s->cgroup_limit, s->mem_total);
    EXPECT_NE(s->cgroup_source, "");
  }
  EXPECT_LE(AvailableForPools(*s, DefaultMemoryReserve(s->mem_total)), s->mem_available);
}

}  // namespace
}  // namespace kvhost
