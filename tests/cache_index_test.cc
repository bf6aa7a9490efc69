// CacheIndex (server/cache/cache_index.h): publish after complete, one copy
// per key, LRU eviction that spares pinned and writing pages, holders'
// bounds and release, the event log, and errors that change nothing.
#include "server/cache/cache_index.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

namespace kvhost {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using Key = CacheKeyState;

constexpr uint64_t kPageSize = 16;

std::vector<std::string> Keys(std::initializer_list<const char*> names) {
  return std::vector<std::string>(names.begin(), names.end());
}

class CacheIndexTest : public ::testing::Test {
 protected:
  explicit CacheIndexTest(uint64_t pages = 4, CacheLimits limits = {})
      : allocator_(pages, kPageSize), index_(&allocator_, limits) {}

  // BeginStore, committed (the copies submitted) when it writes anything.
  absl::StatusOr<CacheStorePlan> Begin(const std::vector<std::string>& keys,
                                       const std::string& holder) {
    absl::StatusOr<CacheStorePlan> plan = index_.BeginStore(keys, holder);
    if (plan.ok() && plan->store_id != 0) {
      const absl::Status s = index_.CommitStore(plan->store_id, holder);
      EXPECT_TRUE(s.ok()) << s;
    }
    return plan;
  }

  // Stores and publishes `keys` for `holder`.
  CacheStorePlan Store(const std::vector<std::string>& keys, const std::string& holder = "s1") {
    absl::StatusOr<CacheStorePlan> plan = Begin(keys, holder);
    EXPECT_TRUE(plan.ok()) << plan.status();
    if (!plan.ok()) return {};
    if (plan->store_id != 0) {
      EXPECT_TRUE(index_.FinishStore(plan->store_id, holder, true).ok());
    }
    return *plan;
  }

  // Conservation: every page is free or held by exactly one entry.
  void ExpectConserved() {
    CacheStats s = index_.stats();
    EXPECT_EQ(s.free_pages + s.published + s.writing, s.page_num);
  }

  PageAllocator allocator_;
  CacheIndex index_;
};

TEST_F(CacheIndexTest, AStoredKeyIsVisibleOnlyOnceItsStoreFinishes) {
  absl::StatusOr<CacheStorePlan> plan = Begin(Keys({"a", "b"}), "s1");
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_THAT(plan->states, ElementsAre(Key::kAbsent, Key::kAbsent));
  EXPECT_THAT(plan->written, ElementsAre(0, 1));
  ASSERT_EQ(plan->pages.size(), 2u);
  EXPECT_NE(plan->pages[0], plan->pages[1]);

  absl::StatusOr<CacheLookup> before = index_.Lookup(Keys({"a", "b"}), nullptr);
  ASSERT_TRUE(before.ok());
  EXPECT_EQ(before->prefix, 0u);
  EXPECT_THAT(before->states, ElementsAre(Key::kPending, Key::kPending));
  EXPECT_TRUE(index_.EventsSince(0, 10).events.empty());

  ASSERT_TRUE(index_.FinishStore(plan->store_id, "s1", true).ok());
  absl::StatusOr<CacheLookup> after = index_.Lookup(Keys({"a", "b", "c"}), nullptr);
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->prefix, 2u);
  EXPECT_THAT(after->states, ElementsAre(Key::kPresent, Key::kPresent, Key::kAbsent));
  EXPECT_EQ(after->pages, plan->pages);
  EXPECT_EQ(after->pin_id, 0u);
  CacheEvents events = index_.EventsSince(0, 10);
  ASSERT_EQ(events.events.size(), 2u);
  EXPECT_EQ(events.events[0].key, "a");
  EXPECT_EQ(events.events[0].kind, CacheEvent::Kind::kStored);
  EXPECT_EQ(events.next_after, 2u);
  EXPECT_FALSE(events.gap);
  ExpectConserved();
}

