#include "bench/cuda_bench_anchor.h"

#include <algorithm>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "bench/bench_util.h"
#include "bench/cuda_bench_kernels.h"

namespace kvhost::bench {
namespace {

// Timed anchor copies per quota and direction (a median; they are short).
constexpr int kMinAnchorRepeats = 3;

// The anchor's CUDA resources: the mapped host buffer, the device tables
// the kernel reads, its stream (not the compute stream: the copies run
// beside the worker's compute, as an in-process pool's do).
struct AnchorBuffers {
  uint8_t* host = nullptr;
  void** layers = nullptr;
  int64_t* rows = nullptr;
  int64_t* other = nullptr;
  int64_t* slots = nullptr;
  cudaStream_t stream = nullptr;
  ~AnchorBuffers() {
    if (stream != nullptr) {
      cudaStreamSynchronize(stream);
      cudaStreamDestroy(stream);
    }
    if (host != nullptr) cudaFreeHost(host);
    for (void* p : {static_cast<void*>(layers), static_cast<void*>(rows), static_cast<void*>(other),
                    static_cast<void*>(slots)}) {
      if (p != nullptr) cudaFree(p);
    }
  }
};

template <typename T>
absl::Status ToDevice(const std::vector<T>& v, T** out) {
  void* p = nullptr;
  absl::Status s = Cuda(cudaMalloc(&p, v.size() * sizeof(T)), "cudaMalloc");
  if (!s.ok()) return s;
  *out = static_cast<T*>(p);
  return Cuda(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), "cudaMemcpy");
}

absl::Status Copy(const AnchorCopy& copy, int quota, cudaStream_t stream) {
  absl::Status s = Cuda(LaunchAnchorCopy(copy, quota, stream), "anchor copy launch");
  if (s.ok()) s = Cuda(cudaStreamSynchronize(stream), "anchor copy");
  return s;
}

// Median ms of the copy on its stream.
absl::StatusOr<double> TimeCopy(const AnchorCopy& copy, int quota, cudaStream_t stream,
                                int repeats) {
  absl::StatusOr<std::unique_ptr<Events>> ev = Events::Create(2);
  if (!ev.ok()) return ev.status();
  std::vector<double> ms;
  for (int i = 0; i < repeats; ++i) {
    absl::Status s = Cuda(cudaEventRecord((**ev)[0], stream), "cudaEventRecord");
    if (s.ok()) s = Cuda(LaunchAnchorCopy(copy, quota, stream), "anchor copy launch");
    if (s.ok()) s = Cuda(cudaEventRecord((**ev)[1], stream), "cudaEventRecord");
    if (s.ok()) s = Cuda(cudaEventSynchronize((**ev)[1]), "anchor copy");
    if (!s.ok()) return s;
    absl::StatusOr<double> t = ElapsedMs((**ev)[0], (**ev)[1]);
    if (!t.ok()) return t;
    ms.push_back(*t);
  }
  return Median(ms);
}

// GB/s and every worker's cost of `copy` at `quota`.
absl::StatusOr<AnchorResult> MeasureQuota(const Options& o, Worker& w, const AnchorCopy& copy,
                                          int quota, cudaStream_t stream, const Results& results) {
  AnchorResult r;
  r.quota = static_cast<uint32_t>(quota);
  r.backup = copy.backup;
  r.bytes = copy.tokens * copy.buffers * copy.row_bytes;
  absl::StatusOr<double> ms = TimeCopy(copy, quota, stream, std::max(o.repeats, kMinAnchorRepeats));
  if (!ms.ok()) return ms.status();
  r.gbps = static_cast<double>(r.bytes) / 1e9 / (*ms / 1e3);
  r.vs_ceiling = r.gbps / (copy.backup ? results.ceiling.d2h_gbps : results.ceiling.h2d_gbps);
  auto transfer = [&]() { return Copy(copy, quota, stream); };
  if (absl::Status s = MeasureCosts(o, w, results, /*slow=*/false, transfer, r.costs); !s.ok()) {
    return s;
  }
  return r;
}

}  // namespace

