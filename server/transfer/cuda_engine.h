// CudaEngine: the transfer engine of the cuda backend. A worker's device
// layer buffers arrive as CUDA IPC handles (one per allocation, opened once
// per attachment), the host pools are registered with CUDA, and each job
// takes one of three paths (CudaPath), chosen by Prepare:
//   cuda-ce      per layer and component, the pieces that the layout math
//                yields (ForEachPiece; page runs for page-row components) are
//                merged where they are contiguous on both sides and
//                submitted as one cudaMemcpyBatchAsync per layer;
//   cuda-staged  the job's complete pool blocks (copy_plan.h) go through a
//                device staging buffer in two halves: a gather kernel fills
//                half b while the copy engines drain half 1-b to the pool
//                (backup), or the copy engines fill it while a scatter kernel
//                empties the other (load); a second stream per lane runs the
//                kernels;
//   cuda-sm      one copy kernel per layer and launch group (copy_plan.h:
//                one for MHA's K and V) through mapped host memory, its grid
//                bounded by sm_blocks.
// Every pool kind is served through its components (Pool::components());
// all the per-component, page-run and layer-range planning is in copy_plan.h.
// A ticket has one layer per attached device layer; a layer the pool does
// not hold (layer sharding) copies nothing but still records its events.
// A pool group's attachment (OpenGroup) has the load events, one per model
// layer, and its jobs one part per pool: each path loops over the parts
// (per layer for ce and sm, one staged plan per part and interval of its
// held layers), each part copying through its own entry's mapping.
// auto takes the copy engines when their pieces are large, else the SM copy path
// under MPS, else the staged path where its blocks are larger than the
// pieces, else the copy engines (never a kernel that time-slices against the
// worker for no gain).
//
// Each GPU has two lanes: a backup stream and a load stream (full duplex on
// the link), loads at the higher priority since a forward pass waits on them.
// Jobs of one lane are enqueued in submission order on its stream, so they
// run and finish in that order. Enqueueing happens on the caller's thread in
// Submit (so a Load RPC returns once its copies are on the stream, which the
// worker-side per-layer events rely on); a completion thread per lane
// waits on the event recorded after each layer and reports it to the ticket.
//
// Synchronisation with the worker (DESIGN.md) uses interprocess events. At
// attach, the mapping creates a ring of load event sets (load_event_sets x
// layers, cudaEventInterprocess) on the attachment's GPU and exports their
// handles; a load takes the next free set (Prepare; RESOURCE_EXHAUSTED, not a
// wait, when all are busy), records event [set][layer] on the load stream
// after each layer's copies, and frees the set when its last layer has
// completed, just before its ticket finishes. The events live as long as the
// mapping. A backup may name an event the worker recorded after writing the
// rows: Prepare opens it, the backup stream waits on it before the first
// copy, and it is closed when the job goes, after the ticket finished.
// With gate_loads, a load's events are instead recorded up front on a gate
// stream, each behind a wait for a device word that the load stream sets
// after the layer's copies, and an enqueue thread queues the copies, so
// the Load call returns before them (see CudaEngineOptions::gate_loads for
// what that costs the worker).
//
// Thread safety: as TransferEngine. Mappings returned by Open must be
// destroyed before the engine (TransferManager's member order does that), and
// a mapping must be destroyed before the Pool it was opened for is (each
// holder of both, the attachment and the job, declares the pool first).
#ifndef KVHOST_SERVER_TRANSFER_CUDA_ENGINE_H_
#define KVHOST_SERVER_TRANSFER_CUDA_ENGINE_H_

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/transfer/engine.h"

