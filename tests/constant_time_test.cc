#include "common/constant_time.h"

#include <string>

#include "gtest/gtest.h"

namespace kvhost {
namespace {

TEST(SecretEqualsTest, EqualOnlyWhenEveryByteAndTheLengthMatch) {
  EXPECT_TRUE(SecretEquals("owner-token", "owner-token"));
  EXPECT_FALSE(SecretEquals("owner-tokeN", "owner-token"));       // last byte
  EXPECT_FALSE(SecretEquals("Owner-token", "owner-token"));       // first byte
  EXPECT_FALSE(SecretEquals("owner", "owner-token"));             // a prefix
  EXPECT_FALSE(SecretEquals("owner-tokenowner", "owner-token"));  // the secret repeated
  EXPECT_FALSE(SecretEquals("", "owner-token"));
}

TEST(SecretEqualsTest, EmptySecretEqualsOnlyEmpty) {
  EXPECT_TRUE(SecretEquals("", ""));
  EXPECT_FALSE(SecretEquals("x", ""));
}

TEST(SecretEqualsTest, BytesPastNulAndHighBitCount) {
  const std::string a("a\0b\xff", 4);
  const std::string b("a\0c\xff", 4);
  EXPECT_TRUE(SecretEquals(a, a));
  EXPECT_FALSE(SecretEquals(a, b));
}

}  // namespace
}  // namespace kvhost
