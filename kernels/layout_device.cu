#include <cuda_runtime.h>

#include "layout_device.h"

namespace kvhost {
namespace {

__global__ void OffsetsKernel(KvLayout layout, uint64_t* offsets, uint64_t* contiguous) {
  const uint64_t n = layout.planes * layout.tokens * layout.layers * layout.heads;
  for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < n;
       i += uint64_t{gridDim.x} * blockDim.x) {
    const uint64_t head = i % layout.heads;
    const uint64_t layer = (i / layout.heads) % layout.layers;
    const uint64_t token = (i / (layout.heads * layout.layers)) % layout.tokens;
    const uint64_t plane = i / (layout.heads * layout.layers * layout.tokens);
    offsets[i] = layout.Offset(plane, token, layer, head);
    if (plane == 0 && layer == 0 && head == 0) contiguous[token] = layout.ContiguousTokens(token);
  }
}

bool Check(cudaError_t err, const char* what, std::string* error) {
  if (err == cudaSuccess) return true;
  *error = std::string(what) + ": " + cudaGetErrorString(err);
  return false;
}

}  // namespace

int CudaDeviceCount(std::string* why) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    *why = cudaGetErrorString(err);
    return 0;
  }
  if (count == 0) *why = "no CUDA device";
  return count;
}

bool DeviceLayoutTable(const KvLayout& layout, std::vector<uint64_t>* offsets,
                       std::vector<uint64_t>* contiguous, std::string* error) {
  const uint64_t n = layout.planes * layout.tokens * layout.layers * layout.heads;
  uint64_t* d_offsets = nullptr;
  uint64_t* d_contiguous = nullptr;
  bool ok = Check(cudaMalloc(&d_offsets, n * sizeof(uint64_t)), "cudaMalloc", error) &&
            Check(cudaMalloc(&d_contiguous, layout.tokens * sizeof(uint64_t)), "cudaMalloc", error);
  if (ok) {
    OffsetsKernel<<<64, 256>>>(layout, d_offsets, d_contiguous);
    ok = Check(cudaGetLastError(), "launch", error) &&
         Check(cudaDeviceSynchronize(), "kernel", error);
  }
  if (ok) {
    offsets->resize(n);
    contiguous->resize(layout.tokens);
    ok = Check(cudaMemcpy(offsets->data(), d_offsets, n * sizeof(uint64_t), cudaMemcpyDeviceToHost),
               "cudaMemcpy", error) &&
         Check(cudaMemcpy(contiguous->data(), d_contiguous, layout.tokens * sizeof(uint64_t),
                          cudaMemcpyDeviceToHost),
               "cudaMemcpy", error);
  }
  cudaFree(d_offsets);
  cudaFree(d_contiguous);
  return ok;
}

}  // namespace kvhost
