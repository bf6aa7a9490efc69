// Tests of the L3 tier's domain (server/storage/): CRC32C against its
// published check value and across its two paths, the page record (header,
// parts, checksums, shape fingerprint, MAC) and StorageTier over
// FakeBackend: round trips, misses, torn and corrupted pages that never
// reach the pool, pages of another shape refused, refused calls that change
// nothing, the bound on pages in flight and each pool's share of it; and
// what a hostile cache holds (issue 29): a forged part count that asks for
// nothing more, a record rewritten with recomputed checksums (a miss,
// counted), namespaces that neither see nor overwrite each other, a backend
// that throws.
#include "server/storage/storage_tier.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <new>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "pool_test_util.h"
#include "server/storage/crc32c.h"
#include "server/storage/fake_backend.h"
#include "server/storage/l3_secret.h"
#include "server/storage/page_record.h"

namespace kvhost {
namespace {

using ShmDir = ::kvhost::testing::PoolShmDir;

absl::Span<const uint8_t> AsBytes(const std::string& s) {
  return absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(s.data()), s.size());
}

TEST(Crc32cTest, CheckValueAndPathsAgree) {
  // The CRC-32C check value (RFC 3720 B.4 lists the same polynomial).
  EXPECT_EQ(Crc32c(AsBytes("123456789")), 0xE3069283u);
  EXPECT_EQ(Crc32c({}), 0u);
  std::mt19937 rng(7);
  for (size_t n : {1, 7, 8, 9, 63, 64, 65, 1000, 4096 + 3}) {
    std::string data(n, '\0');
    for (char& c : data) c = static_cast<char>(rng());
    const uint32_t whole = Crc32c(AsBytes(data));
    EXPECT_EQ(whole, Crc32cExtendPortable(0, AsBytes(data))) << n;
    const size_t cut = n / 3;
    EXPECT_EQ(Crc32cExtend(Crc32c(AsBytes(data.substr(0, cut))), AsBytes(data.substr(cut))), whole)
        << n;
  }
}

PoolSpec Mha(LayoutKind layout, uint32_t page_size = 4) {
  PoolSpec s;
  s.kind = PoolKind::kMha;
  s.layout = layout;
  s.dtype = DType::kBf16;
  s.page_size = page_size;
  s.layer_num = 3;
  s.head_num = 2;
  s.head_dim = 8;
  return s;
}

PoolSpec Mla(LayoutKind layout) {
  PoolSpec s;
  s.kind = PoolKind::kMla;
  s.layout = layout;
  s.dtype = DType::kBf16;
  s.page_size = 4;
  s.layer_num = 3;
  s.kv_lora_rank = 12;
  s.qk_rope_head_dim = 4;
  return s;
}

class StorageTest : public ::testing::Test {
 protected:
  // A pool of 16 pages with `pages` pages allocated (their first slots in
  // `slots`) and filled with random bytes.
  std::shared_ptr<Pool> MakePool(const std::string& name, const PoolSpec& spec, uint64_t pages,
                                 std::vector<int64_t>* slots) {
    absl::StatusOr<std::shared_ptr<Pool>> pool =
        Pool::Create(name, spec, 16 * spec.page_size, dir_.path() + "/x.");
    EXPECT_TRUE(pool.ok()) << pool.status();
    if (!pool.ok()) return nullptr;
    absl::StatusOr<std::vector<uint64_t>> got = (*pool)->AllocPages(pages * spec.page_size);
    EXPECT_TRUE(got.ok()) << got.status();
    slots->clear();
    for (uint64_t i = 0; got.ok() && i < got->size(); ++i) {  // page ids
      slots->push_back(static_cast<int64_t>((*got)[i] * spec.page_size));
    }
    // MHA_ASYMMETRIC has no flat page to write (the tier refuses it).
    if (spec.kind == PoolKind::kMhaAsymmetric) return *pool;
    for (int64_t slot : *slots) {
      EXPECT_TRUE((*pool)->WritePage(slot, Random((*pool)->flat_page_bytes())).ok());
    }
    return *pool;
  }
  std::vector<uint8_t> Random(uint64_t n) {
    std::vector<uint8_t> out(n);
    for (uint8_t& b : out) b = static_cast<uint8_t>(rng_());
    return out;
  }
  static std::vector<uint8_t> Page(const Pool& pool, int64_t slot) {
    std::vector<uint8_t> out(pool.flat_page_bytes());
    EXPECT_TRUE(pool.ReadPage(slot, absl::MakeSpan(out)).ok());
    return out;
  }
  static std::vector<std::optional<std::string>> Optional(const std::vector<std::string>& items) {
    return std::vector<std::optional<std::string>>(items.begin(), items.end());
  }
  // The scope of `key` in the public namespace.
  RecordScope Scope(const std::string& key) {
    keys_.push_back(std::make_unique<std::string>(key));
    return {&secret_, ns_, *keys_.back()};
  }
  // The cache key of part `part` of `key` in namespace `ns` (default public).
  std::string Item(const std::string& key, uint32_t part, const std::string* ns = nullptr) const {
    return PartKey(secret_.CacheKey(ns != nullptr ? *ns : ns_, key), part);
  }

