// kvhost::Client: the C++ client of kvhostd, for schedulers (pools, alloc,
// free, page metadata) and workers (attach, backup, load, wait).
//
// Every call is a blocking gRPC call with a deadline (ClientOptions::timeout
// unless the call takes its own) and returns absl::Status / absl::StatusOr
// with the daemon's canonical code and message; nothing throws. A Client is
// cheap to share: all methods are thread-safe and reuse one channel.
//
// ShmDevicePool is the host backend's stand-in for a GPU worker's device KV
// pool: per-layer row buffers in a shared-memory file that kvhostd maps.
//
//   kvhost::ClientOptions options;  // address defaults to kDefaultAddress
//   auto client = kvhost::Client::Connect(options);
//   auto pool = (*client)->CreatePool("llama", spec);
//   auto slots = (*client)->Alloc("llama", 64);
#ifndef KVHOST_CLIENT_CLIENT_H_
#define KVHOST_CLIENT_CLIENT_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kvhost/v1/daemon.grpc.pb.h"
#include "kvhost/v1/pool.grpc.pb.h"
#include "kvhost/v1/transfer.grpc.pb.h"

namespace grpc {
class Channel;
}

namespace kvhost {

// The daemon's default address.
inline constexpr char kDefaultAddress[] = "unix:///run/kvhost/kvhost.sock";

struct ClientOptions {
  // "unix:///path.sock" or "host:port".
  std::string address = kDefaultAddress;
  // Deadline of each call unless the call gives its own.
  absl::Duration timeout = absl::Seconds(30);
  // Largest message either way (Alloc of many tokens returns many indices).
  int max_message_bytes = 64 << 20;
};

// A load's ticket and the load event set it records (cuda backend; see
// Attachment.load_event_handles), -1 where there is none to wait on.
struct LoadTicket {
  uint64_t ticket_id = 0;
  int32_t event_set = -1;
};

class Client {
 public:
  // Creates the channel; connecting happens on the first call (or WaitForReady).
  static absl::StatusOr<std::unique_ptr<Client>> Connect(const ClientOptions& options);

  // Waits until the daemon answers a health check with SERVING.
  absl::Status WaitForReady(absl::Duration timeout);
  // grpc.health.v1 status of `service` ("" = the whole server): "SERVING", ...
  absl::StatusOr<std::string> Health(const std::string& service = "");

  // DaemonService: engine, memory budget, attachments, ticket counters.
  absl::StatusOr<v1::DaemonStatus> GetStatus();

  // PoolService.
  absl::StatusOr<v1::Pool> CreatePool(const std::string& name, const v1::PoolSpec& spec);
  absl::StatusOr<v1::Pool> GetPool(const std::string& name);
  absl::StatusOr<std::vector<v1::Pool>> ListPools();
  // Returns the bytes released.
  absl::StatusOr<uint64_t> DeletePool(const std::string& name);
  absl::StatusOr<std::vector<int64_t>> Alloc(const std::string& pool, uint64_t num_tokens);
  // Returns the slots freed.
  absl::StatusOr<uint64_t> Free(const std::string& pool, absl::Span<const int64_t> indices);
  absl::StatusOr<v1::PageBufferMeta> GetPageBufferMeta(const std::string& pool,
                                                       absl::Span<const int64_t> indices);

