#include "server/transfer/cuda/lane.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/cuda_util.h"
#include "spdlog/spdlog.h"

namespace kvhost {
namespace {

// Descriptor uploads go through pinned buffers of this size (a job's
// descriptors are a few hundred KiB; larger uploads take several).
constexpr size_t kScratchBytes = size_t{4} << 20;

absl::Status Failed(int gpu, const char* what, cudaError_t e) {
  cudaGetLastError();
  return absl::InternalError(absl::StrCat("GPU ", gpu, ": ", what, ": ", CudaError(e)));
}

}  // namespace

absl::StatusOr<std::unique_ptr<CudaLane[]>> CreateGpuLanes(int gpu,
                                                           const CudaEngineOptions& options) {
  // Numerically lower is higher priority: loads get `greatest`, since a
  // forward pass waits on them, backups `least`.
  int least = 0;
  int greatest = 0;
  if (cudaError_t e = cudaDeviceGetStreamPriorityRange(&least, &greatest); e != cudaSuccess) {
    return Failed(gpu, "cudaDeviceGetStreamPriorityRange", e);
  }
  // On error, the streams and events made so far are simply dropped with
  // the process's context: this GPU is unusable anyway.
  auto lanes = std::make_unique<CudaLane[]>(2);
  const size_t copy_streams = static_cast<size_t>(std::max(options.copy_streams, 1));
  for (int i = 0; i < 2; ++i) {
    CudaLane& lane = lanes[i];
    lane.gpu = gpu;
    lane.direction = i == 0 ? Direction::kBackup : Direction::kLoad;
    const int priority = lane.direction == Direction::kLoad ? greatest : least;
    cudaError_t e = cudaStreamCreateWithPriority(&lane.stream, cudaStreamNonBlocking, priority);
    if (e == cudaSuccess) {
      e = cudaStreamCreateWithPriority(&lane.kernel_stream, cudaStreamNonBlocking, priority);
    }
    for (cudaEvent_t* event :
         {&lane.half_ready[0], &lane.half_ready[1], &lane.half_free[0], &lane.half_free[1],
          &lane.stage_start, &lane.stage_end, &lane.fork}) {
      if (e == cudaSuccess) e = cudaEventCreateWithFlags(event, cudaEventDisableTiming);
    }
    if (copy_streams > 1) {
      lane.copy_streams.assign(copy_streams, nullptr);
      lane.join.assign(copy_streams, nullptr);
      for (size_t k = 0; k < copy_streams && e == cudaSuccess; ++k) {
        e = cudaStreamCreateWithPriority(&lane.copy_streams[k], cudaStreamNonBlocking, priority);
        if (e == cudaSuccess) e = cudaEventCreateWithFlags(&lane.join[k], cudaEventDisableTiming);
      }
    }
    if (e != cudaSuccess) return Failed(gpu, "creating the lanes' streams and events", e);
  }
  // Descriptor buffers come from the stream-ordered allocator; keep what a
  // few jobs use instead of returning it to the driver at every sync.
  cudaMemPool_t mem_pool = nullptr;
  if (cudaDeviceGetDefaultMemPool(&mem_pool, gpu) == cudaSuccess) {
    uint64_t keep = uint64_t{64} << 20;
    cudaMemPoolSetAttribute(mem_pool, cudaMemPoolAttrReleaseThreshold, &keep);
  }
  cudaGetLastError();
  spdlog::info(
      "GPU {}: backup and load streams up, load priority {} over {}, {} copy stream(s) per "
      "direction",
      gpu, greatest, least, copy_streams);
  return lanes;
}

void DestroyLane(CudaLane* lane) {
  cudaSetDevice(lane->gpu);
  absl::MutexLock lock(&lane->mu);
  for (cudaEvent_t event : lane->free_events) cudaEventDestroy(event);
  for (void* scratch : lane->free_scratch) cudaFreeHost(scratch);
  for (cudaEvent_t event : {lane->half_ready[0], lane->half_ready[1], lane->half_free[0],
                            lane->half_free[1], lane->stage_start, lane->stage_end, lane->fork}) {
    if (event != nullptr) cudaEventDestroy(event);
  }
  for (cudaEvent_t event : lane->join) {
    if (event != nullptr) cudaEventDestroy(event);
  }
  for (cudaStream_t stream : lane->copy_streams) {
    if (stream != nullptr) cudaStreamDestroy(stream);
  }
  if (lane->staging != nullptr) cudaFree(lane->staging);
  if (lane->kernel_stream != nullptr) cudaStreamDestroy(lane->kernel_stream);
  if (lane->stream != nullptr) cudaStreamDestroy(lane->stream);
}

absl::StatusOr<void*> UploadDescriptors(CudaLane* lane, cudaStream_t stream, const void* data,
                                        size_t bytes, std::vector<void*>* scratch) {
  void* device = nullptr;
  if (cudaError_t e = cudaMallocAsync(&device, bytes, stream); e != cudaSuccess) {
    cudaGetLastError();
    return absl::ResourceExhaustedError(
        absl::StrCat("GPU ", lane->gpu, ": ", bytes, " bytes of copy descriptors: ", CudaError(e)));
  }
  for (size_t off = 0; off < bytes; off += kScratchBytes) {
    const size_t n = std::min(kScratchBytes, bytes - off);
    void* buffer = nullptr;
    {
      absl::MutexLock lock(&lane->mu);
      if (!lane->free_scratch.empty()) {
        buffer = lane->free_scratch.back();
        lane->free_scratch.pop_back();
      }
    }
    if (buffer == nullptr) {
      if (cudaError_t e = cudaHostAlloc(&buffer, kScratchBytes, cudaHostAllocDefault);
          e != cudaSuccess) {
        cudaGetLastError();
        cudaFreeAsync(device, stream);
        return absl::ResourceExhaustedError(
            absl::StrCat("pinned descriptor scratch: cudaHostAlloc: ", CudaError(e)));
      }
    }
    scratch->push_back(buffer);
    std::memcpy(buffer, static_cast<const uint8_t*>(data) + off, n);
    if (cudaError_t e = cudaMemcpyAsync(static_cast<uint8_t*>(device) + off, buffer, n,
                                        cudaMemcpyHostToDevice, stream);
        e != cudaSuccess) {
      cudaGetLastError();
      cudaFreeAsync(device, stream);
      return absl::InternalError(absl::StrCat("uploading copy descriptors: ", CudaError(e)));
    }
  }
  return device;
}

}  // namespace kvhost
