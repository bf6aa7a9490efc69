// kvhost_rpc_bench: latency and throughput of the allocator RPCs, the calls a
// scheduler makes on every request. One round trip is Alloc(page_size tokens)
// then Free of the page it returned. Each case runs N client threads at once
// (--clients, default 1 and 8), each with its own Client and connection, as
// separate scheduler processes would have; after a warm-up, a case runs for
// --seconds, or --iterations round trips per thread.
//
// Two floors are measured in the same run, so the allocator's cost can be
// read as a ratio: two grpc.health.v1 Check calls per round trip on the same
// connections (what any two unary gRPC calls cost on this machine), and two
// one-byte ping-pongs over a plain unix socket pair between two processes (what
// any two round trips between processes cost).
//
// It starts its own kvhostd (host backend, private socket and shm dir) unless
// --server names a running one; it creates one small pool and deletes it at
// the end. Prints one progress line per case, then a table; --json-out writes
// the same numbers as JSON. Exit codes: 0 done, 1 a call failed, 2 bad flags.
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "bench/bench_util.h"
#include "common/cli_flags.h"
#include "kvhost/client.h"
#include "tests/daemon_fixture.h"

ABSL_FLAG(std::string, server, "",
          "kvhostd to measure ('unix:///path.sock'); empty = start a private kvhostd.");
ABSL_FLAG(std::string, kvhostd, KVHOSTD_PATH, "kvhostd binary to start when --server is empty.");
ABSL_FLAG(std::vector<std::string>, clients, std::vector<std::string>({"1", "8"}),
          "Cases: concurrent client threads, comma separated.");
ABSL_FLAG(double, seconds, 5, "Measured seconds per case (unless --iterations is set).");
ABSL_FLAG(double, warmup_seconds, 1, "Unmeasured round trips before each case, in seconds.");
ABSL_FLAG(uint64_t, iterations, 0,
          "Round trips per client thread per case; when > 0 it replaces --seconds.");
ABSL_FLAG(uint32_t, page_size, 16, "Page size of the pool; each Alloc asks for one page.");
ABSL_FLAG(std::string, json_out, "", "Write the results as JSON to this file.");

