// Tests of StorageServiceImpl (server/service/storage_service.h) over a real
// registry and the L3 tier on its in-memory backend (FakeBackend), through
// real calls to an in-process gRPC server (tests/in_process_server.h): no
// socket, no kvhostd. StorePages, ExistPages and FetchPages move a pool's
// pages and count them; a detached call's ticket is answered by WaitStorage,
// again and again, for its own pool only, its kept result reserved against
// --memory-limit; a protected pool's keys live in its owner token's
// namespace, which no other caller sees; a group's name acts on its anchor
// pool; a fetch into a pool another live session holds is refused. Every
// refusal (no tier, an unknown pool, a missing or wrong token, lists over
// --max-indices-per-call, bad keys and indices, the pages-in-flight bound, a
// ticket over the memory budget, an unknown ticket) gives its code and a
// message naming the value, with nothing stored, written, reserved or in
// flight.
#include "server/service/storage_service.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "domain_test_util.h"
#include "in_process_server.h"
#include "kvhost/v1/storage.grpc.pb.h"
#include "pool_test_util.h"
#include "server/access/credentials.h"
#include "server/pool/pool.h"
#include "server/pool/pool_group.h"
#include "server/pool/registry.h"
#include "server/storage/fake_backend.h"
#include "server/storage/l3_secret.h"
#include "server/storage/page_record.h"
#include "server/storage/storage_tier.h"

namespace kvhost {
namespace {

using ::kvhost::testing::AbslStatus;
using ::kvhost::testing::ContextWith;
using ::kvhost::testing::InProcessServer;
using ::kvhost::testing::Msg;
using ::kvhost::testing::Options;
using ::kvhost::testing::RegistryTest;
using ::testing::HasSubstr;

constexpr uint64_t kMaxIndices = 8;   // --max-indices-per-call
constexpr uint64_t kMaxInFlight = 6;  // --l3-max-pages-in-flight
constexpr uint32_t kPageSize = 4;
// 2 planes x 2 layers x 4 tokens x 2 heads x 8 x 2 bytes.
constexpr uint64_t kPageBytes = 512;
constexpr uint64_t kMemoryLimit = uint64_t{1} << 30;  // --memory-limit

// 16 pages of kPageBytes.
PoolSpec SmallSpec() {
  PoolSpec s;
  s.kind = PoolKind::kMha;
  s.layout = LayoutKind::kPageFirst;
  s.dtype = DType::kBf16;
  s.page_size = kPageSize;
  s.layer_num = 2;
  s.head_num = 2;
  s.head_dim = 8;
  s.size_tokens = 16 * kPageSize;
  return s;
}

class StorageServiceTest : public RegistryTest {
 protected:
  void SetUp() override {
    RegistryTest::SetUp();
    RegistryOptions options = Options(dir_.path(), &mem_);
    options.memory_limit = kMemoryLimit;
    registry_ = std::make_unique<PoolRegistry>(options);
    pool_ = MakePool("p");
    other_ = MakePool("q");
    owned_ = MakePool("owned", token_);
    ASSERT_TRUE(pool_ && other_ && owned_);
    ASSERT_EQ(pool_->flat_page_bytes(), kPageBytes);
    auto fake = std::make_unique<FakeBackend>(uint64_t{1} << 20);
    fake_ = fake.get();
    StorageTierOptions tier;
    tier.threads = 2;
    tier.max_pages_in_flight = kMaxInFlight;
    tier_ = std::make_unique<StorageTier>(std::move(fake), tier, secret_);
    service_ = std::make_unique<StorageServiceImpl>(
        registry_.get(), tier_.get(), kMaxIndices, nullptr, PerPoolRetention{},
        [this](const std::string& id) { return !open_session_.empty() && id == open_session_; });
    Serve(service_.get());
  }
  void TearDown() override {
    stub_.reset();
    server_.reset();
    service_.reset();
    tier_.reset();
    registry_.reset();
  }

  // Serves `service` (instead of the one before) to stub_.
  void Serve(StorageServiceImpl* service) {
    stub_.reset();
    server_.reset();
    server_ = std::make_unique<InProcessServer>(std::initializer_list<grpc::Service*>{service});
    ASSERT_TRUE(server_->ok());
    stub_ = v1::StorageService::NewStub(server_->Channel());
  }

