// CudaEngine: the transfer engine of the cuda backend. A worker's device
// layer buffers arrive as CUDA IPC handles (one per allocation, opened once
// per attachment), the host pools are registered with CUDA, and backups and
// loads run on the GPU's copy engines ("cuda-ce"): per layer and K / V plane,
// the pieces that the layout math yields (ForEachPiece) are merged where they
// are contiguous on both sides and submitted as one cudaMemcpyBatchAsync.
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
//
// Thread safety: as TransferEngine. Mappings returned by Open must be
// destroyed before the engine (TransferManager's member order does that), and
// a mapping must be destroyed before the Pool it was opened for is (each
// holder of both, the attachment and the job, declares the pool first).
#ifndef KVHOST_SERVER_TRANSFER_CUDA_ENGINE_H_
#define KVHOST_SERVER_TRANSFER_CUDA_ENGINE_H_

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

struct CudaEngineOptions {
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
                                                      const AttachRequest& request) override;
  // Loads take the attachment's next free load event set (RESOURCE_EXHAUSTED
  // when all are busy); a backup's wait_event_handle is opened here
  // (INVALID_ARGUMENT for a wrong size or a handle that will not open).
  absl::Status Prepare(TransferJob* job) override;
  void Submit(TransferJob job) override;
  void Drain() override;

  // "1 GPU(s): 0 NVIDIA H200 GPU-xxxxxxxx-...", for the log and status.
  std::string Describe() const;

 private:
  struct Device {
    int ordinal = 0;
    std::string uuid;  // "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", lower case
    std::string name;
  };
  class HostPins;  // pool memory registered with CUDA, by base pointer
  struct Lane;     // one stream and its completion thread
  class Mapping;   // a worker's buffers opened from IPC handles

  CudaEngine(CudaEngineOptions options, std::vector<Device> devices);
  // The two lanes of GPU `ordinal`, created on first use (a CUDA context and
  // two streams on that GPU, and their completion threads).
  absl::StatusOr<Lane*> LanesFor(int ordinal);
  // Enqueues one layer of `job` (both planes) on the lane's stream.
  absl::Status EnqueueLayer(Lane* lane, const TransferJob& job, uint64_t layer);
  // The completion thread of `lane`.
  void CompleteLoop(Lane* lane);

  const CudaEngineOptions options_;
  const std::vector<Device> devices_;
  const std::shared_ptr<HostPins> pins_;

  // Whether cudaMemcpyBatchAsync works here, and the flags it accepts;
  // cleared for good on the first refusal (an older driver).
  std::atomic<bool> batch_ok_{true};
  std::atomic<unsigned> batch_flags_{1};  // cudaMemcpyFlagPreferOverlapWithCompute

  absl::Mutex lanes_mu_;
  // Per device: [0] backups, [1] loads; empty until the first attach there.
  std::vector<std::unique_ptr<Lane[]>> lanes_ ABSL_GUARDED_BY(lanes_mu_);
};

}  // namespace kvhost

#endif  // KVHOST_SERVER_TRANSFER_CUDA_ENGINE_H_
