// The CUDA engine's path policy and job plans, on the CPU: every rule of
// DecidePath (server/transfer/cuda/path_policy.h), and PlanJob's choice and
// layer-ordered staged ranges for real pools (server/transfer/cuda/job_plan.h).
#include "server/transfer/cuda/path_policy.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <variant>

#include "absl/strings/match.h"
#include "server/transfer/cuda/job_plan.h"
#include "transfer_test_util.h"

namespace kvhost {
namespace {

using testing::Shape;
using testing::SpecOf;

PathFacts SmallPieces(uint64_t piece, absl::StatusOr<uint64_t> block, int* plans) {
  PathFacts f;
  f.ce_piece_bytes = piece;
  f.staged_block_bytes = [block, plans]() {
    ++*plans;
    return block;
  };
  return f;
}

TEST(PathPolicyTest, ParsesAndNamesEveryPath) {
  for (const char* name : {"auto", "ce", "staged", "sm"}) EXPECT_TRUE(ParseCudaPath(name).ok());
  EXPECT_STREQ(CudaPathName(*ParseCudaPath("ce")), "cuda-ce");
  EXPECT_STREQ(CudaPathName(*ParseCudaPath("staged")), "cuda-staged");
  EXPECT_STREQ(CudaPathName(*ParseCudaPath("sm")), "cuda-sm");
  absl::StatusOr<CudaPath> bad = ParseCudaPath("fast");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(bad.status().message(), "'fast'")) << bad.status();
}

TEST(PathPolicyTest, LargePiecesTakeTheCopyEnginesWithoutPlanningStaged) {
  int plans = 0;
  PathPolicy policy;
  absl::StatusOr<PathDecision> d = DecidePath(SmallPieces(128 << 10, 1 << 20, &plans), policy);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->path, CudaPath::kCopyEngine);
  EXPECT_TRUE(absl::StrContains(d->why, "128.00 KiB")) << d->why;
  EXPECT_EQ(plans, 0);
  // Exactly at the threshold counts as large, just below it does not.
  EXPECT_EQ(DecidePath(SmallPieces(policy.ce_min_piece_bytes, 1 << 20, &plans), policy)->path,
            CudaPath::kCopyEngine);
  EXPECT_EQ(DecidePath(SmallPieces(policy.ce_min_piece_bytes - 1, 1 << 20, &plans), policy)->path,
            CudaPath::kStaged);
}

TEST(PathPolicyTest, MpsTakesStagedFirstAndTheSmPathWhereNothingStages) {
  int plans = 0;
  PathFacts f = SmallPieces(2048, 1 << 20, &plans);
  f.mps = true;
  absl::StatusOr<PathDecision> d = DecidePath(f, {});
  EXPECT_EQ(d->path, CudaPath::kStaged);
  EXPECT_TRUE(absl::StrContains(d->why, "MPS active")) << d->why;
  // No larger staged blocks: under MPS the SM path, where the GPU can use
  // host pointers; the copy engines otherwise.
  f = SmallPieces(2048, 2048, &plans);
  f.mps = true;
  d = DecidePath(f, {});
  EXPECT_EQ(d->path, CudaPath::kSm);
  EXPECT_TRUE(absl::StrContains(d->why, "no larger blocks to stage, MPS active")) << d->why;
  f.stageable = false;
  EXPECT_EQ(DecidePath(f, {})->path, CudaPath::kSm);
  f.host_pointer_ok = false;
  EXPECT_EQ(DecidePath(f, {})->path, CudaPath::kCopyEngine);
}

TEST(PathPolicyTest, StagedOnlyWhereItsBlocksAreClearlyLarger) {
  int plans = 0;
  EXPECT_EQ(DecidePath(SmallPieces(2048, 4096, &plans), {})->path, CudaPath::kStaged);
  EXPECT_EQ(DecidePath(SmallPieces(2048, 4095, &plans), {})->path, CudaPath::kCopyEngine);
  EXPECT_EQ(
      DecidePath(SmallPieces(2048, absl::FailedPreconditionError("too big"), &plans), {})->path,
      CudaPath::kCopyEngine);
  PathFacts f = SmallPieces(2048, 1 << 20, &plans);
  f.stageable = false;
  EXPECT_EQ(DecidePath(f, {})->path, CudaPath::kCopyEngine);
  EXPECT_EQ(plans, 3);
}

TEST(PathPolicyTest, TheThresholdIsTheOperatorsToSet) {
  int plans = 0;
  PathPolicy policy;
  policy.ce_min_piece_bytes = 16 << 10;
  EXPECT_EQ(DecidePath(SmallPieces(32 << 10, 1 << 20, &plans), policy)->path,
            CudaPath::kCopyEngine);
  policy.ce_min_piece_bytes = 64 << 10;
  EXPECT_EQ(DecidePath(SmallPieces(32 << 10, 1 << 20, &plans), policy)->path, CudaPath::kStaged);
}

