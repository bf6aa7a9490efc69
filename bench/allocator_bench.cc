// kvhost_allocator_bench: how long the runs of consecutive pages are that a
// pool's allocator hands out after churn, and how fast it is, for
// PageAllocator (server/pool/allocator.h: free extents, best fit) against the
// FIFO ring it replaced (the seeds' free_slots order, modelled in
// tests/allocator_models.h). A transfer's copy pieces are as long as the runs
// of its host slots, so the runs decide whether copies go at link speed.
//
// Both see the same sequence of calls (alloc_model::Churn): requests of
// 1..--max-request pages, every --large-every-th one exactly --max-request
// pages, allocated while the pool stays at most --occupancy full, else a
// random live allocation freed. Reported per allocator, for all allocations
// and for the --max-request ones: mean pages per run, p50 / p90 run length
// (over runs), the fraction of pages in runs of >= 16 and >= 64 pages, and
// Alloc + Free calls per second (time inside the calls only; the ring does
// the old allocator's per-call and per-page work around it). In-process, no daemon. A table on
// stdout, --json-out writes the same as JSON, a progress line per allocator
// on stderr. Exit codes: 0 done, 1 a call failed, 2 bad flags.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "bench/bench_util.h"
#include "common/cli_flags.h"
#include "server/pool/allocator.h"
#include "tests/allocator_models.h"

ABSL_FLAG(uint64_t, pages, 65536, "Pages in the pool.");
ABSL_FLAG(uint64_t, page_size, 1, "Token slots per page (Alloc asks for pages * page_size).");
ABSL_FLAG(uint64_t, ops, 20000, "Alloc and Free calls, in all.");
ABSL_FLAG(uint64_t, max_request, 4096, "Largest request, in pages.");
ABSL_FLAG(uint64_t, large_every, 8, "Every N-th request is exactly --max-request pages.");
ABSL_FLAG(double, occupancy, 0.85, "Allocate only while the pool stays at most this full.");
ABSL_FLAG(uint64_t, seed, 1, "Seed of the request sequence.");
ABSL_FLAG(std::string, json_out, "", "Write the results as JSON to this file.");

