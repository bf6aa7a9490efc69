// kvhost_rpc_bench: latency and throughput of the calls on a scheduler's and
// a worker's hot path, over gRPC and over the fast path
// (proto/kvhost/v1/fast_path.proto), each beside its floors measured in the
// same run:
//   * Alloc(page_size) + Free of that page, with 1 and 8 clients (--clients),
//     each client thread with its own Client and connection (and mailbox),
//     as separate scheduler processes would have;
//   * AllocBatch of 64 one-page runs + one Free of them all;
//   * Backup and Load submits of 4096 tokens (the call alone: each ticket
//     is waited for after the timed part);
//   * the floors: two one-byte ping-pongs over a unix socket pair between
//     two processes, two ping-pongs through a shared-memory mailbox with a
//     futex doorbell between two processes (what the fast path is built
//     on), and two grpc.health.v1 Check calls (what any two unary gRPC
//     calls cost).
// Every case runs per placement (--placements): "split" pins kvhostd (and a
// floor's echo process) to CPU 0 and the client threads to CPU 1, "same"
// puts all on CPU 0, "none" pins nothing. After a warm-up, a case runs for
// --seconds, or --iterations round trips per thread.
//
// It starts its own kvhostd (host backend, private socket and shm dir) unless
// --server names a running one (then nothing is pinned on its side); it
// creates two small pools and deletes them at the end. Prints one progress
// line per case, then a table; --json-out writes the same numbers as JSON.
// Exit codes: 0 done, 1 a call failed, 2 bad flags.
#include <pthread.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>

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
#include "common/fast_path_mailbox.h"
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
ABSL_FLAG(std::vector<std::string>, paths, std::vector<std::string>({"grpc", "fast"}),
          "Transports, comma separated: grpc (ClientOptions::fast_path off), fast (on).");
ABSL_FLAG(std::vector<std::string>, placements, std::vector<std::string>({"split", "same"}),
          "CPU placements, comma separated: split (kvhostd on CPU 0, clients on CPU 1), same "
          "(all on CPU 0), none (no pinning).");
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
  std::string placement;
  uint64_t clients = 0;
  uint64_t round_trips = 0;
  double seconds = 0;
  double ops_per_s = 0;
  double p50_us = 0, p99_us = 0, p999_us = 0, max_us = 0;
};

// One measured round trip on one client, and what follows it untimed
// (waiting for a submitted ticket); `after` may be empty.
using RoundTrip = std::function<absl::Status(kvhost::Client&)>;
struct Op {
  RoundTrip timed;
  RoundTrip after;
};

Op AllocFree(const std::string& pool, uint64_t tokens) {
  return {[pool, tokens](kvhost::Client& client) -> absl::Status {
            absl::StatusOr<std::vector<int64_t>> slots = client.Alloc(pool, tokens);
            if (!slots.ok()) return slots.status();
            return client.Free(pool, *slots).status();
          },
          nullptr};
}

// AllocBatch of `runs` runs of `tokens`, then one Free of them all.
Op BatchAllocFree(const std::string& pool, uint64_t tokens, uint64_t runs) {
  return {[pool, tokens, runs](kvhost::Client& client) -> absl::Status {
            const std::vector<uint64_t> wanted(runs, tokens);
            absl::StatusOr<std::vector<std::vector<int64_t>>> got = client.AllocBatch(pool, wanted);
            if (!got.ok()) return got.status();
            std::vector<int64_t> all;
            for (const std::vector<int64_t>& run : *got)
              all.insert(all.end(), run.begin(), run.end());
            return client.Free(pool, all).status();
          },
          nullptr};
}

// A Backup or Load submit of `host.size()` tokens on `attachment`; the
// ticket is waited for untimed.
Op Submit(bool backup, const std::string& attachment, std::vector<int64_t> host,
          std::vector<int64_t> device) {
  auto ticket = std::make_shared<uint64_t>(0);
  return {[=](kvhost::Client& client) -> absl::Status {
            absl::StatusOr<uint64_t> id = backup ? client.Backup(attachment, host, device)
                                                 : client.Load(attachment, host, device);
            if (!id.ok()) return id.status();
            *ticket = *id;
            return absl::OkStatus();
          },
          [ticket](kvhost::Client& client) -> absl::Status {
            return client.WaitTransfer(*ticket, absl::Seconds(30)).status();
          }};
}

