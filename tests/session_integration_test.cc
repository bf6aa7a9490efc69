// Worker sessions and daemon restarts through kvhostd:
// a worker killed with SIGKILL mid-transfer has its session, attachments and
// transfers closed within --session-timeout while the pool and its backed-up
// bytes stay for the next worker; a client reconnects to a restarted daemon
// and reports what was lost; SIGTERM's drain is bounded; session errors.
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "api_test_util.h"
#include "daemon_fixture.h"
#include "gtest/gtest.h"
#include "kvhost/client.h"
#include "worker_process.h"

namespace kvhost::testing {
namespace {

namespace fs = std::filesystem;

constexpr absl::Duration kWait = absl::Seconds(30);

// $KVHOST_SESSION_WORKER when set (a bundle run elsewhere than where it was
// built, as scripts/gpu_run.sh does), else the one this build made.
std::string SessionWorkerPath() {
  const char* env = std::getenv("KVHOST_SESSION_WORKER");
  return env != nullptr && *env != '\0' ? env : KVHOST_SESSION_WORKER_PATH;
}

std::vector<std::string> WorkerArgs(const TestDaemon& d, const std::string& pool,
                                    const std::string& mode, int64_t first, int64_t count) {
  return {SessionWorkerPath(), d.address(),        d.shm_dir(), pool, mode,
          absl::StrCat(first), absl::StrCat(count)};
}

// 8 layers of 1 KiB K and V rows: 16 KiB a token.
v1::PoolSpec WorkerSpec(uint64_t tokens) {
  Dims dims;
  dims.layers = 8;
  dims.heads = 8;
  dims.head_dim = 64;
  return MakeSpec(v1::MHA, v1::PAGE_FIRST, 16, tokens, v1::BF16, dims);
}

TEST(SessionTest, KilledWorkerIsCleanedUpWithinTheTimeoutAndItsBackupsSurvive) {
  absl::StatusOr<std::unique_ptr<TestDaemon>> d_or =
      TestDaemon::Start(KVHOSTD_PATH, {"--session-timeout=1s"});
  ASSERT_TRUE(d_or.ok()) << d_or.status();
  TestDaemon& d = **d_or;
  Client& c = d.client();
  constexpr int64_t kCount = 4096;  // 64 MiB a backup
  ASSERT_TRUE(c.CreatePool("kv", WorkerSpec(2 * kCount)).ok());
  absl::StatusOr<std::vector<int64_t>> slots = c.Alloc("kv", kCount);
  ASSERT_TRUE(slots.ok()) << slots.status();
  ASSERT_EQ(slots->front(), 0);
  ASSERT_EQ(slots->back(), kCount - 1);

  WorkerProcess worker(WorkerArgs(d, "kv", "backup", 0, kCount));
  ASSERT_NE(worker.WaitFor("attached", kWait), "") << worker.output() << d.Log();
  absl::StatusOr<v1::DaemonStatus> status = c.GetStatus();
  ASSERT_TRUE(status.ok()) << status.status();
  ASSERT_EQ(status->sessions_size(), 1);
  EXPECT_EQ(status->sessions(0).pid(), worker.pid());
  EXPECT_EQ(status->sessions(0).worker(), "session_worker-backup");
  EXPECT_EQ(status->sessions(0).attachment_count(), 1u);
  ASSERT_NE(worker.WaitFor("promised", kWait), "") << worker.output() << d.Log();
  ASSERT_NE(worker.WaitFor("queued", kWait), "") << worker.output() << d.Log();
  status = c.GetStatus();
  ASSERT_TRUE(status.ok());
  const uint64_t in_flight = status->tickets_in_flight();
  const uint64_t failed_before = status->tickets_failed();

  const absl::Time killed = absl::Now();
  worker.Kill();
  EXPECT_EQ(worker.Wait(), 128 + SIGKILL);
  // The session, its attachment and every transfer it had in flight are
  // gone within the timeout (1 s) and a margin for the test's polling.
  absl::Duration took = absl::InfiniteDuration();
  while (absl::Now() - killed < absl::Seconds(5)) {
    status = c.GetStatus();
    ASSERT_TRUE(status.ok());
    if (status->sessions_size() == 0 && status->attachments() == 0 &&
        status->tickets_in_flight() == 0) {
      took = absl::Now() - killed;
      break;
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  std::printf("%llu transfer(s) in flight at the kill; cleaned up after %s\n",
              static_cast<unsigned long long>(in_flight), absl::FormatDuration(took).c_str());
  EXPECT_LE(took, absl::Seconds(2)) << d.Log();
  const std::string log = d.Log();
  EXPECT_TRUE(absl::StrContains(log, "of worker 'session_worker-backup'")) << log;
  EXPECT_TRUE(absl::StrContains(log, "closed 1 attachment(s)")) << log;
  // The loads it left were cancelled or finished; none is left running.
  EXPECT_GE(status->tickets_failed(), failed_before);

  // The pool and its slots stay as they were...
  absl::StatusOr<v1::Pool> pool = c.GetPool("kv");
  ASSERT_TRUE(pool.ok());
  EXPECT_EQ(pool->available_tokens(), pool->size_tokens() - kCount);
  EXPECT_EQ(pool->attachments(), 0u);
  // ... and a new worker loads what the dead one backed up.
  WorkerProcess next(WorkerArgs(d, "kv", "verify", 0, kCount));
  const std::string verified = next.WaitFor("verified", kWait);
  EXPECT_EQ(next.Wait(), 0) << next.output() << d.Log();
  EXPECT_EQ(verified, absl::StrCat("verified ", kCount * 8 * 2 * 1024));
}

TEST(SessionTest, ClosingTheClientClosesItsAttachmentsAtOnce) {
  absl::StatusOr<std::unique_ptr<TestDaemon>> d_or = TestDaemon::Start(KVHOSTD_PATH);
  ASSERT_TRUE(d_or.ok()) << d_or.status();
  TestDaemon& d = **d_or;
  absl::StatusOr<v1::Pool> pool = d.client().CreatePool("kv", WorkerSpec(256));
  ASSERT_TRUE(pool.ok());
  absl::StatusOr<std::unique_ptr<ShmDevicePool>> dev =
      ShmDevicePool::Create(*pool, 256, d.shm_dir());
  ASSERT_TRUE(dev.ok());
  {
    ClientOptions options;
    options.address = d.address();
    absl::StatusOr<std::unique_ptr<Client>> worker = Client::Connect(options);
    ASSERT_TRUE(worker.ok());
    absl::StatusOr<v1::Attachment> a = (*worker)->AttachDevice((*dev)->MakeAttachRequest("kv"));
    ASSERT_TRUE(a.ok()) << a.status();
    EXPECT_FALSE(a->session_id().empty());
    EXPECT_EQ(a->session_id(), (*worker)->session_state().session_id);
    absl::StatusOr<v1::DaemonStatus> status = d.client().GetStatus();
    ASSERT_TRUE(status.ok());
    EXPECT_EQ(status->attachments(), 1u);
  }
  absl::StatusOr<v1::DaemonStatus> status;
  for (int i = 0; i < 100; ++i) {
    status = d.client().GetStatus();
    ASSERT_TRUE(status.ok());
    if (status->attachments() == 0) break;
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(status->attachments(), 0u);
  EXPECT_EQ(status->sessions_size(), 0);

  // Without a session (tools), the attachment stays until DetachDevice.
  ClientOptions options;
  options.address = d.address();
  options.worker_session = false;
  {
    absl::StatusOr<std::unique_ptr<Client>> tool = Client::Connect(options);
    ASSERT_TRUE(tool.ok());
    absl::StatusOr<v1::Attachment> a = (*tool)->AttachDevice((*dev)->MakeAttachRequest("kv"));
    ASSERT_TRUE(a.ok()) << a.status();
    EXPECT_EQ(a->session_id(), "");
  }
  status = d.client().GetStatus();
  ASSERT_TRUE(status.ok());
  EXPECT_EQ(status->attachments(), 1u);
}

TEST(SessionTest, SessionErrors) {
  absl::StatusOr<std::unique_ptr<TestDaemon>> d_or = TestDaemon::Start(KVHOSTD_PATH);
  ASSERT_TRUE(d_or.ok()) << d_or.status();
  TestDaemon& d = **d_or;
  absl::StatusOr<v1::Pool> pool = d.client().CreatePool("kv", WorkerSpec(256));
  ASSERT_TRUE(pool.ok());
  absl::StatusOr<std::unique_ptr<ShmDevicePool>> dev =
      ShmDevicePool::Create(*pool, 256, d.shm_dir());
  ASSERT_TRUE(dev.ok());
  v1::AttachDeviceRequest request = (*dev)->MakeAttachRequest("kv");
  request.set_session_id("ses-1-00000000000000000000000000000000");
  // The message names the session by its prefix (the id is a capability).
  EXPECT_ERROR(d.client().AttachDevice(request), kNotFound, "ses-1-0000", "not open");
  absl::StatusOr<v1::Pool> after = d.client().GetPool("kv");
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->attachments(), 0u);

  // A first message without a worker name.
  auto channel = grpc::CreateChannel(d.address(), grpc::InsecureChannelCredentials());
  auto stub = v1::DaemonService::NewStub(channel);
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  auto stream = stub->OpenSession(&context);
  ASSERT_TRUE(stream->Write(v1::SessionRequest()));
  v1::SessionEvent event;
  EXPECT_FALSE(stream->Read(&event));
  const grpc::Status s = stream->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_TRUE(absl::StrContains(s.error_message(), "worker")) << s.error_message();
}

TEST(RestartTest, ClientReconnectsAndReportsWhatTheRestartLost) {
  char dir_template[] = "/tmp/kvhost-restart-XXXXXX";
  ASSERT_NE(::mkdtemp(dir_template), nullptr);
  const std::string dir = dir_template;
  char shm_template[] = "/dev/shm/kvhost-restart-XXXXXX";
  ASSERT_NE(::mkdtemp(shm_template), nullptr);
  const std::string shm_dir = shm_template;
  const std::string socket = dir + "/kvhost.sock";
  const std::string config = dir + "/kvhostd.yaml";
  const std::string log = dir + "/kvhostd.log";
  {
    std::ofstream out(config);
    out << "pools:\n  - name: declared\n    spec: {kind: MHA, layout: PAGE_FIRST, dtype: BF16, "
           "page_size: 16, layer_num: 2, head_num: 2, head_dim: 64, size_tokens: 256}\n";
  }
  pid_t first = StartKvhostd(socket, shm_dir, log, config);
  ClientOptions options;
  options.address = absl::StrCat("unix://", socket);
  options.reconnect_max_backoff = absl::Milliseconds(200);
  absl::StatusOr<std::unique_ptr<Client>> client_or = Client::Connect(options);
  ASSERT_TRUE(client_or.ok());
  Client& c = **client_or;
  ASSERT_TRUE(c.WaitForReady(absl::Seconds(20)).ok()) << ReadFile(log);
  std::vector<SessionLoss> reported;
  absl::Mutex mu;
  c.OnSessionLoss([&](const SessionLoss& loss) {
    absl::MutexLock lock(&mu);
    reported.push_back(loss);
  });
  absl::StatusOr<v1::Pool> undeclared = c.CreatePool("undeclared", WorkerSpec(256));
  ASSERT_TRUE(undeclared.ok());
  absl::StatusOr<v1::Pool> declared = c.GetPool("declared");
  ASSERT_TRUE(declared.ok()) << declared.status();
  absl::StatusOr<std::unique_ptr<ShmDevicePool>> dev_a =
      ShmDevicePool::Create(*undeclared, 256, shm_dir);
  absl::StatusOr<std::unique_ptr<ShmDevicePool>> dev_b =
      ShmDevicePool::Create(*declared, 256, shm_dir);
  ASSERT_TRUE(dev_a.ok() && dev_b.ok());
  absl::StatusOr<v1::Attachment> a = c.AttachDevice((*dev_a)->MakeAttachRequest("undeclared"));
  absl::StatusOr<v1::Attachment> b = c.AttachDevice((*dev_b)->MakeAttachRequest("declared"));
  ASSERT_TRUE(a.ok() && b.ok()) << a.status() << b.status();
  const std::string instance = c.session_state().daemon_instance;
  EXPECT_FALSE(instance.empty());
  absl::StatusOr<v1::DaemonStatus> status = c.GetStatus();
  ASSERT_TRUE(status.ok());
  EXPECT_EQ(status->instance_id(), instance);
  ASSERT_EQ(status->declared_pools_size(), 1);
  EXPECT_EQ(status->declared_pools(0), "declared");

  // With an open session, SIGTERM still exits promptly: the daemon ends the
  // session streams instead of waiting out the RPC grace period.
  const absl::Time stop = absl::Now();
  EXPECT_EQ(StopKvhostd(first), 0) << ReadFile(log);
  EXPECT_LT(absl::Now() - stop, absl::Seconds(5)) << ReadFile(log);
  // Calls fail UNAVAILABLE while it is down.
  EXPECT_EQ(c.GetStatus().status().code(), absl::StatusCode::kUnavailable);
  EXPECT_FALSE(c.session_state().open);

  pid_t second = StartKvhostd(socket, shm_dir, log, config);
  // The client reconnects on its own and reports the loss once.
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (absl::Now() < deadline) {
    {
      absl::MutexLock lock(&mu);
      if (!reported.empty()) break;
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  {
    absl::MutexLock lock(&mu);
    ASSERT_EQ(reported.size(), 1u) << ReadFile(log);
    const SessionLoss& loss = reported[0];
    EXPECT_TRUE(loss.daemon_restarted);
    EXPECT_EQ(loss.old_instance, instance);
    EXPECT_NE(loss.new_instance, instance);
    EXPECT_EQ(loss.attachments.size(), 2u);
    EXPECT_EQ(loss.pools_gone, std::vector<std::string>{"undeclared"});
    EXPECT_EQ(loss.pools_recreated_empty, std::vector<std::string>{"declared"});
    const std::string text = loss.Describe();
    EXPECT_TRUE(absl::StrContains(text, "restarted")) << text;
    EXPECT_TRUE(absl::StrContains(text, "undeclared")) << text;
    EXPECT_TRUE(absl::StrContains(text, "recreated empty")) << text;
  }
  EXPECT_EQ(c.session_losses().size(), 1u);
  EXPECT_TRUE(c.session_state().open);
  EXPECT_EQ(c.session_state().reconnects, 1u);
  // The worker attaches again within the new session.
  absl::StatusOr<v1::Attachment> again = c.AttachDevice((*dev_b)->MakeAttachRequest("declared"));
  EXPECT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->session_id(), c.session_state().session_id);
  EXPECT_EQ(StopKvhostd(second), 0) << ReadFile(log);
  dev_a->reset();
  dev_b->reset();
  std::error_code ec;
  fs::remove_all(dir, ec);
  fs::remove_all(shm_dir, ec);
}

// Pool "kv" of `tokens` tokens, every slot allocated, and a ShmDevicePool of
// as many rows attached to it through the daemon's own client (in its session).
struct AttachedPool {
  v1::Pool pool;
  std::unique_ptr<ShmDevicePool> device;
  v1::Attachment attachment;
};

absl::StatusOr<AttachedPool> AttachAllocatedPool(TestDaemon& d, int64_t tokens) {
  Client& c = d.client();
  AttachedPool out;
  absl::StatusOr<v1::Pool> pool = c.CreatePool("kv", WorkerSpec(tokens));
  if (!pool.ok()) return pool.status();
  out.pool = *pool;
  if (absl::StatusOr<std::vector<int64_t>> slots = c.Alloc("kv", tokens); !slots.ok()) {
    return slots.status();
  }
  absl::StatusOr<std::unique_ptr<ShmDevicePool>> device =
      ShmDevicePool::Create(out.pool, tokens, d.shm_dir());
  if (!device.ok()) return device.status();
  out.device = *std::move(device);
  absl::StatusOr<v1::Attachment> attachment = c.AttachDevice(out.device->MakeAttachRequest("kv"));
  if (!attachment.ok()) return attachment.status();
  out.attachment = *attachment;
  return out;
}

TEST(DrainTest, SigtermCancelsWhatTheDrainTimeoutLeaves) {
  absl::StatusOr<std::unique_ptr<TestDaemon>> d_or =
      TestDaemon::Start(KVHOSTD_PATH, {"--drain-timeout=300ms", "--copy-threads=0"});
  ASSERT_TRUE(d_or.ok()) << d_or.status();
  TestDaemon& d = **d_or;
  Client& c = d.client();
  constexpr int64_t kCount = 4096;
  absl::StatusOr<AttachedPool> attached = AttachAllocatedPool(d, kCount);
  ASSERT_TRUE(attached.ok()) << attached.status();
  const v1::Attachment* a = &attached->attachment;
  // 200 backups of 64 MiB: far more than 300 ms of copying on one thread.
  for (int i = 0; i < 200; ++i) {
    ASSERT_TRUE(c.Backup(a->id(), Range(0, kCount), Range(0, kCount)).ok());
  }
  const absl::Time stop = absl::Now();
  EXPECT_EQ(d.Stop(SIGTERM), 0) << d.Log();
  const absl::Duration took = absl::Now() - stop;
  std::printf("SIGTERM with 200 backups queued: exited after %s\n",
              absl::FormatDuration(took).c_str());
  EXPECT_LT(took, absl::Seconds(5)) << d.Log();
  EXPECT_TRUE(absl::StrContains(d.Log(), "unfinished after 300ms")) << d.Log();
}

// A worker that shrinks its shm "device" file under the daemon's mapping
// fails its own transfers (SIGBUS caught), not the daemon.
TEST(FaultTest, TruncatedDeviceFileFailsTheTicketNotTheDaemon) {
  absl::StatusOr<std::unique_ptr<TestDaemon>> d_or = TestDaemon::Start(KVHOSTD_PATH);
  ASSERT_TRUE(d_or.ok()) << d_or.status();
  TestDaemon& d = **d_or;
  Client& c = d.client();
  constexpr int64_t kCount = 1024;
  absl::StatusOr<AttachedPool> attached = AttachAllocatedPool(d, kCount);
  ASSERT_TRUE(attached.ok()) << attached.status();
  const v1::Attachment* a = &attached->attachment;
  ASSERT_EQ(::truncate(attached->device->path().c_str(), 0), 0);
  for (bool backup : {true, false}) {
    absl::StatusOr<uint64_t> t = backup ? c.Backup(a->id(), Range(0, kCount), Range(0, kCount))
                                        : c.Load(a->id(), Range(0, kCount), Range(0, kCount));
    ASSERT_TRUE(t.ok()) << t.status() << d.Log();
    EXPECT_ERROR(c.WaitTransfer(*t, kWait), kFailedPrecondition, "truncated", "SIGBUS") << d.Log();
  }
  absl::StatusOr<v1::DaemonStatus> status = c.GetStatus();
  ASSERT_TRUE(status.ok()) << status.status() << d.Log();
  EXPECT_EQ(status->tickets_failed(), 2u);
  EXPECT_EQ(status->tickets_in_flight(), 0u);
  EXPECT_EQ(d.Stop(SIGTERM), 0) << d.Log();
}

}  // namespace
}  // namespace kvhost::testing
