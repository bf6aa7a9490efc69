// kvhost_cuda_transfer_bench's flags, checked into one Options value, the
// cases they select and the run's time estimate. No CUDA here: the flags are
// checked (and unit-tested) on machines without a GPU, before the benchmark
// looks for one.
//
// OptionsFromFlags reads the process's absl flags (defined in the .cc);
// everything else is a pure function of its arguments. Thread-compatible.
#ifndef KVHOST_BENCH_CUDA_BENCH_OPTIONS_H_
#define KVHOST_BENCH_CUDA_BENCH_OPTIONS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kvhost/v1/pool.pb.h"

namespace kvhost::bench {

// The duplex case uses this page size (MHA, LAYER_FIRST), as the time to
// first layer's largest one; --tokens must be a multiple of it.
constexpr uint32_t kProbePageSize = 64;
// Time-to-first-layer target: one layer's share of the load plus this.
constexpr double kFirstLayerSlackMs = 0.1;
// The worker bounds for a kvhost path (GEMM worker): at a 25 % duty
// cycle and with transfers back to back; the headline's best path is the
// fastest one within both.
constexpr double kCostBoundDutyPct = 2.0;
constexpr double kCostBoundBackToBackPct = 4.0;

enum class HostSlots { kChurned, kRandom, kFresh };

struct Shape {
  v1::PoolKind kind;
  v1::Layout layout;
};

struct Case {
  v1::PoolKind kind;
  v1::Layout layout;
  uint32_t page_size;
};

struct Options {
  std::string kvhostd;
  std::vector<std::string> paths;
  std::vector<Shape> shapes;
  std::vector<uint32_t> page_sizes;
  std::vector<bool> directions;      // true = backup
  std::vector<std::string> workers;  // "gemm", "fma"
  bool workers_from_quick = false;   // --quick chose them: gemm may drop out
  std::vector<double> duties;        // 1 = back to back
  std::vector<uint32_t> anchor_quotas;
  std::vector<uint32_t> ttfl_page_sizes;
  std::vector<uint32_t> cache_page_sizes;  // node cache cases; empty = none
  v1::Layout cache_layout = v1::PAGE_FIRST;
  std::string cublas;  // --cublas; empty = search
  uint32_t gemm_n = 0;
  HostSlots host_slots = HostSlots::kChurned;
  uint64_t churn_ops = 0;
  uint64_t tokens = 0;
  uint32_t layers = 0;
  uint32_t head_groups = 1;  // --head-groups: PAGE_UNIFIED MHA pools
  int repeats = 0;
  double slow_case_s = 0;
  double window_s = 0;
  double duplex_s = 0;
  double baseline_s = 0;
  std::string staging_bytes;
  int sm_blocks = 0;
  uint64_t ceiling_bytes = 0;
  uint64_t seed = 0;
  bool quick = false;
  bool estimate_only = false;
  std::string json_out;
  std::string daemon_logs;
  std::vector<std::string> daemon_flags;  // added to every kvhostd's flags
};

// "1G", "256M", "268435456": K/M/G/T are powers of 1024. INVALID_ARGUMENT
// naming --`flag` for anything else, zero included.
absl::StatusOr<uint64_t> ParseBytes(absl::string_view flag, absl::string_view text);

// The checked flags: INVALID_ARGUMENT naming the bad flag and value.
absl::StatusOr<Options> OptionsFromFlags();

// Every kind x layout x page size of `o`, in run order.
std::vector<Case> MakeCases(const Options& o);

// The host pool of a case: `need_tokens` for the transfer plus --tokens for
// the churn to hold (so the transfer's slots come from a fragmented pool).
v1::PoolSpec SpecFor(const Options& o, v1::PoolKind kind, v1::Layout layout, uint32_t page_size,
                     uint64_t need_tokens);

// Bytes one transfer of `o.tokens` moves for `kind`.
uint64_t TransferBytes(const Options& o, v1::PoolKind kind);

// Seconds the run should take on an H200, from what each step costs there
// (assumed transfer speed and per-case overheads, see the .cc); slow cases
// add their transfer time on top.
double EstimateSeconds(const Options& o);

const char* HostSlotsName(HostSlots h);
std::string KindName(v1::PoolKind kind);
std::string LayoutName(v1::Layout layout);
const char* DirName(bool backup);
// "1" for 1, "0.25" for 0.25: a duty cycle as the tables and JSON keys show it.
std::string DutyName(double duty);

}  // namespace kvhost::bench

#endif  // KVHOST_BENCH_CUDA_BENCH_OPTIONS_H_
