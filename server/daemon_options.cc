// DaemonOptions (contract: daemon_options.h).
#include "server/daemon_options.h"

#include "absl/strings/str_cat.h"

namespace kvhost {

absl::StatusOr<BackendChoice> ParseBackendChoice(absl::string_view name) {
  if (name == "auto") return BackendChoice::kAuto;
  if (name == "host") return BackendChoice::kHost;
  if (name == "cuda") return BackendChoice::kCuda;
  return absl::InvalidArgumentError(
      absl::StrCat("--backend '", name, "' is not one of auto, cuda, host"));
}

const char* BackendChoiceName(BackendChoice backend) {
  switch (backend) {
    case BackendChoice::kAuto:
      return "auto";
    case BackendChoice::kHost:
      return "host";
    case BackendChoice::kCuda:
      return "cuda";
  }
  return "auto";
}

absl::Status DaemonOptions::Validate() const {
  if (copy_threads < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--copy-threads=", copy_threads, " must be >= 0"));
  }
  if (session_timeout < absl::Milliseconds(100)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--session-timeout=", absl::FormatDuration(session_timeout), " must be at least 100ms"));
  }
  if (max_indices_per_call == 0) {
    return absl::InvalidArgumentError("--max-indices-per-call=0 must be >= 1");
  }
  if (max_message_bytes < 4096) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max-message-bytes=", max_message_bytes, " must be >= 4096"));
  }
  if (cuda.path != CudaPath::kAuto && backend == BackendChoice::kHost) {
    return absl::InvalidArgumentError(
        absl::StrCat("--transfer-path=", CudaPathFlag(cuda.path),
                     " applies to the cuda backend, but --backend=host"));
  }
  return cuda.Validate();
}

}  // namespace kvhost
