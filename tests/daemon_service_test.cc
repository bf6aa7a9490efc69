// Tests of DaemonServiceImpl (server/service/daemon_service.h) over a real
// registry and a transfer manager on the host engine, through real calls to
// an in-process gRPC server (tests/in_process_server.h): no socket, no
// kvhostd. GetStatus reports what the registry, the manager and the
// daemon's identity hold (version, engine, memory budget, pools and deleted
// pools still mapped, attachments, ticket counters, declared pools, the L3
// servers, sessions), and fails with the memory figures' own error when they
// cannot be read. OpenSession opens a worker session on its first message
// (its id, the daemon's instance and the session timeout in the reply),
// keeps it through heartbeats and closes it, with its attachments, when the
// worker half-closes, cancels or the daemon ends every session; a first
// message without a worker name, or with one that is not 1-128 printable
// ASCII characters, is INVALID_ARGUMENT naming it, and opens nothing.
#include "server/service/daemon_service.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "domain_test_util.h"
#include "in_process_server.h"
#include "kvhost/v1/daemon.grpc.pb.h"
#include "pool_test_util.h"
#include "server/pool/registry.h"
#include "server/storage/backend.h"
#include "server/transfer/host_engine.h"
#include "server/transfer/transfer_manager.h"
#include "transfer_test_util.h"

namespace kvhost {
namespace {

using ::kvhost::testing::AbslStatus;
using ::kvhost::testing::AttachByName;
using ::kvhost::testing::ContextWith;
using ::kvhost::testing::EngineFixture;
using ::kvhost::testing::FakeMemory;
using ::kvhost::testing::InProcessServer;
using ::kvhost::testing::Msg;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr uint64_t kMemoryLimit = uint64_t{1} << 30;    // --memory-limit
constexpr uint64_t kMemoryReserve = uint64_t{1} << 20;  // --memory-reserve
constexpr absl::Duration kSessionTimeout = absl::Milliseconds(2500);

// A backend with servers to report (FakeBackend has none): one up for a
// minute, one down for 5 s, one whose clock says it changed in the future.
class ServersBackend final : public StorageBackend {
 public:
  uint64_t max_item_bytes() const override { return 1 << 20; }
  std::vector<absl::Status> Set(absl::Span<const StorageItem> items) override {
    return std::vector<absl::Status>(items.size(), absl::UnavailableError("no cache"));
  }
  std::vector<FetchedItem> Get(absl::Span<const std::string> keys) override {
    return std::vector<FetchedItem>(keys.size());
  }
  std::vector<bool> ExistPrefix(absl::Span<const std::string>) override { return {false}; }
  std::string Describe() const override { return "three servers"; }
  std::vector<BackendServer> Servers() const override {
    return {{"10.0.0.1:11211", true, "", made_ - absl::Seconds(60)},
            {"10.0.0.2:11211", false, "connection failure", made_ - absl::Seconds(5)},
            {"10.0.0.3:11211", true, "", made_ + absl::Hours(1)}};
  }

 private:
  const absl::Time made_ = absl::Now();
};

class DaemonServiceTest : public EngineFixture {
 protected:
  void SetUp() override {
    EngineFixture::SetUp();
    if (HasFatalFailure()) return;
    mem_.snapshot.mem_total = uint64_t{1} << 40;
    mem_.snapshot.mem_available = uint64_t{1} << 39;
    // Options(): the engine's (EngineFixture); the registry's memory figures
    // are the test's.
    RegistryOptions options = ::kvhost::testing::Options(dir_.path(), &mem_);
    options.memory_limit = kMemoryLimit;
    options.memory_reserve = kMemoryReserve;
    registry_ = std::make_unique<PoolRegistry>(options);
    absl::StatusOr<std::shared_ptr<Pool>> pool = registry_->Create("llama", spec_);
    ASSERT_TRUE(pool.ok()) << pool.status();
    pool_ = *pool;  // the registry's pool; the device file matches its layout
    manager_ = std::make_unique<TransferManager>(std::make_unique<HostEngine>(Options()));
    absl::StatusOr<AttachmentInfo> att =
        AttachByName(*manager_, *registry_, "llama", dev_.Request(pool_->layout().planes));
    ASSERT_TRUE(att.ok()) << att.status();
    att_ = att->id;
    DaemonIdentity identity;
    identity.backend_detail = "host engine, 2 threads";
    identity.instance_id = "inst-7f3a";
    identity.declared_pools = {"llama", "mistral"};
    identity.session_timeout = kSessionTimeout;
    identity.handoff_socket = "/run/kvhost/handoff.sock";
    identity.l3 = &l3_;
    service_ = std::make_unique<DaemonServiceImpl>(registry_.get(), manager_.get(), identity);
    server_ =
        std::make_unique<InProcessServer>(std::initializer_list<grpc::Service*>{service_.get()});
    ASSERT_TRUE(server_->ok());
    stub_ = v1::DaemonService::NewStub(server_->Channel());
  }
  void TearDown() override {
    stub_.reset();
    server_.reset();
    service_.reset();
    manager_.reset();
    registry_.reset();
  }

