// The domain's invariants under concurrency: many threads
// on one Pool, one PoolRegistry and one TransferManager with the host engine,
// the way kvhostd's gRPC threads drive them, with no gRPC in between so that
// scripts/sanitize.sh tsan can run these with all of the code under test
// instrumented.
//
// What is checked, during the run and after it:
//   * no token page is handed out twice (an owner table claimed on every
//     Alloc, released before every Free);
//   * free + allocated == size at every checkpoint (all threads stopped at a
//     barrier) and at the end;
//   * a failed call changes nothing: after each refused Free or Alloc the
//     caller's pages are still allocated and its page bytes unchanged;
//   * bytes backed up and loaded back are the bytes that were written;
//   * every ticket finishes, and counters agree with what was accepted;
//   * a pool with attachments is never deleted; after Detach or CloseSession
//     the attachments are gone and the pools' attachment counts return to 0.
//
// Each test runs in well under a second natively and under 20 s with TSan.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "domain_test_util.h"
#include "server/pool/pool.h"
#include "server/pool/pool_group.h"
#include "server/pool/pool_spec.h"
#include "server/pool/registry.h"
#include "server/pool/shm_region.h"
#include "server/tickets/ticket.h"
#include "server/transfer/engine.h"
#include "server/transfer/host_engine.h"
#include "server/transfer/transfer_manager.h"
#include "shm_dir.h"
#include "spdlog/spdlog.h"

namespace kvhost {
namespace {

// spdlog's registry is a function-local static inside Debian's libspdlog,
// which is not built for TSan: when the first log line comes from two threads
// at once, TSan cannot see the static's guard and reports a race. kvhostd
// logs on its main thread before any other thread starts; so do these tests.
class SpdlogOnMainThread : public ::testing::Environment {
 public:
  void SetUp() override { spdlog::default_logger()->flush(); }
};
[[maybe_unused]] const ::testing::Environment* const kSpdlogOnMainThread =
    ::testing::AddGlobalTestEnvironment(new SpdlogOnMainThread);

namespace fs = std::filesystem;
using ::kvhost::testing::AttachByName;
using ::kvhost::testing::RoomyRegistryOptions;
using Code = absl::StatusCode;

// Long enough for any ticket under TSan on a loaded 2-core machine.
constexpr absl::Duration kTicketDeadline = absl::Seconds(30);

// Every ShmDir here is /dev/shm/kvhost-concurrency-test-XXXXXX.
class ShmDir : public testing::ShmDir {
 public:
  ShmDir() : testing::ShmDir("kvhost-concurrency-test") {}
};

// MHA, PAGE_FIRST, 2 layers of 2 heads x 8 bf16, pages of 4 tokens.
PoolSpec SmallSpec(uint64_t pages) {
  PoolSpec spec;
  spec.kind = PoolKind::kMha;
  spec.layout = LayoutKind::kPageFirst;
  spec.dtype = DType::kBf16;
  spec.page_size = 4;
  spec.layer_num = 2;
  spec.head_num = 2;
  spec.head_dim = 8;
  spec.size_tokens = pages * spec.page_size;
  return spec;
}

// Slots of `pages` (page ids) of a pool with `page_size`.
std::vector<int64_t> SlotsOf(const std::vector<uint64_t>& pages, uint64_t page_size) {
  std::vector<int64_t> slots;
  for (uint64_t p : pages) {
    for (uint64_t k = 0; k < page_size; ++k)
      slots.push_back(static_cast<int64_t>(p * page_size + k));
  }
  return slots;
}

// A cyclic barrier: Wait() returns once `n` threads called it; the last one
// to arrive runs `at_barrier` first, with every other thread stopped.
class Barrier {
 public:
  explicit Barrier(int n) : n_(n) {}
  void Wait(const std::function<void()>& at_barrier) {
    absl::MutexLock lock(&mu_);
    const uint64_t generation = generation_;
    if (++arrived_ == n_) {
      at_barrier();
      arrived_ = 0;
      ++generation_;
      return;
    }
    auto next = [this, generation]()
                    ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return generation_ != generation; };
    mu_.Await(absl::Condition(&next));
  }

