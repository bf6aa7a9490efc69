// The L3 tier behind the node cache, end to end: two kvhostds on one local
// memcached server (tests/memcached_cluster.h) as two nodes of a fleet.
// Node A stores keys written through to L3; node B's lookup with
// fetch_missing reports them PENDING, then PRESENT (with STORED events), and
// B restores A's bytes byte-exact; a key nobody stored reads ABSENT again. A
// kvhostd without --l3-memcached refuses both flags, its cache unchanged.
// Skipped, saying why, where no memcached binary exists (CI installs it).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "cache_instance.h"
#include "daemon_fixture.h"
#include "kvhost/client.h"
#include "memcached_cluster.h"

namespace kvhost::testing {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// How long a test waits for the tier's background work.
constexpr absl::Duration kPatience = absl::Seconds(20);

class CacheL3Test : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<MemcachedCluster>> cluster = MemcachedCluster::Start(1);
    if (cluster.status().code() == absl::StatusCode::kNotFound) {
      GTEST_SKIP() << cluster.status().message();
    }
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = *std::move(cluster);
  }
  void TearDown() override {
    for (TestDaemon* d : {a_.get(), b_.get()}) {
      if (d != nullptr && HasFailure()) {
        std::string log = d->Log();
        if (log.size() > 4000) log = "..." + log.substr(log.size() - 4000);
        std::fprintf(stderr, "--- kvhostd log (tail) ---\n%s\n", log.c_str());
      }
    }
  }
  // A kvhostd (with L3 or without) whose node cache kCache exists.
  std::unique_ptr<TestDaemon> StartNode(bool l3) {
    std::vector<std::string> flags;
    if (l3) flags = {absl::StrCat("--l3-memcached=", cluster_->Servers()), secret_.Flag()};
    absl::StatusOr<std::unique_ptr<TestDaemon>> d = TestDaemon::Start(KVHOSTD_PATH, flags);
    EXPECT_TRUE(d.ok()) << d.status();
    if (!d.ok()) return nullptr;
    ClientOptions options;
    options.address = (*d)->address();
    options.owner_token = kToken;
    options.worker_session = false;
    absl::StatusOr<std::unique_ptr<Client>> admin = Client::Connect(options);
    EXPECT_TRUE(admin.ok()) << admin.status();
    if (admin.ok()) {
      absl::StatusOr<v1::Pool> pool = (*admin)->CreatePool(kCache, CacheSpec(64));
      EXPECT_TRUE(pool.ok()) << pool.status();
    }
    return *std::move(d);
  }
  static v1::CacheStats Stats(const Instance& i) {
    absl::StatusOr<v1::CacheStats> stats = i.client->GetCacheStats(kCache);
    EXPECT_TRUE(stats.ok()) << stats.status();
    return stats.ok() ? *stats : v1::CacheStats();
  }
  // Polls `done` until it holds or kPatience passed.
  template <typename F>
  static bool Eventually(F done) {
    const absl::Time deadline = absl::Now() + kPatience;
    while (!done()) {
      if (absl::Now() > deadline) return false;
      absl::SleepFor(absl::Milliseconds(20));
    }
    return true;
  }

  std::unique_ptr<MemcachedCluster> cluster_;
  L3SecretFile secret_;
  std::unique_ptr<TestDaemon> a_, b_;
};

