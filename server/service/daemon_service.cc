#include "server/service/daemon_service.h"

#include <unistd.h>

#include "server/service/convert.h"

namespace kvhost {

grpc::ServerUnaryReactor* DaemonServiceImpl::GetStatus(grpc::CallbackServerContext* context,
                                                       const v1::GetStatusRequest* request,
                                                       v1::DaemonStatus* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  absl::StatusOr<uint64_t> available = registry_->Available();
  if (!available.ok()) {
    reactor->Finish(ToGrpcStatus(available.status()));
    return reactor;
  }
  response->set_version(KVHOST_VERSION);
  response->set_backend(transfers_->backend());
  response->set_backend_detail(backend_detail_);
  response->set_shm_dir(registry_->options().shm_dir);
  response->set_pid(::getpid());
  response->set_uptime_s(static_cast<uint64_t>(absl::ToInt64Seconds(absl::Now() - started_)));
  response->set_pools(static_cast<uint32_t>(registry_->List().size()));
  response->set_pool_bytes(registry_->used_bytes());
  response->set_memory_limit_bytes(registry_->options().memory_limit);
  response->set_memory_reserve_bytes(registry_->options().memory_reserve);
  response->set_memory_available_bytes(*available);
  response->set_attachments(static_cast<uint32_t>(transfers_->ListAttachments().size()));
  const TransferCounters counters = transfers_->counters();
  response->set_tickets_in_flight(counters.tickets_in_flight);
  response->set_tickets_done(counters.tickets_done);
  response->set_tickets_failed(counters.tickets_failed);
  response->set_backup_bytes(counters.bytes[static_cast<int>(Direction::kBackup)]);
  response->set_load_bytes(counters.bytes[static_cast<int>(Direction::kLoad)]);
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

}  // namespace kvhost
