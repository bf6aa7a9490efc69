#include "server/metrics/kvhost_metrics.h"

namespace kvhost {

KvhostMetrics::KvhostMetrics()
    : pool_alloc_calls(registry.AddCounter("kvhost_pool_alloc_calls_total",
                                           "Alloc calls served for the pool.", {"pool"})),
      pool_free_calls(registry.AddCounter("kvhost_pool_free_calls_total",
                                          "Free calls served for the pool.", {"pool"})),
      pool_alloc_failures(registry.AddCounter(
          "kvhost_pool_alloc_failures_total",
          "Alloc calls for the pool that allocated nothing (pool full, bad num_tokens, response "
          "too large).",
          {"pool"})),
      transfer_bytes(registry.AddCounter("kvhost_transfer_bytes_total",
                                         "Bytes moved by transfer tickets that completed OK.",
                                         {"pool", "direction", "path"})),
      transfer_tickets_done(registry.AddCounter("kvhost_transfer_tickets_done_total",
                                                "Transfer tickets that completed OK.",
                                                {"pool", "direction", "path"})),
      transfer_tickets_failed(registry.AddCounter("kvhost_transfer_tickets_failed_total",
                                                  "Transfer tickets that ended with an error.",
                                                  {"pool", "direction", "path"})),
      transfer_seconds(registry.AddHistogram(
          "kvhost_transfer_duration_seconds",
          "Time from a ticket's acceptance to its end, for every finished ticket.",
          {"pool", "direction", "path"}, kTransferSecondsBuckets)),
      transfer_tickets_dropped(registry.AddCounter(
          "kvhost_transfer_tickets_dropped_total",
          "Finished transfer tickets dropped by the kept-ticket limit (the attachment keeping "
          "the most loses its oldest).",
          {})),
      rpcs(registry.AddCounter(
          "kvhost_rpc_requests_total",
          "Calls answered, by transport (grpc, fast_path), full gRPC method name and status code.",
          {"transport", "method", "code"})),
      rpc_seconds(registry.AddHistogram(
          "kvhost_rpc_duration_seconds",
          "Time from a call's arrival at its method (gRPC) or in its mailbox (fast path) to its "
          "status or reply being sent.",
          {"transport", "method"}, kRpcSecondsBuckets)),
      fast_path_cpu(registry.AddCounter(
          "kvhost_fast_path_cpu_seconds_total",
          "CPU time of the fast-path mailbox threads (waiting, spinning, serving), by the "
          "client's uid, in seconds.",
          {"uid"}, /*unit=*/1e-6)),
      fast_path_rings_ignored(registry.AddCounter(
          "kvhost_fast_path_rings_ignored_total",
          "Fast-path doorbell rings not served: they came before the last reply was read.",
          {"uid"})),
      l3_pages(registry.AddCounter("kvhost_l3_pages_total",
                                   "L3 tier pages by operation and outcome.", {"op", "outcome"})),
      l3_bytes(registry.AddCounter("kvhost_l3_bytes_total",
                                   "Page bytes stored to / fetched whole from the L3 tier.",
                                   {"op"})),
      l3_seconds(
          registry.AddHistogram("kvhost_l3_call_duration_seconds",
                                "Time from an L3 call's acceptance to the end of its last page.",
                                {"op"}, kStorageSecondsBuckets)),
      l3_tickets_dropped(registry.AddCounter(
          "kvhost_l3_tickets_dropped_total",
          "Detached L3 calls whose results were dropped uncollected (a pool's kept-ticket limits).",
          {})) {}

}  // namespace kvhost
