// Device-side evaluation of the layout math, so the same KvLayout that the
// host engine, the page-metadata RPC and the tests use is checked to give the
// same offsets inside a CUDA kernel (tests/layout_gpu_test.cc). The CUDA
// transfer kernels build on the same header.
//
// Thread-safe; each call uses its own device buffers and the default stream.
#ifndef KVHOST_KERNELS_LAYOUT_DEVICE_H_
#define KVHOST_KERNELS_LAYOUT_DEVICE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "kvhost/layout.h"

namespace kvhost {

// Number of CUDA devices this process can use (0 with no driver or GPU);
// `why` says why there are none.
int CudaDeviceCount(std::string* why);

// Computes Offset(plane, token, layer, head) for every element on the GPU, in
// plane-token-layer-head order, and ContiguousTokens(token) for every token.
// Returns false with `error` set if a CUDA call fails.
bool DeviceLayoutTable(const KvLayout& layout, std::vector<uint64_t>* offsets,
                       std::vector<uint64_t>* contiguous, std::string* error);

}  // namespace kvhost

#endif  // KVHOST_KERNELS_LAYOUT_DEVICE_H_
