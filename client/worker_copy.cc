#include "kvhost/worker_copy.h"
#include "client/handoff.h"

#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <deque>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/cuda_util.h"
#include "copy_kernel.h"
#include "kvhost/copy_tile.h"
#include "kvhost/layer_progress.h"

namespace kvhost {
namespace {

// kvhostd's kMaxWorkerCopyRegions.
constexpr size_t kMaxRegions = 16;

absl::Status Cuda(cudaError_t e, const std::string& what) {
  if (e == cudaSuccess) return absl::OkStatus();
  cudaGetLastError();
  return absl::InternalError(absl::StrCat(what, ": ", CudaError(e)));
}

}  // namespace

// One region of the pool, mapped here and registered.
struct WorkerCopier::Region {
  uint8_t* host = nullptr;
  uint8_t* device = nullptr;  // as the GPU sees it (cudaHostGetDevicePointer)
  uint64_t bytes = 0;
  uint64_t mapped = 0;  // bytes rounded up to whole pages: what is mapped and registered
  bool registered = false;
};

// One launch group (kvhost.v1.WorkerCopyGroup) with this process's pointers.
struct WorkerCopier::Group {
  KvLayout layout;
  uint8_t* other = nullptr;         // plane 0 in the device's view of the region
  uint8_t** layer_table = nullptr;  // device: planes x layer_num_ layer bases
  bool aligned16 = false;
};

// One copy in flight: its events, its descriptors and how it ended.
struct WorkerCopier::Copy {
  uint64_t ticket_id = 0;
  std::vector<cudaEvent_t> layer_events;
  cudaEvent_t done = nullptr;
  // Pinned host copy of the tiles (uploaded from there, stream-ordered),
  // given back to the completion's pool once the copy ended.
  void* pinned = nullptr;
  size_t pinned_bytes = 0;
  // Set before the copy is handed to the completion when queueing failed
  // part-way: the ticket fails with it once what was queued has run.
  std::string error;

  mutable absl::Mutex mu;
  bool finished ABSL_GUARDED_BY(mu) = false;
  absl::Status outcome ABSL_GUARDED_BY(mu);

  ~Copy() {
    for (cudaEvent_t e : layer_events) cudaEventDestroy(e);
    if (done != nullptr) cudaEventDestroy(done);
  }
};

// The thread that waits for each copy's end and finishes its ticket, and the
// pinned buffers the copies' tiles are uploaded from.
class WorkerCopier::Completion {
 public:
  struct Pinned {
    void* data = nullptr;
    size_t bytes = 0;
  };

  Completion(Client* client, int device) : client_(client), device_(device) {
    thread_ = std::thread([this] { Loop(); });
  }
  // Waits for every copy handed over, then frees the pinned buffers.
  ~Completion() {
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
    }
    thread_.join();
    for (const Pinned& p : free_) cudaFreeHost(p.data);
  }

  void Add(std::shared_ptr<Copy> copy) {
    absl::MutexLock lock(&mu_);
    queue_.push_back(std::move(copy));
  }

  // A pinned buffer of at least `bytes`.
  absl::StatusOr<Pinned> TakePinned(size_t bytes);
  void GivePinned(void* data, size_t bytes) {
    absl::MutexLock lock(&mu_);
    free_.push_back({data, bytes});
  }

 private:
  void Loop();

  Client* const client_;
  const int device_;
  absl::Mutex mu_;
  std::deque<std::shared_ptr<Copy>> queue_ ABSL_GUARDED_BY(mu_);
  std::vector<Pinned> free_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

absl::StatusOr<WorkerCopier::Completion::Pinned> WorkerCopier::Completion::TakePinned(
    size_t bytes) {
  {
    absl::MutexLock lock(&mu_);
    for (size_t i = 0; i < free_.size(); ++i) {
      if (free_[i].bytes < bytes) continue;
      Pinned p = free_[i];
      free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(i));
      return p;
    }
  }
  // Powers of two from 64 KiB, so that buffers are reused across sizes.
  size_t size = size_t{64} << 10;
  while (size < bytes) size *= 2;
  Pinned p;
  p.bytes = size;
  if (absl::Status s = Cuda(cudaHostAlloc(&p.data, size, cudaHostAllocDefault),
                            absl::StrCat("cudaHostAlloc of ", size, " bytes of copy tiles"));
      !s.ok()) {
    return s;
  }
  return p;
}

