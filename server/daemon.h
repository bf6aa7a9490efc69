// Daemon: kvhostd assembled — registry, transfer engine and manager, the gRPC
// server with its listeners, health and reflection — and its orderly end.
//
// Start() returns once every listener (the handoff socket too) accepts calls
// and health says SERVING. Shutdown() sets health to NOT_SERVING, refuses new
// transfers, waits for the accepted ones to finish, then stops the server
// (in-flight RPCs get `grace`) and the handoff socket, removes its unix
// socket files and releases every pool's memory.
//
// Thread safety: Shutdown may be called from any thread, once.
#ifndef KVHOST_SERVER_DAEMON_H_
#define KVHOST_SERVER_DAEMON_H_

#include <grpcpp/server.h>
#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/cache/node_caches.h"
#include "server/daemon_options.h"
#include "server/metrics/http_server.h"
#include "server/metrics/kvhost_metrics.h"
#include "server/pool/registry.h"
#include "server/service/cache_service.h"
#include "server/service/daemon_service.h"
#include "server/service/fast_path_calls.h"
#include "server/service/fast_path_server.h"
#include "server/service/handoff_server.h"
#include "server/storage/memcached_backend.h"
#include "server/storage/storage_tier.h"
#include "server/transfer/transfer_manager.h"

namespace grpc {
class ServerBuilder;
class ServerCredentials;
}  // namespace grpc

namespace kvhost {

// The services kvhostd serves, by their full names, each with its own
// grpc.health.v1 status besides the overall one ("").
inline constexpr const char* kServedServices[] = {
    "kvhost.v1.PoolService", "kvhost.v1.TransferService", "kvhost.v1.DaemonService",
    "kvhost.v1.StorageService", "kvhost.v1.CacheService"};

class Daemon {
 public:
  static absl::StatusOr<std::unique_ptr<Daemon>> Start(const DaemonOptions& options);
  ~Daemon();

  void Shutdown(absl::Duration grace);
  // Addresses actually bound (a TCP port 0 is resolved).
  const std::vector<std::string>& addresses() const { return addresses_; }

 private:
  // What the listeners need, settled before anything is created.
  struct Listeners {
    gid_t socket_gid = 0;
    std::shared_ptr<grpc::ServerCredentials> tcp_credentials;  // null: no TCP listener
  };
  // The transfer engine chosen: its name and why (DaemonStatus.backend_detail).
  struct Backend {
    std::string name;
    std::string detail;
  };

  Daemon() = default;

  // Start's steps, in order. Each fills the members it names; a failure
  // leaves the daemon to be destroyed, which undoes what was started.
  // The options a bad value of which must fail the start before anything
  // is created: listen addresses, socket access, TLS files, the metrics
  // address, the shm dir.
  static absl::StatusOr<Listeners> CheckListeners(const DaemonOptions& options);
  // registry_, with stale region files of an earlier daemon removed.
  void StartRegistry(const RegistryOptions& options);
  // The engine (MakeEngine), metrics_ (with --metrics-listen) and transfers_.
  absl::StatusOr<Backend> StartTransfers(const DaemonOptions& options,
                                         std::shared_ptr<const RegionInodes> region_inodes);
  // storage_, with --l3-memcached (a bad server list, or no good
  // --l3-secret-file, fails the start).
  absl::Status StartStorage(const DaemonOptions& options);
  // Admits every declared pool (server/declared_pools.h: they fill in the
  // background, followers once the pool they follow is filled); the first
  // refused fails the start.
  absl::Status CreateDeclaredPools(const DaemonOptions& options);
  // server_ on every listener, not yet SERVING; socket files get their mode
  // and group; addresses_ with TCP port 0 resolved.
  absl::Status StartServer(const DaemonOptions& options, const Listeners& listeners,
                           const std::string& backend_detail, const std::string& instance_id);
  void RegisterServices(const DaemonOptions& options, const std::string& backend_detail,
                        const std::string& instance_id, grpc::ServerBuilder* builder);
  // metrics_server_, with --metrics-listen.
  absl::Status StartMetrics(const DaemonOptions& options, const std::string& backend,
                            const std::string& instance_id);
  // Health SERVING, overall and per service.
  void ReportServing(const DaemonOptions& options, const std::string& backend);
  // storage_'s backend, or null.
  const StorageBackend* L3Backend() const {
    return storage_ == nullptr ? nullptr : &storage_->backend();
  }

  // First, so that it goes last: the services, the transfer manager's
  // callbacks and the server's interceptors count into it until they end.
  std::unique_ptr<KvhostMetrics> metrics_;
  std::unique_ptr<PoolRegistry> registry_;
  std::unique_ptr<TransferManager> transfers_;
  // Destroyed before transfers_; a cache with tickets in flight lives on in
  // their callbacks (NodeCache's ownership rule).
  std::unique_ptr<NodeCaches> caches_;
  // Before the services and the server, so that it goes after them: its
  // threads finish the StorageService calls still open.
  // Shared with the cache service, whose caches' callbacks hold it weakly.
  std::shared_ptr<StorageTier> storage_;  // null: no L3 tier
  // After transfers_, so that it stops first: its source reads them.
  std::string handoff_path_;  // "" = none
  // Before handoff_ and the services, which use it.
  std::unique_ptr<Deposits> deposits_;
  // Before handoff_, which opens its mailboxes; its threads call the
  // services and are stopped by Shutdown before anything else goes.
  std::unique_ptr<FastPathCalls> fast_path_calls_;
  std::unique_ptr<FastPathServer> fast_path_;
  std::unique_ptr<HandoffServer> handoff_;
  std::vector<std::unique_ptr<grpc::Service>> services_;
  DaemonServiceImpl* daemon_service_ = nullptr;  // in services_
  CacheServiceImpl* cache_service_ = nullptr;    // in services_
  absl::Duration drain_timeout_ = absl::Seconds(30);
  std::unique_ptr<grpc::Server> server_;
  std::vector<std::string> addresses_;
  std::vector<std::string> socket_paths_;  // the handoff socket's too
  bool stopped_ = false;
  // Last, so that it goes first: its gauges read the registry and transfers.
  std::unique_ptr<MetricsHttpServer> metrics_server_;
};

}  // namespace kvhost

#endif  // KVHOST_SERVER_DAEMON_H_