namespace {

using Clock = std::chrono::steady_clock;
namespace bench = kvhost::bench;
namespace v1 = kvhost::v1;

// Pages in the benchmark pool: every thread holds at most one at a time, so
// this only needs to exceed the thread count (each round trip splits one free
// extent and joins it again; bench/allocator_bench.cc measures churn).
constexpr uint64_t kPoolPages = 4096;

struct Plan {
  Clock::time_point measure_start;  // warm-up ends here
  Clock::time_point measure_end;    // time mode
  uint64_t iterations = 0;          // iteration mode when > 0
};

struct ThreadResult {
  std::vector<double> latencies_us;
  Clock::time_point end;
  absl::Status status;
};

struct CaseResult {
  std::string what;
  uint64_t clients = 0;
  uint64_t round_trips = 0;
  double seconds = 0;
  double ops_per_s = 0;
  double p50_us = 0, p99_us = 0, p999_us = 0, max_us = 0;
};

// One measured round trip on one client.
using RoundTrip = std::function<absl::Status(kvhost::Client&)>;

RoundTrip AllocFree(const std::string& pool, uint64_t tokens) {
  return [pool, tokens](kvhost::Client& client) -> absl::Status {
    absl::StatusOr<std::vector<int64_t>> slots = client.Alloc(pool, tokens);
    if (!slots.ok()) return slots.status();
    return client.Free(pool, *slots).status();
  };
}

// The gRPC floor: two unary calls that do no work in kvhost's code.
absl::Status TwoHealthChecks(kvhost::Client& client) {
  for (int i = 0; i < 2; ++i) {
    absl::StatusOr<std::string> health = client.Health();
    if (!health.ok()) return health.status();
  }
  return absl::OkStatus();
}

void RunClient(kvhost::Client* client, const RoundTrip& round_trip, const Plan& plan,
               ThreadResult* out) {
  while (Clock::now() < plan.measure_start) {
    out->status = round_trip(*client);
    if (!out->status.ok()) return;
  }
  for (uint64_t i = 0; plan.iterations == 0 || i < plan.iterations; ++i) {
    const Clock::time_point start = Clock::now();
    if (plan.iterations == 0 && start >= plan.measure_end) break;
    out->status = round_trip(*client);
    if (!out->status.ok()) return;
    out->latencies_us.push_back(
        std::chrono::duration<double, std::micro>(Clock::now() - start).count());
  }
  out->end = Clock::now();
}

// One Client per thread. gRPC lets channels with equal arguments to one
// address share a connection; a per-client message limit (never reached by
// these calls) makes the arguments differ, so each thread has its own
// connection as a separate scheduler process would.
absl::StatusOr<std::vector<std::unique_ptr<kvhost::Client>>> MakeClients(const std::string& address,
                                                                         uint64_t n) {
  std::vector<std::unique_ptr<kvhost::Client>> clients;
  for (uint64_t i = 0; i < n; ++i) {
    kvhost::ClientOptions options;
    options.address = address;
    options.timeout = absl::Seconds(30);
    options.max_message_bytes -= static_cast<int>(i);
    absl::StatusOr<std::unique_ptr<kvhost::Client>> client = kvhost::Client::Connect(options);
    if (!client.ok()) return client.status();
    if (absl::Status s = (*client)->WaitForReady(absl::Seconds(10)); !s.ok()) return s;
    clients.push_back(*std::move(client));
  }
  return clients;
}

absl::StatusOr<CaseResult> RunCase(const std::string& address, const RoundTrip& round_trip,
                                   uint64_t threads) {
  absl::StatusOr<std::vector<std::unique_ptr<kvhost::Client>>> clients =
      MakeClients(address, threads);
  if (!clients.ok()) return clients.status();
  Plan plan;
  // The margin lets every thread start before the measured part begins.
  plan.measure_start = Clock::now() + std::chrono::milliseconds(20) +
                       std::chrono::duration_cast<Clock::duration>(
                           std::chrono::duration<double>(absl::GetFlag(FLAGS_warmup_seconds)));
  plan.measure_end =
      plan.measure_start + std::chrono::duration_cast<Clock::duration>(
                               std::chrono::duration<double>(absl::GetFlag(FLAGS_seconds)));
  plan.iterations = absl::GetFlag(FLAGS_iterations);

  std::vector<ThreadResult> results(threads);
  std::vector<std::thread> workers;
  for (uint64_t t = 0; t < threads; ++t) {
    workers.emplace_back(RunClient, (*clients)[t].get(), std::cref(round_trip), std::cref(plan),
                         &results[t]);
  }
  for (std::thread& w : workers) w.join();

  CaseResult r;
  r.clients = threads;
  std::vector<double> all;
  Clock::time_point end = plan.measure_start;
  for (const ThreadResult& t : results) {
    if (!t.status.ok()) return t.status;
    all.insert(all.end(), t.latencies_us.begin(), t.latencies_us.end());
    end = std::max(end, t.end);
  }
  std::sort(all.begin(), all.end());
  r.round_trips = all.size();
  r.seconds = std::chrono::duration<double>(end - plan.measure_start).count();
  r.ops_per_s = r.seconds > 0 ? r.round_trips / r.seconds : 0;
  r.p50_us = bench::Percentile(all, 0.50);
  r.p99_us = bench::Percentile(all, 0.99);
  r.p999_us = bench::Percentile(all, 0.999);
  r.max_us = all.empty() ? 0 : all.back();
  return r;
}

// The process floor: two one-byte ping-pongs over a unix socket pair between
// this process and a forked echo child, timed like the RPC cases.
absl::StatusOr<CaseResult> RunSocketFloor(uint64_t round_trips) {
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
    return absl::InternalError("socketpair failed");
  }
  const pid_t child = ::fork();
  if (child < 0) return absl::InternalError("fork failed");
  if (child == 0) {
    ::close(sv[0]);
    char c;
    while (::read(sv[1], &c, 1) == 1) {
      if (::write(sv[1], &c, 1) != 1) break;
    }
    ::_exit(0);
  }
  ::close(sv[1]);
  std::vector<double> all;
  all.reserve(round_trips);
  const Clock::time_point begin = Clock::now();
  char c = 'x';
  for (uint64_t i = 0; i < round_trips + round_trips / 10; ++i) {
    const Clock::time_point start = Clock::now();
    for (int k = 0; k < 2; ++k) {
      if (::write(sv[0], &c, 1) != 1 || ::read(sv[0], &c, 1) != 1) {
        ::close(sv[0]);
        ::waitpid(child, nullptr, 0);
        return absl::InternalError("socket ping-pong failed");
      }
    }
    // The first tenth warms up.
    if (i >= round_trips / 10) {
      all.push_back(std::chrono::duration<double, std::micro>(Clock::now() - start).count());
    }
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - begin).count();
  ::close(sv[0]);
  ::waitpid(child, nullptr, 0);
  std::sort(all.begin(), all.end());
  CaseResult r;
  r.what = "floor: 2 unix-socket ping-pongs";
  r.clients = 1;
  r.round_trips = all.size();
  r.seconds = seconds;
  r.ops_per_s = all.size() / seconds;
  r.p50_us = bench::Percentile(all, 0.50);
  r.p99_us = bench::Percentile(all, 0.99);
  r.p999_us = bench::Percentile(all, 0.999);
  r.max_us = all.back();
  return r;
}

