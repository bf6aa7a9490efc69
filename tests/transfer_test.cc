// Tests of the transfer path: index runs (server/transfer/runs.h), the
// piece iterator every engine uses (ForEachPiece, server/transfer/engine.h),
// the host engine (server/transfer/host_engine.h) and the manager's
// validation (server/transfer/transfer_manager.h).
//
// Every copy is checked byte for byte against a naive reference that moves one
// (token, head) at a time with KvLayout::Offset, so a wrong merge of tokens
// into ranges, a wrong split over threads or a wrong plane / layer base shows
// up as a byte mismatch. Pools and emulated device pools live in a private
// directory under /dev/shm.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <deque>
#include <filesystem>
#include <functional>
#include <memory>
#include <ostream>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "kvhost/layout.h"
#include "server/pool/pool.h"
#include "server/pool/pool_spec.h"
#include "server/pool/registry.h"
#include "server/pool/shm_region.h"
#include "server/transfer/engine.h"
#include "server/transfer/host_engine.h"
#include "server/transfer/runs.h"
#include "server/transfer/ticket.h"
#include "server/transfer/transfer_manager.h"

namespace kvhost {

// For gtest (found by ADL, so in IndexRun's namespace).
bool operator==(const IndexRun& a, const IndexRun& b) {
  return a.host == b.host && a.device == b.device && a.count == b.count;
}
void PrintTo(const IndexRun& r, std::ostream* os) {
  *os << "{host " << r.host << ", device " << r.device << ", count " << r.count << "}";
}

namespace {

using ::testing::HasSubstr;
namespace fs = std::filesystem;

std::string Msg(const absl::Status& s) { return std::string(s.message()); }

// ============================================================ runs

TEST(CoalesceRunsTest, MergesOnlyWhereBothSidesStepByOne) {
  using R = std::vector<IndexRun>;
  EXPECT_EQ(CoalesceRuns({}, {}), R{});
  EXPECT_EQ(CoalesceRuns({7}, {3}), (R{{7, 3, 1}}));
  EXPECT_EQ(CoalesceRuns({0, 1, 2, 3}, {10, 11, 12, 13}), (R{{0, 10, 4}}));
  // Host steps, device does not (and the other way round).
  EXPECT_EQ(CoalesceRuns({0, 1, 2}, {10, 11, 13}), (R{{0, 10, 2}, {2, 13, 1}}));
  EXPECT_EQ(CoalesceRuns({0, 2, 3}, {10, 11, 12}), (R{{0, 10, 1}, {2, 11, 2}}));
  // Same index twice, or descending: no merge.
  EXPECT_EQ(CoalesceRuns({5, 5}, {1, 2}), (R{{5, 1, 1}, {5, 2, 1}}));
  EXPECT_EQ(CoalesceRuns({3, 2, 1}, {3, 2, 1}), (R{{3, 3, 1}, {2, 2, 1}, {1, 1, 1}}));
  // Request order is kept, even where sorting would merge.
  EXPECT_EQ(CoalesceRuns({4, 5, 0, 1, 2, 6}, {4, 5, 0, 1, 2, 6}),
            (R{{4, 4, 2}, {0, 0, 3}, {6, 6, 1}}));
  EXPECT_EQ(CoalesceRuns({100, 101, 102, 50, 51}, {0, 1, 2, 3, 4}), (R{{100, 0, 3}, {50, 3, 2}}));
}

TEST(CoalesceRunsTest, RunsCoverTheRequestExactly) {
  std::mt19937_64 rng(5);
  for (int round = 0; round < 200; ++round) {
    std::vector<int64_t> host, device;
    int64_t h = static_cast<int64_t>(rng() % 100), d = static_cast<int64_t>(rng() % 100);
    for (int i = 0; i < 50; ++i) {
      if (rng() % 3 == 0) h = static_cast<int64_t>(rng() % 100);
      if (rng() % 3 == 0) d = static_cast<int64_t>(rng() % 100);
      host.push_back(h++);
      device.push_back(d++);
    }
    std::vector<IndexRun> runs = CoalesceRuns(host, device);
    size_t i = 0;
    for (size_t r = 0; r < runs.size(); ++r) {
      ASSERT_GE(runs[r].count, 1u);
      for (uint64_t k = 0; k < runs[r].count; ++k, ++i) {
        ASSERT_LT(i, host.size());
        ASSERT_EQ(static_cast<int64_t>(runs[r].host + k), host[i]);
        ASSERT_EQ(static_cast<int64_t>(runs[r].device + k), device[i]);
      }
      // Maximal: the next run could not have been appended.
      if (r + 1 < runs.size()) {
        ASSERT_FALSE(runs[r].host + runs[r].count == runs[r + 1].host &&
                     runs[r].device + runs[r].count == runs[r + 1].device);
      }
    }
    ASSERT_EQ(i, host.size());
  }
}

TEST(CheckNoOverlapTest, FindsRepeatedDestinations) {
  // Host side: 5..7 and 7..8 share slot 7; the device side does not repeat.
  std::vector<IndexRun> runs = {{5, 0, 3}, {20, 3, 1}, {7, 10, 2}};
  absl::Status s = CheckNoOverlap(runs, /*host_side=*/true, "host slot");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Msg(s), HasSubstr("host slot 7"));
  EXPECT_TRUE(CheckNoOverlap(runs, /*host_side=*/false, "device row").ok());
  // Adjacent is not overlapping.
  EXPECT_TRUE(CheckNoOverlap({{0, 0, 4}, {4, 9, 4}, {8, 4, 1}}, true, "host slot").ok());
  EXPECT_TRUE(CheckNoOverlap({}, true, "host slot").ok());
  // Device side, a run inside another.
  s = CheckNoOverlap({{0, 10, 8}, {50, 12, 2}}, false, "device row");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Msg(s), HasSubstr("device row 12"));
  // Exactly the same slot twice.
  s = CheckNoOverlap({{3, 0, 1}, {3, 1, 1}}, true, "host slot");
  EXPECT_THAT(Msg(s), HasSubstr("host slot 3"));
}

