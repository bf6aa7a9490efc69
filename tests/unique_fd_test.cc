#include "common/unique_fd.h"

#include <fcntl.h>
#include <unistd.h>

#include <utility>

#include "gtest/gtest.h"

namespace kvhost {
namespace {

bool IsOpen(int fd) { return ::fcntl(fd, F_GETFD) != -1; }

TEST(UniqueFdTest, ClosesWhenItGoes) {
  int raw = -1;
  {
    UniqueFd fd(::open("/dev/null", O_RDONLY | O_CLOEXEC));
    ASSERT_TRUE(fd.valid());
    raw = fd.get();
    EXPECT_TRUE(IsOpen(raw));
  }
  EXPECT_FALSE(IsOpen(raw));
}

TEST(UniqueFdTest, MoveHandsOverAndAssignmentClosesTheOldOne) {
  UniqueFd a(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  UniqueFd b(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  const int a_raw = a.get();
  const int b_raw = b.get();
  b = std::move(a);
  EXPECT_FALSE(a.valid());  // NOLINT(bugprone-use-after-move): moved-from holds none
  EXPECT_EQ(b.get(), a_raw);
  EXPECT_FALSE(IsOpen(b_raw));
  UniqueFd c(std::move(b));
  EXPECT_EQ(c.get(), a_raw);
  EXPECT_TRUE(IsOpen(a_raw));
}

TEST(UniqueFdTest, ReleaseKeepsItOpenAndResetClosesIt) {
  UniqueFd fd(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  const int raw = fd.Release();
  EXPECT_FALSE(fd.valid());
  EXPECT_TRUE(IsOpen(raw));
  fd = UniqueFd(raw);
  fd.Reset();
  EXPECT_FALSE(fd.valid());
  EXPECT_FALSE(IsOpen(raw));
  fd.Reset();  // holding none: nothing to close
}

}  // namespace
}  // namespace kvhost
