// Tests of PoolServiceImpl's shared call bodies (server/service/pool_service.h)
// on a real registry, without a gRPC server: DoAlloc, DoAllocBatch, DoFree and
// DoClaimPool, their happy paths and their refusals (INVALID_ARGUMENT naming
// the value, NOT_FOUND, PERMISSION_DENIED, RESOURCE_EXHAUSTED above the reply
// limit, FAILED_PRECONDITION for another session's change of a held pool),
// each failed call leaving the pool's free slots as they were.
#include "server/service/pool_service.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "domain_test_util.h"
#include "pool_test_util.h"
#include "server/access/caller.h"
#include "server/pool/pool.h"
#include "server/pool/registry.h"

namespace kvhost {
namespace {

using ::kvhost::testing::MhaSpec;
using ::kvhost::testing::Msg;
using ::kvhost::testing::Options;
using ::kvhost::testing::RegistryTest;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr uint64_t kPageSize = 16;    // MhaSpec
constexpr uint64_t kTokens = 1024;    // MhaSpec
constexpr uint64_t kMaxIndices = 64;  // the service's --max-indices-per-call
constexpr uint64_t kReply = 1 << 20;  // max_reply_bytes: room for any reply here

class PoolServiceTest : public RegistryTest {
 protected:
  void SetUp() override {
    RegistryTest::SetUp();
    registry_ = std::make_unique<PoolRegistry>(Options(dir_.path(), &mem_));
    absl::StatusOr<std::shared_ptr<Pool>> p = registry_->Create("p", MhaSpec());
    ASSERT_TRUE(p.ok()) << p.status();
    pool_ = *p;
    absl::StatusOr<std::shared_ptr<Pool>> owned = registry_->Create("owned", MhaSpec(), {}, token_);
    ASSERT_TRUE(owned.ok()) << owned.status();
    owned_ = *owned;
    service_ = std::make_unique<PoolServiceImpl>(
        registry_.get(), "host", 64 << 20, nullptr, kMaxIndices,
        [this](const std::string& id) { return open_sessions_.count(id) != 0; });
  }
  void TearDown() override {
    service_.reset();
    registry_.reset();
  }

  uint64_t Available(const Pool& p) const { return p.allocator().available_tokens(); }

  absl::StatusOr<v1::AllocResponse> Alloc(const Caller& caller, const std::string& pool,
                                          uint64_t n) {
    v1::AllocRequest req;
    req.set_pool(pool);
    req.set_num_tokens(n);
    v1::AllocResponse resp;
    absl::Status s = service_->DoAlloc(caller, req, &resp, kReply);
    if (!s.ok()) return s;
    return resp;
  }
  absl::StatusOr<v1::FreeResponse> Free(const Caller& caller, const std::string& pool,
                                        const std::vector<int64_t>& indices) {
    v1::FreeRequest req;
    req.set_pool(pool);
    for (int64_t i : indices) req.add_indices(i);
    v1::FreeResponse resp;
    absl::Status s = service_->DoFree(caller, req, &resp);
    if (!s.ok()) return s;
    return resp;
  }
  absl::StatusOr<v1::PoolClaim> Claim(const Caller& caller, const std::string& pool,
                                      const std::string& instance) {
    v1::ClaimPoolRequest req;
    req.set_pool(pool);
    req.set_instance_id(instance);
    v1::PoolClaim resp;
    absl::Status s = service_->DoClaimPool(caller, req, &resp);
    if (!s.ok()) return s;
    return resp;
  }

