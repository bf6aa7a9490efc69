#include "server/daemon.h"

#include <grp.h>
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server_builder.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "common/bytes.h"
#include "grpc/health/v1/health.pb.h"
#include "server/daemon_metrics.h"
#include "server/declared_pools.h"
#include "server/gpu_probe.h"
#include "server/ids.h"
#include "server/pool/host_memory.h"
#include "server/service/cache_service.h"
#include "server/service/daemon_service.h"
#include "server/service/pool_service.h"
#include "server/service/reflection_v1.h"
#include "server/service/storage_service.h"
#include "server/service/transfer_service.h"
#include "server/tickets/retention.h"
#include "server/transfer/host_engine.h"
#ifdef KVHOST_HAVE_CUDA_ENGINE
#include "server/transfer/cuda_engine.h"
#endif
#include "spdlog/spdlog.h"

namespace kvhost {
namespace {

// Handshake bound of a new connection (TLS included, on a loaded 2-core
// machine well under a second) and the idle bound of an open one.
constexpr int kHandshakeTimeoutMs = 10'000;
constexpr int kMaxConnectionIdleMs = 10 * 60'000;

// "unix:///run/x.sock" or "unix:/run/x.sock" -> "/run/x.sock"; "" otherwise.
std::string UnixPath(const std::string& address) {
  if (absl::StartsWith(address, "unix://")) return address.substr(7);
  if (absl::StartsWith(address, "unix:")) return address.substr(5);
  return "";
}

// Makes the socket's directory and removes a socket file nobody listens on
// (left by a killed daemon); refuses when another server answers there.
// `what` names the path's flag in messages.
absl::Status PrepareSocketPath(const std::string& path, const char* what = "--listen unix path") {
  if (path.empty() || path[0] != '/') {
    return absl::InvalidArgumentError(absl::StrCat(what, " '", path, "' must be absolute"));
  }
  sockaddr_un addr{};
  if (path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " '", path, "' is longer than ", sizeof(addr.sun_path) - 1, " bytes"));
  }
  std::error_code ec;
  std::filesystem::create_directories(std::filesystem::path(path).parent_path(), ec);
  if (ec) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot create the directory of ", path, ": ", ec.message()));
  }
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) return absl::OkStatus();
  if (!S_ISSOCK(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat(path, " exists and is not a socket"));
  }
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  // A listener of another socket type (the handoff socket's SEQPACKET)
  // answers EPROTOTYPE: live too.
  const bool live =
      ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 || errno == EPROTOTYPE;
  ::close(fd);
  if (live) {
    return absl::FailedPreconditionError(absl::StrCat("another server already listens on ", path));
  }
  ::unlink(path.c_str());
  spdlog::info("removed stale socket {}", path);
  return absl::OkStatus();
}

// --socket-group: a group name or a numeric gid; "" = the process's group.
absl::StatusOr<gid_t> ResolveSocketGroup(const std::string& group) {
  if (group.empty()) return ::getegid();
  uint32_t gid = 0;
  if (absl::SimpleAtoi(group, &gid)) return static_cast<gid_t>(gid);
  std::vector<char> buffer(16384);
  struct group entry;
  struct group* found = nullptr;
  const int err = ::getgrnam_r(group.c_str(), &entry, buffer.data(), buffer.size(), &found);
  if (found == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("--socket-group '", group, "' is not a known group",
                     err != 0 ? absl::StrCat(" (", std::strerror(err), ")") : std::string()));
  }
  return found->gr_gid;
}

// A PEM file named by `flag`, read whole; FAILED_PRECONDITION naming the file.
absl::StatusOr<std::string> ReadPem(const char* flag, const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::FailedPreconditionError(
        absl::StrCat(flag, " ", path, " cannot be read: ", std::strerror(errno)));
  }
  std::ostringstream text;
  text << in.rdbuf();
  if (text.str().empty()) {
    return absl::FailedPreconditionError(absl::StrCat(flag, " ", path, " is empty"));
  }
  return text.str();
}

