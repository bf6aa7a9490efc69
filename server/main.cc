// kvhostd: the per-node host-memory KV-cache daemon. Flags are documented in
// --help; see README.md and docs/ for the API and operations.
//
// Under systemd (Type=notify, deploy/systemd/kvhostd.service) it reports its
// state through sd_notify: READY=1 once every listener accepts calls and health
// is SERVING, STOPPING=1 when SIGTERM / SIGINT arrives, before draining. Outside
// systemd (NOTIFY_SOCKET unset) the notifications are no-ops.
#include <malloc.h>
#include <signal.h>
#include <sys/resource.h>
#include <systemd/sd-daemon.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/cli_flags.h"
#include "server/config.h"
#include "server/daemon.h"
#include "server/pool/host_memory.h"
#include "spdlog/spdlog.h"

// Defaults read from the option structs (server/daemon_options.h), so that
// each lives in one place.
namespace {
const kvhost::DaemonOptions kDefaults;
}  // namespace

ABSL_FLAG(std::vector<std::string>, listen, kDefaults.listen,
          "Addresses to serve on, comma separated: 'unix:///abs/path.sock' (the directory is "
          "created; a stale socket file is replaced) or 'host:port' (TCP: TLS with --tls-cert "
          "and --tls-key, or plaintext only with --insecure-tcp).");
ABSL_FLAG(std::string, backend, kvhost::BackendChoiceName(kDefaults.backend),
          "Transfer engine: 'host' (device pools emulated in shared memory), 'cuda' (GPU "
          "buffers through CUDA IPC, see --transfer-path; needs a GPU and a CUDA build), or "
          "'auto' (cuda where a GPU is usable and this build has the CUDA engine, else host; "
          "the choice and the reason are logged).");
ABSL_FLAG(std::string, shm_dir, kDefaults.registry.shm_dir,
          "Directory of the pools' shared-memory files, and the only directory from which shm "
          "device buffers may be attached.");
ABSL_FLAG(std::string, memory_limit, "0",
          "Most host memory all pools together may take, e.g. '512G' (K/M/G/T are powers of "
          "1024); '0' = bounded only by the host's available memory less the reserve.");
ABSL_FLAG(std::string, memory_reserve, "auto",
          "Host memory never given to pools, e.g. '10G'; 'auto' = min(10 GiB, 10% of RAM). A pool "
          "is refused when it needs more than MemAvailable (and the cgroup's limit minus its "
          "usage) less this reserve.");
ABSL_FLAG(std::string, config, "",
          "YAML config file: flag names as keys (memory_limit or memory-limit), values as the "
          "flags take them, plus 'pools' to create at start. Flags given on the command line "
          "override it; it overrides the defaults. See docs/OPERATIONS.md.");
ABSL_FLAG(bool, print_config, false,
          "Print the effective configuration (every flag, and the config file's pools) as YAML "
          "that --config accepts, then exit 0 without starting.");
ABSL_FLAG(std::string, log_level, "info",
          "Log level: trace, debug, info, warn, error, critical, off.");
ABSL_FLAG(int, copy_threads, kDefaults.copy_threads,
          "Host engine: helper threads per transfer direction (besides the direction's own "
          "thread), >= 0.");
ABSL_FLAG(std::string, transfer_path, kvhost::CudaPathFlag(kDefaults.cuda.path),
          "cuda backend: how bytes move. 'ce' = copy engines only (no cost to the worker's "
          "kernels; fast for large contiguous pieces), 'staged' = device gather / scatter "
          "kernel plus large copy-engine copies through a staging buffer (token-granular host "
          "layouts), 'sm' = copy kernels through mapped host memory (costs the worker most: "
          "time-slices against it without MPS, +24-27 % for backups under MPS), 'auto' = chosen "
          "per transfer from the piece sizes, the layout and whether MPS is active: ce for large "
          "pieces, else staged, sm only under MPS where nothing stages (logged, and shown in the "
          "ticket status).");
ABSL_FLAG(std::string, staging_bytes, kvhost::FormatByteSize(kDefaults.cuda.staging_bytes),
          "cuda backend: device staging buffer of the staged path, per stream (one for backups, "
          "one for loads, per GPU), allocated on first use; larger = fewer, longer kernels.");
ABSL_FLAG(int, sm_blocks, kDefaults.cuda.sm_blocks,
          "cuda backend: most thread blocks of an SM copy kernel (8 warps each); the rest "
          "of the SMs stay with the worker.");
