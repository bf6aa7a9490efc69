// CudaEngine: the transfer engine of the cuda backend. A worker's device
// layer buffers arrive as CUDA IPC handles (one per allocation, opened once
// per attachment: CudaMapping), the host pools are registered with CUDA
// (HostPins), and each job takes one of three copy paths (cuda/paths.h),
// chosen by Prepare through the path policy (cuda/path_policy.h) and
// planned there (cuda/job_plan.h). Its rooms, under cuda/:
//   gpus          the GPUs and MPS, probed at start;
//   host_pins     pool memory pinned for CUDA;
//   mapping       a worker's buffers, load events and layer table;
//   lane          one direction of one GPU: streams, queues, threads' state;
//   batch_copies  copy-engine copies, split over a lane's copy streams;
//   path_policy   which path, and why (a pure function);
//   copy_plan     a job's runs as copy-engine pieces or copy-kernel tiles
//                 (CPU code, replayed by tests/copy_plan_test.cc);
//   job_plan      the chosen path's plan of a job;
//   paths         the three paths' enqueueing.
// This file keeps what ties them together: attach (Open, OpenGroup), the
// lanes of each GPU and their threads, Prepare / Submit, and completion.
//
// A ticket has one layer per attached device layer; a layer the pool does
// not hold (layer sharding) copies nothing but still records its events.
// A pool group's attachment (OpenGroup) has the load events, one per model
// layer, and its jobs one part per pool: each path loops over the parts,
// each part copying through its own entry's mapping.
//
// Enqueueing happens on the caller's thread in Submit (so a Load RPC returns
// once its copies are on the stream, which the worker-side per-layer events
// rely on), except for a load of an attachment with layer progress
// (AttachDeviceRequest.layer_progress): its worker waits on the layer
// counters (LayerCounters) before each layer's event, so Submit hands it to
// the lane's enqueue thread and returns, and the thread publishes each layer
// right after recording its load event. A backup of such an attachment takes
// an event set as a load does, and Submit records and publishes it per layer
// on the backup stream the same way (its worker waits for the last layer,
// so nothing is gained by another thread): the worker's stream waits on the
// last layer's event and so learns the backup finished without a host wait
// for the copy (sglang's ack). A staged load of such an attachment
// is planned in layer intervals growing from one layer (job_plan.h), so that
// its first layer lands after a small chunk. A completion thread per lane
// waits on the event recorded after each layer and reports it to the ticket.
// A transfer records load event [set][layer] (CudaMapping) after each
// layer's copies, on its lane's stream: never ahead of them behind a GPU-side gate
// (cuStreamWaitValue), which the removed --load-gates mode did and which
// could deadlock the GPU's work queues (docs/PERF.md, run S).
// A backup may name an event the worker recorded after writing the rows:
// Prepare opens it, the backup stream waits on it before the first copy, and
// it is closed when the job goes, after the ticket finished.
//
// Thread safety: as TransferEngine. Mappings returned by Open must be
// destroyed before the engine (TransferManager's member order does that), and
// a mapping must be destroyed before the Pool it was opened for is (each
// holder of both, the attachment and the job, declares the pool first).
#ifndef KVHOST_SERVER_TRANSFER_CUDA_ENGINE_H_
#define KVHOST_SERVER_TRANSFER_CUDA_ENGINE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/transfer/cuda/batch_copies.h"
#include "server/transfer/cuda/engine_options.h"
#include "server/transfer/cuda/gpus.h"
#include "server/transfer/cuda/host_pins.h"
#include "server/transfer/cuda/job_plan.h"
#include "server/transfer/cuda/lane.h"
#include "server/transfer/cuda/path_policy.h"
#include "server/transfer/engine.h"

namespace kvhost {

class CudaMapping;

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
  // Loads, and backups with layer progress, take the attachment's next free
  // load event set (RESOURCE_EXHAUSTED when all are busy) and record and
  // publish its events per layer alike; a job's wait_event_handle (a
  // backup's or a load's) is opened here (INVALID_ARGUMENT for a wrong size
  // or a handle that will not open).
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
  CudaEngine(CudaEngineOptions options, std::vector<GpuInfo> gpus);
  // The two lanes of GPU `gpu` (an ordinal), created on first use (a CUDA
  // context and the lanes' streams on that GPU, and their threads).
  absl::StatusOr<CudaLane*> LanesFor(int gpu);
  // Opens a job's wait_event_handle (REQUIRES: of the right size) into
  // job->wait_event, on `mapping`'s GPU. INVALID_ARGUMENT for a handle that
  // will not open.
  absl::Status OpenWaitEvent(const CudaMapping& mapping, TransferJob* job);
  // The GPU ordinal of every buffer of `attach` (all on one), checking
  // everything that needs no CUDA call.
  absl::StatusOr<int> AttachGpu(const ResolvedAttach& attach) const;
  // What PlanJob needs of the engine for `job`.
  JobPlanInputs PlanInputs(const TransferJob& job) const;
  // The completion thread of `lane`.
  void CompleteLoop(CudaLane* lane);
  // The enqueue thread of a load lane: queues, in Submit order, the work of
  // the loads that return before it is queued (those with layer progress).
  void EnqueueLoop(CudaLane* lane);
  // Queues `pending`'s work on the lane's streams (the worker's event, the
  // path's copies or kernels, and per layer the load event and the
  // completion event); on failure sets pending->error. REQUIRES: the lane's
  // submit_mu held.
  void EnqueueWork(CudaLane* lane, CudaPending* pending);

  const CudaEngineOptions options_;
  const std::vector<GpuInfo> gpus_;
  // Whether an MPS control daemon serves this process (its pipe exists), and
  // where; the SM copy path is chosen automatically only then.
  bool mps_ = false;  // set once by the constructor
  std::string mps_detail_;
  const std::shared_ptr<HostPins> pins_;
  mutable BatchCopier copier_;

  absl::Mutex lanes_mu_;
  // Per GPU: [0] backups, [1] loads; empty until the first attach there.
  std::vector<std::unique_ptr<CudaLane[]>> lanes_ ABSL_GUARDED_BY(lanes_mu_);
};

}  // namespace kvhost

#endif  // KVHOST_SERVER_TRANSFER_CUDA_ENGINE_H_