  ShmDir dir_;
  std::mt19937 rng_{42};
  const L3Secret secret_ = L3Secret::FromBytes("a test secret of at least 32 bytes!");
  const std::string ns_ = secret_.PublicNamespace();
  std::vector<std::unique_ptr<std::string>> keys_;  // what Scope's views look into
};

TEST_F(StorageTest, RecordRoundTripInOnePartAndInMany) {
  std::vector<int64_t> a_slots, b_slots;
  std::shared_ptr<Pool> a = MakePool("a", Mha(LayoutKind::kPageFirst), 2, &a_slots);
  std::shared_ptr<Pool> b = MakePool("b", Mha(LayoutKind::kPageFirst), 2, &b_slots);
  ASSERT_TRUE(a && b);
  absl::StatusOr<PageShapeTag> tag = ShapeTagOf(*a);
  ASSERT_TRUE(tag.ok()) << tag.status();
  EXPECT_EQ(tag->page_bytes, a->flat_page_bytes());
  // 3 layers x 4 tokens x 2 planes x 2 heads x 8 x 2 bytes = 768.
  ASSERT_EQ(tag->page_bytes, 768u);
  for (const uint64_t item_bytes :
       {uint64_t{1} << 20, kPartHeaderBytes + 100, kPartHeaderBytes + 1}) {
    SCOPED_TRACE(item_bytes);
    absl::StatusOr<std::vector<std::string>> items =
        EncodePage(*a, a_slots[0], *tag, Scope("k"), 9, item_bytes);
    ASSERT_TRUE(items.ok()) << items.status();
    const uint64_t payload = item_bytes - kPartHeaderBytes;
    EXPECT_EQ(items->size(), (768 + payload - 1) / payload);
    EXPECT_EQ(items->size(), PartCount(768, item_bytes));
    for (const std::string& item : *items) EXPECT_LE(item.size(), item_bytes);
    const std::vector<std::optional<std::string>> parts = Optional(*items);
    PageResult r = CheckPage(*tag, Scope("k"), item_bytes, parts);
    ASSERT_EQ(r.outcome, PageOutcome::kHit) << r.detail;
    // Under another key, namespace or secret the MAC fails: a miss.
    const L3Secret other = L3Secret::FromBytes("another secret of at least 32 bytes");
    const std::string token_ns = secret_.TokenNamespace("t");
    for (const RecordScope& wrong :
         {Scope("k2"), RecordScope{&secret_, token_ns, "k"}, RecordScope{&other, ns_, "k"}}) {
      r = CheckPage(*tag, wrong, item_bytes, parts);
      EXPECT_EQ(r.outcome, PageOutcome::kMiss) << r.detail;
      EXPECT_TRUE(r.unauthenticated);
    }
    ASSERT_TRUE(WriteCheckedPage(*b, b_slots[1], parts).ok());
    EXPECT_EQ(Page(*b, b_slots[1]), Page(*a, a_slots[0]));
  }
}

TEST_F(StorageTest, TornAndCorruptedPagesNeverPass) {
  std::vector<int64_t> slots;
  std::shared_ptr<Pool> a = MakePool("a", Mha(LayoutKind::kLayerFirst), 2, &slots);
  ASSERT_TRUE(a);
  const PageShapeTag tag = *ShapeTagOf(*a);
  const uint64_t item = kPartHeaderBytes + 200;  // 768 bytes: 4 parts
  const RecordScope scope = Scope("k");
  const std::vector<std::string> first = *EncodePage(*a, slots[0], tag, scope, 1, item);
  const std::vector<std::string> second = *EncodePage(*a, slots[1], tag, scope, 2, item);
  ASSERT_EQ(first.size(), 4u);

  std::vector<std::optional<std::string>> parts = Optional(first);
  parts[2].reset();  // evicted
  PageResult r = CheckPage(tag, scope, item, parts);
  EXPECT_EQ(r.outcome, PageOutcome::kMiss);
  EXPECT_TRUE(absl::StrContains(r.detail, "part 2 of 4 is missing")) << r.detail;

  parts = Optional(first);
  parts[1] = second[1];  // another store of the key overwrote part 1
  r = CheckPage(tag, scope, item, parts);
  EXPECT_EQ(r.outcome, PageOutcome::kCorrupt);
  EXPECT_TRUE(absl::StrContains(r.detail, "another store")) << r.detail;

  for (const size_t at : {size_t{3}, size_t{30}, kPartHeaderBytes + 5}) {
    parts = Optional(first);
    (*parts[3])[at] = static_cast<char>((*parts[3])[at] ^ 0x10);
    r = CheckPage(tag, scope, item, parts);
    EXPECT_EQ(r.outcome, PageOutcome::kCorrupt) << "byte " << at;
  }
  parts = Optional(first);
  parts[3]->pop_back();  // cut short
  EXPECT_EQ(CheckPage(tag, scope, item, parts).outcome, PageOutcome::kCorrupt);
  parts = Optional(first);
  parts.pop_back();  // the caller read fewer parts than part 0 says
  EXPECT_EQ(CheckPage(tag, scope, item, parts).outcome, PageOutcome::kCorrupt);
  parts = Optional(first);
  parts[0].reset();
  EXPECT_EQ(CheckPage(tag, scope, item, parts).outcome, PageOutcome::kMiss);
  parts = Optional(first);
  parts[0] = std::string("not a page at all");
  EXPECT_EQ(CheckPage(tag, scope, item, parts).outcome, PageOutcome::kCorrupt);
}

TEST_F(StorageTest, PagesOfAnotherShapeAreRefused) {
  std::vector<int64_t> slots;
  std::shared_ptr<Pool> mha = MakePool("mha", Mha(LayoutKind::kPageFirst), 1, &slots);
  ASSERT_TRUE(mha);
  const PageShapeTag mha_tag = *ShapeTagOf(*mha);
  const std::vector<std::string> items =
      *EncodePage(*mha, slots[0], mha_tag, Scope("k"), 1, 1 << 20);
  std::vector<int64_t> other;
  PoolSpec fp16 = Mha(LayoutKind::kPageFirst);
  fp16.dtype = DType::kFp16;  // same bytes per page, other dtype
  PoolSpec sharded = Mha(LayoutKind::kPageFirst);
  sharded.start_layer = 3;  // same shape, other layers
  for (const PoolSpec& spec : {Mla(LayoutKind::kPageFirst), Mha(LayoutKind::kPageFirstDirect),
                               Mha(LayoutKind::kPageFirst, 8), fp16, sharded}) {
    std::shared_ptr<Pool> pool = MakePool(absl::StrCat("p", rng_()), spec, 1, &other);
    ASSERT_TRUE(pool);
    const PageShapeTag tag = *ShapeTagOf(*pool);
    EXPECT_NE(tag.fingerprint, mha_tag.fingerprint) << DescribeSpec(spec);
    PageResult r = CheckPage(tag, Scope("k"), 1 << 20, Optional(items));
    EXPECT_EQ(r.outcome, PageOutcome::kShapeMismatch) << DescribeSpec(spec);
    EXPECT_TRUE(absl::StrContains(r.detail, "the stored page is MHA/PAGE_FIRST")) << r.detail;
    EXPECT_TRUE(absl::StrContains(r.detail, tag.Describe())) << r.detail;
  }
}

// Waits for a tier call's results.
struct Results {
  absl::Notification done;
  std::vector<PageResult> pages;
  StorageTier::PagesDone Callback() {
    return [this](std::vector<PageResult> r) {
      pages = std::move(r);
      done.Notify();
    };
  }
  std::vector<PageOutcome> Outcomes() {
    done.WaitForNotification();
    std::vector<PageOutcome> out;
    for (const PageResult& p : pages) out.push_back(p.outcome);
    return out;
  }
};

uint64_t Prefix(StorageTier& tier, std::shared_ptr<Pool> pool, const std::string& ns,
                std::vector<std::string> keys) {
  absl::Notification done;
  uint64_t prefix = 0;
  absl::Status s = tier.Exist(std::move(pool), ns, std::move(keys), [&](uint64_t p) {
    prefix = p;
    done.Notify();
  });
  EXPECT_TRUE(s.ok()) << s;
  done.WaitForNotification();
  return prefix;
}

class TierTest : public StorageTest {
 protected:
  TierTest() {
    auto fake = std::make_unique<FakeBackend>(kPartHeaderBytes + 300);  // 768-byte pages: 3 parts
    fake_ = fake.get();
    StorageTierOptions options;
    options.threads = 3;
    options.job_bytes = 1;  // a page per job: a call's pages on several threads
    options.max_pages_in_flight = 8;
    tier_ = std::make_unique<StorageTier>(std::move(fake), options, secret_);
  }
  FakeBackend* fake_;
  std::unique_ptr<StorageTier> tier_;
};

using O = PageOutcome;

TEST_F(TierTest, StoreExistFetchRoundTrip) {
  std::vector<int64_t> src, dst;
  std::shared_ptr<Pool> a = MakePool("a", Mha(LayoutKind::kPageHead), 5, &src);
  std::shared_ptr<Pool> b = MakePool("b", Mha(LayoutKind::kPageHead), 6, &dst);
  ASSERT_TRUE(a && b);
  const std::vector<std::string> keys = {"k0", "k1", "k2", "k3", "k4"};
  Results stored;
  absl::Status st = tier_->Store(a, ns_, src, keys, stored.Callback());
  ASSERT_TRUE(st.ok()) << st;
  EXPECT_EQ(stored.Outcomes(), std::vector<O>(5, O::kStored));
  EXPECT_EQ(fake_->size(), 15u);  // 3 parts each
  EXPECT_EQ(Prefix(*tier_, a, ns_, {"k0", "k1", "k2", "nope", "k4"}), 3u);
  EXPECT_EQ(Prefix(*tier_, a, ns_, keys), 5u);
  EXPECT_EQ(Prefix(*tier_, a, ns_, {}), 0u);
  // Fetch in another order, with a key never stored, into the second pool.
  const std::vector<uint8_t> untouched = Page(*b, dst[5]);
  Results fetched;
  ASSERT_TRUE(tier_
                  ->Fetch(b, ns_, {"k3", "k0", "k4", "k1", "k2", "nope"},
                          {dst[0], dst[1], dst[2], dst[3], dst[4], dst[5]}, fetched.Callback())
                  .ok());
  EXPECT_EQ(fetched.Outcomes(),
            (std::vector<O>{O::kHit, O::kHit, O::kHit, O::kHit, O::kHit, O::kMiss}));
  for (const auto& [from, to] : std::vector<std::pair<int, int>>{{3, 0}, {0, 1}, {4, 2}, {1, 3}}) {
    EXPECT_EQ(Page(*b, dst[to]), Page(*a, src[from]));
  }
  EXPECT_EQ(Page(*b, dst[5]), untouched);
  EXPECT_EQ(tier_->pages_in_flight(), 0u);
}

TEST_F(TierTest, TornCorruptAndForeignPagesNeverReachThePool) {
  std::vector<int64_t> src, dst;
  std::shared_ptr<Pool> a = MakePool("a", Mha(LayoutKind::kPageFirst), 4, &src);
  std::shared_ptr<Pool> b = MakePool("b", Mha(LayoutKind::kPageFirst), 4, &dst);
  std::vector<int64_t> mla_slots;
  std::shared_ptr<Pool> mla = MakePool("m", Mla(LayoutKind::kPageFirst), 1, &mla_slots);
  ASSERT_TRUE(a && b && mla);
  Results stored, stored_mla;
  ASSERT_TRUE(tier_->Store(a, ns_, src, {"t0", "t1", "t2", "t3"}, stored.Callback()).ok());
  ASSERT_TRUE(tier_->Store(mla, ns_, mla_slots, {"m0"}, stored_mla.Callback()).ok());
  ASSERT_EQ(stored.Outcomes(), std::vector<O>(4, O::kStored));
  ASSERT_EQ(stored_mla.Outcomes(), std::vector<O>{O::kStored});
  ASSERT_TRUE(fake_->Erase(Item("t0", 2)));                        // torn: a part evicted
  ASSERT_TRUE(fake_->Flip(Item("t1", 1), kPartHeaderBytes + 17));  // a payload bit flipped
  fake_->Put(Item("t2", 1), fake_->Value(Item("t3", 1)));          // another store's part
  std::vector<std::vector<uint8_t>> before;
  for (int64_t s : dst) before.push_back(Page(*b, s));
  Results fetched;
  ASSERT_TRUE(tier_->Fetch(b, ns_, {"t0", "t1", "t2", "m0"}, dst, fetched.Callback()).ok());
  EXPECT_EQ(fetched.Outcomes(),
            (std::vector<O>{O::kMiss, O::kCorrupt, O::kCorrupt, O::kShapeMismatch}));
  EXPECT_TRUE(absl::StrContains(fetched.pages[0].detail, "part 2 of 3 is missing"))
      << fetched.pages[0].detail;
  EXPECT_TRUE(absl::StrContains(fetched.pages[3].detail, "MLA/PAGE_FIRST"))
      << fetched.pages[3].detail;
  for (size_t i = 0; i < dst.size(); ++i) EXPECT_EQ(Page(*b, dst[i]), before[i]) << i;
}

TEST_F(TierTest, RefusedCallsRunNothing) {
  std::vector<int64_t> src;
  std::shared_ptr<Pool> a = MakePool("a", Mha(LayoutKind::kPageFirst), 2, &src);
  ASSERT_TRUE(a);
  auto never = [](std::vector<PageResult>) { ADD_FAILURE() << "a refused call ran"; };
  absl::Status s = tier_->Store(a, ns_, src, {"only-one"}, never);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(), "1 keys for 2 indices")) << s;
  s = tier_->Store(a, ns_, src, {"ok", ""}, never);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(), "keys[1] is empty")) << s;
  s = tier_->Store(a, ns_, src, {"ok", std::string(kMaxStorageKeyBytes + 1, 'x')}, never);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(), "keys[1] has 113 bytes")) << s;
  s = tier_->Store(a, ns_, {src[0], 2}, {"x", "y"}, never);  // slot 2 is not a page start
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(), "indices[1]: pool 'a'")) << s;
  int64_t unallocated = 0;
  while (unallocated == src[0] || unallocated == src[1]) unallocated += 4;
  const std::vector<uint8_t> before = Page(*a, src[0]);
  s = tier_->Fetch(a, ns_, {"x", "y"}, {src[0], unallocated}, never);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(s.message(), "not allocated")) << s;
  s = tier_->Fetch(a, ns_, {"x", "y"}, {src[0], src[0]}, never);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(), "indices[1] = " + std::to_string(src[0]))) << s;
  s = tier_->Exist(a, ns_, {"a", std::string(200, 'k')}, [](uint64_t) { ADD_FAILURE(); });
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(fake_->size(), 0u);
  EXPECT_EQ(Page(*a, src[0]), before);
  EXPECT_EQ(tier_->pages_in_flight(), 0u);
}

