// The CUDA engine's three copy paths (path_policy.h says which takes a
// job), each enqueueing a job's work on one lane's streams:
//   copy engines  per ticket layer, every part's layout-contiguous pieces
//                 (PlanCopyEngineLayer) as one batch (BatchCopier);
//   SM copy       descriptors up, then per ticket layer and part one copy
//                 kernel per launch group, reading or writing the pool
//                 through mapped memory with a grid of at most sm_blocks;
//   staged        per range and chunk of the plan, a full-grid gather
//                 (backup) or scatter (load) kernel on the kernel stream
//                 beside large copies between the staging buffer and the
//                 pool on the copy stream, the two halves of the staging
//                 buffer alternating.
// After enqueueing each layer a path calls `layer_enqueued(ticket_layer)`
// (the engine records the layer's events there, on lane->stream): the copies
// are queued, not finished; the engine calls Ticket::LayerFinished when the
// layer's completion event fires. The staged path calls it for the layers a
// range completes, and the engine for the rest after.
//
// Thread safety: REQUIRES the lane's submit_mu held by the caller.
#ifndef KVHOST_SERVER_TRANSFER_CUDA_PATHS_H_
#define KVHOST_SERVER_TRANSFER_CUDA_PATHS_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "absl/status/status.h"
#include "server/transfer/cuda/batch_copies.h"
#include "server/transfer/cuda/engine_options.h"
#include "server/transfer/cuda/gpus.h"
#include "server/transfer/cuda/job_plan.h"
#include "server/transfer/cuda/lane.h"
#include "server/transfer/engine.h"

namespace kvhost {

// What every path needs of the engine.
struct PathContext {
  const CudaEngineOptions* options = nullptr;
  const GpuInfo* gpu = nullptr;  // the lane's
  uint64_t host_split = 0;       // HostPins::chunk(): copies never cross it
  BatchCopier* copier = nullptr;
};

// A layer's copies are on the stream (see above); records its events.
using LayerEnqueued = std::function<absl::Status(uint64_t ticket_layer)>;

// Ticket layer `ticket_layer` of `job` (every part and component, in one
// batch; nothing for a part that does not copy the layer) on lane->stream.
absl::Status EnqueueCopyEngineLayer(const PathContext& context, CudaLane* lane,
                                    const TransferJob& job, size_t ticket_layer);

// Every ticket layer of `job` by the SM copy kernel, each followed by
// layer_enqueued. `plan` null: a job of no rows, which only records its events.
absl::Status EnqueueSmCopy(const PathContext& context, CudaLane* lane, const TransferJob& job,
                           const SmCopyJobPlan* plan, std::vector<void*>* scratch,
                           const LayerEnqueued& layer_enqueued);

// Every range and chunk of `plan` (null: nothing to copy), layer_enqueued for
// each range's StagedRange::layers_complete. Returns how many leading ticket
// layers it reported complete.
absl::StatusOr<uint64_t> EnqueueStaged(const PathContext& context, CudaLane* lane,
                                       const TransferJob& job, const StagedJobPlan* plan,
                                       std::vector<void*>* scratch,
                                       const LayerEnqueued& layer_enqueued);

// The staged path's chunk: half the staging buffer, 256-byte aligned so
// that both halves keep the alignment of the allocation.
inline uint64_t StagingChunk(uint64_t staging_bytes) {
  return (staging_bytes / 2) & ~uint64_t{255};
}

}  // namespace kvhost

#endif  // KVHOST_SERVER_TRANSFER_CUDA_PATHS_H_
