#include "server/gpu_probe.h"

#include <dlfcn.h>

#include "absl/strings/str_cat.h"

namespace kvhost {

GpuProbe ProbeGpus() {
  GpuProbe probe;
  void* lib = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    probe.detail = "no CUDA driver (libcuda.so.1 not found)";
    return probe;
  }
  // Driver API entry points, by their documented C signatures.
  using InitFn = int (*)(unsigned int);
  using CountFn = int (*)(int*);
  using VersionFn = int (*)(int*);
  auto init = reinterpret_cast<InitFn>(::dlsym(lib, "cuInit"));
  auto count = reinterpret_cast<CountFn>(::dlsym(lib, "cuDeviceGetCount"));
  auto version = reinterpret_cast<VersionFn>(::dlsym(lib, "cuDriverGetVersion"));
  if (init == nullptr || count == nullptr) {
    probe.detail = "libcuda.so.1 lacks cuInit / cuDeviceGetCount";
  } else if (int rc = init(0); rc != 0) {
    probe.detail = absl::StrCat("cuInit failed with CUresult ", rc);
  } else if (int rc2 = count(&probe.count); rc2 != 0) {
    probe.count = 0;
    probe.detail = absl::StrCat("cuDeviceGetCount failed with CUresult ", rc2);
  } else {
    int v = 0;
    if (version != nullptr) version(&v);
    probe.detail =
        absl::StrCat(probe.count, " GPU(s), driver API ", v / 1000, ".", (v % 1000) / 10);
  }
  // The driver stays loaded: unloading it after cuInit is not supported.
  return probe;
}

}  // namespace kvhost
