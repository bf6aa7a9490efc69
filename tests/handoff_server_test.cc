// HandoffWaiting (server/service/handoff_server.h): the connections waiting
// for their request keep a share per uid and a bound in all; a new
// connection past its uid's share pushes out that uid's oldest, never
// another uid's, and past the bound in all the oldest of anyone.
#include "server/service/handoff_server.h"

#include <optional>

#include "gtest/gtest.h"

namespace kvhost {
namespace {

WaitingConnection Connection(int fd, uint32_t uid) {
  WaitingConnection c;
  c.fd = fd;
  c.uid = uid;
  return c;
}

TEST(HandoffWaitingTest, ASilentUidPushesOutOnlyItsOwn) {
  HandoffWaiting waiting(/*max_connections=*/10, /*per_uid=*/3);
  ASSERT_FALSE(waiting.Add(Connection(100, /*victim*/ 7)).has_value());
  for (int fd = 1; fd <= 3; ++fd) EXPECT_FALSE(waiting.Add(Connection(fd, 666)).has_value());
  // The attacker's 4th and later push out its own oldest, one by one.
  for (int fd = 4; fd <= 50; ++fd) {
    std::optional<WaitingConnection> out = waiting.Add(Connection(fd, 666));
    ASSERT_TRUE(out.has_value());
    EXPECT_EQ(out->fd, fd - 3);
    EXPECT_EQ(out->uid, 666u);
  }
  EXPECT_EQ(waiting.of_uid(666), 3u);
  EXPECT_EQ(waiting.of_uid(7), 1u);
  EXPECT_EQ(waiting.connections().front().fd, 100);  // the victim still waits
  // A second victim connection of the same uid is not refused either.
  EXPECT_FALSE(waiting.Add(Connection(101, 7)).has_value());
}

TEST(HandoffWaitingTest, PastTheBoundInAllTheOldestGoes) {
  HandoffWaiting waiting(/*max_connections=*/4, /*per_uid=*/3);
  for (uint32_t uid = 1; uid <= 4; ++uid) {
    EXPECT_FALSE(waiting.Add(Connection(static_cast<int>(uid), uid)).has_value());
  }
  std::optional<WaitingConnection> out = waiting.Add(Connection(5, 5));
  ASSERT_TRUE(out.has_value());
  EXPECT_EQ(out->fd, 1);
  EXPECT_EQ(waiting.of_uid(1), 0u);
  EXPECT_EQ(waiting.connections().size(), 4u);
  // Take keeps the counts.
  const WaitingConnection taken = waiting.Take(0);
  EXPECT_EQ(taken.fd, 2);
  EXPECT_EQ(waiting.of_uid(2), 0u);
  EXPECT_EQ(waiting.connections().size(), 3u);
}

}  // namespace
}  // namespace kvhost
