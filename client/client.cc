#include "kvhost/client.h"

#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/calls.h"
#include "client/grpc_status.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "kvhost/v1/fast_path.pb.h"

namespace kvhost {
namespace {

// WritePages' chunk when the caller gives none (the daemon's ReadPages default).
constexpr size_t kDefaultPageChunkBytes = 4 << 20;

// How long one connection attempt may take to reach the daemon's HTTP/2
// SETTINGS (gRPC's "min connect timeout"; its default is 20 s).
constexpr int kMinConnectTimeoutMs = 10'000;

absl::StatusOr<std::string> ReadPemFile(const char* field, const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::FailedPreconditionError(absl::StrCat("ClientOptions.", field, " ", path,
                                                      " cannot be read: ", std::strerror(errno)));
  }
  std::ostringstream text;
  text << in.rdbuf();
  if (text.str().empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("ClientOptions.", field, " ", path, " is empty"));
  }
  return text.str();
}

// Unix sockets: plaintext (the socket file's mode and group are the
// control). TCP: TLS, unless options.insecure.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentials(
    const ClientOptions& options, grpc::ChannelArguments* args) {
  if (absl::StartsWith(options.address, "unix") || options.insecure) {
    return grpc::InsecureChannelCredentials();
  }
  if (options.tls_cert_file.empty() != options.tls_key_file.empty()) {
    return absl::InvalidArgumentError(
        "ClientOptions.tls_cert_file and tls_key_file go together; one was given alone");
  }
  grpc::SslCredentialsOptions ssl;
  if (!options.tls_ca_file.empty()) {  // else gRPC's default roots
    absl::StatusOr<std::string> ca = ReadPemFile("tls_ca_file", options.tls_ca_file);
    if (!ca.ok()) return ca.status();
    ssl.pem_root_certs = *std::move(ca);
  }
  if (!options.tls_cert_file.empty()) {
    absl::StatusOr<std::string> cert = ReadPemFile("tls_cert_file", options.tls_cert_file);
    if (!cert.ok()) return cert.status();
    absl::StatusOr<std::string> key = ReadPemFile("tls_key_file", options.tls_key_file);
    if (!key.ok()) return key.status();
    ssl.pem_cert_chain = *std::move(cert);
    ssl.pem_private_key = *std::move(key);
  }
  if (!options.tls_server_name.empty()) args->SetSslTargetNameOverride(options.tls_server_name);
  return grpc::SslCredentials(ssl);
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
  if (spec.kind() == v1::MLA || spec.kind() == v1::DSA) {
    if (spec.kv_cache_dim() != 0) return uint64_t{spec.kv_cache_dim()} * b;
    return (uint64_t{spec.kv_lora_rank()} + spec.qk_rope_head_dim()) * b;
  }
  return uint64_t{spec.head_num()} * spec.head_dim() * b;
}

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const ClientOptions& options) {
  if (options.address.empty()) return absl::InvalidArgumentError("client address is empty");
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(options.max_message_bytes);
  args.SetMaxSendMessageSize(options.max_message_bytes);
  // Reconnect quickly after a daemon restart instead of gRPC's default
  // backoff of up to two minutes.
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 2000);
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  // gRPC reads this as the least time a connection attempt is given to
  // finish its handshake (not a backoff): at 100 ms a loaded node's daemon
  // that answered a little late failed the call (CI's sanitizer run).
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, kMinConnectTimeoutMs);
  // While a call (such as the worker session) is open, find a daemon that
  // stopped answering within 15 s (the daemon allows pings every 1 s).
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 10000);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 5000);
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> credentials =
      ChannelCredentials(options, &args);
  if (!credentials.ok()) return credentials.status();
  auto channel = grpc::CreateCustomChannel(options.address, *credentials, args);
  if (channel == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("cannot make a channel to ", options.address));
  }
  return std::unique_ptr<Client>(new Client(options, std::move(channel)));
}

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
  request.set_owner_token(options_.owner_token);
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