struct Options {
  std::vector<uint64_t> clients;
  uint32_t page_size = 0;
};

// Flag mistakes, found before anything starts (exit code 2).
absl::StatusOr<Options> OptionsFromFlags() {
  Options o;
  absl::StatusOr<std::vector<uint64_t>> clients =
      bench::ParsePositiveList("clients", absl::GetFlag(FLAGS_clients));
  if (!clients.ok()) return clients.status();
  o.clients = *clients;
  o.page_size = absl::GetFlag(FLAGS_page_size);
  if (o.page_size == 0) return absl::InvalidArgumentError("--page-size must be >= 1");
  if (absl::GetFlag(FLAGS_iterations) == 0 && !(absl::GetFlag(FLAGS_seconds) > 0)) {
    return absl::InvalidArgumentError("--seconds must be > 0 (or set --iterations)");
  }
  if (!(absl::GetFlag(FLAGS_warmup_seconds) >= 0)) {
    return absl::InvalidArgumentError("--warmup-seconds must be >= 0");
  }
  return o;
}

absl::Status Run(const Options& options) {
  const std::vector<uint64_t>& cases = options.clients;
  const uint32_t page_size = options.page_size;
  std::unique_ptr<kvhost::testing::TestDaemon> daemon;
  std::string address = absl::GetFlag(FLAGS_server);
  if (address.empty()) {
    // Debug logging would put the daemon's log writes into the measurement.
    absl::StatusOr<std::unique_ptr<kvhost::testing::TestDaemon>> started =
        kvhost::testing::TestDaemon::Start(absl::GetFlag(FLAGS_kvhostd), {"--log-level=warn"});
    if (!started.ok()) return started.status();
    daemon = *std::move(started);
    address = daemon->address();
  }
  absl::PrintF("kvhost_rpc_bench: kvhostd at %s%s\n", address,
               daemon ? " (started for this run)" : "");

  absl::StatusOr<std::vector<std::unique_ptr<kvhost::Client>>> admin = MakeClients(address, 1);
  if (!admin.ok()) return admin.status();
  kvhost::Client& client = *admin->front();
  // The smallest row there is: Alloc and Free cost the same whatever a token
  // holds, and a small pool is created at once.
  v1::PoolSpec spec;
  spec.set_kind(v1::MHA);
  spec.set_layout(v1::LAYER_FIRST);
  spec.set_dtype(v1::UINT8);
  spec.set_page_size(page_size);
  spec.set_layer_num(1);
  spec.set_head_num(1);
  spec.set_head_dim(1);
  spec.set_size_tokens(kPoolPages * page_size);
  const std::string pool = absl::StrCat("rpc-bench-", ::getpid());
  absl::StatusOr<v1::Pool> created = client.CreatePool(pool, spec);
  if (!created.ok()) return created.status();

  // The cases: the two floors with one client, then Alloc + Free with each
  // --clients count.
  struct Case {
    std::string what;
    uint64_t threads;
    RoundTrip round_trip;  // empty: the socket floor
  };
  std::vector<Case> plan = {{"floor: 2 unix-socket ping-pongs", 1, nullptr},
                            {"floor: 2 gRPC health checks", 1, TwoHealthChecks}};
  for (uint64_t threads : cases) {
    plan.push_back(
        {absl::StrCat("Alloc(", page_size, ") + Free"), threads, AllocFree(pool, page_size)});
  }
  std::vector<CaseResult> results;
  absl::Status failed;
  for (size_t i = 0; i < plan.size(); ++i) {
    absl::PrintF("[%d/%d] %d client(s), %s: ", i + 1, plan.size(), plan[i].threads, plan[i].what);
    std::fflush(stdout);
    const uint64_t iterations = absl::GetFlag(FLAGS_iterations);
    absl::StatusOr<CaseResult> r = plan[i].round_trip
                                       ? RunCase(address, plan[i].round_trip, plan[i].threads)
                                       : RunSocketFloor(iterations > 0 ? iterations : 20000);
    if (!r.ok()) {
      std::printf("failed\n");
      failed = r.status();
      break;
    }
    r->what = plan[i].what;
    absl::PrintF("%.0f round trips/s, p50 %.1f us, p99 %.1f us (%d round trips in %.2f s)\n",
                 r->ops_per_s, r->p50_us, r->p99_us, r->round_trips, r->seconds);
    results.push_back(*r);
  }
  const absl::StatusOr<uint64_t> deleted = client.DeletePool(pool);
  if (!failed.ok()) return failed;
  if (!deleted.ok()) return deleted.status();

  std::printf("\n");
  std::vector<std::vector<std::string>> rows = {{"CASE", "CLIENTS", "ROUND TRIPS", "OPS/S",
                                                 "P50 US", "P99 US", "P99.9 US", "MAX US",
                                                 "P50 / gRPC FLOOR"}};
  double grpc_floor_p50 = 0;
  for (const CaseResult& r : results) {
    if (absl::StrContains(r.what, "gRPC")) grpc_floor_p50 = r.p50_us;
  }
  std::vector<std::string> json_cases;
  for (const CaseResult& r : results) {
    const double ratio = grpc_floor_p50 > 0 ? r.p50_us / grpc_floor_p50 : 0;
    rows.push_back({r.what, absl::StrCat(r.clients), absl::StrCat(r.round_trips),
                    absl::StrFormat("%.0f", r.ops_per_s), absl::StrFormat("%.1f", r.p50_us),
                    absl::StrFormat("%.1f", r.p99_us), absl::StrFormat("%.1f", r.p999_us),
                    absl::StrFormat("%.1f", r.max_us), absl::StrFormat("%.2f", ratio)});
    json_cases.push_back(bench::JsonObject()
                             .Str("case", r.what)
                             .Uint("clients", r.clients)
                             .Uint("round_trips", r.round_trips)
                             .Num("seconds", r.seconds, 3)
                             .Num("ops_per_s", r.ops_per_s, 1)
                             .Num("p50_us", r.p50_us, 1)
                             .Num("p99_us", r.p99_us, 1)
                             .Num("p999_us", r.p999_us, 1)
                             .Num("max_us", r.max_us, 1)
                             .Num("p50_over_grpc_floor", ratio, 3)
                             .str());
  }
  bench::PrintTable(rows, "lrrrrrrrr");
  std::printf(
      "(a round trip is Alloc of one page then Free of it; ops/s counts round trips of "
      "all clients)\n");

  const std::string json_out = absl::GetFlag(FLAGS_json_out);
  if (!json_out.empty()) {
    const std::string json = bench::JsonObject()
                                 .Str("benchmark", "kvhost_rpc_bench")
                                 .Str("server", address)
                                 .Bool("own_daemon", daemon != nullptr)
                                 .Uint("page_size", page_size)
                                 .Num("warmup_seconds", absl::GetFlag(FLAGS_warmup_seconds), 3)
                                 .Num("seconds", absl::GetFlag(FLAGS_seconds), 3)
                                 .Uint("iterations", absl::GetFlag(FLAGS_iterations))
                                 .Uint("hardware_threads", std::thread::hardware_concurrency())
                                 .Raw("cases", bench::JsonArray(json_cases))
                                 .str();
    return bench::WriteJsonOut(json_out, json);
  }
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  kvhost::ParseFlags(argc, argv,
                     "kvhost_rpc_bench: Alloc + Free round trips against kvhostd, from 1 and 8 "
                     "concurrent clients.\n"
                     "Usage: kvhost_rpc_bench [--seconds=5 | --iterations=N] [--clients=1,8] "
                     "[--server=unix:///path.sock] [--json-out=FILE]",
                     "bench/rpc_bench.cc");
  return bench::Finish(OptionsFromFlags(), Run);
}
