// pool_lifecycle_integration_test: creating and deleting
// multi-GiB pools never stalls the daemon. While a 3 GiB pool is created and
// deleted, a prober opens a fresh connection every 50 ms and calls
// Health/Check with a 1 s deadline: none may fail. During the create,
// ListPools shows the pool CREATING with growing progress, the metrics show
// kvhost_pool_state creating (and no usage figures), and Alloc on it is
// FAILED_PRECONDITION; a delete followed at once by a create of the same name
// works; SIGTERM during a create exits 0 quickly and leaves no region file.
// The figures (create vs fallocate of the same size, delete, probes, SIGTERM)
// are printed for docs/PERF.md.
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "daemon_fixture.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "gtest/gtest.h"
#include "kvhost/client.h"
#include "kvhost/v1/pool.grpc.pb.h"
#include "metrics_test_util.h"
#include "time_scale.h"

namespace kvhost {
namespace {

using testing::TestDaemon;
using Clock = std::chrono::steady_clock;

constexpr uint64_t kGiB = uint64_t{1} << 30;
// Big enough to take seconds on the 2-core CI VM, small enough for 24 GB.
constexpr uint64_t kBigBytes = 3 * kGiB;

double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// MHA bf16 of `bytes` host bytes.
v1::PoolSpec Spec(uint64_t bytes) {
  v1::PoolSpec s;
  s.set_kind(v1::MHA);
  s.set_layout(v1::PAGE_FIRST);
  s.set_dtype(v1::BF16);
  s.set_page_size(16);
  s.set_layer_num(4);
  s.set_head_num(8);
  s.set_head_dim(128);
  s.set_size_bytes(bytes);
  return s;
}

std::unique_ptr<TestDaemon> Start() {
  absl::StatusOr<std::unique_ptr<TestDaemon>> d = TestDaemon::Start(
      KVHOSTD_PATH, {"--memory-reserve=0", "--log-level=info", "--metrics-listen=127.0.0.1:0"});
  EXPECT_TRUE(d.ok()) << d.status();
  return d.ok() ? *std::move(d) : nullptr;
}

std::unique_ptr<v1::PoolService::Stub> Stub(const TestDaemon& d) {
  return v1::PoolService::NewStub(
      grpc::CreateChannel(d.address(), grpc::InsecureChannelCredentials()));
}

// Health/Check every 50 ms, each on a connection of its own (a local
// subchannel pool: no connection is shared), deadline 1 s (kTimeScale s
// sanitized).
class Prober {
 public:
  explicit Prober(std::string address) : address_(std::move(address)) {
    thread_ = std::thread([this] { Run(); });
  }
  ~Prober() { StopNow(); }
  void StopNow() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
  }
  int probes() const { return probes_; }
  int failures() const { return failures_; }
  double slowest_s() const { return slowest_us_ / 1e6; }
  std::string first_failure() {
    absl::MutexLock lock(&mu_);
    return first_failure_;
  }

 private:
  void Run() {
    while (!stop_) {
      const auto start = Clock::now();
      grpc::ChannelArguments args;
      args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
      auto channel = grpc::CreateCustomChannel(address_, grpc::InsecureChannelCredentials(), args);
      auto stub = grpc::health::v1::Health::NewStub(channel);
      grpc::ClientContext context;
      context.set_deadline(std::chrono::system_clock::now() +
                           std::chrono::seconds(1 * testing::kTimeScale));
      context.set_wait_for_ready(true);
      grpc::health::v1::HealthCheckRequest request;
      grpc::health::v1::HealthCheckResponse response;
      const grpc::Status s = stub->Check(&context, request, &response);
      ++probes_;
      const bool ok = s.ok() && response.status() == grpc::health::v1::HealthCheckResponse::SERVING;
      if (!ok) {
        ++failures_;
        absl::MutexLock lock(&mu_);
        if (first_failure_.empty()) {
          first_failure_ = absl::StrCat(s.error_code(), ": ", s.error_message(), " (status ",
                                        response.status(), ")");
        }
      }
      const int64_t us =
          std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - start).count();
      if (us > slowest_us_) slowest_us_ = us;
      std::this_thread::sleep_until(start + std::chrono::milliseconds(50));
    }
  }

  const std::string address_;
  std::atomic<bool> stop_{false};
  std::atomic<int> probes_{0}, failures_{0};
  std::atomic<int64_t> slowest_us_{0};
  absl::Mutex mu_;
  std::string first_failure_;
  std::thread thread_;
};

