#include "kvhost/cuda_export.h"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/const_init.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/cuda_util.h"
#include "common/cuda_vmm.h"
#include "common/unique_fd.h"

namespace kvhost {
namespace {

std::string Ptr(const void* p) {
  return absl::StrCat("0x", absl::Hex(reinterpret_cast<uintptr_t>(p)));
}

// The UUID of device `ordinal`, cached: cudaGetDeviceProperties is slow.
absl::StatusOr<std::string> DeviceUuid(int ordinal) {
  static absl::Mutex mu(absl::kConstInit);
  static std::map<int, std::string>* cache = new std::map<int, std::string>();
  absl::MutexLock lock(&mu);
  auto it = cache->find(ordinal);
  if (it != cache->end()) return it->second;
  cudaDeviceProp prop;
  if (cudaError_t e = cudaGetDeviceProperties(&prop, ordinal); e != cudaSuccess) {
    cudaGetLastError();
    return absl::InternalError(
        absl::StrCat("cudaGetDeviceProperties(", ordinal, "): ", CudaError(e)));
  }
  return cache->emplace(ordinal, FormatUuid(prop.uuid)).first->second;
}

}  // namespace

absl::StatusOr<v1::CudaIpcBuffer> ExportCudaBuffer(const void* device_ptr) {
  if (device_ptr == nullptr) return absl::InvalidArgumentError("device pointer is null");
  cudaPointerAttributes attributes;
  if (cudaError_t e = cudaPointerGetAttributes(&attributes, device_ptr); e != cudaSuccess) {
    cudaGetLastError();
    return absl::InvalidArgumentError(
        absl::StrCat("cudaPointerGetAttributes(", Ptr(device_ptr), "): ", CudaError(e)));
  }
  if (attributes.type != cudaMemoryTypeDevice) {
    return absl::InvalidArgumentError(absl::StrCat(Ptr(device_ptr),
                                                   " is not device memory (cudaMemoryType ",
                                                   static_cast<int>(attributes.type), ")"));
  }
  absl::StatusOr<PFN_cuMemGetAddressRange_v3020> range = AddressRangeFn();
  if (!range.ok()) return range.status();
  CUdeviceptr base = 0;
  size_t size = 0;
  const auto ptr = reinterpret_cast<CUdeviceptr>(device_ptr);
  if (CUresult r = (*range)(&base, &size, ptr); r != CUDA_SUCCESS) {
    return absl::InternalError(absl::StrCat("cuMemGetAddressRange(", Ptr(device_ptr),
                                            ") failed with CUresult ", static_cast<int>(r)));
  }
  cudaIpcMemHandle_t handle;
  if (cudaError_t e = cudaIpcGetMemHandle(&handle, reinterpret_cast<void*>(base));
      e != cudaSuccess) {
    cudaGetLastError();
    return absl::FailedPreconditionError(absl::StrCat(
        "cudaIpcGetMemHandle of the allocation at ", Ptr(reinterpret_cast<void*>(base)),
        " (holding ", Ptr(device_ptr), "): ", CudaError(e),
        "; only cudaMalloc memory has an IPC handle (cuMem memory, e.g. expandable segments, "
        "is attached through MakeCudaAttachRequest with its size and the Client)"));
  }
  absl::StatusOr<std::string> uuid = DeviceUuid(attributes.device);
  if (!uuid.ok()) return uuid.status();
  v1::CudaIpcBuffer out;
  out.set_ipc_handle(std::string(reinterpret_cast<const char*>(&handle), sizeof(handle)));
  out.set_offset(ptr - base);
  out.set_gpu_uuid(*uuid);
  return out;
}

namespace {

// Whether `ptr` lies in memory of the CUDA virtual memory API (cuMemCreate):
// the driver can retain its allocation's handle, which it cannot for
// cudaMalloc memory.
bool IsVmmMemory(const VmmApi& api, const void* ptr) {
  CUmemGenericAllocationHandle handle = 0;
  if (api.retain_allocation_handle(&handle, const_cast<void*>(ptr)) != CUDA_SUCCESS) return false;
  api.release(handle);
  return true;
}

// Every CudaFdChunk of `buffers`.
template <typename Fn>
void ForEachChunk(google::protobuf::RepeatedPtrField<v1::DeviceBuffer>* buffers, Fn fn) {
  for (v1::DeviceBuffer& b : *buffers) {
    if (!b.has_cuda_fd()) continue;
    for (v1::CudaFdChunk& chunk : *b.mutable_cuda_fd()->mutable_chunks()) fn(&chunk);
  }
}

template <typename Fn>
void ForEachChunk(google::protobuf::RepeatedPtrField<v1::DeviceComponent>* components, Fn fn) {
  for (v1::DeviceComponent& c : *components) ForEachChunk(c.mutable_layers(), fn);
}

}  // namespace

// Describes device pointers as buffers of an AttachDeviceRequest, exporting
// each allocation once however many buffers it holds: a cudaMalloc
// allocation by its IPC handle (by its base), a cuMem allocation as a
// descriptor (by its mapping's start). Finish deposits the descriptors and
// names them in the request; they close with the exporter.
class BufferExporter {
 public:
  explicit BufferExporter(Client* client) : client_(client) {}
  BufferExporter(const BufferExporter&) = delete;
  BufferExporter& operator=(const BufferExporter&) = delete;

