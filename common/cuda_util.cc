#include "common/cuda_util.h"

#include "absl/strings/str_cat.h"

namespace kvhost {

std::string CudaError(cudaError_t error) {
  return absl::StrCat(cudaGetErrorName(error), " (", cudaGetErrorString(error), ")");
}

// nvidia-smi's spelling of a GPU UUID: "GPU-" and 8-4-4-4-12 hex digits.
std::string FormatUuid(const cudaUUID_t& uuid) {
  static constexpr int kGroups[] = {4, 2, 2, 2, 6};
  std::string out = "GPU";
  int i = 0;
  for (int group : kGroups) {
    out += '-';
    for (int k = 0; k < group; ++k, ++i) {
      absl::StrAppend(&out, absl::Hex(static_cast<unsigned char>(uuid.bytes[i]), absl::kZeroPad2));
    }
  }
  return out;
}

absl::StatusOr<PFN_cuMemGetAddressRange_v3020> AddressRangeFn() {
  static const absl::StatusOr<PFN_cuMemGetAddressRange_v3020> fn =
      []() -> absl::StatusOr<PFN_cuMemGetAddressRange_v3020> {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
    const cudaError_t e = cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &p, 12000,
                                                           cudaEnableDefault, &found);
#else
    const cudaError_t e =
        cudaGetDriverEntryPoint("cuMemGetAddressRange", &p, cudaEnableDefault, &found);
#endif
    if (e != cudaSuccess || found != cudaDriverEntryPointSuccess || p == nullptr) {
      cudaGetLastError();
      return absl::InternalError(absl::StrCat("cannot find the driver's cuMemGetAddressRange: ",
                                              CudaError(e), ", lookup ", static_cast<int>(found)));
    }
    return reinterpret_cast<PFN_cuMemGetAddressRange_v3020>(p);
  }();
  return fn;
}

}  // namespace kvhost