// The credentials of TCP listeners: TLS from --tls-cert / --tls-key (with
// --tls-client-ca, clients must present a certificate it signed), or
// plaintext with --insecure-tcp. Null when there is no TCP listener to serve.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> TcpCredentials(
    const DaemonOptions& options, const std::vector<std::string>& tcp_addresses) {
  if (options.tls_cert.empty() != options.tls_key.empty()) {
    return absl::InvalidArgumentError("--tls-cert and --tls-key go together; one was given alone");
  }
  if (!options.tls_client_ca.empty() && options.tls_cert.empty()) {
    return absl::InvalidArgumentError("--tls-client-ca needs --tls-cert and --tls-key");
  }
  if (tcp_addresses.empty()) return std::shared_ptr<grpc::ServerCredentials>();
  if (options.tls_cert.empty()) {
    if (!options.insecure_tcp) {
      return absl::FailedPreconditionError(absl::StrCat(
          "TCP listener ", absl::StrJoin(tcp_addresses, ", "),
          " needs TLS: give --tls-cert/--tls-key or --insecure-tcp (plaintext, anyone who "
          "reaches the port may use kvhostd)"));
    }
    spdlog::warn(
        "INSECURE: --insecure-tcp: {} serve(s) plaintext TCP without TLS or any client "
        "authentication; anyone who can reach the port can create, read, change and delete pools",
        absl::StrJoin(tcp_addresses, ", "));
    return grpc::InsecureServerCredentials();
  }
  grpc::SslServerCredentialsOptions ssl;
  absl::StatusOr<std::string> cert = ReadPem("--tls-cert", options.tls_cert);
  if (!cert.ok()) return cert.status();
  absl::StatusOr<std::string> key = ReadPem("--tls-key", options.tls_key);
  if (!key.ok()) return key.status();
  ssl.pem_key_cert_pairs.push_back({*std::move(key), *std::move(cert)});
  if (!options.tls_client_ca.empty()) {
    absl::StatusOr<std::string> ca = ReadPem("--tls-client-ca", options.tls_client_ca);
    if (!ca.ok()) return ca.status();
    ssl.pem_root_certs = *std::move(ca);
    ssl.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  } else {
    ssl.client_certificate_request = GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE;
  }
  spdlog::info(
      "TLS on {} with certificate {}{}", absl::StrJoin(tcp_addresses, ", "), options.tls_cert,
      options.tls_client_ca.empty()
          ? std::string(" (no client certificates)")
          : absl::StrCat(", client certificates required, signed by ", options.tls_client_ca));
  return grpc::SslServerCredentials(ssl);
}

// Gives a unix socket file its group and then its mode (it was created with
// at most the owner's bits of the mode, so it is never more open than asked).
absl::Status ApplySocketAccess(const std::string& path, uint32_t mode, gid_t gid) {
  if (::chown(path.c_str(), static_cast<uid_t>(-1), gid) != 0) {
    return absl::PermissionDeniedError(
        absl::StrCat("cannot give socket ", path, " group ", gid, ": ", std::strerror(errno)));
  }
  if (::chmod(path.c_str(), static_cast<mode_t>(mode)) != 0) {
    return absl::PermissionDeniedError(absl::StrCat("cannot give socket ", path, " mode ",
                                                    absl::StrFormat("%04o", mode), ": ",
                                                    std::strerror(errno)));
  }
  return absl::OkStatus();
}