// Seconds posix_fallocate takes for `bytes` in `dir` (the file removed).
double FallocateSeconds(const std::string& dir, uint64_t bytes) {
  const std::string path = dir + "/fallocate-reference";
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  if (fd < 0) return -1;
  const auto start = Clock::now();
  const int err = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  const double s = Since(start);
  ::unlink(path.c_str());
  ::close(fd);
  return err == 0 ? s : -1;
}

bool HasRegionFiles(const std::string& dir) {
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    if (e.path().filename().string().rfind("kvhost.", 0) == 0) return true;
  }
  return false;
}

TEST(PoolLifecycleTest, BigCreateAndDeleteNeverStallNewConnections) {
  std::unique_ptr<TestDaemon> d = Start();
  ASSERT_NE(d, nullptr);
  auto stub = Stub(*d);
  const double fallocate_s = FallocateSeconds(d->shm_dir(), kBigBytes);
  ASSERT_GT(fallocate_s, 0);

  Prober create_probe(d->address());
  std::atomic<bool> create_done{false};
  grpc::Status create_status;
  v1::Pool created;
  const auto create_start = Clock::now();
  double create_s = 0;
  std::thread creator([&] {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
    v1::CreatePoolRequest request;
    request.set_name("big");
    *request.mutable_spec() = Spec(kBigBytes);
    create_status = stub->CreatePool(&context, request, &created);
    create_s = Since(create_start);
    create_done = true;
  });
  // ListPools shows it CREATING, its progress growing; Alloc is refused.
  std::vector<uint64_t> progress;
  bool alloc_checked = false;
  while (!create_done) {
    grpc::ClientContext context;
    v1::ListPoolsResponse list;
    ASSERT_TRUE(stub->ListPools(&context, v1::ListPoolsRequest(), &list).ok());
    for (const v1::Pool& p : list.pools()) {
      if (p.name() != "big" || p.state() != v1::CREATING) continue;
      EXPECT_EQ(p.bytes(), kBigBytes);
      if (progress.empty() || p.populated_bytes() != progress.back()) {
        progress.push_back(p.populated_bytes());
      }
      if (!alloc_checked) {
        const testing::Scrape m = testing::ScrapeMetrics(testing::MetricsPort(*d));
        EXPECT_EQ(testing::SeriesValue(m, R"(kvhost_pool_state{pool="big",state="creating"})"), 1);
        EXPECT_EQ(testing::SeriesValue(m, R"(kvhost_pool_state{pool="big",state="ready"})"), 0);
        EXPECT_EQ(m.count(R"(kvhost_pool_used_tokens{pool="big"})"), 0u)
            << "a pool being created has no usage";
        grpc::ClientContext alloc_context;
        v1::AllocRequest alloc;
        alloc.set_pool("big");
        alloc.set_num_tokens(16);
        v1::AllocResponse slots;
        const grpc::Status s = stub->Alloc(&alloc_context, alloc, &slots);
        EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << s.error_message();
        EXPECT_NE(s.error_message().find("still being created"), std::string::npos)
            << s.error_message();
        alloc_checked = true;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  creator.join();
  create_probe.StopNow();
  ASSERT_TRUE(create_status.ok()) << create_status.error_message();
  EXPECT_EQ(created.state(), v1::READY);
  EXPECT_EQ(created.populated_bytes(), created.bytes());
  EXPECT_TRUE(alloc_checked) << "never saw the pool CREATING";
  const testing::Scrape m = testing::ScrapeMetrics(testing::MetricsPort(*d));
  EXPECT_EQ(testing::SeriesValue(m, R"(kvhost_pool_state{pool="big",state="ready"})"), 1);
  EXPECT_EQ(testing::SeriesValue(m, R"(kvhost_pool_state{pool="big",state="creating"})"), 0);
  EXPECT_GE(progress.size(), 2u) << "progress did not grow";
  for (size_t i = 1; i < progress.size(); ++i) EXPECT_GT(progress[i], progress[i - 1]);

  Prober delete_probe(d->address());
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const auto delete_start = Clock::now();
  {
    grpc::ClientContext context;
    v1::DeletePoolRequest request;
    request.set_name("big");
    v1::DeletePoolResponse response;
    ASSERT_TRUE(stub->DeletePool(&context, request, &response).ok());
  }
  const double delete_call_s = Since(delete_start);
  // The name is free at once: the same name again.
  {
    grpc::ClientContext context;
    v1::CreatePoolRequest request;
    request.set_name("big");
    *request.mutable_spec() = Spec(64 << 20);
    v1::Pool again;
    const grpc::Status s = stub->CreatePool(&context, request, &again);
    EXPECT_TRUE(s.ok()) << s.error_message();
  }
  // The memory goes in the background.
  double released_s = -1;
  for (int i = 0; i < 600; ++i) {
    absl::StatusOr<v1::DaemonStatus> status = d->client().GetStatus();
    ASSERT_TRUE(status.ok()) << status.status();
    if (status->pool_bytes_releasing() == 0) {
      released_s = Since(delete_start);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  delete_probe.StopNow();
  std::printf(
      "[figures] create %.2f GiB: %.2f s, fallocate of the same size %.2f s (ratio %.2f); "
      "delete call %.3f s, memory released after %.2f s\n",
      static_cast<double>(kBigBytes) / kGiB, create_s, fallocate_s, create_s / fallocate_s,
      delete_call_s, released_s);
  std::printf(
      "[figures] health probes on fresh connections: during create %d probes, %d failed "
      "(slowest %.3f s); during delete %d probes, %d failed (slowest %.3f s)\n",
      create_probe.probes(), create_probe.failures(), create_probe.slowest_s(),
      delete_probe.probes(), delete_probe.failures(), delete_probe.slowest_s());
  EXPECT_GE(released_s, 0) << "the deleted pool's bytes were never released";
  EXPECT_LT(delete_call_s, 1.0 * testing::kTimeScale);
  EXPECT_GT(create_probe.probes(), 5);
  EXPECT_EQ(create_probe.failures(), 0) << create_probe.first_failure();
  EXPECT_GT(delete_probe.probes(), 3);
  EXPECT_EQ(delete_probe.failures(), 0) << delete_probe.first_failure();
}

TEST(PoolLifecycleTest, SigtermDuringCreateExitsCleanlyWithoutRegionFiles) {
  std::unique_ptr<TestDaemon> d = Start();
  ASSERT_NE(d, nullptr);
  auto stub = Stub(*d);
  grpc::Status create_status;
  std::thread creator([&] {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    v1::CreatePoolRequest request;
    request.set_name("big");
    *request.mutable_spec() = Spec(kBigBytes);
    v1::Pool created;
    create_status = stub->CreatePool(&context, request, &created);
  });
  bool seen = false;
  for (int i = 0; i < 400 && !seen; ++i) {
    absl::StatusOr<v1::Pool> p = d->client().GetPool("big");
    seen = p.ok() && p->state() == v1::CREATING && p->populated_bytes() > 0;
    if (!seen) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_TRUE(seen) << "never saw the pool CREATING";
  const auto start = Clock::now();
  const int code = d->Stop(SIGTERM);
  const double stop_s = Since(start);
  creator.join();
  std::printf("[figures] SIGTERM during a %.2f GiB create: exit %d after %.2f s (create: %d %s)\n",
              static_cast<double>(kBigBytes) / kGiB, code, stop_s, create_status.error_code(),
              create_status.error_message().c_str());
  EXPECT_EQ(code, 0);
  EXPECT_LT(stop_s, 5.0);
  EXPECT_FALSE(create_status.ok());
  EXPECT_FALSE(HasRegionFiles(d->shm_dir()));
}

TEST(PoolLifecycleTest, SigtermWithABigPoolReleasesIt) {
  std::unique_ptr<TestDaemon> d = Start();
  ASSERT_NE(d, nullptr);
  auto stub = Stub(*d);
  {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
    v1::CreatePoolRequest request;
    request.set_name("big");
    *request.mutable_spec() = Spec(kBigBytes);
    v1::Pool created;
    const grpc::Status s = stub->CreatePool(&context, request, &created);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  const auto start = Clock::now();
  const int code = d->Stop(SIGTERM);
  const double stop_s = Since(start);
  std::printf("[figures] SIGTERM with a ready %.2f GiB pool: exit %d after %.2f s\n",
              static_cast<double>(kBigBytes) / kGiB, code, stop_s);
  EXPECT_EQ(code, 0);
  EXPECT_FALSE(HasRegionFiles(d->shm_dir()));
}

}  // namespace
}  // namespace kvhost
