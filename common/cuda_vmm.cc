#include "common/cuda_vmm.h"

#include <cuda_runtime.h>

#include "absl/strings/str_cat.h"
#include "common/cuda_util.h"

namespace kvhost {
namespace {

// The driver's `name`, as of the API version of the typedef it is used by.
absl::Status Resolve(const char* name, unsigned int version, void** out) {
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
  const cudaError_t e =
      cudaGetDriverEntryPointByVersion(name, out, version, cudaEnableDefault, &found);
#else
  (void)version;
  const cudaError_t e = cudaGetDriverEntryPoint(name, out, cudaEnableDefault, &found);
#endif
  if (e != cudaSuccess || found != cudaDriverEntryPointSuccess || *out == nullptr) {
    cudaGetLastError();
    return absl::InternalError(absl::StrCat("cannot find the driver's ", name, ": ", CudaError(e),
                                            ", lookup ", static_cast<int>(found)));
  }
  return absl::OkStatus();
}

template <typename Fn>
absl::Status Get(const char* name, unsigned int version, Fn* out) {
  void* p = nullptr;
  if (absl::Status s = Resolve(name, version, &p); !s.ok()) return s;
  *out = reinterpret_cast<Fn>(p);
  return absl::OkStatus();
}

absl::StatusOr<VmmApi> Load() {
  VmmApi api{};
  for (absl::Status s : {
           Get("cuMemCreate", 10020, &api.create),
           Get("cuMemGetAllocationGranularity", 10020, &api.allocation_granularity),
           Get("cuMemRetainAllocationHandle", 11000, &api.retain_allocation_handle),
           Get("cuMemExportToShareableHandle", 10020, &api.export_to_shareable_handle),
           Get("cuMemImportFromShareableHandle", 10020, &api.import_from_shareable_handle),
           Get("cuMemGetAllocationPropertiesFromHandle", 10020, &api.allocation_properties),
           Get("cuMemRelease", 10020, &api.release),
           Get("cuMemAddressReserve", 10020, &api.address_reserve),
           Get("cuMemAddressFree", 10020, &api.address_free),
           Get("cuMemMap", 10020, &api.map),
           Get("cuMemUnmap", 10020, &api.unmap),
           Get("cuMemSetAccess", 10020, &api.set_access),
           Get("cuGetErrorName", 6000, &api.error_name),
       }) {
    if (!s.ok()) return s;
  }
  return api;
}

}  // namespace

std::string VmmApi::Error(CUresult result) const {
  const char* name = nullptr;
  if (error_name == nullptr || error_name(result, &name) != CUDA_SUCCESS || name == nullptr) {
    name = "CUDA error";
  }
  return absl::StrCat(name, " (", static_cast<int>(result), ")");
}

absl::StatusOr<const VmmApi*> Vmm() {
  static const absl::StatusOr<VmmApi> api = Load();
  if (!api.ok()) return api.status();
  return &*api;
}

}  // namespace kvhost
