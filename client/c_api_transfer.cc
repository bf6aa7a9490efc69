// The C ABI's worker calls (kvhost/kvhost_c.h) that need no CUDA: shm
// device pools, attaching them (to a pool or a pool group), attachments,
// Backup / Load (with a group's pool_transfers) and their
// tickets, the per-layer waits of a load (layer counters here; the
// load events' half is in c_api_cuda.cc), and the pool's regions for the
// caller's own mapping.
#include <unistd.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "c_api_internal.h"
#include "client/handoff.h"
#include "kvhost/layer_progress.h"

namespace kvhost::c_api {

// The fields an attach's options_json may set: the rest are the buffers,
// which the call itself fills.
absl::Status AttachOptions(const char* options_json, bool layer_range,
                           v1::AttachDeviceRequest* request) {
  v1::AttachDeviceRequest options;
  if (absl::Status s = FromJson(options_json, &options, "options_json", /*optional=*/true);
      !s.ok()) {
    return s;
  }
  const char* buffer_field = nullptr;
  if (!options.pool().empty()) buffer_field = "pool";
  if (options.k_layers_size() > 0) buffer_field = "k_layers";
  if (options.v_layers_size() > 0) buffer_field = "v_layers";
  if (options.components_size() > 0) buffer_field = "components";
  if (options.entries_size() > 0) buffer_field = "entries";
  if (options.device_size_tokens() != 0) buffer_field = "device_size_tokens";
  if (!options.session_id().empty()) buffer_field = "session_id";
  if (buffer_field != nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "options_json sets ", buffer_field,
        ", which the attach call fills itself (options: tp_rank, load_only, layer_progress, "
        "load_event_sets, start_layer, end_layer)"));
  }
  if (!layer_range && (options.start_layer() != 0 || options.end_layer() != 0)) {
    return absl::InvalidArgumentError(
        "options_json sets start_layer / end_layer; this attach takes the layer range from "
        "its device buffers (kvhost_shm_device_pool_create's, or each group entry's)");
  }
  if (options.has_tp_rank()) request->set_tp_rank(options.tp_rank());
  if (options.load_only()) request->set_load_only(true);
  if (options.layer_progress()) request->set_layer_progress(true);
  if (options.load_event_sets() != 0) request->set_load_event_sets(options.load_event_sets());
  if (options.start_layer() != 0) request->set_start_layer(options.start_layer());
  if (options.end_layer() != 0) request->set_end_layer(options.end_layer());
  return absl::OkStatus();
}

absl::Status Attach(Client& client, v1::AttachDeviceRequest request, const char* options_json,
                    bool layer_range, std::unique_ptr<kvhost_attachment> handle,
                    kvhost_attachment** out) {
  if (absl::Status s = AttachOptions(options_json, layer_range, &request); !s.ok()) return s;
  absl::StatusOr<v1::Attachment> attachment = client.AttachDevice(request);
  if (!attachment.ok()) return attachment.status();
  handle->attachment = *std::move(attachment);
  *out = handle.release();
  return absl::OkStatus();
}

absl::StatusOr<const v1::Attachment*> AttachmentOf(const kvhost_attachment* attachment) {
  if (attachment == nullptr) return absl::InvalidArgumentError("attachment is NULL");
  return &attachment->attachment;
}

absl::StatusOr<std::string> EventHandle(const void* handle, size_t len, const char* what) {
  if (handle == nullptr && len != 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, " is NULL with a length of ", len));
  }
  return handle == nullptr ? std::string() : std::string(static_cast<const char*>(handle), len);
}

