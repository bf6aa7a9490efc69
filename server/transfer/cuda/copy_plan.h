// Planning of the CUDA engine's copies: a job's index runs as copy-engine
// pieces, or as CopyTiles (kernels/kvhost/copy_tile.h) for the copy
// kernel. Everything that knows about components, page runs and layer
// ranges lives here, so that tests/copy_plan_test.cc can replay the plans on
// the CPU; the engine only turns offsets into pointers and launches.
//
// Components and launches: the copy kernel addresses one KvLayout per
// launch. Consecutive components with the same layout lying back to back in
// one region (MHA's K and V) form one LayoutGroup, whose planes they are, so
// MHA and MLA take one launch per layer or chunk as before; other kinds take
// one launch per group. Page-row components (Component::row_tokens > 1) copy
// the job's page runs instead of its token runs.
//
// Copy engines (PlanCopyEngineLayer): per held layer and component, the
// pieces that ForEachPiece yields, merged where contiguous on both sides.
//
// SM copy path (PlanSmCopy): the kernel reads or writes the pool itself
// through mapped memory, one launch per group and layer, so a tile is
// simply one run of one plane, one layer wide, lying as in the pool
// (bias 0, other_layer_stride the pool's LayerStride).
//
// Staged (PlanStaged): the job goes through a device staging buffer in
// chunks of `chunk_bytes`. Runs are planned in host slot order (a chunk's
// runs may come in any order: a backup's host slots never overlap, and a
// load that reads a slot twice reads it into two places), so host-adjacent
// runs share blocks and copies whatever the request order. In a chunk, the
// copy engines move complete contiguous ranges of the pool (no bytes of
// other slots or layers inside) between staging and pool, and the kernel
// gathers or scatters the items between staging and the worker's rows.
//   LAYER_FIRST        a chunk holds [plane][held layer][the chunk's slots in
//                      host order]: as many slots as fit with every held
//                      layer of every plane; a tile per (plane, run) spans
//                      the held layers (CopyTile::other_layer_stride = the
//                      chunk's slots' row bytes), a copy per (plane, layer,
//                      host run). Where one slot's held rows do not fit a
//                      chunk, one (plane, layer) at a time.
// The page-major layouts lay their blocks out in staging as in the pool, a
// tile per run inside a block, blocks as large as the layout allows over the
// held host layers [layer_begin, layer_end) of host runs (host-sorted runs
// whose slots follow each other, so that a page whose slots come in several
// runs is still one block):
//   PAGE_FIRST         a host run's slots, all layers (a slot's layers are
//                      adjacent); a slot's held layers when they are not all;
//   PAGE_FIRST_DIRECT  a host run's whole pages, all layers; a page's held
//                      layers when they are not all; partial pages per layer;
//   PAGE_HEAD          a host run's whole pages, all heads and layers;
//                      partial pages per head; a slot's head's held layers
//                      when they are not all;
//   PAGE_UNIFIED       a host run's whole pages, all head groups, layers and
//                      planes (K and V interleave in a page's block, so a
//                      block holds both, a tile per plane); a page's head
//                      group's held layers when they are not all; partial
//                      pages per plane, layer and head group.
// A block larger than a chunk is split at units (a slot, or a whole page for
// the page-major layouts); a unit never is, so a chunk must hold the largest
// unit (StagedUnitBytes: LAYER_FIRST's is one row). A group's staging starts
// 16-byte aligned in its chunk.
//
// Pure functions; thread-safe.
#ifndef KVHOST_SERVER_TRANSFER_COPY_PLAN_H_
#define KVHOST_SERVER_TRANSFER_COPY_PLAN_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "kvhost/copy_tile.h"
#include "kvhost/layout.h"
#include "server/pool/pool_spec.h"
#include "server/transfer/engine.h"
#include "server/transfer/runs.h"

