// kvhostd's metrics glue that needs the gRPC server and the domain objects:
// the RPC interceptor and the scrape-time gauges over pools and transfers.
// Kept apart from the registry so kvhost_metrics depends on nothing of ours.
//
// Thread safety: the interceptor runs on gRPC's threads and the gauge
// callbacks on the scraper's; both only read through thread-safe APIs.
#ifndef KVHOST_SERVER_METRICS_DAEMON_METRICS_H_
#define KVHOST_SERVER_METRICS_DAEMON_METRICS_H_

#include <grpcpp/support/server_interceptor.h>

#include <memory>

#include "server/metrics/kvhost_metrics.h"
#include "server/pool/registry.h"
#include "server/transfer/transfer_manager.h"

namespace kvhost {

// Counts every RPC by method and status code and times it from its arrival at
// the method to its status being sent. For ServerBuilder's
// experimental().SetInterceptorCreators. REQUIRES: `metrics` outlives the
// server.
std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
MakeRpcMetricsInterceptorFactory(KvhostMetrics* metrics);

// Adds the gauges computed at scrape time: per pool capacity (tokens, bytes),
// used and available tokens and attachments; transfer tickets in flight.
// REQUIRES: `registry` and `transfers` outlive every scrape.
void AddDaemonGauges(KvhostMetrics* metrics, const PoolRegistry* registry,
                     const TransferManager* transfers);

}  // namespace kvhost

#endif  // KVHOST_SERVER_METRICS_DAEMON_METRICS_H_
