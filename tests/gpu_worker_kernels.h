// Kernels that the GPU tests launch as the worker would: read or write its
// device KV rows on its own stream, ordered against kvhostd's copies only by
// the interprocess events under test. Launchers return the launch's error
// (cudaGetLastError) and change no device state.
#ifndef KVHOST_TESTS_GPU_WORKER_KERNELS_H_
#define KVHOST_TESTS_GPU_WORKER_KERNELS_H_

#include <cuda_runtime_api.h>

#include <cstdint>

namespace kvhost::testing {

// Copies `bytes` from `src` to `dst` with SM loads and stores (not a copy
// engine), as an attention kernel would read the rows.
cudaError_t LaunchCopyRows(void* dst, const void* src, uint64_t bytes, cudaStream_t stream);

// Busy-waits `cycles` SM clock cycles (clock64) in one thread: keeps the
// stream busy for a known time without touching memory.
cudaError_t LaunchSpin(long long cycles, cudaStream_t stream);

// Busy-waits in one thread until *flag (mapped pinned host memory, as the
// device sees it) is not zero, or `max_cycles` SM clock cycles passed (a
// bound, so that a test that fails before it sets the flag frees the GPU):
// holds everything queued behind it on `stream` until the host says so.
cudaError_t LaunchWaitFlag(const volatile uint32_t* flag, long long max_cycles,
                           cudaStream_t stream);

// Writes PatternByte(seed, i) to dst[i] for i in [0, bytes).
cudaError_t LaunchFillPattern(void* dst, uint64_t bytes, uint32_t seed, cudaStream_t stream);

// The fill pattern, never zero, also computable on the host.
inline uint8_t PatternByte(uint32_t seed, uint64_t i) {
  return static_cast<uint8_t>((i * 131u + seed * 17u) % 251u + 1u);
}

}  // namespace kvhost::testing

#endif  // KVHOST_TESTS_GPU_WORKER_KERNELS_H_
