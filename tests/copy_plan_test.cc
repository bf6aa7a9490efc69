// The CUDA engine's copy plans (server/transfer/cuda/copy_plan.h), checked on the
// CPU: the copy-engine pieces (PlanCopyEngineLayer), the copy kernel's item
// decoding (DecodeCopyItem, the same function the kernel runs, launch by
// launch as the engine issues them) and the staged plan's copy-engine copies
// are replayed with memcpy, for backups and loads, against a naive copy of
// every (component, row, layer, head) at Component::layout offsets.
//
// Shapes: every layout with MHA-like (K and V as two components, one launch
// group) and MLA-like components at page sizes 1, 3 and 4, index runs with
// partial pages (PAGE_UNIFIED with one head group and with a group per head:
// K and V interleaved, rows split per group); then every pool kind x layout
// of MakeComponents
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
#include "server/transfer/cuda/copy_plan.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "seed_offsets.h"
#include "server/transfer/cuda/path_policy.h"
#include "server/transfer/engine.h"

#ifdef KVHOST_HAVE_CUDA_ENGINE
#include <cuda_runtime_api.h>

#include "copy_kernel.h"
#endif

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
  bool load_only = false;           // host slots read twice: no backup of it
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
    r.resize(std::max<uint64_t>(r.size(), comp.region_offset + comp.extent_bytes()));
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

// A component's buffer as one of the seeds' (tests/seed_offsets.h), so that
// the reference's offsets do not come from the code under test: its plane 0
// (a PAGE_UNIFIED component is one of the buffer's interleaved planes; the
// component's region offset places it).
testing::SeedBuffer SeedOf(const KvLayout& layout) {
  testing::SeedBuffer s;
  s.layout = testing::SeedLayoutNamed(layout.kind);
  s.planes = layout.kind == LayoutKind::kPageUnified ? layout.interleaved_planes : 1;
  s.groups = layout.head_groups;
  s.layers = layout.layers;
  s.rows = layout.tokens;
  s.page_size = layout.page_size;
  s.heads = layout.heads;
  s.dim = layout.head_bytes;
  return s;
}

