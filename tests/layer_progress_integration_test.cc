// Layer progress through a real kvhostd (host backend, which publishes the
// counters as the cuda backend does): an attachment with layer_progress
// names the handoff socket, its worker fetches the read-only counters
// (kvhost::LayerProgress), every load's counter reaches base + layers and
// the bases advance per set; a load that fails midway still releases its
// waiters; the handoff socket refuses unknown and strangers' ids alike, and
// malformed, oversized, kind-less and silent requests, without stalling the
// next; the descriptor is read-only; the socket file has the gRPC socket's
// mode and goes at shutdown; --handoff-socket moves or disables it; and an
// attachment without layer_progress behaves as before.
#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "api_test_util.h"
#include "client/handoff.h"
#include "daemon_fixture.h"
#include "gtest/gtest.h"
#include "kvhost/client.h"
#include "kvhost/layer_progress.h"

namespace kvhost {
namespace {

using ::kvhost::testing::IsError;
using ::kvhost::testing::MakeSpec;
using ::kvhost::testing::Range;
using ::kvhost::testing::StatusOf;
using ::kvhost::testing::TestDaemon;

constexpr absl::Duration kWait = absl::Seconds(30);
constexpr uint32_t kLayers = 3;  // MakeSpec's
// 4096 rows of 32 bytes: each device layer buffer is 128 KiB, whole pages,
// so a truncated file faults exactly at a layer's buffer.
constexpr uint64_t kDeviceRows = 4096;

// The handoff socket's path for a daemon listening on `address`.
std::string HandoffPathOf(const std::string& address) {
  return absl::StrCat(address.substr(std::strlen("unix://")), ".fds");
}

std::unique_ptr<Client> Connect(const std::string& address, bool worker_session) {
  ClientOptions options;
  options.address = address;
  options.timeout = absl::Seconds(10);
  options.worker_session = worker_session;
  absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect(options);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *std::move(c) : nullptr;
}

// Sends `bytes` as one message on a fresh connection to `path` (nothing when
// `send` is false) and returns the reply; code -1 when none came within
// `timeout` or the connection closed without one.
v1::HandoffReply RawExchange(const std::string& path, const std::string& bytes, bool send = true,
                             absl::Duration timeout = absl::Seconds(5)) {
  v1::HandoffReply reply;
  reply.set_code(-1);
  const int fd = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ADD_FAILURE() << "connect " << path << ": " << std::strerror(errno);
    ::close(fd);
    return reply;
  }
  if (send) {
    EXPECT_EQ(::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL),
              static_cast<ssize_t>(bytes.size()));
  }
  pollfd ready = {fd, POLLIN, 0};
  if (::poll(&ready, 1, static_cast<int>(absl::ToInt64Milliseconds(timeout))) == 1) {
    char buffer[4096];
    const ssize_t n = ::recv(fd, buffer, sizeof(buffer), 0);
    if (n > 0 && !reply.ParseFromArray(buffer, static_cast<int>(n))) reply.set_code(-2);
  }
  ::close(fd);
  return reply;
}

// Whether the daemon's log comes to hold `needle` within a few seconds (it
// logs a handoff after sending the reply).
bool LogShows(const TestDaemon& daemon, const std::string& needle) {
  for (absl::Time end = absl::Now() + absl::Seconds(5); absl::Now() < end;
       absl::SleepFor(absl::Milliseconds(10))) {
    if (absl::StrContains(daemon.Log(), needle)) return true;
  }
  return false;
}

v1::HandoffRequest CountersRequest(const std::string& attachment_id,
                                   const std::vector<std::string>& sessions) {
  v1::HandoffRequest request;
  request.set_attachment_id(attachment_id);
  request.set_kind(v1::HANDOFF_KIND_LAYER_COUNTERS);
  for (const std::string& s : sessions) request.add_session_ids(s);
  return request;
}

class LayerProgressTest : public ::testing::Test {
 protected:
  void SetUp() override { StartDaemon({}); }
  void TearDown() override {
    if (daemon_ != nullptr && HasFailure()) {
      std::string log = daemon_->Log();
      if (log.size() > 6000) log = "..." + log.substr(log.size() - 6000);
      std::fprintf(stderr, "--- kvhostd log (tail) ---\n%s\n", log.c_str());
    }
  }