// The gRPC floor: two unary calls that do no work in kvhost's code.
Op TwoHealthChecks() {
  return {[](kvhost::Client& client) -> absl::Status {
            for (int i = 0; i < 2; ++i) {
              absl::StatusOr<std::string> health = client.Health();
              if (!health.ok()) return health.status();
            }
            return absl::OkStatus();
          },
          nullptr};
}

// Where a placement puts the daemon and the clients (-1: anywhere).
struct Placement {
  std::string name;
  int server_cpu = -1;
  int client_cpu = -1;
};

// CPU `cpu` alone, or every CPU (-1).
cpu_set_t CpuSet(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  const int cpus = static_cast<int>(std::thread::hardware_concurrency());
  for (int c = 0; c < CPU_SETSIZE && c < cpus; ++c) {
    if (cpu < 0 || c == cpu) CPU_SET(c, &set);
  }
  return set;
}

void PinThread(int cpu) {
  const cpu_set_t set = CpuSet(cpu);
  pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
}

// Every thread of process `pid` to `cpu` (or anywhere, -1); threads it
// makes later inherit their creator's.
void PinProcess(pid_t pid, int cpu) {
  const cpu_set_t set = CpuSet(cpu);
  std::error_code ec;
  for (const auto& task :
       std::filesystem::directory_iterator(absl::StrCat("/proc/", pid, "/task"), ec)) {
    const pid_t tid = static_cast<pid_t>(std::stol(task.path().filename().string()));
    ::sched_setaffinity(tid, sizeof(set), &set);
  }
}

void RunClient(kvhost::Client* client, const Op& op, const Plan& plan, int cpu, ThreadResult* out) {
  PinThread(cpu);
  while (Clock::now() < plan.measure_start) {
    out->status = op.timed(*client);
    if (out->status.ok() && op.after) out->status = op.after(*client);
    if (!out->status.ok()) return;
  }
  for (uint64_t i = 0; plan.iterations == 0 || i < plan.iterations; ++i) {
    const Clock::time_point start = Clock::now();
    if (plan.iterations == 0 && start >= plan.measure_end) break;
    out->status = op.timed(*client);
    if (!out->status.ok()) return;
    out->latencies_us.push_back(
        std::chrono::duration<double, std::micro>(Clock::now() - start).count());
    if (op.after) {
      out->status = op.after(*client);
      if (!out->status.ok()) return;
    }
  }
  out->end = Clock::now();
}

// One Client per thread. gRPC lets channels with equal arguments to one
// address share a connection; a per-client message limit (never reached by
// these calls) makes the arguments differ, so each thread has its own
// connection as a separate scheduler process would (and its own mailbox).
absl::StatusOr<std::vector<std::unique_ptr<kvhost::Client>>> MakeClients(const std::string& address,
                                                                         uint64_t n,
                                                                         bool fast_path) {
  std::vector<std::unique_ptr<kvhost::Client>> clients;
  for (uint64_t i = 0; i < n; ++i) {
    kvhost::ClientOptions options;
    options.address = address;
    options.timeout = absl::Seconds(30);
    options.max_message_bytes -= static_cast<int>(i);
    options.fast_path = fast_path;
    options.worker_session = false;
    absl::StatusOr<std::unique_ptr<kvhost::Client>> client = kvhost::Client::Connect(options);
    if (!client.ok()) return client.status();
    if (absl::Status s = (*client)->WaitForReady(absl::Seconds(10)); !s.ok()) return s;
    clients.push_back(*std::move(client));
  }
  return clients;
}