TEST_F(TierTest, ClusterDownIsAPerPageResult) {
  std::vector<int64_t> src;
  std::shared_ptr<Pool> a = MakePool("a", Mha(LayoutKind::kPageFirst), 2, &src);
  ASSERT_TRUE(a);
  fake_->Down(true);
  Results stored;
  ASSERT_TRUE(tier_->Store(a, ns_, src, {"d0", "d1"}, stored.Callback()).ok());
  EXPECT_EQ(stored.Outcomes(), std::vector<O>(2, O::kUnavailable));
  EXPECT_TRUE(absl::StrContains(stored.pages[0].detail, "down")) << stored.pages[0].detail;
  const std::vector<uint8_t> before = Page(*a, src[0]);
  Results fetched;
  ASSERT_TRUE(tier_->Fetch(a, ns_, {"d0"}, {src[0]}, fetched.Callback()).ok());
  EXPECT_EQ(fetched.Outcomes(), std::vector<O>{O::kMiss});
  EXPECT_EQ(Prefix(*tier_, a, ns_, {"d0"}), 0u);
  fake_->Down(false);
  EXPECT_EQ(Page(*a, src[0]), before);
}

// Every kind with its own page space and a flat page, through the tier and
// back into a second pool of the same spec; MHA_ASYMMETRIC (no flat page)
// refused with the pool's message.
TEST_F(TierTest, EveryKindWithFlatPagesRoundTrips) {
  for (const PoolKind kind : ::kvhost::testing::kKinds) {
    PoolSpec spec = ::kvhost::testing::KindSpec(kind);
    if (!spec.follows.empty() || kind == PoolKind::kLogical) continue;
    SCOPED_TRACE(PoolKindName(kind));
    std::vector<int64_t> src, dst;
    std::shared_ptr<Pool> a = MakePool(absl::StrCat("a", rng_()), spec, 3, &src);
    std::shared_ptr<Pool> b = MakePool(absl::StrCat("b", rng_()), spec, 3, &dst);
    ASSERT_TRUE(a && b);
    const std::vector<std::string> keys = {absl::StrCat(PoolKindName(kind), "/0"),
                                           absl::StrCat(PoolKindName(kind), "/1"),
                                           absl::StrCat(PoolKindName(kind), "/2")};
    Results stored;
    absl::Status s = tier_->Store(a, ns_, src, keys, stored.Callback());
    if (kind == PoolKind::kMhaAsymmetric) {
      EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
      EXPECT_TRUE(absl::StrContains(s.message(), "has no flat page")) << s;
      continue;
    }
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(stored.Outcomes(), std::vector<PageOutcome>(3, PageOutcome::kStored));
    Results fetched;
    ASSERT_TRUE(tier_->Fetch(b, ns_, keys, dst, fetched.Callback()).ok());
    EXPECT_EQ(fetched.Outcomes(), std::vector<PageOutcome>(3, PageOutcome::kHit));
    for (size_t i = 0; i < 3; ++i) EXPECT_EQ(Page(*b, dst[i]), Page(*a, src[i])) << i;
  }
}