  void StartDaemon(std::vector<std::string> flags) {
    dev_.reset();
    absl::StatusOr<std::unique_ptr<TestDaemon>> d = TestDaemon::Start(KVHOSTD_PATH, flags);
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = *std::move(d);
    absl::StatusOr<v1::Pool> pool =
        client().CreatePool("p", MakeSpec(v1::MHA, v1::PAGE_FIRST, 4, 64));
    ASSERT_TRUE(pool.ok()) << pool.status();
    pool_ = *pool;
    absl::StatusOr<std::vector<int64_t>> slots = client().Alloc("p", 16);
    ASSERT_TRUE(slots.ok()) << slots.status();
    absl::StatusOr<std::unique_ptr<ShmDevicePool>> dev =
        ShmDevicePool::Create(pool_, kDeviceRows, daemon_->shm_dir());
    ASSERT_TRUE(dev.ok()) << dev.status();
    dev_ = *std::move(dev);
  }

  // An attachment of dev_ to "p" with layer progress and `sets` sets.
  v1::Attachment AttachWithProgress(uint32_t sets) {
    AttachOptions options;
    options.layer_progress = true;
    v1::AttachDeviceRequest request = dev_->MakeAttachRequest("p", options);
    request.set_load_event_sets(sets);
    absl::StatusOr<v1::Attachment> att = client().AttachDevice(request);
    EXPECT_TRUE(att.ok()) << att.status();
    return att.ok() ? *att : v1::Attachment();
  }

  Client& client() { return daemon_->client(); }
  std::string handoff_path() const { return HandoffPathOf(daemon_->address()); }

  std::unique_ptr<TestDaemon> daemon_;
  v1::Pool pool_;
  std::unique_ptr<ShmDevicePool> dev_;
};

TEST_F(LayerProgressTest, WithoutLayerProgressNothingChanges) {
  absl::StatusOr<v1::Attachment> att = client().AttachDevice(dev_->MakeAttachRequest("p"));
  ASSERT_TRUE(att.ok()) << att.status();
  EXPECT_FALSE(att->layer_progress());
  // Only for the caller's own map of the pool (HANDOFF_KIND_POOL_MAP), when
  // attached within a session.
  EXPECT_EQ(att->handoff_socket(), att->session_id().empty() ? "" : handoff_path());
  EXPECT_EQ(att->load_event_sets(), 0u);  // host backend: no events
  absl::StatusOr<LoadTicket> load = client().LoadWithEvents(att->id(), Range(0, 16), Range(0, 16));
  ASSERT_TRUE(load.ok()) << load.status();
  EXPECT_EQ(load->event_set, -1);
  EXPECT_EQ(load->layer_base, 0u);
  ASSERT_TRUE(client().WaitTransfer(load->ticket_id, kWait).ok());
  // Its owner asks for counters it does not have.
  absl::StatusOr<Handoff> fetched =
      FetchHandoff(handoff_path(), CountersRequest(att->id(), client().session_ids()), kWait);
  EXPECT_TRUE(IsError(StatusOf(fetched), absl::StatusCode::kFailedPrecondition,
                      {"without layer_progress"}));
  EXPECT_TRUE(IsError(StatusOf(LayerProgress::Open(client(), *att)),
                      absl::StatusCode::kFailedPrecondition, {"layer_progress"}));
}

