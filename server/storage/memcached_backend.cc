#include "server/storage/memcached_backend.h"

#include <libmemcached/memcached.h>

#include <algorithm>
#include <map>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/storage/page_record.h"
#include "spdlog/spdlog.h"

namespace kvhost {
namespace {

uint64_t Millis(absl::Duration d) { return static_cast<uint64_t>(absl::ToInt64Milliseconds(d)); }
// libmemcached counts retry and dead timeouts in whole seconds.
uint64_t Seconds(absl::Duration d) { return std::max<uint64_t>(1, Millis(d) / 1000); }

// "host:port" of the server `key` hashes to, for messages.
std::string ServerOf(memcached_st* mc, const std::string& key) {
  memcached_return_t rc;
  const memcached_instance_st* server = memcached_server_by_key(mc, key.data(), key.size(), &rc);
  if (server == nullptr) return "no server";
  return absl::StrCat(memcached_server_name(server), ":", memcached_server_port(server));
}

absl::Status ParseServer(const std::string& server, std::string* host, in_port_t* port) {
  const size_t colon = server.rfind(':');
  uint32_t value = 0;
  if (colon == std::string::npos || colon == 0 ||
      !absl::SimpleAtoi(server.substr(colon + 1), &value) || value == 0 || value > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("memcached server '", server, "' is not host:port (port 1..65535)"));
  }
  *host = server.substr(0, colon);
  *port = static_cast<in_port_t>(value);
  return absl::OkStatus();
}

// How often a call is tried against a failing server before its keys are
// given up on. Each of a handle's connections finds a dead server on its
// own, in up to three failed tries: a broken connection (EPIPE or a reset on
// the socket kept open), a refused reconnect (counted as its failure), and
// the next connect, which takes it out of the ring; the fourth try hashes to
// the servers left.
constexpr int kAttempts = 4;

// A key no one stores (a page's keys are PartKey's, which never take this
// form): the probe's get of it is a miss from a server that answers.
constexpr char kProbeKey[] = "kvhost-probe";

// libmemcached's name of `rc`, in lower case ("connection failure"): what
// a caller sees. memcached_last_error_message adds the source file and
// line, and at times a pointer; that detail goes to the log only.
std::string ErrorWords(const memcached_st* mc, memcached_return_t rc) {
  return absl::AsciiStrToLower(memcached_strerror(mc, rc));
}

}  // namespace

class MemcachedBackend::Handle {
 public:
  explicit Handle(MemcachedBackend* owner) : owner_(owner), c_(owner->Borrow()) {}
  ~Handle() { owner_->Return(c_); }
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;
  // Null when a handle could not be made.
  memcached_st* get() const { return c_.mc; }
  const Connection& connection() const { return c_; }

 private:
  MemcachedBackend* owner_;
  Connection c_;
};

