// The GPU worker that kvhost_cuda_transfer_bench plays: its stream, its
// device KV pools (DeviceKv: filled with known bytes, checked after
// transfers), its compute (ComputeUnit: a cuBLAS bf16 GEMM or a one-wave FMA
// kernel, looped on its stream by a thread) and the measurement of what
// transfers cost that compute (MeasureAlone, MeasureCost), plus the CUDA
// helpers the other bench files share.
//
// Everything here runs on device kDevice. A Worker and its pools are used by
// the benchmark's main thread; a compute loop's thread only launches the
// unit and records events. Objects own their CUDA resources and release them
// in their destructors (before the context goes).
#ifndef KVHOST_BENCH_CUDA_BENCH_WORKER_H_
#define KVHOST_BENCH_CUDA_BENCH_WORKER_H_

#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "bench/cuda_bench_options.h"
#include "bench/cuda_bench_report.h"

namespace kvhost::bench {

constexpr int kDevice = 0;  // CUDA_VISIBLE_DEVICES picks the GPU

// OK for cudaSuccess, else INTERNAL "what: error" (a non-sticky error is
// cleared).
absl::Status Cuda(cudaError_t e, absl::string_view what);
absl::StatusOr<double> ElapsedMs(cudaEvent_t from, cudaEvent_t to);

// Timing events, destroyed with the object.
class Events {
 public:
  static absl::StatusOr<std::unique_ptr<Events>> Create(int n);
  ~Events();
  Events(const Events&) = delete;
  Events& operator=(const Events&) = delete;
  cudaEvent_t operator[](size_t i) const { return events_[i]; }

 private:
  Events() = default;
  std::vector<cudaEvent_t> events_;
};

// The worker's device KV pool of one kind: per plane (K then V for MHA; the
// latent for MLA) and layer, `rows` rows of `row_bytes` in GPU memory,
// several layer buffers per cudaMalloc allocation (as a worker's caching
// allocator shares them). Buffer b = plane * layers + layer holds KV words
// from b * rows * row_words on (cuda_bench_kernels.h), so every row of
// every buffer has its own bytes and Check knows what each row must hold.
class DeviceKv {
 public:
  static absl::StatusOr<std::unique_ptr<DeviceKv>> Create(uint32_t planes, uint32_t layers,
                                                          uint64_t rows, uint64_t row_bytes);
  ~DeviceKv();
  DeviceKv(const DeviceKv&) = delete;
  DeviceKv& operator=(const DeviceKv&) = delete;

  uint64_t rows() const { return rows_; }
  uint64_t row_bytes() const { return row_bytes_; }
  uint32_t buffers() const { return planes_ * layers_; }
  uint64_t layer_bytes() const { return rows_ * row_bytes_; }
  // The layer buffers of `plane`; empty for a plane the pool lacks (MLA V).
  std::vector<void*> layers(uint32_t plane) const;
  // Every buffer, b = plane * layers + layer.
  std::vector<void*> all_buffers() const;

  // Every buffer gets seed's KV words; returns once they are on the device.
  absl::Status Fill(uint64_t seed, cudaStream_t stream);
  // After Fill(seed) and transfers: row dst[i] of every buffer must hold
  // what row src[i] was filled with, every other row its own fill.
  // DATA_LOSS naming the first wrong buffer and row otherwise.
  absl::Status Check(uint64_t seed, const std::vector<int64_t>& dst,
                     const std::vector<int64_t>& src, cudaStream_t stream);

 private:
  DeviceKv(uint32_t planes, uint32_t layers, uint64_t rows, uint64_t row_bytes)
      : planes_(planes), layers_(layers), rows_(rows), row_bytes_(row_bytes) {}
  uint8_t* buffer(uint32_t b) const;
  uint64_t FirstWord(uint32_t b) const { return b * (layer_bytes() / 8); }

  const uint32_t planes_, layers_;
  const uint64_t rows_, row_bytes_;
  std::vector<uint8_t*> allocations_;
  int64_t* source_rows_ = nullptr;
  unsigned long long* counters_ = nullptr;
};

// One unit of the worker's compute, enqueued on a stream: a GEMM or an FMA
// kernel. Launch is called from the compute loop's thread only.
class ComputeUnit {
 public:
  virtual ~ComputeUnit() = default;
  virtual const std::string& name() const = 0;  // "gemm", "fma"
  virtual const std::string& what() const = 0;  // its shape, for the report
  virtual absl::Status Launch(cudaStream_t stream) = 0;
};

// The worker: its stream, its compute units (by name, in --workers order)
// and its device pools. Create loads cuBLAS when --workers has gemm:
// NOT_FOUND (what was tried) when it cannot, unless `gemm_optional`, where
// the GEMM unit is then left out and *cublas says why.
class Worker {
 public:
  static absl::StatusOr<std::unique_ptr<Worker>> Create(const Options& o, bool gemm_optional,
                                                        std::string* cublas);
  ~Worker();
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  cudaStream_t stream() const { return stream_; }
  const std::vector<std::unique_ptr<ComputeUnit>>& units() const { return units_; }
  // The device pool of `kind` (2 x tokens rows), made and filled on first use.
  absl::StatusOr<DeviceKv*> Pool(const Options& o, v1::PoolKind kind);

 private:
  Worker() = default;
  cudaStream_t stream_ = nullptr;
  std::vector<std::unique_ptr<ComputeUnit>> units_;
  std::unique_ptr<DeviceKv> mha_, mla_;
};

struct ComputeTime {
  double ms = 0;       // mean per unit
  uint64_t units = 0;  // units averaged
};

// The unit looped on `stream` alone for `seconds`.
absl::StatusOr<ComputeTime> MeasureAlone(ComputeUnit& unit, cudaStream_t stream, double seconds);

// The unit looped on `stream` while `transfer` (one whole transfer, waited
// for) repeats at `duty`: after each transfer the loop stays idle
// (1 / duty - 1) times its duration, so the window holds whole cycles. The
// window lasts at least `min_s` and one cycle, and until a few units
// finished inside it. The cost is against the unit alone in the same loop,
// the mean of a short window right before and one right after; `alone_ms`
// (the run's start) is kept in the result for comparison.
absl::StatusOr<Cost> MeasureCost(ComputeUnit& unit, cudaStream_t stream, double alone_ms,
                                 double duty, double min_s,
                                 const std::function<absl::Status()>& transfer);

// Every worker unit's cost (MeasureCost) at every --duty, appended to
// `costs`: the one loop of the cases, the anchor and the node cache. With
// `slow`, back to back only and over one transfer (min_s 0).
absl::Status MeasureCosts(const Options& o, Worker& w, const Results& results, bool slow,
                          const std::function<absl::Status()>& transfer, std::vector<Cost>& costs);

}  // namespace kvhost::bench

#endif  // KVHOST_BENCH_CUDA_BENCH_WORKER_H_
