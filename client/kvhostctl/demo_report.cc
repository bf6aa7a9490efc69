#include "client/kvhostctl/demo.h"

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/cli_output.h"
#include "client/kvhostctl/output.h"

namespace kvhost::ctl {
namespace {

struct Rpc {
  const char* name;
  const LatencyLog* log;
};

std::string DirectionJson(const DirectionTotals& d) {
  return JsonObject()
      .Uint("bytes", d.bytes)
      .Num("seconds", d.seconds, 6)
      .Num("gb_per_s", d.GbPerS())
      .str();
}

void PrintDemoJson(const DemoOptions& o, const v1::Pool& pool, const DemoReport& r,
                   const std::vector<Rpc>& rpcs, const absl::Status& result) {
  JsonObject latency;
  for (const Rpc& rpc : rpcs) {
    latency.Raw(rpc.name, JsonObject()
                              .Uint("count", rpc.log->count())
                              .Num("p50_us", rpc.log->Percentile(0.50), 1)
                              .Num("p99_us", rpc.log->Percentile(0.99), 1)
                              .str());
  }
  JsonObject out;
  out.Str("pool", o.pool)
      .Str("shape", ShapeOf(o.spec))
      .Uint("layers", o.spec.layer_num())
      .Uint("page_size", o.spec.page_size())
      .Uint("pool_tokens", pool.size_tokens())
      .Uint("device_tokens", o.device_tokens)
      .Uint("batch_tokens", o.batch_tokens)
      .Uint("cycles", o.cycles)
      .Uint("cycles_done", r.cycles_done)
      .Raw("backup", DirectionJson(r.backup))
      .Raw("load", DirectionJson(r.load))
      .Raw("latency", latency.str())
      .Bool("verified", result.ok());
  if (!result.ok()) out.Str("error", result.message());
  PrintLine(out.str());
}

void PrintDemoText(const DemoReport& r, const std::vector<Rpc>& rpcs, const absl::Status& result) {
  PrintLine("");
  PrintTable({{"DIRECTION", "GIB MOVED", "GB/S"},
              {"backup", Gib(r.backup.bytes), absl::StrFormat("%.2f", r.backup.GbPerS())},
              {"load", Gib(r.load.bytes), absl::StrFormat("%.2f", r.load.GbPerS())}},
             "lrr");
  PrintLine("(GB/s: bytes over the summed submit-to-WaitTransfer time of the tickets)");
  PrintLine("");
  std::vector<std::vector<std::string>> rows = {{"RPC", "CALLS", "P50 US", "P99 US"}};
  for (const Rpc& rpc : rpcs) {
    rows.push_back({rpc.name, absl::StrCat(rpc.log->count()),
                    absl::StrFormat("%.1f", rpc.log->Percentile(0.50)),
                    absl::StrFormat("%.1f", rpc.log->Percentile(0.99))});
  }
  PrintTable(rows, "lrrr");
  PrintLine("");
  PrintLine(result.ok() ? "verified: OK" : "verified: FAILED");
}

}  // namespace

double LatencyLog::Percentile(double q) const {
  std::vector<double> sorted = samples_;
  std::sort(sorted.begin(), sorted.end());
  return cli::Percentile(sorted, q);
}

void PrintDemoReport(const Context& ctx, const DemoOptions& o, const v1::Pool& pool,
                     const DemoReport& r, const absl::Status& result) {
  const std::vector<Rpc> rpcs = {{"alloc", &r.alloc},
                                 {"free", &r.free},
                                 {"backup_submit", &r.backup_submit},
                                 {"load_submit", &r.load_submit},
                                 {"wait_transfer", &r.wait}};
  if (ctx.json) {
    PrintDemoJson(o, pool, r, rpcs, result);
  } else {
    PrintDemoText(r, rpcs, result);
  }
}

}  // namespace kvhost::ctl