  const std::string token_ = "owner-token";
  std::set<std::string> open_sessions_;
  std::unique_ptr<PoolRegistry> registry_;
  std::shared_ptr<Pool> pool_;
  std::shared_ptr<Pool> owned_;
  std::unique_ptr<PoolServiceImpl> service_;
};

// Whole pages, each a run of page_size consecutive slots starting a page.
void ExpectWholePages(const google::protobuf::RepeatedField<int64_t>& indices, size_t want) {
  ASSERT_EQ(static_cast<size_t>(indices.size()), want);
  for (int i = 0; i < indices.size(); ++i) {
    if (i % kPageSize == 0) {
      EXPECT_EQ(indices[i] % static_cast<int64_t>(kPageSize), 0) << i;
    } else {
      EXPECT_EQ(indices[i], indices[i - 1] + 1) << i;
    }
    EXPECT_GE(indices[i], 0);
    EXPECT_LT(indices[i], static_cast<int64_t>(kTokens));
  }
}

TEST_F(PoolServiceTest, AllocThenFreeGivesTheSlotsBack) {
  absl::StatusOr<v1::AllocResponse> a = Alloc({}, "p", 2 * kPageSize);
  ASSERT_TRUE(a.ok()) << a.status();
  ExpectWholePages(a->indices(), 2 * kPageSize);
  EXPECT_EQ(a->available_tokens(), kTokens - 2 * kPageSize);
  EXPECT_EQ(Available(*pool_), kTokens - 2 * kPageSize);
  EXPECT_EQ(Available(*owned_), kTokens);  // the other pool untouched
  const std::vector<int64_t> slots(a->indices().begin(), a->indices().end());
  absl::StatusOr<v1::FreeResponse> f = Free({}, "p", slots);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->freed(), 2 * kPageSize);
  EXPECT_EQ(f->available_tokens(), kTokens);
  EXPECT_EQ(Available(*pool_), kTokens);
}

TEST_F(PoolServiceTest, AllocRefusalsNameTheValueAndChangeNothing) {
  struct Case {
    std::string pool;
    uint64_t n;
    absl::StatusCode code;
    std::string message;
  };
  const Case cases[] = {
      {"p", 0, absl::StatusCode::kInvalidArgument, "num_tokens 0 is not a positive multiple"},
      {"p", 17, absl::StatusCode::kInvalidArgument,
       "num_tokens 17 is not a positive multiple of page_size 16"},
      {"p", kMaxIndices + kPageSize, absl::StatusCode::kInvalidArgument,
       "pool 'p': Alloc num_tokens: 80 is over the daemon's limit of 64"},
      {"absent", kPageSize, absl::StatusCode::kNotFound, "'absent'"},
      {"owned", kPageSize, absl::StatusCode::kPermissionDenied, "pool 'owned' is owner-protected"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<v1::AllocResponse> a = Alloc({}, c.pool, c.n);
    EXPECT_EQ(a.status().code(), c.code) << c.pool << " " << c.n << ": " << a.status();
    EXPECT_THAT(Msg(a.status()), HasSubstr(c.message));
  }
  EXPECT_EQ(Available(*pool_), kTokens);
  EXPECT_EQ(Available(*owned_), kTokens);
  // The owner's token opens it.
  absl::StatusOr<v1::AllocResponse> mine = Alloc({{}, token_}, "owned", kPageSize);
  ASSERT_TRUE(mine.ok()) << mine.status();
  EXPECT_EQ(Available(*owned_), kTokens - kPageSize);
}

TEST_F(PoolServiceTest, AllocOverThePoolIsResourceExhaustedAndChangesNothing) {
  auto big = std::make_unique<PoolServiceImpl>(registry_.get(), "host", 64 << 20, nullptr,
                                               uint64_t{1} << 20);
  v1::AllocRequest req;
  req.set_pool("p");
  req.set_num_tokens(kTokens + kPageSize);
  v1::AllocResponse resp;
  const absl::Status s = big->DoAlloc({}, req, &resp, kReply);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_THAT(Msg(s), HasSubstr("num_tokens 1040 requested but only 1024 of 1024 slots are free"));
  EXPECT_EQ(resp.indices_size(), 0);
  EXPECT_EQ(Available(*pool_), kTokens);
}

TEST_F(PoolServiceTest, AllocWhoseReplyCannotFitIsRefusedBeforeAllocating) {
  v1::AllocRequest req;
  req.set_pool("p");
  req.set_num_tokens(4 * kPageSize);
  v1::AllocResponse resp;
  // 64 slots below 1024 take 2 bytes each: 128 + 32 bytes of reply.
  const absl::Status s = service_->DoAlloc({}, req, &resp, 100);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_THAT(Msg(s), HasSubstr("pool 'p': num_tokens 64 needs a response of up to 160 bytes, "
                                "over the 100-byte message limit"));
  EXPECT_EQ(resp.indices_size(), 0);
  EXPECT_EQ(Available(*pool_), kTokens);
  EXPECT_TRUE(service_->DoAlloc({}, req, &resp, 160).ok());
}

TEST_F(PoolServiceTest, AllocBatchAllocatesEveryRun) {
  v1::AllocBatchRequest req;
  req.set_pool("p");
  req.add_num_tokens(kPageSize);
  req.add_num_tokens(3 * kPageSize);
  v1::AllocBatchResponse resp;
  ASSERT_TRUE(service_->DoAllocBatch({}, req, &resp, kReply).ok());
  ASSERT_EQ(resp.runs_size(), 2);
  ExpectWholePages(resp.runs(0).indices(), kPageSize);
  ExpectWholePages(resp.runs(1).indices(), 3 * kPageSize);
  std::set<int64_t> all(resp.runs(0).indices().begin(), resp.runs(0).indices().end());
  all.insert(resp.runs(1).indices().begin(), resp.runs(1).indices().end());
  EXPECT_EQ(all.size(), 4 * kPageSize);  // no slot twice
  EXPECT_EQ(resp.available_tokens(), kTokens - 4 * kPageSize);
  EXPECT_EQ(Available(*pool_), kTokens - 4 * kPageSize);
}

TEST_F(PoolServiceTest, AFailedAllocBatchFreesWhatItAllocated) {
  // The second run fails (not a multiple of the page size) after the first
  // was allocated: the first is freed again and the response is empty.
  v1::AllocBatchRequest req;
  req.set_pool("p");
  req.add_num_tokens(2 * kPageSize);
  req.add_num_tokens(5);
  v1::AllocBatchResponse resp;
  const absl::Status s = service_->DoAllocBatch({}, req, &resp, kReply);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(Msg(s),
              HasSubstr("AllocBatch allocation 1 of 2: pool 'p': num_tokens 5 is not a positive"));
  EXPECT_EQ(resp.runs_size(), 0);
  EXPECT_EQ(resp.available_tokens(), 0u);
  EXPECT_EQ(Available(*pool_), kTokens);
  // More than the pool holds, over two runs: RESOURCE_EXHAUSTED, nothing kept.
  auto big = std::make_unique<PoolServiceImpl>(registry_.get(), "host", 64 << 20, nullptr,
                                               uint64_t{1} << 20);
  req.set_num_tokens(1, kTokens);
  resp.Clear();
  const absl::Status full = big->DoAllocBatch({}, req, &resp, kReply);
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted) << full;
  EXPECT_EQ(resp.runs_size(), 0);
  EXPECT_EQ(Available(*pool_), kTokens);
}

TEST_F(PoolServiceTest, AllocBatchCountsEachRunAndTheirSum) {
  v1::AllocBatchRequest req;
  req.set_pool("p");
  v1::AllocBatchResponse resp;
  absl::Status s = service_->DoAllocBatch({}, req, &resp, kReply);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(Msg(s), HasSubstr("num_tokens is empty"));
  req.add_num_tokens(kMaxIndices + kPageSize);
  s = service_->DoAllocBatch({}, req, &resp, kReply);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(Msg(s), HasSubstr("pool 'p': AllocBatch num_tokens: 80 is over"));
  // Each run under the limit, their sum over it.
  req.set_num_tokens(0, 3 * kPageSize);
  req.add_num_tokens(2 * kPageSize);
  s = service_->DoAllocBatch({}, req, &resp, kReply);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(Msg(s), HasSubstr("pool 'p': AllocBatch total num_tokens: 80 is over"));
  EXPECT_EQ(resp.runs_size(), 0);
  EXPECT_EQ(Available(*pool_), kTokens);
}

TEST_F(PoolServiceTest, FreeRefusalsNameTheValueAndChangeNothing) {
  absl::StatusOr<v1::AllocResponse> a = Alloc({}, "p", 2 * kPageSize);
  ASSERT_TRUE(a.ok()) << a.status();
  const std::vector<int64_t> slots(a->indices().begin(), a->indices().end());
  const int64_t first = slots[0];
  std::vector<int64_t> broken = slots;
  broken[3] = first;  // breaks the first page's run
  // A page never allocated, beside one that is: neither is freed.
  std::vector<int64_t> unallocated(slots.begin(), slots.begin() + kPageSize);
  const int64_t spare = first == 0 ? static_cast<int64_t>(kTokens - kPageSize) : 0;
  for (uint64_t j = 0; j < kPageSize; ++j) unallocated.push_back(spare + static_cast<int64_t>(j));
  struct Case {
    std::vector<int64_t> indices;
    absl::StatusCode code;
    std::string message;
  };
  const Case cases[] = {
      {{}, absl::StatusCode::kInvalidArgument, "indices length 0"},
      {{first}, absl::StatusCode::kInvalidArgument, "indices length 1"},
      {std::vector<int64_t>(kPageSize, -1), absl::StatusCode::kInvalidArgument, "index -1"},
      {broken, absl::StatusCode::kInvalidArgument, "breaks the page run"},
      {std::vector<int64_t>(kMaxIndices + 1, first), absl::StatusCode::kInvalidArgument,
       "pool 'p': Free indices: 65 is over"},
      {unallocated, absl::StatusCode::kFailedPrecondition, "page "},
  };
  for (const Case& c : cases) {
    absl::StatusOr<v1::FreeResponse> f = Free({}, "p", c.indices);
    EXPECT_EQ(f.status().code(), c.code) << c.message << ": " << f.status();
    EXPECT_THAT(Msg(f.status()), HasSubstr(c.message));
    EXPECT_EQ(Available(*pool_), kTokens - 2 * kPageSize) << c.message;
  }
  EXPECT_EQ(Free({}, "absent", slots).status().code(), absl::StatusCode::kNotFound);
  // Twice: the second is refused and frees nothing more.
  ASSERT_TRUE(Free({}, "p", slots).ok());
  absl::StatusOr<v1::FreeResponse> again = Free({}, "p", slots);
  EXPECT_EQ(again.status().code(), absl::StatusCode::kFailedPrecondition) << again.status();
  EXPECT_EQ(Available(*pool_), kTokens);
}

TEST_F(PoolServiceTest, ClaimTakesThePoolOverAndFreesItsSlots) {
  ASSERT_TRUE(Alloc({}, "p", 3 * kPageSize).ok());
  open_sessions_ = {"s1"};
  const Caller s1{{"s1"}, std::nullopt};
  absl::StatusOr<v1::PoolClaim> c = Claim(s1, "p", "inst-a");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->generation(), 1u);
  EXPECT_EQ(c->reclaimed_tokens(), 3 * kPageSize);
  EXPECT_EQ(c->available_tokens(), kTokens);
  EXPECT_FALSE(c->renewed());
  EXPECT_EQ(Available(*pool_), kTokens);
  // The same session again: renewed, nothing changed.
  absl::StatusOr<v1::AllocResponse> a = Alloc(s1, "p", kPageSize);
  ASSERT_TRUE(a.ok()) << a.status();
  c = Claim(s1, "p", "inst-a");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->generation(), 1u);
  EXPECT_TRUE(c->renewed());
  EXPECT_EQ(c->reclaimed_tokens(), 0u);
  EXPECT_EQ(Available(*pool_), kTokens - kPageSize);
  // GetPool's holder: instance and generation, live while s1 is open.
  v1::Pool shown;
  service_->SetHolder(*pool_, &shown);
  EXPECT_EQ(shown.holder().instance_id(), "inst-a");
  EXPECT_EQ(shown.holder().generation(), 1u);
  EXPECT_TRUE(shown.holder().live());
}