 private:
  const int n_;
  absl::Mutex mu_;
  int arrived_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
};

// ============================================================ Pool

// Threads allocate, write, read back and free pages of one pool, with
// refused calls mixed in; at every checkpoint the pages held by the threads
// plus the free pages are exactly the pool's pages.
TEST(PoolConcurrencyTest, AllocFreeAndPagesKeepTheInvariants) {
  ShmDir dir;
  ASSERT_FALSE(dir.path().empty());
  constexpr uint64_t kPages = 48;
  const PoolSpec spec = SmallSpec(kPages);
  absl::StatusOr<std::shared_ptr<Pool>> created = Pool::Create(
      "p", spec, spec.size_tokens, absl::StrCat(dir.path(), "/kvhost.", ::getpid(), "."));
  ASSERT_TRUE(created.ok()) << created.status();
  Pool& pool = **created;
  const uint64_t ps = pool.page_size();
  const uint64_t page_bytes = pool.flat_page_bytes();

  constexpr int kThreads = 6;
  constexpr int kRounds = 20;
  constexpr int kStepsPerRound = 25;
  // owner[p] = thread + 1 while a thread holds page p.
  std::vector<std::atomic<int>> owner(kPages);
  for (auto& o : owner) o = 0;
  std::vector<std::vector<uint64_t>> held(kThreads);  // each thread's, read at barriers
  std::atomic<int> violations{0};
  std::atomic<uint64_t> refused{0};
  Barrier barrier(kThreads);
  auto checkpoint = [&] {
    uint64_t allocated = 0;
    for (int t = 0; t < kThreads; ++t) {
      allocated += held[t].size();
      if (!held[t].empty()) {
        EXPECT_TRUE(pool.allocator().CheckAllocated(SlotsOf(held[t], ps)).ok())
            << "thread " << t << " holds pages the allocator calls free";
      }
    }
    EXPECT_EQ(pool.allocator().free_pages() + allocated, kPages)
        << "free + allocated != size at a checkpoint";
  };

  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(1000 + t);
      std::vector<uint64_t>& mine = held[t];
      std::vector<uint8_t> page(page_bytes), back(page_bytes);
      // The byte each of my pages was last written with.
      std::vector<uint8_t> fill(kPages, 0);
      for (int round = 0; round < kRounds; ++round) {
        for (int step = 0; step < kStepsPerRound; ++step) {
          switch (rng() % 6) {
            case 0:
            case 1: {  // Alloc 1-4 pages; claim each, write it.
              absl::StatusOr<std::vector<uint64_t>> got = pool.AllocPages((1 + rng() % 4) * ps);
              if (!got.ok()) {
                EXPECT_EQ(got.status().code(), Code::kResourceExhausted) << got.status();
                break;
              }
              for (uint64_t p : *got) {
                int expected = 0;
                if (!owner[p].compare_exchange_strong(expected, t + 1)) {
                  ++violations;
                  ADD_FAILURE() << "page " << p << " handed to thread " << t << " while thread "
                                << expected - 1 << " holds it";
                  continue;
                }
                mine.push_back(p);
                fill[p] = static_cast<uint8_t>(rng());
                std::memset(page.data(), fill[p], page_bytes);
                EXPECT_TRUE(pool.WritePage(static_cast<int64_t>(p * ps), page).ok());
              }
              break;
            }
            case 2: {  // Free some of mine: release the claim first.
              if (mine.empty()) break;
              std::shuffle(mine.begin(), mine.end(), rng);
              const size_t n = 1 + rng() % mine.size();
              std::vector<uint64_t> freed(mine.end() - n, mine.end());
              mine.resize(mine.size() - n);
              for (uint64_t p : freed) owner[p] = 0;
              absl::StatusOr<uint64_t> s = pool.Free(SlotsOf(freed, ps));
              EXPECT_TRUE(s.ok()) << s.status();
              break;
            }
            case 3: {  // Refused calls: nothing of mine may change.
              std::vector<int64_t> bad = SlotsOf(mine, ps);
              switch (rng() % 4) {
                case 0:  // a slot past the end
                  bad.push_back(static_cast<int64_t>(kPages * ps));
                  break;
                case 1:  // half a page
                  bad.push_back(0);
                  break;
                case 2:  // a page twice
                  if (mine.empty()) break;
                  for (uint64_t k = 0; k < ps; ++k) bad.push_back(bad[k]);
                  break;
                default:
                  bad.push_back(-1);
              }
              if (absl::StatusOr<uint64_t> s = pool.Free(bad); s.ok()) {
                ADD_FAILURE() << "Free of a bad slot list succeeded";
                for (uint64_t p : mine) owner[p] = 0;
                mine.clear();
                break;
              }
              const Code code = (rng() % 2 == 0)
                                    ? pool.AllocPages(ps + 1).status().code()
                                    : pool.AllocPages((kPages + 1) * ps).status().code();
              EXPECT_NE(code, Code::kOk);
              ++refused;
              if (!mine.empty()) {
                EXPECT_TRUE(pool.allocator().CheckAllocated(SlotsOf(mine, ps)).ok())
                    << "a refused call freed pages of thread " << t;
              }
              break;
            }
            default: {  // Read one of mine back: my bytes, nobody else's.
              if (mine.empty()) break;
              const uint64_t p = mine[rng() % mine.size()];
              EXPECT_TRUE(pool.ReadPage(static_cast<int64_t>(p * ps), absl::MakeSpan(back)).ok());
              std::memset(page.data(), fill[p], page_bytes);
              EXPECT_EQ(back, page) << "page " << p << " of thread " << t << " changed";
            }
          }
        }
        barrier.Wait(checkpoint);
      }
      for (uint64_t p : mine) owner[p] = 0;
      if (!mine.empty()) {
        EXPECT_TRUE(pool.Free(SlotsOf(mine, ps)).ok());
      }
      mine.clear();
    });
  }
  for (std::thread& th : threads) th.join();
  EXPECT_EQ(violations.load(), 0);
  EXPECT_GT(refused.load(), 0u);
  EXPECT_EQ(pool.allocator().free_pages(), kPages);
}

