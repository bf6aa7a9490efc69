// Integration tests of kvhostd driven through kvhost::Client: pools and their
// sizing, the error contract of every RPC, the allocator, page metadata,
// byte-exact transfers for every kind x layout, tickets, and the daemon's
// lifecycle (SIGTERM drain, --help, bad flags).
//
// Each test runs its own kvhostd (TestDaemon) on a private unix socket and a
// private shm directory. Host-buffer offsets are computed here from the seeds'
// formulas (SEED_INVENTORY.md §2 and §5), independently of kernels/kvhost/
// layout.h, so a wrong stride in the daemon cannot hide behind a shared one.
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "api_test_util.h"
#include "daemon_fixture.h"
#include "gtest/gtest.h"
#include "kvhost/client.h"

namespace kvhost {
namespace {

namespace fs = std::filesystem;
using ::kvhost::testing::TestDaemon;

// Every wait in these tests is bounded, so a hung daemon fails a test instead
// of stalling the suite.
constexpr absl::Duration kWait = absl::Seconds(30);

using ::kvhost::testing::Combo;
using ::kvhost::testing::ComboName;
using ::kvhost::testing::Dims;
using ::kvhost::testing::ElemBytes;
using ::kvhost::testing::FillRandomNonZero;
using ::kvhost::testing::Geo;
using ::kvhost::testing::GeoOf;
using ::kvhost::testing::IsError;
using ::kvhost::testing::kCombos;
using ::kvhost::testing::MakeSpec;
using ::kvhost::testing::MappedFile;
using ::kvhost::testing::OtherRows;
using ::kvhost::testing::PageSlots;
using ::kvhost::testing::Range;
using ::kvhost::testing::SourceRows;
using ::kvhost::testing::StatusOf;

v1::PoolSpec MhaSpec(uint32_t page_size, uint64_t size_tokens, v1::Layout layout = v1::PAGE_FIRST) {
  return MakeSpec(v1::MHA, layout, page_size, size_tokens);
}

// A host buffer's geometry in the seeds' terms: S tokens, L layers, ps page
// size, H heads (1 for MLA), Db bytes per head (D x dtype size; MLA: C x b).
struct Seg {
  uint64_t offset, length;
  bool operator==(const Seg& o) const { return offset == o.offset && length == o.length; }
};

// SEED_INVENTORY §5, get_page_buffer_meta: LAYER_FIRST per page per layer K
// then V at i0*H*D*b + l*S*H*D*b (+V_OFF), ps*H*D*b long; page-major layouts
// per page K then V at i0*L*H*D*b (+V_OFF), L*ps*H*D*b long. PAGE_UNIFIED
// (sglang's page_unified, not in the seeds): per page, per head group g, the
// group's (L, 2, ps, H / G, D) block of the page's (G, L, 2, ps, H / G, D).
std::vector<Seg> SeedPageBufferMeta(const Geo& g, const std::vector<int64_t>& indices) {
  std::vector<Seg> out;
  for (size_t i = 0; i < indices.size(); i += g.ps) {
    const uint64_t i0 = static_cast<uint64_t>(indices[i]);
    if (g.layout == v1::PAGE_UNIFIED) {
      const uint64_t group = g.L * g.planes() * g.ps * (g.H / g.G) * g.Db;
      for (uint64_t h = 0; h < g.G; ++h) out.push_back({(i0 / g.ps * g.G + h) * group, group});
    } else if (g.layout == v1::LAYER_FIRST) {
      for (uint64_t l = 0; l < g.L; ++l) {
        for (uint64_t kv = 0; kv < g.planes(); ++kv) {
          out.push_back(
              {kv * g.v_off() + i0 * g.H * g.Db + l * g.S * g.H * g.Db, g.ps * g.H * g.Db});
        }
      }
    } else {
      for (uint64_t kv = 0; kv < g.planes(); ++kv) {
        out.push_back({kv * g.v_off() + i0 * g.L * g.H * g.Db, g.L * g.ps * g.H * g.Db});
      }
    }
  }
  return out;
}

std::vector<std::string> RegionFiles(const std::string& dir) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (absl::StartsWith(name, "kvhost.")) out.push_back(entry.path().string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::string Describe(const std::vector<v1::Pool>& pools) {
  std::string out;
  for (const v1::Pool& p : pools) absl::StrAppend(&out, p.DebugString(), "\n");
  return out;
}

// ---------------------------------------------------------------------------
// Fixture: one daemon per test (testing::WithDaemon), and the pools as they
// are now.

template <typename Base>
class WithDaemon : public testing::WithDaemon<Base> {
 protected:
  std::string PoolsNow() {
    absl::StatusOr<std::vector<v1::Pool>> pools = this->client().ListPools();
    EXPECT_TRUE(pools.ok()) << pools.status();
    return pools.ok() ? Describe(*pools) : "";
  }
  uint64_t Available(const std::string& pool) {
    absl::StatusOr<v1::Pool> p = this->client().GetPool(pool);
    EXPECT_TRUE(p.ok()) << p.status();
    return p.ok() ? p->available_tokens() : ~uint64_t{0};
  }
};

using DaemonTest = WithDaemon<::testing::Test>;

// ===========================================================================
// 1. Pools.

using PoolTest = DaemonTest;

TEST_F(PoolTest, CreateGetListDeleteEveryKindAndLayout) {
  std::vector<v1::Pool> created;
  const std::string shm = fs::canonical(shm_dir()).string();
  for (const Combo& c : kCombos) {
    SCOPED_TRACE(ComboName(c));
    const std::string name = ComboName(c);
    const v1::PoolSpec spec = MakeSpec(c.kind, c.layout, 16, 100);
    absl::StatusOr<v1::Pool> pool = client().CreatePool(name, spec);
    ASSERT_TRUE(pool.ok()) << pool.status();
    const Geo g = GeoOf(*pool);
    EXPECT_EQ(pool->name(), name);
    EXPECT_EQ(pool->spec().DebugString(), spec.DebugString());
    EXPECT_EQ(pool->size_tokens(), 112u) << "100 tokens round up to 7 pages of 16, no extra page";
    EXPECT_EQ(pool->page_num(), 7u);
    EXPECT_EQ(pool->available_tokens(), 112u);
    const uint64_t bpt = c.kind == v1::MHA ? 2u * 3 * 2 * 8 * 2 : 3u * (12 + 4) * 2;
    EXPECT_EQ(pool->bytes_per_token(), bpt);
    EXPECT_EQ(g.bytes_per_token(), bpt);
    EXPECT_EQ(pool->bytes(), 112 * bpt);
    EXPECT_EQ(pool->attachments(), 0u);
    EXPECT_EQ(pool->backend(), "host");
    ASSERT_EQ(pool->region_paths_size(), 1);
    const std::string path = pool->region_paths(0);
    ASSERT_TRUE(fs::exists(path)) << path;
    EXPECT_EQ(fs::canonical(path).parent_path().string(), shm) << path << " not in the shm dir";
    EXPECT_EQ(fs::file_size(path), pool->bytes()) << path;

    absl::StatusOr<v1::Pool> got = client().GetPool(name);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->DebugString(), pool->DebugString());
    created.push_back(*pool);
  }

  absl::StatusOr<std::vector<v1::Pool>> list = client().ListPools();
  ASSERT_TRUE(list.ok()) << list.status();
  std::vector<v1::Pool> by_name = created;
  std::sort(by_name.begin(), by_name.end(),
            [](const v1::Pool& a, const v1::Pool& b) { return a.name() < b.name(); });
  EXPECT_EQ(Describe(*list), Describe(by_name)) << "ListPools: every pool, ordered by name";
  EXPECT_EQ(RegionFiles(shm_dir()).size(), created.size());

  size_t left = created.size();
  for (const v1::Pool& pool : created) {
    SCOPED_TRACE(pool.name());
    absl::StatusOr<uint64_t> released = client().DeletePool(pool.name());
    ASSERT_TRUE(released.ok()) << released.status();
    EXPECT_EQ(*released, pool.bytes());
    EXPECT_FALSE(fs::exists(pool.region_paths(0))) << "region file stays after DeletePool";
    EXPECT_ERROR(client().GetPool(pool.name()), kNotFound, pool.name());
    absl::StatusOr<std::vector<v1::Pool>> now = client().ListPools();
    ASSERT_TRUE(now.ok());
    EXPECT_EQ(now->size(), --left);
  }
  EXPECT_TRUE(RegionFiles(shm_dir()).empty());
  // The name is free again.
  EXPECT_TRUE(client().CreatePool(created[0].name(), created[0].spec()).ok());
}

TEST_F(PoolTest, SizingRules) {
  struct Case {
    std::string name;
    v1::PoolSpec spec;
    uint64_t want_tokens;
  };
  std::vector<Case> cases;
  // bytes per token of the default MHA spec: 2 x L3 x H2 x D8 x 2 B = 192.
  constexpr uint64_t kBpt = 192;
  auto mha = [](uint32_t ps) { return MakeSpec(v1::MHA, v1::PAGE_FIRST, ps, 0); };
  // Rule 1: size_tokens, rounded up to whole pages, nothing more.
  cases.push_back({"t100-ps16", MhaSpec(16, 100), 112});
  cases.push_back({"t96-ps16", MhaSpec(16, 96), 96});
  cases.push_back({"t1-ps16", MhaSpec(16, 1), 16});
  cases.push_back({"t5-ps1", MhaSpec(1, 5), 5});
  cases.push_back({"t7-ps3", MhaSpec(3, 7), 9});
  cases.push_back({"t9-ps3", MhaSpec(3, 9), 9});
  {  // Rule 1 wins over rule 2.
    v1::PoolSpec s = MhaSpec(16, 16);
    s.set_size_bytes(1000 * kBpt);
    cases.push_back({"tokens-over-bytes", s, 16});
  }
  {  // Rule 2: floor(size_bytes / bytes per token), then whole pages.
    v1::PoolSpec s = mha(16);
    s.set_size_bytes(50 * kBpt + kBpt - 1);
    cases.push_back({"bytes-50.99tok-ps16", s, 64});
    s.set_size_bytes(48 * kBpt);
    cases.push_back({"bytes-48tok-ps16", s, 48});
    v1::PoolSpec s1 = mha(1);
    s1.set_size_bytes(50 * kBpt + kBpt - 1);
    cases.push_back({"bytes-50.99tok-ps1", s1, 50});
  }
  {  // Rule 2 wins over rule 3.
    v1::PoolSpec s = mha(1);
    s.set_size_bytes(10 * kBpt);
    s.set_host_to_device_ratio(4.0);
    s.set_device_size_tokens(100);
    cases.push_back({"bytes-over-ratio", s, 10});
  }
  {  // Rule 3: floor(device_size_tokens x ratio), then whole pages.
    v1::PoolSpec s = mha(16);
    s.set_host_to_device_ratio(2.0);
    s.set_device_size_tokens(40);
    cases.push_back({"ratio-2x40-ps16", s, 80});
    s.set_host_to_device_ratio(1.5);
    s.set_device_size_tokens(33);  // 49.5 -> 49 -> 64
    cases.push_back({"ratio-1.5x33-ps16", s, 64});
    v1::PoolSpec s1 = mha(1);
    s1.set_host_to_device_ratio(0.5);
    s1.set_device_size_tokens(7);  // 3.5 -> 3
    cases.push_back({"ratio-0.5x7-ps1", s1, 3});
  }
  {  // MLA by bytes: 3 layers x (12 + 4) x 2 B = 96 bytes per token.
    v1::PoolSpec s = MakeSpec(v1::MLA, v1::PAGE_FIRST_DIRECT, 4, 0);
    s.set_size_bytes(96 * 10);
    cases.push_back({"mla-bytes-10tok-ps4", s, 12});
  }
  {  // v_head_dim equal to head_dim is accepted.
    v1::PoolSpec s = MhaSpec(1, 4);
    s.set_v_head_dim(s.head_dim());
    cases.push_back({"v-head-dim-equal", s, 4});
  }
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    absl::StatusOr<v1::Pool> pool = client().CreatePool(c.name, c.spec);
    ASSERT_TRUE(pool.ok()) << pool.status();
    EXPECT_EQ(pool->size_tokens(), c.want_tokens);
    EXPECT_EQ(pool->page_num(), c.want_tokens / c.spec.page_size());
    EXPECT_EQ(pool->available_tokens(), c.want_tokens);
    EXPECT_EQ(pool->bytes(), c.want_tokens * pool->bytes_per_token());
    ASSERT_EQ(pool->region_paths_size(), 1);
    EXPECT_EQ(fs::file_size(pool->region_paths(0)), pool->bytes());
  }
}

// ===========================================================================
// 2. Errors: code, a message naming the field / value, nothing changed.

using PoolErrorTest = DaemonTest;

TEST_F(PoolErrorTest, BadSpecIsInvalidArgumentNamingTheField) {
  ASSERT_TRUE(client().CreatePool("keep", MhaSpec(4, 64)).ok());
  const std::string before = PoolsNow();
  const std::vector<std::string> files_before = RegionFiles(shm_dir());

  struct Case {
    std::string what;
    v1::PoolSpec spec;
    std::vector<std::string> needles;
    std::string name = "bad";
  };
  std::vector<Case> cases;
  auto with = [](auto mutate, v1::PoolSpec s = MhaSpec(4, 64)) {
    mutate(&s);
    return s;
  };
  cases.push_back(
      {"page_size 0", with([](v1::PoolSpec* s) { s->set_page_size(0); }), {"page_size"}});
  cases.push_back(
      {"layer_num 0", with([](v1::PoolSpec* s) { s->set_layer_num(0); }), {"layer_num"}});
  cases.push_back({"head_num 0", with([](v1::PoolSpec* s) { s->set_head_num(0); }), {"head_num"}});
  cases.push_back({"head_dim 0", with([](v1::PoolSpec* s) { s->set_head_dim(0); }), {"head_dim"}});
  cases.push_back({"kind 99",
                   with([](v1::PoolSpec* s) { s->set_kind(static_cast<v1::PoolKind>(99)); }),
                   {"kind", "99"}});
  cases.push_back({"kind unspecified",
                   with([](v1::PoolSpec* s) { s->set_kind(v1::POOL_KIND_UNSPECIFIED); }),
                   {"kind"}});
  cases.push_back({"layout unspecified",
                   with([](v1::PoolSpec* s) { s->set_layout(v1::LAYOUT_UNSPECIFIED); }),
                   {"layout", "LAYOUT_UNSPECIFIED"}});
  cases.push_back({"layout 99",
                   with([](v1::PoolSpec* s) { s->set_layout(static_cast<v1::Layout>(99)); }),
                   {"layout", "99"}});
  cases.push_back({"dtype unspecified",
                   with([](v1::PoolSpec* s) { s->set_dtype(v1::DTYPE_UNSPECIFIED); }),
                   {"dtype", "DTYPE_UNSPECIFIED"}});
  cases.push_back({"dtype 42",
                   with([](v1::PoolSpec* s) { s->set_dtype(static_cast<v1::DType>(42)); }),
                   {"dtype", "42"}});
  cases.push_back(
      {"MLA with PAGE_HEAD", MakeSpec(v1::MLA, v1::PAGE_HEAD, 4, 64), {"layout", "PAGE_HEAD"}});
  cases.push_back({"MLA without a row",
                   with(
                       [](v1::PoolSpec* s) {
                         s->set_kv_lora_rank(0);
                         s->set_qk_rope_head_dim(0);
                       },
                       MakeSpec(v1::MLA, v1::PAGE_FIRST, 4, 64)),
                   {"kv_lora_rank"}});
  cases.push_back({"v_head_dim != head_dim",
                   with([](v1::PoolSpec* s) { s->set_v_head_dim(s->head_dim() + 4); }),
                   {"v_head_dim", "12"}});
  cases.push_back(
      {"no size", with([](v1::PoolSpec* s) { s->clear_size_tokens(); }), {"size_tokens"}});
  cases.push_back({"ratio without device size",
                   with([](v1::PoolSpec* s) {
                     s->clear_size_tokens();
                     s->set_host_to_device_ratio(2.0);
                   }),
                   {"size"}});
  cases.push_back({"size_bytes below one token",
                   with([](v1::PoolSpec* s) {
                     s->clear_size_tokens();
                     s->set_size_bytes(100);  // < 192 bytes per token
                   }),
                   {"size_bytes"}});
  cases.push_back({"negative ratio",
                   with([](v1::PoolSpec* s) { s->set_host_to_device_ratio(-1.0); }),
                   {"host_to_device_ratio"}});
  cases.push_back({"name a/b", MhaSpec(4, 64), {"name", "a/b"}, "a/b"});
  cases.push_back({"empty name", MhaSpec(4, 64), {"name"}, ""});
  cases.push_back({"name of 65 chars", MhaSpec(4, 64), {"name"}, std::string(65, 'x')});
  cases.push_back({"name with space", MhaSpec(4, 64), {"name", "a b"}, "a b"});
  cases.push_back({"name ..", MhaSpec(4, 64), {"name"}, ".."});

  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    EXPECT_ERROR(client().CreatePool(c.name, c.spec), kInvalidArgument, c.needles);
  }
  EXPECT_EQ(PoolsNow(), before);
  EXPECT_EQ(RegionFiles(shm_dir()), files_before);
  // A 64-character name is the longest allowed.
  EXPECT_TRUE(client().CreatePool(std::string(64, 'y'), MhaSpec(4, 4)).ok());
}

