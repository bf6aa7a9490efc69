// The CUDA engine's implementation (contract: cuda_engine.h).
//
// Size exception: this file and its three functions over 100 lines
// (LanesFor, ChoosePath, EnqueueStaged) are split by concern (mappings,
// lanes, plans, the three copy paths) in the rewrite of the CUDA engine for
// transfers at link speed, which replaces most of them; splitting them here
// first would move code that is about to be rewritten.
#include "server/transfer/cuda_engine.h"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>
#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <thread>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/cuda_util.h"
#include "copy_kernel.h"
#include "server/transfer/copy_plan.h"
#include "spdlog/spdlog.h"

namespace kvhost {
namespace {

bool LooksLikeUuid(const std::string& s) {
  if (s.size() != 40 || s.compare(0, 4, "GPU-") != 0) return false;
  for (size_t i = 4; i < s.size(); ++i) {
    const bool dash = i == 12 || i == 17 || i == 22 || i == 27;
    if (dash ? s[i] != '-' : !absl::ascii_isxdigit(static_cast<unsigned char>(s[i]))) return false;
  }
  return true;
}

// MPS serves a CUDA process when the control daemon's pipe exists where the
// client library looks for it.
bool MpsActive(std::string* detail) {
  const char* env = std::getenv("CUDA_MPS_PIPE_DIRECTORY");
  const std::string dir = env != nullptr && *env != '\0' ? env : "/tmp/nvidia-mps";
  struct stat st;
  const bool active = ::stat((dir + "/control").c_str(), &st) == 0;
  *detail = absl::StrCat("MPS ", active ? "active" : "not active", " (", dir, "/control ",
                         active ? "present" : "absent", ")");
  return active;
}

// The staged path's chunk: half the staging buffer, 256-byte aligned so
// that both halves keep the alignment of the allocation.
uint64_t StagingChunk(uint64_t staging_bytes) { return (staging_bytes / 2) & ~uint64_t{255}; }

// Descriptor uploads go through pinned buffers of this size (a job's
// descriptors are a few hundred KiB; larger uploads take several), and a
// lane keeps at most kMaxFreeScratch of them between jobs.
constexpr size_t kScratchBytes = size_t{4} << 20;
constexpr size_t kMaxFreeScratch = 8;

std::string Bytes(uint64_t n) {
  if (n >= (uint64_t{1} << 20)) return absl::StrCat(n >> 20, " MiB");
  if (n >= (uint64_t{1} << 10)) return absl::StrCat(n >> 10, " KiB");
  return absl::StrCat(n, " B");
}

// The SM copy path's plan of a job: one SmCopyPlan per job part, in order.
struct JobSmCopyPlan {
  std::vector<SmCopyPlan> parts;
};

// The staged path's plan of one job part over one interval of its held host
// layers (HeldLayerRanges; a plain attachment's job has one).
struct StagedRange {
  size_t part = 0;
  int64_t delta = 0;  // device layer - host layer
  StagedPlan plan;
};

// The staged path's plan of a job: its ranges run one after the other, and
// every ticket layer is complete after the last.
struct JobStagedPlan {
  std::vector<StagedRange> ranges;

  size_t chunks() const {
    size_t n = 0;
    for (const StagedRange& range : ranges) n += range.plan.chunks.size();
    return n;
  }
  size_t copies() const {
    size_t n = 0;
    for (const StagedRange& range : ranges) n += range.plan.copies.size();
    return n;
  }
};

// "pool 'a'", or "pools 'a', 'b'" for a pool group's job, for the log.
std::string PoolsOf(const TransferJob& job) {
  std::vector<std::string> names;
  for (const JobPart& part : job.parts) names.push_back(absl::StrCat("'", part.pool->name(), "'"));
  return absl::StrCat(names.size() == 1 ? "pool " : "pools ", absl::StrJoin(names, ", "));
}

}  // namespace

absl::StatusOr<CudaPath> ParseCudaPath(const std::string& name) {
  if (name == "auto") return CudaPath::kAuto;
  if (name == "ce") return CudaPath::kCopyEngine;
  if (name == "staged") return CudaPath::kStaged;
  if (name == "sm") return CudaPath::kSm;
  return absl::InvalidArgumentError(
      absl::StrCat("transfer path '", name, "' is not one of auto, ce (copy engines), staged, sm"));
}

const char* CudaPathName(CudaPath path) {
  switch (path) {
    case CudaPath::kAuto:
      return "auto";
    case CudaPath::kCopyEngine:
      return "cuda-ce";
    case CudaPath::kStaged:
      return "cuda-staged";
    case CudaPath::kSm:
      return "cuda-sm";
  }
  return "auto";
}

// Pool memory registered with CUDA (pinned and mapped), keyed by the pool's
// base address and counted by the mappings that use it.
//
// Why counted by mappings, not tied to the Pool: the engine sees a pool only
// through `const Pool&` in Open, and the Pool unmaps its memory when its last
// shared_ptr goes. Every holder of a mapping (the attachment, each job)
// holds the pool too and declares the pool first, so the mapping is
// destroyed, and the memory unregistered, before the pool can unmap it. The
// registry is shared by the engine and its mappings so that either can go
// last. cudaHostRegisterPortable makes one registration serve every GPU's
// context, so a pool attached on several GPUs is registered once, not once
// per device (a second registration of the same range would fail with
// cudaErrorHostMemoryAlreadyRegistered).
class CudaEngine::HostPins {
 public:
  explicit HostPins(uint64_t chunk) : chunk_(std::max<uint64_t>(chunk, 4096)) {}

  uint64_t chunk() const { return chunk_; }

  // Registers [base, base + bytes) on first use. The lock is held while
  // registering (seconds for a large pool) so that two attachments of one
  // pool never register it twice.
  absl::Status Acquire(uint8_t* base, uint64_t bytes, const std::string& pool) {
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

  void Release(uint8_t* base) {
    absl::MutexLock lock(&mu_);
    auto it = entries_.find(base);
    if (it == entries_.end() || --it->second.users > 0) return;
    Unregister(base, it->second.chunks);
    spdlog::debug("unpinned {} bytes at {}", it->second.bytes, static_cast<void*>(base));
    entries_.erase(it);
  }

 private:
  struct Entry {
    uint64_t bytes;
    size_t chunks;
    int users;
  };

  void Unregister(uint8_t* base, size_t chunks) {
    for (size_t c = 0; c < chunks; ++c) {
      if (cudaError_t e = cudaHostUnregister(base + c * chunk_); e != cudaSuccess) {
        cudaGetLastError();
        spdlog::error("cudaHostUnregister at {}: {}", static_cast<void*>(base + c * chunk_),
                      CudaError(e));
      }
    }
  }

  const uint64_t chunk_;
  absl::Mutex mu_;
  std::map<uint8_t*, Entry> entries_ ABSL_GUARDED_BY(mu_);
};

// What the completion thread waits for: one event per layer enqueued.
struct CudaEngine::Pending {
  TransferJob job;
  std::vector<cudaEvent_t> events;
  // Pinned descriptor scratch the job's uploads read; back to
  // free_scratch once the job is done.
  std::vector<void*> scratch;
  uint64_t layers_enqueued = 0;  // ticket layers
  // A gated load (see Lane::gate_stream): its gate counts from gate_base.
  bool gated = false;
  uint64_t gate_base = 0;
  absl::Status error;  // why enqueueing stopped early, if it did
};

// One stream of one GPU, the jobs enqueued on it and the thread that waits
// for them.
struct CudaEngine::Lane {
  int gpu = 0;
  Direction direction = Direction::kBackup;
  cudaStream_t stream = nullptr;
  // The staged path's gather / scatter kernels run here, beside the copies
  // on `stream`: chunk i's kernel overlaps chunk i-1's copies. The events
  // hand each half of the staging buffer between the two streams:
  // ready[b] after the producer of half b, free[b] after its consumer.
  // Touched only under submit_mu.
  cudaStream_t kernel_stream = nullptr;
  cudaEvent_t half_ready[2] = {nullptr, nullptr};
  cudaEvent_t half_free[2] = {nullptr, nullptr};
  cudaEvent_t stage_start = nullptr;
  cudaEvent_t stage_end = nullptr;
  uint8_t* staging = nullptr;  // allocated by the first staged job

  // Loads only, where the driver has 64-bit stream memory operations: the
  // per-layer load events are recorded here, each behind a wait for its
  // set's gate value (a device word) to reach the layer's count, and the
  // copy stream writes that count after the layer's copies. So Submit
  // records every event up front and returns (the RPC with it), and the
  // enqueue thread queues the copies afterwards: the first layer starts
  // moving while the rest are still being queued, and the Load call does
  // not wait for 32 layers of copy submissions.
  cudaStream_t gate_stream = nullptr;
  absl::Mutex gate_mu;  // orders the gate ops and the enqueue queue alike

  // Held while a job is enqueued: the order in which jobs take it is their
  // order on the stream and in `pending`, so one direction stays FIFO.
  absl::Mutex submit_mu;
  std::vector<CopyEnginePiece> pieces ABSL_GUARDED_BY(submit_mu);
  std::vector<void*> dsts ABSL_GUARDED_BY(submit_mu);
  std::vector<void*> srcs ABSL_GUARDED_BY(submit_mu);
  std::vector<size_t> sizes ABSL_GUARDED_BY(submit_mu);

