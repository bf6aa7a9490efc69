// kvhost_cuda_transfer_bench: kvhostd's CUDA transfer paths on a real GPU,
// from the worker's side. This process IS the GPU worker, as in production:
// it owns the device KV buffers (cudaMalloc, several layers per allocation,
// random non-zero bytes), runs its own compute kernels on its own stream, and
// starts kvhostd (--backend=cuda, private socket and shm dir) once per
// transfer path (--transfer-path=auto|ce|staged|sm), attaching its buffers
// through CUDA IPC. In one run, in this order:
//
//  1. The ceiling: contiguous cudaMemcpyAsync between a pinned buffer and a
//     device buffer (--ceiling-bytes): D2H, H2D, and both at once on two
//     streams. Median of a few repeats.
//  2. The worker's compute alone: an FMA kernel filling every SM, ~5 ms per
//     launch, looped on the worker's stream by a separate thread; mean ms
//     per kernel over --baseline-s (measured again at the end, as a drift
//     check).
//  3. Per path x kind x host layout x page size x direction: a transfer of
//     --tokens slots (whole pages picked at random in a host pool of twice
//     that many, and device rows picked the same way in a device pool of
//     twice that many). First a backup then a load into other device rows,
//     after which every device row is checked (the loaded rows must hold
//     the source rows' bytes, every other row its own): no speed is reported
//     for wrong bytes. Those two transfers are the warm-ups. Then --repeats
//     timed transfers per direction (one when the warm-up took longer than
//     --slow-case-s): engine GB/s is bytes over the ticket's duration_us
//     (median), its ratio is to the ceiling of the same direction. Then the
//     worker's cost: the compute loop runs while the same transfer is issued
//     back to back for at least --window-s and one whole transfer; slowdown
//     = mean kernel time during / alone - 1.
//  4. Duplex (MHA, LAYER_FIRST, page 64, per path): a backup loop and a load
//     loop at once from two client threads on disjoint host slots and device
//     rows for --duplex-s; aggregate GB/s against each direction looped alone
//     and against the ceiling's both-at-once figure.
//  5. Time to first layer (same case, --layers layers): the worker records a
//     timed event on its stream, issues the Load RPC, records one when it
//     returns, waits on load event [set][0] and records, waits on
//     [set][L-1] and records; RPC, first-layer and total ms from the first
//     event (median of 10 loads). Target: first <= total / L + 0.1 ms.
//
// A ticket of a forced path must report that path ("cuda-ce", "cuda-staged",
// "cuda-sm"); for auto the path it chose is recorded. Progress goes to
// stderr, one line per case and direction; the results go to stdout as
// tables, and with --json-out to a file, rewritten after every case and
// marked incomplete until the run ends (so a run cut short or failed keeps
// what it measured). Exit codes: 0 done, 1 a CUDA call, an RPC or a byte
// check failed, 2 bad flags, 77 no usable GPU (skipped).
#include <cuda_runtime_api.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "bench/bench_util.h"
#include "bench/cuda_bench_kernels.h"
#include "common/cli_flags.h"
#include "common/cuda_util.h"
#include "kvhost/client.h"
#include "kvhost/cuda_export.h"
#include "tests/daemon_fixture.h"

ABSL_FLAG(std::string, kvhostd, "",
          "kvhostd binary to start (once per path); empty = $KVHOST_KVHOSTD if set (a bundle, "
          "as scripts/gpu_run.sh sets it), else this build's " KVHOSTD_PATH ".");
ABSL_FLAG(std::vector<std::string>, paths, std::vector<std::string>({"auto", "ce", "staged", "sm"}),
          "kvhostd --transfer-path values to measure, comma separated: auto, ce, staged, sm.");
ABSL_FLAG(std::vector<std::string>, kinds, std::vector<std::string>({"MHA", "MLA"}),
          "Pool kinds: MHA (8 KV heads x 128 dims bf16, K and V), MLA (576 dims bf16).");
ABSL_FLAG(std::vector<std::string>, layouts,
          std::vector<std::string>({"LAYER_FIRST", "PAGE_FIRST", "PAGE_FIRST_DIRECT", "PAGE_HEAD"}),
          "Host layouts, comma separated (PAGE_HEAD applies to MHA only).");
ABSL_FLAG(std::vector<std::string>, page_sizes, std::vector<std::string>({"1", "16", "64"}),
          "Page sizes, comma separated.");
ABSL_FLAG(std::vector<std::string>, directions, std::vector<std::string>({"backup", "load"}),
          "Directions to time: backup (device to host), load (host to device).");
ABSL_FLAG(uint64_t, tokens, 4096,
          "Token slots per transfer; a multiple of every page size and of 64.");
ABSL_FLAG(uint32_t, layers, 32, "Layers of the pools (and of the time-to-first-layer load).");
ABSL_FLAG(int, repeats, 3, "Timed transfers per case and direction, after the warm-up.");
ABSL_FLAG(double, slow_case_s, 1.5,
          "A case whose warm-up transfer took longer than this gets one timed transfer.");
ABSL_FLAG(double, window_s, 0.3,
          "Least time the worker's compute runs against back-to-back transfers per case.");
ABSL_FLAG(double, duplex_s, 0.5, "Seconds of each duplex loop (and of each direction alone).");
ABSL_FLAG(double, baseline_s, 1.0, "Seconds of the worker's compute loop alone.");
ABSL_FLAG(std::string, staging_bytes, "",
          "kvhostd --staging-bytes (e.g. 256M); empty = not passed (kvhostd's default).");
ABSL_FLAG(int, sm_blocks, 0, "kvhostd --sm-blocks; 0 = not passed (kvhostd's default).");
ABSL_FLAG(bool, load_gates, false, "Pass kvhostd --load-gates (loads return before queueing).");
ABSL_FLAG(std::string, ceiling_bytes, "1G",
          "Bytes of each contiguous ceiling copy (K/M/G suffixes are powers of 1024).");
ABSL_FLAG(uint64_t, seed, 1, "Seed of the random slot and row choice.");
ABSL_FLAG(bool, quick, false,
          "Smoke run (CI on a GPU, < 30 s): 256 tokens, 4 layers, page size 16, paths "
          "ce,staged,sm, MHA PAGE_FIRST and MLA LAYER_FIRST, one repeat, short windows.");
ABSL_FLAG(std::string, json_out, "", "Write the results as JSON to this file.");
ABSL_FLAG(std::string, daemon_logs, "",
          "Directory to keep each path's kvhostd log in (kvhostd-PATH.log: auto's path choices "
          "and their reasons); empty = not kept.");

namespace {

using Clock = std::chrono::steady_clock;
namespace bench = kvhost::bench;
namespace v1 = kvhost::v1;

constexpr int kSkipped = 77;  // ctest's SKIP_RETURN_CODE
constexpr int kDevice = 0;    // CUDA_VISIBLE_DEVICES picks the GPU
// A transfer that has not finished by then is a hang, not a slow path: the
// slowest case measured on an H200 (PAGE_HEAD through the copy engines,
// 256-byte pieces, 0.27 GB/s) moves a 4096-token, 32-layer MHA transfer
// (512 MiB) in 2 s.
constexpr absl::Duration kTransferTimeout = absl::Minutes(2);
// The worker's kernel: the DESIGN.md measurement ran 60 kernels in 325 ms.
constexpr double kComputeKernelMs = 5.0;
// Kernels that must complete inside a slowdown window before it may close,
// and how far past --window-s it may stretch to get them.
constexpr uint64_t kMinWindowKernels = 3;
constexpr double kMaxWindowStretchS = 5.0;
// Layer buffers per cudaMalloc allocation: a worker's buffers share
// allocations, so kvhostd opens one IPC handle for several layers.
constexpr uint32_t kLayersPerAllocation = 8;
// The duplex and time-to-first-layer case.
constexpr uint32_t kProbePageSize = 64;
// Time-to-first-layer target: one layer's share of the load plus this.
constexpr double kFirstLayerSlackMs = 0.1;
// Timed loads of the time-to-first-layer case (milliseconds each; the first
// layer's time varies by a few ms from load to load, so take a median of many).
constexpr int kFirstLayerSamples = 10;

const char* const kPathNames[] = {"auto", "ce", "staged", "sm"};

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
  std::vector<bool> directions;  // true = backup
  uint64_t tokens = 0;
  uint32_t layers = 0;
  int repeats = 0;
  double slow_case_s = 0;
  double window_s = 0;
  double duplex_s = 0;
  double baseline_s = 0;
  std::string staging_bytes;
  int sm_blocks = 0;
  bool load_gates = false;
  uint64_t ceiling_bytes = 0;
  uint64_t seed = 0;
  bool quick = false;
  std::string json_out;
  std::string daemon_logs;
};

// ---------------------------------------------------------------------------
// Flags.

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

std::vector<std::string> Upper(const std::vector<std::string>& items) {
  std::vector<std::string> out;
  for (const std::string& item : items) out.push_back(absl::AsciiStrToUpper(item));
  return out;
}

