// Fixtures of the transfer manager's tests (attachments_test.cc,
// submission_test.cc, transfer_manager_test.cc), over the host engine:
// ManagerTest (one MHA pool attached), the pool kinds' specs, DevicePool (an
// emulated device pool in a file under /dev/shm), KindFixture (a registry and
// a manager), SeedOffset and SeedCopy (what a transfer must move, written from
// the seeds' tensor shapes, tests/seed_offsets.h), PageRowTest (page-row
// rows) and GroupTest (a pool group of an MHA and a MAMBA pool).
#ifndef KVHOST_TESTS_TRANSFER_MANAGER_FIXTURES_H_
#define KVHOST_TESTS_TRANSFER_MANAGER_FIXTURES_H_

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <ostream>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "domain_test_util.h"
#include "kvhost/layout.h"
#include "seed_offsets.h"
#include "server/pool/pool.h"
#include "server/pool/pool_group.h"
#include "server/pool/pool_spec.h"
#include "server/pool/registry.h"
#include "server/pool/shm_region.h"
#include "server/tickets/ticket.h"
#include "server/transfer/engine.h"
#include "server/transfer/host_engine.h"
#include "server/transfer/transfer_manager.h"
#include "transfer_test_util.h"

namespace kvhost {

using ::kvhost::testing::AttachByName;
using ::kvhost::testing::EngineFixture;
using ::kvhost::testing::Msg;
using ::kvhost::testing::RandomBytes;
using ::kvhost::testing::RandomPairs;
using ::kvhost::testing::RoomyRegistryOptions;
using ::kvhost::testing::SameBytes;
using ::testing::HasSubstr;
using ::testing::Not;
using ShmDir = ::kvhost::testing::TransferShmDir;

class ManagerTest : public EngineFixture {
 protected:
  void SetUp() override {
    EngineFixture::SetUp();
    registry_ = std::make_unique<PoolRegistry>(RoomyRegistryOptions(dir_.path()));
    absl::StatusOr<std::shared_ptr<Pool>> pool = registry_->Create("llama", spec_);
    ASSERT_TRUE(pool.ok()) << pool.status();
    pool_ = *pool;  // the registry's pool; the device file matches its layout
    manager_ = std::make_unique<TransferManager>(std::make_unique<HostEngine>(Options()));
    absl::StatusOr<AttachmentInfo> att =
        AttachByName(*manager_, *registry_, "llama", dev_.Request(pool_->layout().planes));
    ASSERT_TRUE(att.ok()) << att.status();
    att_ = att->id;
  }
  void TearDown() override {
    manager_.reset();
    registry_.reset();
  }

  // No ticket exists, none is in flight and none finished.
  void ExpectNoTickets() {
    const TransferCounters c = manager_->counters();
    EXPECT_EQ(c.tickets_in_flight, 0u);
    EXPECT_EQ(c.tickets_done, 0u);
    EXPECT_EQ(c.tickets_failed, 0u);
    EXPECT_EQ(c.bytes[0] + c.bytes[1], 0u);
    for (uint64_t id = 0; id < 20; ++id) {
      EXPECT_EQ(manager_->FindTicket({}, id).status().code(), absl::StatusCode::kNotFound) << id;
    }
  }