ABSL_FLAG(int, copy_streams, kDefaults.cuda.copy_streams,
          "cuda backend: copy-engine streams per direction and GPU that a batch of large "
          "pieces (>= 32K on average) is split over, 1-16; 1 = one stream.");
ABSL_FLAG(std::string, ce_min_piece, kvhost::FormatByteSize(kDefaults.cuda.ce_min_piece_bytes),
          "cuda backend, --transfer-path=auto: the copy engines take a transfer whose "
          "contiguous pieces average at least this many bytes (else the staged or SM copy path, "
          "where they move larger pieces).");
// Kept only so that configs naming it still parse: see RefuseRemovedFlags.
ABSL_FLAG(bool, load_gates, false,
          "Removed: true refuses to start (gated loads could deadlock the GPU's work queues, "
          "docs/PERF.md run S); false is accepted. For a Load call that returns before its "
          "layers are queued, attach with AttachDeviceRequest.layer_progress and wait with "
          "LoadEvents::WaitLayer.");
ABSL_FLAG(bool, worker_copy, kDefaults.worker_copy,
          "cuda backend: serve worker copies (Backup / Load with worker_copy): the worker runs "
          "the copy kernel on its own stream through its own mapping of the pool, handed over "
          "the handoff socket; off because the measured cost to a worker's kernels exceeds the "
          "daemon's own paths (docs/PERF.md, run M).");
ABSL_FLAG(std::string, handoff_socket, kDefaults.handoff_socket,
          "Unix socket (SOCK_SEQPACKET) where attached workers fetch descriptors gRPC cannot "
          "carry: the layer counters of attachments with layer_progress and the pool regions of "
          "worker copies. 'auto' = the first "
          "unix --listen path + '.fds' (none with TCP listeners only); '' = none (layer_progress "
          "refused). Same mode and group as the gRPC socket; removed at shutdown.");
ABSL_FLAG(uint32_t, fast_path_connections, kDefaults.fast_path_connections,
          "Local clients served at once over the fast path (a shared-memory mailbox each, one "
          "kvhostd thread each, set up through the handoff socket): Alloc, Free, AllocBatch, "
          "Backup, Load, AllocBackup and WaitTransfer without gRPC's per-call cost. More clients "
          "are refused and use gRPC. 0 = off. Needs the handoff socket.");
ABSL_FLAG(uint32_t, fast_path_connections_per_client, kDefaults.fast_path_connections_per_client,
          "Fast-path mailboxes one client may hold (a client: its open worker session, else its "
          "uid), so that one client cannot take them all; more are refused and use gRPC.");
ABSL_FLAG(std::string, metrics_listen, "",
          "Serve Prometheus metrics over plain HTTP at http://ADDRESS/metrics: 'host:port', "
          "':port' (every IPv4 interface) or '[v6]:port'; port 0 picks a free one (logged). "
          "'' = no metrics. See docs/METRICS.md.");
ABSL_FLAG(int, shutdown_grace_s, 10,
          "Seconds in-flight RPCs get to finish after SIGTERM, once accepted transfers are done.");
ABSL_FLAG(absl::Duration, drain_timeout, kDefaults.drain_timeout,
          "After SIGTERM, how long accepted transfers get to finish (e.g. '30s'); the ones "
          "still queued then are cancelled and logged.");
ABSL_FLAG(absl::Duration, session_timeout, kDefaults.session_timeout,
          "Worker sessions: at most this long after a worker's session breaks (exit, kill, or "
          "no keepalive answer), its attachments are closed and their transfers finished or "
          "cancelled. Pools and their data stay.");
ABSL_FLAG(uint64_t, max_indices_per_call, kDefaults.max_indices_per_call,
          "Most indices (or tokens, for Alloc) one call may carry, per pool; more is "
          "INVALID_ARGUMENT.");
ABSL_FLAG(int, max_message_bytes, kDefaults.max_message_bytes,
          "Largest gRPC message either way, in bytes; larger is RESOURCE_EXHAUSTED.");
ABSL_FLAG(std::string, socket_mode, "0660",
          "File mode (octal) of the unix socket files; who may connect is who may use kvhostd.");
ABSL_FLAG(std::string, socket_group, "",
          "Group (name or gid) of the unix socket files; '' = kvhostd's own group.");
