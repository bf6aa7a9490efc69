// The CUDA driver's virtual memory calls (cuMem*), reached through the
// runtime as cuda_util.h reaches cuMemGetAddressRange, so that nothing links
// libcuda.so.1 at load time. Shared by the worker-side export of cuMem
// allocations as POSIX file descriptors (client/cuda_export.cc) and the
// daemon's import and mapping of them (server/transfer/cuda/mapping.cc).
//
// Thread-safe: Vmm resolves every entry point once.
#ifndef KVHOST_COMMON_CUDA_VMM_H_
#define KVHOST_COMMON_CUDA_VMM_H_

#include <cuda.h>
#include <cudaTypedefs.h>

#include <string>

#include "absl/status/statusor.h"

namespace kvhost {

struct VmmApi {
  // What a worker (and the tests) allocate with.
  PFN_cuMemCreate_v10020 create;
  PFN_cuMemGetAllocationGranularity_v10020 allocation_granularity;
  PFN_cuMemRetainAllocationHandle_v11000 retain_allocation_handle;
  PFN_cuMemExportToShareableHandle_v10020 export_to_shareable_handle;
  PFN_cuMemImportFromShareableHandle_v10020 import_from_shareable_handle;
  PFN_cuMemGetAllocationPropertiesFromHandle_v10020 allocation_properties;
  PFN_cuMemRelease_v10020 release;
  PFN_cuMemAddressReserve_v10020 address_reserve;
  PFN_cuMemAddressFree_v10020 address_free;
  PFN_cuMemMap_v10020 map;
  PFN_cuMemUnmap_v10020 unmap;
  PFN_cuMemSetAccess_v10020 set_access;
  PFN_cuGetErrorName_v6000 error_name;

  // "CUDA_ERROR_INVALID_VALUE (1)".
  std::string Error(CUresult result) const;
};

// The entry points; INTERNAL naming the first the driver lacks.
absl::StatusOr<const VmmApi*> Vmm();

}  // namespace kvhost

#endif  // KVHOST_COMMON_CUDA_VMM_H_
