// The staged path (contract: paths.h).
#include <string>

#include "absl/strings/str_cat.h"
#include "common/bytes.h"
#include "common/cuda_util.h"
#include "copy_kernel.h"
#include "server/transfer/cuda/mapping.h"
#include "server/transfer/cuda/paths.h"
#include "spdlog/spdlog.h"

namespace kvhost {
namespace {

// One job's staged work on one lane: per range, the descriptors up, then per
// chunk (alternating halves b of the staging buffer):
//   backup  wait half_free[b] -> gather kernel (kernel stream) -> ready[b]
//           -> copies out (copy stream) -> half_free[b];
//   load    wait half_free[b] -> copies in (copy stream) -> ready[b]
//           -> scatter kernel (kernel stream) -> half_free[b].
// A half is refilled only after its last consumer. After a range that
// completes ticket layers, the copy stream waits for the kernels (so that
// the layers' events follow their last scatter) and reports the layers.
class StagedRun {
 public:
  StagedRun(const PathContext& context, CudaLane* lane, const TransferJob& job,
            std::vector<void*>* scratch)
      : context_(context),
        lane_(lane),
        job_(job),
        scratch_(scratch),
        backup_(job.direction == Direction::kBackup),
        chunk_bytes_(StagingChunk(context.options->staging_bytes)),
        blocks_(context.options->staged_blocks > 0 ? context.options->staged_blocks
                                                   : 4 * context.gpu->sms) {}

  absl::StatusOr<uint64_t> Run(const StagedJobPlan& plan, const LayerEnqueued& layer_enqueued) {
    if (absl::Status s = EnsureStaging(); !s.ok()) return s;
    // The kernels start after everything before this job on the lane (the
    // worker's event for a backup, earlier loads of the same rows).
    if (!Ok(cudaEventRecord(lane_->stage_start, lane_->stream), "cudaEventRecord") ||
        !Ok(cudaStreamWaitEvent(lane_->kernel_stream, lane_->stage_start, 0),
            "cudaStreamWaitEvent")) {
      return Failed();
    }
    uint64_t reported = 0;
    StagedPlan late;  // a range planned at its turn (job_plan.h)
    for (const StagedRange& range : plan.ranges) {
      if (!range.planned) {
        if (absl::Status s = PlanStagedRange(job_, plan, range, &late); !s.ok()) return s;
      }
      if (absl::Status s = RunRange(range, range.planned ? range.plan : late); !s.ok()) return s;
      if (range.layers_complete <= reported) continue;
      if (absl::Status s = JoinKernels(); !s.ok()) return s;
      for (; reported < range.layers_complete; ++reported) {
        if (absl::Status s = layer_enqueued(reported); !s.ok()) return s;
      }
    }
    // Whatever follows on the copy stream (this job's layer events, the next
    // job) comes after the last kernel.
    if (absl::Status s = JoinKernels(); !s.ok()) return s;
    return reported;
  }

 private:
  absl::Status EnsureStaging() {
    if (lane_->staging != nullptr) return absl::OkStatus();
    if (cudaError_t e = cudaMalloc(&lane_->staging, 2 * chunk_bytes_); e != cudaSuccess) {
      cudaGetLastError();
      lane_->staging = nullptr;
      return absl::ResourceExhaustedError(
          absl::StrCat("GPU ", lane_->gpu, ": the staging buffer (--staging-bytes=",
                       context_.options->staging_bytes, ") cannot be allocated: ", CudaError(e)));
    }
    spdlog::info("GPU {}: {} staging buffer of {} up", lane_->gpu, DirectionName(lane_->direction),
                 FormatBytes(2 * chunk_bytes_));
    return absl::OkStatus();
  }

  absl::Status RunRange(const StagedRange& range, const StagedPlan& p) {
    if (p.chunks.empty()) return absl::OkStatus();
    const JobPart& part = job_.parts[range.part];
    // Every mapping of this engine's jobs is one it opened.
    const auto& mapping = static_cast<const CudaMapping&>(*part.mapping);
    absl::StatusOr<void*> tiles = UploadDescriptors(lane_, lane_->kernel_stream, p.tiles.data(),
                                                    p.tiles.size() * sizeof(CopyTile), scratch_);
    if (!tiles.ok()) return tiles.status();
    CopyKernelArgs args;
    args.device_layers_per_plane = static_cast<uint32_t>(mapping.layer_num());
    args.device_layer_delta = static_cast<int32_t>(range.delta);
    args.to_device = !backup_;
    args.aligned16 = mapping.aligned16();
    const auto* uploaded = static_cast<const CopyTile*>(*tiles);
    absl::Status status;
    for (size_t i = 0; i < p.chunks.size() && status.ok(); ++i) {
      status = RunChunk(range, p, mapping, i, uploaded, &args);
    }
    cudaFreeAsync(*tiles, lane_->kernel_stream);
    return status;
  }

