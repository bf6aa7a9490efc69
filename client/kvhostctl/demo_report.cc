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

void PrintDemoText(const DemoOptions& o, const v1::Pool& pool, const DemoReport& r,
                   const std::vector<Rpc>& rpcs, const absl::Status& result) {
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
  // What the rows time, beside the submit figures of the README and
  // docs/PERF.md (kvhost_rpc_bench), which time the same call on a transfer
  // made to cost nothing else.
  PrintLine(absl::StrFormat(
      "(over %s. alloc, free: one call each. backup_submit, load_submit: the Backup / Load call\n"
      " alone, until its ticket is back, for %d tokens x %d layers (%.1f MiB) of random pages;\n"
      " wait_transfer: from the ticket until WaitTransfer returns, i.e. the copy itself. The\n"
      " submit figures in the README and docs/PERF.md are kvhost_rpc_bench's: the same call\n"
      " naming 4096 tokens of one 8-byte row (32 KiB), client and kvhostd pinned to separate\n"
      " cores, to time the call's own cost; here each call names the transfer above.)",
      r.fast_path ? "the fast path" : "gRPC (no fast path)", o.batch_tokens, o.spec.layer_num(),
      static_cast<double>(o.batch_tokens * pool.bytes_per_token()) / (1 << 20)));
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
    PrintDemoText(o, pool, r, rpcs, result);
  }
}

}  // namespace kvhost::ctl