  absl::StatusOr<v1::DaemonStatus> Status() {
    auto context = ContextWith();
    v1::DaemonStatus status;
    const grpc::Status s = stub_->GetStatus(context.get(), v1::GetStatusRequest(), &status);
    if (!s.ok()) return AbslStatus(s);
    return status;
  }

  // A session stream: its context and the stream.
  struct Stream {
    std::unique_ptr<grpc::ClientContext> context;
    std::unique_ptr<grpc::ClientReaderWriter<v1::SessionRequest, v1::SessionEvent>> rw;
  };
  Stream Open() {
    Stream s;
    s.context = ContextWith();
    s.rw = stub_->OpenSession(s.context.get());
    return s;
  }
  static v1::SessionRequest Hello(const std::string& worker, int64_t pid = 4321) {
    v1::SessionRequest r;
    r.set_worker(worker);
    r.set_pid(pid);
    return r;
  }
  // Waits up to 10 s for the manager to hold `n` sessions.
  void ExpectSessions(size_t n) {
    const absl::Time end = absl::Now() + absl::Seconds(10);
    while (manager_->ListSessions().size() != n && absl::Now() < end) {
      absl::SleepFor(absl::Milliseconds(2));
    }
    EXPECT_EQ(manager_->ListSessions().size(), n);
  }

