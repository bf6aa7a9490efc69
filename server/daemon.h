// Daemon: kvhostd assembled — registry, transfer engine and manager, the gRPC
// server with its listeners, health and reflection — and its orderly end.
//
// Start() returns once every listener accepts calls and health says SERVING.
// Shutdown() sets health to NOT_SERVING, refuses new transfers, waits for the
// accepted ones to finish, then stops the server (in-flight RPCs get `grace`),
// removes its unix socket files and releases every pool's memory.
//
// Thread safety: Shutdown may be called from any thread, once.
#ifndef KVHOST_SERVER_DAEMON_H_
#define KVHOST_SERVER_DAEMON_H_

#include <grpcpp/server.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/pool/registry.h"
#include "server/transfer/transfer_manager.h"

namespace kvhost {

struct DaemonOptions {
  std::vector<std::string> listen = {"unix:///run/kvhost/kvhost.sock"};
  std::string backend = "auto";  // auto | host | cuda
  std::string shm_dir = "/dev/shm";
  uint64_t memory_limit = 0;
  std::optional<uint64_t> memory_reserve;  // default: min(10 GiB, 10 % of RAM)
  int copy_threads = 2;
  // cuda backend (CudaEngineOptions): auto | ce | staged | sm, the device
  // staging buffer per stream, and the SM path's grid quota.
  std::string transfer_path = "auto";
  uint64_t staging_bytes = uint64_t{1} << 30;
  int sm_blocks = 16;
  bool load_gates = false;
  int max_message_bytes = 64 << 20;
};

class Daemon {
 public:
  static absl::StatusOr<std::unique_ptr<Daemon>> Start(const DaemonOptions& options);
  ~Daemon();

  void Shutdown(absl::Duration grace);
  // Addresses actually bound (a TCP port 0 is resolved).
  const std::vector<std::string>& addresses() const { return addresses_; }

 private:
  Daemon() = default;

  std::unique_ptr<PoolRegistry> registry_;
  std::unique_ptr<TransferManager> transfers_;
  std::vector<std::unique_ptr<grpc::Service>> services_;
  std::unique_ptr<grpc::Server> server_;
  std::vector<std::string> addresses_;
  std::vector<std::string> socket_paths_;
  bool stopped_ = false;
};

}  // namespace kvhost

#endif  // KVHOST_SERVER_DAEMON_H_