  // `bytes`: the buffer's size from `ptr` (0: unknown, cudaMalloc memory only).
  absl::Status Add(void* ptr, uint64_t bytes, const std::string& where, v1::DeviceBuffer* out) {
    absl::StatusOr<PFN_cuMemGetAddressRange_v3020> range = AddressRangeFn();
    if (!range.ok()) return range.status();
    const auto p = reinterpret_cast<CUdeviceptr>(ptr);
    for (const Export& e : exports_) {
      if (p >= e.base && p < e.end) {
        *out->mutable_cuda() = e.buffer;
        out->mutable_cuda()->set_offset(p - e.base);
        return absl::OkStatus();
      }
    }
    if (ptr != nullptr) {
      absl::StatusOr<const VmmApi*> vmm = Vmm();
      if (vmm.ok() && IsVmmMemory(**vmm, ptr)) return AddVmm(**vmm, ptr, bytes, where, out);
    }
    absl::StatusOr<v1::CudaIpcBuffer> buffer = ExportCudaBuffer(ptr);
    if (!buffer.ok()) {
      return absl::Status(buffer.status().code(),
                          absl::StrCat(where, ": ", buffer.status().message()));
    }
    CUdeviceptr base = 0;
    size_t size = 0;
    if (CUresult r = (*range)(&base, &size, p); r != CUDA_SUCCESS) {
      return absl::InternalError(
          absl::StrCat(where, ": cuMemGetAddressRange: ", static_cast<int>(r)));
    }
    exports_.push_back(Export{base, base + size, *buffer});
    *out->mutable_cuda() = *std::move(buffer);
    return absl::OkStatus();
  }

  // Deposits the descriptors exported (if any) with the client, and names
  // each chunk of `request` by its deposit and index there.
  absl::Status Finish(v1::AttachDeviceRequest* request) {
    if (fds_.empty()) return absl::OkStatus();
    std::vector<int> raw;  // still fds_'s: the deposit sends copies
    raw.reserve(fds_.size());
    for (const UniqueFd& fd : fds_) raw.push_back(fd.get());
    absl::StatusOr<std::vector<std::string>> ids = client_->DepositDescriptors(raw);
    if (!ids.ok()) return ids.status();
    auto rename = [&](v1::CudaFdChunk* chunk) {
      const uint32_t local = chunk->index();
      chunk->set_deposit_id((*ids)[local / kMaxDepositDescriptors]);
      chunk->set_index(local % kMaxDepositDescriptors);
    };
    ForEachChunk(request->mutable_k_layers(), rename);
    ForEachChunk(request->mutable_v_layers(), rename);
    ForEachChunk(request->mutable_components(), rename);
    for (v1::DeviceEntry& entry : *request->mutable_entries()) {
      ForEachChunk(entry.mutable_k_layers(), rename);
      ForEachChunk(entry.mutable_v_layers(), rename);
      ForEachChunk(entry.mutable_components(), rename);
    }
    return absl::OkStatus();
  }

