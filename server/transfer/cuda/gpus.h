// The GPUs the CUDA engine can use, as probed once at start, and whether an
// MPS control daemon serves this process. No CUDA context is created here
// (cudaGetDeviceProperties does not make one).
//
// Thread-safe: plain values and functions.
#ifndef KVHOST_SERVER_TRANSFER_CUDA_GPUS_H_
#define KVHOST_SERVER_TRANSFER_CUDA_GPUS_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace kvhost {

// A GPU this process can use.
struct GpuInfo {
  int ordinal = 0;
  std::string uuid;  // "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", lower case
  std::string name;
  int sms = 0;
  // The SM copy path reads the pool through its host address
  // (cudaDevAttrCanUseHostPointerForRegisteredMem).
  bool host_pointer_ok = false;
};

// Every GPU of this process. FAILED_PRECONDITION when there is none or the
// CUDA runtime fails.
absl::StatusOr<std::vector<GpuInfo>> ProbeCudaGpus();

// `uuid` in GpuInfo's spelling ("GPU-" then lower-case hex; nvidia-smi
// prints lower case, but any case is accepted), or "" when it is not a GPU
// UUID.
std::string CanonicalGpuUuid(const std::string& uuid);

// Whether an MPS control daemon's pipe exists where the CUDA client library
// looks for it ($CUDA_MPS_PIPE_DIRECTORY, else /tmp/nvidia-mps), and a line
// saying so for the log.
bool MpsActive(std::string* detail);

}  // namespace kvhost

#endif  // KVHOST_SERVER_TRANSFER_CUDA_GPUS_H_
