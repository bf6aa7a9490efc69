// NodeCache (server/cache/node_cache.h) over the host engine: two engine
// instances (two sessions, two attachments of the cache's pool, two emulated
// device pools) share pages byte-exact; a store whose session ends in flight
// publishes nothing and leaks nothing; a restore pins what it reads; bad
// calls change nothing; the L3 tier behind it (a FakeBackend): keys written
// through and fetched back byte-exact, a bad record or a lost one a miss, a
// failed write leaving the key published, a refused fetch changing nothing.
#include "server/cache/node_cache.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "domain_test_util.h"
#include "server/pool/registry.h"
#include "server/storage/fake_backend.h"
#include "server/storage/storage_tier.h"
#include "server/transfer/host_engine.h"
#include "server/transfer/transfer_manager.h"
#include "transfer_test_util.h"

namespace kvhost {
namespace {

using ::kvhost::testing::AttachByName;
using ::kvhost::testing::DeviceFile;
using ::kvhost::testing::EngineFixture;
using ::kvhost::testing::RoomyRegistryOptions;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

// The host engine, whose jobs wait while the gate is closed: a copy still in
// flight when a test acts, without timing.
class GatedEngine : public TransferEngine {
 public:
  explicit GatedEngine(HostEngineOptions options) : inner_(std::move(options)) {}
  const char* name() const override { return inner_.name(); }
  std::string PathFor(const TransferJob& job) const override { return inner_.PathFor(job); }
  absl::StatusOr<std::unique_ptr<DeviceMapping>> Open(const Pool& pool,
                                                      const ResolvedAttach& attach) override {
    return inner_.Open(pool, attach);
  }
  absl::StatusOr<std::unique_ptr<DeviceMapping>> OpenGroup(
      std::vector<std::shared_ptr<const DeviceMapping>> entries, uint32_t layer_num,
      uint32_t load_event_sets) override {
    return inner_.OpenGroup(std::move(entries), layer_num, load_event_sets);
  }
  absl::Status Prepare(TransferJob* job) override { return inner_.Prepare(job); }
  void Submit(TransferJob job) override {
    {
      absl::MutexLock lock(&mu_);
      if (closed_) {
        held_.push_back(std::move(job));
        return;
      }
    }
    inner_.Submit(std::move(job));
  }
  void Drain() override {
    Open();
    inner_.Drain();
  }
  void Close() {
    absl::MutexLock lock(&mu_);
    closed_ = true;
  }
  void Open() {
    std::vector<TransferJob> jobs;
    {
      absl::MutexLock lock(&mu_);
      closed_ = false;
      jobs.swap(held_);
    }
    for (TransferJob& job : jobs) inner_.Submit(std::move(job));
  }

 private:
  HostEngine inner_;
  absl::Mutex mu_;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<TransferJob> held_ ABSL_GUARDED_BY(mu_);
};

class NodeCacheTest : public EngineFixture {
 protected:
  void SetUp() override {
    EngineFixture::SetUp();
    registry_ = std::make_unique<PoolRegistry>(RoomyRegistryOptions(dir_.path()));
    absl::StatusOr<std::shared_ptr<Pool>> pool = registry_->Create("cache", spec_);
    ASSERT_TRUE(pool.ok()) << pool.status();
    cache_pool_ = *pool;
    auto engine = std::make_unique<GatedEngine>(Options());
    engine_ = engine.get();
    manager_ = std::make_unique<TransferManager>(std::move(engine));
    cache_ = NodeCache::Create(cache_pool_, manager_.get(), CacheLimits{});
    dev_b_ = DeviceFile::Create(dir_.path() + "/device-b", cache_pool_->layout(), kRows);
    ASSERT_NE(dev_b_.region, nullptr);
    a_ = Instance(dev_);
    b_ = Instance(dev_b_);
    ps_ = cache_pool_->page_size();
  }
  void TearDown() override {
    manager_->Drain();
    cache_.reset();
    manager_.reset();
    registry_.reset();
  }

