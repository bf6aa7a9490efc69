// Tests of TransferManager's attachments (server/transfer/attachments.cc,
// attachment.h) over the host engine: an attachment holds its pool, attach
// errors hold nothing (page-row pools, pool groups), TP ranks share
// replicated kinds only, k_layers and named components mix, and a pool in a
// group or attached cannot be deleted (fixtures: transfer_manager_fixtures.h).

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "transfer_manager_fixtures.h"

namespace kvhost {
namespace {

TEST_F(ManagerTest, AttachmentsHoldThePool) {
  EXPECT_EQ(pool_->attachments(), 1u);
  EXPECT_EQ(manager_->ListAttachments().size(), 1u);
  EXPECT_EQ(registry_->Delete("llama").status().code(), absl::StatusCode::kFailedPrecondition);
  // A malformed attach takes no attachment.
  AttachRequest bad = dev_.Request(pool_->layout().planes);
  bad.v_layers.pop_back();
  EXPECT_EQ(AttachByName(*manager_, *registry_, "llama", bad).status().code(),
            absl::StatusCode::kInvalidArgument);
  bad = dev_.Request(pool_->layout().planes);
  bad.k_layers[0].shm_path = "/etc/hostname";
  EXPECT_EQ(AttachByName(*manager_, *registry_, "llama", bad).status().code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(AttachByName(*manager_, *registry_, "nope", dev_.Request(2)).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(pool_->attachments(), 1u);

  ASSERT_TRUE(manager_->Detach({}, att_).ok());
  EXPECT_EQ(manager_->Detach({}, att_).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(pool_->attachments(), 0u);
  ASSERT_TRUE(pool_->AllocPages(4).ok());
  EXPECT_EQ(manager_->Submit({}, att_, Direction::kBackup, {0}, {0}).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_TRUE(registry_->Delete("llama").ok());
  ExpectNoTickets();
}

TEST_F(PageRowTest, AttachErrorsTakeNoAttachment) {
  struct Bad {
    const char* what;
    std::function<void(AttachRequest&)> edit;
    const char* needle1;
    const char* needle2;
  } cases[] = {
      {"unknown component", [](AttachRequest& r) { r.named[0].name = "index"; }, "'index'",
       "index_k"},
      {"given twice", [this](AttachRequest& r) { r.named.push_back(dev_->Buffers(0)); },
       "given twice", "index_k"},
      {"too few layers", [](AttachRequest& r) { r.named[0].layers.pop_back(); }, "has 1 buffers",
       "needs 2"},
      {"missing component", [](AttachRequest& r) { r.named.clear(); }, "index_k", "needs 2"},
      {"k_layers on a kind without it",
       [](AttachRequest& r) {
         r.k_layers = r.named[0].layers;
         r.named.clear();
       },
       "k_layers", "DSA_INDEXER"},
      {"v_layers on a kind without it", [](AttachRequest& r) { r.v_layers = r.named[0].layers; },
       "v_layers", "needs 0"},
      {"partial device page", [](AttachRequest& r) { r.device_size_tokens = 30; }, "30",
       "multiple of 4"},
      {"no device slots", [](AttachRequest& r) { r.device_size_tokens = 0; }, "device_size_tokens",
       ">= 1"},
      {"empty layer range",
       [](AttachRequest& r) {
         r.start_layer = 3;
         r.end_layer = 3;
       },
       "start_layer 3", "end_layer 3"},
      {"more layers than buffers",
       [](AttachRequest& r) {
         r.start_layer = 0;
         r.end_layer = 3;
       },
       "has 2 buffers", "needs 3"},
  };
  for (const Bad& b : cases) {
    AttachRequest req = dev_->Request();
    b.edit(req);
    absl::StatusOr<AttachmentInfo> att = AttachByName(*f_.manager_, *f_.registry_, "p", req);
    EXPECT_EQ(att.status().code(), absl::StatusCode::kInvalidArgument)
        << b.what << ": " << att.status();
    EXPECT_THAT(Msg(att.status()), HasSubstr(b.needle1)) << b.what;
    EXPECT_THAT(Msg(att.status()), HasSubstr(b.needle2)) << b.what;
  }
  EXPECT_EQ(pool_->attachments(), 0u);
  EXPECT_TRUE(f_.manager_->ListAttachments().empty());
  EXPECT_TRUE(AttachByName(*f_.manager_, *f_.registry_, "p", dev_->Request()).ok());
  EXPECT_EQ(pool_->attachments(), 1u);
}

TEST(TpRankTest, ReplicatedKindsShareOtherKindsRefuseASecondRank) {
  KindFixture f;
  absl::StatusOr<std::shared_ptr<Pool>> mla =
      f.registry_->Create("p", MlaSpec(LayoutKind::kPageFirst));
  ASSERT_TRUE(mla.ok()) << mla.status();
  absl::StatusOr<std::shared_ptr<Pool>> mha =
      f.registry_->Create("m", MhaSpec(LayoutKind::kPageFirst));
  ASSERT_TRUE(mha.ok()) << mha.status();
  std::unique_ptr<DevicePool> d0 = DevicePool::Create(f.dir_.path() + "/d0", **mla, 20, 2);
  std::unique_ptr<DevicePool> d1 = DevicePool::Create(f.dir_.path() + "/d1", **mla, 20, 2);
  std::unique_ptr<DevicePool> dm = DevicePool::Create(f.dir_.path() + "/dm", **mha, 9, 3);
  ASSERT_TRUE(d0 && d1 && dm);
  AttachRequest r0 = d0->Request();
  r0.tp_rank = 0;
  AttachRequest r1 = d1->Request();
  r1.tp_rank = 1;
  r1.load_only = true;
  absl::StatusOr<AttachmentInfo> a0 = AttachByName(*f.manager_, *f.registry_, "p", r0);
  absl::StatusOr<AttachmentInfo> a1 = AttachByName(*f.manager_, *f.registry_, "p", r1);
  ASSERT_TRUE(a0.ok()) << a0.status();
  ASSERT_TRUE(a1.ok()) << a1.status();
  EXPECT_EQ(a1->tp_rank, std::optional<uint32_t>(1));
  EXPECT_TRUE(a1->load_only);
  EXPECT_FALSE(a0->load_only);
  EXPECT_EQ((*mla)->replica_ranks(), 2u);
  ASSERT_TRUE((*mla)->AllocPages(10).ok());
  // Rank 1 only loads.
  absl::StatusOr<std::shared_ptr<Ticket>> refused =
      f.manager_->Submit({}, a1->id, Direction::kBackup, {0}, {0});
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_THAT(Msg(refused.status()), HasSubstr("load_only"));
  f.ExpectNoTickets();
  // Rank 0 backs up, rank 1 loads the same bytes.
  std::vector<int64_t> host = {7, 8, 9, 0, 1}, from = {3, 4, 5, 19, 0}, to = {10, 11, 12, 2, 6};
  std::mt19937_64 rng(11);
  std::vector<uint8_t> bytes = RandomBytes(rng, d0->size());
  std::memcpy(d0->data(), bytes.data(), bytes.size());
  EXPECT_TRUE(f.Run(a0->id, Direction::kBackup, host, from).status.ok());
  EXPECT_TRUE(f.Run(a1->id, Direction::kLoad, host, to).status.ok());
  const uint64_t row = (*mla)->components()[0].row_bytes();
  for (uint32_t l = 0; l < 2; ++l) {
    for (size_t i = 0; i < host.size(); ++i) {
      EXPECT_TRUE(SameBytes(d1->Row(0, l, static_cast<uint64_t>(to[i])),
                            d0->Row(0, l, static_cast<uint64_t>(from[i])), row))
          << "layer " << l << " pair " << i;
    }
  }
  // MHA holds one rank's heads.
  AttachRequest m0 = dm->Request();
  m0.tp_rank = 0;
  AttachRequest m1 = dm->Request();
  m1.tp_rank = 1;
  ASSERT_TRUE(AttachByName(*f.manager_, *f.registry_, "m", m0).ok());
  absl::StatusOr<AttachmentInfo> second = AttachByName(*f.manager_, *f.registry_, "m", m1);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition) << second.status();
  EXPECT_EQ((*mha)->attachments(), 1u);
  EXPECT_TRUE(
      AttachByName(*f.manager_, *f.registry_, "m", m0).ok());  // the same rank again is fine
  EXPECT_EQ((*mha)->attachments(), 2u);
}

TEST(ComponentSpellingTest, KLayersAndNamedComponentsMix) {
  // DSA: k_layers is the latent, the index_k goes by name; MHA_ASYMMETRIC:
  // k_layers / v_layers are K and V. The same bytes move either way.
  KindFixture f;
  PoolSpec dsa = BaseSpec(PoolKind::kDsa, LayoutKind::kLayerFirst, 2, 2, 8);
  dsa.kv_lora_rank = 3;
  dsa.qk_rope_head_dim = 1;
  dsa.index_row_bytes = 5;
  absl::StatusOr<std::shared_ptr<Pool>> p = f.registry_->Create("p", dsa);
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_EQ((*p)->components().size(), 2u);
  std::unique_ptr<DevicePool> dev = DevicePool::Create(f.dir_.path() + "/device", **p, 4, 2);
  ASSERT_NE(dev, nullptr);
  AttachRequest req = dev->Request();
  req.k_layers = req.named[0].layers;
  req.named.erase(req.named.begin());
  ASSERT_TRUE(AttachByName(*f.manager_, *f.registry_, "p", req).ok());
  // Both spellings for the latent: refused, naming both.
  AttachRequest twice = dev->Request();
  twice.k_layers = twice.named[0].layers;
  absl::StatusOr<AttachmentInfo> bad = AttachByName(*f.manager_, *f.registry_, "p", twice);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Msg(bad.status()), HasSubstr("k_layers"));
  EXPECT_THAT(Msg(bad.status()), HasSubstr("components[0]"));
  // v_layers is not DSA's.
  AttachRequest v = req;
  v.v_layers = v.named[0].layers;
  v.named.clear();
  EXPECT_EQ(AttachByName(*f.manager_, *f.registry_, "p", v).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*p)->attachments(), 1u);
}

TEST_F(GroupTest, AttachErrorsHoldNothing) {
  struct Bad {
    const char* what;
    std::function<void(AttachRequest&)> edit;
    const char* needle1;
    const char* needle2;
  } cases[] = {
      {"missing entry", [](AttachRequest& r) { r.entries.pop_back(); }, "'ssm'",
       "one per group entry"},
      {"unknown entry", [](AttachRequest& r) { r.entries[1].entry = "mamba"; }, "'mamba'",
       "kv, ssm"},
      {"entry twice", [](AttachRequest& r) { r.entries[1] = r.entries[0]; }, "'kv'", "given twice"},
      {"no entries", [](AttachRequest& r) { r.entries.clear(); }, "'kv'", "one per group entry"},
      {"range without a mapped layer",
       [this](AttachRequest& r) {
         // attn attached at device layers [2, 4): model layer 2 maps device layer 1.
         r.entries[0].request = kv_.dev->Request(2, 4);
         r.entries[0].request.named.clear();
         for (size_t c = 0; c < 2; ++c) {
           ComponentBuffers b = kv_.dev->Buffers(c);
           b.layers.pop_back();
           r.entries[0].request.named.push_back(b);
         }
       },
       "device layer 1", "layer_map[2]"},
      {"bad buffers in an entry",
       [](AttachRequest& r) { r.entries[1].request.named[0].layers.pop_back(); }, "entry 'ssm'",
       "needs 2"},
      {"plain buffers with a group's name",
       [this](AttachRequest& r) { r.named = kv_.dev->Request().named; }, "'hybrid' is a pool group",
       "entries"},
      {"device slots with a group's name", [](AttachRequest& r) { r.device_size_tokens = 12; },
       "'hybrid' is a pool group", "device_size_tokens"},
  };
  for (const Bad& b : cases) {
    AttachRequest req = GroupRequest(kv_, ssm_);
    b.edit(req);
    absl::StatusOr<AttachmentInfo> att = AttachByName(*f_.manager_, *f_.registry_, "hybrid", req);
    EXPECT_EQ(att.status().code(), absl::StatusCode::kInvalidArgument)
        << b.what << ": " << att.status();
    EXPECT_THAT(Msg(att.status()), HasSubstr(b.needle1)) << b.what;
    EXPECT_THAT(Msg(att.status()), HasSubstr(b.needle2)) << b.what;
  }
  // Entries on a plain pool's name.
  absl::StatusOr<AttachmentInfo> plain =
      AttachByName(*f_.manager_, *f_.registry_, "attn", GroupRequest(kv_, ssm_));
  EXPECT_EQ(plain.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Msg(plain.status()), HasSubstr("not a pool group"));
  EXPECT_EQ(
      AttachByName(*f_.manager_, *f_.registry_, "nope", GroupRequest(kv_, ssm_)).status().code(),
      absl::StatusCode::kNotFound);
  EXPECT_EQ(group_->attachments(), 0u);
  EXPECT_EQ(kv_.pool->attachments(), 0u);
  EXPECT_EQ(ssm_.pool->attachments(), 0u);
  EXPECT_TRUE(f_.manager_->ListAttachments().empty());
  // A wider range that holds every mapped layer is fine.
  AttachRequest wide = GroupRequest(kv_, ssm_);
  std::unique_ptr<DevicePool> wider =
      DevicePool::Create(f_.dir_.path() + "/wide", *kv_.pool, 12, 5);
  ASSERT_NE(wider, nullptr);
  wide.entries[0].request = wider->Request(0, 5);
  EXPECT_TRUE(AttachByName(*f_.manager_, *f_.registry_, "hybrid", wide).ok());
}

TEST_F(GroupTest, DeletesRefusedWhileGroupedOrAttached) {
  EXPECT_EQ(f_.registry_->Delete("attn").status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(f_.registry_->Delete("ssm").status().code(), absl::StatusCode::kFailedPrecondition);
  absl::StatusOr<AttachmentInfo> att =
      AttachByName(*f_.manager_, *f_.registry_, "hybrid", GroupRequest(kv_, ssm_));
  ASSERT_TRUE(att.ok()) << att.status();
  absl::Status del = f_.registry_->DeleteGroup("hybrid");
  EXPECT_EQ(del.code(), absl::StatusCode::kFailedPrecondition) << del;
  EXPECT_TRUE(f_.registry_->GetGroup("hybrid").ok());
  ASSERT_TRUE(f_.manager_->Detach({}, att->id).ok());
  EXPECT_TRUE(f_.registry_->DeleteGroup("hybrid").ok());
  EXPECT_TRUE(f_.registry_->Delete("ssm").ok());
}

}  // namespace
}  // namespace kvhost
