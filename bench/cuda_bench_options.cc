#include "bench/cuda_bench_options.h"

#include <stdlib.h>

#include <algorithm>
#include <iterator>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "bench/bench_util.h"

ABSL_FLAG(std::string, kvhostd, "",
          "kvhostd binary to start (once per path); empty = $KVHOST_KVHOSTD if set (a bundle, "
          "as scripts/gpu_run.sh sets it), else this build's " KVHOSTD_PATH ".");
ABSL_FLAG(std::vector<std::string>, paths, std::vector<std::string>({"auto", "ce", "staged"}),
          "kvhostd --transfer-path values to measure, comma separated: auto, ce, staged, sm "
          "(sm, the SM copy path, is auto's choice only under MPS and costs a worker without "
          "MPS +80-200 %; with every path the run no longer fits one 10-minute GPU call: "
          "measure it in a run of its own, --paths=sm); worker: kvhostd --worker-copy, this "
          "process runs each copy (kvhost::WorkerCopier) on a copy stream of its own at the "
          "first --anchor-quotas value (its cases only, no duplex or time to first layer).");
ABSL_FLAG(std::vector<std::string>, kinds, std::vector<std::string>({"MHA", "MLA"}),
          "Pool kinds: MHA (8 KV heads x 128 dims bf16, K and V), MLA (576 dims bf16).");
ABSL_FLAG(std::vector<std::string>, layouts,
          std::vector<std::string>({"LAYER_FIRST", "PAGE_FIRST", "PAGE_FIRST_DIRECT", "PAGE_HEAD"}),
          "Host layouts, comma separated: LAYER_FIRST, PAGE_FIRST, PAGE_FIRST_DIRECT, PAGE_HEAD "
          "(MHA only), PAGE_UNIFIED (sglang's page_unified; --head-groups).");
ABSL_FLAG(uint32_t, head_groups, 1,
          "PAGE_UNIFIED: head groups of the MHA pools' 8 KV heads per page (1, 2, 4 or 8).");
ABSL_FLAG(std::vector<std::string>, page_sizes, std::vector<std::string>({"1", "16", "64"}),
          "Page sizes, comma separated.");
ABSL_FLAG(std::vector<std::string>, directions, std::vector<std::string>({"backup", "load"}),
          "Directions to time: backup (device to host), load (host to device).");
ABSL_FLAG(std::vector<std::string>, workers, std::vector<std::string>({"gemm", "fma"}),
          "The worker's compute whose cost is measured: gemm (a cuBLAS bf16 GEMM loop, the "
          "headline), fma (one wave of long FMA blocks on every SM, the worst case).");
ABSL_FLAG(std::vector<std::string>, duty, std::vector<std::string>({"1", "0.25"}),
          "Duty cycles of the transfers while the worker's cost is measured: 1 = back to back; "
          "d < 1 = issue a transfer, wait for it, stay idle (1/d - 1) times its duration.");
ABSL_FLAG(std::vector<std::string>, anchor_quotas, std::vector<std::string>({"2", "8"}),
          "Block quotas of the in-process anchor (sglang's kernel io default is 2); 'none' = no "
          "anchor.");
ABSL_FLAG(std::vector<std::string>, ttfl_page_sizes, std::vector<std::string>({"1", "16", "64"}),
          "Page sizes of the time-to-first-layer case (MHA LAYER_FIRST).");
ABSL_FLAG(std::vector<std::string>, cache_page_sizes, std::vector<std::string>({"16", "64"}),
          "Page sizes of the node cache cases (MHA, --cache-layout; cuda_bench_cache.h), run on "
          "the first path; 'none' = no node cache cases.");
ABSL_FLAG(std::string, cache_layout, "PAGE_FIRST",
          "Host layout of the node cache cases' MHA cache pools.");
ABSL_FLAG(std::string, cublas, "",
          "libcublas to dlopen for the GEMM worker; empty = $KVHOST_CUBLAS, then libcublas.so.13 "
          "and .12 from the loader path, then python site-packages nvidia/*/lib.");
