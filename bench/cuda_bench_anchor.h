// The in-process anchor of kvhost_cuda_transfer_bench: what kvhost replaces,
// measured in the same run. An in-process host pool (sglang's kernel io
// path, its default LAYER_FIRST page-1 host layout) copies a worker's KV
// rows with a warp-per-item kernel in the worker's own CUDA context,
// zero-copy into pinned host memory mapped into the device, on a grid of a
// few 1024-thread blocks (the block quota). Here that kernel
// (cuda_bench_kernels.h) runs in this process, between the worker's device
// pool and a host buffer of its own, on the same device rows and host slots
// as the kvhost case MHA / MLA LAYER_FIRST page 1 (CaseRng, and host slots
// from the daemon's allocator after the same churn); bytes verified, GB/s
// and every worker's cost at every duty cycle, per quota and direction.
//
// Used from the benchmark's main thread while a kvhostd runs (it hands out
// the slots). Owns and frees its pinned buffer and stream.
#ifndef KVHOST_BENCH_CUDA_BENCH_ANCHOR_H_
#define KVHOST_BENCH_CUDA_BENCH_ANCHOR_H_

#include <cstdint>

#include "absl/status/status.h"
#include "bench/cuda_bench_cases.h"
#include "bench/cuda_bench_options.h"
#include "bench/cuda_bench_report.h"
#include "bench/cuda_bench_worker.h"
#include "kvhost/client.h"

namespace kvhost::bench {

// The anchor for `kind` at every --anchor-quotas value and direction.
// Appends to results.anchor.
absl::Status RunAnchor(const Options& o, kvhost::Client& client, Worker& w, v1::PoolKind kind,
                       uint64_t& fill_seed, Results& results, Progress& progress);

}  // namespace kvhost::bench

#endif  // KVHOST_BENCH_CUDA_BENCH_ANCHOR_H_
