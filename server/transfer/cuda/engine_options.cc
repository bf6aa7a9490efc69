// CudaEngineOptions (contract: engine_options.h).
#include "server/transfer/cuda/engine_options.h"

#include "absl/strings/str_cat.h"

namespace kvhost {

absl::Status CudaEngineOptions::Validate() const {
  if (sm_blocks < 1) {
    return absl::InvalidArgumentError(absl::StrCat("--sm-blocks=", sm_blocks, " must be >= 1"));
  }
  if (copy_streams < 1 || copy_streams > 16) {
    return absl::InvalidArgumentError(
        absl::StrCat("--copy-streams=", copy_streams, " is not in [1, 16]"));
  }
  if (staging_bytes < (uint64_t{64} << 10)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--staging-bytes=", staging_bytes, " is below the minimum of 64K"));
  }
  return absl::OkStatus();
}

}  // namespace kvhost