// ============================================================ shapes

struct Shape {
  const char* name;
  PoolKind kind;
  LayoutKind layout;
  uint32_t layers;
  uint32_t heads;     // MHA
  uint32_t head_dim;  // MHA: elements; MLA: kv_lora_rank
  uint32_t page_size;
  uint64_t pages;
};

void PrintTo(const Shape& s, std::ostream* os) { *os << s.name; }

PoolSpec SpecOf(const Shape& s) {
  PoolSpec spec;
  spec.kind = s.kind;
  spec.layout = s.layout;
  spec.dtype = DType::kBf16;
  spec.page_size = s.page_size;
  spec.layer_num = s.layers;
  if (s.kind == PoolKind::kMha) {
    spec.head_num = s.heads;
    spec.head_dim = s.head_dim;
  } else {
    spec.kv_lora_rank = s.head_dim;
    spec.qk_rope_head_dim = 2;
  }
  spec.size_tokens = s.pages * s.page_size;
  return spec;
}

// Every layout of each kind, plus the degenerate shapes where whole runs of
// tokens are contiguous (one layer, one head).
std::vector<Shape> AllShapes() {
  std::vector<Shape> out;
  const struct {
    LayoutKind l;
    const char* n;
  } layouts[] = {{LayoutKind::kLayerFirst, "LayerFirst"},
                 {LayoutKind::kPageFirst, "PageFirst"},
                 {LayoutKind::kPageFirstDirect, "PageFirstDirect"},
                 {LayoutKind::kPageHead, "PageHead"}};
  static std::deque<std::string> names;  // keeps the c_str()s alive
  for (const auto& l : layouts) {
    names.push_back(absl::StrCat("Mha", l.n));
    out.push_back({names.back().c_str(), PoolKind::kMha, l.l, 3, 3, 5, 4, 16});
    names.push_back(absl::StrCat("Mha", l.n, "OneLayerOneHead"));
    out.push_back({names.back().c_str(), PoolKind::kMha, l.l, 1, 1, 4, 8, 8});
    names.push_back(absl::StrCat("Mha", l.n, "OneLayer"));
    out.push_back({names.back().c_str(), PoolKind::kMha, l.l, 1, 4, 2, 5, 10});
    if (l.l == LayoutKind::kPageHead) continue;  // MLA has no PAGE_HEAD
    names.push_back(absl::StrCat("Mla", l.n));
    out.push_back({names.back().c_str(), PoolKind::kMla, l.l, 3, 1, 6, 4, 16});
    names.push_back(absl::StrCat("Mla", l.n, "OneLayer"));
    out.push_back({names.back().c_str(), PoolKind::kMla, l.l, 1, 1, 3, 16, 4});
  }
  return out;
}

// A random transfer: `n` distinct host slots in [0, tokens) paired with `n`
// distinct device rows in [0, rows), made of random-length consecutive
// stretches on each side so that runs form, cross pages and break.
std::pair<std::vector<int64_t>, std::vector<int64_t>> RandomPairs(std::mt19937_64& rng,
                                                                  uint64_t tokens, uint64_t rows,
                                                                  uint64_t n) {
  auto stretches = [&rng](uint64_t limit) {
    std::vector<std::vector<int64_t>> blocks;
    for (uint64_t t = 0; t < limit;) {
      const uint64_t len = std::min<uint64_t>(limit - t, 1 + rng() % 11);
      std::vector<int64_t> b;
      for (uint64_t k = 0; k < len; ++k) b.push_back(static_cast<int64_t>(t + k));
      blocks.push_back(std::move(b));
      t += len;
    }
    std::shuffle(blocks.begin(), blocks.end(), rng);
    std::vector<int64_t> flat;
    for (auto& b : blocks) flat.insert(flat.end(), b.begin(), b.end());
    return flat;
  };
  std::vector<int64_t> host = stretches(tokens), device = stretches(rows);
  n = std::min<uint64_t>({n, host.size(), device.size()});
  host.resize(n);
  device.resize(n);
  return {host, device};
}

