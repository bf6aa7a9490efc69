#include "bench/cuda_bench_worker.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "bench/bench_util.h"
#include "bench/cuda_bench_cublas.h"
#include "bench/cuda_bench_kernels.h"
#include "common/cuda_util.h"
#include "kvhost/client.h"
#include "kvhost/cuda_export.h"

namespace kvhost::bench {
namespace {

using Clock = std::chrono::steady_clock;
double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// Layer buffers per cudaMalloc allocation: a worker's buffers share
// allocations, so kvhostd opens one IPC handle for several layers.
constexpr uint32_t kLayersPerAllocation = 8;
// The FMA kernel's length: the docs/DESIGN.md measurement ran 60 kernels in 325 ms.
constexpr double kFmaKernelMs = 5.0;
// Units that must complete inside a cost window before it may close, and
// how far past its least length it may stretch to get them.
constexpr uint64_t kMinWindowUnits = 3;
constexpr double kMaxWindowStretchS = 5.0;
// The baseline window right before each cost window (MeasureCost), at most
// as long as the cost window: long enough for ~130 GEMMs of 1.5 ms or ~40
// FMA units of 5 ms.
constexpr double kAdjacentAloneS = 0.2;
constexpr std::chrono::milliseconds kPollAlone{1};

// Launches the unit back to back on the stream from its own thread, two
// launches queued so the SMs never wait for the host, and times each launch
// with a pair of events (the start event fires when the previous unit ends,
// so the pair spans one unit). A window (Open / Close) selects the units
// that both started and finished inside it.
class ComputeLoop {
 public:
  ComputeLoop(ComputeUnit& unit, cudaStream_t stream) : unit_(unit), stream_(stream) {}
  ~ComputeLoop() {
    if (thread_.joinable()) (void)Stop();
  }
  ComputeLoop(const ComputeLoop&) = delete;
  ComputeLoop& operator=(const ComputeLoop&) = delete;

  void Start() {
    thread_ = std::thread([this] { Run(); });
  }
  // Blocks until `n` units have completed (or the loop failed).
  void WaitCompleted(uint64_t n) const {
    while (completed_.load() < n && !failed_.load()) std::this_thread::sleep_for(kPoll);
  }
  // Returns the window's id (odd), for Mean.
  uint64_t OpenWindow() {
    in_window_.store(0);
    return window_.fetch_add(1) + 1;  // odd: open
  }
  void CloseWindow() { window_.fetch_add(1); }
  // Units that completed inside the open window so far.
  uint64_t InWindow() const { return in_window_.load(); }
  bool failed() const { return failed_.load(); }

  // Stops, joins and returns the mean of the last window's units: those
  // that started and ended inside it, or, should none have, those launched
  // inside it.
  absl::StatusOr<ComputeTime> Stop() {
    stop_.store(true);
    thread_.join();
    if (!status_.ok()) return status_;
    const uint64_t last = window_.load() % 2 == 1 ? window_.load() : window_.load() - 1;
    return Mean(last);
  }

  // After Stop: the mean of window `window`'s units (as Stop's).
  absl::StatusOr<ComputeTime> Mean(uint64_t window) const {
    ComputeTime strict, launched;
    for (const Sample& s : samples_) {
      if (s.launch_window != window) continue;
      launched.ms += s.ms;
      ++launched.units;
      if (s.end_window == window) {
        strict.ms += s.ms;
        ++strict.units;
      }
    }
    ComputeTime t = strict.units > 0 ? strict : launched;
    if (t.units == 0) return absl::InternalError("the compute loop completed no unit in a window");
    t.ms /= static_cast<double>(t.units);
    return t;
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
      if (absl::Status s = Cuda(cudaEventSynchronize((**events)[2 * k + 1]), unit_.name());
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
      if (s.ok()) s = unit_.Launch(stream_);
      if (s.ok()) s = Cuda(cudaEventRecord((**events)[2 * k + 1], stream_), "cudaEventRecord");
      if (!s.ok()) return s;
      ++launched;
    }
    while (harvested < launched) {
      if (absl::Status s = harvest(); !s.ok()) return s;
    }
    return absl::OkStatus();
  }