absl::StatusOr<v1::PoolClaim> Client::ClaimPool(const std::string& pool,
                                                const std::string& instance_id) {
  if (absl::Status s = OpenWorkerSession(absl::StrCat("ClaimPool of pool '", pool, "'")); !s.ok()) {
    return s;
  }
  v1::ClaimPoolRequest request;
  request.set_pool(pool);
  request.set_instance_id(instance_id);
  v1::PoolClaim response;
  absl::Status s = KVHOST_SESSION_CALL(pools_, ClaimPool, request, &response, options_.timeout);
  if (!s.ok()) return s;
  return response;
}

absl::StatusOr<std::vector<int64_t>> Client::Alloc(const std::string& pool, uint64_t num_tokens) {
  v1::AllocRequest request;
  request.set_pool(pool);
  request.set_num_tokens(num_tokens);
  v1::AllocResponse response;
  absl::Status s =
      KVHOST_FAST_CALL(FAST_PATH_METHOD_ALLOC, pools_, Alloc, request, &response, options_.timeout);
  if (!s.ok()) return s;
  return std::vector<int64_t>(response.indices().begin(), response.indices().end());
}

absl::StatusOr<uint64_t> Client::Free(const std::string& pool, absl::Span<const int64_t> indices) {
  v1::FreeRequest request;
  request.set_pool(pool);
  Fill(request.mutable_indices(), indices);
  v1::FreeResponse response;
  absl::Status s =
      KVHOST_FAST_CALL(FAST_PATH_METHOD_FREE, pools_, Free, request, &response, options_.timeout);
  if (!s.ok()) return s;
  return response.freed();
}

absl::StatusOr<std::vector<std::vector<int64_t>>> Client::AllocBatch(
    const std::string& pool, absl::Span<const uint64_t> num_tokens) {
  v1::AllocBatchRequest request;
  request.set_pool(pool);
  request.mutable_num_tokens()->Add(num_tokens.begin(), num_tokens.end());
  v1::AllocBatchResponse response;
  absl::Status s = KVHOST_FAST_CALL(FAST_PATH_METHOD_ALLOC_BATCH, pools_, AllocBatch, request,
                                    &response, options_.timeout);
  if (!s.ok()) return s;
  std::vector<std::vector<int64_t>> runs;
  runs.reserve(response.runs_size());
  for (const v1::IndexRun& run : response.runs()) {
    runs.emplace_back(run.indices().begin(), run.indices().end());
  }
  return runs;
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

absl::StatusOr<std::string> Client::GetDataPage(const std::string& pool, int64_t index) {
  v1::PageRequest request;
  request.set_pool(pool);
  request.set_index(index);
  v1::PageData response;
  absl::Status s = KVHOST_CALL(pools_, GetDataPage, request, &response, options_.timeout);
  if (!s.ok()) return s;
  return std::move(*response.mutable_data());
}

absl::Status Client::SetFromFlatDataPage(const std::string& pool, int64_t index,
                                         absl::string_view data) {
  v1::SetPageRequest request;
  request.set_pool(pool);
  request.set_index(index);
  request.set_data(data.data(), data.size());
  v1::SetPageResponse response;
  return KVHOST_SESSION_CALL(pools_, SetFromFlatDataPage, request, &response, options_.timeout);
}

absl::StatusOr<std::vector<std::string>> Client::ReadPages(const std::string& pool,
                                                           absl::Span<const int64_t> indices,
                                                           uint32_t chunk_bytes) {
  v1::ReadPagesRequest request;
  request.set_pool(pool);
  Fill(request.mutable_indices(), indices);
  request.set_chunk_bytes(chunk_bytes);
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + options_.timeout));
  AddOwnerToken(options_, &context);
  std::unique_ptr<grpc::ClientReader<v1::PageData>> reader = pools_->ReadPages(&context, request);
  std::vector<std::string> pages;
  pages.reserve(indices.size());
  absl::Status order;       // the first chunk that breaks the protocol
  uint64_t page_bytes = 0;  // of pages.back()
  v1::PageData chunk;
  while (reader->Read(&chunk)) {
    if (!order.ok()) continue;
    // A chunk continues the current page, or starts the next one at 0.
    const bool current_done = pages.empty() || pages.back().size() == page_bytes;
    if (current_done && pages.size() < indices.size() && chunk.offset() == 0 &&
        chunk.index() == indices[pages.size()]) {
      pages.emplace_back();
      page_bytes = chunk.page_bytes();
      pages.back().reserve(page_bytes);
    } else if (current_done || chunk.index() != indices[pages.size() - 1] ||
               chunk.offset() != pages.back().size()) {
      order = absl::InternalError(absl::StrCat("ReadPages: chunk of page ", chunk.index(),
                                               " at offset ", chunk.offset(), " out of order"));
      continue;
    }
    if (chunk.data().size() > page_bytes - pages.back().size()) {
      order = absl::InternalError(
          absl::StrCat("ReadPages: page ", chunk.index(), " overruns its ", page_bytes, " bytes"));
      continue;
    }
    pages.back().append(chunk.data());
  }
  if (absl::Status s = FromGrpc(reader->Finish()); !s.ok()) return s;
  if (!order.ok()) return order;
  if (pages.size() != indices.size() || (!pages.empty() && pages.back().size() != page_bytes)) {
    return absl::InternalError(absl::StrCat("ReadPages: the stream ended after ", pages.size(),
                                            " of ", indices.size(), " pages (the last one ",
                                            pages.empty() ? 0 : pages.back().size(), " of ",
                                            page_bytes, " bytes)"));
  }
  return pages;
}