namespace {

namespace bench = kvhost::bench;
namespace model = kvhost::alloc_model;

// Pools above this would take minutes to churn through the FIFO model's
// deque and are not what a benchmark run is for (2^30 pages = 8 GiB of ring).
constexpr uint64_t kMaxPages = uint64_t{1} << 30;

struct Options {
  model::ChurnOptions churn;
  uint64_t page_size = 1;
};

absl::StatusOr<Options> OptionsFromFlags() {
  Options o;
  o.churn.pages = absl::GetFlag(FLAGS_pages);
  o.churn.ops = absl::GetFlag(FLAGS_ops);
  o.churn.max_request = absl::GetFlag(FLAGS_max_request);
  o.churn.large_every = absl::GetFlag(FLAGS_large_every);
  o.churn.occupancy = absl::GetFlag(FLAGS_occupancy);
  o.churn.seed = absl::GetFlag(FLAGS_seed);
  o.page_size = absl::GetFlag(FLAGS_page_size);
  if (o.churn.pages == 0 || o.churn.pages > kMaxPages) {
    return absl::InvalidArgumentError(
        absl::StrCat("--pages ", o.churn.pages, " out of range [1, ", kMaxPages, "]"));
  }
  if (o.page_size == 0) return absl::InvalidArgumentError("--page-size must be >= 1");
  if (o.churn.ops == 0) return absl::InvalidArgumentError("--ops must be >= 1");
  if (o.churn.max_request == 0 || o.churn.max_request > o.churn.pages) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--max-request ", o.churn.max_request, " out of range [1, --pages ", o.churn.pages, "]"));
  }
  if (o.churn.large_every == 0) return absl::InvalidArgumentError("--large-every must be >= 1");
  if (!(o.churn.occupancy > 0 && o.churn.occupancy <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--occupancy ", o.churn.occupancy, " out of range (0, 1]"));
  }
  return o;
}

// PageAllocator in the shape Churn drives; the first failed call is kept.
struct ExtentAllocator {
  kvhost::PageAllocator a;
  absl::Status failed;
  ExtentAllocator(uint64_t pages, uint64_t page_size) : a(pages, page_size) {}
  std::vector<uint64_t> Alloc(uint64_t n) {
    std::vector<uint64_t> pages;
    absl::Status s = a.Alloc(n * a.page_size(), &pages);
    if (!s.ok() && failed.ok()) failed = s;
    return pages;
  }
  void Free(const std::vector<uint64_t>& pages) {
    absl::Status s = a.FreePages(pages);
    if (!s.ok() && failed.ok()) failed = s;
  }
};

// The ring with what the allocator it models did per call and per page, so
// that the speeds compare: a mutex, a flag set on Alloc, checked on Free (all
// first, for all or nothing) and then cleared.
struct OldAllocator {
  absl::Mutex mu;
  model::FifoRing ring ABSL_GUARDED_BY(mu);
  std::vector<uint8_t> allocated ABSL_GUARDED_BY(mu);
  absl::Status failed;
  explicit OldAllocator(uint64_t pages) : ring(pages), allocated(pages, 0) {}
  std::vector<uint64_t> Alloc(uint64_t n) {
    absl::MutexLock lock(&mu);
    std::vector<uint64_t> pages = ring.Alloc(n);
    for (uint64_t p : pages) allocated[p] = 1;
    return pages;
  }
  void Free(const std::vector<uint64_t>& pages) {
    absl::MutexLock lock(&mu);
    for (uint64_t p : pages) {
      if (!allocated[p] && failed.ok()) failed = absl::InternalError(absl::StrCat("page ", p));
    }
    for (uint64_t p : pages) allocated[p] = 0;
    ring.Free(pages);
  }
};

struct RunSummary {
  uint64_t allocations = 0;
  uint64_t runs = 0;
  double mean = 0;  // pages per run
  double p50 = 0;
  double p90 = 0;
  double at_least_16 = 0;  // fraction of pages in runs of >= 16 pages
  double at_least_64 = 0;
};

RunSummary Summarize(const std::vector<uint64_t>& runs, uint64_t allocations) {
  RunSummary s;
  s.allocations = allocations;
  s.runs = runs.size();
  s.mean = model::MeanRun(runs);
  std::vector<double> sorted(runs.begin(), runs.end());
  std::sort(sorted.begin(), sorted.end());
  s.p50 = bench::Percentile(sorted, 0.5);
  s.p90 = bench::Percentile(sorted, 0.9);
  uint64_t pages = 0, long16 = 0, long64 = 0;
  for (uint64_t r : runs) {
    pages += r;
    if (r >= 16) long16 += r;
    if (r >= 64) long64 += r;
  }
  if (pages > 0) {
    s.at_least_16 = static_cast<double>(long16) / static_cast<double>(pages);
    s.at_least_64 = static_cast<double>(long64) / static_cast<double>(pages);
  }
  return s;
}

struct Result {
  std::string allocator;
  model::ChurnStats stats;
  RunSummary all;
  RunSummary large;
  double ops_per_s = 0;
};

template <typename Allocator>
Result Measure(const std::string& name, Allocator& a, const Options& o) {
  absl::FPrintF(stderr, "%s: %d calls on %d pages...\n", name, o.churn.ops, o.churn.pages);
  const auto start = std::chrono::steady_clock::now();
  Result r;
  r.allocator = name;
  r.stats = model::Churn(a, o.churn);
  r.all = Summarize(r.stats.runs, r.stats.allocs);
  r.large = Summarize(r.stats.large_runs, r.stats.large_allocs);
  const double calls = static_cast<double>(r.stats.allocs + r.stats.frees);
  r.ops_per_s = r.stats.call_seconds > 0 ? calls / r.stats.call_seconds : 0;
  absl::FPrintF(stderr, "%s: done in %.2f s (mean occupancy %.3f)\n", name,
                std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(),
                r.stats.mean_occupancy);
  return r;
}

std::string SummaryJson(const RunSummary& s) {
  return bench::JsonObject()
      .Uint("allocations", s.allocations)
      .Uint("runs", s.runs)
      .Num("mean_pages_per_run", s.mean, 2)
      .Num("p50_run_pages", s.p50, 0)
      .Num("p90_run_pages", s.p90, 0)
      .Num("pages_in_runs_ge_16", s.at_least_16, 4)
      .Num("pages_in_runs_ge_64", s.at_least_64, 4)
      .str();
}

absl::Status Run(const Options& o) {
  ExtentAllocator extents(o.churn.pages, o.page_size);
  OldAllocator ring(o.churn.pages);
  std::vector<Result> results;
  results.push_back(Measure("extents", extents, o));
  if (!extents.failed.ok()) return extents.failed;
  results.push_back(Measure("fifo ring", ring, o));
  if (!ring.failed.ok()) return ring.failed;

  std::vector<std::vector<std::string>> rows = {{"ALLOCATOR", "ALLOCATIONS", "ALLOCS", "RUNS",
                                                 "PAGES/RUN", "P50 RUN", "P90 RUN", "IN RUNS>=16",
                                                 "IN RUNS>=64", "OPS/S"}};
  std::vector<std::string> json_results;
  const std::string large = absl::StrCat(o.churn.max_request, " pages");
  for (const Result& r : results) {
    for (const auto& [what, s] :
         {std::pair<std::string, const RunSummary*>{"all", &r.all}, {large, &r.large}}) {
      rows.push_back({r.allocator, what, absl::StrCat(s->allocations), absl::StrCat(s->runs),
                      absl::StrFormat("%.1f", s->mean), absl::StrFormat("%.0f", s->p50),
                      absl::StrFormat("%.0f", s->p90),
                      absl::StrFormat("%.1f%%", 100 * s->at_least_16),
                      absl::StrFormat("%.1f%%", 100 * s->at_least_64),
                      what == "all" ? absl::StrFormat("%.0f", r.ops_per_s) : ""});
    }
    json_results.push_back(bench::JsonObject()
                               .Str("allocator", r.allocator)
                               .Uint("allocs", r.stats.allocs)
                               .Uint("frees", r.stats.frees)
                               .Num("mean_occupancy", r.stats.mean_occupancy, 4)
                               .Num("call_seconds", r.stats.call_seconds, 6)
                               .Num("ops_per_s", r.ops_per_s, 0)
                               .Raw("all", SummaryJson(r.all))
                               .Raw("large", SummaryJson(r.large))
                               .str());
  }
  bench::PrintTable(rows, "llrrrrrrrr");
  const double gain = results[1].large.mean > 0 ? results[0].large.mean / results[1].large.mean : 0;
  absl::PrintF(
      "(%d pages of %d slots, %d calls, requests 1..%d pages with every %d-th %d, occupancy <= "
      "%.2f, seed %d; %s allocations: %.1fx the ring's pages per run)\n",
      o.churn.pages, o.page_size, o.churn.ops, o.churn.max_request, o.churn.large_every,
      o.churn.max_request, o.churn.occupancy, o.churn.seed, large, gain);

  const std::string json_out = absl::GetFlag(FLAGS_json_out);
  if (json_out.empty()) return absl::OkStatus();
  const std::string json = bench::JsonObject()
                               .Str("benchmark", "kvhost_allocator_bench")
                               .Uint("pages", o.churn.pages)
                               .Uint("page_size", o.page_size)
                               .Uint("ops", o.churn.ops)
                               .Uint("max_request", o.churn.max_request)
                               .Uint("large_every", o.churn.large_every)
                               .Num("occupancy", o.churn.occupancy, 4)
                               .Uint("seed", o.churn.seed)
                               .Num("large_gain_over_fifo", gain, 2)
                               .Raw("results", bench::JsonArray(json_results))
                               .str();
  return bench::WriteJsonOut(json_out, json);
}

}  // namespace

int main(int argc, char** argv) {
  kvhost::ParseFlags(argc, argv,
                     "kvhost_allocator_bench: run lengths and speed of the page allocator after "
                     "churn, against the FIFO ring it replaced.\n"
                     "Usage: kvhost_allocator_bench [--pages=65536] [--page-size=1] "
                     "[--ops=20000] [--max-request=4096] [--occupancy=0.85] [--seed=1] "
                     "[--json-out=FILE]",
                     "bench/allocator_bench.cc");
  return bench::Finish(OptionsFromFlags(), Run);
}
