// Tests of a transfer's validation (server/transfer/submission.h, job_part.h)
// through TransferManager::Submit over the host engine: every refused
// transfer leaves no ticket and changes no byte (lengths, ranges, repeated
// destinations, slots not allocated, partial pages, a follower's slots,
// pool_transfers on a group), and a group's page-row entries copy whole
// pages along the map (fixtures: transfer_manager_fixtures.h).
#include "server/transfer/submission.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "transfer_manager_fixtures.h"

namespace kvhost {
namespace {

TEST_F(ManagerTest, ValidationErrorsLeaveNoTicket) {
  ASSERT_TRUE(pool_->AllocPages(8).ok());  // slots 0..7 allocated
  const int64_t size = static_cast<int64_t>(pool_->size_tokens());
  const int64_t rows = static_cast<int64_t>(kRows);
  struct Bad {
    const char* what;
    std::string att;
    Direction dir;
    std::vector<int64_t> host, device;
    absl::StatusCode code;
    const char* message;
  } cases[] = {
      {"lengths differ",
       att_,
       Direction::kBackup,
       {0, 1},
       {0},
       absl::StatusCode::kInvalidArgument,
       "host_indices has 2"},
      {"negative host",
       att_,
       Direction::kBackup,
       {0, -1},
       {0, 1},
       absl::StatusCode::kInvalidArgument,
       "host_indices[1] = -1"},
      {"host past end",
       att_,
       Direction::kLoad,
       {size},
       {0},
       absl::StatusCode::kInvalidArgument,
       "host_indices[0]"},
      {"device past end",
       att_,
       Direction::kBackup,
       {0, 1},
       {0, rows},
       absl::StatusCode::kInvalidArgument,
       "device_indices[1]"},
      {"negative device",
       att_,
       Direction::kLoad,
       {0},
       {-3},
       absl::StatusCode::kInvalidArgument,
       "device_indices[0] = -3"},
      {"backup repeats a host slot",
       att_,
       Direction::kBackup,
       {0, 1, 2, 1},
       {0, 1, 2, 3},
       absl::StatusCode::kInvalidArgument,
       "host slot 1"},
      {"load repeats a device row",
       att_,
       Direction::kLoad,
       {0, 1, 2, 3},
       {5, 6, 7, 6},
       absl::StatusCode::kInvalidArgument,
       "device row 6"},
      {"unallocated host slot",
       att_,
       Direction::kBackup,
       {6, 7, 8},
       {0, 1, 2},
       absl::StatusCode::kFailedPrecondition,
       "host slot 8"},
      {"unallocated on load",
       att_,
       Direction::kLoad,
       {40},
       {0},
       absl::StatusCode::kFailedPrecondition,
       "host slot 40"},
      {"unknown attachment",
       "att-nope",
       Direction::kBackup,
       {0},
       {0},
       absl::StatusCode::kNotFound,
       "att-nope"},
  };
  for (const Bad& b : cases) {
    absl::StatusOr<std::shared_ptr<Ticket>> t =
        manager_->Submit({}, b.att, b.dir, b.host, b.device);
    EXPECT_EQ(t.status().code(), b.code) << b.what << ": " << t.status();
    EXPECT_THAT(Msg(t.status()), HasSubstr(b.message)) << b.what;
  }
  ExpectNoTickets();
  // A load may read one host slot twice (only destinations must be unique).
  absl::StatusOr<std::shared_ptr<Ticket>> ok =
      manager_->Submit({}, att_, Direction::kLoad, {3, 3}, {0, 1});
  ASSERT_TRUE(ok.ok()) << ok.status();
  ASSERT_TRUE((*ok)->WaitUntil(absl::Now() + absl::Seconds(30)));
  EXPECT_TRUE((*ok)->Snapshot().status.ok());
  EXPECT_TRUE(manager_->FindTicket({}, (*ok)->id()).ok());
}

TEST_F(PageRowTest, PartialPagesAreRefusedAndChangeNothing) {
  absl::StatusOr<AttachmentInfo> att =
      AttachByName(*f_.manager_, *f_.registry_, "p", dev_->Request());
  ASSERT_TRUE(att.ok()) << att.status();
  // The follower has no allocator; pages 0..3 (slots 0..15) in the MLA pool.
  EXPECT_EQ(pool_->AllocPages(4).status().code(), absl::StatusCode::kFailedPrecondition);
  absl::StatusOr<std::shared_ptr<Pool>> anchor = f_.registry_->Get("anchor");
  ASSERT_TRUE(anchor.ok());
  ASSERT_TRUE((*anchor)->AllocPages(16).ok());
  const std::vector<std::vector<uint8_t>> host_before = HostBytes(*pool_);
  const std::string device_before = DeviceBytes();
  auto r = [](int64_t from, int64_t n) {
    std::vector<int64_t> v;
    for (int64_t i = 0; i < n; ++i) v.push_back(from + i);
    return v;
  };
  auto cat = [](std::vector<int64_t> a, const std::vector<int64_t>& b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
  };
  struct Bad {
    const char* what;
    Direction dir;
    std::vector<int64_t> host, device;
    absl::StatusCode code;
    const char* needle;
    bool names_kind = false;  // the whole-page errors name the pool's kind
  } cases[] = {
      {"host not a page start", Direction::kBackup, r(2, 4), r(0, 4),
       absl::StatusCode::kInvalidArgument, "host_indices[0] = 2 does not start a page", true},
      {"device not a page start", Direction::kLoad, r(0, 4), r(5, 4),
       absl::StatusCode::kInvalidArgument, "device_indices[0] = 5 does not start a page", true},
      {"part of a page", Direction::kBackup, r(0, 6), r(8, 6), absl::StatusCode::kInvalidArgument,
       "not a multiple of 4", true},
      {"page broken in the middle", Direction::kBackup, cat(r(4, 2), r(7, 2)), r(0, 4),
       absl::StatusCode::kInvalidArgument, "host_indices[2] = 7 breaks the page 4..7", true},
      {"second page broken on the device", Direction::kLoad, r(0, 8),
       cat(r(0, 4), {12, 13, 15, 14}), absl::StatusCode::kInvalidArgument, "device_indices[6] = 15",
       true},
      {"device page past the end", Direction::kLoad, r(0, 4), r(32, 4),
       absl::StatusCode::kInvalidArgument, "device_indices[0] = 32 out of range"},
      {"page twice", Direction::kBackup, cat(r(4, 4), r(4, 4)), r(0, 8),
       absl::StatusCode::kInvalidArgument, "host slot 4"},
      {"page not allocated in the followed pool", Direction::kBackup, r(16, 4), r(0, 4),
       absl::StatusCode::kFailedPrecondition, "anchor"},
  };
  for (const Bad& b : cases) {
    absl::StatusOr<std::shared_ptr<Ticket>> t =
        f_.manager_->Submit({}, att->id, b.dir, b.host, b.device);
    EXPECT_EQ(t.status().code(), b.code) << b.what << ": " << t.status();
    EXPECT_THAT(Msg(t.status()), HasSubstr(b.needle)) << b.what;
    if (b.names_kind) {
      EXPECT_THAT(Msg(t.status()), HasSubstr("DSA_INDEXER")) << b.what;
    }
  }
  f_.ExpectNoTickets();
  EXPECT_EQ(HostBytes(*pool_), host_before);
  EXPECT_EQ(DeviceBytes(), device_before);
  // Whole pages in any order go through: pages 3, 1 -> device pages 7, 0.
  const TicketStatus st =
      f_.Run(att->id, Direction::kBackup, cat(r(12, 4), r(4, 4)), cat(r(28, 4), r(0, 4)));
  EXPECT_TRUE(st.status.ok()) << st.status;
  const Component& c = pool_->components()[0];
  EXPECT_EQ(st.bytes, 2 * c.row_bytes() * 2);  // 2 pages x 2 layers
  for (uint32_t l = 0; l < 2; ++l) {
    EXPECT_TRUE(SameBytes(pool_->component_base(0) + SeedOffset(c.layout, 3, l, 0),
                          dev_->Row(0, l, 7), c.row_bytes()));
    EXPECT_TRUE(SameBytes(pool_->component_base(0) + SeedOffset(c.layout, 1, l, 0),
                          dev_->Row(0, l, 0), c.row_bytes()));
  }
}

TEST(FollowerTest, KOnlyTransfersSlotsAllocatedInTheMhaPool) {
  KindFixture f;
  PoolSpec s = BaseSpec(PoolKind::kKOnly, LayoutKind::kPageFirst, 0, 2, 0);
  s.head_num = 1;
  s.head_dim = 4;
  absl::StatusOr<std::shared_ptr<Pool>> p =
      f.Create({"k_only", FollowerSpec(s), MhaSpec(LayoutKind::kLayerFirst)});
  ASSERT_TRUE(p.ok()) << p.status();
  std::shared_ptr<Pool> anchor = *f.registry_->Get("anchor");
  EXPECT_EQ((*p)->size_tokens(), anchor->size_tokens());
  std::unique_ptr<DevicePool> dev = DevicePool::Create(f.dir_.path() + "/device", **p, 9, 2);
  ASSERT_NE(dev, nullptr);
  // k_layers is K_ONLY's spelling too.
  AttachRequest req = dev->Request();
  req.k_layers = req.named[0].layers;
  req.named.clear();
  absl::StatusOr<AttachmentInfo> att = AttachByName(*f.manager_, *f.registry_, "p", req);
  ASSERT_TRUE(att.ok()) << att.status();
  EXPECT_EQ((*p)->AllocPages(3).status().code(), absl::StatusCode::kFailedPrecondition);
  absl::StatusOr<std::shared_ptr<Ticket>> t =
      f.manager_->Submit({}, att->id, Direction::kBackup, {4, 0}, {1, 2});
  EXPECT_EQ(t.status().code(), absl::StatusCode::kFailedPrecondition) << t.status();
  EXPECT_THAT(Msg(t.status()), HasSubstr("'anchor'"));
  f.ExpectNoTickets();
  ASSERT_TRUE(anchor->AllocPages(6).ok());  // slots 0..5
  std::memset(dev->Row(0, 1, 2), 0x5a, (*p)->components()[0].row_bytes());
  const TicketStatus st = f.Run(att->id, Direction::kBackup, {4, 0}, {1, 2});
  EXPECT_TRUE(st.status.ok()) << st.status;
  const Component& k = (*p)->components()[0];
  EXPECT_TRUE(SameBytes((*p)->component_base(0) + SeedOffset(k.layout, 0, 1, 0), dev->Row(0, 1, 2),
                        k.row_bytes()));
  EXPECT_EQ(dev->Row(0, 1, 2)[0], 0x5a);
}

TEST_F(GroupTest, RefusedTransfersLeaveNoTicketAndChangeNothing) {
  absl::StatusOr<AttachmentInfo> att =
      AttachByName(*f_.manager_, *f_.registry_, "hybrid", GroupRequest(kv_, ssm_));
  ASSERT_TRUE(att.ok()) << att.status();
  const std::vector<int64_t> kv_host = Alloc(*kv_.pool, 3);
  const std::vector<int64_t> ssm_host = Alloc(*ssm_.pool, 2);
  ASSERT_EQ(ssm_host.size(), 2u);
  const std::vector<int64_t> kv_dev = {3, 4, 5};
  const std::vector<int64_t> ssm_dev = {1, 2};
  // The free ssm slot that is not allocated.
  int64_t free_slot = 0;
  while (std::find(ssm_host.begin(), ssm_host.end(), free_slot) != ssm_host.end()) ++free_slot;
  const std::vector<int64_t> one_ssm = {ssm_host[0]};
  struct Bad {
    const char* what;
    std::vector<EntryRows> others;
    absl::StatusCode code;
    const char* needle;
  };
  const std::vector<int64_t> bad_dev = {1, 8};  // ssm's device has 8 rows
  const std::vector<int64_t> bad_host = {ssm_host[0], free_slot};
  const std::vector<int64_t> neg = {-1, 2};
  const std::vector<int64_t> dup_dev = {2, 2};
  const Bad cases[] = {
      {"unknown entry",
       {{"mamba", ssm_host, ssm_dev}},
       absl::StatusCode::kInvalidArgument,
       "'mamba'"},
      {"the anchor", {{"kv", kv_host, kv_dev}}, absl::StatusCode::kInvalidArgument, "anchor"},
      {"a name twice",
       {{"ssm", ssm_host, ssm_dev}, {"ssm", ssm_host, ssm_dev}},
       absl::StatusCode::kInvalidArgument,
       "pool_transfers[1]"},
      {"device row out of range",
       {{"ssm", ssm_host, bad_dev}},
       absl::StatusCode::kInvalidArgument,
       "pool_transfers[0].device_indices[1] = 8"},
      {"negative host slot",
       {{"ssm", neg, ssm_dev}},
       absl::StatusCode::kInvalidArgument,
       "pool_transfers[0].host_indices[0] = -1"},
      {"lengths differ",
       {{"ssm", one_ssm, ssm_dev}},
       absl::StatusCode::kInvalidArgument,
       "pool_transfers[0].host_indices has 1"},
      {"device row twice (load)",
       {{"ssm", ssm_host, dup_dev}},
       absl::StatusCode::kInvalidArgument,
       "device row 2"},
      {"host slot not allocated",
       {{"ssm", bad_host, ssm_dev}},
       absl::StatusCode::kFailedPrecondition,
       "ssm"},
  };
  const std::vector<std::vector<uint8_t>> kv_h = HostBytes(*kv_.pool);
  const std::vector<std::vector<uint8_t>> ssm_h = HostBytes(*ssm_.pool);
  const std::vector<uint8_t> kv_d = kv_.DeviceBytes(), ssm_d = ssm_.DeviceBytes();
  for (const Bad& b : cases) {
    for (Direction d : {Direction::kBackup, Direction::kLoad}) {
      if (std::string(b.what) == "device row twice (load)" && d == Direction::kBackup) continue;
      absl::StatusOr<std::shared_ptr<Ticket>> t =
          f_.manager_->Submit({}, att->id, d, kv_host, kv_dev, "", b.others);
      EXPECT_EQ(t.status().code(), b.code) << b.what << ": " << t.status();
      EXPECT_THAT(Msg(t.status()), HasSubstr(b.needle)) << b.what;
    }
  }
  // pool_transfers on a plain attachment.
  std::unique_ptr<DevicePool> plain =
      DevicePool::Create(f_.dir_.path() + "/plain", *kv_.pool, 12, 3);
  ASSERT_NE(plain, nullptr);
  absl::StatusOr<AttachmentInfo> plain_att =
      AttachByName(*f_.manager_, *f_.registry_, "attn", plain->Request());
  ASSERT_TRUE(plain_att.ok()) << plain_att.status();
  EXPECT_TRUE(plain_att->group.empty());
  absl::StatusOr<std::shared_ptr<Ticket>> t = f_.manager_->Submit(
      {}, plain_att->id, Direction::kBackup, kv_host, kv_dev, "", {{"ssm", ssm_host, ssm_dev}});
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << t.status();
  EXPECT_THAT(Msg(t.status()), HasSubstr("not of a pool group"));

  f_.ExpectNoTickets();
  EXPECT_TRUE(HostBytes(*kv_.pool) == kv_h);
  EXPECT_TRUE(HostBytes(*ssm_.pool) == ssm_h);
  EXPECT_TRUE(kv_.DeviceBytes() == kv_d);
  EXPECT_TRUE(ssm_.DeviceBytes() == ssm_d);
}

// A group with a page-row entry: V4_PAGED rows move in whole pages, mapped
// per model layer like any other entry.
TEST(GroupPageRowTest, WholePagesFollowTheMapAndPartialPagesChangeNothing) {
  KindFixture f;
  ASSERT_FALSE(f.dir_.path().empty());
  absl::StatusOr<std::shared_ptr<Pool>> mla =
      f.registry_->Create("mla", MlaSpec(LayoutKind::kLayerFirst, 3));
  absl::StatusOr<std::shared_ptr<Pool>> v4 =
      f.registry_->Create("v4", V4PagedSpec(LayoutKind::kPageFirst));
  ASSERT_TRUE(mla.ok()) << mla.status();
  ASSERT_TRUE(v4.ok()) << v4.status();
  ASSERT_EQ((*v4)->components().size(), 1u);
  ASSERT_EQ((*v4)->components()[0].row_tokens, 3u);
  Member a, b;
  a.entry = "latent";
  a.pool = *mla;
  a.attached = 2;
  a.map = {1, -1, 0};
  a.dev = DevicePool::Create(f.dir_.path() + "/dev-mla", *a.pool, 9, 2);
  b.entry = "paged";
  b.pool = *v4;
  b.attached = 3;
  b.map = {-1, 2, 0};
  b.dev = DevicePool::Create(f.dir_.path() + "/dev-v4", *b.pool, 12, 3);
  ASSERT_NE(a.dev, nullptr);
  ASSERT_NE(b.dev, nullptr);
  ASSERT_TRUE(
      f.registry_
          ->CreateGroup("mixed", 3, {{"latent", "mla", a.map, false}, {"paged", "v4", b.map, true}})
          .ok());
  AttachRequest req;
  req.entries.push_back({"paged", b.dev->Request()});
  req.entries.push_back({"latent", a.dev->Request()});  // any order
  absl::StatusOr<AttachmentInfo> att = AttachByName(*f.manager_, *f.registry_, "mixed", req);
  ASSERT_TRUE(att.ok()) << att.status();
  EXPECT_EQ(att->pool, "v4");
  EXPECT_EQ(att->end_layer, 3u);
  std::mt19937_64 rng(9);
  for (Member* m : {&a, &b}) {
    std::vector<uint8_t> d = RandomBytes(rng, m->dev->size());
    for (uint8_t& x : d) x |= 1;
    std::memcpy(m->dev->data(), d.data(), d.size());
  }
  // Two whole v4 pages against device pages 3 and 1.
  std::vector<int64_t> v4_host = AllocSlots(*b.pool, 6);
  std::vector<int64_t> mla_host = AllocSlots(*a.pool, 3);
  ASSERT_EQ(v4_host.size(), 6u);
  ASSERT_EQ(mla_host.size(), 3u);
  std::vector<int64_t> v4_dev = {9, 10, 11, 3, 4, 5};
  std::vector<int64_t> mla_dev = {8, 0, 4};

  // A partial v4 page: refused, no ticket, nothing changed.
  const std::vector<std::vector<uint8_t>> v4_before = HostBytes(*b.pool);
  const std::vector<int64_t> partial_host(v4_host.begin(), v4_host.begin() + 2);
  const std::vector<int64_t> partial_dev = {9, 10};
  absl::StatusOr<std::shared_ptr<Ticket>> refused =
      f.manager_->Submit({}, att->id, Direction::kBackup, partial_host, partial_dev, "",
                         {{"latent", mla_host, mla_dev}});
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  EXPECT_THAT(Msg(refused.status()), HasSubstr("whole pages"));
  f.ExpectNoTickets();
  EXPECT_TRUE(HostBytes(*b.pool) == v4_before);

  // Backup, then load into other device rows, byte-exact per entry.
  std::vector<std::vector<uint8_t>> ah = HostBytes(*a.pool), bh = HostBytes(*b.pool);
  std::vector<uint8_t> ad = a.DeviceBytes(), bd = b.DeviceBytes();
  a.Expect(true, mla_host, mla_dev, &ah, &ad);
  b.Expect(true, v4_host, v4_dev, &bh, &bd);
  absl::StatusOr<std::shared_ptr<Ticket>> t = f.manager_->Submit(
      {}, att->id, Direction::kBackup, v4_host, v4_dev, "", {{"latent", mla_host, mla_dev}});
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_TRUE((*t)->WaitUntil(absl::Now() + absl::Seconds(30)));
  TicketStatus st = (*t)->Snapshot();
  EXPECT_TRUE(st.status.ok()) << st.status;
  EXPECT_EQ(st.layer_num, 3u);
  EXPECT_EQ(st.layers_done, 3u);
  // MLA rows: (7 + 2) bf16 per token; V4_PAGED: one item_bytes (13) row per page.
  const uint64_t want = a.mapped_layers() * mla_host.size() * (7 + 2) * 2 +
                        b.mapped_layers() * (v4_host.size() / 3) * 13;
  EXPECT_EQ(st.bytes, want);
  EXPECT_TRUE(HostBytes(*a.pool) == ah) << "mla host bytes";
  EXPECT_TRUE(HostBytes(*b.pool) == bh) << "v4 host bytes";

  for (Member* m : {&a, &b}) {
    std::vector<uint8_t> d = RandomBytes(rng, m->dev->size());
    std::memcpy(m->dev->data(), d.data(), d.size());
  }
  std::vector<int64_t> v4_dev2 = {0, 1, 2, 6, 7, 8};
  std::vector<int64_t> mla_dev2 = {1, 2, 3};
  ad = a.DeviceBytes();
  bd = b.DeviceBytes();
  a.Expect(false, mla_host, mla_dev2, &ah, &ad);
  b.Expect(false, v4_host, v4_dev2, &bh, &bd);
  t = f.manager_->Submit({}, att->id, Direction::kLoad, v4_host, v4_dev2, "",
                         {{"latent", mla_host, mla_dev2}});
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_TRUE((*t)->WaitUntil(absl::Now() + absl::Seconds(30)));
  st = (*t)->Snapshot();
  EXPECT_TRUE(st.status.ok()) << st.status;
  EXPECT_EQ(st.bytes, want);
  EXPECT_TRUE(a.DeviceBytes() == ad) << "mla device bytes";
  EXPECT_TRUE(b.DeviceBytes() == bd) << "v4 device bytes";
}

// AssignRows alone, with no manager, session or engine: each entry gets the
// rows the request names for it, and every misnamed entry is refused.
TEST_F(GroupTest, AssignRowsGivesEachEntryItsRowsWithoutAManager) {
  SubmitTarget target;
  target.group = group_;
  for (const GroupEntry& e : group_->entries())
    target.pools.push_back({e.name, e.pool, nullptr, {}});
  const std::vector<int64_t> host = {0, 1, 2};
  const std::vector<int64_t> device = {3, 4, 5};
  const size_t anchor = group_->anchor_index();
  const size_t other = 1 - anchor;
  const std::string other_name = group_->entries()[other].name;
  const std::string anchor_name = group_->entries()[anchor].name;
  absl::StatusOr<std::vector<PartRows>> rows =
      AssignRows(target, "att-1", host, device, {{other_name, device, host}});
  ASSERT_TRUE(rows.ok()) << rows.status();
  ASSERT_EQ(rows->size(), 2u);
  EXPECT_TRUE((*rows)[anchor].given);
  EXPECT_EQ((*rows)[anchor].prefix, "");
  EXPECT_EQ((*rows)[anchor].host.data(), host.data());
  EXPECT_TRUE((*rows)[other].given);
  EXPECT_EQ((*rows)[other].prefix, "pool_transfers[0].");
  EXPECT_EQ((*rows)[other].host.data(), device.data());

  const std::vector<std::pair<std::vector<EntryRows>, std::string>> refused = {
      {{{"nope", host, device}}, "pool_transfers[0] names entry 'nope'"},
      {{{anchor_name, host, device}}, "the anchor of pool group 'hybrid'"},
      {{{other_name, host, device}, {other_name, host, device}}, "a second time"},
  };
  for (const auto& [transfers, message] : refused) {
    absl::StatusOr<std::vector<PartRows>> r = AssignRows(target, "att-1", host, device, transfers);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << message;
    EXPECT_THAT(r.status().message(), HasSubstr(message));
  }
  // pool_transfers on a plain pool's attachment.
  SubmitTarget plain;
  plain.pools.push_back(target.pools[anchor]);
  absl::StatusOr<std::vector<PartRows>> r =
      AssignRows(plain, "att-2", host, device, {{other_name, host, device}});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("not of a pool group"));
}

}  // namespace
}  // namespace kvhost