  absl::Mutex mu;
  std::deque<Pending> pending ABSL_GUARDED_BY(mu);
  std::vector<cudaEvent_t> free_events ABSL_GUARDED_BY(mu);
  // Pinned host buffers of kScratchBytes for descriptor uploads.
  std::vector<void*> free_scratch ABSL_GUARDED_BY(mu);
  bool busy ABSL_GUARDED_BY(mu) = false;  // the completion thread holds a job
  bool stopping ABSL_GUARDED_BY(mu) = false;
  std::thread completer;
  // Gated loads waiting for the enqueue thread, in Submit order.
  std::deque<Pending> to_enqueue ABSL_GUARDED_BY(mu);
  bool enqueuing ABSL_GUARDED_BY(mu) = false;
  std::thread enqueuer;
};

// A worker's device layer buffers opened from CUDA IPC handles, each handle
// once, and the pool's host regions pinned while the mapping lives.
class CudaEngine::Mapping : public DeviceMapping {
 public:
  Mapping(const Pool& pool, const ResolvedAttach& attach, int gpu, Lane* lanes)
      : DeviceMapping(pool, attach),
        gpu_(gpu),
        lanes_(lanes),
        groups_(GroupComponents(pool.components())) {}
  // A pool group's: no buffers of its own (jobs copy through their parts'
  // mappings), `layer_num` model layers of load events, and the entries'
  // mappings kept open as long as this one.
  Mapping(std::vector<std::shared_ptr<const DeviceMapping>> entries, uint32_t layer_num, int gpu,
          Lane* lanes)
      : DeviceMapping(layer_num, 0, {}), gpu_(gpu), lanes_(lanes), entries_(std::move(entries)) {}

  ~Mapping() override {
    // The handles were opened in this device's context and close there.
    if (!opened_.empty() || !load_events_.empty()) cudaSetDevice(gpu_);
    // Every load that recorded these has finished (each job holds the
    // mapping). A worker that still has them open keeps its own references:
    // destroying ours does not invalidate its waits.
    for (cudaEvent_t event : load_events_) cudaEventDestroy(event);
    if (layer_table_ != nullptr) cudaFree(layer_table_);
    if (gates_ != nullptr) cudaFree(gates_);
    for (const auto& [handle, allocation] : opened_) {
      if (cudaError_t e = cudaIpcCloseMemHandle(allocation.ptr); e != cudaSuccess) {
        cudaGetLastError();
        spdlog::error("cudaIpcCloseMemHandle on GPU {}: {}", gpu_, CudaError(e));
      }
    }
    for (uint8_t* base : pinned_) pins_->Release(base);
  }

  // The GPU's two lanes: [0] backups, [1] loads.
  Lane* lanes() const { return lanes_; }
  int gpu() const { return gpu_; }

  // Creates `sets` x `layers` interprocess events and exports their handles
  // (DeviceMapping::load_event_handles). REQUIRES: the current device is
  // this mapping's; called once.
  absl::Status CreateLoadEvents(uint32_t sets, uint64_t layers) {
    for (uint64_t i = 0; i < uint64_t{sets} * layers; ++i) {
      cudaEvent_t event = nullptr;
      // Interprocess events must not time; they are only recorded here and
      // waited on by the worker's streams, never synchronised on by a host
      // thread of ours, so blocking sync does not matter.
      if (cudaError_t e =
              cudaEventCreateWithFlags(&event, cudaEventDisableTiming | cudaEventInterprocess);
          e != cudaSuccess) {
        cudaGetLastError();
        return absl::InternalError(absl::StrCat("creating load event ", i, " of ",
                                                uint64_t{sets} * layers, " on GPU ", gpu_, ": ",
                                                CudaError(e)));
      }
      load_events_.push_back(event);
      cudaIpcEventHandle_t handle;
      if (cudaError_t e = cudaIpcGetEventHandle(&handle, event); e != cudaSuccess) {
        cudaGetLastError();
        return absl::InternalError(
            absl::StrCat("cudaIpcGetEventHandle of load event ", i, ": ", CudaError(e)));
      }
      load_event_handles_.emplace_back(reinterpret_cast<const char*>(&handle), sizeof(handle));
    }
    load_event_sets_ = sets;
    set_busy_.assign(sets, false);
    // One gate word per set, counting up by the layers of each load of the
    // set: 64 bits never wrap, so a wait can never see a stale value pass.
    if (cudaError_t e = cudaMalloc(&gates_, sets * sizeof(uint64_t)); e != cudaSuccess) {
      cudaGetLastError();
      gates_ = nullptr;
      return absl::ResourceExhaustedError(
          absl::StrCat("GPU ", gpu_, ": the load gates: cudaMalloc: ", CudaError(e)));
    }
    if (cudaError_t e = cudaMemset(gates_, 0, sets * sizeof(uint64_t)); e != cudaSuccess) {
      cudaGetLastError();
      return absl::InternalError(
          absl::StrCat("GPU ", gpu_, ": clearing the load gates: ", CudaError(e)));
    }
    gate_next_.assign(sets, 0);
    return absl::OkStatus();
  }

  // The gate word of load event set `set`, and the count its next load
  // starts from (advanced by `layers`). REQUIRES: the lane's gate_mu held.
  CUdeviceptr gate(int set) const { return reinterpret_cast<CUdeviceptr>(gates_ + set); }
  uint64_t TakeGateRange(int set, uint64_t layers) const {
    const uint64_t base = gate_next_[static_cast<size_t>(set)];
    gate_next_[static_cast<size_t>(set)] += layers;
    return base;
  }

  cudaEvent_t load_event(int set, uint64_t layer) const {
    return load_events_[static_cast<uint64_t>(set) * layer_num_ + layer];
  }

  // The next free load event set in round-robin order, held until
  // ReleaseSet. RESOURCE_EXHAUSTED when every set is held: waiting here
  // would block an RPC thread for as long as a load runs, and a worker that
  // issues loads from the thread that would later wait for them could never
  // make progress.
  absl::StatusOr<int> AcquireSet() const {
    absl::MutexLock lock(&ring_mu_);
    for (uint32_t k = 0; k < load_event_sets_; ++k) {
      const uint32_t set = (next_set_ + k) % load_event_sets_;
      if (set_busy_[set]) continue;
      set_busy_[set] = true;
      next_set_ = (set + 1) % load_event_sets_;
      return static_cast<int>(set);
    }
    return absl::ResourceExhaustedError(absl::StrCat(
        "all ", load_event_sets_,
        " load event sets are in use by loads in flight; wait for a load to finish or attach "
        "with more load_event_sets"));
  }
  // REQUIRES: `set` was acquired and every event of it recorded by that
  // load has completed.
  void ReleaseSet(int set) const {
    absl::MutexLock lock(&ring_mu_);
    set_busy_[static_cast<uint32_t>(set)] = false;
  }