namespace {

absl::StatusOr<const ShmDevicePool*> DeviceOf(const kvhost_shm_device_pool* device) {
  if (device == nullptr || device->pool == nullptr) {
    return absl::InvalidArgumentError("device pool is NULL");
  }
  return device->pool.get();
}

// A finished ticket's status into the caller's optional JSON buffer.
absl::Status WriteTransferStatus(const v1::TransferStatus& status, char* out, size_t out_len,
                                 size_t* needed) {
  if (out == nullptr && out_len == 0 && needed == nullptr) return absl::OkStatus();
  return WriteJson(status, out, out_len, needed, "the transfer status");
}

// Backup or Load, then the wait that KVHOST_TRANSFER_WAIT asks for.
template <typename Submit>
absl::Status Transfer(kvhost_client* client, const kvhost_attachment* attachment,
                      const int64_t* host_indices, size_t num_host, const int64_t* device_indices,
                      size_t num_device, uint32_t flags, int64_t wait_timeout_ms,
                      uint64_t* ticket_id, Submit&& submit) {
  absl::StatusOr<Client*> c = ClientOf(client);
  if (!c.ok()) return c.status();
  absl::StatusOr<const v1::Attachment*> a = AttachmentOf(attachment);
  if (!a.ok()) return a.status();
  absl::StatusOr<absl::Span<const int64_t>> host = Indices(host_indices, num_host, "host_indices");
  if (!host.ok()) return host.status();
  absl::StatusOr<absl::Span<const int64_t>> dev =
      Indices(device_indices, num_device, "device_indices");
  if (!dev.ok()) return dev.status();
  if ((flags & ~KVHOST_TRANSFER_WAIT) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown transfer flags 0x", absl::Hex(flags & ~KVHOST_TRANSFER_WAIT)));
  }
  absl::StatusOr<absl::Duration> timeout =
      Timeout(wait_timeout_ms, absl::Minutes(10), "wait_timeout");
  if (!timeout.ok()) return timeout.status();
  absl::StatusOr<uint64_t> ticket = submit(**c, (*a)->id(), *host, *dev);
  if (!ticket.ok()) return ticket.status();
  if (ticket_id != nullptr) *ticket_id = *ticket;
  if ((flags & KVHOST_TRANSFER_WAIT) == 0) return absl::OkStatus();
  return (*c)->WaitTransfer(*ticket, *timeout).status();
}

// The caller's kvhost_pool_transfer array as PoolTransfers; null is fine
// only for n == 0. The daemon checks the entry names against the group.
absl::StatusOr<std::vector<v1::PoolTransfer>> PoolTransfers(const kvhost_pool_transfer* p,
                                                            size_t n) {
  if (p == nullptr && n != 0) {
    return absl::InvalidArgumentError(absl::StrCat("pool_transfers is NULL with ", n, " entries"));
  }
  std::vector<v1::PoolTransfer> out;
  out.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    const std::string what = absl::StrCat("pool_transfers[", i, "]");
    absl::StatusOr<std::string> entry = Str(p[i].entry, (what + ".entry").c_str());
    if (!entry.ok()) return entry.status();
    const std::string host_what = what + ".host_indices";
    absl::StatusOr<absl::Span<const int64_t>> host =
        Indices(p[i].host_indices, p[i].num_host, host_what.c_str());
    if (!host.ok()) return host.status();
    const std::string dev_what = what + ".device_indices";
    absl::StatusOr<absl::Span<const int64_t>> dev =
        Indices(p[i].device_indices, p[i].num_device, dev_what.c_str());
    if (!dev.ok()) return dev.status();
    out.push_back(MakePoolTransfer(*entry, *host, *dev));
  }
  return out;
}

// A backup or load that names its event set (kvhost_*_with_events): the
// arguments checked as Transfer checks them, then `submit(client,
// attachment id, host, device, pool transfers)`'s LoadTicket into *ticket.
template <typename Submit>
absl::Status TransferWithEvents(kvhost_client* client, const kvhost_attachment* attachment,
                                const int64_t* host_indices, size_t num_host,
                                const int64_t* device_indices, size_t num_device,
                                const kvhost_pool_transfer* pool_transfers,
                                size_t num_pool_transfers, kvhost_load_ticket* ticket,
                                Submit&& submit) {
  if (absl::Status s = NotNull(ticket, "ticket"); !s.ok()) return s;
  absl::StatusOr<std::vector<v1::PoolTransfer>> transfers =
      PoolTransfers(pool_transfers, num_pool_transfers);
  if (!transfers.ok()) return transfers.status();
  absl::StatusOr<Client*> c = ClientOf(client);
  if (!c.ok()) return c.status();
  absl::StatusOr<const v1::Attachment*> a = AttachmentOf(attachment);
  if (!a.ok()) return a.status();
  absl::StatusOr<absl::Span<const int64_t>> host = Indices(host_indices, num_host, "host_indices");
  if (!host.ok()) return host.status();
  absl::StatusOr<absl::Span<const int64_t>> dev =
      Indices(device_indices, num_device, "device_indices");
  if (!dev.ok()) return dev.status();
  absl::StatusOr<LoadTicket> done = submit(**c, (*a)->id(), *host, *dev, *transfers);
  if (!done.ok()) return done.status();
  *ticket = kvhost_load_ticket{done->ticket_id, done->event_set, 0, done->layer_base};
  return absl::OkStatus();
}

}  // namespace
}  // namespace kvhost::c_api

