#include "server/daemon_metrics.h"

#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "kvhost/v1/pool.pb.h"
#include "server/metrics/process_metrics.h"

namespace kvhost {
namespace {

using grpc::experimental::InterceptionHookPoints;

// One per RPC, created when the call reaches its method and destroyed with
// the call.
class RpcMetricsInterceptor final : public grpc::experimental::Interceptor {
 public:
  RpcMetricsInterceptor(KvhostMetrics* metrics, std::string method)
      : metrics_(metrics), method_(std::move(method)), start_(absl::Now()) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_STATUS)) {
      // gRPC's status codes are absl's, number for number.
      const auto code = static_cast<absl::StatusCode>(methods->GetSendStatus().error_code());
      metrics_->rpcs->WithLabels({kTransportGrpc, method_, absl::StatusCodeToString(code)})
          ->Increment();
      metrics_->rpc_seconds->WithLabels({kTransportGrpc, method_})
          ->Observe(absl::ToDoubleSeconds(absl::Now() - start_));
    }
    methods->Proceed();
  }

 private:
  KvhostMetrics* const metrics_;
  const std::string method_;
  const absl::Time start_;
};

class RpcMetricsInterceptorFactory final
    : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit RpcMetricsInterceptorFactory(KvhostMetrics* metrics) : metrics_(metrics) {}

  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    // Unregistered methods have no name; the server answers them
    // UNIMPLEMENTED without our help, and counting them would let clients
    // create series at will.
    if (info->method() == nullptr) return nullptr;
    std::string method = info->method();
    if (!method.empty() && method[0] == '/') method.erase(0, 1);
    return new RpcMetricsInterceptor(metrics_, std::move(method));
  }

 private:
  KvhostMetrics* const metrics_;
};

}  // namespace

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
MakeRpcMetricsInterceptorFactory(KvhostMetrics* metrics) {
  return std::make_unique<RpcMetricsInterceptorFactory>(metrics);
}

