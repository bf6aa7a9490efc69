#include "kvhost/client.h"

#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace kvhost {
namespace {

absl::Status FromGrpc(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

template <typename Repeated>
void Fill(Repeated* field, absl::Span<const int64_t> values) {
  field->Reserve(static_cast<int>(values.size()));
  for (int64_t v : values) field->AddAlreadyReserved(v);
}

}  // namespace

uint32_t DTypeBytes(v1::DType dtype) {
  switch (dtype) {
    case v1::FP32:
      return 4;
    case v1::BF16:
    case v1::FP16:
      return 2;
    case v1::FP8_E4M3:
    case v1::FP8_E5M2:
    case v1::UINT8:
      return 1;
    default:
      return 0;
  }
}

uint64_t DeviceRowBytes(const v1::PoolSpec& spec) {
  const uint64_t b = DTypeBytes(spec.dtype());
  if (spec.kind() == v1::MLA) return (uint64_t{spec.kv_lora_rank()} + spec.qk_rope_head_dim()) * b;
  return uint64_t{spec.head_num()} * spec.head_dim() * b;
}

Client::Client(ClientOptions options, std::shared_ptr<grpc::Channel> channel)
    : options_(std::move(options)),
      channel_(std::move(channel)),
      daemon_(v1::DaemonService::NewStub(channel_)),
      pools_(v1::PoolService::NewStub(channel_)),
      transfers_(v1::TransferService::NewStub(channel_)) {}

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const ClientOptions& options) {
  if (options.address.empty()) return absl::InvalidArgumentError("client address is empty");
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(options.max_message_bytes);
  args.SetMaxSendMessageSize(options.max_message_bytes);
  // Reconnect quickly after a daemon restart instead of gRPC's default
  // backoff of up to two minutes.
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 2000);
  auto channel =
      grpc::CreateCustomChannel(options.address, grpc::InsecureChannelCredentials(), args);
  if (channel == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("cannot make a channel to ", options.address));
  }
  return std::unique_ptr<Client>(new Client(options, std::move(channel)));
}

#define KVHOST_CALL(stub, method, request, response, timeout)          \
  [&]() -> absl::Status {                                              \
    grpc::ClientContext context;                                       \
    context.set_deadline(absl::ToChronoTime(absl::Now() + (timeout))); \
    return FromGrpc((stub)->method(&context, (request), (response)));  \
  }()

absl::StatusOr<std::string> Client::Health(const std::string& service) {
  auto stub = grpc::health::v1::Health::NewStub(channel_);
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  grpc::health::v1::HealthCheckResponse response;
  absl::Status s = KVHOST_CALL(stub, Check, request, &response, options_.timeout);
  if (!s.ok()) return s;
  return grpc::health::v1::HealthCheckResponse::ServingStatus_Name(response.status());
}

absl::Status Client::WaitForReady(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  absl::Status last = absl::DeadlineExceededError("not tried");
  while (absl::Now() < deadline) {
    auto stub = grpc::health::v1::Health::NewStub(channel_);
    grpc::health::v1::HealthCheckRequest request;
    grpc::health::v1::HealthCheckResponse response;
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(std::min(deadline, absl::Now() + absl::Seconds(1))));
    context.set_wait_for_ready(true);
    last = FromGrpc(stub->Check(&context, request, &response));
    if (last.ok() && response.status() == grpc::health::v1::HealthCheckResponse::SERVING) {
      return absl::OkStatus();
    }
    if (last.ok()) last = absl::UnavailableError("daemon is not SERVING yet");
    absl::SleepFor(absl::Milliseconds(20));
  }
  return absl::DeadlineExceededError(
      absl::StrCat("kvhostd at ", options_.address, " not ready after ",
                   absl::FormatDuration(timeout), ": ", last.message()));
}

absl::StatusOr<v1::DaemonStatus> Client::GetStatus() {
  v1::GetStatusRequest request;
  v1::DaemonStatus response;
  absl::Status s = KVHOST_CALL(daemon_, GetStatus, request, &response, options_.timeout);
  if (!s.ok()) return s;
  return response;
}

absl::StatusOr<v1::Pool> Client::CreatePool(const std::string& name, const v1::PoolSpec& spec) {
  v1::CreatePoolRequest request;
  request.set_name(name);
  *request.mutable_spec() = spec;
  v1::Pool response;
  absl::Status s = KVHOST_CALL(pools_, CreatePool, request, &response, options_.timeout);
  if (!s.ok()) return s;
  return response;
}