TEST_F(PoolErrorTest, DuplicateNameIsAlreadyExists) {
  absl::StatusOr<v1::Pool> first = client().CreatePool("dup", MhaSpec(4, 64));
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_TRUE(client().Alloc("dup", 8).ok());
  const std::string before = PoolsNow();
  EXPECT_ERROR(client().CreatePool("dup", MakeSpec(v1::MLA, v1::LAYER_FIRST, 1, 10)),
               kAlreadyExists, "dup");
  EXPECT_ERROR(client().CreatePool("dup", MhaSpec(4, 64)), kAlreadyExists, "dup");
  EXPECT_EQ(PoolsNow(), before);
  EXPECT_EQ(RegionFiles(shm_dir()).size(), 1u);
}

TEST_F(PoolErrorTest, UnknownPoolIsNotFound) {
  absl::StatusOr<v1::Pool> real = client().CreatePool("real", MhaSpec(4, 64));
  ASSERT_TRUE(real.ok()) << real.status();
  absl::StatusOr<std::unique_ptr<ShmDevicePool>> dev = ShmDevicePool::Create(*real, 8, shm_dir());
  ASSERT_TRUE(dev.ok()) << dev.status();
  const std::string before = PoolsNow();

  EXPECT_ERROR(client().GetPool("nope"), kNotFound, "nope");
  EXPECT_ERROR(client().Alloc("nope", 4), kNotFound, "nope");
  EXPECT_ERROR(client().Free("nope", Range(0, 4)), kNotFound, "nope");
  EXPECT_ERROR(client().GetPageBufferMeta("nope", Range(0, 4)), kNotFound, "nope");
  EXPECT_ERROR(client().DeletePool("nope"), kNotFound, "nope");
  EXPECT_ERROR(client().AttachDevice((*dev)->MakeAttachRequest("nope")), kNotFound, "nope");
  EXPECT_ERROR(client().DetachDevice("att-nope"), kNotFound, "att-nope");

  EXPECT_EQ(PoolsNow(), before);
}

TEST_F(PoolErrorTest, PoolLargerThanMemoryIsResourceExhausted) {
  ASSERT_TRUE(client().CreatePool("small", MhaSpec(4, 64)).ok());
  const std::string before = PoolsNow();
  v1::PoolSpec spec = MakeSpec(v1::MHA, v1::PAGE_FIRST, 16, 0);
  spec.set_size_bytes(uint64_t{10} * 1000 * 1000 * 1000 * 1000);  // 10 TB
  EXPECT_ERROR(client().CreatePool("huge", spec), kResourceExhausted, "bytes) available", "huge");
  spec.set_size_bytes(0);
  spec.set_size_tokens(uint64_t{1} << 40);  // 2^40 tokens x 192 B
  EXPECT_ERROR(client().CreatePool("huge", spec), kResourceExhausted, "bytes) available");
  EXPECT_EQ(PoolsNow(), before);
  EXPECT_EQ(RegionFiles(shm_dir()).size(), 1u);
  EXPECT_ERROR(client().GetPool("huge"), kNotFound, "huge");
}

// Shapes whose byte counts wrap around 64 bits must be refused, not turned
// into a small pool whose layout addresses far beyond its memory (with
// PAGE_HEAD, a one-token backup into such a pool used to crash kvhostd).
TEST_F(PoolErrorTest, ShapesWhoseSizesOverflowAreRefused) {
  const std::string before = PoolsNow();
  struct Case {
    std::string what;
    v1::PoolSpec spec;
  };
  std::vector<Case> cases;
  {  // head_num x head_dim x 4 = 2^64 + 166832.
    v1::PoolSpec s = MakeSpec(v1::MHA, v1::PAGE_HEAD, 1, 1, v1::FP32);
    s.set_layer_num(1);
    s.set_head_num(2147529989u);
    s.set_head_dim(2147437308u);
    cases.push_back({"row bytes wrap", s});
  }
  {  // 2 x layer_num x row bytes = 2^64 + 65536.
    v1::PoolSpec s = MakeSpec(v1::MHA, v1::LAYER_FIRST, 1, 16, v1::UINT8);
    s.set_layer_num(4294901761u);
    s.set_head_num(1);
    s.set_head_dim(2147516416u);
    cases.push_back({"bytes per token wrap", s});
  }
  {  // size_tokens x bytes per token = 2^64 + 166832.
    v1::PoolSpec s = MakeSpec(v1::MLA, v1::PAGE_FIRST, 2147529989u, 0, v1::UINT8);
    s.set_layer_num(1);
    s.set_kv_lora_rank(2147437308u);
    s.set_qk_rope_head_dim(0);
    s.set_size_tokens(uint64_t{4} * 2147529989u);
    cases.push_back({"pool bytes wrap", s});
  }
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    absl::StatusOr<v1::Pool> pool = client().CreatePool("wrap", c.spec);
    EXPECT_TRUE(pool.status().code() == absl::StatusCode::kInvalidArgument ||
                pool.status().code() == absl::StatusCode::kResourceExhausted)
        << pool.status();
    if (pool.ok()) {
      EXPECT_EQ(pool->bytes() / pool->size_tokens(), pool->bytes_per_token())
          << "accepted with wrapped sizes: " << pool->ShortDebugString();
      ASSERT_TRUE(client().DeletePool("wrap").ok());
    }
  }
  EXPECT_EQ(PoolsNow(), before);
  EXPECT_TRUE(RegionFiles(shm_dir()).empty());
}

TEST(MemoryLimitTest, MemoryLimitFlagCapsAllPools) {
  absl::StatusOr<std::unique_ptr<TestDaemon>> d =
      TestDaemon::Start(KVHOSTD_PATH, {"--memory-limit=64M"});
  ASSERT_TRUE(d.ok()) << d.status();
  Client& c = (*d)->client();
  constexpr uint64_t kMiB = uint64_t{1} << 20;
  auto by_bytes = [](uint64_t bytes) {
    v1::PoolSpec s = MakeSpec(v1::MHA, v1::PAGE_FIRST, 1, 0);
    s.set_size_bytes(bytes);
    return s;
  };
  EXPECT_ERROR(c.CreatePool("p100", by_bytes(100 * 1000 * 1000)), kResourceExhausted,
               "(67108864 bytes) available", "p100");
  absl::StatusOr<v1::Pool> p32 = c.CreatePool("p32", by_bytes(32 * kMiB));
  ASSERT_TRUE(p32.ok()) << p32.status();
  EXPECT_LE(p32->bytes(), 32 * kMiB);
  // 32 MiB + 40 MiB > 64 MiB: refused while p32 exists, fine once it is gone.
  EXPECT_ERROR(c.CreatePool("p40", by_bytes(40 * kMiB)), kResourceExhausted,
               "(33554560 bytes) available", "p40");
  absl::StatusOr<std::vector<v1::Pool>> list = c.ListPools();
  ASSERT_TRUE(list.ok());
  EXPECT_EQ(list->size(), 1u);
  ASSERT_TRUE(c.DeletePool("p32").ok());
  absl::StatusOr<v1::Pool> p40 = c.CreatePool("p40", by_bytes(40 * kMiB));
  EXPECT_TRUE(p40.ok()) << p40.status();

  // --memory-reserve: host memory no pool may take.
  absl::StatusOr<std::unique_ptr<TestDaemon>> r =
      TestDaemon::Start(KVHOSTD_PATH, {"--memory-reserve=100T"});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_ERROR((*r)->client().CreatePool("any", by_bytes(kMiB)), kResourceExhausted,
               "0 bytes available", "reserve");
}