void WorkerCopier::Completion::Loop() {
  cudaSetDevice(device_);
  for (;;) {
    std::shared_ptr<Copy> copy;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]()
                       ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !queue_.empty() || stopping_; };
      mu_.Await(absl::Condition(&ready));
      if (queue_.empty()) return;  // stopping, and nothing left
      copy = std::move(queue_.front());
      queue_.pop_front();
    }
    std::string error = copy->error;
    if (copy->done != nullptr) {
      if (cudaError_t e = cudaEventSynchronize(copy->done); e != cudaSuccess) {
        cudaGetLastError();
        if (error.empty()) error = absl::StrCat("the worker's copy kernels: ", CudaError(e));
      }
    }
    if (copy->pinned != nullptr) GivePinned(copy->pinned, copy->pinned_bytes);
    absl::Status outcome = client_->FinishWorkerCopy(copy->ticket_id, error);
    if (outcome.ok() && !error.empty()) outcome = absl::InternalError(error);
    absl::MutexLock lock(&copy->mu);
    copy->finished = true;
    copy->outcome = std::move(outcome);
  }
}

WorkerCopier::WorkerCopier() = default;

WorkerCopier::~WorkerCopier() {
  completion_.reset();  // every copy ended and finished
  if (!groups_.empty() || !regions_.empty()) cudaSetDevice(device_);
  for (const Group& g : groups_) {
    if (g.layer_table != nullptr) cudaFree(g.layer_table);
  }
  for (const Region& r : regions_) {
    if (r.registered) cudaHostUnregister(r.host);
    if (r.host != nullptr) ::munmap(r.host, r.mapped);
  }
}

uint64_t WorkerCopier::mapped_bytes() const {
  uint64_t n = 0;
  for (const Region& r : regions_) n += r.bytes;
  return n;
}

absl::StatusOr<std::unique_ptr<WorkerCopier>> WorkerCopier::Open(
    Client& client, const v1::Attachment& attachment,
    absl::Span<const CudaComponentLayers> components, const WorkerCopierOptions& options) {
  if (attachment.handoff_socket().empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "kvhostd serves no worker copies for the attachment of pool '", attachment.pool(),
        "' (it needs --worker-copy, the cuda backend and a plain pool)"));
  }
  if (options.blocks < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("WorkerCopierOptions.blocks = ", options.blocks, " must be >= 1"));
  }
  std::unique_ptr<WorkerCopier> copier(new WorkerCopier());
  copier->client_ = &client;
  copier->attachment_id_ = attachment.id();
  copier->blocks_ = options.blocks;
  copier->layer_num_ = attachment.end_layer() - attachment.start_layer();
  if (absl::Status s = Cuda(cudaGetDevice(&copier->device_), "cudaGetDevice"); !s.ok()) return s;

  v1::HandoffRequest request;
  request.set_attachment_id(attachment.id());
  request.set_kind(v1::HANDOFF_KIND_POOL_REGIONS);
  for (const std::string& id : client.session_ids()) request.add_session_ids(id);
  request.set_owner_token(client.options().owner_token);
  absl::StatusOr<Handoff> handoff =
      FetchHandoff(attachment.handoff_socket(), request, options.handoff_timeout);
  if (!handoff.ok()) return handoff.status();
  // The descriptors close with `handoff`: the mappings keep the files.
  if (absl::Status s = copier->MapRegions(*handoff, attachment.handoff_socket()); !s.ok()) {
    return s;
  }
  for (int g = 0; g < handoff->pool_regions.groups_size(); ++g) {
    if (absl::Status s = copier->AddGroup(handoff->pool_regions.groups(g), g, components);
        !s.ok()) {
      return s;
    }
  }
  copier->completion_ = std::make_unique<Completion>(&client, copier->device_);
  return copier;
}

