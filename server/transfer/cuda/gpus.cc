#include "server/transfer/cuda/gpus.h"

#include <cuda_runtime_api.h>
#include <sys/stat.h>

#include <cstdlib>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/cuda_util.h"

namespace kvhost {

absl::StatusOr<std::vector<GpuInfo>> ProbeCudaGpus() {
  int count = 0;
  if (cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess || count == 0) {
    cudaGetLastError();
    return absl::FailedPreconditionError(absl::StrCat(
        "no usable CUDA GPU: ", e != cudaSuccess ? CudaError(e) : "cudaGetDeviceCount is 0"));
  }
  std::vector<GpuInfo> gpus;
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop;
    if (cudaError_t e = cudaGetDeviceProperties(&prop, i); e != cudaSuccess) {
      cudaGetLastError();
      return absl::FailedPreconditionError(
          absl::StrCat("cudaGetDeviceProperties(", i, "): ", CudaError(e)));
    }
    int host_pointer = 0;
    if (cudaError_t e =
            cudaDeviceGetAttribute(&host_pointer, cudaDevAttrCanUseHostPointerForRegisteredMem, i);
        e != cudaSuccess) {
      cudaGetLastError();
      host_pointer = 0;
    }
    gpus.push_back(
        GpuInfo{i, FormatUuid(prop.uuid), prop.name, prop.multiProcessorCount, host_pointer != 0});
  }
  return gpus;
}

std::string CanonicalGpuUuid(const std::string& uuid) {
  std::string s = absl::AsciiStrToLower(uuid);
  if (s.size() != 40 || s.compare(0, 4, "gpu-") != 0) return "";
  s.replace(0, 4, "GPU-");
  for (size_t i = 4; i < s.size(); ++i) {
    const bool dash = i == 12 || i == 17 || i == 22 || i == 27;
    if (dash ? s[i] != '-' : !absl::ascii_isxdigit(static_cast<unsigned char>(s[i]))) return "";
  }
  return s;
}

bool MpsActive(std::string* detail) {
  const char* env = std::getenv("CUDA_MPS_PIPE_DIRECTORY");
  const std::string dir = env != nullptr && *env != '\0' ? env : "/tmp/nvidia-mps";
  struct stat st;
  const bool active = ::stat((dir + "/control").c_str(), &st) == 0;
  *detail = absl::StrCat("MPS ", active ? "active" : "not active", " (", dir, "/control ",
                         active ? "present" : "absent", ")");
  return active;
}

}  // namespace kvhost
