// The CUDA engine's kernel-path plans (server/transfer/segments.h), checked
// on the CPU: the copy kernel's item decoding (DecodeCopyItem, the same
// function the kernel runs) and the plan's copy-engine copies are replayed
// with memcpy, for backups and loads, every layout, MHA / MLA shapes, page
// sizes 1, 3 and 4, index runs with partial pages, and staging chunks from
// the smallest allowed to larger than the job. The reference is a naive copy
// of every (token, layer, head) at KvLayout::Offset. Also: every staging byte
// a chunk copies is written by exactly one item (so a backup never writes
// stale staging bytes into the pool), no copy crosses a registration chunk,
// and a chunk smaller than a unit is FAILED_PRECONDITION.
#include "server/transfer/segments.h"

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace kvhost {
namespace {

struct Shape {
  LayoutKind kind;
  uint64_t planes;
  uint64_t heads;
  uint64_t page_size;
};

std::string ShapeName(const ::testing::TestParamInfo<Shape>& info) {
  const Shape& s = info.param;
  const char* kind = s.kind == LayoutKind::kLayerFirst        ? "LayerFirst"
                     : s.kind == LayoutKind::kPageFirst       ? "PageFirst"
                     : s.kind == LayoutKind::kPageFirstDirect ? "PageFirstDirect"
                                                              : "PageHead";
  return absl::StrCat(kind, "_planes", s.planes, "_heads", s.heads, "_ps", s.page_size);
}

constexpr uint64_t kLayers = 3;
constexpr uint64_t kHeadBytes = 8;
constexpr uint64_t kPages = 12;

KvLayout LayoutOf(const Shape& s) {
  return KvLayout(s.kind, s.planes, kLayers, kPages * s.page_size, s.page_size, s.heads,
                  kHeadBytes);
}

// Runs with whole pages, partial pages at both ends, singletons and device
// rows out of order; host slots distinct.
std::vector<IndexRun> SomeRuns(const KvLayout& layout, std::mt19937_64& rng) {
  std::vector<uint64_t> host(layout.tokens);
  for (uint64_t i = 0; i < host.size(); ++i) host[i] = i;
  std::shuffle(host.begin(), host.end(), rng);
  std::vector<IndexRun> runs;
  const uint64_t ps = layout.page_size;
  // Two pages and a bit, starting mid-page, then scattered singletons.
  const uint64_t start = ps + ps / 2;
  const uint64_t n = std::min<uint64_t>(2 * ps + 1, layout.tokens - start);
  runs.push_back(IndexRun{start, 7, n});
  runs.push_back(IndexRun{6 * ps, 7 + n + 3, 3 * ps});  // whole pages
  uint64_t device = 200;
  for (uint64_t h : host) {
    if (h < 10 * ps) continue;  // keep clear of the runs above
    runs.push_back(IndexRun{h, device, 1});
    device += 2;
  }
  return runs;
}

struct Buffers {
  std::vector<uint8_t> host;
  std::vector<std::vector<uint8_t>> device;  // plane * layers + layer
};

Buffers MakeBuffers(const KvLayout& layout, uint64_t device_rows, std::mt19937_64& rng) {
  Buffers b;
  b.host.resize(layout.total_bytes());
  for (auto& byte : b.host) byte = static_cast<uint8_t>(rng() | 1);
  b.device.resize(layout.planes * layout.layers);
  for (auto& d : b.device) {
    d.resize(device_rows * layout.token_bytes);
    for (auto& byte : d) byte = static_cast<uint8_t>(rng() | 1);
  }
  return b;
}

// The reference: every (plane, token, layer, head) of every run, one at a time.
void NaiveCopy(const KvLayout& layout, const std::vector<IndexRun>& runs, bool backup, Buffers* b) {
  for (uint64_t p = 0; p < layout.planes; ++p) {
    for (const IndexRun& run : runs) {
      for (uint64_t t = 0; t < run.count; ++t) {
        for (uint64_t l = 0; l < layout.layers; ++l) {
          for (uint64_t h = 0; h < layout.heads; ++h) {
            uint8_t* host = b->host.data() + layout.Offset(p, run.host + t, l, h);
            uint8_t* dev = b->device[p * layout.layers + l].data() +
                           (run.device + t) * layout.token_bytes + h * layout.head_bytes;
            if (backup) {
              std::memcpy(host, dev, layout.head_bytes);
            } else {
              std::memcpy(dev, host, layout.head_bytes);
            }
          }
        }
      }
    }
  }
}

uint64_t MaxDeviceRow(const std::vector<IndexRun>& runs) {
  uint64_t rows = 0;
  for (const IndexRun& r : runs) rows = std::max(rows, r.device + r.count);
  return rows;
}

// Replays one kernel launch over `segments` (items [0, items)) between the
// device buffers and `other`; counts writes into `other` per byte when given.
void ReplayKernel(const KvLayout& layout, const CopySegment* segments, size_t count, uint64_t items,
                  uint32_t layer_shift, uint8_t* other, bool to_device, Buffers* b,
                  std::vector<int>* other_writes, uint64_t other_size) {
  const uint64_t item_bytes = CopyItemBytes(layout);
  for (size_t s = 0; s < count; ++s) {
    const uint64_t end = s + 1 < count ? segments[s + 1].first_item : items;
    ASSERT_EQ(end - segments[s].first_item, SegmentItems(segments[s])) << "segment " << s;
    for (uint64_t r = 0; r < SegmentItems(segments[s]); ++r) {
      const CopyItem item = DecodeCopyItem(layout, segments[s], r, layer_shift);
      const uint64_t other_off = item.host_offset - static_cast<uint64_t>(segments[s].bias);
      ASSERT_LE(other_off + item_bytes, other_size) << "segment " << s << " item " << r;
      ASSERT_LT(item.device_buffer, b->device.size());
      ASSERT_LE(item.device_offset + item_bytes, b->device[item.device_buffer].size());
      uint8_t* dev = b->device[item.device_buffer].data() + item.device_offset;
      if (to_device) {
        std::memcpy(dev, other + other_off, item_bytes);
      } else {
        std::memcpy(other + other_off, dev, item_bytes);
        if (other_writes != nullptr) {
          for (uint64_t i = 0; i < item_bytes; ++i) ++(*other_writes)[other_off + i];
        }
      }
    }
  }
}

class SegmentsTest : public ::testing::TestWithParam<Shape> {};

TEST_P(SegmentsTest, StagedPlanMovesExactlyTheRunsBytes) {
  const KvLayout layout = LayoutOf(GetParam());
  std::mt19937_64 rng(7);
  const std::vector<IndexRun> runs = SomeRuns(layout, rng);
  const uint64_t unit = StagedUnitBytes(layout);
  const uint64_t rows = MaxDeviceRow(runs);
  for (const uint64_t chunk : {unit, 3 * unit + 5, uint64_t{1} << 20}) {
    // A registration split inside the pool, so that some copies are cut.
    const uint64_t split = std::max<uint64_t>(64, layout.total_bytes() / 5);
    StagedPlan plan;
    ASSERT_TRUE(PlanStaged(layout, runs, chunk, split, &plan).ok());
    for (const bool backup : {true, false}) {
      SCOPED_TRACE(absl::StrCat("chunk ", chunk, backup ? " backup" : " load"));
      Buffers got = MakeBuffers(layout, rows, rng);
      Buffers want = got;
      NaiveCopy(layout, runs, backup, &want);
      std::vector<uint8_t> staging(chunk);
      for (const StagedChunk& c : plan.chunks) {
        ASSERT_LE(c.bytes, chunk);
        std::fill(staging.begin(), staging.end(), 0);
        std::vector<int> writes(chunk, 0);
        if (!backup) {
          for (size_t i = c.copy_begin; i < c.copy_end; ++i) {
            const StagedCopy& cp = plan.copies[i];
            std::memcpy(staging.data() + cp.staging_offset, got.host.data() + cp.host_offset,
                        cp.bytes);
          }
        }
        ReplayKernel(layout, plan.segments.data() + c.segment_begin,
                     c.segment_end - c.segment_begin, c.items, 0, staging.data(), !backup, &got,
                     &writes, chunk);
        if (HasFatalFailure()) return;
        for (size_t i = c.copy_begin; i < c.copy_end; ++i) {
          const StagedCopy& cp = plan.copies[i];
          EXPECT_EQ(cp.host_offset / split, (cp.host_offset + cp.bytes - 1) / split)
              << "copy crosses a registration chunk";
          if (backup) {
            for (uint64_t k = 0; k < cp.bytes; ++k) {
              ASSERT_EQ(writes[cp.staging_offset + k], 1)
                  << "staging byte " << cp.staging_offset + k << " copied to the pool but written "
                  << writes[cp.staging_offset + k] << " times";
            }
            std::memcpy(got.host.data() + cp.host_offset, staging.data() + cp.staging_offset,
                        cp.bytes);
          }
        }
      }
      EXPECT_TRUE(got.host == want.host);
      EXPECT_TRUE(got.device == want.device);
    }
  }
}

TEST_P(SegmentsTest, DirectPlanPerLayerMovesExactlyTheRunsBytes) {
  const KvLayout layout = LayoutOf(GetParam());
  std::mt19937_64 rng(11);
  const std::vector<IndexRun> runs = SomeRuns(layout, rng);
  const DirectPlan plan = PlanDirect(layout, runs);
  for (const bool backup : {true, false}) {
    Buffers got = MakeBuffers(layout, MaxDeviceRow(runs), rng);
    Buffers want = got;
    NaiveCopy(layout, runs, backup, &want);
    for (uint32_t l = 0; l < layout.layers; ++l) {
      ReplayKernel(layout, plan.segments.data(), plan.segments.size(), plan.items_per_layer, l,
                   got.host.data(), !backup, &got, nullptr, got.host.size());
      if (HasFatalFailure()) return;
    }
    EXPECT_TRUE(got.host == want.host) << (backup ? "backup" : "load");
    EXPECT_TRUE(got.device == want.device) << (backup ? "backup" : "load");
  }
}

TEST_P(SegmentsTest, ChunkSmallerThanAUnitIsRefused) {
  const KvLayout layout = LayoutOf(GetParam());
  std::mt19937_64 rng(3);
  StagedPlan plan;
  const absl::Status s =
      PlanStaged(layout, SomeRuns(layout, rng), StagedUnitBytes(layout) - 1, 1 << 30, &plan);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("--staging-bytes"), std::string::npos) << s;
}

std::vector<Shape> Shapes() {
  std::vector<Shape> shapes;
  for (LayoutKind kind : {LayoutKind::kLayerFirst, LayoutKind::kPageFirst,
                          LayoutKind::kPageFirstDirect, LayoutKind::kPageHead}) {
    for (uint64_t ps : {1, 3, 4}) {
      shapes.push_back(Shape{kind, 2, 3, ps});  // MHA-like, K and V
      shapes.push_back(Shape{kind, 1, 1, ps});  // MLA-like latent
    }
  }
  return shapes;
}

INSTANTIATE_TEST_SUITE_P(AllLayouts, SegmentsTest, ::testing::ValuesIn(Shapes()), ShapeName);

TEST(CopyEnginePiecesTest, CountsLayoutContiguousPieces) {
  // 4 pages of 16; one run of two whole pages, one of 3 tokens.
  const std::vector<IndexRun> runs = {{0, 0, 32}, {40, 100, 3}};
  EXPECT_EQ(CopyEnginePiecesPerLayer(KvLayout(LayoutKind::kLayerFirst, 2, 4, 64, 16, 2, 8), runs),
            2u);
  EXPECT_EQ(
      CopyEnginePiecesPerLayer(KvLayout(LayoutKind::kPageFirstDirect, 2, 4, 64, 16, 2, 8), runs),
      3u);
  EXPECT_EQ(CopyEnginePiecesPerLayer(KvLayout(LayoutKind::kPageFirst, 2, 4, 64, 16, 2, 8), runs),
            35u);
  EXPECT_EQ(CopyEnginePiecesPerLayer(KvLayout(LayoutKind::kPageHead, 2, 4, 64, 16, 2, 8), runs),
            70u);
}

}  // namespace
}  // namespace kvhost