TEST(PathPolicyTest, ForcedPathsAreTakenOrRefusedWithTheReason) {
  int plans = 0;
  PathPolicy policy;
  policy.forced = CudaPath::kCopyEngine;
  EXPECT_EQ(DecidePath(SmallPieces(16, 1 << 20, &plans), policy)->path, CudaPath::kCopyEngine);
  policy.forced = CudaPath::kSm;
  PathFacts f = SmallPieces(1 << 20, 1 << 20, &plans);
  EXPECT_EQ(DecidePath(f, policy)->path, CudaPath::kSm);
  f.host_pointer_ok = false;
  EXPECT_EQ(DecidePath(f, policy).status().code(), absl::StatusCode::kFailedPrecondition);
  policy.forced = CudaPath::kStaged;
  EXPECT_EQ(DecidePath(f, policy)->path, CudaPath::kStaged);
  absl::StatusOr<PathDecision> refused = DecidePath(
      SmallPieces(1 << 20, absl::FailedPreconditionError("unit too big"), &plans), policy);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "--transfer-path=staged: unit too big"))
      << refused.status();
}

TEST(GeometricLayerIntervalsTest, DoubleAfterTheFirstTwo) {
  std::vector<HeldLayers> v = GeometricLayerIntervals(HeldLayers{0, 32, 0});
  std::vector<std::pair<uint64_t, uint64_t>> got;
  for (const HeldLayers& h : v) got.emplace_back(h.begin, h.end);
  EXPECT_EQ(got, (std::vector<std::pair<uint64_t, uint64_t>>{
                     {0, 1}, {1, 2}, {2, 4}, {4, 8}, {8, 16}, {16, 32}}));
  v = GeometricLayerIntervals(HeldLayers{5, 8, -5});
  ASSERT_EQ(v.size(), 3u);
  EXPECT_EQ(v[2].begin, 7u);
  EXPECT_EQ(v[2].end, 8u);
  EXPECT_EQ(v[2].delta, -5);
  EXPECT_EQ(GeometricLayerIntervals(HeldLayers{3, 4, 0}).size(), 1u);
}

// A one-part job of `host` / `device` slots on a real pool of `shape`.
class JobPlanTest : public ::testing::Test {
 protected:
  void Make(const Shape& shape, const std::vector<int64_t>& host,
            const std::vector<int64_t>& device) {
    ASSERT_FALSE(dir_.path().empty());
    job_ = TransferJob();  // the previous pool goes first: a new one of the same name
    const PoolSpec spec = SpecOf(shape);
    absl::StatusOr<std::shared_ptr<Pool>> pool =
        Pool::Create("p", spec, *ResolveSizeTokens(spec), dir_.path() + "/kvhost.");
    ASSERT_TRUE(pool.ok()) << pool.status();
    job_.direction = Direction::kLoad;
    JobPart& part = job_.parts.emplace_back();
    part.pool = *pool;
    part.runs = CoalesceRuns(host, device);
    part.tokens = host.size();
    for (uint32_t l = 0; l < shape.layers; ++l) {
      part.layers.push_back(JobLayer{static_cast<int32_t>(l), l});
    }
  }
  JobPlanInputs Inputs() const {
    JobPlanInputs in;
    in.staging_chunk = uint64_t{1} << 20;
    in.host_split = uint64_t{1} << 30;
    return in;
  }

  testing::ShmDir dir_{"kvhost-plan"};
  TransferJob job_;
};

std::vector<int64_t> Iota(int64_t n) {
  std::vector<int64_t> v(static_cast<size_t>(n));
  std::iota(v.begin(), v.end(), 0);
  return v;
}

std::vector<int64_t> Shuffled(int64_t n, uint64_t seed) {
  std::vector<int64_t> v = Iota(n);
  std::mt19937_64 rng(seed);
  std::shuffle(v.begin(), v.end(), rng);
  return v;
}

TEST_F(JobPlanTest, TokenMajorLayoutWithScatteredRowsIsStaged) {
  Make({"pf", PoolKind::kMha, LayoutKind::kPageFirst, 8, 8, 128, 1, 1024}, Shuffled(256, 1),
       Shuffled(256, 2));
  absl::StatusOr<CudaJobPlan> plan = PlanJob(job_, Inputs());
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->path, CudaPath::kStaged) << plan->why;
  ASSERT_TRUE(std::holds_alternative<StagedJobPlan>(plan->detail));
  EXPECT_GT(std::get<StagedJobPlan>(plan->detail).chunks(), 0u);
}

TEST_F(JobPlanTest, LayerFirstLargePagesTakeTheCopyEngines) {
  std::vector<int64_t> host, device;
  for (int64_t p : Shuffled(8, 3)) {
    for (int64_t t = 0; t < 64; ++t) host.push_back(p * 64 + t);
  }
  for (int64_t p : Shuffled(8, 4)) {
    for (int64_t t = 0; t < 64; ++t) device.push_back(p * 64 + t);
  }
  Make({"lf", PoolKind::kMha, LayoutKind::kLayerFirst, 4, 8, 128, 64, 16}, host, device);
  absl::StatusOr<CudaJobPlan> plan = PlanJob(job_, Inputs());
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->path, CudaPath::kCopyEngine) << plan->why;
  EXPECT_TRUE(std::holds_alternative<std::monostate>(plan->detail));
}