namespace {

// The render-time upkeep of the per-pool series (see AddDaemonMetrics).
void SyncPoolSeries(KvhostMetrics* metrics, const PoolRegistry& registry) {
  std::set<std::string> pools;
  for (const std::shared_ptr<Pool>& pool : registry.List()) pools.insert(pool->name());
  const SeriesFilter existing = [&pools](const LabelValues& values) {
    return pools.count(values[0]) > 0;  // every family here has `pool` first
  };
  for (CounterFamily* family :
       {metrics->pool_alloc_calls, metrics->pool_free_calls, metrics->pool_alloc_failures}) {
    family->RetainSeries(existing);
    for (const std::string& pool : pools) family->WithLabels({pool});
  }
  // Transfer series exist from a pool's first ticket on a path (the paths
  // an engine takes are known only from its tickets); from then on every
  // transfer family has that (pool, direction, path).
  CounterFamily* const transfer_counters[] = {
      metrics->transfer_bytes, metrics->transfer_tickets_done, metrics->transfer_tickets_failed};
  std::set<LabelValues> seen;
  for (CounterFamily* family : transfer_counters) {
    family->RetainSeries(existing);
    for (LabelValues& values : family->SeriesLabels()) seen.insert(std::move(values));
  }
  metrics->transfer_seconds->RetainSeries(existing);
  for (LabelValues& values : metrics->transfer_seconds->SeriesLabels()) {
    seen.insert(std::move(values));
  }
  for (const LabelValues& values : seen) {
    if (!existing(values)) continue;  // retired by a ticket of a pool deleted meanwhile
    for (CounterFamily* family : transfer_counters) family->WithLabels(values);
    metrics->transfer_seconds->WithLabels(values);
  }
}

// The pool state label values: the API's PoolState names, lowercased.
std::string StateLabel(v1::PoolState state) {
  return absl::AsciiStrToLower(v1::PoolState_Name(state));
}

// Every pool, created or being created, with a 1 for its state and a 0 for
// the other.
std::vector<GaugeSample> PoolStateSamples(const PoolRegistry& registry) {
  static const std::string kCreating = StateLabel(v1::CREATING);
  static const std::string kReady = StateLabel(v1::READY);
  std::vector<GaugeSample> out;
  const auto add = [&out](const std::string& pool, bool ready) {
    out.push_back({{pool, kCreating}, ready ? 0.0 : 1.0});
    out.push_back({{pool, kReady}, ready ? 1.0 : 0.0});
  };
  for (const std::shared_ptr<Pool>& pool : registry.List()) add(pool->name(), true);
  for (const CreatingPool& pool : registry.ListCreating()) add(pool.name, false);
  return out;
}

// Tickets and bytes over every pool since the start, deleted pools' included.
void AddTransferCounters(MetricsRegistry* r, const TransferManager* transfers) {
  constexpr Direction kDirections[] = {Direction::kBackup, Direction::kLoad};
  r->AddComputedCounter(
      "kvhost_transfers_total",
      "Transfer tickets finished since the start, every pool (deleted ones included), by "
      "direction and result (ok, failed).",
      {"direction", "result"}, [transfers, kDirections] {
        const TransferCounters c = transfers->counters();
        std::vector<GaugeSample> out;
        for (const Direction d : kDirections) {
          const int i = static_cast<int>(d);
          out.push_back({{DirectionName(d), "ok"}, static_cast<double>(c.done[i])});
          out.push_back({{DirectionName(d), "failed"}, static_cast<double>(c.failed[i])});
        }
        return out;
      });
  r->AddComputedCounter(
      "kvhost_transfers_bytes_total",
      "Bytes moved by transfer tickets that completed OK since the start, every pool (deleted "
      "ones included), by direction.",
      {"direction"}, [transfers, kDirections] {
        const TransferCounters c = transfers->counters();
        std::vector<GaugeSample> out;
        for (const Direction d : kDirections) {
          out.push_back({{DirectionName(d)}, static_cast<double>(c.bytes[static_cast<int>(d)])});
        }
        return out;
      });
}

// The L3 tier's servers as its prober last found them.
void AddL3ServerGauges(MetricsRegistry* r, const StorageBackend* l3) {
  r->AddGauge("kvhost_l3_servers", "memcached servers of the L3 tier (--l3-memcached).", {}, [l3] {
    return std::vector<GaugeSample>{{{}, static_cast<double>(l3->Servers().size())}};
  });
  r->AddGauge("kvhost_l3_servers_up", "memcached servers of the L3 tier its last probe reached.",
              {}, [l3] {
                double up = 0;
                for (const BackendServer& s : l3->Servers()) up += s.up ? 1 : 0;
                return std::vector<GaugeSample>{{{}, up}};
              });
  r->AddGauge("kvhost_l3_server_up",
              "1 when the last probe of the L3 tier's memcached server reached it, else 0.",
              {"server"}, [l3] {
                std::vector<GaugeSample> out;
                for (const BackendServer& s : l3->Servers()) {
                  out.push_back({{s.address}, s.up ? 1.0 : 0.0});
                }
                return out;
              });
}

// The node caches (issue 33), one series set per node-cache pool: keys now
// by state, free pages, and what happened to keys since the pool was made.
void AddCacheMetrics(MetricsRegistry* r, const PoolRegistry* registry, NodeCaches* caches) {
  // The cache of every node-cache pool, made here if no call made it yet.
  const auto each = [registry, caches](auto sample) {
    std::vector<GaugeSample> out;
    for (const std::shared_ptr<Pool>& pool : registry->List()) {
      if (!pool->spec().node_cache) continue;
      sample(pool->name(), caches->For(pool)->stats(), &out);
    }
    return out;
  };
  r->AddGauge("kvhost_cache_keys",
              "Keys of the node cache now: published (restorable), writing (a store in flight), "
              "pinned (a lookup or restore holds them).",
              {"cache", "state"}, [each] {
                return each([](const std::string& name, const CacheStats& s,
                               std::vector<GaugeSample>* out) {
                  out->push_back({{name, "published"}, static_cast<double>(s.published)});
                  out->push_back({{name, "writing"}, static_cast<double>(s.writing)});
                  out->push_back({{name, "pinned"}, static_cast<double>(s.pinned)});
                });
              });
  r->AddGauge("kvhost_cache_free_pages", "Pages of the node cache that hold no key now.", {"cache"},
              [each] {
                return each([](const std::string& name, const CacheStats& s,
                               std::vector<GaugeSample>* out) {
                  out->push_back({{name}, static_cast<double>(s.free_pages)});
                });
              });
  r->AddComputedCounter(
      "kvhost_cache_keys_total",
      "Keys of the node cache since its pool was created, by outcome: hit and miss (Lookup), "
      "stored (published), skipped (a store found them present or pending), evicted, aborted "
      "(a failed or abandoned store dropped them), l3_written (written through to the L3 tier), "
      "l3_fetched (fetched from it and published), l3_missed (asked of it, no good copy).",
      {"cache", "outcome"}, [each] {
        return each(
            [](const std::string& name, const CacheStats& s, std::vector<GaugeSample>* out) {
              out->push_back({{name, "hit"}, static_cast<double>(s.hits)});
              out->push_back({{name, "miss"}, static_cast<double>(s.misses)});
              out->push_back({{name, "stored"}, static_cast<double>(s.stored)});
              out->push_back({{name, "skipped"}, static_cast<double>(s.skipped)});
              out->push_back({{name, "evicted"}, static_cast<double>(s.evicted)});
              out->push_back({{name, "aborted"}, static_cast<double>(s.aborted)});
              out->push_back({{name, "l3_written"}, static_cast<double>(s.l3_written)});
              out->push_back({{name, "l3_fetched"}, static_cast<double>(s.l3_fetched)});
              out->push_back({{name, "l3_missed"}, static_cast<double>(s.l3_missed)});
            });
      });
}

}  // namespace

