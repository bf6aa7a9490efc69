// Byte sizes in flags (ParseByteSize): powers of 1024, the spelling and the
// refusals of kvhostd's and kvhostctl's flags alike.
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/cli_flags.h"
#include "gtest/gtest.h"

namespace kvhost {
namespace {

constexpr uint64_t kKiB = uint64_t{1} << 10;
constexpr uint64_t kMiB = uint64_t{1} << 20;
constexpr uint64_t kGiB = uint64_t{1} << 30;
constexpr uint64_t kTiB = uint64_t{1} << 40;

TEST(ParseByteSizeTest, Good) {
  struct Case {
    const char* text;
    uint64_t want;
  };
  const Case cases[] = {
      {"0", 0},
      {"123", 123},
      {"123B", 123},
      {"123b", 123},
      {"64K", 64 * kKiB},
      {"64k", 64 * kKiB},
      {"64KiB", 64 * kKiB},
      {"10G", 10 * kGiB},
      {"10GiB", 10 * kGiB},
      {"10gib", 10 * kGiB},
      {"1.5G", 3 * kGiB / 2},
      {"0.5K", 512},
      {"1.1K", 1126},  // 1126.4 truncated
      {"512MiB", 512 * kMiB},
      {"512m", 512 * kMiB},
      {"2T", 2 * kTiB},
      {"2TiB", 2 * kTiB},
      {" 10G ", 10 * kGiB},
      {"10 GiB", 10 * kGiB},
      {"16777215T", 16777215 * kTiB},
      {"18446744073709551615", UINT64_MAX},
  };
  for (const Case& c : cases) {
    absl::StatusOr<uint64_t> got = ParseByteSize(c.text);
    ASSERT_TRUE(got.ok()) << c.text << ": " << got.status();
    EXPECT_EQ(*got, c.want) << c.text;
  }
}

TEST(ParseByteSizeTest, Bad) {
  const char* const cases[] = {
      "",
      " ",
      "G",
      "-1",
      "-1G",
      "+1G",
      "1.5",
      "1.",
      ".5G",
      "1..5G",
      "1.5.G",
      "10X",
      "10P",
      "10GiBs",
      "10Gb",
      "10iB",
      "10 G B",
      "abc",
      "1e9",
      "0x10",
      "10Gi",
      "10 GG",
      "16777216T",             // 2^64 bytes
      "18446744073709551616",  // 2^64
  };
  for (const char* text : cases) {
    absl::StatusOr<uint64_t> got = ParseByteSize(text);
    ASSERT_FALSE(got.ok()) << "\"" << text << "\" parsed as " << *got;
    EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument) << text;
    EXPECT_TRUE(absl::StrContains(got.status().message(), absl::StrCat("\"", text, "\"")))
        << got.status();
  }
}

// "1GB" was taken as 1 GiB without a word (issue 31): it is 10^9 bytes to
// many. It is refused, the message naming the text and what to write.
TEST(ParseByteSizeTest, DecimalUnitsAreRefusedWithTheSpellingToUse) {
  for (const char* text : {"1GB", "1gb", "64KB", "512MB", "2TB", "1.5GB", "10 GB"}) {
    absl::StatusOr<uint64_t> got = ParseByteSize(text);
    ASSERT_FALSE(got.ok()) << "\"" << text << "\" parsed as " << *got;
    EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument) << text;
    const std::string message(got.status().message());
    EXPECT_TRUE(absl::StrContains(message, absl::StrCat("\"", text, "\""))) << message;
    EXPECT_TRUE(absl::StrContains(message, "ambiguous")) << message;
  }
  absl::StatusOr<uint64_t> got = ParseByteSize("1GB");
  EXPECT_TRUE(absl::StrContains(got.status().message(), "write G or GiB")) << got.status();
}

TEST(FormatByteSizeTest, ReadsBackExactlyInTheLargestUnit) {
  const struct {
    uint64_t bytes;
    const char* want;
  } cases[] = {
      {0, "0"},
      {1000, "1000"},
      {1024, "1K"},
      {65536, "64K"},
      {3 * 1048576, "3M"},
      {1 << 30, "1G"},
      {1536ull << 20, "1536M"},
      {2ull << 40, "2T"},
      {UINT64_MAX, "18446744073709551615"},
  };
  for (const auto& c : cases) {
    EXPECT_EQ(FormatByteSize(c.bytes), c.want) << c.bytes;
    absl::StatusOr<uint64_t> back = ParseByteSize(FormatByteSize(c.bytes));
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(*back, c.bytes);
  }
}

}  // namespace
}  // namespace kvhost