absl::StatusOr<CaseResult> RunCase(const std::string& address, const Op& op, uint64_t threads,
                                   bool fast_path, int cpu) {
  absl::StatusOr<std::vector<std::unique_ptr<kvhost::Client>>> clients =
      MakeClients(address, threads, fast_path);
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
    workers.emplace_back(RunClient, (*clients)[t].get(), std::cref(op), std::cref(plan), cpu,
                         &results[t]);
  }
  for (std::thread& w : workers) w.join();
  // The fast-path cases must have taken the mailbox.
  if (fast_path && !(*clients)[0]->fast_path_open()) {
    return absl::FailedPreconditionError("a fast-path case ran over gRPC: no mailbox opened");
  }

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

// The fast path's spin: 50 us for a peer on another CPU, none on this one.
int64_t MailboxSpin(uint32_t peer_cpu) {
  return kvhost::SpinFor(peer_cpu, kvhost::CpuHint()) ? 50'000 : 0;
}

// The process floors, timed like the RPC cases: two one-byte ping-pongs
// with a forked echo child over a unix socket pair (`mailbox` false), or
// through a shared-memory mailbox with a futex doorbell, spinning as the
// fast path does before it sleeps (`mailbox` true).
absl::StatusOr<CaseResult> RunFloor(bool mailbox, uint64_t round_trips, const Placement& where) {
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
    return absl::InternalError("socketpair failed");
  }
  void* shared = ::mmap(nullptr, kvhost::kFastPathHeaderBytes, PROT_READ | PROT_WRITE,
                        MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (shared == MAP_FAILED) return absl::InternalError("mmap failed");
  auto* header = new (shared) kvhost::FastPathHeader();
  const auto forever = [] { return true; };
  const pid_t child = ::fork();
  if (child < 0) return absl::InternalError("fork failed");
  if (child == 0) {
    ::close(sv[0]);
    PinThread(where.server_cpu);
    if (mailbox) {
      uint32_t seen = 0;
      while (true) {
        seen = kvhost::WaitForChange(&header->request_seq, seen,
                                     MailboxSpin(header->client_cpu.load()), 100'000'000, forever);
        header->server_cpu.store(kvhost::CpuHint());
        header->reply_seq.store(seen, std::memory_order_release);
        kvhost::FutexWake(&header->reply_seq);
      }
    }
    char c;
    while (::read(sv[1], &c, 1) == 1) {
      if (::write(sv[1], &c, 1) != 1) break;
    }
    ::_exit(0);
  }
  ::close(sv[1]);
  PinThread(where.client_cpu);
  std::vector<double> all;
  all.reserve(round_trips);
  const Clock::time_point begin = Clock::now();
  char c = 'x';
  uint32_t seq = 0;
  absl::Status failed;
  for (uint64_t i = 0; i < round_trips + round_trips / 10 && failed.ok(); ++i) {
    const Clock::time_point start = Clock::now();
    for (int k = 0; k < 2; ++k) {
      if (mailbox) {
        header->client_cpu.store(kvhost::CpuHint());
        header->request_seq.store(++seq, std::memory_order_release);
        kvhost::FutexWake(&header->request_seq);
        uint32_t now = header->reply_seq.load(std::memory_order_acquire);
        while (now != seq)
          now = kvhost::WaitForChange(&header->reply_seq, now,
                                      MailboxSpin(header->server_cpu.load()), 20'000'000, forever);
      } else if (::write(sv[0], &c, 1) != 1 || ::read(sv[0], &c, 1) != 1) {
        failed = absl::InternalError("socket ping-pong failed");
      }
    }
    // The first tenth warms up.
    if (i >= round_trips / 10) {
      all.push_back(std::chrono::duration<double, std::micro>(Clock::now() - start).count());
    }
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - begin).count();
  PinThread(-1);
  ::close(sv[0]);
  ::kill(child, SIGKILL);
  ::waitpid(child, nullptr, 0);
  ::munmap(shared, kvhost::kFastPathHeaderBytes);
  if (!failed.ok()) return failed;
  std::sort(all.begin(), all.end());
  CaseResult r;
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
  std::vector<bool> fast_paths;
  std::vector<Placement> placements;
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
  for (const std::string& path : absl::GetFlag(FLAGS_paths)) {
    if (path != "grpc" && path != "fast") {
      return absl::InvalidArgumentError(
          absl::StrCat("--paths: '", path, "' is neither grpc nor fast"));
    }
    o.fast_paths.push_back(path == "fast");
  }
  const bool two_cpus = std::thread::hardware_concurrency() >= 2;
  for (const std::string& name : absl::GetFlag(FLAGS_placements)) {
    if (name == "split") {
      if (!two_cpus) return absl::InvalidArgumentError("--placements=split needs two CPUs");
      o.placements.push_back({name, 0, 1});
    } else if (name == "same") {
      o.placements.push_back({name, 0, 0});
    } else if (name == "none") {
      o.placements.push_back({name, -1, -1});
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("--placements: '", name, "' is not split, same or none"));
    }
  }
  if (o.fast_paths.empty() || o.placements.empty()) {
    return absl::InvalidArgumentError("--paths and --placements need a value each");
  }
  return o;
}

