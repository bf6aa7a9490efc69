#include "server/transfer/cuda/job_plan.h"

#include <algorithm>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"

namespace kvhost {

size_t StagedJobPlan::chunks() const {
  size_t n = 0;
  for (const StagedRange& range : ranges) n += range.plan.chunks.size();
  return n;
}

size_t StagedJobPlan::copies() const {
  size_t n = 0;
  for (const StagedRange& range : ranges) n += range.plan.copies.size();
  return n;
}

uint64_t StagedJobPlan::bytes() const {
  uint64_t n = 0;
  for (const StagedRange& range : ranges) {
    for (const StagedChunk& chunk : range.plan.chunks) n += chunk.bytes;
  }
  return n;
}

bool StagedJobPlan::empty() const {
  for (const StagedRange& range : ranges) {
    if (!range.planned || !range.plan.chunks.empty()) return false;
  }
  return true;
}

std::vector<HeldLayers> GeometricLayerIntervals(const HeldLayers& held) {
  std::vector<HeldLayers> out;
  uint64_t width = 1;
  for (uint64_t b = held.begin; b < held.end;) {
    const uint64_t e = std::min(held.end, b + width);
    out.push_back(HeldLayers{b, e, held.delta});
    // 1, 1, 2, 4, ...: the second interval as small as the first, so that
    // layer 1 is not queued behind a chunk twice layer 0's size.
    if (out.size() > 1) width *= 2;
    b = e;
  }
  return out;
}

namespace {

// Ticket layers [0, k) of `part` are complete once host layers below
// `host_end` are: k is the first held ticket layer at or above it.
uint64_t CompleteBelow(const JobPart& part, uint64_t host_end) {
  for (size_t i = 0; i < part.layers.size(); ++i) {
    const int32_t host = part.layers[i].host_layer;
    if (host >= 0 && static_cast<uint64_t>(host) >= host_end) return i;
  }
  return part.layers.size();
}

// Each part's components as launch groups, in part order.
using PartGroups = std::vector<std::vector<LayoutGroup>>;

absl::Status WithPoolName(const TransferJob& job, const JobPart& part, const absl::Status& s) {
  if (s.ok() || job.parts.size() == 1) return s;
  return absl::Status(s.code(), absl::StrCat("pool '", part.pool->name(), "': ", s.message()));
}

// The staged plan of every part, or the first part's reason it has none.
absl::StatusOr<StagedJobPlan> PlanStagedJob(const TransferJob& job, PartGroups part_groups,
                                            const JobPlanInputs& in) {
  StagedJobPlan plan;
  plan.staging_chunk = in.staging_chunk;
  plan.host_split = in.host_split;
  for (size_t j = 0; j < job.parts.size(); ++j) {
    const JobPart& part = job.parts[j];
    if (part.tokens == 0) continue;
    const std::vector<LayoutGroup>& groups = part_groups[j];
    // Layer by layer only where one part is the whole job (a plain
    // attachment: its host layers follow the ticket's) and the host layout
    // is layer-major: a token-major layout's blocks of a few layers are a
    // few rows each (2 KiB pieces for one MHA layer at page 1), which the
    // copy engines move at a twentieth of the link's speed.
    bool layer_major = true;
    for (const LayoutGroup& g : groups) layer_major &= g.layout.kind == LayoutKind::kLayerFirst;
    const bool ordered = in.layer_ordered && job.parts.size() == 1 && layer_major;
    for (const HeldLayers& held : HeldLayerRanges(part.layers)) {
      std::vector<HeldLayers> intervals{held};
      if (ordered) intervals = GeometricLayerIntervals(held);
      for (const HeldLayers& interval : intervals) {
        StagedRange& range = plan.ranges.emplace_back();
        range.part = j;
        range.delta = interval.delta;
        range.layer_begin = interval.begin;
        range.layer_end = interval.end;
        if (ordered) range.layers_complete = CompleteBelow(part, interval.end);
        // A layer-ordered load's first range is planned here, the rest
        // later (see job_plan.h); the first tells the policy the blocks'
        // size, which is the same for every range of a LAYER_FIRST pool.
        range.planned = !ordered || plan.ranges.size() == 1;
        if (!range.planned) continue;
        absl::Status s = PlanStaged(groups, part.runs, part.page_runs, interval.begin, interval.end,
                                    in.staging_chunk, in.host_split, &range.plan);
        if (!s.ok()) return WithPoolName(job, part, s);
      }
    }
  }
  plan.part_groups = std::move(part_groups);
  return plan;
}

SmCopyJobPlan PlanSmJob(const TransferJob& job, const PartGroups& part_groups) {
  SmCopyJobPlan plan;
  for (size_t j = 0; j < job.parts.size(); ++j) {
    const JobPart& part = job.parts[j];
    plan.parts.push_back(PlanSmCopy(part_groups[j], part.runs, part.page_runs));
  }
  return plan;
}

}  // namespace

absl::Status PlanStagedRange(const TransferJob& job, const StagedJobPlan& plan,
                             const StagedRange& range, StagedPlan* out) {
  const JobPart& part = job.parts[range.part];
  absl::Status s =
      PlanStaged(plan.part_groups[range.part], part.runs, part.page_runs, range.layer_begin,
                 range.layer_end, plan.staging_chunk, plan.host_split, out);
  return WithPoolName(job, part, s);
}

absl::StatusOr<CudaJobPlan> PlanJob(const TransferJob& job, const JobPlanInputs& in) {
  // Over every part: the bytes moved and the copy-engine pieces, each part's
  // per held layer (the same over its held layers) times its held layers.
  uint64_t total = 0;
  uint64_t total_pieces = 0;
  // The same per layer, unweighted: the average piece of a job that holds
  // no layer (it copies nothing; the path name is all it gets).
  uint64_t layer_bytes = 0;
  uint64_t layer_pieces = 0;
  PartGroups part_groups;
  for (const JobPart& part : job.parts) {
    const std::vector<LayoutGroup>& groups =
        part_groups.emplace_back(GroupComponents(part.pool->components()));
    uint64_t held = 0;
    for (const JobLayer& layer : part.layers) held += layer.host_layer >= 0 ? 1 : 0;
    const LayerPieces per_layer = CopyEngineLayerPieces(groups, part.runs, part.page_runs);
    total += per_layer.bytes * held;
    total_pieces += per_layer.pieces * held;
    layer_bytes += per_layer.bytes;
    layer_pieces += per_layer.pieces;
  }
  PathFacts facts;
  facts.ce_piece_bytes = total_pieces > 0   ? total / total_pieces
                         : layer_pieces > 0 ? layer_bytes / layer_pieces
                                            : 0;
  facts.mps = in.mps;
  facts.host_pointer_ok = in.host_pointer_ok;
  // The staged plan is built at most once, by the policy when it asks.
  std::unique_ptr<absl::StatusOr<StagedJobPlan>> staged;
  facts.staged_block_bytes = [&]() -> absl::StatusOr<uint64_t> {
    staged = std::make_unique<absl::StatusOr<StagedJobPlan>>(PlanStagedJob(job, part_groups, in));
    if (!staged->ok()) return staged->status();
    return (*staged)->bytes() / std::max<uint64_t>((*staged)->copies(), 1);
  };
  absl::StatusOr<PathDecision> decision = DecidePath(facts, in.policy);
  if (!decision.ok()) return decision.status();
  CudaJobPlan plan;
  plan.path = decision->path;
  plan.why = std::move(decision->why);
  if (plan.path == CudaPath::kStaged) {
    plan.detail = *std::move(*staged);
  } else if (plan.path == CudaPath::kSm) {
    plan.detail = PlanSmJob(job, part_groups);
  }
  return plan;
}

}  // namespace kvhost
