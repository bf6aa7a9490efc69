// ServiceDaemon: kvhostd's Pool, Transfer and Daemon services over a
// registry and a host-engine transfer manager, served in the test process
// on a unix socket (tests/in_process_server.h), for the unit tests of the
// client modules (session_test, deposit_test): a kvhost::Client connects to
// address() as to a kvhostd, and the test reaches the daemon's state
// (manager(), registry(), service()) directly. Restart() is a kvhostd
// restart: the sessions end, and a new registry (the pools gone; declared
// ones made again, empty), manager and instance id serve the same socket.
// The pools' files and the "device" files live in one private /dev/shm
// directory (shm_dir()).
//
// For test binaries (tests/service_daemon.cc); not thread-safe (one test
// thread drives it; the services synchronise themselves). This header
// leaves out the services' own headers, which a client test need not see.
#ifndef KVHOST_TESTS_SERVICE_DAEMON_H_
#define KVHOST_TESTS_SERVICE_DAEMON_H_

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/time/time.h"
#include "server/pool/pool_spec.h"
#include "server/pool/registry.h"
#include "server/service/daemon_service.h"
#include "server/transfer/transfer_manager.h"
#include "shm_dir.h"

namespace kvhost {
class PoolServiceImpl;
class TransferServiceImpl;
}  // namespace kvhost

namespace kvhost::testing {

class InProcessServer;

class ServiceDaemon {
 public:
  struct Config {
    std::string instance_id = "inst-1";
    // DaemonStatus.handoff_socket ("": none).
    std::string handoff_socket;
    // Pools made (empty) at every start, as kvhostd's --config declares them.
    std::vector<std::pair<std::string, PoolSpec>> declared;
    absl::Duration session_timeout = absl::Seconds(5);
  };

  explicit ServiceDaemon(Config config);
  ~ServiceDaemon();
  ServiceDaemon(const ServiceDaemon&) = delete;
  ServiceDaemon& operator=(const ServiceDaemon&) = delete;

  // Whether it serves (the directory, the declared pools and the server).
  bool ok() const { return ok_; }
  const std::string& address() const { return address_; }
  const std::string& shm_dir() const { return dir_.path(); }
  PoolRegistry& registry() { return *registry_; }
  TransferManager& manager() { return *manager_; }
  DaemonServiceImpl& service() { return *daemon_; }

  // Stops (every session stream ends UNAVAILABLE, as at kvhostd's
  // shutdown) and starts again with `config`.
  void Restart(Config config) {
    Stop();
    Start(std::move(config));
  }

 private:
  void Start(Config config);
  void Stop();

  ShmDir dir_;
  std::string address_;
  bool ok_ = false;
  std::unique_ptr<PoolRegistry> registry_;
  std::unique_ptr<TransferManager> manager_;
  std::unique_ptr<PoolServiceImpl> pools_;
  std::unique_ptr<TransferServiceImpl> transfers_;
  std::unique_ptr<DaemonServiceImpl> daemon_;
  std::unique_ptr<InProcessServer> server_;
};

}  // namespace kvhost::testing

#endif  // KVHOST_TESTS_SERVICE_DAEMON_H_