std::function<std::string()> AddDaemonMetrics(KvhostMetrics* metrics, const PoolRegistry* registry,
                                              const TransferManager* transfers, NodeCaches* caches,
                                              const StorageBackend* l3, DaemonBuildInfo build) {
  // Each family reads the pools again: a scrape is rare, and the figures of
  // one pool need not be a single snapshot across families.
  const auto per_pool = [registry](uint64_t (*value)(const Pool&)) {
    return [registry, value] {
      std::vector<GaugeSample> out;
      for (const std::shared_ptr<Pool>& pool : registry->List()) {
        out.push_back({{pool->name()}, static_cast<double>(value(*pool))});
      }
      return out;
    };
  };
  const auto one = [](double value) { return std::vector<GaugeSample>{{{}, value}}; };
  MetricsRegistry& r = metrics->registry;
  r.AddGauge(
      "kvhost_build_info", "Always 1; the labels name this daemon's build and run.",
      {"version", "backend", "daemon_id"}, [build] {
        return std::vector<GaugeSample>{{{build.version, build.backend, build.daemon_id}, 1}};
      });
  r.AddGauge("kvhost_pool_state",
             "1 for the pool's state now (creating: its memory is being reserved and mapped; "
             "ready), 0 for the other.",
             {"pool", "state"}, [registry] { return PoolStateSamples(*registry); });
  r.AddGauge("kvhost_pool_capacity_tokens", "Token slots of the pool.", {"pool"},
             per_pool([](const Pool& p) { return p.size_tokens(); }));
  r.AddGauge("kvhost_pool_capacity_bytes", "Host memory of the pool's regions, in bytes.", {"pool"},
             per_pool([](const Pool& p) { return p.bytes(); }));
  r.AddGauge(
      "kvhost_pool_used_tokens", "Token slots of the pool allocated now.", {"pool"},
      per_pool([](const Pool& p) { return p.size_tokens() - p.allocator().available_tokens(); }));
  r.AddGauge("kvhost_pool_available_tokens", "Token slots of the pool free now.", {"pool"},
             per_pool([](const Pool& p) { return p.allocator().available_tokens(); }));
  r.AddGauge("kvhost_pool_attachments", "Device pools attached to the pool now.", {"pool"},
             per_pool([](const Pool& p) { return uint64_t{p.attachments()}; }));
  r.AddGauge("kvhost_pools", "Pools that exist now.", {},
             [registry, one] { return one(static_cast<double>(registry->List().size())); });
  r.AddGauge("kvhost_memory_used_bytes",
             "Host memory the pools take now (the budget's account), in bytes.", {},
             [registry, one] { return one(static_cast<double>(registry->used_bytes())); });
  r.AddGauge("kvhost_memory_available_bytes",
             "Host memory a new pool could take now (host memory, cgroup, reserve and "
             "--memory-limit considered), in bytes.",
             {}, [registry, one] {
               const absl::StatusOr<uint64_t> available = registry->Available();
               return available.ok() ? one(static_cast<double>(*available))
                                     : std::vector<GaugeSample>{};
             });
  r.AddGauge("kvhost_memory_releasing_bytes",
             "Host memory of deleted pools not yet unmapped (still counted against "
             "--memory-limit), in bytes.",
             {}, [registry, one] { return one(static_cast<double>(registry->releasing_bytes())); });
  r.AddGauge("kvhost_memory_limit_bytes",
             "--memory-limit: what all pools together may take, in bytes (no sample: no limit).",
             {}, [registry, one] {
               const uint64_t limit = registry->options().memory_limit;
               return limit > 0 ? one(static_cast<double>(limit)) : std::vector<GaugeSample>{};
             });
  r.AddGauge(
      "kvhost_memory_reserve_bytes", "Host memory never given to pools, in bytes.", {},
      [registry, one] { return one(static_cast<double>(registry->options().memory_reserve)); });
  r.AddGauge("kvhost_sessions", "Worker sessions open now.", {}, [transfers, one] {
    return one(static_cast<double>(transfers->ListSessions().size()));
  });
  r.AddGauge(
      "kvhost_attachments", "Device attachments open now, every pool and group.", {},
      [transfers, one] { return one(static_cast<double>(transfers->ListAttachments().size())); });
  r.AddGauge("kvhost_transfer_tickets_in_flight", "Transfer tickets accepted and not yet finished.",
             {}, [transfers, one] {
               return one(static_cast<double>(transfers->counters().tickets_in_flight));
             });
  AddTransferCounters(&r, transfers);
  AddCacheMetrics(&r, registry, caches);
  if (l3 != nullptr) AddL3ServerGauges(&r, l3);
  AddProcessMetrics(&r);
  return [metrics, registry] {
    SyncPoolSeries(metrics, *registry);
    return metrics->registry.Render();
  };
}

}  // namespace kvhost