absl::StatusOr<std::unique_ptr<MemcachedBackend>> MemcachedBackend::Create(
    const MemcachedOptions& options) {
  if (options.servers.empty()) return absl::InvalidArgumentError("no memcached server given");
  if (options.item_bytes <= kPartHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat("item size ", options.item_bytes,
                                                   " must exceed the ", kPartHeaderBytes,
                                                   "-byte page header"));
  }
  if (options.replicas >= options.servers.size()) {
    return absl::InvalidArgumentError(absl::StrCat(options.replicas, " replicas need more than ",
                                                   options.replicas, " servers; ",
                                                   options.servers.size(), " given"));
  }
  for (const absl::Duration d :
       {options.connect_timeout, options.io_timeout, options.retry_timeout}) {
    if (d < absl::Milliseconds(1)) {
      return absl::InvalidArgumentError(
          absl::StrCat("memcached timeout ", absl::FormatDuration(d), " must be >= 1ms"));
    }
  }
  std::unique_ptr<MemcachedBackend> backend(new MemcachedBackend(options));
  memcached_st* mc = memcached_create(nullptr);
  if (mc == nullptr) return absl::ResourceExhaustedError("memcached_create failed");
  backend->prototype_ = mc;
  for (const std::string& server : options.servers) {
    std::string host;
    in_port_t port = 0;
    if (absl::Status s = ParseServer(server, &host, &port); !s.ok()) return s;
    if (memcached_return_t rc = memcached_server_add(mc, host.c_str(), port);
        rc != MEMCACHED_SUCCESS) {
      return absl::InvalidArgumentError(
          absl::StrCat("memcached server '", server, "': ", memcached_strerror(mc, rc)));
    }
  }
  const std::pair<memcached_behavior_t, uint64_t> behaviors[] = {
      {MEMCACHED_BEHAVIOR_BINARY_PROTOCOL, 1},
      {MEMCACHED_BEHAVIOR_DISTRIBUTION, MEMCACHED_DISTRIBUTION_CONSISTENT_KETAMA},
      {MEMCACHED_BEHAVIOR_TCP_NODELAY, 1},
      {MEMCACHED_BEHAVIOR_CONNECT_TIMEOUT, Millis(options.connect_timeout)},
      {MEMCACHED_BEHAVIOR_POLL_TIMEOUT, Millis(options.io_timeout)},
      {MEMCACHED_BEHAVIOR_SND_TIMEOUT, Millis(options.io_timeout) * 1000},
      {MEMCACHED_BEHAVIOR_RCV_TIMEOUT, Millis(options.io_timeout) * 1000},
      {MEMCACHED_BEHAVIOR_NUMBER_OF_REPLICAS, options.replicas},
      // A server that fails once leaves the ring for retry_timeout, unless
      // replicas hold its keys (they are found from its place in the ring).
      {MEMCACHED_BEHAVIOR_SERVER_FAILURE_LIMIT, 1},
      {MEMCACHED_BEHAVIOR_AUTO_EJECT_HOSTS, options.replicas == 0 ? 1u : 0u},
      {MEMCACHED_BEHAVIOR_REMOVE_FAILED_SERVERS, options.replicas == 0 ? 1u : 0u},
      {MEMCACHED_BEHAVIOR_RETRY_TIMEOUT, Seconds(options.retry_timeout)},
      {MEMCACHED_BEHAVIOR_DEAD_TIMEOUT, Seconds(options.retry_timeout)},
  };
  for (const auto& [behavior, value] : behaviors) {
    if (memcached_return_t rc = memcached_behavior_set(mc, behavior, value);
        rc != MEMCACHED_SUCCESS) {
      return absl::InternalError(absl::StrCat("libmemcached behavior ", behavior, " = ", value,
                                              ": ", memcached_strerror(mc, rc)));
    }
  }
  if (absl::Status s = backend->StartProbes(); !s.ok()) return s;
  return backend;
}

absl::Status MemcachedBackend::StartProbes() {
  // A handle per server, that server alone, the binary protocol and the
  // timeouts of the ring's handles; a failed server is tried again at the
  // next probe.
  const absl::Time now = absl::Now();
  probes_.resize(options_.servers.size());
  for (size_t i = 0; i < probes_.size(); ++i) {
    Probe& probe = probes_[i];
    probe.state.address = options_.servers[i];
    probe.state.since = now;
    probe.mc = memcached_create(nullptr);
    if (probe.mc == nullptr) return absl::ResourceExhaustedError("memcached_create failed");
    std::string host;
    in_port_t port = 0;
    if (absl::Status s = ParseServer(options_.servers[i], &host, &port); !s.ok()) return s;
    const std::pair<memcached_behavior_t, uint64_t> behaviors[] = {
        {MEMCACHED_BEHAVIOR_BINARY_PROTOCOL, 1},
        {MEMCACHED_BEHAVIOR_CONNECT_TIMEOUT, Millis(options_.connect_timeout)},
        {MEMCACHED_BEHAVIOR_POLL_TIMEOUT, Millis(options_.io_timeout)},
        {MEMCACHED_BEHAVIOR_RETRY_TIMEOUT, 1},
    };
    memcached_return_t rc = memcached_server_add(probe.mc, host.c_str(), port);
    for (const auto& [behavior, value] : behaviors) {
      if (rc == MEMCACHED_SUCCESS) rc = memcached_behavior_set(probe.mc, behavior, value);
    }
    if (rc != MEMCACHED_SUCCESS) {
      return absl::InternalError(absl::StrCat("memcached server '", options_.servers[i],
                                              "': probe handle: ", ErrorWords(probe.mc, rc)));
    }
  }
  // The state is known before the daemon serves: the first probe runs here.
  ProbeAll();
  prober_ = std::thread([this] { ProbeLoop(); });
  return absl::OkStatus();
}

