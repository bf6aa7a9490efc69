// Runs the C checks of tests/c_api_test.c, one TEST each, against a kvhostd
// of their own (host backend, StartKvhostd on a private socket and shm
// directory). The binary links libkvhost_c.so and not kvhost::client: one
// process holds one copy of kvhost's generated protobuf code (kvhost_c.h),
// so the daemon is started without the C++ client, and the checks see it
// through the ABI only (kvhost_client_wait_ready). kvhostd logs to this
// test's output (StartKvhostd sends only its stderr to the log file).
#include <stdlib.h>
#include <unistd.h>

#include <filesystem>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "c_api_test.h"
#include "daemon_fixture.h"
#include "gtest/gtest.h"

namespace kvhost {
namespace {

class CApiTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char dir[] = "/tmp/kvhost-c-api-XXXXXX";
    ASSERT_NE(::mkdtemp(dir), nullptr);
    dir_ = dir;
    char shm[] = "/dev/shm/kvhost-c-api-XXXXXX";
    ASSERT_NE(::mkdtemp(shm), nullptr);
    shm_dir_ = shm;
    socket_ = dir_ + "/kvhost.sock";
    address_ = "unix://" + socket_;
    Start();
  }

  void TearDown() override {
    if (pid_ > 0) {
      EXPECT_EQ(testing::StopKvhostd(pid_), 0);
    }
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
    std::filesystem::remove_all(shm_dir_, ec);
  }

  // A kvhostd on socket_, once its socket exists (the checks wait for it
  // to serve through the ABI).
  void Start() {
    std::error_code ec;
    std::filesystem::remove(socket_, ec);
    pid_ = testing::StartKvhostd(socket_, shm_dir_, dir_ + "/kvhostd.log");
    for (int i = 0; i < 2000 && !std::filesystem::exists(socket_); ++i) {
      absl::SleepFor(absl::Milliseconds(10));
    }
  }

  static void Restart(void* arg) {
    auto* self = static_cast<CApiTest*>(arg);
    EXPECT_EQ(testing::StopKvhostd(self->pid_), 0);
    self->Start();
  }

  // Runs one check; its failure and the daemon's log otherwise.
  void Check(int (*check)(const c_api_test_env*, char*, size_t)) {
    ASSERT_TRUE(std::filesystem::exists(socket_)) << "kvhostd did not listen on " << socket_;
    c_api_test_env env{address_.c_str(), shm_dir_.c_str(), &CApiTest::Restart, this};
    char why[4096] = "";
    EXPECT_EQ(check(&env, why, sizeof(why)), 0) << why;
  }

  std::string dir_, shm_dir_, socket_, address_;
  pid_t pid_ = -1;
};

TEST_F(CApiTest, LibraryCallsAndTheBufferConvention) { Check(c_api_test_library_and_buffers); }
TEST_F(CApiTest, ClientOptionsAndConnect) { Check(c_api_test_options_and_connect); }
TEST_F(CApiTest, PoolsFromJsonSpecsAndTheirErrors) { Check(c_api_test_pools); }
TEST_F(CApiTest, AllocFreeAndPagesIntoCallerBuffers) { Check(c_api_test_alloc_free_pages); }
TEST_F(CApiTest, Groups) { Check(c_api_test_groups); }
TEST_F(CApiTest, ShmBackupAndLoadAreByteExact) { Check(c_api_test_shm_backup_load); }
TEST_F(CApiTest, GroupBackupAndLoadAreByteExact) { Check(c_api_test_group_backup_load); }
TEST_F(CApiTest, PageStreamsIntoCallerBuffers) { Check(c_api_test_page_streams); }
TEST_F(CApiTest, AllocBatchIntoCallerBuffers) { Check(c_api_test_alloc_batch); }
TEST_F(CApiTest, AllocBackupIsByteExactAndRefusalsFreeAll) { Check(c_api_test_alloc_backup); }
TEST_F(CApiTest, PerLayerWaitsOnTheLayerCounters) { Check(c_api_test_layer_waits); }
TEST_F(CApiTest, CudaCallsAnswerClearlyWithoutAGpu) { Check(c_api_test_cuda_calls); }
TEST_F(CApiTest, GroupCudaAttachAnswersClearlyWithoutAGpu) { Check(c_api_test_group_cuda_calls); }
TEST_F(CApiTest, SessionLossAcrossADaemonRestart) { Check(c_api_test_session_loss); }
TEST_F(CApiTest, NodeCacheSharedByTwoInstancesByteExact) { Check(c_api_test_cache_store_restore); }
TEST_F(CApiTest, NodeCacheRefusalsAreNamedAndChangeNothing) { Check(c_api_test_cache_refusals); }
TEST_F(CApiTest, NodeCacheStoresFromAndRestoresToPoolsByteExact) { Check(c_api_test_cache_pools); }
TEST_F(CApiTest, AsyncCallsInOrderWithTheSyncCallsErrors) { Check(c_api_test_async_calls); }
TEST_F(CApiTest, AsyncBackupAndLoadAreByteExact) { Check(c_api_test_async_shm_backup_load); }
TEST_F(CApiTest, AsyncBoundAndDestroyWithRequestsQueued) {
  Check(c_api_test_async_bound_and_destroy);
}

}  // namespace
}  // namespace kvhost
