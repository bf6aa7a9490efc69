// The node cache on the GPU (kvhost.v1.CacheService: a pool created with
// PoolSpec.node_cache, its pages addressed by key): what
// kvhost_cuda_transfer_bench measures of it, beside the index-addressed
// pools' cases of the same run.
//
// Per --cache-page-sizes page size, on the run's path: an MHA node cache
// of --cache-layout holding twice --tokens, the worker's device pool
// attached to it with layer progress. First a byte check: --tokens worth
// of new keys stored from random device pages, restored into other pages,
// every device row checked. Then per direction --repeats timed calls
// (Store of new keys, so each one writes every page and the cache evicts
// the oldest; Restore of the stored ones), GB/s over the tickets' time as
// a ratio to the same ceiling as the cases, and every worker's cost at
// every --duty, as for a case. Then a time-to-first-layer series of
// Restores through the layer counters (results.ttfl, call "Restore").
//
// Used from the benchmark's main thread; the cache's pool is deleted
// whatever happened.
#ifndef KVHOST_BENCH_CUDA_BENCH_CACHE_H_
#define KVHOST_BENCH_CUDA_BENCH_CACHE_H_

#include <cstdint>

#include "absl/status/status.h"
#include "bench/cuda_bench_cases.h"
#include "bench/cuda_bench_options.h"
#include "bench/cuda_bench_report.h"
#include "bench/cuda_bench_worker.h"
#include "kvhost/client.h"

namespace kvhost::bench {

// The node cache case at `page_size` (see above). Appends to
// results.cache_cases (backup = Store) and results.ttfl.
absl::Status RunCacheCase(const Options& o, const PathRun& run, uint32_t page_size,
                          kvhost::Client& client, Worker& w, uint64_t& fill_seed, Results& results,
                          Progress& progress);

}  // namespace kvhost::bench

#endif  // KVHOST_BENCH_CUDA_BENCH_CACHE_H_