  std::shared_ptr<Pool> MakePool(const std::string& name, const std::string& token = "") {
    absl::StatusOr<std::shared_ptr<Pool>> p = registry_->Create(name, SmallSpec(), {}, token);
    EXPECT_TRUE(p.ok()) << p.status();
    return p.ok() ? *p : nullptr;
  }
  // `n` pages of `pool` allocated and filled with random bytes: their first
  // slots.
  std::vector<int64_t> Pages(Pool& pool, uint64_t n) {
    absl::StatusOr<std::vector<uint64_t>> got = pool.AllocPages(n * kPageSize);
    EXPECT_TRUE(got.ok()) << got.status();
    std::vector<int64_t> slots;
    if (!got.ok()) return slots;
    for (uint64_t page : *got) {
      const int64_t slot = static_cast<int64_t>(page * kPageSize);
      std::vector<uint8_t> bytes(kPageBytes);
      for (uint8_t& b : bytes) b = static_cast<uint8_t>(rng_());
      EXPECT_TRUE(pool.WritePage(slot, bytes).ok());
      slots.push_back(slot);
    }
    return slots;
  }
  static std::vector<uint8_t> Page(const Pool& pool, int64_t slot) {
    std::vector<uint8_t> out(pool.flat_page_bytes());
    EXPECT_TRUE(pool.ReadPage(slot, absl::MakeSpan(out)).ok());
    return out;
  }

  // The calls, with the owner token `token` ("" for none) in metadata.
  absl::Status Store(const std::string& pool, const std::vector<int64_t>& indices,
                     const std::vector<std::string>& keys, v1::StorePagesResponse* out,
                     const std::string& token = "", bool detach = false) {
    v1::StorePagesRequest req;
    req.set_pool(pool);
    for (int64_t i : indices) req.add_indices(i);
    for (const std::string& k : keys) req.add_keys(k);
    req.set_detach(detach);
    auto context = ContextWith(kOwnerTokenMetadata, token);
    return AbslStatus(stub_->StorePages(context.get(), req, out));
  }
  absl::Status Fetch(const std::string& pool, const std::vector<std::string>& keys,
                     const std::vector<int64_t>& indices, v1::FetchPagesResponse* out,
                     const std::string& token = "", bool detach = false,
                     const std::string& session = "") {
    v1::FetchPagesRequest req;
    req.set_pool(pool);
    for (const std::string& k : keys) req.add_keys(k);
    for (int64_t i : indices) req.add_indices(i);
    req.set_detach(detach);
    auto context = ContextWith(kOwnerTokenMetadata, token);
    if (!session.empty()) context->AddMetadata(kSessionMetadata, session);
    return AbslStatus(stub_->FetchPages(context.get(), req, out));
  }
  absl::Status Exist(const std::string& pool, const std::vector<std::string>& keys,
                     v1::ExistPagesResponse* out, const std::string& token = "") {
    v1::ExistPagesRequest req;
    req.set_pool(pool);
    for (const std::string& k : keys) req.add_keys(k);
    auto context = ContextWith(kOwnerTokenMetadata, token);
    return AbslStatus(stub_->ExistPages(context.get(), req, out));
  }
  // ExistPages' prefix, or a failure.
  uint64_t Prefix(const std::string& pool, const std::vector<std::string>& keys,
                  const std::string& token = "") {
    v1::ExistPagesResponse resp;
    const absl::Status s = Exist(pool, keys, &resp, token);
    EXPECT_TRUE(s.ok()) << s;
    return resp.prefix_pages();
  }
  absl::Status Wait(const std::string& pool, uint64_t ticket, v1::StorageTicketStatus* out,
                    bool poll = false) {
    v1::WaitStorageRequest req;
    req.set_pool(pool);
    req.set_ticket_id(ticket);
    req.set_poll(poll);
    auto context = ContextWith();
    return AbslStatus(stub_->WaitStorage(context.get(), req, out));
  }

  static std::vector<v1::PageOutcome> Outcomes(
      const google::protobuf::RepeatedPtrField<v1::PageResult>& pages) {
    std::vector<v1::PageOutcome> out;
    for (const v1::PageResult& p : pages) out.push_back(p.outcome());
    return out;
  }