ABSL_FLAG(uint32_t, gemm_n, 8192, "The GEMM worker's M = N = K.");
ABSL_FLAG(std::string, host_slots, "churned",
          "Host slots of each transfer: churned (what the daemon's Alloc returns after "
          "--churn-ops Alloc/Free calls on the pool), random (random whole pages), fresh (Alloc "
          "on a new pool: consecutive).");
ABSL_FLAG(uint64_t, churn_ops, 1000, "Alloc/Free calls of the churn before each transfer's Alloc.");
ABSL_FLAG(uint64_t, tokens, 8192,
          "Token slots per transfer; a multiple of every page size and of 64 (8192 at 32 layers: "
          "1 GiB MHA transfers).");
ABSL_FLAG(uint32_t, layers, 32, "Layers of the pools (and of the time-to-first-layer load).");
ABSL_FLAG(int, repeats, 3, "Timed transfers per case and direction, after the warm-up.");
ABSL_FLAG(double, slow_case_s, 0.25,
          "A case whose warm-up transfer took longer than this (1 GiB under 4.3 GB/s) gets one "
          "timed transfer and its worker costs back to back only, over one transfer.");
ABSL_FLAG(double, window_s, 0.3, "Least time of each worker cost measurement.");
ABSL_FLAG(double, duplex_s, 0.5, "Seconds of each duplex loop (and of each direction alone).");
ABSL_FLAG(double, baseline_s, 0.5, "Seconds of each worker's compute loop alone (start and end).");
ABSL_FLAG(std::string, staging_bytes, "",
          "kvhostd --staging-bytes (e.g. 256M); empty = not passed (kvhostd's default).");
ABSL_FLAG(int, sm_blocks, 0, "kvhostd --sm-blocks; 0 = not passed (kvhostd's default).");
ABSL_FLAG(std::string, ceiling_bytes, "1G",
          "Bytes of each contiguous ceiling copy (K/M/G suffixes are powers of 1024).");
ABSL_FLAG(uint64_t, seed, 1, "Seed of the churn and of the random slot and row choice.");
ABSL_FLAG(bool, quick, false,
          "Smoke run (CI on a GPU, < 30 s): 256 tokens, 4 layers, page size 16, paths "
          "ce,staged,sm, MHA PAGE_FIRST and MLA LAYER_FIRST, one repeat, short windows; the "
          "GEMM worker only where cuBLAS is found.");
ABSL_FLAG(bool, estimate, false, "Print the cases and the time estimate, then exit (no GPU used).");
ABSL_FLAG(std::string, json_out, "", "Write the results as JSON to this file.");
ABSL_FLAG(std::vector<std::string>, daemon_flags, {},
          "More kvhostd flags for every daemon started, comma-separated (e.g. "
          "--log-level=debug, with --daemon-logs, for the per-call timing lines).");
ABSL_FLAG(std::string, daemon_logs, "",
          "Directory to keep each path's kvhostd log in (kvhostd-PATH.log: auto's path choices "
          "and their reasons); empty = not kept.");