  FakeMemory mem_;
  std::unique_ptr<PoolRegistry> registry_;
  std::unique_ptr<TransferManager> manager_;
  std::string att_;
  ServersBackend l3_;
  std::unique_ptr<DaemonServiceImpl> service_;
  std::unique_ptr<InProcessServer> server_;
  std::unique_ptr<v1::DaemonService::Stub> stub_;
};

TEST_F(DaemonServiceTest, GetStatusReportsTheDaemon) {
  // One backup of 4 slots, finished and counted.
  ASSERT_TRUE(pool_->AllocPages(4).ok());
  absl::StatusOr<std::shared_ptr<Ticket>> t =
      manager_->Submit({}, att_, Direction::kBackup, {0, 1, 2, 3}, {0, 1, 2, 3});
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_TRUE((*t)->WaitUntil(absl::Now() + absl::Seconds(30)));
  const uint64_t backup_bytes = (*t)->Snapshot().bytes;
  ASSERT_GT(backup_bytes, 0u);
  for (absl::Time end = absl::Now() + absl::Seconds(10);
       manager_->counters().tickets_done != 1 && absl::Now() < end;) {
    absl::SleepFor(absl::Milliseconds(1));  // retiring runs after the waiters wake
  }

  absl::StatusOr<v1::DaemonStatus> st = Status();
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(st->version(), KVHOST_VERSION);
  EXPECT_EQ(st->backend(), "host");
  EXPECT_EQ(st->backend_detail(), "host engine, 2 threads");
  EXPECT_FALSE(st->worker_copy());
  EXPECT_EQ(st->handoff_socket(), "/run/kvhost/handoff.sock");
  EXPECT_EQ(st->fast_path_connections(), 0u);  // no fast path
  EXPECT_EQ(st->fast_path_max_connections(), 0u);
  EXPECT_EQ(st->shm_dir(), dir_.path());
  EXPECT_EQ(st->pid(), ::getpid());
  EXPECT_LE(st->uptime_s(), 60u);
  EXPECT_EQ(st->instance_id(), "inst-7f3a");
  EXPECT_THAT(st->declared_pools(), ElementsAre("llama", "mistral"));

  EXPECT_EQ(st->pools(), 1u);
  EXPECT_EQ(st->pool_bytes(), registry_->used_bytes());
  EXPECT_EQ(st->pool_bytes(), pool_->bytes());
  EXPECT_EQ(st->pool_bytes_releasing(), 0u);
  EXPECT_EQ(st->pools_creating_size(), 0);
  EXPECT_EQ(st->memory_limit_bytes(), kMemoryLimit);
  EXPECT_EQ(st->memory_reserve_bytes(), kMemoryReserve);
  EXPECT_EQ(st->memory_available_bytes(), kMemoryLimit - pool_->bytes());

  EXPECT_EQ(st->attachments(), 1u);
  EXPECT_EQ(st->tickets_in_flight(), 0u);
  EXPECT_EQ(st->tickets_done(), 1u);
  EXPECT_EQ(st->tickets_failed(), 0u);
  EXPECT_EQ(st->backup_bytes(), backup_bytes);
  EXPECT_EQ(st->load_bytes(), 0u);
  EXPECT_EQ(st->sessions_size(), 0);

  ASSERT_EQ(st->l3_servers_size(), 3);
  EXPECT_EQ(st->l3_servers(0).address(), "10.0.0.1:11211");
  EXPECT_TRUE(st->l3_servers(0).up());
  EXPECT_EQ(st->l3_servers(0).error(), "");
  EXPECT_GE(st->l3_servers(0).since_s(), 60u);
  EXPECT_LE(st->l3_servers(0).since_s(), 120u);
  EXPECT_EQ(st->l3_servers(1).address(), "10.0.0.2:11211");
  EXPECT_FALSE(st->l3_servers(1).up());
  EXPECT_EQ(st->l3_servers(1).error(), "connection failure");
  EXPECT_GE(st->l3_servers(1).since_s(), 5u);
  EXPECT_EQ(st->l3_servers(2).since_s(), 0u);  // a change "in the future" is not negative
}

TEST_F(DaemonServiceTest, ADeletedPoolStillMappedIsReleasing) {
  absl::StatusOr<std::shared_ptr<Pool>> other = registry_->Create("other", spec_);
  ASSERT_TRUE(other.ok()) << other.status();
  const uint64_t bytes = (*other)->bytes();
  absl::StatusOr<v1::DaemonStatus> st = Status();
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(st->pools(), 2u);
  EXPECT_EQ(st->pool_bytes(), pool_->bytes() + bytes);
  EXPECT_EQ(st->memory_available_bytes(), kMemoryLimit - pool_->bytes() - bytes);
  ASSERT_TRUE(registry_->Delete("other").ok());
  st = Status();  // `other` is still held here: mapped, and counted
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(st->pools(), 1u);
  EXPECT_EQ(st->pool_bytes(), pool_->bytes());
  EXPECT_EQ(st->pool_bytes_releasing(), bytes);
  EXPECT_EQ(st->memory_available_bytes(), kMemoryLimit - pool_->bytes() - bytes);
  other->reset();  // the last holder: unmapped by the releaser's thread, soon
  for (absl::Time end = absl::Now() + absl::Seconds(10);
       registry_->releasing_bytes() != 0 && absl::Now() < end;) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  st = Status();
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(st->pool_bytes_releasing(), 0u);
  EXPECT_EQ(st->memory_available_bytes(), kMemoryLimit - pool_->bytes());
}

TEST_F(DaemonServiceTest, GetStatusFailsWhenMemoryCannotBeRead) {
  mem_.error = absl::UnavailableError("/proc/meminfo: no such file");
  absl::StatusOr<v1::DaemonStatus> st = Status();
  EXPECT_EQ(st.status().code(), absl::StatusCode::kUnavailable) << st.status();
  EXPECT_THAT(Msg(st.status()), HasSubstr("/proc/meminfo: no such file"));
  mem_.error = absl::OkStatus();
  EXPECT_TRUE(Status().ok());
}

TEST_F(DaemonServiceTest, ASessionLivesAsLongAsItsStream) {
  Stream s = Open();
  ASSERT_TRUE(s.rw->Write(Hello("sglang-tp0", 4321)));
  v1::SessionEvent event;
  ASSERT_TRUE(s.rw->Read(&event));
  const std::string id = event.session_id();
  EXPECT_FALSE(id.empty());
  EXPECT_EQ(event.daemon_instance(), "inst-7f3a");
  EXPECT_EQ(event.timeout_ms(), 2500u);
  EXPECT_TRUE(manager_->IsSessionOpen(id));

  // An attachment made within the session is counted as the session's.
  AttachRequest request = dev_.Request(pool_->layout().planes);
  request.session_id = id;
  absl::StatusOr<AttachmentInfo> att = AttachByName(*manager_, *registry_, "llama", request);
  ASSERT_TRUE(att.ok()) << att.status();

  // Heartbeats keep the one session.
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(s.rw->Write(Hello("sglang-tp0", 4321)));
  absl::StatusOr<v1::DaemonStatus> st = Status();
  ASSERT_TRUE(st.ok()) << st.status();
  ASSERT_EQ(st->sessions_size(), 1);
  EXPECT_EQ(st->sessions(0).worker(), "sglang-tp0");
  EXPECT_EQ(st->sessions(0).pid(), 4321);
  EXPECT_FALSE(st->sessions(0).peer().empty());
  EXPECT_EQ(st->sessions(0).attachment_count(), 1u);
  EXPECT_LE(st->sessions(0).age_s(), 60u);
  EXPECT_EQ(st->attachments(), 2u);
  EXPECT_EQ(manager_->ListSessions().size(), 1u);

  // The worker half-closes: the session ends, its attachment with it.
  ASSERT_TRUE(s.rw->WritesDone());
  EXPECT_FALSE(s.rw->Read(&event));
  const grpc::Status end = s.rw->Finish();
  EXPECT_TRUE(end.ok()) << end.error_message();
  EXPECT_FALSE(manager_->IsSessionOpen(id));
  st = Status();
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(st->sessions_size(), 0);
  EXPECT_EQ(st->attachments(), 1u);
}

TEST_F(DaemonServiceTest, ACancelledStreamClosesItsSession) {
  Stream s = Open();
  ASSERT_TRUE(s.rw->Write(Hello("w")));
  v1::SessionEvent event;
  ASSERT_TRUE(s.rw->Read(&event));
  ASSERT_TRUE(manager_->IsSessionOpen(event.session_id()));
  s.context->TryCancel();
  EXPECT_EQ(s.rw->Finish().error_code(), grpc::StatusCode::CANCELLED);
  ExpectSessions(0);
  EXPECT_FALSE(manager_->IsSessionOpen(event.session_id()));
}

TEST_F(DaemonServiceTest, EndSessionsEndsEveryStreamUnavailable) {
  std::vector<Stream> streams;
  std::vector<std::string> ids;
  for (int i = 0; i < 2; ++i) {
    streams.push_back(Open());
    ASSERT_TRUE(streams.back().rw->Write(Hello(absl::StrCat("w", i), 100 + i)));
    v1::SessionEvent event;
    ASSERT_TRUE(streams.back().rw->Read(&event));
    ids.push_back(event.session_id());
  }
  EXPECT_NE(ids[0], ids[1]);
  EXPECT_EQ(manager_->ListSessions().size(), 2u);
  service_->EndSessions();
  for (Stream& s : streams) {
    v1::SessionEvent event;
    EXPECT_FALSE(s.rw->Read(&event));
    const grpc::Status end = s.rw->Finish();
    EXPECT_EQ(end.error_code(), grpc::StatusCode::UNAVAILABLE);
    EXPECT_EQ(end.error_message(), "kvhostd is shutting down");
  }
  for (const std::string& id : ids) EXPECT_FALSE(manager_->IsSessionOpen(id)) << id;
  EXPECT_EQ(manager_->ListSessions().size(), 0u);
}

TEST_F(DaemonServiceTest, ABadWorkerNameOpensNothing) {
  struct Case {
    const char* what;
    std::string worker;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"empty", "",
       "SessionRequest.worker is empty: the first message of OpenSession must name the worker"},
      {"too long", std::string(129, 'w'), "' must be 1-128 printable ASCII characters"},
      {"a newline", "sglang\nforged log line", "' must be 1-128 printable ASCII characters"},
      {"not ASCII", "w\xc3\xa9", "' must be 1-128 printable ASCII characters"},
  };
  for (const Case& c : cases) {
    Stream s = Open();
    s.rw->Write(Hello(c.worker));  // the server may have ended the call already
    v1::SessionEvent event;
    EXPECT_FALSE(s.rw->Read(&event)) << c.what;
    const grpc::Status end = s.rw->Finish();
    EXPECT_EQ(end.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << c.what;
    EXPECT_THAT(end.error_message(), HasSubstr(c.message)) << c.what;
    EXPECT_THAT(end.error_message(), Not(HasSubstr("\n"))) << c.what;  // shown safely
    EXPECT_EQ(manager_->ListSessions().size(), 0u) << c.what;
  }
  // 128 printable characters are a name.
  Stream s = Open();
  ASSERT_TRUE(s.rw->Write(Hello(std::string(128, '~'))));
  v1::SessionEvent event;
  ASSERT_TRUE(s.rw->Read(&event));
  EXPECT_FALSE(event.session_id().empty());
  ASSERT_EQ(manager_->ListSessions().size(), 1u);
  EXPECT_EQ(manager_->ListSessions()[0].worker, std::string(128, '~'));
  s.context->TryCancel();
  s.rw->Finish();
}

}  // namespace
}  // namespace kvhost
