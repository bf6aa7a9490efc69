// MemcachedBackend: a StorageBackend on a memcached cluster through
// libmemcached 1.1: keys spread over the servers by consistent hashing
// (ketama), so a server that joins or goes moves only its share of keys;
// the binary protocol, which libmemcached's replication needs.
//
// A server that fails (refused, timed out) is taken out of the hash ring for
// `retry_timeout` and tried again after: its keys are misses meanwhile and
// new stores go to the other servers; a server restarted empty returns
// misses until its pages are stored again. With `replicas` > 0 every item
// is also written to that many further servers, and a failed server stays
// in the ring (taking it out would move its keys away from their
// replicas): a get whose server failed is served by a replica, a set whose
// first server failed is refused until it returns.
//
// Each server's state (Servers(): up or down, and why) comes from a probe of
// that server alone, at Create and then every `retry_timeout` on a thread of
// the backend's own: a get of a key no one stores, answered (hit or miss)
// = up. Each change is logged once (a warning when a server goes down, with
// libmemcached's detail; info when it is back), never per call. The errors
// Set and Get return name the server and the failure in words, without
// libmemcached's detail.
//
// Thread safety: all methods may be called concurrently. libmemcached's
// handles are not thread-safe, so each call borrows one from a free list
// (cloned from a prototype on demand, at most one per concurrent caller);
// the probes' handles are the probe thread's alone.
#ifndef KVHOST_SERVER_STORAGE_MEMCACHED_BACKEND_H_
#define KVHOST_SERVER_STORAGE_MEMCACHED_BACKEND_H_

#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/storage/backend.h"

struct memcached_st;
struct memcached_result_st;

namespace kvhost {

// memcached's default item size is 1 MiB (-I); an item also holds its key
// and ~50 bytes of memcached's own header, so values stay 4 KiB below it.
inline constexpr uint64_t kDefaultMemcachedItemBytes = (uint64_t{1} << 20) - 4096;

struct MemcachedOptions {
  std::vector<std::string> servers;  // "host:port", at least one
  absl::Duration connect_timeout = absl::Milliseconds(200);
  absl::Duration io_timeout = absl::Seconds(1);
  absl::Duration retry_timeout = absl::Seconds(2);
  uint32_t replicas = 0;
  uint64_t item_bytes = kDefaultMemcachedItemBytes;
};

class MemcachedBackend final : public StorageBackend {
 public:
  // INVALID_ARGUMENT naming the value for a bad server ("host:port", port
  // 1..65535), item_bytes not above the page header, replicas not below the
  // server count, a timeout not positive. Connects lazily: servers that are
  // down now are not an error.
  static absl::StatusOr<std::unique_ptr<MemcachedBackend>> Create(const MemcachedOptions& options);
  ~MemcachedBackend() override;

  uint64_t max_item_bytes() const override { return options_.item_bytes; }
  std::vector<absl::Status> Set(absl::Span<const StorageItem> items) override;
  std::vector<FetchedItem> Get(absl::Span<const std::string> keys) override;
  std::vector<bool> ExistPrefix(absl::Span<const std::string> keys) override;
  std::string Describe() const override;
  std::vector<BackendServer> Servers() const override;

 private:
  explicit MemcachedBackend(const MemcachedOptions& options) : options_(options) {}

  // One server's probe: a handle of its own and what the last probe found.
  struct Probe {
    memcached_st* mc = nullptr;  // the probe thread's (or Create's, before it starts)
    BackendServer state;         // guarded by state_mu_
    bool probed = false;         // guarded by state_mu_; false until the first probe
  };
  // Makes the probes' handles and runs the first probe; starts the thread.
  absl::Status StartProbes();
  // Probes every server once, logging each change.
  void ProbeAll();
  // The probe thread: ProbeAll every retry_timeout until the destructor.
  void ProbeLoop();

  // One libmemcached handle and the result it reads values into. The
  // result lives as long as the handle: a fresh one grows its buffer for
  // each value, which made a 256 KiB get ~8x slower (docs/PERF.md, run L3-1).
  struct Connection {
    memcached_st* mc = nullptr;
    memcached_result_st* result = nullptr;
  };
  // A connection of this caller's own, returned on destruction.
  class Handle;
  Connection Borrow();
  void Return(Connection c);
  // One memcached_mget of keys[wanted] into `out`; "" or the error seen.
  std::string GetOnce(const Connection& c, absl::Span<const std::string> keys,
                      const std::vector<size_t>& wanted, std::vector<FetchedItem>* out) const;

  const MemcachedOptions options_;
  memcached_st* prototype_ = nullptr;
  absl::Mutex mu_;
  std::vector<Connection> free_ ABSL_GUARDED_BY(mu_);

  mutable absl::Mutex state_mu_;
  std::vector<Probe> probes_;  // fixed at Create; each's state under state_mu_
  bool stopping_ ABSL_GUARDED_BY(state_mu_) = false;
  std::thread prober_;
};

}  // namespace kvhost

#endif  // KVHOST_SERVER_STORAGE_MEMCACHED_BACKEND_H_
