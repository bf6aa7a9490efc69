#include "server/transfer/cuda/copy_plan.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/transfer/engine.h"

namespace kvhost {
namespace {

// Tokens per tile stay well inside CopyTile::tokens.
constexpr uint64_t kMaxTileTokens = uint64_t{1} << 30;

uint16_t PiecesPerRow(const KvLayout& layout) { return static_cast<uint16_t>(layout.RowPieces()); }

bool SameShape(const KvLayout& a, const KvLayout& b) {
  return a.kind == b.kind && a.layers == b.layers && a.tokens == b.tokens &&
         a.page_size == b.page_size && a.heads == b.heads && a.head_bytes == b.head_bytes &&
         a.head_groups == b.head_groups && a.interleaved_planes == b.interleaved_planes;
}

// Staging offsets of a group start at a multiple of the kernel's 16-byte
// vectors: a group whose items are multiples of 16 then finds all of them
// aligned, whatever the item size of the group before it in the chunk.
constexpr uint64_t kStagingAlign = 16;

CopyTile Tile(uint64_t plane, uint64_t host_token, uint64_t device_token, uint64_t layer0,
              uint64_t layers, uint64_t piece0, uint64_t pieces) {
  CopyTile s;
  s.plane = static_cast<uint16_t>(plane);
  s.host_token = host_token;
  s.device_token = device_token;
  s.layer0 = static_cast<uint32_t>(layer0);
  s.layers = static_cast<uint32_t>(layers);
  s.piece0 = static_cast<uint16_t>(piece0);
  s.pieces = static_cast<uint16_t>(pieces);
  return s;
}

// Runs in host slot order (stable: a load's runs that read one slot keep
// their order), runs then adjacent on both sides merged. A staged chunk's
// runs may come in any order (a backup's host slots never overlap; a load
// reading a slot twice reads it into two places), and in host order
// host-adjacent runs share blocks and copies whatever the request order.
std::vector<IndexRun> HostSorted(const std::vector<IndexRun>& runs) {
  std::vector<IndexRun> sorted;
  sorted.reserve(runs.size());
  for (const IndexRun& run : runs) {
    if (run.count > 0) sorted.push_back(run);
  }
  auto by_host = [](const IndexRun& a, const IndexRun& b) { return a.host < b.host; };
  if (!std::is_sorted(sorted.begin(), sorted.end(), by_host)) {
    std::stable_sort(sorted.begin(), sorted.end(), by_host);
  }
  std::vector<IndexRun> out;
  out.reserve(sorted.size());
  for (const IndexRun& run : sorted) {
    if (!out.empty() && out.back().host + out.back().count == run.host &&
        out.back().device + out.back().count == run.device) {
      out.back().count += run.count;
    } else {
      out.push_back(run);
    }
  }
  return out;
}

// Host-sorted runs [begin, end) whose host slots follow each other, covering
// host slots [host, host + count) once each: the page-major layouts plan
// blocks over these, so that a page whose slots come in several runs (device
// rows scattered) is still one block.
struct HostRun {
  const IndexRun* begin = nullptr;
  const IndexRun* end = nullptr;
  uint64_t host = 0;
  uint64_t count = 0;
};

std::vector<HostRun> HostRunsOf(const std::vector<IndexRun>& sorted) {
  std::vector<HostRun> out;
  for (const IndexRun& run : sorted) {
    if (!out.empty() && out.back().host + out.back().count == run.host) {
      out.back().end = &run + 1;
      out.back().count += run.count;
    } else {
      out.push_back(HostRun{&run, &run + 1, run.host, run.count});
    }
  }
  return out;
}

// Fills a StagedPlan chunk by chunk.
class ChunkBuilder {
 public:
  ChunkBuilder(uint64_t chunk_bytes, uint64_t host_split, StagedPlan* plan)
      : chunk_bytes_(chunk_bytes), host_split_(host_split), plan_(plan) {}

  // The group the next tiles and copies belong to.
  void SetGroup(uint32_t index, const LayoutGroup* group) {
    group_index_ = index;
    group_ = group;
    used_ = std::min(chunk_bytes_, (used_ + kStagingAlign - 1) / kStagingAlign * kStagingAlign);
  }
  const LayoutGroup& group() const { return *group_; }
  uint64_t chunk_bytes() const { return chunk_bytes_; }
  uint64_t free() const { return chunk_bytes_ - used_; }

