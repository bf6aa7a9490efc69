// Worker copies through a real kvhostd (host backend, no GPU): without
// --worker-copy, Backup / Load with worker_copy and the pool-regions handoff
// are FAILED_PRECONDITION naming the flag, and GetStatus says it is off;
// with it, the host backend refuses them too (naming the cuda backend) and
// hands out no handoff socket for them; FinishWorkerCopy refuses unknown
// and other sessions' tickets as NOT_FOUND and the daemon's own tickets as
// FAILED_PRECONDITION; a stranger's pool-regions request is NOT_FOUND; no
// refusal leaves a ticket, and the daemon serves on. The accepted path (a
// worker copy run by kvhost::WorkerCopier) needs a GPU:
// tests/worker_copy_gpu_test.cc; the manager's side of it is in
// tests/worker_copy_test.cc.
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
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

class WorkerCopyIntegrationTest : public ::testing::Test {
 protected:
  void Start(std::vector<std::string> flags) {
    absl::StatusOr<std::unique_ptr<TestDaemon>> d = TestDaemon::Start(KVHOSTD_PATH, flags);
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = *std::move(d);
    absl::StatusOr<v1::Pool> pool =
        client().CreatePool("p", MakeSpec(v1::MHA, v1::PAGE_FIRST, 4, 64));
    ASSERT_TRUE(pool.ok()) << pool.status();
    ASSERT_TRUE(client().Alloc("p", 16).ok());
    absl::StatusOr<std::unique_ptr<ShmDevicePool>> dev =
        ShmDevicePool::Create(*pool, 64, daemon_->shm_dir());
    ASSERT_TRUE(dev.ok()) << dev.status();
    dev_ = *std::move(dev);
    absl::StatusOr<v1::Attachment> att = client().AttachDevice(dev_->MakeAttachRequest("p"));
    ASSERT_TRUE(att.ok()) << att.status();
    att_ = *att;
  }
  void TearDown() override {
    if (daemon_ != nullptr && HasFailure()) {
      std::string log = daemon_->Log();
      if (log.size() > 6000) log = "..." + log.substr(log.size() - 6000);
      std::fprintf(stderr, "--- kvhostd log (tail) ---\n%s\n", log.c_str());
    }
  }

  Client& client() { return daemon_->client(); }
  std::string handoff_path() const {
    return absl::StrCat(daemon_->address().substr(std::strlen("unix://")), ".fds");
  }
  absl::StatusOr<Handoff> FetchRegions(const std::vector<std::string>& sessions,
                                       v1::HandoffKind kind = v1::HANDOFF_KIND_POOL_REGIONS) {
    v1::HandoffRequest request;
    request.set_attachment_id(att_.id());
    request.set_kind(kind);
    for (const std::string& s : sessions) request.add_session_ids(s);
    return FetchHandoff(handoff_path(), request, kWait);
  }
  absl::Status WorkerBackup(std::vector<int64_t> host, std::vector<int64_t> device,
                            const std::string& wait_event = "") {
    v1::BackupRequest request;
    request.set_attachment_id(att_.id());
    request.mutable_host_indices()->Add(host.begin(), host.end());
    request.mutable_device_indices()->Add(device.begin(), device.end());
    request.set_wait_event_handle(wait_event);
    request.set_worker_copy(true);
    return client().SubmitBackup(request).status();
  }
  absl::Status WorkerLoad(std::vector<int64_t> host, std::vector<int64_t> device) {
    v1::LoadRequest request;
    request.set_attachment_id(att_.id());
    request.mutable_host_indices()->Add(host.begin(), host.end());
    request.mutable_device_indices()->Add(device.begin(), device.end());
    request.set_worker_copy(true);
    return client().SubmitLoad(request).status();
  }
  uint64_t Tickets() {
    absl::StatusOr<v1::DaemonStatus> s = client().GetStatus();
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? s->tickets_in_flight() + s->tickets_done() + s->tickets_failed() : 0;
  }
  // The daemon's own copies still work, and FinishWorkerCopy refuses their
  // tickets; a stranger's view of one is NOT_FOUND.
  void ExpectServingAndFinishRefused() {
    absl::StatusOr<uint64_t> own = client().Backup(att_.id(), Range(0, 16), Range(0, 16));
    ASSERT_TRUE(own.ok()) << own.status();
    ASSERT_TRUE(client().WaitTransfer(*own, kWait).ok());
    EXPECT_TRUE(IsError(client().FinishWorkerCopy(*own), absl::StatusCode::kFailedPrecondition,
                        {"ticket"}));
    ClientOptions options;
    options.address = daemon_->address();
    absl::StatusOr<std::unique_ptr<Client>> other = Client::Connect(options);
    ASSERT_TRUE(other.ok()) << other.status();
    ASSERT_TRUE((*other)->OpenSession().ok());
    EXPECT_TRUE(
        IsError((*other)->FinishWorkerCopy(*own), absl::StatusCode::kNotFound, {"unknown"}));
    EXPECT_TRUE(IsError(client().FinishWorkerCopy(*own ^ 1, "x"), absl::StatusCode::kNotFound,
                        {"unknown"}));
  }