// The reference: every (component, row, held layer, head) of every run, one
// at a time, at the seeds' offsets.
void NaiveCopy(const Case& c, bool backup, Buffers* b) {
  for (size_t ci = 0; ci < c.components.size(); ++ci) {
    const Component& comp = c.components[ci];
    const KvLayout& layout = comp.layout;
    const testing::SeedBuffer seed = SeedOf(layout);
    for (const IndexRun& run : comp.row_tokens > 1 ? c.page_runs : c.runs) {
      for (uint64_t t = 0; t < run.count; ++t) {
        for (const JobLayer& jl : c.layers) {
          if (jl.host_layer < 0) continue;
          for (uint64_t h = 0; h < layout.heads; ++h) {
            uint8_t* host =
                b->regions[comp.region].data() + comp.region_offset +
                testing::SeedOffset(seed, 0, run.host + t, static_cast<uint64_t>(jl.host_layer), h);
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

// The kernel's grid for the lane replay: blocks of kWarps warps of 32 lanes
// (kernels/copy_kernel.cu), few enough blocks that groups take several items.
constexpr uint64_t kReplayBlocks = 3;
constexpr uint64_t kWarps = 8;

// Replays one kernel launch over group `g` (tiles [begin, end), items
// [0, items)) between the device buffers and `other` as the kernel runs it:
// item i by lane group i mod (the grid's groups), CopyLanesPerItem lanes of a
// warp per item of 16-byte vectors (aligned items), each lane its vectors;
// a warp per item for the byte copy. Counts writes into `other` per byte
// when given, and checks that every byte of every item is copied once and,
// for vectors, that a warp's lanes all have work where its items are large
// enough (sub-warp groups: PAGE_HEAD's 256 B heads two to a warp).
void ReplayLaunch(const Case& c, const LayoutGroup& g, const CopyTile* tiles, size_t count,
                  uint64_t items, uint32_t layer_shift, int64_t delta, uint8_t* other,
                  uint64_t other_size, bool to_device, Buffers* b, std::vector<int>* other_writes) {
  const KvLayout& layout = g.layout;
  const uint64_t item_bytes = CopyItemBytes(layout);
  const bool vector = item_bytes % 16 == 0;
  const uint64_t lanes = vector ? CopyLanesPerItem(item_bytes) : 32;
  ASSERT_EQ(32 % lanes, 0u);
  if (vector) {
    ASSERT_GE(lanes * 16, std::min<uint64_t>(item_bytes, 512));
    ASSERT_LT(lanes * 8, item_bytes) << "half the lanes would idle";
  }
  uint64_t seen = 0;
  std::vector<uint64_t> tile_of(items);
  for (size_t s = 0; s < count; ++s) {
    ASSERT_EQ(tiles[s].first_item, seen) << "tile " << s;
    for (uint64_t r = 0; r < TileItems(tiles[s]); ++r) tile_of[seen + r] = s;
    seen += TileItems(tiles[s]);
  }
  ASSERT_EQ(seen, items);
  const uint64_t groups = kReplayBlocks * kWarps * (32 / lanes);
  std::vector<uint8_t> copied(item_bytes);
  for (uint64_t first = 0; first < groups; ++first) {
    for (uint64_t i = first; i < items; i += groups) {
      const CopyTile& tile = tiles[tile_of[i]];
      const CopyItem item =
          DecodeCopyItem(layout, tile, i - tile.first_item, layer_shift, c.device_layers, delta);
      const uint64_t other_off = item.other_offset;
      ASSERT_LE(other_off + item_bytes, other_size) << "item " << i;
      if (vector) {
        ASSERT_EQ(other_off % 16, 0u) << "item " << i << " breaks the 16-byte vectors";
      }
      // The launch's table starts at the group's first component.
      const uint64_t buffer = uint64_t{g.first_component} * c.device_layers + item.device_buffer;
      ASSERT_LT(item.device_buffer, layout.planes * c.device_layers);
      ASSERT_LE(item.device_offset + item_bytes, b->device[buffer].size());
      uint8_t* dev = b->device[buffer].data() + item.device_offset;
      uint8_t* dst = to_device ? dev : other + other_off;
      const uint8_t* src = to_device ? other + other_off : dev;
      std::fill(copied.begin(), copied.end(), 0);
      const uint64_t piece = vector ? 16 : 1;
      for (uint64_t lane = 0; lane < lanes; ++lane) {
        for (uint64_t o = lane * piece; o < item_bytes; o += lanes * piece) {
          std::memcpy(dst + o, src + o, piece);
          for (uint64_t k = 0; k < piece; ++k) ++copied[o + k];
        }
      }
      for (uint64_t k = 0; k < item_bytes; ++k) {
        ASSERT_EQ(copied[k], 1) << "item " << i << " byte " << k;
      }
      if (!to_device && other_writes != nullptr) {
        for (uint64_t k = 0; k < item_bytes; ++k) ++(*other_writes)[other_off + k];
      }
    }
  }
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

// The most bytes of one slot's held rows, every plane, of any group.
uint64_t RowsOf(const std::vector<LayoutGroup>& groups, const std::vector<Held>& held) {
  uint64_t rows = 0;
  for (const Held& h : held) {
    for (const LayoutGroup& g : groups) {
      rows = std::max(rows, g.layout.planes * (h.end - h.begin) * g.layout.token_bytes);
    }
  }
  return rows;
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
  // A LAYER_FIRST chunk holds every held row of its slots where a slot's fit
  // (twice and a bit: windows split in runs, and a second group may start
  // mid-chunk); the unit alone and 3 units plan one (plane, layer) at a time.
  const uint64_t rows = RowsOf(groups, held);
  for (const uint64_t chunk :
       {unit, 3 * unit + 5, std::max(unit, 2 * rows + 21), uint64_t{1} << 20}) {
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
      if (backup && c.load_only) continue;
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
    if (backup && c.load_only) continue;
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
    if (backup && c.load_only) continue;
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
  uint64_t groups = 1;  // PAGE_UNIFIED's head groups
};

std::string ShapeName(const ::testing::TestParamInfo<Shape>& info) {
  const Shape& s = info.param;
  const char* kind = s.kind == LayoutKind::kLayerFirst        ? "LayerFirst"
                     : s.kind == LayoutKind::kPageFirst       ? "PageFirst"
                     : s.kind == LayoutKind::kPageFirstDirect ? "PageFirstDirect"
                     : s.kind == LayoutKind::kPageHead        ? "PageHead"
                                                              : "PageUnified";
  return absl::StrCat(kind, "_planes", s.planes, "_heads", s.heads, "_ps", s.page_size,
                      s.groups > 1 ? absl::StrCat("_groups", s.groups) : "");
}

constexpr uint64_t kLayers = 3;
constexpr uint64_t kHeadBytes = 8;
constexpr uint64_t kPages = 12;

KvLayout LayoutOf(const Shape& s) {
  return KvLayout(s.kind, s.planes, kLayers, kPages * s.page_size, s.page_size, s.heads, kHeadBytes,
                  s.groups);
}

// The planes of `layout` as back-to-back components of region 0 (MHA's K
// and V, or MLA's latent), as Pool::components() lists them: V at V_OFF, or
// in PAGE_UNIFIED one (ps, H / G, D) chunk after K (the planes interleave).
std::vector<Component> PlaneComponents(const KvLayout& layout) {
  const bool unified = layout.kind == LayoutKind::kPageUnified;
  const uint64_t v_off = layout.layers * layout.tokens * layout.heads * layout.head_bytes;
  const uint64_t chunk = layout.page_size * layout.heads / layout.head_groups * layout.head_bytes;
  std::vector<Component> out;
  for (uint64_t p = 0; p < layout.planes; ++p) {
    Component c;
    c.name = absl::StrCat("plane", p);
    c.layout = KvLayout(layout.kind, 1, layout.layers, layout.tokens, layout.page_size,
                        layout.heads, layout.head_bytes, layout.head_groups, layout.planes);
    c.region_offset = p * (unified ? chunk : v_off);
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
  EXPECT_EQ(groups[0].layout.plane_stride, layout.plane_stride);
  EXPECT_EQ(groups[0].layout.head_groups, layout.head_groups);
  EXPECT_EQ(groups[0].layout.interleaved_planes, layout.planes);
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

// Host slots in runs of kHostRun at shuffled places, named in shuffled
// request order, device rows scattered: what a contiguity-keeping host
// allocator gives a job, which the staged path plans in host order. Rows of
// 256 B heads, so that the kernel's 16-byte vectors and lane groups replay
// (PAGE_HEAD: a head per item, two to a warp). `repeat`: a load that also
// reads the first host slots a second time.
constexpr uint64_t kHostRun = 5;
Case LongRunCase(const Shape& s, bool repeat) {
  const uint64_t ps = s.page_size;
  const uint64_t head_bytes = s.heads == 1 ? 48 : 256;
  const KvLayout layout(s.kind, s.planes, kLayers, 40 * ps, ps, s.heads, head_bytes, s.groups);
  std::mt19937_64 rng(23);
  std::vector<uint64_t> starts(layout.tokens / kHostRun);
  for (uint64_t i = 0; i < starts.size(); ++i) starts[i] = i * kHostRun;
  std::shuffle(starts.begin(), starts.end(), rng);
  std::vector<int64_t> host;
  for (size_t r = 0; r < starts.size() * 3 / 4; ++r) {
    for (uint64_t i = 0; i < kHostRun; ++i) host.push_back(static_cast<int64_t>(starts[r] + i));
  }
  std::shuffle(host.begin(), host.end(), rng);
  if (repeat) host.insert(host.end(), host.begin(), host.begin() + 7);
  std::vector<int64_t> device(2 * host.size());
  for (size_t i = 0; i < device.size(); ++i) device[i] = static_cast<int64_t>(i);
  std::shuffle(device.begin(), device.end(), rng);
  device.resize(host.size());
  Case c;
  c.name = absl::StrCat("long host runs, planes ", s.planes, " layout ", static_cast<int>(s.kind),
                        " ps ", ps, repeat ? ", slots read twice" : "");
  c.components = PlaneComponents(layout);
  c.runs = CoalesceRuns(host, device);
  c.layers = SameLayers(kLayers);
  c.device_layers = kLayers;
  c.device_tokens = 2 * host.size();
  c.load_only = repeat;
  return c;
}

TEST_P(CopyPlanTest, LongHostRunsInAnyRequestOrder) {
  ExpectAllPathsMatchNaive(LongRunCase(GetParam(), false));
  ExpectAllPathsMatchNaive(LongRunCase(GetParam(), true));
  Case sharded = LongRunCase(GetParam(), false);
  sharded.layers = ShardLayers(2, kLayers, 3, 5);  // the last two host layers
  sharded.device_layers = 2;
  ExpectAllPathsMatchNaive(sharded);
}

std::vector<Shape> Shapes() {
  std::vector<Shape> shapes;
  for (LayoutKind kind :
       {LayoutKind::kLayerFirst, LayoutKind::kPageFirst, LayoutKind::kPageFirstDirect,
        LayoutKind::kPageHead, LayoutKind::kPageUnified}) {
    for (uint64_t ps : {1, 3, 4}) {
      shapes.push_back(Shape{kind, 2, 3, ps});  // MHA-like, K and V
      shapes.push_back(Shape{kind, 1, 1, ps});  // MLA-like latent
      if (kind == LayoutKind::kPageUnified) {
        shapes.push_back(Shape{kind, 2, 3, ps, 3});  // MHA-like, a head group per head
        shapes.push_back(Shape{kind, 1, 3, ps, 3});  // K_ONLY-like, a head group per head
      }
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
    case PoolKind::kMha:  // PAGE_UNIFIED in 2 head groups of 2 heads
      s.head_num = 4;
      s.head_dim = 4;
      if (layout == LayoutKind::kPageUnified) s.head_groups = 2;
      break;
    case PoolKind::kMla:
      s.kv_lora_rank = 8;
      s.qk_rope_head_dim = 4;
      break;
    case PoolKind::kMhaAsymmetric:
      s.v_head_dim = 6;
      [[fallthrough]];
    case PoolKind::kKOnly:
      s.head_num = 2;
      s.head_dim = 4;
      if (kind == PoolKind::kKOnly) s.follows = "mha";
      if (layout == LayoutKind::kPageUnified) s.head_groups = 2;
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
      EXPECT_EQ(c.region_offset, g.region_offset + p * g.layout.plane_stride);
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
    for (LayoutKind layout :
         {LayoutKind::kLayerFirst, LayoutKind::kPageFirst, LayoutKind::kPageFirstDirect,
          LayoutKind::kPageHead, LayoutKind::kPageUnified}) {
      if (ValidateSpec(SpecOf(kind, layout)).ok()) out.push_back(KindCase{kind, layout});
    }
  }
  // MHA and MLA as MakeComponents places PAGE_UNIFIED's interleaved planes
  // (their other layouts are the plane shapes above).
  out.push_back(KindCase{PoolKind::kMha, LayoutKind::kPageUnified});
  out.push_back(KindCase{PoolKind::kMla, LayoutKind::kPageUnified});
  return out;
}

INSTANTIATE_TEST_SUITE_P(AllKinds, KindCopyPlanTest, ::testing::ValuesIn(KindCases()),
                         KindCaseName);

TEST(KindCasesTest, CoverEveryKindOfTheTask) {
  // MHA_ASYMMETRIC pf/pfd, K_ONLY lf/pf/pfd/pu, DSA lf, DSA_INDEXER, V4_PAGED and
  // V4_STATE lf/pf/pfd, MAMBA pfd; MHA and MLA pu.
  EXPECT_EQ(KindCases().size(), 2u + 4u + 1u + 3u + 1u + 3u + 3u + 2u);
}

TEST(GroupComponentsTest, UnifiedPlanesAreOneGroupOneChunkApart) {
  // MHA PAGE_UNIFIED: K at 0, V one (ps, H / G, D) chunk on, each plane's
  // extent reaching the buffer's end; one launch group of two planes.
  const PoolSpec mha = SpecOf(PoolKind::kMha, LayoutKind::kPageUnified);
  const std::vector<Component> comps = MakeComponents(mha, 16 * mha.page_size);
  ASSERT_EQ(comps.size(), 2u);
  const uint64_t chunk = 4 * (4 / 2) * 4 * 2;  // ps * H / G * D * bf16
  const uint64_t total = 16 * 4 * 3 * 4 * 4 * 2 * 2;
  EXPECT_EQ(comps[0].region_offset, 0u);
  EXPECT_EQ(comps[1].region_offset, chunk);
  EXPECT_EQ(comps[0].bytes(), total / 2);
  EXPECT_EQ(comps[0].region_offset + comps[0].extent_bytes(), total - chunk);
  EXPECT_EQ(comps[1].region_offset + comps[1].extent_bytes(), total);
  const std::vector<LayoutGroup> g = GroupComponents(comps);
  ASSERT_EQ(g.size(), 1u);
  EXPECT_EQ(g[0].layout.planes, 2u);
  EXPECT_EQ(g[0].layout.extent_bytes(), total);
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

// ---------------------------------------------------------------------------
// Plan shapes: few tiles and large copies whatever the request order.

// Host slots [start, start + len) of each host run, named one by one in
// shuffled request order, each with a device row of its own (every run of
// CoalesceRuns is one slot), or, with `device_runs`, device rows that
// follow the host slots run by run (runs merge once host-sorted).
std::vector<IndexRun> ShuffledSlots(const std::vector<std::pair<uint64_t, uint64_t>>& host_runs,
                                    bool device_runs) {
  std::vector<std::pair<int64_t, int64_t>> pairs;  // (host slot, device row)
  for (const auto& [start, len] : host_runs) {
    for (uint64_t i = 0; i < len; ++i) pairs.emplace_back(static_cast<int64_t>(start + i), 0);
  }
  std::mt19937_64 rng(29);
  // Rows 3 apart: no two follow each other.
  std::vector<int64_t> device(pairs.size());
  for (size_t i = 0; i < device.size(); ++i) device[i] = static_cast<int64_t>(3 * i);
  std::shuffle(device.begin(), device.end(), rng);
  size_t k = 0;
  for (const auto& [start, len] : host_runs) {
    for (uint64_t i = 0; i < len; ++i, ++k) {
      pairs[k].second = device_runs ? static_cast<int64_t>(10 * start + i) : device[k];
    }
  }
  std::shuffle(pairs.begin(), pairs.end(), rng);
  std::vector<int64_t> host_slots, device_rows;
  for (const auto& [h, d] : pairs) {
    host_slots.push_back(h);
    device_rows.push_back(d);
  }
  std::vector<IndexRun> runs = CoalesceRuns(host_slots, device_rows);
  if (!device_runs) {
    EXPECT_EQ(runs.size(), pairs.size()) << "every run should be one slot";
  }
  EXPECT_GT(runs.size(), 2 * host_runs.size()) << "the request order should break the runs";
  return runs;
}

TEST(StagedPlanShapeTest, LayerFirstTilesPerRunCopiesPerLayerAndHostRun) {
  // 2 planes x 4 layers of rows of 32 B; host runs of 16 and 8 slots, the
  // second and third adjacent (one host run of 24), device rows scattered.
  const KvLayout layout(LayoutKind::kLayerFirst, 2, 4, 256, 1, 2, 16);
  const std::vector<IndexRun> runs = ShuffledSlots({{32, 16}, {96, 16}, {112, 8}}, false);
  StagedPlan plan;
  ASSERT_TRUE(PlanStaged({GroupOf(layout)}, runs, {}, 0, 4, 1 << 20, 1 << 30, &plan).ok());
  ASSERT_EQ(plan.chunks.size(), 1u);
  ASSERT_EQ(plan.launches.size(), 1u);
  EXPECT_EQ(plan.tiles.size(), 2u * 40u) << "a tile per (plane, run)";
  for (const CopyTile& t : plan.tiles) {
    EXPECT_EQ(t.layers, 4u);
    EXPECT_EQ(t.tokens, 1u);
    EXPECT_EQ(t.other_layer_stride, 40u * 32u) << "layers a chunk's slots apart";
  }
  ASSERT_EQ(plan.copies.size(), 2u * 4u * 2u) << "a copy per (plane, layer, host run)";
  for (size_t i = 0; i < plan.copies.size(); ++i) {
    EXPECT_EQ(plan.copies[i].bytes, (i % 2 == 0 ? 16u : 24u) * 32u) << "copy " << i;
  }
  // Two chunks of 25 and 15 slots, each with every held layer: the first
  // chunk's second host run is cut at its slot 9.
  StagedPlan split;
  ASSERT_TRUE(PlanStaged({GroupOf(layout)}, runs, {}, 0, 4, 25 * 8 * 32, 1 << 30, &split).ok());
  ASSERT_EQ(split.chunks.size(), 2u);
  EXPECT_EQ(split.chunks[0].bytes, 25u * 8u * 32u);
  EXPECT_EQ(split.chunks[1].bytes, 15u * 8u * 32u);
  EXPECT_EQ(split.tiles.size(), 2u * 40u);
  EXPECT_EQ(split.copies.size(), 2u * 4u * 2u + 2u * 4u * 1u);
  // Held layers [1, 3): tiles of two layers, copies per held layer only.
  StagedPlan part;
  ASSERT_TRUE(PlanStaged({GroupOf(layout)}, runs, {}, 1, 3, 1 << 20, 1 << 30, &part).ok());
  EXPECT_EQ(part.tiles.size(), 2u * 40u);
  EXPECT_EQ(part.tiles[0].layers, 2u);
  EXPECT_EQ(part.copies.size(), 2u * 2u * 2u);
}

TEST(StagedPlanShapeTest, HostSortedRunsMergeOnBothSides) {
  // Slots named in shuffled order whose device rows follow the host slots:
  // host-sorted, each host run is one run, so one tile per plane and run.
  const KvLayout layout(LayoutKind::kLayerFirst, 2, 4, 256, 1, 2, 16);
  const std::vector<IndexRun> runs = ShuffledSlots({{32, 16}, {96, 16}}, true);
  StagedPlan plan;
  ASSERT_TRUE(PlanStaged({GroupOf(layout)}, runs, {}, 0, 4, 1 << 20, 1 << 30, &plan).ok());
  EXPECT_EQ(plan.tiles.size(), 2u * 2u);
  EXPECT_EQ(plan.copies.size(), 2u * 4u * 2u);
}

TEST(StagedPlanShapeTest, PageMajorBlocksSpanTheRunsOfAHostRun) {
  // Pages of 4: host runs of 2 and 3 whole pages, one slot per run (device
  // rows scattered). A host run's pages are one block of all layers (and
  // heads) whatever the runs inside; a tile per (plane, run).
  for (LayoutKind kind :
       {LayoutKind::kPageFirst, LayoutKind::kPageFirstDirect, LayoutKind::kPageHead}) {
    SCOPED_TRACE(LayoutName(kind));
    const KvLayout layout(kind, 2, 3, 64, 4, 2, 16);
    const std::vector<IndexRun> runs = ShuffledSlots({{8, 8}, {32, 12}}, false);
    StagedPlan plan;
    ASSERT_TRUE(PlanStaged({GroupOf(layout)}, runs, {}, 0, 3, 1 << 20, 1 << 30, &plan).ok());
    EXPECT_EQ(plan.tiles.size(), 2u * 20u);
    ASSERT_EQ(plan.copies.size(), 2u * 2u) << "a copy per (plane, host run)";
    EXPECT_EQ(plan.copies[0].bytes, 8u * 3u * 32u);
    EXPECT_EQ(plan.copies[1].bytes, 12u * 3u * 32u);
    for (const CopyTile& t : plan.tiles) {
      EXPECT_EQ(t.layers, 3u);
      EXPECT_EQ(t.other_layer_stride, LayerStride(layout)) << "staging mirrors the pool";
      EXPECT_EQ(t.pieces, kind == LayoutKind::kPageHead ? 2u : 1u);
    }
  }
}

TEST(StagedPlanShapeTest, UnifiedPagesAreOneBlockOfBothPlanes) {
  // PAGE_UNIFIED, pages of 4, 2 head groups: a host run's whole pages are
  // one block holding K and V of every group and layer, so one copy per host
  // run (not per plane), a tile per (plane, run) over every group.
  const KvLayout layout(LayoutKind::kPageUnified, 2, 3, 64, 4, 2, 16, 2);
  const std::vector<IndexRun> runs = ShuffledSlots({{8, 8}, {32, 12}}, false);
  StagedPlan plan;
  ASSERT_TRUE(PlanStaged({GroupOf(layout)}, runs, {}, 0, 3, 1 << 20, 1 << 30, &plan).ok());
  EXPECT_EQ(plan.tiles.size(), 2u * 20u);
  ASSERT_EQ(plan.copies.size(), 2u) << "a copy per host run, both planes";
  EXPECT_EQ(plan.copies[0].bytes, 2u * 8u * 3u * 32u);
  EXPECT_EQ(plan.copies[1].bytes, 2u * 12u * 3u * 32u);
  for (const CopyTile& t : plan.tiles) {
    EXPECT_EQ(t.layers, 3u);
    EXPECT_EQ(t.pieces, 2u) << "both head groups";
    EXPECT_EQ(t.other_layer_stride, LayerStride(layout)) << "staging mirrors the pool";
  }
  // The unit is a page of both planes; held layers [1, 3): per page and head
  // group, the group's held layers of both planes.
  EXPECT_EQ(StagedUnitBytes(layout), 2u * 3u * 4u * 32u);
  StagedPlan part;
  ASSERT_TRUE(PlanStaged({GroupOf(layout)}, runs, {}, 1, 3, 1 << 20, 1 << 30, &part).ok());
  ASSERT_EQ(part.copies.size(), 5u * 2u) << "a copy per page and head group";
  for (const StagedCopy& c : part.copies) EXPECT_EQ(c.bytes, 2u * 2u * 4u * 16u);
}

TEST(CopyLanesPerItemTest, LaneGroupsCoverSmallItemsWithoutIdleLanes) {
  EXPECT_EQ(CopyLanesPerItem(16), 1u);
  EXPECT_EQ(CopyLanesPerItem(48), 4u);
  EXPECT_EQ(CopyLanesPerItem(128), 8u);
  EXPECT_EQ(CopyLanesPerItem(256), 16u);  // PAGE_HEAD's 128 bf16 heads: two to a warp
  EXPECT_EQ(CopyLanesPerItem(512), 32u);
  EXPECT_EQ(CopyLanesPerItem(2048), 32u);
  EXPECT_EQ(CopyLanesPerItem(4096 + 16), 32u);
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
  // PAGE_UNIFIED: a page's rows of one layer and plane, as PAGE_FIRST_DIRECT;
  // in head groups, a piece per slot and group, as PAGE_HEAD per head.
  EXPECT_EQ(CopyEnginePiecesPerLayer(KvLayout(LayoutKind::kPageUnified, 2, 4, 64, 16, 2, 8), runs),
            3u);
  EXPECT_EQ(
      CopyEnginePiecesPerLayer(KvLayout(LayoutKind::kPageUnified, 2, 4, 64, 16, 2, 8, 2), runs),
      70u);
  // Over groups: planes count, bytes are rows x row bytes x planes.
  const LayerPieces lp = CopyEngineLayerPieces(
      {GroupOf(KvLayout(LayoutKind::kPageFirstDirect, 2, 4, 64, 16, 2, 8))}, runs, {});
  EXPECT_EQ(lp.pieces, 6u);
  EXPECT_EQ(lp.bytes, 2u * 35u * 16u);
}

// Which path auto gives PAGE_UNIFIED jobs (DecidePath over the facts the
// engine gathers from these plans): a page's layer rows are one copy-engine
// piece, so large pages go to the copy engines; at page size 1 the pieces
// are rows, and the staged path's blocks (whole pages of both planes and all
// layers) take it.
TEST(UnifiedPathTest, AutoTakesTheCopyEnginesForLargePagesElseStaged) {
  auto decide = [](uint64_t ps, uint64_t groups, bool mps) {
    // MHA, 8 heads x 128 bf16 (2 KiB rows), 4 layers, 64 pages.
    const KvLayout layout(LayoutKind::kPageUnified, 2, 4, 64 * ps, ps, 8, 256, groups);
    std::vector<IndexRun> runs;  // every other page, device rows scattered
    for (uint64_t p = 0; p < 64; p += 2) runs.push_back(IndexRun{p * ps, 3 * p * ps, ps});
    const std::vector<LayoutGroup> groups_of = {GroupOf(layout)};
    const LayerPieces pieces = CopyEngineLayerPieces(groups_of, runs, {});
    PathFacts facts;
    facts.ce_piece_bytes = pieces.bytes / pieces.pieces;
    facts.mps = mps;
    facts.staged_block_bytes = [&]() -> absl::StatusOr<uint64_t> {
      StagedPlan plan;
      absl::Status s = PlanStaged(groups_of, runs, {}, 0, 4, 64 << 20, 1 << 30, &plan);
      if (!s.ok()) return s;
      uint64_t bytes = 0;
      for (const StagedCopy& c : plan.copies) bytes += c.bytes;
      return bytes / plan.copies.size();
    };
    absl::StatusOr<PathDecision> d = DecidePath(facts, PathPolicy{});
    EXPECT_TRUE(d.ok()) << d.status();
    return d.ok() ? d->path : CudaPath::kAuto;
  };
  // ps 64: 128 KiB pieces (a page's rows of one layer and plane).
  EXPECT_EQ(decide(64, 1, false), CudaPath::kCopyEngine);
  EXPECT_EQ(decide(64, 1, true), CudaPath::kCopyEngine);
  // ps 1: 2 KiB pieces, 16 KiB staged blocks (a page of 2 planes x 4 layers).
  EXPECT_EQ(decide(1, 1, false), CudaPath::kStaged);
  EXPECT_EQ(decide(1, 1, true), CudaPath::kStaged);
  // Head groups split the rows (256 B pieces), never the staged blocks.
  EXPECT_EQ(decide(16, 8, false), CudaPath::kStaged);
}

#ifdef KVHOST_HAVE_CUDA_ENGINE
// ---------------------------------------------------------------------------
// The kernel itself where there is a GPU (skipped elsewhere): staged and SM
// copy plans run through LaunchCopyKernel on device copies of the buffers,
// the pool's copies done with cudaMemcpy, against the same reference. Its
// forms: lane groups of 16 (PAGE_HEAD's 256 B heads), of 4 (48 B rows), a
// warp per 512 B row, and the byte copy (24 B rows, and unaligned launches).

class GpuBuffers {
 public:
  explicit GpuBuffers(const Case& c) : c_(c) {}
  GpuBuffers(const GpuBuffers&) = delete;
  GpuBuffers& operator=(const GpuBuffers&) = delete;
  ~GpuBuffers() {
    for (void* p : allocations_) cudaFree(p);
  }

  // Device memory holding `bytes` of `data` (uninitialised where null).
  uint8_t* Upload(const void* data, size_t bytes) {
    void* p = nullptr;
    EXPECT_EQ(cudaMalloc(&p, std::max<size_t>(bytes, 16)), cudaSuccess);
    allocations_.push_back(p);
    if (data != nullptr) {
      EXPECT_EQ(cudaMemcpy(p, data, bytes, cudaMemcpyHostToDevice), cudaSuccess);
    }
    return static_cast<uint8_t*>(p);
  }

  // The worker's layer buffers of `b` on the device, and per group its table.
  void UploadDevice(const Buffers& b, const std::vector<LayoutGroup>& groups) {
    for (const auto& layer : b.device) layers_.push_back(Upload(layer.data(), layer.size()));
    for (const LayoutGroup& g : groups) {
      const uint8_t* const* first = layers_.data() + uint64_t{g.first_component} * c_.device_layers;
      tables_.push_back(reinterpret_cast<uint8_t* const*>(
          Upload(first, g.layout.planes * c_.device_layers * sizeof(uint8_t*))));
    }
  }
  void DownloadDevice(Buffers* b) {
    for (size_t i = 0; i < layers_.size(); ++i) {
      EXPECT_EQ(
          cudaMemcpy(b->device[i].data(), layers_[i], b->device[i].size(), cudaMemcpyDeviceToHost),
          cudaSuccess);
    }
  }
  uint8_t* const* table(size_t group) const { return tables_[group]; }

 private:
  const Case& c_;
  std::vector<void*> allocations_;
  std::vector<uint8_t*> layers_;
  std::vector<uint8_t* const*> tables_;
};

bool HaveGpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

// A small grid, so that every lane group takes several items.
constexpr int kGpuBlocks = 3;

void ExpectGpuStagedMatchesNaive(const Case& c, bool aligned16) {
  SCOPED_TRACE(c.name);
  const std::vector<LayoutGroup> groups = GroupComponents(c.components);
  const std::vector<Held> held = HeldOf(c);
  const uint64_t unit = UnitOf(groups, held);
  std::mt19937_64 rng(31);
  for (const uint64_t chunk : {std::max(unit, 2 * RowsOf(groups, held) + 21), uint64_t{1} << 20}) {
    for (const bool backup : {true, false}) {
      if (backup && c.load_only) continue;
      SCOPED_TRACE(absl::StrCat("chunk ", chunk, backup ? " backup" : " load"));
      Buffers got = MakeBuffers(c, rng);
      Buffers want = got;
      NaiveCopy(c, backup, &want);
      GpuBuffers gpu(c);
      gpu.UploadDevice(got, groups);
      uint8_t* staging = gpu.Upload(nullptr, chunk);
      for (const Held& h : held) {
        StagedPlan plan;
        ASSERT_TRUE(
            PlanStaged(groups, c.runs, c.page_runs, h.begin, h.end, chunk, 1 << 30, &plan).ok());
        const auto* tiles = reinterpret_cast<const CopyTile*>(
            gpu.Upload(plan.tiles.data(), plan.tiles.size() * sizeof(CopyTile)));
        for (const StagedChunk& ch : plan.chunks) {
          for (size_t i = ch.copy_begin; i < ch.copy_end && !backup; ++i) {
            const StagedCopy& cp = plan.copies[i];
            ASSERT_EQ(cudaMemcpy(staging + cp.staging_offset,
                                 got.regions[cp.region].data() + cp.host_offset, cp.bytes,
                                 cudaMemcpyHostToDevice),
                      cudaSuccess);
          }
          for (size_t k = ch.launch_begin; k < ch.launch_end; ++k) {
            const TileLaunch& launch = plan.launches[k];
            CopyKernelArgs args;
            args.layout = groups[launch.group].layout;
            args.device_layers = gpu.table(launch.group);
            args.device_layers_per_plane = c.device_layers;
            args.device_layer_delta = static_cast<int32_t>(h.delta);
            args.other = staging;
            args.tiles = tiles + launch.tile_begin;
            args.tile_count = static_cast<uint32_t>(launch.tile_end - launch.tile_begin);
            args.item_count = launch.items;
            args.to_device = !backup;
            args.aligned16 = aligned16;
            ASSERT_EQ(LaunchCopyKernel(args, kGpuBlocks, nullptr), cudaSuccess);
          }
          ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
          for (size_t i = ch.copy_begin; i < ch.copy_end && backup; ++i) {
            const StagedCopy& cp = plan.copies[i];
            ASSERT_EQ(cudaMemcpy(got.regions[cp.region].data() + cp.host_offset,
                                 staging + cp.staging_offset, cp.bytes, cudaMemcpyDeviceToHost),
                      cudaSuccess);
          }
        }
      }
      gpu.DownloadDevice(&got);
      EXPECT_TRUE(got.regions == want.regions);
      EXPECT_TRUE(got.device == want.device);
    }
  }
}

// The SM copy plan with the pool's regions in device memory as `other`.
void ExpectGpuSmCopyMatchesNaive(const Case& c) {
  SCOPED_TRACE(c.name);
  const std::vector<LayoutGroup> groups = GroupComponents(c.components);
  const SmCopyPlan plan = PlanSmCopy(groups, c.runs, c.page_runs);
  std::mt19937_64 rng(37);
  for (const bool backup : {true, false}) {
    if (backup && c.load_only) continue;
    SCOPED_TRACE(backup ? "backup" : "load");
    Buffers got = MakeBuffers(c, rng);
    Buffers want = got;
    NaiveCopy(c, backup, &want);
    GpuBuffers gpu(c);
    gpu.UploadDevice(got, groups);
    std::vector<uint8_t*> regions;
    for (const auto& r : got.regions) regions.push_back(gpu.Upload(r.data(), r.size()));
    const auto* tiles = reinterpret_cast<const CopyTile*>(
        gpu.Upload(plan.tiles.data(), plan.tiles.size() * sizeof(CopyTile)));
    for (const JobLayer& jl : c.layers) {
      if (jl.host_layer < 0) continue;
      for (const TileLaunch& launch : plan.launches) {
        const LayoutGroup& g = groups[launch.group];
        CopyKernelArgs args;
        args.layout = g.layout;
        args.device_layers = gpu.table(launch.group);
        args.device_layers_per_plane = c.device_layers;
        args.device_layer_delta = static_cast<int32_t>(int64_t{jl.device_layer} - jl.host_layer);
        args.other = regions[g.region] + g.region_offset;
        args.tiles = tiles + launch.tile_begin;
        args.tile_count = static_cast<uint32_t>(launch.tile_end - launch.tile_begin);
        args.item_count = launch.items;
        args.layer_shift = static_cast<uint32_t>(jl.host_layer);
        args.to_device = !backup;
        args.aligned16 = g.region_offset % 16 == 0;
        ASSERT_EQ(LaunchCopyKernel(args, kGpuBlocks, nullptr), cudaSuccess);
      }
    }
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    for (size_t i = 0; i < regions.size(); ++i) {
      ASSERT_EQ(cudaMemcpy(got.regions[i].data(), regions[i], got.regions[i].size(),
                           cudaMemcpyDeviceToHost),
                cudaSuccess);
    }
    gpu.DownloadDevice(&got);
    EXPECT_TRUE(got.regions == want.regions);
    EXPECT_TRUE(got.device == want.device);
  }
}

TEST(CopyKernelGpuTest, EveryKernelFormMatchesTheReference) {
  if (!HaveGpu()) GTEST_SKIP() << "no usable CUDA GPU";
  for (const Shape& s : Shapes()) {
    // Rows of 256 B heads (PAGE_HEAD: lane groups of 16; the others a warp
    // per 512 B row) and of 48 B (groups of 4); 24 B rows (bytes).
    for (const bool repeat : {false, true}) {
      const Case c = LongRunCase(s, repeat);
      ExpectGpuStagedMatchesNaive(c, true);
      ExpectGpuSmCopyMatchesNaive(c);
    }
    ExpectGpuStagedMatchesNaive(LongRunCase(s, false), false);
    const Case small = PlaneCase(s, SameLayers(kLayers), kLayers);
    ExpectGpuStagedMatchesNaive(small, true);
    ExpectGpuSmCopyMatchesNaive(small);
    if (::testing::Test::HasFatalFailure()) return;
  }
}
#endif  // KVHOST_HAVE_CUDA_ENGINE

}  // namespace
}  // namespace kvhost
