// Tests of LayerCounters (server/transfer/layer_counters.h): bases advance
// per set in Reserve order; Publish and Release are monotonic (a late
// Release lowers nothing); the bounds of Create; the read-only descriptor
// maps the same counters and can neither be mapped writable nor resized;
// concurrent publishers on different sets and a reader see only increasing
// values.
#include "server/transfer/layer_counters.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <thread>
#include <vector>

#include "absl/status/status.h"

namespace kvhost {
namespace {

std::shared_ptr<LayerCounters> Make(uint32_t sets) {
  absl::StatusOr<std::shared_ptr<LayerCounters>> counters = LayerCounters::Create(sets);
  EXPECT_TRUE(counters.ok()) << counters.status();
  return counters.ok() ? *counters : nullptr;
}

TEST(LayerCountersTest, CreateRefusesZeroAndTooManySets) {
  EXPECT_EQ(LayerCounters::Create(0).status().code(), absl::StatusCode::kInvalidArgument);
  absl::Status over = LayerCounters::Create(65).status();
  EXPECT_EQ(over.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(over.message().find("65"), std::string::npos) << over;
  EXPECT_TRUE(LayerCounters::Create(64).ok());
}

TEST(LayerCountersTest, StartAtZeroAndBasesAdvancePerSet) {
  std::shared_ptr<LayerCounters> c = Make(3);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->sets(), 3u);
  EXPECT_EQ(c->bytes(), 24u);
  for (uint32_t s = 0; s < 3; ++s) EXPECT_EQ(c->Recorded(s), 0u);
  EXPECT_EQ(c->Reserve(0, 32), 0u);
  EXPECT_EQ(c->Reserve(1, 8), 0u);  // another set: its own count
  EXPECT_EQ(c->Reserve(0, 32), 32u);
  EXPECT_EQ(c->Reserve(0, 5), 64u);
  EXPECT_EQ(c->Reserve(1, 8), 8u);
  EXPECT_EQ(c->Recorded(0), 0u);  // reserved is not recorded
}

TEST(LayerCountersTest, PublishCountsLayersAndReleaseCompletesALoad) {
  std::shared_ptr<LayerCounters> c = Make(2);
  ASSERT_NE(c, nullptr);
  const uint64_t base = c->Reserve(1, 4);
  c->Publish(1, base, 0);
  EXPECT_EQ(c->Recorded(1), 1u);
  c->Publish(1, base, 1);
  EXPECT_EQ(c->Recorded(1), 2u);
  EXPECT_EQ(c->Recorded(0), 0u);  // the other set untouched
  // It fails after layer 1: its waiters for layers 2 and 3 are released.
  c->Release(1, base, 4);
  EXPECT_EQ(c->Recorded(1), 4u);
  c->Release(1, base, 4);  // idempotent
  EXPECT_EQ(c->Recorded(1), 4u);
  // The set's next load starts where the first ended.
  const uint64_t next = c->Reserve(1, 4);
  EXPECT_EQ(next, 4u);
  c->Publish(1, next, 0);
  EXPECT_EQ(c->Recorded(1), 5u);
}

TEST(LayerCountersTest, ALateReleaseOrPublishNeverLowersTheCounter) {
  std::shared_ptr<LayerCounters> c = Make(1);
  ASSERT_NE(c, nullptr);
  const uint64_t first = c->Reserve(0, 3);
  const uint64_t second = c->Reserve(0, 3);
  for (uint32_t l = 0; l < 3; ++l) c->Publish(0, second, l);
  EXPECT_EQ(c->Recorded(0), 6u);
  // The first load's end reported after the second published (the
  // manager's completion callback runs after the engine freed the set).
  c->Release(0, first, 3);
  c->Publish(0, first, 1);
  EXPECT_EQ(c->Recorded(0), 6u);
}

TEST(LayerCountersTest, TheReadOnlyDescriptorSeesTheCountersAndCannotWrite) {
  std::shared_ptr<LayerCounters> c = Make(4);
  ASSERT_NE(c, nullptr);
  const int fd = c->read_only_fd();
  ASSERT_GE(fd, 0);
  EXPECT_EQ(::fcntl(fd, F_GETFL) & O_ACCMODE, O_RDONLY);
  struct stat st {};
  ASSERT_EQ(::fstat(fd, &st), 0);
  EXPECT_EQ(static_cast<uint64_t>(st.st_size), c->bytes());
  errno = 0;
  EXPECT_EQ(::mmap(nullptr, c->bytes(), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0), MAP_FAILED);
  EXPECT_EQ(errno, EACCES);
  EXPECT_NE(::ftruncate(fd, 0), 0);
  EXPECT_NE(::ftruncate(fd, 1 << 20), 0);
  const char byte = 1;
  EXPECT_LT(::pwrite(fd, &byte, 1, 0), 0);
  // Even a writable reopen of the same file (a worker that found it under
  // /proc) may not map it writable or resize it: the seals.
  const std::string path = "/proc/self/fd/" + std::to_string(fd);
  const int rw = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (rw >= 0) {
    EXPECT_EQ(::mmap(nullptr, c->bytes(), PROT_READ | PROT_WRITE, MAP_SHARED, rw, 0), MAP_FAILED);
    EXPECT_NE(::ftruncate(rw, 0), 0);
    ::close(rw);
  }
  void* mapped = ::mmap(nullptr, c->bytes(), PROT_READ, MAP_SHARED, fd, 0);
  ASSERT_NE(mapped, MAP_FAILED);
  const auto* view = static_cast<const uint64_t*>(mapped);
  const uint64_t base = c->Reserve(2, 7);
  c->Publish(2, base, 4);
  EXPECT_EQ(__atomic_load_n(&view[2], __ATOMIC_ACQUIRE), 5u);
  EXPECT_EQ(view[0], 0u);
  // The mapping outlives the counters object (a worker's, after a detach).
  c.reset();
  EXPECT_EQ(__atomic_load_n(&view[2], __ATOMIC_ACQUIRE), 5u);
  ::munmap(mapped, 32);
}

TEST(LayerCountersTest, ConcurrentLoadsOnEverySetAndAReaderSeeOnlyIncreasingCounts) {
  constexpr uint32_t kSets = 4;
  constexpr uint32_t kLoads = 200;
  constexpr uint32_t kLayers = 16;
  std::shared_ptr<LayerCounters> c = Make(kSets);
  ASSERT_NE(c, nullptr);
  std::atomic<bool> done{false};
  std::atomic<bool> monotonic{true};
  std::thread reader([&] {
    uint64_t last[kSets] = {};
    while (!done.load()) {
      for (uint32_t s = 0; s < kSets; ++s) {
        const uint64_t now = c->Recorded(s);
        if (now < last[s]) monotonic = false;
        last[s] = now;
      }
    }
  });
  std::vector<std::thread> loads;
  for (uint32_t s = 0; s < kSets; ++s) {
    // One thread per set: a set serves one load at a time.
    loads.emplace_back([&, s] {
      for (uint32_t n = 0; n < kLoads; ++n) {
        const uint64_t base = c->Reserve(s, kLayers);
        const uint32_t stop = n % 5 == 0 ? kLayers / 2 : kLayers;  // some fail midway
        for (uint32_t l = 0; l < stop; ++l) c->Publish(s, base, l);
        c->Release(s, base, kLayers);
      }
    });
  }
  for (std::thread& t : loads) t.join();
  done = true;
  reader.join();
  EXPECT_TRUE(monotonic.load());
  for (uint32_t s = 0; s < kSets; ++s) EXPECT_EQ(c->Recorded(s), uint64_t{kLoads} * kLayers);
}

}  // namespace
}  // namespace kvhost