 private:
  struct Export {
    CUdeviceptr base;
    CUdeviceptr end;
    v1::CudaIpcBuffer buffer;
  };
  struct Chunk {
    uint64_t bytes;
    uint32_t local;  // index into fds_
  };

  // A cuMem buffer: the allocations [ptr, ptr + bytes) spans, each exported
  // once as a descriptor.
  absl::Status AddVmm(const VmmApi& api, void* ptr, uint64_t bytes, const std::string& where,
                      v1::DeviceBuffer* out) {
    if (bytes == 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          where, ": ", Ptr(ptr),
          " is cuMem memory (expandable segments, a cumem allocator), which is attached by "
          "the allocations it spans: give the buffer's size in bytes (layer_bytes)"));
    }
    if (client_ == nullptr) {
      return absl::FailedPreconditionError(absl::StrCat(
          where, ": ", Ptr(ptr),
          " is cuMem memory, whose descriptors are deposited with the daemon before the attach: "
          "pass the Client to the request builder"));
    }
    absl::StatusOr<PFN_cuMemGetAddressRange_v3020> range = AddressRangeFn();
    if (!range.ok()) return range.status();
    cudaPointerAttributes attributes;
    if (cudaError_t e = cudaPointerGetAttributes(&attributes, ptr); e != cudaSuccess) {
      cudaGetLastError();
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": cudaPointerGetAttributes(", Ptr(ptr), "): ", CudaError(e)));
    }
    absl::StatusOr<std::string> uuid = DeviceUuid(attributes.device);
    if (!uuid.ok()) return uuid.status();
    v1::CudaFdBuffer* buffer = out->mutable_cuda_fd();
    buffer->set_gpu_uuid(*uuid);
    const auto start = reinterpret_cast<CUdeviceptr>(ptr);
    if (bytes > ~CUdeviceptr{0} - start) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": ", bytes, " bytes from ", Ptr(ptr), " wrap the address space"));
    }
    const CUdeviceptr end = start + bytes;
    for (CUdeviceptr p = start; p < end;) {
      CUdeviceptr base = 0;
      size_t size = 0;
      if (CUresult r = (*range)(&base, &size, p); r != CUDA_SUCCESS || size == 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            where, ": byte ", p - start, " of the ", bytes, " bytes from ", Ptr(ptr),
            " is not mapped (cuMemGetAddressRange: ", api.Error(r), "); is layer_bytes right?"));
      }
      if (p == start) buffer->set_offset(start - base);
      absl::StatusOr<Chunk> chunk = ExportChunk(api, base, size, where);
      if (!chunk.ok()) return chunk.status();
      v1::CudaFdChunk* c = buffer->add_chunks();
      c->set_index(chunk->local);  // the deposit's in Finish
      c->set_bytes(chunk->bytes);
      p = base + size;
    }
    return absl::OkStatus();
  }

  absl::StatusOr<Chunk> ExportChunk(const VmmApi& api, CUdeviceptr base, size_t size,
                                    const std::string& where) {
    if (auto it = chunks_.find(base); it != chunks_.end()) return it->second;
    CUmemGenericAllocationHandle handle = 0;
    if (CUresult r = api.retain_allocation_handle(&handle, reinterpret_cast<void*>(base));
        r != CUDA_SUCCESS) {
      return absl::InternalError(absl::StrCat(where, ": cuMemRetainAllocationHandle(",
                                              Ptr(reinterpret_cast<void*>(base)),
                                              "): ", api.Error(r)));
    }
    int raw = -1;
    const CUresult r =
        api.export_to_shareable_handle(&raw, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
    api.release(handle);
    UniqueFd fd(raw);
    if (r != CUDA_SUCCESS) {
      return absl::FailedPreconditionError(absl::StrCat(
          where, ": cuMemExportToShareableHandle of the allocation at ",
          Ptr(reinterpret_cast<void*>(base)), ": ", api.Error(r),
          "; the allocation must be made with requestedHandleTypes including "
          "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR (PyTorch's expandable segments are)"));
    }
    fds_.push_back(std::move(fd));
    const Chunk chunk{size, static_cast<uint32_t>(fds_.size() - 1)};
    chunks_.emplace(base, chunk);
    return chunk;
  }

  Client* const client_;
  std::vector<Export> exports_;
  std::map<CUdeviceptr, Chunk> chunks_;  // by the mapping's start
  std::vector<UniqueFd> fds_;
};

