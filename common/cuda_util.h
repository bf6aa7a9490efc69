// CUDA helpers shared by the daemon's CUDA engine and the worker-side client
// library: error text, GPU UUIDs in nvidia-smi's spelling, and the driver's
// cuMemGetAddressRange reached through the runtime (so nothing links
// libcuda.so.1 at load time: kvhostd and the tests must start on machines
// without a driver).
//
// Thread-safe: AddressRangeFn resolves the entry point once.
#ifndef KVHOST_COMMON_CUDA_UTIL_H_
#define KVHOST_COMMON_CUDA_UTIL_H_

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <string>

#include "absl/status/statusor.h"

namespace kvhost {

// "cudaErrorInvalidValue (invalid argument)".
std::string CudaError(cudaError_t error);
// "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", lower case, as nvidia-smi -L.
std::string FormatUuid(const cudaUUID_t& uuid);
// The driver's cuMemGetAddressRange; INTERNAL when the driver lacks it.
absl::StatusOr<PFN_cuMemGetAddressRange_v3020> AddressRangeFn();

}  // namespace kvhost

#endif  // KVHOST_COMMON_CUDA_UTIL_H_