absl::StatusOr<uint64_t> Client::WritePages(const std::string& pool,
                                            absl::Span<const int64_t> indices,
                                            absl::Span<const std::string> pages,
                                            uint32_t chunk_bytes) {
  if (indices.size() != pages.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("WritePages: ", indices.size(), " indices but ", pages.size(), " pages"));
  }
  const size_t chunk = chunk_bytes == 0 ? kDefaultPageChunkBytes : chunk_bytes;
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + options_.timeout));
  AddOwnerToken(options_, &context);
  // A pool a session holds takes only that session's writes (ClaimPool).
  for (const std::string& id : SessionIds()) context.AddMetadata("kvhost-session", id);
  v1::WritePagesResponse response;
  std::unique_ptr<grpc::ClientWriter<v1::WritePagesChunk>> writer =
      pools_->WritePages(&context, &response);
  bool open = true;  // false once the daemon ended the stream (its status says why)
  for (size_t i = 0; i < pages.size() && open; ++i) {
    const std::string& page = pages[i];
    size_t offset = 0;
    do {  // a page of 0 bytes still sends its one chunk
      v1::WritePagesChunk message;
      if (i == 0 && offset == 0) message.set_pool(pool);
      message.set_index(indices[i]);
      message.set_offset(offset);
      const size_t n = std::min(chunk, page.size() - offset);
      message.set_data(page.data() + offset, n);
      offset += n;
      open = writer->Write(message);
    } while (open && offset < page.size());
  }
  if (open) writer->WritesDone();
  if (absl::Status s = FromGrpc(writer->Finish()); !s.ok()) return s;
  return response.pages_written();
}

absl::StatusOr<v1::PageShape> Client::GetPageShape(const std::string& pool) {
  v1::GetPageShapeRequest request;
  request.set_pool(pool);
  v1::PageShape response;
  absl::Status s = KVHOST_CALL(pools_, GetPageShape, request, &response, options_.timeout);
  if (!s.ok()) return s;
  return response;
}

namespace {

v1::StorePagesRequest StoreRequest(const std::string& pool, absl::Span<const int64_t> indices,
                                   const std::vector<std::string>& keys, bool detach) {
  v1::StorePagesRequest request;
  request.set_pool(pool);
  Fill(request.mutable_indices(), indices);
  for (const std::string& key : keys) request.add_keys(key);
  request.set_detach(detach);
  return request;
}

v1::FetchPagesRequest FetchRequest(const std::string& pool, const std::vector<std::string>& keys,
                                   absl::Span<const int64_t> indices, bool detach) {
  v1::FetchPagesRequest request;
  request.set_pool(pool);
  for (const std::string& key : keys) request.add_keys(key);
  Fill(request.mutable_indices(), indices);
  request.set_detach(detach);
  return request;
}

}  // namespace

absl::StatusOr<v1::StorePagesResponse> Client::StorePages(const std::string& pool,
                                                          absl::Span<const int64_t> indices,
                                                          const std::vector<std::string>& keys) {
  v1::StorePagesResponse response;
  absl::Status s = KVHOST_CALL(storage_, StorePages, StoreRequest(pool, indices, keys, false),
                               &response, options_.timeout);
  if (!s.ok()) return s;
  return response;
}