  // Opens (or reuses) `ref`'s allocation and adds its layer buffer of
  // component `component`. REQUIRES: the current device is this mapping's;
  // ref.ipc_handle has the size of a cudaIpcMemHandle_t; buffers are added
  // component-major.
  absl::Status AddLayer(size_t component, const DeviceBufferRef& ref, const std::string& where) {
    auto it = opened_.find(ref.ipc_handle);
    if (it == opened_.end()) {
      cudaIpcMemHandle_t handle;
      std::memcpy(&handle, ref.ipc_handle.data(), sizeof(handle));
      void* ptr = nullptr;
      if (cudaError_t e = cudaIpcOpenMemHandle(&ptr, handle, cudaIpcMemLazyEnablePeerAccess);
          e != cudaSuccess) {
        cudaGetLastError();
        return absl::InvalidArgumentError(absl::StrCat(
            where, ": cudaIpcOpenMemHandle failed: ", CudaError(e),
            "; the handle must come from cudaIpcGetMemHandle on a live cudaMalloc allocation of "
            "another process"));
      }
      it = opened_.emplace(ref.ipc_handle, Allocation{static_cast<uint8_t*>(ptr), 0}).first;
      absl::StatusOr<PFN_cuMemGetAddressRange_v3020> range = AddressRangeFn();
      if (!range.ok()) return range.status();
      CUdeviceptr base = 0;
      size_t size = 0;
      if (CUresult r = (*range)(&base, &size, reinterpret_cast<CUdeviceptr>(ptr));
          r != CUDA_SUCCESS) {
        return absl::InternalError(absl::StrCat(
            where,
            ": cuMemGetAddressRange of the opened allocation failed: ", static_cast<int>(r)));
      }
      // The handle names the allocation's base, so ptr == base; the bytes
      // from ptr are what a layer may use either way.
      it->second.bytes = base + size - reinterpret_cast<CUdeviceptr>(ptr);
    }
    const DeviceRows& rows = rows_[component];
    const uint64_t need = rows.total_bytes();
    const uint64_t have = it->second.bytes;
    if (ref.offset > have || have - ref.offset < need) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": offset ", ref.offset, " + ", rows.rows, " rows x ", rows.row_bytes,
                       " bytes exceeds its CUDA allocation (", have, " bytes)"));
    }
    layers_.push_back(it->second.ptr + ref.offset);
    return absl::OkStatus();
  }

  // Registers every region of `pool` (none for LOGICAL); a region that
  // fails leaves the ones before it to the destructor.
  absl::Status Pin(const Pool& pool, std::shared_ptr<HostPins> pins) {
    pins_ = std::move(pins);
    for (size_t r = 0; r < pool.region_count(); ++r) {
      const std::string what =
          pool.region_count() == 1 ? pool.name() : absl::StrCat(pool.name(), "' region '", r);
      absl::Status s = pins_->Acquire(pool.region_base(r), pool.region_bytes(r), what);
      if (!s.ok()) return s;
      pinned_.push_back(pool.region_base(r));
    }
    return absl::OkStatus();
  }

  // What the kernel paths need: the layer bases in device memory, and
  // whether the GPU can use the pool's host addresses (else the SM copy path is
  // unavailable). REQUIRES: every layer added, the pool pinned, the current
  // device is this mapping's.
  absl::Status PrepareKernels(bool host_pointer_ok) {
    const size_t bytes = layers_.size() * sizeof(uint8_t*);
    if (cudaError_t e = cudaMalloc(&layer_table_, bytes); e != cudaSuccess) {
      cudaGetLastError();
      layer_table_ = nullptr;
      return absl::ResourceExhaustedError(
          absl::StrCat("GPU ", gpu_, ": cudaMalloc of the layer table: ", CudaError(e)));
    }
    if (cudaError_t e = cudaMemcpy(layer_table_, layers_.data(), bytes, cudaMemcpyHostToDevice);
        e != cudaSuccess) {
      cudaGetLastError();
      return absl::InternalError(
          absl::StrCat("GPU ", gpu_, ": uploading the layer table: ", CudaError(e)));
    }
    aligned16_ = true;
    for (uint8_t* layer : layers_) aligned16_ &= reinterpret_cast<uintptr_t>(layer) % 16 == 0;
    host_pointer_ok_ = host_pointer_ok;
    return absl::OkStatus();
  }

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

  const int gpu_;
  Lane* const lanes_;  // owned by the engine, which outlives us
  const std::vector<LayoutGroup> groups_;
  // A group's entries (empty for a plain attachment's mapping).
  const std::vector<std::shared_ptr<const DeviceMapping>> entries_;
  std::map<std::string, Allocation> opened_;  // by handle bytes
  std::shared_ptr<HostPins> pins_;
  std::vector<uint8_t*> pinned_;             // region bases
  std::vector<cudaEvent_t> load_events_;     // set-major, as load_event_handles_
  uint8_t** layer_table_ = nullptr;          // device copy of layers_
  uint64_t* gates_ = nullptr;                // device words, one per load event set
  mutable std::vector<uint64_t> gate_next_;  // guarded by the load lane's gate_mu
  bool host_pointer_ok_ = false;
  bool aligned16_ = false;
  mutable std::atomic<uint8_t> last_path_[2] = {255, 255};

  // The ring of load event sets. Mutable: jobs see the mapping as const, and
  // taking a set changes no buffer.
  mutable absl::Mutex ring_mu_;
  mutable std::vector<bool> set_busy_ ABSL_GUARDED_BY(ring_mu_);
  mutable uint32_t next_set_ ABSL_GUARDED_BY(ring_mu_) = 0;
};

absl::StatusOr<std::unique_ptr<CudaEngine>> CudaEngine::Create(CudaEngineOptions options) {
  int count = 0;
  if (cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess || count == 0) {
    cudaGetLastError();
    return absl::FailedPreconditionError(absl::StrCat(
        "no usable CUDA GPU: ", e != cudaSuccess ? CudaError(e) : "cudaGetDeviceCount is 0"));
  }
  std::vector<GpuInfo> gpus;
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop;
    if (cudaError_t e = cudaGetDeviceProperties(&prop, i); e != cudaSuccess) {
      cudaGetLastError();
      return absl::FailedPreconditionError(
          absl::StrCat("cudaGetDeviceProperties(", i, "): ", CudaError(e)));
    }
    int host_pointer = 0;
    if (cudaError_t e =
            cudaDeviceGetAttribute(&host_pointer, cudaDevAttrCanUseHostPointerForRegisteredMem, i);
        e != cudaSuccess) {
      cudaGetLastError();
      host_pointer = 0;
    }
    gpus.push_back(
        GpuInfo{i, FormatUuid(prop.uuid), prop.name, prop.multiProcessorCount, host_pointer != 0});
  }
  options.max_batch = std::max<size_t>(options.max_batch, 1);
  options.sm_blocks = std::max(options.sm_blocks, 1);
  options.staging_bytes = std::max<uint64_t>(options.staging_bytes, 512);
  return std::unique_ptr<CudaEngine>(new CudaEngine(options, std::move(gpus)));
}

CudaEngine::CudaEngine(CudaEngineOptions options, std::vector<GpuInfo> gpus)
    : options_(options),
      gpus_(std::move(gpus)),
      pins_(std::make_shared<HostPins>(options_.host_register_chunk)) {
  mps_ = MpsActive(&mps_detail_);
  absl::MutexLock lock(&lanes_mu_);
  lanes_.resize(gpus_.size());
}

CudaEngine::~CudaEngine() {
  Drain();
  absl::MutexLock lock(&lanes_mu_);
  for (size_t d = 0; d < lanes_.size(); ++d) {
    if (lanes_[d] == nullptr) continue;
    for (int i = 0; i < 2; ++i) {
      Lane& lane = lanes_[d][i];
      {
        absl::MutexLock lane_lock(&lane.mu);
        lane.stopping = true;
      }
      if (lane.enqueuer.joinable()) lane.enqueuer.join();
      lane.completer.join();
      cudaSetDevice(lane.gpu);
      absl::MutexLock lane_lock(&lane.mu);
      for (cudaEvent_t event : lane.free_events) cudaEventDestroy(event);
      for (void* scratch : lane.free_scratch) cudaFreeHost(scratch);
      for (cudaEvent_t event : {lane.half_ready[0], lane.half_ready[1], lane.half_free[0],
                                lane.half_free[1], lane.stage_start, lane.stage_end}) {
        if (event != nullptr) cudaEventDestroy(event);
      }
      if (lane.staging != nullptr) cudaFree(lane.staging);
      if (lane.kernel_stream != nullptr) cudaStreamDestroy(lane.kernel_stream);
      if (lane.gate_stream != nullptr) cudaStreamDestroy(lane.gate_stream);
      cudaStreamDestroy(lane.stream);
    }
  }
}

std::string CudaEngine::Describe() const {
#if CUDART_VERSION >= 12080
  constexpr char kCopies[] = "cudaMemcpyBatchAsync";
#else
  constexpr char kCopies[] = "cudaMemcpyAsync";
#endif
  std::vector<std::string> parts;
  for (const GpuInfo& d : gpus_) parts.push_back(absl::StrCat(d.ordinal, " ", d.name, " ", d.uuid));
  return absl::StrCat(gpus_.size(), " GPU(s): ", absl::StrJoin(parts, ", "), "; copies by ",
                      kCopies, options_.gate_loads ? ", gated loads" : "", "; transfer path ",
                      CudaPathName(options_.path), ", staging ", Bytes(options_.staging_bytes),
                      " per stream, SM copy path grid <= ", options_.sm_blocks, " blocks; ",
                      mps_detail_);
}

std::string CudaEngine::PathFor(const TransferJob& job) const {
  return CudaPathName(static_cast<CudaPath>(job.path));
}

absl::StatusOr<std::unique_ptr<DeviceMapping>> CudaEngine::OpenGroup(
    std::vector<std::shared_ptr<const DeviceMapping>> entries, uint32_t layer_num,
    uint32_t load_event_sets) {
  if (entries.empty()) return absl::InvalidArgumentError("a pool group attachment with no entries");
  // The GPU of each entry this engine opened; the others (pools without
  // components, LOGICAL) have no buffers and no GPU, and their jobs' parts
  // never reach the engine.
  std::vector<int> gpu_of(entries.size(), -1);
  int gpu = -1;
  for (size_t i = 0; i < entries.size(); ++i) {
    if (const auto* m = dynamic_cast<const Mapping*>(entries[i].get()); m != nullptr) {
      gpu_of[i] = m->gpu();
      if (gpu < 0) gpu = m->gpu();
    }
  }
  for (size_t i = 0; i < entries.size(); ++i) {
    if (gpu_of[i] < 0 || gpu_of[i] == gpu) continue;
    std::vector<std::string> where;
    for (size_t k = 0; k < entries.size(); ++k) {
      if (gpu_of[k] < 0) continue;
      where.push_back(
          absl::StrCat("entries[", k, "] on GPU ", gpus_[static_cast<size_t>(gpu_of[k])].uuid));
    }
    return absl::InvalidArgumentError(
        absl::StrCat("the group's entries are on different GPUs (", absl::StrJoin(where, ", "),
                     "); every buffer of a group attachment must be on one GPU"));
  }
  if (gpu < 0) {
    // No entry has buffers: no GPU to make events on, and no job copies.
    return std::unique_ptr<DeviceMapping>(
        std::make_unique<Mapping>(std::move(entries), layer_num, -1, nullptr));
  }
  absl::StatusOr<Lane*> lanes = LanesFor(gpu);
  if (!lanes.ok()) return lanes.status();
  if (cudaError_t e = cudaSetDevice(gpu); e != cudaSuccess) {
    cudaGetLastError();
    return absl::InternalError(absl::StrCat("cudaSetDevice(", gpu, "): ", CudaError(e)));
  }
  // On error, `mapping` destroys the events it made.
  auto mapping = std::make_unique<Mapping>(std::move(entries), layer_num, gpu, *lanes);
  if (absl::Status s = mapping->CreateLoadEvents(load_event_sets, layer_num); !s.ok()) return s;
  return std::unique_ptr<DeviceMapping>(std::move(mapping));
}