using kvhost::c_api::ClientOf;
using kvhost::c_api::NotNull;
using kvhost::c_api::Run;
using kvhost::c_api::Str;

extern "C" {

int kvhost_shm_device_pool_create(kvhost_client* client, const char* pool,
                                  uint64_t device_size_tokens, const char* shm_dir,
                                  uint32_t start_layer, uint32_t end_layer,
                                  kvhost_shm_device_pool** out, char* err, size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    if (absl::Status s = NotNull(out, "out"); !s.ok()) return s;
    *out = nullptr;
    absl::StatusOr<kvhost::Client*> c = ClientOf(client);
    if (!c.ok()) return c.status();
    absl::StatusOr<std::string> p = Str(pool, "pool name");
    if (!p.ok()) return p.status();
    absl::StatusOr<kvhost::v1::Pool> info = (*c)->GetPool(*p);
    if (!info.ok()) return info.status();
    absl::StatusOr<std::unique_ptr<kvhost::ShmDevicePool>> dev = kvhost::ShmDevicePool::Create(
        *info, device_size_tokens, shm_dir == nullptr ? "/dev/shm" : shm_dir, start_layer,
        end_layer);
    if (!dev.ok()) return dev.status();
    auto handle = std::make_unique<kvhost_shm_device_pool>();
    handle->pool = *std::move(dev);
    *out = handle.release();
    return absl::OkStatus();
  });
}

void kvhost_shm_device_pool_destroy(kvhost_shm_device_pool* device) {
  try {
    delete device;
  } catch (...) {
  }
}

int kvhost_shm_device_pool_info(const kvhost_shm_device_pool* device, uint32_t* components,
                                uint32_t* layers, uint64_t* bytes, char* err, size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    absl::StatusOr<const kvhost::ShmDevicePool*> d = kvhost::c_api::DeviceOf(device);
    if (!d.ok()) return d.status();
    if (components != nullptr) *components = (*d)->components();
    if (layers != nullptr) *layers = (*d)->layers();
    if (bytes != nullptr) *bytes = (*d)->bytes();
    return absl::OkStatus();
  });
}

int kvhost_shm_device_pool_component(const kvhost_shm_device_pool* device, uint32_t component,
                                     char* name, size_t name_len, size_t* name_needed,
                                     uint64_t* rows, uint64_t* row_bytes, uint64_t* row_tokens,
                                     char* err, size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    absl::StatusOr<const kvhost::ShmDevicePool*> d = kvhost::c_api::DeviceOf(device);
    if (!d.ok()) return d.status();
    if (component >= (*d)->components()) {
      return absl::InvalidArgumentError(
          absl::StrCat("component ", component, " out of range [0, ", (*d)->components(), ")"));
    }
    if (rows != nullptr) *rows = (*d)->rows(component);
    if (row_bytes != nullptr) *row_bytes = (*d)->row_bytes(component);
    if (row_tokens != nullptr) *row_tokens = (*d)->row_tokens(component);
    if (name == nullptr && name_len == 0 && name_needed == nullptr) return absl::OkStatus();
    return kvhost::c_api::WriteString((*d)->component_name(component), name, name_len, name_needed,
                                      "the component name");
  });
}

int kvhost_shm_device_pool_layer(const kvhost_shm_device_pool* device, uint32_t component,
                                 uint32_t layer, void** base, uint64_t* bytes, char* err,
                                 size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    absl::StatusOr<const kvhost::ShmDevicePool*> d = kvhost::c_api::DeviceOf(device);
    if (!d.ok()) return d.status();
    if (component >= (*d)->components() || layer >= (*d)->layers()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "component ", component, " layer ", layer, " out of range: the device pool has ",
          (*d)->components(), " components of ", (*d)->layers(), " layers"));
    }
    if (base != nullptr) *base = (*d)->layer(component, layer);
    if (bytes != nullptr) *bytes = (*d)->rows(component) * (*d)->row_bytes(component);
    return absl::OkStatus();
  });
}