absl::StatusOr<v1::Pool> Client::GetPool(const std::string& name) {
  v1::GetPoolRequest request;
  request.set_name(name);
  v1::Pool response;
  absl::Status s = KVHOST_CALL(pools_, GetPool, request, &response, options_.timeout);
  if (!s.ok()) return s;
  return response;
}

absl::StatusOr<std::vector<v1::Pool>> Client::ListPools() {
  v1::ListPoolsRequest request;
  v1::ListPoolsResponse response;
  absl::Status s = KVHOST_CALL(pools_, ListPools, request, &response, options_.timeout);
  if (!s.ok()) return s;
  return std::vector<v1::Pool>(response.pools().begin(), response.pools().end());
}

absl::StatusOr<uint64_t> Client::DeletePool(const std::string& name) {
  v1::DeletePoolRequest request;
  request.set_name(name);
  v1::DeletePoolResponse response;
  absl::Status s = KVHOST_CALL(pools_, DeletePool, request, &response, options_.timeout);
  if (!s.ok()) return s;
  return response.bytes_released();
}

absl::StatusOr<std::vector<int64_t>> Client::Alloc(const std::string& pool, uint64_t num_tokens) {
  v1::AllocRequest request;
  request.set_pool(pool);
  request.set_num_tokens(num_tokens);
  v1::AllocResponse response;
  absl::Status s = KVHOST_CALL(pools_, Alloc, request, &response, options_.timeout);
  if (!s.ok()) return s;
  return std::vector<int64_t>(response.indices().begin(), response.indices().end());
}

absl::StatusOr<uint64_t> Client::Free(const std::string& pool, absl::Span<const int64_t> indices) {
  v1::FreeRequest request;
  request.set_pool(pool);
  Fill(request.mutable_indices(), indices);
  v1::FreeResponse response;
  absl::Status s = KVHOST_CALL(pools_, Free, request, &response, options_.timeout);
  if (!s.ok()) return s;
  return response.freed();
}

absl::StatusOr<v1::PageBufferMeta> Client::GetPageBufferMeta(const std::string& pool,
                                                             absl::Span<const int64_t> indices) {
  v1::GetPageBufferMetaRequest request;
  request.set_pool(pool);
  Fill(request.mutable_indices(), indices);
  v1::PageBufferMeta response;
  absl::Status s = KVHOST_CALL(pools_, GetPageBufferMeta, request, &response, options_.timeout);
  if (!s.ok()) return s;
  return response;
}

absl::StatusOr<v1::Attachment> Client::AttachDevice(const v1::AttachDeviceRequest& request) {
  v1::Attachment response;
  absl::Status s = KVHOST_CALL(transfers_, AttachDevice, request, &response, options_.timeout);
  if (!s.ok()) return s;
  return response;
}

absl::Status Client::DetachDevice(const std::string& attachment_id) {
  v1::DetachDeviceRequest request;
  request.set_attachment_id(attachment_id);
  v1::DetachDeviceResponse response;
  return KVHOST_CALL(transfers_, DetachDevice, request, &response, options_.timeout);
}

absl::StatusOr<uint64_t> Client::Backup(const std::string& attachment_id,
                                        absl::Span<const int64_t> host_indices,
                                        absl::Span<const int64_t> device_indices) {
  return Backup(attachment_id, host_indices, device_indices, /*wait_event_handle=*/"");
}

absl::StatusOr<uint64_t> Client::Backup(const std::string& attachment_id,
                                        absl::Span<const int64_t> host_indices,
                                        absl::Span<const int64_t> device_indices,
                                        const std::string& wait_event_handle) {
  v1::BackupRequest request;
  request.set_attachment_id(attachment_id);
  request.set_wait_event_handle(wait_event_handle);
  Fill(request.mutable_host_indices(), host_indices);
  Fill(request.mutable_device_indices(), device_indices);
  v1::TransferTicket response;
  absl::Status s = KVHOST_CALL(transfers_, Backup, request, &response, options_.timeout);
  if (!s.ok()) return s;
  return response.id();
}

absl::StatusOr<uint64_t> Client::Load(const std::string& attachment_id,
                                      absl::Span<const int64_t> host_indices,
                                      absl::Span<const int64_t> device_indices) {
  absl::StatusOr<LoadTicket> ticket = LoadWithEvents(attachment_id, host_indices, device_indices);
  if (!ticket.ok()) return ticket.status();
  return ticket->ticket_id;
}