  // TransferService.
  absl::StatusOr<v1::Attachment> AttachDevice(const v1::AttachDeviceRequest& request);
  absl::Status DetachDevice(const std::string& attachment_id);
  // Return the ticket id.
  absl::StatusOr<uint64_t> Backup(const std::string& attachment_id,
                                  absl::Span<const int64_t> host_indices,
                                  absl::Span<const int64_t> device_indices);
  // A backup whose copies wait for the worker's event first (cuda backend;
  // `wait_event_handle` from ExportEvent in kvhost/cuda_export.h, recorded
  // after the rows were written). FAILED_PRECONDITION on the host backend.
  absl::StatusOr<uint64_t> Backup(const std::string& attachment_id,
                                  absl::Span<const int64_t> host_indices,
                                  absl::Span<const int64_t> device_indices,
                                  const std::string& wait_event_handle);
  absl::StatusOr<uint64_t> Load(const std::string& attachment_id,
                                absl::Span<const int64_t> host_indices,
                                absl::Span<const int64_t> device_indices);
  // Load, also returning the event set to wait on per layer (LoadEvents).
  // RESOURCE_EXHAUSTED while every set of the attachment is busy.
  absl::StatusOr<LoadTicket> LoadWithEvents(const std::string& attachment_id,
                                            absl::Span<const int64_t> host_indices,
                                            absl::Span<const int64_t> device_indices);
  // Blocks until the ticket is done (its error if it failed) or `timeout`
  // passes (DEADLINE_EXCEEDED).
  absl::StatusOr<v1::TransferStatus> WaitTransfer(uint64_t ticket_id,
                                                  absl::Duration timeout = absl::Minutes(10));
  // The ticket's status now, without waiting.
  absl::StatusOr<v1::TransferStatus> PollTransfer(uint64_t ticket_id);

  const ClientOptions& options() const { return options_; }

 private:
  Client(ClientOptions options, std::shared_ptr<grpc::Channel> channel);

  const ClientOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::DaemonService::Stub> daemon_;
  std::unique_ptr<v1::PoolService::Stub> pools_;
  std::unique_ptr<v1::TransferService::Stub> transfers_;
};

// A device KV pool emulated in one shared-memory file (host backend): for each
// plane (K then V for MHA; the latent for MLA) and layer, `device_size_tokens`
// rows of the pool's row size, back to back. The file is removed when the
// object is destroyed. Not thread-safe to create or destroy; the bytes are the
// caller's to synchronise with transfers (wait for the ticket).
class ShmDevicePool {
 public:
  // `pool` as CreatePool / GetPool returned it. The file is created inside
  // `shm_dir`, which must be the daemon's --shm-dir.
  static absl::StatusOr<std::unique_ptr<ShmDevicePool>> Create(
      const v1::Pool& pool, uint64_t device_size_tokens, const std::string& shm_dir = "/dev/shm");
  ~ShmDevicePool();
  ShmDevicePool(const ShmDevicePool&) = delete;
  ShmDevicePool& operator=(const ShmDevicePool&) = delete;

  // Rows of layer `layer` of plane `plane` (0 = K / latent, 1 = V).
  uint8_t* layer(uint32_t plane, uint32_t layer) const;
  uint8_t* row(uint32_t plane, uint32_t layer, uint64_t row) const {
    return layer_ptr(plane, layer) + row * row_bytes_;
  }
  uint32_t planes() const { return planes_; }
  uint32_t layers() const { return layers_; }
  uint64_t rows() const { return rows_; }
  uint64_t row_bytes() const { return row_bytes_; }
  uint64_t bytes() const { return bytes_; }
  const std::string& path() const { return path_; }

  // The AttachDevice request that attaches this pool to `pool_name`.
  v1::AttachDeviceRequest MakeAttachRequest(const std::string& pool_name) const;

 private:
  ShmDevicePool() = default;
  uint8_t* layer_ptr(uint32_t plane, uint32_t layer) const {
    return data_ + (uint64_t{plane} * layers_ + layer) * rows_ * row_bytes_;
  }

  std::string path_;
  uint8_t* data_ = nullptr;
  uint64_t bytes_ = 0;
  uint32_t planes_ = 0;
  uint32_t layers_ = 0;
  uint64_t rows_ = 0;
  uint64_t row_bytes_ = 0;
};

// Bytes of one device row (one token, one layer, one plane) of a pool.
uint64_t DeviceRowBytes(const v1::PoolSpec& spec);
// Element size of a dtype in bytes (0 for DTYPE_UNSPECIFIED).
uint32_t DTypeBytes(v1::DType dtype);

}  // namespace kvhost

#endif  // KVHOST_CLIENT_CLIENT_H_