int kvhost_attach_shm(kvhost_client* client, const char* pool, const kvhost_shm_device_pool* device,
                      const char* options_json, kvhost_attachment** out, char* err,
                      size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    if (absl::Status s = NotNull(out, "out"); !s.ok()) return s;
    *out = nullptr;
    absl::StatusOr<kvhost::Client*> c = ClientOf(client);
    if (!c.ok()) return c.status();
    absl::StatusOr<std::string> p = Str(pool, "pool name");
    if (!p.ok()) return p.status();
    absl::StatusOr<const kvhost::ShmDevicePool*> d = kvhost::c_api::DeviceOf(device);
    if (!d.ok()) return d.status();
    return kvhost::c_api::Attach(**c, (*d)->MakeAttachRequest(*p), options_json,
                                 /*layer_range=*/false, std::make_unique<kvhost_attachment>(), out);
  });
}

int kvhost_attach_group_shm(kvhost_client* client, const char* group, size_t num_entries,
                            const char* const* entries,
                            const kvhost_shm_device_pool* const* devices, const char* options_json,
                            kvhost_attachment** out, char* err, size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    if (absl::Status s = NotNull(out, "out"); !s.ok()) return s;
    *out = nullptr;
    absl::StatusOr<kvhost::Client*> c = ClientOf(client);
    if (!c.ok()) return c.status();
    absl::StatusOr<std::string> g = Str(group, "group name");
    if (!g.ok()) return g.status();
    if (num_entries == 0) return absl::InvalidArgumentError("num_entries is 0");
    if (absl::Status s = NotNull(entries, "entries"); !s.ok()) return s;
    if (absl::Status s = NotNull(devices, "devices"); !s.ok()) return s;
    std::vector<kvhost::GroupDevice> group_devices;
    group_devices.reserve(num_entries);
    for (size_t i = 0; i < num_entries; ++i) {
      const std::string what = absl::StrCat("entries[", i, "]");
      absl::StatusOr<std::string> entry = Str(entries[i], what.c_str());
      if (!entry.ok()) return entry.status();
      absl::StatusOr<const kvhost::ShmDevicePool*> d = kvhost::c_api::DeviceOf(devices[i]);
      if (!d.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat("devices[", i, "] (entry '", *entry, "') is NULL"));
      }
      group_devices.push_back(kvhost::GroupDevice{*entry, *d});
    }
    return kvhost::c_api::Attach(**c, kvhost::MakeGroupAttachRequest(*g, group_devices),
                                 options_json, /*layer_range=*/false,
                                 std::make_unique<kvhost_attachment>(), out);
  });
}

int kvhost_attachment_id(const kvhost_attachment* attachment, char* out, size_t out_len,
                         size_t* needed, char* err, size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    absl::StatusOr<const kvhost::v1::Attachment*> a = kvhost::c_api::AttachmentOf(attachment);
    if (!a.ok()) return a.status();
    return kvhost::c_api::WriteString((*a)->id(), out, out_len, needed, "the attachment id");
  });
}

int kvhost_attachment_json(const kvhost_attachment* attachment, char* out, size_t out_len,
                           size_t* needed, char* err, size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    absl::StatusOr<const kvhost::v1::Attachment*> a = kvhost::c_api::AttachmentOf(attachment);
    if (!a.ok()) return a.status();
    return kvhost::c_api::WriteJson(**a, out, out_len, needed, "the attachment");
  });
}

int kvhost_detach(kvhost_client* client, const kvhost_attachment* attachment, char* err,
                  size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    absl::StatusOr<kvhost::Client*> c = ClientOf(client);
    if (!c.ok()) return c.status();
    absl::StatusOr<const kvhost::v1::Attachment*> a = kvhost::c_api::AttachmentOf(attachment);
    if (!a.ok()) return a.status();
    return (*c)->DetachDevice((*a)->id());
  });
}

void kvhost_attachment_destroy(kvhost_attachment* attachment) {
  try {
    delete attachment;
  } catch (...) {
  }
}