// A backend whose Set waits until the test opens the gate, so calls stay in
// flight.
class GatedBackend final : public StorageBackend {
 public:
  explicit GatedBackend(absl::Notification* gate) : inner_(1 << 20), gate_(gate) {}
  uint64_t max_item_bytes() const override { return inner_.max_item_bytes(); }
  std::vector<absl::Status> Set(absl::Span<const StorageItem> items) override {
    gate_->WaitForNotification();
    return inner_.Set(items);
  }
  std::vector<FetchedItem> Get(absl::Span<const std::string> keys) override {
    return inner_.Get(keys);
  }
  std::vector<bool> ExistPrefix(absl::Span<const std::string> keys) override {
    return inner_.ExistPrefix(keys);
  }
  std::string Describe() const override { return "gated"; }

 private:
  FakeBackend inner_;
  absl::Notification* gate_;
};

TEST_F(StorageTest, PagesInFlightAreBounded) {
  absl::Notification gate;
  StorageTierOptions options;
  options.threads = 2;
  options.max_pages_in_flight = 5;
  StorageTier tier(std::make_unique<GatedBackend>(&gate), options, secret_);
  std::vector<int64_t> src;
  std::shared_ptr<Pool> a = MakePool("a", Mha(LayoutKind::kPageFirst), 6, &src);
  ASSERT_TRUE(a);
  auto never = [](std::vector<PageResult>) { ADD_FAILURE() << "a refused call ran"; };
  absl::Status s = tier.Store(a, ns_, src, {"0", "1", "2", "3", "4", "5"}, never);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(absl::StrContains(s.message(), "a call of 6 pages, over the bound of 5")) << s;
  Results first;
  ASSERT_TRUE(
      tier.Store(a, ns_, {src[0], src[1], src[2], src[3]}, {"0", "1", "2", "3"}, first.Callback())
          .ok());
  EXPECT_EQ(tier.pages_in_flight(), 4u);
  s = tier.Store(a, ns_, {src[4], src[5]}, {"4", "5"}, never);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(absl::StrContains(s.message(), "2 pages asked with 4 in flight, over the bound of 5"))
      << s;
  s = tier.Exist(a, ns_, {"a", "b"}, [](uint64_t) { ADD_FAILURE(); });
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  gate.Notify();
  EXPECT_EQ(first.Outcomes(), std::vector<O>(4, O::kStored));
  EXPECT_EQ(tier.pages_in_flight(), 0u);
  Results second;
  ASSERT_TRUE(tier.Store(a, ns_, {src[4], src[5]}, {"4", "5"}, second.Callback()).ok());
  EXPECT_EQ(second.Outcomes(), std::vector<O>(2, O::kStored));
}

