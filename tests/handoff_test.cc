// Tests of FetchHandoff (client/handoff.h), the client of kvhostd's handoff
// socket, against a stand-in socket in this process (tests/handoff_stub.h):
// the request arrives as given, with the descriptors sent beside it; the
// reply's descriptors, numbers, pool regions and deposit id come back; a
// fast-path handoff keeps its connection; the daemon's refusal comes back
// with its code and message; and every failure (no socket, a bad path, too
// many descriptors to send, silence, a close without a reply, a reply that
// is not one, an OK without a descriptor, more descriptors than the
// protocol sends) has its code, and leaves no received descriptor open.
#include "client/handoff.h"

#include <sys/stat.h>
#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "handoff_stub.h"
#include "kvhost/client.h"

namespace kvhost {
namespace {

using ::kvhost::testing::HandoffStub;
using ::kvhost::testing::Memfd;
using ::kvhost::testing::OpenMemfds;
using ::testing::HasSubstr;

using Answer = HandoffStub::Answer;

constexpr absl::Duration kTimeout = absl::Seconds(10);

std::string Msg(const absl::Status& s) { return std::string(s.message()); }

struct stat StatOf(int fd) {
  struct stat st {};
  EXPECT_EQ(::fstat(fd, &st), 0) << fd;
  return st;
}

v1::HandoffRequest Request(v1::HandoffKind kind) {
  v1::HandoffRequest r;
  r.set_attachment_id("att-1234");
  r.set_kind(kind);
  r.add_session_ids("s-1");
  r.add_session_ids("s-2");
  r.set_owner_token("tok");
  return r;
}

TEST(HandoffTest, TheRequestGoesAndTheReplysDescriptorsComeBack) {
  const int a = Memfd("handoff-a", 4096);
  const int b = Memfd("handoff-b", 8192);
  HandoffStub stub([&](const HandoffStub::Received&) {
    Answer answer = HandoffStub::Reply(0);
    answer.reply.set_bytes(12288);
    answer.reply.set_count(2);
    answer.reply.mutable_pool_regions()->add_region_bytes(4096);
    answer.reply.mutable_pool_regions()->add_region_bytes(8192);
    answer.fds = {a, b};
    return answer;
  });
  ASSERT_FALSE(stub.path().empty());
  const v1::HandoffRequest request = Request(v1::HANDOFF_KIND_POOL_REGIONS);
  absl::StatusOr<Handoff> h = FetchHandoff(stub.path(), request, kTimeout);
  ASSERT_TRUE(h.ok()) << h.status();
  ASSERT_EQ(stub.received().size(), 1u);
  EXPECT_EQ(stub.received()[0].request.SerializeAsString(), request.SerializeAsString());
  EXPECT_TRUE(stub.received()[0].inodes.empty());
  ASSERT_EQ(h->fds.size(), 2u);
  EXPECT_EQ(h->fd(), h->fds[0].get());
  // The same files as the stub's, in order.
  EXPECT_EQ(StatOf(h->fds[0].get()).st_ino, StatOf(a).st_ino);
  EXPECT_EQ(StatOf(h->fds[1].get()).st_ino, StatOf(b).st_ino);
  EXPECT_EQ(StatOf(h->fds[1].get()).st_size, 8192);
  EXPECT_EQ(h->bytes, 12288u);
  EXPECT_EQ(h->count, 2u);
  EXPECT_THAT(h->pool_regions.region_bytes(), ::testing::ElementsAre(4096u, 8192u));
  EXPECT_EQ(h->deposit_id, "");
  EXPECT_EQ(h->connection.get(), -1);  // only a fast-path handoff keeps it
  ::close(a);
  ::close(b);
}

TEST(HandoffTest, ADepositSendsItsDescriptorsAndGetsAnIdWithoutAny) {
  std::vector<int> mine;
  for (int i = 0; i < 3; ++i) mine.push_back(Memfd("handoff-deposit", 4096));
  HandoffStub stub([](const HandoffStub::Received& got) {
    Answer answer = HandoffStub::Reply(0);
    answer.reply.set_count(static_cast<uint32_t>(got.inodes.size()));
    answer.reply.set_deposit_id("dep-42");
    return answer;
  });
  absl::StatusOr<Handoff> h =
      FetchHandoff(stub.path(), Request(v1::HANDOFF_KIND_DEPOSIT), kTimeout, mine);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->deposit_id, "dep-42");
  EXPECT_EQ(h->count, 3u);
  EXPECT_EQ(h->fd(), -1);
  EXPECT_TRUE(h->fds.empty());
  ASSERT_EQ(stub.received().size(), 1u);
  ASSERT_EQ(stub.received()[0].inodes.size(), 3u);
  for (size_t i = 0; i < mine.size(); ++i) {
    EXPECT_EQ(stub.received()[0].inodes[i], StatOf(mine[i]).st_ino) << i;  // still open: ours
    ::close(mine[i]);
  }
}

TEST(HandoffTest, AFastPathHandoffKeepsItsConnection) {
  const int mailbox = Memfd("handoff-mailbox", 4096);
  HandoffStub stub([&](const HandoffStub::Received&) {
    Answer answer = HandoffStub::Reply(0);
    answer.reply.set_bytes(4096);
    answer.fds = {mailbox};
    return answer;
  });
  absl::StatusOr<Handoff> h =
      FetchHandoff(stub.path(), Request(v1::HANDOFF_KIND_FAST_PATH), kTimeout);
  ASSERT_TRUE(h.ok()) << h.status();
  ASSERT_GE(h->connection.get(), 0);
  EXPECT_TRUE(S_ISSOCK(StatOf(h->connection.get()).st_mode));
  EXPECT_EQ(StatOf(h->fd()).st_ino, StatOf(mailbox).st_ino);
  ::close(mailbox);
}

TEST(HandoffTest, TheDaemonsRefusalComesBackAndItsDescriptorsAreClosed) {
  const std::string name = "handoff-refused";
  const int fd = Memfd(name, 4096);
  HandoffStub stub([&](const HandoffStub::Received&) {
    Answer answer = HandoffStub::Reply(static_cast<int>(absl::StatusCode::kNotFound),
                                       "no attachment 'att-1234' of these credentials");
    answer.fds = {fd, fd};
    return answer;
  });
  ASSERT_EQ(OpenMemfds(name), 1);
  absl::StatusOr<Handoff> h =
      FetchHandoff(stub.path(), Request(v1::HANDOFF_KIND_LAYER_COUNTERS), kTimeout);
  EXPECT_EQ(h.status().code(), absl::StatusCode::kNotFound) << h.status();
  EXPECT_EQ(Msg(h.status()), "no attachment 'att-1234' of these credentials");
  EXPECT_EQ(OpenMemfds(name), 1);  // only the stub's own
  ::close(fd);
}

TEST(HandoffTest, MoreDescriptorsThanTheProtocolSendsAreRefusedAndClosed) {
  const std::string name = "handoff-flood";
  const int fd = Memfd(name, 4096);
  HandoffStub stub([&](const HandoffStub::Received&) {
    Answer answer = HandoffStub::Reply(0);
    answer.fds = std::vector<int>(17, fd);
    return answer;
  });
  absl::StatusOr<Handoff> h =
      FetchHandoff(stub.path(), Request(v1::HANDOFF_KIND_POOL_REGIONS), kTimeout);
  EXPECT_EQ(h.status().code(), absl::StatusCode::kInternal) << h.status();
  EXPECT_THAT(Msg(h.status()), HasSubstr(absl::StrCat("handoff socket ", stub.path(),
                                                      ": more descriptors than 16")));
  EXPECT_EQ(OpenMemfds(name), 1);
  ::close(fd);
}

TEST(HandoffTest, FailuresHaveTheirCodes) {
  struct Case {
    const char* what;
    Answer answer;
    v1::HandoffKind kind;
    absl::StatusCode code;
    std::string message;
  };
  Answer raw;
  raw.kind = Answer::Kind::kRaw;
  raw.raw = std::string(
      "\x12\x10"
      "abc",
      5);  // a string field cut short
  Answer close;
  close.kind = Answer::Kind::kClose;
  Answer silent;
  silent.kind = Answer::Kind::kSilent;
  // An OK reply of numbers alone (an empty one is no reply at all).
  Answer counted = HandoffStub::Reply(0);
  counted.reply.set_bytes(32);
  counted.reply.set_count(4);
  const std::vector<Case> cases = {
      {"not a reply", raw, v1::HANDOFF_KIND_LAYER_COUNTERS, absl::StatusCode::kInternal,
       ": the reply is not a HandoffReply"},
      {"closed without a reply", close, v1::HANDOFF_KIND_LAYER_COUNTERS,
       absl::StatusCode::kUnavailable, " closed the connection without a reply"},
      {"an OK without a descriptor", counted, v1::HANDOFF_KIND_LAYER_COUNTERS,
       absl::StatusCode::kInternal, ": an OK reply without a descriptor"},
      {"silence", silent, v1::HANDOFF_KIND_LAYER_COUNTERS, absl::StatusCode::kDeadlineExceeded,
       ": no reply within 300ms"},
  };
  for (const Case& c : cases) {
    HandoffStub stub([&](const HandoffStub::Received&) { return c.answer; });
    absl::StatusOr<Handoff> h = FetchHandoff(stub.path(), Request(c.kind), absl::Milliseconds(300));
    EXPECT_EQ(h.status().code(), c.code) << c.what << ": " << h.status();
    EXPECT_THAT(Msg(h.status()), HasSubstr(absl::StrCat("handoff socket ", stub.path()))) << c.what;
    EXPECT_THAT(Msg(h.status()), HasSubstr(c.message)) << c.what;
  }
}

TEST(HandoffTest, BadArgumentsAndNoSocketAreRefusedBeforeAnythingIsSent) {
  const v1::HandoffRequest request = Request(v1::HANDOFF_KIND_LAYER_COUNTERS);
  absl::StatusOr<Handoff> h = FetchHandoff("", request, kTimeout);
  EXPECT_EQ(h.status().code(), absl::StatusCode::kInvalidArgument) << h.status();
  EXPECT_THAT(Msg(h.status()), HasSubstr("handoff socket path '' is empty or too long"));
  const std::string longer(200, 'x');
  h = FetchHandoff(longer, request, kTimeout);
  EXPECT_EQ(h.status().code(), absl::StatusCode::kInvalidArgument) << h.status();
  EXPECT_THAT(Msg(h.status()), HasSubstr(absl::StrCat("'", longer, "' is empty or too long")));
  const std::vector<int> many(kMaxDepositDescriptors + 1, 0);
  HandoffStub stub([](const HandoffStub::Received&) { return HandoffStub::Reply(0); });
  h = FetchHandoff(stub.path(), Request(v1::HANDOFF_KIND_DEPOSIT), kTimeout, many);
  EXPECT_EQ(h.status().code(), absl::StatusCode::kInvalidArgument) << h.status();
  EXPECT_THAT(Msg(h.status()), HasSubstr("251 descriptors in one handoff request; at most 250"));
  EXPECT_TRUE(stub.received().empty());
  const std::string gone = stub.path() + ".gone";
  h = FetchHandoff(gone, request, kTimeout);
  EXPECT_EQ(h.status().code(), absl::StatusCode::kUnavailable) << h.status();
  EXPECT_THAT(Msg(h.status()), HasSubstr(absl::StrCat("handoff socket ", gone, ": connect")));
}

}  // namespace
}  // namespace kvhost