// `region_inodes`: the registry's region files, which the host engine
// refuses as device buffers.
absl::StatusOr<std::unique_ptr<TransferEngine>> MakeEngine(
    const DaemonOptions& options, std::shared_ptr<const RegionInodes> region_inodes,
    std::string* chosen, std::string* detail) {
  // Ranges and combinations: DaemonOptions::Validate, in Start.
  const CudaPath path = options.cuda.path;
  const char* backend = BackendChoiceName(options.backend);
  const GpuProbe gpus =
      options.backend == BackendChoice::kHost ? GpuProbe{0, "not probed"} : ProbeGpus();
  const char* why_host = "";
#ifdef KVHOST_HAVE_CUDA_ENGINE
  if (options.backend == BackendChoice::kCuda ||
      (options.backend == BackendChoice::kAuto && gpus.count > 0)) {
    if (gpus.count == 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("--backend=cuda: no usable GPU (", gpus.detail, "); use --backend=host"));
    }
    absl::StatusOr<std::unique_ptr<CudaEngine>> cuda = CudaEngine::Create(options.cuda);
    if (cuda.ok()) {
      *chosen = "cuda";
      *detail =
          absl::StrCat("--backend=", backend, "; ", (*cuda)->Describe(), "; driver: ", gpus.detail);
      spdlog::info("backend cuda (--backend={}): {}", backend, (*cuda)->Describe());
      return std::unique_ptr<TransferEngine>(*std::move(cuda));
    }
    if (options.backend == BackendChoice::kCuda) {
      return absl::FailedPreconditionError(
          absl::StrCat("--backend=cuda: ", cuda.status().message(), " (", gpus.detail, ")"));
    }
    why_host = "the CUDA engine did not start";
    spdlog::warn("backend auto: {}, but the CUDA engine did not start ({}); using host",
                 gpus.detail, std::string(cuda.status().message()));
  }
#else
  if (options.backend == BackendChoice::kCuda) {
    return absl::FailedPreconditionError(
        absl::StrCat("--backend=cuda: this kvhostd was built without CUDA (GPUs: ", gpus.detail,
                     "); rebuild where nvcc is found, or use --backend=host"));
  }
  if (options.backend == BackendChoice::kAuto && gpus.count > 0) {
    why_host = "no CUDA transfer engine in this build";
    spdlog::warn("backend auto: {}, but {}; using host", gpus.detail, why_host);
  }
#endif
  if (options.backend == BackendChoice::kAuto && gpus.count == 0) {
    spdlog::info("backend auto: {}; using host", gpus.detail);
  }
  if (path != CudaPath::kAuto) {
    spdlog::warn("--transfer-path={} ignored on the host backend", CudaPathFlag(path));
  }
  *chosen = "host";
  *detail = absl::StrCat("--backend=", backend, "; GPUs: ", gpus.detail,
                         *why_host != '\0' ? "; " : "", why_host);
  HostEngineOptions host;
  host.shm_dir = options.registry.shm_dir;
  host.region_inodes = region_inodes;
  host.helper_threads = options.copy_threads;
  return std::unique_ptr<TransferEngine>(new HostEngine(host));
}

}  // namespace

