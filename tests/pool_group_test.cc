// Tests of pool groups (server/pool/pool_group.h and the registry's group
// methods): validation naming the entry and the value and creating nothing,
// identity maps, anchors, names shared with pools, deletes refused while in
// use, groups resolved to their anchor, groups whose replies cannot be sent.
#include "server/pool/pool_group.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "domain_test_util.h"
#include "pool_test_util.h"
#include "server/pool/registry.h"

namespace kvhost {
namespace {

using ::kvhost::testing::KindRegistryTest;
using ::kvhost::testing::KindSpec;
using ::kvhost::testing::Msg;
using ::kvhost::testing::Options;
using ::testing::HasSubstr;

// ---------------------------------------------------------------------------
// Pool groups (server/pool/pool_group.h, the registry's group methods).

GroupEntrySpec Entry(std::string name, std::string pool, std::vector<int32_t> map = {},
                     bool anchor = false) {
  return GroupEntrySpec{std::move(name), std::move(pool), std::move(map), anchor};
}

// Pools of a hybrid model: "attn" MHA holding device layers [0, 4), "ssm"
// MAMBA holding [0, 2), "shard" MHA holding [2, 4), "lat" MLA holding [0, 2).
class GroupRegistryTest : public KindRegistryTest {
 protected:
  void SetUp() override {
    KindRegistryTest::SetUp();
    PoolSpec attn = KindSpec(PoolKind::kMha);
    attn.layer_num = 4;
    ASSERT_NE(Make(reg_, "attn", attn), nullptr);
    ASSERT_NE(Make(reg_, "ssm", KindSpec(PoolKind::kMamba)), nullptr);
    PoolSpec shard = KindSpec(PoolKind::kMha);
    shard.start_layer = 2;
    ASSERT_NE(Make(reg_, "shard", shard), nullptr);
    ASSERT_NE(Make(reg_, "lat", KindSpec(PoolKind::kMla)), nullptr);
  }
  // No group exists and no pool is in one.
  void ExpectNoGroups() {
    EXPECT_TRUE(reg_.ListGroups().empty());
    for (const std::shared_ptr<Pool>& p : reg_.List()) EXPECT_EQ(p->group(), "") << p->name();
  }
  PoolRegistry reg_{Options(dir_.path(), &mem_)};
};

struct BadGroup {
  std::string label;
  std::string name;
  uint32_t layer_num;
  std::vector<GroupEntrySpec> entries;
  absl::StatusCode code;
  std::vector<std::string> needles;
};

std::ostream& operator<<(std::ostream& os, const BadGroup& b) { return os << b.label; }

std::vector<GroupEntrySpec> NineEntries() {
  std::vector<GroupEntrySpec> e;
  for (int i = 0; i < 9; ++i) e.push_back(Entry(absl::StrCat("e", i), absl::StrCat("p", i)));
  return e;
}

const BadGroup kBadGroups[] = {
    {"bad_group_name",
     "a b",
     4,
     {Entry("kv", "attn")},
     absl::StatusCode::kInvalidArgument,
     {"group name 'a b'"}},
    {"layer_num_0",
     "g",
     0,
     {Entry("kv", "attn")},
     absl::StatusCode::kInvalidArgument,
     {"group 'g'", "layer_num"}},
    {"layer_num_over_cap",
     "g",
     kMaxLayers + 1,
     {Entry("kv", "attn")},
     absl::StatusCode::kInvalidArgument,
     {"group 'g'", "layer_num 4097 is over the limit of 4096"}},
    // 2^32 - 1 with a map of one value: the cap is checked before the map.
    {"layer_num_max",
     "g",
     4294967295u,
     {Entry("kv", "attn", {0})},
     absl::StatusCode::kInvalidArgument,
     {"layer_num 4294967295 is over the limit"}},
    {"no_entries", "g", 4, {}, absl::StatusCode::kInvalidArgument, {"group 'g'", "0 entries"}},
    {"nine_entries",
     "g",
     4,
     NineEntries(),
     absl::StatusCode::kInvalidArgument,
     {"9 entries", "1 to 8"}},
    {"bad_entry_name",
     "g",
     4,
     {Entry("kv", "attn"), Entry(".x", "ssm")},
     absl::StatusCode::kInvalidArgument,
     {"entries[1]", "'.x'"}},
    {"entry_name_twice",
     "g",
     4,
     {Entry("kv", "attn"), Entry("kv", "ssm")},
     absl::StatusCode::kInvalidArgument,
     {"entries[1] 'kv'", "earlier entry"}},
    {"no_pool",
     "g",
     4,
     {Entry("kv", "")},
     absl::StatusCode::kInvalidArgument,
     {"entries[0] 'kv'", "no pool"}},
    {"pool_twice",
     "g",
     4,
     {Entry("kv", "attn"), Entry("again", "attn")},
     absl::StatusCode::kInvalidArgument,
     {"entries[1] 'again'", "pool 'attn'"}},
    {"map_too_short",
     "g",
     4,
     {Entry("kv", "attn", {0, 1, 2})},
     absl::StatusCode::kInvalidArgument,
     {"entries[0] 'kv'", "3 values", "layer_num 4"}},
    {"two_anchors",
     "g",
     4,
     {Entry("kv", "attn", {}, true), Entry("ssm", "ssm", {}, true)},
     absl::StatusCode::kInvalidArgument,
     {"entries[1] 'ssm'", "second anchor"}},
    {"map_past_the_pool",
     "g",
     4,
     {Entry("kv", "attn"), Entry("ssm", "ssm", {0, 1, 2, -1})},
     absl::StatusCode::kInvalidArgument,
     {"entries[1] 'ssm'", "layer_map[2] = 2", "pool 'ssm'", "MAMBA", "[0, 2)"}},
    {"map_below_minus_one",
     "g",
     4,
     {Entry("kv", "attn", {-2, 1, 2, 3})},
     absl::StatusCode::kInvalidArgument,
     {"entries[0] 'kv'", "layer_map[0] = -2"}},
    {"map_layer_twice",
     "g",
     4,
     {Entry("kv", "attn", {0, -1, 0, -1})},
     absl::StatusCode::kInvalidArgument,
     {"entries[0] 'kv'", "layer_map[2] = 0"}},
    {"map_below_the_shard",
     "g",
     4,
     {Entry("kv", "shard", {0, 1, 2, 3})},
     absl::StatusCode::kInvalidArgument,
     {"layer_map[0] = 0", "pool 'shard'", "[2, 4)"}},
    {"unknown_pool",
     "g",
     4,
     {Entry("kv", "attn"), Entry("x", "nope")},
     absl::StatusCode::kNotFound,
     {"entries[1] 'x'", "pool 'nope'"}},
    {"name_of_a_pool",
     "attn",
     4,
     {Entry("kv", "ssm")},
     absl::StatusCode::kAlreadyExists,
     {"'attn'", "pool"}},
};

class GroupValidationTest : public GroupRegistryTest,
                            public ::testing::WithParamInterface<BadGroup> {};

TEST_P(GroupValidationTest, RefusesNamingEntryAndValueAndCreatesNothing) {
  const BadGroup& b = GetParam();
  absl::StatusOr<std::shared_ptr<PoolGroup>> g = reg_.CreateGroup(b.name, b.layer_num, b.entries);
  ASSERT_FALSE(g.ok());
  EXPECT_EQ(g.status().code(), b.code) << g.status();
  for (const std::string& needle : b.needles) EXPECT_THAT(Msg(g.status()), HasSubstr(needle));
  ExpectNoGroups();
  EXPECT_EQ(reg_.GetGroup(b.name).status().code(), absl::StatusCode::kNotFound);
}

INSTANTIATE_TEST_SUITE_P(Groups, GroupValidationTest, ::testing::ValuesIn(kBadGroups),
                         [](const ::testing::TestParamInfo<BadGroup>& info) {
                           return info.param.label;
                         });

TEST_F(GroupRegistryTest, EmptyMapsAreTheIdentityOverTheHeldLayers) {
  absl::StatusOr<std::shared_ptr<PoolGroup>> g = reg_.CreateGroup(
      "hybrid", 4, {Entry("kv", "attn"), Entry("ssm", "ssm"), Entry("upper", "shard")});
  ASSERT_TRUE(g.ok()) << g.status();
  const std::vector<GroupEntry>& e = (*g)->entries();
  ASSERT_EQ(e.size(), 3u);
  EXPECT_EQ(e[0].layer_map, (std::vector<int32_t>{0, 1, 2, 3}));
  EXPECT_EQ(e[1].layer_map, (std::vector<int32_t>{0, 1, -1, -1}));  // holds [0, 2)
  EXPECT_EQ(e[2].layer_map, (std::vector<int32_t>{-1, -1, 2, 3}));  // holds [2, 4)
  EXPECT_EQ((*g)->anchor_index(), 0u);                              // none flagged: the first
  EXPECT_EQ((*g)->anchor().pool->name(), "attn");
  EXPECT_EQ((*g)->layer_num(), 4u);
  ASSERT_NE((*g)->Find("ssm"), nullptr);
  EXPECT_EQ((*g)->Find("ssm")->pool->name(), "ssm");
  EXPECT_EQ((*g)->Find("nope"), nullptr);
  for (const char* pool : {"attn", "ssm", "shard"}) EXPECT_EQ((*reg_.Get(pool))->group(), "hybrid");
  EXPECT_EQ((*reg_.Get("lat"))->group(), "");
}

TEST_F(GroupRegistryTest, AGivenMapAndAnchorAreKept) {
  // A hybrid model: MHA on model layers 1 and 3, Mamba on 0 and 2.
  absl::StatusOr<std::shared_ptr<PoolGroup>> g = reg_.CreateGroup(
      "hybrid", 4,
      {Entry("kv", "attn", {-1, 0, -1, 1}), Entry("ssm", "ssm", {1, -1, 0, -1}, true)});
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ((*g)->entries()[0].layer_map, (std::vector<int32_t>{-1, 0, -1, 1}));
  EXPECT_EQ((*g)->entries()[1].layer_map, (std::vector<int32_t>{1, -1, 0, -1}));
  EXPECT_EQ((*g)->anchor_index(), 1u);
  EXPECT_EQ((*g)->anchor().name, "ssm");
}

TEST_F(GroupRegistryTest, NamesAreSharedWithPoolsAndAPoolIsInOneGroup) {
  ASSERT_TRUE(reg_.CreateGroup("g1", 4, {Entry("kv", "attn")}).ok());
  absl::StatusOr<std::shared_ptr<PoolGroup>> again = reg_.CreateGroup("g1", 2, {Entry("x", "lat")});
  EXPECT_EQ(again.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(Msg(again.status()), HasSubstr("group 'g1' already exists"));
  absl::StatusOr<std::shared_ptr<Pool>> pool = reg_.Create("g1", KindSpec(PoolKind::kMla));
  EXPECT_EQ(pool.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(Msg(pool.status()), HasSubstr("'g1'"));
  absl::StatusOr<std::shared_ptr<PoolGroup>> taken =
      reg_.CreateGroup("g2", 4, {Entry("s", "ssm"), Entry("kv", "attn")});
  EXPECT_EQ(taken.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(Msg(taken.status()), HasSubstr("entries[1] 'kv'"));
  EXPECT_THAT(Msg(taken.status()), HasSubstr("group 'g1'"));
  // Nothing of g2 stayed: ssm is free for another group.
  EXPECT_EQ((*reg_.Get("ssm"))->group(), "");
  EXPECT_EQ(reg_.GetGroup("g2").status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(reg_.CreateGroup("g3", 2, {Entry("s", "ssm")}).ok());
  std::vector<std::string> names;
  for (const auto& g : reg_.ListGroups()) names.push_back(g->name());
  EXPECT_EQ(names, (std::vector<std::string>{"g1", "g3"}));
}

TEST_F(GroupRegistryTest, DeletesAreRefusedWhileInUse) {
  absl::StatusOr<std::shared_ptr<PoolGroup>> g =
      reg_.CreateGroup("hybrid", 4, {Entry("kv", "attn"), Entry("ssm", "ssm")});
  ASSERT_TRUE(g.ok()) << g.status();
  absl::StatusOr<uint64_t> del = reg_.Delete("ssm");
  EXPECT_EQ(del.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(Msg(del.status()), HasSubstr("group 'hybrid'"));
  EXPECT_TRUE(reg_.Get("ssm").ok());
  ASSERT_TRUE((*g)->AcquireAttachment().ok());
  EXPECT_EQ((*g)->attachments(), 1u);
  absl::Status busy = reg_.DeleteGroup("hybrid");
  EXPECT_EQ(busy.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(Msg(busy), HasSubstr("1 device attachment"));
  EXPECT_TRUE(reg_.GetGroup("hybrid").ok());
  EXPECT_EQ((*reg_.Get("attn"))->group(), "hybrid");
  (*g)->ReleaseAttachment();
  EXPECT_EQ((*g)->attachments(), 0u);
  ASSERT_TRUE(reg_.DeleteGroup("hybrid").ok());
  // A retired group takes no new attachment (a caller still holding it).
  EXPECT_EQ((*g)->AcquireAttachment().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(reg_.DeleteGroup("hybrid").code(), absl::StatusCode::kNotFound);
  ExpectNoGroups();
  EXPECT_TRUE(reg_.Delete("ssm").ok());
  // The name is free for a pool now.
  EXPECT_TRUE(reg_.Create("hybrid", KindSpec(PoolKind::kMla)).ok());
}

TEST_F(GroupRegistryTest, GetPoolOrAnchorResolvesGroupsToTheirAnchor) {
  ASSERT_TRUE(
      reg_.CreateGroup("hybrid", 4, {Entry("kv", "attn"), Entry("ssm", "ssm", {}, true)}).ok());
  absl::StatusOr<std::shared_ptr<Pool>> anchor = reg_.GetPoolOrAnchor("hybrid");
  ASSERT_TRUE(anchor.ok()) << anchor.status();
  EXPECT_EQ((*anchor)->name(), "ssm");
  EXPECT_EQ(*anchor, *reg_.Get("ssm"));
  EXPECT_EQ((*reg_.GetPoolOrAnchor("attn"))->name(), "attn");
  absl::StatusOr<std::shared_ptr<Pool>> none = reg_.GetPoolOrAnchor("nope");
  EXPECT_EQ(none.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(Msg(none.status()), HasSubstr("'nope'"));
  // Get is for pools only.
  EXPECT_EQ(reg_.Get("hybrid").status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(reg_.DeleteGroup("hybrid").ok());
  EXPECT_EQ(reg_.GetPoolOrAnchor("hybrid").status().code(), absl::StatusCode::kNotFound);
}

// A group's layer maps are bounded before the group exists.
TEST_F(GroupRegistryTest, GroupWhoseRepliesCannotBeSentIsNotCreated) {
  absl::StatusOr<std::shared_ptr<PoolGroup>> g =
      reg_.CreateGroup("g", 4, {Entry("kv", "attn"), Entry("ssm", "ssm")}, 7);
  EXPECT_EQ(g.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(Msg(g.status()), HasSubstr("8 layer-map values, over the 7"));
  ExpectNoGroups();
  EXPECT_TRUE(reg_.CreateGroup("g", 4, {Entry("kv", "attn"), Entry("ssm", "ssm")}, 8).ok());
}

}  // namespace
}  // namespace kvhost