TEST_F(CacheIndexTest, ThePrefixEndsAtTheFirstKeyNotPresent) {
  Store(Keys({"a", "c"}));
  absl::StatusOr<CacheLookup> found = index_.Lookup(Keys({"a", "b", "c"}), nullptr);
  ASSERT_TRUE(found.ok());
  EXPECT_EQ(found->prefix, 1u);
  EXPECT_EQ(found->pages.size(), 1u);
  EXPECT_THAT(found->states, ElementsAre(Key::kPresent, Key::kAbsent, Key::kPresent));
  EXPECT_EQ(index_.stats().hits, 2u);
  EXPECT_EQ(index_.stats().misses, 1u);
}

TEST_F(CacheIndexTest, TwoStoresOfOneKeyMakeOneCopy) {
  absl::StatusOr<CacheStorePlan> first = Begin(Keys({"a", "b"}), "s1");
  absl::StatusOr<CacheStorePlan> second = Begin(Keys({"b", "c"}), "s2");
  ASSERT_TRUE(first.ok() && second.ok());
  EXPECT_THAT(second->states, ElementsAre(Key::kPending, Key::kAbsent));
  EXPECT_THAT(second->written, ElementsAre(1));
  ASSERT_TRUE(index_.FinishStore(first->store_id, "s1", true).ok());
  ASSERT_TRUE(index_.FinishStore(second->store_id, "s2", true).ok());
  absl::StatusOr<CacheStorePlan> third = Begin(Keys({"a", "b", "c"}), "s3");
  ASSERT_TRUE(third.ok());
  EXPECT_EQ(third->store_id, 0u);
  EXPECT_TRUE(third->pages.empty());
  EXPECT_THAT(third->states, ElementsAre(Key::kPresent, Key::kPresent, Key::kPresent));
  EXPECT_EQ(index_.stats().published, 3u);
  EXPECT_EQ(index_.stats().skipped, 4u);
  ExpectConserved();
}

TEST_F(CacheIndexTest, AFailedStorePublishesNothingAndFreesItsPages) {
  absl::StatusOr<CacheStorePlan> plan = Begin(Keys({"a", "b"}), "s1");
  ASSERT_TRUE(plan.ok());
  ASSERT_TRUE(index_.FinishStore(plan->store_id, "s1", false).ok());
  absl::StatusOr<CacheLookup> found = index_.Lookup(Keys({"a", "b"}), nullptr);
  ASSERT_TRUE(found.ok());
  EXPECT_THAT(found->states, ElementsAre(Key::kAbsent, Key::kAbsent));
  EXPECT_EQ(allocator_.free_pages(), 4u);
  EXPECT_EQ(index_.stats().aborted, 2u);
  EXPECT_TRUE(index_.EventsSince(0, 10).events.empty());
  // Finished: a second finish is refused.
  EXPECT_EQ(index_.FinishStore(plan->store_id, "s1", true).code(), absl::StatusCode::kNotFound);
}

