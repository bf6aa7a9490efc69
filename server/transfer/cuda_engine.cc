// The CUDA engine's implementation (contract: cuda_engine.h; its rooms are
// under cuda/).
#include "server/transfer/cuda_engine.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <thread>
#include <utility>
#include <variant>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/bytes.h"
#include "common/cuda_util.h"
#include "server/transfer/cuda/job_plan.h"
#include "server/transfer/cuda/mapping.h"
#include "server/transfer/cuda/paths.h"
#include "spdlog/spdlog.h"

namespace kvhost {
namespace {

// "pool 'a'", or "pools 'a', 'b'" for a pool group's job, for the log.
std::string PoolsOf(const TransferJob& job) {
  std::vector<std::string> names;
  for (const JobPart& part : job.parts) names.push_back(absl::StrCat("'", part.pool->name(), "'"));
  return absl::StrCat(names.size() == 1 ? "pool " : "pools ", absl::StrJoin(names, ", "));
}

// The plan Prepare put in `job`; every job this engine sees went through
// its Prepare, so a job without one is a bug, answered with the copy
// engines' empty plan rather than a crash.
const CudaJobPlan& PlanOf(const TransferJob& job) {
  static const CudaJobPlan kNone;
  const auto* plan = std::any_cast<std::shared_ptr<const CudaJobPlan>>(&job.plan);
  return plan != nullptr && *plan != nullptr ? **plan : kNone;
}

}  // namespace

absl::StatusOr<std::unique_ptr<CudaEngine>> CudaEngine::Create(CudaEngineOptions options) {
  absl::StatusOr<std::vector<GpuInfo>> gpus = ProbeCudaGpus();
  if (!gpus.ok()) return gpus.status();
  options.max_batch = std::max<size_t>(options.max_batch, 1);
  options.sm_blocks = std::max(options.sm_blocks, 1);
  options.copy_streams = std::max(options.copy_streams, 1);
  options.staging_bytes = std::max<uint64_t>(options.staging_bytes, 512);
  return std::unique_ptr<CudaEngine>(new CudaEngine(options, *std::move(gpus)));
}

CudaEngine::CudaEngine(CudaEngineOptions options, std::vector<GpuInfo> gpus)
    : options_(options),
      gpus_(std::move(gpus)),
      pins_(std::make_shared<HostPins>(options_.host_register_chunk)),
      copier_(options_) {
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
      CudaLane& lane = lanes_[d][i];
      {
        absl::MutexLock lane_lock(&lane.mu);
        lane.stopping = true;
      }
      if (lane.enqueuer.joinable()) lane.enqueuer.join();
      lane.completer.join();
      DestroyLane(&lane);
    }
  }
}

std::string CudaEngine::Describe() const {
  std::vector<std::string> parts;
  for (const GpuInfo& d : gpus_) parts.push_back(absl::StrCat(d.ordinal, " ", d.name, " ", d.uuid));
  return absl::StrCat(
      gpus_.size(), " GPU(s): ", absl::StrJoin(parts, ", "), "; copies by ", BatchCopier::Api(),
      " on ", options_.copy_streams, " stream(s) per direction; transfer path ",
      CudaPathName(options_.path), ", staging ", FormatBytes(options_.staging_bytes),
      " per stream, SM copy path grid <= ", options_.sm_blocks, " blocks; ", mps_detail_);
}

std::string CudaEngine::PathFor(const TransferJob& job) const {
  return CudaPathName(PlanOf(job).path);
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
    if (const auto* m = dynamic_cast<const CudaMapping*>(entries[i].get()); m != nullptr) {
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
        std::make_unique<CudaMapping>(std::move(entries), layer_num, -1, nullptr));
  }
  absl::StatusOr<CudaLane*> lanes = LanesFor(gpu);
  if (!lanes.ok()) return lanes.status();
  if (cudaError_t e = cudaSetDevice(gpu); e != cudaSuccess) {
    cudaGetLastError();
    return absl::InternalError(absl::StrCat("cudaSetDevice(", gpu, "): ", CudaError(e)));
  }
  // On error, `mapping` destroys the events it made.
  auto mapping = std::make_unique<CudaMapping>(std::move(entries), layer_num, gpu, *lanes);
  if (absl::Status s = mapping->CreateLoadEvents(load_event_sets, layer_num); !s.ok()) return s;
  return std::unique_ptr<DeviceMapping>(std::move(mapping));
}

