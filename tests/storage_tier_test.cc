// Tests of the L3 tier's domain (server/storage/): CRC32C against its
// published check value and across its two paths, the page record (header,
// parts, checksums, shape fingerprint) and StorageTier over FakeBackend:
// round trips, misses, torn and corrupted pages that never reach the pool,
// pages of another shape refused, refused calls that change nothing, and the
// bound on pages in flight.
#include "server/storage/storage_tier.h"

#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/synchronization/notification.h"
#include "pool_test_util.h"
#include "server/storage/crc32c.h"
#include "server/storage/fake_backend.h"
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

  ShmDir dir_;
  std::mt19937 rng_{42};
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
        EncodePage(*a, a_slots[0], *tag, 9, item_bytes);
    ASSERT_TRUE(items.ok()) << items.status();
    const uint64_t payload = item_bytes - kPartHeaderBytes;
    EXPECT_EQ(items->size(), (768 + payload - 1) / payload);
    EXPECT_EQ(items->size(), PartCount(768, item_bytes));
    for (const std::string& item : *items) EXPECT_LE(item.size(), item_bytes);
    const std::vector<std::optional<std::string>> parts = Optional(*items);
    PageResult r = CheckPage(*tag, parts);
    ASSERT_EQ(r.outcome, PageOutcome::kHit) << r.detail;
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
  const std::vector<std::string> first = *EncodePage(*a, slots[0], tag, 1, item);
  const std::vector<std::string> second = *EncodePage(*a, slots[1], tag, 2, item);
  ASSERT_EQ(first.size(), 4u);

  std::vector<std::optional<std::string>> parts = Optional(first);
  parts[2].reset();  // evicted
  PageResult r = CheckPage(tag, parts);
  EXPECT_EQ(r.outcome, PageOutcome::kMiss);
  EXPECT_TRUE(absl::StrContains(r.detail, "part 2 of 4 is missing")) << r.detail;

  parts = Optional(first);
  parts[1] = second[1];  // another store of the key overwrote part 1
  r = CheckPage(tag, parts);
  EXPECT_EQ(r.outcome, PageOutcome::kCorrupt);
  EXPECT_TRUE(absl::StrContains(r.detail, "another store")) << r.detail;

  for (const size_t at : {size_t{3}, size_t{30}, kPartHeaderBytes + 5}) {
    parts = Optional(first);
    (*parts[3])[at] = static_cast<char>((*parts[3])[at] ^ 0x10);
    r = CheckPage(tag, parts);
    EXPECT_EQ(r.outcome, PageOutcome::kCorrupt) << "byte " << at;
  }
  parts = Optional(first);
  parts[3]->pop_back();  // cut short
  EXPECT_EQ(CheckPage(tag, parts).outcome, PageOutcome::kCorrupt);
  parts = Optional(first);
  parts.pop_back();  // the caller read fewer parts than part 0 says
  EXPECT_EQ(CheckPage(tag, parts).outcome, PageOutcome::kCorrupt);
  parts = Optional(first);
  parts[0].reset();
  EXPECT_EQ(CheckPage(tag, parts).outcome, PageOutcome::kMiss);
  parts = Optional(first);
  parts[0] = std::string("not a page at all");
  EXPECT_EQ(CheckPage(tag, parts).outcome, PageOutcome::kCorrupt);
}

