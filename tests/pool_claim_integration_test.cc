// ClaimPool through a real kvhostd (host backend): one sglang instance owns
// a pool at a time. A second live owner is refused and changes nothing; the
// owner's own claim again is renewed; once the owner's session ends, a claim
// takes the pool over in one call (generation + 1, every slot the dead owner
// allocated freed); while a pool is held, other sessions' Alloc, AllocBatch
// and Free are refused on gRPC and on the fast path alike, and so are their
// writes of its pages (SetFromFlatDataPage, WritePages, a Backup from their
// own attachment), leaving the pages as they were; all allowed again once
// the holder's session ends; bad instance ids and sessionless claims are
// refused naming the value.
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "api_test_util.h"
#include "daemon_fixture.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvhost/client.h"
#include "kvhost/v1/transfer.pb.h"

namespace kvhost {
namespace {

using ::kvhost::testing::MakeSpec;
using ::kvhost::testing::TestDaemon;

constexpr uint64_t kPoolTokens = 256;

class PoolClaimTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<TestDaemon>> d = TestDaemon::Start(KVHOSTD_PATH);
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = *std::move(d);
    ASSERT_TRUE(
        daemon_->client().CreatePool("p", MakeSpec(v1::MHA, v1::LAYER_FIRST, 4, kPoolTokens)).ok());
  }
  void TearDown() override {
    if (daemon_ != nullptr && HasFailure()) {
      std::fprintf(stderr, "--- kvhostd log ---\n%s\n", daemon_->Log().c_str());
    }
  }
  // A scheduler's client: its own worker session; `fast_path` picks the
  // path its Alloc / Free take.
  std::unique_ptr<Client> Scheduler(bool fast_path = false, bool session = true) {
    ClientOptions options;
    options.address = daemon_->address();
    options.fast_path = fast_path;
    options.worker_session = session;
    absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect(options);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? *std::move(c) : nullptr;
  }
  v1::Pool Pool() {
    absl::StatusOr<v1::Pool> p = daemon_->client().GetPool("p");
    EXPECT_TRUE(p.ok()) << p.status();
    return p.ok() ? *p : v1::Pool();
  }
  // The holder's session end is the daemon's to notice: waits for it.
  void WaitReleased() {
    for (int i = 0; i < 500 && Pool().holder().live(); ++i) absl::SleepFor(absl::Milliseconds(10));
    ASSERT_FALSE(Pool().holder().live()) << "the holder's session did not end";
  }

  std::unique_ptr<TestDaemon> daemon_;
};

TEST_F(PoolClaimTest, ASecondLiveOwnerIsRefusedAndTheOwnersOwnClaimIsRenewed) {
  std::unique_ptr<Client> a = Scheduler();
  std::unique_ptr<Client> b = Scheduler();
  absl::StatusOr<v1::PoolClaim> first = a->ClaimPool("p", "inst-a");
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->generation(), 1u);
  EXPECT_EQ(first->reclaimed_tokens(), 0u);
  EXPECT_FALSE(first->renewed());
  EXPECT_EQ(first->available_tokens(), kPoolTokens);

  absl::StatusOr<v1::PoolClaim> second = b->ClaimPool("p", "inst-b");
  ASSERT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition) << second.status();
  EXPECT_THAT(
      std::string(second.status().message()),
      ::testing::AllOf(::testing::HasSubstr("pool 'p'"), ::testing::HasSubstr("'inst-a'"),
                       ::testing::HasSubstr("generation 1"), ::testing::HasSubstr("second owner")));
  // Even under the holder's own instance id: a live owner is one session.
  EXPECT_EQ(b->ClaimPool("p", "inst-a").status().code(), absl::StatusCode::kFailedPrecondition);

  absl::StatusOr<v1::PoolClaim> again = a->ClaimPool("p", "inst-a");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(again->renewed());
  EXPECT_EQ(again->generation(), 1u);
  EXPECT_EQ(again->reclaimed_tokens(), 0u);

  const v1::Pool pool = Pool();
  ASSERT_TRUE(pool.has_holder());
  EXPECT_EQ(pool.holder().instance_id(), "inst-a");
  EXPECT_EQ(pool.holder().generation(), 1u);
  EXPECT_TRUE(pool.holder().live());
  // The holder's session id is a capability: shown nowhere.
  for (const std::string& id : a->session_ids()) {
    EXPECT_EQ(pool.DebugString().find(id), std::string::npos);
  }
}

