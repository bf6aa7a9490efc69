// CudaLane: one direction of one GPU in the CUDA engine — its streams, the
// jobs queued on them, and the state its threads share. Each GPU has two
// lanes, [0] backups and [1] loads (full duplex on the link), loads at the
// higher stream priority since a forward pass waits on them.
//
// Jobs of one lane are enqueued in submission order (submit_mu), so they run
// and finish in that order; a completion thread per lane waits on the event
// recorded after each layer (CudaPending::events) and reports it to the
// ticket. The lane's streams:
//   stream         the lane's order: every job's layer events are recorded
//                  here, and every copy joins it;
//   copy_streams   copy-engine streams that a batch of large pieces is split
//                  over (BatchCopier), forked from and joined back to
//                  `stream` with fork / join events;
//   kernel_stream  the staged path's gather / scatter kernels, beside the
//                  copies: chunk i's kernel overlaps chunk i-1's copies, the
//                  half_ready / half_free events handing each half of the
//                  staging buffer between the two.
// No stream waits on a device word (cuStreamWaitValue): with more streams
// than the GPU has work queues (CUDA_DEVICE_MAX_CONNECTIONS), such a wait can
// block the very work that would end it (docs/PERF.md, run S).
//
// Thread safety: the fields say which mutex guards them; streams and events
// are created before the lane's threads start and destroyed after they end.
// Ownership: the engine owns its lanes for its whole life (DestroyLane).
#ifndef KVHOST_SERVER_TRANSFER_CUDA_LANE_H_
#define KVHOST_SERVER_TRANSFER_CUDA_LANE_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/transfer/cuda/engine_options.h"
#include "server/transfer/engine.h"

namespace kvhost {

// A job on a lane, with what the completion thread waits for: one event per
// ticket layer enqueued.
struct CudaPending {
  TransferJob job;
  std::vector<cudaEvent_t> events;
  // Pinned descriptor scratch the job's uploads read; back to the lane's
  // free_scratch once the job is done.
  std::vector<void*> scratch;
  uint64_t layers_enqueued = 0;  // ticket layers
  absl::Status error;            // why enqueueing stopped early, if it did
};

struct CudaLane {
  int gpu = 0;
  Direction direction = Direction::kBackup;
  cudaStream_t stream = nullptr;

  std::vector<cudaStream_t> copy_streams;
  cudaEvent_t fork = nullptr;
  std::vector<cudaEvent_t> join;  // one per copy stream

  cudaStream_t kernel_stream = nullptr;
  cudaEvent_t half_ready[2] = {nullptr, nullptr};
  cudaEvent_t half_free[2] = {nullptr, nullptr};
  cudaEvent_t stage_start = nullptr;
  cudaEvent_t stage_end = nullptr;
  uint8_t* staging = nullptr;  // allocated by the first staged job

  // Held while a job is enqueued: the order in which jobs take it is their
  // order on the stream and in `pending`, so one direction stays FIFO.
  absl::Mutex submit_mu;
  std::vector<void*> dsts ABSL_GUARDED_BY(submit_mu);
  std::vector<void*> srcs ABSL_GUARDED_BY(submit_mu);
  std::vector<size_t> sizes ABSL_GUARDED_BY(submit_mu);

  absl::Mutex mu;
  std::deque<CudaPending> pending ABSL_GUARDED_BY(mu);
  std::vector<cudaEvent_t> free_events ABSL_GUARDED_BY(mu);
  // Pinned host buffers of kScratchBytes for descriptor uploads.
  std::vector<void*> free_scratch ABSL_GUARDED_BY(mu);
  bool busy ABSL_GUARDED_BY(mu) = false;  // the completion thread holds a job
  bool stopping ABSL_GUARDED_BY(mu) = false;
  std::thread completer;
  // Loads waiting for the enqueue thread (those with layer progress), in
  // Submit order.
  std::deque<CudaPending> to_enqueue ABSL_GUARDED_BY(mu);
  bool enqueuing ABSL_GUARDED_BY(mu) = false;
  std::thread enqueuer;
};

// The two lanes of GPU `gpu` with their streams and events (no threads yet).
// INTERNAL when a stream or event cannot be made. REQUIRES: the current
// device is `gpu`.
absl::StatusOr<std::unique_ptr<CudaLane[]>> CreateGpuLanes(int gpu,
                                                           const CudaEngineOptions& options);

// Frees what CreateGpuLanes and the jobs made (streams, events, staging,
// scratch). REQUIRES: the lane's threads have ended.
void DestroyLane(CudaLane* lane);

// Copies `bytes` of descriptors to a device buffer allocated on `stream`
// (freed by the caller with cudaFreeAsync), through the pinned scratch
// that `scratch` keeps until the job has finished.
absl::StatusOr<void*> UploadDescriptors(CudaLane* lane, cudaStream_t stream, const void* data,
                                        size_t bytes, std::vector<void*>* scratch);

// A lane keeps at most this many descriptor scratch buffers between jobs.
inline constexpr size_t kMaxFreeScratch = 8;

}  // namespace kvhost

#endif  // KVHOST_SERVER_TRANSFER_CUDA_LANE_H_
