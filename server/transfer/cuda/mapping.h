// CudaMapping: a worker's device layer buffers opened from CUDA IPC handles
// (each allocation's handle once), the pool's host regions pinned while the
// mapping lives (HostPins), the attachment's ring of interprocess load event
// sets, and the device table of layer bases that the copy kernel reads. A
// pool group's mapping has no buffers of its own: its jobs copy through their
// parts' mappings, which it keeps open, and it holds the group's load events.
//
// Synchronisation with the worker (docs/DESIGN.md): at attach the mapping creates
// load_event_sets x layers interprocess events and exports their handles; a
// load, and a backup with layer progress, takes the next free set
// (AcquireSet; RESOURCE_EXHAUSTED, not a wait, when all are busy) and frees
// it when its last layer has completed. The
// events live as long as the mapping; a worker that still has them open
// keeps its own references.
//
// Thread safety: built by one thread in CudaEngine::Open / OpenGroup, then
// read-only, except the set ring (its own mutex) and PathChanged (atomic).
// Ownership: destroyed before the Pool it pinned (every holder of both
// declares the pool first), and before the engine that owns its lanes.
#ifndef KVHOST_SERVER_TRANSFER_CUDA_MAPPING_H_
#define KVHOST_SERVER_TRANSFER_CUDA_MAPPING_H_

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/transfer/cuda/copy_plan.h"
#include "server/transfer/cuda/host_pins.h"
#include "server/transfer/engine.h"

namespace kvhost {

struct CudaLane;

class CudaMapping : public DeviceMapping {
 public:
  CudaMapping(const Pool& pool, const ResolvedAttach& attach, int gpu, CudaLane* lanes)
      : DeviceMapping(pool, attach),
        gpu_(gpu),
        lanes_(lanes),
        groups_(GroupComponents(pool.components())) {}
  // A pool group's: no buffers of its own (jobs copy through their parts'
  // mappings), `layer_num` model layers of load events, and the entries'
  // mappings kept open as long as this one.
  CudaMapping(std::vector<std::shared_ptr<const DeviceMapping>> entries, uint32_t layer_num,
              int gpu, CudaLane* lanes)
      : DeviceMapping(layer_num, 0, {}), gpu_(gpu), lanes_(lanes), entries_(std::move(entries)) {}

  ~CudaMapping() override;

  // The GPU's two lanes: [0] backups, [1] loads.
  CudaLane* lanes() const { return lanes_; }
  int gpu() const { return gpu_; }

  // Creates `sets` x `layers` interprocess events and exports their handles
  // (DeviceMapping::load_event_handles). REQUIRES: the current device is
  // this mapping's; called once.
  absl::Status CreateLoadEvents(uint32_t sets, uint64_t layers);

  cudaEvent_t load_event(int set, uint64_t layer) const {
    return load_events_[static_cast<uint64_t>(set) * layer_num_ + layer];
  }

  // The next free load event set in round-robin order, held until
  // ReleaseSet. RESOURCE_EXHAUSTED when every set is held: waiting here
  // would block an RPC thread for as long as a load runs, and a worker that
  // issues loads from the thread that would later wait for them could never
  // make progress.
  absl::StatusOr<int> AcquireSet() const;
  // REQUIRES: `set` was acquired and every event of it recorded by that
  // load has completed.
  void ReleaseSet(int set) const {
    absl::MutexLock lock(&ring_mu_);
    set_busy_[static_cast<uint32_t>(set)] = false;
  }

  // Opens (or reuses) `ref`'s allocation and adds its layer buffer of
  // component `component`: a cudaMalloc allocation by its IPC handle, or
  // cuMem allocations (kCudaFd) imported from their lent descriptors and
  // mapped back to back in a range of this process's address space, with
  // read-write access for this GPU (buffers naming the same chunks share
  // it). REQUIRES: the current device is this mapping's; a kCuda
  // ref.ipc_handle has the size of a cudaIpcMemHandle_t; buffers are added
  // component-major.
  absl::Status AddLayer(size_t component, const DeviceBufferRef& ref, const std::string& where);

  // Registers every region of `pool` (none for LOGICAL); a region that
  // fails leaves the ones before it to the destructor.
  absl::Status Pin(const Pool& pool, std::shared_ptr<HostPins> pins);

  // What the kernel paths need: the layer bases in device memory, and
  // whether the GPU can use the pool's host addresses (else the SM copy path is
  // unavailable). REQUIRES: every layer added, the pool pinned, the current
  // device is this mapping's.
  absl::Status PrepareKernels(bool host_pointer_ok);

  // The device table of group `group`'s buffers (plane-major, layer_num()
  // per plane: components are contiguous in the table).
  uint8_t* const* layer_table(const LayoutGroup& group) const {
    return layer_table_ + uint64_t{group.first_component} * layer_num_;
  }
  bool host_pointer_ok() const { return host_pointer_ok_; }
  // Every device layer buffer is 16-byte aligned.
  bool aligned16() const { return aligned16_; }
  // The pool's components as kernel launch groups.
  const std::vector<LayoutGroup>& groups() const { return groups_; }

  // The path of this attachment's last job per direction, so that the log
  // says when the choice changes rather than once per job.
  bool PathChanged(Direction direction, uint8_t path) const {
    return last_path_[static_cast<int>(direction)].exchange(path) != path;
  }

 private:
  struct Allocation {
    uint8_t* ptr;
    uint64_t bytes;
  };
  // A range of our address space holding imported cuMem chunks: unmapped
  // chunk by chunk (the `mapped` ones) and freed in the destructor.
  struct ImportedRange {
    uint64_t base;  // CUdeviceptr
    uint64_t bytes;
    std::vector<std::pair<uint64_t, uint64_t>> mapped;  // (address, bytes)
  };
  // Adds the layer buffer at `offset` of `allocation`, checked to hold the
  // component's rows.
  absl::Status AddBuffer(size_t component, const Allocation& allocation, uint64_t offset,
                         const std::string& where);
  // `ref`'s chunks imported and mapped (kCudaFd), as AddLayer says.
  absl::StatusOr<Allocation> Import(const DeviceBufferRef& ref, const std::string& where);

  const int gpu_;
  CudaLane* const lanes_;  // owned by the engine, which outlives us
  const std::vector<LayoutGroup> groups_;
  // A group's entries (empty for a plain attachment's mapping).
  const std::vector<std::shared_ptr<const DeviceMapping>> entries_;
  std::map<std::string, Allocation> opened_;              // by handle bytes
  std::map<std::string, Allocation> imported_by_chunks_;  // by the chunks' names
  std::vector<ImportedRange> imported_;
  std::shared_ptr<HostPins> pins_;
  std::vector<uint8_t*> pinned_;          // region bases
  std::vector<cudaEvent_t> load_events_;  // set-major, as load_event_handles_
  uint8_t** layer_table_ = nullptr;       // device copy of layers_
  bool host_pointer_ok_ = false;
  bool aligned16_ = false;
  mutable std::atomic<uint8_t> last_path_[2] = {255, 255};

  // The ring of load event sets. Mutable: jobs see the mapping as const, and
  // taking a set changes no buffer.
  mutable absl::Mutex ring_mu_;
  mutable std::vector<bool> set_busy_ ABSL_GUARDED_BY(ring_mu_);
  mutable uint32_t next_set_ ABSL_GUARDED_BY(ring_mu_) = 0;
};

}  // namespace kvhost

#endif  // KVHOST_SERVER_TRANSFER_CUDA_MAPPING_H_