// A hostile cache (issue 29, findings 2 and 4). Headers are little-endian;
// these rewrite a field and fix the header's CRC, as anyone who can write
// to memcached can (neither CRC32C nor the shape fingerprint is secret).
void PutU32(std::string& item, size_t at, uint32_t v) {
  for (int i = 0; i < 4; ++i) item[at + i] = static_cast<char>(v >> (8 * i));
}
uint32_t GetU32(const std::string& item, size_t at) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(item[at + i]);
  return v;
}
void FixHeaderCrc(std::string& item) {
  const size_t crc_at = kPartHeaderBytes - 4;
  PutU32(item, crc_at,
         Crc32c(absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(item.data()), crc_at)));
}

// A backend that remembers the most keys one Get asked for, and can throw.
class WatchedBackend final : public StorageBackend {
 public:
  explicit WatchedBackend(FakeBackend* inner) : inner_(inner) {}
  uint64_t max_item_bytes() const override { return inner_->max_item_bytes(); }
  std::vector<absl::Status> Set(absl::Span<const StorageItem> items) override {
    return inner_->Set(items);
  }
  std::vector<FetchedItem> Get(absl::Span<const std::string> keys) override {
    if (throw_) throw std::bad_alloc();
    most_keys_ = std::max<size_t>(most_keys_, keys.size());
    return inner_->Get(keys);
  }
  std::vector<bool> ExistPrefix(absl::Span<const std::string> keys) override {
    if (throw_) throw std::bad_alloc();
    return inner_->ExistPrefix(keys);
  }
  std::string Describe() const override { return "watched"; }
  std::atomic<size_t> most_keys_{0};
  std::atomic<bool> throw_{false};