absl::StatusOr<Options> OptionsFromFlags() {
  Options o;
  o.kvhostd = absl::GetFlag(FLAGS_kvhostd);
  if (o.kvhostd.empty()) {
    const char* env = std::getenv("KVHOST_KVHOSTD");
    o.kvhostd = env != nullptr && *env != '\0' ? env : KVHOSTD_PATH;
  }
  o.quick = absl::GetFlag(FLAGS_quick);
  o.json_out = absl::GetFlag(FLAGS_json_out);
  o.daemon_logs = absl::GetFlag(FLAGS_daemon_logs);
  o.seed = absl::GetFlag(FLAGS_seed);
  o.staging_bytes = absl::GetFlag(FLAGS_staging_bytes);
  o.sm_blocks = absl::GetFlag(FLAGS_sm_blocks);
  o.load_gates = absl::GetFlag(FLAGS_load_gates);
  if (o.sm_blocks < 0) return absl::InvalidArgumentError("--sm-blocks must be >= 0");
  o.directions.clear();
  if (o.quick) {
    o.paths = {"ce", "staged", "sm"};
    o.shapes = {{v1::MHA, v1::PAGE_FIRST}, {v1::MLA, v1::LAYER_FIRST}};
    o.page_sizes = {16};
    o.directions = {true, false};
    o.tokens = 256;
    o.layers = 4;
    o.repeats = 1;
    o.slow_case_s = absl::GetFlag(FLAGS_slow_case_s);
    o.window_s = 0.1;
    o.duplex_s = 0.1;
    o.baseline_s = 0.2;
    o.ceiling_bytes = uint64_t{256} << 20;
    return o;
  }
  o.paths = absl::GetFlag(FLAGS_paths);
  if (o.paths.empty()) return absl::InvalidArgumentError("--paths is empty");
  for (const std::string& p : o.paths) {
    if (std::find(std::begin(kPathNames), std::end(kPathNames), p) == std::end(kPathNames)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--paths: '", p, "' is not one of auto, ce, staged, sm"));
    }
  }
  std::vector<v1::PoolKind> kinds;
  for (const std::string& k : Upper(absl::GetFlag(FLAGS_kinds))) {
    v1::PoolKind kind;
    if (!v1::PoolKind_Parse(k, &kind) || kind == v1::POOL_KIND_UNSPECIFIED) {
      return absl::InvalidArgumentError(absl::StrCat("--kinds: '", k, "' is not MHA or MLA"));
    }
    kinds.push_back(kind);
  }
  std::vector<v1::Layout> layouts;
  for (const std::string& l : Upper(absl::GetFlag(FLAGS_layouts))) {
    v1::Layout layout;
    if (!v1::Layout_Parse(l, &layout) || layout == v1::LAYOUT_UNSPECIFIED) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--layouts: '", l, "' is not LAYER_FIRST, PAGE_FIRST, PAGE_FIRST_DIRECT or PAGE_HEAD"));
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
  absl::StatusOr<std::vector<uint64_t>> sizes =
      bench::ParsePositiveList("page-sizes", absl::GetFlag(FLAGS_page_sizes));
  if (!sizes.ok()) return sizes.status();
  for (uint64_t ps : *sizes) o.page_sizes.push_back(static_cast<uint32_t>(ps));
  for (const std::string& d : absl::GetFlag(FLAGS_directions)) {
    const std::string dir = absl::AsciiStrToLower(d);
    if (dir != "backup" && dir != "load") {
      return absl::InvalidArgumentError(
          absl::StrCat("--directions: '", d, "' is not backup or load"));
    }
    o.directions.push_back(dir == "backup");
  }
  if (o.directions.empty()) return absl::InvalidArgumentError("--directions is empty");
  o.tokens = absl::GetFlag(FLAGS_tokens);
  o.layers = absl::GetFlag(FLAGS_layers);
  o.repeats = absl::GetFlag(FLAGS_repeats);
  o.slow_case_s = absl::GetFlag(FLAGS_slow_case_s);
  o.window_s = absl::GetFlag(FLAGS_window_s);
  o.duplex_s = absl::GetFlag(FLAGS_duplex_s);
  o.baseline_s = absl::GetFlag(FLAGS_baseline_s);
  absl::StatusOr<uint64_t> ceiling =
      ParseBytes("ceiling-bytes", absl::GetFlag(FLAGS_ceiling_bytes));
  if (!ceiling.ok()) return ceiling.status();
  o.ceiling_bytes = *ceiling;
  if (o.tokens == 0 || o.layers == 0) {
    return absl::InvalidArgumentError("--tokens and --layers must be >= 1");
  }
  for (uint32_t ps : o.page_sizes) {
    if (ps > o.tokens || o.tokens % ps != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--tokens ", o.tokens, " is not a multiple of page size ", ps));
    }
  }
  if (o.tokens % kProbePageSize != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--tokens ", o.tokens, " is not a multiple of ", kProbePageSize,
        " (the duplex and time-to-first-layer case uses page size ", kProbePageSize, ")"));
  }
  if (o.repeats < 1) return absl::InvalidArgumentError("--repeats must be >= 1");
  if (!(o.slow_case_s > 0 && o.window_s > 0 && o.duplex_s > 0 && o.baseline_s > 0)) {
    return absl::InvalidArgumentError(
        "--slow-case-s, --window-s, --duplex-s and --baseline-s must be > 0");
  }
  return o;
}

std::vector<Case> MakeCases(const Options& o) {
  std::vector<Case> cases;
  for (const Shape& s : o.shapes) {
    for (uint32_t ps : o.page_sizes) cases.push_back({s.kind, s.layout, ps});
  }
  return cases;
}

v1::PoolSpec SpecFor(const Options& o, v1::PoolKind kind, v1::Layout layout, uint32_t page_size) {
  // Twice the transfer, so that the random half it moves is fragmented.
  return bench::BenchPoolSpec(kind, layout, page_size, o.layers, 2 * o.tokens);
}

std::string KindName(v1::PoolKind kind) { return v1::PoolKind_Name(kind); }
std::string LayoutName(v1::Layout layout) { return v1::Layout_Name(layout); }
const char* DirName(bool backup) { return backup ? "backup" : "load"; }
double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// ---------------------------------------------------------------------------
// CUDA helpers.

absl::Status Cuda(cudaError_t e, absl::string_view what) {
  if (e == cudaSuccess) return absl::OkStatus();
  cudaGetLastError();  // clear a non-sticky error
  return absl::InternalError(absl::StrCat(what, ": ", kvhost::CudaError(e)));
}

absl::StatusOr<double> ElapsedMs(cudaEvent_t from, cudaEvent_t to) {
  float ms = 0;
  if (absl::Status s = Cuda(cudaEventElapsedTime(&ms, from, to), "cudaEventElapsedTime"); !s.ok()) {
    return s;
  }
  return static_cast<double>(ms);
}

// Timing events, destroyed with the object.
class Events {
 public:
  static absl::StatusOr<std::unique_ptr<Events>> Create(int n) {
    std::unique_ptr<Events> e(new Events());
    for (int i = 0; i < n; ++i) {
      cudaEvent_t ev = nullptr;
      if (absl::Status s = Cuda(cudaEventCreate(&ev), "cudaEventCreate"); !s.ok()) return s;
      e->events_.push_back(ev);
    }
    return e;
  }
  ~Events() {
    for (cudaEvent_t ev : events_) cudaEventDestroy(ev);
  }
  Events(const Events&) = delete;
  Events& operator=(const Events&) = delete;
  cudaEvent_t operator[](size_t i) const { return events_[i]; }

 private:
  Events() = default;
  std::vector<cudaEvent_t> events_;
};

// ---------------------------------------------------------------------------
// The worker's device KV pool of one kind.

// Per plane (K then V for MHA; the latent for MLA) and layer, `rows` rows of
// `row_bytes` in GPU memory; kLayersPerAllocation layer buffers per
// cudaMalloc allocation. Buffer b = plane * layers + layer holds KV words
// from b * rows * row_words on (cuda_bench_kernels.h), so every row of every
// buffer has its own bytes and Check knows what each row must hold.
class DeviceKv {
 public:
  static absl::StatusOr<std::unique_ptr<DeviceKv>> Create(uint32_t planes, uint32_t layers,
                                                          uint64_t rows, uint64_t row_bytes) {
    if (row_bytes % 8 != 0) {
      return absl::InvalidArgumentError(absl::StrCat("row of ", row_bytes, " bytes: not 8-byte"));
    }
    std::unique_ptr<DeviceKv> d(new DeviceKv(planes, layers, rows, row_bytes));
    const uint32_t buffers = planes * layers;
    for (uint32_t first = 0; first < buffers; first += kLayersPerAllocation) {
      const uint32_t n = std::min(kLayersPerAllocation, buffers - first);
      void* p = nullptr;
      if (absl::Status s = Cuda(cudaMalloc(&p, n * d->layer_bytes()),
                                absl::StrCat("cudaMalloc of ", n * d->layer_bytes(), " bytes"));
          !s.ok()) {
        return s;
      }
      d->allocations_.push_back(static_cast<uint8_t*>(p));
    }
    void* p = nullptr;
    if (absl::Status s = Cuda(cudaMalloc(&p, rows * sizeof(int64_t)), "cudaMalloc"); !s.ok()) {
      return s;
    }
    d->source_rows_ = static_cast<int64_t*>(p);
    if (absl::Status s =
            Cuda(cudaMalloc(&p, 2 * buffers * sizeof(unsigned long long)), "cudaMalloc");
        !s.ok()) {
      return s;
    }
    d->counters_ = static_cast<unsigned long long*>(p);
    return d;
  }
  ~DeviceKv() {
    for (uint8_t* p : allocations_) cudaFree(p);
    if (source_rows_ != nullptr) cudaFree(source_rows_);
    if (counters_ != nullptr) cudaFree(counters_);
  }
  DeviceKv(const DeviceKv&) = delete;
  DeviceKv& operator=(const DeviceKv&) = delete;

  uint64_t rows() const { return rows_; }
  uint64_t layer_bytes() const { return rows_ * row_bytes_; }
  uint64_t bytes() const { return uint64_t{planes_} * layers_ * layer_bytes(); }
  // The layer buffers of `plane`; empty for a plane the pool lacks (MLA V).
  std::vector<void*> layers(uint32_t plane) const {
    std::vector<void*> out;
    if (plane >= planes_) return out;
    for (uint32_t l = 0; l < layers_; ++l) out.push_back(buffer(plane * layers_ + l));
    return out;
  }

  // Every buffer gets seed's KV words; returns once they are on the device.
  absl::Status Fill(uint64_t seed, cudaStream_t stream) {
    for (uint32_t b = 0; b < planes_ * layers_; ++b) {
      if (absl::Status s =
              Cuda(bench::LaunchFillKv(buffer(b), layer_bytes(), seed, FirstWord(b), stream),
                   "fill kernel");
          !s.ok()) {
        return s;
      }
    }
    return Cuda(cudaStreamSynchronize(stream), "fill kernel");
  }