  ComputeUnit& unit_;
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

// Median ms of three launches of `unit` after a warm-up.
absl::StatusOr<double> TimeUnit(ComputeUnit& unit, cudaStream_t stream) {
  absl::StatusOr<std::unique_ptr<Events>> ev = Events::Create(2);
  if (!ev.ok()) return ev.status();
  std::vector<double> ms;
  for (int run = 0; run < 4; ++run) {
    absl::Status s = Cuda(cudaEventRecord((**ev)[0], stream), "cudaEventRecord");
    if (s.ok()) s = unit.Launch(stream);
    if (s.ok()) s = Cuda(cudaEventRecord((**ev)[1], stream), "cudaEventRecord");
    if (s.ok()) s = Cuda(cudaEventSynchronize((**ev)[1]), unit.name());
    if (!s.ok()) return s;
    absl::StatusOr<double> t = ElapsedMs((**ev)[0], (**ev)[1]);
    if (!t.ok()) return t;
    if (run > 0) ms.push_back(*t);
  }
  return Median(ms);
}

// Independent FMA chains in every thread, one wave filling every SM: the
// worst case for sharing the SMs, sized to about kFmaKernelMs.
class FmaUnit : public ComputeUnit {
 public:
  static absl::StatusOr<std::unique_ptr<ComputeUnit>> Create(cudaStream_t stream) {
    std::unique_ptr<FmaUnit> u(new FmaUnit());
    void* sink = nullptr;
    if (absl::Status s = Cuda(cudaMalloc(&sink, sizeof(float)), "cudaMalloc"); !s.ok()) return s;
    u->sink_ = static_cast<float*>(sink);
    if (absl::Status s = Cuda(ComputeGridFor(kDevice, &u->grid_), "occupancy"); !s.ok()) return s;
    u->iterations_ = 4096;
    absl::StatusOr<double> ms = TimeUnit(*u, stream);
    if (!ms.ok()) return ms.status();
    const double scaled = u->iterations_ * kFmaKernelMs / std::max(*ms, 1e-3);
    u->iterations_ = static_cast<uint32_t>(std::clamp(scaled, 256.0, 1e9));
    u->what_ = absl::StrFormat("FMA loop, %d blocks x %d threads, %d iterations", u->grid_.blocks,
                               u->grid_.threads, u->iterations_);
    return std::unique_ptr<ComputeUnit>(std::move(u));
  }
  ~FmaUnit() override {
    if (sink_ != nullptr) cudaFree(sink_);
  }
  const std::string& name() const override { return name_; }
  const std::string& what() const override { return what_; }
  absl::Status Launch(cudaStream_t stream) override {
    return Cuda(LaunchCompute(grid_, iterations_, sink_, stream), "FMA kernel launch");
  }