// The plain calls are the group calls with no other entries' rows, as in
// the C++ client.
int kvhost_backup(kvhost_client* client, const kvhost_attachment* attachment,
                  const int64_t* host_indices, size_t num_host, const int64_t* device_indices,
                  size_t num_device, const void* wait_event_handle, size_t wait_event_handle_len,
                  uint32_t flags, int64_t wait_timeout_ms, uint64_t* ticket_id, char* err,
                  size_t err_len) {
  return kvhost_backup_group(client, attachment, host_indices, num_host, device_indices, num_device,
                             nullptr, 0, wait_event_handle, wait_event_handle_len, flags,
                             wait_timeout_ms, ticket_id, err, err_len);
}

int kvhost_load(kvhost_client* client, const kvhost_attachment* attachment,
                const int64_t* host_indices, size_t num_host, const int64_t* device_indices,
                size_t num_device, uint32_t flags, int64_t wait_timeout_ms, uint64_t* ticket_id,
                char* err, size_t err_len) {
  return kvhost_load_group(client, attachment, host_indices, num_host, device_indices, num_device,
                           nullptr, 0, flags, wait_timeout_ms, ticket_id, err, err_len);
}

int kvhost_backup_group(kvhost_client* client, const kvhost_attachment* attachment,
                        const int64_t* host_indices, size_t num_host, const int64_t* device_indices,
                        size_t num_device, const kvhost_pool_transfer* pool_transfers,
                        size_t num_pool_transfers, const void* wait_event_handle,
                        size_t wait_event_handle_len, uint32_t flags, int64_t wait_timeout_ms,
                        uint64_t* ticket_id, char* err, size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    absl::StatusOr<std::string> handle =
        kvhost::c_api::EventHandle(wait_event_handle, wait_event_handle_len, "wait_event_handle");
    if (!handle.ok()) return handle.status();
    absl::StatusOr<std::vector<kvhost::v1::PoolTransfer>> transfers =
        kvhost::c_api::PoolTransfers(pool_transfers, num_pool_transfers);
    if (!transfers.ok()) return transfers.status();
    return kvhost::c_api::Transfer(
        client, attachment, host_indices, num_host, device_indices, num_device, flags,
        wait_timeout_ms, ticket_id,
        [&](kvhost::Client& c, const std::string& id, absl::Span<const int64_t> host,
            absl::Span<const int64_t> dev) {
          return c.Backup(id, host, dev, *transfers, *handle);
        });
  });
}

int kvhost_alloc_backup(kvhost_client* client, const kvhost_attachment* attachment,
                        const int64_t* device_indices, size_t num_device, int64_t* host_indices,
                        size_t host_capacity, size_t* count, const void* wait_event_handle,
                        size_t wait_event_handle_len, uint32_t flags, int64_t wait_timeout_ms,
                        uint64_t* ticket_id, char* err, size_t err_len) {
  using kvhost::c_api::Indices;
  return Run(err, err_len, [&]() -> absl::Status {
    absl::StatusOr<kvhost::Client*> c = kvhost::c_api::ClientOf(client);
    if (!c.ok()) return c.status();
    absl::StatusOr<const kvhost::v1::Attachment*> a = kvhost::c_api::AttachmentOf(attachment);
    if (!a.ok()) return a.status();
    absl::StatusOr<absl::Span<const int64_t>> dev =
        Indices(device_indices, num_device, "device_indices");
    if (!dev.ok()) return dev.status();
    absl::StatusOr<std::string> handle =
        kvhost::c_api::EventHandle(wait_event_handle, wait_event_handle_len, "wait_event_handle");
    if (!handle.ok()) return handle.status();
    if ((flags & ~KVHOST_TRANSFER_WAIT) != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown transfer flags 0x", absl::Hex(flags & ~KVHOST_TRANSFER_WAIT)));
    }
    absl::StatusOr<absl::Duration> timeout =
        kvhost::c_api::Timeout(wait_timeout_ms, absl::Minutes(10), "wait_timeout");
    if (!timeout.ok()) return timeout.status();
    // Checked before the call, so a short buffer allocates nothing.
    if (count != nullptr) *count = num_device;
    if (host_capacity < num_device || (host_indices == nullptr && num_device > 0)) {
      return absl::OutOfRangeError(absl::StrCat(
          "AllocBackup of ", num_device, " rows needs room for ", num_device,
          " host indices; the buffer has ", host_indices == nullptr ? 0 : host_capacity));
    }
    kvhost::v1::AllocBackupRequest request;
    kvhost::v1::BackupRequest* backup = request.mutable_backup();
    backup->set_attachment_id((*a)->id());
    backup->mutable_device_indices()->Add(dev->begin(), dev->end());
    backup->set_wait_event_handle(*std::move(handle));
    absl::StatusOr<kvhost::v1::AllocBackupResponse> done = (*c)->AllocBackup(request);
    if (!done.ok()) return done.status();
    if (static_cast<size_t>(done->host_indices_size()) != num_device) {
      return absl::InternalError(absl::StrCat("AllocBackup of ", num_device, " rows returned ",
                                              done->host_indices_size(), " host slots"));
    }
    std::copy(done->host_indices().begin(), done->host_indices().end(), host_indices);
    if (ticket_id != nullptr) *ticket_id = done->ticket().id();
    if ((flags & KVHOST_TRANSFER_WAIT) == 0) return absl::OkStatus();
    return (*c)->WaitTransfer(done->ticket().id(), *timeout).status();
  });
}