absl::StatusOr<LoadTicket> Client::LoadWithEvents(const std::string& attachment_id,
                                                  absl::Span<const int64_t> host_indices,
                                                  absl::Span<const int64_t> device_indices) {
  v1::LoadRequest request;
  request.set_attachment_id(attachment_id);
  Fill(request.mutable_host_indices(), host_indices);
  Fill(request.mutable_device_indices(), device_indices);
  v1::TransferTicket response;
  absl::Status s = KVHOST_CALL(transfers_, Load, request, &response, options_.timeout);
  if (!s.ok()) return s;
  return LoadTicket{response.id(), response.event_set()};
}

absl::StatusOr<v1::TransferStatus> Client::WaitTransfer(uint64_t ticket_id,
                                                        absl::Duration timeout) {
  v1::WaitTransferRequest request;
  request.set_ticket_id(ticket_id);
  v1::TransferStatus response;
  absl::Status s = KVHOST_CALL(transfers_, WaitTransfer, request, &response, timeout);
  if (!s.ok()) return s;
  return response;
}

absl::StatusOr<v1::TransferStatus> Client::PollTransfer(uint64_t ticket_id) {
  v1::WaitTransferRequest request;
  request.set_ticket_id(ticket_id);
  request.set_poll(true);
  v1::TransferStatus response;
  absl::Status s = KVHOST_CALL(transfers_, WaitTransfer, request, &response, options_.timeout);
  if (!s.ok()) return s;
  return response;
}

#undef KVHOST_CALL

absl::StatusOr<std::unique_ptr<ShmDevicePool>> ShmDevicePool::Create(const v1::Pool& pool,
                                                                     uint64_t device_size_tokens,
                                                                     const std::string& shm_dir) {
  const v1::PoolSpec& spec = pool.spec();
  const uint64_t row_bytes = DeviceRowBytes(spec);
  if (row_bytes == 0 || spec.layer_num() == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "pool '", pool.name(), "' has no row size; pass the Pool the daemon returned"));
  }
  if (device_size_tokens == 0) return absl::InvalidArgumentError("device_size_tokens must be >= 1");
  static std::atomic<uint64_t> counter{0};
  std::unique_ptr<ShmDevicePool> dev(new ShmDevicePool());
  dev->planes_ = spec.kind() == v1::MLA ? 1 : 2;
  dev->layers_ = spec.layer_num();
  dev->rows_ = device_size_tokens;
  dev->row_bytes_ = row_bytes;
  dev->bytes_ = uint64_t{dev->planes_} * dev->layers_ * dev->rows_ * row_bytes;
  dev->path_ = absl::StrCat(shm_dir, "/kvhost-dev.", ::getpid(), ".", counter++, ".", pool.name());
  const int fd = ::open(dev->path_.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot create ", dev->path_, ": ", std::strerror(errno)));
  }
  if (int err = ::posix_fallocate(fd, 0, static_cast<off_t>(dev->bytes_)); err != 0) {
    ::close(fd);
    ::unlink(dev->path_.c_str());
    return absl::ResourceExhaustedError(absl::StrCat("cannot reserve ", dev->bytes_, " bytes for ",
                                                     dev->path_, ": ", std::strerror(err)));
  }
  void* data = ::mmap(nullptr, dev->bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (data == MAP_FAILED) {
    ::unlink(dev->path_.c_str());
    return absl::ResourceExhaustedError(absl::StrCat("cannot map ", dev->path_));
  }
  dev->data_ = static_cast<uint8_t*>(data);
  return dev;
}

ShmDevicePool::~ShmDevicePool() {
  if (data_ != nullptr) ::munmap(data_, bytes_);
  if (!path_.empty()) ::unlink(path_.c_str());
}

uint8_t* ShmDevicePool::layer(uint32_t plane, uint32_t layer) const {
  return layer_ptr(plane, layer);
}

v1::AttachDeviceRequest ShmDevicePool::MakeAttachRequest(const std::string& pool_name) const {
  v1::AttachDeviceRequest request;
  request.set_pool(pool_name);
  request.set_device_size_tokens(rows_);
  for (uint32_t plane = 0; plane < planes_; ++plane) {
    for (uint32_t l = 0; l < layers_; ++l) {
      v1::DeviceBuffer* buffer = plane == 0 ? request.add_k_layers() : request.add_v_layers();
      buffer->mutable_shm()->set_path(path_);
      buffer->mutable_shm()->set_offset(static_cast<uint64_t>(layer_ptr(plane, l) - data_));
    }
  }
  return request;
}

}  // namespace kvhost