absl::Status WorkerCopier::MapRegions(const Handoff& handoff, const std::string& socket) {
  const v1::PoolRegions& regions = handoff.pool_regions;
  if (handoff.fds.size() != static_cast<size_t>(regions.region_bytes_size()) ||
      handoff.fds.size() > kMaxRegions || handoff.count != handoff.fds.size()) {
    return absl::InternalError(absl::StrCat("handoff socket ", socket, ": ", handoff.fds.size(),
                                            " descriptors for ", regions.region_bytes_size(),
                                            " regions (count ", handoff.count, ")"));
  }
  for (size_t r = 0; r < handoff.fds.size(); ++r) {
    const int fd = handoff.fds[r].get();
    const uint64_t bytes = regions.region_bytes(static_cast<int>(r));
    struct stat st {};
    if (bytes == 0 || ::fstat(fd, &st) != 0 || static_cast<uint64_t>(st.st_size) < bytes) {
      return absl::InternalError(
          absl::StrCat("region ", r, ": the descriptor is not a file of ", bytes, " bytes"));
    }
    // Whole pages, as cudaHostRegister wants them (the mapping has them anyway).
    const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
    const uint64_t length = (bytes + page - 1) / page * page;
    void* mapped = ::mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (mapped == MAP_FAILED) {
      return absl::InternalError(
          absl::StrCat("mmap of region ", r, " (", bytes, " bytes): ", std::strerror(errno)));
    }
    Region& region = regions_.emplace_back();
    region.host = static_cast<uint8_t*>(mapped);
    region.bytes = bytes;
    region.mapped = length;
    if (absl::Status s = Cuda(
            cudaHostRegister(mapped, length, cudaHostRegisterMapped | cudaHostRegisterPortable),
            absl::StrCat("cudaHostRegister of region ", r, " (", bytes, " bytes)"));
        !s.ok()) {
      return s;
    }
    region.registered = true;
    void* device = nullptr;
    if (absl::Status s = Cuda(cudaHostGetDevicePointer(&device, mapped, 0),
                              absl::StrCat("cudaHostGetDevicePointer of region ", r));
        !s.ok()) {
      return s;
    }
    region.device = static_cast<uint8_t*>(device);
  }
  return absl::OkStatus();
}

absl::Status WorkerCopier::AddGroup(const v1::WorkerCopyGroup& in, int index,
                                    absl::Span<const CudaComponentLayers> components) {
  const std::string what = absl::StrCat("launch group ", index);
  // 0: a daemon that predates PAGE_UNIFIED's fields.
  const uint64_t head_groups = in.head_groups() != 0 ? in.head_groups() : 1;
  const uint64_t interleaved = in.interleaved_planes() != 0 ? in.interleaved_planes() : in.planes();
  const auto kind = static_cast<LayoutKind>(in.layout());
  if (in.layout() < 1 || in.layout() > static_cast<uint32_t>(LayoutKind::kPageUnified) ||
      in.planes() < 1 || in.layers() < 1 || in.tokens() < 1 || in.page_size() < 1 ||
      in.tokens() % in.page_size() != 0 || in.heads() < 1 || in.head_bytes() < 1 ||
      in.heads() % head_groups != 0 || interleaved < in.planes() ||
      (kind != LayoutKind::kPageUnified && (head_groups != 1 || interleaved != in.planes())) ||
      static_cast<uint64_t>(in.components_size()) != in.planes()) {
    return absl::InternalError(absl::StrCat(what, ": not a layout kvhost knows"));
  }
  Group& group = groups_.emplace_back();
  group.layout = KvLayout(kind, in.planes(), in.layers(), in.tokens(), in.page_size(), in.heads(),
                          in.head_bytes(), head_groups, interleaved);
  if (group.layout.token_bytes != in.token_bytes() ||
      group.layout.plane_bytes != in.plane_bytes()) {
    return absl::InternalError(
        absl::StrCat(what, ": the layout rebuilt here is not the daemon's (token bytes ",
                     group.layout.token_bytes, " vs ", in.token_bytes(), ")"));
  }
  if (in.region() >= regions_.size() || in.region_offset() > regions_[in.region()].bytes ||
      regions_[in.region()].bytes - in.region_offset() < group.layout.extent_bytes()) {
    return absl::InternalError(absl::StrCat(what, " does not fit its region ", in.region()));
  }
  group.other = regions_[in.region()].device + in.region_offset();
  // Plane-major: plane p's attached layers at p * layer_num_ (as kvhostd's
  // own table, server/transfer/cuda/mapping.h).
  std::vector<uint8_t*> table;
  bool aligned = reinterpret_cast<uintptr_t>(group.other) % 16 == 0;
  for (const std::string& name : in.components()) {
    const CudaComponentLayers* found = nullptr;
    for (const CudaComponentLayers& c : components) {
      if (c.name == name) found = &c;
    }
    if (found == nullptr || found->layers.size() != layer_num_) {
      return absl::InvalidArgumentError(absl::StrCat(
          "component '", name, "' of the pool ",
          found == nullptr
              ? std::string("is not among the buffers given")
              : absl::StrCat("has ", found->layers.size(), " layer buffers, not ", layer_num_)));
    }
    for (void* layer : found->layers) {
      table.push_back(static_cast<uint8_t*>(layer));
      aligned &= reinterpret_cast<uintptr_t>(layer) % 16 == 0;
    }
  }
  group.aligned16 = aligned;
  const size_t bytes = table.size() * sizeof(uint8_t*);
  if (absl::Status s = Cuda(cudaMalloc(&group.layer_table, bytes), "cudaMalloc of a layer table");
      !s.ok()) {
    group.layer_table = nullptr;
    return s;
  }
  return Cuda(cudaMemcpy(group.layer_table, table.data(), bytes, cudaMemcpyHostToDevice),
              "uploading a layer table");
}