namespace kvhost::bench {
namespace {

const char* const kPathNames[] = {"auto", "ce", "staged", "sm", "worker"};
const char* const kWorkerNames[] = {"gemm", "fma"};

// What EstimateSeconds assumes, from the H200 runs of docs/PERF.md: the
// good paths move 45-53 GB/s; a case's pool creation, churn RPCs (~50 us
// each), fill, warm-ups and byte check take about this; starting a compute
// loop waits for two of its kernels; a kvhostd starts in about a second.
constexpr double kAssumedGbps = 40;
constexpr double kCaseOverheadS = 0.3;
constexpr double kChurnRpcS = 50e-6;
constexpr double kLoopStartS = 0.02;
constexpr double kDaemonStartS = 1.0;
constexpr double kCeilingS = 1.5;

std::vector<std::string> Upper(const std::vector<std::string>& items) {
  std::vector<std::string> out;
  for (const std::string& item : items) out.push_back(absl::AsciiStrToUpper(item));
  return out;
}

template <typename T>
bool OneOf(const std::string& value, const T& names) {
  return std::find(std::begin(names), std::end(names), value) != std::end(names);
}

absl::StatusOr<std::vector<uint32_t>> U32List(absl::string_view flag,
                                              const std::vector<std::string>& items) {
  absl::StatusOr<std::vector<uint64_t>> values = ParsePositiveList(flag, items);
  if (!values.ok()) return values.status();
  std::vector<uint32_t> out;
  for (uint64_t v : *values) {
    if (v > UINT32_MAX) {
      return absl::InvalidArgumentError(absl::StrCat("--", flag, ": ", v, " is too large"));
    }
    out.push_back(static_cast<uint32_t>(v));
  }
  return out;
}

absl::Status ParseCache(Options& o) {
  const std::vector<std::string> sizes = absl::GetFlag(FLAGS_cache_page_sizes);
  if (sizes != std::vector<std::string>({"none"})) {
    absl::StatusOr<std::vector<uint32_t>> parsed = U32List("cache-page-sizes", sizes);
    if (!parsed.ok()) return parsed.status();
    o.cache_page_sizes = *parsed;
  }
  const std::string layout = absl::AsciiStrToUpper(absl::GetFlag(FLAGS_cache_layout));
  if (!v1::Layout_Parse(layout, &o.cache_layout) || o.cache_layout == v1::LAYOUT_UNSPECIFIED) {
    return absl::InvalidArgumentError(absl::StrCat("--cache-layout: '", layout,
                                                   "' is not LAYER_FIRST, PAGE_FIRST, "
                                                   "PAGE_FIRST_DIRECT, PAGE_HEAD or PAGE_UNIFIED"));
  }
  return absl::OkStatus();
}

absl::Status ParseShapes(Options& o) {
  std::vector<v1::PoolKind> kinds;
  for (const std::string& k : Upper(absl::GetFlag(FLAGS_kinds))) {
    v1::PoolKind kind;
    if (!v1::PoolKind_Parse(k, &kind) || (kind != v1::MHA && kind != v1::MLA)) {
      return absl::InvalidArgumentError(absl::StrCat("--kinds: '", k, "' is not MHA or MLA"));
    }
    kinds.push_back(kind);
  }
  std::vector<v1::Layout> layouts;
  for (const std::string& l : Upper(absl::GetFlag(FLAGS_layouts))) {
    v1::Layout layout;
    if (!v1::Layout_Parse(l, &layout) || layout == v1::LAYOUT_UNSPECIFIED) {
      return absl::InvalidArgumentError(
          absl::StrCat("--layouts: '", l,
                       "' is not LAYER_FIRST, PAGE_FIRST, PAGE_FIRST_DIRECT, PAGE_HEAD or "
                       "PAGE_UNIFIED"));
    }
    layouts.push_back(layout);
  }
  for (v1::PoolKind kind : kinds) {
    for (v1::Layout layout : layouts) {
      if (kind == v1::MLA && layout == v1::PAGE_HEAD) continue;  // MHA only
      o.shapes.push_back({kind, layout});
    }
  }
  if (o.shapes.empty()) {
    return absl::InvalidArgumentError("--kinds x --layouts leaves no valid combination");
  }
  return absl::OkStatus();
}

// --paths, --workers, --duty, --directions, --anchor-quotas, --host-slots.
absl::Status ParseLists(Options& o) {
  o.paths = absl::GetFlag(FLAGS_paths);
  if (o.paths.empty()) return absl::InvalidArgumentError("--paths is empty");
  for (const std::string& p : o.paths) {
    if (!OneOf(p, kPathNames)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--paths: '", p, "' is not one of auto, ce, staged, sm, worker"));
    }
  }
  if (!o.quick) {
    o.workers.clear();
    for (const std::string& w : absl::GetFlag(FLAGS_workers)) {
      const std::string name = absl::AsciiStrToLower(w);
      if (!OneOf(name, kWorkerNames)) {
        return absl::InvalidArgumentError(absl::StrCat("--workers: '", w, "' is not gemm or fma"));
      }
      if (!OneOf(name, o.workers)) o.workers.push_back(name);
    }
    if (o.workers.empty()) return absl::InvalidArgumentError("--workers is empty");
  }
  o.duties.clear();
  for (const std::string& d : absl::GetFlag(FLAGS_duty)) {
    double duty = 0;
    if (!absl::SimpleAtod(d, &duty) || !(duty > 0 && duty <= 1)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--duty: '", d, "' is not a duty cycle in (0, 1]"));
    }
    if (std::find(o.duties.begin(), o.duties.end(), duty) == o.duties.end()) {
      o.duties.push_back(duty);
    }
  }
  if (o.duties.empty()) return absl::InvalidArgumentError("--duty is empty");
  o.directions.clear();
  for (const std::string& d : absl::GetFlag(FLAGS_directions)) {
    const std::string dir = absl::AsciiStrToLower(d);
    if (dir != "backup" && dir != "load") {
      return absl::InvalidArgumentError(
          absl::StrCat("--directions: '", d, "' is not backup or load"));
    }
    o.directions.push_back(dir == "backup");
  }
  if (o.directions.empty()) return absl::InvalidArgumentError("--directions is empty");
  const std::vector<std::string> quotas = absl::GetFlag(FLAGS_anchor_quotas);
  if (quotas.size() == 1 && absl::AsciiStrToLower(quotas[0]) == "none") {
    o.anchor_quotas.clear();
  } else {
    absl::StatusOr<std::vector<uint32_t>> q = U32List("anchor-quotas", quotas);
    if (!q.ok()) return q.status();
    o.anchor_quotas = *q;
  }
  const std::string slots = absl::AsciiStrToLower(absl::GetFlag(FLAGS_host_slots));
  if (slots == "churned") {
    o.host_slots = HostSlots::kChurned;
  } else if (slots == "random") {
    o.host_slots = HostSlots::kRandom;
  } else if (slots == "fresh") {
    o.host_slots = HostSlots::kFresh;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "--host-slots: '", absl::GetFlag(FLAGS_host_slots), "' is not churned, random or fresh"));
  }
  return absl::OkStatus();
}