TEST_F(LayerProgressTest, CountersReachBasePlusLayersAndBasesAdvancePerSet) {
  const v1::Attachment att = AttachWithProgress(2);
  ASSERT_FALSE(att.id().empty());
  EXPECT_TRUE(att.layer_progress());
  EXPECT_EQ(att.handoff_socket(), handoff_path());
  EXPECT_EQ(att.load_event_sets(), 2u);
  absl::StatusOr<std::unique_ptr<LayerProgress>> progress = LayerProgress::Open(client(), att);
  ASSERT_TRUE(progress.ok()) << progress.status();
  ASSERT_EQ((*progress)->sets(), 2u);
  EXPECT_EQ((*progress)->Recorded(0), 0u);
  EXPECT_EQ((*progress)->Recorded(1), 0u);
  uint64_t expected_base[2] = {0, 0};
  std::mt19937 rng(3);
  for (int n = 0; n < 6; ++n) {
    SCOPED_TRACE(absl::StrCat("load ", n));
    std::vector<int64_t> rows = Range(0, 16);
    std::shuffle(rows.begin(), rows.end(), rng);
    absl::StatusOr<LoadTicket> load = client().LoadWithEvents(att.id(), Range(0, 16), rows);
    ASSERT_TRUE(load.ok()) << load.status();
    ASSERT_TRUE(load->event_set == 0 || load->event_set == 1) << load->event_set;
    const uint32_t set = static_cast<uint32_t>(load->event_set);
    EXPECT_EQ(load->layer_base, expected_base[set]);
    for (uint32_t l = 0; l < kLayers; ++l) {
      EXPECT_TRUE((*progress)->WaitRecorded(*load, l, kWait).ok()) << "layer " << l;
    }
    absl::StatusOr<v1::TransferStatus> done = client().WaitTransfer(load->ticket_id, kWait);
    ASSERT_TRUE(done.ok()) << done.status();
    EXPECT_EQ(done->event_set(), load->event_set);
    EXPECT_EQ((*progress)->Recorded(set), load->layer_base + kLayers);
    expected_base[set] += kLayers;
  }
  // Both sets served (round robin), each counter at its loads' layers.
  EXPECT_EQ(expected_base[0], 3 * kLayers);
  EXPECT_EQ(expected_base[1], 3 * kLayers);
  // A layer no load has recorded yet: the wait ends with what it saw.
  absl::Status late = (*progress)->WaitRecorded(0, expected_base[0], 1, absl::Milliseconds(50));
  EXPECT_TRUE(IsError(late, absl::StatusCode::kDeadlineExceeded,
                      {"layer 1", "event set 0", absl::StrCat("at ", expected_base[0]),
                       absl::StrCat("needs ", expected_base[0] + 2)}));
  EXPECT_TRUE(IsError((*progress)->WaitRecorded(2, 0, 0, kWait), absl::StatusCode::kInvalidArgument,
                      {"event set 2"}));
  EXPECT_TRUE((*progress)->WaitRecorded(-1, 0, 0, kWait).ok());  // nothing to wait on
  // A load of no rows takes no set.
  absl::StatusOr<LoadTicket> empty = client().LoadWithEvents(att.id(), {}, {});
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_EQ(empty->event_set, -1);
  // The mapping outlives the attachment.
  ASSERT_TRUE(client().DetachDevice(att.id()).ok());
  EXPECT_EQ((*progress)->Recorded(0), expected_base[0]);
}

TEST_F(LayerProgressTest, ALoadThatFailsMidwayStillReleasesItsWaiters) {
  const v1::Attachment att = AttachWithProgress(1);
  absl::StatusOr<std::unique_ptr<LayerProgress>> progress = LayerProgress::Open(client(), att);
  ASSERT_TRUE(progress.ok()) << progress.status();
  // Cut the file where V of layer 1 starts: layer 0 copies, layer 1 faults.
  const uint64_t cut = static_cast<uint64_t>(dev_->layer(1, 1) - dev_->layer(0, 0));
  ASSERT_EQ(cut % 4096, 0u);
  const int fd = ::open(dev_->path().c_str(), O_RDWR | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::ftruncate(fd, static_cast<off_t>(cut)), 0);
  absl::StatusOr<LoadTicket> load = client().LoadWithEvents(att.id(), Range(0, 16), Range(0, 16));
  ASSERT_TRUE(load.ok()) << load.status();
  ASSERT_EQ(load->event_set, 0);
  EXPECT_EQ(load->layer_base, 0u);
  // The last layer's waiter is released although that layer never copied.
  EXPECT_TRUE((*progress)->WaitRecorded(*load, kLayers - 1, kWait).ok());
  EXPECT_TRUE(IsError(StatusOf(client().WaitTransfer(load->ticket_id, kWait)),
                      absl::StatusCode::kFailedPrecondition, {"layer 1", "truncated"}));
  EXPECT_EQ((*progress)->Recorded(0), kLayers);
  // The set is free again and the next load follows the failed one's count.
  ASSERT_EQ(::ftruncate(fd, static_cast<off_t>(dev_->bytes())), 0);
  ::close(fd);
  absl::StatusOr<LoadTicket> next = client().LoadWithEvents(att.id(), Range(0, 16), Range(0, 16));
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->layer_base, kLayers);
  ASSERT_TRUE(client().WaitTransfer(next->ticket_id, kWait).ok());
  EXPECT_EQ((*progress)->Recorded(0), 2 * kLayers);
}