ABSL_FLAG(std::string, region_mode, "0600",
          "File mode (octal) of the pools' region files in --shm-dir. 0600 keeps every other "
          "local user out; give storage connectors access with --region-group and 0640 or 0660.");
ABSL_FLAG(std::string, region_group, "",
          "Group (name or gid) of the pools' region files; '' = kvhostd's own group.");
ABSL_FLAG(std::string, tls_cert, "",
          "PEM certificate (chain) for TCP listeners; with --tls-key. TCP without TLS needs "
          "--insecure-tcp.");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls-cert.");
ABSL_FLAG(std::string, tls_client_ca, "",
          "PEM CA bundle: TCP clients must present a certificate it signed (mutual TLS).");
ABSL_FLAG(bool, insecure_tcp, false,
          "Allow plaintext TCP listeners (no TLS): anyone who reaches the port may use kvhostd.");
ABSL_FLAG(std::vector<std::string>, l3_memcached, {},
          "The L3 tier: memcached servers 'host:port,host:port,...' that pages are stored in and "
          "fetched from (kvhost.v1.StorageService), keys spread by consistent hashing. Empty = "
          "no L3 tier. See docs/OPERATIONS.md.");
ABSL_FLAG(absl::Duration, l3_connect_timeout, absl::Milliseconds(200),
          "L3: how long a connection to a memcached server may take.");
ABSL_FLAG(absl::Duration, l3_io_timeout, absl::Seconds(1),
          "L3: how long one memcached request may wait for its server.");
ABSL_FLAG(absl::Duration, l3_retry_timeout, absl::Seconds(2),
          "L3: a server that failed leaves the hash ring for this long (its pages are misses, "
          "new stores go to the others), then is tried again. Also how often each server is "
          "probed for kvhostctl status and the kvhost_l3_server_up metric (each change logged).");
ABSL_FLAG(uint32_t, l3_replicas, 0,
          "L3: further servers each page is also written to (libmemcached replication); fewer "
          "than the servers.");
ABSL_FLAG(std::string, l3_item_bytes, "1044480",
          "L3: largest memcached item (value) written; larger pages are split into parts. "
          "Keep it under the servers' -I (1m by default) minus 4K.");
ABSL_FLAG(uint64_t, l3_max_pages_in_flight, 4096,
          "L3: most pages (keys, for ExistPages) accepted and not yet done over all calls; a call "
          "that would pass it is RESOURCE_EXHAUSTED.");
ABSL_FLAG(uint64_t, l3_max_pages_in_flight_per_pool, 1024,
          "L3: one pool's share of --l3-max-pages-in-flight (a pool group's and a follower's "
          "pages count as the pool whose owner token protects them), so that one client's flood "
          "leaves the rest to the others.");
ABSL_FLAG(int, l3_threads, 4, "L3: threads that talk to the cache (the tier's own).");
ABSL_FLAG(std::string, l3_secret_file, "",
          "L3: the fleet secret (required with --l3-memcached; the same file on every node): "
          "stored pages carry a MAC under it and keys are scoped by namespaces derived from it. "
          "Mode 0600, owned by kvhostd's user or root; make one with "
          "'install -m 0600 /dev/null FILE && openssl rand -hex 32 > FILE'. A new secret starts "
          "an empty tier (docs/OPERATIONS.md).");

