#include "gpu_worker_kernels.h"

namespace kvhost::testing {
namespace {

// Enough blocks to keep an H200 busy; the loops stride over the rest.
constexpr unsigned kBlocks = 264;
constexpr unsigned kThreads = 256;

__global__ void CopyRows(uint8_t* dst, const uint8_t* src, uint64_t bytes) {
  const uint64_t stride = uint64_t{gridDim.x} * blockDim.x;
  const uint64_t words = bytes / 16;
  auto* d = reinterpret_cast<uint4*>(dst);
  const auto* s = reinterpret_cast<const uint4*>(src);
  const bool aligned =
      (reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src)) % 16 == 0;
  uint64_t i = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (aligned) {
    for (uint64_t w = i; w < words; w += stride) d[w] = s[w];
    for (uint64_t b = words * 16 + i; b < bytes; b += stride) dst[b] = src[b];
  } else {
    for (uint64_t b = i; b < bytes; b += stride) dst[b] = src[b];
  }
}

__global__ void Spin(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

// Reads the host word each time round: the host's store reaches it over the
// bus, so no fence is needed on this side.
__global__ void WaitFlag(const volatile uint32_t* flag, long long max_cycles) {
  const long long start = clock64();
  while (*flag == 0 && clock64() - start < max_cycles) {
  }
}

__global__ void FillPattern(uint8_t* dst, uint64_t bytes, uint32_t seed) {
  const uint64_t stride = uint64_t{gridDim.x} * blockDim.x;
  for (uint64_t i = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < bytes; i += stride) {
    dst[i] = static_cast<uint8_t>((i * 131u + seed * 17u) % 251u + 1u);
  }
}

}  // namespace

cudaError_t LaunchCopyRows(void* dst, const void* src, uint64_t bytes, cudaStream_t stream) {
  CopyRows<<<kBlocks, kThreads, 0, stream>>>(static_cast<uint8_t*>(dst),
                                             static_cast<const uint8_t*>(src), bytes);
  return cudaGetLastError();
}

cudaError_t LaunchSpin(long long cycles, cudaStream_t stream) {
  Spin<<<1, 1, 0, stream>>>(cycles);
  return cudaGetLastError();
}

cudaError_t LaunchWaitFlag(const volatile uint32_t* flag, long long max_cycles,
                           cudaStream_t stream) {
  WaitFlag<<<1, 1, 0, stream>>>(flag, max_cycles);
  return cudaGetLastError();
}

cudaError_t LaunchFillPattern(void* dst, uint64_t bytes, uint32_t seed, cudaStream_t stream) {
  FillPattern<<<kBlocks, kThreads, 0, stream>>>(static_cast<uint8_t*>(dst), bytes, seed);
  return cudaGetLastError();
}

}  // namespace kvhost::testing
