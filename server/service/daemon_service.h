// DaemonServiceImpl: kvhost.v1.DaemonService — the daemon's own status (engine,
// memory budget, attachments, ticket counters, sessions) for operators and
// kvhostctl, and the workers' sessions (OpenSession: a stream whose end
// closes the session's attachments, TransferManager::CloseSession).
//
// Thread safety: handlers run concurrently; the registry and the manager
// synchronise themselves, the rest is fixed at construction.
#ifndef KVHOST_SERVER_SERVICE_DAEMON_SERVICE_H_
#define KVHOST_SERVER_SERVICE_DAEMON_SERVICE_H_

#include <functional>
#include <set>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kvhost/v1/daemon.grpc.pb.h"
#include "server/pool/registry.h"
#include "server/storage/backend.h"
#include "server/transfer/transfer_manager.h"

namespace kvhost {

class FastPathServer;

struct DaemonIdentity {
  std::string backend_detail;
  // DaemonStatus.instance_id: random, new at every start.
  std::string instance_id;
  std::vector<std::string> declared_pools;
  // --session-timeout.
  absl::Duration session_timeout = absl::Seconds(5);
  // The handoff socket's path, "" for none (DaemonStatus.handoff_socket).
  std::string handoff_socket;
  // The fast path's mailboxes (DaemonStatus.fast_path_*); null for none.
  const FastPathServer* fast_path = nullptr;
  // The L3 tier's backend (DaemonStatus.l3_servers); null without one.
  const StorageBackend* l3 = nullptr;
  // Called with a session's id once it has ended (after the transfer
  // manager closed it): the node caches release what it held. Null: none.
  std::function<void(const std::string&)> session_ended;
};

class SessionReactor;

class DaemonServiceImpl final : public v1::DaemonService::CallbackService {
 public:
  DaemonServiceImpl(const PoolRegistry* registry, TransferManager* transfers,
                    DaemonIdentity identity)
      : registry_(registry),
        transfers_(transfers),
        identity_(std::move(identity)),
        started_(absl::Now()) {}

  grpc::ServerUnaryReactor* GetStatus(grpc::CallbackServerContext* context,
                                      const v1::GetStatusRequest* request,
                                      v1::DaemonStatus* response) override;
  grpc::ServerBidiReactor<v1::SessionRequest, v1::SessionEvent>* OpenSession(
      grpc::CallbackServerContext* context) override;

  // Ends every open session stream with UNAVAILABLE (kvhostd is stopping),
  // so that the server's shutdown need not wait for them.
  void EndSessions();

 private:
  friend class SessionReactor;

  const PoolRegistry* const registry_;
  TransferManager* const transfers_;
  const DaemonIdentity identity_;
  const absl::Time started_;
  absl::Mutex live_mu_;
  std::set<SessionReactor*> live_ ABSL_GUARDED_BY(live_mu_);
};

}  // namespace kvhost

#endif  // KVHOST_SERVER_SERVICE_DAEMON_SERVICE_H_