absl::StatusOr<WorkerTicket> WorkerCopier::Backup(absl::Span<const int64_t> host_indices,
                                                  absl::Span<const int64_t> device_indices,
                                                  cudaStream_t stream) {
  v1::BackupRequest request;
  request.set_attachment_id(attachment_id_);
  request.mutable_host_indices()->Add(host_indices.begin(), host_indices.end());
  request.mutable_device_indices()->Add(device_indices.begin(), device_indices.end());
  request.set_worker_copy(true);
  absl::StatusOr<v1::TransferTicket> ticket = client_->SubmitBackup(request);
  if (!ticket.ok()) return ticket.status();
  return Run(/*load=*/false, *ticket, stream);
}

absl::StatusOr<WorkerTicket> WorkerCopier::Load(absl::Span<const int64_t> host_indices,
                                                absl::Span<const int64_t> device_indices,
                                                cudaStream_t stream) {
  v1::LoadRequest request;
  request.set_attachment_id(attachment_id_);
  request.mutable_host_indices()->Add(host_indices.begin(), host_indices.end());
  request.mutable_device_indices()->Add(device_indices.begin(), device_indices.end());
  request.set_worker_copy(true);
  absl::StatusOr<v1::TransferTicket> ticket = client_->SubmitLoad(request);
  if (!ticket.ok()) return ticket.status();
  return Run(/*load=*/true, *ticket, stream);
}

absl::StatusOr<WorkerTicket> WorkerCopier::Run(bool load, const v1::TransferTicket& ticket,
                                               cudaStream_t stream) {
  WorkerTicket out;
  out.ticket_id = ticket.id();
  out.layers = layer_num_;
  if (!ticket.has_worker_copy()) return out;  // nothing to copy: finished already
  auto copy = std::make_shared<Copy>();
  copy->ticket_id = ticket.id();
  absl::Status s = Enqueue(load, ticket.worker_copy(), copy.get(), stream);
  if (!s.ok() && copy->done == nullptr) {
    // Nothing to wait for: the ticket fails now.
    client_->FinishWorkerCopy(ticket.id(), std::string(s.message())).IgnoreError();
    if (copy->pinned != nullptr) completion_->GivePinned(copy->pinned, copy->pinned_bytes);
    return s;
  }
  if (!s.ok()) copy->error = std::string(s.message());
  completion_->Add(copy);
  if (!s.ok()) return s;
  out.copy = std::move(copy);
  return out;
}