 private:
  FakeBackend* inner_;
};

class HostileCacheTest : public StorageTest {
 protected:
  HostileCacheTest() : fake_(kPartHeaderBytes + 300) {  // 768-byte pages: 3 parts
    auto watched = std::make_unique<WatchedBackend>(&fake_);
    watched_ = watched.get();
    StorageTierOptions options;
    options.threads = 2;
    tier_ = std::make_unique<StorageTier>(std::move(watched), options, secret_);
  }
  FakeBackend fake_;
  WatchedBackend* watched_;
  std::unique_ptr<StorageTier> tier_;
};

// One forged 72-byte item with a huge part count cost a FetchPages 24 s and
// 2.1 GiB: the count of an unauthenticated header is believed only when it
// is the one the pool's page and the item size give, so nothing more is
// asked for.
TEST_F(HostileCacheTest, AForgedPartCountAsksForNothingMore) {
  std::vector<int64_t> src, dst;
  std::shared_ptr<Pool> a = MakePool("a", Mha(LayoutKind::kPageFirst), 1, &src);
  std::shared_ptr<Pool> b = MakePool("b", Mha(LayoutKind::kPageFirst), 4, &dst);
  ASSERT_TRUE(a && b);
  Results stored;
  ASSERT_TRUE(tier_->Store(a, ns_, src, {"real"}, stored.Callback()).ok());
  ASSERT_EQ(stored.Outcomes(), std::vector<O>{O::kStored});
  const std::string part0 = fake_.Value(Item("real", 0));
  const uint64_t page_bytes = a->flat_page_bytes();
  std::vector<std::string> keys;
  for (const uint32_t count : {uint32_t(page_bytes + 1), uint32_t{1} << 31, 4u, 0u}) {
    std::string forged = part0;
    PutU32(forged, 44, count);
    FixHeaderCrc(forged);
    keys.push_back(absl::StrCat("forged-", count));
    fake_.Put(Item(keys.back(), 0), forged);
  }
  std::vector<std::vector<uint8_t>> before;
  for (int64_t slot : dst) before.push_back(Page(*b, slot));
  Results fetched;
  ASSERT_TRUE(tier_->Fetch(b, ns_, keys, dst, fetched.Callback()).ok());
  EXPECT_EQ(fetched.Outcomes(), std::vector<O>(4, O::kCorrupt));
  EXPECT_TRUE(absl::StrContains(fetched.pages[0].detail, "have 3 parts"))
      << fetched.pages[0].detail;
  EXPECT_LE(watched_->most_keys_.load(), 4u) << "parts of a forged count were asked for";
  for (size_t i = 0; i < dst.size(); ++i) EXPECT_EQ(Page(*b, dst[i]), before[i]) << i;
}