absl::StatusOr<v1::FetchPagesResponse> Client::FetchPages(const std::string& pool,
                                                          const std::vector<std::string>& keys,
                                                          absl::Span<const int64_t> indices) {
  v1::FetchPagesResponse response;
  absl::Status s = KVHOST_SESSION_CALL(
      storage_, FetchPages, FetchRequest(pool, keys, indices, false), &response, options_.timeout);
  if (!s.ok()) return s;
  return response;
}

absl::StatusOr<uint64_t> Client::StartStorePages(const std::string& pool,
                                                 absl::Span<const int64_t> indices,
                                                 const std::vector<std::string>& keys) {
  v1::StorePagesResponse response;
  absl::Status s = KVHOST_CALL(storage_, StorePages, StoreRequest(pool, indices, keys, true),
                               &response, options_.timeout);
  if (!s.ok()) return s;
  return response.ticket_id();
}

absl::StatusOr<uint64_t> Client::StartFetchPages(const std::string& pool,
                                                 const std::vector<std::string>& keys,
                                                 absl::Span<const int64_t> indices) {
  v1::FetchPagesResponse response;
  absl::Status s = KVHOST_SESSION_CALL(
      storage_, FetchPages, FetchRequest(pool, keys, indices, true), &response, options_.timeout);
  if (!s.ok()) return s;
  return response.ticket_id();
}

absl::StatusOr<v1::StorageTicketStatus> Client::WaitStorage(const std::string& pool,
                                                            uint64_t ticket, bool poll) {
  v1::WaitStorageRequest request;
  request.set_pool(pool);
  request.set_ticket_id(ticket);
  request.set_poll(poll);
  v1::StorageTicketStatus response;
  absl::Status s = KVHOST_CALL(storage_, WaitStorage, request, &response, options_.timeout);
  if (!s.ok()) return s;
  return response;
}

absl::StatusOr<uint64_t> Client::ExistPages(const std::string& pool,
                                            const std::vector<std::string>& keys) {
  v1::ExistPagesRequest request;
  request.set_pool(pool);
  for (const std::string& key : keys) request.add_keys(key);
  v1::ExistPagesResponse response;
  absl::Status s = KVHOST_CALL(storage_, ExistPages, request, &response, options_.timeout);
  if (!s.ok()) return s;
  return response.prefix_pages();
}

absl::StatusOr<v1::PageBufferMeta> Client::GetSplitHeadsPageBufferMeta(
    const std::string& pool, absl::Span<const int64_t> indices, uint32_t split_factor) {
  v1::SplitHeadsMetaRequest request;
  request.set_pool(pool);
  Fill(request.mutable_indices(), indices);
  request.set_split_factor(split_factor);
  v1::PageBufferMeta response;
  absl::Status s =
      KVHOST_CALL(pools_, GetSplitHeadsPageBufferMeta, request, &response, options_.timeout);
  if (!s.ok()) return s;
  return response;
}

absl::StatusOr<v1::StrideAlignment> Client::IsStridePageAligned(const std::string& pool,
                                                                uint64_t alignment) {
  v1::StrideAlignmentRequest request;
  request.set_pool(pool);
  request.set_alignment(alignment);
  v1::StrideAlignment response;
  absl::Status s = KVHOST_CALL(pools_, IsStridePageAligned, request, &response, options_.timeout);
  if (!s.ok()) return s;
  return response;
}

absl::StatusOr<v1::ContiguousBufferInfos> Client::GetContiguousBufferInfos(
    const std::string& pool) {
  v1::ContiguousBufferInfosRequest request;
  request.set_pool(pool);
  v1::ContiguousBufferInfos response;
  absl::Status s =
      KVHOST_CALL(pools_, GetContiguousBufferInfos, request, &response, options_.timeout);
  if (!s.ok()) return s;
  return response;
}

absl::StatusOr<v1::PoolGroup> Client::CreatePoolGroup(const std::string& name, uint32_t layer_num,
                                                      const std::vector<v1::PoolEntry>& entries) {
  v1::CreatePoolGroupRequest request;
  request.set_name(name);
  request.set_layer_num(layer_num);
  for (const v1::PoolEntry& e : entries) *request.add_entries() = e;
  v1::PoolGroup response;
  absl::Status s = KVHOST_CALL(pools_, CreatePoolGroup, request, &response, options_.timeout);
  if (!s.ok()) return s;
  return response;
}