  const std::string token_ = "owner-token";
  const L3Secret secret_ = L3Secret::FromBytes("a test secret of at least 32 bytes!");
  std::string open_session_;  // the one live session (ClaimPool's holder); set before calls
  std::mt19937 rng_{42};
  std::unique_ptr<PoolRegistry> registry_;
  std::shared_ptr<Pool> pool_, other_, owned_;
  FakeBackend* fake_ = nullptr;
  std::unique_ptr<StorageTier> tier_;
  std::unique_ptr<StorageServiceImpl> service_;
  std::unique_ptr<InProcessServer> server_;
  std::unique_ptr<v1::StorageService::Stub> stub_;
};

TEST_F(StorageServiceTest, StoreExistFetchMoveAndCountThePages) {
  const std::vector<int64_t> src = Pages(*pool_, 3);
  const std::vector<int64_t> dst = Pages(*other_, 4);
  ASSERT_EQ(src.size(), 3u);
  ASSERT_EQ(dst.size(), 4u);
  v1::StorePagesResponse stored;
  ASSERT_TRUE(Store("p", src, {"k0", "k1", "k2"}, &stored).ok());
  EXPECT_EQ(Outcomes(stored.pages()), std::vector<v1::PageOutcome>(3, v1::PAGE_STORED));
  EXPECT_EQ(stored.stored_pages(), 3u);
  EXPECT_EQ(stored.stored_bytes(), 3 * kPageBytes);
  EXPECT_EQ(stored.ticket_id(), 0u);
  EXPECT_EQ(fake_->size(), 3u);  // a page fits one item

  EXPECT_EQ(Prefix("p", {"k0", "k1", "nope", "k2"}), 2u);
  EXPECT_EQ(Prefix("p", {"k0", "k1", "k2"}), 3u);
  EXPECT_EQ(Prefix("q", {"k0", "k1", "k2"}), 3u);  // unprotected pools share a namespace
  EXPECT_EQ(Prefix("q", {}), 0u);

  const std::vector<uint8_t> untouched = Page(*other_, dst[2]);
  v1::FetchPagesResponse fetched;
  ASSERT_TRUE(Fetch("q", {"k2", "k0", "nope", "k1"}, dst, &fetched).ok());
  EXPECT_EQ(Outcomes(fetched.pages()), (std::vector<v1::PageOutcome>{v1::PAGE_HIT, v1::PAGE_HIT,
                                                                     v1::PAGE_MISS, v1::PAGE_HIT}));
  EXPECT_EQ(fetched.hit_pages(), 3u);
  EXPECT_EQ(fetched.hit_bytes(), 3 * kPageBytes);
  EXPECT_EQ(fetched.pages(0).detail(), "");
  EXPECT_NE(fetched.pages(2).detail(), "");  // a miss says why
  EXPECT_LE(fetched.pages(2).detail().size(), StorageServiceImpl::kMaxDetailBytes);
  EXPECT_EQ(Page(*other_, dst[0]), Page(*pool_, src[2]));
  EXPECT_EQ(Page(*other_, dst[1]), Page(*pool_, src[0]));
  EXPECT_EQ(Page(*other_, dst[3]), Page(*pool_, src[1]));
  EXPECT_EQ(Page(*other_, dst[2]), untouched);
  EXPECT_EQ(tier_->pages_in_flight(), 0u);
}

TEST_F(StorageServiceTest, ACorruptedPageIsReportedAndNeverWritten) {
  const std::vector<int64_t> src = Pages(*pool_, 1);
  const std::vector<int64_t> dst = Pages(*other_, 1);
  v1::StorePagesResponse stored;
  ASSERT_TRUE(Store("p", src, {"k"}, &stored).ok());
  ASSERT_TRUE(fake_->Flip(PartKey(secret_.CacheKey(secret_.PublicNamespace(), "k"), 0),
                          kPartHeaderBytes + 7));
  const std::vector<uint8_t> before = Page(*other_, dst[0]);
  v1::FetchPagesResponse fetched;
  ASSERT_TRUE(Fetch("q", {"k"}, dst, &fetched).ok());
  ASSERT_EQ(fetched.pages_size(), 1);
  EXPECT_EQ(fetched.pages(0).outcome(), v1::PAGE_CORRUPT);
  EXPECT_NE(fetched.pages(0).detail(), "");
  EXPECT_LE(fetched.pages(0).detail().size(), StorageServiceImpl::kMaxDetailBytes);
  EXPECT_EQ(fetched.hit_pages(), 0u);
  EXPECT_EQ(fetched.hit_bytes(), 0u);
  EXPECT_EQ(Page(*other_, dst[0]), before);
}

TEST_F(StorageServiceTest, DetachedCallsAreAnsweredByWaitStorage) {
  const std::vector<int64_t> src = Pages(*pool_, 2);
  const std::vector<int64_t> dst = Pages(*pool_, 2);
  v1::StorePagesResponse store;
  ASSERT_TRUE(Store("p", src, {"a", "b"}, &store, "", /*detach=*/true).ok());
  const uint64_t store_id = store.ticket_id();
  EXPECT_NE(store_id, 0u);
  EXPECT_EQ(store.pages_size(), 0);  // the result comes with the ticket
  EXPECT_EQ(store.stored_pages(), 0u);

  v1::StorageTicketStatus done;
  ASSERT_TRUE(Wait("p", store_id, &done).ok());
  EXPECT_TRUE(done.done());
  EXPECT_EQ(done.ticket_id(), store_id);
  ASSERT_TRUE(done.has_store());
  EXPECT_EQ(done.store().ticket_id(), store_id);
  EXPECT_EQ(done.store().stored_pages(), 2u);
  EXPECT_EQ(done.store().stored_bytes(), 2 * kPageBytes);
  EXPECT_EQ(Outcomes(done.store().pages()), std::vector<v1::PageOutcome>(2, v1::PAGE_STORED));
  // A done ticket stays: asked again (a poll too), the same result.
  v1::StorageTicketStatus again;
  ASSERT_TRUE(Wait("p", store_id, &again, /*poll=*/true).ok());
  EXPECT_TRUE(again.done());
  EXPECT_EQ(again.store().stored_pages(), 2u);

  v1::FetchPagesResponse fetch;
  ASSERT_TRUE(Fetch("p", {"b", "a"}, dst, &fetch, "", /*detach=*/true).ok());
  const uint64_t fetch_id = fetch.ticket_id();
  EXPECT_NE(fetch_id, 0u);
  EXPECT_NE(fetch_id, store_id);
  EXPECT_EQ(fetch.pages_size(), 0);
  v1::StorageTicketStatus fetched;
  ASSERT_TRUE(Wait("p", fetch_id, &fetched).ok());
  EXPECT_TRUE(fetched.done());
  ASSERT_TRUE(fetched.has_fetch());
  EXPECT_EQ(fetched.fetch().ticket_id(), fetch_id);
  EXPECT_EQ(fetched.fetch().hit_pages(), 2u);
  EXPECT_EQ(fetched.fetch().hit_bytes(), 2 * kPageBytes);
  EXPECT_EQ(Page(*pool_, dst[0]), Page(*pool_, src[1]));
  EXPECT_EQ(Page(*pool_, dst[1]), Page(*pool_, src[0]));
  // The kept results are paid for by the memory budget, per page.
  EXPECT_EQ(registry_->transient_bytes(), 4 * StorageTicketTable::kBytesPerPage);

  // A ticket is its pool's: another pool's name, or an id never issued,
  // finds none.
  v1::StorageTicketStatus none;
  absl::Status s = Wait("q", store_id, &none);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_THAT(Msg(s), HasSubstr(absl::StrCat("no storage ticket ", store_id, " of pool 'q'")));
  s = Wait("p", 9999, &none);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_THAT(Msg(s), HasSubstr("no storage ticket 9999 of pool 'p'"));
  s = Wait("nope", store_id, &none);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_THAT(Msg(s), HasSubstr("'nope'"));
  EXPECT_FALSE(none.done());
}

TEST_F(StorageServiceTest, ADetachedCallOverTheMemoryBudgetIsRefused) {
  const std::vector<int64_t> src = Pages(*pool_, 1);
  // All of --memory-limit but 100 bytes taken: a ticket's 384 bytes do not fit.
  absl::StatusOr<TransientReservation> taken =
      registry_->ReserveTransient(kMemoryLimit - registry_->used_bytes() - 100, "the test");
  ASSERT_TRUE(taken.ok()) << taken.status();
  const uint64_t reserved = registry_->transient_bytes();
  v1::StorePagesResponse store;
  absl::Status s = Store("p", src, {"k"}, &store, "", /*detach=*/true);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_THAT(Msg(s), HasSubstr("the results of a detached L3 call of 1 pages of pool 'p'"));
  EXPECT_THAT(Msg(s), HasSubstr("--memory-limit"));
  v1::FetchPagesResponse fetch;
  s = Fetch("p", {"k"}, src, &fetch, "", /*detach=*/true);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_EQ(store.ticket_id(), 0u);
  EXPECT_EQ(fetch.ticket_id(), 0u);
  EXPECT_EQ(fake_->size(), 0u);
  EXPECT_EQ(registry_->transient_bytes(), reserved);
  // An attached call keeps no result: it runs.
  ASSERT_TRUE(Store("p", src, {"k"}, &store).ok());
  EXPECT_EQ(store.stored_pages(), 1u);
  // Room again: the detached call runs.
  *taken = TransientReservation();
  ASSERT_TRUE(Store("p", src, {"k2"}, &store, "", /*detach=*/true).ok());
  EXPECT_NE(store.ticket_id(), 0u);
}

TEST_F(StorageServiceTest, AProtectedPoolsKeysAreItsTokensOwn) {
  const std::vector<int64_t> mine = Pages(*owned_, 2);
  const std::vector<int64_t> theirs = Pages(*pool_, 1);
  v1::StorePagesResponse stored;
  ASSERT_TRUE(Store("owned", {mine[0]}, {"k"}, &stored, token_).ok());
  EXPECT_EQ(stored.stored_pages(), 1u);
  EXPECT_EQ(Prefix("owned", {"k"}, token_), 1u);
  EXPECT_EQ(Prefix("p", {"k"}), 0u);  // the public namespace does not see it
  // The same key in the public namespace neither overwrites nor shows.
  ASSERT_TRUE(Store("p", theirs, {"k"}, &stored).ok());
  EXPECT_EQ(fake_->size(), 2u);
  v1::FetchPagesResponse fetched;
  ASSERT_TRUE(Fetch("owned", {"k"}, {mine[1]}, &fetched, token_).ok());
  EXPECT_EQ(fetched.hit_pages(), 1u);
  EXPECT_EQ(Page(*owned_, mine[1]), Page(*owned_, mine[0]));
  EXPECT_NE(Page(*owned_, mine[1]), Page(*pool_, theirs[0]));
}

TEST_F(StorageServiceTest, AGroupsNameActsOnItsAnchorPool) {
  absl::StatusOr<std::shared_ptr<PoolGroup>> group =
      registry_->CreateGroup("grp", SmallSpec().layer_num, {{"kv", "p", {}, true}});
  ASSERT_TRUE(group.ok()) << group.status();
  const std::vector<int64_t> slots = Pages(*pool_, 2);
  v1::StorePagesResponse stored;
  ASSERT_TRUE(Store("grp", {slots[0]}, {"g"}, &stored).ok());
  EXPECT_EQ(stored.stored_pages(), 1u);
  EXPECT_EQ(Prefix("p", {"g"}), 1u);
  EXPECT_EQ(Prefix("grp", {"g"}), 1u);
  v1::FetchPagesResponse fetched;
  ASSERT_TRUE(Fetch("grp", {"g"}, {slots[1]}, &fetched).ok());
  EXPECT_EQ(fetched.hit_pages(), 1u);
  EXPECT_EQ(Page(*pool_, slots[1]), Page(*pool_, slots[0]));
}

TEST_F(StorageServiceTest, AFetchIntoAPoolAnotherSessionHoldsIsRefused) {
  open_session_ = "s-holder";
  ASSERT_TRUE(pool_
                  ->Claim("inst-a", open_session_,
                          [this](const std::string& id) { return id == open_session_; })
                  .ok());
  const std::vector<int64_t> slots = Pages(*pool_, 2);
  v1::StorePagesResponse stored;
  ASSERT_TRUE(Store("p", {slots[0]}, {"k"}, &stored).ok());  // a store only reads the pool
  const std::vector<uint8_t> before = Page(*pool_, slots[1]);
  for (const std::string session : {"", "s-other"}) {
    v1::FetchPagesResponse fetched;
    const absl::Status s = Fetch("p", {"k"}, {slots[1]}, &fetched, "", false, session);
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << session << ": " << s;
    EXPECT_THAT(Msg(s), HasSubstr("FetchPages")) << session;
    EXPECT_THAT(Msg(s), HasSubstr("'p'")) << session;
    EXPECT_EQ(fetched.pages_size(), 0);
  }
  EXPECT_EQ(Page(*pool_, slots[1]), before);
  // The holder's own session fetches.
  v1::FetchPagesResponse fetched;
  ASSERT_TRUE(Fetch("p", {"k"}, {slots[1]}, &fetched, "", false, "s-holder").ok());
  EXPECT_EQ(fetched.hit_pages(), 1u);
  EXPECT_EQ(Page(*pool_, slots[1]), Page(*pool_, slots[0]));
}

TEST_F(StorageServiceTest, RefusalsChangeNothing) {
  const std::vector<int64_t> src = Pages(*pool_, 2);
  v1::StorePagesResponse stored;
  ASSERT_TRUE(Store("p", src, {"s0", "s1"}, &stored).ok());
  const std::vector<int64_t> dst = Pages(*pool_, kMaxInFlight + 1);
  ASSERT_EQ(dst.size(), kMaxInFlight + 1);
  const int64_t d = dst[0];
  const std::vector<std::string> nine(kMaxIndices + 1, "s0");
  std::vector<std::string> seven;
  for (uint64_t i = 0; i <= kMaxInFlight; ++i) seven.push_back(absl::StrCat("s", i));
  enum Op { kStore, kFetch, kExist };
  struct Case {
    const char* what;
    Op op;
    std::string pool;
    std::vector<int64_t> indices;
    std::vector<std::string> keys;
    std::string token;
    absl::StatusCode code;
    std::string message;
  };
  std::vector<Case> cases;
  using C = absl::StatusCode;
  auto add = [&cases](const char* what, Op op, const std::string& pool,
                      std::vector<int64_t> indices, std::vector<std::string> keys, C code,
                      const std::string& message, const std::string& token = "") {
    cases.push_back({what, op, pool, std::move(indices), std::move(keys), token, code, message});
  };
  add("unknown pool", kStore, "nope", {d}, {"s0"}, C::kNotFound, "'nope'");
  add("unknown pool on fetch", kFetch, "nope", {d}, {"s0"}, C::kNotFound, "'nope'");
  add("indices over the limit", kStore, "p", std::vector<int64_t>(kMaxIndices + 1, d), {"s0"},
      C::kInvalidArgument,
      "pool 'p': indices: 9 is over the daemon's limit of 8 per call (--max-indices-per-call)");
  add("keys over the limit", kFetch, "p", {d}, nine, C::kInvalidArgument,
      "pool 'p': keys: 9 is over the daemon's limit of 8");
  add("exist keys over the limit", kExist, "p", {}, nine, C::kInvalidArgument,
      "pool 'p': keys: 9 is over the daemon's limit of 8");
  add("a key short", kStore, "p", {dst[0], dst[1]}, {"s0"}, C::kInvalidArgument,
      "pool 'p': 1 keys for 2 indices");
  add("an empty key", kStore, "p", {dst[0], dst[1]}, {"x", ""}, C::kInvalidArgument,
      "keys[1] is empty");
  add("a key too long", kFetch, "p", {d}, {std::string(kMaxStorageKeyBytes + 1, 'k')},
      C::kInvalidArgument,
      absl::StrCat("keys[0] has ", kMaxStorageKeyBytes + 1, " bytes, over the limit of ",
                   kMaxStorageKeyBytes));
  add("not a page's first slot", kStore, "p", {d + 1}, {"x"}, C::kInvalidArgument,
      absl::StrCat("indices[0]: pool 'p' (MHA/PAGE_FIRST): index ", d + 1,
                   " is not the first slot of a page"));
  add("a negative index", kFetch, "p", {-4}, {"s0"}, C::kInvalidArgument, "index -4");
  add("an unallocated page", kFetch, "q", {0}, {"s0"}, C::kFailedPrecondition,
      "indices[0]: pool 'q' (MHA/PAGE_FIRST): the page at index 0 is not allocated");
  add("a page under five keys", kStore, "p", {d, d, d, d, d}, {"a", "b", "c", "d", "e"},
      C::kInvalidArgument,
      absl::StrCat("pool 'p': indices[4] = ", d, " is given more than 4 times"));
  add("a page fetched twice", kFetch, "p", {d, d}, {"s0", "s1"}, C::kInvalidArgument,
      absl::StrCat("pool 'p': indices[1] = ", d, " is given twice"));
  add("a store over the bound in flight", kStore, "p", dst, seven, C::kResourceExhausted,
      "a call of 7 pages, over the bound of 6 pages in flight (--l3-max-pages-in-flight)");
  add("a fetch over the bound in flight", kFetch, "p", dst, seven, C::kResourceExhausted,
      "a call of 7 pages, over the bound of 6");
  add("an exist over the bound in flight", kExist, "p", {}, seven, C::kResourceExhausted,
      "a call of 7 pages, over the bound of 6");
  add("exist without a pool", kExist, "", {}, {"s0"}, C::kInvalidArgument,
      "ExistPages names no pool");
  add("exist with an empty key", kExist, "p", {}, {"s0", ""}, C::kInvalidArgument,
      "keys[1] is empty");
  add("no token for a protected pool", kStore, "owned", {d}, {"s0"}, C::kPermissionDenied,
      "'owned'");
  add("a wrong token", kFetch, "owned", {d}, {"s0"}, C::kPermissionDenied, "'owned'",
      "not-the-token");
  add("exist without the token", kExist, "owned", {}, {"s0"}, C::kPermissionDenied, "'owned'");
  const uint64_t items = fake_->size();
  std::vector<std::vector<uint8_t>> pages;
  for (int64_t slot : dst) pages.push_back(Page(*pool_, slot));
  for (const Case& c : cases) {
    absl::Status s;
    v1::StorePagesResponse store;
    v1::FetchPagesResponse fetch;
    v1::ExistPagesResponse exist;
    for (bool detach : {false, true}) {
      if (c.op == kExist && detach) continue;
      if (c.op == kStore) s = Store(c.pool, c.indices, c.keys, &store, c.token, detach);
      if (c.op == kFetch) s = Fetch(c.pool, c.keys, c.indices, &fetch, c.token, detach);
      if (c.op == kExist) s = Exist(c.pool, c.keys, &exist, c.token);
      EXPECT_EQ(s.code(), c.code) << c.what << (detach ? " (detached): " : ": ") << s;
      EXPECT_THAT(Msg(s), HasSubstr(c.message)) << c.what;
      EXPECT_EQ(store.pages_size() + fetch.pages_size(), 0) << c.what;
      EXPECT_EQ(store.ticket_id() + fetch.ticket_id() + exist.prefix_pages(), 0u) << c.what;
      EXPECT_EQ(fake_->size(), items) << c.what;
      EXPECT_EQ(tier_->pages_in_flight(), 0u) << c.what;
      EXPECT_EQ(registry_->transient_bytes(), 0u) << c.what;  // no ticket kept
    }
  }
  for (size_t i = 0; i < dst.size(); ++i) EXPECT_EQ(Page(*pool_, dst[i]), pages[i]) << i;
}

TEST_F(StorageServiceTest, WithoutATierEveryCallSaysSo) {
  StorageServiceImpl none(registry_.get(), nullptr, kMaxIndices);
  Serve(&none);
  const std::vector<int64_t> slots = Pages(*pool_, 1);
  v1::StorePagesResponse store;
  v1::FetchPagesResponse fetch;
  v1::ExistPagesResponse exist;
  v1::StorageTicketStatus wait;
  for (const absl::Status& s : {Store("p", slots, {"k"}, &store), Fetch("p", {"k"}, slots, &fetch),
                                Exist("p", {"k"}, &exist), Wait("p", 1, &wait)}) {
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_THAT(Msg(s), HasSubstr("this kvhostd has no L3 tier: start it with --l3-memcached"));
  }
  Serve(service_.get());  // before `none` goes
}

}  // namespace
}  // namespace kvhost