using AllocErrorTest = DaemonTest;

TEST_F(AllocErrorTest, BadNumTokensAndExhaustion) {
  ASSERT_TRUE(client().CreatePool("p", MhaSpec(16, 64)).ok());
  EXPECT_ERROR(client().Alloc("p", 0), kInvalidArgument, "num_tokens", "0");
  EXPECT_ERROR(client().Alloc("p", 17), kInvalidArgument, "num_tokens", "17", "16");
  EXPECT_ERROR(client().Alloc("p", 8), kInvalidArgument, "num_tokens", "8");
  EXPECT_ERROR(client().Alloc("p", 80), kResourceExhausted, "80");
  EXPECT_EQ(Available("p"), 64u);
  ASSERT_TRUE(client().Alloc("p", 48).ok());
  EXPECT_ERROR(client().Alloc("p", 32), kResourceExhausted, "32");
  EXPECT_EQ(Available("p"), 16u);
  EXPECT_TRUE(client().Alloc("p", 16).ok());
  EXPECT_ERROR(client().Alloc("p", 16), kResourceExhausted, "16");
  EXPECT_EQ(Available("p"), 0u);
}

// An Alloc whose indices cannot fit in one response (64 MiB) must fail
// without allocating: gRPC refusing to send the response used to leave every
// slot allocated and unknown to the caller.
// (The default --max-indices-per-call refuses such an Alloc first; this
// daemon raises it so that the response size is what refuses it.)
TEST(AllocResponseTest, AllocTooLargeForOneResponseChangesNothing) {
  absl::StatusOr<std::unique_ptr<TestDaemon>> d =
      TestDaemon::Start(KVHOSTD_PATH, {"--max-indices-per-call=20000000"});
  ASSERT_TRUE(d.ok()) << d.status();
  Client& c = (*d)->client();
  auto available = [&c] {
    absl::StatusOr<v1::Pool> p = c.GetPool("p");
    return p.ok() ? p->available_tokens() : 0;
  };
  v1::PoolSpec spec = MakeSpec(v1::MHA, v1::PAGE_FIRST, 1, 17'000'000, v1::UINT8);
  spec.set_layer_num(1);
  spec.set_head_num(1);
  spec.set_head_dim(1);  // 2 bytes per token: 34 MB
  ASSERT_TRUE(c.CreatePool("p", spec).ok());
  absl::StatusOr<std::vector<int64_t>> all = c.Alloc("p", 17'000'000);
  EXPECT_ERROR(all, kResourceExhausted, "num_tokens", "17000000");
  EXPECT_EQ(available(), all.ok() ? 0u : 17'000'000u)
      << "a failed Alloc must allocate nothing: " << all.status();
  absl::StatusOr<std::vector<int64_t>> half = c.Alloc("p", 8'000'000);
  ASSERT_TRUE(half.ok()) << half.status();
  EXPECT_EQ(half->size(), 8'000'000u);
  EXPECT_EQ(available(), 9'000'000u);
}

using FreeErrorTest = DaemonTest;

TEST_F(FreeErrorTest, MalformedListsAndUnallocatedPagesFreeNothing) {
  constexpr uint64_t kPs = 4;
  ASSERT_TRUE(client().CreatePool("p", MhaSpec(kPs, 32)).ok());  // 8 pages
  absl::StatusOr<std::vector<int64_t>> got = client().Alloc("p", 16);
  ASSERT_TRUE(got.ok()) << got.status();
  std::set<uint64_t> allocated;
  for (int64_t s : *got) allocated.insert(static_cast<uint64_t>(s) / kPs);
  ASSERT_EQ(allocated.size(), 4u);
  std::vector<uint64_t> unallocated;
  for (uint64_t p = 0; p < 8; ++p) {
    if (!allocated.count(p)) unallocated.push_back(p);
  }
  const uint64_t a = *allocated.begin();
  const uint64_t b = *std::next(allocated.begin());
  const uint64_t u = unallocated[0];
  const int64_t a0 = static_cast<int64_t>(a * kPs);
  const std::string before = PoolsNow();
  ASSERT_EQ(Available("p"), 16u);

  // Malformed: INVALID_ARGUMENT.
  EXPECT_ERROR(client().Free("p", {a0, a0 + 1, a0 + 2}), kInvalidArgument, "length", "3");
  EXPECT_ERROR(client().Free("p", {a0, a0 + 1, a0 + 3, a0 + 2}), kInvalidArgument,
               absl::StrCat(a0 + 3));
  EXPECT_ERROR(client().Free("p", {a0 + 1, a0 + 2, a0 + 3, a0 + 4}), kInvalidArgument,
               absl::StrCat(a0 + 1), "page");
  EXPECT_ERROR(client().Free("p", {32, 33, 34, 35}), kInvalidArgument, "32", "range");
  EXPECT_ERROR(client().Free("p", {-4, -3, -2, -1}), kInvalidArgument, "-4");
  EXPECT_ERROR(client().Free("p", PageSlots({a, a}, kPs)), kInvalidArgument, absl::StrCat(a0),
               "more than once");
  // A valid allocated page with a malformed one: nothing freed.
  std::vector<int64_t> mixed = PageSlots({a}, kPs);
  for (int64_t s : {32, 33, 34, 35}) mixed.push_back(s);
  EXPECT_ERROR(client().Free("p", mixed), kInvalidArgument, "32");
  EXPECT_EQ(PoolsNow(), before);

  // Well formed but not allocated: FAILED_PRECONDITION, nothing freed.
  EXPECT_ERROR(client().Free("p", PageSlots({u}, kPs)), kFailedPrecondition, absl::StrCat(u * kPs),
               "not allocated");
  EXPECT_ERROR(client().Free("p", PageSlots({a, b, u}, kPs)), kFailedPrecondition,
               absl::StrCat(u * kPs), "not allocated");
  EXPECT_ERROR(client().Free("p", PageSlots({u, a}, kPs)), kFailedPrecondition,
               absl::StrCat(u * kPs));
  EXPECT_EQ(PoolsNow(), before) << "a failed Free must free nothing (all or nothing)";

  // The valid pages are still allocated: freeing them works, once.
  absl::StatusOr<uint64_t> freed = client().Free("p", PageSlots({a, b}, kPs));
  ASSERT_TRUE(freed.ok()) << freed.status();
  EXPECT_EQ(*freed, 2 * kPs);
  EXPECT_EQ(Available("p"), 24u);
  const std::string after_free = PoolsNow();
  EXPECT_ERROR(client().Free("p", PageSlots({a}, kPs)), kFailedPrecondition, absl::StrCat(a0),
               "not allocated");
  EXPECT_ERROR(client().Free("p", PageSlots({b, a}, kPs)), kFailedPrecondition, "not allocated");
  EXPECT_EQ(PoolsNow(), after_free) << "double free changed the pool";
}

using MetaErrorTest = DaemonTest;

TEST_F(MetaErrorTest, BadIndicesAreInvalidArgument) {
  ASSERT_TRUE(client().CreatePool("p", MhaSpec(4, 32, v1::LAYER_FIRST)).ok());
  const std::string before = PoolsNow();
  EXPECT_ERROR(client().GetPageBufferMeta("p", {0, 1, 2}), kInvalidArgument, "length", "3");
  EXPECT_ERROR(client().GetPageBufferMeta("p", {2, 3, 4, 5}), kInvalidArgument, "2");
  EXPECT_ERROR(client().GetPageBufferMeta("p", {0, 1, 3, 2}), kInvalidArgument, "3");
  EXPECT_ERROR(client().GetPageBufferMeta("p", {32, 33, 34, 35}), kInvalidArgument, "32");
  EXPECT_ERROR(client().GetPageBufferMeta("p", {-4, -3, -2, -1}), kInvalidArgument, "-4");
  EXPECT_ERROR(client().GetPageBufferMeta("p", {8, 9, 10, 11, 8, 9, 10, 11}), kInvalidArgument, "8",
               "more than once");
  // Pages need not be allocated.
  EXPECT_TRUE(client().GetPageBufferMeta("p", {28, 29, 30, 31}).ok());
  EXPECT_EQ(PoolsNow(), before);
}

// Transfers and attachments.
class TransferErrorTest : public DaemonTest {
 protected:
  void SetUp() override {
    DaemonTest::SetUp();
    if (HasFatalFailure()) return;
    absl::StatusOr<v1::Pool> pool = client().CreatePool("p", MhaSpec(4, 32));  // 8 pages
    ASSERT_TRUE(pool.ok()) << pool.status();
    pool_ = *pool;
    absl::StatusOr<std::vector<int64_t>> slots = client().Alloc("p", 16);  // slots 0..15
    ASSERT_TRUE(slots.ok()) << slots.status();
    ASSERT_EQ(*slots, Range(0, 16)) << "a fresh allocator hands out pages in order";
    absl::StatusOr<std::unique_ptr<ShmDevicePool>> dev =
        ShmDevicePool::Create(pool_, 16, shm_dir());
    ASSERT_TRUE(dev.ok()) << dev.status();
    dev_ = *std::move(dev);
    std::mt19937 rng(7);
    FillRandomNonZero(dev_->layer(0, 0), dev_->bytes(), rng);
  }

  std::string DeviceBytes() const {
    return std::string(reinterpret_cast<const char*>(dev_->layer(0, 0)), dev_->bytes());
  }
  bool HostAllZero() const {
    std::unique_ptr<MappedFile> host = MappedFile::Open(pool_.region_paths(0));
    if (host == nullptr) return false;
    return std::all_of(host->data(), host->data() + host->size(), [](uint8_t c) { return c == 0; });
  }

  v1::Pool pool_;
  std::unique_ptr<ShmDevicePool> dev_;
};