TEST_F(PoolClaimTest, AClaimAfterTheHoldersSessionEndsReclaimsItsSlotsInOneCall) {
  std::unique_ptr<Client> a = Scheduler();
  ASSERT_TRUE(a->ClaimPool("p", "sched").ok());
  ASSERT_TRUE(a->Alloc("p", 64).ok());
  const std::vector<uint64_t> runs = {16, 8};
  ASSERT_TRUE(a->AllocBatch("p", runs).ok());
  EXPECT_EQ(Pool().available_tokens(), kPoolTokens - 88);

  a.reset();  // the scheduler dies: its session ends, its radix tree with it
  WaitReleased();
  // Released, not freed: the slots wait for the next claim.
  EXPECT_EQ(Pool().available_tokens(), kPoolTokens - 88);
  EXPECT_EQ(Pool().holder().generation(), 1u);

  std::unique_ptr<Client> restarted = Scheduler();
  absl::StatusOr<v1::PoolClaim> claim = restarted->ClaimPool("p", "sched");
  ASSERT_TRUE(claim.ok()) << claim.status();
  EXPECT_EQ(claim->generation(), 2u);
  EXPECT_EQ(claim->reclaimed_tokens(), 88u);
  EXPECT_FALSE(claim->renewed());
  EXPECT_EQ(claim->available_tokens(), kPoolTokens);
  EXPECT_EQ(Pool().available_tokens(), kPoolTokens);
  EXPECT_TRUE(Pool().holder().live());
  // The whole pool is the new scheduler's.
  EXPECT_TRUE(restarted->Alloc("p", kPoolTokens).ok());
}