  // After Fill(seed) and transfers: row dst[i] of every buffer must hold
  // what row src[i] was filled with, every other row its own fill.
  // DATA_LOSS naming the first wrong buffer and row otherwise.
  absl::Status Check(uint64_t seed, const std::vector<int64_t>& dst,
                     const std::vector<int64_t>& src, cudaStream_t stream) {
    std::vector<int64_t> source(rows_, -1);
    for (size_t i = 0; i < dst.size(); ++i) source[static_cast<size_t>(dst[i])] = src[i];
    const uint32_t buffers = planes_ * layers_;
    std::vector<unsigned long long> counters(2 * buffers);
    for (uint32_t b = 0; b < buffers; ++b) {
      counters[2 * b] = 0;
      counters[2 * b + 1] = ~0ull;
    }
    absl::Status s = Cuda(
        cudaMemcpy(source_rows_, source.data(), rows_ * sizeof(int64_t), cudaMemcpyHostToDevice),
        "cudaMemcpy");
    if (s.ok()) {
      s = Cuda(cudaMemcpy(counters_, counters.data(), counters.size() * sizeof(counters[0]),
                          cudaMemcpyHostToDevice),
               "cudaMemcpy");
    }
    for (uint32_t b = 0; b < buffers && s.ok(); ++b) {
      s = Cuda(bench::LaunchCheckKv(buffer(b), rows_, row_bytes_, seed, FirstWord(b), source_rows_,
                                    counters_ + 2 * b, stream),
               "check kernel");
    }
    if (s.ok()) s = Cuda(cudaStreamSynchronize(stream), "check kernel");
    if (s.ok()) {
      s = Cuda(cudaMemcpy(counters.data(), counters_, counters.size() * sizeof(counters[0]),
                          cudaMemcpyDeviceToHost),
               "cudaMemcpy");
    }
    if (!s.ok()) return s;
    uint64_t wrong = 0;
    std::string first;
    for (uint32_t b = 0; b < buffers; ++b) {
      if (counters[2 * b] == 0) continue;
      wrong += counters[2 * b];
      if (first.empty()) {
        const uint64_t row = counters[2 * b + 1];
        const int64_t want = source[row] < 0 ? static_cast<int64_t>(row) : source[row];
        first = absl::StrCat("first in plane ", b / layers_, " layer ", b % layers_, " row ", row,
                             " (should hold ", source[row] < 0 ? "its own bytes" : "the bytes of ",
                             source[row] < 0 ? "" : absl::StrCat("row ", want), ")");
      }
    }
    if (wrong == 0) return absl::OkStatus();
    return absl::DataLossError(
        absl::StrCat(wrong, " wrong 8-byte words on the device after a backup of ", src.size(),
                     " rows and a load of them into other rows; ", first));
  }

 private:
  DeviceKv(uint32_t planes, uint32_t layers, uint64_t rows, uint64_t row_bytes)
      : planes_(planes), layers_(layers), rows_(rows), row_bytes_(row_bytes) {}
  uint8_t* buffer(uint32_t b) const {
    return allocations_[b / kLayersPerAllocation] + (b % kLayersPerAllocation) * layer_bytes();
  }
  uint64_t FirstWord(uint32_t b) const { return b * (layer_bytes() / 8); }

  const uint32_t planes_, layers_;
  const uint64_t rows_, row_bytes_;
  std::vector<uint8_t*> allocations_;
  int64_t* source_rows_ = nullptr;
  unsigned long long* counters_ = nullptr;
};

// ---------------------------------------------------------------------------
// The worker's compute.

struct ComputeKernel {
  bench::ComputeGrid grid;
  uint32_t iterations = 0;
  float* sink = nullptr;
};

// Launches the compute kernel back to back on the worker's stream from its
// own thread, two launches queued so the SMs never wait for the host, and
// times each launch with a pair of events (the start event fires when the
// previous kernel ends, so the pair spans one kernel). A window (Open /
// Close) selects the kernels that both started and finished inside it.
class ComputeLoop {
 public:
  ComputeLoop(const ComputeKernel& kernel, cudaStream_t stream)
      : kernel_(kernel), stream_(stream) {}
  ~ComputeLoop() {
    if (thread_.joinable()) (void)Stop();
  }
  ComputeLoop(const ComputeLoop&) = delete;
  ComputeLoop& operator=(const ComputeLoop&) = delete;

  void Start() {
    thread_ = std::thread([this] { Run(); });
  }
  // Blocks until `n` kernels have completed (or the loop failed).
  void WaitCompleted(uint64_t n) const {
    while (completed_.load() < n && !failed_.load()) std::this_thread::sleep_for(kPoll);
  }
  void OpenWindow() {
    in_window_.store(0);
    window_.fetch_add(1);  // odd: open
  }
  void CloseWindow() { window_.fetch_add(1); }
  // Kernels that completed inside the open window so far.
  uint64_t InWindow() const { return in_window_.load(); }

  // Stops, joins and returns the times (ms) of the last window's kernels:
  // those that started and ended inside it, or, should none have, those
  // launched inside it.
  absl::StatusOr<std::vector<double>> Stop() {
    stop_.store(true);
    thread_.join();
    if (!status_.ok()) return status_;
    const uint64_t last = window_.load() % 2 == 1 ? window_.load() : window_.load() - 1;
    std::vector<double> strict, launched;
    for (const Sample& s : samples_) {
      if (s.launch_window != last) continue;
      launched.push_back(s.ms);
      if (s.end_window == last) strict.push_back(s.ms);
    }
    return strict.empty() ? launched : strict;
  }

 private:
  static constexpr std::chrono::microseconds kPoll{200};
  struct Sample {
    uint64_t launch_window;
    uint64_t end_window;
    double ms;
  };

  void Run() {
    status_ = Loop();
    if (!status_.ok()) failed_.store(true);
  }

  absl::Status Loop() {
    if (absl::Status s = Cuda(cudaSetDevice(kDevice), "cudaSetDevice"); !s.ok()) return s;
    absl::StatusOr<std::unique_ptr<Events>> events = Events::Create(4);  // start, end x 2
    if (!events.ok()) return events.status();
    uint64_t launch_window[2] = {0, 0};
    uint64_t launched = 0, harvested = 0;
    auto harvest = [&]() -> absl::Status {
      const int k = static_cast<int>(harvested % 2);
      if (absl::Status s = Cuda(cudaEventSynchronize((**events)[2 * k + 1]), "compute kernel");
          !s.ok()) {
        return s;
      }
      const uint64_t now = window_.load();
      absl::StatusOr<double> ms = ElapsedMs((**events)[2 * k], (**events)[2 * k + 1]);
      if (!ms.ok()) return ms.status();
      samples_.push_back({launch_window[k], now, *ms});
      if (now % 2 == 1 && launch_window[k] == now) in_window_.fetch_add(1);
      completed_.fetch_add(1);
      ++harvested;
      return absl::OkStatus();
    };
    while (true) {
      if (launched - harvested == 2) {
        if (absl::Status s = harvest(); !s.ok()) return s;
      }
      if (stop_.load()) break;
      const int k = static_cast<int>(launched % 2);
      launch_window[k] = window_.load();
      absl::Status s = Cuda(cudaEventRecord((**events)[2 * k], stream_), "cudaEventRecord");
      if (s.ok()) {
        s = Cuda(bench::LaunchCompute(kernel_.grid, kernel_.iterations, kernel_.sink, stream_),
                 "compute kernel launch");
      }
      if (s.ok()) s = Cuda(cudaEventRecord((**events)[2 * k + 1], stream_), "cudaEventRecord");
      if (!s.ok()) return s;
      ++launched;
    }
    while (harvested < launched) {
      if (absl::Status s = harvest(); !s.ok()) return s;
    }
    return absl::OkStatus();
  }

  const ComputeKernel kernel_;
  const cudaStream_t stream_;
  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> failed_{false};
  std::atomic<uint64_t> window_{0};  // odd while a window is open
  std::atomic<uint64_t> in_window_{0};
  std::atomic<uint64_t> completed_{0};
  // Written by the thread, read after the join.
  std::vector<Sample> samples_;
  absl::Status status_;
};

// The worker process: its stream, its compute kernel and its KV pools.
class Worker {
 public:
  static absl::StatusOr<std::unique_ptr<Worker>> Create() {
    std::unique_ptr<Worker> w(new Worker());
    if (absl::Status s =
            Cuda(cudaStreamCreateWithFlags(&w->stream_, cudaStreamNonBlocking), "cudaStreamCreate");
        !s.ok()) {
      return s;
    }
    void* sink = nullptr;
    if (absl::Status s = Cuda(cudaMalloc(&sink, sizeof(float)), "cudaMalloc"); !s.ok()) return s;
    w->kernel_.sink = static_cast<float*>(sink);
    if (absl::Status s = Cuda(bench::ComputeGridFor(kDevice, &w->kernel_.grid), "occupancy");
        !s.ok()) {
      return s;
    }
    return w;
  }
  ~Worker() {
    mha_.reset();
    mla_.reset();
    if (stream_ != nullptr) {
      cudaStreamSynchronize(stream_);
      cudaStreamDestroy(stream_);
    }
    if (kernel_.sink != nullptr) cudaFree(kernel_.sink);
  }
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  cudaStream_t stream() const { return stream_; }
  const ComputeKernel& kernel() const { return kernel_; }

  // Sizes the kernel to about kComputeKernelMs per launch; returns the ms of
  // one launch as sized.
  absl::StatusOr<double> Calibrate() {
    kernel_.iterations = 4096;
    absl::StatusOr<double> ms = TimeKernel();
    if (!ms.ok()) return ms;
    const double scaled = kernel_.iterations * kComputeKernelMs / std::max(*ms, 1e-3);
    kernel_.iterations = static_cast<uint32_t>(std::clamp(scaled, 256.0, 1e9));
    return TimeKernel();
  }