TEST_F(TransferErrorTest, AttachErrors) {
  const std::string before = PoolsNow();
  const v1::AttachDeviceRequest good = dev_->MakeAttachRequest("p");
  {
    v1::AttachDeviceRequest r = good;
    r.mutable_k_layers()->RemoveLast();
    EXPECT_ERROR(client().AttachDevice(r), kInvalidArgument, "k_layers", "2", "3");
  }
  {
    v1::AttachDeviceRequest r = good;
    *r.add_v_layers() = good.v_layers(0);
    EXPECT_ERROR(client().AttachDevice(r), kInvalidArgument, "v_layers", "4");
  }
  {
    v1::AttachDeviceRequest r = good;
    r.clear_v_layers();
    EXPECT_ERROR(client().AttachDevice(r), kInvalidArgument, "v_layers");
  }
  {
    v1::AttachDeviceRequest r = good;
    r.set_device_size_tokens(0);
    EXPECT_ERROR(client().AttachDevice(r), kInvalidArgument, "device_size_tokens");
  }
  {  // One row more than the file holds: the last layer buffer runs past its end.
    v1::AttachDeviceRequest r = good;
    r.set_device_size_tokens(17);
    EXPECT_ERROR(client().AttachDevice(r), kInvalidArgument, "v_layers[2]", "17 rows");
  }
  {  // Offset beyond the file.
    v1::AttachDeviceRequest r = good;
    r.mutable_k_layers(1)->mutable_shm()->set_offset(dev_->bytes() + 4096);
    EXPECT_ERROR(client().AttachDevice(r), kInvalidArgument, "k_layers[1]", "offset",
                 absl::StrCat(dev_->bytes() + 4096));
  }
  {
    v1::AttachDeviceRequest r = good;
    r.mutable_v_layers(0)->Clear();
    EXPECT_ERROR(client().AttachDevice(r), kInvalidArgument, "v_layers[0]");
  }
  {  // A CUDA IPC buffer on the host backend.
    v1::AttachDeviceRequest r = good;
    v1::CudaIpcBuffer* cuda = r.mutable_k_layers(0)->mutable_cuda();
    cuda->set_ipc_handle(std::string(64, '\1'));
    cuda->set_gpu_uuid("GPU-00000000-0000-0000-0000-000000000000");
    EXPECT_ERROR(client().AttachDevice(r), kFailedPrecondition, "k_layers[0]", "CUDA");
  }
  // A file outside the shm dir, directly, through "..", and through a symlink.
  char tmp_path[] = "/tmp/kvhost-outside-XXXXXX";
  const int fd = ::mkstemp(tmp_path);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::ftruncate(fd, static_cast<off_t>(dev_->bytes())), 0);
  ::close(fd);
  const std::string outside = tmp_path;
  {
    v1::AttachDeviceRequest r = good;
    for (auto& b : *r.mutable_k_layers()) b.mutable_shm()->set_path(outside);
    for (auto& b : *r.mutable_v_layers()) b.mutable_shm()->set_path(outside);
    EXPECT_ERROR(client().AttachDevice(r), kPermissionDenied, outside, "outside");
  }
  {
    const std::string dotdot = absl::StrCat(shm_dir(), "/../../..", outside);
    v1::AttachDeviceRequest r = good;
    r.mutable_k_layers(0)->mutable_shm()->set_path(dotdot);
    EXPECT_ERROR(client().AttachDevice(r), kPermissionDenied, "outside");
  }
  {
    const std::string link = absl::StrCat(shm_dir(), "/link-out");
    ASSERT_EQ(::symlink(outside.c_str(), link.c_str()), 0);
    v1::AttachDeviceRequest r = good;
    r.mutable_v_layers(1)->mutable_shm()->set_path(link);
    EXPECT_ERROR(client().AttachDevice(r), kPermissionDenied, "v_layers[1]", "outside");
    ::unlink(link.c_str());
  }
  {  // A pool region is inside the shm dir but is never a device buffer
     // (it would bypass the pool's owner token), whatever the offset.
    v1::AttachDeviceRequest r = good;
    r.mutable_k_layers(0)->mutable_shm()->set_path(pool_.region_paths(0));
    r.mutable_k_layers(0)->mutable_shm()->set_offset(pool_.bytes());
    EXPECT_ERROR(client().AttachDevice(r), kPermissionDenied, "k_layers[0]",
                 "kvhostd pool region file");
  }
  ::unlink(outside.c_str());

  {  // device_size_tokens x row bytes wrapping to 0: 2^40 rows of 16 MiB. Once
     // accepted for any file, a backup from row 2^40 - 1 crashed kvhostd.
    v1::PoolSpec wide = MakeSpec(v1::MHA, v1::PAGE_FIRST, 1, 1);
    wide.set_layer_num(1);
    wide.set_head_num(1);
    wide.set_head_dim(uint32_t{1} << 23);
    ASSERT_TRUE(client().CreatePool("wide", wide).ok());
    const std::string tiny = absl::StrCat(shm_dir(), "/tiny-device");
    const int tfd = ::open(tiny.c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0600);
    ASSERT_GE(tfd, 0);
    ASSERT_EQ(::ftruncate(tfd, 4096), 0);
    ::close(tfd);
    v1::AttachDeviceRequest r;
    r.set_pool("wide");
    r.set_device_size_tokens(uint64_t{1} << 40);
    r.add_k_layers()->mutable_shm()->set_path(tiny);
    r.add_v_layers()->mutable_shm()->set_path(tiny);
    absl::StatusOr<v1::Attachment> a = client().AttachDevice(r);
    EXPECT_ERROR(a, kInvalidArgument, "device_size_tokens");
    if (a.ok()) {
      ASSERT_TRUE(client().DetachDevice(a->id()).ok());
    }
    ASSERT_TRUE(client().DeletePool("wide").ok());
    ::unlink(tiny.c_str());
  }

  // Nothing leaked: no attachment counted, the pool deletes.
  EXPECT_EQ(PoolsNow(), before);
  absl::StatusOr<v1::Pool> p = client().GetPool("p");
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->attachments(), 0u);
  EXPECT_TRUE(client().DeletePool("p").ok()) << "a failed AttachDevice left an attachment";
}

TEST_F(TransferErrorTest, BadIndexListsChangeNothing) {
  absl::StatusOr<v1::Attachment> att = client().AttachDevice(dev_->MakeAttachRequest("p"));
  ASSERT_TRUE(att.ok()) << att.status();
  const std::string id = att->id();
  EXPECT_FALSE(id.empty());
  EXPECT_EQ(att->pool(), "p");
  EXPECT_EQ(att->device_size_tokens(), 16u);
  EXPECT_EQ(att->backend(), "host");
  const std::string device_before = DeviceBytes();
  const std::string pools_before = PoolsNow();

  for (bool backup : {true, false}) {
    SCOPED_TRACE(backup ? "Backup" : "Load");
    auto submit = [&](std::vector<int64_t> host, std::vector<int64_t> device) {
      return backup ? client().Backup(id, host, device) : client().Load(id, host, device);
    };
    EXPECT_ERROR(submit({0, 1}, {0}), kInvalidArgument, "host_indices", "device_indices", "2", "1");
    EXPECT_ERROR(submit({0}, {16}), kInvalidArgument, "device_indices[0]", "16");
    EXPECT_ERROR(submit({0, 1, 2}, {3, 4, 1000}), kInvalidArgument, "device_indices[2]", "1000");
    EXPECT_ERROR(submit({32}, {0}), kInvalidArgument, "host_indices[0]", "32");
    EXPECT_ERROR(submit({0, 99999}, {0, 1}), kInvalidArgument, "host_indices[1]", "99999");
    EXPECT_ERROR(submit({-1}, {0}), kInvalidArgument, "host_indices[0]", "-1");
    EXPECT_ERROR(submit({0, 1}, {0, -5}), kInvalidArgument, "device_indices[1]", "-5");
    EXPECT_ERROR(submit({20}, {0}), kFailedPrecondition, "20", "not allocated");
    EXPECT_ERROR(submit({0, 1, 2, 16}, {0, 1, 2, 3}), kFailedPrecondition, "16", "not allocated");
    EXPECT_ERROR(
        backup ? client().Backup("att-nope", {0}, {0}) : client().Load("att-nope", {0}, {0}),
        kNotFound, "att-nope");
  }
  // Repeated destinations: host slots for a backup, device rows for a load.
  EXPECT_ERROR(client().Backup(id, {0, 1, 0}, {0, 1, 2}), kInvalidArgument, "host slot", "0");
  EXPECT_ERROR(client().Backup(id, {5, 6, 7, 6}, {9, 3, 1, 0}), kInvalidArgument, "6");
  EXPECT_ERROR(client().Load(id, {0, 1}, {3, 3}), kInvalidArgument, "device row", "3");
  EXPECT_ERROR(client().Load(id, {0, 1, 2, 3}, {4, 5, 6, 5}), kInvalidArgument, "5");

  EXPECT_ERROR(client().WaitTransfer(123456789, kWait), kNotFound, "123456789");
  EXPECT_ERROR(client().PollTransfer(123456789), kNotFound, "123456789");

  EXPECT_EQ(DeviceBytes(), device_before) << "a refused transfer wrote the device buffer";
  EXPECT_TRUE(HostAllZero()) << "a refused transfer wrote the host pool";
  EXPECT_EQ(PoolsNow(), pools_before);

  // Repeated sources are fine: a backup may read a device row twice, a load a
  // host slot twice.
  absl::StatusOr<uint64_t> t1 = client().Backup(id, {0, 1}, {5, 5});
  ASSERT_TRUE(t1.ok()) << t1.status();
  ASSERT_TRUE(client().WaitTransfer(*t1, kWait).ok());
  absl::StatusOr<uint64_t> t2 = client().Load(id, {1, 1}, {14, 15});
  ASSERT_TRUE(t2.ok()) << t2.status();
  ASSERT_TRUE(client().WaitTransfer(*t2, kWait).ok());
  for (uint32_t plane = 0; plane < 2; ++plane) {
    for (uint32_t l = 0; l < 3; ++l) {
      EXPECT_EQ(std::memcmp(dev_->row(plane, l, 14), dev_->row(plane, l, 5), dev_->row_bytes()), 0);
      EXPECT_EQ(std::memcmp(dev_->row(plane, l, 15), dev_->row(plane, l, 5), dev_->row_bytes()), 0);
    }
  }
  // An empty transfer is accepted and done at once.
  absl::StatusOr<uint64_t> t3 = client().Backup(id, {}, {});
  ASSERT_TRUE(t3.ok()) << t3.status();
  absl::StatusOr<v1::TransferStatus> s3 = client().WaitTransfer(*t3, kWait);
  ASSERT_TRUE(s3.ok()) << s3.status();
  EXPECT_TRUE(s3->done());
  EXPECT_EQ(s3->bytes(), 0u);
}

// The host backend has no CUDA events: a backup or load that asks to wait on
// one is refused up front and queues nothing; loads name no event set and
// attachments carry no event handles (load_event_sets is ignored).
TEST_F(TransferErrorTest, WaitEventOnHostBackendIsFailedPrecondition) {
  v1::AttachDeviceRequest request = dev_->MakeAttachRequest("p");
  request.set_load_event_sets(7);
  absl::StatusOr<v1::Attachment> att = client().AttachDevice(request);
  ASSERT_TRUE(att.ok()) << att.status();
  EXPECT_EQ(att->load_event_handles_size(), 0);
  EXPECT_EQ(att->load_event_sets(), 0u);
  const std::string handle(64, '\x11');
  EXPECT_ERROR(client().Backup(att->id(), {0}, {0}, handle), kFailedPrecondition,
               "wait_event_handle", "host");
  EXPECT_ERROR(client().Backup(att->id(), {}, {}, handle), kFailedPrecondition,
               "wait_event_handle");
  // A load's wait event likewise (LoadRequest.wait_event_handle).
  EXPECT_ERROR(client().LoadWithEvents(att->id(), {0}, {1}, {}, handle), kFailedPrecondition,
               "wait_event_handle", "host");
  absl::StatusOr<v1::DaemonStatus> status = client().GetStatus();
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(status->tickets_in_flight(), 0u);
  // An empty handle is no wait.
  absl::StatusOr<uint64_t> t = client().Backup(att->id(), {0}, {0}, "");
  ASSERT_TRUE(t.ok()) << t.status();
  absl::StatusOr<v1::TransferStatus> st = client().WaitTransfer(*t, kWait);
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(st->event_set(), -1);
  absl::StatusOr<LoadTicket> load = client().LoadWithEvents(att->id(), {0}, {1});
  ASSERT_TRUE(load.ok()) << load.status();
  EXPECT_EQ(load->event_set, -1);
  EXPECT_TRUE(client().WaitTransfer(load->ticket_id, kWait).ok());
  // Still validated on every backend.
  request.set_load_event_sets(65);
  EXPECT_ERROR(client().AttachDevice(request), kInvalidArgument, "load_event_sets", "65", "64");
  ASSERT_TRUE(client().DetachDevice(att->id()).ok());
}

TEST_F(TransferErrorTest, DeletePoolWithAttachmentIsFailedPrecondition) {
  absl::StatusOr<v1::Attachment> att = client().AttachDevice(dev_->MakeAttachRequest("p"));
  ASSERT_TRUE(att.ok()) << att.status();
  absl::StatusOr<v1::Pool> p = client().GetPool("p");
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->attachments(), 1u);
  const std::string before = PoolsNow();
  EXPECT_ERROR(client().DeletePool("p"), kFailedPrecondition, "p", "attachment");
  EXPECT_EQ(PoolsNow(), before);
  EXPECT_TRUE(fs::exists(pool_.region_paths(0)));
  // The attachment still works after the refused delete.
  absl::StatusOr<uint64_t> t = client().Backup(att->id(), {0}, {0});
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_TRUE(client().WaitTransfer(*t, kWait).ok());

  ASSERT_TRUE(client().DetachDevice(att->id()).ok());
  p = client().GetPool("p");
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->attachments(), 0u);
  // Messages name the id by its prefix (the id is a capability).
  const std::string shown = att->id().substr(0, att->id().rfind('-') + 5);
  EXPECT_ERROR(client().DetachDevice(att->id()), kNotFound, shown, "not found");
  EXPECT_ERROR(client().Backup(att->id(), {0}, {0}), kNotFound, shown, "not found");
  EXPECT_ERROR(client().Load(att->id(), {0}, {0}), kNotFound, shown, "not found");
  absl::StatusOr<uint64_t> released = client().DeletePool("p");
  ASSERT_TRUE(released.ok()) << released.status();
  EXPECT_EQ(*released, pool_.bytes());
  EXPECT_FALSE(fs::exists(pool_.region_paths(0)));

  // Two attachments both count; the pool deletes only once both are gone.
  ASSERT_TRUE(client().CreatePool("p", MhaSpec(4, 32)).ok());

  absl::StatusOr<v1::Attachment> a1 = client().AttachDevice(dev_->MakeAttachRequest("p"));
  absl::StatusOr<v1::Attachment> a2 = client().AttachDevice(dev_->MakeAttachRequest("p"));
  ASSERT_TRUE(a1.ok() && a2.ok());
  EXPECT_NE(a1->id(), a2->id());
  EXPECT_EQ(client().GetPool("p")->attachments(), 2u);
  ASSERT_TRUE(client().DetachDevice(a1->id()).ok());
  EXPECT_ERROR(client().DeletePool("p"), kFailedPrecondition, "1");
  ASSERT_TRUE(client().DetachDevice(a2->id()).ok());
  EXPECT_TRUE(client().DeletePool("p").ok());
}

