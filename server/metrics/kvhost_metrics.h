// KvhostMetrics: kvhostd's metric families (docs/METRICS.md lists each), in
// one registry. The daemon creates one when --metrics-listen is set and hands
// it to the places that count: PoolServiceImpl (alloc / free calls), the
// TransferManager (finished tickets), the RPC interceptor; the scrape-time
// gauges and the per-pool series' upkeep are added by the daemon
// (AddDaemonMetrics).
// Components take a null KvhostMetrics* to mean "metrics off".
//
// Thread safety: as MetricsRegistry; the family pointers are fixed at
// construction.
#ifndef KVHOST_SERVER_METRICS_KVHOST_METRICS_H_
#define KVHOST_SERVER_METRICS_KVHOST_METRICS_H_

#include <string>
#include <vector>

#include "server/metrics/metrics.h"

namespace kvhost {

// Transfer durations: from a 64 KiB copy on one core (~0.5 ms) to a multi-GB
// load (seconds).
inline const std::vector<double> kTransferSecondsBuckets = {
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10};
// RPC handling times, gRPC and fast path alike: a fast-path Alloc answers
// in a few microseconds, a gRPC unary call in tens of them, a WaitTransfer
// may wait a minute, and CreatePool reserves and touches its memory, 10-50 s
// for tens of GiB on a small machine, hence buckets up to two minutes.
inline const std::vector<double> kRpcSecondsBuckets = {
    0.000005, 0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001,
    0.0025,   0.005,   0.01,     0.025,   0.05,   0.1,     0.25,   0.5,
    1,        2.5,     5,        10,      30,     60,      120};

// The `transport` label of the RPC families: how a call reached kvhostd.
inline constexpr char kTransportGrpc[] = "grpc";
inline constexpr char kTransportFastPath[] = "fast_path";

// L3 tier calls (StorePages / FetchPages / ExistPages): a few pages on the
// loopback take ~100 us, a batch of large pages over a network seconds.
inline const std::vector<double> kStorageSecondsBuckets = {
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10};

struct KvhostMetrics {
  KvhostMetrics();

  MetricsRegistry registry;

  // PoolService, per pool (only pools that exist: a request naming an
  // unknown pool is counted by the RPC metrics alone, so clients cannot
  // create series at will). Every pool has its series, at 0 until used.
  CounterFamily* const pool_alloc_calls;     // {pool}
  CounterFamily* const pool_free_calls;      // {pool}
  CounterFamily* const pool_alloc_failures;  // {pool}

  // Finished transfer tickets, {pool, direction, path}.
  CounterFamily* const transfer_bytes;  // bytes of tickets that ended OK
  CounterFamily* const transfer_tickets_done;
  CounterFamily* const transfer_tickets_failed;
  HistogramFamily* const transfer_seconds;  // acceptance to end, every finished ticket
  // Finished tickets dropped by per-attachment retention
  // (server/tickets/retention.h, ticket_table.h), {}.
  CounterFamily* const transfer_tickets_dropped;

  // Every call answered, over gRPC (the interceptor) or the fast path
  // (server/service/fast_path_server.h): {transport, method, code} and
  // {transport, method}, method the full gRPC method name (a fast-path
  // call's is the gRPC method it mirrors).
  CounterFamily* const rpcs;
  HistogramFamily* const rpc_seconds;
  // Mailbox threads' CPU (incremented in microseconds, shown in seconds),
  // and rings before the last reply was read (not served), by the client's
  // uid: {uid}.
  CounterFamily* const fast_path_cpu;
  CounterFamily* const fast_path_rings_ignored;

  // The L3 tier (server/storage/storage_tier.h), op = store | fetch | exist:
  // pages by outcome (stored, hit, miss, corrupt, shape_mismatch,
  // unavailable; exist counts its prefix as hits and the key that ended it
  // as a miss), page bytes stored / fetched whole, and each call's time from
  // acceptance to its last page.
  CounterFamily* const l3_pages;      // {op, outcome}
  CounterFamily* const l3_bytes;      // {op}
  HistogramFamily* const l3_seconds;  // {op}
  // Finished detached calls whose results were dropped uncollected
  // (per-pool retention; server/tickets/storage_ticket_table.h).
  CounterFamily* const l3_tickets_dropped;  // {}
};

}  // namespace kvhost

#endif  // KVHOST_SERVER_METRICS_KVHOST_METRICS_H_