  // The device pool of `kind` (2 x tokens rows), made on first use; its
  // bytes are set by Fill before every byte check.
  absl::StatusOr<DeviceKv*> Pool(const Options& o, v1::PoolKind kind) {
    std::unique_ptr<DeviceKv>& pool = kind == v1::MLA ? mla_ : mha_;
    if (pool == nullptr) {
      const v1::PoolSpec spec = SpecFor(o, kind, v1::LAYER_FIRST, 1);
      absl::StatusOr<std::unique_ptr<DeviceKv>> created = DeviceKv::Create(
          kind == v1::MLA ? 1 : 2, o.layers, 2 * o.tokens, kvhost::DeviceRowBytes(spec));
      if (!created.ok()) return created.status();
      pool = *std::move(created);
      if (absl::Status s = pool->Fill(0, stream_); !s.ok()) return s;
    }
    return pool.get();
  }

 private:
  Worker() = default;

  // Median ms of three launches after a warm-up.
  absl::StatusOr<double> TimeKernel() {
    absl::StatusOr<std::unique_ptr<Events>> ev = Events::Create(2);
    if (!ev.ok()) return ev.status();
    std::vector<double> ms;
    for (int run = 0; run < 4; ++run) {
      absl::Status s = Cuda(cudaEventRecord((**ev)[0], stream_), "cudaEventRecord");
      if (s.ok()) {
        s = Cuda(bench::LaunchCompute(kernel_.grid, kernel_.iterations, kernel_.sink, stream_),
                 "compute kernel");
      }
      if (s.ok()) s = Cuda(cudaEventRecord((**ev)[1], stream_), "cudaEventRecord");
      if (s.ok()) s = Cuda(cudaEventSynchronize((**ev)[1]), "compute kernel");
      if (!s.ok()) return s;
      absl::StatusOr<double> t = ElapsedMs((**ev)[0], (**ev)[1]);
      if (!t.ok()) return t;
      if (run > 0) ms.push_back(*t);
    }
    return bench::Median(ms);
  }

  cudaStream_t stream_ = nullptr;
  ComputeKernel kernel_;
  std::unique_ptr<DeviceKv> mha_, mla_;
};

struct ComputeTime {
  double ms = 0;         // mean per kernel
  uint64_t kernels = 0;  // kernels averaged
};

absl::StatusOr<ComputeTime> Mean(absl::StatusOr<std::vector<double>> samples) {
  if (!samples.ok()) return samples.status();
  ComputeTime t;
  t.kernels = samples->size();
  for (double ms : *samples) t.ms += ms;
  if (t.kernels > 0) t.ms /= static_cast<double>(t.kernels);
  return t;
}

// The compute loop alone for `seconds`.
absl::StatusOr<ComputeTime> MeasureComputeAlone(const Worker& w, double seconds) {
  ComputeLoop loop(w.kernel(), w.stream());
  loop.Start();
  loop.WaitCompleted(2);
  loop.OpenWindow();
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  loop.CloseWindow();
  absl::StatusOr<ComputeTime> t = Mean(loop.Stop());
  if (t.ok() && t->kernels == 0) {
    return absl::InternalError("the compute loop completed no kernel in its window");
  }
  return t;
}

// ---------------------------------------------------------------------------
// Transfers.

// The path whose daemon runs now.
struct PathRun {
  std::string path;         // --transfer-path
  std::string ticket_path;  // what its tickets must report; empty for auto
};

struct Done {
  double wall_s = 0;    // submit to WaitTransfer's return
  double engine_s = 0;  // the ticket's duration_us
  std::string path;     // the ticket's path
};

absl::StatusOr<Done> Transfer(kvhost::Client& client, const PathRun& run,
                              const std::string& attachment, bool backup,
                              const std::vector<int64_t>& host, const std::vector<int64_t>& rows,
                              uint64_t bytes) {
  const Clock::time_point start = Clock::now();
  absl::StatusOr<uint64_t> ticket =
      backup ? client.Backup(attachment, host, rows) : client.Load(attachment, host, rows);
  if (!ticket.ok()) return ticket.status();
  absl::StatusOr<v1::TransferStatus> st = client.WaitTransfer(*ticket, kTransferTimeout);
  if (!st.ok()) return st.status();
  Done d;
  d.wall_s = Seconds(Clock::now() - start);
  // duration_us has microsecond resolution; never divide by zero.
  d.engine_s = std::max<double>(st->duration_us(), 1) / 1e6;
  d.path = st->path();
  if (st->bytes() != bytes) {
    return absl::InternalError(absl::StrCat(DirName(backup), " ticket ", *ticket, " copied ",
                                            st->bytes(), " bytes, expected ", bytes));
  }
  if (!run.ticket_path.empty() && st->path() != run.ticket_path) {
    return absl::FailedPreconditionError(
        absl::StrCat("kvhostd --transfer-path=", run.path, " ran ", DirName(backup), " ticket ",
                     *ticket, " on path '", st->path(), "', not '", run.ticket_path, "'"));
  }
  return d;
}

// Pages 0 .. n-1 in random order.
std::vector<uint64_t> ShuffledPages(uint64_t n, std::mt19937_64& rng) {
  std::vector<uint64_t> pages(n);
  for (uint64_t p = 0; p < n; ++p) pages[p] = p;
  std::shuffle(pages.begin(), pages.end(), rng);
  return pages;
}

// The slots of pages[first, first + count).
std::vector<int64_t> PageSlots(const std::vector<uint64_t>& pages, uint64_t first, uint64_t count,
                               uint32_t page_size) {
  std::vector<int64_t> slots;
  slots.reserve(count * page_size);
  for (uint64_t i = first; i < first + count; ++i) {
    for (uint32_t j = 0; j < page_size; ++j) {
      slots.push_back(static_cast<int64_t>(pages[i] * page_size + j));
    }
  }
  return slots;
}

// Creates a pool, allocates all of it, attaches the worker's device pool,
// runs `body`, then detaches and deletes the pool whatever happened.
absl::Status WithAttachedPool(
    kvhost::Client& client, const std::string& name, const v1::PoolSpec& spec,
    const DeviceKv& device,
    const std::function<absl::Status(const v1::Pool&, const v1::Attachment&)>& body) {
  absl::StatusOr<v1::Pool> pool = client.CreatePool(name, spec);
  if (!pool.ok()) return pool.status();
  absl::Status result = [&]() -> absl::Status {
    absl::StatusOr<std::vector<int64_t>> all = client.Alloc(name, pool->size_tokens());
    if (!all.ok()) return all.status();
    absl::StatusOr<v1::AttachDeviceRequest> request =
        kvhost::MakeCudaAttachRequest(name, device.layers(0), device.layers(1), device.rows());
    if (!request.ok()) return request.status();
    absl::StatusOr<v1::Attachment> attachment = client.AttachDevice(*request);
    if (!attachment.ok()) return attachment.status();
    absl::Status s = body(*pool, *attachment);
    absl::Status detached = client.DetachDevice(attachment->id());
    return s.ok() ? detached : s;
  }();
  absl::Status deleted = client.DeletePool(name).status();
  return result.ok() ? deleted : result;
}

// ---------------------------------------------------------------------------
// Results.

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

struct CaseResult {
  std::string path;
  Case c;
  bool backup = true;
  uint64_t bytes = 0;
  double warmup_s = 0;
  int timed = 0;
  double engine_gbps = 0, client_gbps = 0, vs_ceiling = 0;
  std::string ticket_path;
  // The worker's cost.
  double window_s = 0;
  uint64_t window_transfers = 0;
  uint64_t window_kernels = 0;
  double compute_ms = 0;
  double slowdown_pct = 0;
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
  uint32_t layers = 0;
  uint64_t bytes = 0;
  // From the event recorded before the Load RPC: the RPC's return, layer 0
  // usable, the last layer usable.
  std::vector<double> rpc_ms, first_ms, total_ms;
  double rpc_median_ms = 0, first_median_ms = 0, total_median_ms = 0, target_ms = 0;
  bool met = false;
  // The daemon's view, from the ticket (TransferStatus): acceptance to the
  // first layer done, to the last, and to the end of queueing.
  std::vector<double> daemon_first_ms, daemon_total_ms, enqueue_ms;
  double daemon_first_median_ms = 0, daemon_total_median_ms = 0, enqueue_median_ms = 0,
         daemon_target_ms = 0;
  bool daemon_met = false;
  std::string ticket_path;
};

struct Results {
  GpuInfo gpu;
  CeilingResult ceiling;
  ComputeKernel kernel;
  ComputeTime alone, alone_end;
  std::vector<CaseResult> cases;
  std::vector<DuplexResult> duplex;
  std::vector<TtflResult> ttfl;
  std::vector<std::string> paths_done;
  bool mps = false;      // an MPS control pipe was found
  double elapsed_s = 0;  // of the whole run
};

// One progress line per case and direction, on stderr, with the seconds
// since the start; after each case the --json-out snapshot is rewritten.
struct Progress {
  int done = 0;
  int total = 0;
  Clock::time_point start = Clock::now();
  std::function<void()> snapshot = [] {};
  double elapsed_s() const { return Seconds(Clock::now() - start); }
};

// ---------------------------------------------------------------------------
// 1. The ceiling.