 private:
  FmaUnit() = default;
  const std::string name_ = "fma";
  std::string what_;
  ComputeGrid grid_;
  uint32_t iterations_ = 0;
  float* sink_ = nullptr;
};

// C = A * B, n x n bf16, fp32 accumulate: what an engine's forward pass
// spends its time in.
class GemmUnit : public ComputeUnit {
 public:
  static absl::StatusOr<std::unique_ptr<ComputeUnit>> Create(std::unique_ptr<Cublas> cublas, int n,
                                                             cudaStream_t stream) {
    std::unique_ptr<GemmUnit> u(new GemmUnit());
    u->cublas_ = std::move(cublas);
    u->n_ = n;
    const uint64_t bytes = uint64_t{2} * n * n;
    for (void*& m : u->matrices_) {
      if (absl::Status s = Cuda(cudaMalloc(&m, bytes), absl::StrCat("cudaMalloc of ", bytes));
          !s.ok()) {
        return s;
      }
    }
    absl::Status s = Cuda(LaunchFillBf16(u->matrices_[0], uint64_t{1} * n * n, 1, stream), "fill");
    if (s.ok()) s = Cuda(LaunchFillBf16(u->matrices_[1], uint64_t{1} * n * n, 2, stream), "fill");
    if (s.ok()) s = Cuda(cudaStreamSynchronize(stream), "fill");
    if (s.ok()) s = u->cublas_->SetStream(stream);
    if (!s.ok()) return s;
    u->what_ = absl::StrFormat("cuBLAS bf16 GEMM %d x %d x %d, fp32 accumulate, %s", n, n, n,
                               u->cublas_->path());
    return std::unique_ptr<ComputeUnit>(std::move(u));
  }
  ~GemmUnit() override {
    cublas_.reset();
    for (void* m : matrices_) {
      if (m != nullptr) cudaFree(m);
    }
  }
  const std::string& name() const override { return name_; }
  const std::string& what() const override { return what_; }
  absl::Status Launch(cudaStream_t stream) override {
    (void)stream;  // bound at creation: the handle runs on the worker's stream
    return cublas_->GemmBf16(n_, matrices_[0], matrices_[1], matrices_[2]);
  }