TEST_F(PoolServiceTest, AnotherSessionsChangesOfAHeldPoolAreRefused) {
  open_sessions_ = {"s1", "s2"};
  const Caller s1{{"s1"}, std::nullopt}, s2{{"s2"}, std::nullopt};
  ASSERT_TRUE(Claim(s1, "p", "inst-a").ok());
  absl::StatusOr<v1::AllocResponse> mine = Alloc(s1, "p", kPageSize);
  ASSERT_TRUE(mine.ok()) << mine.status();
  const std::vector<int64_t> slots(mine->indices().begin(), mine->indices().end());
  const uint64_t held = Available(*pool_);
  for (const Caller& other : {s2, Caller{}}) {
    absl::StatusOr<v1::AllocResponse> a = Alloc(other, "p", kPageSize);
    EXPECT_EQ(a.status().code(), absl::StatusCode::kFailedPrecondition) << a.status();
    EXPECT_THAT(Msg(a.status()), HasSubstr("pool 'p' is held by"));
    EXPECT_THAT(Msg(a.status()), HasSubstr("Alloc from another session is refused"));
    absl::StatusOr<v1::FreeResponse> f = Free(other, "p", slots);
    EXPECT_EQ(f.status().code(), absl::StatusCode::kFailedPrecondition) << f.status();
    EXPECT_THAT(Msg(f.status()), HasSubstr("Free from another session is refused"));
    v1::AllocBatchRequest req;
    req.set_pool("p");
    req.add_num_tokens(kPageSize);
    v1::AllocBatchResponse resp;
    const absl::Status b = service_->DoAllocBatch(other, req, &resp, kReply);
    EXPECT_EQ(b.code(), absl::StatusCode::kFailedPrecondition) << b;
    EXPECT_EQ(resp.runs_size(), 0);
    EXPECT_EQ(Available(*pool_), held);
  }
  // A second owner while s1 is live is refused; the holder stays.
  absl::StatusOr<v1::PoolClaim> second = Claim(s2, "p", "inst-b");
  EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition) << second.status();
  EXPECT_THAT(Msg(second.status()), HasSubstr("a second owner is refused"));
  EXPECT_EQ(pool_->holder().instance_id, "inst-a");
  EXPECT_EQ(Available(*pool_), held);
  // Once s1 ends, s2 takes it over and gets the slots back.
  open_sessions_.erase("s1");
  absl::StatusOr<v1::PoolClaim> taken = Claim(s2, "p", "inst-b");
  ASSERT_TRUE(taken.ok()) << taken.status();
  EXPECT_EQ(taken->generation(), 2u);
  EXPECT_EQ(taken->reclaimed_tokens(), kPageSize);
  EXPECT_EQ(Available(*pool_), kTokens);
}

