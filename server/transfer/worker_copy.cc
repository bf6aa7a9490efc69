#include "server/transfer/worker_copy.h"

namespace kvhost {

WorkerCopyPlan PlanWorkerCopy(const TransferJob& job) {
  const JobPart& part = job.parts[0];
  WorkerCopyPlan plan;
  plan.sm = PlanSmCopy(GroupComponents(part.pool->components()), part.runs, part.page_runs);
  plan.layers = part.layers;
  return plan;
}

uint64_t WorkerCopyPlanBytes(const WorkerCopyPlan& plan) {
  // Per repeated message at most a tag and a length (2 + 10 bytes) and
  // each varint field 11 bytes (a tag and a 10-byte varint).
  constexpr uint64_t kMessage = 12;
  constexpr uint64_t kField = 11;
  return 64 + plan.sm.tiles.size() * sizeof(CopyTile) +
         plan.sm.launches.size() * (kMessage + 4 * kField) +
         plan.layers.size() * (kMessage + 2 * kField);
}

}  // namespace kvhost
