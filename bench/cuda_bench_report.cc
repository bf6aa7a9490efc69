#include "bench/cuda_bench_report.h"

#include <algorithm>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "bench/bench_util.h"
#include "client/cli_output.h"

namespace kvhost::bench {
namespace {

// The worker the headline and its bounds are about: the GEMM where it ran.
std::string HeadlineWorker(const Options& o) {
  if (std::find(o.workers.begin(), o.workers.end(), "gemm") != o.workers.end()) return "gemm";
  return o.workers.empty() ? "" : o.workers.front();
}

std::string CostCell(const std::vector<Cost>& costs, const std::string& worker, double duty) {
  const Cost* c = FindCost(costs, worker, duty);
  return c == nullptr ? "-" : absl::StrFormat("%+.1f", c->cost_pct);
}

bool WithinBounds(const CaseResult& c, const std::string& worker) {
  const Cost* duty = FindCost(c.costs, worker, 0.25);
  const Cost* b2b = FindCost(c.costs, worker, 1);
  return duty != nullptr && b2b != nullptr && duty->cost_pct <= kCostBoundDutyPct &&
         b2b->cost_pct <= kCostBoundBackToBackPct;
}

std::string CostsJson(const std::vector<Cost>& costs) {
  std::vector<std::string> out;
  for (const Cost& c : costs) {
    out.push_back(JsonObject()
                      .Str("worker", c.worker)
                      .Num("duty", c.duty, 3)
                      .Num("window_s", c.window_s)
                      .Uint("transfers", c.transfers)
                      .Uint("units", c.units)
                      .Num("unit_ms", c.unit_ms, 4)
                      .Num("alone_before_ms", c.alone_before_ms, 4)
                      .Num("alone_after_ms", c.alone_after_ms, 4)
                      .Num("alone_ms", c.alone_ms, 4)
                      .Num("run_alone_ms", c.run_alone_ms, 4)
                      .Num("cost_pct", c.cost_pct, 2)
                      .str());
  }
  return JsonArray(out);
}

std::string NumbersJson(const std::vector<double>& v) {
  std::vector<std::string> out;
  for (double x : v) out.push_back(absl::StrFormat("%.4f", x));
  return JsonArray(out);
}

std::string StringsJson(const std::vector<std::string>& v) {
  std::vector<std::string> out;
  for (const std::string& s : v) out.push_back(cli::JsonQuote(s));
  return JsonArray(out);
}

// A case's direction: backup / load, or a node cache case's store / restore.
const char* CaseDir(const CaseResult& c, bool cache) {
  if (cache) return c.backup ? "store" : "restore";
  return DirName(c.backup);
}

std::string CaseJson(const CaseResult& c, bool cache = false) {
  return JsonObject()
      .Str("path", c.path)
      .Str("kind", c.kind)
      .Str("layout", c.layout)
      .Uint("page_size", c.page_size)
      .Str("direction", CaseDir(c, cache))
      .Uint("bytes", c.bytes)
      .Num("engine_gb_per_s", c.engine_gbps)
      .Num("client_gb_per_s", c.client_gbps)
      .Num("vs_ceiling", c.vs_ceiling)
      .Uint("timed_transfers", static_cast<uint64_t>(c.timed))
      .Num("warmup_s", c.warmup_s, 4)
      .Bool("slow", c.slow)
      .Bool("bytes_verified", true)
      .Str("ticket_path", c.ticket_path)
      .Uint("host_pages", c.host.pages)
      .Uint("host_runs", c.host.runs)
      .Num("host_run_pages", c.host.MeanPages(), 2)
      .Raw("costs", CostsJson(c.costs))
      .str();
}

std::string AnchorJson(const AnchorResult& a) {
  return JsonObject()
      .Str("kind", a.kind)
      .Str("layout", "LAYER_FIRST")
      .Uint("page_size", 1)
      .Uint("quota", a.quota)
      .Uint("threads_per_block", 1024)
      .Str("direction", DirName(a.backup))
      .Uint("bytes", a.bytes)
      .Num("gb_per_s", a.gbps)
      .Num("vs_ceiling", a.vs_ceiling)
      .Bool("bytes_verified", true)
      .Num("host_run_pages", a.host.MeanPages(), 2)
      .Raw("costs", CostsJson(a.costs))
      .str();
}

std::string DuplexJson(const DuplexResult& d) {
  return JsonObject()
      .Str("path", d.path)
      .Str("kind", "MHA")
      .Str("layout", "LAYER_FIRST")
      .Uint("page_size", kProbePageSize)
      .Uint("bytes_per_transfer", d.bytes)
      .Num("backup_alone_gb_per_s", d.backup_alone_gbps)
      .Num("load_alone_gb_per_s", d.load_alone_gbps)
      .Num("backup_gb_per_s", d.backup_gbps)
      .Num("load_gb_per_s", d.load_gbps)
      .Num("aggregate_gb_per_s", d.aggregate_gbps)
      .Uint("backups", d.backups)
      .Uint("loads", d.loads)
      .Num("seconds", d.seconds)
      .Num("vs_one_direction", d.vs_one_direction)
      .Num("vs_duplex_ceiling", d.vs_ceiling)
      .Str("backup_ticket_path", d.backup_path)
      .Str("load_ticket_path", d.load_path)
      .str();
}

std::string TtflJson(const TtflResult& t) {
  return JsonObject()
      .Str("path", t.path)
      .Str("call", t.call)
      .Bool("fast_path", t.fast_path)
      .Str("kind", "MHA")
      .Str("layout", t.layout)
      .Uint("page_size", t.page_size)
      .Uint("layers", t.layers)
      .Uint("bytes", t.bytes)
      .Num("rpc_return_ms", t.rpc_median_ms, 4)
      .Num("first_layer_ms", t.first_median_ms, 4)
      .Num("total_ms", t.total_median_ms, 4)
      .Num("target_ms", t.target_ms, 4)
      .Bool("met", t.met)
      .Num("daemon_first_layer_ms", t.daemon_first_median_ms, 4)
      .Num("daemon_total_ms", t.daemon_total_median_ms, 4)
      .Num("enqueue_ms", t.enqueue_median_ms, 4)
      .Num("empty_rpc_ms", t.empty_rpc_median_ms, 4)
      .Raw("rpc_return_ms_samples", NumbersJson(t.rpc_ms))
      .Raw("first_layer_ms_samples", NumbersJson(t.first_ms))
      .Raw("total_ms_samples", NumbersJson(t.total_ms))
      .Str("ticket_path", t.ticket_path)
      .str();
}

std::string HeadlineJson(const Options& o, const Results& r) {
  std::vector<std::string> rows;
  const std::string worker = HeadlineWorker(o);
  for (const HeadlineRow& h : Headline(r)) {
    JsonObject row;
    row.Str("kind", h.kind)
        .Str("layout", h.layout)
        .Uint("page_size", h.page_size)
        .Str("direction", DirName(h.backup))
        .Str("worker", worker)
        .Str("best_path", h.best->path)
        .Str("best_ticket_path", h.best->ticket_path)
        .Bool("within_bounds", h.best_within_bounds)
        .Num("gb_per_s", h.best->engine_gbps)
        .Num("vs_ceiling", h.best->vs_ceiling)
        .Raw("costs", CostsJson(h.best->costs));
    if (h.automatic != nullptr) {
      row.Str("auto_ticket_path", h.automatic->ticket_path)
          .Num("auto_gb_per_s", h.automatic->engine_gbps);
    }
    std::vector<std::string> anchors;
    for (const AnchorResult* a : h.anchors) anchors.push_back(AnchorJson(*a));
    row.Raw("anchor", JsonArray(anchors));
    rows.push_back(row.str());
  }
  return JsonArray(rows);
}

std::string AnchorCell(const AnchorResult* a, const std::string& worker) {
  if (a == nullptr) return "-";
  return absl::StrFormat("%.1f %s/%s", a->gbps, CostCell(a->costs, worker, 0.25),
                         CostCell(a->costs, worker, 1));
}

}  // namespace

HostRuns RunsOf(const std::vector<int64_t>& slots, uint32_t page_size) {
  HostRuns r;
  int64_t last = -2;
  for (size_t i = 0; i < slots.size(); i += page_size) {
    const int64_t page = slots[i] / page_size;
    if (page != last + 1) ++r.runs;
    last = page;
    ++r.pages;
  }
  return r;
}

double WorkerInfo::DriftPct() const {
  if (alone_ms <= 0 || alone_end_units == 0) return 0;
  return (alone_end_ms / alone_ms - 1) * 100;
}

const Cost* FindCost(const std::vector<Cost>& costs, const std::string& worker, double duty) {
  for (const Cost& c : costs) {
    if (c.worker == worker && c.duty == duty) return &c;
  }
  return nullptr;
}

std::vector<HeadlineRow> Headline(const Results& r) {
  std::vector<HeadlineRow> rows;
  // The worker whose bounds pick the best path: the GEMM if any case has it.
  std::string worker = "fma";
  for (const CaseResult& c : r.cases) {
    if (FindCost(c.costs, "gemm", 1) != nullptr || FindCost(c.costs, "gemm", 0.25) != nullptr) {
      worker = "gemm";
    }
  }
  for (const CaseResult& c : r.cases) {
    auto same = [&](const HeadlineRow& h) {
      return h.kind == c.kind && h.layout == c.layout && h.page_size == c.page_size &&
             h.backup == c.backup;
    };
    auto it = std::find_if(rows.begin(), rows.end(), same);
    if (it == rows.end()) {
      HeadlineRow h;
      h.kind = c.kind;
      h.layout = c.layout;
      h.page_size = c.page_size;
      h.backup = c.backup;
      for (const AnchorResult& a : r.anchor) {
        if (a.kind == c.kind && a.backup == c.backup) h.anchors.push_back(&a);
      }
      rows.push_back(h);
      it = rows.end() - 1;
    }
    if (c.path == "auto") it->automatic = &c;
    const bool within = WithinBounds(c, worker);
    if (it->best == nullptr || (within && !it->best_within_bounds) ||
        (within == it->best_within_bounds && c.engine_gbps > it->best->engine_gbps)) {
      it->best = &c;
      it->best_within_bounds = within;
    }
  }
  return rows;
}

std::vector<std::string> CaseTableLines(const Options& o, const Results& r, const std::string& path,
                                        const std::string& worker) {
  std::vector<std::string> head = {"KIND", "LAYOUT", "PAGE", "DIR", "GB/S", "RATIO", "RUN"};
  std::string align = "llllrrr";
  for (double d : o.duties) {
    head.push_back(absl::StrCat(worker, " % @", DutyName(d)));
    align += "r";
  }
  head.push_back("TICKET PATH");
  align += "l";
  std::vector<std::vector<std::string>> rows = {head};
  for (const CaseResult& c : r.cases) {
    if (c.path != path) continue;
    std::vector<std::string> row = {c.kind,
                                    c.layout,
                                    absl::StrCat(c.page_size),
                                    DirName(c.backup),
                                    absl::StrFormat("%.2f", c.engine_gbps),
                                    absl::StrFormat("%.2f", c.vs_ceiling),
                                    absl::StrFormat("%.1f", c.host.MeanPages())};
    for (double d : o.duties) row.push_back(CostCell(c.costs, worker, d));
    row.push_back(absl::StrCat(c.ticket_path, c.slow ? " (slow: 1 timed)" : ""));
    rows.push_back(row);
  }
  if (rows.size() == 1) return {};
  std::vector<std::string> lines = {absl::StrCat("path ", path, ", worker ", worker, ":")};
  for (std::string& l : cli::TableLines(rows, align)) lines.push_back(std::move(l));
  return lines;
}

std::vector<std::string> CacheTableLines(const Options& o, const Results& r) {
  if (r.cache_cases.empty()) return {};
  std::vector<std::string> head = {"PATH", "LAYOUT", "PAGE", "CALL", "GB/S", "RATIO"};
  std::string align = "llllrr";
  for (const std::string& w : o.workers) {
    for (double d : o.duties) {
      head.push_back(absl::StrCat(w, " % @", DutyName(d)));
      align += "r";
    }
  }
  head.insert(head.end(), {"POOL RATIO", "POOL GEMM @1/@0.25", "TICKET PATH"});
  align += "rrl";
  std::vector<std::vector<std::string>> rows = {head};
  for (const CaseResult& c : r.cache_cases) {
    std::vector<std::string> row = {c.path,
                                    c.layout,
                                    absl::StrCat(c.page_size),
                                    CaseDir(c, true),
                                    absl::StrFormat("%.2f", c.engine_gbps),
                                    absl::StrFormat("%.2f", c.vs_ceiling)};
    for (const std::string& w : o.workers) {
      for (double d : o.duties) row.push_back(CostCell(c.costs, w, d));
    }
    const CaseResult* pool = nullptr;
    for (const CaseResult& p : r.cases) {
      if (p.path == c.path && p.kind == c.kind && p.layout == c.layout &&
          p.page_size == c.page_size && p.backup == c.backup) {
        pool = &p;
      }
    }
    row.push_back(pool == nullptr ? "-" : absl::StrFormat("%.2f", pool->vs_ceiling));
    row.push_back(pool == nullptr ? "-"
                                  : absl::StrCat(CostCell(pool->costs, "gemm", 1), "/",
                                                 CostCell(pool->costs, "gemm", 0.25)));
    row.push_back(c.ticket_path);
    rows.push_back(row);
  }
  std::vector<std::string> lines = {
      "node cache (MHA; store: new keys each call, restore: present keys; GB/s over the tickets' "
      "time, RATIO to the ceiling of the direction; POOL: the index-addressed pool's Backup / "
      "Load of the same case and path in this run):"};
  for (std::string& l : cli::TableLines(rows, align)) lines.push_back(std::move(l));
  return lines;
}

std::vector<std::string> AnchorTableLines(const Options& o, const Results& r) {
  if (r.anchor.empty()) return {};
  std::vector<std::string> head = {"KIND", "QUOTA", "DIR", "GB/S", "RATIO", "RUN"};
  std::string align = "lrlrrr";
  for (const std::string& w : o.workers) {
    for (double d : o.duties) {
      head.push_back(absl::StrCat(w, " % @", DutyName(d)));
      align += "r";
    }
  }
  std::vector<std::vector<std::string>> rows = {head};
  for (const AnchorResult& a : r.anchor) {
    std::vector<std::string> row = {a.kind,
                                    absl::StrCat(a.quota),
                                    DirName(a.backup),
                                    absl::StrFormat("%.2f", a.gbps),
                                    absl::StrFormat("%.2f", a.vs_ceiling),
                                    absl::StrFormat("%.1f", a.host.MeanPages())};
    for (const std::string& w : o.workers) {
      for (double d : o.duties) row.push_back(CostCell(a.costs, w, d));
    }
    rows.push_back(row);
  }
  std::vector<std::string> lines = {
      "in-process anchor (warp-per-item zero-copy kernel in this worker's context, LAYER_FIRST "
      "page-1 host buffer, 1024-thread blocks, grid = quota):"};
  for (std::string& l : cli::TableLines(rows, align)) lines.push_back(std::move(l));
  return lines;
}

std::vector<std::string> HeadlineTableLines(const Options& o, const Results& r) {
  const std::vector<HeadlineRow> headline = Headline(r);
  if (headline.empty()) return {};
  const std::string w = HeadlineWorker(o);
  std::vector<std::string> head = {"KIND",
                                   "LAYOUT",
                                   "PAGE",
                                   "DIR",
                                   "BEST",
                                   "GB/S",
                                   "RATIO",
                                   absl::StrCat(w, " % @0.25"),
                                   absl::StrCat(w, " % @1"),
                                   "AUTO"};
  std::string align = "llllllrrrl";
  for (uint32_t q : o.anchor_quotas) {
    head.push_back(absl::StrCat("ANCHOR q", q));
    align += "r";
  }
  std::vector<std::vector<std::string>> rows = {head};
  for (const HeadlineRow& h : headline) {
    std::vector<std::string> row = {
        h.kind,
        h.layout,
        absl::StrCat(h.page_size),
        DirName(h.backup),
        absl::StrCat(h.best->path, h.best->path == "auto" ? ":" + h.best->ticket_path : "",
                     h.best_within_bounds ? "" : " (over)"),
        absl::StrFormat("%.2f", h.best->engine_gbps),
        absl::StrFormat("%.2f", h.best->vs_ceiling),
        CostCell(h.best->costs, w, 0.25),
        CostCell(h.best->costs, w, 1),
        h.automatic == nullptr
            ? "-"
            : absl::StrFormat("%.1f %s", h.automatic->engine_gbps, h.automatic->ticket_path)};
    for (uint32_t q : o.anchor_quotas) {
      const AnchorResult* found = nullptr;
      for (const AnchorResult* a : h.anchors) {
        if (a->quota == q) found = a;
      }
      row.push_back(AnchorCell(found, w));
    }
    rows.push_back(row);
  }
  std::vector<std::string> lines = {absl::StrFormat(
      "headline (%s worker): per case the fastest path within %s <= +%.0f %% at a 25 %% duty "
      "cycle and <= +%.0f %% back to back ('(over)': none is; the fastest shown); AUTO: GB/s "
      "and the path auto took; ANCHOR: GB/s and %s %% at 0.25 / 1",
      w, w, kCostBoundDutyPct, kCostBoundBackToBackPct, w)};
  for (std::string& l : cli::TableLines(rows, align)) lines.push_back(std::move(l));
  return lines;
}

std::vector<std::string> TtflTableLines(const Results& r) {
  if (r.ttfl.empty()) return {};
  std::vector<std::vector<std::string>> rows = {
      {"PATH", "CALL", "VIA", "LAYOUT", "PAGE", "FIRST MS", "ALL MS", "TARGET MS", "",
       "CALL BACK MS", "EMPTY CALL MS", "DAEMON FIRST / ALL MS", "QUEUED MS", "TICKET PATH"}};
  for (const TtflResult& t : r.ttfl) {
    rows.push_back(
        {t.path, t.call, t.fast_path ? "fast path" : "gRPC", t.layout, absl::StrCat(t.page_size),
         absl::StrFormat("%.3f", t.first_median_ms), absl::StrFormat("%.3f", t.total_median_ms),
         absl::StrFormat("%.3f", t.target_ms), t.met ? "met" : "MISSED",
         absl::StrFormat("%.3f", t.rpc_median_ms), absl::StrFormat("%.3f", t.empty_rpc_median_ms),
         absl::StrFormat("%.3f / %.3f", t.daemon_first_median_ms, t.daemon_total_median_ms),
         absl::StrFormat("%.3f", t.enqueue_median_ms), t.ticket_path});
  }
  std::vector<std::string> lines = {absl::StrFormat(
      "time to first layer (MHA, %d layers, from the event before the call; target all / "
      "layers + %.1f ms; median; EMPTY CALL: a Load of no rows):",
      r.ttfl.front().layers, kFirstLayerSlackMs)};
  for (std::string& l : cli::TableLines(rows, "llllrrrrlrrrrl")) lines.push_back(std::move(l));
  return lines;
}

std::string Json(const Options& o, const Results& r, const absl::Status& status) {
  std::vector<std::string> cases, cache_cases, anchor, duplex, ttfl, workers;
  for (const CaseResult& c : r.cases) cases.push_back(CaseJson(c));
  for (const CaseResult& c : r.cache_cases) cache_cases.push_back(CaseJson(c, /*cache=*/true));
  for (const AnchorResult& a : r.anchor) anchor.push_back(AnchorJson(a));
  for (const DuplexResult& d : r.duplex) duplex.push_back(DuplexJson(d));
  for (const TtflResult& t : r.ttfl) ttfl.push_back(TtflJson(t));
  for (const WorkerInfo& w : r.workers) {
    workers.push_back(JsonObject()
                          .Str("name", w.name)
                          .Str("what", w.what)
                          .Num("alone_ms", w.alone_ms, 4)
                          .Uint("alone_units", w.alone_units)
                          .Num("alone_end_ms", w.alone_end_ms, 4)
                          .Uint("alone_end_units", w.alone_end_units)
                          .Num("drift_pct", w.DriftPct(), 2)
                          .str());
  }
  std::vector<std::string> duties;
  for (double d : o.duties) duties.push_back(absl::StrFormat("%.3f", d));
  std::vector<std::string> quotas;
  for (uint32_t q : o.anchor_quotas) quotas.push_back(absl::StrCat(q));
  return JsonObject()
      .Str("benchmark", "kvhost_cuda_transfer_bench")
      .Uint("schema", 2)
      .Bool("complete", status.ok())
      .Num("elapsed_s", r.elapsed_s, 1)
      .Num("estimate_s", r.estimate_s, 0)
      .Bool("mps", r.mps)
      .Str("error", status.ok() ? "" : std::string(status.message()))
      .Raw("gpu", JsonObject()
                      .Str("name", r.gpu.name)
                      .Str("uuid", r.gpu.uuid)
                      .Uint("sms", static_cast<uint64_t>(r.gpu.sms))
                      .Uint("memory_bytes", r.gpu.memory_bytes)
                      .Uint("cuda_driver", static_cast<uint64_t>(r.gpu.driver))
                      .Uint("cuda_runtime", static_cast<uint64_t>(r.gpu.runtime))
                      .str())
      .Raw("config", JsonObject()
                         .Str("kvhostd", o.kvhostd)
                         .Raw("paths", StringsJson(o.paths))
                         .Raw("cache_page_sizes", JsonArray([&] {
                                std::vector<std::string> v;
                                for (uint32_t ps : o.cache_page_sizes)
                                  v.push_back(absl::StrCat(ps));
                                return v;
                              }()))
                         .Str("cache_layout", LayoutName(o.cache_layout))
                         .Raw("workers", StringsJson(o.workers))
                         .Raw("duties", JsonArray(duties))
                         .Raw("anchor_quotas", JsonArray(quotas))
                         .Str("host_slots", HostSlotsName(o.host_slots))
                         .Uint("churn_ops", o.churn_ops)
                         .Uint("tokens", o.tokens)
                         .Uint("layers", o.layers)
                         .Uint("gemm_n", o.gemm_n)
                         .Uint("repeats", static_cast<uint64_t>(o.repeats))
                         .Num("slow_case_s", o.slow_case_s)
                         .Num("window_s", o.window_s)
                         .Num("duplex_s", o.duplex_s)
                         .Num("baseline_s", o.baseline_s)
                         .Str("staging_bytes", o.staging_bytes)
                         .Uint("sm_blocks", static_cast<uint64_t>(o.sm_blocks))
                         .Raw("daemon_flags", StringsJson(o.daemon_flags))
                         .Uint("seed", o.seed)
                         .Bool("quick", o.quick)
                         .str())
      .Str("cublas", r.cublas)
      .Raw("paths_done", StringsJson(r.paths_done))
      .Raw("ceiling", JsonObject()
                          .Uint("bytes", r.ceiling.bytes)
                          .Uint("runs", static_cast<uint64_t>(r.ceiling.runs))
                          .Num("d2h_gb_per_s", r.ceiling.d2h_gbps)
                          .Num("h2d_gb_per_s", r.ceiling.h2d_gbps)
                          .Num("duplex_gb_per_s", r.ceiling.duplex_gbps)
                          .Num("duplex_d2h_gb_per_s", r.ceiling.duplex_d2h_gbps)
                          .Num("duplex_h2d_gb_per_s", r.ceiling.duplex_h2d_gbps)
                          .str())
      .Raw("workers", JsonArray(workers))
      .Raw("cases", JsonArray(cases))
      .Raw("anchor", JsonArray(anchor))
      .Raw("headline", HeadlineJson(o, r))
      .Raw("duplex", JsonArray(duplex))
      .Raw("ttfl", JsonArray(ttfl))
      .Raw("cache_cases", JsonArray(cache_cases))
      .str();
}

void PrintReport(const Options& o, const Results& r) {
  auto print = [](const std::vector<std::string>& lines) {
    if (lines.empty()) return;
    std::printf("\n");
    for (const std::string& l : lines) std::printf("%s\n", l.c_str());
  };
  for (const std::string& path : o.paths) {
    for (const std::string& worker : o.workers) print(CaseTableLines(o, r, path, worker));
  }
  if (!r.cases.empty()) {
    absl::PrintF(
        "(GB/s: bytes over kvhostd's accept-to-done ticket time, median; RATIO: to the ceiling "
        "of the same direction; RUN: mean host run of the slots used, in pages; WORKER %% @d: "
        "mean compute unit time with transfers at duty cycle d, vs alone; bytes checked)\n");
  }
  print(AnchorTableLines(o, r));
  print(HeadlineTableLines(o, r));
  const CeilingResult& c = r.ceiling;
  if (c.bytes > 0) {
    absl::PrintF("\nceiling: D2H %.2f GB/s, H2D %.2f GB/s, both at once %.2f GB/s\n", c.d2h_gbps,
                 c.h2d_gbps, c.duplex_gbps);
  }
  for (const WorkerInfo& w : r.workers) {
    absl::PrintF("worker %s (%s) alone: %.3f ms per unit at the start, %s at the end%s\n", w.name,
                 w.what, w.alone_ms,
                 w.alone_end_units > 0 ? absl::StrFormat("%.3f ms", w.alone_end_ms) : "-",
                 w.alone_end_units > 0 ? absl::StrFormat(" (drift %+.2f %%)", w.DriftPct()) : "");
  }
  for (const DuplexResult& d : r.duplex) {
    absl::PrintF(
        "duplex %-6s MHA LAYER_FIRST ps%d: %.2f GB/s (backup %.2f + load %.2f) over %.2f s; "
        "alone backup %.2f, load %.2f GB/s; %.2fx one direction, %.2f of the duplex ceiling "
        "[%s / %s]\n",
        d.path, kProbePageSize, d.aggregate_gbps, d.backup_gbps, d.load_gbps, d.seconds,
        d.backup_alone_gbps, d.load_alone_gbps, d.vs_one_direction, d.vs_ceiling, d.backup_path,
        d.load_path);
  }
  print(TtflTableLines(r));
  print(CacheTableLines(o, r));
  if (r.elapsed_s > 0) {
    absl::PrintF("done in %.1f s (estimate %.0f s)\n", r.elapsed_s, r.estimate_s);
  }
  std::fflush(stdout);
}

}  // namespace kvhost::bench
