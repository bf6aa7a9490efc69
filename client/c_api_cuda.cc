// The C ABI's CUDA calls (kvhost/kvhost_c.h), built with CUDA only
// (c_api_no_cuda.cc answers them otherwise): attaching a worker's device
// buffers, exporting its event for a Backup, the load events' half of
// kvhost_wait_layer, and worker copies. Each checks for a usable GPU first,
// so a host without one gets FAILED_PRECONDITION saying so rather than a
// CUDA error about the first pointer.
#include <cuda_runtime_api.h>

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "c_api_internal.h"
#include "kvhost/cuda_export.h"
#include "kvhost/worker_copy.h"

struct kvhost_worker_copier {
  std::unique_ptr<kvhost::WorkerCopier> copier;
};

struct kvhost_worker_ticket {
  kvhost::WorkerTicket ticket;
};

namespace kvhost::c_api {
namespace {

absl::Status UsableGpu() {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return absl::FailedPreconditionError(
        absl::StrCat("no usable CUDA GPU: cudaGetDeviceCount: ", cudaGetErrorString(e)));
  }
  if (count == 0) return absl::FailedPreconditionError("no usable CUDA GPU: none found");
  return absl::OkStatus();
}

// Each component's layer buffers against the rows the pool's component
// needs (Pool.components), before anything is exported: a tensor of the
// wrong shape would otherwise be written past its end.
absl::Status CheckLayerBytes(Client& client, const std::string& pool,
                             absl::Span<const kvhost_cuda_component> components,
                             const uint64_t* layer_bytes, uint64_t device_size_tokens) {
  absl::StatusOr<v1::Pool> info = client.GetPool(pool);
  if (!info.ok()) return info.status();
  for (size_t c = 0; c < components.size(); ++c) {
    const v1::PoolComponent* found = nullptr;
    for (const v1::PoolComponent& pc : info->components()) {
      if (pc.name() == components[c].name) found = &pc;
    }
    if (found == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("pool '", pool, "' has no component '", components[c].name, "'"));
    }
    const uint64_t row_tokens = std::max<uint64_t>(1, found->row_tokens());
    const uint64_t need = device_size_tokens / row_tokens * found->row_bytes();
    if (layer_bytes[c] < need) {
      return absl::InvalidArgumentError(absl::StrCat(
          "component '", components[c].name, "' layer buffers of ", layer_bytes[c],
          " bytes are smaller than the ", need, " bytes its ", device_size_tokens / row_tokens,
          " rows of ", found->row_bytes(), " bytes need"));
    }
  }
  return absl::OkStatus();
}

// `layer_bytes` (per component; may be null: cudaMalloc memory only) gives
// cuMem memory the size it spans.
std::vector<CudaComponentLayers> Layers(absl::Span<const kvhost_cuda_component> components,
                                        const uint64_t* layer_bytes) {
  std::vector<CudaComponentLayers> out;
  for (size_t i = 0; i < components.size(); ++i) {
    out.push_back(
        {components[i].name, components[i].layers, layer_bytes != nullptr ? layer_bytes[i] : 0});
  }
  return out;
}

absl::StatusOr<WorkerCopier*> CopierOf(const kvhost_worker_copier* copier) {
  if (copier == nullptr || copier->copier == nullptr) {
    return absl::InvalidArgumentError("copier is NULL");
  }
  return copier->copier.get();
}