TEST_F(CacheIndexTest, AnotherHoldersIdsOpenNothing) {
  absl::StatusOr<CacheStorePlan> plan = Begin(Keys({"a"}), "s1");
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(index_.FinishStore(plan->store_id, "s2", true).code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(index_.FinishStore(plan->store_id, "s1", true).ok());
  std::string holder = "s1";
  absl::StatusOr<CacheLookup> pinned = index_.Lookup(Keys({"a"}), &holder);
  ASSERT_TRUE(pinned.ok());
  ASSERT_NE(pinned->pin_id, 0u);
  EXPECT_EQ(index_.Unpin(pinned->pin_id, "s2").code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(index_.stats().pinned, 1u);
  EXPECT_TRUE(index_.Unpin(pinned->pin_id, "s1").ok());
  EXPECT_EQ(index_.stats().pinned, 0u);
}

TEST_F(CacheIndexTest, EvictionTakesTheLeastRecentlyUsedFirst) {
  Store(Keys({"a", "b", "c", "d"}));
  ASSERT_TRUE(index_.Lookup(Keys({"a"}), nullptr).ok());  // a is used now: b is the oldest
  CacheStorePlan plan = Store(Keys({"e"}));
  EXPECT_EQ(plan.evicted, 1u);
  absl::StatusOr<CacheLookup> found = index_.Lookup(Keys({"a", "b", "c", "d", "e"}), nullptr);
  ASSERT_TRUE(found.ok());
  EXPECT_THAT(found->states, ElementsAre(Key::kPresent, Key::kAbsent, Key::kPresent, Key::kPresent,
                                         Key::kPresent));
  CacheEvents events = index_.EventsSince(4, 10);
  ASSERT_EQ(events.events.size(), 2u);
  EXPECT_EQ(events.events[0].kind, CacheEvent::Kind::kEvicted);
  EXPECT_EQ(events.events[0].key, "b");
  EXPECT_EQ(events.events[1].key, "e");
  ExpectConserved();
}

TEST_F(CacheIndexTest, PinnedAndWritingPagesAreNeverEvictedAndARefusalChangesNothing) {
  Store(Keys({"a", "b"}));
  std::string holder = "reader";
  absl::StatusOr<CacheLookup> pin = index_.Lookup(Keys({"a", "b"}), &holder);
  ASSERT_TRUE(pin.ok());
  absl::StatusOr<CacheStorePlan> writing = Begin(Keys({"c", "d"}), "writer");
  ASSERT_TRUE(writing.ok());
  const CacheStats before = index_.stats();
  const uint64_t seq = index_.EventsSince(0, 100).next_after;

  absl::StatusOr<CacheStorePlan> refused = Begin(Keys({"e"}), "s3");
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(refused.status().message(), HasSubstr("0 are free and 0 evictable"));
  absl::StatusOr<std::vector<CacheEvictOutcome>> evict = index_.Evict(Keys({"a", "c", "x"}));
  ASSERT_TRUE(evict.ok());
  EXPECT_THAT(*evict, ElementsAre(CacheEvictOutcome::kBusy, CacheEvictOutcome::kBusy,
                                  CacheEvictOutcome::kAbsent));
  const CacheStats after = index_.stats();
  EXPECT_EQ(after.published, before.published);
  EXPECT_EQ(after.writing, before.writing);
  EXPECT_EQ(after.free_pages, 0u);
  EXPECT_EQ(index_.EventsSince(0, 100).next_after, seq);

  // Once the pin goes, a and b are evictable again, oldest first.
  ASSERT_TRUE(index_.Unpin(pin->pin_id, holder).ok());
  CacheStorePlan plan = Store(Keys({"e"}));
  EXPECT_EQ(plan.evicted, 1u);
  ExpectConserved();
}

TEST_F(CacheIndexTest, ReleaseHolderDropsItsPinsAndAbandonsItsStores) {
  Store(Keys({"a"}), "s1");
  std::string holder = "dead";
  ASSERT_TRUE(index_.Lookup(Keys({"a"}), &holder).ok());
  absl::StatusOr<CacheStorePlan> plan = Begin(Keys({"b", "c"}), holder);
  ASSERT_TRUE(plan.ok());
  index_.ReleaseHolder(holder);
  CacheStats s = index_.stats();
  EXPECT_EQ(s.pinned, 0u);
  EXPECT_EQ(s.writing, 0u);
  EXPECT_EQ(s.published, 1u);
  EXPECT_EQ(s.free_pages, 3u);
  EXPECT_EQ(index_.FinishStore(plan->store_id, holder, true).code(), absl::StatusCode::kNotFound);
  absl::StatusOr<std::vector<CacheEvictOutcome>> evict = index_.Evict(Keys({"a"}));
  ASSERT_TRUE(evict.ok());
  EXPECT_THAT(*evict, ElementsAre(CacheEvictOutcome::kEvicted));
  ExpectConserved();
}

// A store whose copies were refused (CancelStore) leaves the index as it was:
// its victims read as absent only while it was tentative, and come back
// published, oldest first as before, with no event and no count.
TEST_F(CacheIndexTest, ACancelledStoreLeavesTheIndexAsItWas) {
  Store(Keys({"a", "b", "c", "d"}));  // full: 4 pages
  const CacheStats before = index_.stats();
  const uint64_t seq = index_.EventsSince(0, 100).next_after;
  absl::StatusOr<CacheStorePlan> plan = index_.BeginStore(Keys({"x", "c", "y"}), "s1");
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->evicted, 2u);
  absl::StatusOr<CacheLookup> during = index_.Lookup(Keys({"a", "b", "c"}), nullptr);
  ASSERT_TRUE(during.ok());
  EXPECT_THAT(during->states, ElementsAre(Key::kAbsent, Key::kAbsent, Key::kPresent));
  // A victim is another store's to write or give back: pending to a store.
  absl::StatusOr<CacheStorePlan> other = index_.BeginStore(Keys({"a"}), "s2");
  ASSERT_TRUE(other.ok());
  EXPECT_THAT(other->states, ElementsAre(Key::kPending));
  EXPECT_EQ(index_.FinishStore(plan->store_id, "s1", true).code(), absl::StatusCode::kNotFound)
      << "not committed";
  ASSERT_TRUE(index_.CancelStore(plan->store_id, "s1").ok());
  EXPECT_EQ(index_.CancelStore(plan->store_id, "s1").code(), absl::StatusCode::kNotFound);

  const CacheStats after = index_.stats();
  EXPECT_EQ(after.published, before.published);
  EXPECT_EQ(after.free_pages, before.free_pages);
  EXPECT_EQ(after.writing, 0u);
  EXPECT_EQ(after.evicted, 0u);
  EXPECT_EQ(after.aborted, 0u);
  EXPECT_EQ(after.skipped, before.skipped + 1) << "only s2's skipped 'a' counts";
  EXPECT_TRUE(index_.EventsSince(seq, 100).events.empty());
  absl::StatusOr<CacheLookup> back = index_.Lookup(Keys({"a", "b", "c", "d"}), nullptr);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->prefix, 4u);
  // The next store that needs a page still evicts the oldest unused key;
  // the lookup just made all four recently used, in order, so "a".
  CacheStorePlan next = Store(Keys({"e"}));
  EXPECT_EQ(next.evicted, 1u);
  absl::StatusOr<CacheLookup> gone = index_.Lookup(Keys({"a"}), nullptr);
  EXPECT_THAT(gone->states, ElementsAre(Key::kAbsent));
  ExpectConserved();
}

