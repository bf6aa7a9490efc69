// What kvhost_cuda_transfer_bench measured, and how it is shown: the result
// records the run fills in, the stdout tables (one per path and worker, the
// anchor's, the headline) and the --json-out document. No CUDA here, so the
// rendering is unit-tested without a GPU.
//
// A worker cost is the worker's mean time per compute unit (one GEMM, one
// FMA kernel) while transfers run, over its mean time alone at the start of
// the run, minus 1, in percent. Plain data and pure functions:
// thread-compatible.
#ifndef KVHOST_BENCH_CUDA_BENCH_REPORT_H_
#define KVHOST_BENCH_CUDA_BENCH_REPORT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "bench/cuda_bench_options.h"

namespace kvhost::bench {

struct GpuInfo {
  std::string name, uuid;
  int sms = 0;
  int driver = 0, runtime = 0;
  uint64_t memory_bytes = 0;
};

struct CeilingResult {
  uint64_t bytes = 0;
  int runs = 0;
  double d2h_gbps = 0, h2d_gbps = 0;
  double duplex_gbps = 0, duplex_d2h_gbps = 0, duplex_h2d_gbps = 0;
};

// One worker's compute alone, at the start and the end of the run.
struct WorkerInfo {
  std::string name;  // "gemm", "fma"
  std::string what;  // its shape, for the header line
  double alone_ms = 0;
  uint64_t alone_units = 0;
  double alone_end_ms = 0;
  uint64_t alone_end_units = 0;
  // End against start, percent; 0 before the end was measured.
  double DriftPct() const;
};

// One worker cost measurement.
struct Cost {
  std::string worker;
  double duty = 1;
  double window_s = 0;
  uint64_t transfers = 0;
  uint64_t units = 0;  // compute units averaged
  double unit_ms = 0;
  // The unit alone right before and right after the window, their mean
  // (the baseline of cost_pct), and at the run's start (for comparison: the
  // GPU's clocks drift).
  double alone_before_ms = 0;
  double alone_after_ms = 0;
  double alone_ms = 0;
  double run_alone_ms = 0;
  double cost_pct = 0;
};

// The cost of `worker` at `duty` in `costs`, or null.
const Cost* FindCost(const std::vector<Cost>& costs, const std::string& worker, double duty);

// Mean pages per run of consecutive host pages, and the runs, of a transfer.
struct HostRuns {
  uint64_t pages = 0;
  uint64_t runs = 0;
  double MeanPages() const { return runs == 0 ? 0 : static_cast<double>(pages) / runs; }
};
// The runs of consecutive pages in `slots` (whole pages, in transfer order).
HostRuns RunsOf(const std::vector<int64_t>& slots, uint32_t page_size);

struct CaseResult {
  std::string path;  // --transfer-path
  std::string kind, layout;
  uint32_t page_size = 0;
  bool backup = true;
  uint64_t bytes = 0;
  double warmup_s = 0;
  int timed = 0;
  bool slow = false;  // warm-up over --slow-case-s: one timed transfer, fewer costs
  double engine_gbps = 0, client_gbps = 0, vs_ceiling = 0;
  std::string ticket_path;
  HostRuns host;
  std::vector<Cost> costs;
};

// The in-process anchor: sglang's kernel io copy in the worker's context.
struct AnchorResult {
  std::string kind;
  uint32_t quota = 0;  // blocks of 1024 threads
  bool backup = true;
  uint64_t bytes = 0;
  double gbps = 0, vs_ceiling = 0;
  HostRuns host;
  std::vector<Cost> costs;
};

struct DuplexResult {
  std::string path;
  uint64_t bytes = 0;  // per transfer
  double backup_alone_gbps = 0, load_alone_gbps = 0;
  double backup_gbps = 0, load_gbps = 0, aggregate_gbps = 0;
  uint64_t backups = 0, loads = 0;
  double seconds = 0;
  double vs_one_direction = 0, vs_ceiling = 0;
  std::string backup_path, load_path;
};

struct TtflResult {
  std::string path;
  std::string call = "Load";  // or "Restore" (a node cache's)
  std::string layout = "LAYER_FIRST";
  bool fast_path = false;  // the calls went over the fast path
  uint32_t page_size = 0;
  uint32_t layers = 0;
  uint64_t bytes = 0;
  // From the event recorded before the call: the call's return, layer 0
  // usable, the last layer usable.
  std::vector<double> rpc_ms, first_ms, total_ms;
  double rpc_median_ms = 0, first_median_ms = 0, total_median_ms = 0, target_ms = 0;
  bool met = false;
  // The daemon's view, from the ticket: acceptance to the first layer done,
  // to the last, and to the end of queueing.
  std::vector<double> daemon_first_ms, daemon_total_ms, enqueue_ms;
  double daemon_first_median_ms = 0, daemon_total_median_ms = 0, enqueue_median_ms = 0;
  // The floor under rpc_ms: the same Load RPC on the same attachment with no
  // rows (nothing to validate, plan or queue), wall time of the call.
  std::vector<double> empty_rpc_ms;
  double empty_rpc_median_ms = 0;
  std::string ticket_path;
};

struct Results {
  GpuInfo gpu;
  CeilingResult ceiling;
  std::vector<WorkerInfo> workers;
  std::string cublas;  // the library loaded, or why none was
  std::vector<CaseResult> cases;
  std::vector<AnchorResult> anchor;
  std::vector<DuplexResult> duplex;
  std::vector<TtflResult> ttfl;
  // Node cache cases (cuda_bench_cache.h): backup = Store, else Restore.
  std::vector<CaseResult> cache_cases;
  std::vector<std::string> paths_done;
  bool mps = false;      // an MPS control pipe was found
  double elapsed_s = 0;  // of the whole run
  double estimate_s = 0;
};

// One headline row: per kind, layout, page size and direction, the best
// kvhost path (the fastest within the GEMM cost bounds, else the fastest)
// next to auto and the anchor.
struct HeadlineRow {
  std::string kind, layout;
  uint32_t page_size = 0;
  bool backup = true;
  const CaseResult* best = nullptr;
  bool best_within_bounds = false;
  const CaseResult* automatic = nullptr;     // the auto path's case, if run
  std::vector<const AnchorResult*> anchors;  // per quota, of the same kind and direction
};
std::vector<HeadlineRow> Headline(const Results& r);

// The stdout tables, as lines (none without rows): the cases of one path
// and worker; the anchor; the headline; the time to first layer.
std::vector<std::string> CaseTableLines(const Options& o, const Results& r, const std::string& path,
                                        const std::string& worker);
std::vector<std::string> AnchorTableLines(const Options& o, const Results& r);
std::vector<std::string> HeadlineTableLines(const Options& o, const Results& r);
std::vector<std::string> TtflTableLines(const Results& r);
// The node cache cases, each beside the index-addressed pool's case of the
// same kind, layout, page size, direction and path where the run has one.
std::vector<std::string> CacheTableLines(const Options& o, const Results& r);

// The --json-out document; "complete" is status.ok().
std::string Json(const Options& o, const Results& r, const absl::Status& status);

// Prints every table and summary line of `r` to stdout.
void PrintReport(const Options& o, const Results& r);

}  // namespace kvhost::bench

#endif  // KVHOST_BENCH_CUDA_BENCH_REPORT_H_
