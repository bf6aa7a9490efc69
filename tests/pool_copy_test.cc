// Pool-to-pool copies (server/transfer/pool_copy.h) and the node cache's
// Store from / Restore to a pool on them (NodeCache::StoreFromPool /
// RestoreToPool): a page stored from a PAGE_FIRST pool comes back byte-exact
// into a LAYER_FIRST one; skips and pins as the attachment's Store and
// Restore; each refusal (shape, slots, claim, keys) names its value and
// changes nothing; a pool deleted while a copy runs keeps its memory until
// the copy ends.
#include "server/transfer/pool_copy.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "domain_test_util.h"
#include "server/cache/node_cache.h"
#include "server/pool/registry.h"
#include "server/transfer/host_engine.h"
#include "server/transfer/transfer_manager.h"
#include "transfer_test_util.h"

namespace kvhost {
namespace {

using ::kvhost::testing::Msg;
using ::kvhost::testing::RoomyRegistryOptions;
using ::kvhost::testing::Shape;
using ::kvhost::testing::SpecOf;
using ::kvhost::testing::TransferShmDir;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr uint32_t kPage = 4;

class PoolCopyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    registry_ = std::make_unique<PoolRegistry>(RoomyRegistryOptions(dir_.path()));
    cache_pool_ = Create("cache", LayoutKind::kPageFirst, 8);
    src_ = Create("src", LayoutKind::kPageFirst, 8);
    dst_ = Create("dst", LayoutKind::kLayerFirst, 8);
    HostEngineOptions options;
    options.shm_dir = dir_.path();
    manager_ = std::make_unique<TransferManager>(std::make_unique<HostEngine>(options));
    cache_ = NodeCache::Create(cache_pool_, manager_.get(), CacheLimits{});
    caller_.sessions = {manager_->OpenSession("engine", 1, "test")};
  }
  void TearDown() override {
    manager_->Drain();
    cache_.reset();
    manager_.reset();
    registry_.reset();
  }

  std::shared_ptr<Pool> Create(const std::string& name, LayoutKind layout, uint64_t pages,
                               uint32_t layers = 3, uint32_t heads = 2) {
    absl::StatusOr<std::shared_ptr<Pool>> pool = registry_->Create(
        name, SpecOf(Shape{"m", PoolKind::kMha, layout, layers, heads, 8, kPage, pages}));
    EXPECT_TRUE(pool.ok()) << pool.status();
    return pool.ok() ? *pool : nullptr;
  }
  // `pages` pages of `pool`, allocated: their slots in order.
  static std::vector<int64_t> Alloc(Pool& pool, uint64_t pages) {
    absl::StatusOr<std::vector<uint64_t>> got = pool.AllocPages(pages * kPage);
    EXPECT_TRUE(got.ok()) << got.status();
    std::vector<int64_t> slots;
    for (uint64_t page : *got) {
      for (uint64_t t = 0; t < kPage; ++t) slots.push_back(static_cast<int64_t>(page * kPage + t));
    }
    return slots;
  }
  // Every byte of slot `slot`'s rows (all planes and layers), in order.
  static std::vector<uint8_t> RowsOf(const Pool& pool, int64_t slot) {
    std::vector<uint8_t> out;
    const KvLayout& l = pool.layout();
    for (uint64_t p = 0; p < l.planes; ++p) {
      for (uint64_t layer = 0; layer < pool.spec().layer_num; ++layer) {
        const uint8_t* row = pool.base() + l.Offset(p, static_cast<uint64_t>(slot), layer, 0);
        out.insert(out.end(), row, row + l.token_bytes);
      }
    }
    return out;
  }
  static void Fill(Pool& pool, absl::Span<const int64_t> slots, uint8_t seed) {
    const KvLayout& l = pool.layout();
    for (int64_t slot : slots) {
      for (uint64_t p = 0; p < l.planes; ++p) {
        for (uint64_t layer = 0; layer < pool.spec().layer_num; ++layer) {
          uint8_t* row = pool.base() + l.Offset(p, static_cast<uint64_t>(slot), layer, 0);
          for (uint64_t i = 0; i < l.token_bytes; ++i) {
            row[i] = static_cast<uint8_t>(seed + slot * 7 + p * 3 + layer * 5 + i);
          }
        }
      }
    }
  }
  static bool Same(const Pool& a, absl::Span<const int64_t> a_slots, const Pool& b,
                   absl::Span<const int64_t> b_slots) {
    if (a_slots.size() != b_slots.size()) return false;
    for (size_t i = 0; i < a_slots.size(); ++i) {
      if (RowsOf(a, a_slots[i]) != RowsOf(b, b_slots[i])) return false;
    }
    return true;
  }
  static absl::Status Wait(const std::shared_ptr<Ticket>& ticket) {
    if (!ticket->WaitUntil(absl::Now() + absl::Seconds(30))) {
      return absl::DeadlineExceededError("ticket");
    }
    return ticket->Snapshot().status;
  }