absl::Status WorkerCopy(bool load, kvhost_worker_copier* copier, const int64_t* host_indices,
                        size_t num_host, const int64_t* device_indices, size_t num_device,
                        void* cuda_stream, kvhost_worker_ticket** out) {
  if (absl::Status s = NotNull(out, "out"); !s.ok()) return s;
  *out = nullptr;
  absl::StatusOr<WorkerCopier*> c = CopierOf(copier);
  if (!c.ok()) return c.status();
  absl::StatusOr<absl::Span<const int64_t>> host = Indices(host_indices, num_host, "host_indices");
  if (!host.ok()) return host.status();
  absl::StatusOr<absl::Span<const int64_t>> dev =
      Indices(device_indices, num_device, "device_indices");
  if (!dev.ok()) return dev.status();
  auto stream = static_cast<cudaStream_t>(cuda_stream);
  absl::StatusOr<WorkerTicket> ticket =
      load ? (*c)->Load(*host, *dev, stream) : (*c)->Backup(*host, *dev, stream);
  if (!ticket.ok()) return ticket.status();
  auto handle = std::make_unique<kvhost_worker_ticket>();
  handle->ticket = *std::move(ticket);
  *out = handle.release();
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::shared_ptr<LoadEvents>> OpenCudaLoadEvents(Client& client,
                                                               const v1::Attachment& attachment) {
  if (absl::Status s = UsableGpu(); !s.ok()) return s;
  absl::StatusOr<std::unique_ptr<LoadEvents>> events = LoadEvents::Open(client, attachment);
  if (!events.ok()) return events.status();
  return std::shared_ptr<LoadEvents>(*std::move(events));
}

absl::Status WaitCudaLayer(const LoadEvents& events, const LoadTicket& ticket, uint32_t layer,
                           void* cuda_stream, absl::Duration timeout) {
  return events.WaitLayer(ticket, layer, static_cast<cudaStream_t>(cuda_stream), timeout);
}

}  // namespace kvhost::c_api

using kvhost::c_api::ClientOf;
using kvhost::c_api::NotNull;
using kvhost::c_api::Run;

extern "C" {

int kvhost_attach_cuda(kvhost_client* client, const char* pool, size_t num_components,
                       const char* const* component_names, uint32_t num_layers,
                       void* const* layer_ptrs, const uint64_t* layer_bytes,
                       uint64_t device_size_tokens, const char* options_json,
                       kvhost_attachment** out, char* err, size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    if (absl::Status s = NotNull(out, "out"); !s.ok()) return s;
    *out = nullptr;
    absl::StatusOr<kvhost::Client*> c = ClientOf(client);
    if (!c.ok()) return c.status();
    absl::StatusOr<std::string> p = kvhost::c_api::Str(pool, "pool name");
    if (!p.ok()) return p.status();
    if (num_components == 0) return absl::InvalidArgumentError("num_components is 0");
    if (absl::Status s = NotNull(component_names, "component_names"); !s.ok()) return s;
    if (absl::Status s = NotNull(layer_ptrs, "layer_ptrs"); !s.ok()) return s;
    auto handle = std::make_unique<kvhost_attachment>();
    for (size_t i = 0; i < num_components; ++i) {
      if (component_names[i] == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat("component_names[", i, "] is NULL"));
      }
      kvhost_cuda_component component{component_names[i], {}};
      component.layers.assign(layer_ptrs + i * num_layers, layer_ptrs + (i + 1) * num_layers);
      handle->cuda_components.push_back(std::move(component));
    }
    if (layer_bytes != nullptr) {
      if (absl::Status s = kvhost::c_api::CheckLayerBytes(**c, *p, handle->cuda_components,
                                                          layer_bytes, device_size_tokens);
          !s.ok()) {
        return s;
      }
    }
    if (absl::Status s = kvhost::c_api::UsableGpu(); !s.ok()) return s;
    const std::vector<kvhost::CudaComponentLayers> layers =
        kvhost::c_api::Layers(handle->cuda_components, layer_bytes);
    absl::StatusOr<kvhost::v1::AttachDeviceRequest> request =
        kvhost::MakeCudaAttachRequest(*p, layers, device_size_tokens, *c);
    if (!request.ok()) return request.status();
    return kvhost::c_api::Attach(**c, *std::move(request), options_json, /*layer_range=*/true,
                                 std::move(handle), out);
  });
}

int kvhost_cuda_export_event(void* cuda_event, void* handle, size_t handle_len, size_t* needed,
                             char* err, size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    if (absl::Status s = kvhost::c_api::UsableGpu(); !s.ok()) return s;
    absl::StatusOr<std::string> bytes = kvhost::ExportEvent(static_cast<cudaEvent_t>(cuda_event));
    if (!bytes.ok()) return bytes.status();
    return kvhost::c_api::WriteBytes(*bytes, handle, handle_len, needed, "the event handle");
  });
}

