// Tests of the client's worker session (client/session.cc): a
// kvhost::Client against the daemon's services in this process
// (tests/service_daemon.h), whose state the test reads directly.
// OpenSession opens one session under the worker's name and pid (default
// "<host>:<pid>"), idempotently; AttachDevice attaches within it; a broken
// session is reopened by the background thread (reconnects counted, the old
// id still carried), with no loss to report when the same daemon had
// nothing of the worker's; a restarted daemon (another instance) is a loss,
// naming the attachments lost and, of their pools, those gone and those
// recreated empty from the daemon's config, given to OnSessionLoss and kept
// in session_losses(); session ids a caller gave are carried too (the last
// four); the client's end closes its session at once; an unreachable daemon
// is UNAVAILABLE or DEADLINE_EXCEEDED naming its address. SessionLoss::
// Describe says all of it in one line, never showing a whole attachment id.
#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "kvhost/client.h"
#include "service_daemon.h"

namespace kvhost {
namespace {

using ::kvhost::testing::ServiceDaemon;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Not;
using ::testing::UnorderedElementsAre;

std::string Msg(const absl::Status& s) { return std::string(s.message()); }

TEST(SessionLossTest, DescribeSaysWhatWasLost) {
  SessionLoss restarted;
  restarted.daemon_restarted = true;
  restarted.old_instance = "inst-a";
  restarted.new_instance = "inst-b";
  restarted.attachments = {"att-7-0123456789abcdef", "nodash"};
  restarted.pools_gone = {"scratch"};
  restarted.pools_recreated_empty = {"llama", "mistral"};
  const std::string line = restarted.Describe();
  EXPECT_EQ(line,
            "kvhostd restarted (instance inst-a -> inst-b); 2 attachment(s) lost (att-7-0123..., "
            "noda...), attach again; pools gone: scratch; pools recreated empty from the "
            "daemon's config (their data is lost): llama, mistral");
  // An attachment id is a capability: never shown whole.
  EXPECT_THAT(line, Not(HasSubstr("0123456789abcdef")));

  SessionLoss broke;
  broke.new_instance = "inst-b";
  EXPECT_EQ(broke.Describe(),
            "the session with kvhostd (instance inst-b) broke and was reopened; 0 attachment(s) "
            "lost, attach again");
}

PoolSpec SmallSpec() {
  PoolSpec s;
  s.kind = PoolKind::kMha;
  s.layout = LayoutKind::kPageFirst;
  s.dtype = DType::kBf16;
  s.page_size = 4;
  s.layer_num = 2;
  s.head_num = 2;
  s.head_dim = 8;
  s.size_tokens = 64;
  return s;
}

v1::PoolSpec SmallApiSpec() {
  v1::PoolSpec s;
  s.set_kind(v1::MHA);
  s.set_layout(v1::PAGE_FIRST);
  s.set_dtype(v1::BF16);
  s.set_page_size(4);
  s.set_layer_num(2);
  s.set_head_num(2);
  s.set_head_dim(8);
  s.set_size_tokens(64);
  return s;
}

class SessionTest : public ::testing::Test {
 protected:
  SessionTest() : daemon_(Config("inst-1")) {}
  void SetUp() override { ASSERT_TRUE(daemon_.ok()); }

  // A config declaring pool "decl" (recreated empty at every start).
  static ServiceDaemon::Config Config(const std::string& instance) {
    ServiceDaemon::Config c;
    c.instance_id = instance;
    c.declared = {{"decl", SmallSpec()}};
    return c;
  }
  std::unique_ptr<Client> Connect(const std::string& worker_name = "tp0") {
    ClientOptions options;
    options.address = daemon_.address();
    options.worker_name = worker_name;
    options.fast_path = false;
    options.timeout = absl::Seconds(10);
    options.reconnect_max_backoff = absl::Milliseconds(200);
    absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect(options);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? *std::move(c) : nullptr;
  }
  // Waits up to 20 s for `client`'s session to be open after `reconnects`
  // reopenings.
  static bool Reopened(const Client& client, uint64_t reconnects) {
    const absl::Time end = absl::Now() + absl::Seconds(20);
    while (absl::Now() < end) {
      const SessionState s = client.session_state();
      if (s.open && s.reconnects == reconnects) return true;
      absl::SleepFor(absl::Milliseconds(5));
    }
    return false;
  }
  // An attachment of `pool` made by `client` (within its session).
  absl::StatusOr<v1::Attachment> Attach(Client& client, const std::string& pool) {
    absl::StatusOr<v1::Pool> p = client.GetPool(pool);
    if (!p.ok()) return p.status();
    absl::StatusOr<std::unique_ptr<ShmDevicePool>> dev =
        ShmDevicePool::Create(*p, 16, daemon_.shm_dir());
    if (!dev.ok()) return dev.status();
    devices_.push_back(*std::move(dev));
    return client.AttachDevice(devices_.back()->MakeAttachRequest(pool));
  }

