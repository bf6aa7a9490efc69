// Tests of the pool calls' prologue (server/service/call_scope.h):
// CheckIndexCount's limit and message; OpenCallPool's order (every index
// count before the name, the first over the limit refused naming the pool),
// the name resolved once with the token checked on the pool or on every
// entry of a group (whose anchor pool is returned), and that it changes
// nothing; L3Namespace's choice of namespace and its owner check.
#include "server/service/call_scope.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "domain_test_util.h"
#include "pool_test_util.h"
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

TEST(CheckIndexCountTest, RefusesOnlyAboveTheLimitNamingCountAndLimit) {
  EXPECT_TRUE(CheckIndexCount("Free indices", 0, 0).ok());
  EXPECT_TRUE(CheckIndexCount("Free indices", 7, 7).ok());
  const absl::Status s = CheckIndexCount("Free indices", 8, 7);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(Msg(s),
            "Free indices: 8 is over the daemon's limit of 7 per call (--max-indices-per-call)");
  // Counts past 2^32 are not truncated.
  const absl::Status big = CheckIndexCount("x", uint64_t{1} << 40, 1);
  EXPECT_THAT(Msg(big), HasSubstr("x: 1099511627776 is over"));
}

class CallScopeTest : public RegistryTest {
 protected:
  void SetUp() override {
    RegistryTest::SetUp();
    registry_ = std::make_unique<PoolRegistry>(Options(dir_.path(), &mem_));
    absl::StatusOr<std::shared_ptr<Pool>> open = registry_->Create("open", MhaSpec());
    ASSERT_TRUE(open.ok()) << open.status();
    open_ = *open;
    absl::StatusOr<std::shared_ptr<Pool>> owned = registry_->Create("owned", MhaSpec(), {}, token_);
    ASSERT_TRUE(owned.ok()) << owned.status();
    owned_ = *owned;
  }
  void TearDown() override { registry_.reset(); }

  const std::string token_ = "owner-token";
  const std::string wrong_ = "attacker-token";
  std::unique_ptr<PoolRegistry> registry_;
  std::shared_ptr<Pool> open_;
  std::shared_ptr<Pool> owned_;
};

TEST_F(CallScopeTest, ReturnsTheResolvedPool) {
  absl::StatusOr<std::shared_ptr<Pool>> p = OpenCallPool(*registry_, "open", nullptr, 10);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(*p, open_);
  // Counts at the limit pass.
  p = OpenCallPool(*registry_, "owned", &token_, 10, {{"a", 10}, {"b", 0}});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(*p, owned_);
}

TEST_F(CallScopeTest, TheFirstCountOverTheLimitIsRefusedNamingThePool) {
  absl::StatusOr<std::shared_ptr<Pool>> p =
      OpenCallPool(*registry_, "open", nullptr, 10, {{"first", 3}, {"second", 11}, {"third", 12}});
  ASSERT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument) << p.status();
  EXPECT_EQ(Msg(p.status()),
            "pool 'open': second: 11 is over the daemon's limit of 10 per call "
            "(--max-indices-per-call)");
}

TEST_F(CallScopeTest, CountsAreCheckedBeforeTheName) {
  // An unknown pool and a protected one without its token: the count is
  // what is refused, so a caller learns nothing of the name from it.
  for (const std::string name : {"absent", "owned"}) {
    absl::StatusOr<std::shared_ptr<Pool>> p =
        OpenCallPool(*registry_, name, nullptr, 1, {{"Free indices", 2}});
    EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument) << p.status();
    EXPECT_THAT(Msg(p.status()), HasSubstr("pool '" + name + "': Free indices: 2"));
  }
}

TEST_F(CallScopeTest, UnknownNameIsNotFound) {
  absl::StatusOr<std::shared_ptr<Pool>> p = OpenCallPool(*registry_, "absent", &token_, 10);
  ASSERT_EQ(p.status().code(), absl::StatusCode::kNotFound) << p.status();
  EXPECT_THAT(Msg(p.status()), HasSubstr("'absent'"));
}