absl::StatusOr<v1::PoolGroup> Client::GetPoolGroup(const std::string& name) {
  v1::GetPoolGroupRequest request;
  request.set_name(name);
  v1::PoolGroup response;
  absl::Status s = KVHOST_CALL(pools_, GetPoolGroup, request, &response, options_.timeout);
  if (!s.ok()) return s;
  return response;
}

absl::StatusOr<std::vector<v1::PoolGroup>> Client::ListPoolGroups() {
  v1::ListPoolGroupsRequest request;
  v1::ListPoolGroupsResponse response;
  absl::Status s = KVHOST_CALL(pools_, ListPoolGroups, request, &response, options_.timeout);
  if (!s.ok()) return s;
  return std::vector<v1::PoolGroup>(response.groups().begin(), response.groups().end());
}

absl::Status Client::DeletePoolGroup(const std::string& name) {
  v1::DeletePoolGroupRequest request;
  request.set_name(name);
  v1::DeletePoolGroupResponse response;
  return KVHOST_CALL(pools_, DeletePoolGroup, request, &response, options_.timeout);
}

absl::StatusOr<v1::Attachment> Client::AttachOnce(const v1::AttachDeviceRequest& request) {
  v1::Attachment response;
  absl::Status s = KVHOST_TRANSFER_CALL(AttachDevice, request, &response, options_.timeout);
  if (!s.ok()) return s;
  return response;
}

absl::Status Client::DetachDevice(const std::string& attachment_id) {
  v1::DetachDeviceRequest request;
  request.set_attachment_id(attachment_id);
  v1::DetachDeviceResponse response;
  absl::Status s = KVHOST_TRANSFER_CALL(DetachDevice, request, &response, options_.timeout);
  if (s.ok()) ForgetAttachment(attachment_id);
  return s;
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
  return Backup(attachment_id, host_indices, device_indices, {}, wait_event_handle);
}

absl::StatusOr<uint64_t> Client::Backup(const std::string& attachment_id,
                                        absl::Span<const int64_t> host_indices,
                                        absl::Span<const int64_t> device_indices,
                                        absl::Span<const v1::PoolTransfer> pool_transfers,
                                        const std::string& wait_event_handle) {
  absl::StatusOr<LoadTicket> ticket = BackupWithEvents(attachment_id, host_indices, device_indices,
                                                       pool_transfers, wait_event_handle);
  if (!ticket.ok()) return ticket.status();
  return ticket->ticket_id;
}

absl::StatusOr<LoadTicket> Client::BackupWithEvents(
    const std::string& attachment_id, absl::Span<const int64_t> host_indices,
    absl::Span<const int64_t> device_indices, absl::Span<const v1::PoolTransfer> pool_transfers,
    const std::string& wait_event_handle) {
  v1::BackupRequest request;
  request.set_attachment_id(attachment_id);
  request.set_wait_event_handle(wait_event_handle);
  Fill(request.mutable_host_indices(), host_indices);
  Fill(request.mutable_device_indices(), device_indices);
  for (const v1::PoolTransfer& t : pool_transfers) *request.add_pool_transfers() = t;
  v1::TransferTicket response;
  absl::Status s = KVHOST_FAST_TRANSFER_CALL(FAST_PATH_METHOD_BACKUP, Backup, request, &response,
                                             options_.timeout, absl::ZeroDuration());
  if (!s.ok()) return s;
  return LoadTicket{response.id(), response.event_set(), response.layer_base()};
}

absl::StatusOr<uint64_t> Client::Load(const std::string& attachment_id,
                                      absl::Span<const int64_t> host_indices,
                                      absl::Span<const int64_t> device_indices) {
  absl::StatusOr<LoadTicket> ticket = LoadWithEvents(attachment_id, host_indices, device_indices);
  if (!ticket.ok()) return ticket.status();
  return ticket->ticket_id;
}

absl::StatusOr<uint64_t> Client::Load(const std::string& attachment_id,
                                      absl::Span<const int64_t> host_indices,
                                      absl::Span<const int64_t> device_indices,
                                      absl::Span<const v1::PoolTransfer> pool_transfers) {
  absl::StatusOr<LoadTicket> ticket =
      LoadWithEvents(attachment_id, host_indices, device_indices, pool_transfers);
  if (!ticket.ok()) return ticket.status();
  return ticket->ticket_id;
}