std::vector<uint8_t> RandomBytes(std::mt19937_64& rng, uint64_t n) {
  std::vector<uint8_t> v(n);
  for (uint64_t i = 0; i < n; i += 8) {
    const uint64_t word = rng();
    std::memcpy(v.data() + i, &word, std::min<uint64_t>(8, n - i));
  }
  return v;
}

// The reference: one head of one token at a time, addressed by KvLayout::Offset.
// `device(plane, layer)` is that layer's row buffer.
template <typename DeviceFn>
void NaiveCopy(const KvLayout& layout, uint8_t* host, DeviceFn&& device,
               const std::vector<int64_t>& host_idx, const std::vector<int64_t>& dev_idx,
               bool backup) {
  for (uint64_t plane = 0; plane < layout.planes; ++plane) {
    for (uint64_t layer = 0; layer < layout.layers; ++layer) {
      uint8_t* dev = device(plane, layer);
      for (size_t i = 0; i < host_idx.size(); ++i) {
        for (uint64_t h = 0; h < layout.heads; ++h) {
          uint8_t* hp = host + layout.Offset(plane, static_cast<uint64_t>(host_idx[i]), layer, h);
          uint8_t* dp =
              dev + static_cast<uint64_t>(dev_idx[i]) * layout.token_bytes + h * layout.head_bytes;
          if (backup) {
            std::memcpy(hp, dp, layout.head_bytes);
          } else {
            std::memcpy(dp, hp, layout.head_bytes);
          }
        }
      }
    }
  }
}

// First differing byte, for readable failures.
::testing::AssertionResult SameBytes(const uint8_t* got, const uint8_t* want, uint64_t n) {
  if (std::memcmp(got, want, n) == 0) return ::testing::AssertionSuccess();
  for (uint64_t i = 0; i < n; ++i) {
    if (got[i] != want[i]) {
      return ::testing::AssertionFailure()
             << "byte " << i << " of " << n << " is " << int{got[i]} << ", want " << int{want[i]};
    }
  }
  return ::testing::AssertionSuccess();
}

// ============================================================ ForEachPiece

class ForEachPieceTest : public ::testing::TestWithParam<Shape> {};

