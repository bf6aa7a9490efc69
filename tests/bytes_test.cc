#include "common/bytes.h"

#include <cstdint>

#include "gtest/gtest.h"

namespace kvhost {
namespace {

constexpr uint64_t kGiB = uint64_t{1} << 30;

TEST(FormatBytesTest, BinaryUnits) {
  EXPECT_EQ(FormatBytes(0), "0 bytes");
  EXPECT_EQ(FormatBytes(1), "1 byte");
  EXPECT_EQ(FormatBytes(1023), "1023 bytes");
  EXPECT_EQ(FormatBytes(1024), "1.00 KiB");
  EXPECT_EQ(FormatBytes(10 * kGiB), "10.00 GiB");
  EXPECT_EQ(FormatBytes(64 * kGiB), "64.00 GiB");  // what --size-bytes=64G gives
  EXPECT_EQ(FormatBytes(1536 * kGiB), "1.50 TiB");
  EXPECT_EQ(FormatBytesExact(8 * kGiB), "8.00 GiB (8589934592 bytes)");
  // The exact count tells apart what rounding makes look equal.
  EXPECT_NE(FormatBytesExact(8 * kGiB), FormatBytesExact(8 * kGiB - 4096));
}

}  // namespace
}  // namespace kvhost