  std::unique_ptr<PoolRegistry> registry_;
  std::unique_ptr<TransferManager> manager_;
  std::string att_;
};

// The offset of row `row` (a token slot, or a page of a page-row
// component), layer `layer`, head `head` in a one-plane component of shape
// `c`, from the seeds' C-contiguous tensor shapes (tests/seed_offsets.h),
// apart from KvLayout::Offset.
inline uint64_t SeedOffset(const KvLayout& c, uint64_t row, uint64_t layer, uint64_t head) {
  testing::SeedBuffer b;
  b.layout = testing::SeedLayoutNamed(c.kind);
  // A PAGE_UNIFIED component is plane 0 of the buffer whose planes
  // interleave (its region offset places the others).
  if (c.kind == LayoutKind::kPageUnified) b.planes = c.interleaved_planes, b.groups = c.head_groups;
  b.layers = c.layers;
  b.rows = c.tokens;
  b.page_size = c.page_size;
  b.heads = c.heads;
  b.dim = c.head_bytes;
  return testing::SeedOffset(b, /*kv=*/0, row, layer, head);
}

inline PoolSpec BaseSpec(PoolKind kind, LayoutKind layout, uint32_t ps, uint32_t layers,
                         uint64_t size_tokens, DType dtype = DType::kBf16) {
  PoolSpec s;
  s.kind = kind;
  s.layout = layout;
  s.dtype = dtype;
  s.page_size = ps;
  s.layer_num = layers;
  s.size_tokens = size_tokens;
  return s;
}
inline PoolSpec MhaSpec(LayoutKind layout, uint32_t ps = 3) {
  PoolSpec s = BaseSpec(PoolKind::kMha, layout, ps, 3, 12 * ps);
  s.head_num = 2;
  s.head_dim = 5;
  return s;
}
inline PoolSpec MlaSpec(LayoutKind layout, uint32_t ps = 5) {
  PoolSpec s = BaseSpec(PoolKind::kMla, layout, ps, 2, 10 * ps);
  s.kv_lora_rank = 7;
  s.qk_rope_head_dim = 2;
  return s;
}
inline PoolSpec V4PagedSpec(LayoutKind layout, uint32_t ps = 3) {
  PoolSpec s = BaseSpec(PoolKind::kV4Paged, layout, ps, 3, 12 * ps, DType::kUint8);
  s.item_bytes = 13;
  return s;
}
inline PoolSpec LogicalSpec(uint32_t ps = 3) {
  return BaseSpec(PoolKind::kLogical, LayoutKind::kLayerFirst, ps, 0, 12 * ps, DType::kUint8);
}
// A follower of the pool named "anchor": its size and page size are the
// anchor's.
inline PoolSpec FollowerSpec(PoolSpec s) {
  s.follows = "anchor";
  s.size_tokens = 0;
  s.page_size = 0;
  return s;
}

struct KindCase {
  std::string name;
  PoolSpec spec;  // follows "anchor" when anchor is set
  std::optional<PoolSpec> anchor;
  uint32_t att_start = 0, att_end = 0;  // the attachment's device layers (0 / 0: the pool's)
};

inline void PrintTo(const KindCase& c, std::ostream* os) { *os << c.name; }

// An emulated device pool for any kind: per component and attached layer,
// rows(c) rows of the component's row bytes, all in one shared-memory file.
class DevicePool {
 public:
  static std::unique_ptr<DevicePool> Create(const std::string& path, const Pool& pool,
                                            uint64_t device_tokens, uint32_t layers) {
    auto d = std::unique_ptr<DevicePool>(new DevicePool);
    d->layers_ = layers;
    d->device_tokens_ = device_tokens;
    uint64_t offset = 48;  // layer buffers need not start at the file's start
    for (const Component& c : pool.components()) {
      d->rows_.push_back(device_tokens / c.row_tokens);
      d->row_bytes_.push_back(c.row_bytes());
      d->names_.push_back(c.name);
      d->offsets_.emplace_back();
      for (uint32_t l = 0; l < layers; ++l) {
        d->offsets_.back().push_back(offset);
        offset += d->rows_.back() * c.row_bytes() + 8;  // a gap the copies must not touch
      }
    }
    absl::StatusOr<std::unique_ptr<ShmRegion>> r = ShmRegion::Create(path, offset);
    if (!r.ok()) return nullptr;
    d->region_ = *std::move(r);
    return d;
  }
  // Every component by name.
  AttachRequest Request(uint32_t start = 0, uint32_t end = 0) const {
    AttachRequest req;
    req.device_size_tokens = device_tokens_;
    req.start_layer = start;
    req.end_layer = end;
    for (size_t c = 0; c < names_.size(); ++c) req.named.push_back(Buffers(c));
    return req;
  }
  ComponentBuffers Buffers(size_t c) const {
    ComponentBuffers b;
    b.name = names_[c];
    for (uint64_t off : offsets_[c]) {
      b.layers.push_back({DeviceBufferRef::Kind::kShm, region_->path(), "", "", off});
    }
    return b;
  }
  uint8_t* Row(size_t c, uint32_t layer, uint64_t row) const {
    return region_->data() + offsets_[c][layer] + row * row_bytes_[c];
  }
  uint8_t* data() const { return region_->data(); }
  uint64_t size() const { return region_->size(); }
  uint64_t offset(size_t c, uint32_t layer) const { return offsets_[c][layer]; }