absl::StatusOr<CudaLane*> CudaEngine::LanesFor(int gpu) {
  absl::MutexLock lock(&lanes_mu_);
  std::unique_ptr<CudaLane[]>& lanes = lanes_[static_cast<size_t>(gpu)];
  if (lanes != nullptr) return lanes.get();
  if (cudaError_t e = cudaSetDevice(gpu); e != cudaSuccess) {
    cudaGetLastError();
    return absl::InternalError(absl::StrCat("cudaSetDevice(", gpu, "): ", CudaError(e)));
  }
  absl::StatusOr<std::unique_ptr<CudaLane[]>> created = CreateGpuLanes(gpu, options_);
  if (!created.ok()) return created.status();
  for (int i = 0; i < 2; ++i) {
    CudaLane* lane = &(*created)[i];
    lane->completer = std::thread([this, lane] { CompleteLoop(lane); });
    // Loads that return before they are queued (with layer progress) are
    // queued by this thread.
    if (lane->direction == Direction::kLoad) {
      lane->enqueuer = std::thread([this, lane] { EnqueueLoop(lane); });
    }
  }
  spdlog::info("GPU {} is {} ({})", gpu, gpus_[static_cast<size_t>(gpu)].name,
               gpus_[static_cast<size_t>(gpu)].uuid);
  lanes = *std::move(created);
  return lanes.get();
}

absl::StatusOr<int> CudaEngine::AttachGpu(const ResolvedAttach& attach) const {
  int gpu = -1;
  std::string first_where;
  auto check = [&](const DeviceBufferRef& ref, const std::string& where) -> absl::Status {
    if (ref.kind == DeviceBufferRef::Kind::kShm) {
      return absl::FailedPreconditionError(
          absl::StrCat(where,
                       " is a shared-memory buffer, but this daemon runs the cuda backend "
                       "(send CUDA IPC buffers, or start kvhostd with --backend=host)"));
    }
    if (ref.kind == DeviceBufferRef::Kind::kCuda &&
        ref.ipc_handle.size() != sizeof(cudaIpcMemHandle_t)) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": ipc_handle has ", ref.ipc_handle.size(),
                       " bytes; a cudaIpcMemHandle_t has ", sizeof(cudaIpcMemHandle_t)));
    }
    const std::string canonical = CanonicalGpuUuid(ref.gpu_uuid);
    if (canonical.empty()) {
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
  return gpu;
}