// The --quick smoke's choices; the flags it does not fix still apply.
void SetQuick(Options& o) {
  o.shapes = {{v1::MHA, v1::PAGE_FIRST}, {v1::MLA, v1::LAYER_FIRST}};
  o.page_sizes = {16};
  o.ttfl_page_sizes = {16};
  o.cache_page_sizes = {16};
  o.workers = {"gemm", "fma"};
  o.workers_from_quick = true;
  o.tokens = 256;
  o.layers = 4;
  o.repeats = 1;
  o.window_s = 0.05;
  o.duplex_s = 0.1;
  o.baseline_s = 0.1;
  o.churn_ops = 100;
  o.ceiling_bytes = uint64_t{256} << 20;
}

absl::Status CheckSizes(const Options& o) {
  if (o.tokens == 0 || o.layers == 0) {
    return absl::InvalidArgumentError("--tokens and --layers must be >= 1");
  }
  std::vector<uint32_t> all = o.page_sizes;
  all.insert(all.end(), o.ttfl_page_sizes.begin(), o.ttfl_page_sizes.end());
  all.insert(all.end(), o.cache_page_sizes.begin(), o.cache_page_sizes.end());
  all.push_back(kProbePageSize);
  for (uint32_t ps : all) {
    if (ps > o.tokens || o.tokens % ps != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--tokens ", o.tokens, " is not a multiple of page size ", ps,
                       ps == kProbePageSize ? " (the duplex case's page size)" : ""));
    }
  }
  if (o.repeats < 1) return absl::InvalidArgumentError("--repeats must be >= 1");
  if (!(o.slow_case_s > 0 && o.window_s > 0 && o.duplex_s > 0 && o.baseline_s > 0)) {
    return absl::InvalidArgumentError(
        "--slow-case-s, --window-s, --duplex-s and --baseline-s must be > 0");
  }
  if (o.gemm_n == 0 || o.gemm_n % 8 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--gemm-n ", o.gemm_n, " is not a positive multiple of 8"));
  }
  if (o.sm_blocks < 0) return absl::InvalidArgumentError("--sm-blocks must be >= 0");
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<uint64_t> ParseBytes(absl::string_view flag, absl::string_view text) {
  std::string digits(absl::StripAsciiWhitespace(text));
  uint64_t scale = 1;
  if (!digits.empty()) {
    const char last = absl::ascii_toupper(digits.back());
    const std::string units = "KMGT";
    if (const size_t u = units.find(last); u != std::string::npos) {
      scale = uint64_t{1} << (10 * (u + 1));
      digits.pop_back();
    }
  }
  uint64_t value = 0;
  if (!absl::SimpleAtoi(digits, &value) || value == 0 || value > UINT64_MAX / scale) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, ": '", text, "' is not a positive size like 1G or 268435456"));
  }
  return value * scale;
}