TEST_F(CallScopeTest, TokenIsCheckedOnTheProtectedPoolAndNeverShown) {
  for (const std::string* t : {static_cast<const std::string*>(nullptr), &wrong_}) {
    absl::StatusOr<std::shared_ptr<Pool>> p = OpenCallPool(*registry_, "owned", t, 10);
    ASSERT_EQ(p.status().code(), absl::StatusCode::kPermissionDenied) << p.status();
    EXPECT_THAT(Msg(p.status()), HasSubstr("pool 'owned' is owner-protected"));
    EXPECT_THAT(Msg(p.status()), Not(HasSubstr(token_)));
    EXPECT_THAT(Msg(p.status()), Not(HasSubstr(wrong_)));
  }
  // An unprotected pool ignores whatever token is given.
  EXPECT_TRUE(OpenCallPool(*registry_, "open", &wrong_, 10).ok());
}

TEST_F(CallScopeTest, AGroupNameReturnsItsAnchorCheckedOnEveryEntry) {
  const std::vector<GroupEntrySpec> entries = {{"kv", "owned", {}, true}, {"x", "open", {}, false}};
  absl::StatusOr<std::shared_ptr<PoolGroup>> g =
      registry_->CreateGroup("g", MhaSpec().layer_num, entries, UINT64_MAX, &token_);
  ASSERT_TRUE(g.ok()) << g.status();
  absl::StatusOr<std::shared_ptr<Pool>> p = OpenCallPool(*registry_, "g", &token_, 10);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(*p, owned_);
  absl::StatusOr<std::shared_ptr<Pool>> refused = OpenCallPool(*registry_, "g", &wrong_, 10);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kPermissionDenied) << refused.status();
  EXPECT_THAT(Msg(refused.status()), HasSubstr("entry 'kv' of group 'g'"));
}

TEST_F(CallScopeTest, ChangesNothing) {
  const uint64_t before = open_->allocator().available_tokens();
  ASSERT_TRUE(OpenCallPool(*registry_, "open", nullptr, 10, {{"a", 1}}).ok());
  EXPECT_FALSE(OpenCallPool(*registry_, "open", nullptr, 0, {{"a", 1}}).ok());
  EXPECT_FALSE(OpenCallPool(*registry_, "owned", nullptr, 10).ok());
  EXPECT_EQ(open_->allocator().available_tokens(), before);
  EXPECT_EQ(owned_->allocator().available_tokens(), owned_->size_tokens());
  EXPECT_EQ(registry_->List().size(), 2u);
  EXPECT_TRUE(registry_->ListGroups().empty());
}

// The public namespace for an unprotected pool whatever the token; a
// protected pool's only with its own token, checked on the pool itself.
TEST_F(CallScopeTest, L3NamespaceIsThePoolsOwnAndCheckedOnIt) {
  const L3Secret secret = L3Secret::FromBytes(std::string(32, 's'));
  absl::StatusOr<std::string> open = L3Namespace(secret, *open_, nullptr);
  ASSERT_TRUE(open.ok()) << open.status();
  EXPECT_EQ(*open, secret.PublicNamespace());
  EXPECT_EQ(*L3Namespace(secret, *open_, &wrong_), secret.PublicNamespace());
  absl::StatusOr<std::string> owned = L3Namespace(secret, *owned_, &token_);
  ASSERT_TRUE(owned.ok()) << owned.status();
  EXPECT_EQ(*owned, secret.TokenNamespace(token_));
  EXPECT_NE(*owned, secret.PublicNamespace());
  EXPECT_EQ(L3Namespace(secret, *owned_, &wrong_).status().code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(L3Namespace(secret, *owned_, nullptr).status().code(),
            absl::StatusCode::kPermissionDenied);
}

}  // namespace
}  // namespace kvhost