namespace kvhost {

// How a job's bytes move (DESIGN.md, "Transfer engines"):
//   kCopyEngine  cudaMemcpyBatchAsync of the layout-contiguous pieces; costs
//                the worker nothing, fast only for large pieces;
//   kStaged      through a device staging buffer: a device-to-device gather
//                (backup) or scatter (load) kernel next to large copy-engine
//                copies of whole pool blocks, double-buffered; a short kernel
//                from our context per chunk, so a small cost to the worker;
//   kSm          one kernel per layer copying through mapped host memory,
//                its grid bounded by sm_blocks; fastest for small pieces, but
//                without MPS it time-slices against the worker's kernels.
// kAuto picks per job (CudaEngine::Prepare).
enum class CudaPath : uint8_t { kAuto, kCopyEngine, kStaged, kSm };

// "auto", "ce", "staged", "sm" (the --transfer-path values).
absl::StatusOr<CudaPath> ParseCudaPath(const std::string& name);
// The ticket status names: "cuda-ce", "cuda-staged", "cuda-sm" ("auto" for kAuto).
const char* CudaPathName(CudaPath path);

struct CudaEngineOptions {
  // --transfer-path: every job's path, or kAuto to choose per job.
  CudaPath path = CudaPath::kAuto;
  // Device staging buffer per stream (two per GPU), split in two halves so
  // that one fills while the other drains; allocated on first use. Every
  // gather / scatter kernel from our context costs the worker a time-slice
  // switch (about 0.5 ms on the H200 without MPS, docs/PERF.md), so fewer,
  // larger chunks cost it less: a 512 MiB MHA job took +14 % of the
  // worker's time in 128 MiB chunks and +4.4 % in one 512 MiB chunk, at
  // 0.76 and 0.66 of the ceiling (PAGE_FIRST, page size 1).
  uint64_t staging_bytes = uint64_t{1} << 30;
  // Most blocks of an SM copy kernel (the seeds' block_quota); the SMs left
  // over stay with the worker.
  int sm_blocks = 16;
  // Most blocks of a staged gather / scatter kernel; 0 = 4 per SM, so that
  // the kernel is as short as possible.
  int staged_blocks = 0;
  // Loads return from Submit once their per-layer events are recorded behind
  // gates (stream memory operations), and a thread queues the copies: the
  // Load call took 0.57 ms instead of 3.5-5 ms for 32 layers of 64 random
  // pages on the H200, but a stream of ours blocked in a wait makes the
  // GPU time-slice against the worker: its kernels took +18-26 % longer
  // during copy-engine loads that cost it nothing ungated (docs/PERF.md).
  // Off by default: the worker's time comes first.
  bool gate_loads = false;
  // auto: the copy engines take a job whose layout-contiguous pieces average
  // at least this many bytes. On the H200 (docs/PERF.md, 2026-11-30) they
  // moved 64 KiB pieces at 0.93-0.96 of the ceiling, 32 KiB at 0.66-0.90
  // and 18 KiB at 0.30-0.49, at no cost to the worker, while the staged
  // path reached 0.82-0.94 at +4-32 % of the worker's time: where the copy
  // engines are merely slower, they win; below this, where they are hopeless
  // (2 KiB rows: 0.02-0.05), the staged or SM copy path is worth its cost.
  uint64_t ce_min_piece_bytes = uint64_t{16} << 10;

  // Largest host range pinned by one cudaHostRegister call: registering
  // hundreds of GiB at once is slow and runs into driver limits, so a pool is
  // registered in chunks (sglang's allocator does the same). Copies never
  // straddle a chunk boundary, since a range spanning two registrations is not
  // guaranteed to be treated as pinned.
  uint64_t host_register_chunk = uint64_t{1} << 30;
  // Most copies per cudaMemcpyBatchAsync call; bounds the scratch arrays of a
  // layer with very many pieces (PAGE_HEAD at page size 1).
  size_t max_batch = 8192;
};

class CudaEngine : public TransferEngine {
 public:
  // Enumerates the GPUs this process can use (no CUDA context is created
  // until a buffer on a GPU is attached). FAILED_PRECONDITION when there is
  // none or the CUDA runtime fails.
  static absl::StatusOr<std::unique_ptr<CudaEngine>> Create(CudaEngineOptions options = {});
  ~CudaEngine() override;

  const char* name() const override { return "cuda"; }
  std::string PathFor(const TransferJob& job) const override;
  // Errors: FAILED_PRECONDITION for a shared-memory buffer; INVALID_ARGUMENT
  // for a malformed or unknown GPU UUID, a handle of the wrong size or one
  // that cannot be opened, layers on different GPUs, or a layer that does not
  // fit in its allocation; RESOURCE_EXHAUSTED / INTERNAL when pinning the host
  // pool fails. On error nothing stays open.
  absl::StatusOr<std::unique_ptr<DeviceMapping>> Open(const Pool& pool,
                                                      const ResolvedAttach& attach) override;
  // Loads take the attachment's next free load event set (RESOURCE_EXHAUSTED
  // when all are busy); a backup's wait_event_handle is opened here
  // (INVALID_ARGUMENT for a wrong size or a handle that will not open).
  // A pool group's job (several parts) takes one path, chosen from every
  // part's runs, and per ticket (model) layer copies every part's rows of
  // that layer before the layer's events; staged, every part's chunks run
  // and then every layer's events are recorded.
  absl::Status Prepare(TransferJob* job) override;
  void Submit(TransferJob job) override;
  // The group mapping's load events are made on the entries' GPU, like a
  // plain mapping's (none when no entry has buffers: all LOGICAL).
  // INVALID_ARGUMENT when the entries are on different GPUs (naming each
  // entry's) or there are none.
  absl::StatusOr<std::unique_ptr<DeviceMapping>> OpenGroup(
      std::vector<std::shared_ptr<const DeviceMapping>> entries, uint32_t layer_num,
      uint32_t load_event_sets) override;
  void Drain() override;

