// kvhostctl's statuses and exit codes (client/kvhostctl/errors.h): each made
// status maps to its exit code, and an UNAVAILABLE call gets the hint that
// fits why kvhostd could not be reached or dropped it.
#include "client/kvhostctl/errors.h"

#include <string>

#include "absl/status/status.h"
#include "absl/strings/cord.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvhost::ctl {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

TEST(ErrorsTest, EachMadeStatusReportsItsExitCode) {
  EXPECT_EQ(Report(absl::OkStatus()), 0);
  EXPECT_EQ(Report(UsageError("bad flag")), kExitUsage);
  EXPECT_EQ(Report(MismatchError("byte 3")), kExitMismatch);
  EXPECT_EQ(Report(PartialError("2 of 3 pages")), kExitPartial);
  EXPECT_EQ(Report(absl::NotFoundError("pool 'x'")), kExitRpc);
  EXPECT_TRUE(IsMismatch(MismatchError("byte 3")));
  EXPECT_FALSE(IsMismatch(absl::DataLossError("byte 3")));
}

TEST(ErrorsTest, OnlyUnavailableGetsAHint) {
  const absl::Status s = absl::NotFoundError("no pool 'x'");
  EXPECT_EQ(WithServerHint("unix:///nonexistent/s.sock", s), s);
}

TEST(ErrorsTest, AMissingUnixSocketAsksWhetherKvhostdRuns) {
  const absl::Status s =
      WithServerHint("unix:///nonexistent/s.sock", absl::UnavailableError("failed to connect"));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(s.message(),
              HasSubstr("failed to connect\n  hint: no socket at /nonexistent/s.sock"));
  EXPECT_THAT(s.message(), HasSubstr("is kvhostd running?"));
}

TEST(ErrorsTest, ATcpAddressNamesItsListenFlag) {
  const absl::Status s = WithServerHint("127.0.0.1:7", absl::UnavailableError("failed to connect"));
  EXPECT_THAT(s.message(), HasSubstr("is kvhostd listening on 127.0.0.1:7"));
}

// kvhostd closes a connection whose client misses its keepalive ping; the
// socket is fine, so the hint must not send the operator looking for a dead
// daemon.
TEST(ErrorsTest, AKeepaliveTimeoutPointsAtTheSessionTimeoutNotTheSocket) {
  const absl::Status s = WithServerHint("unix:///nonexistent/s.sock",
                                        absl::UnavailableError("keepalive watchdog timeout"));
  EXPECT_THAT(s.message(), HasSubstr("did not answer its keepalive ping"));
  EXPECT_THAT(s.message(), HasSubstr("--session-timeout"));
  EXPECT_THAT(s.message(), Not(HasSubstr("no socket at")));
}

TEST(ErrorsTest, ADaemonThatAnsweredPartlyGetsNoHint) {
  const absl::Status partial = PartialError("1 of 2 pages");
  const absl::Status s = WithServerHint("unix:///nonexistent/s.sock", partial);
  EXPECT_EQ(s, partial);
  EXPECT_EQ(Report(s), kExitPartial);
}

TEST(ErrorsTest, TheHintKeepsThePayloads) {
  absl::Status in = absl::UnavailableError("failed to connect");
  in.SetPayload("test/x", absl::Cord("y"));
  const absl::Status s = WithServerHint("unix:///nonexistent/s.sock", in);
  ASSERT_TRUE(s.GetPayload("test/x").has_value());
  EXPECT_EQ(std::string(*s.GetPayload("test/x")), "y");
}

}  // namespace
}  // namespace kvhost::ctl