TEST_F(PoolClaimTest, AFailedClaimChangesNothing) {
  std::unique_ptr<Client> a = Scheduler();
  ASSERT_TRUE(a->ClaimPool("p", "inst-a").ok());
  absl::StatusOr<std::vector<int64_t>> slots = a->Alloc("p", 16);
  ASSERT_TRUE(slots.ok()) << slots.status();
  const auto unchanged = [&] {
    const v1::Pool pool = Pool();
    EXPECT_EQ(pool.available_tokens(), kPoolTokens - 16);
    EXPECT_EQ(pool.holder().instance_id(), "inst-a");
    EXPECT_EQ(pool.holder().generation(), 1u);
    EXPECT_TRUE(pool.holder().live());
  };

  std::unique_ptr<Client> b = Scheduler();
  EXPECT_EQ(b->ClaimPool("p", "inst-b").status().code(), absl::StatusCode::kFailedPrecondition);
  unchanged();
  for (const std::string& bad : {std::string(), std::string("tab\there"), std::string(129, 'x'),
                                 std::string("del\x7f"), std::string("caf\xc3\xa9")}) {
    absl::StatusOr<v1::PoolClaim> claim = a->ClaimPool("p", bad);
    ASSERT_EQ(claim.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(std::string(claim.status().message()),
                ::testing::HasSubstr("ClaimPool instance_id"));
    unchanged();
  }
  // A sessionless client cannot own a pool: nothing would end its claim.
  std::unique_ptr<Client> sessionless = Scheduler(/*fast_path=*/false, /*session=*/false);
  EXPECT_EQ(sessionless->ClaimPool("p", "inst-c").status().code(),
            absl::StatusCode::kFailedPrecondition);
  unchanged();
  EXPECT_EQ(b->ClaimPool("nope", "inst-b").status().code(), absl::StatusCode::kNotFound);
  unchanged();
}

TEST_F(PoolClaimTest, OtherSessionsCannotWriteAHeldPoolsPages) {
  std::unique_ptr<Client> holder = Scheduler();
  ASSERT_TRUE(holder->ClaimPool("p", "inst-a").ok());
  absl::StatusOr<std::vector<int64_t>> mine = holder->Alloc("p", 8);
  ASSERT_TRUE(mine.ok()) << mine.status();
  const int64_t page = (*mine)[0];  // the first slot of a page (page size 4)
  absl::StatusOr<std::string> before = holder->GetDataPage("p", page);
  ASSERT_TRUE(before.ok()) << before.status();
  const std::string junk(before->size(), 'x');

  std::unique_ptr<Client> other = Scheduler();
  ASSERT_TRUE(other->OpenSession(absl::Seconds(10)).ok());
  const auto refused = [](const absl::Status& s, const std::string& what) {
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_THAT(std::string(s.message()),
                ::testing::AllOf(::testing::HasSubstr("pool 'p'"),
                                 ::testing::HasSubstr("'inst-a' (generation 1)"),
                                 ::testing::HasSubstr(what + " from another session")));
  };
  refused(other->SetFromFlatDataPage("p", page, junk), "SetFromFlatDataPage");
  const std::vector<int64_t> pages = {page};
  refused(other->WritePages("p", pages, {junk}).status(), "WritePages");
  // A Backup from the other session's own attachment of the held pool.
  absl::StatusOr<std::unique_ptr<ShmDevicePool>> dev =
      ShmDevicePool::Create(Pool(), 8, daemon_->shm_dir());
  ASSERT_TRUE(dev.ok()) << dev.status();
  for (uint32_t c = 0; c < (*dev)->components(); ++c) {
    for (uint32_t l = 0; l < (*dev)->layers(); ++l) {
      std::memset((*dev)->layer(c, l), 'y', (*dev)->rows(c) * (*dev)->row_bytes(c));
    }
  }
  absl::StatusOr<v1::Attachment> att = other->AttachDevice((*dev)->MakeAttachRequest("p"));
  ASSERT_TRUE(att.ok()) << att.status();
  const std::vector<int64_t> slots(mine->begin(), mine->begin() + 4);
  const std::vector<int64_t> rows = {0, 1, 2, 3};
  refused(other->Backup(att->id(), slots, rows).status(), "Backup");
  // Nothing was written.
  absl::StatusOr<std::string> after = holder->GetDataPage("p", page);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(*after, *before);

  // The holder's own write passes.
  const absl::Status own = holder->SetFromFlatDataPage("p", page, junk);
  ASSERT_TRUE(own.ok()) << own;
  EXPECT_EQ(*holder->GetDataPage("p", page), junk);

  // Once the holder's session ends, the others write again.
  holder.reset();
  WaitReleased();
  absl::StatusOr<uint64_t> written = other->WritePages("p", pages, {*before});
  ASSERT_TRUE(written.ok()) << written.status();
  EXPECT_EQ(*other->GetDataPage("p", page), *before);
  absl::StatusOr<uint64_t> ticket = other->Backup(att->id(), slots, rows);
  ASSERT_TRUE(ticket.ok()) << ticket.status();
  EXPECT_TRUE(other->WaitTransfer(*ticket, absl::Seconds(30)).ok());
}

// Alloc, AllocBatch and Free of another session while the pool is held, on
// the path the parameter picks (true: the fast path); allowed again after
// the holder's session ends.
class PoolClaimPathTest : public PoolClaimTest, public ::testing::WithParamInterface<bool> {};

TEST_P(PoolClaimPathTest, OtherSessionsCannotChangeAHeldPoolsAllocation) {
  const bool fast_path = GetParam();
  std::unique_ptr<Client> holder = Scheduler(fast_path);
  ASSERT_TRUE(holder->ClaimPool("p", "inst-a").ok());
  absl::StatusOr<std::vector<int64_t>> mine = holder->Alloc("p", 8);
  ASSERT_TRUE(mine.ok()) << mine.status();

  std::unique_ptr<Client> other = Scheduler(fast_path);
  std::unique_ptr<Client> sessionless = Scheduler(fast_path, /*session=*/false);
  for (Client* c : {other.get(), sessionless.get()}) {
    ASSERT_TRUE(c->OpenSession(absl::Seconds(10)).ok() || c == sessionless.get());
    const uint64_t fast_calls = c->fast_path_calls();
    absl::StatusOr<std::vector<int64_t>> alloc = c->Alloc("p", 4);
    ASSERT_EQ(alloc.status().code(), absl::StatusCode::kFailedPrecondition) << alloc.status();
    EXPECT_THAT(std::string(alloc.status().message()),
                ::testing::AllOf(::testing::HasSubstr("pool 'p'"),
                                 ::testing::HasSubstr("'inst-a' (generation 1)"),
                                 ::testing::HasSubstr("Alloc from another session")));
    const std::vector<uint64_t> runs = {4, 4};
    EXPECT_EQ(c->AllocBatch("p", runs).status().code(), absl::StatusCode::kFailedPrecondition);
    absl::StatusOr<uint64_t> freed = c->Free("p", *mine);
    ASSERT_EQ(freed.status().code(), absl::StatusCode::kFailedPrecondition) << freed.status();
    EXPECT_THAT(std::string(freed.status().message()),
                ::testing::HasSubstr("Free from another session"));
    // The refusals came through the path asked for.
    EXPECT_EQ(c->fast_path_calls() - fast_calls, fast_path ? 3u : 0u);
  }
  EXPECT_EQ(Pool().available_tokens(), kPoolTokens - 8);
  // Reads stay open.
  EXPECT_TRUE(other->GetPageBufferMeta("p", *mine).ok());

  // The holder's own calls pass, on the same path.
  absl::StatusOr<std::vector<int64_t>> more = holder->Alloc("p", 4);
  ASSERT_TRUE(more.ok()) << more.status();
  ASSERT_TRUE(holder->Free("p", *more).ok());

  holder.reset();
  WaitReleased();
  absl::StatusOr<uint64_t> freed = other->Free("p", *mine);
  ASSERT_TRUE(freed.ok()) << freed.status();
  EXPECT_TRUE(other->Alloc("p", 4).ok());
  EXPECT_TRUE(sessionless->Alloc("p", 4).ok());
}

INSTANTIATE_TEST_SUITE_P(Paths, PoolClaimPathTest, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? std::string("FastPath") : std::string("Grpc");
                         });

}  // namespace
}  // namespace kvhost
