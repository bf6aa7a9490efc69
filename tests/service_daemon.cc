#include "service_daemon.h"

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <utility>

#include "domain_test_util.h"
#include "in_process_server.h"
#include "server/service/pool_service.h"
#include "server/service/transfer_service.h"
#include "server/transfer/host_engine.h"

namespace kvhost::testing {

ServiceDaemon::ServiceDaemon(Config config) : dir_("kvhost-service-daemon") {
  address_ = "unix://" + dir_.path() + "/grpc.sock";
  Start(std::move(config));
}

ServiceDaemon::~ServiceDaemon() { Stop(); }

void ServiceDaemon::Start(Config config) {
  ok_ = false;
  if (dir_.path().empty()) return;
  RegistryOptions options = RoomyRegistryOptions(dir_.path());
  options.read_fs_free = [](const DirFd&) -> absl::StatusOr<uint64_t> { return UINT64_MAX; };
  registry_ = std::make_unique<PoolRegistry>(options);
  for (const auto& [name, spec] : config.declared) {
    if (!registry_->Create(name, spec).ok()) return;
  }
  HostEngineOptions engine;
  engine.shm_dir = dir_.path();
  engine.region_inodes = options.region_inodes;
  manager_ = std::make_unique<TransferManager>(std::make_unique<HostEngine>(engine));
  pools_ = std::make_unique<PoolServiceImpl>(
      registry_.get(), "host", 64 << 20, nullptr, PoolServiceImpl::kDefaultMaxIndicesPerCall,
      [manager = manager_.get()](const std::string& id) { return manager->IsSessionOpen(id); });
  transfers_ = std::make_unique<TransferServiceImpl>(manager_.get(), registry_.get(), 1 << 16);
  DaemonIdentity identity;
  identity.backend_detail = "host engine (ServiceDaemon)";
  identity.instance_id = config.instance_id;
  for (const auto& declared : config.declared) identity.declared_pools.push_back(declared.first);
  identity.session_timeout = config.session_timeout;
  identity.handoff_socket = config.handoff_socket;
  daemon_ = std::make_unique<DaemonServiceImpl>(registry_.get(), manager_.get(), identity);
  server_ = std::make_unique<InProcessServer>(
      std::initializer_list<grpc::Service*>{pools_.get(), transfers_.get(), daemon_.get()},
      address_);
  ok_ = server_->ok();
}

void ServiceDaemon::Stop() {
  if (daemon_ != nullptr) daemon_->EndSessions();
  server_.reset();
  daemon_.reset();
  transfers_.reset();
  pools_.reset();
  manager_.reset();
  registry_.reset();
}

}  // namespace kvhost::testing