absl::StatusOr<Options> OptionsFromFlags() {
  Options o;
  o.kvhostd = absl::GetFlag(FLAGS_kvhostd);
  if (o.kvhostd.empty()) {
    const char* env = std::getenv("KVHOST_KVHOSTD");
    o.kvhostd = env != nullptr && *env != '\0' ? env : KVHOSTD_PATH;
  }
  o.quick = absl::GetFlag(FLAGS_quick);
  o.estimate_only = absl::GetFlag(FLAGS_estimate);
  o.json_out = absl::GetFlag(FLAGS_json_out);
  o.daemon_logs = absl::GetFlag(FLAGS_daemon_logs);
  o.daemon_flags = absl::GetFlag(FLAGS_daemon_flags);
  o.seed = absl::GetFlag(FLAGS_seed);
  o.staging_bytes = absl::GetFlag(FLAGS_staging_bytes);
  o.sm_blocks = absl::GetFlag(FLAGS_sm_blocks);
  o.cublas = absl::GetFlag(FLAGS_cublas);
  o.gemm_n = absl::GetFlag(FLAGS_gemm_n);
  o.slow_case_s = absl::GetFlag(FLAGS_slow_case_s);
  if (absl::Status s = ParseLists(o); !s.ok()) return s;
  if (o.quick) {
    SetQuick(o);
    if (absl::GetFlag(FLAGS_paths) == std::vector<std::string>({"auto", "ce", "staged"})) {
      o.paths = {"ce", "staged", "sm"};
    }
  } else {
    if (absl::Status s = ParseShapes(o); !s.ok()) return s;
    absl::StatusOr<std::vector<uint32_t>> sizes =
        U32List("page-sizes", absl::GetFlag(FLAGS_page_sizes));
    if (!sizes.ok()) return sizes.status();
    o.page_sizes = *sizes;
    absl::StatusOr<std::vector<uint32_t>> ttfl =
        U32List("ttfl-page-sizes", absl::GetFlag(FLAGS_ttfl_page_sizes));
    if (!ttfl.ok()) return ttfl.status();
    o.ttfl_page_sizes = *ttfl;
    if (absl::Status s = ParseCache(o); !s.ok()) return s;
    o.churn_ops = absl::GetFlag(FLAGS_churn_ops);
    o.tokens = absl::GetFlag(FLAGS_tokens);
    o.layers = absl::GetFlag(FLAGS_layers);
    o.repeats = absl::GetFlag(FLAGS_repeats);
    o.window_s = absl::GetFlag(FLAGS_window_s);
    o.duplex_s = absl::GetFlag(FLAGS_duplex_s);
    o.baseline_s = absl::GetFlag(FLAGS_baseline_s);
    absl::StatusOr<uint64_t> ceiling =
        ParseBytes("ceiling-bytes", absl::GetFlag(FLAGS_ceiling_bytes));
    if (!ceiling.ok()) return ceiling.status();
    o.ceiling_bytes = *ceiling;
  }
  // The MHA pools' KV heads (BenchPoolSpec, bench/bench_util.h).
  constexpr uint32_t kMhaHeads = 8;
  o.head_groups = absl::GetFlag(FLAGS_head_groups);
  if (o.head_groups == 0 || kMhaHeads % o.head_groups != 0) {
    return absl::InvalidArgumentError(absl::StrCat("--head-groups: ", o.head_groups,
                                                   " does not divide the MHA pools' ", kMhaHeads,
                                                   " KV heads (use 1, 2, 4 or 8)"));
  }
  if (absl::Status s = CheckSizes(o); !s.ok()) return s;
  return o;
}