TEST_F(JobPlanTest, LayerFirstScatteredRowsButConsecutiveHostSlotsIsStaged) {
  // Host slots in one run (a contiguity-keeping allocator's), device rows
  // scattered: 2 KiB copy-engine pieces, but whole-layer staged blocks.
  Make({"lf1", PoolKind::kMha, LayoutKind::kLayerFirst, 4, 8, 128, 1, 1024}, Iota(256),
       Shuffled(256, 5));
  absl::StatusOr<CudaJobPlan> plan = PlanJob(job_, Inputs());
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->path, CudaPath::kStaged) << plan->why;
  // The same slots in any request order: the staged plan sorts them.
  Make({"lf1", PoolKind::kMha, LayoutKind::kLayerFirst, 4, 8, 128, 1, 1024}, Shuffled(256, 6),
       Shuffled(256, 7));
  plan = PlanJob(job_, Inputs());
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->path, CudaPath::kStaged) << plan->why;
  // Host slots no two of which are adjacent: nothing to gain, the copy
  // engines.
  std::vector<int64_t> apart = Shuffled(256, 8);
  for (int64_t& slot : apart) slot *= 4;
  Make({"lf1", PoolKind::kMha, LayoutKind::kLayerFirst, 4, 8, 128, 1, 1024}, apart,
       Shuffled(256, 7));
  plan = PlanJob(job_, Inputs());
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->path, CudaPath::kCopyEngine) << plan->why;
}

TEST_F(JobPlanTest, LayerOrderedLoadsCompleteLayersRangeByRange) {
  Make({"lf", PoolKind::kMha, LayoutKind::kLayerFirst, 8, 8, 128, 1, 1024}, Iota(256),
       Shuffled(256, 9));
  JobPlanInputs in = Inputs();
  in.layer_ordered = true;
  absl::StatusOr<CudaJobPlan> plan = PlanJob(job_, in);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->path, CudaPath::kStaged);
  const StagedJobPlan& staged = std::get<StagedJobPlan>(plan->detail);
  std::vector<uint64_t> complete;
  for (const StagedRange& r : staged.ranges) complete.push_back(r.layers_complete);
  EXPECT_EQ(complete, (std::vector<uint64_t>{1, 2, 4, 8}));
  // Only the first range is planned by PlanJob (the Load call waits for
  // it); each later one by PlanStagedRange, as its interval alone.
  for (size_t i = 0; i < staged.ranges.size(); ++i) {
    const StagedRange& r = staged.ranges[i];
    EXPECT_EQ(r.planned, i == 0) << "range " << i;
    StagedPlan late;
    ASSERT_TRUE(PlanStagedRange(job_, staged, r, &late).ok());
    StagedPlan direct;
    ASSERT_TRUE(PlanStaged(staged.part_groups[0], job_.parts[0].runs, job_.parts[0].page_runs,
                           r.layer_begin, r.layer_end, in.staging_chunk, in.host_split, &direct)
                    .ok());
    EXPECT_EQ(late.tiles.size(), direct.tiles.size()) << "range " << i;
    EXPECT_EQ(late.copies.size(), direct.copies.size()) << "range " << i;
    EXPECT_EQ(late.chunks.size(), direct.chunks.size()) << "range " << i;
    EXPECT_FALSE(late.chunks.empty()) << "range " << i;
    if (i == 0) {
      EXPECT_EQ(r.plan.tiles.size(), direct.tiles.size());
    }
  }
  EXPECT_FALSE(staged.empty());
  // Not layer-ordered: one range, every layer at the job's end.
  plan = PlanJob(job_, Inputs());
  ASSERT_TRUE(plan.ok());
  ASSERT_EQ(std::get<StagedJobPlan>(plan->detail).ranges.size(), 1u);
  EXPECT_EQ(std::get<StagedJobPlan>(plan->detail).ranges[0].layers_complete, 0u);
}

TEST_F(JobPlanTest, TokenMajorLayoutsAreNotLayerOrdered) {
  // A token's few layers are a few rows: layer by layer would cut the
  // copies to single rows.
  Make({"pf", PoolKind::kMha, LayoutKind::kPageFirst, 8, 8, 128, 1, 1024}, Shuffled(256, 8),
       Shuffled(256, 9));
  JobPlanInputs in = Inputs();
  in.layer_ordered = true;
  absl::StatusOr<CudaJobPlan> plan = PlanJob(job_, in);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->path, CudaPath::kStaged);
  EXPECT_EQ(std::get<StagedJobPlan>(plan->detail).ranges.size(), 1u);
}

TEST_F(JobPlanTest, ForcedStagedNamesAUnitThatDoesNotFit) {
  Make({"pf", PoolKind::kMha, LayoutKind::kPageFirstDirect, 8, 8, 128, 64, 16}, Iota(64), Iota(64));
  JobPlanInputs in = Inputs();
  in.staging_chunk = 4096;
  in.policy.forced = CudaPath::kStaged;
  absl::StatusOr<CudaJobPlan> plan = PlanJob(job_, in);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(plan.status().message(), "--transfer-path=staged"))
      << plan.status();
}

}  // namespace
}  // namespace kvhost