  std::unique_ptr<TestDaemon> daemon_;
  std::unique_ptr<ShmDevicePool> dev_;
  v1::Attachment att_;
};

TEST_F(WorkerCopyIntegrationTest, WithoutTheFlagEverythingIsRefused) {
  ASSERT_NO_FATAL_FAILURE(Start({}));
  absl::StatusOr<v1::DaemonStatus> status = client().GetStatus();
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_FALSE(status->worker_copy());
  EXPECT_EQ(att_.handoff_socket(), handoff_path());  // for the caller's own map
  const uint64_t before = Tickets();
  EXPECT_TRUE(IsError(WorkerBackup(Range(0, 16), Range(0, 16)),
                      absl::StatusCode::kFailedPrecondition, {"--worker-copy"}));
  EXPECT_TRUE(IsError(WorkerLoad(Range(0, 16), Range(0, 16)), absl::StatusCode::kFailedPrecondition,
                      {"--worker-copy"}));
  EXPECT_TRUE(IsError(StatusOf(FetchRegions(client().session_ids())),
                      absl::StatusCode::kFailedPrecondition, {"--worker-copy"}));
  EXPECT_TRUE(IsError(StatusOf(FetchRegions({})), absl::StatusCode::kNotFound, {"not found"}));
  EXPECT_EQ(Tickets(), before);
  ExpectServingAndFinishRefused();
}

TEST_F(WorkerCopyIntegrationTest, TheHostBackendRefusesThemWithTheFlag) {
  ASSERT_NO_FATAL_FAILURE(Start({"--worker-copy"}));
  absl::StatusOr<v1::DaemonStatus> status = client().GetStatus();
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_TRUE(status->worker_copy());
  EXPECT_EQ(att_.handoff_socket(), handoff_path());  // for the caller's own map
  const uint64_t before = Tickets();
  EXPECT_TRUE(IsError(WorkerBackup(Range(0, 16), Range(0, 16)),
                      absl::StatusCode::kFailedPrecondition, {"cuda backend"}));
  EXPECT_TRUE(IsError(WorkerLoad(Range(0, 16), Range(0, 16)), absl::StatusCode::kFailedPrecondition,
                      {"cuda backend"}));
  EXPECT_TRUE(IsError(WorkerBackup(Range(0, 16), Range(0, 16), std::string(64, 'e')),
                      absl::StatusCode::kInvalidArgument, {"wait_event_handle"}));
  EXPECT_TRUE(IsError(StatusOf(FetchRegions(client().session_ids())),
                      absl::StatusCode::kFailedPrecondition, {"cuda backend"}));
  EXPECT_TRUE(
      IsError(StatusOf(FetchRegions({"ses-1-0123"})), absl::StatusCode::kNotFound, {"not found"}));
  EXPECT_EQ(Tickets(), before);
  ExpectServingAndFinishRefused();
}

// The caller's own view of its pool (HANDOFF_KIND_POOL_MAP: kvhost.sglang's
// zero-copy host buffers) needs neither --worker-copy nor the cuda backend:
// the descriptors map the pool's own bytes, read-write, and only the
// attachment's session gets them.
TEST_F(WorkerCopyIntegrationTest, TheCallersOwnMapNeedsNoFlagAndWritesThePool) {
  ASSERT_NO_FATAL_FAILURE(Start({}));
  absl::StatusOr<Handoff> map = FetchRegions(client().session_ids(), v1::HANDOFF_KIND_POOL_MAP);
  ASSERT_TRUE(map.ok()) << map.status();
  ASSERT_EQ(map->fds.size(), static_cast<size_t>(map->pool_regions.region_bytes_size()));
  absl::StatusOr<v1::PageBufferMeta> meta = client().GetPageBufferMeta("p", Range(4, 8));
  ASSERT_TRUE(meta.ok()) << meta.status();
  ASSERT_GT(meta->segments_size(), 0);
  const v1::RegionRange& seg = meta->segments(0);
  const uint64_t region_bytes =
      map->pool_regions.region_bytes(static_cast<int>(seg.region_index()));
  void* base = ::mmap(nullptr, region_bytes, PROT_READ | PROT_WRITE, MAP_SHARED,
                      map->fds[seg.region_index()].get(), 0);
  map->fds.clear();  // the mapping keeps the files
  ASSERT_NE(base, MAP_FAILED) << std::strerror(errno);
  std::memset(static_cast<char*>(base) + seg.offset(), 0x5a, seg.length());
  ::munmap(base, region_bytes);
  absl::StatusOr<std::string> page = client().GetDataPage("p", 4);
  ASSERT_TRUE(page.ok()) << page.status();
  EXPECT_EQ(page->substr(0, seg.length()), std::string(seg.length(), '\x5a'));
  // Another client's credentials: the attachment is not found for it.
  EXPECT_TRUE(IsError(StatusOf(FetchRegions({"ses-1-0123"}, v1::HANDOFF_KIND_POOL_MAP)),
                      absl::StatusCode::kNotFound, {"not found"}));
  EXPECT_TRUE(IsError(StatusOf(FetchRegions({}, v1::HANDOFF_KIND_POOL_MAP)),
                      absl::StatusCode::kNotFound, {"not found"}));
}

}  // namespace
}  // namespace kvhost
