// DaemonServiceImpl: kvhost.v1.DaemonService — the daemon's own status (engine,
// memory budget, attachments, ticket counters) for operators and kvhostctl.
//
// Thread safety: handlers run concurrently; the registry and the manager
// synchronise themselves, the rest is fixed at construction.
#ifndef KVHOST_SERVER_SERVICE_DAEMON_SERVICE_H_
#define KVHOST_SERVER_SERVICE_DAEMON_SERVICE_H_

#include <string>

#include "absl/time/time.h"
#include "kvhost/v1/daemon.grpc.pb.h"
#include "server/pool/registry.h"
#include "server/transfer/transfer_manager.h"

namespace kvhost {

class DaemonServiceImpl final : public v1::DaemonService::CallbackService {
 public:
  DaemonServiceImpl(const PoolRegistry* registry, const TransferManager* transfers,
                    std::string backend_detail)
      : registry_(registry),
        transfers_(transfers),
        backend_detail_(std::move(backend_detail)),
        started_(absl::Now()) {}

  grpc::ServerUnaryReactor* GetStatus(grpc::CallbackServerContext* context,
                                      const v1::GetStatusRequest* request,
                                      v1::DaemonStatus* response) override;

 private:
  const PoolRegistry* const registry_;
  const TransferManager* const transfers_;
  const std::string backend_detail_;
  const absl::Time started_;
};

}  // namespace kvhost

#endif  // KVHOST_SERVER_SERVICE_DAEMON_SERVICE_H_