namespace {

// --handoff-socket resolved: "auto" is the first unix listener's path +
// ".fds" ("" when there is none), anything else as given.
std::string HandoffPath(const DaemonOptions& options) {
  if (options.handoff_socket != "auto") return options.handoff_socket;
  for (const std::string& address : options.listen) {
    if (const std::string path = UnixPath(address); !path.empty()) return path + ".fds";
  }
  return "";
}

// Whether `address` is a unix socket's ("unix:..."); the rest are TCP.
bool IsUnixAddress(const std::string& address) {
  return !UnixPath(address).empty() || absl::StartsWith(address, "unix");
}

// The registry's options: the memory budget from the host's memory and the
// flags, the region files' mode and group.
absl::StatusOr<RegistryOptions> MakeRegistryOptions(const DaemonOptions& options) {
  absl::StatusOr<MemorySnapshot> mem = ReadMemorySnapshot("/");
  if (!mem.ok()) return mem.status();
  RegistryOptions registry = options.registry;
  registry.memory_reserve = options.memory_reserve.value_or(DefaultMemoryReserve(mem->mem_total));
  if (!options.region_group.empty()) {
    absl::StatusOr<gid_t> region_gid = ResolveSocketGroup(options.region_group);
    if (!region_gid.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--region-group '", options.region_group, "' is not a known group"));
    }
    registry.region_gid = static_cast<int64_t>(*region_gid);
  }
  spdlog::info("memory: {} total, {} available, reserve {}, limit {}{}",
               FormatBytes(mem->mem_total), FormatBytes(mem->mem_available),
               FormatBytes(registry.memory_reserve),
               registry.memory_limit ? FormatBytes(registry.memory_limit) : "none",
               mem->cgroup_limit ? absl::StrCat(", cgroup ", mem->cgroup_source, " limit ",
                                                FormatBytes(*mem->cgroup_limit))
                                 : "");
  return registry;
}

// Channel arguments of every connection (keepalive, handshake and idle
// bounds).
void SetChannelArguments(const DaemonOptions& options, grpc::ServerBuilder* builder) {
  builder->SetMaxReceiveMessageSize(options.max_message_bytes);
  builder->SetMaxSendMessageSize(options.max_message_bytes);
  // Worker sessions: a peer that stops answering pings (a frozen host, a
  // cut link; a dead process closes its connection at once) is found within
  // --session-timeout: a ping every half of it, the other half to answer.
  const int half_ms = static_cast<int>(
      std::max<int64_t>(absl::ToInt64Milliseconds(options.session_timeout) / 2, 50));
  builder->AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, half_ms);
  builder->AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, half_ms);
  builder->AddChannelArgument(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  // Clients may ping too (kvhost::Client does every 10 s).
  builder->AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 1000);
  // A connection that has not finished its handshake (TLS, and the HTTP/2
  // preface and SETTINGS) is closed after this; gRPC's default of 120 s let
  // a local client hold thousands of half-open connections (and their fds).
  builder->AddChannelArgument(GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS, kHandshakeTimeoutMs);
  // A connection with no call for this long is closed (GOAWAY); clients
  // reconnect on their next call. Session streams are calls: never idle.
  builder->AddChannelArgument(GRPC_ARG_MAX_CONNECTION_IDLE_MS, kMaxConnectionIdleMs);
}

}  // namespace

// The options checked before anything is created, so that a bad group, an
// unreadable certificate or a malformed address fails the start at once.
absl::StatusOr<Daemon::Listeners> Daemon::CheckListeners(const DaemonOptions& options) {
  if (options.listen.empty()) return absl::InvalidArgumentError("--listen names no address");
  // Listen addresses first: a unix path that is not absolute would otherwise
  // be blamed on --handoff-socket (which defaults to it + ".fds"), and a
  // path without "unix:" on TLS (it is taken as a TCP address).
  for (const std::string& address : options.listen) {
    if (absl::StartsWith(address, "/") || absl::StartsWith(address, ".")) {
      return absl::InvalidArgumentError(
          absl::StrCat("--listen '", address,
                       "' is a file path, which would be taken as a TCP address: "
                       "write a unix socket as unix://",
                       address[0] == '/' ? address : "/ABSOLUTE/PATH"));
    }
    if (const std::string path = UnixPath(address); IsUnixAddress(address) && path[0] != '/') {
      return absl::InvalidArgumentError(
          absl::StrCat("--listen '", address, "': the socket path '", path,
                       "' must be absolute: unix:///absolute/path (three slashes)"));
    }
  }
  if (const std::string handoff = HandoffPath(options); !handoff.empty() && handoff[0] != '/') {
    return absl::InvalidArgumentError(absl::StrCat("--handoff-socket '", options.handoff_socket,
                                                   "' must be an absolute path, 'auto' or ''"));
  }
  if (options.socket_mode > 0777) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--socket-mode ", absl::StrFormat("%04o", options.socket_mode), " is not a file mode"));
  }
  Listeners listeners;
  absl::StatusOr<gid_t> socket_gid = ResolveSocketGroup(options.socket_group);
  if (!socket_gid.ok()) return socket_gid.status();
  listeners.socket_gid = *socket_gid;
  std::vector<std::string> tcp_addresses;
  for (const std::string& address : options.listen) {
    if (!IsUnixAddress(address)) tcp_addresses.push_back(address);
  }
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> tcp_credentials =
      TcpCredentials(options, tcp_addresses);
  if (!tcp_credentials.ok()) return tcp_credentials.status();
  listeners.tcp_credentials = *std::move(tcp_credentials);
  if (!options.metrics_listen.empty()) {
    // A malformed address fails before anything starts; one that cannot be
    // bound fails once the endpoint starts, after the gRPC server.
    std::string host;
    int port = 0;
    if (absl::Status s = ParseHostPort(options.metrics_listen, &host, &port); !s.ok()) return s;
  }
  struct stat st;
  const std::string& shm_dir = options.registry.shm_dir;
  if (::stat(shm_dir.c_str(), &st) != 0) {
    const int err = errno;
    return absl::FailedPreconditionError(absl::StrCat(
        "--shm-dir ", shm_dir, ": ", std::strerror(err),
        err == ENOENT ? "; create it (a tmpfs, e.g. mkdir -p and mount -t tmpfs, or use /dev/shm)"
                      : ""));
  }
  if (!S_ISDIR(st.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat("--shm-dir ", shm_dir, " is not a directory"));
  }
  return listeners;
}