 private:
  GemmUnit() = default;
  const std::string name_ = "gemm";
  std::string what_;
  std::unique_ptr<Cublas> cublas_;
  int n_ = 0;
  void* matrices_[3] = {nullptr, nullptr, nullptr};
};

}  // namespace

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

absl::StatusOr<std::unique_ptr<Events>> Events::Create(int n) {
  std::unique_ptr<Events> e(new Events());
  for (int i = 0; i < n; ++i) {
    cudaEvent_t ev = nullptr;
    if (absl::Status s = Cuda(cudaEventCreate(&ev), "cudaEventCreate"); !s.ok()) return s;
    e->events_.push_back(ev);
  }
  return e;
}

Events::~Events() {
  for (cudaEvent_t ev : events_) cudaEventDestroy(ev);
}

absl::StatusOr<std::unique_ptr<DeviceKv>> DeviceKv::Create(uint32_t planes, uint32_t layers,
                                                           uint64_t rows, uint64_t row_bytes) {
  if (row_bytes % 16 != 0) {
    return absl::InvalidArgumentError(absl::StrCat("row of ", row_bytes, " bytes: not 16-byte"));
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
  if (absl::Status s = Cuda(cudaMalloc(&p, 2 * buffers * sizeof(unsigned long long)), "cudaMalloc");
      !s.ok()) {
    return s;
  }
  d->counters_ = static_cast<unsigned long long*>(p);
  return d;
}

DeviceKv::~DeviceKv() {
  for (uint8_t* p : allocations_) cudaFree(p);
  if (source_rows_ != nullptr) cudaFree(source_rows_);
  if (counters_ != nullptr) cudaFree(counters_);
}

uint8_t* DeviceKv::buffer(uint32_t b) const {
  return allocations_[b / kLayersPerAllocation] + (b % kLayersPerAllocation) * layer_bytes();
}

std::vector<void*> DeviceKv::layers(uint32_t plane) const {
  std::vector<void*> out;
  if (plane >= planes_) return out;
  for (uint32_t l = 0; l < layers_; ++l) out.push_back(buffer(plane * layers_ + l));
  return out;
}

std::vector<void*> DeviceKv::all_buffers() const {
  std::vector<void*> out;
  for (uint32_t b = 0; b < buffers(); ++b) out.push_back(buffer(b));
  return out;
}

absl::Status DeviceKv::Fill(uint64_t seed, cudaStream_t stream) {
  for (uint32_t b = 0; b < buffers(); ++b) {
    if (absl::Status s =
            Cuda(LaunchFillKv(buffer(b), layer_bytes(), seed, FirstWord(b), stream), "fill kernel");
        !s.ok()) {
      return s;
    }
  }
  return Cuda(cudaStreamSynchronize(stream), "fill kernel");
}

absl::Status DeviceKv::Check(uint64_t seed, const std::vector<int64_t>& dst,
                             const std::vector<int64_t>& src, cudaStream_t stream) {
  std::vector<int64_t> source(rows_, -1);
  for (size_t i = 0; i < dst.size(); ++i) source[static_cast<size_t>(dst[i])] = src[i];
  const uint32_t n = buffers();
  std::vector<unsigned long long> counters(2 * n);
  for (uint32_t b = 0; b < n; ++b) {
    counters[2 * b] = 0;
    counters[2 * b + 1] = ~0ull;
  }
  absl::Status s =
      Cuda(cudaMemcpy(source_rows_, source.data(), rows_ * sizeof(int64_t), cudaMemcpyHostToDevice),
           "cudaMemcpy");
  if (s.ok()) {
    s = Cuda(cudaMemcpy(counters_, counters.data(), counters.size() * sizeof(counters[0]),
                        cudaMemcpyHostToDevice),
             "cudaMemcpy");
  }
  for (uint32_t b = 0; b < n && s.ok(); ++b) {
    s = Cuda(LaunchCheckKv(buffer(b), rows_, row_bytes_, seed, FirstWord(b), source_rows_,
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
  for (uint32_t b = 0; b < n; ++b) {
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

absl::StatusOr<std::unique_ptr<Worker>> Worker::Create(const Options& o, bool gemm_optional,
                                                       std::string* cublas) {
  std::unique_ptr<Worker> w(new Worker());
  if (absl::Status s =
          Cuda(cudaStreamCreateWithFlags(&w->stream_, cudaStreamNonBlocking), "cudaStreamCreate");
      !s.ok()) {
    return s;
  }
  for (const std::string& name : o.workers) {
    absl::StatusOr<std::unique_ptr<ComputeUnit>> unit;
    if (name == "fma") {
      unit = FmaUnit::Create(w->stream_);
    } else {
      absl::StatusOr<std::unique_ptr<Cublas>> lib = Cublas::Load(o.cublas);
      if (!lib.ok()) {
        *cublas = std::string(lib.status().message());
        if (gemm_optional && lib.status().code() == absl::StatusCode::kNotFound) continue;
        return lib.status();
      }
      *cublas = (*lib)->path();
      unit = GemmUnit::Create(*std::move(lib), static_cast<int>(o.gemm_n), w->stream_);
    }
    if (!unit.ok()) return unit.status();
    w->units_.push_back(*std::move(unit));
  }
  return w;
}

Worker::~Worker() {
  mha_.reset();
  mla_.reset();
  units_.clear();
  if (stream_ != nullptr) {
    cudaStreamSynchronize(stream_);
    cudaStreamDestroy(stream_);
  }
}

absl::StatusOr<DeviceKv*> Worker::Pool(const Options& o, v1::PoolKind kind) {
  std::unique_ptr<DeviceKv>& pool = kind == v1::MLA ? mla_ : mha_;
  if (pool == nullptr) {
    const v1::PoolSpec spec = BenchPoolSpec(kind, v1::LAYER_FIRST, 1, o.layers, o.tokens);
    absl::StatusOr<std::unique_ptr<DeviceKv>> created = DeviceKv::Create(
        kind == v1::MLA ? 1 : 2, o.layers, 2 * o.tokens, kvhost::DeviceRowBytes(spec));
    if (!created.ok()) return created.status();
    pool = *std::move(created);
    if (absl::Status s = pool->Fill(0, stream_); !s.ok()) return s;
  }
  return pool.get();
}

absl::StatusOr<ComputeTime> MeasureAlone(ComputeUnit& unit, cudaStream_t stream, double seconds) {
  ComputeLoop loop(unit, stream);
  loop.Start();
  loop.WaitCompleted(2);
  loop.OpenWindow();
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  loop.CloseWindow();
  return loop.Stop();
}

absl::StatusOr<Cost> MeasureCost(ComputeUnit& unit, cudaStream_t stream, double alone_ms,
                                 double duty, double min_s,
                                 const std::function<absl::Status()>& transfer) {
  ComputeLoop loop(unit, stream);
  loop.Start();
  loop.WaitCompleted(2);
  // The baseline: the unit alone right before and right after the
  // transfers, in the same loop, averaged. The GPU's clocks drift with its
  // temperature and power by more than the costs measured here: against a
  // baseline from the run's start, copy-engine transfers that cost nothing
  // showed +12 % right after a window that kept the GPU busy; against the
  // window before alone, a GPU that idled during the case's setup still
  // boosts its clocks and every cost reads several points too high.
  const auto alone = [&loop, min_s]() {
    const uint64_t id = loop.OpenWindow();
    std::this_thread::sleep_for(std::chrono::duration<double>(std::min(kAdjacentAloneS, min_s)));
    while (loop.InWindow() < kMinWindowUnits && !loop.failed()) {
      std::this_thread::sleep_for(kPollAlone);
    }
    loop.CloseWindow();
    return id;
  };
  const uint64_t before_window = alone();
  const uint64_t window = loop.OpenWindow();
  Cost cost;
  cost.worker = unit.name();
  cost.duty = duty;
  const Clock::time_point start = Clock::now();
  absl::Status s;
  while (true) {
    const double elapsed = Seconds(Clock::now() - start);
    if (cost.transfers > 0 && elapsed >= min_s &&
        (loop.InWindow() >= kMinWindowUnits || elapsed >= min_s + kMaxWindowStretchS)) {
      break;
    }
    const Clock::time_point t0 = Clock::now();
    s = transfer();
    if (!s.ok()) break;
    ++cost.transfers;
    if (duty < 1) {
      std::this_thread::sleep_for((Clock::now() - t0) * (1 / duty - 1));
    }
  }
  cost.window_s = Seconds(Clock::now() - start);
  loop.CloseWindow();
  const uint64_t after_window = alone();
  absl::StatusOr<ComputeTime> stopped = loop.Stop();
  if (!s.ok()) return s;
  if (!stopped.ok()) return stopped.status();
  absl::StatusOr<ComputeTime> t = loop.Mean(window);
  if (!t.ok()) return t.status();
  absl::StatusOr<ComputeTime> before = loop.Mean(before_window);
  if (!before.ok()) return before.status();
  absl::StatusOr<ComputeTime> after = loop.Mean(after_window);
  if (!after.ok()) return after.status();
  cost.units = t->units;
  cost.unit_ms = t->ms;
  cost.alone_before_ms = before->ms;
  cost.alone_after_ms = after->ms;
  cost.alone_ms = (before->ms + after->ms) / 2;
  cost.run_alone_ms = alone_ms;
  cost.cost_pct = (t->ms / cost.alone_ms - 1) * 100;
  return cost;
}

absl::Status MeasureCosts(const Options& o, Worker& w, const Results& results, bool slow,
                          const std::function<absl::Status()>& transfer, std::vector<Cost>& costs) {
  for (size_t u = 0; u < w.units().size(); ++u) {
    for (double duty : o.duties) {
      // A slow case: back to back only, over one transfer (its cost at a
      // duty cycle would take 1 / duty transfers of seconds each).
      if (slow && duty < 1) continue;
      absl::StatusOr<Cost> cost =
          MeasureCost(*w.units()[u], w.stream(), results.workers[u].alone_ms, duty,
                      slow ? 0 : o.window_s, transfer);
      if (!cost.ok()) return cost.status();
      costs.push_back(*cost);
    }
  }
  return absl::OkStatus();
}

}  // namespace kvhost::bench