  TransferShmDir dir_;
  std::unique_ptr<PoolRegistry> registry_;
  std::shared_ptr<Pool> cache_pool_, src_, dst_;
  std::unique_ptr<TransferManager> manager_;
  std::shared_ptr<NodeCache> cache_;
  Caller caller_;
};

TEST_F(PoolCopyTest, AShapeCheckNamesTheFirstDifference) {
  EXPECT_TRUE(CheckPoolCopyShape(*dst_, *cache_pool_).ok());  // layouts may differ
  std::shared_ptr<Pool> layers = Create("layers", LayoutKind::kPageFirst, 4, /*layers=*/2);
  absl::Status s = CheckPoolCopyShape(*layers, *cache_pool_);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Msg(s), HasSubstr("layer range is [0, 2), the cache's [0, 3)"));
  std::shared_ptr<Pool> heads = Create("heads", LayoutKind::kPageFirst, 4, 3, /*heads=*/1);
  s = CheckPoolCopyShape(*heads, *cache_pool_);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Msg(s), HasSubstr("16 bytes a row"));
}

TEST_F(PoolCopyTest, SlotChecksNameTheValue) {
  const std::vector<int64_t> slots = Alloc(*src_, 1);
  EXPECT_TRUE(CheckPoolCopySlots(*src_, slots, "pool.host_indices").ok());
  absl::Status s =
      CheckPoolCopySlots(*src_, std::vector<int64_t>{0, 1, 2, 99}, "pool.host_indices");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Msg(s), HasSubstr("pool.host_indices[3] = 99 out of range [0, 32)"));
  s = CheckPoolCopySlots(*src_, std::vector<int64_t>{1, 2, 3, 4}, "pool.host_indices");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Msg(s), HasSubstr("does not start a page"));
  std::vector<int64_t> twice = slots;
  twice.insert(twice.end(), slots.begin(), slots.end());
  s = CheckPoolCopySlots(*src_, twice, "pool.host_indices");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Msg(s), HasSubstr("more than once"));
  const std::vector<int64_t> free_page = {28, 29, 30, 31};  // never allocated
  s = CheckPoolCopySlots(*src_, free_page, "pool.host_indices");
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(Msg(s), HasSubstr("src"));
}

TEST_F(PoolCopyTest, StoredFromAPageFirstPoolRestoresIntoALayerFirstOneByteExact) {
  const std::vector<int64_t> from = Alloc(*src_, 3);
  Fill(*src_, from, 17);
  const std::vector<std::string> keys = {"k0", "k1", "k2"};
  absl::StatusOr<NodeCache::Stored> stored = cache_->StoreFromPool(caller_, {src_, from}, keys);
  ASSERT_TRUE(stored.ok()) << stored.status();
  ASSERT_NE(stored->ticket, nullptr);
  ASSERT_TRUE(Wait(stored->ticket).ok());
  const TicketStatus backup = stored->ticket->Snapshot();
  EXPECT_EQ(backup.path, "host-pool-copy");
  EXPECT_EQ(backup.layers_done, 3u);
  EXPECT_EQ(backup.bytes, 3 * HeldLayerBytes(*src_, 3 * kPage));  // 3 layers
  // Published when the ticket shows done; a second store skips them all.
  absl::StatusOr<NodeCache::Stored> again = cache_->StoreFromPool(caller_, {src_, from}, keys);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->ticket, nullptr);
  EXPECT_THAT(again->plan.states, ElementsAre(CacheKeyState::kPresent, CacheKeyState::kPresent,
                                              CacheKeyState::kPresent));

  // Into other slots of a pool of another layout, in another order.
  std::vector<int64_t> to = Alloc(*dst_, 3);
  Fill(*dst_, to, 200);
  const std::vector<std::string> order = {"k2", "k0", "k1"};
  absl::StatusOr<std::shared_ptr<Ticket>> restored =
      cache_->RestoreToPool(caller_, {dst_, to}, order);
  ASSERT_TRUE(restored.ok()) << restored.status();
  ASSERT_TRUE(Wait(*restored).ok());
  EXPECT_EQ((*restored)->direction(), Direction::kLoad);
  auto page = [](const std::vector<int64_t>& s, size_t i) {
    return absl::MakeConstSpan(s).subspan(i * kPage, kPage);
  };
  EXPECT_TRUE(Same(*src_, page(from, 2), *dst_, page(to, 0)));
  EXPECT_TRUE(Same(*src_, page(from, 0), *dst_, page(to, 1)));
  EXPECT_TRUE(Same(*src_, page(from, 1), *dst_, page(to, 2)));
  EXPECT_EQ(cache_->stats().pinned, 0u);  // the restore's pin ended with it
  // The session's tickets are found by it, as any transfer's.
  EXPECT_TRUE(manager_->FindTicket(caller_, (*restored)->id()).ok());
  EXPECT_FALSE(manager_->FindTicket(Caller{}, (*restored)->id()).ok());
}