  // "1 GPU(s): 0 NVIDIA H200 GPU-xxxxxxxx-...", for the log and status.
  std::string Describe() const;

 private:
  // A GPU this process can use, as probed by Create.
  struct GpuInfo {
    int ordinal = 0;
    std::string uuid;  // "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", lower case
    std::string name;
    int sms = 0;
    // The SM copy path reads the pool through its host address
    // (cudaDevAttrCanUseHostPointerForRegisteredMem).
    bool host_pointer_ok = false;
  };
  class HostPins;  // pool memory registered with CUDA, by base pointer
  struct Pending;  // a job on a lane, with its events
  struct Lane;     // one stream and its completion thread
  class Mapping;   // a worker's buffers opened from IPC handles

  CudaEngine(CudaEngineOptions options, std::vector<GpuInfo> gpus);
  // The two lanes of GPU `gpu` (an ordinal), created on first use (a CUDA context and
  // two streams on that GPU, and their completion threads).
  absl::StatusOr<Lane*> LanesFor(int gpu);
  // The path of `job`, and why (auto), from its runs and layout. Fills
  // job->plan for the kernel paths.
  absl::Status ChoosePath(TransferJob* job, std::string* why) const;
  // Enqueues ticket layer `ticket_layer` of `job` (every part and
  // component, in one batch; nothing for a part that does not copy the
  // layer) on the lane's stream by the copy engines.
  absl::Status EnqueueCopyEngineLayer(Lane* lane, const TransferJob& job, size_t ticket_layer);
  // Submits copies dsts[i] <- srcs[i] of sizes[i] bytes on `stream`, batched.
  absl::Status SubmitCopies(Lane* lane, cudaStream_t stream, size_t n, const std::string& what);
  // The SM copy path: descriptors up, then per ticket layer and part one kernel
  // per launch group where the part copies the layer, followed by
  // `layer_done(layer)`.
  template <typename LayerDone>
  absl::Status EnqueueSmCopy(Lane* lane, const TransferJob& job, std::vector<void*>* scratch,
                             LayerDone&& layer_done);
  // The staged path: every chunk of the job's plan (every part's ranges).
  absl::Status EnqueueStaged(Lane* lane, const TransferJob& job, std::vector<void*>* scratch);
  // Copies `bytes` of descriptors to a device buffer allocated on `stream`
  // (freed by the caller with cudaFreeAsync), through the pinned scratch
  // that `scratch` keeps until the job has finished.
  absl::StatusOr<void*> UploadDescriptors(Lane* lane, cudaStream_t stream, const void* data,
                                          size_t bytes, std::vector<void*>* scratch);
  // The completion thread of `lane`.
  void CompleteLoop(Lane* lane);
  // The enqueue thread of a load lane with a gate stream: queues the work
  // of gated loads in Submit order.
  void EnqueueLoop(Lane* lane);
  // Queues `pending`'s work on the lane's streams (the worker's event, the
  // path's copies or kernels, and per layer the gate or load event and the
  // completion event); on failure sets pending->error. REQUIRES: the lane's
  // submit_mu held.
  void EnqueueWork(Lane* lane, Pending* pending);
  // Records every load event of a gated load behind its gate on the lane's
  // gate stream. REQUIRES: the lane's gate_mu held.
  absl::Status OpenGates(Lane* lane, Pending* pending);

  const CudaEngineOptions options_;
  const std::vector<GpuInfo> gpus_;
  // Whether an MPS control daemon serves this process (its pipe exists), and
  // where; the SM copy path is chosen automatically only then.
  bool mps_ = false;  // set once by the constructor
  std::string mps_detail_;
  const std::shared_ptr<HostPins> pins_;

  // Whether cudaMemcpyBatchAsync works here, and the flags it accepts;
  // cleared for good on the first refusal (an older driver).
  std::atomic<bool> batch_ok_{true};
  std::atomic<unsigned> batch_flags_{1};  // cudaMemcpyFlagPreferOverlapWithCompute

  absl::Mutex lanes_mu_;
  // Per GPU: [0] backups, [1] loads; empty until the first attach there.
  std::vector<std::unique_ptr<Lane[]>> lanes_ ABSL_GUARDED_BY(lanes_mu_);
};

}  // namespace kvhost

#endif  // KVHOST_SERVER_TRANSFER_CUDA_ENGINE_H_