namespace kvhost {

// Components [first_component, first_component + layout.planes) of a pool,
// addressed as the planes of `layout`: plane p starts at byte
// region_offset + p * layout.plane_stride of region `region` (V_OFF, or
// PAGE_UNIFIED's one plane chunk).
struct LayoutGroup {
  KvLayout layout;
  uint32_t first_component = 0;
  uint32_t region = 0;
  uint64_t region_offset = 0;
  bool page_rows = false;  // rows are whole pages: the job's page runs apply
};

// The groups of `components` in order (every component in exactly one).
// REQUIRES: every component's layout has one plane.
std::vector<LayoutGroup> GroupComponents(const std::vector<Component>& components);

// The group made of one layout of any plane count (region 0, offset 0):
// the MHA / MLA planes of a Pool::layout(), for callers that have no
// components.
LayoutGroup GroupOf(const KvLayout& layout, bool page_rows = false);

// The runs a group copies: page runs for page rows, token runs otherwise.
inline const std::vector<IndexRun>& RunsOf(const LayoutGroup& group,
                                           const std::vector<IndexRun>& runs,
                                           const std::vector<IndexRun>& page_runs) {
  return group.page_rows ? page_runs : runs;
}

// The host layers a job's ticket layers hold, [begin, end) (both ranges are
// intervals, so these are too), and device layer - host layer, the same for
// every held layer. Empty when the attachment and the pool share no layer.
struct HeldLayers {
  uint64_t begin = 0;
  uint64_t end = 0;
  int64_t delta = 0;
  uint64_t count() const { return end - begin; }
};
HeldLayers HeldLayersOf(const std::vector<JobLayer>& layers);

// The held host layers of a pool group's job part, whose layer map may hold
// any set of a pool's layers in any order: maximal intervals of consecutive
// host layers with one delta, in host layer order. A plain attachment's
// layers give one interval, HeldLayersOf's (none when nothing is held).
std::vector<HeldLayers> HeldLayerRanges(const std::vector<JobLayer>& layers);

// A copy-engine copy of one held layer: bytes [host_offset, + bytes) of
// region `region` and [device_offset, + bytes) of component `component`'s
// buffer of the layer.
struct CopyEnginePiece {
  uint32_t component = 0;
  uint32_t region = 0;
  uint64_t host_offset = 0;  // from the region's base
  uint64_t device_offset = 0;
  uint64_t bytes = 0;
};

// Appends to `pieces` the copies of host layer `host_layer` of every
// component: pieces contiguous on both sides merged, split where they would
// cross a multiple of `host_split` region bytes (the pool's CUDA
// registration chunks). REQUIRES: host_split > 0; page_runs filled when a
// component has page rows.
void PlanCopyEngineLayer(const std::vector<Component>& components,
                         const std::vector<IndexRun>& runs, const std::vector<IndexRun>& page_runs,
                         uint64_t host_layer, uint64_t host_split,
                         std::vector<CopyEnginePiece>* pieces);

// Tiles [tile_begin, tile_end) of a plan, for one kernel launch over
// group `group` (first_item counted from the launch's first item).
struct TileLaunch {
  uint32_t group = 0;
  size_t tile_begin = 0;
  size_t tile_end = 0;
  uint64_t items = 0;
};

// SM copy path: per layer, every launch (with layer_shift = the host layer).
struct SmCopyPlan {
  std::vector<CopyTile> tiles;
  std::vector<TileLaunch> launches;
  uint64_t items_per_layer = 0;  // over all launches
};
SmCopyPlan PlanSmCopy(const std::vector<LayoutGroup>& groups, const std::vector<IndexRun>& runs,
                      const std::vector<IndexRun>& page_runs);

// A copy-engine copy between a region of the pool and a chunk of the
// staging buffer.
struct StagedCopy {
  uint32_t region = 0;
  uint64_t host_offset = 0;     // from the region's base
  uint64_t staging_offset = 0;  // from the chunk's base
  uint64_t bytes = 0;
};

// One chunk: launches [launch_begin, launch_end) of the plan (their
// tiles' bias relative to the chunk's base) and copies
// [copy_begin, copy_end).
struct StagedChunk {
  size_t launch_begin = 0;
  size_t launch_end = 0;
  size_t copy_begin = 0;
  size_t copy_end = 0;
  uint64_t bytes = 0;
};

struct StagedPlan {
  std::vector<CopyTile> tiles;
  std::vector<TileLaunch> launches;
  std::vector<StagedCopy> copies;
  std::vector<StagedChunk> chunks;
};

// The largest block the staged path never splits, for host layers
// [layer_begin, layer_end) of `layout`.
uint64_t StagedUnitBytes(const KvLayout& layout, uint64_t layer_begin, uint64_t layer_end);
inline uint64_t StagedUnitBytes(const KvLayout& layout) {
  return StagedUnitBytes(layout, 0, layout.layers);
}

// Plans host layers [layer_begin, layer_end) of every group in chunks of at
// most `chunk_bytes`, copies split where they would cross a multiple of
// `host_split` region bytes. FAILED_PRECONDITION when a unit of some group
// does not fit in a chunk. REQUIRES: host_split > 0, layer_begin < layer_end
// <= every group's layers, page_runs filled when a group has page rows.
absl::Status PlanStaged(const std::vector<LayoutGroup>& groups, const std::vector<IndexRun>& runs,
                        const std::vector<IndexRun>& page_runs, uint64_t layer_begin,
                        uint64_t layer_end, uint64_t chunk_bytes, uint64_t host_split,
                        StagedPlan* plan);

// Contiguous pieces per layer and plane that the copy-engine path would
// issue for `runs` (layer 0, plane 0: every layer and plane has the same
// shape), for the path choice.
uint64_t CopyEnginePiecesPerLayer(const KvLayout& layout, const std::vector<IndexRun>& runs);

// Bytes and copy-engine pieces of one held layer over every group, for the
// path choice (their ratio is the average piece).
struct LayerPieces {
  uint64_t bytes = 0;
  uint64_t pieces = 0;
};
LayerPieces CopyEngineLayerPieces(const std::vector<LayoutGroup>& groups,
                                  const std::vector<IndexRun>& runs,
                                  const std::vector<IndexRun>& page_runs);

}  // namespace kvhost

#endif  // KVHOST_SERVER_TRANSFER_COPY_PLAN_H_
