// Runs the C checks of tests/c_api_gpu_test.c, one TEST each, on GPU 0
// against a kvhostd of their own with --backend=cuda --worker-copy; skipped
// where there is no usable CUDA GPU. Like c_api_test_driver.cc it links
// libkvhost_c.so and not kvhost::client (one copy of the proto code per
// process), so it starts kvhostd itself, with the daemon's output going to
// a log file the failure message shows.
#include <cuda_runtime_api.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "c_api_test.h"
#include "daemon_fixture.h"
#include "gtest/gtest.h"

namespace kvhost {
namespace {

class CApiGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int count = 0;
    const cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess || count == 0) {
      GTEST_SKIP() << "no usable CUDA GPU: "
                   << (e != cudaSuccess ? cudaGetErrorString(e) : "cudaGetDeviceCount is 0");
    }
    char dir[] = "/tmp/kvhost-c-api-gpu-XXXXXX";
    ASSERT_NE(::mkdtemp(dir), nullptr);
    dir_ = dir;
    char shm[] = "/dev/shm/kvhost-c-api-gpu-XXXXXX";
    ASSERT_NE(::mkdtemp(shm), nullptr);
    shm_dir_ = shm;
    socket_ = dir_ + "/kvhost.sock";
    address_ = "unix://" + socket_;
    pid_ = ::fork();
    ASSERT_GE(pid_, 0);
    if (pid_ == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGTERM);
      FILE* log = std::freopen(Log().c_str(), "w", stderr);
      (void)log;
      ::dup2(2, 1);
      // $KVHOST_KVHOSTD: a bundle's daemon (scripts/gpu_run.sh), elsewhere
      // than where it was built.
      const char* env = std::getenv("KVHOST_KVHOSTD");
      const std::string kvhostd = env != nullptr && *env != '\0' ? env : KVHOSTD_PATH;
      std::vector<std::string> args = {kvhostd, "--listen=" + address_, "--shm-dir=" + shm_dir_,
                                       "--backend=cuda", "--worker-copy"};
      std::vector<char*> argv;
      for (std::string& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      ::execv(argv[0], argv.data());
      ::_exit(127);
    }
    for (int i = 0; i < 3000 && !std::filesystem::exists(socket_); ++i) {
      absl::SleepFor(absl::Milliseconds(10));
    }
  }

  void TearDown() override {
    if (pid_ > 0) {
      EXPECT_EQ(testing::StopKvhostd(pid_), 0) << testing::ReadFile(Log());
    }
    std::error_code ec;
    if (!dir_.empty()) std::filesystem::remove_all(dir_, ec);
    if (!shm_dir_.empty()) std::filesystem::remove_all(shm_dir_, ec);
  }

  std::string Log() const { return dir_ + "/kvhostd.log"; }

  void Check(int (*check)(const c_api_test_env*, char*, size_t)) {
    ASSERT_TRUE(std::filesystem::exists(socket_)) << "kvhostd did not listen\n"
                                                  << testing::ReadFile(Log());
    c_api_test_env env{address_.c_str(), shm_dir_.c_str(), nullptr, nullptr};
    char why[4096] = "";
    EXPECT_EQ(check(&env, why, sizeof(why)), 0) << why << "\n--- kvhostd log ---\n"
                                                << testing::ReadFile(Log());
  }

  std::string dir_, shm_dir_, socket_, address_;
  pid_t pid_ = -1;
};

TEST_F(CApiGpuTest, AttachBackupWithEventAndLoadWaitedPerLayer) {
  Check(c_api_gpu_test_attach_backup_load);
}
TEST_F(CApiGpuTest, WorkerCopiesOnTheCallersStreams) { Check(c_api_gpu_test_worker_copy); }
TEST_F(CApiGpuTest, HybridGroupFromCudaBuffersIsByteExact) { Check(c_api_gpu_test_group_attach); }

}  // namespace
}  // namespace kvhost
