// NodeCaches (server/cache/node_caches.h): one cache per node-cache pool
// object, the same on every call; a deleted pool's cache dropped, a pool made
// again under the name a new, empty cache; session ends reach every cache.
#include "server/cache/node_caches.h"

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "domain_test_util.h"
#include "server/pool/registry.h"
#include "server/transfer/host_engine.h"
#include "server/transfer/transfer_manager.h"
#include "transfer_test_util.h"

namespace kvhost {
namespace {

using ::kvhost::testing::AttachByName;
using ::kvhost::testing::EngineFixture;
using ::kvhost::testing::RoomyRegistryOptions;

class NodeCachesTest : public EngineFixture {
 protected:
  void SetUp() override {
    EngineFixture::SetUp();
    registry_ = std::make_unique<PoolRegistry>(RoomyRegistryOptions(dir_.path()));
    manager_ = std::make_unique<TransferManager>(std::make_unique<HostEngine>(Options()));
    caches_ = std::make_unique<NodeCaches>(manager_.get());
    spec_.node_cache = true;
  }
  void TearDown() override {
    caches_.reset();
    manager_.reset();
    registry_.reset();
  }
  std::shared_ptr<Pool> Create(const std::string& name) {
    absl::StatusOr<std::shared_ptr<Pool>> pool = registry_->Create(name, spec_);
    EXPECT_TRUE(pool.ok()) << pool.status();
    return pool.ok() ? *pool : nullptr;
  }

  std::unique_ptr<PoolRegistry> registry_;
  std::unique_ptr<TransferManager> manager_;
  std::unique_ptr<NodeCaches> caches_;
};

TEST_F(NodeCachesTest, OnePoolObjectHasOneCache) {
  std::shared_ptr<Pool> a = Create("a");
  std::shared_ptr<Pool> b = Create("b");
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  std::shared_ptr<NodeCache> first = caches_->For(a);
  EXPECT_EQ(caches_->For(a), first);
  EXPECT_NE(caches_->For(b), first);
  EXPECT_EQ(first->pool(), a);
  EXPECT_EQ(caches_->size(), 2u);
}

TEST_F(NodeCachesTest, ADeletedPoolsCacheGoesAndANewPoolGetsANewOne) {
  std::shared_ptr<Pool> a = Create("a");
  ASSERT_NE(a, nullptr);
  std::weak_ptr<NodeCache> old = caches_->For(a);
  ASSERT_TRUE(registry_->Delete("a").ok());
  a.reset();
  std::shared_ptr<Pool> again = Create("a");
  ASSERT_NE(again, nullptr);
  std::shared_ptr<NodeCache> fresh = caches_->For(again);
  EXPECT_TRUE(old.expired());  // dropped at this call: its pool retired
  EXPECT_EQ(fresh->pool(), again);
  EXPECT_EQ(fresh->stats().published, 0u);
  EXPECT_EQ(caches_->size(), 1u);
}

TEST_F(NodeCachesTest, ASessionsEndReachesEveryCache) {
  const std::string session = manager_->OpenSession("engine", 1, "test");
  Caller caller;
  caller.sessions = {session};
  const int64_t ps = static_cast<int64_t>(spec_.page_size);
  std::vector<int64_t> rows(ps);
  for (int64_t r = 0; r < ps; ++r) rows[r] = r;
  std::vector<std::shared_ptr<NodeCache>> caches;
  for (const char* name : {"a", "b"}) {
    ASSERT_NE(Create(name), nullptr);
    AttachRequest request = dev_.Request(pool_->layout().planes);
    request.session_id = session;
    absl::StatusOr<AttachmentInfo> att = AttachByName(*manager_, *registry_, name, request);
    ASSERT_TRUE(att.ok()) << att.status();
    std::shared_ptr<NodeCache> cache = caches_->For(*registry_->GetPoolOrAnchor(name));
    absl::StatusOr<NodeCache::Stored> stored = cache->Store(caller, att->id, {"k"}, rows, "");
    ASSERT_TRUE(stored.ok()) << stored.status();
    ASSERT_TRUE(stored->ticket->WaitUntil(absl::Now() + absl::Seconds(30)));
    absl::StatusOr<CacheLookup> pinned = cache->Lookup(caller, {"k"}, true);
    ASSERT_TRUE(pinned.ok()) << pinned.status();
    EXPECT_NE(pinned->pin_id, 0u);
    EXPECT_EQ(cache->stats().pinned, 1u);
    caches.push_back(cache);
  }
  caches_->SessionEnded(session);
  for (const std::shared_ptr<NodeCache>& cache : caches) {
    EXPECT_EQ(cache->stats().pinned, 0u) << cache->name();
    EXPECT_EQ(cache->stats().published, 1u) << cache->name();
  }
  manager_->CloseSession(session, "test", absl::Seconds(1));
}

}  // namespace
}  // namespace kvhost
