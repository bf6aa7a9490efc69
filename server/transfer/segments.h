// Planning of the CUDA engine's kernel paths: a job's index runs as
// CopySegments (kernels/kvhost/copy_segment.h) for the copy kernel.
//
// SM zero-copy (PlanDirect): the kernel reads or writes the pool itself
// through mapped memory, one launch per layer, so a segment is simply one run
// of one plane, one layer wide.
//
// Staged (PlanStaged): the job goes through a device staging buffer in
// chunks of `chunk_bytes`. In a chunk, every segment's host bytes form one
// complete contiguous block of the pool (no bytes of other slots inside), laid
// out in the staging buffer exactly as in the pool, so that one copy-engine
// copy moves a block (or several adjacent ones) between staging and pool,
// and the kernel gathers or scatters the items between staging and the
// worker's rows. Blocks are as large as the layout allows:
//   LAYER_FIRST        a run's rows of one layer;
//   PAGE_FIRST         a run's tokens, all layers (a token's layers are adjacent);
//   PAGE_FIRST_DIRECT  a run's whole pages, all layers; partial pages per layer;
//   PAGE_HEAD          a run's whole pages, all heads and layers; partial pages
//                      per head.
// A block larger than a chunk is split at units (a token, or a whole page for
// the page-major layouts); a unit never is, so a chunk must hold the largest
// unit (StagedUnitBytes).
//
// Pure functions; thread-safe.
#ifndef KVHOST_SERVER_TRANSFER_SEGMENTS_H_
#define KVHOST_SERVER_TRANSFER_SEGMENTS_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "kvhost/copy_segment.h"
#include "kvhost/layout.h"
#include "server/transfer/runs.h"

namespace kvhost {

// SM path: segments of one layer (launch with layer_shift = layer).
struct DirectPlan {
  std::vector<CopySegment> segments;
  uint64_t items_per_layer = 0;
};
DirectPlan PlanDirect(const KvLayout& layout, const std::vector<IndexRun>& runs);

// A copy-engine copy between the pool and a chunk of the staging buffer.
struct StagedCopy {
  uint64_t host_offset = 0;     // from the pool base
  uint64_t staging_offset = 0;  // from the chunk's base
  uint64_t bytes = 0;
};

// One chunk: segments [segment_begin, segment_end) of the plan (first_item
// counted from the chunk's first item, bias relative to the chunk's base) and
// copies [copy_begin, copy_end).
struct StagedChunk {
  size_t segment_begin = 0;
  size_t segment_end = 0;
  size_t copy_begin = 0;
  size_t copy_end = 0;
  uint64_t items = 0;
  uint64_t bytes = 0;
};

struct StagedPlan {
  std::vector<CopySegment> segments;
  std::vector<StagedCopy> copies;
  std::vector<StagedChunk> chunks;
};

// The largest block the staged path never splits.
uint64_t StagedUnitBytes(const KvLayout& layout);

// Plans `runs` in chunks of at most `chunk_bytes`, copies split where they
// would cross a multiple of `host_split` host bytes (the pool's CUDA
// registration chunks). FAILED_PRECONDITION when a unit does not fit in a
// chunk. REQUIRES: host_split > 0.
absl::Status PlanStaged(const KvLayout& layout, const std::vector<IndexRun>& runs,
                        uint64_t chunk_bytes, uint64_t host_split, StagedPlan* plan);

// Contiguous pieces per layer and plane that the copy-engine path would
// issue for `runs` (layer 0, plane 0: every layer and plane has the same
// shape), for the path choice.
uint64_t CopyEnginePiecesPerLayer(const KvLayout& layout, const std::vector<IndexRun>& runs);

}  // namespace kvhost

#endif  // KVHOST_SERVER_TRANSFER_SEGMENTS_H_
