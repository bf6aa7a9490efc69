// Tests of Client::DepositDescriptors (client/deposit.cc): a kvhost::Client
// against the daemon's services in this process (tests/service_daemon.h),
// whose DaemonStatus names a stand-in handoff socket (tests/handoff_stub.h)
// that records every deposit. Descriptors go in deposits of at most
// kMaxDepositDescriptors, in order, each naming the client's session (opened
// first, when it keeps one) and answered by a deposit id; none asks nothing;
// a daemon without a handoff socket is FAILED_PRECONDITION; a refused
// deposit's code and message come back; a reply without an id or with
// another count is INTERNAL; an unreachable daemon is UNAVAILABLE.
#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "handoff_stub.h"
#include "kvhost/client.h"
#include "service_daemon.h"

namespace kvhost {
namespace {

using ::kvhost::testing::HandoffStub;
using ::kvhost::testing::Memfd;
using ::kvhost::testing::ServiceDaemon;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::string Msg(const absl::Status& s) { return std::string(s.message()); }

class DepositTest : public ::testing::Test {
 protected:
  DepositTest()
      : stub_([this](const HandoffStub::Received& got) { return Answer(got); }),
        daemon_(Config()) {}
  void SetUp() override {
    ASSERT_FALSE(stub_.path().empty());
    ASSERT_TRUE(daemon_.ok());
    fd_ = Memfd("deposit-test", 4096);
    ASSERT_GE(fd_, 0);
  }
  void TearDown() override {
    if (fd_ >= 0) ::close(fd_);
  }
  ServiceDaemon::Config Config() {
    ServiceDaemon::Config c;
    c.handoff_socket = stub_.path();
    return c;
  }
  // The stub's answer: a deposit id per deposit, "dep-<n>", counting what
  // came; the deposit numbered refuse_ refused, the one numbered bad_ given
  // a wrong count.
  HandoffStub::Answer Answer(const HandoffStub::Received& got) {
    const int n = deposits_++;
    if (n == refuse_) {
      return HandoffStub::Reply(static_cast<int>(absl::StatusCode::kResourceExhausted),
                                "the session's share of deposits is used up");
    }
    HandoffStub::Answer answer = HandoffStub::Reply(0);
    answer.reply.set_count(static_cast<uint32_t>(got.inodes.size()) - (n == bad_ ? 1 : 0));
    answer.reply.set_deposit_id(absl::StrCat("dep-", n));
    return answer;
  }
  std::unique_ptr<Client> Connect(bool worker_session) {
    ClientOptions options;
    options.address = daemon_.address();
    options.worker_session = worker_session;
    options.fast_path = false;
    options.timeout = absl::Seconds(10);
    absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect(options);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? *std::move(c) : nullptr;
  }

  std::atomic<int> deposits_{0};
  std::atomic<int> refuse_{-1};
  std::atomic<int> bad_{-1};
  HandoffStub stub_;
  ServiceDaemon daemon_;
  int fd_ = -1;
};

TEST_F(DepositTest, DescriptorsGoInDepositsOfAtMostTheBound) {
  std::unique_ptr<Client> client = Connect(/*worker_session=*/true);
  ASSERT_NE(client, nullptr);
  const size_t n = 2 * kMaxDepositDescriptors + 7;
  const std::vector<int> fds(n, fd_);  // one file, many descriptors' worth
  absl::StatusOr<std::vector<std::string>> ids = client->DepositDescriptors(fds);
  ASSERT_TRUE(ids.ok()) << ids.status();
  EXPECT_THAT(*ids, ElementsAre("dep-0", "dep-1", "dep-2"));
  // The session was opened first, and every deposit names it.
  const SessionState session = client->session_state();
  ASSERT_TRUE(session.open);
  EXPECT_TRUE(daemon_.manager().IsSessionOpen(session.session_id));
  const std::vector<HandoffStub::Received> got = stub_.received();
  ASSERT_EQ(got.size(), 3u);
  const std::vector<size_t> sizes = {kMaxDepositDescriptors, kMaxDepositDescriptors, 7};
  struct stat st {};
  ASSERT_EQ(::fstat(fd_, &st), 0);
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].request.kind(), v1::HANDOFF_KIND_DEPOSIT) << i;
    EXPECT_THAT(got[i].request.session_ids(), ElementsAre(session.session_id)) << i;
    EXPECT_EQ(got[i].request.attachment_id(), "") << i;
    ASSERT_EQ(got[i].inodes.size(), sizes[i]) << i;
    EXPECT_EQ(got[i].inodes.front(), st.st_ino) << i;
  }
  // The descriptors stay the caller's.
  EXPECT_EQ(::fstat(fd_, &st), 0);
}