int kvhost_worker_copier_open(kvhost_client* client, const kvhost_attachment* attachment,
                              int32_t blocks, kvhost_worker_copier** out, char* err,
                              size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    if (absl::Status s = NotNull(out, "out"); !s.ok()) return s;
    *out = nullptr;
    absl::StatusOr<kvhost::Client*> c = ClientOf(client);
    if (!c.ok()) return c.status();
    if (absl::Status s = NotNull(attachment, "attachment"); !s.ok()) return s;
    if (attachment->cuda_components.empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "attachment ", attachment->attachment.id(),
          " was not attached from CUDA buffers (kvhost_attach_cuda); worker copies need them"));
    }
    if (blocks < 0) {
      return absl::InvalidArgumentError(absl::StrCat("blocks ", blocks, " is negative"));
    }
    if (absl::Status s = kvhost::c_api::UsableGpu(); !s.ok()) return s;
    kvhost::WorkerCopierOptions options;
    if (blocks > 0) options.blocks = blocks;
    absl::StatusOr<std::unique_ptr<kvhost::WorkerCopier>> copier = kvhost::WorkerCopier::Open(
        **c, attachment->attachment, kvhost::c_api::Layers(attachment->cuda_components, nullptr),
        options);
    if (!copier.ok()) return copier.status();
    auto handle = std::make_unique<kvhost_worker_copier>();
    handle->copier = *std::move(copier);
    *out = handle.release();
    return absl::OkStatus();
  });
}

void kvhost_worker_copier_destroy(kvhost_worker_copier* copier) {
  try {
    delete copier;
  } catch (...) {
  }
}

int kvhost_worker_copy_backup(kvhost_worker_copier* copier, const int64_t* host_indices,
                              size_t num_host, const int64_t* device_indices, size_t num_device,
                              void* cuda_stream, kvhost_worker_ticket** out, char* err,
                              size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    return kvhost::c_api::WorkerCopy(/*load=*/false, copier, host_indices, num_host, device_indices,
                                     num_device, cuda_stream, out);
  });
}

int kvhost_worker_copy_load(kvhost_worker_copier* copier, const int64_t* host_indices,
                            size_t num_host, const int64_t* device_indices, size_t num_device,
                            void* cuda_stream, kvhost_worker_ticket** out, char* err,
                            size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    return kvhost::c_api::WorkerCopy(/*load=*/true, copier, host_indices, num_host, device_indices,
                                     num_device, cuda_stream, out);
  });
}

int kvhost_worker_ticket_info(const kvhost_worker_ticket* ticket, uint64_t* ticket_id,
                              uint32_t* layers, char* err, size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    if (absl::Status s = NotNull(ticket, "ticket"); !s.ok()) return s;
    if (ticket_id != nullptr) *ticket_id = ticket->ticket.ticket_id;
    if (layers != nullptr) *layers = ticket->ticket.layers;
    return absl::OkStatus();
  });
}

int kvhost_worker_copy_wait_layer(const kvhost_worker_copier* copier,
                                  const kvhost_worker_ticket* ticket, uint32_t layer,
                                  void* consumer_stream, char* err, size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    absl::StatusOr<kvhost::WorkerCopier*> c = kvhost::c_api::CopierOf(copier);
    if (!c.ok()) return c.status();
    if (absl::Status s = NotNull(ticket, "ticket"); !s.ok()) return s;
    return (*c)->WaitLayer(ticket->ticket, layer, static_cast<cudaStream_t>(consumer_stream));
  });
}

int kvhost_worker_copy_wait(const kvhost_worker_copier* copier, const kvhost_worker_ticket* ticket,
                            int64_t timeout_ms, char* err, size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    absl::StatusOr<kvhost::WorkerCopier*> c = kvhost::c_api::CopierOf(copier);
    if (!c.ok()) return c.status();
    if (absl::Status s = NotNull(ticket, "ticket"); !s.ok()) return s;
    absl::StatusOr<absl::Duration> timeout =
        kvhost::c_api::Timeout(timeout_ms, absl::Minutes(1), "timeout");
    if (!timeout.ok()) return timeout.status();
    return (*c)->Wait(ticket->ticket, *timeout);
  });
}

void kvhost_worker_ticket_destroy(kvhost_worker_ticket* ticket) {
  try {
    delete ticket;
  } catch (...) {
  }
}

}  // extern "C"