  struct Engine {
    Caller caller;
    std::string attachment;
    const DeviceFile* device = nullptr;
  };
  // An engine instance: a session and an attachment of the cache's pool.
  Engine Instance(const DeviceFile& device) {
    Engine e;
    const std::string session = manager_->OpenSession("engine", 1, "test");
    AttachRequest request = device.Request(cache_pool_->layout().planes);
    request.session_id = session;
    absl::StatusOr<AttachmentInfo> att = AttachByName(*manager_, *registry_, "cache", request);
    EXPECT_TRUE(att.ok()) << att.status();
    if (att.ok()) e.attachment = att->id;
    e.caller.sessions = {session};
    e.device = &device;
    return e;
  }
  // Device rows [first, first + n).
  static std::vector<int64_t> Rows(int64_t first, int64_t n) {
    std::vector<int64_t> rows(n);
    for (int64_t i = 0; i < n; ++i) rows[i] = first + i;
    return rows;
  }
  // Fills device rows with bytes from `seed`.
  void Fill(const DeviceFile& d, int64_t first, int64_t n, uint8_t seed) {
    const uint64_t planes = cache_pool_->layout().planes;
    for (uint64_t p = 0; p < planes; ++p) {
      for (uint64_t l = 0; l < d.layers; ++l) {
        uint8_t* row = d.region->data() + d.LayerOffset(p, l) + first * d.row_bytes;
        for (uint64_t i = 0; i < n * d.row_bytes; ++i)
          row[i] = static_cast<uint8_t>(seed + p + l + i);
      }
    }
  }
  // Whether rows [a_first, +n) of `a` equal rows [b_first, +n) of `b`, in
  // every plane and layer.
  bool Same(const DeviceFile& a, int64_t a_first, const DeviceFile& b, int64_t b_first, int64_t n) {
    const uint64_t planes = cache_pool_->layout().planes;
    for (uint64_t p = 0; p < planes; ++p) {
      for (uint64_t l = 0; l < a.layers; ++l) {
        if (std::memcmp(a.region->data() + a.LayerOffset(p, l) + a_first * a.row_bytes,
                        b.region->data() + b.LayerOffset(p, l) + b_first * b.row_bytes,
                        n * a.row_bytes) != 0) {
          return false;
        }
      }
    }
    return true;
  }
  static absl::Status Wait(const std::shared_ptr<Ticket>& ticket) {
    if (!ticket->WaitUntil(absl::Now() + absl::Seconds(30))) {
      return absl::DeadlineExceededError("ticket");
    }
    return ticket->Snapshot().status;
  }