absl::StatusOr<std::unique_ptr<Daemon>> Daemon::Start(const DaemonOptions& options) {
  if (absl::Status s = options.Validate(); !s.ok()) return s;
  std::unique_ptr<Daemon> daemon(new Daemon());
  absl::StatusOr<Listeners> listeners = CheckListeners(options);
  if (!listeners.ok()) return listeners.status();
  absl::StatusOr<RegistryOptions> registry = MakeRegistryOptions(options);
  if (!registry.ok()) return registry.status();
  daemon->StartRegistry(*registry);
  absl::StatusOr<Backend> backend = daemon->StartTransfers(options, registry->region_inodes);
  if (!backend.ok()) return backend.status();
  if (absl::Status s = daemon->StartStorage(options); !s.ok()) return s;
  if (absl::Status s = daemon->CreateDeclaredPools(options); !s.ok()) return s;
  const std::string instance_id = RandomHex();
  if (absl::Status s = daemon->StartServer(options, *listeners, backend->detail, instance_id);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = daemon->StartMetrics(options, backend->name, instance_id); !s.ok()) {
    return s;
  }
  daemon->ReportServing(options, backend->name);
  return daemon;
}

void Daemon::StartRegistry(const RegistryOptions& options) {
  registry_ = std::make_unique<PoolRegistry>(options);
  if (int n = registry_->RemoveStaleRegions(); n > 0) {
    spdlog::warn("removed {} stale region file(s) from {}", n, options.shm_dir);
  }
}

absl::StatusOr<Daemon::Backend> Daemon::StartTransfers(
    const DaemonOptions& options, std::shared_ptr<const RegionInodes> region_inodes) {
  Backend backend;
  absl::StatusOr<std::unique_ptr<TransferEngine>> engine =
      MakeEngine(options, std::move(region_inodes), &backend.name, &backend.detail);
  if (!engine.ok()) return engine.status();
  if (!options.metrics_listen.empty()) metrics_ = std::make_unique<KvhostMetrics>();
  transfers_ = std::make_unique<TransferManager>(*std::move(engine), metrics_.get());
  caches_ = std::make_unique<NodeCaches>(transfers_.get());
  if (options.worker_copy) {
    transfers_->EnableWorkerCopy();
    spdlog::info("worker copies on (--worker-copy){}",
                 backend.name == "host" ? ", but the host backend refuses them" : "");
  }
  return backend;
}

absl::Status Daemon::StartStorage(const DaemonOptions& options) {
  if (options.l3.servers.empty()) return absl::OkStatus();
  if (options.l3_secret_file.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--l3-memcached needs --l3-secret-file: the fleet secret that authenticates stored pages "
        "and separates tenants' keys; ",
        L3Secret::HowToMake()));
  }
  absl::StatusOr<L3Secret> secret = L3Secret::Load(options.l3_secret_file);
  if (!secret.ok()) return secret.status();
  absl::StatusOr<std::unique_ptr<MemcachedBackend>> backend = MemcachedBackend::Create(options.l3);
  if (!backend.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--l3-memcached: ", backend.status().message()));
  }
  const std::string described = (*backend)->Describe();
  storage_ = std::make_unique<StorageTier>(*std::move(backend), options.l3_tier, *std::move(secret),
                                           metrics_.get());
  spdlog::info(
      "L3 tier on {}: {} threads, at most {} pages in flight ({} per pool)", described,
      options.l3_tier.threads, options.l3_tier.max_pages_in_flight,
      std::min(options.l3_tier.max_pages_in_flight, options.l3_tier.max_pages_in_flight_per_pool));
  return absl::OkStatus();
}

