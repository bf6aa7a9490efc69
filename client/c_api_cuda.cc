// The C ABI's CUDA calls (kvhost/kvhost_c.h), built with CUDA only
// (c_api_no_cuda.cc answers them otherwise): attaching a worker's device
// buffers (to a pool or a pool group), exporting its event for a Backup, the load events' half of
// kvhost_wait_layer, and worker copies. Each checks for a usable GPU first,
// so a host without one gets FAILED_PRECONDITION saying so rather than a
// CUDA error about the first pointer.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <limits>
#include <memory>
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

// The caller's per-component arrays (kvhost_attach_cuda's, or one group
// entry's): component c's buffers at layer_ptrs[c * num_layers + l], with
// layer_bytes[c] when given. `what` starts the messages ("", "entries[1]
// (entry 'ssm') ").
absl::StatusOr<std::vector<kvhost_cuda_component>> Components(
    size_t num_components, const char* const* component_names, uint32_t num_layers,
    void* const* layer_ptrs, const uint64_t* layer_bytes, const std::string& what) {
  std::vector<kvhost_cuda_component> out;
  if (num_components == 0) return out;
  if (component_names == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(what, "component_names is NULL"));
  }
  if (layer_ptrs == nullptr && num_layers > 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, "layer_ptrs is NULL with ", num_layers, " layers"));
  }
  if (num_layers > 0 && num_components > std::numeric_limits<size_t>::max() / num_layers) {
    return absl::InvalidArgumentError(absl::StrCat(what, num_components, " components x ",
                                                   num_layers, " layers overflow layer_ptrs"));
  }
  out.reserve(num_components);
  for (size_t i = 0; i < num_components; ++i) {
    if (component_names[i] == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(what, "component_names[", i, "] is NULL"));
    }
    kvhost_cuda_component component{component_names[i], {}, 0};
    if (num_layers > 0) {
      component.layers.assign(layer_ptrs + i * num_layers, layer_ptrs + (i + 1) * num_layers);
    }
    if (layer_bytes != nullptr) component.layer_bytes = layer_bytes[i];
    out.push_back(std::move(component));
  }
  return out;
}

// Each component's layer buffers against the rows the pool's component
// needs (Pool.components), before anything is exported: a tensor of the
// wrong shape would otherwise be written past its end. `where` starts the
// messages ("", "entry 'kv' ").
absl::Status CheckLayerBytes(const v1::Pool& pool,
                             absl::Span<const kvhost_cuda_component> components,
                             uint64_t device_size_tokens, const std::string& where) {
  for (const kvhost_cuda_component& component : components) {
    const v1::PoolComponent* found = nullptr;
    for (const v1::PoolComponent& pc : pool.components()) {
      if (pc.name() == component.name) found = &pc;
    }
    if (found == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, "pool '", pool.name(), "' has no component '", component.name, "'"));
    }
    const uint64_t row_tokens = std::max<uint64_t>(1, found->row_tokens());
    uint64_t need = 0;
    if (__builtin_mul_overflow(device_size_tokens / row_tokens, found->row_bytes(), &need)) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, "component '", component.name, "': device_size_tokens ",
                       device_size_tokens, " makes ", device_size_tokens / row_tokens, " rows of ",
                       found->row_bytes(), " bytes, more than 2^64 bytes"));
    }
    if (component.layer_bytes < need) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, "component '", component.name, "' layer buffers of ", component.layer_bytes,
          " bytes are smaller than the ", need, " bytes its ", device_size_tokens / row_tokens,
          " rows of ", found->row_bytes(), " bytes need"));
    }
  }
  return absl::OkStatus();
}