TEST_P(ForEachPieceTest, MatchesNaivePerHeadCopy) {
  const Shape& shape = GetParam();
  const PoolSpec spec = SpecOf(shape);
  ASSERT_TRUE(ValidateSpec(spec).ok());
  const uint64_t tokens = shape.pages * shape.page_size;
  const KvLayout layout = MakeKvLayout(spec, tokens);
  const uint64_t rows = tokens + 7;  // device pool of a different size
  const uint64_t layer_bytes = rows * layout.token_bytes;
  std::mt19937_64 rng(std::hash<std::string>()(shape.name));

  for (int round = 0; round < 12; ++round) {
    for (bool backup : {true, false}) {
      auto [host_idx, dev_idx] = RandomPairs(rng, tokens, rows, 1 + rng() % tokens);
      std::vector<IndexRun> runs = CoalesceRuns(host_idx, dev_idx);
      std::vector<uint8_t> host = RandomBytes(rng, layout.total_bytes());
      std::vector<uint8_t> dev = RandomBytes(rng, layout.planes * layout.layers * layer_bytes);
      std::vector<uint8_t> want_host = host, want_dev = dev;
      auto dev_layer = [&](std::vector<uint8_t>& buf) {
        return [&buf, &layout, layer_bytes](uint64_t plane, uint64_t layer) {
          return buf.data() + (plane * layout.layers + layer) * layer_bytes;
        };
      };
      NaiveCopy(layout, want_host.data(), dev_layer(want_dev), host_idx, dev_idx, backup);

      uint64_t copied = 0;
      for (uint64_t plane = 0; plane < layout.planes; ++plane) {
        for (uint64_t layer = 0; layer < layout.layers; ++layer) {
          uint8_t* d = dev_layer(dev)(plane, layer);
          for (const IndexRun& run : runs) {
            // Two calls over a random cut: pieces of [0, k) and [k, count).
            const uint64_t k = rng() % (run.count + 1);
            for (auto [from, to] : {std::pair<uint64_t, uint64_t>{0, k}, {k, run.count}}) {
              uint64_t pieces = 0;
              ForEachPiece(layout, plane, layer, run, from, to,
                           [&](uint64_t host_off, uint64_t dev_off, uint64_t bytes) {
                             ASSERT_GT(bytes, 0u);
                             ASSERT_LE(host_off + bytes, host.size());
                             ASSERT_LE(dev_off + bytes, layer_bytes);
                             if (backup) {
                               std::memcpy(host.data() + host_off, d + dev_off, bytes);
                             } else {
                               std::memcpy(d + dev_off, host.data() + host_off, bytes);
                             }
                             copied += bytes;
                             ++pieces;
                           });
              if (to > from && layout.kind == LayoutKind::kLayerFirst) {
                EXPECT_EQ(pieces, 1u) << "LAYER_FIRST rows of a run are one range";
              }
              if (!layout.RowContiguous()) {
                EXPECT_EQ(pieces, (to - from) * layout.heads);
              }
            }
          }
        }
      }
      EXPECT_EQ(copied, host_idx.size() * layout.token_bytes * layout.planes * layout.layers);
      ASSERT_TRUE(SameBytes(host.data(), want_host.data(), host.size()))
          << (backup ? "backup" : "load") << " round " << round;
      ASSERT_TRUE(SameBytes(dev.data(), want_dev.data(), dev.size()))
          << (backup ? "backup" : "load") << " round " << round;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, ForEachPieceTest, ::testing::ValuesIn(AllShapes()),
                         [](const ::testing::TestParamInfo<Shape>& info) {
                           return std::string(info.param.name);
                         });

// ============================================================ HostEngine

// A private directory under /dev/shm, removed with everything in it.
class ShmDir {
 public:
  ShmDir() {
    char tmpl[] = "/dev/shm/kvhost-transfer-test-XXXXXX";
    if (::mkdtemp(tmpl) != nullptr) path_ = tmpl;
  }
  ~ShmDir() {
    std::error_code ec;
    if (!path_.empty()) fs::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// An emulated device pool like kvhost::ShmDevicePool: per plane and layer,
// `rows` rows of the pool's row size, back to back, in one file.
struct DeviceFile {
  std::unique_ptr<ShmRegion> region;
  uint64_t layers = 0, rows = 0, row_bytes = 0;

  static DeviceFile Create(const std::string& path, const KvLayout& layout, uint64_t rows,
                           uint64_t lead = 0) {
    DeviceFile f;
    f.layers = layout.layers;
    f.rows = rows;
    f.row_bytes = layout.token_bytes;
    absl::StatusOr<std::unique_ptr<ShmRegion>> r =
        ShmRegion::Create(path, lead + layout.planes * layout.layers * rows * layout.token_bytes);
    if (r.ok()) f.region = *std::move(r);
    return f;
  }
  uint64_t LayerOffset(uint64_t plane, uint64_t layer) const {
    return (plane * layers + layer) * rows * row_bytes;
  }
  AttachRequest Request(uint64_t planes, uint64_t lead = 0) const {
    AttachRequest req;
    req.device_size_tokens = rows;
    for (uint64_t l = 0; l < layers; ++l) {
      req.k_layers.push_back(
          {DeviceBufferRef::Kind::kShm, region->path(), "", "", lead + LayerOffset(0, l)});
      if (planes == 2) {
        req.v_layers.push_back(
            {DeviceBufferRef::Kind::kShm, region->path(), "", "", lead + LayerOffset(1, l)});
      }
    }
    return req;
  }
};

// `request` resolved against `pool`, as TransferManager::Attach does before
// the engine's Open.
AttachRequest Resolved(const Pool& pool, const AttachRequest& request) {
  absl::StatusOr<AttachRequest> resolved = ResolveAttachRequest(pool, request);
  EXPECT_TRUE(resolved.ok()) << resolved.status();
  return resolved.ok() ? *std::move(resolved) : AttachRequest();
}

// Ticket layers of an attachment of exactly the pool's layers.
std::vector<JobLayer> AllLayers(const Pool& pool) {
  std::vector<JobLayer> layers;
  for (uint32_t l = 0; l < pool.spec().layer_num; ++l)
    layers.push_back({static_cast<int32_t>(l), l});
  return layers;
}

struct EngineCase {
  Shape shape;
  int helper_threads;
  uint64_t min_split_bytes;
  uint64_t transfer_tokens;  // pairs per job
};

void PrintTo(const EngineCase& c, std::ostream* os) {
  *os << c.shape.name << "/helpers" << c.helper_threads << "/split" << c.min_split_bytes;
}

class HostEngineTest : public ::testing::TestWithParam<EngineCase> {};

TEST_P(HostEngineTest, BackupAndLoadAreExact) {
  const EngineCase& c = GetParam();
  ShmDir dir;
  ASSERT_FALSE(dir.path().empty());
  const PoolSpec spec = SpecOf(c.shape);
  ASSERT_TRUE(ValidateSpec(spec).ok());
  const uint64_t tokens = *ResolveSizeTokens(spec);
  absl::StatusOr<std::shared_ptr<Pool>> pool =
      Pool::Create("p", spec, tokens, absl::StrCat(dir.path(), "/kvhost.", ::getpid(), "."));
  ASSERT_TRUE(pool.ok()) << pool.status();
  const KvLayout& layout = (*pool)->layout();
  const uint64_t rows = tokens / 2 + 3;
  const uint64_t lead = 64;  // layers need not start at the file's start
  DeviceFile dev = DeviceFile::Create(dir.path() + "/device", layout, rows, lead);
  ASSERT_NE(dev.region, nullptr);

  HostEngineOptions options;
  options.shm_dir = dir.path();
  options.helper_threads = c.helper_threads;
  options.min_split_bytes = c.min_split_bytes;
  HostEngine engine(options);
  absl::StatusOr<std::unique_ptr<DeviceMapping>> opened =
      engine.Open(**pool, Resolved(**pool, dev.Request(layout.planes, lead)));
  ASSERT_TRUE(opened.ok()) << opened.status();
  std::shared_ptr<const DeviceMapping> mapping = *std::move(opened);
  ASSERT_EQ(mapping->component_count(), layout.planes);
  for (uint64_t plane = 0; plane < layout.planes; ++plane) {
    EXPECT_EQ(mapping->rows(plane).rows, rows);
    EXPECT_EQ(mapping->rows(plane).row_bytes, layout.token_bytes);
  }

  uint8_t* host = (*pool)->base();
  uint8_t* device = dev.region->data() + lead;
  const uint64_t host_bytes = layout.total_bytes();
  const uint64_t dev_bytes = layout.planes * layout.layers * rows * layout.token_bytes;
  std::mt19937_64 rng(std::hash<std::string>()(c.shape.name) + c.helper_threads);
  uint64_t next_id = 1;

  for (int round = 0; round < 4; ++round) {
    for (Direction dir_kind : {Direction::kBackup, Direction::kLoad}) {
      const bool backup = dir_kind == Direction::kBackup;
      auto [host_idx, dev_idx] = RandomPairs(rng, tokens, rows, c.transfer_tokens);
      std::vector<uint8_t> h0 = RandomBytes(rng, host_bytes);
      std::vector<uint8_t> d0 = RandomBytes(rng, dev_bytes);
      std::memcpy(host, h0.data(), host_bytes);
      std::memcpy(device, d0.data(), dev_bytes);
      NaiveCopy(
          layout, h0.data(),
          [&](uint64_t plane, uint64_t layer) { return d0.data() + dev.LayerOffset(plane, layer); },
          host_idx, dev_idx, backup);

      TransferJob job;
      job.direction = dir_kind;
      job.pool = *pool;
      job.device = mapping;
      job.runs = CoalesceRuns(host_idx, dev_idx);
      job.tokens = host_idx.size();
      job.layers = AllLayers(**pool);
      job.ticket = std::make_shared<TransferTicket>(
          next_id++, dir_kind, static_cast<uint32_t>(layout.layers), engine.PathFor(job));
      std::shared_ptr<TransferTicket> ticket = job.ticket;
      std::atomic<int> callbacks{0};
      ticket->OnDone([&callbacks] { ++callbacks; });
      engine.Submit(std::move(job));
      ASSERT_TRUE(ticket->WaitUntil(absl::Now() + absl::Seconds(30)));
      const TicketStatus st = ticket->Snapshot();
      EXPECT_TRUE(st.done);
      EXPECT_TRUE(st.status.ok()) << st.status;
      EXPECT_EQ(st.layers_done, layout.layers);
      EXPECT_EQ(st.layer_num, layout.layers);
      EXPECT_EQ(st.bytes, host_idx.size() * layout.token_bytes * layout.planes * layout.layers);
      EXPECT_EQ(st.path, "host-memcpy");
      // Callbacks run on the finishing thread after waiters wake; Drain
      // returns only once the job, callbacks included, is over.
      engine.Drain();
      EXPECT_EQ(callbacks.load(), 1);
      ASSERT_TRUE(SameBytes(host, h0.data(), host_bytes))
          << (backup ? "backup" : "load") << " round " << round << " host";
      ASSERT_TRUE(SameBytes(device, d0.data(), dev_bytes))
          << (backup ? "backup" : "load") << " round " << round << " device";
    }
  }
}

std::vector<EngineCase> EngineCases() {
  std::vector<EngineCase> out;
  for (const Shape& s : AllShapes()) {
    // Default split: these small jobs run on the driver alone.
    out.push_back({s, 2, uint64_t{1} << 20, 1u << 30});
    // Tiny split size: every job fans out over all helpers, with cuts inside runs.
    out.push_back({s, 3, 1, 1u << 30});
  }
  // Large jobs split across threads (hundreds of KB per layer).
  out.push_back({{"MhaLayerFirstLarge", PoolKind::kMha, LayoutKind::kLayerFirst, 4, 8, 64, 16, 256},
                 4,
                 4096,
                 6000});
  out.push_back({{"MhaPageHeadLarge", PoolKind::kMha, LayoutKind::kPageHead, 4, 8, 64, 16, 256},
                 4,
                 4096,
                 6000});
  out.push_back(
      {{"MlaPageFirstDirectLarge", PoolKind::kMla, LayoutKind::kPageFirstDirect, 6, 1, 510, 64, 64},
       3,
       8192,
       5000});
  out.push_back(
      {{"MhaNoHelpers", PoolKind::kMha, LayoutKind::kPageFirst, 2, 2, 16, 8, 64}, 0, 1, 400});
  return out;
}

INSTANTIATE_TEST_SUITE_P(Cases, HostEngineTest, ::testing::ValuesIn(EngineCases()),
                         [](const ::testing::TestParamInfo<EngineCase>& info) {
                           return absl::StrCat(info.param.shape.name, "_h",
                                               info.param.helper_threads, "_s",
                                               info.param.min_split_bytes);
                         });

// Fixture for single-shape engine and manager tests.
class EngineFixture : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_FALSE(dir_.path().empty());
    spec_ = SpecOf({"m", PoolKind::kMha, LayoutKind::kPageFirst, 2, 2, 8, 4, 16});
    tokens_ = *ResolveSizeTokens(spec_);
    absl::StatusOr<std::shared_ptr<Pool>> pool =
        Pool::Create("p", spec_, tokens_, absl::StrCat(dir_.path(), "/kvhost.", ::getpid(), "."));
    ASSERT_TRUE(pool.ok()) << pool.status();
    pool_ = *pool;
    dev_ = DeviceFile::Create(dir_.path() + "/device", pool_->layout(), kRows);
    ASSERT_NE(dev_.region, nullptr);
  }
  HostEngineOptions Options() const {
    HostEngineOptions o;
    o.shm_dir = dir_.path();
    return o;
  }
  // A device row's bytes of one layer and plane.
  uint8_t* DeviceRow(uint64_t plane, uint64_t layer, uint64_t row) {
    return dev_.region->data() + dev_.LayerOffset(plane, layer) + row * dev_.row_bytes;
  }
  uint8_t* HostRow(uint64_t plane, uint64_t layer, uint64_t slot) {
    return pool_->base() + pool_->layout().Offset(plane, slot, layer, 0);
  }

  static constexpr uint64_t kRows = 40;
  ShmDir dir_;
  PoolSpec spec_;
  uint64_t tokens_ = 0;
  std::shared_ptr<Pool> pool_;
  DeviceFile dev_;
};

TEST_F(EngineFixture, JobsOfOneDirectionRunInOrderAndDrainWaits) {
  HostEngine engine(Options());
  absl::StatusOr<std::unique_ptr<DeviceMapping>> opened =
      engine.Open(*pool_, Resolved(*pool_, dev_.Request(pool_->layout().planes)));
  ASSERT_TRUE(opened.ok()) << opened.status();
  std::shared_ptr<const DeviceMapping> mapping = *std::move(opened);
  const KvLayout& layout = pool_->layout();
  // Device row r holds the byte r everywhere.
  for (uint64_t plane = 0; plane < layout.planes; ++plane) {
    for (uint64_t layer = 0; layer < layout.layers; ++layer) {
      for (uint64_t r = 0; r < kRows; ++r) {
        std::memset(DeviceRow(plane, layer, r), static_cast<int>(r), dev_.row_bytes);
      }
    }
  }
  // 30 backups into host slots 0..15 from rows j..j+15: the last one wins.
  std::vector<std::shared_ptr<TransferTicket>> tickets;
  for (uint64_t j = 0; j < 30; ++j) {
    std::vector<int64_t> host, device;
    for (int64_t k = 0; k < 16; ++k) {
      host.push_back(k);
      device.push_back(static_cast<int64_t>((j + k) % kRows));
    }
    TransferJob job;
    job.direction = Direction::kBackup;
    job.pool = pool_;
    job.device = mapping;
    job.runs = CoalesceRuns(host, device);
    job.tokens = 16;
    job.layers = AllLayers(*pool_);
    job.ticket = std::make_shared<TransferTicket>(j + 1, Direction::kBackup, layout.layers, "x");
    tickets.push_back(job.ticket);
    engine.Submit(std::move(job));
  }
  engine.Drain();
  for (const auto& t : tickets) {
    const TicketStatus st = t->Snapshot();
    EXPECT_TRUE(st.done) << "ticket " << st.id << " not done after Drain";
    EXPECT_TRUE(st.status.ok());
  }
  for (uint64_t plane = 0; plane < layout.planes; ++plane) {
    for (uint64_t layer = 0; layer < layout.layers; ++layer) {
      for (uint64_t k = 0; k < 16; ++k) {
        const uint8_t want = static_cast<uint8_t>((29 + k) % kRows);
        std::vector<uint8_t> row(HostRow(plane, layer, k),
                                 HostRow(plane, layer, k) + dev_.row_bytes);
        EXPECT_EQ(row, std::vector<uint8_t>(dev_.row_bytes, want))
            << "plane " << plane << " layer " << layer << " slot " << k;
      }
    }
  }
  // Drain with nothing queued returns at once.
  engine.Drain();
}

TEST_F(EngineFixture, OpenRefusesBadBuffers) {
  HostEngine engine(Options());
  const uint64_t planes = pool_->layout().planes;
  // Outside the shm dir.
  AttachRequest req = dev_.Request(planes);
  req.k_layers[1].shm_path = "/etc/hostname";
  absl::StatusOr<std::unique_ptr<DeviceMapping>> m = engine.Open(*pool_, Resolved(*pool_, req));
  EXPECT_EQ(m.status().code(), absl::StatusCode::kPermissionDenied) << m.status();
  EXPECT_THAT(Msg(m.status()), HasSubstr("k_layers[1]"));
  // Missing file.
  req = dev_.Request(planes);
  req.v_layers[0].shm_path = dir_.path() + "/missing";
  m = engine.Open(*pool_, Resolved(*pool_, req));
  EXPECT_EQ(m.status().code(), absl::StatusCode::kNotFound) << m.status();
  EXPECT_THAT(Msg(m.status()), HasSubstr("v_layers[0]"));
  // Buffer past the end of the file.
  req = dev_.Request(planes);
  req.v_layers[1].offset += 1;
  m = engine.Open(*pool_, Resolved(*pool_, req));
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument) << m.status();
  EXPECT_THAT(Msg(m.status()), HasSubstr("v_layers[1]"));
  // More rows than the file holds.
  req = dev_.Request(planes);
  req.device_size_tokens = kRows * 10;
  EXPECT_EQ(engine.Open(*pool_, Resolved(*pool_, req)).status().code(),
            absl::StatusCode::kInvalidArgument);
  // A CUDA buffer on the host backend.
  req = dev_.Request(planes);
  req.k_layers[0].kind = DeviceBufferRef::Kind::kCuda;
  EXPECT_EQ(engine.Open(*pool_, Resolved(*pool_, req)).status().code(),
            absl::StatusCode::kFailedPrecondition);
  // The good request opens.
  EXPECT_TRUE(engine.Open(*pool_, Resolved(*pool_, dev_.Request(planes))).ok());
}

// ============================================================ TransferManager

class ManagerTest : public EngineFixture {
 protected:
  void SetUp() override {
    EngineFixture::SetUp();
    RegistryOptions o;
    o.shm_dir = dir_.path();
    o.read_memory = []() -> absl::StatusOr<MemorySnapshot> {
      MemorySnapshot s;
      s.mem_total = uint64_t{1} << 40;
      s.mem_available = uint64_t{1} << 39;
      return s;
    };
    registry_ = std::make_unique<PoolRegistry>(o);
    absl::StatusOr<std::shared_ptr<Pool>> pool = registry_->Create("llama", spec_);
    ASSERT_TRUE(pool.ok()) << pool.status();
    pool_ = *pool;  // the registry's pool; the device file matches its layout
    manager_ =
        std::make_unique<TransferManager>(registry_.get(), std::make_unique<HostEngine>(Options()));
    absl::StatusOr<AttachmentInfo> att =
        manager_->Attach("llama", dev_.Request(pool_->layout().planes));
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
      EXPECT_EQ(manager_->FindTicket(id).status().code(), absl::StatusCode::kNotFound) << id;
    }
  }

  std::unique_ptr<PoolRegistry> registry_;
  std::unique_ptr<TransferManager> manager_;
  std::string att_;
};

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
    absl::StatusOr<std::shared_ptr<TransferTicket>> t =
        manager_->Submit(b.att, b.dir, b.host, b.device);
    EXPECT_EQ(t.status().code(), b.code) << b.what << ": " << t.status();
    EXPECT_THAT(Msg(t.status()), HasSubstr(b.message)) << b.what;
  }
  ExpectNoTickets();
  // A load may read one host slot twice (only destinations must be unique).
  absl::StatusOr<std::shared_ptr<TransferTicket>> ok =
      manager_->Submit(att_, Direction::kLoad, {3, 3}, {0, 1});
  ASSERT_TRUE(ok.ok()) << ok.status();
  ASSERT_TRUE((*ok)->WaitUntil(absl::Now() + absl::Seconds(30)));
  EXPECT_TRUE((*ok)->Snapshot().status.ok());
  EXPECT_TRUE(manager_->FindTicket((*ok)->id()).ok());
}