// A record rewritten in the cache with every CRC recomputed was a clean
// PAGE_HIT of the attacker's bytes: the MAC makes it a miss, counted.
TEST_F(HostileCacheTest, ARecordRewrittenWithRecomputedChecksumsIsAMiss) {
  std::vector<int64_t> src, dst;
  std::shared_ptr<Pool> a = MakePool("a", Mha(LayoutKind::kPageFirst), 1, &src);
  std::shared_ptr<Pool> b = MakePool("b", Mha(LayoutKind::kPageFirst), 1, &dst);
  ASSERT_TRUE(a && b);
  Results stored;
  ASSERT_TRUE(tier_->Store(a, ns_, src, {"victim"}, stored.Callback()).ok());
  ASSERT_EQ(stored.Outcomes(), std::vector<O>{O::kStored});
  std::vector<std::string> parts;
  for (uint32_t p = 0; p < 3; ++p) parts.push_back(fake_.Value(Item("victim", p)));
  // The attacker's bytes in part 1, its CRC and the page CRC recomputed in
  // every part.
  for (size_t i = kPartHeaderBytes; i < parts[1].size(); ++i) parts[1][i] = 'A';
  uint32_t page_crc = 0;
  for (std::string& part : parts) {
    const auto body =
        absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(part.data()) + kPartHeaderBytes,
                            part.size() - kPartHeaderBytes);
    PutU32(part, 48, Crc32c(body));
    page_crc = Crc32cExtend(page_crc, body);
  }
  for (uint32_t p = 0; p < 3; ++p) {
    PutU32(parts[p], 52, page_crc);
    FixHeaderCrc(parts[p]);
    fake_.Put(Item("victim", p), parts[p]);
  }
  ASSERT_NE(GetU32(parts[0], 52), 0u);
  const std::vector<uint8_t> before = Page(*b, dst[0]);
  Results fetched;
  ASSERT_TRUE(tier_->Fetch(b, ns_, {"victim"}, dst, fetched.Callback()).ok());
  EXPECT_EQ(fetched.Outcomes(), std::vector<O>{O::kMiss});
  EXPECT_TRUE(fetched.pages[0].unauthenticated);
  EXPECT_TRUE(absl::StrContains(fetched.pages[0].detail, "not authenticated"))
      << fetched.pages[0].detail;
  EXPECT_EQ(tier_->unauthenticated(), 1u);
  EXPECT_EQ(Page(*b, dst[0]), before);
}

