// FastPathServer: kvhostd's side of the fast path
// (proto/kvhost/v1/fast_path.proto). The handoff socket
// (server/service/handoff_server.h) answers HANDOFF_KIND_FAST_PATH with
// Open's mailbox and hands the connection to Serve; one thread per mailbox
// then waits on its doorbell, copies each request out, runs it through
// FastPathCalls and writes the reply, until the client's connection closes
// (the client exited, was killed, or closed its channel) or Stop.
//
// The mailbox is a sealed memfd (it cannot shrink under the daemon's
// mapping, so no client can make the daemon fault), mapped by both sides.
// A request arrives when request_seq changes; the daemon reads
// request_bytes once, refuses more than the capacity, and copies the frame
// out before decoding, so that a client rewriting the mailbox meanwhile
// changes nothing but its own reply. A connection that dies mid-request
// leaves every pool as the call left it (each call is whole: its reply just
// finds no reader).
//
// Thread safety: Open, Serve, connections and Stop may be called from any
// thread. Stop (or the destructor) wakes and joins every mailbox thread;
// Serve after Stop closes what it was given.
#ifndef KVHOST_SERVER_SERVICE_FAST_PATH_SERVER_H_
#define KVHOST_SERVER_SERVICE_FAST_PATH_SERVER_H_

#include <atomic>
#include <cstdint>
#include <list>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/fast_path_mailbox.h"
#include "server/metrics/kvhost_metrics.h"
#include "server/pool/beneath.h"
#include "server/service/fast_path_calls.h"

namespace kvhost {

// --fast-path-connections' default: a node's workers and schedulers, a
// mailbox each, with room to spare.
inline constexpr uint32_t kDefaultFastPathConnections = 128;
// How long a mailbox thread sleeps on its doorbell before it checks its
// connection and Stop: the longest a dead client's mailbox outlives it.
inline constexpr absl::Duration kFastPathIdleCheck = absl::Milliseconds(100);

// A mailbox made for one client, not yet served: its memfd (what the
// handoff sends) and the daemon's mapping.
class FastPathOffer {
 public:
  FastPathOffer() = default;
  FastPathOffer(FastPathOffer&& other) noexcept;
  FastPathOffer& operator=(FastPathOffer&&) = delete;
  FastPathOffer(const FastPathOffer&) = delete;
  ~FastPathOffer();

  int fd() const { return fd_.get(); }
  uint64_t bytes() const { return bytes_; }
  const FastPathMailbox& mailbox() const { return mailbox_; }

 private:
  friend class FastPathServer;
  // The server's connection count this offer holds a place in until it is
  // destroyed (dropped unserved, or at the end of its serving thread); null
  // once moved from.
  std::atomic<uint32_t>* reservation_ = nullptr;
  UniqueFd fd_;
  void* mapping_ = nullptr;
  uint64_t bytes_ = 0;
  FastPathMailbox mailbox_;
};

class FastPathServer {
 public:
  // `calls` must outlive this; `max_connections` mailboxes at once (0: the
  // fast path is off); `capacity` bytes per mailbox area; `metrics` may be
  // null.
  FastPathServer(FastPathCalls* calls, uint32_t max_connections,
                 uint32_t capacity = kFastPathDefaultCapacity, KvhostMetrics* metrics = nullptr);
  ~FastPathServer();
  FastPathServer(const FastPathServer&) = delete;
  FastPathServer& operator=(const FastPathServer&) = delete;

  // A new mailbox, counted against max_connections until its thread ends
  // (or the offer is dropped unserved). FAILED_PRECONDITION when the fast
  // path is off or stopped; RESOURCE_EXHAUSTED at max_connections (naming
  // the flag); INTERNAL when the memfd cannot be made.
  absl::StatusOr<FastPathOffer> Open();
  // Serves `offer` on a thread of its own until `connection` (the client's
  // handoff connection, now owned) hangs up. `peer` is for logs.
  void Serve(FastPathOffer offer, UniqueFd connection, const std::string& peer);
  // Stops every mailbox thread (a call in progress finishes first) and
  // refuses new ones. Idempotent.
  void Stop();

  uint32_t connections() const { return reserved_.load(std::memory_order_relaxed); }
  uint32_t max_connections() const { return max_connections_; }
  uint32_t capacity() const { return capacity_; }

 private:
  struct Worker {
    std::thread thread;
    std::atomic<bool> done{false};
    FastPathHeader* header = nullptr;  // for Stop's wake-up
  };
  void Loop(FastPathOffer offer, UniqueFd connection, std::string peer, Worker* worker);
  // One request of `mailbox`: copied out, handled, replied to.
  void Answer(const FastPathMailbox& mailbox, std::string* frame);
  // Joins threads that ended. REQUIRES mu_.
  void Reap() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  FastPathCalls* const calls_;
  const uint32_t max_connections_;
  const uint32_t capacity_;
  KvhostMetrics* const metrics_;
  std::atomic<uint32_t> reserved_{0};
  std::atomic<bool> stopping_{false};
  absl::Mutex mu_;
  std::list<Worker> workers_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvhost

#endif  // KVHOST_SERVER_SERVICE_FAST_PATH_SERVER_H_