TEST_F(CacheL3Test, ANodeFetchesWhatAnotherWroteThroughByteExact) {
  a_ = StartNode(true);
  b_ = StartNode(true);
  ASSERT_NE(a_, nullptr);
  ASSERT_NE(b_, nullptr);
  absl::StatusOr<std::unique_ptr<Instance>> on_a = Instance::Start(a_->address(), a_->shm_dir());
  ASSERT_TRUE(on_a.ok()) << on_a.status();
  absl::StatusOr<std::unique_ptr<Instance>> on_b = Instance::Start(b_->address(), b_->shm_dir());
  ASSERT_TRUE(on_b.ok()) << on_b.status();
  Instance& a = **on_a;
  Instance& b = **on_b;

  const std::vector<std::string> keys = Keys("block-", 0, 3);
  for (uint64_t p = 0; p < 3; ++p) a.FillPage(p, static_cast<uint8_t>(50 + p));
  absl::StatusOr<v1::CacheStoreReply> stored =
      a.client->CacheStore(kCache, a.attachment, keys, PageRows(0, 3), "", /*write_through=*/true);
  ASSERT_TRUE(stored.ok()) << stored.status();
  ASSERT_TRUE(stored->has_ticket());
  ASSERT_TRUE(a.client->WaitTransfer(stored->ticket().id()).ok());
  ASSERT_TRUE(Eventually([&] { return Stats(a).l3_written() == 3; })) << Stats(a).l3_written();
  EXPECT_TRUE(Eventually([&] { return Stats(a).pinned() == 0; }));

  std::vector<std::string> asked = keys;
  asked.push_back("nobody-stored-this");
  absl::StatusOr<v1::CacheLookupReply> found =
      b.client->CacheLookup(kCache, asked, /*pin=*/false, /*fetch_missing=*/true);
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_EQ(found->prefix(), 0u);
  EXPECT_EQ(found->fetching(), 4u);
  EXPECT_THAT(found->states(), ElementsAre(v1::CACHE_KEY_PENDING, v1::CACHE_KEY_PENDING,
                                           v1::CACHE_KEY_PENDING, v1::CACHE_KEY_PENDING));
  ASSERT_TRUE(Eventually([&] {
    absl::StatusOr<v1::CacheLookupReply> now = b.client->CacheLookup(kCache, asked);
    return now.ok() && now->prefix() == 3 && now->states(3) == v1::CACHE_KEY_ABSENT;
  }));
  const v1::CacheStats stats = Stats(b);
  EXPECT_EQ(stats.l3_fetched(), 3u);
  EXPECT_EQ(stats.l3_missed(), 1u);
  EXPECT_EQ(stats.writing(), 0u);
  absl::StatusOr<v1::CacheEventBatch> events = b.client->ReadCacheEvents(kCache, 0);
  ASSERT_TRUE(events.ok()) << events.status();
  std::vector<std::string> stored_keys;
  for (const v1::CacheEvent& e : events->events()) {
    if (e.kind() == v1::CacheEvent::STORED) stored_keys.push_back(e.key());
  }
  EXPECT_THAT(stored_keys, ::testing::UnorderedElementsAreArray(keys));

  ASSERT_TRUE(b.Restore(keys, 8).ok());
  for (uint64_t p = 0; p < 3; ++p) EXPECT_TRUE(b.PageIs(8 + p, static_cast<uint8_t>(50 + p)));
}

TEST_F(CacheL3Test, WithoutL3BothFlagsAreRefusedAndChangeNothing) {
  a_ = StartNode(false);
  ASSERT_NE(a_, nullptr);
  absl::StatusOr<std::unique_ptr<Instance>> on_a = Instance::Start(a_->address(), a_->shm_dir());
  ASSERT_TRUE(on_a.ok()) << on_a.status();
  Instance& a = **on_a;
  const v1::CacheStats before = Stats(a);
  const std::vector<std::string> keys = Keys("k", 0, 2);
  absl::Status store =
      a.client->CacheStore(kCache, a.attachment, keys, PageRows(0, 2), "", /*write_through=*/true)
          .status();
  EXPECT_EQ(store.code(), absl::StatusCode::kFailedPrecondition) << store;
  EXPECT_THAT(store.message(), HasSubstr("--l3-memcached"));
  absl::Status lookup = a.client->CacheLookup(kCache, keys, false, /*fetch_missing=*/true).status();
  EXPECT_EQ(lookup.code(), absl::StatusCode::kFailedPrecondition) << lookup;
  EXPECT_THAT(lookup.message(), HasSubstr("--l3-memcached"));
  const v1::CacheStats after = Stats(a);
  EXPECT_EQ(after.published(), before.published());
  EXPECT_EQ(after.writing(), 0u);
  EXPECT_EQ(after.stored(), before.stored());
  EXPECT_EQ(after.free_pages(), before.free_pages());
  EXPECT_EQ(after.hits() + after.misses(), before.hits() + before.misses());
  absl::StatusOr<v1::CacheLookupReply> found = a.client->CacheLookup(kCache, keys);
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_THAT(found->states(), ElementsAre(v1::CACHE_KEY_ABSENT, v1::CACHE_KEY_ABSENT));
}

}  // namespace
}  // namespace kvhost::testing