namespace {

// Tells the service manager `state` (newline-separated VAR=value lines,
// sd_notify(3)); says so in the log when the notification could not be sent.
void Notify(const std::string& state) {
  if (const int r = sd_notify(0, state.c_str()); r < 0) {
    spdlog::warn("sd_notify to NOTIFY_SOCKET failed: {}", std::strerror(-r));
  }
}

// An octal file mode flag ("0660"); nullopt unless it is one (<= 0777).
std::optional<uint32_t> ParseFileMode(const std::string& text) {
  char* end = nullptr;
  const unsigned long parsed = std::strtoul(text.c_str(), &end, 8);
  if (text.empty() || *end != '\0' || parsed > 0777) return std::nullopt;
  return static_cast<uint32_t>(parsed);
}

int Fail(const std::string& message) {
  spdlog::critical("{}", message);
  Notify(absl::StrCat("STATUS=", message));  // shown by `systemctl status kvhostd`
  return 2;
}

// A bad flag value, as the steps below report it for main to Fail with.
absl::Status Invalid(const std::string& message) { return absl::InvalidArgumentError(message); }

// The log level flag applied to spdlog.
absl::Status SetLogLevel() {
  const spdlog::level::level_enum level =
      spdlog::level::from_str(absl::AsciiStrToLower(absl::GetFlag(FLAGS_log_level)));
  if (level == spdlog::level::off && absl::GetFlag(FLAGS_log_level) != "off") {
    return Invalid(
        absl::StrCat("--log-level '", absl::GetFlag(FLAGS_log_level), "' is not a level"));
  }
  spdlog::set_level(level);
  return absl::OkStatus();
}

// SIGTERM and SIGINT, blocked: the main thread takes them synchronously
// (sigwait). Called before any thread starts, so none of gRPC's threads
// receives them.
sigset_t BlockStopSignals() {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  return signals;
}

// Flags of removed features: their old default is accepted, so that
// existing flag files and configs keep working; the value that asked for the
// feature stops the start, saying why it went and what replaces it.
absl::Status RefuseRemovedFlags() {
  if (absl::GetFlag(FLAGS_load_gates)) {
    // Its GPU-side waits (cuStreamWaitValue64) hung the GPU's shared work
    // queues, and layer progress gives the early Load return without them.
    return Invalid(
        "--load-gates=true is refused: gated loads were removed because their GPU-side waits "
        "could deadlock the GPU's work queues (docs/PERF.md, run S); for a Load call that "
        "returns before its layers are queued, attach with AttachDeviceRequest.layer_progress "
        "and wait with LoadEvents::WaitLayer (--load-gates=false is still accepted)");
  }
  return absl::OkStatus();
}

// The L3 tier's options (--l3-*); INVALID_ARGUMENT naming a bad value.
absl::Status L3OptionsFromFlags(kvhost::DaemonOptions* options) {
  options->l3.servers = absl::GetFlag(FLAGS_l3_memcached);
  options->l3.connect_timeout = absl::GetFlag(FLAGS_l3_connect_timeout);
  options->l3.io_timeout = absl::GetFlag(FLAGS_l3_io_timeout);
  options->l3.retry_timeout = absl::GetFlag(FLAGS_l3_retry_timeout);
  options->l3.replicas = absl::GetFlag(FLAGS_l3_replicas);
  absl::StatusOr<uint64_t> item = kvhost::ParseByteSize(absl::GetFlag(FLAGS_l3_item_bytes));
  if (!item.ok()) return Invalid(absl::StrCat("--l3-item-bytes: ", item.status().message()));
  options->l3.item_bytes = *item;
  options->l3_tier.max_pages_in_flight = absl::GetFlag(FLAGS_l3_max_pages_in_flight);
  if (options->l3_tier.max_pages_in_flight == 0) {
    return Invalid("--l3-max-pages-in-flight must be >= 1");
  }
  options->l3_tier.max_pages_in_flight_per_pool =
      absl::GetFlag(FLAGS_l3_max_pages_in_flight_per_pool);
  if (options->l3_tier.max_pages_in_flight_per_pool == 0) {
    return Invalid("--l3-max-pages-in-flight-per-pool must be >= 1");
  }
  options->l3_secret_file = absl::GetFlag(FLAGS_l3_secret_file);
  options->l3_tier.threads = absl::GetFlag(FLAGS_l3_threads);
  if (options->l3_tier.threads < 1 || options->l3_tier.threads > 256) {
    return Invalid(absl::StrCat("--l3-threads ", options->l3_tier.threads, " is not in [1, 256]"));
  }
  return absl::OkStatus();
}

// The daemon's options from the flags and the config file's pools; a bad
// flag value is INVALID_ARGUMENT with the message Fail logs.
absl::StatusOr<kvhost::DaemonOptions> OptionsFromFlags(
    const std::vector<kvhost::DeclaredPool>& declared_pools) {
  if (absl::Status s = RefuseRemovedFlags(); !s.ok()) return s;
  kvhost::DaemonOptions options;
  options.listen = absl::GetFlag(FLAGS_listen);
  absl::StatusOr<kvhost::BackendChoice> backend =
      kvhost::ParseBackendChoice(absl::GetFlag(FLAGS_backend));
  if (!backend.ok()) return backend.status();
  options.backend = *backend;
  options.registry.shm_dir = absl::GetFlag(FLAGS_shm_dir);
  options.copy_threads = absl::GetFlag(FLAGS_copy_threads);
  absl::StatusOr<kvhost::CudaPath> path = kvhost::ParseCudaPath(absl::GetFlag(FLAGS_transfer_path));
  if (!path.ok()) {
    return Invalid(absl::StrCat("--transfer-path '", absl::GetFlag(FLAGS_transfer_path),
                                "' is not one of auto, ce (copy engines), staged, sm"));
  }
  options.cuda.path = *path;
  options.cuda.sm_blocks = absl::GetFlag(FLAGS_sm_blocks);
  options.cuda.copy_streams = absl::GetFlag(FLAGS_copy_streams);
  options.worker_copy = absl::GetFlag(FLAGS_worker_copy);
  options.metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  options.handoff_socket = absl::GetFlag(FLAGS_handoff_socket);
  options.fast_path_connections = absl::GetFlag(FLAGS_fast_path_connections);
  options.fast_path_connections_per_client = absl::GetFlag(FLAGS_fast_path_connections_per_client);
  options.drain_timeout = absl::GetFlag(FLAGS_drain_timeout);
  options.session_timeout = absl::GetFlag(FLAGS_session_timeout);
  options.max_indices_per_call = absl::GetFlag(FLAGS_max_indices_per_call);
  options.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  std::optional<uint32_t> socket_mode = ParseFileMode(absl::GetFlag(FLAGS_socket_mode));
  if (!socket_mode) {
    return Invalid(absl::StrCat("--socket-mode '", absl::GetFlag(FLAGS_socket_mode),
                                "' is not an octal mode such as 0660"));
  }
  options.socket_mode = *socket_mode;
  options.socket_group = absl::GetFlag(FLAGS_socket_group);
  std::optional<uint32_t> region_mode = ParseFileMode(absl::GetFlag(FLAGS_region_mode));
  if (!region_mode) {
    return Invalid(absl::StrCat("--region-mode '", absl::GetFlag(FLAGS_region_mode),
                                "' is not an octal mode such as 0600"));
  }
  options.registry.region_mode = *region_mode;
  options.region_group = absl::GetFlag(FLAGS_region_group);
  options.tls_cert = absl::GetFlag(FLAGS_tls_cert);
  options.tls_key = absl::GetFlag(FLAGS_tls_key);
  options.tls_client_ca = absl::GetFlag(FLAGS_tls_client_ca);
  options.insecure_tcp = absl::GetFlag(FLAGS_insecure_tcp);
  for (const kvhost::DeclaredPool& pool : declared_pools) {
    options.pools.emplace_back(pool.name, pool.spec);
  }
  absl::StatusOr<uint64_t> staging = kvhost::ParseByteSize(absl::GetFlag(FLAGS_staging_bytes));
  if (!staging.ok()) return Invalid(absl::StrCat("--staging-bytes: ", staging.status().message()));
  options.cuda.staging_bytes = *staging;
  absl::StatusOr<uint64_t> ce_min = kvhost::ParseByteSize(absl::GetFlag(FLAGS_ce_min_piece));
  if (!ce_min.ok()) return Invalid(absl::StrCat("--ce-min-piece: ", ce_min.status().message()));
  options.cuda.ce_min_piece_bytes = *ce_min;
  absl::StatusOr<uint64_t> limit = kvhost::ParseByteSize(absl::GetFlag(FLAGS_memory_limit));
  if (!limit.ok()) return Invalid(absl::StrCat("--memory-limit: ", limit.status().message()));
  options.registry.memory_limit = *limit;
  if (absl::GetFlag(FLAGS_memory_reserve) != "auto") {
    absl::StatusOr<uint64_t> reserve = kvhost::ParseByteSize(absl::GetFlag(FLAGS_memory_reserve));
    if (!reserve.ok()) {
      return Invalid(absl::StrCat("--memory-reserve: ", reserve.status().message()));
    }
    options.memory_reserve = *reserve;
  }
  if (absl::Status s = L3OptionsFromFlags(&options); !s.ok()) return s;
  if (absl::Status s = options.Validate(); !s.ok()) return s;
  return options;
}

// Runs the daemon until SIGTERM / SIGINT (`signals`, blocked), then drains
// and stops it. Returns the exit code.
int Serve(const kvhost::DaemonOptions& options, const sigset_t& signals) {
  absl::StatusOr<std::unique_ptr<kvhost::Daemon>> daemon = kvhost::Daemon::Start(options);
  if (!daemon.ok()) return Fail(absl::StrCat("cannot start: ", daemon.status().ToString()));
  Notify(absl::StrCat("READY=1\nSTATUS=serving on ", absl::StrJoin((*daemon)->addresses(), ", ")));

  int signal = 0;
  sigwait(&signals, &signal);
  const char* signal_name = signal == SIGTERM ? "SIGTERM" : "SIGINT";
  spdlog::info("received {}", signal_name);
  Notify(absl::StrCat("STOPPING=1\nSTATUS=", signal_name, ": draining transfers, then stopping"));
  (*daemon)->Shutdown(absl::Seconds(absl::GetFlag(FLAGS_shutdown_grace_s)));
  daemon->reset();
  spdlog::info("bye");
  return 0;
}

}  // namespace