// The rows and ticket of the transfer cases: 4096 tokens of pool `pool`
// allocated, and an attachment of a device pool of as many rows.
constexpr uint64_t kTransferTokens = 4096;
// AllocBatch's runs.
constexpr uint64_t kBatchRuns = 64;

absl::Status Run(const Options& options) {
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

  absl::StatusOr<std::vector<std::unique_ptr<kvhost::Client>>> admin =
      MakeClients(address, 1, false);
  if (!admin.ok()) return admin.status();
  kvhost::Client& client = *admin->front();
  absl::StatusOr<v1::DaemonStatus> status = client.GetStatus();
  if (!status.ok()) return status.status();
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
  if (absl::StatusOr<v1::Pool> p = client.CreatePool(pool, spec); !p.ok()) return p.status();
  // The transfer cases' pool: page 1, one layer of 8-byte rows.
  spec.set_page_size(1);
  spec.set_head_dim(8);
  spec.set_size_tokens(kTransferTokens);
  const std::string xfer = absl::StrCat("rpc-bench-xfer-", ::getpid());
  absl::StatusOr<v1::Pool> xfer_pool = client.CreatePool(xfer, spec);
  if (!xfer_pool.ok()) return xfer_pool.status();
  absl::StatusOr<std::vector<int64_t>> host = client.Alloc(xfer, kTransferTokens);
  if (!host.ok()) return host.status();
  absl::StatusOr<std::unique_ptr<kvhost::ShmDevicePool>> device =
      kvhost::ShmDevicePool::Create(*xfer_pool, kTransferTokens, status->shm_dir());
  if (!device.ok()) return device.status();
  absl::StatusOr<v1::Attachment> attachment =
      client.AttachDevice((*device)->MakeAttachRequest(xfer));
  if (!attachment.ok()) return attachment.status();
  std::vector<int64_t> device_rows(kTransferTokens);
  for (uint64_t i = 0; i < kTransferTokens; ++i) device_rows[i] = static_cast<int64_t>(i);

  // The cases, per placement: the floors, then per path Alloc + Free with
  // each --clients count, AllocBatch + Free, the two submits.
  struct Case {
    std::string what;
    uint64_t threads;
    Op op;         // empty: a process floor
    bool mailbox;  // which process floor
    bool fast;     // the client's fast path
    Placement where;
  };
  std::vector<Case> plan;
  for (const Placement& where : options.placements) {
    plan.push_back({"floor: 2 unix-socket ping-pongs", 1, {}, false, false, where});
    plan.push_back({"floor: 2 shm-mailbox ping-pongs", 1, {}, true, false, where});
    plan.push_back({"floor: 2 gRPC health checks", 1, TwoHealthChecks(), false, false, where});
    for (bool fast : options.fast_paths) {
      const std::string path = fast ? "fast" : "gRPC";
      for (uint64_t threads : options.clients) {
        plan.push_back({absl::StrCat(path, ": Alloc(", page_size, ") + Free"), threads,
                        AllocFree(pool, page_size), false, fast, where});
      }
      plan.push_back({absl::StrCat(path, ": AllocBatch(", kBatchRuns, " x ", page_size, ") + Free"),
                      1, BatchAllocFree(pool, page_size, kBatchRuns), false, fast, where});
      plan.push_back({absl::StrCat(path, ": Backup submit, ", kTransferTokens, " tokens"), 1,
                      Submit(true, attachment->id(), *host, device_rows), false, fast, where});
      plan.push_back({absl::StrCat(path, ": Load submit, ", kTransferTokens, " tokens"), 1,
                      Submit(false, attachment->id(), *host, device_rows), false, fast, where});
    }
  }
  std::vector<CaseResult> results;
  absl::Status failed;
  std::string pinned;
  for (size_t i = 0; i < plan.size(); ++i) {
    const Case& c = plan[i];
    if (daemon != nullptr && pinned != c.where.name) {
      PinProcess(daemon->pid(), c.where.server_cpu);
      pinned = c.where.name;
    }
    absl::PrintF("[%d/%d] %s, %d client(s), %s: ", i + 1, plan.size(), c.where.name, c.threads,
                 c.what);
    std::fflush(stdout);
    const uint64_t iterations = absl::GetFlag(FLAGS_iterations);
    absl::StatusOr<CaseResult> r =
        c.op.timed ? RunCase(address, c.op, c.threads, c.fast, c.where.client_cpu)
                   : RunFloor(c.mailbox, iterations > 0 ? iterations : 20000, c.where);
    if (!r.ok()) {
      std::printf("failed\n");
      failed = r.status();
      break;
    }
    r->what = c.what;
    r->placement = c.where.name;
    absl::PrintF("%.0f round trips/s, p50 %.1f us, p99 %.1f us (%d round trips in %.2f s)\n",
                 r->ops_per_s, r->p50_us, r->p99_us, r->round_trips, r->seconds);
    results.push_back(*r);
  }
  (void)client.DetachDevice(attachment->id());
  (void)client.DeletePool(xfer);
  const absl::StatusOr<uint64_t> deleted = client.DeletePool(pool);
  if (!failed.ok()) return failed;
  if (!deleted.ok()) return deleted.status();

  std::printf("\n");
  std::vector<std::vector<std::string>> rows = {{"PLACEMENT", "CASE", "CLIENTS", "ROUND TRIPS",
                                                 "OPS/S", "P50 US", "P99 US", "P99.9 US", "MAX US",
                                                 "P50 / gRPC FLOOR"}};
  std::vector<std::string> json_cases;
  for (const CaseResult& r : results) {
    double grpc_floor_p50 = 0;
    for (const CaseResult& f : results) {
      if (f.placement == r.placement && absl::StrContains(f.what, "gRPC health")) {
        grpc_floor_p50 = f.p50_us;
      }
    }
    const double ratio = grpc_floor_p50 > 0 ? r.p50_us / grpc_floor_p50 : 0;
    rows.push_back({r.placement, r.what, absl::StrCat(r.clients), absl::StrCat(r.round_trips),
                    absl::StrFormat("%.0f", r.ops_per_s), absl::StrFormat("%.1f", r.p50_us),
                    absl::StrFormat("%.1f", r.p99_us), absl::StrFormat("%.1f", r.p999_us),
                    absl::StrFormat("%.1f", r.max_us), absl::StrFormat("%.2f", ratio)});
    json_cases.push_back(bench::JsonObject()
                             .Str("placement", r.placement)
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
  bench::PrintTable(rows, "llrrrrrrrr");
  std::printf(
      "(Alloc + Free: Alloc of one page then Free of it; a submit is the call alone, its "
      "ticket waited for untimed; ops/s counts round trips of all clients)\n");

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
                     "kvhost_rpc_bench: a scheduler's and a worker's hot-path calls against "
                     "kvhostd over gRPC and the fast path, beside their floors.\n"
                     "Usage: kvhost_rpc_bench [--seconds=5 | --iterations=N] [--clients=1,8] "
                     "[--paths=grpc,fast] [--placements=split,same] "
                     "[--server=unix:///path.sock] [--json-out=FILE]",
                     "bench/rpc_bench.cc");
  return bench::Finish(OptionsFromFlags(), Run);
}
