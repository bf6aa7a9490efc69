// DaemonOptions: what kvhostd starts with (main.cc fills it from the flags
// and the config file), and the one home of each setting's default: the
// engine's, the registry's and the L3 tier's settings are their own option
// structs, embedded here, and main.cc's flag defaults read them.
//
// Validate() checks what needs no machine (ranges and combinations), naming
// the flag and the value; Daemon::Start calls it first, and main.cc before
// anything else. Settings that need the machine (a group name, the shm
// directory, a GPU) are checked where they are used.
//
// Plain data.
#ifndef KVHOST_SERVER_DAEMON_OPTIONS_H_
#define KVHOST_SERVER_DAEMON_OPTIONS_H_

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "kvhost/defaults.h"
#include "server/pool/pool_spec.h"
#include "server/pool/registry.h"
#include "server/service/fast_path_server.h"
#include "server/storage/memcached_backend.h"
#include "server/storage/storage_tier.h"
#include "server/transfer/cuda/engine_options.h"

namespace kvhost {

// --backend: which transfer engine.
enum class BackendChoice : uint8_t {
  kAuto,  // cuda where a GPU is usable and the build has the CUDA engine, else host
  kHost,  // device pools emulated in shared memory
  kCuda,  // GPU buffers through CUDA IPC
};
// "auto" / "host" / "cuda"; INVALID_ARGUMENT naming the value otherwise.
absl::StatusOr<BackendChoice> ParseBackendChoice(absl::string_view name);
const char* BackendChoiceName(BackendChoice backend);

struct DaemonOptions {
  std::vector<std::string> listen = {KVHOST_DEFAULT_ADDRESS};
  BackendChoice backend = BackendChoice::kAuto;
  // The pools' registry: shm_dir, memory_limit and region_mode are set
  // here; memory_reserve and region_gid are resolved at start from
  // memory_reserve and region_group below (they need the machine).
  RegistryOptions registry;
  std::optional<uint64_t> memory_reserve;  // default: min(10 GiB, 10 % of RAM)
  // Group (name or gid) of the pools' region files; "" = the process's.
  std::string region_group;
  // Host engine: helper threads per transfer direction.
  int copy_threads = 2;
  // Pools to create before any listener accepts calls (the config file's
  // `pools`), the same way CreatePool creates them; they live until the
  // daemon stops, like any other.
  std::vector<std::pair<std::string, PoolSpec>> pools;
  // The cuda backend's settings (--transfer-path, --staging-bytes,
  // --sm-blocks, --copy-streams, --ce-min-piece).
  CudaEngineOptions cuda;
  // Worker copies (server/transfer/worker_copy.h): Backup / Load with
  // worker_copy served on the cuda backend. Off: docs/PERF.md run M.
  bool worker_copy = false;
  int max_message_bytes = 64 << 20;
  // Most indices one call may carry (Alloc's num_tokens, Free, meta, Backup /
  // Load per pool): INVALID_ARGUMENT naming the count and the limit above it.
  uint64_t max_indices_per_call = uint64_t{1} << 22;
  // Access control (docs/RELIABILITY.md). Unix socket files get this mode
  // and group ("" = the process's group).
  uint32_t socket_mode = 0660;
  std::string socket_group;
  // TCP listeners: TLS with this certificate and key (PEM files); with
  // tls_client_ca, clients must present a certificate it signed. Without a
  // certificate, a TCP listener is refused unless insecure_tcp.
  std::string tls_cert;
  std::string tls_key;
  std::string tls_client_ca;
  bool insecure_tcp = false;
  // Worker sessions: how long a broken session's attachments may keep
  // transfers in flight before they are closed (also the keepalive bound
  // that finds a silent peer).
  absl::Duration session_timeout = absl::Seconds(5);
  // SIGTERM: accepted transfers get this long to finish, then the rest are
  // cancelled.
  absl::Duration drain_timeout = absl::Seconds(30);
  // Prometheus endpoint, "host:port" or ":port" ("" = no metrics at all).
  std::string metrics_listen;
  // The handoff socket (server/service/handoff_server.h), an absolute path;
  // "auto" = the first unix listener's path + ".fds" (none when every
  // listener is TCP), "" = none (attachments with layer_progress refused).
  std::string handoff_socket = "auto";
  // Fast-path mailboxes served at once (server/service/fast_path_server.h),
  // through the handoff socket; 0 = the fast path is off.
  uint32_t fast_path_connections = kDefaultFastPathConnections;
  // Of which one client may hold (its open session, else its uid).
  uint32_t fast_path_connections_per_client = kDefaultFastPathConnectionsPerClient;
  // The L3 tier (server/storage/storage_tier.h, kvhost.v1.StorageService):
  // on when l3.servers is not empty (--l3-memcached), else its calls are
  // FAILED_PRECONDITION.
  MemcachedOptions l3;
  StorageTierOptions l3_tier;
  // The fleet secret's file (--l3-secret-file), required with l3.servers.
  std::string l3_secret_file;

  // INVALID_ARGUMENT naming the flag and the value for a setting out of
  // range or a combination that cannot work (the cuda settings:
  // CudaEngineOptions::Validate; a forced transfer path with
  // --backend=host).
  absl::Status Validate() const;
};

}  // namespace kvhost

#endif  // KVHOST_SERVER_DAEMON_OPTIONS_H_