  // The staging offset of `bytes` more of the current chunk.
  // REQUIRES: bytes <= free().
  uint64_t Reserve(uint64_t bytes) {
    const uint64_t at = used_;
    used_ += bytes;
    return at;
  }

  // Appends `s` to the current chunk's launch of the group.
  void AddTile(CopyTile s) {
    std::vector<TileLaunch>& launches = plan_->launches;
    if (launches.size() == launch_begin_ || launches.back().group != group_index_) {
      const size_t at = plan_->tiles.size();
      launches.push_back(TileLaunch{group_index_, at, at, 0});
    }
    TileLaunch& launch = launches.back();
    s.first_item = launch.items;
    plan_->tiles.push_back(s);
    launch.tile_end = plan_->tiles.size();
    launch.items += TileItems(s);
  }

  // A copy of `bytes` between host offset `host` of the group's layout
  // (from its first plane) and staging offset `staging`, merged with the
  // last one where both follow it, split at registration chunks.
  void AddCopy(uint64_t host, uint64_t staging, uint64_t bytes) {
    const uint32_t region = group_->region;
    host += group_->region_offset;
    while (bytes > 0) {
      const uint64_t n = std::min(bytes, (host / host_split_ + 1) * host_split_ - host);
      std::vector<StagedCopy>& copies = plan_->copies;
      if (copies.size() > copy_begin_ && host % host_split_ != 0 &&
          copies.back().region == region &&
          copies.back().host_offset + copies.back().bytes == host &&
          copies.back().staging_offset + copies.back().bytes == staging) {
        copies.back().bytes += n;
      } else {
        copies.push_back(StagedCopy{region, host, staging, n});
      }
      host += n;
      staging += n;
      bytes -= n;
    }
  }

  // Adds `units` blocks of `unit_tokens` host slots and `unit_bytes` each,
  // starting at `tile`'s host slot (its `tokens` and device row ignored),
  // which together are one contiguous range of the pool starting at the
  // offset of (host slot, layer0, piece0), mirrored in staging: one tile per
  // run of `hr` in each chunk's part, and per plane of [tile.plane,
  // tile.plane + planes) (PAGE_UNIFIED's blocks hold every plane).
  // REQUIRES: unit_bytes <= chunk_bytes, the slots inside `hr`.
  void Add(const HostRun& hr, CopyTile tile, uint64_t units, uint64_t unit_tokens,
           uint64_t unit_bytes, uint64_t planes = 1) {
    const KvLayout& layout = group_->layout;
    while (units > 0) {
      uint64_t fit = free() / unit_bytes;
      if (fit == 0) {
        Flush();
        continue;
      }
      fit = std::min(fit, units);
      const uint64_t host_offset =
          layout.Offset(tile.plane, tile.host_token, tile.layer0, layout.PieceHead(tile.piece0));
      const uint64_t bytes = fit * unit_bytes;
      const uint64_t staging = Reserve(bytes);
      const uint64_t from = tile.host_token;
      const uint64_t to = from + fit * unit_tokens;
      // The runs of `hr` that meet [from, to), host-sorted.
      const IndexRun* run = std::partition_point(
          hr.begin, hr.end, [&](const IndexRun& r) { return r.host + r.count <= from; });
      for (; run != hr.end && run->host < to; ++run) {
        const uint64_t a = std::max(from, run->host);
        const uint64_t b = std::min(to, run->host + run->count);
        for (uint64_t t = a; t < b; t += kMaxTileTokens) {
          for (uint64_t q = 0; q < planes; ++q) {
            CopyTile s = tile;
            s.plane = static_cast<uint16_t>(tile.plane + q);
            s.host_token = t;
            s.device_token = run->device + (t - run->host);
            s.tokens = static_cast<uint32_t>(std::min(kMaxTileTokens, b - t));
            s.bias = static_cast<int64_t>(host_offset - staging);
            s.other_layer_stride = LayerStride(layout);
            AddTile(s);
          }
        }
      }
      AddCopy(host_offset, staging, bytes);
      tile.host_token = to;
      units -= fit;
    }
  }

