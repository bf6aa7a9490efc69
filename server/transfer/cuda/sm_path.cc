// The SM copy path (contract: paths.h).
#include "absl/strings/str_cat.h"
#include "common/cuda_util.h"
#include "copy_kernel.h"
#include "server/transfer/cuda/mapping.h"
#include "server/transfer/cuda/paths.h"

namespace kvhost {

absl::Status EnqueueSmCopy(const PathContext& context, CudaLane* lane, const TransferJob& job,
                           const SmCopyJobPlan* job_plan, std::vector<void*>* scratch,
                           const LayerEnqueued& layer_enqueued) {
  static const SmCopyJobPlan kNoRows;
  const SmCopyJobPlan& plan = job_plan == nullptr ? kNoRows : *job_plan;
  // Each part's descriptors, uploaded once for every layer.
  std::vector<const CopyTile*> tiles(job.parts.size(), nullptr);
  absl::Status status;
  for (size_t j = 0; j < plan.parts.size() && status.ok(); ++j) {
    const SmCopyPlan& part_plan = plan.parts[j];
    if (part_plan.tiles.empty()) continue;
    absl::StatusOr<void*> uploaded =
        UploadDescriptors(lane, lane->stream, part_plan.tiles.data(),
                          part_plan.tiles.size() * sizeof(CopyTile), scratch);
    if (!uploaded.ok()) {
      status = uploaded.status();
    } else {
      tiles[j] = static_cast<const CopyTile*>(*uploaded);
    }
  }
  CopyKernelArgs args;
  args.to_device = job.direction == Direction::kLoad;
  const uint64_t layers = job.layer_num();
  for (size_t i = 0; i < layers && status.ok(); ++i) {
    // Per part, one launch per group (one for MHA's K and V) where the part
    // holds the layer; a layer no part holds only records its events.
    for (size_t j = 0; j < job.parts.size() && status.ok(); ++j) {
      const JobPart& part = job.parts[j];
      const JobLayer& layer = part.layers[i];
      if (layer.host_layer < 0 || j >= plan.parts.size()) continue;
      // Every mapping of this engine's jobs is one it opened.
      const auto& mapping = static_cast<const CudaMapping&>(*part.mapping);
      const SmCopyPlan& part_plan = plan.parts[j];
      args.device_layers_per_plane = static_cast<uint32_t>(mapping.layer_num());
      for (size_t k = 0; k < part_plan.launches.size(); ++k) {
        const TileLaunch& launch = part_plan.launches[k];
        const LayoutGroup& group = mapping.groups()[launch.group];
        args.layout = group.layout;
        args.device_layers = mapping.layer_table(group);
        args.device_layer_delta =
            static_cast<int32_t>(int64_t{layer.device_layer} - layer.host_layer);
        args.other = part.pool->region_base(group.region) + group.region_offset;
        args.aligned16 = mapping.aligned16() && reinterpret_cast<uintptr_t>(args.other) % 16 == 0;
        args.tiles = tiles[j] + launch.tile_begin;
        args.tile_count = static_cast<uint32_t>(launch.tile_end - launch.tile_begin);
        args.item_count = launch.items;
        args.layer_shift = static_cast<uint32_t>(layer.host_layer);
        if (cudaError_t e = LaunchCopyKernel(args, context.options->sm_blocks, lane->stream);
            e != cudaSuccess) {
          status = absl::InternalError(absl::StrCat(
              DirectionName(job.direction), " layer ", i,
              job.parts.size() > 1 ? absl::StrCat(" of pool '", part.pool->name(), "'") : "",
              ": SM copy kernel: ", CudaError(e)));
          break;
        }
      }
    }
    if (status.ok()) status = layer_enqueued(i);
  }
  for (const CopyTile* s : tiles) {
    if (s != nullptr) cudaFreeAsync(const_cast<CopyTile*>(s), lane->stream);
  }
  return status;
}

}  // namespace kvhost
