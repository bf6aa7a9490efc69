// The CUDA engine's copy plans (server/transfer/copy_plan.h), checked on the
// CPU: the copy-engine pieces (PlanCopyEngineLayer), the copy kernel's item
// decoding (DecodeCopyItem, the same function the kernel runs, launch by
// launch as the engine issues them) and the staged plan's copy-engine copies
// are replayed with memcpy, for backups and loads, against a naive copy of
// every (component, row, layer, head) at Component::layout offsets.
//
// Shapes: every layout with MHA-like (K and V as two components, one launch
// group) and MLA-like components at page sizes 1, 3 and 4, index runs with
// partial pages; then every pool kind x layout of MakeComponents
// (multi-component kinds, page-row components that copy page runs, components
// in separate region files at offsets), and layer sharding (attachments wider
// than the pool, narrower, and offset from it, where host layer h is device
// layer h + delta and device layers the pool does not hold stay untouched),
// and pool group layer maps (held host layers with gaps and in any model
// order: the staged path plans each interval of HeldLayerRanges, and host
// layers no model layer maps stay untouched).
// Staging chunks run from the smallest allowed to larger than the job. Also:
// every staging byte a chunk copies is written by exactly one item (so a
// backup never writes stale staging bytes into the pool), no copy crosses a
// registration chunk, and a chunk smaller than a unit is FAILED_PRECONDITION.
#include "server/transfer/copy_plan.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "server/transfer/engine.h"