int kvhost_load_group(kvhost_client* client, const kvhost_attachment* attachment,
                      const int64_t* host_indices, size_t num_host, const int64_t* device_indices,
                      size_t num_device, const kvhost_pool_transfer* pool_transfers,
                      size_t num_pool_transfers, uint32_t flags, int64_t wait_timeout_ms,
                      uint64_t* ticket_id, char* err, size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    absl::StatusOr<std::vector<kvhost::v1::PoolTransfer>> transfers =
        kvhost::c_api::PoolTransfers(pool_transfers, num_pool_transfers);
    if (!transfers.ok()) return transfers.status();
    return kvhost::c_api::Transfer(
        client, attachment, host_indices, num_host, device_indices, num_device, flags,
        wait_timeout_ms, ticket_id,
        [&](kvhost::Client& c, const std::string& id, absl::Span<const int64_t> host,
            absl::Span<const int64_t> dev) { return c.Load(id, host, dev, *transfers); });
  });
}

int kvhost_load_with_events(kvhost_client* client, const kvhost_attachment* attachment,
                            const int64_t* host_indices, size_t num_host,
                            const int64_t* device_indices, size_t num_device,
                            kvhost_load_ticket* ticket, char* err, size_t err_len) {
  return kvhost_load_group_with_events(client, attachment, host_indices, num_host, device_indices,
                                       num_device, nullptr, 0, ticket, err, err_len);
}

int kvhost_load_group_with_events(kvhost_client* client, const kvhost_attachment* attachment,
                                  const int64_t* host_indices, size_t num_host,
                                  const int64_t* device_indices, size_t num_device,
                                  const kvhost_pool_transfer* pool_transfers,
                                  size_t num_pool_transfers, kvhost_load_ticket* ticket, char* err,
                                  size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    return kvhost::c_api::TransferWithEvents(
        client, attachment, host_indices, num_host, device_indices, num_device, pool_transfers,
        num_pool_transfers, ticket,
        [](kvhost::Client& c, const std::string& id, absl::Span<const int64_t> host,
           absl::Span<const int64_t> dev, const std::vector<kvhost::v1::PoolTransfer>& transfers) {
          // No pool_transfers is the plain pool's call, whose behaviour stays its own.
          return transfers.empty() ? c.LoadWithEvents(id, host, dev)
                                   : c.LoadWithEvents(id, host, dev, transfers);
        });
  });
}

int kvhost_load_group_with_events_after(kvhost_client* client, const kvhost_attachment* attachment,
                                        const int64_t* host_indices, size_t num_host,
                                        const int64_t* device_indices, size_t num_device,
                                        const kvhost_pool_transfer* pool_transfers,
                                        size_t num_pool_transfers, const void* wait_event_handle,
                                        size_t wait_event_handle_len, kvhost_load_ticket* ticket,
                                        char* err, size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    absl::StatusOr<std::string> handle =
        kvhost::c_api::EventHandle(wait_event_handle, wait_event_handle_len, "wait_event_handle");
    if (!handle.ok()) return handle.status();
    return kvhost::c_api::TransferWithEvents(
        client, attachment, host_indices, num_host, device_indices, num_device, pool_transfers,
        num_pool_transfers, ticket,
        [&](kvhost::Client& c, const std::string& id, absl::Span<const int64_t> host,
            absl::Span<const int64_t> dev, const std::vector<kvhost::v1::PoolTransfer>& transfers) {
          return c.LoadWithEvents(id, host, dev, transfers, *handle);
        });
  });
}