absl::Status Daemon::CreateDeclaredPools(const DaemonOptions& options) {
  // Admitted (spec, name, memory budget) before the daemon serves, and one
  // refused stops the start; their memory fills in the background, so
  // health, GetStatus (pools_creating) and GetPool (CREATING) answer while it
  // does. Followers are created once the pool they follow is filled.
  return kvhost::CreateDeclaredPools(registry_.get(), options.pools);
}

absl::Status Daemon::StartServer(const DaemonOptions& options, const Listeners& listeners,
                                 const std::string& backend_detail,
                                 const std::string& instance_id) {
  grpc::EnableDefaultHealthCheckService(true);
  // Reflection serves descriptors from protobuf's generated pool. gRPC's own
  // health service is not built from protobuf, so grpc.health.v1 gets there
  // only from kvhost_proto's health.pb.cc, which nothing else in kvhostd
  // uses: this reference links it in (its static initializer registers the
  // file), so that grpcurl can describe and call Health.
  (void)grpc::health::v1::HealthCheckRequest::descriptor();
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  SetChannelArguments(options, &builder);
  if (metrics_ != nullptr) {
    std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> creators;
    creators.push_back(MakeRpcMetricsInterceptorFactory(metrics_.get()));
    builder.experimental().SetInterceptorCreators(std::move(creators));
  }
  std::vector<int> ports(options.listen.size(), 0);
  for (size_t i = 0; i < options.listen.size(); ++i) {
    const std::string& address = options.listen[i];
    // Unix sockets: plaintext; their file's mode and group are the control.
    const bool unix_socket = IsUnixAddress(address);
    if (unix_socket) {
      const std::string path = UnixPath(address);
      if (absl::Status s = PrepareSocketPath(path); !s.ok()) return s;
      socket_paths_.push_back(path);
    }
    builder.AddListeningPort(
        address, unix_socket ? grpc::InsecureServerCredentials() : listeners.tcp_credentials,
        &ports[i]);
  }
  handoff_path_ = HandoffPath(options);
  deposits_ = std::make_unique<Deposits>(DepositLimitsOfThisProcess(),
                                         [transfers = transfers_.get()](const std::string& id) {
                                           return transfers->IsSessionOpen(id);
                                         });
  if (!handoff_path_.empty()) {
    if (absl::Status s = PrepareSocketPath(handoff_path_, "--handoff-socket"); !s.ok()) return s;
  }
  RegisterServices(options, backend_detail, instance_id, &builder);
  // The socket files are made while the server starts (bind); a umask that
  // leaves at most the mode's owner bits means no one else may connect
  // before ApplySocketAccess gives them the group and the mode asked for.
  // (The umask is the process's: nothing else creates files meanwhile.)
  const mode_t umask_before = ::umask(static_cast<mode_t>(0777 & ~(options.socket_mode & 0700)));
  server_ = builder.BuildAndStart();
  absl::Status handoff = absl::OkStatus();
  if (server_ != nullptr && !handoff_path_.empty()) {
    absl::StatusOr<std::unique_ptr<HandoffServer>> started = HandoffServer::Start(
        handoff_path_, TransferHandoffSource(transfers_.get()), deposits_.get(), fast_path_.get());
    handoff = started.status();
    if (started.ok()) {
      handoff_ = *std::move(started);
      socket_paths_.push_back(handoff_path_);
    }
  }
  ::umask(umask_before);
  if (server_ == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", absl::StrJoin(options.listen, ", ")));
  }
  if (!handoff.ok()) return handoff;
  // gRPC's health service starts out SERVING; until the rest is up it is not.
  server_->GetHealthCheckService()->SetServingStatus(false);
  for (const std::string& path : socket_paths_) {
    if (absl::Status s = ApplySocketAccess(path, options.socket_mode, listeners.socket_gid);
        !s.ok()) {
      return s;
    }
    spdlog::info("socket {}: mode {}, group {}{}", path,
                 absl::StrFormat("%04o", options.socket_mode), listeners.socket_gid,
                 options.socket_group.empty()
                     ? " (kvhostd's own)"
                     : absl::StrCat(" (--socket-group ", options.socket_group, ")"));
  }
  for (size_t i = 0; i < options.listen.size(); ++i) {
    const std::string& address = options.listen[i];
    if (UnixPath(address).empty() && absl::EndsWith(address, ":0")) {
      addresses_.push_back(absl::StrCat(address.substr(0, address.size() - 1), ports[i]));
    } else {
      addresses_.push_back(address);
    }
  }
  return absl::OkStatus();
}