// CheckLayerBytes for every group entry that gave its sizes, each against
// its own pool (the group's PoolEntry.pool). NOT_FOUND for an unknown
// group; INVALID_ARGUMENT for an entry the group does not have.
absl::Status CheckGroupLayerBytes(Client& client, const std::string& group,
                                  absl::Span<const kvhost_cuda_group_entry> entries,
                                  absl::Span<const std::vector<kvhost_cuda_component>> components) {
  absl::StatusOr<v1::PoolGroup> info = client.GetPoolGroup(group);
  if (!info.ok()) return info.status();
  for (size_t i = 0; i < entries.size(); ++i) {
    if (entries[i].layer_bytes == nullptr) continue;
    const std::string name = entries[i].entry;
    const v1::PoolEntry* found = nullptr;
    for (const v1::PoolEntry& e : info->entries()) {
      if (e.name() == name) found = &e;
    }
    if (found == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("group '", group, "' has no entry '", name, "' (entries[", i, "])"));
    }
    absl::StatusOr<v1::Pool> pool = client.GetPool(found->pool());
    if (!pool.ok()) return pool.status();
    if (absl::Status s = CheckLayerBytes(*pool, components[i], entries[i].device_size_tokens,
                                         absl::StrCat("entry '", name, "' "));
        !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

std::vector<CudaComponentLayers> Layers(absl::Span<const kvhost_cuda_component> components) {
  std::vector<CudaComponentLayers> out;
  for (const kvhost_cuda_component& c : components) {
    out.push_back({c.name, c.layers, c.layer_bytes});
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
    if (absl::Status s = NotNull(layer_ptrs, "layer_ptrs"); !s.ok()) return s;
    kvhost::v1::AttachDeviceRequest scratch;  // options refused before anything is exported
    if (absl::Status s = kvhost::c_api::AttachOptions(options_json, /*layer_range=*/true, &scratch);
        !s.ok()) {
      return s;
    }
    absl::StatusOr<std::vector<kvhost_cuda_component>> components = kvhost::c_api::Components(
        num_components, component_names, num_layers, layer_ptrs, layer_bytes, "");
    if (!components.ok()) return components.status();
    if (layer_bytes != nullptr) {
      absl::StatusOr<kvhost::v1::Pool> info = (*c)->GetPool(*p);
      if (!info.ok()) return info.status();
      if (absl::Status s =
              kvhost::c_api::CheckLayerBytes(*info, *components, device_size_tokens, "");
          !s.ok()) {
        return s;
      }
    }
    if (absl::Status s = kvhost::c_api::UsableGpu(); !s.ok()) return s;
    auto handle = std::make_unique<kvhost_attachment>();
    handle->cuda_components = *std::move(components);
    const std::vector<kvhost::CudaComponentLayers> layers =
        kvhost::c_api::Layers(handle->cuda_components);
    absl::StatusOr<kvhost::v1::AttachDeviceRequest> request =
        kvhost::MakeCudaAttachRequest(*p, layers, device_size_tokens, *c);
    if (!request.ok()) return request.status();
    return kvhost::c_api::Attach(**c, *std::move(request), options_json, /*layer_range=*/true,
                                 std::move(handle), out);
  });
}

int kvhost_attach_group_cuda(kvhost_client* client, const char* group, size_t num_entries,
                             const kvhost_cuda_group_entry* entries, const char* options_json,
                             kvhost_attachment** out, char* err, size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    if (absl::Status s = NotNull(out, "out"); !s.ok()) return s;
    *out = nullptr;
    absl::StatusOr<kvhost::Client*> c = ClientOf(client);
    if (!c.ok()) return c.status();
    absl::StatusOr<std::string> g = kvhost::c_api::Str(group, "group name");
    if (!g.ok()) return g.status();
    if (num_entries == 0) return absl::InvalidArgumentError("num_entries is 0");
    if (absl::Status s = NotNull(entries, "entries"); !s.ok()) return s;
    kvhost::v1::AttachDeviceRequest scratch;  // options refused before anything is exported
    if (absl::Status s =
            kvhost::c_api::AttachOptions(options_json, /*layer_range=*/false, &scratch);
        !s.ok()) {
      return s;
    }
    const absl::Span<const kvhost_cuda_group_entry> given(entries, num_entries);
    std::vector<std::vector<kvhost_cuda_component>> components;
    components.reserve(num_entries);
    bool sized = false;
    for (size_t i = 0; i < num_entries; ++i) {
      const std::string what = absl::StrCat("entries[", i, "]");
      absl::StatusOr<std::string> entry =
          kvhost::c_api::Str(given[i].entry, (what + ".entry").c_str());
      if (!entry.ok()) return entry.status();
      const std::string where = absl::StrCat(what, " (entry '", *entry, "') ");
      if (given[i].reserved != 0) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, "reserved is ", given[i].reserved, "; it must be 0"));
      }
      absl::StatusOr<std::vector<kvhost_cuda_component>> entry_components =
          kvhost::c_api::Components(given[i].num_components, given[i].component_names,
                                    given[i].num_layers, given[i].layer_ptrs, given[i].layer_bytes,
                                    where);
      if (!entry_components.ok()) return entry_components.status();
      components.push_back(*std::move(entry_components));
      sized = sized || given[i].layer_bytes != nullptr;
    }
    if (sized) {
      if (absl::Status s = kvhost::c_api::CheckGroupLayerBytes(**c, *g, given, components);
          !s.ok()) {
        return s;
      }
    }
    if (absl::Status s = kvhost::c_api::UsableGpu(); !s.ok()) return s;
    std::vector<kvhost::CudaGroupEntry> group_entries;
    group_entries.reserve(num_entries);
    for (size_t i = 0; i < num_entries; ++i) {
      group_entries.push_back(kvhost::CudaGroupEntry{
          given[i].entry, kvhost::c_api::Layers(components[i]), given[i].device_size_tokens,
          given[i].start_layer, given[i].end_layer});
    }
    absl::StatusOr<kvhost::v1::AttachDeviceRequest> request =
        kvhost::MakeCudaGroupAttachRequest(*g, group_entries, *c);
    if (!request.ok()) return request.status();
    return kvhost::c_api::Attach(**c, *std::move(request), options_json, /*layer_range=*/false,
                                 std::make_unique<kvhost_attachment>(), out);
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
          " was not attached by kvhost_attach_cuda (a plain pool's CUDA buffers); worker "
          "copies need one"));
    }
    if (blocks < 0) {
      return absl::InvalidArgumentError(absl::StrCat("blocks ", blocks, " is negative"));
    }
    if (absl::Status s = kvhost::c_api::UsableGpu(); !s.ok()) return s;
    kvhost::WorkerCopierOptions options;
    if (blocks > 0) options.blocks = blocks;
    absl::StatusOr<std::unique_ptr<kvhost::WorkerCopier>> copier = kvhost::WorkerCopier::Open(
        **c, attachment->attachment, kvhost::c_api::Layers(attachment->cuda_components), options);
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
