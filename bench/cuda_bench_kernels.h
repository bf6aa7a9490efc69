// Device code of kvhost_cuda_transfer_bench, the benchmark process that plays
// the GPU worker: a compute-bound FMA kernel (the worst-case worker: its
// slowdown while kvhostd copies is reported next to the GEMM worker's), the
// fill of the GEMM's bf16 operands, the fill and check of the worker's KV
// rows that prove a transfer moved the right bytes before its speed is
// reported, and the in-process anchor: the warp-per-item zero-copy copy
// kernel that an in-process host pool (sglang's kernel io path) runs in the
// worker's own context.
//
// The KV content is a pure function of (seed, word index): word i of a
// buffer filled from `first_word` holds KvWord(seed, first_word + i), 8 random
// bytes none of which is zero. So the check needs no copy of the old rows:
// it recomputes what each row must hold.
//
// Launchers enqueue on `stream` and return the launch's error
// (cudaGetLastError); they change no other device state. Thread-safe.
#ifndef KVHOST_BENCH_CUDA_BENCH_KERNELS_H_
#define KVHOST_BENCH_CUDA_BENCH_KERNELS_H_

#include <cuda_runtime_api.h>

#include <cstdint>

namespace kvhost::bench {

// Fills `bytes` at `dst` (both multiples of 8) with the KV words
// first_word, first_word + 1, ... of `seed`.
cudaError_t LaunchFillKv(void* dst, uint64_t bytes, uint64_t seed, uint64_t first_word,
                         cudaStream_t stream);

// Checks a layer buffer of `rows` rows of `row_bytes` (a multiple of 8) that
// was filled from `first_word`: row r must hold the fill of row
// source_rows[r], or its own fill where source_rows[r] < 0. `source_rows` is
// device memory with `rows` entries. Adds the number of wrong 8-byte words to
// counters[0] and lowers counters[1] to the first wrong row (the caller sets
// them to 0 and UINT64_MAX; device memory).
cudaError_t LaunchCheckKv(const void* buffer, uint64_t rows, uint64_t row_bytes, uint64_t seed,
                          uint64_t first_word, const int64_t* source_rows,
                          unsigned long long* counters, cudaStream_t stream);

// The worker's compute kernel: independent FMA chains in every thread, no
// memory traffic, as many blocks as fit on every SM at once (a worst case for
// sharing the SMs: nothing is left idle for another context's kernel).
struct ComputeGrid {
  int blocks = 0;
  int threads = 0;
};

// The grid that fills every SM of GPU `gpu` (an ordinal).
cudaError_t ComputeGridFor(int gpu, ComputeGrid* grid);

// One launch of `iterations` FMA rounds per thread; its time grows linearly
// with `iterations`. `sink` (one float of device memory) is written only
// under a condition that never holds, so the loop cannot be optimised away.
cudaError_t LaunchCompute(const ComputeGrid& grid, uint32_t iterations, float* sink,
                          cudaStream_t stream);

// `count` bf16 values at `dst`, uniform in [-1, 1) from `seed`: GEMM
// operands with real bits (zeros would let the tensor cores idle on power).
cudaError_t LaunchFillBf16(void* dst, uint64_t count, uint64_t seed, cudaStream_t stream);

// One in-process anchor transfer: every row of `tokens` tokens in every one
// of `buffers` device layer buffers, between device row device_rows[t] of
// buffer b and host row host_slots[t] of the host buffer's plane-layer b, in
// a LAYER_FIRST page-1 host layout (sglang's default host pool: row (b, slot)
// at (b * host_rows + slot) * row_bytes). `device_layers`, `device_rows` and
// `host_slots` are device memory; `host` is pinned host memory mapped into
// the device (cudaHostAllocMapped), written or read in place (zero copy).
struct AnchorCopy {
  void* const* device_layers = nullptr;
  uint8_t* host = nullptr;
  const int64_t* device_rows = nullptr;
  const int64_t* host_slots = nullptr;
  uint64_t tokens = 0;
  uint64_t host_rows = 0;
  uint64_t row_bytes = 0;  // a multiple of 16
  uint32_t buffers = 0;
  bool backup = true;  // device to host; false: host to device
};

// Threads per anchor block: 32 warps, as sglang's kernel io path launches.
constexpr int kAnchorThreads = 1024;

// The anchor copy on `blocks` blocks of kAnchorThreads (the block quota):
// one warp per token item, looping over the buffers, 16-byte vectors.
cudaError_t LaunchAnchorCopy(const AnchorCopy& copy, int blocks, cudaStream_t stream);

}  // namespace kvhost::bench

#endif  // KVHOST_BENCH_CUDA_BENCH_KERNELS_H_
