#include "server/transfer/cuda/path_policy.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/bytes.h"

namespace kvhost {

absl::StatusOr<CudaPath> ParseCudaPath(const std::string& name) {
  if (name == "auto") return CudaPath::kAuto;
  if (name == "ce") return CudaPath::kCopyEngine;
  if (name == "staged") return CudaPath::kStaged;
  if (name == "sm") return CudaPath::kSm;
  return absl::InvalidArgumentError(
      absl::StrCat("transfer path '", name, "' is not one of auto, ce (copy engines), staged, sm"));
}

const char* CudaPathFlag(CudaPath path) {
  switch (path) {
    case CudaPath::kAuto:
      return "auto";
    case CudaPath::kCopyEngine:
      return "ce";
    case CudaPath::kStaged:
      return "staged";
    case CudaPath::kSm:
      return "sm";
  }
  return "auto";
}

const char* CudaPathName(CudaPath path) {
  switch (path) {
    case CudaPath::kAuto:
      return "auto";
    case CudaPath::kCopyEngine:
      return "cuda-ce";
    case CudaPath::kStaged:
      return "cuda-staged";
    case CudaPath::kSm:
      return "cuda-sm";
  }
  return "auto";
}

absl::StatusOr<PathDecision> DecidePath(const PathFacts& facts, const PathPolicy& policy) {
  constexpr char kNoSm[] =
      "this GPU cannot address registered host memory by its host pointer "
      "(cudaDevAttrCanUseHostPointerForRegisteredMem is 0)";
  auto decided = [](CudaPath path, std::string why) { return PathDecision{path, std::move(why)}; };
  switch (policy.forced) {
    case CudaPath::kCopyEngine:
      return decided(CudaPath::kCopyEngine, "--transfer-path=ce");
    case CudaPath::kSm:
      if (!facts.host_pointer_ok) {
        return absl::FailedPreconditionError(absl::StrCat("--transfer-path=sm: ", kNoSm));
      }
      return decided(CudaPath::kSm, "--transfer-path=sm");
    case CudaPath::kStaged: {
      absl::StatusOr<uint64_t> block = facts.staged_block_bytes
                                           ? facts.staged_block_bytes()
                                           : absl::FailedPreconditionError("no staged plan");
      if (!block.ok()) {
        return absl::Status(block.status().code(),
                            absl::StrCat("--transfer-path=staged: ", block.status().message()));
      }
      return decided(CudaPath::kStaged, "--transfer-path=staged");
    }
    case CudaPath::kAuto:
      break;
  }
  const uint64_t piece = facts.ce_piece_bytes;
  if (piece >= policy.ce_min_piece_bytes) {
    return decided(CudaPath::kCopyEngine,
                   absl::StrCat("auto: copy-engine pieces of ", FormatBytes(piece),
                                " on average, >= ", FormatBytes(policy.ce_min_piece_bytes)));
  }
  // Staged before the SM path even under MPS: measured on the H200 against a
  // GEMM worker (docs/PERF.md, run Q), staged cost it +4.3 to +5.9 % back to
  // back under MPS at 0.96 of the link, the SM path's long small-grid kernel
  // +24 to +27 % for backups at 0.89-0.92.
  const char* const mps = facts.mps ? "MPS active" : "MPS not active";
  if (facts.stageable && facts.staged_block_bytes) {
    absl::StatusOr<uint64_t> block = facts.staged_block_bytes();
    if (block.ok() && *block >= policy.staged_min_gain * piece) {
      return decided(CudaPath::kStaged,
                     absl::StrCat("auto: copy-engine pieces of only ", FormatBytes(piece),
                                  ", staged blocks of ", FormatBytes(*block), ", ", mps));
    }
  }
  if (facts.mps && facts.host_pointer_ok) {
    return decided(CudaPath::kSm,
                   absl::StrCat("auto: copy-engine pieces of only ", FormatBytes(piece),
                                ", no larger blocks to stage, MPS active"));
  }
  return decided(CudaPath::kCopyEngine,
                 absl::StrCat("auto: copy-engine pieces of ", FormatBytes(piece),
                              "; no larger blocks to stage and MPS not active (the SM copy path "
                              "would time-slice against the worker)"));
}

}  // namespace kvhost