// Namespaces: what one stores another neither sees (Exist, Fetch) nor
// overwrites (Store under the same key).
TEST_F(HostileCacheTest, NamespacesNeitherSeeNorOverwriteEachOther) {
  std::vector<int64_t> victim_slots, attacker_slots, dst;
  std::shared_ptr<Pool> victim = MakePool("v", Mha(LayoutKind::kPageFirst), 1, &victim_slots);
  std::shared_ptr<Pool> attacker = MakePool("x", Mha(LayoutKind::kPageFirst), 1, &attacker_slots);
  std::shared_ptr<Pool> b = MakePool("b", Mha(LayoutKind::kPageFirst), 1, &dst);
  ASSERT_TRUE(victim && attacker && b);
  const std::string mine = secret_.TokenNamespace("victim-token");
  const std::string theirs = secret_.TokenNamespace("attacker-token");
  ASSERT_NE(mine, theirs);
  ASSERT_NE(mine, ns_);
  Results stored;
  ASSERT_TRUE(tier_->Store(victim, mine, victim_slots, {"prefix"}, stored.Callback()).ok());
  ASSERT_EQ(stored.Outcomes(), std::vector<O>{O::kStored});
  EXPECT_EQ(Prefix(*tier_, victim, mine, {"prefix"}), 1u);
  EXPECT_EQ(Prefix(*tier_, attacker, theirs, {"prefix"}), 0u);
  EXPECT_EQ(Prefix(*tier_, attacker, ns_, {"prefix"}), 0u);
  Results seen;
  ASSERT_TRUE(tier_->Fetch(attacker, theirs, {"prefix"}, attacker_slots, seen.Callback()).ok());
  EXPECT_EQ(seen.Outcomes(), std::vector<O>{O::kMiss});
  Results poisoned;
  ASSERT_TRUE(tier_->Store(attacker, theirs, attacker_slots, {"prefix"}, poisoned.Callback()).ok());
  ASSERT_EQ(poisoned.Outcomes(), std::vector<O>{O::kStored});
  Results fetched;
  ASSERT_TRUE(tier_->Fetch(b, mine, {"prefix"}, dst, fetched.Callback()).ok());
  EXPECT_EQ(fetched.Outcomes(), std::vector<O>{O::kHit});
  EXPECT_EQ(Page(*b, dst[0]), Page(*victim, victim_slots[0]));
  EXPECT_NE(Page(*b, dst[0]), Page(*attacker, attacker_slots[0]));
}

// An exception on a tier thread (std::bad_alloc, as four forged items
// caused) fails the job's pages; the process and the tier go on.
TEST_F(HostileCacheTest, AJobThatThrowsFailsItsPagesNotTheProcess) {
  std::vector<int64_t> src;
  std::shared_ptr<Pool> a = MakePool("a", Mha(LayoutKind::kPageFirst), 2, &src);
  ASSERT_TRUE(a);
  watched_->throw_ = true;
  Results fetched;
  ASSERT_TRUE(tier_->Fetch(a, ns_, {"x", "y"}, src, fetched.Callback()).ok());
  EXPECT_EQ(fetched.Outcomes(), std::vector<O>(2, O::kUnavailable));
  EXPECT_EQ(Prefix(*tier_, a, ns_, {"x"}), 0u);
  EXPECT_EQ(tier_->pages_in_flight(), 0u);
  watched_->throw_ = false;
  Results stored;
  ASSERT_TRUE(tier_->Store(a, ns_, src, {"x", "y"}, stored.Callback()).ok());
  EXPECT_EQ(stored.Outcomes(), std::vector<O>(2, O::kStored));
}

// One pool's flood takes at most its share of the bound: another pool's
// calls are still accepted (issue 29, finding 8); one page under more than
// kMaxKeysPerPage keys in a call is refused.
TEST_F(StorageTest, APoolsFloodLeavesTheRestOfTheBoundToOthers) {
  absl::Notification gate;
  StorageTierOptions options;
  options.threads = 2;
  options.max_pages_in_flight = 8;
  options.max_pages_in_flight_per_pool = 4;
  StorageTier tier(std::make_unique<GatedBackend>(&gate), options, secret_);
  std::vector<int64_t> flood_slots, victim_slots;
  std::shared_ptr<Pool> flood = MakePool("flood", Mha(LayoutKind::kPageFirst), 8, &flood_slots);
  std::shared_ptr<Pool> victim = MakePool("victim", Mha(LayoutKind::kPageFirst), 2, &victim_slots);
  ASSERT_TRUE(flood && victim);
  auto never = [](std::vector<PageResult>) { ADD_FAILURE() << "a refused call ran"; };
  std::vector<std::unique_ptr<Results>> accepted;
  int refused = 0;
  for (int i = 0; i < 8; ++i) {
    auto r = std::make_unique<Results>();
    absl::Status s =
        tier.Store(flood, ns_, {flood_slots[i]}, {absl::StrCat("f", i)}, r->Callback());
    if (s.ok()) {
      accepted.push_back(std::move(r));
      continue;
    }
    ++refused;
    EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
    EXPECT_TRUE(absl::StrContains(s.message(), "pool 'flood'")) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "--l3-max-pages-in-flight-per-pool")) << s;
  }
  EXPECT_EQ(accepted.size(), 4u);
  EXPECT_EQ(refused, 4);
  Results mine;
  ASSERT_TRUE(tier.Store(victim, ns_, victim_slots, {"v0", "v1"}, mine.Callback()).ok());
  absl::Status s = tier.Store(victim, ns_, std::vector<int64_t>(5, victim_slots[0]),
                              {"a", "b", "c", "d", "e"}, never);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(), "more than 4 times")) << s;
  gate.Notify();
  EXPECT_EQ(mine.Outcomes(), std::vector<O>(2, O::kStored));
  for (auto& r : accepted) EXPECT_EQ(r->Outcomes(), std::vector<O>{O::kStored});
  EXPECT_EQ(tier.pages_in_flight(), 0u);
}

}  // namespace
}  // namespace kvhost
