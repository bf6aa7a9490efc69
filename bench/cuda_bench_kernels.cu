#include "bench/cuda_bench_kernels.h"

namespace kvhost::bench {
namespace {

// Memory-bound kernels: enough blocks to cover an H200's 132 SMs several
// times; the loops stride over the rest.
constexpr unsigned kMemBlocks = 1056;
constexpr unsigned kMemThreads = 256;
constexpr int kComputeThreads = 256;

// splitmix64 of the word index, with every zero byte turned into 0x01: a row
// left at zero, or copied from the wrong place, never passes the check.
__device__ __forceinline__ uint64_t KvWord(uint64_t seed, uint64_t index) {
  uint64_t z = index * 0x9E3779B97F4A7C15ull + seed * 0xD1B54A32D192ED03ull + 0x632BE59BD9B4E019ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  constexpr uint64_t kLow7 = 0x7F7F7F7F7F7F7F7Full;
  // Bit 7 of each byte of `nonzero` is set iff that byte of z is non-zero
  // (no carry crosses a byte: (b & 0x7f) + 0x7f <= 0xfe).
  const uint64_t nonzero = ((z & kLow7) + kLow7) | z;
  const uint64_t zero_bytes = ~(nonzero | kLow7);  // 0x80 in each zero byte
  return z | (zero_bytes >> 7);
}

__global__ void FillKv(uint64_t* dst, uint64_t words, uint64_t seed, uint64_t first_word) {
  const uint64_t stride = uint64_t{gridDim.x} * blockDim.x;
  for (uint64_t i = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < words; i += stride) {
    dst[i] = KvWord(seed, first_word + i);
  }
}

__global__ void CheckKv(const uint64_t* buffer, uint64_t rows, uint64_t row_words, uint64_t seed,
                        uint64_t first_word, const int64_t* source_rows,
                        unsigned long long* counters) {
  const uint64_t stride = uint64_t{gridDim.x} * blockDim.x;
  const uint64_t words = rows * row_words;
  unsigned long long wrong = 0;
  unsigned long long first_bad = ~0ull;
  for (uint64_t i = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < words; i += stride) {
    const uint64_t row = i / row_words;
    const int64_t source = source_rows[row];
    const uint64_t from = source < 0 ? row : static_cast<uint64_t>(source);
    if (buffer[i] != KvWord(seed, first_word + from * row_words + i % row_words)) {
      ++wrong;
      if (row < first_bad) first_bad = row;
    }
  }
  if (wrong != 0) {
    atomicAdd(&counters[0], wrong);
    atomicMin(&counters[1], first_bad);
  }
}

// Eight independent chains keep the FMA pipes full; x converges to
// b / (1 - a) = 1, so nothing overflows however long it runs.
__global__ void __launch_bounds__(kComputeThreads) FmaLoop(uint32_t iterations, float* sink) {
  constexpr int kChains = 8;
  const float a = 0.999f, b = 0.001f;
  float x[kChains];
#pragma unroll
  for (int k = 0; k < kChains; ++k) x[k] = 0.5f + 1e-4f * static_cast<float>(threadIdx.x + k);
  for (uint32_t i = 0; i < iterations; ++i) {
#pragma unroll
    for (int k = 0; k < kChains; ++k) x[k] = fmaf(x[k], a, b);
  }
  float sum = 0;
#pragma unroll
  for (int k = 0; k < kChains; ++k) sum += x[k];
  if (sum == -1.0f) *sink = sum;
}

__global__ void FillBf16(uint16_t* dst, uint64_t count, uint64_t seed) {
  const uint64_t stride = uint64_t{gridDim.x} * blockDim.x;
  for (uint64_t i = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < count; i += stride) {
    // A float in [-1, 1) from 23 random bits, rounded down to bf16 (its top
    // 16 bits): never a NaN or an infinity.
    const uint32_t bits = static_cast<uint32_t>(KvWord(seed, i) >> 41);
    const float x = static_cast<float>(bits) * (2.0f / 8388608.0f) - 1.0f;
    dst[i] = static_cast<uint16_t>(__float_as_uint(x) >> 16);
  }
}

// Vectors a lane has in flight before it stores them: a PCIe read takes
// microseconds, so each lane issues several before waiting on the first.
constexpr int kAnchorUnroll = 4;
constexpr int kWarp = 32;

__global__ void __launch_bounds__(kAnchorThreads) AnchorCopyKernel(AnchorCopy c) {
  const uint64_t warps = uint64_t{gridDim.x} * (blockDim.x / kWarp);
  const uint64_t lane = threadIdx.x % kWarp;
  const uint64_t vectors = c.row_bytes / sizeof(int4);
  for (uint64_t t = (uint64_t{blockIdx.x} * blockDim.x + threadIdx.x) / kWarp; t < c.tokens;
       t += warps) {
    const uint64_t dev_off = static_cast<uint64_t>(c.device_rows[t]) * c.row_bytes;
    const uint64_t host_row = static_cast<uint64_t>(c.host_slots[t]);
    for (uint32_t b = 0; b < c.buffers; ++b) {
      uint8_t* dev = static_cast<uint8_t*>(c.device_layers[b]) + dev_off;
      uint8_t* host = c.host + (uint64_t{b} * c.host_rows + host_row) * c.row_bytes;
      const int4* src = reinterpret_cast<const int4*>(c.backup ? dev : host);
      int4* dst = reinterpret_cast<int4*>(c.backup ? host : dev);
      for (uint64_t v = lane; v < vectors; v += kWarp * kAnchorUnroll) {
        int4 r[kAnchorUnroll];
#pragma unroll
        for (int u = 0; u < kAnchorUnroll; ++u) {
          if (v + u * kWarp < vectors) r[u] = src[v + u * kWarp];
        }
#pragma unroll
        for (int u = 0; u < kAnchorUnroll; ++u) {
          if (v + u * kWarp < vectors) dst[v + u * kWarp] = r[u];
        }
      }
    }
  }
}

}  // namespace

cudaError_t LaunchFillBf16(void* dst, uint64_t count, uint64_t seed, cudaStream_t stream) {
  FillBf16<<<kMemBlocks, kMemThreads, 0, stream>>>(static_cast<uint16_t*>(dst), count, seed);
  return cudaGetLastError();
}

cudaError_t LaunchAnchorCopy(const AnchorCopy& copy, int blocks, cudaStream_t stream) {
  AnchorCopyKernel<<<blocks, kAnchorThreads, 0, stream>>>(copy);
  return cudaGetLastError();
}

cudaError_t LaunchFillKv(void* dst, uint64_t bytes, uint64_t seed, uint64_t first_word,
                         cudaStream_t stream) {
  FillKv<<<kMemBlocks, kMemThreads, 0, stream>>>(static_cast<uint64_t*>(dst), bytes / 8, seed,
                                                 first_word);
  return cudaGetLastError();
}

cudaError_t LaunchCheckKv(const void* buffer, uint64_t rows, uint64_t row_bytes, uint64_t seed,
                          uint64_t first_word, const int64_t* source_rows,
                          unsigned long long* counters, cudaStream_t stream) {
  CheckKv<<<kMemBlocks, kMemThreads, 0, stream>>>(static_cast<const uint64_t*>(buffer), rows,
                                                  row_bytes / 8, seed, first_word, source_rows,
                                                  counters);
  return cudaGetLastError();
}

cudaError_t ComputeGridFor(int gpu, ComputeGrid* grid) {
  int sms = 0;
  cudaError_t e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, gpu);
  if (e != cudaSuccess) return e;
  int per_sm = 0;
  e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, FmaLoop, kComputeThreads, 0);
  if (e != cudaSuccess) return e;
  grid->blocks = sms * (per_sm > 0 ? per_sm : 1);
  grid->threads = kComputeThreads;
  return cudaSuccess;
}

cudaError_t LaunchCompute(const ComputeGrid& grid, uint32_t iterations, float* sink,
                          cudaStream_t stream) {
  FmaLoop<<<grid.blocks, grid.threads, 0, stream>>>(iterations, sink);
  return cudaGetLastError();
}

}  // namespace kvhost::bench