absl::StatusOr<LoadTicket> Client::LoadWithEvents(const std::string& attachment_id,
                                                  absl::Span<const int64_t> host_indices,
                                                  absl::Span<const int64_t> device_indices) {
  return LoadWithEvents(attachment_id, host_indices, device_indices, {});
}

absl::StatusOr<LoadTicket> Client::LoadWithEvents(const std::string& attachment_id,
                                                  absl::Span<const int64_t> host_indices,
                                                  absl::Span<const int64_t> device_indices,
                                                  absl::Span<const v1::PoolTransfer> pool_transfers,
                                                  const std::string& wait_event_handle) {
  v1::LoadRequest request;
  request.set_attachment_id(attachment_id);
  request.set_wait_event_handle(wait_event_handle);
  Fill(request.mutable_host_indices(), host_indices);
  Fill(request.mutable_device_indices(), device_indices);
  for (const v1::PoolTransfer& t : pool_transfers) *request.add_pool_transfers() = t;
  v1::TransferTicket response;
  absl::Status s = KVHOST_FAST_TRANSFER_CALL(FAST_PATH_METHOD_LOAD, Load, request, &response,
                                             options_.timeout, absl::ZeroDuration());
  if (!s.ok()) return s;
  return LoadTicket{response.id(), response.event_set(), response.layer_base()};
}

absl::StatusOr<v1::TransferTicket> Client::SubmitBackup(const v1::BackupRequest& request) {
  v1::TransferTicket response;
  absl::Status s = KVHOST_FAST_TRANSFER_CALL(FAST_PATH_METHOD_BACKUP, Backup, request, &response,
                                             options_.timeout, absl::ZeroDuration());
  if (!s.ok()) return s;
  return response;
}

absl::StatusOr<v1::TransferTicket> Client::SubmitLoad(const v1::LoadRequest& request) {
  v1::TransferTicket response;
  absl::Status s = KVHOST_FAST_TRANSFER_CALL(FAST_PATH_METHOD_LOAD, Load, request, &response,
                                             options_.timeout, absl::ZeroDuration());
  if (!s.ok()) return s;
  return response;
}

absl::StatusOr<v1::AllocBackupResponse> Client::AllocBackup(const v1::AllocBackupRequest& request) {
  v1::AllocBackupResponse response;
  absl::Status s = KVHOST_FAST_TRANSFER_CALL(FAST_PATH_METHOD_ALLOC_BACKUP, AllocBackup, request,
                                             &response, options_.timeout, absl::ZeroDuration());
  if (!s.ok()) return s;
  return response;
}

absl::Status Client::FinishWorkerCopy(uint64_t ticket_id, const std::string& error) {
  v1::FinishWorkerCopyRequest request;
  request.set_ticket_id(ticket_id);
  request.set_error(error);
  v1::FinishWorkerCopyResponse response;
  return KVHOST_TRANSFER_CALL(FinishWorkerCopy, request, &response, options_.timeout);
}

absl::StatusOr<v1::TransferStatus> Client::WaitTransfer(uint64_t ticket_id,
                                                        absl::Duration timeout) {
  v1::WaitTransferRequest request;
  request.set_ticket_id(ticket_id);
  v1::TransferStatus response;
  absl::Status s = KVHOST_FAST_TRANSFER_CALL(FAST_PATH_METHOD_WAIT_TRANSFER, WaitTransfer, request,
                                             &response, timeout, timeout);
  if (!s.ok()) return s;
  return response;
}

absl::StatusOr<v1::TransferStatus> Client::PollTransfer(uint64_t ticket_id) {
  v1::WaitTransferRequest request;
  request.set_ticket_id(ticket_id);
  request.set_poll(true);
  v1::TransferStatus response;
  absl::Status s = KVHOST_FAST_TRANSFER_CALL(FAST_PATH_METHOD_WAIT_TRANSFER, WaitTransfer, request,
                                             &response, options_.timeout, absl::ZeroDuration());
  if (!s.ok()) return s;
  return response;
}

}  // namespace kvhost