TEST_F(DepositTest, WithoutASessionTheDepositsNameNone) {
  std::unique_ptr<Client> client = Connect(/*worker_session=*/false);
  ASSERT_NE(client, nullptr);
  absl::StatusOr<std::vector<std::string>> ids = client->DepositDescriptors({fd_, fd_});
  ASSERT_TRUE(ids.ok()) << ids.status();
  EXPECT_THAT(*ids, ElementsAre("dep-0"));
  ASSERT_EQ(stub_.received().size(), 1u);
  EXPECT_EQ(stub_.received()[0].request.session_ids_size(), 0);
  EXPECT_EQ(stub_.received()[0].inodes.size(), 2u);
  EXPECT_FALSE(client->session_state().open);
  EXPECT_TRUE(daemon_.manager().ListSessions().empty());
}

TEST_F(DepositTest, NoDescriptorsAskNothing) {
  std::unique_ptr<Client> client = Connect(/*worker_session=*/true);
  ASSERT_NE(client, nullptr);
  absl::StatusOr<std::vector<std::string>> ids = client->DepositDescriptors({});
  ASSERT_TRUE(ids.ok()) << ids.status();
  EXPECT_TRUE(ids->empty());
  EXPECT_TRUE(stub_.received().empty());
  EXPECT_FALSE(client->session_state().open);  // not even a session
}

TEST_F(DepositTest, ARefusedDepositsCodeAndMessageComeBack) {
  std::unique_ptr<Client> client = Connect(/*worker_session=*/true);
  ASSERT_NE(client, nullptr);
  refuse_ = 1;  // the second deposit
  const std::vector<int> fds(kMaxDepositDescriptors + 1, fd_);
  absl::StatusOr<std::vector<std::string>> ids = client->DepositDescriptors(fds);
  EXPECT_EQ(ids.status().code(), absl::StatusCode::kResourceExhausted) << ids.status();
  EXPECT_EQ(Msg(ids.status()), "the session's share of deposits is used up");
  EXPECT_EQ(stub_.received().size(), 2u);
}

TEST_F(DepositTest, AReplyThatIsNotTheDepositsIsInternal) {
  std::unique_ptr<Client> client = Connect(/*worker_session=*/false);
  ASSERT_NE(client, nullptr);
  bad_ = 0;
  absl::StatusOr<std::vector<std::string>> ids = client->DepositDescriptors({fd_, fd_, fd_});
  EXPECT_EQ(ids.status().code(), absl::StatusCode::kInternal) << ids.status();
  EXPECT_EQ(Msg(ids.status()), absl::StrCat("handoff socket ", stub_.path(),
                                            ": a deposit of 3 descriptors answered with 2 and "
                                            "no id"));
}

TEST_F(DepositTest, ADaemonWithoutAHandoffSocketCannotTakeThem) {
  daemon_.Restart({});  // handoff_socket ""
  ASSERT_TRUE(daemon_.ok());
  std::unique_ptr<Client> client = Connect(/*worker_session=*/true);
  ASSERT_NE(client, nullptr);
  absl::StatusOr<std::vector<std::string>> ids = client->DepositDescriptors({fd_});
  EXPECT_EQ(ids.status().code(), absl::StatusCode::kFailedPrecondition) << ids.status();
  EXPECT_THAT(Msg(ids.status()), HasSubstr("kvhostd has no handoff socket"));
  EXPECT_TRUE(stub_.received().empty());
}

TEST_F(DepositTest, AnUnreachableDaemonIsUnavailable) {
  ClientOptions options;
  options.address = absl::StrCat("unix://", daemon_.shm_dir(), "/nobody.sock");
  options.timeout = absl::Seconds(5);
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(options);
  ASSERT_TRUE(client.ok()) << client.status();
  absl::StatusOr<std::vector<std::string>> ids = (*client)->DepositDescriptors({fd_});
  EXPECT_EQ(ids.status().code(), absl::StatusCode::kUnavailable) << ids.status();
  EXPECT_TRUE(stub_.received().empty());
}

}  // namespace
}  // namespace kvhost