TEST_F(ManagerTest, RoundTripThroughThePool) {
  const KvLayout& layout = pool_->layout();
  absl::StatusOr<std::vector<uint64_t>> pages = pool_->AllocPages(12);  // pages 0..2
  ASSERT_TRUE(pages.ok());
  std::mt19937_64 rng(9);
  std::vector<uint8_t> original = RandomBytes(rng, dev_.region->size());
  std::memcpy(dev_.region->data(), original.data(), original.size());
  // Device rows 20..31 -> host slots 8..11, 0..7 (two runs), then back to rows 0..11.
  std::vector<int64_t> host = {8, 9, 10, 11, 0, 1, 2, 3, 4, 5, 6, 7};
  std::vector<int64_t> from(12), to(12);
  for (int i = 0; i < 12; ++i) from[i] = 20 + i, to[i] = i;
  absl::StatusOr<std::shared_ptr<TransferTicket>> b =
      manager_->Submit(att_, Direction::kBackup, host, from);
  ASSERT_TRUE(b.ok()) << b.status();
  ASSERT_TRUE((*b)->WaitUntil(absl::Now() + absl::Seconds(30)));
  absl::StatusOr<std::shared_ptr<TransferTicket>> l =
      manager_->Submit(att_, Direction::kLoad, host, to);
  ASSERT_TRUE(l.ok()) << l.status();
  ASSERT_TRUE((*l)->WaitUntil(absl::Now() + absl::Seconds(30)));
  EXPECT_NE((*b)->id(), (*l)->id());
  const uint64_t bytes = 12 * layout.token_bytes * layout.planes * layout.layers;
  for (const auto& t : {*b, *l}) {
    const TicketStatus st = t->Snapshot();
    EXPECT_TRUE(st.status.ok()) << st.status;
    EXPECT_EQ(st.bytes, bytes);
    EXPECT_EQ(st.layers_done, layout.layers);
  }
  for (uint64_t plane = 0; plane < layout.planes; ++plane) {
    for (uint64_t layer = 0; layer < layout.layers; ++layer) {
      const uint64_t off = dev_.LayerOffset(plane, layer);
      // Rows 0..11 now equal rows 20..31; rows 12.. untouched.
      EXPECT_TRUE(SameBytes(dev_.region->data() + off, original.data() + off + 20 * dev_.row_bytes,
                            12 * dev_.row_bytes));
      EXPECT_TRUE(SameBytes(dev_.region->data() + off + 12 * dev_.row_bytes,
                            original.data() + off + 12 * dev_.row_bytes,
                            (kRows - 12) * dev_.row_bytes));
    }
  }
  // Counters: each ticket retired once with its bytes. Retiring is a ticket
  // callback, which runs after waiters wake, so wait for it.
  TransferCounters c = manager_->counters();
  for (absl::Time end = absl::Now() + absl::Seconds(10);
       c.tickets_in_flight != 0 && absl::Now() < end; c = manager_->counters()) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_EQ(c.tickets_in_flight, 0u);
  EXPECT_EQ(c.tickets_done, 2u);
  EXPECT_EQ(c.tickets_failed, 0u);
  EXPECT_EQ(c.bytes[static_cast<int>(Direction::kBackup)], bytes);
  EXPECT_EQ(c.bytes[static_cast<int>(Direction::kLoad)], bytes);
  // An empty transfer finishes at once with every layer reported.
  absl::StatusOr<std::shared_ptr<TransferTicket>> empty =
      manager_->Submit(att_, Direction::kBackup, {}, {});
  ASSERT_TRUE(empty.ok());
  const TicketStatus st = (*empty)->Snapshot();
  EXPECT_TRUE(st.done);
  EXPECT_EQ(st.layers_done, layout.layers);
  EXPECT_EQ(st.bytes, 0u);
}

