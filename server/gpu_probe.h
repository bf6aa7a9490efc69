// Finds out whether this process can use a CUDA GPU, without linking the CUDA
// runtime: the driver library is loaded with dlopen, so one kvhostd binary
// runs on machines with and without a GPU.
//
// Thread-safe; each call probes afresh.
#ifndef KVHOST_SERVER_GPU_PROBE_H_
#define KVHOST_SERVER_GPU_PROBE_H_

#include <string>

namespace kvhost {

struct GpuProbe {
  int count = 0;       // CUDA GPUs usable by this process
  std::string detail;  // why none, or the driver version, for the log
};

GpuProbe ProbeGpus();

}  // namespace kvhost

#endif  // KVHOST_SERVER_GPU_PROBE_H_