void MemcachedBackend::ProbeAll() {
  for (Probe& probe : probes_) {
    const memcached_return_t rc = memcached_exist(probe.mc, kProbeKey, sizeof(kProbeKey) - 1);
    const bool up = rc == MEMCACHED_SUCCESS || rc == MEMCACHED_NOTFOUND;
    // A server that failed is not tried again for a second (the probe
    // handle's retry timeout): it is still down for the reason found then.
    const bool not_tried =
        rc == MEMCACHED_SERVER_TEMPORARILY_DISABLED || rc == MEMCACHED_SERVER_MARKED_DEAD;
    const std::string error = up ? std::string() : ErrorWords(probe.mc, rc);
    {
      absl::MutexLock lock(&state_mu_);
      const bool changed = !probe.probed || probe.state.up != up;
      probe.probed = true;
      if (!(not_tried && !probe.state.error.empty())) probe.state.error = error;
      if (!changed) continue;
      probe.state.up = up;
      probe.state.since = absl::Now();
    }
    if (up) {
      spdlog::info("L3 memcached server {} is up", probe.state.address);
    } else {
      // libmemcached's own message, with its source location: for the log.
      spdlog::warn(
          "L3 memcached server {} is down: {} ({}); its keys miss and its stores fail until it "
          "answers again (probed every {})",
          probe.state.address, error, memcached_last_error_message(probe.mc),
          absl::FormatDuration(options_.retry_timeout));
    }
  }
}

void MemcachedBackend::ProbeLoop() {
  for (;;) {
    {
      absl::MutexLock lock(&state_mu_);
      const auto stopping = [this]() ABSL_SHARED_LOCKS_REQUIRED(state_mu_) { return stopping_; };
      if (state_mu_.AwaitWithTimeout(absl::Condition(&stopping), options_.retry_timeout)) return;
    }
    ProbeAll();
  }
}

std::vector<BackendServer> MemcachedBackend::Servers() const {
  absl::MutexLock lock(&state_mu_);
  std::vector<BackendServer> out;
  out.reserve(probes_.size());
  for (const Probe& probe : probes_) out.push_back(probe.state);
  return out;
}

MemcachedBackend::~MemcachedBackend() {
  {
    absl::MutexLock lock(&state_mu_);
    stopping_ = true;
  }
  if (prober_.joinable()) prober_.join();
  for (const Probe& probe : probes_) {
    if (probe.mc != nullptr) memcached_free(probe.mc);
  }
  absl::MutexLock lock(&mu_);
  for (const Connection& c : free_) {
    memcached_result_free(c.result);  // its buffer; the struct is ours
    delete c.result;
    memcached_free(c.mc);
  }
  if (prototype_ != nullptr) memcached_free(prototype_);
}

MemcachedBackend::Connection MemcachedBackend::Borrow() {
  {
    absl::MutexLock lock(&mu_);
    if (!free_.empty()) {
      Connection c = free_.back();
      free_.pop_back();
      return c;
    }
  }
  Connection c;
  c.mc = memcached_clone(nullptr, prototype_);
  if (c.mc == nullptr) return c;
  // Our own storage, not libmemcached's: memcached_fetch_result frees a
  // result it allocated at the end of every batch.
  c.result = new memcached_result_st;
  if (memcached_result_create(c.mc, c.result) == nullptr) {
    delete c.result;
    memcached_free(c.mc);
    c.mc = nullptr;
  }
  return c;
}

void MemcachedBackend::Return(Connection c) {
  if (c.mc == nullptr) return;
  absl::MutexLock lock(&mu_);
  free_.push_back(c);
}

std::vector<absl::Status> MemcachedBackend::Set(absl::Span<const StorageItem> items) {
  std::vector<absl::Status> out;
  if (items.empty()) return out;
  Handle handle(this);
  memcached_st* mc = handle.get();
  for (const StorageItem& item : items) {
    if (mc == nullptr) {
      out.push_back(absl::ResourceExhaustedError("memcached_clone failed"));
      continue;
    }
    memcached_return_t rc = MEMCACHED_FAILURE;
    // As in Get: a server that just failed is out of the ring by the last try.
    int tries = 0;
    while (tries < kAttempts) {
      ++tries;
      rc = memcached_set(mc, item.key.data(), item.key.size(), item.value.data(), item.value.size(),
                         0, 0);
      if (rc == MEMCACHED_SUCCESS || rc == MEMCACHED_E2BIG) break;
    }
    if (rc == MEMCACHED_SUCCESS) {
      out.push_back(absl::OkStatus());
    } else if (rc == MEMCACHED_E2BIG) {
      out.push_back(absl::ResourceExhaustedError(absl::StrCat(
          "server ", ServerOf(mc, item.key), " refused an item of ", item.value.size(),
          " bytes as too large; start memcached with a larger -I or lower --l3-item-bytes")));
    } else {
      out.push_back(absl::UnavailableError(absl::StrCat(
          "server ", ServerOf(mc, item.key), ": ", ErrorWords(mc, rc), " (", tries, " tries)")));
    }
  }
  // libmemcached sends replicas' copies without waiting for an answer and
  // leaves them in its buffers until the connection's next request: send
  // them now, or a server that dies before then loses the only copy.
  if (mc != nullptr && options_.replicas > 0) (void)memcached_flush_buffers(mc);
  return out;
}