namespace kvhost {
namespace {

// ---------------------------------------------------------------------------
// A pool's host regions and a worker's device buffers, in plain memory.

struct Case {
  std::string name;
  std::vector<Component> components;
  // Ticket layers: (host layer or -1, attached device layer), in order.
  std::vector<JobLayer> layers;
  uint32_t device_layers = 0;  // attached layers
  uint64_t device_tokens = 0;  // device slots
  std::vector<IndexRun> runs;
  std::vector<IndexRun> page_runs;  // when a component has page rows
};

struct Buffers {
  std::vector<std::vector<uint8_t>> regions;
  std::vector<std::vector<uint8_t>> device;  // component * device_layers + attached layer
};

void FillRandom(std::vector<uint8_t>* v, std::mt19937_64& rng) {
  for (auto& byte : *v) byte = static_cast<uint8_t>(rng() | 1);
}

Buffers MakeBuffers(const Case& c, std::mt19937_64& rng) {
  Buffers b;
  for (const Component& comp : c.components) {
    if (b.regions.size() <= comp.region) b.regions.resize(comp.region + 1);
    std::vector<uint8_t>& r = b.regions[comp.region];
    r.resize(std::max<uint64_t>(r.size(), comp.region_offset + comp.bytes()));
  }
  for (auto& r : b.regions) FillRandom(&r, rng);
  for (const Component& comp : c.components) {
    for (uint32_t l = 0; l < c.device_layers; ++l) {
      b.device.emplace_back(c.device_tokens / comp.row_tokens * comp.row_bytes());
      FillRandom(&b.device.back(), rng);
    }
  }
  return b;
}

// The reference: every (component, row, held layer, head) of every run, one
// at a time.
void NaiveCopy(const Case& c, bool backup, Buffers* b) {
  for (size_t ci = 0; ci < c.components.size(); ++ci) {
    const Component& comp = c.components[ci];
    const KvLayout& layout = comp.layout;
    for (const IndexRun& run : comp.row_tokens > 1 ? c.page_runs : c.runs) {
      for (uint64_t t = 0; t < run.count; ++t) {
        for (const JobLayer& jl : c.layers) {
          if (jl.host_layer < 0) continue;
          for (uint64_t h = 0; h < layout.heads; ++h) {
            uint8_t* host = b->regions[comp.region].data() + comp.region_offset +
                            layout.Offset(0, run.host + t, static_cast<uint64_t>(jl.host_layer), h);
            uint8_t* dev = b->device[ci * c.device_layers + jl.device_layer].data() +
                           (run.device + t) * comp.row_bytes() + h * layout.head_bytes;
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

// Host layers the job holds as intervals of consecutive host layers, each
// with its device layer delta, computed independently of HeldLayerRanges:
// a plain attachment's layers give one; a pool group's layer map (any held
// layers, any order) may give several.
struct Held {
  uint64_t begin = 0, end = 0;
  int64_t delta = 0;
};
std::vector<Held> HeldOf(const Case& c) {
  std::vector<int64_t> delta_of;  // per host layer, or kNone
  constexpr int64_t kNone = std::numeric_limits<int64_t>::min();
  for (const JobLayer& jl : c.layers) {
    if (jl.host_layer < 0) continue;
    const auto h = static_cast<size_t>(jl.host_layer);
    if (delta_of.size() <= h) delta_of.resize(h + 1, kNone);
    EXPECT_EQ(delta_of[h], kNone) << "host layer " << h << " held twice";
    delta_of[h] = int64_t{jl.device_layer} - jl.host_layer;
  }
  std::vector<Held> out;
  for (size_t h = 0; h < delta_of.size(); ++h) {
    if (delta_of[h] == kNone) continue;
    if (!out.empty() && out.back().end == h && out.back().delta == delta_of[h]) {
      ++out.back().end;
    } else {
      out.push_back(Held{h, h + 1, delta_of[h]});
    }
  }
  return out;
}

// Replays one kernel launch over group `g` (tiles [begin, end), items
// [0, items)) between the device buffers and `other`; counts writes into
// `other` per byte when given.
void ReplayLaunch(const Case& c, const LayoutGroup& g, const CopyTile* tiles, size_t count,
                  uint64_t items, uint32_t layer_shift, int64_t delta, uint8_t* other,
                  uint64_t other_size, bool to_device, Buffers* b, std::vector<int>* other_writes) {
  const KvLayout& layout = g.layout;
  const uint64_t item_bytes = CopyItemBytes(layout);
  uint64_t seen = 0;
  for (size_t s = 0; s < count; ++s) {
    ASSERT_EQ(tiles[s].first_item, seen) << "tile " << s;
    seen += TileItems(tiles[s]);
    for (uint64_t r = 0; r < TileItems(tiles[s]); ++r) {
      const CopyItem item =
          DecodeCopyItem(layout, tiles[s], r, layer_shift, c.device_layers, delta);
      const uint64_t other_off = item.other_offset;
      ASSERT_LE(other_off + item_bytes, other_size) << "tile " << s << " item " << r;
      // The launch's table starts at the group's first component.
      const uint64_t buffer = uint64_t{g.first_component} * c.device_layers + item.device_buffer;
      ASSERT_LT(item.device_buffer, layout.planes * c.device_layers);
      ASSERT_LE(item.device_offset + item_bytes, b->device[buffer].size());
      uint8_t* dev = b->device[buffer].data() + item.device_offset;
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
  ASSERT_EQ(seen, items);
}

uint64_t UnitOf(const std::vector<LayoutGroup>& groups, const std::vector<Held>& held) {
  uint64_t unit = 0;
  for (const Held& h : held) {
    for (const LayoutGroup& g : groups) {
      unit = std::max(unit, StagedUnitBytes(g.layout, h.begin, h.end));
    }
  }
  return unit;
}

uint64_t SplitOf(const Buffers& b) {
  uint64_t total = 0;
  for (const auto& r : b.regions) total = std::max<uint64_t>(total, r.size());
  return std::max<uint64_t>(64, total / 5);
}

void ExpectStagedMatchesNaive(const Case& c) {
  SCOPED_TRACE(c.name);
  std::mt19937_64 rng(7);
  const std::vector<LayoutGroup> groups = GroupComponents(c.components);
  const std::vector<Held> held = HeldOf(c);
  ASSERT_FALSE(held.empty()) << "the case holds no layer";
  // As the engine plans: one interval per HeldLayerRanges entry.
  const std::vector<HeldLayers> ranges = HeldLayerRanges(c.layers);
  ASSERT_EQ(ranges.size(), held.size());
  for (size_t i = 0; i < held.size(); ++i) {
    EXPECT_EQ(ranges[i].begin, held[i].begin) << "range " << i;
    EXPECT_EQ(ranges[i].end, held[i].end) << "range " << i;
    EXPECT_EQ(ranges[i].delta, held[i].delta) << "range " << i;
  }
  bool in_order = true;  // host layers rise with the ticket layers, as a plain attachment's
  int32_t last = -1;
  for (const JobLayer& jl : c.layers) {
    if (jl.host_layer < 0) continue;
    in_order = in_order && jl.host_layer > last;
    last = jl.host_layer;
  }
  if (held.size() == 1 && in_order) {
    // A plain attachment's: the same as HeldLayersOf.
    const HeldLayers one = HeldLayersOf(c.layers);
    EXPECT_EQ(one.begin, held[0].begin);
    EXPECT_EQ(one.end, held[0].end);
    EXPECT_EQ(one.delta, held[0].delta);
  }
  const uint64_t unit = UnitOf(groups, held);
  for (const uint64_t chunk : {unit, 3 * unit + 5, uint64_t{1} << 20}) {
    Buffers got = MakeBuffers(c, rng);
    // A registration split inside the regions, so that some copies are cut.
    const uint64_t split = SplitOf(got);
    std::vector<StagedPlan> plans(held.size());
    for (size_t i = 0; i < held.size(); ++i) {
      ASSERT_TRUE(PlanStaged(groups, c.runs, c.page_runs, held[i].begin, held[i].end, chunk, split,
                             &plans[i])
                      .ok());
    }
    for (const bool backup : {true, false}) {
      SCOPED_TRACE(absl::StrCat("chunk ", chunk, backup ? " backup" : " load"));
      got = MakeBuffers(c, rng);
      Buffers want = got;
      NaiveCopy(c, backup, &want);
      std::vector<uint8_t> staging(chunk);
      for (size_t range = 0; range < held.size(); ++range) {
        const StagedPlan& plan = plans[range];
        const int64_t delta = held[range].delta;
        for (const StagedChunk& ch : plan.chunks) {
          ASSERT_LE(ch.bytes, chunk);
          std::fill(staging.begin(), staging.end(), 0);
          std::vector<int> writes(chunk, 0);
          if (!backup) {
            for (size_t i = ch.copy_begin; i < ch.copy_end; ++i) {
              const StagedCopy& cp = plan.copies[i];
              std::memcpy(staging.data() + cp.staging_offset,
                          got.regions[cp.region].data() + cp.host_offset, cp.bytes);
            }
          }
          for (size_t k = ch.launch_begin; k < ch.launch_end; ++k) {
            const TileLaunch& launch = plan.launches[k];
            ReplayLaunch(c, groups[launch.group], plan.tiles.data() + launch.tile_begin,
                         launch.tile_end - launch.tile_begin, launch.items, 0, delta,
                         staging.data(), chunk, !backup, &got, &writes);
            if (::testing::Test::HasFatalFailure()) return;
          }
          for (size_t i = ch.copy_begin; i < ch.copy_end; ++i) {
            const StagedCopy& cp = plan.copies[i];
            ASSERT_LE(cp.host_offset + cp.bytes, got.regions[cp.region].size());
            EXPECT_EQ(cp.host_offset / split, (cp.host_offset + cp.bytes - 1) / split)
                << "copy crosses a registration chunk";
            if (backup) {
              for (uint64_t k = 0; k < cp.bytes; ++k) {
                ASSERT_EQ(writes[cp.staging_offset + k], 1)
                    << "staging byte " << cp.staging_offset + k
                    << " copied to the pool but written " << writes[cp.staging_offset + k]
                    << " times";
              }
              std::memcpy(got.regions[cp.region].data() + cp.host_offset,
                          staging.data() + cp.staging_offset, cp.bytes);
            }
          }
        }
      }
      EXPECT_TRUE(got.regions == want.regions);
      EXPECT_TRUE(got.device == want.device);
    }
  }
}

void ExpectDirectMatchesNaive(const Case& c) {
  SCOPED_TRACE(c.name);
  std::mt19937_64 rng(11);
  const std::vector<LayoutGroup> groups = GroupComponents(c.components);
  const SmCopyPlan plan = PlanSmCopy(groups, c.runs, c.page_runs);
  uint64_t items = 0;
  for (const TileLaunch& launch : plan.launches) items += launch.items;
  EXPECT_EQ(items, plan.items_per_layer);
  for (const bool backup : {true, false}) {
    SCOPED_TRACE(backup ? "backup" : "load");
    Buffers got = MakeBuffers(c, rng);
    Buffers want = got;
    NaiveCopy(c, backup, &want);
    // As the engine: per ticket layer the pool holds, every launch.
    for (const JobLayer& jl : c.layers) {
      if (jl.host_layer < 0) continue;
      for (const TileLaunch& launch : plan.launches) {
        const LayoutGroup& g = groups[launch.group];
        std::vector<uint8_t>& region = got.regions[g.region];
        ReplayLaunch(c, g, plan.tiles.data() + launch.tile_begin,
                     launch.tile_end - launch.tile_begin, launch.items,
                     static_cast<uint32_t>(jl.host_layer), int64_t{jl.device_layer} - jl.host_layer,
                     region.data() + g.region_offset, region.size() - g.region_offset, !backup,
                     &got, nullptr);
        if (::testing::Test::HasFatalFailure()) return;
      }
    }
    EXPECT_TRUE(got.regions == want.regions);
    EXPECT_TRUE(got.device == want.device);
  }
}

void ExpectCopyEngineMatchesNaive(const Case& c) {
  SCOPED_TRACE(c.name);
  std::mt19937_64 rng(13);
  for (const bool backup : {true, false}) {
    SCOPED_TRACE(backup ? "backup" : "load");
    Buffers got = MakeBuffers(c, rng);
    Buffers want = got;
    NaiveCopy(c, backup, &want);
    const uint64_t split = SplitOf(got);
    for (const JobLayer& jl : c.layers) {
      if (jl.host_layer < 0) continue;
      std::vector<CopyEnginePiece> pieces;
      PlanCopyEngineLayer(c.components, c.runs, c.page_runs, static_cast<uint64_t>(jl.host_layer),
                          split, &pieces);
      for (const CopyEnginePiece& p : pieces) {
        ASSERT_LT(p.component, c.components.size());
        EXPECT_EQ(p.region, c.components[p.component].region);
        EXPECT_EQ(p.host_offset / split, (p.host_offset + p.bytes - 1) / split)
            << "piece crosses a registration chunk";
        std::vector<uint8_t>& region = got.regions[p.region];
        std::vector<uint8_t>& dev = got.device[p.component * c.device_layers + jl.device_layer];
        ASSERT_LE(p.host_offset + p.bytes, region.size());
        ASSERT_LE(p.device_offset + p.bytes, dev.size());
        if (backup) {
          std::memcpy(region.data() + p.host_offset, dev.data() + p.device_offset, p.bytes);
        } else {
          std::memcpy(dev.data() + p.device_offset, region.data() + p.host_offset, p.bytes);
        }
      }
    }
    EXPECT_TRUE(got.regions == want.regions);
    EXPECT_TRUE(got.device == want.device);
  }
}

void ExpectAllPathsMatchNaive(const Case& c) {
  ExpectCopyEngineMatchesNaive(c);
  ExpectDirectMatchesNaive(c);
  ExpectStagedMatchesNaive(c);
}

// Every layer held, attachment = pool.
std::vector<JobLayer> SameLayers(uint64_t layers) {
  std::vector<JobLayer> out;
  for (uint64_t l = 0; l < layers; ++l) {
    out.push_back(JobLayer{static_cast<int32_t>(l), static_cast<uint32_t>(l)});
  }
  return out;
}

// Device layers [att_start, att_end) on a pool holding [pool_start, pool_start + layers).
std::vector<JobLayer> ShardLayers(uint32_t pool_start, uint32_t layers, uint32_t att_start,
                                  uint32_t att_end) {
  std::vector<JobLayer> out;
  for (uint32_t d = att_start; d < att_end; ++d) {
    JobLayer jl;
    jl.device_layer = d - att_start;
    if (d >= pool_start && d < pool_start + layers)
      jl.host_layer = static_cast<int32_t>(d - pool_start);
    out.push_back(jl);
  }
  return out;
}

// A pool group entry's ticket layers: model layer l copies host layer
// map[l] (-1: none) to or from attached layer map[l] + delta, as the
// transfer manager fills a group job's part (device layer - host layer is
// the attachment's offset from the pool, the same for every layer).
std::vector<JobLayer> MapLayers(const std::vector<int>& map, int delta) {
  std::vector<JobLayer> out;
  for (int h : map) {
    JobLayer jl;
    if (h >= 0) {
      jl.host_layer = h;
      jl.device_layer = static_cast<uint32_t>(h + delta);
    }
    out.push_back(jl);
  }
  return out;
}

uint64_t MaxDeviceRow(const std::vector<IndexRun>& runs) {
  uint64_t rows = 0;
  for (const IndexRun& r : runs) rows = std::max(rows, r.device + r.count);
  return rows;
}

// ---------------------------------------------------------------------------
// MHA / MLA-like components of every layout, with partial pages.

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

// The planes of `layout` as back-to-back components of region 0 (MHA's K
// and V, or MLA's latent), as Pool::components() lists them.
std::vector<Component> PlaneComponents(const KvLayout& layout) {
  std::vector<Component> out;
  for (uint64_t p = 0; p < layout.planes; ++p) {
    Component c;
    c.name = absl::StrCat("plane", p);
    c.layout = KvLayout(layout.kind, 1, layout.layers, layout.tokens, layout.page_size,
                        layout.heads, layout.head_bytes);
    c.region_offset = p * layout.plane_bytes;
    out.push_back(c);
  }
  return out;
}

// Runs with whole pages, partial pages at both ends, singletons and device
// rows out of order; host slots distinct.
std::vector<IndexRun> SomeRuns(uint64_t tokens, uint64_t ps, std::mt19937_64& rng) {
  std::vector<uint64_t> host(tokens);
  for (uint64_t i = 0; i < host.size(); ++i) host[i] = i;
  std::shuffle(host.begin(), host.end(), rng);
  std::vector<IndexRun> runs;
  // Two pages and a bit, starting mid-page, then scattered singletons.
  const uint64_t start = ps + ps / 2;
  const uint64_t n = std::min<uint64_t>(2 * ps + 1, tokens - start);
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

Case PlaneCase(const Shape& s, std::vector<JobLayer> layers, uint32_t device_layers) {
  const KvLayout layout = LayoutOf(s);
  std::mt19937_64 rng(5);
  Case c;
  c.name =
      absl::StrCat("planes ", s.planes, " layout ", static_cast<int>(s.kind), " ps ", s.page_size);
  c.components = PlaneComponents(layout);
  c.runs = SomeRuns(layout.tokens, layout.page_size, rng);
  c.layers = std::move(layers);
  c.device_layers = device_layers;
  c.device_tokens = MaxDeviceRow(c.runs);
  return c;
}

class CopyPlanTest : public ::testing::TestWithParam<Shape> {};

TEST_P(CopyPlanTest, PlanesAreOneLaunchGroup) {
  const KvLayout layout = LayoutOf(GetParam());
  const std::vector<LayoutGroup> groups = GroupComponents(PlaneComponents(layout));
  ASSERT_EQ(groups.size(), 1u);
  EXPECT_EQ(groups[0].layout.planes, layout.planes);
  EXPECT_EQ(groups[0].layout.plane_bytes, layout.plane_bytes);
  EXPECT_EQ(groups[0].region_offset, 0u);
}

TEST_P(CopyPlanTest, EveryPathMovesExactlyTheRunsBytes) {
  ExpectAllPathsMatchNaive(PlaneCase(GetParam(), SameLayers(kLayers), kLayers));
}

TEST_P(CopyPlanTest, ShardedLayersMoveOnlyTheHeldLayers) {
  // Pool layers [2, 5): an attachment of [1, 6) (all held, delta 1), of
  // [3, 5) (the last two, delta -1) and of [3, 4) (the middle one).
  ExpectAllPathsMatchNaive(PlaneCase(GetParam(), ShardLayers(2, kLayers, 1, 6), 5));
  ExpectAllPathsMatchNaive(PlaneCase(GetParam(), ShardLayers(2, kLayers, 3, 5), 2));
  ExpectAllPathsMatchNaive(PlaneCase(GetParam(), ShardLayers(2, kLayers, 3, 4), 1));
}

TEST_P(CopyPlanTest, GroupLayerMapsMoveOnlyTheMappedLayers) {
  // A group entry of a 3-layer pool over 5 model layers: layers 0 and 2 held
  // with 1 unmapped between them (untouched in every layout, including the
  // PAGE_FIRST blocks that span a token's layers), attached from one layer
  // below the pool (delta 1); all three in reverse model order; only the
  // middle one.
  ExpectAllPathsMatchNaive(PlaneCase(GetParam(), MapLayers({0, -1, -1, 2, -1}, 1), 4));
  ExpectAllPathsMatchNaive(PlaneCase(GetParam(), MapLayers({2, -1, 1, 0, -1}, 0), 3));
  ExpectAllPathsMatchNaive(PlaneCase(GetParam(), MapLayers({-1, -1, -1, 1, -1}, 0), 3));
}

TEST(HeldLayerRangesTest, IntervalsInHostLayerOrder) {
  const std::vector<HeldLayers> r = HeldLayerRanges(MapLayers({4, -1, 0, 1, 5, -1, 2}, 3));
  ASSERT_EQ(r.size(), 2u);
  EXPECT_EQ(r[0].begin, 0u);
  EXPECT_EQ(r[0].end, 3u);
  EXPECT_EQ(r[0].delta, 3);
  EXPECT_EQ(r[1].begin, 4u);
  EXPECT_EQ(r[1].end, 6u);
  EXPECT_EQ(r[1].delta, 3);
  EXPECT_TRUE(HeldLayerRanges(MapLayers({-1, -1}, 0)).empty());
  // A delta that changes starts a new interval.
  std::vector<JobLayer> layers = MapLayers({0, 1}, 0);
  layers[1].device_layer = 5;
  EXPECT_EQ(HeldLayerRanges(layers).size(), 2u);
}

TEST_P(CopyPlanTest, ChunkSmallerThanAUnitIsRefused) {
  const KvLayout layout = LayoutOf(GetParam());
  std::mt19937_64 rng(3);
  StagedPlan plan;
  const absl::Status s =
      PlanStaged({GroupOf(layout)}, SomeRuns(layout.tokens, layout.page_size, rng), {}, 0,
                 layout.layers, StagedUnitBytes(layout) - 1, 1 << 30, &plan);
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

INSTANTIATE_TEST_SUITE_P(AllLayouts, CopyPlanTest, ::testing::ValuesIn(Shapes()), ShapeName);

// ---------------------------------------------------------------------------
// Every pool kind: MakeComponents' components.

struct KindCase {
  PoolKind kind;
  LayoutKind layout;
};

std::string KindCaseName(const ::testing::TestParamInfo<KindCase>& info) {
  return absl::StrCat(PoolKindName(info.param.kind), "_", LayoutName(info.param.layout));
}

PoolSpec SpecOf(PoolKind kind, LayoutKind layout) {
  PoolSpec s;
  s.kind = kind;
  s.layout = layout;
  s.dtype = DType::kBf16;
  s.page_size = 4;
  s.layer_num = 3;
  switch (kind) {
    case PoolKind::kMhaAsymmetric:
      s.v_head_dim = 6;
      [[fallthrough]];
    case PoolKind::kKOnly:
      s.head_num = 2;
      s.head_dim = 4;
      if (kind == PoolKind::kKOnly) s.follows = "mha";
      break;
    case PoolKind::kDsa:
      s.kv_lora_rank = 8;
      s.qk_rope_head_dim = 4;
      s.index_head_dim = 8;
      s.index_quant_block_size = 4;
      break;
    case PoolKind::kDsaIndexer:
      s.dtype = DType::kUint8;
      s.index_head_dim = 16;
      s.index_quant_block_size = 8;
      s.follows = "mla";
      break;
    case PoolKind::kMamba:
      s.page_size = 1;
      s.mamba.temporal = {2, 3};
      s.mamba.temporal_dtype = DType::kFp32;
      s.mamba.conv = {{2, 4}, {3, 2}};
      break;
    case PoolKind::kV4Paged:
      s.dtype = DType::kUint8;
      s.item_bytes = 40;
      break;
    case PoolKind::kV4State:
      s.dtype = DType::kUint8;
      s.ring_size = 3;
      s.state_slot_bytes = 12;
      s.follows = "v4";
      break;
    default:
      break;
  }
  return s;
}

// Whole pages in shuffled order on both sides, some runs of several pages;
// for kinds with token rows only, SomeRuns (partial pages) instead.
Case KindOf(const KindCase& k, std::vector<JobLayer> layers, uint32_t device_layers) {
  const PoolSpec spec = SpecOf(k.kind, k.layout);
  EXPECT_TRUE(ValidateSpec(spec).ok()) << ValidateSpec(spec);
  const uint64_t ps = spec.page_size;
  const uint64_t pages = 16;
  Case c;
  c.name = DescribeSpec(spec);
  c.components = MakeComponents(spec, pages * ps);
  c.layers = std::move(layers);
  c.device_layers = device_layers;
  std::mt19937_64 rng(17);
  bool page_rows = false;
  for (const Component& comp : c.components) page_rows = page_rows || comp.row_tokens > 1;
  if (!page_rows) {
    c.runs = SomeRuns(pages * ps, ps, rng);
    c.device_tokens = MaxDeviceRow(c.runs);
    return c;
  }
  std::vector<uint64_t> host_pages(pages), device_pages(2 * pages);
  for (uint64_t p = 0; p < host_pages.size(); ++p) host_pages[p] = p;
  for (uint64_t p = 0; p < device_pages.size(); ++p) device_pages[p] = p;
  std::shuffle(host_pages.begin() + 4, host_pages.end(), rng);  // pages 0..3 stay a run
  std::shuffle(device_pages.begin() + 4, device_pages.end(), rng);
  std::vector<int64_t> host, device;
  for (uint64_t i = 0; i + 3 < pages; ++i) {  // 3 pages left out
    for (uint64_t o = 0; o < ps; ++o) {
      host.push_back(static_cast<int64_t>(host_pages[i] * ps + o));
      device.push_back(static_cast<int64_t>(device_pages[i] * ps + o));
    }
  }
  c.runs = CoalesceRuns(host, device);
  c.page_runs = PageRuns(c.runs, ps);
  c.device_tokens = 2 * pages * ps;
  return c;
}

class KindCopyPlanTest : public ::testing::TestWithParam<KindCase> {};

TEST_P(KindCopyPlanTest, EveryPathMovesExactlyTheRunsBytes) {
  ExpectAllPathsMatchNaive(KindOf(GetParam(), SameLayers(3), 3));
}

TEST_P(KindCopyPlanTest, ShardedLayersMoveOnlyTheHeldLayers) {
  ExpectAllPathsMatchNaive(KindOf(GetParam(), ShardLayers(2, 3, 1, 6), 5));
  ExpectAllPathsMatchNaive(KindOf(GetParam(), ShardLayers(2, 3, 3, 4), 1));
}

TEST_P(KindCopyPlanTest, GroupLayerMapsMoveOnlyTheMappedLayers) {
  ExpectAllPathsMatchNaive(KindOf(GetParam(), MapLayers({-1, 2, -1, 0}, 0), 3));
  ExpectAllPathsMatchNaive(KindOf(GetParam(), MapLayers({1, -1, 0, 2}, 2), 5));
}

TEST_P(KindCopyPlanTest, GroupsCoverEveryComponentOnce) {
  const PoolSpec spec = SpecOf(GetParam().kind, GetParam().layout);
  const std::vector<Component> components = MakeComponents(spec, 16 * spec.page_size);
  const std::vector<LayoutGroup> groups = GroupComponents(components);
  size_t next = 0;
  for (const LayoutGroup& g : groups) {
    ASSERT_EQ(g.first_component, next);
    const Component& first = components[next];
    EXPECT_EQ(g.region, first.region);
    EXPECT_EQ(g.region_offset, first.region_offset);
    EXPECT_EQ(g.page_rows, first.row_tokens > 1);
    for (uint64_t p = 0; p < g.layout.planes; ++p) {
      const Component& c = components[next + p];
      EXPECT_EQ(c.region, g.region);
      EXPECT_EQ(c.region_offset, g.region_offset + p * g.layout.plane_bytes);
      EXPECT_EQ(c.row_bytes(), g.layout.token_bytes);
    }
    next += g.layout.planes;
  }
  EXPECT_EQ(next, components.size());
}

std::vector<KindCase> KindCases() {
  std::vector<KindCase> out;
  for (PoolKind kind :
       {PoolKind::kMhaAsymmetric, PoolKind::kKOnly, PoolKind::kDsa, PoolKind::kDsaIndexer,
        PoolKind::kMamba, PoolKind::kV4Paged, PoolKind::kV4State}) {
    for (LayoutKind layout : {LayoutKind::kLayerFirst, LayoutKind::kPageFirst,
                              LayoutKind::kPageFirstDirect, LayoutKind::kPageHead}) {
      if (ValidateSpec(SpecOf(kind, layout)).ok()) out.push_back(KindCase{kind, layout});
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(AllKinds, KindCopyPlanTest, ::testing::ValuesIn(KindCases()),
                         KindCaseName);

TEST(KindCasesTest, CoverEveryKindOfTheTask) {
  // MHA_ASYMMETRIC pf/pfd, K_ONLY lf/pf/pfd, DSA lf, DSA_INDEXER, V4_PAGED and
  // V4_STATE lf/pf/pfd, MAMBA pfd.
  EXPECT_EQ(KindCases().size(), 2u + 3u + 1u + 3u + 1u + 3u + 3u);
}

TEST(GroupComponentsTest, SeparateRegionsAndShapesAreSeparateGroups) {
  // MHA_ASYMMETRIC: K and V in files of their own, rows of different sizes.
  const PoolSpec asym = SpecOf(PoolKind::kMhaAsymmetric, LayoutKind::kPageFirst);
  EXPECT_EQ(GroupComponents(MakeComponents(asym, 16 * asym.page_size)).size(), 2u);
  // DSA: the latent's token rows and the index_k page rows.
  const PoolSpec dsa = SpecOf(PoolKind::kDsa, LayoutKind::kLayerFirst);
  const std::vector<LayoutGroup> g = GroupComponents(MakeComponents(dsa, 16 * dsa.page_size));
  ASSERT_EQ(g.size(), 2u);
  EXPECT_FALSE(g[0].page_rows);
  EXPECT_TRUE(g[1].page_rows);
  EXPECT_EQ(g[1].region, 1u);
  // MAMBA: temporal and each conv state in their own files.
  const PoolSpec mamba = SpecOf(PoolKind::kMamba, LayoutKind::kPageFirstDirect);
  EXPECT_EQ(GroupComponents(MakeComponents(mamba, 16)).size(), 3u);
}

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
  // Over groups: planes count, bytes are rows x row bytes x planes.
  const LayerPieces lp = CopyEngineLayerPieces(
      {GroupOf(KvLayout(LayoutKind::kPageFirstDirect, 2, 4, 64, 16, 2, 8))}, runs, {});
  EXPECT_EQ(lp.pieces, 6u);
  EXPECT_EQ(lp.bytes, 2u * 35u * 16u);
}

}  // namespace
}  // namespace kvhost