absl::StatusOr<CudaEngine::Lane*> CudaEngine::LanesFor(int gpu) {
  absl::MutexLock lock(&lanes_mu_);
  std::unique_ptr<Lane[]>& lanes = lanes_[static_cast<size_t>(gpu)];
  if (lanes != nullptr) return lanes.get();
  if (cudaError_t e = cudaSetDevice(gpu); e != cudaSuccess) {
    cudaGetLastError();
    return absl::InternalError(absl::StrCat("cudaSetDevice(", gpu, "): ", CudaError(e)));
  }
  // Numerically lower is higher priority: loads get `greatest`, since a
  // forward pass waits on them, backups `least`.
  int least = 0;
  int greatest = 0;
  if (cudaError_t e = cudaDeviceGetStreamPriorityRange(&least, &greatest); e != cudaSuccess) {
    cudaGetLastError();
    return absl::InternalError(absl::StrCat("GPU ", gpu, ": ", CudaError(e)));
  }
  auto created = std::make_unique<Lane[]>(2);
  for (int i = 0; i < 2; ++i) {
    Lane& lane = created[i];
    lane.gpu = gpu;
    lane.direction = i == 0 ? Direction::kBackup : Direction::kLoad;
    const int priority = lane.direction == Direction::kLoad ? greatest : least;
    if (cudaError_t e = cudaStreamCreateWithPriority(&lane.stream, cudaStreamNonBlocking, priority);
        e != cudaSuccess) {
      cudaGetLastError();
      if (i == 1) cudaStreamDestroy(created[0].stream);
      return absl::InternalError(
          absl::StrCat("GPU ", gpu, ": cudaStreamCreateWithPriority: ", CudaError(e)));
    }
  }
  for (int i = 0; i < 2; ++i) {
    Lane& lane = created[i];
    const int priority = lane.direction == Direction::kLoad ? greatest : least;
    cudaError_t e =
        cudaStreamCreateWithPriority(&lane.kernel_stream, cudaStreamNonBlocking, priority);
    for (cudaEvent_t* event : {&lane.half_ready[0], &lane.half_ready[1], &lane.half_free[0],
                               &lane.half_free[1], &lane.stage_start, &lane.stage_end}) {
      if (e == cudaSuccess) e = cudaEventCreateWithFlags(event, cudaEventDisableTiming);
    }
    if (e != cudaSuccess) {
      cudaGetLastError();
      // Streams and events of a lane that never ran are simply dropped with
      // the process's context; this GPU is unusable anyway.
      return absl::InternalError(absl::StrCat(
          "GPU ", gpu, ": creating the staged path's stream and events: ", CudaError(e)));
    }
  }
  // Descriptor buffers come from the stream-ordered allocator; keep what a
  // few jobs use instead of returning it to the driver at every sync.
  cudaMemPool_t mem_pool = nullptr;
  if (cudaDeviceGetDefaultMemPool(&mem_pool, gpu) == cudaSuccess) {
    uint64_t keep = uint64_t{64} << 20;
    cudaMemPoolSetAttribute(mem_pool, cudaMemPoolAttrReleaseThreshold, &keep);
  }
  cudaGetLastError();
  // Gated loads (CudaEngineOptions::gate_loads), where the driver has 64-bit
  // stream memory operations (tried once here, so that a driver without
  // them falls back to queueing every load's copies inside the Load call).
  Lane& loads = created[1];
  absl::StatusOr<StreamMemOps> ops = StreamMemOpsFns();
  std::string no_gate = ops.ok() ? "" : std::string(ops.status().message());
  if (options_.gate_loads && ops.ok()) {
    uint64_t* word = nullptr;
    cudaError_t e =
        cudaStreamCreateWithPriority(&loads.gate_stream, cudaStreamNonBlocking, greatest);
    if (e == cudaSuccess) e = cudaMalloc(&word, sizeof(uint64_t));
    CUresult r = CUDA_SUCCESS;
    if (e == cudaSuccess) {
      r = ops->write(loads.gate_stream, reinterpret_cast<CUdeviceptr>(word), 1, 0);
      if (r == CUDA_SUCCESS) {
        r = ops->wait(loads.gate_stream, reinterpret_cast<CUdeviceptr>(word), 1,
                      CU_STREAM_WAIT_VALUE_GEQ);
      }
      if (r == CUDA_SUCCESS) e = cudaStreamSynchronize(loads.gate_stream);
    }
    if (word != nullptr) cudaFree(word);
    if (e != cudaSuccess || r != CUDA_SUCCESS) {
      cudaGetLastError();
      no_gate = absl::StrCat("stream memory operations fail here (",
                             e != cudaSuccess ? CudaError(e) : absl::StrCat("CUresult ", r), ")");
      if (loads.gate_stream != nullptr) cudaStreamDestroy(loads.gate_stream);
      loads.gate_stream = nullptr;
    }
  }
  if (options_.gate_loads && !no_gate.empty()) {
    spdlog::warn("GPU {}: loads queue all their copies before the Load call returns: {}", gpu,
                 no_gate);
  }
  for (int i = 0; i < 2; ++i) {
    Lane* lane = &created[i];
    lane->completer = std::thread([this, lane] { CompleteLoop(lane); });
    if (lane->gate_stream != nullptr) {
      lane->enqueuer = std::thread([this, lane] { EnqueueLoop(lane); });
    }
  }
  spdlog::info("GPU {} ({}, {}): backup and load streams up, load priority {} over {}", gpu,
               gpus_[static_cast<size_t>(gpu)].name, gpus_[static_cast<size_t>(gpu)].uuid, greatest,
               least);
  lanes = std::move(created);
  return lanes.get();
}

absl::StatusOr<std::unique_ptr<DeviceMapping>> CudaEngine::Open(const Pool& pool,
                                                                const ResolvedAttach& attach) {
  // Everything that needs no CUDA call is checked first.
  int gpu = -1;
  std::string first_where;
  auto check = [&](const DeviceBufferRef& ref, const std::string& where) -> absl::Status {
    if (ref.kind != DeviceBufferRef::Kind::kCuda) {
      return absl::FailedPreconditionError(
          absl::StrCat(where,
                       " is a shared-memory buffer, but this daemon runs the cuda backend "
                       "(send CUDA IPC buffers, or start kvhostd with --backend=host)"));
    }
    if (ref.ipc_handle.size() != sizeof(cudaIpcMemHandle_t)) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": ipc_handle has ", ref.ipc_handle.size(),
                       " bytes; a cudaIpcMemHandle_t has ", sizeof(cudaIpcMemHandle_t)));
    }
    // nvidia-smi prints lower-case hex; accept any case.
    std::string canonical = absl::AsciiStrToLower(ref.gpu_uuid);
    if (canonical.size() >= 4)
      canonical.replace(0, 4, absl::AsciiStrToUpper(canonical.substr(0, 4)));
    if (!LooksLikeUuid(canonical)) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": gpu_uuid '", ref.gpu_uuid,
                       "' is not a GPU UUID (GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx, as "
                       "nvidia-smi -L prints it)"));
    }
    int ref_gpu = -1;
    for (const GpuInfo& d : gpus_) {
      if (d.uuid == canonical) ref_gpu = d.ordinal;
    }
    if (ref_gpu < 0) {
      std::vector<std::string> known;
      for (const GpuInfo& d : gpus_) known.push_back(d.uuid);
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": GPU ", ref.gpu_uuid, " is not one of kvhostd's GPUs (",
                       absl::StrJoin(known, ", "),
                       "); run kvhostd where it sees the worker's GPU (CUDA_VISIBLE_DEVICES)"));
    }
    if (gpu < 0) {
      gpu = ref_gpu;
      first_where = where;
    } else if (ref_gpu != gpu) {
      return absl::InvalidArgumentError(absl::StrCat(where, " is on GPU ", ref.gpu_uuid, " but ",
                                                     first_where, " is on GPU ",
                                                     gpus_[static_cast<size_t>(gpu)].uuid,
                                                     "; all layers of an attachment must be on "
                                                     "one GPU"));
    }
    return absl::OkStatus();
  };
  for (const ComponentBuffers& component : attach.components) {
    for (size_t l = 0; l < component.layers.size(); ++l) {
      if (absl::Status s = check(component.layers[l], component.Where(l)); !s.ok()) return s;
    }
  }
  if (gpu < 0) return absl::InvalidArgumentError("no layer buffers");

  absl::StatusOr<Lane*> lanes = LanesFor(gpu);
  if (!lanes.ok()) return lanes.status();
  if (cudaError_t e = cudaSetDevice(gpu); e != cudaSuccess) {
    cudaGetLastError();
    return absl::InternalError(absl::StrCat("cudaSetDevice(", gpu, "): ", CudaError(e)));
  }
  // On any error below, `mapping` closes what it opened and unpins.
  auto mapping = std::make_unique<Mapping>(pool, attach, gpu, *lanes);
  for (size_t c = 0; c < attach.components.size(); ++c) {
    const ComponentBuffers& component = attach.components[c];
    for (size_t l = 0; l < component.layers.size(); ++l) {
      absl::Status s = mapping->AddLayer(c, component.layers[l], component.Where(l));
      if (!s.ok()) return s;
    }
  }
  if (absl::Status s = mapping->CreateLoadEvents(attach.load_event_sets, attach.layer_num());
      !s.ok()) {
    return s;
  }
  if (absl::Status s = mapping->Pin(pool, pins_); !s.ok()) return s;
  if (absl::Status s = mapping->PrepareKernels(gpus_[static_cast<size_t>(gpu)].host_pointer_ok);
      !s.ok()) {
    return s;
  }
  return std::unique_ptr<DeviceMapping>(std::move(mapping));
}