absl::StatusOr<CeilingResult> MeasureCeiling(const Options& o) {
  struct Buffers {
    void* host[2] = {nullptr, nullptr};
    void* dev[2] = {nullptr, nullptr};
    cudaStream_t stream[2] = {nullptr, nullptr};
    ~Buffers() {
      for (int i = 0; i < 2; ++i) {
        if (stream[i] != nullptr) {
          cudaStreamSynchronize(stream[i]);
          cudaStreamDestroy(stream[i]);
        }
        if (host[i] != nullptr) cudaFreeHost(host[i]);
        if (dev[i] != nullptr) cudaFree(dev[i]);
      }
    }
  } b;
  const uint64_t bytes = o.ceiling_bytes;
  for (int i = 0; i < 2; ++i) {
    absl::Status s = Cuda(cudaMallocHost(&b.host[i], bytes),
                          absl::StrCat("cudaMallocHost of ", bytes, " bytes"));
    if (s.ok())
      s = Cuda(cudaMalloc(&b.dev[i], bytes), absl::StrCat("cudaMalloc of ", bytes, " bytes"));
    if (s.ok())
      s = Cuda(cudaStreamCreateWithFlags(&b.stream[i], cudaStreamNonBlocking), "cudaStreamCreate");
    if (s.ok()) s = Cuda(cudaMemset(b.dev[i], 0x5a, bytes), "cudaMemset");
    if (!s.ok()) return s;
    std::memset(b.host[i], 0xa5, bytes);
  }
  absl::StatusOr<std::unique_ptr<Events>> ev = Events::Create(3);
  if (!ev.ok()) return ev.status();
  // Copies D2H on stream 0 and / or H2D on stream 1, both released by one
  // event; returns each copy's ms from that event.
  auto copy = [&](bool d2h, bool h2d) -> absl::StatusOr<std::pair<double, double>> {
    absl::Status s = Cuda(cudaEventRecord((**ev)[0], b.stream[0]), "cudaEventRecord");
    if (s.ok()) s = Cuda(cudaStreamWaitEvent(b.stream[1], (**ev)[0], 0), "cudaStreamWaitEvent");
    if (s.ok() && d2h) {
      s = Cuda(cudaMemcpyAsync(b.host[0], b.dev[0], bytes, cudaMemcpyDeviceToHost, b.stream[0]),
               "cudaMemcpyAsync D2H");
    }
    if (s.ok() && h2d) {
      s = Cuda(cudaMemcpyAsync(b.dev[1], b.host[1], bytes, cudaMemcpyHostToDevice, b.stream[1]),
               "cudaMemcpyAsync H2D");
    }
    if (s.ok()) s = Cuda(cudaEventRecord((**ev)[1], b.stream[0]), "cudaEventRecord");
    if (s.ok()) s = Cuda(cudaEventRecord((**ev)[2], b.stream[1]), "cudaEventRecord");
    if (s.ok()) s = Cuda(cudaEventSynchronize((**ev)[1]), "ceiling copy");
    if (s.ok()) s = Cuda(cudaEventSynchronize((**ev)[2]), "ceiling copy");
    if (!s.ok()) return s;
    absl::StatusOr<double> t0 = ElapsedMs((**ev)[0], (**ev)[1]);
    if (!t0.ok()) return t0.status();
    absl::StatusOr<double> t1 = ElapsedMs((**ev)[0], (**ev)[2]);
    if (!t1.ok()) return t1.status();
    return std::make_pair(*t0, *t1);
  };
  CeilingResult c;
  c.bytes = bytes;
  c.runs = std::max(o.repeats, 5);
  const double gb = static_cast<double>(bytes) / 1e9;
  std::vector<double> d2h, h2d, both, both_d2h, both_h2d;
  for (int run = 0; run <= c.runs; ++run) {  // run 0 warms up
    absl::StatusOr<std::pair<double, double>> a = copy(true, false);
    if (!a.ok()) return a.status();
    absl::StatusOr<std::pair<double, double>> l = copy(false, true);
    if (!l.ok()) return l.status();
    absl::StatusOr<std::pair<double, double>> x = copy(true, true);
    if (!x.ok()) return x.status();
    if (run == 0) continue;
    d2h.push_back(gb / (a->first / 1e3));
    h2d.push_back(gb / (l->second / 1e3));
    both.push_back(2 * gb / (std::max(x->first, x->second) / 1e3));
    both_d2h.push_back(gb / (x->first / 1e3));
    both_h2d.push_back(gb / (x->second / 1e3));
  }
  c.d2h_gbps = bench::Median(d2h);
  c.h2d_gbps = bench::Median(h2d);
  c.duplex_gbps = bench::Median(both);
  c.duplex_d2h_gbps = bench::Median(both_d2h);
  c.duplex_h2d_gbps = bench::Median(both_h2d);
  return c;
}

// ---------------------------------------------------------------------------
// 3. One case: byte check, timed transfers, the worker's cost.

struct Impact {
  double window_s = 0;
  uint64_t transfers = 0;
  ComputeTime compute;
};

// Runs `transfer` back to back while the compute loop runs, for at least
// `min_s` and one whole transfer, and until kMinWindowKernels kernels
// finished inside the window (or kMaxWindowStretchS more passed).
absl::StatusOr<Impact> MeasureImpact(const Worker& w, double min_s,
                                     const std::function<absl::Status()>& transfer) {
  ComputeLoop loop(w.kernel(), w.stream());
  loop.Start();
  loop.WaitCompleted(2);
  loop.OpenWindow();
  Impact impact;
  const Clock::time_point start = Clock::now();
  absl::Status s;
  while (true) {
    const double elapsed = Seconds(Clock::now() - start);
    if (impact.transfers > 0 && elapsed >= min_s &&
        (loop.InWindow() >= kMinWindowKernels || elapsed >= min_s + kMaxWindowStretchS)) {
      break;
    }
    s = transfer();
    if (!s.ok()) break;
    ++impact.transfers;
  }
  impact.window_s = Seconds(Clock::now() - start);
  loop.CloseWindow();
  absl::StatusOr<ComputeTime> t = Mean(loop.Stop());
  if (!s.ok()) return s;
  if (!t.ok()) return t.status();
  impact.compute = *t;
  return impact;
}

absl::Status RunCase(const Options& o, const PathRun& run, const Case& c, kvhost::Client& client,
                     Worker& w, std::mt19937_64& rng, uint64_t& fill_seed, Results& results,
                     Progress& progress) {
  absl::StatusOr<DeviceKv*> device = w.Pool(o, c.kind);
  if (!device.ok()) return device.status();
  DeviceKv& dev = **device;
  const std::string name =
      absl::StrCat("bench-", KindName(c.kind), "-", LayoutName(c.layout), "-ps", c.page_size);
  const std::string what =
      absl::StrCat(run.path, " ", KindName(c.kind), " ", LayoutName(c.layout), " ps", c.page_size);
  auto body = [&](const v1::Pool& pool, const v1::Attachment& att) -> absl::Status {
    const uint64_t pages = o.tokens / c.page_size;
    const std::vector<int64_t> host =
        PageSlots(ShuffledPages(pool.page_num(), rng), 0, pages, c.page_size);
    const std::vector<uint64_t> device_pages = ShuffledPages(dev.rows() / c.page_size, rng);
    const std::vector<int64_t> rows = PageSlots(device_pages, 0, pages, c.page_size);
    const std::vector<int64_t> other = PageSlots(device_pages, pages, pages, c.page_size);
    const uint64_t bytes = o.tokens * pool.bytes_per_token();

    // The byte check; its backup and load are the warm-ups.
    const uint64_t seed = ++fill_seed;
    if (absl::Status s = dev.Fill(seed, w.stream()); !s.ok()) return s;
    absl::StatusOr<Done> warm_backup = Transfer(client, run, att.id(), true, host, rows, bytes);
    if (!warm_backup.ok()) return warm_backup.status();
    absl::StatusOr<Done> warm_load = Transfer(client, run, att.id(), false, host, other, bytes);
    if (!warm_load.ok()) return warm_load.status();
    if (absl::Status s = dev.Check(seed, other, rows, w.stream()); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat(what, " (tickets on ", warm_backup->path, " / ",
                                                 warm_load->path, "): ", s.message()));
    }

    for (bool backup : o.directions) {
      const Done& warm = backup ? *warm_backup : *warm_load;
      CaseResult r;
      r.path = run.path;
      r.c = c;
      r.backup = backup;
      r.bytes = bytes;
      r.warmup_s = warm.wall_s;
      r.timed = warm.wall_s > o.slow_case_s ? 1 : o.repeats;
      std::vector<double> engine_s, client_s;
      std::string path = warm.path;
      for (int i = 0; i < r.timed; ++i) {
        absl::StatusOr<Done> d = Transfer(client, run, att.id(), backup, host, rows, bytes);
        if (!d.ok()) return d.status();
        engine_s.push_back(d->engine_s);
        client_s.push_back(d->wall_s);
        if (d->path != path) path = absl::StrCat(path, "+", d->path);  // auto changed its mind
      }
      r.ticket_path = path;
      const double gb = static_cast<double>(bytes) / 1e9;
      r.engine_gbps = gb / bench::Median(engine_s);
      r.client_gbps = gb / bench::Median(client_s);
      r.vs_ceiling = r.engine_gbps / (backup ? results.ceiling.d2h_gbps : results.ceiling.h2d_gbps);

      absl::StatusOr<Impact> impact = MeasureImpact(w, o.window_s, [&]() -> absl::Status {
        return Transfer(client, run, att.id(), backup, host, rows, bytes).status();
      });
      if (!impact.ok()) return impact.status();
      r.window_s = impact->window_s;
      r.window_transfers = impact->transfers;
      r.window_kernels = impact->compute.kernels;
      r.compute_ms = impact->compute.ms;
      r.slowdown_pct = (impact->compute.ms / results.alone.ms - 1) * 100;
      results.cases.push_back(r);
      ++progress.done;
      absl::FPrintF(
          stderr, "[%d/%d %.0fs] %s %s: %.1f GB/s (%.2f), worker %+.1f%%%s%s\n", progress.done,
          progress.total, progress.elapsed_s(), what, DirName(backup), r.engine_gbps, r.vs_ceiling,
          r.slowdown_pct, run.ticket_path.empty() ? absl::StrCat(" [", path, "]") : "",
          r.timed < o.repeats ? absl::StrFormat(" (slow: warm-up %.2f s, 1 timed)", r.warmup_s)
                              : "");
    }
    return absl::OkStatus();
  };
  absl::Status s =
      WithAttachedPool(client, name, SpecFor(o, c.kind, c.layout, c.page_size), dev, body);
  if (!s.ok() && !absl::StartsWith(s.message(), what)) {
    return absl::Status(s.code(), absl::StrCat(what, ": ", s.message()));
  }
  return s;
}

// ---------------------------------------------------------------------------
// 4. Duplex.

struct LoopResult {
  uint64_t transfers = 0;
  double seconds = 0;
  std::string path;
  absl::Status status;
};