// ===========================================================================
// 3. Alloc semantics.

using AllocTest = DaemonTest;

TEST_F(AllocTest, WholePagesUntilExhausted) {
  std::mt19937 rng(11);
  for (uint32_t ps : {1u, 3u, 16u}) {
    SCOPED_TRACE(absl::StrCat("page_size ", ps));
    const std::string name = absl::StrCat("p", ps);
    constexpr uint64_t kPages = 20;
    ASSERT_TRUE(client().CreatePool(name, MhaSpec(ps, kPages * ps)).ok());
    std::set<int64_t> seen_pages;
    uint64_t left = kPages;
    std::vector<int64_t> all;
    while (left > 0) {
      const uint64_t want = std::min<uint64_t>(left, 1 + rng() % 5);
      absl::StatusOr<std::vector<int64_t>> got = client().Alloc(name, want * ps);
      ASSERT_TRUE(got.ok()) << got.status();
      ASSERT_EQ(got->size(), want * ps);
      for (size_t i = 0; i < got->size(); i += ps) {
        const int64_t first = (*got)[i];
        EXPECT_EQ(first % ps, 0) << "page does not start at a multiple of page_size";
        EXPECT_GE(first, 0);
        EXPECT_LT(first, static_cast<int64_t>(kPages * ps));
        for (uint32_t j = 1; j < ps; ++j) EXPECT_EQ((*got)[i + j], first + j);
        EXPECT_TRUE(seen_pages.insert(first / ps).second) << "page handed out twice: " << first;
      }
      all.insert(all.end(), got->begin(), got->end());
      left -= want;
      EXPECT_EQ(Available(name), left * ps);
    }
    EXPECT_EQ(Available(name), 0u);
    EXPECT_ERROR(client().Alloc(name, ps), kResourceExhausted, absl::StrCat(ps));
    absl::StatusOr<uint64_t> freed = client().Free(name, all);
    ASSERT_TRUE(freed.ok()) << freed.status();
    EXPECT_EQ(*freed, kPages * ps);
    EXPECT_EQ(Available(name), kPages * ps);
  }
}

TEST_F(AllocTest, RandomAllocFreeConservesSlots) {
  constexpr uint64_t kPs = 4, kPages = 64;
  ASSERT_TRUE(client().CreatePool("p", MhaSpec(kPs, kPs * kPages)).ok());
  std::mt19937 rng(2024);
  std::vector<uint64_t> held;  // pages we hold
  uint64_t free_pages = kPages;
  for (int op = 0; op < 200; ++op) {
    SCOPED_TRACE(absl::StrCat("op ", op));
    const bool alloc = held.empty() || rng() % 2 == 0;
    if (alloc) {
      const uint64_t want = 1 + rng() % 12;
      absl::StatusOr<std::vector<int64_t>> got = client().Alloc("p", want * kPs);
      if (want > free_pages) {
        EXPECT_ERROR(got, kResourceExhausted, absl::StrCat(want * kPs));
      } else {
        ASSERT_TRUE(got.ok()) << got.status();
        ASSERT_EQ(got->size(), want * kPs);
        for (size_t i = 0; i < got->size(); i += kPs) {
          const uint64_t page = static_cast<uint64_t>((*got)[i]) / kPs;
          ASSERT_EQ((*got)[i] % static_cast<int64_t>(kPs), 0);
          for (uint64_t j = 1; j < kPs; ++j)
            ASSERT_EQ((*got)[i + j], (*got)[i] + static_cast<int64_t>(j));
          ASSERT_EQ(std::count(held.begin(), held.end(), page), 0) << "page " << page << " twice";
          held.push_back(page);
        }
        free_pages -= want;
      }
    } else {
      std::shuffle(held.begin(), held.end(), rng);
      const size_t n = 1 + rng() % held.size();
      std::vector<uint64_t> give(held.end() - static_cast<std::ptrdiff_t>(n), held.end());
      absl::StatusOr<uint64_t> freed = client().Free("p", PageSlots(give, kPs));
      ASSERT_TRUE(freed.ok()) << freed.status();
      EXPECT_EQ(*freed, n * kPs);
      held.resize(held.size() - n);
      free_pages += n;
    }
    ASSERT_EQ(Available("p"), free_pages * kPs);
    ASSERT_EQ(free_pages + held.size(), kPages);
  }
  if (!held.empty()) {
    ASSERT_TRUE(client().Free("p", PageSlots(held, kPs)).ok());
  }
  EXPECT_EQ(Available("p"), kPs * kPages);
  absl::StatusOr<std::vector<int64_t>> everything = client().Alloc("p", kPs * kPages);
  ASSERT_TRUE(everything.ok()) << everything.status();
  EXPECT_EQ(std::set<int64_t>(everything->begin(), everything->end()).size(), kPs * kPages);
}

// ===========================================================================
// 4. GetPageBufferMeta equals the seeds' get_page_buffer_meta.

using MetaTest = DaemonTest;

TEST_F(MetaTest, MatchesSeedFormulaForEveryKindAndLayout) {
  const v1::DType dtypes[] = {v1::BF16, v1::FP32, v1::FP8_E4M3};
  int n = 0;
  for (const Combo& c : kCombos) {
    for (uint32_t ps : {1u, 3u, 16u}) {
      const v1::DType dtype = dtypes[n % 3];
      const std::string name = absl::StrCat(ComboName(c), "-ps", ps, "-", n++);
      SCOPED_TRACE(name);
      Dims dims;
      dims.layers = 5;
      dims.heads = 3;
      // PAGE_UNIFIED MHA: a head group per head at page size 3.
      if (c.kind == v1::MHA && c.layout == v1::PAGE_UNIFIED && ps == 3) dims.head_groups = 3;
      absl::StatusOr<v1::Pool> pool =
          client().CreatePool(name, MakeSpec(c.kind, c.layout, ps, 10 * ps, dtype, dims));
      ASSERT_TRUE(pool.ok()) << pool.status();
      const Geo g = GeoOf(*pool);
      const std::vector<int64_t> indices = PageSlots({3, 0, 9, 7}, ps);  // request order matters
      absl::StatusOr<v1::PageBufferMeta> meta = client().GetPageBufferMeta(name, indices);
      ASSERT_TRUE(meta.ok()) << meta.status();
      ASSERT_EQ(meta->region_paths_size(), 1);
      EXPECT_EQ(meta->region_paths(0), pool->region_paths(0));
      const std::vector<Seg> want = SeedPageBufferMeta(g, indices);
      ASSERT_EQ(static_cast<size_t>(meta->segments_size()), want.size());
      for (size_t i = 0; i < want.size(); ++i) {
        const v1::RegionRange& s = meta->segments(static_cast<int>(i));
        EXPECT_EQ(s.region_index(), 0u) << "segment " << i;
        EXPECT_EQ(s.offset(), want[i].offset) << "segment " << i;
        EXPECT_EQ(s.length(), want[i].length) << "segment " << i;
        EXPECT_LE(s.offset() + s.length(), pool->bytes()) << "segment " << i;
      }
      // Cross-check the seeds' formula itself against the element offsets: a
      // page-major range starts at the page's first (token 0, layer 0, head 0)
      // and a LAYER_FIRST one at the page's first token of that layer.
      EXPECT_EQ(want[0].offset, g.Offset(0, indices[0], 0, 0));
    }
  }
}

// ===========================================================================
// 5. Byte-exact round trips.

struct RoundTripCase {
  Combo combo;
  uint32_t page_size = 1;
  v1::DType dtype = v1::BF16;
  Dims dims;
  uint64_t pool_pages = 12;
  uint64_t freed_pages = 4;  // pages allocated then freed, so used pages are scattered
  uint32_t seed = 1;
};