absl::StatusOr<std::unique_ptr<DeviceMapping>> CudaEngine::Open(const Pool& pool,
                                                                const ResolvedAttach& attach) {
  // Everything that needs no CUDA call is checked first.
  absl::StatusOr<int> attach_gpu = AttachGpu(attach);
  if (!attach_gpu.ok()) return attach_gpu.status();
  const int gpu = *attach_gpu;
  absl::StatusOr<CudaLane*> lanes = LanesFor(gpu);
  if (!lanes.ok()) return lanes.status();
  if (cudaError_t e = cudaSetDevice(gpu); e != cudaSuccess) {
    cudaGetLastError();
    return absl::InternalError(absl::StrCat("cudaSetDevice(", gpu, "): ", CudaError(e)));
  }
  // On any error below, `mapping` closes what it opened and unpins.
  auto mapping = std::make_unique<CudaMapping>(pool, attach, gpu, *lanes);
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

JobPlanInputs CudaEngine::PlanInputs(const TransferJob& job) const {
  JobPlanInputs in;
  in.policy.forced = options_.path;
  in.policy.ce_min_piece_bytes = options_.ce_min_piece_bytes;
  in.mps = mps_;
  in.host_pointer_ok = true;
  for (const JobPart& part : job.parts) {
    in.host_pointer_ok =
        in.host_pointer_ok && static_cast<const CudaMapping&>(*part.mapping).host_pointer_ok();
  }
  in.staging_chunk = StagingChunk(options_.staging_bytes);
  in.host_split = pins_->chunk();
  // A worker that waits layer by layer gets its first layers early.
  in.layer_ordered = job.direction == Direction::kLoad && job.layer_counters != nullptr;
  return in;
}

absl::Status CudaEngine::Prepare(TransferJob* job) {
  const auto& mapping = static_cast<const CudaMapping&>(*job->mapping);
  const bool has_wait = !job->wait_event_handle.empty();
  if (has_wait && job->wait_event_handle.size() != sizeof(cudaIpcEventHandle_t)) {
    return absl::InvalidArgumentError(
        absl::StrCat("wait_event_handle has ", job->wait_event_handle.size(),
                     " bytes; a cudaIpcEventHandle_t has ", sizeof(cudaIpcEventHandle_t)));
  }
  // A job of no rows finishes at once and copies nothing; its path is the
  // forced one, or the copy engines.
  auto plan = std::make_shared<CudaJobPlan>();
  plan->path = options_.path == CudaPath::kAuto ? CudaPath::kCopyEngine : options_.path;
  job->plan = std::shared_ptr<const CudaJobPlan>(plan);
  if (job->tokens() == 0) return absl::OkStatus();
  absl::StatusOr<CudaJobPlan> planned = PlanJob(*job, PlanInputs(*job));
  if (!planned.ok()) return planned.status();
  *plan = *std::move(planned);
  if (mapping.PathChanged(job->direction, static_cast<uint8_t>(plan->path))) {
    spdlog::info("{} on GPU {}: {}s by {} ({})", PoolsOf(*job), mapping.gpu(),
                 DirectionName(job->direction), PathFor(*job), plan->why);
  } else {
    spdlog::debug("{} on GPU {}: {} by {} ({})", PoolsOf(*job), mapping.gpu(),
                  DirectionName(job->direction), PathFor(*job), plan->why);
  }
  if (has_wait) {
    if (absl::Status s = OpenWaitEvent(mapping, job); !s.ok()) return s;
  }
  // Last, since only the job's end gives the set back. Every load takes
  // one; a backup only with layer progress, whose worker waits on its last
  // layer's event to learn the backup finished.
  if (job->direction == Direction::kLoad || job->layer_counters != nullptr) {
    absl::StatusOr<int> set = mapping.AcquireSet();
    if (!set.ok()) return set.status();  // job->wait_event closes with the job
    job->event_set = *set;
  }
  return absl::OkStatus();
}

absl::Status CudaEngine::OpenWaitEvent(const CudaMapping& mapping, TransferJob* job) {
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
  const auto& mapping = static_cast<const CudaMapping&>(*job.mapping);
  CudaLane* lane = mapping.lanes() + (job.direction == Direction::kLoad ? 1 : 0);
  // One completion event per ticket layer, held or not.
  const size_t layers = job.layer_num();
  CudaPending pending;
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
  // Loads whose worker waits on the layer counters
  // (AttachDeviceRequest.layer_progress) go to the lane's enqueue thread:
  // the RPC returns at once, the thread queues layer by layer and publishes
  // each layer once its load event is recorded, so the worker's first layer
  // is on its way while the rest are being queued. Loads of one attachment
  // all take the same route, so each attachment's loads keep their order.
  // A backup with layer counters is queued here, publishing the same way:
  // its worker waits for its last layer, which a hop to another thread
  // would only delay, so its counters are complete when the RPC returns.
  if (pending.job.direction == Direction::kLoad && pending.job.event_set >= 0 &&
      pending.job.layer_counters != nullptr) {
    absl::MutexLock lock(&lane->mu);
    lane->to_enqueue.push_back(std::move(pending));
    return;
  }
  absl::MutexLock submit_lock(&lane->submit_mu);
  EnqueueWork(lane, &pending);
  absl::MutexLock lock(&lane->mu);
  lane->pending.push_back(std::move(pending));
}

void CudaEngine::EnqueueLoop(CudaLane* lane) {
  cudaSetDevice(lane->gpu);
  while (true) {
    CudaPending pending;
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

void CudaEngine::EnqueueWork(CudaLane* lane, CudaPending* p) {
  CudaPending& pending = *p;
  const auto& mapping = static_cast<const CudaMapping&>(*pending.job.mapping);
  const uint64_t layers = pending.job.layer_num();  // ticket layers
  cudaError_t e = cudaSuccess;
  if (pending.error.ok() && pending.job.wait_event != nullptr) {
    // The worker's record precedes this request, so the wait covers the
    // writes it asked us to back up, or the work a load must follow.
    if (e = cudaStreamWaitEvent(lane->stream,
                                static_cast<cudaEvent_t>(pending.job.wait_event.get()), 0);
        e != cudaSuccess) {
      cudaGetLastError();
      pending.error = absl::InternalError(
          absl::StrCat(DirectionName(pending.job.direction), " on GPU ", lane->gpu,
                       ": cudaStreamWaitEvent on the worker's event: ", CudaError(e)));
    }
  }
  const int set = pending.job.event_set;
  // After a layer's copies or kernel: the worker's view of it (its load
  // event, before the completion event so that a waiting forward pass, or
  // a backup's waiting stream, is released as early as possible), then ours.
  const LayerEnqueued layer_enqueued = [&](uint64_t layer) -> absl::Status {
    if (set >= 0) {
      if (e = cudaEventRecord(mapping.load_event(set, layer), lane->stream); e != cudaSuccess) {
        cudaGetLastError();
        return absl::InternalError(
            absl::StrCat("cudaEventRecord of load event [", set, "][", layer, "]: ", CudaError(e)));
      }
      if (pending.job.layer_counters != nullptr) {
        pending.job.layer_counters->Publish(static_cast<uint32_t>(set), pending.job.layer_base,
                                            static_cast<uint32_t>(layer));
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
    const CudaJobPlan& plan = PlanOf(pending.job);
    const PathContext context{&options_, &gpus_[static_cast<size_t>(lane->gpu)], pins_->chunk(),
                              &copier_};
    switch (plan.path) {
      case CudaPath::kSm:
        s = EnqueueSmCopy(context, lane, pending.job, std::get_if<SmCopyJobPlan>(&plan.detail),
                          &pending.scratch, layer_enqueued);
        break;
      case CudaPath::kStaged: {
        // The layers its ranges do not complete are complete after the last.
        absl::StatusOr<uint64_t> reported =
            EnqueueStaged(context, lane, pending.job, std::get_if<StagedJobPlan>(&plan.detail),
                          &pending.scratch, layer_enqueued);
        s = reported.status();
        for (uint64_t layer = reported.ok() ? *reported : 0; s.ok() && layer < layers; ++layer) {
          s = layer_enqueued(layer);
        }
        break;
      }
      case CudaPath::kAuto:
      case CudaPath::kCopyEngine:
        for (uint64_t layer = 0; s.ok() && layer < layers; ++layer) {
          s = EnqueueCopyEngineLayer(context, lane, pending.job, layer);
          if (s.ok()) s = layer_enqueued(layer);
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
}

void CudaEngine::CompleteLoop(CudaLane* lane) {
  cudaSetDevice(lane->gpu);
  while (true) {
    CudaPending pending;
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
      pending.job.ticket->LayerFinished(TicketLayerBytes(pending.job, layer));
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
      static_cast<const CudaMapping&>(*pending.job.mapping).ReleaseSet(pending.job.event_set);
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
    pending = CudaPending();
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
  std::vector<CudaLane*> lanes;
  {
    absl::MutexLock lock(&lanes_mu_);
    for (const auto& pair : lanes_) {
      if (pair != nullptr) {
        lanes.push_back(&pair[0]);
        lanes.push_back(&pair[1]);
      }
    }
  }
  for (CudaLane* lane : lanes) {
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