std::vector<FetchedItem> MemcachedBackend::Get(absl::Span<const std::string> keys) {
  std::vector<FetchedItem> out(keys.size());
  if (keys.empty()) return out;
  Handle handle(this);
  memcached_st* mc = handle.get();
  if (mc == nullptr) {
    for (FetchedItem& f : out) f.error = "memcached_clone failed";
    return out;
  }
  std::vector<size_t> wanted(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) wanted[i] = i;
  // A failing server fails the batch's keys on it (see kAttempts); the keys
  // not found are asked again while an error was seen.
  for (int attempt = 0; attempt < kAttempts && !wanted.empty(); ++attempt) {
    const std::string error = GetOnce(handle.connection(), keys, wanted, &out);
    if (error.empty()) break;
    std::vector<size_t> missing;
    for (const size_t i : wanted) {
      if (out[i].found) continue;
      out[i].error =
          absl::StrCat("server ", ServerOf(mc, keys[i]), ": ", error, " (try ", attempt + 1, ")");
      missing.push_back(i);
    }
    wanted = std::move(missing);
  }
  return out;
}

std::string MemcachedBackend::GetOnce(const Connection& c, absl::Span<const std::string> keys,
                                      const std::vector<size_t>& wanted,
                                      std::vector<FetchedItem>* out) const {
  memcached_st* mc = c.mc;
  memcached_result_st* result = c.result;
  const size_t servers = options_.servers.size();
  std::vector<const char*> ptrs;
  std::vector<size_t> lengths;
  std::map<std::string, std::vector<size_t>> where;  // a key may be asked twice
  for (const size_t i : wanted) {
    ptrs.push_back(keys[i].data());
    lengths.push_back(keys[i].size());
    where[keys[i]].push_back(i);
  }
  const memcached_return_t rc = memcached_mget(mc, ptrs.data(), lengths.data(), ptrs.size());
  std::string error;
  if (rc != MEMCACHED_SUCCESS) error = ErrorWords(mc, rc);
  if (rc != MEMCACHED_SUCCESS && rc != MEMCACHED_SOME_ERRORS) return error;
  // A server failing mid-batch ends one fetch with its error; the other
  // servers' answers are still to be read, so fetching goes on (at most
  // one error per server) until END.
  size_t errors = 0;
  for (;;) {
    memcached_return_t fetch_rc = MEMCACHED_SUCCESS;
    if (memcached_fetch_result(mc, result, &fetch_rc) == nullptr) {
      if (fetch_rc == MEMCACHED_END || fetch_rc == MEMCACHED_NOTFOUND) break;
      if (error.empty()) error = ErrorWords(mc, fetch_rc);
      if (++errors > servers) break;
      continue;
    }
    const std::string key(memcached_result_key_value(result), memcached_result_key_length(result));
    auto it = where.find(key);
    if (it == where.end()) continue;
    for (const size_t i : it->second) {
      (*out)[i].found = true;
      (*out)[i].value.assign(memcached_result_value(result), memcached_result_length(result));
    }
  }
  return error;
}

std::vector<bool> MemcachedBackend::ExistPrefix(absl::Span<const std::string> keys) {
  std::vector<bool> out;
  if (keys.empty()) return out;
  Handle handle(this);
  memcached_st* mc = handle.get();
  for (const std::string& key : keys) {
    memcached_return_t rc = MEMCACHED_FAILURE;
    for (int attempt = 0; mc != nullptr && attempt < kAttempts; ++attempt) {
      rc = memcached_exist(mc, key.data(), key.size());
      if (rc == MEMCACHED_SUCCESS || rc == MEMCACHED_NOTFOUND) break;
    }
    out.push_back(rc == MEMCACHED_SUCCESS);
    if (!out.back()) break;
  }
  return out;
}

std::string MemcachedBackend::Describe() const {
  return absl::StrCat("memcached ", absl::StrJoin(options_.servers, ","), " (", options_.replicas,
                      " replicas, items of up to ", options_.item_bytes, " bytes)");
}

}  // namespace kvhost