  void Flush() {
    if (used_ == 0) return;
    StagedChunk chunk;
    chunk.launch_begin = launch_begin_;
    chunk.launch_end = plan_->launches.size();
    chunk.copy_begin = copy_begin_;
    chunk.copy_end = plan_->copies.size();
    chunk.bytes = used_;
    plan_->chunks.push_back(chunk);
    launch_begin_ = plan_->launches.size();
    copy_begin_ = plan_->copies.size();
    used_ = 0;
  }

 private:
  const uint64_t chunk_bytes_;
  const uint64_t host_split_;
  StagedPlan* const plan_;
  uint32_t group_index_ = 0;
  const LayoutGroup* group_ = nullptr;
  size_t launch_begin_ = 0;
  size_t copy_begin_ = 0;
  uint64_t used_ = 0;
};

// One window of a LAYER_FIRST group: `tokens` host slots, the pieces of
// host-sorted runs in `pieces`, times the (plane, layer) slices
// [first, first + slices) of the held layers [lb, lb + n) (slice
// plane * n + layer - lb). Staging holds [slice][the window's slots in host
// order]: one tile per (plane, piece) over the plane's layers in the window
// (layers apart by the window's slot bytes), one copy per (slice, piece),
// host-adjacent pieces merged.
void AddLayerFirstWindow(const std::vector<IndexRun>& pieces, uint64_t tokens, uint64_t first,
                         uint64_t slices, uint64_t lb, uint64_t n, ChunkBuilder* builder) {
  const KvLayout& layout = builder->group().layout;
  const uint64_t tb = layout.token_bytes;
  const uint64_t base = builder->Reserve(slices * tokens * tb);
  for (uint64_t k = first; k < first + slices;) {
    const uint64_t plane = k / n;
    const uint64_t layers = std::min(first + slices, (plane + 1) * n) - k;
    const uint64_t layer0 = lb + k % n;
    uint64_t pos = 0;
    for (const IndexRun& piece : pieces) {
      CopyTile s = Tile(plane, piece.host, piece.device, layer0, layers, 0, 1);
      s.tokens = static_cast<uint32_t>(piece.count);
      const uint64_t staging = base + ((k - first) * tokens + pos) * tb;
      s.bias = static_cast<int64_t>(layout.Offset(plane, piece.host, layer0, 0) - staging);
      s.other_layer_stride = tokens * tb;
      builder->AddTile(s);
      pos += piece.count;
    }
    k += layers;
  }
  // Host-adjacent pieces are one copy per slice: merged once here rather
  // than by AddCopy for every slice (a page-1 window of scattered device
  // rows has thousands of one-slot pieces, often in a few host runs).
  struct HostSpan {
    uint64_t host;   // first host slot
    uint64_t pos;    // its slot in the window's staging
    uint64_t count;  // slots
  };
  std::vector<HostSpan> spans;
  uint64_t pos = 0;
  for (const IndexRun& piece : pieces) {
    if (!spans.empty() && spans.back().host + spans.back().count == piece.host) {
      spans.back().count += piece.count;
    } else {
      spans.push_back(HostSpan{piece.host, pos, piece.count});
    }
    pos += piece.count;
  }
  for (uint64_t k = first; k < first + slices; ++k) {
    for (const HostSpan& span : spans) {
      builder->AddCopy(layout.Offset(k / n, span.host, lb + k % n, 0),
                       base + ((k - first) * tokens + span.pos) * tb, span.count * tb);
    }
  }
}

// A LAYER_FIRST group, host layers [lb, lb + n), host-sorted runs: windows
// of as many slots as a chunk holds with every held layer of every plane, so
// that a copy is a host run of many slots; where one slot's held rows do not
// fit a chunk, slice by slice (a unit is one row).
void PlanLayerFirst(const std::vector<IndexRun>& runs, uint64_t lb, uint64_t n,
                    ChunkBuilder* builder) {
  const KvLayout& layout = builder->group().layout;
  const uint64_t tb = layout.token_bytes;
  const uint64_t all = layout.planes * n;
  const uint64_t per_window = all * tb <= builder->chunk_bytes() ? all : 1;
  std::vector<IndexRun> pieces;
  for (uint64_t first = 0; first < all; first += per_window) {
    size_t r = 0;
    uint64_t done = 0;  // slots of runs[r] already planned
    while (r < runs.size()) {
      const uint64_t window = std::min(builder->free() / (per_window * tb), kMaxTileTokens);
      if (window == 0) {
        builder->Flush();
        continue;
      }
      pieces.clear();
      uint64_t tokens = 0;
      while (r < runs.size() && tokens < window) {
        const uint64_t take = std::min(runs[r].count - done, window - tokens);
        pieces.push_back(IndexRun{runs[r].host + done, runs[r].device + done, take});
        tokens += take;
        done += take;
        if (done == runs[r].count) {
          ++r;
          done = 0;
        }
      }
      AddLayerFirstWindow(pieces, tokens, first, per_window, lb, n, builder);
    }
  }
}

// Slots [host, host + count) of `hr` in PAGE_HEAD, each slot's held layers
// of one head as a block (the layers of a slot's head are adjacent; nothing
// larger is once some layers are left out).
void AddTokenHeads(const HostRun& hr, uint64_t plane, uint64_t host, uint64_t count, uint64_t lb,
                   uint64_t n, ChunkBuilder* builder) {
  const KvLayout& layout = builder->group().layout;
  for (uint64_t t = 0; t < count; ++t) {
    for (uint64_t h = 0; h < layout.RowPieces(); ++h) {
      builder->Add(hr, Tile(plane, host + t, 0, lb, n, h, 1), 1, 1, n * layout.RowPieceBytes());
    }
  }
}

// Slots [host, host + count) of `hr` that lie in one page but do not fill
// it, in PAGE_HEAD, as blocks that are complete: per head (a head's slots of
// one page are adjacent there, all layers each). All layers held;
// PAGE_FIRST_DIRECT's partial pages are planned per layer in PlanPageMajor.
void AddPartialPage(const HostRun& hr, uint64_t plane, uint64_t host, uint64_t count,
                    ChunkBuilder* builder) {
  const KvLayout& layout = builder->group().layout;
  if (layout.RowContiguous()) {
    builder->Add(hr, Tile(plane, host, 0, 0, layout.layers, 0, 1), count, 1,
                 layout.layers * layout.token_bytes);
    return;
  }
  for (uint64_t h = 0; h < layout.RowPieces(); ++h) {
    builder->Add(hr, Tile(plane, host, 0, 0, layout.layers, h, 1), count, 1,
                 layout.layers * layout.RowPieceBytes());
  }
}

// One plane of a PAGE_FIRST, PAGE_FIRST_DIRECT or PAGE_HEAD group, host
// layers [lb, lb + n), over host runs: blocks as copy_plan.h lists them,
// each mirrored in staging, a tile per run inside each.
void PlanPageMajor(uint64_t plane, const std::vector<HostRun>& host_runs, uint64_t lb, uint64_t n,
                   ChunkBuilder* builder) {
  const KvLayout& layout = builder->group().layout;
  const uint64_t tb = layout.token_bytes;
  const uint64_t ps = layout.page_size;
  const bool all = lb == 0 && n == layout.layers;
  for (const HostRun& hr : host_runs) {
    if (layout.kind == LayoutKind::kPageFirst) {
      if (all) {
        builder->Add(hr, Tile(plane, hr.host, 0, 0, n, 0, 1), hr.count, 1, n * tb);
      } else {
        for (uint64_t t = 0; t < hr.count; ++t) {
          builder->Add(hr, Tile(plane, hr.host + t, 0, lb, n, 0, 1), 1, 1, n * tb);
        }
      }
      continue;
    }
    if (layout.kind == LayoutKind::kPageHead && !all) {
      AddTokenHeads(hr, plane, hr.host, hr.count, lb, n, builder);
      continue;
    }
    uint64_t t = hr.host;
    const uint64_t end = hr.host + hr.count;
    while (t < end) {
      const uint64_t page_end = t - t % ps + ps;
      if (t % ps != 0 || end < page_end) {
        const uint64_t to = std::min(end, page_end);
        if (layout.kind == LayoutKind::kPageFirstDirect) {
          for (uint64_t l = lb; l < lb + n; ++l) {
            builder->Add(hr, Tile(plane, t, 0, l, 1, 0, 1), to - t, 1, tb);
          }
        } else {
          AddPartialPage(hr, plane, t, to - t, builder);
        }
        t = to;
        continue;
      }
      const uint64_t pages = (end - t) / ps;
      if (all) {
        builder->Add(hr, Tile(plane, t, 0, 0, n, 0, PiecesPerRow(layout)), pages, ps,
                     n * layout.page_bytes);
      } else {  // PAGE_FIRST_DIRECT: a page's held layers are adjacent
        for (uint64_t p = 0; p < pages; ++p) {
          builder->Add(hr, Tile(plane, t + p * ps, 0, lb, n, 0, 1), 1, ps, n * layout.page_bytes);
        }
      }
      t += pages * ps;
    }
  }
}

// A PAGE_UNIFIED group, host layers [lb, lb + n), over host runs. A page's
// block (G, L, planes, ps, H / G, D) holds every plane, so where the group
// has all of the pool's planes (MHA's K and V) its blocks span them, a tile
// per plane and run inside each:
//   whole pages, all layers    a host run's pages, one block;
//   whole pages, some layers   per page and head group, the held layers;
//   partial pages (or a group  per plane, held layer and head group, the
//   of fewer planes)           slots' rows of the page (adjacent there).
void PlanUnified(const std::vector<HostRun>& host_runs, uint64_t lb, uint64_t n,
                 ChunkBuilder* builder) {
  const KvLayout& layout = builder->group().layout;
  const uint64_t ps = layout.page_size;
  const uint64_t groups = layout.head_groups;
  const uint64_t planes = layout.planes;
  // One (page, head group, layer)'s rows of every plane.
  const uint64_t layer_block = planes * layout.plane_stride;
  const bool all_planes = planes == layout.interleaved_planes;
  const bool all = lb == 0 && n == layout.layers;
  for (const HostRun& hr : host_runs) {
    uint64_t t = hr.host;
    const uint64_t end = hr.host + hr.count;
    while (t < end) {
      const uint64_t page_end = t - t % ps + ps;
      if (t % ps != 0 || end < page_end || !all_planes) {
        const uint64_t to = std::min(end, page_end);
        for (uint64_t plane = 0; plane < planes; ++plane) {
          for (uint64_t l = lb; l < lb + n; ++l) {
            for (uint64_t g = 0; g < groups; ++g) {
              builder->Add(hr, Tile(plane, t, 0, l, 1, g, 1), to - t, 1, layout.RowPieceBytes());
            }
          }
        }
        t = to;
        continue;
      }
      const uint64_t pages = (end - t) / ps;
      if (all) {
        builder->Add(hr, Tile(0, t, 0, 0, n, 0, groups), pages, ps, groups * n * layer_block,
                     planes);
      } else {
        for (uint64_t p = 0; p < pages; ++p) {
          for (uint64_t g = 0; g < groups; ++g) {
            builder->Add(hr, Tile(0, t + p * ps, 0, lb, n, g, 1), 1, ps, n * layer_block, planes);
          }
        }
      }
      t += pages * ps;
    }
  }
}

}  // namespace

std::vector<LayoutGroup> GroupComponents(const std::vector<Component>& components) {
  std::vector<LayoutGroup> groups;
  for (size_t i = 0; i < components.size(); ++i) {
    const Component& c = components[i];
    const bool page_rows = c.row_tokens > 1;
    if (!groups.empty()) {
      LayoutGroup& g = groups.back();
      if (g.page_rows == page_rows && g.region == c.region && SameShape(g.layout, c.layout) &&
          c.region_offset == g.region_offset + g.layout.planes * g.layout.plane_stride) {
        const KvLayout& l = g.layout;
        g.layout = KvLayout(l.kind, l.planes + 1, l.layers, l.tokens, l.page_size, l.heads,
                            l.head_bytes, l.head_groups, l.interleaved_planes);
        continue;
      }
    }
    LayoutGroup g;
    g.layout = c.layout;
    g.first_component = static_cast<uint32_t>(i);
    g.region = c.region;
    g.region_offset = c.region_offset;
    g.page_rows = page_rows;
    groups.push_back(g);
  }
  return groups;
}

HeldLayers HeldLayersOf(const std::vector<JobLayer>& layers) {
  HeldLayers held;
  for (const JobLayer& layer : layers) {
    if (layer.host_layer < 0) continue;
    const auto host = static_cast<uint64_t>(layer.host_layer);
    if (held.count() == 0) {
      held.begin = host;
      held.delta = int64_t{layer.device_layer} - layer.host_layer;
    }
    held.end = host + 1;
  }
  return held;
}

std::vector<HeldLayers> HeldLayerRanges(const std::vector<JobLayer>& layers) {
  // (host layer, delta) of every held ticket layer, in host layer order.
  std::vector<std::pair<uint64_t, int64_t>> held;
  for (const JobLayer& layer : layers) {
    if (layer.host_layer < 0) continue;
    held.emplace_back(static_cast<uint64_t>(layer.host_layer),
                      int64_t{layer.device_layer} - layer.host_layer);
  }
  std::sort(held.begin(), held.end());
  std::vector<HeldLayers> ranges;
  for (const auto& [host, delta] : held) {
    if (ranges.empty() || ranges.back().end != host || ranges.back().delta != delta) {
      ranges.push_back(HeldLayers{host, host + 1, delta});
    } else {
      ranges.back().end = host + 1;
    }
  }
  return ranges;
}

LayoutGroup GroupOf(const KvLayout& layout, bool page_rows) {
  LayoutGroup g;
  g.layout = layout;
  g.page_rows = page_rows;
  return g;
}

void PlanCopyEngineLayer(const std::vector<Component>& components,
                         const std::vector<IndexRun>& runs, const std::vector<IndexRun>& page_runs,
                         uint64_t host_layer, uint64_t host_split,
                         std::vector<CopyEnginePiece>* pieces) {
  for (size_t c = 0; c < components.size(); ++c) {
    const Component& component = components[c];
    // Merging stays inside one component's layer buffer: two buffers that
    // happen to be adjacent may still be different allocations.
    const size_t first = pieces->size();
    for (const IndexRun& run : component.row_tokens > 1 ? page_runs : runs) {
      ForEachPiece(component, host_layer, run, 0, run.count,
                   [&](uint64_t host_off, uint64_t device_off, uint64_t bytes) {
                     uint64_t host = component.region_offset + host_off;
                     while (bytes > 0) {
                       // Split at host registration chunks (CudaEngineOptions).
                       const uint64_t n =
                           std::min(bytes, (host / host_split + 1) * host_split - host);
                       CopyEnginePiece* last = pieces->size() > first ? &pieces->back() : nullptr;
                       if (last != nullptr && host % host_split != 0 &&
                           last->host_offset + last->bytes == host &&
                           last->device_offset + last->bytes == device_off) {
                         last->bytes += n;
                       } else {
                         pieces->push_back(CopyEnginePiece{static_cast<uint32_t>(c),
                                                           component.region, host, device_off, n});
                       }
                       host += n;
                       device_off += n;
                       bytes -= n;
                     }
                   });
    }
  }
}

SmCopyPlan PlanSmCopy(const std::vector<LayoutGroup>& groups, const std::vector<IndexRun>& runs,
                      const std::vector<IndexRun>& page_runs) {
  SmCopyPlan plan;
  for (size_t g = 0; g < groups.size(); ++g) {
    const KvLayout& layout = groups[g].layout;
    TileLaunch launch{static_cast<uint32_t>(g), plan.tiles.size(), 0, 0};
    for (uint64_t plane = 0; plane < layout.planes; ++plane) {
      for (const IndexRun& run : RunsOf(groups[g], runs, page_runs)) {
        for (uint64_t t = 0; t < run.count; t += kMaxTileTokens) {
          CopyTile s = Tile(plane, run.host + t, run.device + t, 0, 1, 0, PiecesPerRow(layout));
          s.tokens = static_cast<uint32_t>(std::min(kMaxTileTokens, run.count - t));
          s.other_layer_stride = LayerStride(layout);
          s.first_item = launch.items;
          launch.items += TileItems(s);
          plan.tiles.push_back(s);
        }
      }
    }
    launch.tile_end = plan.tiles.size();
    if (launch.items == 0) continue;
    plan.items_per_layer += launch.items;
    plan.launches.push_back(launch);
  }
  return plan;
}

uint64_t StagedUnitBytes(const KvLayout& layout, uint64_t layer_begin, uint64_t layer_end) {
  const uint64_t n = layer_end - layer_begin;
  switch (layout.kind) {
    case LayoutKind::kLayerFirst:
      return layout.token_bytes;
    case LayoutKind::kPageFirst:
      return n * layout.token_bytes;
    case LayoutKind::kPageFirstDirect:
      return n * layout.page_bytes;
    case LayoutKind::kPageHead:
      return n == layout.layers ? n * layout.page_bytes : n * layout.head_bytes;
    case LayoutKind::kPageUnified:
      // A page of every head group and plane, or a head group's held layers
      // of every plane; a group of fewer planes than the pool's moves rows.
      if (layout.planes < layout.interleaved_planes) return layout.RowPieceBytes();
      return (n == layout.layers ? layout.head_groups : 1) * n * layout.planes *
             layout.plane_stride;
  }
  return n * layout.page_bytes;
}

absl::Status PlanStaged(const std::vector<LayoutGroup>& groups, const std::vector<IndexRun>& runs,
                        const std::vector<IndexRun>& page_runs, uint64_t layer_begin,
                        uint64_t layer_end, uint64_t chunk_bytes, uint64_t host_split,
                        StagedPlan* plan) {
  for (const LayoutGroup& g : groups) {
    const KvLayout& layout = g.layout;
    const uint64_t unit = StagedUnitBytes(layout, layer_begin, layer_end);
    if (unit > chunk_bytes) {
      const bool all = layer_end - layer_begin == layout.layers;
      return absl::FailedPreconditionError(absl::StrCat(
          "the staged path moves whole blocks of ", unit, " bytes for this pool (",
          g.page_rows                              ? "a page row of "
          : layout.kind == LayoutKind::kLayerFirst ? "a token's row of "
          : layout.kind == LayoutKind::kPageFirst  ? "a token's rows of "
                                                   : "a page of ",
          layout.kind == LayoutKind::kLayerFirst ? "one layer"
          : all                                  ? "all layers"
                                                 : "the held layers",
          ") but a staging chunk has ", chunk_bytes, " bytes; raise --staging-bytes to at least ",
          2 * unit, " or use another path"));
    }
  }
  plan->tiles.clear();
  plan->launches.clear();
  plan->copies.clear();
  plan->chunks.clear();
  ChunkBuilder builder(chunk_bytes, host_split, plan);
  const std::vector<IndexRun> sorted = HostSorted(runs);
  const std::vector<IndexRun> sorted_pages = HostSorted(page_runs);
  const uint64_t n = layer_end - layer_begin;
  // A tile per run and plane at least (LAYER_FIRST: exactly, within a
  // chunk); growing the vector instead was 40 % of a page-1 plan's time.
  size_t tiles = 0;
  for (const LayoutGroup& g : groups) {
    tiles += g.layout.planes * RunsOf(g, sorted, sorted_pages).size();
  }
  plan->tiles.reserve(tiles);
  for (size_t g = 0; g < groups.size(); ++g) {
    builder.SetGroup(static_cast<uint32_t>(g), &groups[g]);
    const std::vector<IndexRun>& group_runs = RunsOf(groups[g], sorted, sorted_pages);
    if (groups[g].layout.kind == LayoutKind::kLayerFirst) {
      PlanLayerFirst(group_runs, layer_begin, n, &builder);
      continue;
    }
    const std::vector<HostRun> host_runs = HostRunsOf(group_runs);
    if (groups[g].layout.kind == LayoutKind::kPageUnified) {
      PlanUnified(host_runs, layer_begin, n, &builder);
      continue;
    }
    for (uint64_t plane = 0; plane < groups[g].layout.planes; ++plane) {
      PlanPageMajor(plane, host_runs, layer_begin, n, &builder);
    }
  }
  builder.Flush();
  return absl::OkStatus();
}

uint64_t CopyEnginePiecesPerLayer(const KvLayout& layout, const std::vector<IndexRun>& runs) {
  uint64_t pieces = 0;
  for (const IndexRun& run : runs) {
    ForEachPiece(layout, 0, 0, run, 0, run.count, [&](uint64_t, uint64_t, uint64_t) { ++pieces; });
  }
  return pieces;
}

LayerPieces CopyEngineLayerPieces(const std::vector<LayoutGroup>& groups,
                                  const std::vector<IndexRun>& runs,
                                  const std::vector<IndexRun>& page_runs) {
  LayerPieces out;
  for (const LayoutGroup& g : groups) {
    const std::vector<IndexRun>& rs = RunsOf(g, runs, page_runs);
    out.pieces += g.layout.planes * CopyEnginePiecesPerLayer(g.layout, rs);
    uint64_t rows = 0;
    for (const IndexRun& run : rs) rows += run.count;
    out.bytes += g.layout.planes * rows * g.layout.token_bytes;
  }
  return out;
}

}  // namespace kvhost