 private:
  DevicePool() = default;
  std::unique_ptr<ShmRegion> region_;
  uint32_t layers_ = 0;
  uint64_t device_tokens_ = 0;
  std::vector<uint64_t> rows_, row_bytes_;
  std::vector<std::string> names_;
  std::vector<std::vector<uint64_t>> offsets_;  // [component][attached layer]
};

// A registry and a manager on the host engine, in a private directory.
class KindFixture {
 public:
  KindFixture() {
    registry_ = std::make_unique<PoolRegistry>(RoomyRegistryOptions(dir_.path()));
    HostEngineOptions e;
    e.shm_dir = dir_.path();
    e.helper_threads = 2;
    e.min_split_bytes = 64;  // split layers over threads, cutting inside runs
    manager_ = std::make_unique<TransferManager>(std::make_unique<HostEngine>(e));
  }
  ~KindFixture() {
    manager_.reset();
    registry_.reset();
  }
  absl::StatusOr<std::shared_ptr<Pool>> Create(const KindCase& c) {
    if (c.anchor.has_value()) {
      absl::StatusOr<std::shared_ptr<Pool>> anchor = registry_->Create("anchor", *c.anchor);
      if (!anchor.ok()) return anchor.status();
    }
    return registry_->Create("p", c.spec);
  }
  // Runs a transfer to the end; its final status.
  TicketStatus Run(const std::string& att, Direction d, const std::vector<int64_t>& host,
                   const std::vector<int64_t>& device) {
    absl::StatusOr<std::shared_ptr<Ticket>> t = manager_->Submit({}, att, d, host, device);
    EXPECT_TRUE(t.ok()) << t.status();
    if (!t.ok()) return TicketStatus{};
    EXPECT_TRUE((*t)->WaitUntil(absl::Now() + absl::Seconds(30)));
    return (*t)->Snapshot();
  }
  void ExpectNoTickets() {
    const TransferCounters c = manager_->counters();
    EXPECT_EQ(c.tickets_in_flight + c.tickets_done + c.tickets_failed, 0u);
    EXPECT_EQ(manager_->FindTicket({}, 1).status().code(), absl::StatusCode::kNotFound);
  }