void RoundTrip(Client& client, const std::string& shm_dir, const RoundTripCase& c) {
  const uint32_t ps = c.page_size;
  const std::string name = absl::StrCat(ComboName(c.combo), "-ps", ps);
  SCOPED_TRACE(absl::StrCat(name, " ", v1::DType_Name(c.dtype)));
  std::mt19937 rng(c.seed);

  absl::StatusOr<v1::Pool> pool = client.CreatePool(
      name, MakeSpec(c.combo.kind, c.combo.layout, ps, c.pool_pages * ps, c.dtype, c.dims));
  ASSERT_TRUE(pool.ok()) << pool.status();
  const Geo g = GeoOf(*pool);
  ASSERT_EQ(pool->bytes_per_token(), g.bytes_per_token());
  ASSERT_EQ(pool->bytes(), g.total_bytes());

  // Allocate every page, give some back: the pages used are scattered, and
  // used in shuffled order.
  absl::StatusOr<std::vector<int64_t>> all = client.Alloc(name, c.pool_pages * ps);
  ASSERT_TRUE(all.ok()) << all.status();
  std::vector<uint64_t> pages;
  for (size_t i = 0; i < all->size(); i += ps)
    pages.push_back(static_cast<uint64_t>((*all)[i]) / ps);
  std::shuffle(pages.begin(), pages.end(), rng);
  const std::vector<uint64_t> given_back(pages.end() - static_cast<std::ptrdiff_t>(c.freed_pages),
                                         pages.end());
  pages.resize(pages.size() - c.freed_pages);
  ASSERT_TRUE(client.Free(name, PageSlots(given_back, ps)).ok());
  const std::vector<int64_t> host = PageSlots(pages, ps);
  const uint64_t n = host.size();

  const uint64_t rows = 6 * n + 16;
  absl::StatusOr<std::unique_ptr<ShmDevicePool>> dev_or =
      ShmDevicePool::Create(*pool, rows, shm_dir);
  ASSERT_TRUE(dev_or.ok()) << dev_or.status();
  ShmDevicePool& dev = **dev_or;
  ASSERT_EQ(dev.row_bytes(), g.row_bytes());
  ASSERT_EQ(dev.planes(), g.planes());
  uint8_t* const dev_base = dev.layer(0, 0);
  FillRandomNonZero(dev_base, dev.bytes(), rng);
  const std::vector<uint8_t> orig(dev_base, dev_base + dev.bytes());
  auto orig_row = [&](uint64_t plane, uint64_t layer, uint64_t row) {
    return orig.data() +
           (dev.row(static_cast<uint32_t>(plane), static_cast<uint32_t>(layer), row) - dev_base);
  };

  const std::vector<int64_t> src = SourceRows(rng, n);
  ASSERT_LT(static_cast<uint64_t>(src.back()), rows);
  const std::vector<int64_t> dst =
      OtherRows(rng, n, rows, std::set<int64_t>(src.begin(), src.end()));

  absl::StatusOr<v1::Attachment> att = client.AttachDevice(dev.MakeAttachRequest(name));
  ASSERT_TRUE(att.ok()) << att.status();
  EXPECT_EQ(att->device_size_tokens(), rows);

  // Backup: device rows src[i] -> host slots host[i].
  absl::StatusOr<uint64_t> ticket = client.Backup(att->id(), host, src);
  ASSERT_TRUE(ticket.ok()) << ticket.status();
  absl::StatusOr<v1::TransferStatus> st = client.WaitTransfer(*ticket, kWait);
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_TRUE(st->done());
  EXPECT_EQ(st->ticket_id(), *ticket);
  EXPECT_EQ(st->bytes(), n * pool->bytes_per_token());
  EXPECT_EQ(st->layers_done(), g.L);
  EXPECT_EQ(st->layer_num(), g.L);
  EXPECT_FALSE(st->path().empty());
  EXPECT_EQ(std::memcmp(dev_base, orig.data(), dev.bytes()), 0) << "a backup wrote the device";

  // The host region, read directly at the seeds' offsets of every
  // (K/V, token, layer, head); every other byte still zero.
  {
    std::unique_ptr<MappedFile> region = MappedFile::Open(pool->region_paths(0));
    ASSERT_NE(region, nullptr) << pool->region_paths(0);
    ASSERT_EQ(region->size(), pool->bytes());
    std::vector<uint8_t> covered(region->size(), 0);
    uint64_t mismatches = 0;
    for (uint64_t i = 0; i < n; ++i) {
      for (uint64_t kv = 0; kv < g.planes(); ++kv) {
        for (uint64_t l = 0; l < g.L; ++l) {
          for (uint64_t h = 0; h < g.H; ++h) {
            const uint64_t off = g.Offset(kv, static_cast<uint64_t>(host[i]), l, h);
            ASSERT_LE(off + g.Db, region->size());
            const uint8_t* want = orig_row(kv, l, static_cast<uint64_t>(src[i])) + h * g.Db;
            if (std::memcmp(region->data() + off, want, g.Db) != 0 && mismatches++ < 5) {
              ADD_FAILURE() << "host slot " << host[i] << " (device row " << src[i] << ") kv " << kv
                            << " layer " << l << " head " << h << " differs at offset " << off;
            }
            std::fill(covered.begin() + static_cast<std::ptrdiff_t>(off),
                      covered.begin() + static_cast<std::ptrdiff_t>(off + g.Db), 1);
          }
        }
      }
    }
    EXPECT_EQ(mismatches, 0u);
    uint64_t stray = 0;
    for (uint64_t i = 0; i < region->size(); ++i) {
      if (!covered[i] && region->data()[i] != 0 && stray++ == 0) {
        ADD_FAILURE() << "host byte " << i << " written outside the targeted slots";
      }
    }
    EXPECT_EQ(stray, 0u);
  }

  // Zero the source rows, load the host slots into other device rows.
  for (uint64_t kv = 0; kv < g.planes(); ++kv) {
    for (uint64_t l = 0; l < g.L; ++l) {
      for (int64_t r : src) std::memset(dev.row(kv, l, r), 0, dev.row_bytes());
    }
  }
  std::vector<uint8_t> expected(dev_base, dev_base + dev.bytes());
  for (uint64_t i = 0; i < n; ++i) {
    for (uint64_t kv = 0; kv < g.planes(); ++kv) {
      for (uint64_t l = 0; l < g.L; ++l) {
        std::memcpy(expected.data() + (dev.row(kv, l, dst[i]) - dev_base),
                    orig_row(kv, l, static_cast<uint64_t>(src[i])), dev.row_bytes());
      }
    }
  }
  ticket = client.Load(att->id(), host, dst);
  ASSERT_TRUE(ticket.ok()) << ticket.status();
  st = client.WaitTransfer(*ticket, kWait);
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_TRUE(st->done());
  EXPECT_EQ(st->bytes(), n * pool->bytes_per_token());
  EXPECT_EQ(st->layers_done(), g.L);
  EXPECT_EQ(st->layer_num(), g.L);
  uint64_t bad_rows = 0;
  for (uint64_t kv = 0; kv < g.planes(); ++kv) {
    for (uint64_t l = 0; l < g.L; ++l) {
      for (uint64_t r = 0; r < rows; ++r) {
        const uint8_t* got = dev.row(kv, l, r);
        if (std::memcmp(got, expected.data() + (got - dev_base), dev.row_bytes()) != 0 &&
            bad_rows++ < 5) {
          const bool targeted = std::count(dst.begin(), dst.end(), static_cast<int64_t>(r)) > 0;
          ADD_FAILURE() << "device row " << r << " kv " << kv << " layer " << l
                        << (targeted ? " (a load target) has the wrong bytes"
                                     : " (not a target) was modified");
        }
      }
    }
  }
  EXPECT_EQ(bad_rows, 0u);

  ASSERT_TRUE(client.DetachDevice(att->id()).ok());
  ASSERT_TRUE(client.DeletePool(name).ok());
}

class RoundTripTest : public WithDaemon<::testing::TestWithParam<int>> {};

TEST_P(RoundTripTest, BackupThenLoadIsByteExact) {
  const int combo = GetParam();
  const v1::DType dtypes[] = {v1::BF16, v1::FP32, v1::FP8_E5M2, v1::FP16};
  for (uint32_t ps : {1u, 3u, 16u}) {
    RoundTripCase c;
    c.combo = kCombos[combo];
    c.page_size = ps;
    c.dtype = dtypes[(combo + ps) % 4];
    c.seed = 1000u * static_cast<uint32_t>(combo) + ps;
    RoundTrip(client(), shm_dir(), c);
    if (HasFatalFailure()) return;
  }
}

INSTANTIATE_TEST_SUITE_P(AllLayouts, RoundTripTest,
                         ::testing::Range(0, static_cast<int>(std::size(kCombos))),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return ComboName(kCombos[info.param]);
                         });

// Layers big enough (> 1 MiB) that the host engine splits them over its
// helper threads, with one-layer and one-head edge shapes.
TEST_F(DaemonTest, LargeAndEdgeShapeRoundTrips) {
  {
    RoundTripCase c;
    c.combo = {v1::MHA, v1::PAGE_HEAD};
    c.page_size = 16;
    c.dims.layers = 4;
    c.dims.heads = 8;
    c.dims.head_dim = 64;  // 1 KiB rows (BF16)
    c.pool_pages = 160;
    c.freed_pages = 32;  // 2048 tokens moved: 4 MiB per layer
    c.seed = 77;
    RoundTrip(client(), shm_dir(), c);
  }
  {
    RoundTripCase c;  // PAGE_UNIFIED in 4 head groups: rows split in 4
    c.combo = {v1::MHA, v1::PAGE_UNIFIED};
    c.page_size = 16;
    c.dims.layers = 4;
    c.dims.heads = 8;
    c.dims.head_dim = 64;
    c.dims.head_groups = 4;
    c.pool_pages = 160;
    c.freed_pages = 32;
    c.seed = 79;
    RoundTrip(client(), shm_dir(), c);
  }
  {
    RoundTripCase c;
    c.combo = {v1::MLA, v1::LAYER_FIRST};
    c.page_size = 64;
    c.dims.layers = 2;
    c.dims.lora_rank = 512;
    c.dims.rope_dim = 64;  // 1152-byte rows
    c.pool_pages = 40;
    c.freed_pages = 8;
    c.seed = 78;
    RoundTrip(client(), shm_dir(), c);
  }
  for (const Combo& combo : kCombos) {  // one layer, one head
    RoundTripCase c;
    c.combo = combo;
    c.page_size = 4;
    c.dims.layers = 1;
    c.dims.heads = 1;
    c.seed = 79;
    RoundTrip(client(), shm_dir(), c);
  }
}

// ===========================================================================
// 6. Tickets.

using TicketTest = DaemonTest;

// DaemonService.GetStatus follows pools, attachments and finished tickets.
TEST_F(DaemonTest, StatusCountsPoolsAttachmentsAndTickets) {
  absl::StatusOr<v1::DaemonStatus> before = client().GetStatus();
  ASSERT_TRUE(before.ok()) << before.status();
  EXPECT_EQ(before->backend(), "host");
  EXPECT_FALSE(before->backend_detail().empty());
  EXPECT_EQ(before->shm_dir(), shm_dir());
  EXPECT_EQ(before->pid(), daemon_->pid());
  EXPECT_FALSE(before->version().empty());
  EXPECT_EQ(before->pools(), 0u);
  EXPECT_EQ(before->pool_bytes(), 0u);
  EXPECT_GT(before->memory_available_bytes(), 0u);

  Dims dims;
  dims.layers = 2;
  dims.heads = 2;
  dims.head_dim = 64;  // 256-byte rows
  absl::StatusOr<v1::Pool> pool =
      client().CreatePool("s", MakeSpec(v1::MHA, v1::PAGE_FIRST, 16, 256, v1::BF16, dims));
  ASSERT_TRUE(pool.ok()) << pool.status();
  absl::StatusOr<std::vector<int64_t>> slots = client().Alloc("s", 32);
  ASSERT_TRUE(slots.ok()) << slots.status();
  absl::StatusOr<std::unique_ptr<ShmDevicePool>> dev = ShmDevicePool::Create(*pool, 64, shm_dir());
  ASSERT_TRUE(dev.ok()) << dev.status();
  absl::StatusOr<v1::Attachment> att = client().AttachDevice((*dev)->MakeAttachRequest("s"));
  ASSERT_TRUE(att.ok()) << att.status();
  const std::vector<int64_t> rows = Range(0, 32);
  absl::StatusOr<uint64_t> backup = client().Backup(att->id(), *slots, rows);
  ASSERT_TRUE(backup.ok()) << backup.status();
  ASSERT_TRUE(client().WaitTransfer(*backup).ok());
  absl::StatusOr<uint64_t> load = client().Load(att->id(), *slots, rows);
  ASSERT_TRUE(load.ok()) << load.status();
  ASSERT_TRUE(client().WaitTransfer(*load).ok());

  // Counters are updated as the ticket ends; give that a moment.
  absl::StatusOr<v1::DaemonStatus> after;
  for (int i = 0; i < 100; ++i) {
    after = client().GetStatus();
    ASSERT_TRUE(after.ok()) << after.status();
    if (after->tickets_done() == 2) break;
    absl::SleepFor(absl::Milliseconds(10));
  }
  const uint64_t moved = 32 * pool->bytes_per_token();
  EXPECT_EQ(after->pools(), 1u);
  EXPECT_EQ(after->pool_bytes(), pool->bytes());
  EXPECT_EQ(after->attachments(), 1u);
  EXPECT_EQ(after->tickets_done(), 2u);
  EXPECT_EQ(after->tickets_failed(), 0u);
  EXPECT_EQ(after->tickets_in_flight(), 0u);
  EXPECT_EQ(after->backup_bytes(), moved);
  EXPECT_EQ(after->load_bytes(), moved);
  ASSERT_TRUE(client().DetachDevice(att->id()).ok());
  absl::StatusOr<v1::DaemonStatus> detached = client().GetStatus();
  ASSERT_TRUE(detached.ok());
  EXPECT_EQ(detached->attachments(), 0u);
}