// A backup of such an attachment takes a set as a load does and counts in
// the same sequence, so a worker can wait on its last layer; one that fails
// midway still ends its counter, and frees its set for the next transfer.
TEST_F(LayerProgressTest, ABackupCountsAsALoadDoesAndAFailedOneStillEnds) {
  const v1::Attachment att = AttachWithProgress(1);
  absl::StatusOr<std::unique_ptr<LayerProgress>> progress = LayerProgress::Open(client(), att);
  ASSERT_TRUE(progress.ok()) << progress.status();
  v1::BackupRequest request;
  request.set_attachment_id(att.id());
  for (int64_t i : Range(0, 16)) request.add_host_indices(i), request.add_device_indices(i);
  absl::StatusOr<v1::TransferTicket> backup = client().SubmitBackup(request);
  ASSERT_TRUE(backup.ok()) << backup.status();
  ASSERT_EQ(backup->event_set(), 0);
  EXPECT_EQ(backup->layer_base(), 0u);
  const LoadTicket waited{backup->id(), backup->event_set(), backup->layer_base()};
  EXPECT_TRUE((*progress)->WaitRecorded(waited, kLayers - 1, kWait).ok());
  ASSERT_TRUE(client().WaitTransfer(backup->id(), kWait).ok());
  EXPECT_EQ((*progress)->Recorded(0), kLayers);
  // Cut the file where V of layer 1 starts: the next backup fails there.
  const uint64_t cut = static_cast<uint64_t>(dev_->layer(1, 1) - dev_->layer(0, 0));
  const int fd = ::open(dev_->path().c_str(), O_RDWR | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::ftruncate(fd, static_cast<off_t>(cut)), 0);
  absl::StatusOr<v1::TransferTicket> failing = client().SubmitBackup(request);
  ASSERT_TRUE(failing.ok()) << failing.status();
  ASSERT_EQ(failing->event_set(), 0);
  EXPECT_EQ(failing->layer_base(), kLayers);
  const LoadTicket failed{failing->id(), failing->event_set(), failing->layer_base()};
  EXPECT_TRUE((*progress)->WaitRecorded(failed, kLayers - 1, kWait).ok());
  EXPECT_TRUE(IsError(StatusOf(client().WaitTransfer(failing->id(), kWait)),
                      absl::StatusCode::kFailedPrecondition, {"layer 1", "truncated"}));
  EXPECT_EQ((*progress)->Recorded(0), 2 * kLayers);
  ASSERT_EQ(::ftruncate(fd, static_cast<off_t>(dev_->bytes())), 0);
  ::close(fd);
  // The set is free: a load takes it next, after the backups' count.
  absl::StatusOr<LoadTicket> load = client().LoadWithEvents(att.id(), Range(0, 16), Range(0, 16));
  ASSERT_TRUE(load.ok()) << load.status();
  EXPECT_EQ(load->layer_base, 2 * kLayers);
  ASSERT_TRUE(client().WaitTransfer(load->ticket_id, kWait).ok());
}

TEST_F(LayerProgressTest, TheHandoffRefusesStrangersAsUnknownIds) {
  const v1::Attachment att = AttachWithProgress(2);
  const std::vector<std::string> mine = client().session_ids();
  ASSERT_FALSE(mine.empty());
  auto fetch = [&](const v1::HandoffRequest& r) { return FetchHandoff(handoff_path(), r, kWait); };
  // Unknown, and a stranger's view of a real one: the same answer.
  EXPECT_TRUE(IsError(StatusOf(fetch(CountersRequest("att-9-0123456789abcdef", mine))),
                      absl::StatusCode::kNotFound, {"not found"}));
  EXPECT_TRUE(IsError(StatusOf(fetch(CountersRequest(att.id(), {}))), absl::StatusCode::kNotFound,
                      {"not found"}));
  EXPECT_TRUE(IsError(StatusOf(fetch(CountersRequest(att.id(), {"sess-1-00000000000000000000"}))),
                      absl::StatusCode::kNotFound, {"not found"}));
  {
    std::unique_ptr<Client> other = Connect(daemon_->address(), /*worker_session=*/true);
    ASSERT_NE(other, nullptr);
    ASSERT_TRUE(other->OpenSession().ok());
    EXPECT_TRUE(IsError(StatusOf(LayerProgress::Open(*other, att)), absl::StatusCode::kNotFound,
                        {"not found"}));
    v1::HandoffRequest with_token = CountersRequest(att.id(), other->session_ids());
    with_token.set_owner_token("not-the-pools-token");  // "p" has no owner token at all
    EXPECT_TRUE(IsError(StatusOf(fetch(with_token)), absl::StatusCode::kNotFound, {"not found"}));
  }
  // The owner, with its session among others.
  std::vector<std::string> several = {"sess-1-00000000000000000000"};
  several.insert(several.end(), mine.begin(), mine.end());
  absl::StatusOr<Handoff> ok = fetch(CountersRequest(att.id(), several));
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->count, 2u);
  EXPECT_EQ(ok->bytes, 16u);
  // What was logged shows no capability whole.
  EXPECT_TRUE(LogShows(*daemon_, "handoff: layer counters of")) << daemon_->Log();
  EXPECT_FALSE(absl::StrContains(daemon_->Log(), att.id()));
}

