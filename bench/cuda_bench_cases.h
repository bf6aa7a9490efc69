// The kvhost side of kvhost_cuda_transfer_bench: transfers through a running
// kvhostd (one per --transfer-path) between the worker's device KV pools and
// host pools whose slots come from the daemon's own allocator, and the
// measurements made of them: a case (speed, bytes verified, worker costs),
// duplex, and time to first layer.
//
// Host slots: a case's random choices come from CaseRng, a function of the
// seed and the case alone, so every path (and the in-process anchor) moves
// the same device rows and, as long as the daemon's allocator is
// deterministic, gets the same host slots from the same churn.
//
// Used from the benchmark's main thread; the duplex starts one more thread
// of its own. Every pool a function creates it deletes, whatever happened.
#ifndef KVHOST_BENCH_CUDA_BENCH_CASES_H_
#define KVHOST_BENCH_CUDA_BENCH_CASES_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "bench/cuda_bench_options.h"
#include "bench/cuda_bench_report.h"
#include "bench/cuda_bench_worker.h"
#include "kvhost/client.h"
#include "kvhost/cuda_export.h"
#include "kvhost/worker_copy.h"

namespace kvhost::bench {

// The worker path (kvhostd --worker-copy): this process runs each copy
// through a kvhost::WorkerCopier on its own copy stream (not the compute
// units' stream), at `blocks` 256-thread blocks (the anchor's first quota).
// WithAttachedPool opens `copier` on each attachment and closes it before
// the detach.
struct WorkerSide {
  cudaStream_t stream = nullptr;
  int blocks = 8;
  std::unique_ptr<kvhost::WorkerCopier> copier;
};

// The path whose daemon runs now.
struct PathRun {
  std::string path;              // --transfer-path, or "worker"
  std::string ticket_path;       // what its tickets must report; empty for auto
  WorkerSide* worker = nullptr;  // the worker path only
};

// One progress line per case and direction on stderr, with the seconds since
// the start; after each case the --json-out snapshot is rewritten.
struct Progress {
  int done = 0;
  int total = 0;
  double start_s = 0;  // steady clock seconds at the start
  std::function<void()> snapshot = [] {};
  double elapsed_s() const;
};

// The random source of one case (kind, layout, page size) under --seed.
std::mt19937_64 CaseRng(const Options& o, v1::PoolKind kind, v1::Layout layout, uint32_t page_size);

// Pages 0 .. n-1 in random order.
std::vector<uint64_t> ShuffledPages(uint64_t n, std::mt19937_64& rng);
// The slots of pages[first, first + count).
std::vector<int64_t> PageSlots(const std::vector<uint64_t>& pages, uint64_t first, uint64_t count,
                               uint32_t page_size);

// Creates the host pool `name` of `spec` (need_tokens + --tokens slots),
// takes `need_tokens` host slots from it as --host-slots says (churned: the
// daemon's Alloc after --churn-ops random Alloc / Free calls), runs `body`
// with them, then deletes the pool.
absl::Status WithHostSlots(
    const Options& o, kvhost::Client& client, const std::string& name, const v1::PoolSpec& spec,
    uint64_t need_tokens, std::mt19937_64& rng,
    const std::function<absl::Status(const v1::Pool&, const std::vector<int64_t>&)>& body);

// Makes `stream` wait until layer `layer` of `load` is on the device: the one
// place the benchmark waits for a layer, as a worker's forward pass would.
absl::Status WaitForLayer(const kvhost::LoadEvents& events, const kvhost::LoadTicket& load,
                          uint32_t layer, cudaStream_t stream);

// One case on the running daemon: the byte check (a backup, a load into
// other rows, every device row checked), then per direction the timed
// transfers and every worker's cost at every duty cycle. Appends to
// results.cases.
absl::Status RunCase(const Options& o, const PathRun& run, const Case& c, kvhost::Client& client,
                     Worker& w, uint64_t& fill_seed, Results& results, Progress& progress);

// A backup loop and a load loop at once (MHA, LAYER_FIRST, kProbePageSize)
// against each direction alone. Appends to results.duplex.
absl::Status RunDuplex(const Options& o, const PathRun& run, kvhost::Client& client, Worker& w,
                       Results& results);

// A call that starts a load and returns its ticket with its event set:
// LoadWithEvents, or a node cache's Restore.
using LayerLoadSubmit = std::function<absl::StatusOr<kvhost::LoadTicket>()>;

// One timed load of a time-to-first-layer series: event 0 on `stream`
// before `submit`, 1 when it returned, 2 when layer 0 may be used, 3 when
// the last layer may; with `keep`, the three times and the ticket's daemon
// side are appended to `r` (else it warms up). Its ticket must end well.
absl::Status TimedLayerLoad(const Options& o, const PathRun& run, kvhost::Client& client,
                            const kvhost::LoadEvents& events, const LayerLoadSubmit& submit,
                            cudaStream_t stream, const Events& ev, TtflResult& r, bool keep);
// Timed loads of a series whose transfer takes `transfer_s`: about 2 s of
// them, 3 to 10.
int TtflSamples(double transfer_s);
// The medians, target and verdict of `r` from its samples, whether
// `client`'s calls went over the fast path; one line on stderr.
void FinishTtfl(const kvhost::Client& client, TtflResult& r);

// Time to first layer of MHA LAYER_FIRST loads at `page_size`, from the
// event recorded before the Load call. Appends to results.ttfl.
absl::Status RunTtfl(const Options& o, const PathRun& run, uint32_t page_size,
                     kvhost::Client& client, Worker& w, Results& results);

}  // namespace kvhost::bench

#endif  // KVHOST_BENCH_CUDA_BENCH_CASES_H_
