#include "kvhost/cuda_export.h"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

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
        "; only cudaMalloc memory can be shared this way (cuMemCreate / expandable segments "
        "need the file-descriptor path, not implemented yet)"));
  }
  absl::StatusOr<std::string> uuid = DeviceUuid(attributes.device);
  if (!uuid.ok()) return uuid.status();
  v1::CudaIpcBuffer out;
  out.set_ipc_handle(std::string(reinterpret_cast<const char*>(&handle), sizeof(handle)));
  out.set_offset(ptr - base);
  out.set_gpu_uuid(*uuid);
  return out;
}

// Describes device pointers as buffers of an AttachDeviceRequest, exporting
// each allocation once (by its base) however many buffers it holds.
class BufferExporter {
 public:
  absl::Status Add(void* ptr, const std::string& where, v1::DeviceBuffer* out) {
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

 private:
  struct Export {
    CUdeviceptr base;
    CUdeviceptr end;
    v1::CudaIpcBuffer buffer;
  };
  std::vector<Export> exports_;
};

absl::StatusOr<v1::AttachDeviceRequest> MakeCudaAttachRequest(
    const std::string& pool, absl::Span<void* const> k_layers, absl::Span<void* const> v_layers,
    uint64_t device_size_tokens, uint64_t layer_bytes, Client* client) {
  v1::AttachDeviceRequest request;
  request.set_pool(pool);
  request.set_device_size_tokens(device_size_tokens);
  BufferExporter exporter;
  for (size_t i = 0; i < k_layers.size(); ++i) {
    if (absl::Status s =
            exporter.Add(k_layers[i], absl::StrCat("k_layers[", i, "]"), request.add_k_layers());
        !s.ok()) {
      return s;
    }
  }
  for (size_t i = 0; i < v_layers.size(); ++i) {
    if (absl::Status s =
            exporter.Add(v_layers[i], absl::StrCat("v_layers[", i, "]"), request.add_v_layers());
        !s.ok()) {
      return s;
    }
  }
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
              exporter->Add(component.layers[i],
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
  BufferExporter exporter;
  if (absl::Status s = AddComponents(components, "", &exporter, request.mutable_components());
      !s.ok()) {
    return s;
  }
  return request;
}

absl::StatusOr<v1::AttachDeviceRequest> MakeCudaGroupAttachRequest(
    const std::string& group, absl::Span<const CudaGroupEntry> entries, Client* client) {
  v1::AttachDeviceRequest request;
  request.set_pool(group);
  BufferExporter exporter;  // one export per allocation over every entry
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