// A key a store finds present is skipped, so never evicted by that store.
TEST_F(CacheIndexTest, AStoreNeverEvictsAKeyItFoundPresent) {
  Store(Keys({"a", "b", "c", "d"}));
  CacheStorePlan plan = Store(Keys({"a", "x"}));  // "a" is the oldest
  EXPECT_THAT(plan.states, ElementsAre(Key::kPresent, Key::kAbsent));
  EXPECT_EQ(plan.evicted, 1u);
  absl::StatusOr<CacheLookup> found = index_.Lookup(Keys({"a", "b", "x"}), nullptr);
  ASSERT_TRUE(found.ok());
  EXPECT_THAT(found->states, ElementsAre(Key::kPresent, Key::kAbsent, Key::kPresent));
  ExpectConserved();
}

// A holder that ends with a tentative store gives its victims back.
TEST_F(CacheIndexTest, ReleaseHolderCancelsATentativeStore) {
  Store(Keys({"a", "b", "c", "d"}));
  absl::StatusOr<CacheStorePlan> plan = index_.BeginStore(Keys({"x"}), "dead");
  ASSERT_TRUE(plan.ok());
  index_.ReleaseHolder("dead");
  EXPECT_EQ(index_.CommitStore(plan->store_id, "dead").code(), absl::StatusCode::kNotFound);
  absl::StatusOr<CacheLookup> found = index_.Lookup(Keys({"a", "b", "c", "d", "x"}), nullptr);
  ASSERT_TRUE(found.ok());
  EXPECT_EQ(found->prefix, 4u);
  EXPECT_EQ(index_.stats().aborted, 0u);
  ExpectConserved();
}