absl::Status RunAnchor(const Options& o, kvhost::Client& client, Worker& w, v1::PoolKind kind,
                       uint64_t& fill_seed, Results& results, Progress& progress) {
  if (o.anchor_quotas.empty()) return absl::OkStatus();
  absl::StatusOr<DeviceKv*> device = w.Pool(o, kind);
  if (!device.ok()) return device.status();
  DeviceKv& dev = **device;
  std::mt19937_64 rng = CaseRng(o, kind, v1::LAYER_FIRST, 1);
  const std::string what = absl::StrCat("anchor ", KindName(kind), " LAYER_FIRST ps1");
  auto body = [&](const v1::Pool& pool, const std::vector<int64_t>& host) -> absl::Status {
    const std::vector<uint64_t> device_pages = ShuffledPages(dev.rows(), rng);
    const std::vector<int64_t> rows = PageSlots(device_pages, 0, o.tokens, 1);
    const std::vector<int64_t> other = PageSlots(device_pages, o.tokens, o.tokens, 1);
    AnchorBuffers b;
    const uint64_t host_bytes = uint64_t{dev.buffers()} * pool.size_tokens() * dev.row_bytes();
    void* h = nullptr;
    absl::Status s = Cuda(cudaHostAlloc(&h, host_bytes, cudaHostAllocMapped),
                          absl::StrCat("cudaHostAlloc (mapped) of ", host_bytes, " bytes"));
    if (!s.ok()) return s;
    b.host = static_cast<uint8_t*>(h);
    void* mapped = nullptr;
    s = Cuda(cudaHostGetDevicePointer(&mapped, h, 0), "cudaHostGetDevicePointer");
    if (s.ok()) s = ToDevice(dev.all_buffers(), &b.layers);
    if (s.ok()) s = ToDevice(rows, &b.rows);
    if (s.ok()) s = ToDevice(other, &b.other);
    if (s.ok()) s = ToDevice(host, &b.slots);
    if (s.ok()) s = Cuda(cudaStreamCreateWithFlags(&b.stream, cudaStreamNonBlocking), "stream");
    if (!s.ok()) return s;
    AnchorCopy copy;
    copy.device_layers = b.layers;
    copy.host = static_cast<uint8_t*>(mapped);
    copy.host_slots = b.slots;
    copy.tokens = o.tokens;
    copy.host_rows = pool.size_tokens();
    copy.row_bytes = dev.row_bytes();
    copy.buffers = dev.buffers();

    // The byte check, at the first quota: rows to the host, back into other rows.
    const int first_quota = static_cast<int>(o.anchor_quotas.front());
    const uint64_t seed = ++fill_seed;
    if (s = dev.Fill(seed, w.stream()); !s.ok()) return s;
    copy.backup = true;
    copy.device_rows = b.rows;
    if (s = Copy(copy, first_quota, b.stream); !s.ok()) return s;
    copy.backup = false;
    copy.device_rows = b.other;
    if (s = Copy(copy, first_quota, b.stream); !s.ok()) return s;
    if (s = dev.Check(seed, other, rows, w.stream()); !s.ok()) return s;

    copy.device_rows = b.rows;
    for (uint32_t quota : o.anchor_quotas) {
      for (bool backup : o.directions) {
        copy.backup = backup;
        absl::StatusOr<AnchorResult> r =
            MeasureQuota(o, w, copy, static_cast<int>(quota), b.stream, results);
        if (!r.ok()) return r.status();
        r->kind = KindName(kind);
        r->host = RunsOf(host, 1);
        std::string costs;
        for (const Cost& k : r->costs) {
          absl::StrAppendFormat(&costs, " %s@%s %+.1f%%", k.worker, DutyName(k.duty), k.cost_pct);
        }
        absl::FPrintF(stderr, "[%.0fs] %s quota %d %s: %.1f GB/s (%.2f),%s\n", progress.elapsed_s(),
                      what, quota, DirName(backup), r->gbps, r->vs_ceiling, costs);
        results.anchor.push_back(*r);
      }
    }
    return absl::OkStatus();
  };
  absl::Status s =
      WithHostSlots(o, client, absl::StrCat("bench-anchor-", KindName(kind)),
                    SpecFor(o, kind, v1::LAYER_FIRST, 1, o.tokens), o.tokens, rng, body);
  if (!s.ok()) return absl::Status(s.code(), absl::StrCat(what, ": ", s.message()));
  progress.snapshot();
  return absl::OkStatus();
}

}  // namespace kvhost::bench