absl::Status CudaEngine::EnqueueCopyEngineLayer(Lane* lane, const TransferJob& job,
                                                size_t ticket_layer) {
  const bool backup = job.direction == Direction::kBackup;
  std::vector<CopyEnginePiece>& pieces = lane->pieces;
  // Every part's pieces of the layer, in one batch.
  size_t n = 0;
  for (const JobPart& part : job.parts) {
    const JobLayer& layer = part.layers[ticket_layer];
    if (layer.host_layer < 0) continue;  // a device layer the part's pool does not copy here
    const Pool& pool = *part.pool;
    pieces.clear();
    PlanCopyEngineLayer(pool.components(), part.runs, part.page_runs,
                        static_cast<uint64_t>(layer.host_layer), pins_->chunk(), &pieces);
    lane->dsts.resize(n + pieces.size());
    lane->srcs.resize(n + pieces.size());
    lane->sizes.resize(n + pieces.size());
    for (const CopyEnginePiece& p : pieces) {
      void* const h = pool.region_base(p.region) + p.host_offset;
      void* const d = part.mapping->buffer(p.component, layer.device_layer) + p.device_offset;
      lane->dsts[n] = backup ? h : d;
      lane->srcs[n] = backup ? d : h;
      lane->sizes[n] = static_cast<size_t>(p.bytes);
      ++n;
    }
  }
  if (n == 0) return absl::OkStatus();
  return SubmitCopies(lane, lane->stream, n,
                      absl::StrCat(DirectionName(job.direction), " layer ", ticket_layer));
}

absl::Status CudaEngine::SubmitCopies(Lane* lane, cudaStream_t stream, size_t n_copies,
                                      const std::string& what) {
  const bool backup = lane->direction == Direction::kBackup;
  // One cudaMemcpyAsync per piece: the fallback where the batch API is
  // missing (CUDA < 12.8) or refused by the driver.
  auto one_by_one = [&](size_t from) -> absl::Status {
    for (size_t i = from; i < n_copies; ++i) {
      const cudaError_t e =
          cudaMemcpyAsync(lane->dsts[i], lane->srcs[i], lane->sizes[i], cudaMemcpyDefault, stream);
      if (e != cudaSuccess) {
        cudaGetLastError();
        return absl::InternalError(absl::StrCat(what, ": cudaMemcpyAsync: ", CudaError(e)));
      }
    }
    return absl::OkStatus();
  };
#if CUDART_VERSION >= 12080
  if (!batch_ok_.load(std::memory_order_relaxed)) return one_by_one(0);
  cudaMemcpyAttributes attr;
  std::memset(&attr, 0, sizeof(attr));
  // The host side is written or read in stream order like the device side:
  // a later job on this stream may reuse the same host slots.
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  cudaMemLocation host_loc;
  host_loc.type = cudaMemLocationTypeHost;
  host_loc.id = 0;
  cudaMemLocation device_loc;
  device_loc.type = cudaMemLocationTypeDevice;
  device_loc.id = lane->gpu;
  attr.srcLocHint = backup ? device_loc : host_loc;
  attr.dstLocHint = backup ? host_loc : device_loc;
  size_t attr_index = 0;
  for (size_t i = 0; i < n_copies;) {
    const size_t n = std::min(options_.max_batch, n_copies - i);
    // A hint to keep the copies off the SMs, which the worker needs.
    attr.flags = batch_flags_.load(std::memory_order_relaxed);
#if CUDART_VERSION >= 13000
    const cudaError_t e =
        cudaMemcpyBatchAsync(lane->dsts.data() + i, lane->srcs.data() + i, lane->sizes.data() + i,
                             n, &attr, &attr_index, 1, stream);
#else
    size_t fail_index = 0;
    const cudaError_t e =
        cudaMemcpyBatchAsync(lane->dsts.data() + i, lane->srcs.data() + i, lane->sizes.data() + i,
                             n, &attr, &attr_index, 1, &fail_index, stream);
#endif
    if (e == cudaSuccess) {
      i += n;
      continue;
    }
    cudaGetLastError();
    if (e == cudaErrorInvalidValue && attr.flags != 0) {
      // A driver that rejects the hint: retry this batch without it.
      batch_flags_.store(0, std::memory_order_relaxed);
      spdlog::warn(
          "cudaMemcpyBatchAsync refused cudaMemcpyFlagPreferOverlapWithCompute ({}); "
          "copying without it",
          CudaError(e));
      continue;
    }
    if (e == cudaErrorNotSupported || e == cudaErrorCallRequiresNewerDriver) {
      batch_ok_.store(false, std::memory_order_relaxed);
      spdlog::warn("cudaMemcpyBatchAsync unavailable ({}); one cudaMemcpyAsync per piece from now",
                   CudaError(e));
      return one_by_one(i);
    }
    return absl::InternalError(
        absl::StrCat(what, ": cudaMemcpyBatchAsync of ", n, " copies: ", CudaError(e)));
  }
  return absl::OkStatus();
#else
  return one_by_one(0);
#endif
}

absl::Status CudaEngine::ChoosePath(TransferJob* job, std::string* why) const {
  // Over every part: the bytes moved and the copy-engine pieces, each part's
  // per held layer (the same over its held layers) times its held layers.
  uint64_t total = 0;
  uint64_t total_pieces = 0;
  // The same per layer, unweighted: the average piece of a job that holds
  // no layer (it copies nothing; the path name is all it gets).
  uint64_t layer_bytes = 0;
  uint64_t layer_pieces = 0;
  bool host_pointer_ok = true;
  bool stageable = false;  // some part's layout has blocks larger than its pieces
  for (const JobPart& part : job->parts) {
    const auto& mapping = static_cast<const Mapping&>(*part.mapping);
    const std::vector<LayoutGroup>& groups = mapping.groups();
    uint64_t held = 0;
    for (const JobLayer& layer : part.layers) held += layer.host_layer >= 0 ? 1 : 0;
    const LayerPieces per_layer = CopyEngineLayerPieces(groups, part.runs, part.page_runs);
    total += per_layer.bytes * held;
    total_pieces += per_layer.pieces * held;
    layer_bytes += per_layer.bytes;
    layer_pieces += per_layer.pieces;
    host_pointer_ok = host_pointer_ok && mapping.host_pointer_ok();
    // LAYER_FIRST blocks are the copy-engine pieces themselves: staging them
    // adds a kernel and gains nothing.
    stageable =
        stageable || (!groups.empty() && groups.front().layout.kind != LayoutKind::kLayerFirst);
  }
  const uint64_t ce_piece = total_pieces > 0   ? total / total_pieces
                            : layer_pieces > 0 ? layer_bytes / layer_pieces
                                               : 0;
  auto use = [job](CudaPath path, std::shared_ptr<const void> plan) {
    job->path = static_cast<uint8_t>(path);
    job->plan = std::move(plan);
    return absl::OkStatus();
  };
  // Staged only where every group's blocks fit a chunk (else an error, which
  // auto answers with the copy engines): one plan per part and interval of
  // its held host layers.
  auto staged = [&]() -> absl::StatusOr<std::shared_ptr<const JobStagedPlan>> {
    auto plan = std::make_shared<JobStagedPlan>();
    for (size_t j = 0; j < job->parts.size(); ++j) {
      const JobPart& part = job->parts[j];
      if (part.tokens == 0) continue;
      const auto& mapping = static_cast<const Mapping&>(*part.mapping);
      for (const HeldLayers& held : HeldLayerRanges(part.layers)) {
        StagedRange& range = plan->ranges.emplace_back();
        range.part = j;
        range.delta = held.delta;
        absl::Status s =
            PlanStaged(mapping.groups(), part.runs, part.page_runs, held.begin, held.end,
                       StagingChunk(options_.staging_bytes), pins_->chunk(), &range.plan);
        if (!s.ok()) {
          if (job->parts.size() == 1) return s;
          return absl::Status(s.code(),
                              absl::StrCat("pool '", part.pool->name(), "': ", s.message()));
        }
      }
    }
    return std::shared_ptr<const JobStagedPlan>(std::move(plan));
  };
  auto sm_copy = [&]() {
    auto plan = std::make_shared<JobSmCopyPlan>();
    for (const JobPart& part : job->parts) {
      const auto& mapping = static_cast<const Mapping&>(*part.mapping);
      plan->parts.push_back(PlanSmCopy(mapping.groups(), part.runs, part.page_runs));
    }
    return std::shared_ptr<const JobSmCopyPlan>(std::move(plan));
  };
  const char* no_sm = host_pointer_ok
                          ? nullptr
                          : "this GPU cannot address registered host memory by its host pointer "
                            "(cudaDevAttrCanUseHostPointerForRegisteredMem is 0)";
  switch (options_.path) {
    case CudaPath::kCopyEngine:
      *why = "--transfer-path=ce";
      return use(CudaPath::kCopyEngine, nullptr);
    case CudaPath::kSm:
      if (no_sm != nullptr) {
        return absl::FailedPreconditionError(absl::StrCat("--transfer-path=sm: ", no_sm));
      }
      *why = "--transfer-path=sm";
      return use(CudaPath::kSm, sm_copy());
    case CudaPath::kStaged: {
      absl::StatusOr<std::shared_ptr<const JobStagedPlan>> plan = staged();
      if (!plan.ok()) {
        return absl::Status(plan.status().code(),
                            absl::StrCat("--transfer-path=staged: ", plan.status().message()));
      }
      *why = "--transfer-path=staged";
      return use(CudaPath::kStaged, *std::move(plan));
    }
    case CudaPath::kAuto:
      break;
  }
  if (ce_piece >= options_.ce_min_piece_bytes) {
    *why = absl::StrCat("auto: copy-engine pieces of ", Bytes(ce_piece),
                        " on average, >= ", Bytes(options_.ce_min_piece_bytes));
    return use(CudaPath::kCopyEngine, nullptr);
  }
  if (mps_ && no_sm == nullptr) {
    *why = absl::StrCat("auto: copy-engine pieces of only ", Bytes(ce_piece), ", MPS active");
    return use(CudaPath::kSm, sm_copy());
  }
  if (stageable) {
    absl::StatusOr<std::shared_ptr<const JobStagedPlan>> plan = staged();
    if (plan.ok()) {
      const uint64_t block = total / std::max<size_t>((*plan)->copies(), 1);
      if (block >= 2 * ce_piece) {
        *why = absl::StrCat("auto: copy-engine pieces of only ", Bytes(ce_piece),
                            ", staged blocks of ", Bytes(block), ", MPS not active");
        return use(CudaPath::kStaged, *std::move(plan));
      }
    }
  }
  *why = absl::StrCat("auto: copy-engine pieces of ", Bytes(ce_piece),
                      "; no larger blocks to stage and MPS not active (the SM copy path would "
                      "time-slice against the worker)");
  return use(CudaPath::kCopyEngine, nullptr);
}