TEST_F(PoolServiceTest, ClaimRefusals) {
  open_sessions_ = {"s1"};
  const Caller s1{{"s1"}, std::nullopt};
  ASSERT_TRUE(Alloc({}, "p", kPageSize).ok());
  struct Case {
    Caller caller;
    std::string pool;
    std::string instance;
    absl::StatusCode code;
    std::string message;
  };
  const Case cases[] = {
      {s1, "p", "", absl::StatusCode::kInvalidArgument, "instance_id '' (0 bytes) must be 1-128"},
      {s1, "p", std::string(129, 'x'), absl::StatusCode::kInvalidArgument, "(129 bytes)"},
      {s1, "p", "bad\nid", absl::StatusCode::kInvalidArgument, "printable ASCII"},
      {s1, "absent", "inst", absl::StatusCode::kNotFound, "'absent'"},
      {s1, "owned", "inst", absl::StatusCode::kPermissionDenied, "owner-protected"},
      {Caller{}, "p", "inst", absl::StatusCode::kFailedPrecondition,
       "ClaimPool needs the caller's worker session"},
      {Caller{{"closed"}, std::nullopt}, "p", "inst", absl::StatusCode::kFailedPrecondition,
       "ClaimPool needs the caller's worker session"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<v1::PoolClaim> r = Claim(c.caller, c.pool, c.instance);
    EXPECT_EQ(r.status().code(), c.code) << c.message << ": " << r.status();
    EXPECT_THAT(Msg(r.status()), HasSubstr(c.message));
    EXPECT_THAT(Msg(r.status()), Not(HasSubstr(token_)));
  }
  EXPECT_EQ(pool_->holder().generation, 0u);
  EXPECT_EQ(Available(*pool_), kTokens - kPageSize);
  v1::Pool shown;
  service_->SetHolder(*pool_, &shown);
  EXPECT_FALSE(shown.has_holder());
}

}  // namespace
}  // namespace kvhost