// Deposited descriptors (a worker's cuMem allocations wait there for their
// attach, up to half of this limit: DepositLimitsFor) and pool region files need more
// than the usual soft limit of 1024: raised to the hard limit, which
// systemd sets high (524288).
static void RaiseDescriptorLimit() {
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0 || limit.rlim_cur >= limit.rlim_max) return;
  const rlim_t before = limit.rlim_cur;
  limit.rlim_cur = limit.rlim_max;
  if (::setrlimit(RLIMIT_NOFILE, &limit) == 0) {
    spdlog::debug("descriptor limit raised from {} to {}", before, limit.rlim_cur);
  }
}

// A transfer call allocates and frees some hundred KiB (its rows, its copy
// plan) on a gRPC or fast-path thread, whose malloc arena glibc trims back
// to the kernel once 128 KiB lie free at its top: an madvise whose TLB
// flush interrupts every CPU, then page faults on the next call's buffers
// (measured: over a third of the daemon's time in a 4096-token submit loop).
// Fixed thresholds keep such buffers in the arenas; what a pool holds is
// shared memory, not malloc's.
static void KeepMallocArenas() {
  constexpr int kTrimThreshold = 64 << 20;
  constexpr int kMmapThreshold = 16 << 20;
  ::mallopt(M_TRIM_THRESHOLD, kTrimThreshold);
  ::mallopt(M_MMAP_THRESHOLD, kMmapThreshold);
}

