// Integration tests of pool groups through kvhostd (host backend) and
// kvhost::Client: CreatePoolGroup / GetPoolGroup / ListPoolGroups /
// DeletePoolGroup and their refusals, Alloc / Free / the page calls through a
// group's name acting on the anchor, and a hybrid model's group (an MHA KV
// pool and a MAMBA state pool, layer maps with -1s) attached through
// ShmDevicePools, backed up with the anchor's rows and a pool_transfer, and
// loaded into fresh device buffers.
//
// Expected host and device images are built here from the seeds' row
// formulas (PAGE_FIRST and one-slot PAGE_FIRST_DIRECT: token t, layer l at
// (t * L + l) * row) and the group's layer maps, independently of the
// daemon. Each test runs its own kvhostd.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "api_test_util.h"
#include "gtest/gtest.h"
#include "kvhost/client.h"

namespace kvhost {
namespace {

using ::kvhost::testing::IsError;
using ::kvhost::testing::StatusOf;

// The hybrid model: 6 model layers; attention on model layers 1, 2 and 4
// (device layers 0, 1, 3 of "attn"; its layer 2 is mapped by no model layer),
// Mamba on model layers 0 and 3 (device layers 0, 1 of "ssm").
constexpr uint32_t kModelLayers = 6;
const std::vector<int32_t> kAttnMap = {-1, 0, 1, -1, 3, -1};
const std::vector<int32_t> kSsmMap = {0, -1, -1, 1, -1, -1};

constexpr uint64_t kAttnTokens = 64, kAttnPage = 4, kAttnLayers = 4;
constexpr uint64_t kAttnRow = 2 * 8 * 2;  // heads x head_dim x bf16
constexpr uint64_t kSsmTokens = 16, kSsmLayers = 2;
constexpr uint64_t kTemporalRow = 2 * 3 * 4;  // 2x3 fp32
constexpr uint64_t kConvRow = 5 * 2;          // 5 bf16

v1::PoolSpec AttnSpec() {
  v1::PoolSpec s;
  s.set_kind(v1::MHA);
  s.set_layout(v1::PAGE_FIRST);
  s.set_dtype(v1::BF16);
  s.set_page_size(kAttnPage);
  s.set_layer_num(kAttnLayers);
  s.set_head_num(2);
  s.set_head_dim(8);
  s.set_size_tokens(kAttnTokens);
  return s;
}

v1::PoolSpec SsmSpec() {
  v1::PoolSpec s;
  s.set_kind(v1::MAMBA);
  s.set_layout(v1::PAGE_FIRST_DIRECT);
  s.set_dtype(v1::BF16);
  s.set_page_size(1);
  s.set_layer_num(kSsmLayers);
  s.set_size_tokens(kSsmTokens);
  v1::MambaStates* m = s.mutable_mamba();
  m->mutable_temporal()->add_dims(2);
  m->mutable_temporal()->add_dims(3);
  m->set_temporal_dtype(v1::FP32);
  m->add_conv()->add_dims(5);
  return s;
}

v1::PoolEntry Entry(const std::string& name, const std::string& pool,
                    const std::vector<int32_t>& map = {}, bool anchor = false) {
  v1::PoolEntry e;
  e.set_name(name);
  e.set_pool(pool);
  for (int32_t v : map) e.add_layer_map(v);
  e.set_anchor(anchor);
  return e;
}

// One host buffer of an entry's pool: token t of host layer l at
// base + (t * L + l) * row in region file `region` (PAGE_FIRST token rows;
// PAGE_FIRST_DIRECT with one-slot pages is the same).
struct HostBuffer {
  uint32_t region;
  uint64_t base;
  uint64_t row;
  uint64_t L;
  uint64_t At(uint64_t t, uint64_t l) const { return base + (t * L + l) * row; }
};

// attn: K then V in one ".kv" file, V at L * S * row; ssm: ".temporal" and
// ".conv0".
const std::vector<HostBuffer> kAttnBuffers = {
    {0, 0, kAttnRow, kAttnLayers}, {0, kAttnLayers* kAttnTokens* kAttnRow, kAttnRow, kAttnLayers}};
const std::vector<HostBuffer> kSsmBuffers = {{0, 0, kTemporalRow, kSsmLayers},
                                             {1, 0, kConvRow, kSsmLayers}};

// A device layer that some model layer maps to.
bool Mapped(const std::vector<int32_t>& map, uint32_t device_layer) {
  for (int32_t v : map) {
    if (v == static_cast<int32_t>(device_layer)) return true;
  }
  return false;
}

class GroupsTest : public testing::WithDaemon<::testing::Test> {
 protected:
  void CreatePools() {
    ASSERT_TRUE(client().CreatePool("attn", AttnSpec()).ok());
    ASSERT_TRUE(client().CreatePool("ssm", SsmSpec()).ok());
  }
  absl::StatusOr<v1::PoolGroup> CreateHybrid() {
    return client().CreatePoolGroup("hybrid", kModelLayers,
                                    {Entry("kv", "attn", kAttnMap), Entry("ssm", "ssm", kSsmMap)});
  }
  uint64_t Tickets() {
    absl::StatusOr<v1::DaemonStatus> s = client().GetStatus();
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? s->tickets_in_flight() + s->tickets_done() + s->tickets_failed() : 0;
  }
  // Every region file's bytes of `pool`, in order.
  std::vector<std::string> HostImage(const std::string& pool) {
    absl::StatusOr<v1::Pool> p = client().GetPool(pool);
    EXPECT_TRUE(p.ok()) << p.status();
    std::vector<std::string> files;
    if (!p.ok()) return files;
    for (const std::string& path : p->region_paths()) {
      std::unique_ptr<testing::MappedFile> f = testing::MappedFile::Open(path);
      EXPECT_NE(f, nullptr) << path;
      files.push_back(f == nullptr
                          ? std::string()
                          : std::string(reinterpret_cast<const char*>(f->data()), f->size()));
    }
    return files;
  }
  // The whole device image of `dev` (every component and layer).
  static std::string DeviceImage(const ShmDevicePool& dev) {
    return std::string(reinterpret_cast<const char*>(dev.layer(0, 0)), dev.bytes());
  }
  uint32_t Wait(absl::StatusOr<uint64_t> ticket) {
    EXPECT_TRUE(ticket.ok()) << ticket.status();
    if (!ticket.ok()) return 0;
    absl::StatusOr<v1::TransferStatus> st = client().WaitTransfer(*ticket, absl::Seconds(30));
    EXPECT_TRUE(st.ok()) << st.status();
    return st.ok() ? st->layer_num() : 0;
  }
};

// ---------------------------------------------------------------------------
// 1. Create, get, list, delete, and the refusals.

TEST_F(GroupsTest, CreateGetListDeleteSpellOutTheMapsAndTheAnchor) {
  CreatePools();
  absl::StatusOr<v1::PoolGroup> created = client().CreatePoolGroup(
      "hybrid", kModelLayers, {Entry("kv", "attn", kAttnMap), Entry("ssm", "ssm", {}, true)});
  ASSERT_TRUE(created.ok()) << created.status();
  absl::StatusOr<v1::PoolGroup> got = client().GetPoolGroup("hybrid");
  ASSERT_TRUE(got.ok()) << got.status();
  absl::StatusOr<std::vector<v1::PoolGroup>> listed = client().ListPoolGroups();
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->size(), 1u);
  for (const v1::PoolGroup* g : {&*created, &*got, &(*listed)[0]}) {
    EXPECT_EQ(g->name(), "hybrid");
    EXPECT_EQ(g->layer_num(), kModelLayers);
    EXPECT_EQ(g->anchor(), "ssm");
    EXPECT_EQ(g->attachments(), 0u);
    ASSERT_EQ(g->entries_size(), 2);
    EXPECT_EQ(g->entries(0).name(), "kv");
    EXPECT_EQ(g->entries(0).pool(), "attn");
    EXPECT_FALSE(g->entries(0).anchor());
    EXPECT_EQ(
        std::vector<int32_t>(g->entries(0).layer_map().begin(), g->entries(0).layer_map().end()),
        kAttnMap);
    EXPECT_EQ(g->entries(1).pool(), "ssm");
    EXPECT_TRUE(g->entries(1).anchor());
    // Empty: the identity over the layers ssm holds, [0, 2).
    EXPECT_EQ(
        std::vector<int32_t>(g->entries(1).layer_map().begin(), g->entries(1).layer_map().end()),
        (std::vector<int32_t>{0, 1, -1, -1, -1, -1}));
  }
  EXPECT_EQ(client().GetPool("attn")->group(), "hybrid");
  EXPECT_EQ(client().GetPool("ssm")->group(), "hybrid");
  EXPECT_ERROR(client().DeletePool("attn"), kFailedPrecondition, "group 'hybrid'");
  EXPECT_TRUE(client().GetPool("attn").ok());
  ASSERT_TRUE(client().DeletePoolGroup("hybrid").ok());
  EXPECT_ERROR(client().GetPoolGroup("hybrid"), kNotFound, "hybrid");
  EXPECT_ERROR(client().DeletePoolGroup("hybrid"), kNotFound, "hybrid");
  EXPECT_EQ(client().GetPool("attn")->group(), "");
  EXPECT_TRUE(client().ListPoolGroups()->empty());
  EXPECT_TRUE(client().DeletePool("attn").ok());
  EXPECT_TRUE(client().DeletePool("ssm").ok());
}

TEST_F(GroupsTest, RefusalsThroughTheApiChangeNothing) {
  CreatePools();
  ASSERT_TRUE(client().CreatePool("other", AttnSpec()).ok());
  ASSERT_TRUE(CreateHybrid().ok());
  EXPECT_ERROR(client().CreatePoolGroup("g", kModelLayers,
                                        {Entry("a", "other", {}, true), Entry("b", "x", {}, true)}),
               kInvalidArgument, "entries[1] 'b'", "anchor");
  EXPECT_ERROR(client().CreatePoolGroup("g", 2, {Entry("a", "other", {0, 4})}), kInvalidArgument,
               "entries[0] 'a'", "layer_map[1] = 4", "[0, 4)");
  EXPECT_ERROR(client().CreatePoolGroup("g", 2, {Entry("a", "other", {1, 1})}), kInvalidArgument,
               "layer_map[1] = 1");
  EXPECT_ERROR(client().CreatePoolGroup("g", 0, {Entry("a", "other")}), kInvalidArgument,
               "layer_num");
  EXPECT_ERROR(client().CreatePoolGroup("g", 2, {}), kInvalidArgument, "0 entries");
  EXPECT_ERROR(client().CreatePoolGroup("g", 2, {Entry("a", "other"), Entry("b", "nope")}),
               kNotFound, "entries[1] 'b'", "'nope'");
  EXPECT_ERROR(client().CreatePoolGroup("g", 2, {Entry("a", "other"), Entry("b", "ssm")}),
               kFailedPrecondition, "'ssm'", "group 'hybrid'");
  EXPECT_ERROR(client().CreatePoolGroup("other", 2, {Entry("a", "other")}), kAlreadyExists,
               "'other'");
  EXPECT_ERROR(client().CreatePoolGroup("hybrid", 2, {Entry("a", "other")}), kAlreadyExists,
               "'hybrid'");
  EXPECT_ERROR(client().CreatePool("hybrid", AttnSpec()), kAlreadyExists, "'hybrid'");
  // Nothing of them stayed.
  absl::StatusOr<std::vector<v1::PoolGroup>> groups = client().ListPoolGroups();
  ASSERT_TRUE(groups.ok());
  ASSERT_EQ(groups->size(), 1u);
  EXPECT_EQ((*groups)[0].name(), "hybrid");
  EXPECT_EQ(client().GetPool("other")->group(), "");
  absl::StatusOr<std::vector<v1::Pool>> pools = client().ListPools();
  ASSERT_TRUE(pools.ok());
  EXPECT_EQ(pools->size(), 3u);
  // "other" is free to join a group now.
  EXPECT_TRUE(client().CreatePoolGroup("g", 2, {Entry("a", "other")}).ok());
}

// ---------------------------------------------------------------------------
// 2. Alloc, Free and the page calls through a group's name act on its anchor.

TEST_F(GroupsTest, AllocFreeAndPagesThroughTheGroupActOnTheAnchor) {
  CreatePools();
  ASSERT_TRUE(CreateHybrid().ok());  // anchor: kv = attn
  absl::StatusOr<std::vector<int64_t>> slots = client().Alloc("hybrid", 2 * kAttnPage);
  ASSERT_TRUE(slots.ok()) << slots.status();
  ASSERT_EQ(slots->size(), 2 * kAttnPage);
  EXPECT_EQ(client().GetPool("attn")->available_tokens(), kAttnTokens - 2 * kAttnPage);
  EXPECT_EQ(client().GetPool("ssm")->available_tokens(), kSsmTokens);
  // The anchor's page metadata and pages, under either name.
  absl::StatusOr<v1::PageBufferMeta> by_group = client().GetPageBufferMeta("hybrid", *slots);
  absl::StatusOr<v1::PageBufferMeta> by_pool = client().GetPageBufferMeta("attn", *slots);
  ASSERT_TRUE(by_group.ok()) << by_group.status();
  ASSERT_TRUE(by_pool.ok()) << by_pool.status();
  EXPECT_EQ(by_group->SerializeAsString(), by_pool->SerializeAsString());
  std::mt19937 rng(3);
  std::string page(client().GetPageShape("attn")->bytes(), '\0');
  testing::FillRandomNonZero(reinterpret_cast<uint8_t*>(page.data()), page.size(), rng);
  ASSERT_TRUE(client().SetFromFlatDataPage("hybrid", (*slots)[0], page).ok());
  absl::StatusOr<std::string> back = client().GetDataPage("attn", (*slots)[0]);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(*back == page);
  absl::StatusOr<std::vector<std::string>> streamed =
      client().ReadPages("hybrid", {(*slots)[0]}, /*chunk_bytes=*/100);
  ASSERT_TRUE(streamed.ok()) << streamed.status();
  EXPECT_TRUE((*streamed)[0] == page);
  EXPECT_EQ(*client().WritePages("hybrid", {(*slots)[kAttnPage]}, {page}, 100), 1u);
  EXPECT_TRUE(*client().GetDataPage("attn", (*slots)[kAttnPage]) == page);
  absl::StatusOr<uint64_t> freed = client().Free("hybrid", *slots);
  ASSERT_TRUE(freed.ok()) << freed.status();
  EXPECT_EQ(*freed, 2 * kAttnPage);
  EXPECT_EQ(client().GetPool("attn")->available_tokens(), kAttnTokens);
  // A name that is neither.
  EXPECT_ERROR(client().Alloc("nope", kAttnPage), kNotFound, "'nope'");
}

// ---------------------------------------------------------------------------
// 3. A hybrid group's backup and load through ShmDevicePools.

struct Side {
  std::vector<int64_t> host, device;
};

// The expected host files of a pool after backing up rows `side` of `dev`
// over `before`, for the device layers `map` names.
std::vector<std::string> ExpectHost(std::vector<std::string> before, const ShmDevicePool& dev,
                                    const std::vector<HostBuffer>& buffers,
                                    const std::vector<int32_t>& map, const Side& side) {
  for (uint32_t c = 0; c < buffers.size(); ++c) {
    const HostBuffer& b = buffers[c];
    for (uint32_t l = 0; l < dev.layers(); ++l) {
      if (!Mapped(map, l)) continue;
      for (size_t i = 0; i < side.host.size(); ++i) {
        std::memcpy(before[b.region].data() + b.At(static_cast<uint64_t>(side.host[i]), l),
                    dev.row(c, l, static_cast<uint64_t>(side.device[i])), b.row);
      }
    }
  }
  return before;
}

TEST_F(GroupsTest, HybridBackupAndLoadFollowTheLayerMaps) {
  CreatePools();
  ASSERT_TRUE(CreateHybrid().ok());
  absl::StatusOr<v1::Pool> attn = client().GetPool("attn");
  absl::StatusOr<v1::Pool> ssm = client().GetPool("ssm");
  ASSERT_TRUE(attn.ok() && ssm.ok());
  constexpr uint64_t kAttnDevice = 16, kSsmDevice = 8;
  auto kv_dev = ShmDevicePool::Create(*attn, kAttnDevice, shm_dir());
  auto ssm_dev = ShmDevicePool::Create(*ssm, kSsmDevice, shm_dir());
  ASSERT_TRUE(kv_dev.ok()) << kv_dev.status();
  ASSERT_TRUE(ssm_dev.ok()) << ssm_dev.status();
  ASSERT_EQ((*kv_dev)->row_bytes(0), kAttnRow);
  ASSERT_EQ((*ssm_dev)->row_bytes(0), kTemporalRow);
  ASSERT_EQ((*ssm_dev)->row_bytes(1), kConvRow);
  std::mt19937 rng(11);
  for (ShmDevicePool* dev : {kv_dev->get(), ssm_dev->get()}) {
    testing::FillRandomNonZero(dev->layer(0, 0), dev->bytes(), rng);
  }
  const GroupDevice devices[] = {{"kv", kv_dev->get()}, {"ssm", ssm_dev->get()}};
  absl::StatusOr<v1::Attachment> att =
      client().AttachDevice(MakeGroupAttachRequest("hybrid", devices));
  ASSERT_TRUE(att.ok()) << att.status();
  EXPECT_EQ(att->group(), "hybrid");
  EXPECT_EQ(att->pool(), "attn");  // the anchor
  EXPECT_EQ(client().GetPoolGroup("hybrid")->attachments(), 1u);
  EXPECT_ERROR(client().DeletePoolGroup("hybrid"), kFailedPrecondition, "attachment");

  // The anchor's rows (Alloc through the group) and ssm's (its own Alloc).
  absl::StatusOr<std::vector<int64_t>> kv_host = client().Alloc("hybrid", 2 * kAttnPage);
  absl::StatusOr<std::vector<int64_t>> ssm_host = client().Alloc("ssm", 3);
  ASSERT_TRUE(kv_host.ok() && ssm_host.ok());
  const Side kv{*kv_host, {3, 4, 5, 6, 9, 10, 11, 0}};
  const Side st{*ssm_host, {5, 1, 6}};
  const std::vector<std::string> attn_before = HostImage("attn");
  const std::vector<std::string> ssm_before = HostImage("ssm");
  const uint64_t tickets = Tickets();

  // Refused backups leave no ticket and no byte changed.
  const v1::PoolTransfer good = MakePoolTransfer("ssm", st.host, st.device);
  EXPECT_ERROR(client().Backup(att->id(), kv.host, kv.device,
                               {MakePoolTransfer("mamba", st.host, st.device)}),
               kInvalidArgument, "mamba");
  EXPECT_ERROR(
      client().Backup(att->id(), kv.host, kv.device, {MakePoolTransfer("kv", st.host, st.device)}),
      kInvalidArgument, "kv");
  EXPECT_ERROR(client().Backup(att->id(), kv.host, kv.device, {good, good}), kInvalidArgument,
               "ssm");
  EXPECT_FALSE(client()
                   .Backup(att->id(), kv.host, kv.device,
                           {MakePoolTransfer("ssm", {st.host[0], 15}, {5, 1})})
                   .ok());  // slot 15 of ssm is not allocated
  EXPECT_FALSE(client()
                   .Backup(att->id(), kv.host, kv.device,
                           {MakePoolTransfer("ssm", st.host, {5, 1, kSsmDevice})})
                   .ok());  // device row out of range
  EXPECT_EQ(Tickets(), tickets);
  EXPECT_TRUE(HostImage("attn") == attn_before);
  EXPECT_TRUE(HostImage("ssm") == ssm_before);

  // The backup: the anchor's rows and ssm's, per model layer.
  EXPECT_EQ(Wait(client().Backup(att->id(), kv.host, kv.device, {good})), kModelLayers);
  const std::vector<std::string> attn_want =
      ExpectHost(attn_before, **kv_dev, kAttnBuffers, kAttnMap, kv);
  const std::vector<std::string> ssm_want =
      ExpectHost(ssm_before, **ssm_dev, kSsmBuffers, kSsmMap, st);
  EXPECT_TRUE(HostImage("attn") == attn_want) << "attn host bytes (device layer 2 unmapped)";
  EXPECT_TRUE(HostImage("ssm") == ssm_want) << "ssm host bytes";
  // attn's device layer 2 is mapped by no model layer: its host layer is
  // untouched, the others hold the rows.
  EXPECT_TRUE(attn_want != attn_before);
  for (size_t i = 0; i < kv.host.size(); ++i) {
    const uint64_t t = static_cast<uint64_t>(kv.host[i]);
    EXPECT_EQ(std::string(HostImage("attn")[0].data() + kAttnBuffers[0].At(t, 2), kAttnRow),
              std::string(kAttnRow, '\0'));
  }

  // Load into fresh device buffers at other rows, through a second group
  // attachment.
  auto kv_dev2 = ShmDevicePool::Create(*attn, kAttnDevice, shm_dir());
  auto ssm_dev2 = ShmDevicePool::Create(*ssm, kSsmDevice, shm_dir());
  ASSERT_TRUE(kv_dev2.ok() && ssm_dev2.ok());
  const GroupDevice devices2[] = {{"kv", kv_dev2->get()}, {"ssm", ssm_dev2->get()}};
  absl::StatusOr<v1::Attachment> att2 =
      client().AttachDevice(MakeGroupAttachRequest("hybrid", devices2));
  ASSERT_TRUE(att2.ok()) << att2.status();
  const Side kv2{kv.host, {15, 14, 13, 12, 1, 2, 7, 8}};
  const Side st2{st.host, {0, 7, 2}};
  const std::string kv2_before = DeviceImage(**kv_dev2);
  const std::string ssm2_before = DeviceImage(**ssm_dev2);
  const uint64_t tickets2 = Tickets();
  EXPECT_TRUE(IsError(StatusOf(client().Load(att2->id(), kv2.host, kv2.device,
                                             {MakePoolTransfer("ssm", st2.host, {0, 7})})),
                      absl::StatusCode::kInvalidArgument, {}))
      << "lengths differ";
  EXPECT_ERROR(client().Load(att2->id(), kv2.host, kv2.device,
                             {MakePoolTransfer("nope", st2.host, st2.device)}),
               kInvalidArgument, "nope");
  EXPECT_EQ(Tickets(), tickets2);
  EXPECT_TRUE(DeviceImage(**kv_dev2) == kv2_before);
  EXPECT_TRUE(DeviceImage(**ssm_dev2) == ssm2_before);

  EXPECT_EQ(Wait(client().Load(att2->id(), kv2.host, kv2.device,
                               {MakePoolTransfer("ssm", st2.host, st2.device)})),
            kModelLayers);
  // Expected device images: zeros but the loaded rows of mapped layers,
  // which equal the rows first backed up from the other device.
  struct Check {
    const char* name;
    const ShmDevicePool* src;
    const ShmDevicePool* dst;
    const std::vector<int32_t>* map;
    const Side* from;
    const Side* to;
  };
  for (const Check& ck : {Check{"kv", kv_dev->get(), kv_dev2->get(), &kAttnMap, &kv, &kv2},
                          Check{"ssm", ssm_dev->get(), ssm_dev2->get(), &kSsmMap, &st, &st2}}) {
    SCOPED_TRACE(ck.name);
    for (uint32_t c = 0; c < ck.dst->components(); ++c) {
      for (uint32_t l = 0; l < ck.dst->layers(); ++l) {
        std::string want(ck.dst->rows(c) * ck.dst->row_bytes(c), '\0');
        if (Mapped(*ck.map, l)) {
          for (size_t i = 0; i < ck.to->device.size(); ++i) {
            std::memcpy(
                want.data() + static_cast<uint64_t>(ck.to->device[i]) * ck.dst->row_bytes(c),
                ck.src->row(c, l, static_cast<uint64_t>(ck.from->device[i])), ck.dst->row_bytes(c));
          }
        }
        const std::string got(reinterpret_cast<const char*>(ck.dst->layer(c, l)), want.size());
        EXPECT_TRUE(got == want) << "component " << ck.dst->component_name(c) << " layer " << l
                                 << (Mapped(*ck.map, l) ? "" : " (unmapped: must stay zero)");
      }
    }
  }

  ASSERT_TRUE(client().DetachDevice(att->id()).ok());
  ASSERT_TRUE(client().DetachDevice(att2->id()).ok());
  EXPECT_EQ(client().GetPoolGroup("hybrid")->attachments(), 0u);
  EXPECT_TRUE(client().DeletePoolGroup("hybrid").ok());
}

TEST_F(GroupsTest, GroupAttachRefusesMissingOrUnknownEntries) {
  CreatePools();
  ASSERT_TRUE(CreateHybrid().ok());
  absl::StatusOr<v1::Pool> attn = client().GetPool("attn");
  absl::StatusOr<v1::Pool> ssm = client().GetPool("ssm");
  ASSERT_TRUE(attn.ok() && ssm.ok());
  auto kv_dev = ShmDevicePool::Create(*attn, 8, shm_dir());
  auto ssm_dev = ShmDevicePool::Create(*ssm, 8, shm_dir());
  ASSERT_TRUE(kv_dev.ok() && ssm_dev.ok());
  const GroupDevice only_kv[] = {{"kv", kv_dev->get()}};
  EXPECT_ERROR(client().AttachDevice(MakeGroupAttachRequest("hybrid", only_kv)), kInvalidArgument,
               "ssm");
  const GroupDevice unknown[] = {{"kv", kv_dev->get()}, {"mamba", ssm_dev->get()}};
  EXPECT_ERROR(client().AttachDevice(MakeGroupAttachRequest("hybrid", unknown)), kInvalidArgument,
               "mamba");
  // The group's name with a plain pool's buffers.
  EXPECT_ERROR(client().AttachDevice((*kv_dev)->MakeAttachRequest("hybrid")), kInvalidArgument,
               "hybrid");
  EXPECT_EQ(client().GetPoolGroup("hybrid")->attachments(), 0u);
  EXPECT_EQ(client().GetPool("attn")->attachments(), 0u);
  EXPECT_EQ(client().GetPool("ssm")->attachments(), 0u);
}

}  // namespace
}  // namespace kvhost