TEST_F(PoolCopyTest, RefusalsNameTheValueAndChangeNothing) {
  const std::vector<int64_t> from = Alloc(*src_, 2);
  const CacheStats before = cache_->stats();
  const uint64_t free_before = cache_pool_->allocator().free_pages();
  auto unchanged = [&] {
    const CacheStats now = cache_->stats();
    EXPECT_EQ(now.published, before.published);
    EXPECT_EQ(now.writing, before.writing);
    EXPECT_EQ(now.pinned, before.pinned);
    EXPECT_EQ(cache_pool_->allocator().free_pages(), free_before);
  };
  // No session.
  absl::StatusOr<NodeCache::Stored> s = cache_->StoreFromPool(Caller{}, {src_, from}, {"a", "b"});
  EXPECT_EQ(s.status().code(), absl::StatusCode::kFailedPrecondition);
  // Slots for one key too few.
  s = cache_->StoreFromPool(caller_, {src_, absl::MakeConstSpan(from).subspan(0, kPage)},
                            {"a", "b"});
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Msg(s.status()), HasSubstr("4 slots for 2 keys; want 8"));
  // Another shape.
  std::shared_ptr<Pool> small = Create("small", LayoutKind::kPageFirst, 4, /*layers=*/2);
  const std::vector<int64_t> small_slots = Alloc(*small, 2);
  s = cache_->StoreFromPool(caller_, {small, small_slots}, {"a", "b"});
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Msg(s.status()), HasSubstr("layer range"));
  // Slots not allocated.
  const std::vector<int64_t> loose = {24, 25, 26, 27, 28, 29, 30, 31};
  s = cache_->StoreFromPool(caller_, {src_, loose}, {"a", "b"});
  EXPECT_EQ(s.status().code(), absl::StatusCode::kFailedPrecondition);
  // The cache's own pool.
  s = cache_->StoreFromPool(caller_, {cache_pool_, from}, {"a", "b"});
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Msg(s.status()), HasSubstr("the cache's own pool"));
  // A restore of keys not present pins nothing.
  absl::StatusOr<std::shared_ptr<Ticket>> r =
      cache_->RestoreToPool(caller_, {dst_, Alloc(*dst_, 2)}, {"a", "b"});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(Msg(r.status()), HasSubstr("key 0 is not present"));
  unchanged();
  // A pool another live session holds is not written by a restore.
  const std::string other = manager_->OpenSession("other", 2, "test");
  ASSERT_TRUE(dst_->Claim("other-instance", other,
                          [&](const std::string& id) { return manager_->IsSessionOpen(id); })
                  .ok());
  ASSERT_TRUE(Wait(cache_->StoreFromPool(caller_, {src_, from}, {"a", "b"})->ticket).ok());
  const CacheStats stored = cache_->stats();
  // (the claim's takeover freed dst's slots: these are the holder's)
  r = cache_->RestoreToPool(caller_, {dst_, Alloc(*dst_, 2)}, {"a", "b"});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(Msg(r.status()), HasSubstr("CacheRestore"));
  EXPECT_EQ(cache_->stats().pinned, stored.pinned);
}

TEST_F(PoolCopyTest, APoolDeletedDuringACopyKeepsItsMemoryUntilTheCopyEnds) {
  // Large enough that the delete usually lands while the copy runs; either
  // way the copy must end well and byte-exact.
  std::shared_ptr<Pool> big = Create("big", LayoutKind::kLayerFirst, 256, 3, 64);
  std::shared_ptr<Pool> big_cache = Create("big-cache", LayoutKind::kPageFirst, 256, 3, 64);
  std::shared_ptr<NodeCache> cache = NodeCache::Create(big_cache, manager_.get(), CacheLimits{});
  const std::vector<int64_t> from = Alloc(*big, 256);
  Fill(*big, from, 5);
  std::vector<std::string> keys;
  for (int i = 0; i < 256; ++i) keys.push_back(absl::StrCat("k", i));
  absl::StatusOr<NodeCache::Stored> stored = cache->StoreFromPool(caller_, {big, from}, keys);
  ASSERT_TRUE(stored.ok()) << stored.status();
  const std::vector<uint8_t> first = RowsOf(*big, from[0]);
  const std::vector<uint8_t> last = RowsOf(*big, from.back());
  std::weak_ptr<Pool> watch = big;
  big.reset();
  ASSERT_TRUE(registry_->Delete("big").ok());
  ASSERT_TRUE(Wait(stored->ticket).ok());
  stored->ticket.reset();
  // Restored from the cache byte-exact: the deleted pool's bytes were read
  // whole.
  std::shared_ptr<Pool> back = Create("back", LayoutKind::kPageFirst, 256, 3, 64);
  const std::vector<int64_t> to = Alloc(*back, 256);
  absl::StatusOr<std::shared_ptr<Ticket>> r = cache->RestoreToPool(caller_, {back, to}, keys);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_TRUE(Wait(*r).ok());
  EXPECT_EQ(RowsOf(*back, to[0]), first);
  EXPECT_EQ(RowsOf(*back, to.back()), last);
  manager_->Drain();
  EXPECT_TRUE(watch.expired());  // the copy's hold ended with it
}

}  // namespace
}  // namespace kvhost
