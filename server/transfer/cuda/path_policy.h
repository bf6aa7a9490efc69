// The CUDA engine's path policy: which of its copy paths (CudaPath) a job
// takes, and why, from facts about the job that the engine gathers (the
// average copy-engine piece, the staged plan's average block, whether MPS
// serves the daemon, whether the GPU can address the pool's host pointers).
// A pure function of those facts and the policy's thresholds, with no CUDA
// dependency, so that tests/path_policy_test.cc checks every rule on the
// CPU; the engine only gathers the facts and follows the answer.
//
// The rules (docs/PERF.md has the measurements behind them):
//   --transfer-path=ce|staged|sm   that path (sm: FAILED_PRECONDITION where
//                                  the GPU cannot use host pointers; staged:
//                                  the plan's own error when it has none);
//   auto, large copy-engine pieces the copy engines: no kernel at all, so
//                                  the worker pays nothing;
//   auto, staged blocks larger     the staged path: one short full-grid
//                                  gather or scatter per chunk and large
//                                  copy-engine copies (under MPS too: it
//                                  costs a GEMM worker less than the SM
//                                  path's long kernel, docs/PERF.md run Q);
//   auto, MPS active               the SM copy path, where no staged plan is
//                                  larger: under MPS a small grid shares the
//                                  SMs instead of time-slicing;
//   auto, otherwise                the copy engines, slow but free for the
//                                  worker (never a kernel that time-slices
//                                  against it for no gain).
//
// The rules read no layout: each layout's plans give the facts. PAGE_UNIFIED,
// say, has copy-engine pieces of a page's rows of one layer and plane (128
// KiB at page 64 for 8 heads of 128 bf16 in one head group: the copy
// engines), and staged blocks of whole pages of both planes and every layer
// (16 KiB at page 1 against 2 KiB rows: the staged path); tests/
// copy_plan_test.cc (UnifiedPathTest) checks both.
//
// Thread-safe: pure functions.
#ifndef KVHOST_SERVER_TRANSFER_CUDA_PATH_POLICY_H_
#define KVHOST_SERVER_TRANSFER_CUDA_PATH_POLICY_H_

#include <cstdint>
#include <functional>
#include <string>

#include "absl/status/statusor.h"

namespace kvhost {

// How a job's bytes move (docs/DESIGN.md, "Transfer paths"):
//   kCopyEngine  cudaMemcpyBatchAsync of the layout-contiguous pieces; costs
//                the worker nothing, fast only for large pieces;
//   kStaged      through a device staging buffer: a device-to-device gather
//                (backup) or scatter (load) kernel next to large copy-engine
//                copies of whole pool blocks, double-buffered; a short kernel
//                from our context per chunk, so a small cost to the worker;
//   kSm          one kernel per layer copying through mapped host memory,
//                its grid bounded by sm_blocks; fastest for small pieces, but
//                without MPS it time-slices against the worker's kernels.
// kAuto picks per job (DecidePath).
enum class CudaPath : uint8_t { kAuto, kCopyEngine, kStaged, kSm };

// "auto", "ce", "staged", "sm" (the --transfer-path values).
absl::StatusOr<CudaPath> ParseCudaPath(const std::string& name);
// The ticket status names: "cuda-ce", "cuda-staged", "cuda-sm" ("auto" for kAuto).
const char* CudaPathName(CudaPath path);
// --transfer-path's spelling, which ParseCudaPath reads: "auto", "ce",
// "staged", "sm".
const char* CudaPathFlag(CudaPath path);

// auto's copy-engine threshold: CudaEngineOptions::ce_min_piece_bytes says
// why, and PathPolicy starts from the same.
inline constexpr uint64_t kDefaultCeMinPieceBytes = uint64_t{64} << 10;

// The thresholds of auto.
struct PathPolicy {
  // --transfer-path: every job's path, or kAuto to choose per job.
  CudaPath forced = CudaPath::kAuto;
  // The copy engines take a job whose layout-contiguous pieces average at
  // least this many bytes (CudaEngineOptions::ce_min_piece_bytes says why).
  uint64_t ce_min_piece_bytes = kDefaultCeMinPieceBytes;
  // The staged path takes a job whose staged blocks average at least this
  // many times its copy-engine pieces: a kernel of ours is worth its cost to
  // the worker only where it makes the link's pieces clearly larger.
  uint64_t staged_min_gain = 2;
};

// What the engine knows about a job when it chooses.
struct PathFacts {
  // Bytes per copy-engine piece, on average over the job.
  uint64_t ce_piece_bytes = 0;
  // Whether an MPS control daemon serves kvhostd (the SM copy path then
  // shares the SMs instead of time-slicing).
  bool mps = false;
  // Whether the GPU can address the pool through its host pointers
  // (cudaDevAttrCanUseHostPointerForRegisteredMem); the SM copy path needs it.
  bool host_pointer_ok = true;
  // Whether some part's layout has staged blocks larger than its pieces.
  bool stageable = true;
  // Plans the staged path and returns its average block in bytes, or why it
  // has no plan; called at most once, and only when the answer matters.
  std::function<absl::StatusOr<uint64_t>()> staged_block_bytes;
};

struct PathDecision {
  CudaPath path = CudaPath::kCopyEngine;
  std::string why;  // for the log: "auto: copy-engine pieces of 2 KiB, ..."
};

// The path of a job with `facts` under `policy` (the rules above). Errors
// only for a forced path the job cannot take.
absl::StatusOr<PathDecision> DecidePath(const PathFacts& facts, const PathPolicy& policy);

}  // namespace kvhost

#endif  // KVHOST_SERVER_TRANSFER_CUDA_PATH_POLICY_H_
