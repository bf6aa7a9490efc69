#include "server/service/daemon_service.h"

#include <unistd.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "server/safe_text.h"
#include "server/service/convert.h"
#include "server/service/fast_path_server.h"

namespace kvhost {
namespace {
// Longest SessionRequest.worker.
constexpr size_t kMaxWorkerNameBytes = 128;
}  // namespace

// One worker session: open on the first message, closed (its attachments
// with it) when the stream ends for any reason: the worker half-closes,
// its process dies (the connection drops), keepalive finds it silent, or
// kvhostd shuts down.
class SessionReactor final : public grpc::ServerBidiReactor<v1::SessionRequest, v1::SessionEvent> {
 public:
  SessionReactor(grpc::CallbackServerContext* context, DaemonServiceImpl* service)
      : context_(context),
        service_(service),
        transfers_(service->transfers_),
        identity_(&service->identity_) {
    {
      absl::MutexLock lock(&service_->live_mu_);
      service_->live_.insert(this);
    }
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      End("the worker closed the session or its connection dropped", grpc::Status::OK);
      return;
    }
    absl::MutexLock lock(&mu_);
    if (ended_) return;
    if (session_id_.empty()) {
      if (request_.worker().empty()) {
        EndLocked("no worker name", grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                                 "SessionRequest.worker is empty: the first "
                                                 "message of OpenSession must name the worker"));
        return;
      }
      // The name goes into log lines and GetStatus: printable ASCII only.
      if (request_.worker().size() > kMaxWorkerNameBytes || !IsPlainText(request_.worker())) {
        EndLocked("bad worker name",
                  grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                               absl::StrCat("SessionRequest.worker '", SafeText(request_.worker()),
                                            "' must be 1-", kMaxWorkerNameBytes,
                                            " printable ASCII characters")));
        return;
      }
      session_id_ = transfers_->OpenSession(request_.worker(), request_.pid(), context_->peer());
      event_.set_session_id(session_id_);
      event_.set_daemon_instance(identity_->instance_id);
      event_.set_timeout_ms(
          static_cast<uint64_t>(absl::ToInt64Milliseconds(identity_->session_timeout)));
      StartWrite(&event_);
    }
    // Later messages are heartbeats: keep reading until the stream ends.
    StartRead(&request_);
  }

  void OnWriteDone(bool ok) override {}

  // May run concurrently with the other reactions, hence mu_.
  void OnCancel() override { End("the session's call was cancelled", grpc::Status::CANCELLED); }

  void OnDone() override {
    {
      absl::MutexLock lock(&service_->live_mu_);
      service_->live_.erase(this);
    }
    delete this;
  }

  void End(const char* why, const grpc::Status& status) {
    absl::MutexLock lock(&mu_);
    EndLocked(why, status);
  }

 private:
  void EndLocked(const char* why, const grpc::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (ended_) return;
    ended_ = true;
    if (!session_id_.empty()) {
      transfers_->CloseSession(session_id_, why, identity_->session_timeout);
      if (identity_->session_ended) identity_->session_ended(session_id_);
    }
    Finish(status);
  }

  grpc::CallbackServerContext* const context_;
  DaemonServiceImpl* const service_;
  TransferManager* const transfers_;
  const DaemonIdentity* const identity_;
  v1::SessionRequest request_;
  v1::SessionEvent event_;
  absl::Mutex mu_;
  std::string session_id_ ABSL_GUARDED_BY(mu_);
  bool ended_ ABSL_GUARDED_BY(mu_) = false;
};

grpc::ServerBidiReactor<v1::SessionRequest, v1::SessionEvent>* DaemonServiceImpl::OpenSession(
    grpc::CallbackServerContext* context) {
  return new SessionReactor(context, this);
}

void DaemonServiceImpl::EndSessions() {
  // A reactor leaves live_ only in OnDone, which gRPC runs on its own
  // thread after Finish, so none is deleted while this holds live_mu_.
  absl::MutexLock lock(&live_mu_);
  for (SessionReactor* reactor : live_) {
    reactor->End("kvhostd is shutting down",
                 grpc::Status(grpc::StatusCode::UNAVAILABLE, "kvhostd is shutting down"));
  }
}

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
  response->set_worker_copy(transfers_->worker_copy());
  response->set_handoff_socket(identity_.handoff_socket);
  if (identity_.fast_path != nullptr) {
    response->set_fast_path_connections(identity_.fast_path->connections());
    response->set_fast_path_max_connections(identity_.fast_path->max_connections());
  }
  response->set_backend_detail(identity_.backend_detail);
  response->set_shm_dir(registry_->options().shm_dir);
  response->set_pid(::getpid());
  response->set_uptime_s(static_cast<uint64_t>(absl::ToInt64Seconds(absl::Now() - started_)));
  response->set_pools(static_cast<uint32_t>(registry_->List().size()));
  response->set_pool_bytes(registry_->used_bytes());
  response->set_pool_bytes_releasing(registry_->releasing_bytes());
  for (const CreatingPool& creating : registry_->ListCreating()) {
    v1::PoolProgress* p = response->add_pools_creating();
    p->set_name(creating.name);
    p->set_bytes(creating.bytes);
    p->set_populated_bytes(creating.populated_bytes);
  }
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
  response->set_instance_id(identity_.instance_id);
  for (const std::string& pool : identity_.declared_pools) response->add_declared_pools(pool);
  const absl::Time now = absl::Now();
  if (identity_.l3 != nullptr) {
    for (const BackendServer& server : identity_.l3->Servers()) {
      v1::L3Server* out = response->add_l3_servers();
      out->set_address(server.address);
      out->set_up(server.up);
      out->set_error(server.error);
      out->set_since_s(
          static_cast<uint64_t>(std::max<int64_t>(0, absl::ToInt64Seconds(now - server.since))));
    }
  }
  for (const SessionSnapshot& session : transfers_->ListSessions()) {
    v1::SessionInfo* info = response->add_sessions();
    info->set_worker(session.worker);
    info->set_pid(session.pid);
    info->set_peer(session.peer);
    info->set_attachment_count(static_cast<uint32_t>(session.attachments.size()));
    info->set_age_s(static_cast<uint64_t>(absl::ToInt64Seconds(now - session.opened)));
  }
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

}  // namespace kvhost