// ============================================================ PoolRegistry

// Pools and groups created and deleted under the same few names while other
// threads use whatever pool a name gives them. Each name is held by at most
// one pool or group; a pool in a group is never deleted; the byte count
// matches the pools left; everything deleted leaves no bytes and no files.
TEST(RegistryConcurrencyTest, CreateDeleteGroupsAndUseRace) {
  ShmDir dir;
  ASSERT_FALSE(dir.path().empty());
  PoolRegistry registry(RoomyRegistryOptions(dir.path()));
  const PoolSpec spec = SmallSpec(16);
  const std::vector<std::string> names = {"a", "b", "c", "g"};  // "g" for groups, or a pool
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> created{0}, deleted{0}, groups{0}, uses{0};

  auto creator = [&](int seed) {
    std::mt19937_64 rng(seed);
    while (!stop) {
      const std::string& name = names[rng() % names.size()];
      if (rng() % 2 == 0) {
        absl::StatusOr<std::shared_ptr<Pool>> p = registry.Create(name, spec);
        if (p.ok()) {
          ++created;
        } else {
          EXPECT_EQ(p.status().code(), Code::kAlreadyExists) << p.status();
        }
      } else {
        absl::StatusOr<uint64_t> bytes = registry.Delete(name);
        if (bytes.ok()) {
          ++deleted;
        } else {
          // NOT_FOUND: no pool (or a group) by that name; FAILED_PRECONDITION:
          // in a group or attached.
          EXPECT_TRUE(bytes.status().code() == Code::kNotFound ||
                      bytes.status().code() == Code::kFailedPrecondition)
              << bytes.status();
        }
      }
    }
  };
  auto grouper = [&] {
    std::mt19937_64 rng(77);
    while (!stop) {
      if (rng() % 2 == 0) {
        std::vector<GroupEntrySpec> entries = {{"x", names[rng() % 3], {}, true},
                                               {"y", names[rng() % 3], {}, false}};
        absl::StatusOr<std::shared_ptr<PoolGroup>> g = registry.CreateGroup("g", 2, entries);
        if (g.ok()) {
          ++groups;
          // Neither pool can go while it is in the group.
          for (const GroupEntry& e : (*g)->entries()) {
            EXPECT_EQ(registry.Delete(e.pool->name()).status().code(), Code::kFailedPrecondition);
          }
        } else {
          const Code c = g.status().code();
          EXPECT_TRUE(c == Code::kAlreadyExists || c == Code::kNotFound ||
                      c == Code::kFailedPrecondition || c == Code::kInvalidArgument)
              << g.status();
        }
      } else {
        const absl::Status s = registry.DeleteGroup("g");
        EXPECT_TRUE(s.ok() || s.code() == Code::kNotFound) << s;
      }
    }
  };
  auto user = [&](int seed) {
    std::mt19937_64 rng(seed);
    std::vector<uint8_t> page, back;
    while (!stop) {
      absl::StatusOr<std::shared_ptr<Pool>> p = registry.GetPoolOrAnchor(names[rng() % 4]);
      if (!p.ok()) continue;
      // The pool may leave the registry now; what this thread holds stays usable.
      Pool& pool = **p;
      absl::StatusOr<std::vector<uint64_t>> got = pool.AllocPages(pool.page_size());
      if (!got.ok()) continue;
      page.assign(pool.flat_page_bytes(), static_cast<uint8_t>(rng()));
      back.assign(pool.flat_page_bytes(), 0);
      const int64_t first = static_cast<int64_t>((*got)[0] * pool.page_size());
      const absl::Status written = pool.WritePage(first, page);
      EXPECT_TRUE(written.ok()) << written;
      const absl::Status read = pool.ReadPage(first, absl::MakeSpan(back));
      EXPECT_TRUE(read.ok()) << read;
      EXPECT_EQ(back, page);
      const std::vector<int64_t> slots = SlotsOf(*got, pool.page_size());
      const absl::StatusOr<uint64_t> freed = pool.Free(slots);
      EXPECT_TRUE(freed.ok()) << freed.status();
      ++uses;
    }
  };
  std::vector<std::thread> threads;
  threads.emplace_back(creator, 1);
  threads.emplace_back(creator, 2);
  threads.emplace_back(grouper);
  threads.emplace_back(user, 3);
  threads.emplace_back(user, 4);
  // Names are unique across pools and groups while they run. List and
  // ListGroups are two snapshots, so a pool may go and a group of its name
  // come between them; a clash is one only when the same pool object is
  // listed before and after the groups (it lived all through, and the list
  // holds it, so no new pool can be it).
  for (int i = 0; i < 40; ++i) {
    const std::vector<std::shared_ptr<Pool>> first = registry.List();
    std::map<std::string, const Pool*> before;
    for (const auto& p : first) {
      EXPECT_TRUE(before.emplace(p->name(), p.get()).second) << p->name();
    }
    const std::vector<std::shared_ptr<PoolGroup>> groups_now = registry.ListGroups();
    const std::vector<std::shared_ptr<Pool>> after = registry.List();
    for (const auto& g : groups_now) {
      auto it = before.find(g->name());
      if (it == before.end()) continue;
      for (const auto& p : after) {
        EXPECT_FALSE(p.get() == it->second) << "group " << g->name() << " is also a pool";
      }
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  absl::SleepFor(absl::Milliseconds(200));
  stop = true;
  for (std::thread& th : threads) th.join();
  EXPECT_GT(created.load(), 0u);
  EXPECT_GT(deleted.load(), 0u);
  EXPECT_GT(uses.load(), 0u);

  uint64_t bytes = 0;
  for (const auto& p : registry.List()) bytes += p->bytes();
  EXPECT_EQ(registry.used_bytes(), bytes);
  for (const auto& g : registry.ListGroups()) EXPECT_TRUE(registry.DeleteGroup(g->name()).ok());
  for (const auto& p : registry.List()) EXPECT_TRUE(registry.Delete(p->name()).ok());
  EXPECT_EQ(registry.used_bytes(), 0u);
  EXPECT_TRUE(registry.List().empty());
  // The last holders are gone: no region file is left.
  for (const auto& entry : fs::directory_iterator(dir.path())) {
    ADD_FAILURE() << "left behind: " << entry.path();
  }
}

// ============================================================ TransferManager

// An emulated device pool (kvhost::ShmDevicePool): per plane and layer,
// kDeviceRows rows of the pool's row size, back to back, in one file.
struct DeviceFile {
  static constexpr uint64_t kDeviceRows = 64;
  std::unique_ptr<ShmRegion> region;
  KvLayout layout;

  static DeviceFile Create(const std::string& path, const KvLayout& layout) {
    DeviceFile f;
    f.layout = layout;
    absl::StatusOr<std::unique_ptr<ShmRegion>> r =
        ShmRegion::Create(path, layout.planes * layout.layers * kDeviceRows * layout.token_bytes);
    if (r.ok()) f.region = *std::move(r);
    return f;
  }
  uint8_t* Row(uint64_t plane, uint64_t layer, uint64_t row) const {
    return region->data() +
           ((plane * layout.layers + layer) * kDeviceRows + row) * layout.token_bytes;
  }
  AttachRequest Request(const std::string& session_id = "") const {
    AttachRequest req;
    req.device_size_tokens = kDeviceRows;
    req.session_id = session_id;
    for (uint64_t l = 0; l < layout.layers; ++l) {
      req.k_layers.push_back({DeviceBufferRef::Kind::kShm, region->path(), "", "",
                              (0 * layout.layers + l) * kDeviceRows * layout.token_bytes});
      req.v_layers.push_back({DeviceBufferRef::Kind::kShm, region->path(), "", "",
                              (1 * layout.layers + l) * kDeviceRows * layout.token_bytes});
    }
    return req;
  }
};

// `n` distinct rows of [lo, lo + 32).
std::vector<int64_t> Rows(std::mt19937_64& rng, size_t n, int64_t lo) {
  std::vector<int64_t> all(32);
  for (int64_t i = 0; i < 32; ++i) all[i] = lo + i;
  std::shuffle(all.begin(), all.end(), rng);
  all.resize(n);
  return all;
}

class ManagerConcurrencyTest : public ::testing::Test {
 protected:
  static constexpr int kWorkers = 4;

  void SetUp() override {
    ASSERT_FALSE(dir_.path().empty());
    registry_ = std::make_unique<PoolRegistry>(RoomyRegistryOptions(dir_.path()));
    absl::StatusOr<std::shared_ptr<Pool>> pool = registry_->Create("kv", SmallSpec(64));
    ASSERT_TRUE(pool.ok()) << pool.status();
    pool_ = *pool;
    HostEngineOptions engine;
    engine.shm_dir = dir_.path();
    engine.helper_threads = 2;
    engine.min_split_bytes = 64;  // split even these small layers over the helpers
    manager_ = std::make_unique<TransferManager>(std::make_unique<HostEngine>(engine));
    for (int w = 0; w < kWorkers; ++w) {
      devices_.push_back(
          DeviceFile::Create(absl::StrCat(dir_.path(), "/device", w), pool_->layout()));
      ASSERT_NE(devices_.back().region, nullptr);
    }
  }
  void TearDown() override {
    manager_.reset();
    registry_.reset();
  }

  // Every ticket of `tickets` finishes; returns how many ended OK.
  static int WaitAll(const std::vector<std::shared_ptr<Ticket>>& tickets) {
    int ok = 0;
    for (const auto& t : tickets) {
      const bool done = t->WaitUntil(absl::Now() + kTicketDeadline);
      EXPECT_TRUE(done) << "ticket " << t->id() << " did not finish";
      if (done && t->Snapshot().status.ok()) ++ok;
    }
    return ok;
  }

  ShmDir dir_;
  std::unique_ptr<PoolRegistry> registry_;
  std::shared_ptr<Pool> pool_;
  std::unique_ptr<TransferManager> manager_;
  std::vector<DeviceFile> devices_;
};

// Workers attach, back up rows of their device file, load them back into
// other rows and compare, with refused requests in between, then detach;
// another thread races Create / Delete of a second pool against attaching to
// it. Bytes round-trip exactly, every ticket finishes, counters add up and
// no attachment is left.
TEST_F(ManagerConcurrencyTest, AttachSubmitDetachRace) {
  constexpr int kIterations = 30;
  std::atomic<uint64_t> accepted{0}, refused{0};
  std::vector<std::thread> threads;
  for (int w = 0; w < kWorkers; ++w) {
    threads.emplace_back([&, w] {
      std::mt19937_64 rng(50 + w);
      const DeviceFile& dev = devices_[w];
      const KvLayout& layout = pool_->layout();
      std::string att;
      for (int i = 0; i < kIterations; ++i) {
        if (att.empty()) {
          absl::StatusOr<AttachmentInfo> info =
              AttachByName(*manager_, *registry_, "kv", dev.Request());
          ASSERT_TRUE(info.ok()) << info.status();
          att = info->id;
        }
        absl::StatusOr<std::vector<uint64_t>> pages = pool_->AllocPages(2 * pool_->page_size());
        if (!pages.ok()) {
          EXPECT_EQ(pages.status().code(), Code::kResourceExhausted);
          continue;
        }
        const std::vector<int64_t> host = SlotsOf(*pages, pool_->page_size());
        const std::vector<int64_t> from = Rows(rng, host.size(), 0);
        const std::vector<int64_t> to = Rows(rng, host.size(), 32);
        for (uint64_t plane = 0; plane < layout.planes; ++plane)
          for (uint64_t layer = 0; layer < layout.layers; ++layer)
            for (int64_t r : from)
              std::memset(dev.Row(plane, layer, r), static_cast<int>(rng()), layout.token_bytes);

        // Refused: a device row past the end, a host slot past the end,
        // lengths that differ. No ticket comes of them.
        std::vector<int64_t> bad_device = from;
        bad_device[rng() % bad_device.size()] = DeviceFile::kDeviceRows;
        std::vector<int64_t> bad_host = host;
        bad_host.back() = static_cast<int64_t>(pool_->size_tokens());
        EXPECT_EQ(manager_->Submit({}, att, Direction::kBackup, host, bad_device).status().code(),
                  Code::kInvalidArgument);
        EXPECT_EQ(manager_->Submit({}, att, Direction::kLoad, bad_host, to).status().code(),
                  Code::kInvalidArgument);
        EXPECT_EQ(manager_->Submit({}, att, Direction::kLoad, host, absl::MakeSpan(to).subspan(1))
                      .status()
                      .code(),
                  Code::kInvalidArgument);
        refused += 3;

        absl::StatusOr<std::shared_ptr<Ticket>> backup =
            manager_->Submit({}, att, Direction::kBackup, host, from);
        ASSERT_TRUE(backup.ok()) << backup.status();
        ++accepted;
        ASSERT_EQ(WaitAll({*backup}), 1) << (*backup)->Snapshot().status;
        absl::StatusOr<std::shared_ptr<Ticket>> load =
            manager_->Submit({}, att, Direction::kLoad, host, to);
        ASSERT_TRUE(load.ok()) << load.status();
        ++accepted;
        ASSERT_EQ(WaitAll({*load}), 1) << (*load)->Snapshot().status;
        for (uint64_t plane = 0; plane < layout.planes; ++plane)
          for (uint64_t layer = 0; layer < layout.layers; ++layer)
            for (size_t k = 0; k < from.size(); ++k)
              ASSERT_EQ(std::memcmp(dev.Row(plane, layer, from[k]), dev.Row(plane, layer, to[k]),
                                    layout.token_bytes),
                        0)
                  << "worker " << w << " plane " << plane << " layer " << layer << " row "
                  << from[k] << " -> slot " << host[k] << " -> row " << to[k];
        EXPECT_TRUE(pool_->Free(host).ok());
        if (rng() % 4 == 0) {
          EXPECT_TRUE(manager_->Detach({}, att).ok());
          EXPECT_EQ(manager_->Detach({}, att).code(), Code::kNotFound);
          att.clear();
        }
      }
      if (!att.empty()) {
        EXPECT_TRUE(manager_->Detach({}, att).ok());
      }
    });
  }
  // A pool that comes and goes under a thread attaching to it: an attached
  // pool is never deleted.
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> victim_attached{0};
  threads.emplace_back([&] {
    while (!stop) {
      (void)registry_->Create("victim", SmallSpec(8));
      absl::SleepFor(absl::Microseconds(200));
      const absl::StatusOr<uint64_t> s = registry_->Delete("victim");
      EXPECT_TRUE(s.ok() || s.status().code() == Code::kFailedPrecondition ||
                  s.status().code() == Code::kNotFound)
          << s.status();
    }
  });
  std::thread attacher([&] {
    DeviceFile dev = DeviceFile::Create(dir_.path() + "/device-victim", pool_->layout());
    while (!stop) {
      absl::StatusOr<AttachmentInfo> info =
          AttachByName(*manager_, *registry_, "victim", dev.Request());
      if (!info.ok()) {
        const Code c = info.status().code();
        EXPECT_TRUE(c == Code::kNotFound || c == Code::kFailedPrecondition) << info.status();
        continue;
      }
      ++victim_attached;
      absl::StatusOr<std::shared_ptr<Pool>> p = registry_->Get("victim");
      ASSERT_TRUE(p.ok()) << "attached pool deleted: " << p.status();
      EXPECT_GE((*p)->attachments(), 1u);
      EXPECT_TRUE(manager_->Detach({}, info->id).ok());
    }
  });
  for (int w = 0; w < kWorkers; ++w) threads[w].join();
  stop = true;
  attacher.join();
  threads.back().join();

  EXPECT_GT(victim_attached.load(), 0u);
  EXPECT_TRUE(manager_->ListAttachments().empty());
  EXPECT_EQ(pool_->attachments(), 0u);
  const TransferCounters c = manager_->counters();
  EXPECT_EQ(c.tickets_in_flight, 0u);
  EXPECT_EQ(c.tickets_done, accepted.load());
  EXPECT_EQ(c.tickets_failed, 0u);
  EXPECT_EQ(pool_->allocator().free_pages(), pool_->page_num());
  (void)registry_->Delete("victim");
}

// Worker sessions open, attach, queue backups and loads and close while
// those run, racing a thread that closes sessions it did not open. After
// CloseSession the session's attachments are gone (Submit NOT_FOUND), every
// ticket still finishes (a load may be cancelled), and the pool's attachment
// count returns to 0.
TEST_F(ManagerConcurrencyTest, SessionsCloseWhileTransfersRun) {
  constexpr int kRounds = 12;
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> accepted{0}, closed_by_other{0};
  std::vector<std::thread> threads;
  for (int w = 0; w < kWorkers; ++w) {
    threads.emplace_back([&, w] {
      std::mt19937_64 rng(90 + w);
      const DeviceFile& dev = devices_[w];
      for (int round = 0; round < kRounds; ++round) {
        const std::string session =
            manager_->OpenSession(absl::StrCat("worker-", w), 1000 + w, "concurrency_test");
        const Caller caller{{session}, std::nullopt};
        std::vector<std::string> atts;
        for (int a = 0; a < 2; ++a) {
          absl::StatusOr<AttachmentInfo> info =
              AttachByName(*manager_, *registry_, "kv", dev.Request(session));
          if (!info.ok()) {  // closed by the other thread meanwhile
            EXPECT_EQ(info.status().code(), Code::kNotFound) << info.status();
            continue;
          }
          EXPECT_EQ(info->session_id, session);
          atts.push_back(info->id);
        }
        // Backups read device rows [0, 32) into host_backup; loads write
        // host_load into rows [32, 64): the lanes run at once, and the test
        // must not race with itself on device or host bytes.
        absl::StatusOr<std::vector<uint64_t>> pages = pool_->AllocPages(4 * pool_->page_size());
        ASSERT_TRUE(pages.ok()) << pages.status();
        const std::vector<int64_t> host = SlotsOf(*pages, pool_->page_size());
        const size_t half = host.size() / 2;
        const absl::Span<const int64_t> host_backup = absl::MakeSpan(host).subspan(0, half);
        const absl::Span<const int64_t> host_load = absl::MakeSpan(host).subspan(half);
        std::vector<std::shared_ptr<Ticket>> tickets;
        for (int k = 0; k < 6 && !atts.empty(); ++k) {
          const std::string& att = atts[rng() % atts.size()];
          const bool backup = k % 2 == 0;
          absl::StatusOr<std::shared_ptr<Ticket>> t =
              manager_->Submit(caller, att, backup ? Direction::kBackup : Direction::kLoad,
                               backup ? host_backup : host_load, Rows(rng, half, backup ? 0 : 32));
          if (!t.ok()) {
            EXPECT_EQ(t.status().code(), Code::kNotFound) << t.status();
            continue;
          }
          ++accepted;
          tickets.push_back(*t);
        }
        manager_->CloseSession(session, "worker gone", absl::Seconds(5));
        // Gone at once, not when the transfers end.
        for (const AttachmentInfo& info : manager_->ListAttachments()) {
          EXPECT_NE(info.session_id, session) << info.id << " outlived its session";
        }
        for (const std::string& att : atts) {
          EXPECT_EQ(
              manager_->Submit(caller, att, Direction::kBackup, host_backup, Rows(rng, half, 0))
                  .status()
                  .code(),
              Code::kNotFound);
          EXPECT_EQ(manager_->Detach(caller, att).code(), Code::kNotFound);
        }
        EXPECT_EQ(AttachByName(*manager_, *registry_, "kv", dev.Request(session)).status().code(),
                  Code::kNotFound);
        WaitAll(tickets);
        for (const auto& t : tickets) {
          const absl::Status s = t->Snapshot().status;
          EXPECT_TRUE(s.ok() || s.code() == Code::kCancelled) << s;
        }
        EXPECT_TRUE(pool_->Free(host).ok());
      }
    });
  }
  std::thread closer([&] {
    std::mt19937_64 rng(7);
    while (!stop) {
      for (const SessionSnapshot& s : manager_->ListSessions()) {
        if (rng() % 3 != 0) continue;
        manager_->CloseSession(s.id, "closed by the test", absl::Seconds(5));
        ++closed_by_other;
      }
      absl::SleepFor(absl::Microseconds(300));
    }
  });
  for (std::thread& th : threads) th.join();
  stop = true;
  closer.join();

  EXPECT_GT(accepted.load(), 0u);
  EXPECT_TRUE(manager_->ListSessions().empty());
  EXPECT_TRUE(manager_->ListAttachments().empty());
  EXPECT_EQ(pool_->attachments(), 0u);
  const TransferCounters c = manager_->counters();
  EXPECT_EQ(c.tickets_in_flight, 0u);
  EXPECT_EQ(c.tickets_done + c.tickets_failed, accepted.load());
  EXPECT_EQ(pool_->allocator().free_pages(), pool_->page_num());
  // The pool can go now that nothing holds it.
  EXPECT_TRUE(registry_->Delete("kv").ok());
}

}  // namespace
}  // namespace kvhost