  ShmDir dir_;
  std::unique_ptr<PoolRegistry> registry_;
  std::unique_ptr<TransferManager> manager_;
};

// Host bytes of every region, for before / after comparisons.
inline std::vector<std::vector<uint8_t>> HostBytes(const Pool& pool) {
  std::vector<std::vector<uint8_t>> out;
  for (size_t r = 0; r < pool.region_count(); ++r) {
    const uint8_t* base = pool.region_base(r);
    out.emplace_back(base, base + pool.region_bytes(r));
  }
  return out;
}

// Slot pairs for a transfer of `pages` whole pages (shuffled, so runs form
// and break), or of `tokens` single slots.
std::pair<std::vector<int64_t>, std::vector<int64_t>> PickPairs(std::mt19937_64& rng,
                                                                bool whole_pages, uint64_t ps,
                                                                uint64_t host_tokens,
                                                                uint64_t device_tokens,
                                                                uint64_t n) {
  if (!whole_pages) return RandomPairs(rng, host_tokens, device_tokens, n);
  auto pages = [&rng](uint64_t count) {
    std::vector<int64_t> p(count);
    for (uint64_t i = 0; i < count; ++i) p[i] = static_cast<int64_t>(i);
    std::shuffle(p.begin(), p.end(), rng);
    return p;
  };
  std::vector<int64_t> hp = pages(host_tokens / ps), dp = pages(device_tokens / ps);
  const uint64_t np = std::min<uint64_t>({n / ps, hp.size(), dp.size()});
  std::vector<int64_t> host, device;
  for (uint64_t k = 0; k < np; ++k) {
    for (uint64_t j = 0; j < ps; ++j) {
      host.push_back(hp[k] * static_cast<int64_t>(ps) + static_cast<int64_t>(j));
      device.push_back(dp[k] * static_cast<int64_t>(ps) + static_cast<int64_t>(j));
    }
  }
  return {host, device};
}

// The reference copy of one transfer: one head of one row of one layer at a
// time, at SeedOffset on the host and row x row_bytes + head x head_bytes on
// the device; a page-row component moves the page row of each page once.
// `host` holds each region's bytes; `device(c, attached layer)` a layer
// buffer's base; `host_layer(a)` the host layer of attached layer a or -1.
template <typename DeviceFn, typename LayerFn>
inline void SeedCopy(const Pool& pool, std::vector<std::vector<uint8_t>>& host, DeviceFn&& device,
                     uint32_t attached, LayerFn&& host_layer, const std::vector<int64_t>& host_idx,
                     const std::vector<int64_t>& dev_idx, bool backup) {
  for (size_t c = 0; c < pool.components().size(); ++c) {
    const Component& comp = pool.components()[c];
    const KvLayout& shape = comp.layout;
    for (uint32_t a = 0; a < attached; ++a) {
      const int64_t l = host_layer(a);
      if (l < 0) continue;
      for (size_t i = 0; i < host_idx.size(); ++i) {
        if (static_cast<uint64_t>(host_idx[i]) % comp.row_tokens != 0) continue;
        const uint64_t hrow = static_cast<uint64_t>(host_idx[i]) / comp.row_tokens;
        const uint64_t drow = static_cast<uint64_t>(dev_idx[i]) / comp.row_tokens;
        for (uint64_t h = 0; h < shape.heads; ++h) {
          uint8_t* hp = host[comp.region].data() + comp.region_offset +
                        SeedOffset(shape, hrow, static_cast<uint64_t>(l), h);
          uint8_t* dp = device(c, a) + drow * shape.heads * shape.head_bytes + h * shape.head_bytes;
          if (backup) {
            std::memcpy(hp, dp, shape.head_bytes);
          } else {
            std::memcpy(dp, hp, shape.head_bytes);
          }
        }
      }
    }
  }
}

// A DSA_INDEXER following an MLA pool: page-row rows, whole pages only.
class PageRowTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_FALSE(f_.dir_.path().empty());
    PoolSpec s = BaseSpec(PoolKind::kDsaIndexer, LayoutKind::kPageFirst, 0, 2, 0, DType::kUint8);
    s.index_head_dim = 16;
    s.index_quant_block_size = 8;
    absl::StatusOr<std::shared_ptr<Pool>> p =
        f_.Create({"indexer", FollowerSpec(s), MlaSpec(LayoutKind::kLayerFirst, 4)});
    ASSERT_TRUE(p.ok()) << p.status();
    pool_ = *p;
    ASSERT_EQ(pool_->components().size(), 1u);
    ASSERT_EQ(pool_->components()[0].row_tokens, 4u);
    dev_ = DevicePool::Create(f_.dir_.path() + "/device", *pool_, kDeviceTokens, 2);
    ASSERT_NE(dev_, nullptr);
    std::mt19937_64 rng(3);
    std::vector<uint8_t> bytes = RandomBytes(rng, dev_->size());
    std::memcpy(dev_->data(), bytes.data(), bytes.size());
  }
  std::string DeviceBytes() const {
    return std::string(reinterpret_cast<const char*>(dev_->data()), dev_->size());
  }

  static constexpr uint64_t kDeviceTokens = 32;  // 8 device pages
  KindFixture f_;
  std::shared_ptr<Pool> pool_;
  std::unique_ptr<DevicePool> dev_;
};