int kvhost_backup_with_events(kvhost_client* client, const kvhost_attachment* attachment,
                              const int64_t* host_indices, size_t num_host,
                              const int64_t* device_indices, size_t num_device,
                              const void* wait_event_handle, size_t wait_event_handle_len,
                              kvhost_load_ticket* ticket, char* err, size_t err_len) {
  return kvhost_backup_group_with_events(client, attachment, host_indices, num_host, device_indices,
                                         num_device, nullptr, 0, wait_event_handle,
                                         wait_event_handle_len, ticket, err, err_len);
}

int kvhost_backup_group_with_events(kvhost_client* client, const kvhost_attachment* attachment,
                                    const int64_t* host_indices, size_t num_host,
                                    const int64_t* device_indices, size_t num_device,
                                    const kvhost_pool_transfer* pool_transfers,
                                    size_t num_pool_transfers, const void* wait_event_handle,
                                    size_t wait_event_handle_len, kvhost_load_ticket* ticket,
                                    char* err, size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    absl::StatusOr<std::string> handle =
        kvhost::c_api::EventHandle(wait_event_handle, wait_event_handle_len, "wait_event_handle");
    if (!handle.ok()) return handle.status();
    return kvhost::c_api::TransferWithEvents(
        client, attachment, host_indices, num_host, device_indices, num_device, pool_transfers,
        num_pool_transfers, ticket,
        [&](kvhost::Client& c, const std::string& id, absl::Span<const int64_t> host,
            absl::Span<const int64_t> dev, const std::vector<kvhost::v1::PoolTransfer>& transfers) {
          return c.BackupWithEvents(id, host, dev, transfers, *handle);
        });
  });
}

int kvhost_transfer_wait(kvhost_client* client, uint64_t ticket_id, int64_t timeout_ms,
                         char* status_json, size_t status_len, size_t* status_needed, char* err,
                         size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    absl::StatusOr<kvhost::Client*> c = ClientOf(client);
    if (!c.ok()) return c.status();
    absl::StatusOr<absl::Duration> timeout =
        kvhost::c_api::Timeout(timeout_ms, absl::Minutes(10), "timeout");
    if (!timeout.ok()) return timeout.status();
    absl::StatusOr<kvhost::v1::TransferStatus> status = (*c)->WaitTransfer(ticket_id, *timeout);
    if (!status.ok()) return status.status();
    return kvhost::c_api::WriteTransferStatus(*status, status_json, status_len, status_needed);
  });
}

int kvhost_transfer_poll(kvhost_client* client, uint64_t ticket_id, int32_t* done,
                         char* status_json, size_t status_len, size_t* status_needed, char* err,
                         size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    absl::StatusOr<kvhost::Client*> c = ClientOf(client);
    if (!c.ok()) return c.status();
    if (done != nullptr) *done = 0;
    absl::StatusOr<kvhost::v1::TransferStatus> status = (*c)->PollTransfer(ticket_id);
    if (!status.ok()) return status.status();  // the ticket's error, or the call's
    if (done != nullptr) *done = status->done() ? 1 : 0;
    return kvhost::c_api::WriteTransferStatus(*status, status_json, status_len, status_needed);
  });
}

