#include "server/transfer/cuda/host_pins.h"

#include <cuda_runtime_api.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/cuda_util.h"
#include "spdlog/spdlog.h"

namespace kvhost {

HostPins::HostPins(uint64_t chunk) : chunk_(std::max<uint64_t>(chunk, 4096)) {}

absl::Status HostPins::Acquire(uint8_t* base, uint64_t bytes, const std::string& pool) {
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(base);
  if (it != entries_.end()) {
    ++it->second.users;
    return absl::OkStatus();
  }
  const absl::Time start = absl::Now();
  size_t chunks = 0;
  for (uint64_t off = 0; off < bytes; off += chunk_, ++chunks) {
    const uint64_t n = std::min(chunk_, bytes - off);
    const cudaError_t e =
        cudaHostRegister(base + off, n, cudaHostRegisterPortable | cudaHostRegisterMapped);
    if (e != cudaSuccess) {
      cudaGetLastError();
      Unregister(base, chunks);
      const std::string message =
          absl::StrCat("pinning pool '", pool, "' for the GPU failed at bytes [", off, ", ",
                       off + n, ") of ", bytes, ": cudaHostRegister: ", CudaError(e));
      return e == cudaErrorMemoryAllocation ? absl::ResourceExhaustedError(message)
                                            : absl::InternalError(message);
    }
  }
  entries_.emplace(base, Entry{bytes, chunks, 1});
  spdlog::info("pinned pool '{}' for CUDA: {} bytes in {} chunk(s), {} ms", pool, bytes, chunks,
               absl::ToInt64Milliseconds(absl::Now() - start));
  return absl::OkStatus();
}

void HostPins::Release(uint8_t* base) {
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(base);
  if (it == entries_.end() || --it->second.users > 0) return;
  Unregister(base, it->second.chunks);
  spdlog::debug("unpinned {} bytes at {}", it->second.bytes, static_cast<void*>(base));
  entries_.erase(it);
}

void HostPins::Unregister(uint8_t* base, size_t chunks) {
  for (size_t c = 0; c < chunks; ++c) {
    if (cudaError_t e = cudaHostUnregister(base + c * chunk_); e != cudaSuccess) {
      cudaGetLastError();
      spdlog::error("cudaHostUnregister at {}: {}", static_cast<void*>(base + c * chunk_),
                    CudaError(e));
    }
  }
}

}  // namespace kvhost