TEST_F(StorageTest, PagesOfAnotherShapeAreRefused) {
  std::vector<int64_t> slots;
  std::shared_ptr<Pool> mha = MakePool("mha", Mha(LayoutKind::kPageFirst), 1, &slots);
  ASSERT_TRUE(mha);
  const PageShapeTag mha_tag = *ShapeTagOf(*mha);
  const std::vector<std::string> items = *EncodePage(*mha, slots[0], mha_tag, 1, 1 << 20);
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
    PageResult r = CheckPage(tag, Optional(items));
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

uint64_t Prefix(StorageTier& tier, std::vector<std::string> keys) {
  absl::Notification done;
  uint64_t prefix = 0;
  absl::Status s = tier.Exist(std::move(keys), [&](uint64_t p) {
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
    tier_ = std::make_unique<StorageTier>(std::move(fake), options);
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
  absl::Status st = tier_->Store(a, src, keys, stored.Callback());
  ASSERT_TRUE(st.ok()) << st;
  EXPECT_EQ(stored.Outcomes(), std::vector<O>(5, O::kStored));
  EXPECT_EQ(fake_->size(), 15u);  // 3 parts each
  EXPECT_EQ(Prefix(*tier_, {"k0", "k1", "k2", "nope", "k4"}), 3u);
  EXPECT_EQ(Prefix(*tier_, keys), 5u);
  EXPECT_EQ(Prefix(*tier_, {}), 0u);
  // Fetch in another order, with a key never stored, into the second pool.
  const std::vector<uint8_t> untouched = Page(*b, dst[5]);
  Results fetched;
  ASSERT_TRUE(tier_
                  ->Fetch(b, {"k3", "k0", "k4", "k1", "k2", "nope"},
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
  ASSERT_TRUE(tier_->Store(a, src, {"t0", "t1", "t2", "t3"}, stored.Callback()).ok());
  ASSERT_TRUE(tier_->Store(mla, mla_slots, {"m0"}, stored_mla.Callback()).ok());
  ASSERT_EQ(stored.Outcomes(), std::vector<O>(4, O::kStored));
  ASSERT_EQ(stored_mla.Outcomes(), std::vector<O>{O::kStored});
  ASSERT_TRUE(fake_->Erase(PartKey("t0", 2)));                        // torn: a part evicted
  ASSERT_TRUE(fake_->Flip(PartKey("t1", 1), kPartHeaderBytes + 17));  // a payload bit flipped
  fake_->Put(PartKey("t2", 1), fake_->Value(PartKey("t3", 1)));       // another store's part
  std::vector<std::vector<uint8_t>> before;
  for (int64_t s : dst) before.push_back(Page(*b, s));
  Results fetched;
  ASSERT_TRUE(tier_->Fetch(b, {"t0", "t1", "t2", "m0"}, dst, fetched.Callback()).ok());
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
  absl::Status s = tier_->Store(a, src, {"only-one"}, never);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(), "1 keys for 2 indices")) << s;
  s = tier_->Store(a, src, {"ok", ""}, never);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(), "keys[1] is empty")) << s;
  s = tier_->Store(a, src, {"ok", std::string(kMaxStorageKeyBytes + 1, 'x')}, never);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(), "keys[1] has 113 bytes")) << s;
  s = tier_->Store(a, {src[0], 2}, {"x", "y"}, never);  // slot 2 is not a page start
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(), "indices[1]: pool 'a'")) << s;
  int64_t unallocated = 0;
  while (unallocated == src[0] || unallocated == src[1]) unallocated += 4;
  const std::vector<uint8_t> before = Page(*a, src[0]);
  s = tier_->Fetch(a, {"x", "y"}, {src[0], unallocated}, never);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(s.message(), "not allocated")) << s;
  s = tier_->Fetch(a, {"x", "y"}, {src[0], src[0]}, never);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(), "indices[1] = " + std::to_string(src[0]))) << s;
  s = tier_->Exist({"a", std::string(200, 'k')}, [](uint64_t) { ADD_FAILURE(); });
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
  ASSERT_TRUE(tier_->Store(a, src, {"d0", "d1"}, stored.Callback()).ok());
  EXPECT_EQ(stored.Outcomes(), std::vector<O>(2, O::kUnavailable));
  EXPECT_TRUE(absl::StrContains(stored.pages[0].detail, "down")) << stored.pages[0].detail;
  const std::vector<uint8_t> before = Page(*a, src[0]);
  Results fetched;
  ASSERT_TRUE(tier_->Fetch(a, {"d0"}, {src[0]}, fetched.Callback()).ok());
  EXPECT_EQ(fetched.Outcomes(), std::vector<O>{O::kMiss});
  EXPECT_EQ(Prefix(*tier_, {"d0"}), 0u);
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
    absl::Status s = tier_->Store(a, src, keys, stored.Callback());
    if (kind == PoolKind::kMhaAsymmetric) {
      EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
      EXPECT_TRUE(absl::StrContains(s.message(), "has no flat page")) << s;
      continue;
    }
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(stored.Outcomes(), std::vector<PageOutcome>(3, PageOutcome::kStored));
    Results fetched;
    ASSERT_TRUE(tier_->Fetch(b, keys, dst, fetched.Callback()).ok());
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
  StorageTier tier(std::make_unique<GatedBackend>(&gate), options);
  std::vector<int64_t> src;
  std::shared_ptr<Pool> a = MakePool("a", Mha(LayoutKind::kPageFirst), 6, &src);
  ASSERT_TRUE(a);
  auto never = [](std::vector<PageResult>) { ADD_FAILURE() << "a refused call ran"; };
  absl::Status s = tier.Store(a, src, {"0", "1", "2", "3", "4", "5"}, never);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(absl::StrContains(s.message(), "a call of 6 pages, over the bound of 5")) << s;
  Results first;
  ASSERT_TRUE(
      tier.Store(a, {src[0], src[1], src[2], src[3]}, {"0", "1", "2", "3"}, first.Callback()).ok());
  EXPECT_EQ(tier.pages_in_flight(), 4u);
  s = tier.Store(a, {src[4], src[5]}, {"4", "5"}, never);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(absl::StrContains(s.message(), "2 pages asked with 4 in flight, over the bound of 5"))
      << s;
  s = tier.Exist({"a", "b"}, [](uint64_t) { ADD_FAILURE(); });
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  gate.Notify();
  EXPECT_EQ(first.Outcomes(), std::vector<O>(4, O::kStored));
  EXPECT_EQ(tier.pages_in_flight(), 0u);
  Results second;
  ASSERT_TRUE(tier.Store(a, {src[4], src[5]}, {"4", "5"}, second.Callback()).ok());
  EXPECT_EQ(second.Outcomes(), std::vector<O>(2, O::kStored));
}

}  // namespace
}  // namespace kvhost