  ServiceDaemon daemon_;
  std::vector<std::unique_ptr<ShmDevicePool>> devices_;
};

TEST_F(SessionTest, OpenSessionOpensOneSessionUnderTheWorkersName) {
  std::unique_ptr<Client> client = Connect("sglang-tp0");
  ASSERT_NE(client, nullptr);
  EXPECT_FALSE(client->session_state().open);
  EXPECT_THAT(client->session_ids(), IsEmpty());
  ASSERT_TRUE(client->OpenSession(absl::Seconds(10)).ok());
  ASSERT_TRUE(client->OpenSession(absl::Seconds(10)).ok());  // idempotent
  const SessionState state = client->session_state();
  EXPECT_TRUE(state.open);
  EXPECT_EQ(state.daemon_instance, "inst-1");
  EXPECT_EQ(state.reconnects, 0u);
  const std::vector<SessionSnapshot> sessions = daemon_.manager().ListSessions();
  ASSERT_EQ(sessions.size(), 1u);
  EXPECT_EQ(sessions[0].worker, "sglang-tp0");
  EXPECT_EQ(sessions[0].pid, ::getpid());
  EXPECT_TRUE(daemon_.manager().IsSessionOpen(state.session_id));
  EXPECT_THAT(client->session_ids(), ElementsAre(state.session_id));

  // An attachment is made within it.
  absl::StatusOr<v1::Attachment> att = Attach(*client, "decl");
  ASSERT_TRUE(att.ok()) << att.status();
  ASSERT_EQ(daemon_.manager().ListSessions().size(), 1u);
  EXPECT_EQ(daemon_.manager().ListSessions()[0].attachments.size(), 1u);
}

TEST_F(SessionTest, TheDefaultWorkerNameIsHostAndPid) {
  std::unique_ptr<Client> client = Connect("");
  ASSERT_NE(client, nullptr);
  ASSERT_TRUE(client->OpenSession().ok());
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  ASSERT_EQ(daemon_.manager().ListSessions().size(), 1u);
  EXPECT_EQ(daemon_.manager().ListSessions()[0].worker, absl::StrCat(host, ":", ::getpid()));
}

TEST_F(SessionTest, ABrokenSessionIsReopenedWithNothingLost) {
  std::unique_ptr<Client> client = Connect();
  ASSERT_NE(client, nullptr);
  ASSERT_TRUE(client->OpenSession().ok());
  const std::string first = client->session_state().session_id;
  daemon_.service().EndSessions();  // the connection broke; the same daemon
  ASSERT_TRUE(Reopened(*client, 1));
  const SessionState state = client->session_state();
  EXPECT_NE(state.session_id, first);
  EXPECT_EQ(state.daemon_instance, "inst-1");
  EXPECT_FALSE(daemon_.manager().IsSessionOpen(first));
  EXPECT_TRUE(daemon_.manager().IsSessionOpen(state.session_id));
  // The old id is still carried (a backup accepted before the break can be
  // waited for), after the current one.
  EXPECT_THAT(client->session_ids(), ElementsAre(state.session_id, first));
  EXPECT_THAT(client->session_losses(), IsEmpty());
}

TEST_F(SessionTest, AnAttachmentLostWithTheSessionIsALoss) {
  std::unique_ptr<Client> client = Connect();
  ASSERT_NE(client, nullptr);
  absl::StatusOr<v1::Attachment> att = Attach(*client, "decl");
  ASSERT_TRUE(att.ok()) << att.status();
  daemon_.service().EndSessions();  // the same daemon closes the attachment
  ASSERT_TRUE(Reopened(*client, 1));
  const std::vector<SessionLoss> losses = client->session_losses();
  ASSERT_EQ(losses.size(), 1u);
  EXPECT_FALSE(losses[0].daemon_restarted);
  EXPECT_EQ(losses[0].old_instance, "inst-1");
  EXPECT_EQ(losses[0].new_instance, "inst-1");
  EXPECT_THAT(losses[0].attachments, ElementsAre(att->id()));
  EXPECT_THAT(losses[0].pools_gone, IsEmpty());  // asked only after a restart
  // A forgotten attachment (detached) is not lost.
  absl::StatusOr<v1::Attachment> again = Attach(*client, "decl");
  ASSERT_TRUE(again.ok()) << again.status();
  ASSERT_TRUE(client->DetachDevice(again->id()).ok());
  daemon_.service().EndSessions();
  ASSERT_TRUE(Reopened(*client, 2));
  EXPECT_EQ(client->session_losses().size(), 1u);
}

TEST_F(SessionTest, ARestartedDaemonIsALossNamingWhatWentWithIt) {
  std::unique_ptr<Client> client = Connect();
  ASSERT_NE(client, nullptr);
  ASSERT_TRUE(client->CreatePool("undecl", SmallApiSpec()).ok());
  absl::StatusOr<v1::Attachment> a = Attach(*client, "decl");
  ASSERT_TRUE(a.ok()) << a.status();
  absl::StatusOr<v1::Attachment> b = Attach(*client, "undecl");
  ASSERT_TRUE(b.ok()) << b.status();
  absl::Mutex mu;
  std::vector<SessionLoss> reported;
  client->OnSessionLoss([&](const SessionLoss& loss) {
    absl::MutexLock lock(&mu);
    reported.push_back(loss);
  });

  daemon_.Restart(Config("inst-2"));  // "decl" made again, empty; "undecl" gone
  ASSERT_TRUE(daemon_.ok());
  ASSERT_TRUE(Reopened(*client, 1));
  EXPECT_EQ(client->session_state().daemon_instance, "inst-2");
  const std::vector<SessionLoss> losses = client->session_losses();
  ASSERT_EQ(losses.size(), 1u);
  const SessionLoss& loss = losses[0];
  EXPECT_TRUE(loss.daemon_restarted);
  EXPECT_EQ(loss.old_instance, "inst-1");
  EXPECT_EQ(loss.new_instance, "inst-2");
  EXPECT_THAT(loss.attachments, UnorderedElementsAre(a->id(), b->id()));
  EXPECT_THAT(loss.pools_gone, ElementsAre("undecl"));
  EXPECT_THAT(loss.pools_recreated_empty, ElementsAre("decl"));
  EXPECT_GE(loss.when, absl::Now() - absl::Seconds(60));
  absl::MutexLock lock(&mu);
  ASSERT_EQ(reported.size(), 1u);  // given to OnSessionLoss too, once
  EXPECT_EQ(reported[0].Describe(), loss.Describe());
}

TEST_F(SessionTest, ARestartWithNothingAttachedIsStillALoss) {
  std::unique_ptr<Client> client = Connect();
  ASSERT_NE(client, nullptr);
  ASSERT_TRUE(client->OpenSession().ok());
  daemon_.Restart(Config("inst-2"));
  ASSERT_TRUE(Reopened(*client, 1));
  const std::vector<SessionLoss> losses = client->session_losses();
  ASSERT_EQ(losses.size(), 1u);
  EXPECT_TRUE(losses[0].daemon_restarted);
  EXPECT_THAT(losses[0].attachments, IsEmpty());
  EXPECT_THAT(losses[0].pools_gone, IsEmpty());
}

TEST_F(SessionTest, SessionIdsACallerGaveAreCarriedTheLastFour) {
  std::unique_ptr<Client> client = Connect();
  ASSERT_NE(client, nullptr);
  ASSERT_TRUE(client->OpenSession().ok());
  const std::string own = client->session_state().session_id;
  absl::StatusOr<v1::Pool> pool = client->GetPool("decl");
  ASSERT_TRUE(pool.ok()) << pool.status();
  absl::StatusOr<std::unique_ptr<ShmDevicePool>> dev =
      ShmDevicePool::Create(*pool, 16, daemon_.shm_dir());
  ASSERT_TRUE(dev.ok()) << dev.status();
  for (int i = 0; i < 5; ++i) {
    v1::AttachDeviceRequest request = (*dev)->MakeAttachRequest("decl");
    request.set_session_id(absl::StrCat("ses-given-", i));
    const absl::StatusOr<v1::Attachment> att = client->AttachDevice(request);
    // Not a session of this daemon: refused, as given.
    EXPECT_EQ(att.status().code(), absl::StatusCode::kNotFound) << att.status();
    EXPECT_THAT(Msg(att.status()), HasSubstr(absl::StrCat("ses-given-", i)));
  }
  EXPECT_THAT(client->session_ids(),
              ElementsAre(own, "ses-given-1", "ses-given-2", "ses-given-3", "ses-given-4"));
}

TEST_F(SessionTest, TheClientsEndClosesItsSession) {
  std::unique_ptr<Client> client = Connect();
  ASSERT_NE(client, nullptr);
  absl::StatusOr<v1::Attachment> att = Attach(*client, "decl");
  ASSERT_TRUE(att.ok()) << att.status();
  const std::string id = client->session_state().session_id;
  ASSERT_TRUE(daemon_.manager().IsSessionOpen(id));
  client.reset();
  // Closed by the client (a half-close the daemon answers at once; a cancel
  // after 500 ms without an answer), not left for keepalive to find after
  // 15 s.
  for (absl::Time end = absl::Now() + absl::Seconds(3);
       daemon_.manager().IsSessionOpen(id) && absl::Now() < end;) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_FALSE(daemon_.manager().IsSessionOpen(id));
  EXPECT_TRUE(daemon_.manager().ListAttachments().empty());
}

TEST_F(SessionTest, AnUnreachableDaemonIsNamed) {
  ClientOptions options;
  options.address = absl::StrCat("unix://", daemon_.shm_dir(), "/nobody.sock");
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(options);
  ASSERT_TRUE(client.ok()) << client.status();
  const absl::Status s = (*client)->OpenSession(absl::Milliseconds(500));
  ASSERT_FALSE(s.ok());
  if (s.code() == absl::StatusCode::kDeadlineExceeded) {  // no attempt ended yet
    EXPECT_EQ(Msg(s),
              absl::StrCat("no worker session with kvhostd at ", options.address, " within 500ms"));
  } else {
    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
    EXPECT_THAT(Msg(s), HasSubstr(absl::StrCat("cannot open a worker session with kvhostd at ",
                                               options.address, ": ")));
  }
  EXPECT_FALSE((*client)->session_state().open);
}

}  // namespace
}  // namespace kvhost