// ---------------------------------------------------------------------------
// Pool groups through the manager and the host engine: per model layer, every
// entry with rows copies the device layer its layer_map names.

// One entry of a group under test: its pool, an emulated device pool over
// its attached device layers [att_start, att_start + layers) and its layer
// map.
struct Member {
  std::string entry;
  std::shared_ptr<Pool> pool;
  std::unique_ptr<DevicePool> dev;
  uint32_t att_start = 0;
  uint32_t attached = 0;
  std::vector<int32_t> map;

  // Host layer of attached layer `a` when some model layer maps its device
  // layer, else -1: what a group transfer touches, written from the map.
  int64_t MappedHostLayer(uint32_t a) const {
    const int32_t d = static_cast<int32_t>(att_start + a);
    if (std::find(map.begin(), map.end(), d) == map.end()) return -1;
    return d - static_cast<int32_t>(pool->start_layer());
  }
  uint32_t mapped_layers() const {
    uint32_t n = 0;
    for (int32_t d : map) n += d >= 0 ? 1 : 0;
    return n;
  }
  std::vector<uint8_t> DeviceBytes() const {
    return std::vector<uint8_t>(dev->data(), dev->data() + dev->size());
  }
  // The host and device images after moving rows host[i] <-> device[i] of
  // the mapped layers, from `host0` / `device0`.
  void Expect(bool backup, const std::vector<int64_t>& host, const std::vector<int64_t>& device,
              std::vector<std::vector<uint8_t>>* host0, std::vector<uint8_t>* device0) const {
    SeedCopy(
        *pool, *host0, [&](size_t c, uint32_t a) { return device0->data() + dev->offset(c, a); },
        attached, [this](uint32_t a) { return MappedHostLayer(a); }, host, device, backup);
  }
};

// Allocates `tokens` slots of `pool` (whole pages); the slots, page by page.
inline std::vector<int64_t> AllocSlots(Pool& pool, uint64_t tokens) {
  absl::StatusOr<std::vector<uint64_t>> pages = pool.AllocPages(tokens);
  EXPECT_TRUE(pages.ok()) << pages.status();
  if (!pages.ok()) return {};
  const uint64_t ps = pool.allocator().page_size();
  std::vector<int64_t> slots;
  for (uint64_t page : *pages) {
    for (uint64_t j = 0; j < ps; ++j) slots.push_back(static_cast<int64_t>(page * ps + j));
  }
  return slots;
}

class GroupTest : public ::testing::Test {
 protected:
  // attn: MHA PAGE_FIRST holding device layers [1, 4), ps 3, rows of
  // 2 heads x 5 x bf16 = 20 bytes for K and for V. ssm: MAMBA with a
  // temporal state of 2 x 3 fp32 (24 bytes) and conv states of 5 and 2 x 3
  // bf16 (10 and 12 bytes), 2 layers. The group has 4 model layers:
  // kv = [3, -1, 1, -1] (attn's device layer 2 unmapped), ssm = [-1, 1, -1, 0].
  static constexpr uint64_t kKvTokenBytes = 2 * 2 * 5 * 2;
  static constexpr uint64_t kSsmTokenBytes = 2 * 3 * 4 + 5 * 2 + 2 * 3 * 2;

