// Pool's ownership (server/pool/pool_claim.cc) without a daemon: takeover
// frees every slot and bumps the generation, a live holder refuses other
// sessions' claims and allocation changes, a claim waits out the jobs that
// use the slots (UNAVAILABLE, nothing changed), the session's end releases.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "domain_test_util.h"
#include "pool_test_util.h"
#include "server/pool/pool.h"

namespace kvhost {
namespace {

using ::kvhost::testing::MhaSpec;
using ::kvhost::testing::Msg;
using ::testing::HasSubstr;
using ShmDir = ::kvhost::testing::PoolShmDir;

class PoolClaimUnitTest : public ::testing::Test {
 protected:
  void SetUp() override {
    PoolSpec s = MhaSpec();
    s.head_num = 1, s.head_dim = 8, s.layer_num = 1, s.page_size = 4;
    absl::StatusOr<std::shared_ptr<Pool>> p = Pool::Create("p", s, 64, dir_.path() + "/x.");
    ASSERT_TRUE(p.ok()) << p.status();
    pool_ = *std::move(p);
  }
  absl::Status Alloc(const std::vector<std::string>& sessions, uint64_t tokens) {
    return pool_->ChangeAllocation(sessions, open_, "Alloc",
                                   [&] { return pool_->AllocPages(tokens).status(); });
  }

  ShmDir dir_;
  std::shared_ptr<Pool> pool_;
  std::set<std::string> live_ = {"ses-a", "ses-b"};
  SessionOpen open_ = [this](const std::string& id) { return live_.count(id) > 0; };
};

TEST_F(PoolClaimUnitTest, ATakeoverFreesEverySlotAndBumpsTheGeneration) {
  ASSERT_TRUE(Alloc({}, 24).ok());  // before any claim, anyone allocates
  absl::StatusOr<PoolClaimResult> first = pool_->Claim("a", "ses-a", open_);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->generation, 1u);
  EXPECT_EQ(first->reclaimed_tokens, 24u);
  EXPECT_EQ(pool_->allocator().available_tokens(), 64u);
  ASSERT_TRUE(Alloc({"ses-a"}, 16).ok());

  live_.erase("ses-a");  // the holder's session ends: released, not freed
  EXPECT_EQ(pool_->allocator().available_tokens(), 48u);
  absl::StatusOr<PoolClaimResult> second = pool_->Claim("a", "ses-b", open_);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(second->generation, 2u);
  EXPECT_EQ(second->reclaimed_tokens, 16u);
  EXPECT_FALSE(second->renewed);
  EXPECT_EQ(pool_->holder().session_id, "ses-b");
}

TEST_F(PoolClaimUnitTest, ALiveHolderRefusesOthersAndRenewsItsOwnClaim) {
  ASSERT_TRUE(pool_->Claim("a", "ses-a", open_).ok());
  ASSERT_TRUE(Alloc({"ses-a"}, 8).ok());
  absl::StatusOr<PoolClaimResult> other = pool_->Claim("b", "ses-b", open_);
  ASSERT_EQ(other.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(Msg(other.status()), HasSubstr("held by sglang instance 'a' (generation 1)"));
  // The same session under another instance id is a second owner too.
  EXPECT_EQ(pool_->Claim("b", "ses-a", open_).status().code(),
            absl::StatusCode::kFailedPrecondition);
  absl::Status refused = Alloc({"ses-b", "ses-old"}, 4);
  ASSERT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(Msg(refused), HasSubstr("Alloc from another session"));
  EXPECT_EQ(pool_->allocator().available_tokens(), 56u);
  absl::StatusOr<PoolClaimResult> renewed = pool_->Claim("a", "ses-a", open_);
  ASSERT_TRUE(renewed.ok()) << renewed.status();
  EXPECT_TRUE(renewed->renewed);
  EXPECT_EQ(renewed->generation, 1u);
  EXPECT_EQ(renewed->reclaimed_tokens, 0u);
  EXPECT_EQ(pool_->allocator().available_tokens(), 56u);
}

TEST_F(PoolClaimUnitTest, AClaimWaitsOutTheJobsThatUseTheSlots) {
  ASSERT_TRUE(Alloc({}, 8).ok());
  std::shared_ptr<void> job = pool_->UseSlots();
  absl::StatusOr<PoolClaimResult> busy = pool_->Claim("a", "ses-a", open_);
  ASSERT_EQ(busy.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(Msg(busy.status()), HasSubstr("1 transfers or L3 jobs still use its slots"));
  // Nothing changed: no holder, the slots still allocated.
  EXPECT_EQ(pool_->holder().generation, 0u);
  EXPECT_EQ(pool_->allocator().available_tokens(), 56u);
  job.reset();
  absl::StatusOr<PoolClaimResult> claim = pool_->Claim("a", "ses-a", open_);
  ASSERT_TRUE(claim.ok()) << claim.status();
  EXPECT_EQ(claim->reclaimed_tokens, 8u);
}

TEST_F(PoolClaimUnitTest, AJobsHoldMayOutliveThePool) {
  std::shared_ptr<void> job = pool_->UseSlots();
  pool_.reset();
  job.reset();  // counts down a counter the pool no longer has: no use after free
}

// A change that checks again inside itself (AllocBackup: its submitted
// backup's check) runs the inner check under the lock already held: no
// second reader lock, which deadlocks behind a Claim waiting meanwhile (and
// which Abseil's deadlock detection, on in tests, aborts). The inner check
// still refuses another session while the pool is held.
TEST_F(PoolClaimUnitTest, ANestedCheckOfTheSamePoolRunsUnderTheHeldLock) {
  ASSERT_TRUE(pool_->Claim("a", "ses-a", open_).ok());
  std::thread claim;
  const absl::Status outer = pool_->ChangeAllocation({"ses-a"}, open_, "AllocBackup", [&] {
    // A takeover waits for the outer check's lock meanwhile.
    claim = std::thread([&] { EXPECT_FALSE(pool_->Claim("b", "ses-b", open_).ok()); });
    absl::SleepFor(absl::Milliseconds(50));
    const absl::Status refused =
        pool_->ChangeAllocation({"ses-b"}, open_, "Backup", [] { return absl::OkStatus(); });
    EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
    EXPECT_THAT(Msg(refused), HasSubstr("Backup from another session is refused"));
    return pool_->ChangeAllocation({"ses-a"}, open_, "Backup",
                                   [&] { return pool_->AllocPages(8).status(); });
  });
  claim.join();
  EXPECT_TRUE(outer.ok()) << outer;
  EXPECT_EQ(pool_->allocator().available_tokens(), 56u);
  EXPECT_EQ(pool_->holder().instance_id, "a");
}

}  // namespace
}  // namespace kvhost