TEST_F(TicketTest, WaitOnDoneTicketReturnsAtOnceAndPollReportsProgress) {
  Dims dims;
  dims.layers = 8;
  dims.heads = 8;
  dims.head_dim = 128;  // 2 KiB rows, 32 KiB per token
  absl::StatusOr<v1::Pool> pool =
      client().CreatePool("p", MakeSpec(v1::MHA, v1::LAYER_FIRST, 16, 2048, v1::BF16, dims));
  ASSERT_TRUE(pool.ok()) << pool.status();
  absl::StatusOr<std::vector<int64_t>> slots = client().Alloc("p", 2048);
  ASSERT_TRUE(slots.ok());
  absl::StatusOr<std::unique_ptr<ShmDevicePool>> dev =
      ShmDevicePool::Create(*pool, 2048, shm_dir());
  ASSERT_TRUE(dev.ok()) << dev.status();
  absl::StatusOr<v1::Attachment> att = client().AttachDevice((*dev)->MakeAttachRequest("p"));
  ASSERT_TRUE(att.ok()) << att.status();

  std::vector<int64_t> rows = *slots;
  std::reverse(rows.begin(), rows.end());  // one token per run: slow enough to watch
  absl::StatusOr<uint64_t> t = client().Backup(att->id(), *slots, rows);
  ASSERT_TRUE(t.ok()) << t.status();
  uint32_t last_layers = 0;
  uint64_t last_bytes = 0;
  int polls = 0;
  for (;; ++polls) {
    absl::StatusOr<v1::TransferStatus> s = client().PollTransfer(*t);
    ASSERT_TRUE(s.ok()) << s.status();
    EXPECT_EQ(s->ticket_id(), *t);
    EXPECT_EQ(s->layer_num(), 8u);
    EXPECT_GE(s->layers_done(), last_layers) << "layers_done went backwards";
    EXPECT_GE(s->bytes(), last_bytes) << "bytes went backwards";
    EXPECT_LE(s->layers_done(), 8u);
    EXPECT_EQ(s->bytes(), uint64_t{s->layers_done()} * 2048 * 2 * 2048)
        << "bytes should count whole layers (K and V)";
    last_layers = s->layers_done();
    last_bytes = s->bytes();
    if (s->done()) {
      EXPECT_EQ(s->layers_done(), 8u);
      EXPECT_GT(s->duration_us(), 0u);
      break;
    }
    EXPECT_EQ(s->duration_us(), 0u) << "duration_us must be 0 while running";
    ASSERT_LT(polls, 100000);
  }
  std::printf("polled %d times before done\n", polls);

  absl::StatusOr<v1::TransferStatus> first = client().WaitTransfer(*t, kWait);
  ASSERT_TRUE(first.ok()) << first.status();
  const absl::Time start = absl::Now();
  absl::StatusOr<v1::TransferStatus> again = client().WaitTransfer(*t, absl::Seconds(5));
  const absl::Duration took = absl::Now() - start;
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_LT(took, absl::Seconds(1)) << "WaitTransfer on a done ticket should return at once";
  EXPECT_EQ(again->DebugString(), first->DebugString());
  EXPECT_TRUE(again->done());
  EXPECT_EQ(again->bytes(), 2048 * pool->bytes_per_token());
  EXPECT_EQ(again->path(), first->path());

  // Ticket ids are unique.
  absl::StatusOr<uint64_t> t2 = client().Load(att->id(), {0}, {0});
  ASSERT_TRUE(t2.ok());
  EXPECT_NE(*t2, *t);
  EXPECT_TRUE(client().WaitTransfer(*t2, kWait).ok());
}

// DetachDevice and DeletePool while a transfer runs: the transfer completes,
// and the pool's name (and its region file name) is free at once.
TEST_F(TicketTest, DetachAndDeleteWhileATransferRuns) {
  Dims dims;
  dims.layers = 8;
  dims.heads = 8;
  dims.head_dim = 128;  // 32 KiB per token
  const v1::PoolSpec spec = MakeSpec(v1::MHA, v1::PAGE_HEAD, 16, 4096, v1::BF16, dims);
  absl::StatusOr<v1::Pool> pool = client().CreatePool("p", spec);
  ASSERT_TRUE(pool.ok()) << pool.status();
  absl::StatusOr<std::vector<int64_t>> slots = client().Alloc("p", 4096);
  ASSERT_TRUE(slots.ok());
  absl::StatusOr<std::unique_ptr<ShmDevicePool>> dev =
      ShmDevicePool::Create(*pool, 4096, shm_dir());
  ASSERT_TRUE(dev.ok()) << dev.status();
  absl::StatusOr<v1::Attachment> att = client().AttachDevice((*dev)->MakeAttachRequest("p"));
  ASSERT_TRUE(att.ok()) << att.status();
  std::vector<int64_t> rows = *slots;
  std::reverse(rows.begin(), rows.end());  // per-head pieces, one token per run: slow
  absl::StatusOr<uint64_t> t = client().Backup(att->id(), *slots, rows);
  ASSERT_TRUE(t.ok()) << t.status();

  // A WaitTransfer that gives up (client deadline) leaves the ticket and the
  // daemon fine; waiting again works.
  absl::StatusOr<v1::TransferStatus> early = client().WaitTransfer(*t, absl::Milliseconds(1));
  EXPECT_TRUE(early.ok() || early.status().code() == absl::StatusCode::kDeadlineExceeded)
      << early.status();

  ASSERT_TRUE(client().DetachDevice(att->id()).ok());
  absl::StatusOr<uint64_t> released = client().DeletePool("p");
  ASSERT_TRUE(released.ok()) << released.status();
  absl::StatusOr<v1::TransferStatus> running = client().PollTransfer(*t);
  ASSERT_TRUE(running.ok()) << running.status();
  std::printf("transfer %s when the pool was deleted\n", running->done() ? "done" : "running");
  // The name is free again at once.
  absl::StatusOr<v1::Pool> again = client().CreatePool("p", spec);
  EXPECT_TRUE(again.ok()) << again.status();

  absl::StatusOr<v1::TransferStatus> st = client().WaitTransfer(*t, kWait);
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_TRUE(st->done());
  EXPECT_EQ(st->bytes(), 4096 * pool->bytes_per_token());
  if (again.ok()) {
    // The old pool's memory went with its last job; the new pool's file stays.
    absl::SleepFor(absl::Milliseconds(50));
    ASSERT_EQ(again->region_paths_size(), 1);
    EXPECT_TRUE(fs::exists(again->region_paths(0)))
        << "the deleted pool's teardown removed the new pool's region file";
    EXPECT_EQ(RegionFiles(shm_dir()).size(), 1u);
    absl::StatusOr<v1::PageBufferMeta> meta = client().GetPageBufferMeta("p", Range(0, 16));
    ASSERT_TRUE(meta.ok()) << meta.status();
    EXPECT_TRUE(fs::exists(meta->region_paths(0)));
  }
}

TEST_F(TicketTest, ConcurrentBackupsAndLoadsFromManyThreads) {
  constexpr int kThreads = 6, kIters = 6, kSlices = 4;
  constexpr uint64_t kPs = 4, kPagesPerThread = 16, kTok = kPs * kPagesPerThread;
  Dims dims;
  dims.layers = 4;
  dims.heads = 2;
  dims.head_dim = 16;
  absl::StatusOr<v1::Pool> pool = client().CreatePool(
      "p", MakeSpec(v1::MHA, v1::PAGE_FIRST_DIRECT, kPs, kThreads * kTok + 64, v1::BF16, dims));
  ASSERT_TRUE(pool.ok()) << pool.status();
  const uint64_t rows = 2 * kThreads * kTok;
  absl::StatusOr<std::unique_ptr<ShmDevicePool>> dev_or =
      ShmDevicePool::Create(*pool, rows, shm_dir());
  ASSERT_TRUE(dev_or.ok()) << dev_or.status();
  ShmDevicePool& dev = **dev_or;
  absl::StatusOr<v1::Attachment> att = client().AttachDevice(dev.MakeAttachRequest("p"));
  ASSERT_TRUE(att.ok()) << att.status();
  std::vector<std::vector<int64_t>> thread_slots;
  for (int t = 0; t < kThreads; ++t) {
    absl::StatusOr<std::vector<int64_t>> s = client().Alloc("p", kTok);
    ASSERT_TRUE(s.ok()) << s.status();
    thread_slots.push_back(*s);
  }

  std::mutex mu;
  std::set<uint64_t> ticket_ids;
  std::atomic<int> failures{0};
  auto worker = [&](int t) {
    std::mt19937 rng(500 + t);
    Client& c = client();
    const std::string id = att->id();
    for (int it = 0; it < kIters && failures == 0; ++it) {
      // Source rows [t*kTok, ...), destination rows in the second half.
      std::vector<int64_t> src = Range(t * static_cast<int64_t>(kTok), kTok);
      std::vector<int64_t> dst = Range(static_cast<int64_t>(kThreads * kTok + t * kTok), kTok);
      std::shuffle(src.begin(), src.end(), rng);
      std::shuffle(dst.begin(), dst.end(), rng);
      for (int64_t r : src) {
        for (uint32_t kv = 0; kv < 2; ++kv) {
          for (uint32_t l = 0; l < dims.layers; ++l) {
            FillRandomNonZero(dev.row(kv, l, r), dev.row_bytes(), rng);
          }
        }
      }
      const std::vector<int64_t>& host = thread_slots[t];
      auto run = [&](bool backup) {
        std::vector<uint64_t> tickets;
        const uint64_t per = kTok / kSlices;
        for (int s = 0; s < kSlices; ++s) {
          std::vector<int64_t> h(host.begin() + s * per, host.begin() + (s + 1) * per);
          std::vector<int64_t> d =
              backup ? std::vector<int64_t>(src.begin() + s * per, src.begin() + (s + 1) * per)
                     : std::vector<int64_t>(dst.begin() + s * per, dst.begin() + (s + 1) * per);
          absl::StatusOr<uint64_t> tk = backup ? c.Backup(id, h, d) : c.Load(id, h, d);
          if (!tk.ok()) {
            ADD_FAILURE() << "thread " << t << ": " << tk.status();
            ++failures;
            return;
          }
          tickets.push_back(*tk);
          std::lock_guard<std::mutex> lock(mu);
          if (!ticket_ids.insert(*tk).second) {
            ADD_FAILURE() << "ticket id " << *tk << " handed out twice";
            ++failures;
          }
        }
        for (uint64_t tk : tickets) {
          absl::StatusOr<v1::TransferStatus> st = c.WaitTransfer(tk, kWait);
          if (!st.ok() || !st->done() || st->bytes() != per * pool->bytes_per_token()) {
            ADD_FAILURE() << "thread " << t << " ticket " << tk << ": "
                          << (st.ok() ? st->DebugString() : st.status().ToString());
            ++failures;
          }
        }
      };
      run(true);
      run(false);
      for (uint64_t i = 0; i < kTok; ++i) {
        for (uint32_t kv = 0; kv < 2; ++kv) {
          for (uint32_t l = 0; l < dims.layers; ++l) {
            if (std::memcmp(dev.row(kv, l, dst[i]), dev.row(kv, l, src[i]), dev.row_bytes()) != 0) {
              ADD_FAILURE() << "thread " << t << " iter " << it << ": device row " << dst[i]
                            << " != row " << src[i] << " (kv " << kv << " layer " << l << ")";
              ++failures;
              return;
            }
          }
        }
      }
    }
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) threads.emplace_back(worker, t);
  for (std::thread& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(ticket_ids.size(), static_cast<size_t>(kThreads * kIters * kSlices * 2));
}

// ===========================================================================
// 7. Daemon lifecycle.

uint64_t Mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Deterministic content of one device row, so it can be checked after the fact.
void PatternRow(uint8_t* p, uint64_t bytes, uint64_t key) {
  for (uint64_t w = 0; w * 8 < bytes; ++w) {
    const uint64_t v = Mix64(key * 0x100000001b3ull + w);
    std::memcpy(p + w * 8, &v, std::min<uint64_t>(8, bytes - w * 8));
  }
}

TEST(LifecycleTest, SigtermDrainsTransfersExitsZeroAndCleansUp) {
  absl::StatusOr<std::unique_ptr<TestDaemon>> d_or = TestDaemon::Start(KVHOSTD_PATH);
  ASSERT_TRUE(d_or.ok()) << d_or.status();
  TestDaemon& d = **d_or;
  Client& c = d.client();
  const std::string socket = d.address().substr(std::string("unix://").size());
  ASSERT_TRUE(fs::exists(socket));

  constexpr uint64_t kTokens = 8192, kHalf = kTokens / 2, kChunk = 512;
  Dims dims;
  dims.layers = 16;
  dims.heads = 8;
  dims.head_dim = 64;  // 1 KiB rows, 32 KiB per token, 256 MiB pool
  absl::StatusOr<v1::Pool> pool =
      c.CreatePool("big", MakeSpec(v1::MHA, v1::PAGE_FIRST_DIRECT, 16, kTokens, v1::BF16, dims));
  ASSERT_TRUE(pool.ok()) << pool.status();
  ASSERT_TRUE(c.CreatePool("idle", MhaSpec(4, 64)).ok());
  const Geo g = GeoOf(*pool);
  ASSERT_TRUE(c.Alloc("big", kTokens).ok());
  const uint64_t rows = kTokens + kHalf;
  absl::StatusOr<std::unique_ptr<ShmDevicePool>> dev_or =
      ShmDevicePool::Create(*pool, rows, d.shm_dir());
  ASSERT_TRUE(dev_or.ok()) << dev_or.status();
  ShmDevicePool& dev = **dev_or;
  auto key = [&](uint64_t kv, uint64_t l, uint64_t r) { return (kv * g.L + l) << 32 | r; };
  for (uint64_t kv = 0; kv < 2; ++kv) {
    for (uint64_t l = 0; l < g.L; ++l) {
      for (uint64_t r = 0; r < kTokens; ++r)
        PatternRow(dev.row(kv, l, r), dev.row_bytes(), key(kv, l, r));
    }
  }
  absl::StatusOr<v1::Attachment> att = c.AttachDevice(dev.MakeAttachRequest("big"));
  ASSERT_TRUE(att.ok()) << att.status();

  // Phase A, finished: rows [0, half) -> slots [0, half).
  absl::StatusOr<uint64_t> a = c.Backup(att->id(), Range(0, kHalf), Range(0, kHalf));
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(c.WaitTransfer(*a, kWait).ok());
  // The host region stays readable through this mapping after the daemon
  // unlinks it, so the backups can be checked after exit.
  std::unique_ptr<MappedFile> region = MappedFile::Open(pool->region_paths(0));
  ASSERT_NE(region, nullptr);

  // Phase B, in flight at SIGTERM: backups of the second half, loads of the
  // first half into rows [tokens, tokens + half).
  std::vector<uint64_t> tickets;
  for (uint64_t s = 0; s < kHalf; s += kChunk) {
    absl::StatusOr<uint64_t> b =
        c.Backup(att->id(), Range(kHalf + s, kChunk), Range(kHalf + s, kChunk));
    ASSERT_TRUE(b.ok()) << b.status();
    tickets.push_back(*b);
    absl::StatusOr<uint64_t> l = c.Load(att->id(), Range(s, kChunk), Range(kTokens + s, kChunk));
    ASSERT_TRUE(l.ok()) << l.status();
    tickets.push_back(*l);
  }
  std::vector<absl::Status> waited(tickets.size());
  std::vector<std::thread> waiters;
  for (size_t i = 0; i < tickets.size(); ++i) {
    waiters.emplace_back([&, i] {
      absl::StatusOr<v1::TransferStatus> st = c.WaitTransfer(tickets[i], kWait);
      waited[i] =
          st.ok() ? (st->done() ? absl::OkStatus() : absl::InternalError("not done")) : st.status();
    });
  }
  absl::SleepFor(absl::Milliseconds(20));  // let the waits reach the daemon
  absl::StatusOr<v1::TransferStatus> last = c.PollTransfer(tickets.back());
  const bool running_at_sigterm = last.ok() && !last->done();

  // A watchdog so a daemon that never exits fails the test instead of hanging it.
  std::atomic<bool> exited{false};
  const pid_t pid = d.pid();
  std::thread watchdog([&] {
    for (int i = 0; i < 300 && !exited; ++i) absl::SleepFor(absl::Milliseconds(100));
    if (!exited) ::kill(pid, SIGKILL);
  });
  const int code = d.Stop(SIGTERM);
  exited = true;
  watchdog.join();
  for (std::thread& w : waiters) w.join();
  std::printf("transfers %s at SIGTERM\n", running_at_sigterm ? "still running" : "already done");

  EXPECT_EQ(code, 0) << d.Log();
  for (size_t i = 0; i < tickets.size(); ++i) {
    EXPECT_TRUE(waited[i].ok()) << "WaitTransfer(" << tickets[i]
                                << ") across SIGTERM: " << waited[i];
  }
  EXPECT_FALSE(fs::exists(socket)) << "socket file left after exit";
  EXPECT_TRUE(RegionFiles(d.shm_dir()).empty())
      << "pool region files left after exit: " << absl::StrJoin(RegionFiles(d.shm_dir()), ", ");
  EXPECT_FALSE(fs::exists(pool->region_paths(0)));

  // Every accepted transfer completed before exit.
  std::vector<uint8_t> want(dev.row_bytes());
  uint64_t bad = 0;
  for (uint64_t kv = 0; kv < 2; ++kv) {
    for (uint64_t l = 0; l < g.L; ++l) {
      for (uint64_t s = 0; s < kTokens; ++s) {  // host slot s holds device row s
        PatternRow(want.data(), want.size(), key(kv, l, s));
        if (std::memcmp(region->data() + g.Offset(kv, s, l, 0), want.data(), want.size()) != 0 &&
            bad++ < 3) {
          ADD_FAILURE() << "host slot " << s << " kv " << kv << " layer " << l << " not backed up";
        }
        if (s < kHalf && std::memcmp(dev.row(kv, l, kTokens + s), want.data(), want.size()) != 0 &&
            bad++ < 3) {
          ADD_FAILURE() << "device row " << kTokens + s << " kv " << kv << " layer " << l
                        << " not loaded";
        }
      }
    }
  }
  EXPECT_EQ(bad, 0u);
}

// Runs a shell command line; returns (exit status, stdout + stderr).
std::pair<int, std::string> RunCommand(const std::string& command) {
  std::string output;
  FILE* p = ::popen(absl::StrCat("timeout 20 ", command, " 2>&1").c_str(), "r");
  if (p == nullptr) return {-1, "popen failed"};
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), p)) > 0) output.append(buf, n);
  const int status = ::pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status), output};
}