void Daemon::RegisterServices(const DaemonOptions& options, const std::string& backend_detail,
                              const std::string& instance_id, grpc::ServerBuilder* builder) {
  TransferManager* sessions = transfers_.get();
  auto pools = std::make_unique<PoolServiceImpl>(
      registry_.get(), transfers_->backend(), options.max_message_bytes, metrics_.get(),
      options.max_indices_per_call,
      [sessions](const std::string& id) { return sessions->IsSessionOpen(id); });
  auto transfers = std::make_unique<TransferServiceImpl>(
      transfers_.get(), registry_.get(), options.max_indices_per_call, handoff_path_,
      static_cast<uint64_t>(options.max_message_bytes),
      handoff_path_.empty() ? nullptr : deposits_.get());
  DaemonIdentity identity;
  identity.backend_detail = backend_detail;
  identity.instance_id = instance_id;
  for (const auto& [name, spec] : options.pools) identity.declared_pools.push_back(name);
  identity.session_timeout = options.session_timeout;
  identity.handoff_socket = handoff_path_;
  identity.l3 = L3Backend();
  NodeCaches* caches = caches_.get();
  identity.session_ended = [caches](const std::string& id) { caches->SessionEnded(id); };
  auto cache = std::make_unique<CacheServiceImpl>(registry_.get(), caches_.get(),
                                                  options.max_indices_per_call, storage_);
  cache_service_ = cache.get();
  if (!handoff_path_.empty()) {
    fast_path_calls_ = std::make_unique<FastPathCalls>(pools.get(), transfers.get(), cache.get());
    FastPathServer::Limits limits;
    limits.max_connections = options.fast_path_connections;
    limits.per_client = options.fast_path_connections_per_client;
    TransferManager* manager = transfers_.get();
    fast_path_ = std::make_unique<FastPathServer>(
        fast_path_calls_.get(), limits, registry_.get(),
        [manager](const std::string& id) { return manager->IsSessionOpen(id); }, metrics_.get());
    identity.fast_path = fast_path_.get();
  }
  auto status = std::make_unique<DaemonServiceImpl>(registry_.get(), transfers_.get(), identity);
  daemon_service_ = status.get();
  drain_timeout_ = options.drain_timeout;
  auto storage = std::make_unique<StorageServiceImpl>(
      registry_.get(), storage_.get(), options.max_indices_per_call, metrics_.get(),
      PerPoolRetention{},
      [sessions](const std::string& id) { return sessions->IsSessionOpen(id); });
  // grpc.reflection.v1 beside gRPC's v1alpha plugin, listing the same
  // services (health and both reflections are the builder's and ours).
  auto reflection = std::make_unique<ReflectionV1Service>(std::vector<std::string>{
      v1::PoolService::service_full_name(), v1::TransferService::service_full_name(),
      v1::DaemonService::service_full_name(), v1::StorageService::service_full_name(),
      v1::CacheService::service_full_name(), "grpc.health.v1.Health",
      "grpc.reflection.v1alpha.ServerReflection",
      grpc::reflection::v1::ServerReflection::service_full_name()});
  builder->RegisterService(pools.get());
  builder->RegisterService(transfers.get());
  builder->RegisterService(status.get());
  builder->RegisterService(storage.get());
  builder->RegisterService(cache.get());
  builder->RegisterService(reflection.get());
  services_.push_back(std::move(pools));
  services_.push_back(std::move(transfers));
  services_.push_back(std::move(status));
  services_.push_back(std::move(storage));
  services_.push_back(std::move(cache));
  services_.push_back(std::move(reflection));
}