int kvhost_load_events_open(kvhost_client* client, const kvhost_attachment* attachment,
                            kvhost_load_events** out, char* err, size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    if (absl::Status s = NotNull(out, "out"); !s.ok()) return s;
    *out = nullptr;
    absl::StatusOr<kvhost::Client*> c = ClientOf(client);
    if (!c.ok()) return c.status();
    absl::StatusOr<const kvhost::v1::Attachment*> a = kvhost::c_api::AttachmentOf(attachment);
    if (!a.ok()) return a.status();
    auto events = std::make_unique<kvhost_load_events>();
    if ((*a)->load_event_handles_size() > 0) {
      // cuda backend: LoadEvents opens the counters too (layer_progress).
      absl::StatusOr<std::shared_ptr<kvhost::LoadEvents>> cuda =
          kvhost::c_api::OpenCudaLoadEvents(**c, **a);
      if (!cuda.ok()) return cuda.status();
      events->cuda = *std::move(cuda);
    } else if ((*a)->layer_progress()) {
      absl::StatusOr<std::unique_ptr<kvhost::LayerProgress>> progress =
          kvhost::LayerProgress::Open(**c, **a);
      if (!progress.ok()) return progress.status();
      events->progress = *std::move(progress);
    } else {
      return absl::FailedPreconditionError(
          absl::StrCat("attachment ", (*a)->id(), " of pool '", (*a)->pool(),
                       "' has no load events (", (*a)->backend(),
                       " backend) and no layer counters (attach with {\"layer_progress\": true})"));
    }
    *out = events.release();
    return absl::OkStatus();
  });
}

void kvhost_load_events_destroy(kvhost_load_events* events) {
  try {
    delete events;
  } catch (...) {
  }
}

int kvhost_wait_layer(const kvhost_load_events* events, const kvhost_load_ticket* ticket,
                      uint32_t layer, void* cuda_stream, int64_t timeout_ms, char* err,
                      size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    if (absl::Status s = NotNull(events, "events"); !s.ok()) return s;
    if (absl::Status s = NotNull(ticket, "ticket"); !s.ok()) return s;
    absl::StatusOr<absl::Duration> timeout =
        kvhost::c_api::Timeout(timeout_ms, absl::Seconds(10), "timeout");
    if (!timeout.ok()) return timeout.status();
    const kvhost::LoadTicket load{ticket->ticket_id, ticket->event_set, ticket->layer_base};
    if (events->cuda != nullptr) {
      return kvhost::c_api::WaitCudaLayer(*events->cuda, load, layer, cuda_stream, *timeout);
    }
    return events->progress->WaitRecorded(load, layer, *timeout);
  });
}

int kvhost_pool_map_open(kvhost_client* client, const kvhost_attachment* attachment, int* fds,
                         uint64_t* region_bytes, size_t capacity, size_t* count, char* err,
                         size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    if (absl::Status s = NotNull(count, "count"); !s.ok()) return s;
    *count = 0;
    absl::StatusOr<kvhost::Client*> c = ClientOf(client);
    if (!c.ok()) return c.status();
    absl::StatusOr<const kvhost::v1::Attachment*> a = kvhost::c_api::AttachmentOf(attachment);
    if (!a.ok()) return a.status();
    if ((*a)->handoff_socket().empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat("attachment ", (*a)->id(), " of pool '", (*a)->pool(),
                       "' names no handoff socket: its pool's regions are handed only for an "
                       "attachment of a plain pool made within a session"));
    }
    kvhost::v1::HandoffRequest request;
    request.set_attachment_id((*a)->id());
    request.set_kind(kvhost::v1::HANDOFF_KIND_POOL_MAP);
    for (const std::string& id : (*c)->session_ids()) request.add_session_ids(id);
    request.set_owner_token((*c)->options().owner_token);
    absl::StatusOr<kvhost::Handoff> handoff =
        kvhost::FetchHandoff((*a)->handoff_socket(), request, absl::Seconds(10));
    if (!handoff.ok()) return handoff.status();
    const size_t n = handoff->fds.size();
    if (n != static_cast<size_t>(handoff->pool_regions.region_bytes_size()) || n > capacity ||
        (n > 0 && (fds == nullptr || region_bytes == nullptr))) {
      return absl::ResourceExhaustedError(
          absl::StrCat("pool '", (*a)->pool(), "' has ", handoff->pool_regions.region_bytes_size(),
                       " regions (", n, " descriptors); room for ", capacity, " was given"));
    }
    for (size_t i = 0; i < n; ++i) {
      fds[i] = handoff->fds[i].Release();  // the caller's from here (kvhost_pool_map_open)
      region_bytes[i] = handoff->pool_regions.region_bytes(static_cast<int>(i));
    }
    *count = n;
    return absl::OkStatus();
  });
}

}  // extern "C"
