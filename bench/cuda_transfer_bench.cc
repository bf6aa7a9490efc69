// kvhost_cuda_transfer_bench: the one command that measures what issue 15's
// targets are about, on a real GPU, from the worker's side. This process IS
// the GPU worker, as in production: it owns the device KV buffers
// (cudaMalloc, several layers per allocation, random non-zero bytes), runs
// its own compute on its own stream, and starts kvhostd (--backend=cuda,
// private socket and shm dir) once per transfer path
// (--transfer-path=auto|ce|staged|sm), attaching its buffers through CUDA
// IPC. In one run, in this order:
//
//  1. The ceiling: contiguous cudaMemcpyAsync between a pinned buffer and a
//     device buffer (--ceiling-bytes): D2H, H2D, and both at once on two
//     streams. Median of a few repeats.
//  2. The workers' compute alone (--workers, cuda_bench_worker.h): gemm, a
//     cuBLAS bf16 GEMM (--gemm-n, 8192^3: 1.1 TFLOP, ~1.5-2 ms on an H200;
//     cuBLAS found at run time, cuda_bench_cublas.h), the headline; fma, one
//     wave of ~5 ms FMA blocks on every SM, the worst case for sharing the
//     SMs. Each is looped on the worker's stream by a thread; mean ms per
//     unit over --baseline-s, measured again at the end (drift reported).
//  3. Per path (one kvhostd each), first for the first path only the
//     in-process anchor (cuda_bench_anchor.h): sglang's warp-per-item
//     zero-copy copy kernel in this process's context, between the worker's
//     rows and a mapped pinned LAYER_FIRST page-1 host buffer, at each
//     --anchor-quotas (1024-thread blocks) and direction; bytes verified,
//     GB/s, worker costs.
//  4. Per path x kind (MHA 8 x 128 bf16, MLA 576 bf16) x host layout x page
//     size (cuda_bench_cases.h): a transfer of --tokens slots, whose host
//     slots are what the daemon's Alloc returns after --churn-ops random
//     Alloc / Free calls on the pool (--host-slots; the mean host run, in
//     pages, is reported) and whose device rows are random whole pages of a
//     device pool of twice that. First a backup then a load into other
//     device rows, after which every device row is checked: no speed is
//     reported for wrong bytes. Then per direction --repeats timed transfers
//     (one when the warm-up took longer than --slow-case-s): GB/s is bytes
//     over the ticket's duration_us (median), its ratio is to the ceiling of
//     the same direction, auto's chosen path is recorded. Then each worker's
//     cost at each --duty cycle: the worker's loop runs while the transfer
//     repeats (back to back, or issue, wait, idle 3x its duration at 0.25)
//     for --window-s of whole cycles; cost = mean unit time during / alone
//     - 1. A slow case gets its back-to-back costs only, over one transfer.
//  5. Duplex (MHA, LAYER_FIRST, page 64): a backup loop and a load loop at
//     once from two client threads on disjoint host slots and device rows
//     for --duplex-s, against each direction alone and the ceiling's
//     both-at-once figure.
//  6. Time to first layer (MHA LAYER_FIRST, each --ttfl-page-sizes): an
//     event before the Load call, one at its return, one after waiting for
//     layer 0 and one after the last layer (WaitForLayer); median of up to
//     10 loads. Target: first <= total / layers + 0.1 ms. The calls go over
//     the fast path where kvhostd offers it (the table says which).
//  7. The node cache, on the first path only (not the worker path; each
//     --cache-page-sizes, cuda_bench_cache.h): Store and Restore GB/s
//     against the ceiling and each worker's cost at each duty, beside the
//     index-addressed pool's case of the same layout where the run has
//     one, and the time to first layer of a Restore.
//
// A ticket of a forced path must report that path ("cuda-ce", ...). The
// estimate of the run's length is printed at the start (--estimate prints
// it and the cases, and exits without a GPU). Progress goes to stderr, one
// line per case and direction; the results go to stdout as tables (per path
// and worker, the anchor, and the headline: per case the best path within
// the GEMM bounds next to auto and the anchor; cuda_bench_report.h) and,
// with --json-out, to a file rewritten after every case and marked
// incomplete until the run ends (bench/cuda_bench_table.py renders it).
// Exit codes: 0 done, 1 a CUDA call, an RPC, a byte check or the GEMM
// worker's cuBLAS failed, 2 bad flags, 77 no usable GPU (skipped).
#include <cuda_runtime_api.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "bench/bench_util.h"
#include "bench/cuda_bench_anchor.h"
#include "bench/cuda_bench_cache.h"
#include "bench/cuda_bench_cases.h"
#include "bench/cuda_bench_options.h"
#include "bench/cuda_bench_report.h"
#include "bench/cuda_bench_worker.h"
#include "common/cli_flags.h"
#include "common/cuda_util.h"
#include "kvhost/client.h"
#include "tests/daemon_fixture.h"