TEST_F(CacheIndexTest, BadKeyListsAreRefusedNamingTheKey) {
  Store(Keys({"a"}));
  const CacheStats before = index_.stats();
  std::vector<std::string> none;
  EXPECT_EQ(index_.Lookup(none, nullptr).status().code(), absl::StatusCode::kInvalidArgument);
  absl::Status empty = Begin(Keys({"b", ""}), "s1").status();
  EXPECT_EQ(empty.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(empty.message(), HasSubstr("key 1 is empty"));
  absl::Status twice = Begin(Keys({"b", "c", "b"}), "s1").status();
  EXPECT_THAT(twice.message(), HasSubstr("key 2 repeats"));
  std::vector<std::string> long_key = {std::string(257, 'k')};
  absl::Status too_long = index_.Evict(long_key).status();
  EXPECT_THAT(too_long.message(), HasSubstr("key 0 has 257 bytes, over the limit of 256"));
  std::vector<std::string> many(4097);
  for (size_t i = 0; i < many.size(); ++i) many[i] = std::to_string(i);
  EXPECT_THAT(index_.Lookup(many, nullptr).status().message(),
              HasSubstr("4097 keys, over the limit of 4096"));
  const CacheStats after = index_.stats();
  EXPECT_EQ(after.published, before.published);
  EXPECT_EQ(after.writing, 0u);
  EXPECT_EQ(after.free_pages, before.free_pages);
  EXPECT_EQ(after.hits, before.hits);
}

class CacheIndexBoundsTest : public CacheIndexTest {
 protected:
  static CacheLimits Small() {
    CacheLimits limits;
    limits.max_held_pages_per_holder = 2;
    limits.max_events = 3;
    return limits;
  }
  CacheIndexBoundsTest() : CacheIndexTest(8, Small()) {}
};

TEST_F(CacheIndexBoundsTest, AHolderIsBoundedAndOthersAreNot) {
  absl::StatusOr<CacheStorePlan> plan = Begin(Keys({"a", "b"}), "greedy");
  ASSERT_TRUE(plan.ok());
  absl::Status over = Begin(Keys({"c"}), "greedy").status();
  EXPECT_EQ(over.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(over.message(), HasSubstr("holds 2 cache pages"));
  EXPECT_TRUE(index_.BeginStore(Keys({"c"}), "other").ok());
  ASSERT_TRUE(index_.FinishStore(plan->store_id, "greedy", true).ok());
  std::string greedy = "greedy";
  std::vector<std::string> three = Keys({"a", "b"});
  ASSERT_TRUE(index_.Lookup(three, &greedy).ok());
  EXPECT_EQ(index_.Lookup(three, &greedy).status().code(), absl::StatusCode::kResourceExhausted);
}

TEST_F(CacheIndexBoundsTest, TheEventLogKeepsTheNewestAndSaysWhatWasLost) {
  Store(Keys({"a", "b"}));  // two at a time: the holder's bound is 2
  Store(Keys({"c", "d"}));
  Store(Keys({"e"}));
  CacheEvents from_start = index_.EventsSince(0, 100);
  EXPECT_TRUE(from_start.gap);
  ASSERT_EQ(from_start.events.size(), 3u);
  EXPECT_EQ(from_start.events[0].seq, 3u);
  EXPECT_EQ(from_start.events[0].key, "c");
  CacheEvents resumed = index_.EventsSince(3, 1);
  EXPECT_FALSE(resumed.gap);
  ASSERT_EQ(resumed.events.size(), 1u);
  EXPECT_EQ(resumed.events[0].key, "d");
  EXPECT_EQ(resumed.next_after, 4u);
  EXPECT_TRUE(index_.EventsSince(5, 100).events.empty());
  EXPECT_FALSE(index_.EventsSince(5, 100).gap);
  CacheEvents future = index_.EventsSince(99, 100);  // from before a restart
  EXPECT_TRUE(future.gap);
  EXPECT_EQ(future.next_after, 5u);
}

// A random mix of every call against the conservation invariant and a model
// of which keys are published.
TEST_F(CacheIndexTest, RandomCallsKeepPagesConserved) {
  std::mt19937 rng(7);
  std::set<std::string> published;
  std::vector<std::pair<uint64_t, std::string>> open_stores, pins;
  for (int step = 0; step < 5000; ++step) {
    std::vector<std::string> keys;
    const int n = 1 + static_cast<int>(rng() % 3);
    std::set<std::string> chosen;
    while (static_cast<int>(chosen.size()) < n) chosen.insert("k" + std::to_string(rng() % 8));
    keys.assign(chosen.begin(), chosen.end());
    const std::string holder = "h" + std::to_string(rng() % 3);
    switch (rng() % 6) {
      case 0: {
        absl::StatusOr<CacheStorePlan> plan = index_.BeginStore(keys, holder);
        if (!plan.ok() || plan->store_id == 0) break;
        if (rng() % 5 == 0) {  // the copies were refused
          ASSERT_TRUE(index_.CancelStore(plan->store_id, holder).ok());
        } else {
          ASSERT_TRUE(index_.CommitStore(plan->store_id, holder).ok());
          open_stores.push_back({plan->store_id, holder});
        }
        break;
      }
      case 1:
        if (!open_stores.empty()) {
          auto [id, who] = open_stores.back();
          open_stores.pop_back();
          ASSERT_TRUE(index_.FinishStore(id, who, rng() % 4 != 0).ok());
        }
        break;
      case 2: {
        absl::StatusOr<CacheLookup> found = index_.Lookup(keys, &holder);
        ASSERT_TRUE(found.ok() || found.status().code() == absl::StatusCode::kResourceExhausted);
        if (found.ok() && found->pin_id != 0) pins.push_back({found->pin_id, holder});
        break;
      }
      case 3:
        if (!pins.empty()) {
          auto [id, who] = pins.front();
          pins.erase(pins.begin());
          ASSERT_TRUE(index_.Unpin(id, who).ok());
        }
        break;
      case 4:
        ASSERT_TRUE(index_.Evict(keys).ok());
        break;
      default:
        index_.ReleaseHolder(holder);
        for (auto* held : {&open_stores, &pins}) {
          held->erase(std::remove_if(held->begin(), held->end(),
                                     [&](const auto& h) { return h.second == holder; }),
                      held->end());
        }
        break;
    }
    ExpectConserved();
  }
  for (auto& [id, who] : pins) ASSERT_TRUE(index_.Unpin(id, who).ok());
  for (auto& [id, who] : open_stores) ASSERT_TRUE(index_.FinishStore(id, who, false).ok());
  CacheStats s = index_.stats();
  EXPECT_EQ(s.pinned, 0u);
  EXPECT_EQ(s.writing, 0u);
  EXPECT_EQ(s.free_pages + s.published, s.page_num);
}

// Threads storing overlapping keys: each key is written by exactly one store.
TEST(CacheIndexConcurrencyTest, ConcurrentStoresOfOneKeyWriteItOnce) {
  PageAllocator allocator(1024, kPageSize);
  CacheIndex index(&allocator, {});
  std::atomic<int> written{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      const std::string holder = "t" + std::to_string(t);
      for (int i = 0; i < 200; ++i) {
        std::vector<std::string> keys = {"k" + std::to_string(i), "k" + std::to_string(i + 1)};
        absl::StatusOr<CacheStorePlan> plan = index.BeginStore(keys, holder);
        ASSERT_TRUE(plan.ok()) << plan.status();
        written += static_cast<int>(plan->written.size());
        if (plan->store_id != 0) {
          ASSERT_TRUE(index.CommitStore(plan->store_id, holder).ok());
          ASSERT_TRUE(index.FinishStore(plan->store_id, holder, true).ok());
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(written.load(), 201);
  EXPECT_EQ(index.stats().published, 201u);
  EXPECT_EQ(allocator.free_pages(), 1024u - 201u);
}

}  // namespace
}  // namespace kvhost