absl::StatusOr<v1::AttachDeviceRequest> MakeCudaAttachRequest(
    const std::string& pool, absl::Span<void* const> k_layers, absl::Span<void* const> v_layers,
    uint64_t device_size_tokens, uint64_t layer_bytes, Client* client) {
  v1::AttachDeviceRequest request;
  request.set_pool(pool);
  request.set_device_size_tokens(device_size_tokens);
  BufferExporter exporter(client);
  for (size_t i = 0; i < k_layers.size(); ++i) {
    if (absl::Status s = exporter.Add(k_layers[i], layer_bytes, absl::StrCat("k_layers[", i, "]"),
                                      request.add_k_layers());
        !s.ok()) {
      return s;
    }
  }
  for (size_t i = 0; i < v_layers.size(); ++i) {
    if (absl::Status s = exporter.Add(v_layers[i], layer_bytes, absl::StrCat("v_layers[", i, "]"),
                                      request.add_v_layers());
        !s.ok()) {
      return s;
    }
  }
  if (absl::Status s = exporter.Finish(&request); !s.ok()) return s;
  return request;
}

namespace {

// Adds `components` to `out` (AttachDeviceRequest.components or
// DeviceEntry.components); `prefix` starts the failure messages.
absl::Status AddComponents(absl::Span<const CudaComponentLayers> components,
                           const std::string& prefix, BufferExporter* exporter,
                           google::protobuf::RepeatedPtrField<v1::DeviceComponent>* out) {
  for (const CudaComponentLayers& component : components) {
    v1::DeviceComponent* added = out->Add();
    added->set_name(component.name);
    for (size_t i = 0; i < component.layers.size(); ++i) {
      if (absl::Status s =
              exporter->Add(component.layers[i], component.layer_bytes,
                            absl::StrCat(prefix, "component '", component.name, "' layer ", i),
                            added->add_layers());
          !s.ok()) {
        return s;
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<v1::AttachDeviceRequest> MakeCudaAttachRequest(
    const std::string& pool, absl::Span<const CudaComponentLayers> components,
    uint64_t device_size_tokens, Client* client) {
  v1::AttachDeviceRequest request;
  request.set_pool(pool);
  request.set_device_size_tokens(device_size_tokens);
  BufferExporter exporter(client);
  if (absl::Status s = AddComponents(components, "", &exporter, request.mutable_components());
      !s.ok()) {
    return s;
  }
  if (absl::Status s = exporter.Finish(&request); !s.ok()) return s;
  return request;
}

absl::StatusOr<v1::AttachDeviceRequest> MakeCudaGroupAttachRequest(
    const std::string& group, absl::Span<const CudaGroupEntry> entries, Client* client) {
  v1::AttachDeviceRequest request;
  request.set_pool(group);
  BufferExporter exporter(client);  // one export per allocation over every entry
  for (const CudaGroupEntry& entry : entries) {
    v1::DeviceEntry* out = request.add_entries();
    out->set_entry(entry.entry);
    out->set_device_size_tokens(entry.device_size_tokens);
    out->set_start_layer(entry.start_layer);
    out->set_end_layer(entry.end_layer);
    if (absl::Status s = AddComponents(entry.components, absl::StrCat("entry '", entry.entry, "' "),
                                       &exporter, out->mutable_components());
        !s.ok()) {
      return s;
    }
  }
  if (absl::Status s = exporter.Finish(&request); !s.ok()) return s;
  return request;
}

absl::StatusOr<std::string> ExportEvent(cudaEvent_t event) {
  if (event == nullptr) return absl::InvalidArgumentError("event is null");
  cudaIpcEventHandle_t handle;
  if (cudaError_t e = cudaIpcGetEventHandle(&handle, event); e != cudaSuccess) {
    cudaGetLastError();
    return absl::InvalidArgumentError(
        absl::StrCat("cudaIpcGetEventHandle: ", CudaError(e),
                     "; create the event with cudaEventInterprocess | cudaEventDisableTiming"));
  }
  return std::string(reinterpret_cast<const char*>(&handle), sizeof(handle));
}

absl::StatusOr<std::unique_ptr<LoadEvents>> LoadEvents::Open(const v1::Attachment& attachment) {
  const uint32_t sets = attachment.load_event_sets();
  const size_t handles = static_cast<size_t>(attachment.load_event_handles_size());
  if (sets == 0 || handles == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("attachment '", attachment.id(), "' has no load events (backend '",
                     attachment.backend(), "'); only the cuda backend creates them"));
  }
  if (handles % sets != 0) {
    return absl::InvalidArgumentError(absl::StrCat("attachment '", attachment.id(), "' has ",
                                                   handles,
                                                   " load event handles, not a multiple "
                                                   "of its ",
                                                   sets, " sets"));
  }
  auto events = std::unique_ptr<LoadEvents>(new LoadEvents());
  events->sets_ = sets;
  events->layers_ = static_cast<uint32_t>(handles / sets);
  events->events_.reserve(handles);
  for (size_t i = 0; i < handles; ++i) {
    const std::string& bytes = attachment.load_event_handles(static_cast<int>(i));
    if (bytes.size() != sizeof(cudaIpcEventHandle_t)) {
      return absl::InvalidArgumentError(
          absl::StrCat("load_event_handles[", i, "] has ", bytes.size(),
                       " bytes; a cudaIpcEventHandle_t has ", sizeof(cudaIpcEventHandle_t)));
    }
    cudaIpcEventHandle_t handle;
    std::memcpy(&handle, bytes.data(), sizeof(handle));
    cudaEvent_t event = nullptr;
    if (cudaError_t e = cudaIpcOpenEventHandle(&event, handle); e != cudaSuccess) {
      cudaGetLastError();
      // The events opened so far close with `events`.
      return absl::InvalidArgumentError(
          absl::StrCat("load_event_handles[", i, "]: cudaIpcOpenEventHandle: ", CudaError(e)));
    }
    events->events_.push_back(event);
  }
  return events;
}

absl::StatusOr<std::unique_ptr<LoadEvents>> LoadEvents::Open(const Client& client,
                                                             const v1::Attachment& attachment) {
  absl::StatusOr<std::unique_ptr<LoadEvents>> events = Open(attachment);
  if (!events.ok() || !attachment.layer_progress()) return events;
  absl::StatusOr<std::unique_ptr<LayerProgress>> progress = LayerProgress::Open(client, attachment);
  if (!progress.ok()) return progress.status();
  (*events)->progress_ = *std::move(progress);
  return events;
}

LoadEvents::~LoadEvents() {
  for (cudaEvent_t event : events_) cudaEventDestroy(event);
}

absl::Status LoadEvents::WaitLayer(const LoadTicket& ticket, uint32_t layer, cudaStream_t stream,
                                   absl::Duration timeout) const {
  if (ticket.event_set < 0) return absl::OkStatus();
  if (layer >= layers_) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", layer, " out of range: the load events have ", layers_, " layers"));
  }
  if (progress_ != nullptr) {
    if (absl::Status s = progress_->WaitRecorded(ticket, layer, timeout); !s.ok()) return s;
  }
  return WaitLayer(ticket.event_set, layer, stream);
}

absl::Status LoadEvents::WaitLayer(int set, uint32_t layer, cudaStream_t stream) const {
  if (set < 0 || static_cast<uint32_t>(set) >= sets_ || layer >= layers_) {
    return absl::InvalidArgumentError(absl::StrCat("load event [", set, "][", layer,
                                                   "] out of range: ", sets_, " sets of ", layers_,
                                                   " layers"));
  }
  if (cudaError_t e = cudaStreamWaitEvent(stream, event(set, layer), 0); e != cudaSuccess) {
    cudaGetLastError();
    return absl::InternalError(
        absl::StrCat("cudaStreamWaitEvent on load event [", set, "][", layer, "]: ", CudaError(e)));
  }
  return absl::OkStatus();
}

}  // namespace kvhost
