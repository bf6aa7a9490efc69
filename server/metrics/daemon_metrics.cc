#include "server/metrics/daemon_metrics.h"

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

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
      metrics_->rpcs->WithLabels({method_, absl::StatusCodeToString(code)})->Increment();
      metrics_->rpc_seconds->WithLabels({method_})->Observe(
          absl::ToDoubleSeconds(absl::Now() - start_));
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

void AddDaemonGauges(KvhostMetrics* metrics, const PoolRegistry* registry,
                     const TransferManager* transfers) {
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
  MetricsRegistry& r = metrics->registry;
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
  r.AddGauge("kvhost_transfer_tickets_in_flight", "Transfer tickets accepted and not yet finished.",
             {}, [transfers] {
               return std::vector<GaugeSample>{
                   {{}, static_cast<double>(transfers->counters().tickets_in_flight)}};
             });
}

}  // namespace kvhost
