// CudaJobPlan: what the CUDA engine's Prepare decided for one job — its path
// (path_policy.h) and that path's plan, built from the job's runs and its
// parts' layouts by copy_plan.h. PlanJob gathers the policy's facts and
// builds only the plan of the path taken.
//
// A staged plan is a list of ranges, each one part's interval of held host
// layers planned in chunks; the ranges run in order. A load of an
// attachment whose worker consumes it layer by layer (layer_ordered) into a
// LAYER_FIRST pool is planned in layer intervals growing geometrically (1, 1,
// 2, 4, ... layers)
// so that its first layers land after a small chunk while the number of
// kernels stays near log2(layers); each range says how many leading ticket
// layers are complete after it. Only such a plan's first range is planned
// by PlanJob (the Load call waits for it); the others are planned by
// PlanStagedRange when their turn comes, on the lane's enqueue thread,
// while the ranges before them are on the GPU.
//
// Thread-safe: pure functions of their arguments; a plan is immutable once
// built and shared by the job (TransferJob::plan).
#ifndef KVHOST_SERVER_TRANSFER_CUDA_JOB_PLAN_H_
#define KVHOST_SERVER_TRANSFER_CUDA_JOB_PLAN_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <variant>
#include <vector>

#include "absl/status/statusor.h"
#include "server/transfer/cuda/copy_plan.h"
#include "server/transfer/cuda/path_policy.h"
#include "server/transfer/engine.h"

namespace kvhost {

// The SM copy path's plan of a job: one SmCopyPlan per job part, in order.
struct SmCopyJobPlan {
  std::vector<SmCopyPlan> parts;
};

// One job part's interval of held host layers (HeldLayerRanges) and its
// plan.
struct StagedRange {
  size_t part = 0;
  int64_t delta = 0;         // device layer - host layer
  uint64_t layer_begin = 0;  // host layers [layer_begin, layer_end)
  uint64_t layer_end = 0;
  // False: `plan` is empty and PlanStagedRange builds it (see above).
  bool planned = true;
  StagedPlan plan;
  // Ticket layers [0, layers_complete) are complete once this range's
  // chunks are (0: nothing new; the job's end completes every layer).
  uint64_t layers_complete = 0;
};

// The staged path's plan of a job: its ranges run one after the other, and
// every ticket layer is complete after the last.
struct StagedJobPlan {
  std::vector<StagedRange> ranges;
  // What PlanStagedRange needs: each part's components as launch groups,
  // and the chunking.
  std::vector<std::vector<LayoutGroup>> part_groups;
  uint64_t staging_chunk = 0;
  uint64_t host_split = 0;

  // Over the planned ranges.
  size_t chunks() const;
  size_t copies() const;
  uint64_t bytes() const;
  // No range has or will have anything to copy.
  bool empty() const;
};

// The plan of `range`, one of `plan`'s ranges of `job` whose `planned` is
// false, into `out`. Errors as PlanStaged.
absl::Status PlanStagedRange(const TransferJob& job, const StagedJobPlan& plan,
                             const StagedRange& range, StagedPlan* out);

struct CudaJobPlan {
  CudaPath path = CudaPath::kCopyEngine;
  std::string why;  // DecidePath's reason, for the log
  // kCopyEngine plans per layer at enqueue time (PlanCopyEngineLayer), so
  // it has no plan here.
  std::variant<std::monostate, StagedJobPlan, SmCopyJobPlan> detail;
};

// What PlanJob needs beyond the job.
struct JobPlanInputs {
  PathPolicy policy;
  bool mps = false;
  bool host_pointer_ok = true;
  uint64_t staging_chunk = 0;  // bytes of one half of the staging buffer
  uint64_t host_split = 0;     // HostPins::chunk()
  // The job is a load whose worker waits layer by layer (see above).
  bool layer_ordered = false;
};

// The path and plan of `job`. Errors as DecidePath.
absl::StatusOr<CudaJobPlan> PlanJob(const TransferJob& job, const JobPlanInputs& inputs);

// The layer intervals of a layer-ordered plan of `count` layers from
// `begin`: [begin, begin+1), [begin+1, begin+2), [begin+2, begin+4), ...,
// each twice the one before (the last cut at the end).
std::vector<HeldLayers> GeometricLayerIntervals(const HeldLayers& held);

}  // namespace kvhost

#endif  // KVHOST_SERVER_TRANSFER_CUDA_JOB_PLAN_H_