namespace {

namespace bench = kvhost::bench;
namespace v1 = kvhost::v1;
using bench::CeilingResult;
using bench::Cuda;
using bench::ElapsedMs;
using bench::Events;
using bench::Options;
using bench::Progress;
using bench::Results;

double NowS() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

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

absl::Status RunPath(const Options& o, const std::string& path, bench::Worker& w,
                     uint64_t& fill_seed, Results& results, Progress& progress) {
  // The worker path: kvhostd plans (--worker-copy), this process copies.
  const bool worker_path = path == "worker";
  std::vector<std::string> flags = {
      "--backend=cuda", "--log-level=info",
      worker_path ? std::string("--worker-copy") : absl::StrCat("--transfer-path=", path)};
  if (!o.staging_bytes.empty()) flags.push_back(absl::StrCat("--staging-bytes=", o.staging_bytes));
  if (o.sm_blocks > 0) flags.push_back(absl::StrCat("--sm-blocks=", o.sm_blocks));
  flags.insert(flags.end(), o.daemon_flags.begin(), o.daemon_flags.end());
  absl::StatusOr<std::unique_ptr<kvhost::testing::TestDaemon>> daemon =
      kvhost::testing::TestDaemon::Start(o.kvhostd, flags);
  if (!daemon.ok()) {
    return absl::Status(daemon.status().code(),
                        absl::StrCat("starting ", o.kvhostd, " ", absl::StrJoin(flags, " "), ": ",
                                     daemon.status().message()));
  }
  kvhost::Client& client = (*daemon)->client();
  bench::WorkerSide worker;
  // 1024-thread blocks of the anchor's first quota, in the copy kernel's
  // 256-thread blocks.
  if (!o.anchor_quotas.empty()) worker.blocks = static_cast<int>(o.anchor_quotas.front()) * 4;
  if (worker_path) {
    if (cudaError_t e = cudaStreamCreateWithFlags(&worker.stream, cudaStreamNonBlocking);
        e != cudaSuccess) {
      return absl::InternalError(
          absl::StrCat("the worker path's copy stream: ", cudaGetErrorString(e)));
    }
  }
  struct StreamCloser {
    cudaStream_t stream;
    ~StreamCloser() {
      if (stream != nullptr) cudaStreamDestroy(stream);
    }
  } closer{worker.stream};
  const bench::PathRun run{path,
                           path == "auto" ? "" : (worker_path ? path : absl::StrCat("cuda-", path)),
                           worker_path ? &worker : nullptr};
  absl::Status s = [&]() -> absl::Status {
    absl::StatusOr<v1::DaemonStatus> status = client.GetStatus();
    if (!status.ok()) return status.status();
    if (status->backend() != "cuda") {
      return absl::FailedPreconditionError(absl::StrCat("kvhostd runs backend '", status->backend(),
                                                        "', not cuda: ", status->backend_detail()));
    }
    if (path == o.paths.front()) {
      std::vector<v1::PoolKind> kinds;
      for (const bench::Shape& sh : o.shapes) {
        if (std::find(kinds.begin(), kinds.end(), sh.kind) == kinds.end()) kinds.push_back(sh.kind);
      }
      for (v1::PoolKind kind : kinds) {
        absl::Status a = bench::RunAnchor(o, client, w, kind, fill_seed, results, progress);
        if (!a.ok()) return a;
      }
    }
    for (const bench::Case& c : bench::MakeCases(o)) {
      absl::Status r = bench::RunCase(o, run, c, client, w, fill_seed, results, progress);
      if (!r.ok()) return r;
      progress.snapshot();
    }
    // The worker path measures its cases only: its duplex and time to the
    // first layer would need the copier in those loops (not done).
    if (worker_path) return absl::OkStatus();
    if (absl::Status d = bench::RunDuplex(o, run, client, w, results); !d.ok()) return d;
    progress.snapshot();
    for (uint32_t ps : o.ttfl_page_sizes) {
      if (absl::Status t = bench::RunTtfl(o, run, ps, client, w, results); !t.ok()) return t;
    }
    if (path != o.paths.front()) return absl::OkStatus();
    for (uint32_t ps : o.cache_page_sizes) {
      absl::Status c = bench::RunCacheCase(o, run, ps, client, w, fill_seed, results, progress);
      if (!c.ok()) return c;
      progress.snapshot();
    }
    return absl::OkStatus();
  }();
  if (!o.daemon_logs.empty()) {
    const std::string file = absl::StrCat(o.daemon_logs, "/kvhostd-", path, ".log");
    if (absl::Status f = bench::WriteFile(file, (*daemon)->Log()); !f.ok()) {
      absl::FPrintF(stderr, "warning: %s\n", f.message());
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

absl::Status Describe(const Options& o, Results& results) {
  if (absl::Status s = Cuda(cudaSetDevice(bench::kDevice), "cudaSetDevice"); !s.ok()) return s;
  cudaDeviceProp prop;
  if (absl::Status s =
          Cuda(cudaGetDeviceProperties(&prop, bench::kDevice), "cudaGetDeviceProperties");
      !s.ok()) {
    return s;
  }
  bench::GpuInfo& gpu = results.gpu;
  gpu.name = prop.name;
  gpu.uuid = kvhost::FormatUuid(prop.uuid);
  gpu.sms = prop.multiProcessorCount;
  gpu.memory_bytes = prop.totalGlobalMem;
  cudaDriverGetVersion(&gpu.driver);
  cudaRuntimeGetVersion(&gpu.runtime);
  results.mps = MpsPipeFound();
  results.estimate_s = bench::EstimateSeconds(o);
  absl::PrintF(
      "kvhost_cuda_transfer_bench: %s (%s, %d SMs), CUDA driver %d, runtime %d, MPS %s\n"
      "paths %s; workers %s; duty %s; %d tokens per transfer, %d layers, host slots %s; "
      "kvhostd %s\nestimate: %.0f s (%.1f min; slow cases add their transfer time)\n",
      gpu.name, gpu.uuid, gpu.sms, gpu.driver, gpu.runtime,
      results.mps ? "control pipe found" : "not running", absl::StrJoin(o.paths, ","),
      absl::StrJoin(o.workers, ","),
      absl::StrJoin(o.duties, ",",
                    [](std::string* out, double d) { out->append(bench::DutyName(d)); }),
      o.tokens, o.layers, bench::HostSlotsName(o.host_slots), o.kvhostd, results.estimate_s,
      results.estimate_s / 60);
  std::fflush(stdout);
  return absl::OkStatus();
}

absl::Status Measure(Options& o, Results& results) {
  Progress progress;
  progress.start_s = NowS();
  if (absl::Status s = Describe(o, results); !s.ok()) return s;

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

  // 2. The workers' compute alone. --quick runs without the GEMM where no
  // cuBLAS is found; a run that asked for it fails.
  absl::StatusOr<std::unique_ptr<bench::Worker>> worker =
      bench::Worker::Create(o, o.workers_from_quick, &results.cublas);
  if (!worker.ok()) return worker.status();
  bench::Worker& w = **worker;
  if (w.units().size() < o.workers.size()) {
    absl::PrintF("worker gemm left out: %s\n", results.cublas);
    o.workers.clear();
    for (const auto& u : w.units()) o.workers.push_back(u->name());
  }
  for (const auto& u : w.units()) {
    absl::StatusOr<bench::ComputeTime> alone = bench::MeasureAlone(*u, w.stream(), o.baseline_s);
    if (!alone.ok()) return alone.status();
    bench::WorkerInfo info;
    info.name = u->name();
    info.what = u->what();
    info.alone_ms = alone->ms;
    info.alone_units = alone->units;
    results.workers.push_back(info);
    absl::PrintF("worker %s (%s): %.3f ms per unit alone (mean of %d)\n", info.name, info.what,
                 info.alone_ms, info.alone_units);
  }
  std::fflush(stdout);

  // 3-6 per path, one kvhostd each.
  progress.total =
      static_cast<int>((o.paths.size() * bench::MakeCases(o).size() +
                        (o.paths.front() == "worker" ? 0 : o.cache_page_sizes.size())) *
                       o.directions.size());
  uint64_t fill_seed = o.seed << 20;
  if (!o.json_out.empty()) {
    // Marked incomplete, for a run cut short (a time limit): what was measured stays.
    progress.snapshot = [&] {
      results.elapsed_s = progress.elapsed_s();
      (void)bench::WriteFile(
          o.json_out,
          bench::Json(o, results, absl::UnavailableError("run still in progress")) + "\n");
    };
  }
  for (const std::string& path : o.paths) {
    if (absl::Status s = RunPath(o, path, w, fill_seed, results, progress); !s.ok()) return s;
    progress.snapshot();
  }

  // The compute alone again: the costs mean little if this moved.
  for (size_t i = 0; i < w.units().size(); ++i) {
    absl::StatusOr<bench::ComputeTime> end =
        bench::MeasureAlone(*w.units()[i], w.stream(), o.baseline_s);
    if (!end.ok()) return end.status();
    results.workers[i].alone_end_ms = end->ms;
    results.workers[i].alone_end_units = end->units;
  }
  return absl::OkStatus();
}

absl::Status Run(const Options& options) {
  Options o = options;  // the workers may shrink (--quick without cuBLAS)
  Results results;
  const double start = NowS();
  const absl::Status status = Measure(o, results);
  results.elapsed_s = NowS() - start;
  bench::PrintReport(o, results);
  if (o.json_out.empty()) return status;
  const absl::Status written = bench::WriteJsonOut(o.json_out, bench::Json(o, results, status));
  return status.ok() ? written : status;
}

// --estimate: the cases and the estimate, no GPU.
int PrintEstimate(const Options& o) {
  const std::vector<bench::Case> cases = bench::MakeCases(o);
  absl::PrintF(
      "%d paths x %d cases x %d directions; workers %s x %d duty cycles; anchor quotas "
      "%d; ttfl page sizes %d\n",
      o.paths.size(), cases.size(), o.directions.size(), absl::StrJoin(o.workers, ","),
      o.duties.size(), o.anchor_quotas.size(), o.ttfl_page_sizes.size());
  for (const bench::Case& c : cases) {
    absl::PrintF("  %s %s ps%d: %d bytes per transfer\n", bench::KindName(c.kind),
                 bench::LayoutName(c.layout), c.page_size, bench::TransferBytes(o, c.kind));
  }
  absl::PrintF("estimate: %.0f s\n", bench::EstimateSeconds(o));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  kvhost::ParseFlags(
      argc, argv,
      "kvhost_cuda_transfer_bench: kvhostd's CUDA transfer paths (GB/s, the cost to a GEMM and "
      "an FMA worker back to back and at a duty cycle, duplex, time to first layer) against the "
      "pinned-memcpy ceiling and the in-process anchor; this process is the GPU worker.\n"
      "Usage: kvhost_cuda_transfer_bench [--quick] [--estimate] [--paths=auto,ce,staged,sm] "
      "[--workers=gemm,fma] [--duty=1,0.25] [--tokens=8192] [--json-out=FILE]",
      "bench/cuda_transfer_bench.cc");
  const absl::StatusOr<Options> options = bench::OptionsFromFlags();
  if (options.ok() && options->estimate_only) return PrintEstimate(*options);
  if (options.ok()) {
    int count = 0;
    const cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess || count == 0) {
      absl::PrintF("skipped: no usable CUDA GPU: %s\n",
                   e != cudaSuccess ? kvhost::CudaError(e) : std::string("no CUDA device"));
      return 77;  // ctest's SKIP_RETURN_CODE
    }
  }
  return bench::Finish(options, Run);
}