  void SetUp() override {
    ASSERT_FALSE(f_.dir_.path().empty());
    PoolSpec attn = BaseSpec(PoolKind::kMha, LayoutKind::kPageFirst, 3, 3, 36);
    attn.head_num = 2;
    attn.head_dim = 5;
    attn.start_layer = 1;
    PoolSpec ssm = BaseSpec(PoolKind::kMamba, LayoutKind::kPageFirstDirect, 1, 2, 20);
    ssm.mamba.temporal = {2, 3};
    ssm.mamba.temporal_dtype = DType::kFp32;
    ssm.mamba.conv = {{5}, {2, 3}};
    absl::StatusOr<std::shared_ptr<Pool>> a = f_.registry_->Create("attn", attn);
    absl::StatusOr<std::shared_ptr<Pool>> m = f_.registry_->Create("ssm", ssm);
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(m.ok()) << m.status();
    kv_ = Make("kv", *a, 12, 1, 3, {3, -1, 1, -1});
    ssm_ = Make("ssm", *m, 8, 0, 2, {-1, 1, -1, 0});
    ASSERT_NE(kv_.dev, nullptr);
    ASSERT_NE(ssm_.dev, nullptr);
    absl::StatusOr<std::shared_ptr<PoolGroup>> g = f_.registry_->CreateGroup(
        "hybrid", 4, {{"kv", "attn", kv_.map, true}, {"ssm", "ssm", ssm_.map, false}});
    ASSERT_TRUE(g.ok()) << g.status();
    group_ = *g;
    std::mt19937_64 rng(17);
    Scramble(rng);
  }

  Member Make(const std::string& entry, std::shared_ptr<Pool> pool, uint64_t device_tokens,
              uint32_t att_start, uint32_t attached, std::vector<int32_t> map) {
    Member m;
    m.entry = entry;
    m.dev = DevicePool::Create(absl::StrCat(f_.dir_.path(), "/device-", entry, "-", ++devices_),
                               *pool, device_tokens, attached);
    m.pool = std::move(pool);
    m.att_start = att_start;
    m.attached = attached;
    m.map = std::move(map);
    return m;
  }
  // Random non-zero bytes in every host pool and device pool.
  void Scramble(std::mt19937_64& rng) {
    for (Member* m : {&kv_, &ssm_}) {
      for (size_t c = 0; c < m->pool->components().size(); ++c) {
        std::vector<uint8_t> bytes = RandomBytes(rng, m->pool->components()[c].bytes());
        for (uint8_t& b : bytes) b |= 1;
        std::memcpy(m->pool->component_base(c), bytes.data(), bytes.size());
      }
      std::vector<uint8_t> d = RandomBytes(rng, m->dev->size());
      for (uint8_t& b : d) b |= 1;
      std::memcpy(m->dev->data(), d.data(), d.size());
    }
  }
  AttachRequest GroupRequest(const Member& kv, const Member& ssm) const {
    AttachRequest req;
    req.entries.push_back({kv.entry, kv.dev->Request()});
    req.entries.push_back({ssm.entry, ssm.dev->Request()});
    return req;
  }
  TicketStatus Run(const std::string& att, Direction d, const std::vector<int64_t>& host,
                   const std::vector<int64_t>& device, const std::vector<EntryRows>& others) {
    absl::StatusOr<std::shared_ptr<Ticket>> t =
        f_.manager_->Submit({}, att, d, host, device, "", others);
    EXPECT_TRUE(t.ok()) << t.status();
    if (!t.ok()) return TicketStatus{};
    EXPECT_TRUE((*t)->WaitUntil(absl::Now() + absl::Seconds(30)));
    return (*t)->Snapshot();
  }
  std::vector<int64_t> Alloc(Pool& pool, uint64_t tokens) { return AllocSlots(pool, tokens); }

  KindFixture f_;
  int devices_ = 0;
  Member kv_, ssm_;
  std::shared_ptr<PoolGroup> group_;
};

}  // namespace kvhost

#endif  // KVHOST_TESTS_TRANSFER_MANAGER_FIXTURES_H_