std::vector<Case> MakeCases(const Options& o) {
  std::vector<Case> cases;
  for (const Shape& s : o.shapes) {
    for (uint32_t ps : o.page_sizes) cases.push_back({s.kind, s.layout, ps});
  }
  return cases;
}

v1::PoolSpec SpecFor(const Options& o, v1::PoolKind kind, v1::Layout layout, uint32_t page_size,
                     uint64_t need_tokens) {
  v1::PoolSpec spec = BenchPoolSpec(kind, layout, page_size, o.layers, need_tokens + o.tokens);
  if (kind == v1::MHA && layout == v1::PAGE_UNIFIED) spec.set_head_groups(o.head_groups);
  return spec;
}

uint64_t TransferBytes(const Options& o, v1::PoolKind kind) {
  // Bytes per token and layer: MHA K and V of 8 x 128 bf16, MLA 576 bf16.
  const uint64_t per_layer = kind == v1::MLA ? 1152 : 2 * 2048;
  return o.tokens * o.layers * per_layer;
}

double EstimateSeconds(const Options& o) {
  const double measures = static_cast<double>(o.workers.size() * o.duties.size());
  // Each cost window sits between two baselines of up to 0.2 s (MeasureCost).
  const double window = o.window_s + kLoopStartS + 2 * std::min(0.2, o.window_s);
  double s = kCeilingS + 2 * o.workers.size() * (o.baseline_s + kLoopStartS);
  double per_path = kDaemonStartS;
  for (const Case& c : MakeCases(o)) {
    const double t = static_cast<double>(TransferBytes(o, c.kind)) / (kAssumedGbps * 1e9);
    per_path += kCaseOverheadS + 2 * t + static_cast<double>(o.churn_ops) * kChurnRpcS;
    for (size_t d = 0; d < o.directions.size(); ++d) {
      per_path += o.repeats * t + measures * window;
    }
  }
  const double mha = static_cast<double>(TransferBytes(o, v1::MHA)) / (kAssumedGbps * 1e9);
  per_path += 3 * o.duplex_s + 4 * mha;                                // alone x 2, both; warm-ups
  per_path += o.ttfl_page_sizes.size() * (12 * mha + kCaseOverheadS);  // 1 + 10 loads, backup
  s += per_path * static_cast<double>(o.paths.size());
  // Node cache cases, first path: a store and a restore to check, per
  // direction the timed calls and the costs, two refills, the restores'
  // time to first layer.
  for (size_t i = 0; i < o.cache_page_sizes.size(); ++i) {
    s += kCaseOverheadS + 16 * mha;
    for (size_t d = 0; d < o.directions.size(); ++d) s += o.repeats * mha + measures * window;
  }
  std::vector<v1::PoolKind> kinds;
  for (const Shape& sh : o.shapes) {
    if (std::find(kinds.begin(), kinds.end(), sh.kind) == kinds.end()) kinds.push_back(sh.kind);
  }
  s += static_cast<double>(kinds.size() * o.anchor_quotas.size() * o.directions.size()) *
       (measures * window + 0.1);
  s += static_cast<double>(kinds.size()) * (kCaseOverheadS + 1.0);  // pinning the host buffer
  return s;
}

const char* HostSlotsName(HostSlots h) {
  switch (h) {
    case HostSlots::kChurned:
      return "churned";
    case HostSlots::kRandom:
      return "random";
    case HostSlots::kFresh:
      return "fresh";
  }
  return "?";
}

std::string KindName(v1::PoolKind kind) { return v1::PoolKind_Name(kind); }
std::string LayoutName(v1::Layout layout) { return v1::Layout_Name(layout); }
const char* DirName(bool backup) { return backup ? "backup" : "load"; }
std::string DutyName(double duty) { return absl::StrFormat("%g", duty); }

}  // namespace kvhost::bench
