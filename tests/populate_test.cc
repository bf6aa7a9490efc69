// populate_test: ReserveAndPopulate (chunks, progress, cancellation, the
// touch fallback, a full file system), ShmRegion::Create on top of it, the
// Releaser, and the registry's CREATING state (visible, its calls refused,
// then READY; cancelled creations leave nothing).
#include "server/pool/populate.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "domain_test_util.h"
#include "gtest/gtest.h"
#include "server/pool/registry.h"
#include "server/pool/releaser.h"
#include "server/pool/shm_region.h"
#include "tests/shm_dir.h"

namespace kvhost {
namespace {

using ::kvhost::testing::RoomyRegistryOptions;

constexpr uint64_t kMiB = uint64_t{1} << 20;

class PopulateTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_FALSE(dir_.path().empty()); }
  // An empty file in the test directory, mapped `bytes` long.
  void Open(uint64_t bytes) {
    fd_ = ::open((dir_.path() + "/f").c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    ASSERT_GE(fd_, 0);
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
    ASSERT_NE(p, MAP_FAILED);
    data_ = static_cast<uint8_t*>(p);
    bytes_ = bytes;
  }
  void TearDown() override {
    if (data_ != nullptr) ::munmap(data_, bytes_);
    if (fd_ >= 0) ::close(fd_);
  }
  uint64_t FileSize() const {
    struct stat st;
    return ::fstat(fd_, &st) == 0 ? static_cast<uint64_t>(st.st_size) : 0;
  }
  // Resident pages of the mapping, in bytes.
  uint64_t ResidentBytes() const {
    const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
    std::vector<unsigned char> vec((bytes_ + page - 1) / page);
    if (::mincore(data_, bytes_, vec.data()) != 0) return 0;
    uint64_t n = 0;
    for (unsigned char v : vec) n += (v & 1) ? page : 0;
    return n;
  }

  testing::ShmDir dir_{"kvhost-populate-test"};
  int fd_ = -1;
  uint8_t* data_ = nullptr;
  uint64_t bytes_ = 0;
};

TEST_F(PopulateTest, EveryChunkReservedMappedAndReported) {
  // 10.5 chunks: the last one is short.
  const uint64_t bytes = 10 * 4 * kMiB + 2 * kMiB;
  Open(bytes);
  absl::Mutex mu;
  std::vector<uint64_t> reported;
  PopulateOptions options;
  options.chunk_bytes = 4 * kMiB;
  options.threads = 3;
  options.on_progress = [&](uint64_t n) {
    absl::MutexLock lock(&mu);
    reported.push_back(n);
  };
  ASSERT_TRUE(ReserveAndPopulate(fd_, data_, bytes, "test file", options).ok());
  uint64_t sum = 0;
  int short_chunks = 0;
  for (uint64_t n : reported) {
    sum += n;
    if (n != 4 * kMiB) ++short_chunks;
  }
  EXPECT_EQ(reported.size(), 11u);
  EXPECT_EQ(short_chunks, 1);
  EXPECT_EQ(sum, bytes);
  EXPECT_EQ(FileSize(), bytes);
  EXPECT_EQ(ResidentBytes(), bytes);
  for (uint64_t off = 0; off < bytes; off += 4096) ASSERT_EQ(data_[off], 0) << off;
}

TEST_F(PopulateTest, TouchFallbackMapsEveryPage) {
  const uint64_t bytes = 8 * kMiB;
  Open(bytes);
  PopulateOptions options;
  options.chunk_bytes = kMiB;
  options.force_touch = true;
  ASSERT_TRUE(ReserveAndPopulate(fd_, data_, bytes, "test file", options).ok());
  EXPECT_EQ(ResidentBytes(), bytes);
}

TEST_F(PopulateTest, CancellationStopsBetweenChunks) {
  const uint64_t bytes = 64 * kMiB;
  Open(bytes);
  std::atomic<uint64_t> done{0};
  std::atomic<int> asked{0};
  PopulateOptions options;
  options.chunk_bytes = kMiB;
  options.threads = 1;
  options.on_progress = [&](uint64_t n) { done += n; };
  // Three chunks, then stop.
  options.cancelled = [&] { return asked++ >= 3; };
  absl::Status s = ReserveAndPopulate(fd_, data_, bytes, "test file", options);
  EXPECT_TRUE(absl::IsCancelled(s)) << s;
  EXPECT_EQ(done.load(), 3 * kMiB);
  EXPECT_EQ(FileSize(), 3 * kMiB);  // nothing past the chunks done was reserved
}

TEST(PopulateThreadsTest, NeverMoreThanChunks) {
  PopulateOptions options;
  options.chunk_bytes = kMiB;
  options.threads = 8;
  EXPECT_EQ(PopulateThreads(kMiB, options), 1);
  EXPECT_EQ(PopulateThreads(3 * kMiB, options), 3);
  EXPECT_EQ(PopulateThreads(100 * kMiB, options), 8);
  options.threads = 0;
  EXPECT_GE(PopulateThreads(100 * kMiB, options), 1);
  EXPECT_LE(PopulateThreads(100 * kMiB, options), kMaxPopulateThreads);
}

TEST(ShmRegionPopulateTest, CancelledCreateLeavesNoFile) {
  testing::ShmDir dir("kvhost-populate-test");
  ASSERT_FALSE(dir.path().empty());
  absl::StatusOr<DirFd> fd = DirFd::Open(dir.path(), "dir");
  ASSERT_TRUE(fd.ok());
  RegionFileOptions options;
  std::atomic<uint64_t> progress{0};
  options.on_progress = [&](uint64_t n) { progress += n; };
  options.cancelled = [&] { return progress.load() >= kPopulateChunkBytes; };
  absl::StatusOr<std::unique_ptr<ShmRegion>> region = ShmRegion::Create(
      std::make_shared<const DirFd>(*std::move(fd)), "r", 8 * kPopulateChunkBytes, options);
  EXPECT_TRUE(absl::IsCancelled(region.status())) << region.status();
  EXPECT_LT(progress.load(), 8 * kPopulateChunkBytes);
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
}

TEST(ReleaserTest, RunsOffTheCallerAndStopDrains) {
  Releaser releaser(2);
  const std::thread::id me = std::this_thread::get_id();
  std::atomic<int> ran{0}, elsewhere{0};
  for (int i = 0; i < 10; ++i) {
    releaser.Post([&] {
      ++ran;
      if (std::this_thread::get_id() != me) ++elsewhere;
    });
  }
  releaser.Stop();
  EXPECT_EQ(ran.load(), 10);
  EXPECT_EQ(elsewhere.load(), 10);
  EXPECT_EQ(releaser.pending(), 0u);
  releaser.Post([&] { ++ran; });  // inline once stopped
  EXPECT_EQ(ran.load(), 11);
}

// MHA of `bytes` host bytes.
PoolSpec MhaOfBytes(uint64_t bytes) {
  PoolSpec spec;
  spec.kind = PoolKind::kMha;
  spec.layout = LayoutKind::kPageFirst;
  spec.dtype = DType::kBf16;
  spec.page_size = 16;
  spec.layer_num = 2;
  spec.head_num = 2;
  spec.head_dim = 64;
  spec.size_bytes = bytes;
  return spec;
}

TEST(RegistryStateTest, CreatingIsVisibleRefusedThenReady) {
  testing::ShmDir dir("kvhost-populate-test");
  ASSERT_FALSE(dir.path().empty());
  PoolRegistry registry(RoomyRegistryOptions(dir.path()));
  absl::Notification looked, reached;
  std::atomic<int> asked{0};
  // The populate asks `abandoned` before each chunk: hold it after two.
  auto abandoned = [&] {
    if (++asked == 3) {
      reached.Notify();
      looked.WaitForNotification();
    }
    return false;
  };
  absl::Notification created;
  absl::StatusOr<std::shared_ptr<Pool>> result;
  registry.CreateInBackground("p", MhaOfBytes(8 * kPopulateChunkBytes), abandoned, "", std::nullopt,
                              [&](absl::StatusOr<std::shared_ptr<Pool>> pool) {
                                result = std::move(pool);
                                created.Notify();
                              });
  reached.WaitForNotification();
  std::vector<CreatingPool> creating = registry.ListCreating();
  ASSERT_EQ(creating.size(), 1u);
  EXPECT_EQ(creating[0].name, "p");
  EXPECT_GT(creating[0].bytes, 0u);
  EXPECT_LT(creating[0].populated_bytes, creating[0].bytes);
  ASSERT_TRUE(registry.GetCreating("p").has_value());
  EXPECT_TRUE(registry.List().empty());
  absl::StatusOr<std::shared_ptr<Pool>> got = registry.Get("p");
  EXPECT_TRUE(absl::IsFailedPrecondition(got.status())) << got.status();
  EXPECT_NE(got.status().message().find("is still being created"), std::string::npos);
  EXPECT_TRUE(absl::IsFailedPrecondition(registry.GetPoolOrAnchor("p").status()));
  EXPECT_TRUE(absl::IsFailedPrecondition(registry.Delete("p").status()));
  EXPECT_TRUE(absl::IsAlreadyExists(registry.Create("p", MhaOfBytes(kMiB)).status()));
  looked.Notify();
  created.WaitForNotification();
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_TRUE(registry.ListCreating().empty());
  EXPECT_TRUE(registry.Get("p").ok());
  result = absl::UnknownError("dropped");  // the registry's reference remains
  // Delete then create again at once: the name is free when Delete returns.
  ASSERT_TRUE(registry.Delete("p").ok());
  EXPECT_TRUE(registry.Create("p", MhaOfBytes(kMiB)).ok());
}

TEST(RegistryStateTest, AbandonedCreationStopsEarlyAndLeavesNothing) {
  testing::ShmDir dir("kvhost-populate-test");
  ASSERT_FALSE(dir.path().empty());
  PoolRegistry registry(RoomyRegistryOptions(dir.path()));
  std::atomic<int> asked{0};
  absl::StatusOr<std::shared_ptr<Pool>> pool =
      registry.Create("p", MhaOfBytes(16 * kPopulateChunkBytes), [&] { return ++asked > 2; });
  EXPECT_TRUE(absl::IsCancelled(pool.status())) << pool.status();
  EXPECT_LT(asked.load(), 16);  // stopped within a chunk, not at the end
  EXPECT_TRUE(registry.ListCreating().empty());
  EXPECT_TRUE(absl::IsNotFound(registry.Get("p").status()));
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
}

TEST(RegistryStateTest, CancelCreationsEndsThemUnavailable) {
  testing::ShmDir dir("kvhost-populate-test");
  ASSERT_FALSE(dir.path().empty());
  PoolRegistry registry(RoomyRegistryOptions(dir.path()));
  absl::Notification started;
  std::atomic<bool> once{false};
  absl::Notification finished;
  absl::Status status;
  registry.CreateInBackground(
      "p", MhaOfBytes(64 * kPopulateChunkBytes),
      [&] {
        if (!once.exchange(true)) started.Notify();
        return false;
      },
      "", std::nullopt,
      [&](absl::StatusOr<std::shared_ptr<Pool>> pool) {
        status = pool.status();
        finished.Notify();
      });
  started.WaitForNotification();
  registry.CancelCreations();  // joins: `finished` is notified by now
  ASSERT_TRUE(finished.HasBeenNotified());
  EXPECT_TRUE(absl::IsUnavailable(status)) << status;
  EXPECT_TRUE(absl::IsUnavailable(registry.Create("q", MhaOfBytes(kMiB)).status()));
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
}

TEST(RegistryStateTest, DeletedPoolIsUnmappedOffTheCallingThread) {
  testing::ShmDir dir("kvhost-populate-test");
  ASSERT_FALSE(dir.path().empty());
  PoolRegistry registry(RoomyRegistryOptions(dir.path()));
  ASSERT_TRUE(registry.Create("p", MhaOfBytes(4 * kPopulateChunkBytes)).ok());
  absl::StatusOr<uint64_t> bytes = registry.Delete("p");
  ASSERT_TRUE(bytes.ok());
  // Released in the background: the ledger empties without another call.
  for (int i = 0; i < 500 && registry.releasing_bytes() > 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(registry.releasing_bytes(), 0u);
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
}

}  // namespace
}  // namespace kvhost