TEST(LifecycleTest, HelpExitsZeroAndListsTheFlags) {
  auto [code, out] = RunCommand(absl::StrCat("'", KVHOSTD_PATH, "' --help"));
  EXPECT_EQ(code, 0) << out;
  for (const char* flag : {"--shm-dir", "--memory-limit", "--memory-reserve", "--backend",
                           "--listen", "--log-level"}) {
    EXPECT_TRUE(absl::StrContains(out, flag)) << "--help does not mention " << flag << ":\n" << out;
  }
}

TEST(LifecycleTest, BadFlagsExitNonZeroWithAMessage) {
  char dir[] = "/tmp/kvhost-flags-XXXXXX";
  ASSERT_NE(::mkdtemp(dir), nullptr);
  const std::string base =
      absl::StrCat("'", KVHOSTD_PATH, "' --listen=unix://", dir, "/s.sock --shm-dir=", dir, " ");
  struct Case {
    std::string flags;
    std::vector<std::string> needles;
  };
  const Case cases[] = {
      {"--backend=gpu", {"gpu", "backend"}},
      {"--memory-limit=abc", {"memory-limit", "abc"}},
      {"--memory-limit=12Q", {"memory-limit"}},
      {"--memory-reserve=lots", {"memory-reserve", "lots"}},
      {"--log-level=loud", {"loud"}},
      {"--copy-threads=-1", {"copy-threads"}},
      {"--no-such-flag=1", {"no"}},
  };
  for (const Case& c : cases) {
    auto [code, out] = RunCommand(base + c.flags);
    EXPECT_NE(code, 0) << c.flags << ": exited 0\n" << out;
    EXPECT_NE(code, 124) << c.flags << ": still running after 20 s (it should refuse to start)";
    for (const std::string& needle : c.needles) {
      EXPECT_TRUE(absl::StrContains(out, needle))
          << c.flags << ": message does not name \"" << needle << "\":\n"
          << out;
    }
  }
  std::error_code ec;
  fs::remove_all(dir, ec);
}

// --load-gates (gated loads, removed: docs/PERF.md run S) stays a flag so
// that existing configs keep working: =false starts and serves as if it were
// absent, =true stops the start with exit 2 and one line that names the flag,
// why it went and what replaces it.
TEST(LifecycleTest, LoadGatesTrueIsRefusedAndFalseStarts) {
  char dir[] = "/tmp/kvhost-gates-XXXXXX";
  ASSERT_NE(::mkdtemp(dir), nullptr);
  auto [code, out] =
      RunCommand(absl::StrCat("'", KVHOSTD_PATH, "' --listen=unix://", dir,
                              "/s.sock --shm-dir=", dir, " --backend=host --load-gates=true"));
  EXPECT_EQ(code, 2) << "--load-gates=true: exit " << code << " (124: still running)\n" << out;
  std::string line;  // the one line that says it all
  for (absl::string_view l : absl::StrSplit(out, '\n')) {
    if (absl::StrContains(l, "--load-gates=true")) line = std::string(l);
  }
  for (const char* needle : {"--load-gates=true", "deadlock", "docs/PERF.md, run S",
                             "AttachDeviceRequest.layer_progress", "LoadEvents::WaitLayer"}) {
    EXPECT_TRUE(absl::StrContains(line, needle))
        << "the refusal does not say \"" << needle << "\" on its line:\n"
        << out;
  }
  EXPECT_FALSE(fs::exists(absl::StrCat(dir, "/s.sock"))) << "a socket after a refused start";
  std::error_code ec;
  fs::remove_all(dir, ec);

  absl::StatusOr<std::unique_ptr<TestDaemon>> d =
      TestDaemon::Start(KVHOSTD_PATH, {"--load-gates=false"});
  ASSERT_TRUE(d.ok()) << "--load-gates=false: " << d.status();
  absl::StatusOr<v1::Pool> pool = (*d)->client().CreatePool("p", MhaSpec(4, 64));
  EXPECT_TRUE(pool.ok()) << pool.status();
  EXPECT_EQ((*d)->Stop(SIGTERM), 0);
  // Silently: an old config's false is no cause for a warning.
  const std::string log = (*d)->Log();
  for (const char* needle : {"load-gates", "load_gates", "gated"}) {
    EXPECT_FALSE(absl::StrContains(log, needle)) << log;
  }
}

// kvhostd killed with SIGKILL leaves its socket and region files; the next
// daemon on the same socket and shm dir replaces the one and removes the others.
TEST(LifecycleTest, RestartAfterSigkillCleansStaleSocketAndRegions) {
  absl::StatusOr<std::unique_ptr<TestDaemon>> a = TestDaemon::Start(KVHOSTD_PATH);
  ASSERT_TRUE(a.ok()) << a.status();
  absl::StatusOr<v1::Pool> pool = (*a)->client().CreatePool("p", MhaSpec(4, 64));
  ASSERT_TRUE(pool.ok()) << pool.status();
  const std::string socket = (*a)->address().substr(std::string("unix://").size());
  EXPECT_EQ((*a)->Stop(SIGKILL), 128 + SIGKILL);
  ASSERT_TRUE(fs::exists(socket));
  ASSERT_TRUE(fs::exists(pool->region_paths(0)));

  // The second daemon runs by hand: TestDaemon would listen on its own socket.
  const pid_t b = ::fork();
  ASSERT_GE(b, 0);
  if (b == 0) {
    (void)std::freopen("/dev/null", "w", stdout);
    (void)std::freopen("/dev/null", "w", stderr);
    const std::string listen = absl::StrCat("--listen=", (*a)->address());
    const std::string shm = absl::StrCat("--shm-dir=", (*a)->shm_dir());
    ::execl(KVHOSTD_PATH, KVHOSTD_PATH, listen.c_str(), shm.c_str(), "--backend=host",
            static_cast<char*>(nullptr));
    ::_exit(127);
  }
  ClientOptions options;
  options.address = (*a)->address();
  absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect(options);
  ASSERT_TRUE(c.ok()) << c.status();
  absl::Status ready = (*c)->WaitForReady(absl::Seconds(20));
  EXPECT_TRUE(ready.ok()) << ready;
  if (ready.ok()) {
    EXPECT_FALSE(fs::exists(pool->region_paths(0))) << "stale region file not removed";
    absl::StatusOr<std::vector<v1::Pool>> pools = (*c)->ListPools();
    ASSERT_TRUE(pools.ok()) << pools.status();
    EXPECT_TRUE(pools->empty());
    absl::StatusOr<v1::Pool> again = (*c)->CreatePool("p", MhaSpec(4, 64));
    EXPECT_TRUE(again.ok()) << again.status();
    // A third daemon on the live socket refuses to start.
    auto [code, out] =
        RunCommand(absl::StrCat("'", KVHOSTD_PATH, "' --backend=host --listen=", (*a)->address(),
                                " --shm-dir=", (*a)->shm_dir()));
    EXPECT_NE(code, 0) << out;
    EXPECT_NE(code, 124) << "a second daemon on a live socket kept running";
    EXPECT_TRUE(absl::StrContains(out, "already")) << out;
  }
  ::kill(b, SIGINT);  // SIGINT drains and exits 0 like SIGTERM
  int status = 0;
  ::waitpid(b, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "status " << status;
  EXPECT_FALSE(fs::exists(socket));
  EXPECT_TRUE(RegionFiles((*a)->shm_dir()).empty());
}

}  // namespace
}  // namespace kvhost