// One direction back to back from `start` until `seconds` passed (at least
// one transfer).
LoopResult TransferLoop(kvhost::Client& client, const PathRun& run, const std::string& attachment,
                        bool backup, const std::vector<int64_t>& host,
                        const std::vector<int64_t>& rows, uint64_t bytes, Clock::time_point start,
                        double seconds) {
  LoopResult r;
  while (r.transfers == 0 || Seconds(Clock::now() - start) < seconds) {
    absl::StatusOr<Done> d = Transfer(client, run, attachment, backup, host, rows, bytes);
    if (!d.ok()) {
      r.status = d.status();
      return r;
    }
    if (r.path.empty()) r.path = d->path;
    ++r.transfers;
  }
  r.seconds = Seconds(Clock::now() - start);
  return r;
}

absl::Status RunDuplex(const Options& o, const PathRun& run, kvhost::Client& client, Worker& w,
                       std::mt19937_64& rng, Results& results) {
  absl::StatusOr<DeviceKv*> device = w.Pool(o, v1::MHA);
  if (!device.ok()) return device.status();
  DuplexResult r;
  r.path = run.path;
  auto body = [&](const v1::Pool& pool, const v1::Attachment& att) -> absl::Status {
    const uint64_t pages = o.tokens / kProbePageSize;
    const std::vector<uint64_t> host_pages = ShuffledPages(pool.page_num(), rng);
    const std::vector<uint64_t> device_pages =
        ShuffledPages((*device)->rows() / kProbePageSize, rng);
    // Backups: host half A <- device half A; loads: host half B -> device half B.
    const std::vector<int64_t> host_a = PageSlots(host_pages, 0, pages, kProbePageSize);
    const std::vector<int64_t> host_b = PageSlots(host_pages, pages, pages, kProbePageSize);
    const std::vector<int64_t> rows_a = PageSlots(device_pages, 0, pages, kProbePageSize);
    const std::vector<int64_t> rows_b = PageSlots(device_pages, pages, pages, kProbePageSize);
    r.bytes = o.tokens * pool.bytes_per_token();
    // Warm-ups; the first gives host half B the bytes of device half B, so
    // the loads move real data.
    for (int i = 0; i < 3; ++i) {
      const bool backup = i < 2;
      const bool a = i == 1;
      absl::StatusOr<Done> d = Transfer(client, run, att.id(), backup, a ? host_a : host_b,
                                        a ? rows_a : rows_b, r.bytes);
      if (!d.ok()) return d.status();
    }
    const double gb = static_cast<double>(r.bytes) / 1e9;
    for (bool backup : {true, false}) {
      LoopResult alone = TransferLoop(client, run, att.id(), backup, backup ? host_a : host_b,
                                      backup ? rows_a : rows_b, r.bytes, Clock::now(), o.duplex_s);
      if (!alone.status.ok()) return alone.status;
      (backup ? r.backup_alone_gbps : r.load_alone_gbps) = alone.transfers * gb / alone.seconds;
    }
    const Clock::time_point start = Clock::now();
    LoopResult backups, loads;
    std::thread backup_thread([&] {
      backups =
          TransferLoop(client, run, att.id(), true, host_a, rows_a, r.bytes, start, o.duplex_s);
    });
    loads = TransferLoop(client, run, att.id(), false, host_b, rows_b, r.bytes, start, o.duplex_s);
    backup_thread.join();
    if (!backups.status.ok()) return backups.status;
    if (!loads.status.ok()) return loads.status;
    r.backups = backups.transfers;
    r.loads = loads.transfers;
    r.seconds = std::max(backups.seconds, loads.seconds);
    r.backup_gbps = backups.transfers * gb / backups.seconds;
    r.load_gbps = loads.transfers * gb / loads.seconds;
    r.aggregate_gbps = (backups.transfers + loads.transfers) * gb / r.seconds;
    r.vs_one_direction = r.aggregate_gbps / std::max(r.backup_alone_gbps, r.load_alone_gbps);
    r.vs_ceiling = r.aggregate_gbps / results.ceiling.duplex_gbps;
    r.backup_path = backups.path;
    r.load_path = loads.path;
    return absl::OkStatus();
  };
  absl::Status s = WithAttachedPool(
      client, "bench-duplex", SpecFor(o, v1::MHA, v1::LAYER_FIRST, kProbePageSize), **device, body);
  if (!s.ok()) return absl::Status(s.code(), absl::StrCat(run.path, " duplex: ", s.message()));
  results.duplex.push_back(r);
  absl::FPrintF(stderr,
                "duplex %s MHA LAYER_FIRST ps%d: %.1f GB/s (backup %.1f + load %.1f); alone %.1f "
                "/ %.1f; %.2fx one direction, %.2f of the duplex ceiling\n",
                run.path, kProbePageSize, r.aggregate_gbps, r.backup_gbps, r.load_gbps,
                r.backup_alone_gbps, r.load_alone_gbps, r.vs_one_direction, r.vs_ceiling);
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// 5. Time to first layer.

absl::Status RunTtfl(const Options& o, const PathRun& run, kvhost::Client& client, Worker& w,
                     std::mt19937_64& rng, Results& results) {
  absl::StatusOr<DeviceKv*> device = w.Pool(o, v1::MHA);
  if (!device.ok()) return device.status();
  TtflResult r;
  r.path = run.path;
  r.layers = o.layers;
  auto body = [&](const v1::Pool& pool, const v1::Attachment& att) -> absl::Status {
    const uint64_t pages = o.tokens / kProbePageSize;
    const std::vector<int64_t> host =
        PageSlots(ShuffledPages(pool.page_num(), rng), 0, pages, kProbePageSize);
    const std::vector<int64_t> rows =
        PageSlots(ShuffledPages((*device)->rows() / kProbePageSize, rng), 0, pages, kProbePageSize);
    r.bytes = o.tokens * pool.bytes_per_token();
    absl::StatusOr<Done> backup = Transfer(client, run, att.id(), true, host, rows, r.bytes);
    if (!backup.ok()) return backup.status();
    absl::StatusOr<std::unique_ptr<kvhost::LoadEvents>> load_events = kvhost::LoadEvents::Open(att);
    if (!load_events.ok()) return load_events.status();
    // start, RPC returned, first layer, last layer
    absl::StatusOr<std::unique_ptr<Events>> ev = Events::Create(4);
    if (!ev.ok()) return ev.status();
    const cudaStream_t stream = w.stream();
    const int runs = 1 + kFirstLayerSamples;  // the first warms up
    for (int i = 0; i < runs; ++i) {
      // The start is recorded before the RPC: its time counts.
      if (absl::Status s = Cuda(cudaEventRecord((**ev)[0], stream), "cudaEventRecord"); !s.ok()) {
        return s;
      }
      absl::StatusOr<kvhost::LoadTicket> load = client.LoadWithEvents(att.id(), host, rows);
      if (!load.ok()) return load.status();
      if (load->event_set < 0) {
        return absl::FailedPreconditionError(
            absl::StrCat("load ticket ", load->ticket_id, " names no load event set"));
      }
      // The stream is idle, so this one marks when the RPC returned: a first
      // layer later than that waited for copies, not for the RPC.
      absl::Status s = Cuda(cudaEventRecord((**ev)[1], stream), "cudaEventRecord");
      if (s.ok()) s = (*load_events)->WaitLayer(load->event_set, 0, stream);
      if (s.ok()) s = Cuda(cudaEventRecord((**ev)[2], stream), "cudaEventRecord");
      if (s.ok()) s = (*load_events)->WaitLayer(load->event_set, o.layers - 1, stream);
      if (s.ok()) s = Cuda(cudaEventRecord((**ev)[3], stream), "cudaEventRecord");
      if (s.ok()) s = Cuda(cudaEventSynchronize((**ev)[3]), "waiting on the load events");
      absl::StatusOr<v1::TransferStatus> st =
          client.WaitTransfer(load->ticket_id, kTransferTimeout);
      if (!s.ok()) return s;
      if (!st.ok()) return st.status();
      if (!run.ticket_path.empty() && st->path() != run.ticket_path) {
        return absl::FailedPreconditionError(
            absl::StrCat("kvhostd --transfer-path=", run.path, " ran load ticket ", load->ticket_id,
                         " on path '", st->path(), "', not '", run.ticket_path, "'"));
      }
      r.ticket_path = st->path();
      absl::StatusOr<double> rpc = ElapsedMs((**ev)[0], (**ev)[1]);
      if (!rpc.ok()) return rpc.status();
      absl::StatusOr<double> first = ElapsedMs((**ev)[0], (**ev)[2]);
      if (!first.ok()) return first.status();
      absl::StatusOr<double> total = ElapsedMs((**ev)[0], (**ev)[3]);
      if (!total.ok()) return total.status();
      if (i == 0) continue;
      r.rpc_ms.push_back(*rpc);
      r.first_ms.push_back(*first);
      r.total_ms.push_back(*total);
      r.daemon_first_ms.push_back(st->first_layer_us() / 1e3);
      r.daemon_total_ms.push_back(st->duration_us() / 1e3);
      r.enqueue_ms.push_back(st->enqueue_us() / 1e3);
    }
    return absl::OkStatus();
  };
  absl::Status s = WithAttachedPool(
      client, "bench-ttfl", SpecFor(o, v1::MHA, v1::LAYER_FIRST, kProbePageSize), **device, body);
  if (!s.ok()) {
    return absl::Status(s.code(), absl::StrCat(run.path, " time to first layer: ", s.message()));
  }
  r.rpc_median_ms = bench::Median(r.rpc_ms);
  r.first_median_ms = bench::Median(r.first_ms);
  r.total_median_ms = bench::Median(r.total_ms);
  r.target_ms = r.total_median_ms / r.layers + kFirstLayerSlackMs;
  r.met = r.first_median_ms <= r.target_ms;
  r.daemon_first_median_ms = bench::Median(r.daemon_first_ms);
  r.daemon_total_median_ms = bench::Median(r.daemon_total_ms);
  r.enqueue_median_ms = bench::Median(r.enqueue_ms);
  r.daemon_target_ms = r.daemon_total_median_ms / r.layers + kFirstLayerSlackMs;
  r.daemon_met = r.daemon_first_median_ms <= r.daemon_target_ms;
  results.ttfl.push_back(r);
  absl::FPrintF(stderr,
                "ttfl %s MHA LAYER_FIRST ps%d, %d layers: RPC back at %.3f ms, first layer %.3f "
                "ms, all %.3f ms, target %.3f ms: %s; daemon side: first %.3f ms, all %.3f "
                "ms, target %.3f ms: %s (queued in %.3f ms)\n",
                run.path, kProbePageSize, r.layers, r.rpc_median_ms, r.first_median_ms,
                r.total_median_ms, r.target_ms, r.met ? "met" : "missed", r.daemon_first_median_ms,
                r.daemon_total_median_ms, r.daemon_target_ms, r.daemon_met ? "met" : "missed",
                r.enqueue_median_ms);
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// One kvhostd per path.

// Whether an MPS control daemon is running, found as kvhostd finds it: its
// pipe in $CUDA_MPS_PIPE_DIRECTORY or /tmp/nvidia-mps. Without MPS the
// worker and kvhostd time-slice the SMs, so kernel paths cost the worker most.
bool MpsPipeFound() {
  const char* env = std::getenv("CUDA_MPS_PIPE_DIRECTORY");
  const std::string dir = env != nullptr && *env != '\0' ? env : "/tmp/nvidia-mps";
  return ::access((dir + "/control").c_str(), F_OK) == 0;
}

std::string LogTail(const kvhost::testing::TestDaemon& daemon) {
  constexpr size_t kTail = 6000;
  std::string log = daemon.Log();
  if (log.size() > kTail) log = "..." + log.substr(log.size() - kTail);
  return log;
}

absl::Status RunPath(const Options& o, const std::string& path, Worker& w, std::mt19937_64& rng,
                     uint64_t& fill_seed, Results& results, Progress& progress) {
  std::vector<std::string> flags = {"--backend=cuda", "--log-level=info",
                                    absl::StrCat("--transfer-path=", path)};
  if (!o.staging_bytes.empty()) flags.push_back(absl::StrCat("--staging-bytes=", o.staging_bytes));
  if (o.sm_blocks > 0) flags.push_back(absl::StrCat("--sm-blocks=", o.sm_blocks));
  if (o.load_gates) flags.push_back("--load-gates");
  absl::StatusOr<std::unique_ptr<kvhost::testing::TestDaemon>> daemon =
      kvhost::testing::TestDaemon::Start(o.kvhostd, flags);
  if (!daemon.ok()) {
    return absl::Status(daemon.status().code(),
                        absl::StrCat("starting ", o.kvhostd, " ", absl::StrJoin(flags, " "), ": ",
                                     daemon.status().message()));
  }
  kvhost::Client& client = (*daemon)->client();
  const PathRun run{path, path == "auto" ? "" : absl::StrCat("cuda-", path)};
  absl::Status s = [&]() -> absl::Status {
    absl::StatusOr<v1::DaemonStatus> status = client.GetStatus();
    if (!status.ok()) return status.status();
    if (status->backend() != "cuda") {
      return absl::FailedPreconditionError(absl::StrCat("kvhostd runs backend '", status->backend(),
                                                        "', not cuda: ", status->backend_detail()));
    }
    for (const Case& c : MakeCases(o)) {
      if (absl::Status s = RunCase(o, run, c, client, w, rng, fill_seed, results, progress);
          !s.ok()) {
        return s;
      }
      progress.snapshot();
    }
    if (absl::Status s = RunDuplex(o, run, client, w, rng, results); !s.ok()) return s;
    progress.snapshot();
    return RunTtfl(o, run, client, w, rng, results);
  }();
  if (!o.daemon_logs.empty()) {
    const std::string file = absl::StrCat(o.daemon_logs, "/kvhostd-", path, ".log");
    if (absl::Status w = bench::WriteFile(file, (*daemon)->Log()); !w.ok()) {
      absl::FPrintF(stderr, "warning: %s\n", w.message());
    }
  }
  if (!s.ok()) {
    return absl::Status(s.code(), absl::StrCat(s.message(), "\n--- kvhostd --transfer-path=", path,
                                               " log (tail) ---\n", LogTail(**daemon)));
  }
  const int code = (*daemon)->Stop();
  if (code != 0) {
    return absl::InternalError(absl::StrCat("kvhostd --transfer-path=", path, " exited with ", code,
                                            " on SIGTERM\n--- kvhostd log (tail) ---\n",
                                            LogTail(**daemon)));
  }
  results.paths_done.push_back(path);
  return absl::OkStatus();
}

std::string Json(const Options& o, const Results& r, const absl::Status& status);

absl::Status Measure(const Options& o, Results& results) {
  Progress progress;
  if (absl::Status s = Cuda(cudaSetDevice(kDevice), "cudaSetDevice"); !s.ok()) return s;
  cudaDeviceProp prop;
  if (absl::Status s = Cuda(cudaGetDeviceProperties(&prop, kDevice), "cudaGetDeviceProperties");
      !s.ok()) {
    return s;
  }
  GpuInfo& gpu = results.gpu;
  gpu.name = prop.name;
  gpu.uuid = kvhost::FormatUuid(prop.uuid);
  gpu.sms = prop.multiProcessorCount;
  gpu.memory_bytes = prop.totalGlobalMem;
  cudaDriverGetVersion(&gpu.driver);
  cudaRuntimeGetVersion(&gpu.runtime);
  results.mps = MpsPipeFound();
  absl::PrintF(
      "kvhost_cuda_transfer_bench: %s (%s, %d SMs), CUDA driver %d, runtime %d, MPS %s\n"
      "paths %s; %d tokens per transfer, %d layers, %d timed repeats per case%s%s; kvhostd %s\n",
      gpu.name, gpu.uuid, gpu.sms, gpu.driver, gpu.runtime,
      results.mps ? "control pipe found" : "not running", absl::StrJoin(o.paths, ","), o.tokens,
      o.layers, o.repeats,
      o.staging_bytes.empty() ? "" : absl::StrCat(", --staging-bytes=", o.staging_bytes),
      o.sm_blocks > 0 ? absl::StrCat(", --sm-blocks=", o.sm_blocks) : "", o.kvhostd);

  // 1. The ceiling; its pinned memory is gone before any kvhostd is forked.
  {
    absl::StatusOr<CeilingResult> ceiling = MeasureCeiling(o);
    if (!ceiling.ok()) return ceiling.status();
    results.ceiling = *ceiling;
    const CeilingResult& c = *ceiling;
    absl::PrintF(
        "ceiling (pinned cudaMemcpyAsync, %.3f GB contiguous, median of %d): D2H %.2f GB/s, "
        "H2D %.2f GB/s, both at once %.2f GB/s (D2H %.2f + H2D %.2f)\n",
        c.bytes / 1e9, c.runs, c.d2h_gbps, c.h2d_gbps, c.duplex_gbps, c.duplex_d2h_gbps,
        c.duplex_h2d_gbps);
    std::fflush(stdout);
  }

  // 2. The worker's compute alone.
  absl::StatusOr<std::unique_ptr<Worker>> worker = Worker::Create();
  if (!worker.ok()) return worker.status();
  Worker& w = **worker;
  absl::StatusOr<double> launch_ms = w.Calibrate();
  if (!launch_ms.ok()) return launch_ms.status();
  results.kernel = w.kernel();
  absl::StatusOr<ComputeTime> alone = MeasureComputeAlone(w, o.baseline_s);
  if (!alone.ok()) return alone.status();
  results.alone = *alone;
  absl::PrintF(
      "worker compute (FMA loop, %d blocks x %d threads, %d iterations): %.3f ms per kernel "
      "alone (mean of %d)\n",
      w.kernel().grid.blocks, w.kernel().grid.threads, w.kernel().iterations, alone->ms,
      alone->kernels);
  std::fflush(stdout);

  // 3-5 per path, one kvhostd each.
  progress.total = static_cast<int>(o.paths.size() * MakeCases(o).size() * o.directions.size());
  std::mt19937_64 rng(o.seed);
  uint64_t fill_seed = o.seed << 20;
  if (!o.json_out.empty()) {
    // Marked incomplete, for a run cut short (a time limit): what was measured stays.
    progress.snapshot = [&] {
      results.elapsed_s = progress.elapsed_s();
      (void)bench::WriteFile(
          o.json_out, Json(o, results, absl::UnavailableError("run still in progress")) + "\n");
    };
  }
  for (const std::string& path : o.paths) {
    if (absl::Status s = RunPath(o, path, w, rng, fill_seed, results, progress); !s.ok()) return s;
    progress.snapshot();
  }

  // The compute alone again: the slowdowns mean little if this moved.
  absl::StatusOr<ComputeTime> end = MeasureComputeAlone(w, o.baseline_s);
  if (!end.ok()) return end.status();
  results.alone_end = *end;
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// Output.

std::string Json(const Options& o, const Results& r, const absl::Status& status) {
  std::vector<std::string> cases, duplex, ttfl;
  for (const CaseResult& c : r.cases) {
    cases.push_back(bench::JsonObject()
                        .Str("path", c.path)
                        .Str("kind", KindName(c.c.kind))
                        .Str("layout", LayoutName(c.c.layout))
                        .Uint("page_size", c.c.page_size)
                        .Str("direction", DirName(c.backup))
                        .Uint("bytes", c.bytes)
                        .Num("engine_gb_per_s", c.engine_gbps)
                        .Num("client_gb_per_s", c.client_gbps)
                        .Num("vs_ceiling", c.vs_ceiling)
                        .Uint("timed_transfers", static_cast<uint64_t>(c.timed))
                        .Num("warmup_s", c.warmup_s, 4)
                        .Bool("bytes_verified", true)
                        .Str("ticket_path", c.ticket_path)
                        .Num("worker_window_s", c.window_s)
                        .Uint("worker_window_transfers", c.window_transfers)
                        .Uint("worker_kernels", c.window_kernels)
                        .Num("worker_kernel_ms", c.compute_ms, 4)
                        .Num("worker_slowdown_pct", c.slowdown_pct, 2)
                        .str());
  }
  // The duplex and time-to-first-layer rows measure one case: MHA,
  // LAYER_FIRST, kProbePageSize.
  auto probe_row = [](const std::string& path) {
    bench::JsonObject row;
    row.Str("path", path)
        .Str("kind", "MHA")
        .Str("layout", "LAYER_FIRST")
        .Uint("page_size", kProbePageSize);
    return row;
  };
  for (const DuplexResult& d : r.duplex) {
    duplex.push_back(probe_row(d.path)
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
                         .str());
  }
  auto numbers = [](const std::vector<double>& v) {
    std::vector<std::string> out;
    for (double x : v) out.push_back(absl::StrFormat("%.4f", x));
    return bench::JsonArray(out);
  };
  for (const TtflResult& t : r.ttfl) {
    ttfl.push_back(probe_row(t.path)
                       .Uint("layers", t.layers)
                       .Uint("bytes", t.bytes)
                       .Num("rpc_return_ms", t.rpc_median_ms, 4)
                       .Num("first_layer_ms", t.first_median_ms, 4)
                       .Num("total_ms", t.total_median_ms, 4)
                       .Num("target_ms", t.target_ms, 4)
                       .Bool("met", t.met)
                       .Num("daemon_first_layer_ms", t.daemon_first_median_ms, 4)
                       .Num("daemon_total_ms", t.daemon_total_median_ms, 4)
                       .Num("daemon_target_ms", t.daemon_target_ms, 4)
                       .Bool("daemon_met", t.daemon_met)
                       .Num("enqueue_ms", t.enqueue_median_ms, 4)
                       .Raw("rpc_return_ms_samples", numbers(t.rpc_ms))
                       .Raw("first_layer_ms_samples", numbers(t.first_ms))
                       .Raw("total_ms_samples", numbers(t.total_ms))
                       .Str("ticket_path", t.ticket_path)
                       .str());
  }
  std::vector<std::string> paths;
  for (const std::string& p : o.paths) paths.push_back(kvhost::cli::JsonQuote(p));
  std::vector<std::string> done;
  for (const std::string& p : r.paths_done) done.push_back(kvhost::cli::JsonQuote(p));
  return bench::JsonObject()
      .Str("benchmark", "kvhost_cuda_transfer_bench")
      .Bool("complete", status.ok())
      .Num("elapsed_s", r.elapsed_s, 1)
      .Bool("mps", r.mps)
      .Str("error", status.ok() ? "" : std::string(status.message()))
      .Raw("gpu", bench::JsonObject()
                      .Str("name", r.gpu.name)
                      .Str("uuid", r.gpu.uuid)
                      .Uint("sms", static_cast<uint64_t>(r.gpu.sms))
                      .Uint("memory_bytes", r.gpu.memory_bytes)
                      .Uint("cuda_driver", static_cast<uint64_t>(r.gpu.driver))
                      .Uint("cuda_runtime", static_cast<uint64_t>(r.gpu.runtime))
                      .str())
      .Raw("config", bench::JsonObject()
                         .Str("kvhostd", o.kvhostd)
                         .Raw("paths", bench::JsonArray(paths))
                         .Uint("tokens", o.tokens)
                         .Uint("layers", o.layers)
                         .Uint("repeats", static_cast<uint64_t>(o.repeats))
                         .Num("slow_case_s", o.slow_case_s)
                         .Num("window_s", o.window_s)
                         .Num("duplex_s", o.duplex_s)
                         .Num("baseline_s", o.baseline_s)
                         .Str("staging_bytes", o.staging_bytes)
                         .Uint("sm_blocks", static_cast<uint64_t>(o.sm_blocks))
                         .Bool("load_gates", o.load_gates)
                         .Uint("seed", o.seed)
                         .Bool("quick", o.quick)
                         .str())
      .Raw("paths_done", bench::JsonArray(done))
      .Raw("ceiling", bench::JsonObject()
                          .Uint("bytes", r.ceiling.bytes)
                          .Uint("runs", static_cast<uint64_t>(r.ceiling.runs))
                          .Num("d2h_gb_per_s", r.ceiling.d2h_gbps)
                          .Num("h2d_gb_per_s", r.ceiling.h2d_gbps)
                          .Num("duplex_gb_per_s", r.ceiling.duplex_gbps)
                          .Num("duplex_d2h_gb_per_s", r.ceiling.duplex_d2h_gbps)
                          .Num("duplex_h2d_gb_per_s", r.ceiling.duplex_h2d_gbps)
                          .str())
      .Raw("worker_compute", bench::JsonObject()
                                 .Uint("blocks", static_cast<uint64_t>(r.kernel.grid.blocks))
                                 .Uint("threads", static_cast<uint64_t>(r.kernel.grid.threads))
                                 .Uint("iterations", r.kernel.iterations)
                                 .Num("alone_ms_per_kernel", r.alone.ms, 4)
                                 .Uint("alone_kernels", r.alone.kernels)
                                 .Num("alone_end_ms_per_kernel", r.alone_end.ms, 4)
                                 .Uint("alone_end_kernels", r.alone_end.kernels)
                                 .str())
      .Raw("cases", bench::JsonArray(cases))
      .Raw("duplex", bench::JsonArray(duplex))
      .Raw("ttfl", bench::JsonArray(ttfl))
      .str();
}

// Prints what was measured (all of it, or up to a failure) and writes
// --json-out; returns an error only for the file.
absl::Status Report(const Options& o, const Results& r, const absl::Status& status) {
  if (!r.cases.empty()) {
    std::printf("\n");
    std::vector<std::vector<std::string>> rows = {
        {"PATH", "KIND", "LAYOUT", "PAGE", "DIR", "GB/S", "RATIO", "WORKER %", "TICKET PATH"}};
    for (const CaseResult& c : r.cases) {
      rows.push_back({c.path, KindName(c.c.kind), LayoutName(c.c.layout),
                      absl::StrCat(c.c.page_size), DirName(c.backup),
                      absl::StrFormat("%.2f", c.engine_gbps), absl::StrFormat("%.2f", c.vs_ceiling),
                      absl::StrFormat("%+.1f", c.slowdown_pct),
                      absl::StrCat(c.ticket_path, c.timed < o.repeats ? " (1 timed)" : "")});
    }
    bench::PrintTable(rows, "llllrrrrl");
    absl::PrintF(
        "(GB/s: bytes over kvhostd's accept-to-done ticket time, median; RATIO: to the ceiling of "
        "the same direction; WORKER %%: mean compute kernel time while the transfer repeats, vs "
        "alone; every case's bytes checked after a backup and a load)\n");
  }
  const CeilingResult& c = r.ceiling;
  if (c.bytes > 0) {
    absl::PrintF("\nceiling: D2H %.2f GB/s, H2D %.2f GB/s, both at once %.2f GB/s\n", c.d2h_gbps,
                 c.h2d_gbps, c.duplex_gbps);
  }
  if (r.alone.kernels > 0) {
    absl::PrintF("worker compute alone: %.3f ms per kernel at the start, %s at the end\n",
                 r.alone.ms,
                 r.alone_end.kernels > 0 ? absl::StrFormat("%.3f ms", r.alone_end.ms) : "-");
  }
  for (const DuplexResult& d : r.duplex) {
    absl::PrintF(
        "duplex %-6s MHA LAYER_FIRST ps%d: %.2f GB/s (backup %.2f + load %.2f) over %.2f s; "
        "alone backup %.2f, load %.2f GB/s; %.2fx one direction, %.2f of the duplex ceiling [%s / "
        "%s]\n",
        d.path, kProbePageSize, d.aggregate_gbps, d.backup_gbps, d.load_gbps, d.seconds,
        d.backup_alone_gbps, d.load_alone_gbps, d.vs_one_direction, d.vs_ceiling, d.backup_path,
        d.load_path);
  }
  for (const TtflResult& t : r.ttfl) {
    absl::PrintF(
        "ttfl   %-6s MHA LAYER_FIRST ps%d, %d layers: first layer %.3f ms, all %.3f ms; target "
        "%.3f ms (all/%d + %.1f): %s [%s; the Load RPC returned at %.3f ms]; daemon side "
        "(ticket): first %.3f ms, all %.3f ms, target %.3f ms: %s, queued in %.3f ms\n",
        t.path, kProbePageSize, t.layers, t.first_median_ms, t.total_median_ms, t.target_ms,
        t.layers, kFirstLayerSlackMs, t.met ? "met" : "MISSED", t.ticket_path, t.rpc_median_ms,
        t.daemon_first_median_ms, t.daemon_total_median_ms, t.daemon_target_ms,
        t.daemon_met ? "met" : "MISSED", t.enqueue_median_ms);
  }
  if (r.elapsed_s > 0) absl::PrintF("done in %.1f s\n", r.elapsed_s);
  std::fflush(stdout);
  if (o.json_out.empty()) return absl::OkStatus();
  return bench::WriteJsonOut(o.json_out, Json(o, r, status));
}

absl::Status Run(const Options& o) {
  Results results;
  const Clock::time_point start = Clock::now();
  const absl::Status status = Measure(o, results);
  results.elapsed_s = Seconds(Clock::now() - start);
  const absl::Status reported = Report(o, results, status);
  return status.ok() ? reported : status;
}

}  // namespace

int main(int argc, char** argv) {
  kvhost::ParseFlags(
      argc, argv,
      "kvhost_cuda_transfer_bench: kvhostd's CUDA transfer paths (GB/s, the worker's slowdown, "
      "duplex, time to first layer) against the pinned-memcpy ceiling; this process is the GPU "
      "worker.\n"
      "Usage: kvhost_cuda_transfer_bench [--quick] [--paths=auto,ce,staged,sm] [--tokens=4096] "
      "[--layers=32] [--page-sizes=1,16,64] [--json-out=FILE]",
      "bench/cuda_transfer_bench.cc");
  const absl::StatusOr<Options> options = OptionsFromFlags();
  if (options.ok()) {
    int count = 0;
    const cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess || count == 0) {
      absl::PrintF("skipped: no usable CUDA GPU: %s\n",
                   e != cudaSuccess ? kvhost::CudaError(e) : std::string("no CUDA device"));
      return kSkipped;
    }
  }
  return bench::Finish(options, Run);
}