absl::Status WorkerCopier::Enqueue(bool load, const v1::WorkerCopyPlan& plan, Copy* copy,
                                   cudaStream_t stream) {
  // The plan, checked against what this process holds before anything is
  // queued: a malformed one fails the ticket instead of faulting.
  const std::string& tiles = plan.tiles();
  if (plan.tile_bytes() != sizeof(CopyTile) || tiles.size() % sizeof(CopyTile) != 0 ||
      tiles.empty()) {
    return absl::InternalError(absl::StrCat("the plan's tiles (", tiles.size(), " bytes of ",
                                            plan.tile_bytes(), "-byte tiles) are not ",
                                            sizeof(CopyTile), "-byte CopyTiles of this build"));
  }
  const uint64_t tile_count = tiles.size() / sizeof(CopyTile);
  if (static_cast<uint32_t>(plan.layers_size()) != layer_num_) {
    return absl::InternalError(
        absl::StrCat("the plan has ", plan.layers_size(), " layers; the attachment ", layer_num_));
  }
  for (const v1::WorkerCopyLaunch& l : plan.launches()) {
    if (l.group() >= groups_.size() || l.tile_begin() >= l.tile_end() ||
        l.tile_end() > tile_count) {
      return absl::InternalError(absl::StrCat("the plan names group ", l.group(), " of ",
                                              groups_.size(), " and tiles [", l.tile_begin(), ", ",
                                              l.tile_end(), ") of ", tile_count));
    }
  }
  for (const v1::WorkerCopyLayer& layer : plan.layers()) {
    for (const v1::WorkerCopyLaunch& l : plan.launches()) {
      const int64_t host = layer.host_layer();
      const int64_t device = host + layer.device_layer_delta();
      if (host >= 0 && (static_cast<uint64_t>(host) >= groups_[l.group()].layout.layers ||
                        device < 0 || device >= layer_num_)) {
        return absl::InternalError(absl::StrCat("the plan's host layer ", host, " (device layer ",
                                                device, ") is outside the pool or attachment"));
      }
    }
  }
  // Stream-ordered upload from pinned memory: the call returns at once, and
  // the buffer goes back to the pool after the copy's end.
  absl::StatusOr<Completion::Pinned> pinned = completion_->TakePinned(tiles.size());
  if (!pinned.ok()) return pinned.status();
  copy->pinned = pinned->data;
  copy->pinned_bytes = pinned->bytes;
  std::memcpy(copy->pinned, tiles.data(), tiles.size());
  for (uint32_t l = 0; l < layer_num_; ++l) {
    cudaEvent_t event = nullptr;
    if (absl::Status s =
            Cuda(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreate");
        !s.ok()) {
      return s;
    }
    copy->layer_events.push_back(event);
  }
  cudaEvent_t done = nullptr;
  if (absl::Status s =
          Cuda(cudaEventCreateWithFlags(&done, cudaEventDisableTiming | cudaEventBlockingSync),
               "cudaEventCreate");
      !s.ok()) {
    return s;
  }
  void* device_tiles = nullptr;
  absl::Status status = Cuda(cudaMallocAsync(&device_tiles, tiles.size(), stream),
                             absl::StrCat("cudaMallocAsync of ", tiles.size(), " bytes of tiles"));
  if (status.ok()) {
    status = Cuda(
        cudaMemcpyAsync(device_tiles, copy->pinned, tiles.size(), cudaMemcpyHostToDevice, stream),
        "uploading the tiles");
  }
  CopyKernelArgs args;
  args.to_device = load;
  args.device_layers_per_plane = layer_num_;
  for (uint32_t i = 0; i < layer_num_ && status.ok(); ++i) {
    const v1::WorkerCopyLayer& layer = plan.layers(static_cast<int>(i));
    for (int k = 0; k < plan.launches_size() && status.ok() && layer.host_layer() >= 0; ++k) {
      const v1::WorkerCopyLaunch& launch = plan.launches(k);
      const Group& group = groups_[launch.group()];
      args.layout = group.layout;
      args.device_layers = group.layer_table;
      args.device_layer_delta = layer.device_layer_delta();
      args.other = group.other;
      args.aligned16 = group.aligned16;
      args.tiles = static_cast<const CopyTile*>(device_tiles) + launch.tile_begin();
      args.tile_count = static_cast<uint32_t>(launch.tile_end() - launch.tile_begin());
      args.item_count = launch.items();
      args.layer_shift = static_cast<uint32_t>(layer.host_layer());
      status = Cuda(LaunchCopyKernel(args, blocks_, stream),
                    absl::StrCat(load ? "load" : "backup", " layer ", i, ": copy kernel"));
    }
    if (status.ok()) {
      status = Cuda(cudaEventRecord(copy->layer_events[i], stream), "cudaEventRecord");
    }
  }
  if (device_tiles != nullptr) cudaFreeAsync(device_tiles, stream);
  // Recorded even after a failure, so the end waits for what was queued.
  if (cudaEventRecord(done, stream) == cudaSuccess) {
    copy->done = done;
  } else {
    cudaGetLastError();
    cudaEventDestroy(done);
  }
  return status;
}

absl::Status WorkerCopier::WaitLayer(const WorkerTicket& ticket, uint32_t layer,
                                     cudaStream_t consumer) const {
  if (ticket.copy == nullptr) return absl::OkStatus();
  const auto* copy = static_cast<const Copy*>(ticket.copy.get());
  if (layer >= copy->layer_events.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", layer, " out of range [0, ", copy->layer_events.size(), ")"));
  }
  return Cuda(cudaStreamWaitEvent(consumer, copy->layer_events[layer], 0),
              absl::StrCat("cudaStreamWaitEvent on layer ", layer));
}

absl::Status WorkerCopier::Wait(const WorkerTicket& ticket, absl::Duration timeout) const {
  if (ticket.copy == nullptr) return absl::OkStatus();
  const auto* copy = static_cast<const Copy*>(ticket.copy.get());
  absl::MutexLock lock(&copy->mu);
  auto finished = [copy]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(copy->mu) { return copy->finished; };
  if (!copy->mu.AwaitWithTimeout(absl::Condition(&finished), timeout)) {
    return absl::DeadlineExceededError(absl::StrCat("worker copy of ticket ", copy->ticket_id,
                                                    " not finished within ",
                                                    absl::FormatDuration(timeout)));
  }
  return copy->outcome;
}

}  // namespace kvhost