absl::StatusOr<void*> CudaEngine::UploadDescriptors(Lane* lane, cudaStream_t stream,
                                                    const void* data, size_t bytes,
                                                    std::vector<void*>* scratch) {
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

template <typename LayerDone>
absl::Status CudaEngine::EnqueueSmCopy(Lane* lane, const TransferJob& job,
                                       std::vector<void*>* scratch, LayerDone&& layer_done) {
  // No plan: a job of no rows, which only records its events.
  static const JobSmCopyPlan kNoRows;
  const auto& plan =
      job.plan == nullptr ? kNoRows : *static_cast<const JobSmCopyPlan*>(job.plan.get());
  // Each part's descriptors, uploaded once for every layer.
  std::vector<const CopyTile*> tiles(job.parts.size(), nullptr);
  absl::Status status;
  for (size_t j = 0; j < plan.parts.size() && status.ok(); ++j) {
    const SmCopyPlan& part_plan = plan.parts[j];
    if (part_plan.tiles.empty()) continue;
    absl::StatusOr<void*> uploaded =
        UploadDescriptors(lane, lane->stream, part_plan.tiles.data(),
                          part_plan.tiles.size() * sizeof(CopyTile), scratch);
    if (!uploaded.ok()) {
      status = uploaded.status();
    } else {
      tiles[j] = static_cast<const CopyTile*>(*uploaded);
    }
  }
  CopyKernelArgs args;
  args.to_device = job.direction == Direction::kLoad;
  const uint64_t layers = job.layer_num();
  for (size_t i = 0; i < layers && status.ok(); ++i) {
    // Per part, one launch per group (one for MHA's K and V) where the part
    // holds the layer; a layer no part holds only records its events.
    for (size_t j = 0; j < job.parts.size() && status.ok(); ++j) {
      const JobPart& part = job.parts[j];
      const JobLayer& layer = part.layers[i];
      if (layer.host_layer < 0 || j >= plan.parts.size()) continue;
      const auto& mapping = static_cast<const Mapping&>(*part.mapping);
      const SmCopyPlan& part_plan = plan.parts[j];
      args.device_layers_per_plane = static_cast<uint32_t>(mapping.layer_num());
      for (size_t k = 0; k < part_plan.launches.size(); ++k) {
        const TileLaunch& launch = part_plan.launches[k];
        const LayoutGroup& group = mapping.groups()[launch.group];
        args.layout = group.layout;
        args.device_layers = mapping.layer_table(group);
        args.device_layer_delta =
            static_cast<int32_t>(int64_t{layer.device_layer} - layer.host_layer);
        args.other = part.pool->region_base(group.region) + group.region_offset;
        args.aligned16 = mapping.aligned16() && reinterpret_cast<uintptr_t>(args.other) % 16 == 0;
        args.tiles = tiles[j] + launch.tile_begin;
        args.tile_count = static_cast<uint32_t>(launch.tile_end - launch.tile_begin);
        args.item_count = launch.items;
        args.layer_shift = static_cast<uint32_t>(layer.host_layer);
        if (cudaError_t e = LaunchCopyKernel(args, options_.sm_blocks, lane->stream);
            e != cudaSuccess) {
          status = absl::InternalError(absl::StrCat(
              DirectionName(job.direction), " layer ", i,
              job.parts.size() > 1 ? absl::StrCat(" of pool '", part.pool->name(), "'") : "",
              ": SM copy kernel: ", CudaError(e)));
          break;
        }
      }
    }
    if (status.ok()) status = layer_done(i);
  }
  for (const CopyTile* s : tiles) {
    if (s != nullptr) cudaFreeAsync(const_cast<CopyTile*>(s), lane->stream);
  }
  return status;
}

absl::Status CudaEngine::EnqueueStaged(Lane* lane, const TransferJob& job,
                                       std::vector<void*>* scratch) {
  // No plan: a job of no rows. No chunks: no layer held. Nothing to copy.
  if (job.plan == nullptr) return absl::OkStatus();
  const auto& plan = *static_cast<const JobStagedPlan*>(job.plan.get());
  if (plan.chunks() == 0) return absl::OkStatus();
  const bool backup = job.direction == Direction::kBackup;
  const uint64_t chunk_bytes = StagingChunk(options_.staging_bytes);
  if (lane->staging == nullptr) {
    if (cudaError_t e = cudaMalloc(&lane->staging, 2 * chunk_bytes); e != cudaSuccess) {
      cudaGetLastError();
      lane->staging = nullptr;
      return absl::ResourceExhaustedError(absl::StrCat(
          "GPU ", lane->gpu, ": the staging buffer (--staging-bytes=", options_.staging_bytes,
          ") cannot be allocated: ", CudaError(e)));
    }
    spdlog::info("GPU {}: {} staging buffer of {} up", lane->gpu, DirectionName(lane->direction),
                 Bytes(2 * chunk_bytes));
  }
  cudaStream_t copies = lane->stream;
  cudaStream_t kernels = lane->kernel_stream;
  cudaError_t e = cudaSuccess;
  const char* step = "";
  auto ok = [&](cudaError_t result, const char* what) {
    if (e == cudaSuccess && result != cudaSuccess) {
      e = result;
      step = what;
    }
    return e == cudaSuccess;
  };
  auto failed = [&]() {
    cudaGetLastError();
    return absl::InternalError(
        absl::StrCat(DirectionName(job.direction), " (staged): ", step, ": ", CudaError(e)));
  };
  // The kernels start after everything before this job on the lane (the
  // worker's event for a backup, earlier loads of the same rows).
  if (!ok(cudaEventRecord(lane->stage_start, copies), "cudaEventRecord") ||
      !ok(cudaStreamWaitEvent(kernels, lane->stage_start, 0), "cudaStreamWaitEvent")) {
    return failed();
  }
  const int blocks = options_.staged_blocks > 0 ? options_.staged_blocks
                                                : 4 * gpus_[static_cast<size_t>(lane->gpu)].sms;
  absl::Status status;
  // Chunks over every range, alternating halves of the staging buffer.
  size_t chunk_count = 0;
  // One part's held host layer range (a plain attachment's job has one).
  auto run_range = [&](const StagedRange& range) {
    const JobPart& part = job.parts[range.part];
    const auto& mapping = static_cast<const Mapping&>(*part.mapping);
    const StagedPlan& p = range.plan;
    if (p.chunks.empty()) return;
    absl::StatusOr<void*> tiles = UploadDescriptors(lane, kernels, p.tiles.data(),
                                                    p.tiles.size() * sizeof(CopyTile), scratch);
    if (!tiles.ok()) {
      status = tiles.status();
      return;
    }
    CopyKernelArgs args;
    args.device_layers_per_plane = static_cast<uint32_t>(mapping.layer_num());
    args.device_layer_delta = static_cast<int32_t>(range.delta);
    args.to_device = !backup;
    args.aligned16 = mapping.aligned16();
    const Pool& pool = *part.pool;
    const auto* uploaded = static_cast<const CopyTile*>(*tiles);
    // The chunk's kernels, one per group in it (one for MHA's K and V).
    auto launch_chunk = [&](const StagedChunk& chunk, const char* what) {
      for (size_t k = chunk.launch_begin; k < chunk.launch_end; ++k) {
        const TileLaunch& launch = p.launches[k];
        const LayoutGroup& group = mapping.groups()[launch.group];
        args.layout = group.layout;
        args.device_layers = mapping.layer_table(group);
        args.tiles = uploaded + launch.tile_begin;
        args.tile_count = static_cast<uint32_t>(launch.tile_end - launch.tile_begin);
        args.item_count = launch.items;
        if (!ok(LaunchCopyKernel(args, blocks, kernels), what)) return;
      }
    };
    for (size_t i = 0; i < p.chunks.size() && status.ok(); ++i) {
      const StagedChunk& chunk = p.chunks[i];
      const int b = static_cast<int>(chunk_count++ % 2);
      uint8_t* const half = lane->staging + b * chunk_bytes;
      const size_t n = chunk.copy_end - chunk.copy_begin;
      lane->dsts.resize(n);
      lane->srcs.resize(n);
      lane->sizes.resize(n);
      for (size_t k = 0; k < n; ++k) {
        const StagedCopy& c = p.copies[chunk.copy_begin + k];
        void* const h = pool.region_base(c.region) + c.host_offset;
        void* const d = half + c.staging_offset;
        lane->dsts[k] = backup ? h : d;
        lane->srcs[k] = backup ? d : h;
        lane->sizes[k] = static_cast<size_t>(c.bytes);
      }
      args.other = half;
      const std::string what = absl::StrCat(
          DirectionName(job.direction), " chunk ", i, " of ", p.chunks.size(),
          job.parts.size() > 1 ? absl::StrCat(" of pool '", pool.name(), "'") : "", " (staged)");
      // Backup: gather (kernel stream) -> copy out (copy stream); load: copy
      // in -> scatter. Half b is refilled only after its last consumer.
      cudaStream_t first = backup ? kernels : copies;
      cudaStream_t second = backup ? copies : kernels;
      if (!ok(cudaStreamWaitEvent(first, lane->half_free[b], 0), "cudaStreamWaitEvent")) break;
      if (backup) {
        launch_chunk(chunk, "gather kernel");
      } else {
        status = SubmitCopies(lane, copies, n, what);
      }
      if (!status.ok() || !ok(cudaEventRecord(lane->half_ready[b], first), "cudaEventRecord") ||
          !ok(cudaStreamWaitEvent(second, lane->half_ready[b], 0), "cudaStreamWaitEvent")) {
        break;
      }
      if (backup) {
        status = SubmitCopies(lane, copies, n, what);
      } else {
        launch_chunk(chunk, "scatter kernel");
      }
      if (!status.ok()) break;
      ok(cudaEventRecord(lane->half_free[b], second), "cudaEventRecord");
    }
    cudaFreeAsync(*tiles, kernels);
  };
  for (size_t r = 0; r < plan.ranges.size() && status.ok() && e == cudaSuccess; ++r) {
    run_range(plan.ranges[r]);
  }
  if (!status.ok()) return status;
  // Whatever follows on the copy stream (this job's layer events, the next
  // job) comes after the last kernel.
  ok(cudaEventRecord(lane->stage_end, kernels), "cudaEventRecord");
  ok(cudaStreamWaitEvent(copies, lane->stage_end, 0), "cudaStreamWaitEvent");
  return e == cudaSuccess ? absl::OkStatus() : failed();
}

absl::Status CudaEngine::Prepare(TransferJob* job) {
  const auto& mapping = static_cast<const Mapping&>(*job->mapping);
  const bool has_wait = job->direction == Direction::kBackup && !job->wait_event_handle.empty();
  if (has_wait && job->wait_event_handle.size() != sizeof(cudaIpcEventHandle_t)) {
    return absl::InvalidArgumentError(
        absl::StrCat("wait_event_handle has ", job->wait_event_handle.size(),
                     " bytes; a cudaIpcEventHandle_t has ", sizeof(cudaIpcEventHandle_t)));
  }
  job->path = static_cast<uint8_t>(options_.path == CudaPath::kAuto ? CudaPath::kCopyEngine
                                                                    : options_.path);
  // Finishes at once, copies nothing.
  if (job->tokens() == 0) return absl::OkStatus();
  std::string why;
  if (absl::Status s = ChoosePath(job, &why); !s.ok()) return s;
  if (mapping.PathChanged(job->direction, job->path)) {
    spdlog::info("{} on GPU {}: {}s by {} ({})", PoolsOf(*job), mapping.gpu(),
                 DirectionName(job->direction), PathFor(*job), why);
  } else {
    spdlog::debug("{} on GPU {}: {} by {} ({})", PoolsOf(*job), mapping.gpu(),
                  DirectionName(job->direction), PathFor(*job), why);
  }
  if (job->direction == Direction::kLoad) {
    absl::StatusOr<int> set = mapping.AcquireSet();
    if (!set.ok()) return set.status();
    job->event_set = *set;
    return absl::OkStatus();
  }
  if (!has_wait) return absl::OkStatus();
  if (cudaError_t e = cudaSetDevice(mapping.gpu()); e != cudaSuccess) {
    cudaGetLastError();
    return absl::InternalError(absl::StrCat("cudaSetDevice(", mapping.gpu(), "): ", CudaError(e)));
  }
  cudaIpcEventHandle_t handle;
  std::memcpy(&handle, job->wait_event_handle.data(), sizeof(handle));
  cudaEvent_t event = nullptr;
  if (cudaError_t e = cudaIpcOpenEventHandle(&event, handle); e != cudaSuccess) {
    cudaGetLastError();
    return absl::InvalidArgumentError(absl::StrCat(
        "wait_event_handle: cudaIpcOpenEventHandle failed: ", CudaError(e),
        "; the handle must come from cudaIpcGetEventHandle on a live event of another process, "
        "created with cudaEventInterprocess | cudaEventDisableTiming"));
  }
  // Opened per request and closed when the job goes (after its ticket
  // finished): a worker may pass a different event each time, and an open
  // handle costs little next to a backup.
  job->wait_event = std::shared_ptr<void>(static_cast<void*>(event), [](void* p) {
    cudaEventDestroy(static_cast<cudaEvent_t>(p));
    cudaGetLastError();
  });
  return absl::OkStatus();
}

void CudaEngine::Submit(TransferJob job) {
  // Every mapping this engine sees is one it opened.
  const auto& mapping = static_cast<const Mapping&>(*job.mapping);
  Lane* lane = mapping.lanes() + (job.direction == Direction::kLoad ? 1 : 0);
  // One completion event per ticket layer, held or not.
  const size_t layers = job.layer_num();
  Pending pending;
  pending.job = std::move(job);

  // Events are recycled by the completion thread; new ones are made only
  // when more layers are in flight than ever before.
  {
    absl::MutexLock lock(&lane->mu);
    while (pending.events.size() < layers && !lane->free_events.empty()) {
      pending.events.push_back(lane->free_events.back());
      lane->free_events.pop_back();
    }
  }
  cudaError_t e = cudaSetDevice(lane->gpu);
  while (e == cudaSuccess && pending.events.size() < layers) {
    cudaEvent_t event = nullptr;
    // Blocking sync: the completion threads sleep instead of spinning a core
    // each while copies run.
    e = cudaEventCreateWithFlags(&event, cudaEventDisableTiming | cudaEventBlockingSync);
    if (e == cudaSuccess) pending.events.push_back(event);
  }
  if (e != cudaSuccess) {
    cudaGetLastError();
    pending.error = absl::InternalError(absl::StrCat("preparing ", DirectionName(lane->direction),
                                                     " on GPU ", lane->gpu, ": ", CudaError(e)));
  }
  if (lane->gate_stream != nullptr && pending.job.event_set >= 0) {
    // The RPC returns once the load events are recorded; the enqueue
    // thread queues the copies. Loads of a lane are all gated, so the queue
    // keeps their order.
    absl::MutexLock gate_lock(&lane->gate_mu);
    if (pending.error.ok()) pending.error = OpenGates(lane, &pending);
    absl::MutexLock lock(&lane->mu);
    lane->to_enqueue.push_back(std::move(pending));
    return;
  }
  absl::MutexLock submit_lock(&lane->submit_mu);
  EnqueueWork(lane, &pending);
  absl::MutexLock lock(&lane->mu);
  lane->pending.push_back(std::move(pending));
}

absl::Status CudaEngine::OpenGates(Lane* lane, Pending* pending) {
  const auto& mapping = static_cast<const Mapping&>(*pending->job.mapping);
  const uint64_t layers = pending->job.layer_num();
  const int set = pending->job.event_set;
  const StreamMemOps ops = *StreamMemOpsFns();  // present: gate_stream exists
  pending->gate_base = mapping.TakeGateRange(set, layers);
  pending->gated = true;
  for (uint64_t layer = 0; layer < layers; ++layer) {
    if (CUresult r = ops.wait(lane->gate_stream, mapping.gate(set), pending->gate_base + layer + 1,
                              CU_STREAM_WAIT_VALUE_GEQ);
        r != CUDA_SUCCESS) {
      // Open the gate fully, so that later loads behind it are not stuck.
      ops.write(lane->gate_stream, mapping.gate(set), pending->gate_base + layers, 0);
      return absl::InternalError(absl::StrCat("load gate wait for layer ", layer,
                                              ": cuStreamWaitValue64: ", static_cast<int>(r)));
    }
    if (cudaError_t e = cudaEventRecord(mapping.load_event(set, layer), lane->gate_stream);
        e != cudaSuccess) {
      cudaGetLastError();
      ops.write(lane->gate_stream, mapping.gate(set), pending->gate_base + layers, 0);
      return absl::InternalError(
          absl::StrCat("cudaEventRecord of load event [", set, "][", layer, "]: ", CudaError(e)));
    }
  }
  return absl::OkStatus();
}

void CudaEngine::EnqueueLoop(Lane* lane) {
  cudaSetDevice(lane->gpu);
  while (true) {
    Pending pending;
    {
      absl::MutexLock lock(&lane->mu);
      auto ready = [lane]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(lane->mu) {
        return !lane->to_enqueue.empty() || lane->stopping;
      };
      lane->mu.Await(absl::Condition(&ready));
      if (lane->to_enqueue.empty()) return;  // stopping, nothing left
      pending = std::move(lane->to_enqueue.front());
      lane->to_enqueue.pop_front();
      lane->enqueuing = true;
    }
    {
      absl::MutexLock submit_lock(&lane->submit_mu);
      EnqueueWork(lane, &pending);
    }
    absl::MutexLock lock(&lane->mu);
    lane->pending.push_back(std::move(pending));
    lane->enqueuing = false;
  }
}

void CudaEngine::EnqueueWork(Lane* lane, Pending* p) {
  Pending& pending = *p;
  const auto& mapping = static_cast<const Mapping&>(*pending.job.mapping);
  const uint64_t layers = pending.job.layer_num();  // ticket layers
  cudaError_t e = cudaSuccess;
  if (pending.error.ok() && pending.job.wait_event != nullptr) {
    // The worker's record precedes this request, so the wait covers the
    // writes it asked us to back up.
    if (e = cudaStreamWaitEvent(lane->stream,
                                static_cast<cudaEvent_t>(pending.job.wait_event.get()), 0);
        e != cudaSuccess) {
      cudaGetLastError();
      pending.error = absl::InternalError(
          absl::StrCat("backup on GPU ", lane->gpu,
                       ": cudaStreamWaitEvent on the worker's event: ", CudaError(e)));
    }
  }
  const int set = pending.job.event_set;
  const StreamMemOps ops = pending.gated ? *StreamMemOpsFns() : StreamMemOps();
  // After a layer's copies or kernel: the worker's view of it (its gate, or
  // its load event, before the completion event so that a waiting forward
  // pass is released as early as possible), then ours.
  auto layer_done = [&](uint64_t layer) -> absl::Status {
    if (pending.gated) {
      if (CUresult r = ops.write(lane->stream, mapping.gate(set), pending.gate_base + layer + 1, 0);
          r != CUDA_SUCCESS) {
        return absl::InternalError(absl::StrCat("opening the load gate of layer ", layer,
                                                ": cuStreamWriteValue64: ", static_cast<int>(r)));
      }
    } else if (set >= 0) {
      if (e = cudaEventRecord(mapping.load_event(set, layer), lane->stream); e != cudaSuccess) {
        cudaGetLastError();
        return absl::InternalError(
            absl::StrCat("cudaEventRecord of load event [", set, "][", layer, "]: ", CudaError(e)));
      }
    }
    if (e = cudaEventRecord(pending.events[layer], lane->stream); e != cudaSuccess) {
      cudaGetLastError();
      return absl::InternalError(
          absl::StrCat("cudaEventRecord after layer ", layer, ": ", CudaError(e)));
    }
    ++pending.layers_enqueued;
    return absl::OkStatus();
  };
  if (pending.error.ok()) {
    absl::Status s;
    switch (static_cast<CudaPath>(pending.job.path)) {
      case CudaPath::kSm:
        s = EnqueueSmCopy(lane, pending.job, &pending.scratch, layer_done);
        break;
      case CudaPath::kStaged:
        // Every layer is complete only after the last chunk.
        s = EnqueueStaged(lane, pending.job, &pending.scratch);
        for (uint64_t layer = 0; s.ok() && layer < layers; ++layer) s = layer_done(layer);
        break;
      case CudaPath::kAuto:
      case CudaPath::kCopyEngine:
        for (uint64_t layer = 0; s.ok() && layer < layers; ++layer) {
          s = EnqueueCopyEngineLayer(lane, pending.job, layer);
          if (s.ok()) s = layer_done(layer);
        }
        break;
    }
    if (!s.ok()) {
      // Part of the work may be on the streams with no event after it: wait
      // for them, so the buffers outlive every copy that uses them.
      cudaStreamSynchronize(lane->kernel_stream);
      cudaStreamSynchronize(lane->stream);
      cudaGetLastError();
      pending.error = s;
    }
  }
  if (pending.gated && pending.layers_enqueued < layers) {
    // A failed load still opens its gates (the ticket carries the error), or
    // every later load of the lane would wait behind them forever.
    ops.write(lane->stream, mapping.gate(set), pending.gate_base + layers, 0);
    cudaStreamSynchronize(lane->stream);
    cudaGetLastError();
  }
}

void CudaEngine::CompleteLoop(Lane* lane) {
  cudaSetDevice(lane->gpu);
  while (true) {
    Pending pending;
    {
      absl::MutexLock lock(&lane->mu);
      auto ready = [lane]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(lane->mu) {
        return !lane->pending.empty() || lane->stopping;
      };
      lane->mu.Await(absl::Condition(&ready));
      if (lane->pending.empty()) return;  // stopping, nothing left
      pending = std::move(lane->pending.front());
      lane->pending.pop_front();
      lane->busy = true;
    }
    absl::Status status = pending.error;
    bool events_ok = true;
    for (uint64_t layer = 0; layer < pending.layers_enqueued; ++layer) {
      if (cudaError_t e = cudaEventSynchronize(pending.events[layer]); e != cudaSuccess) {
        cudaGetLastError();
        status =
            absl::InternalError(absl::StrCat(DirectionName(lane->direction), " on GPU ", lane->gpu,
                                             " failed in layer ", layer, ": ", CudaError(e)));
        events_ok = false;
        break;
      }
      pending.job.ticket->LayerDone(TicketLayerBytes(pending.job, layer));
    }
    if (!events_ok) {
      // The copies may still be running after a failed wait (the context is
      // likely lost too): let the stream drain before the buffers can go.
      cudaStreamSynchronize(lane->stream);
      cudaGetLastError();
    }
    // The set is free before the ticket says so: a worker that waited for
    // the ticket may load again at once on a one-set ring. Every record of
    // the set is complete here (its layers' copies are), so a new load may
    // record the set again.
    if (pending.job.event_set >= 0) {
      static_cast<const Mapping&>(*pending.job.mapping).ReleaseSet(pending.job.event_set);
    }
    pending.job.ticket->Finish(status);
    std::vector<cudaEvent_t> events = std::move(pending.events);
    std::vector<void*> scratch = std::move(pending.scratch);
    // Dropping the job may close the mapping (a detached attachment's last
    // job) and unpin its pool; done here, not in a CUDA callback, since that
    // calls CUDA. The mappings go before the pools they pinned, whatever
    // TransferJob's member order: the attachment's (a group's keeps its
    // entries', whose pools job.group still holds), then each part's, then the
    // rest with the pools.
    pending.job.mapping.reset();
    for (JobPart& part : pending.job.parts) part.mapping.reset();
    pending = Pending();
    absl::MutexLock lock(&lane->mu);
    if (events_ok) {
      lane->free_events.insert(lane->free_events.end(), events.begin(), events.end());
    } else {
      for (cudaEvent_t event : events) cudaEventDestroy(event);
    }
    for (void* buffer : scratch) {
      if (lane->free_scratch.size() < kMaxFreeScratch) {
        lane->free_scratch.push_back(buffer);
      } else {
        cudaFreeHost(buffer);
      }
    }
    lane->busy = false;
  }
}

void CudaEngine::Drain() {
  std::vector<Lane*> lanes;
  {
    absl::MutexLock lock(&lanes_mu_);
    for (const auto& pair : lanes_) {
      if (pair != nullptr) {
        lanes.push_back(&pair[0]);
        lanes.push_back(&pair[1]);
      }
    }
  }
  for (Lane* lane : lanes) {
    // A Submit in progress finishes enqueueing first.
    { absl::MutexLock submit_lock(&lane->submit_mu); }
    absl::MutexLock lock(&lane->mu);
    auto idle = [lane]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(lane->mu) {
      return lane->to_enqueue.empty() && !lane->enqueuing && lane->pending.empty() && !lane->busy;
    };
    lane->mu.Await(absl::Condition(&idle));
  }
}

}  // namespace kvhost