TEST_F(ManagerTest, AttachmentsHoldThePool) {
  EXPECT_EQ(pool_->attachments(), 1u);
  EXPECT_EQ(manager_->ListAttachments().size(), 1u);
  EXPECT_EQ(registry_->Delete("llama").status().code(), absl::StatusCode::kFailedPrecondition);
  // A malformed attach takes no attachment.
  AttachRequest bad = dev_.Request(pool_->layout().planes);
  bad.v_layers.pop_back();
  EXPECT_EQ(manager_->Attach("llama", bad).status().code(), absl::StatusCode::kInvalidArgument);
  bad = dev_.Request(pool_->layout().planes);
  bad.k_layers[0].shm_path = "/etc/hostname";
  EXPECT_EQ(manager_->Attach("llama", bad).status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(manager_->Attach("nope", dev_.Request(2)).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(pool_->attachments(), 1u);

  ASSERT_TRUE(manager_->Detach(att_).ok());
  EXPECT_EQ(manager_->Detach(att_).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(pool_->attachments(), 0u);
  ASSERT_TRUE(pool_->AllocPages(4).ok());
  EXPECT_EQ(manager_->Submit(att_, Direction::kBackup, {0}, {0}).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_TRUE(registry_->Delete("llama").ok());
  ExpectNoTickets();
}

TEST_F(ManagerTest, RefusedAfterDrain) {
  ASSERT_TRUE(pool_->AllocPages(4).ok());
  absl::StatusOr<std::shared_ptr<TransferTicket>> before =
      manager_->Submit(att_, Direction::kBackup, {0, 1, 2, 3}, {0, 1, 2, 3});
  ASSERT_TRUE(before.ok());
  manager_->Drain();
  // Accepted work finished before Drain returned.
  EXPECT_TRUE((*before)->Snapshot().done);
  absl::StatusOr<std::shared_ptr<TransferTicket>> after =
      manager_->Submit(att_, Direction::kLoad, {0, 1, 2, 3}, {0, 1, 2, 3});
  EXPECT_EQ(after.status().code(), absl::StatusCode::kUnavailable) << after.status();
  const TransferCounters c = manager_->counters();
  EXPECT_EQ(c.tickets_done, 1u);
  EXPECT_EQ(c.tickets_in_flight, 0u);
  EXPECT_EQ(manager_->FindTicket((*before)->id() + 1).status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace kvhost