  absl::Status RunChunk(const StagedRange& range, const StagedPlan& p, const CudaMapping& mapping,
                        size_t i, const CopyTile* tiles, CopyKernelArgs* args) {
    const StagedChunk& chunk = p.chunks[i];
    const Pool& pool = *job_.parts[range.part].pool;
    const int b = static_cast<int>(chunk_count_++ % 2);
    uint8_t* const half = lane_->staging + b * chunk_bytes_;
    const size_t n = chunk.copy_end - chunk.copy_begin;
    lane_->dsts.resize(n);
    lane_->srcs.resize(n);
    lane_->sizes.resize(n);
    for (size_t k = 0; k < n; ++k) {
      const StagedCopy& c = p.copies[chunk.copy_begin + k];
      void* const h = pool.region_base(c.region) + c.host_offset;
      void* const d = half + c.staging_offset;
      lane_->dsts[k] = backup_ ? h : d;
      lane_->srcs[k] = backup_ ? d : h;
      lane_->sizes[k] = static_cast<size_t>(c.bytes);
    }
    args->other = half;
    const std::string what = absl::StrCat(
        DirectionName(job_.direction), " chunk ", i, " of ", p.chunks.size(),
        job_.parts.size() > 1 ? absl::StrCat(" of pool '", pool.name(), "'") : "", " (staged)");
    cudaStream_t first = backup_ ? lane_->kernel_stream : lane_->stream;
    cudaStream_t second = backup_ ? lane_->stream : lane_->kernel_stream;
    if (!Ok(cudaStreamWaitEvent(first, lane_->half_free[b], 0), "cudaStreamWaitEvent")) {
      return Failed();
    }
    absl::Status status = backup_ ? Launch(p, chunk, mapping, tiles, args, "gather kernel")
                                  : context_.copier->Submit(lane_, lane_->stream, n, what);
    if (!status.ok()) return status;
    if (!Ok(cudaEventRecord(lane_->half_ready[b], first), "cudaEventRecord") ||
        !Ok(cudaStreamWaitEvent(second, lane_->half_ready[b], 0), "cudaStreamWaitEvent")) {
      return Failed();
    }
    status = backup_ ? context_.copier->Submit(lane_, lane_->stream, n, what)
                     : Launch(p, chunk, mapping, tiles, args, "scatter kernel");
    if (!status.ok()) return status;
    if (!Ok(cudaEventRecord(lane_->half_free[b], second), "cudaEventRecord")) return Failed();
    return absl::OkStatus();
  }

  // The chunk's kernels, one per group in it (one for MHA's K and V).
  absl::Status Launch(const StagedPlan& p, const StagedChunk& chunk, const CudaMapping& mapping,
                      const CopyTile* tiles, CopyKernelArgs* args, const char* what) {
    for (size_t k = chunk.launch_begin; k < chunk.launch_end; ++k) {
      const TileLaunch& launch = p.launches[k];
      const LayoutGroup& group = mapping.groups()[launch.group];
      args->layout = group.layout;
      args->device_layers = mapping.layer_table(group);
      args->tiles = tiles + launch.tile_begin;
      args->tile_count = static_cast<uint32_t>(launch.tile_end - launch.tile_begin);
      args->item_count = launch.items;
      if (!Ok(LaunchCopyKernel(*args, blocks_, lane_->kernel_stream), what)) return Failed();
    }
    return absl::OkStatus();
  }

  absl::Status JoinKernels() {
    if (!Ok(cudaEventRecord(lane_->stage_end, lane_->kernel_stream), "cudaEventRecord") ||
        !Ok(cudaStreamWaitEvent(lane_->stream, lane_->stage_end, 0), "cudaStreamWaitEvent")) {
      return Failed();
    }
    return absl::OkStatus();
  }

  bool Ok(cudaError_t result, const char* what) {
    if (error_ == cudaSuccess && result != cudaSuccess) {
      error_ = result;
      step_ = what;
    }
    return error_ == cudaSuccess;
  }

  absl::Status Failed() {
    cudaGetLastError();
    return absl::InternalError(
        absl::StrCat(DirectionName(job_.direction), " (staged): ", step_, ": ", CudaError(error_)));
  }

  const PathContext& context_;
  CudaLane* const lane_;
  const TransferJob& job_;
  std::vector<void*>* const scratch_;
  const bool backup_;
  const uint64_t chunk_bytes_;
  const int blocks_;
  size_t chunk_count_ = 0;  // over every range: the halves alternate
  cudaError_t error_ = cudaSuccess;
  const char* step_ = "";
};

}  // namespace

absl::StatusOr<uint64_t> EnqueueStaged(const PathContext& context, CudaLane* lane,
                                       const TransferJob& job, const StagedJobPlan* plan,
                                       std::vector<void*>* scratch,
                                       const LayerEnqueued& layer_enqueued) {
  // No plan: a job of no rows. No chunks: no layer held. Nothing to copy.
  if (plan == nullptr || plan->empty()) return uint64_t{0};
  return StagedRun(context, lane, job, scratch).Run(*plan, layer_enqueued);
}

}  // namespace kvhost