int main(int argc, char** argv) {
  KeepMallocArenas();
  // Debian's Abseil checks every Mutex acquisition for lock-order cycles
  // (a debug build's default); the tests keep that check, the daemon does
  // not pay for it on every call.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  kvhost::ParseFlags(
      argc, argv,
      "kvhostd: host-memory KV-cache tier for GPU inference.\n"
      "Usage: kvhostd [--listen=unix:///run/kvhost/kvhost.sock] [--backend=auto] [flags]\n"
      "Serves kvhost.v1.PoolService and TransferService over gRPC, with grpc.health.v1 and\n"
      "server reflection. SIGTERM / SIGINT drain accepted transfers, then exit 0.\n"
      "Flags also come from --flagfile=FILE (one --flag=value per line, underscore names,\n"
      "e.g. deploy/kvhostd.flags) and --config=FILE (YAML; the command line and --flagfile\n"
      "override it).",
      "server/main.cc");

  spdlog::set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%L%$ kvhostd %v");
  std::vector<kvhost::DeclaredPool> declared_pools;
  if (!absl::GetFlag(FLAGS_config).empty()) {
    absl::StatusOr<std::vector<kvhost::DeclaredPool>> loaded =
        kvhost::LoadConfigFile(absl::GetFlag(FLAGS_config), "server/main.cc");
    if (!loaded.ok()) return Fail(absl::StrCat("--config: ", loaded.status().message()));
    declared_pools = *std::move(loaded);
  }
  if (absl::GetFlag(FLAGS_print_config)) {
    std::vector<std::string> skip = {"config", "print_config"};
    // A removed flag is no part of the configuration, unless it is set to
    // the value that is refused: printed then, so that the printed file is
    // refused too.
    if (!absl::GetFlag(FLAGS_load_gates)) skip.push_back("load_gates");
    std::fputs(kvhost::FormatConfig("server/main.cc", skip, declared_pools).c_str(), stdout);
    return 0;
  }
  if (absl::Status s = SetLogLevel(); !s.ok()) return Fail(std::string(s.message()));
  RaiseDescriptorLimit();
  const sigset_t signals = BlockStopSignals();
  absl::StatusOr<kvhost::DaemonOptions> options = OptionsFromFlags(declared_pools);
  if (!options.ok()) return Fail(std::string(options.status().message()));
  return Serve(*options, signals);
}
