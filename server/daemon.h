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
#include "server/metrics/http_server.h"
#include "server/metrics/kvhost_metrics.h"
#include "server/pool/registry.h"
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

struct DaemonOptions {
  std::vector<std::string> listen = {"unix:///run/kvhost/kvhost.sock"};
  std::string backend = "auto";  // auto | host | cuda
  std::string shm_dir = "/dev/shm";
  uint64_t memory_limit = 0;
  std::optional<uint64_t> memory_reserve;  // default: min(10 GiB, 10 % of RAM)
  int copy_threads = 2;
  // Pools to create before any listener accepts calls (the config file's
  // `pools`), the same way CreatePool creates them; they live until the
  // daemon stops, like any other.
  std::vector<std::pair<std::string, PoolSpec>> pools;
  // cuda backend (CudaEngineOptions): auto | ce | staged | sm, the device
  // staging buffer per stream, and the SM copy path's grid quota.
  std::string transfer_path = "auto";
  uint64_t staging_bytes = uint64_t{1} << 30;
  int sm_blocks = 16;
  // Copy-engine streams per direction and GPU (CudaEngineOptions::copy_streams).
  int copy_streams = 4;
  // auto's copy-engine threshold (CudaEngineOptions::ce_min_piece_bytes).
  uint64_t ce_min_piece_bytes = uint64_t{64} << 10;
  // Worker copies (server/transfer/worker_copy.h): Backup / Load with
  // worker_copy served on the cuda backend. Off: docs/PERF.md run M.
  bool worker_copy = false;
  int max_message_bytes = 64 << 20;
  // Most indices one call may carry (Alloc's num_tokens, Free, meta, Backup /
  // Load per pool): INVALID_ARGUMENT naming the count and the limit above it.
  uint64_t max_indices_per_call = uint64_t{1} << 22;
  // Access control (docs/RELIABILITY.md). Unix socket files get this mode
  // and group ("" = the process's group).
  uint32_t socket_mode = 0660;
  std::string socket_group;
  // The pools' region files in shm_dir get this mode and group ("" = the
  // process's group); 0600 by default, so no other local user maps them.
  uint32_t region_mode = 0600;
  std::string region_group;
  // TCP listeners: TLS with this certificate and key (PEM files); with
  // tls_client_ca, clients must present a certificate it signed. Without a
  // certificate, a TCP listener is refused unless insecure_tcp.
  std::string tls_cert;
  std::string tls_key;
  std::string tls_client_ca;
  bool insecure_tcp = false;
  // Worker sessions: how long a broken session's attachments may keep
  // transfers in flight before they are closed (also the keepalive bound
  // that finds a silent peer).
  absl::Duration session_timeout = absl::Seconds(5);
  // SIGTERM: accepted transfers get this long to finish, then the rest are
  // cancelled.
  absl::Duration drain_timeout = absl::Seconds(30);
  // Prometheus endpoint, "host:port" or ":port" ("" = no metrics at all).
  std::string metrics_listen;
  // The handoff socket (server/service/handoff_server.h), an absolute path;
  // "auto" = the first unix listener's path + ".fds" (none when every
  // listener is TCP), "" = none (attachments with layer_progress refused).
  std::string handoff_socket = "auto";
  // Fast-path mailboxes served at once (server/service/fast_path_server.h),
  // through the handoff socket; 0 = the fast path is off.
  uint32_t fast_path_connections = kDefaultFastPathConnections;
  // Of which one client may hold (its open session, else its uid).
  uint32_t fast_path_connections_per_client = kDefaultFastPathConnectionsPerClient;
  // The L3 tier (server/storage/storage_tier.h, kvhost.v1.StorageService):
  // on when l3.servers is not empty (--l3-memcached), else its calls are
  // FAILED_PRECONDITION.
  MemcachedOptions l3;
  StorageTierOptions l3_tier;
  // The fleet secret's file (--l3-secret-file), required with l3.servers.
  std::string l3_secret_file;
};

// The services kvhostd serves, by their full names, each with its own
// grpc.health.v1 status besides the overall one ("").
inline constexpr const char* kServedServices[] = {
    "kvhost.v1.PoolService", "kvhost.v1.TransferService", "kvhost.v1.DaemonService",
    "kvhost.v1.StorageService"};

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
  // Before the services and the server, so that it goes after them: its
  // threads finish the StorageService calls still open.
  std::unique_ptr<StorageTier> storage_;  // null: no L3 tier
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