TEST_F(LayerProgressTest, TheHandoffRefusesBadRequestsAndSilenceWithoutStalling) {
  const v1::Attachment att = AttachWithProgress(1);
  const std::string path = handoff_path();
  // Not a HandoffRequest.
  v1::HandoffReply garbage = RawExchange(path, std::string("\xff\xff\xff\xff garbage", 13));
  EXPECT_EQ(garbage.code(), static_cast<int>(absl::StatusCode::kInvalidArgument))
      << garbage.DebugString();
  // Over the limit, although otherwise well formed.
  v1::HandoffRequest big = CountersRequest(att.id(), client().session_ids());
  big.set_owner_token(std::string(5000, 't'));
  v1::HandoffReply oversized = RawExchange(path, big.SerializeAsString());
  EXPECT_EQ(oversized.code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_TRUE(absl::StrContains(oversized.message(), "4096")) << oversized.message();
  // No kind.
  v1::HandoffRequest no_kind = CountersRequest(att.id(), client().session_ids());
  no_kind.clear_kind();
  v1::HandoffReply kindless = RawExchange(path, no_kind.SerializeAsString());
  EXPECT_EQ(kindless.code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_TRUE(absl::StrContains(kindless.message(), "kind")) << kindless.message();
  // An unknown kind.
  v1::HandoffRequest future = CountersRequest(att.id(), client().session_ids());
  future.set_kind(static_cast<v1::HandoffKind>(77));
  EXPECT_EQ(RawExchange(path, future.SerializeAsString()).code(),
            static_cast<int>(absl::StatusCode::kInvalidArgument));
  // A client that connects and says nothing is dropped after the request
  // timeout (kHandoffRequestTimeout, 100 ms), with a refusal and no
  // descriptor; meanwhile others are served at once
  // (handoff_integration_test holds hundreds of silent ones).
  const absl::Time start = absl::Now();
  std::thread silent_client([&] {
    v1::HandoffReply silent = RawExchange(path, "", /*send=*/false, absl::Seconds(10));
    EXPECT_EQ(silent.code(), static_cast<int>(absl::StatusCode::kDeadlineExceeded))
        << silent.DebugString();
    EXPECT_GE(absl::Now() - start, absl::Milliseconds(90));
    EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  });
  absl::SleepFor(absl::Milliseconds(20));  // the silent one connects first
  for (int n = 0; n < 3; ++n) {
    absl::StatusOr<std::unique_ptr<LayerProgress>> progress = LayerProgress::Open(client(), att);
    EXPECT_TRUE(progress.ok()) << progress.status();
  }
  silent_client.join();
  // The refusals are logged with the peer's credentials.
  EXPECT_TRUE(LogShows(*daemon_, absl::StrCat("handoff refused to pid ", getpid())))
      << daemon_->Log();
}

TEST_F(LayerProgressTest, TheDescriptorIsReadOnly) {
  const v1::Attachment att = AttachWithProgress(4);
  absl::StatusOr<Handoff> h =
      FetchHandoff(handoff_path(), CountersRequest(att.id(), client().session_ids()), kWait);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->count, 4u);
  EXPECT_EQ(::fcntl(h->fd(), F_GETFL) & O_ACCMODE, O_RDONLY);
  errno = 0;
  EXPECT_EQ(::mmap(nullptr, h->bytes, PROT_READ | PROT_WRITE, MAP_SHARED, h->fd(), 0), MAP_FAILED);
  EXPECT_EQ(errno, EACCES);
  EXPECT_NE(::ftruncate(h->fd(), 0), 0);
  EXPECT_NE(::ftruncate(h->fd(), 1 << 20), 0);
  const char byte = 7;
  EXPECT_LT(::pwrite(h->fd(), &byte, 1, 0), 0);
  struct stat st {};
  ASSERT_EQ(::fstat(h->fd(), &st), 0);
  EXPECT_EQ(static_cast<uint64_t>(st.st_size), h->bytes);
  // Still counts what the daemon publishes after a load.
  void* view = ::mmap(nullptr, h->bytes, PROT_READ, MAP_SHARED, h->fd(), 0);
  ASSERT_NE(view, MAP_FAILED);
  absl::StatusOr<LoadTicket> load = client().LoadWithEvents(att.id(), Range(0, 16), Range(0, 16));
  ASSERT_TRUE(load.ok()) << load.status();
  ASSERT_TRUE(client().WaitTransfer(load->ticket_id, kWait).ok());
  EXPECT_EQ(static_cast<const uint64_t*>(view)[load->event_set], kLayers);
  ::munmap(view, h->bytes);
}

TEST_F(LayerProgressTest, TheSocketFileHasTheGrpcSocketsModeAndGoesAtShutdown) {
  const std::string grpc = daemon_->address().substr(std::strlen("unix://"));
  struct stat handoff {
  }, main{};
  ASSERT_EQ(::stat(handoff_path().c_str(), &handoff), 0) << handoff_path();
  ASSERT_EQ(::stat(grpc.c_str(), &main), 0);
  EXPECT_TRUE(S_ISSOCK(handoff.st_mode));
  EXPECT_EQ(handoff.st_mode & 07777, 0660u);  // --socket-mode's default
  EXPECT_EQ(handoff.st_mode & 07777, main.st_mode & 07777);
  EXPECT_EQ(handoff.st_gid, main.st_gid);
  EXPECT_TRUE(absl::StrContains(daemon_->Log(), absl::StrCat("socket ", handoff_path())));
  EXPECT_EQ(daemon_->Stop(), 0);
  EXPECT_NE(::access(handoff_path().c_str(), F_OK), 0) << "left after shutdown";
}

TEST_F(LayerProgressTest, TheSocketModeFlagAppliesToTheHandoffSocket) {
  StartDaemon({"--socket-mode=0600"});
  struct stat st {};
  ASSERT_EQ(::stat(handoff_path().c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0600u);
}

TEST_F(LayerProgressTest, HandoffSocketFlagMovesOrDisablesIt) {
  const std::string dir = absl::StrCat(daemon_->shm_dir(), "-handoff");
  const std::string moved = absl::StrCat(dir, "/h.sock");
  StartDaemon({absl::StrCat("--handoff-socket=", moved)});
  const v1::Attachment att = AttachWithProgress(1);
  EXPECT_EQ(att.handoff_socket(), moved);
  EXPECT_TRUE(LayerProgress::Open(client(), att).ok());
  EXPECT_NE(::access(handoff_path().c_str(), F_OK), 0) << "the default socket exists too";
  EXPECT_EQ(daemon_->Stop(), 0);
  EXPECT_NE(::access(moved.c_str(), F_OK), 0) << "left after shutdown";
  ::rmdir(dir.c_str());

  StartDaemon({"--handoff-socket="});
  AttachOptions options;
  options.layer_progress = true;
  EXPECT_TRUE(IsError(StatusOf(client().AttachDevice(dev_->MakeAttachRequest("p", options))),
                      absl::StatusCode::kFailedPrecondition, {"handoff socket"}));
  EXPECT_NE(::access(handoff_path().c_str(), F_OK), 0);
  absl::StatusOr<v1::Pool> p = client().GetPool("p");
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->attachments(), 0u) << "a refused attach left an attachment";
  // Without the opt-in, attaching works as ever.
  EXPECT_TRUE(client().AttachDevice(dev_->MakeAttachRequest("p")).ok());
}

TEST_F(LayerProgressTest, ARelativeHandoffSocketIsRefusedAtStart) {
  daemon_.reset();
  absl::StatusOr<std::unique_ptr<TestDaemon>> d =
      TestDaemon::Start(KVHOSTD_PATH, {"--handoff-socket=relative.sock"});
  EXPECT_TRUE(IsError(d.status(), absl::StatusCode::kUnavailable,
                      {"--handoff-socket 'relative.sock'", "absolute"}));
}

}  // namespace
}  // namespace kvhost