absl::Status Daemon::StartMetrics(const DaemonOptions& options, const std::string& backend,
                                  const std::string& instance_id) {
  // After the gRPC server, before health says SERVING: a scraper that finds
  // the endpoint finds a daemon that answers.
  if (metrics_ == nullptr) return absl::OkStatus();
  absl::StatusOr<std::unique_ptr<MetricsHttpServer>> http = MetricsHttpServer::Start(
      options.metrics_listen,
      AddDaemonMetrics(metrics_.get(), registry_.get(), transfers_.get(), caches_.get(),
                       L3Backend(), {KVHOST_VERSION, backend, instance_id}));
  if (!http.ok()) return http.status();
  metrics_server_ = *std::move(http);
  spdlog::info("metrics on {}", metrics_server_->url());
  return absl::OkStatus();
}

void Daemon::ReportServing(const DaemonOptions& options, const std::string& backend) {
  // Overall ("") and per service, so that a probe may name the service it
  // needs; Shutdown turns them all NOT_SERVING.
  auto* health = server_->GetHealthCheckService();
  for (const char* service : kServedServices) health->SetServingStatus(service, true);
  // (The overall call sets every service's status too, hence first.)
  health->SetServingStatus(true);
  // Without --l3-memcached every StorageService call answers
  // FAILED_PRECONDITION: a probe asking for it learns so here.
  if (storage_ == nullptr) {
    health->SetServingStatus(v1::StorageService::service_full_name(), false);
  }
  spdlog::info("serving on {} (backend {}, shm dir {})", absl::StrJoin(addresses_, ", "), backend,
               options.registry.shm_dir);
}

void Daemon::Shutdown(absl::Duration grace) {
  if (stopped_) return;
  stopped_ = true;
  server_->GetHealthCheckService()->SetServingStatus(false);
  // Creations in progress stop within a chunk (their calls end UNAVAILABLE),
  // so that the server's shutdown does not wait for them.
  registry_->CancelCreations();
  const TransferCounters before = transfers_->counters();
  spdlog::info("shutting down: draining {} transfer(s) in flight (at most {})",
               before.tickets_in_flight, absl::FormatDuration(drain_timeout_));
  transfers_->Drain(drain_timeout_);
  // Fast-path calls in progress finish (their waits end with the drain);
  // no mailbox is served after this.
  if (fast_path_ != nullptr) fast_path_->Stop();
  // Session streams last as long as their workers, event watches as long as
  // their routers; end them so that the server's shutdown does not wait out
  // `grace` for them.
  daemon_service_->EndSessions();
  cache_service_->EndWatches();
  server_->Shutdown(absl::ToChronoTime(absl::Now() + grace));
  server_->Wait();
  if (metrics_server_ != nullptr) metrics_server_->Stop();
  if (handoff_ != nullptr) handoff_->Stop();
  for (const std::string& path : socket_paths_) ::unlink(path.c_str());
  const TransferCounters after = transfers_->counters();
  const size_t pools = registry_->List().size();
  const uint64_t bytes = registry_->used_bytes();
  spdlog::info("stopped: {} ticket(s) done, {} failed; releasing {} pool(s) ({})",
               after.tickets_done, after.tickets_failed, pools, FormatBytes(bytes));
  const absl::Time release_start = absl::Now();
  registry_->ReleaseAll();
  spdlog::info("released {} pool(s) in {}", pools,
               absl::FormatDuration(absl::Now() - release_start));
}

Daemon::~Daemon() {
  if (server_ != nullptr) Shutdown(absl::Seconds(5));
}

}  // namespace kvhost
