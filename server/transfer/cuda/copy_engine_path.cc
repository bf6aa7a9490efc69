// The copy-engine path (contract: paths.h).
#include "absl/strings/str_cat.h"
#include "server/transfer/cuda/copy_plan.h"
#include "server/transfer/cuda/paths.h"

namespace kvhost {

absl::Status EnqueueCopyEngineLayer(const PathContext& context, CudaLane* lane,
                                    const TransferJob& job, size_t ticket_layer) {
  const bool backup = job.direction == Direction::kBackup;
  thread_local std::vector<CopyEnginePiece> pieces;
  // Every part's pieces of the layer, in one batch.
  size_t n = 0;
  for (const JobPart& part : job.parts) {
    const JobLayer& layer = part.layers[ticket_layer];
    if (layer.host_layer < 0) continue;  // a device layer the part's pool does not copy here
    const Pool& pool = *part.pool;
    pieces.clear();
    PlanCopyEngineLayer(pool.components(), part.runs, part.page_runs,
                        static_cast<uint64_t>(layer.host_layer), context.host_split, &pieces);
    lane->dsts.resize(n + pieces.size());
    lane->srcs.resize(n + pieces.size());
    lane->sizes.resize(n + pieces.size());
    for (const CopyEnginePiece& p : pieces) {
      void* const h = pool.region_base(p.region) + p.host_offset;
      void* const d = part.mapping->buffer(p.component, layer.device_layer) + p.device_offset;
      lane->dsts[n] = backup ? h : d;
      lane->srcs[n] = backup ? d : h;
      lane->sizes[n] = static_cast<size_t>(p.bytes);
      ++n;
    }
  }
  if (n == 0) return absl::OkStatus();
  return context.copier->Submit(
      lane, lane->stream, n, absl::StrCat(DirectionName(job.direction), " layer ", ticket_layer));
}

}  // namespace kvhost
