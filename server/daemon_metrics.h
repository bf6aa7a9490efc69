// kvhostd's metrics glue that needs the gRPC server and the domain objects:
// the RPC interceptor, the scrape-time gauges over pools, sessions and
// transfers, and the upkeep of the per-pool series.
// It lives beside the daemon, not in server/metrics/: it reads the pool
// registry and the transfer manager, and server/metrics/ (the metrics
// registry, exposition, HTTP endpoint) depends on nothing above it.
//
// Thread safety: the interceptor runs on gRPC's threads and the gauge
// callbacks on the scraper's; both only read through thread-safe APIs.
#ifndef KVHOST_SERVER_DAEMON_METRICS_H_
#define KVHOST_SERVER_DAEMON_METRICS_H_

#include <grpcpp/support/server_interceptor.h>

#include <functional>
#include <memory>
#include <string>

#include "server/cache/node_caches.h"
#include "server/metrics/kvhost_metrics.h"
#include "server/pool/registry.h"
#include "server/storage/backend.h"
#include "server/transfer/transfer_manager.h"

namespace kvhost {

// Counts every RPC by method and status code and times it from its arrival at
// the method to its status being sent. For ServerBuilder's
// experimental().SetInterceptorCreators. REQUIRES: `metrics` outlives the
// server.
std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
MakeRpcMetricsInterceptorFactory(KvhostMetrics* metrics);

// What kvhost_build_info says about this daemon.
// (Its label is `daemon_id`, not `instance`: Prometheus sets `instance` on
// every scraped series to the target's address.)
struct DaemonBuildInfo {
  std::string version;    // kvhost's version
  std::string backend;    // the transfer engine's name
  std::string daemon_id;  // DaemonStatus.instance_id, new at every start
};

// Adds the families computed at scrape time: per pool state, capacity
// (tokens, bytes), used and available tokens and attachments; the memory
// budget and bytes releasing, pools, sessions, attachments and tickets in
// flight; the daemon-wide transfer counters (TransferManager::counters, which
// outlive pools); each node cache's keys and outcomes (`caches`); the L3 tier's servers up (`l3`,
// null without an L3 tier); build info; the process metrics. Returns the render function for the
// HTTP endpoint, which first brings the per-pool series in line with the pools that exist: every
// pool has its PoolService counters (at 0 until used), a transfer series
// that exists for a (pool, direction, path) has its siblings in every
// transfer family, and a deleted pool's series are removed.
// REQUIRES: `metrics`, `registry`, `transfers`, `caches` and `l3` outlive
// every scrape.
std::function<std::string()> AddDaemonMetrics(KvhostMetrics* metrics, const PoolRegistry* registry,
                                              const TransferManager* transfers, NodeCaches* caches,
                                              const StorageBackend* l3, DaemonBuildInfo build);

}  // namespace kvhost

#endif  // KVHOST_SERVER_DAEMON_METRICS_H_