  std::unique_ptr<PoolRegistry> registry_;
  std::shared_ptr<Pool> cache_pool_;
  GatedEngine* engine_ = nullptr;
  std::unique_ptr<TransferManager> manager_;
  std::shared_ptr<NodeCache> cache_;
  DeviceFile dev_b_;
  Engine a_, b_;
  int64_t ps_ = 0;
};

TEST_F(NodeCacheTest, AnotherInstanceRestoresWhatOneStoredByteExact) {
  const std::vector<std::string> keys = {"h0", "h1", "h2"};
  Fill(dev_, 0, 3 * ps_, 11);
  absl::StatusOr<NodeCache::Stored> stored =
      cache_->Store(a_.caller, a_.attachment, keys, Rows(0, 3 * ps_), "");
  ASSERT_TRUE(stored.ok()) << stored.status();
  ASSERT_NE(stored->ticket, nullptr);
  ASSERT_TRUE(Wait(stored->ticket).ok());

  absl::StatusOr<CacheLookup> found = cache_->Lookup(b_.caller, {"h0", "h1", "h2", "h3"}, false);
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_EQ(found->prefix, 3u);
  // Instance b restores into other rows of its own device pool.
  absl::StatusOr<std::shared_ptr<Ticket>> restored =
      cache_->Restore(b_.caller, b_.attachment, keys, Rows(2 * ps_, 3 * ps_), "");
  ASSERT_TRUE(restored.ok()) << restored.status();
  ASSERT_TRUE(Wait(*restored).ok());
  EXPECT_EQ((*restored)->Snapshot().layers_done, cache_pool_->spec().layer_num);
  EXPECT_TRUE(Same(dev_, 0, dev_b_, 2 * ps_, 3 * ps_));
  EXPECT_EQ(cache_->stats().pinned, 0u);  // the restore's pin ended with it
}

TEST_F(NodeCacheTest, AStoreSkipsWhatIsPresentAndAKeyIsWrittenOnce) {
  Fill(dev_, 0, 2 * ps_, 3);
  absl::StatusOr<NodeCache::Stored> first =
      cache_->Store(a_.caller, a_.attachment, {"x"}, Rows(0, ps_), "");
  ASSERT_TRUE(first.ok());
  ASSERT_TRUE(Wait(first->ticket).ok());
  Fill(dev_b_, 0, 2 * ps_, 99);
  absl::StatusOr<NodeCache::Stored> second =
      cache_->Store(b_.caller, b_.attachment, {"x", "y"}, Rows(0, 2 * ps_), "");
  ASSERT_TRUE(second.ok());
  EXPECT_THAT(second->plan.states, ElementsAre(CacheKeyState::kPresent, CacheKeyState::kAbsent));
  EXPECT_THAT(second->plan.written, ElementsAre(1));
  ASSERT_TRUE(Wait(second->ticket).ok());
  // x keeps a's bytes: restore both into a's rows [4ps, 6ps).
  absl::StatusOr<std::shared_ptr<Ticket>> restored =
      cache_->Restore(a_.caller, a_.attachment, {"x", "y"}, Rows(4 * ps_, 2 * ps_), "");
  ASSERT_TRUE(restored.ok());
  ASSERT_TRUE(Wait(*restored).ok());
  EXPECT_TRUE(Same(dev_, 0, dev_, 4 * ps_, ps_));
  EXPECT_TRUE(Same(dev_b_, ps_, dev_, 5 * ps_, ps_));
}

TEST_F(NodeCacheTest, AStoreWhoseSessionEndsInFlightPublishesNothingAndLeaksNothing) {
  const uint64_t free_before = cache_pool_->allocator().free_pages();
  engine_->Close();
  absl::StatusOr<NodeCache::Stored> stored =
      cache_->Store(a_.caller, a_.attachment, {"k0", "k1"}, Rows(0, 2 * ps_), "");
  ASSERT_TRUE(stored.ok()) << stored.status();
  EXPECT_EQ(cache_->stats().writing, 2u);
  cache_->SessionEnded(a_.caller.sessions[0]);
  // Its pages stay reserved while the copy may still write them.
  EXPECT_EQ(cache_pool_->allocator().free_pages(), free_before - 2);
  engine_->Open();
  (void)Wait(stored->ticket);
  absl::StatusOr<CacheLookup> found = cache_->Lookup(b_.caller, {"k0", "k1"}, false);
  ASSERT_TRUE(found.ok());
  EXPECT_THAT(found->states, ElementsAre(CacheKeyState::kAbsent, CacheKeyState::kAbsent));
  EXPECT_EQ(cache_pool_->allocator().free_pages(), free_before);
  EXPECT_EQ(cache_->stats().aborted, 2u);
  EXPECT_TRUE(cache_->EventsSince(0, 10).events.empty());
}

TEST_F(NodeCacheTest, ARestoreKeepsItsPagesFromEvictionUntilItEnds) {
  Fill(dev_, 0, ps_, 5);
  absl::StatusOr<NodeCache::Stored> stored =
      cache_->Store(a_.caller, a_.attachment, {"p"}, Rows(0, ps_), "");
  ASSERT_TRUE(stored.ok());
  ASSERT_TRUE(Wait(stored->ticket).ok());
  engine_->Close();
  absl::StatusOr<std::shared_ptr<Ticket>> restored =
      cache_->Restore(b_.caller, b_.attachment, {"p"}, Rows(0, ps_), "");
  ASSERT_TRUE(restored.ok());
  absl::StatusOr<std::vector<CacheEvictOutcome>> evict = cache_->Evict({"p"});
  ASSERT_TRUE(evict.ok());
  EXPECT_THAT(*evict, ElementsAre(CacheEvictOutcome::kBusy));
  // Even its session's end does not unpin what the copy reads.
  cache_->SessionEnded(b_.caller.sessions[0]);
  EXPECT_EQ(cache_->stats().pinned, 1u);
  engine_->Open();
  ASSERT_TRUE(Wait(*restored).ok());
  EXPECT_EQ(cache_->stats().pinned, 0u);
  evict = cache_->Evict({"p"});
  ASSERT_TRUE(evict.ok());
  EXPECT_THAT(*evict, ElementsAre(CacheEvictOutcome::kEvicted));
}

TEST_F(NodeCacheTest, LookupPinsLastUntilReleasedOrTheSessionEnds) {
  Fill(dev_, 0, ps_, 5);
  absl::StatusOr<NodeCache::Stored> stored =
      cache_->Store(a_.caller, a_.attachment, {"p"}, Rows(0, ps_), "");
  ASSERT_TRUE(stored.ok());
  ASSERT_TRUE(Wait(stored->ticket).ok());
  absl::StatusOr<CacheLookup> pinned = cache_->Lookup(b_.caller, {"p"}, true);
  ASSERT_TRUE(pinned.ok());
  ASSERT_NE(pinned->pin_id, 0u);
  EXPECT_EQ(cache_->ReleasePin(a_.caller, pinned->pin_id).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(cache_->stats().pinned, 1u);
  cache_->SessionEnded(b_.caller.sessions[0]);
  EXPECT_EQ(cache_->stats().pinned, 0u);
  EXPECT_EQ(cache_->ReleasePin(b_.caller, pinned->pin_id).code(), absl::StatusCode::kNotFound);
}

TEST_F(NodeCacheTest, BadCallsAreRefusedAndChangeNothing) {
  const CacheStats before = cache_->stats();
  const uint64_t free_before = cache_pool_->allocator().free_pages();
  // No session.
  absl::Status none = cache_->Store(Caller{}, a_.attachment, {"k"}, Rows(0, ps_), "").status();
  EXPECT_EQ(none.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(none.message(), HasSubstr("no open session"));
  // Rows that are not a page per key.
  absl::Status rows = cache_->Store(a_.caller, a_.attachment, {"k"}, Rows(0, ps_ - 1), "").status();
  EXPECT_EQ(rows.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(rows.message(), HasSubstr("device rows for 1 keys"));
  // Another instance's attachment (a's id, b's session): NOT_FOUND, as for
  // an unknown id.
  EXPECT_EQ(cache_->Store(b_.caller, a_.attachment, {"k"}, Rows(0, ps_), "").status().code(),
            absl::StatusCode::kNotFound);
  // A key twice.
  EXPECT_EQ(
      cache_->Store(a_.caller, a_.attachment, {"k", "k"}, Rows(0, 2 * ps_), "").status().code(),
      absl::StatusCode::kInvalidArgument);
  // Rows out of the device pool's range: Submit refuses, the reservation goes.
  absl::Status range =
      cache_->Store(a_.caller, a_.attachment, {"k"}, Rows(kRows, ps_), "").status();
  EXPECT_EQ(range.code(), absl::StatusCode::kInvalidArgument) << range;
  // Restoring a key not present.
  absl::Status absent = cache_->Restore(a_.caller, a_.attachment, {"k"}, Rows(0, ps_), "").status();
  EXPECT_EQ(absent.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(absent.message(), HasSubstr("key 0 is not present"));
  const CacheStats after = cache_->stats();
  EXPECT_EQ(after.published, before.published);
  EXPECT_EQ(after.writing, 0u);
  EXPECT_EQ(after.pinned, 0u);
  // A refused restore counts no hit or miss.
  EXPECT_EQ(after.hits, before.hits);
  EXPECT_EQ(after.misses, before.misses);
  EXPECT_EQ(cache_pool_->allocator().free_pages(), free_before);
}

TEST_F(NodeCacheTest, ARestoreCountsItsHitsOnceItsCopiesAreAccepted) {
  absl::StatusOr<NodeCache::Stored> stored =
      cache_->Store(a_.caller, a_.attachment, {"x", "y"}, Rows(0, 2 * ps_), "");
  ASSERT_TRUE(stored.ok()) << stored.status();
  ASSERT_TRUE(Wait(stored->ticket).ok());
  const CacheStats before = cache_->stats();
  // Present keys, but rows out of the device pool's range: refused by
  // Submit, after the index found them: still no hit counted.
  absl::Status range =
      cache_->Restore(a_.caller, a_.attachment, {"x", "y"}, Rows(kRows, 2 * ps_), "").status();
  EXPECT_EQ(range.code(), absl::StatusCode::kInvalidArgument) << range;
  EXPECT_EQ(cache_->stats().hits, before.hits);
  EXPECT_EQ(cache_->stats().pinned, 0u);
  absl::StatusOr<std::shared_ptr<Ticket>> ticket =
      cache_->Restore(a_.caller, a_.attachment, {"x", "y"}, Rows(2 * ps_, 2 * ps_), "");
  ASSERT_TRUE(ticket.ok()) << ticket.status();
  EXPECT_EQ(cache_->stats().hits, before.hits + 2);
  EXPECT_EQ(cache_->stats().misses, before.misses);
  ASSERT_TRUE(Wait(*ticket).ok());
}

// The L3 tier behind the cache: a StorageTier on a FakeBackend.
class NodeCacheL3Test : public NodeCacheTest {
 protected:
  void SetUp() override {
    NodeCacheTest::SetUp();
    StartTier(StorageTierOptions{});
  }
  void TearDown() override {
    tier_.reset();  // finishes its calls, whose callbacks hold the cache
    NodeCacheTest::TearDown();
  }
  void StartTier(const StorageTierOptions& options) {
    auto fake = std::make_unique<FakeBackend>(1 << 20);
    fake_ = fake.get();
    tier_ = std::make_shared<StorageTier>(std::move(fake), options, secret_);
    l3_ = CacheL3{tier_, secret_.PublicNamespace()};
  }
  // Stores `keys` from a's rows [0, +keys pages), written through, and waits
  // until the tier is done with them (no pin left).
  void StoreThrough(const std::vector<std::string>& keys) {
    Fill(dev_, 0, static_cast<int64_t>(keys.size()) * ps_, 23);
    absl::StatusOr<NodeCache::Stored> stored = cache_->Store(
        a_.caller, a_.attachment, keys, Rows(0, static_cast<int64_t>(keys.size()) * ps_), "", &l3_);
    ASSERT_TRUE(stored.ok()) << stored.status();
    ASSERT_NE(stored->ticket, nullptr);
    ASSERT_TRUE(Wait(stored->ticket).ok());
    ASSERT_TRUE(Eventually([&] { return cache_->stats().pinned == 0; }));
  }
  // Whether `done` holds within 10 s.
  template <typename F>
  static bool Eventually(F done) {
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (!done()) {
      if (absl::Now() > deadline) return false;
      absl::SleepFor(absl::Milliseconds(2));
    }
    return true;
  }
  std::string PartZero(const std::string& key) const {
    return PartKey(secret_.CacheKey(l3_.ns, key), 0);
  }

  const L3Secret secret_ = L3Secret::FromBytes("a test secret of at least 32 bytes!");
  FakeBackend* fake_ = nullptr;
  std::shared_ptr<StorageTier> tier_;
  CacheL3 l3_;
};

TEST_F(NodeCacheL3Test, KeysWrittenThroughAreFetchedBackByteExact) {
  const std::vector<std::string> keys = {"h0", "h1"};
  ASSERT_NO_FATAL_FAILURE(StoreThrough(keys));
  EXPECT_EQ(cache_->stats().l3_written, 2u);
  EXPECT_TRUE(fake_->Has(PartZero("h0")));
  EXPECT_TRUE(fake_->Has(PartZero("h1")));
  // Gone from the node, still in L3: fetched back with a key nobody stored.
  absl::StatusOr<std::vector<CacheEvictOutcome>> evicted = cache_->Evict(keys);
  ASSERT_TRUE(evicted.ok()) << evicted.status();
  const uint64_t hits = cache_->stats().hits;
  absl::StatusOr<std::vector<size_t>> fetching = cache_->FetchMissing(l3_, {"h0", "h1", "nope"});
  ASSERT_TRUE(fetching.ok()) << fetching.status();
  EXPECT_THAT(*fetching, ElementsAre(0u, 1u, 2u));
  ASSERT_TRUE(Eventually([&] { return cache_->stats().writing == 0; }));
  const CacheStats stats = cache_->stats();
  EXPECT_EQ(stats.l3_fetched, 2u);
  EXPECT_EQ(stats.l3_missed, 1u);
  EXPECT_EQ(stats.hits, hits);  // the write-through's pins are not lookups
  absl::StatusOr<CacheLookup> found = cache_->Lookup(b_.caller, {"h0", "h1", "nope"}, false);
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_THAT(found->states, ElementsAre(CacheKeyState::kPresent, CacheKeyState::kPresent,
                                         CacheKeyState::kAbsent));
  absl::StatusOr<std::shared_ptr<Ticket>> restored =
      cache_->Restore(b_.caller, b_.attachment, keys, Rows(4 * ps_, 2 * ps_), "");
  ASSERT_TRUE(restored.ok()) << restored.status();
  ASSERT_TRUE(Wait(*restored).ok());
  EXPECT_TRUE(Same(dev_, 0, dev_b_, 4 * ps_, 2 * ps_));
  // Present keys are not fetched again.
  fetching = cache_->FetchMissing(l3_, keys);
  ASSERT_TRUE(fetching.ok()) << fetching.status();
  EXPECT_TRUE(fetching->empty());
}

TEST_F(NodeCacheL3Test, ABadOrLostRecordIsAMissAndAFailedWriteLeavesTheKeyPublished) {
  ASSERT_NO_FATAL_FAILURE(StoreThrough({"h0", "h1"}));
  ASSERT_TRUE(cache_->Evict({"h0", "h1"}).ok());
  ASSERT_TRUE(fake_->Flip(PartZero("h0"), fake_->Value(PartZero("h0")).size() - 1));
  ASSERT_TRUE(fake_->Erase(PartZero("h1")));
  const uint64_t free_before = cache_pool_->allocator().free_pages();
  ASSERT_TRUE(cache_->FetchMissing(l3_, {"h0", "h1"}).ok());
  ASSERT_TRUE(Eventually([&] { return cache_->stats().writing == 0; }));
  EXPECT_EQ(cache_->stats().l3_missed, 2u);
  EXPECT_EQ(cache_->stats().published, 0u);
  EXPECT_EQ(cache_pool_->allocator().free_pages(), free_before);

  // The cluster down: the store publishes, the write-through writes nothing.
  fake_->Down(true);
  ASSERT_NO_FATAL_FAILURE(StoreThrough({"h2"}));
  EXPECT_EQ(cache_->stats().l3_written, 2u);
  absl::StatusOr<CacheLookup> found = cache_->Lookup(a_.caller, {"h2"}, false);
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_EQ(found->prefix, 1u);
}

TEST_F(NodeCacheL3Test, AFetchTheTierRefusesChangesNothing) {
  tier_.reset();
  StorageTierOptions options;
  options.max_pages_in_flight = 1;
  StartTier(options);
  const CacheStats before = cache_->stats();
  const uint64_t free_before = cache_pool_->allocator().free_pages();
  absl::Status over = cache_->FetchMissing(l3_, {"a", "b"}).status();
  EXPECT_EQ(over.code(), absl::StatusCode::kResourceExhausted) << over;
  EXPECT_THAT(over.message(), HasSubstr("L3 fetch of 2 key(s)"));
  // A key over the tier's bound.
  absl::Status long_key = cache_->FetchMissing(l3_, {std::string(200, 'k')}).status();
  EXPECT_EQ(long_key.code(), absl::StatusCode::kInvalidArgument) << long_key;
  // The tier gone (kvhostd stopping).
  CacheL3 gone = l3_;
  tier_.reset();
  EXPECT_EQ(cache_->FetchMissing(gone, {"a"}).status().code(),
            absl::StatusCode::kFailedPrecondition);
  const CacheStats after = cache_->stats();
  EXPECT_EQ(after.published, before.published);
  EXPECT_EQ(after.writing, 0u);
  EXPECT_EQ(after.stored, before.stored);
  EXPECT_EQ(after.aborted, before.aborted);
  EXPECT_EQ(cache_pool_->allocator().free_pages(), free_before);
  absl::StatusOr<CacheLookup> found = cache_->Lookup(a_.caller, {"a", "b"}, false);
  ASSERT_TRUE(found.ok());
  EXPECT_THAT(found->states, ElementsAre(CacheKeyState::kAbsent, CacheKeyState::kAbsent));
}

}  // namespace
}  // namespace kvhost
