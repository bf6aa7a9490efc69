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
// Against a hostile client: a ring is served only once the previous reply
// was read (reply_read), so ringing costs a wake-up, never a second call; a
// mailbox whose client rang before reading its reply loses the thread's
// spin for good (it sleeps on the doorbell). Each mailbox's thread CPU is
// counted by its client's uid (kvhost_fast_path_cpu_seconds_total) and
// logged when it closes. A client (its open worker session, else its uid)
// holds at most `per_client` mailboxes, and each mailbox's bytes count
// against --memory-limit (PoolRegistry::ReserveTransient) while it lives.
// Opening and closing are logged with a rate limit.
//
// Thread safety: Open, Serve, connections and Stop may be called from any
// thread. Stop (or the destructor) wakes and joins every mailbox thread;
// Serve after Stop closes what it was given.
#ifndef KVHOST_SERVER_SERVICE_FAST_PATH_SERVER_H_
#define KVHOST_SERVER_SERVICE_FAST_PATH_SERVER_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/fast_path_mailbox.h"
#include "server/log_limit.h"
#include "server/metrics/kvhost_metrics.h"
#include "server/pool/beneath.h"
#include "server/pool/registry.h"
#include "server/service/fast_path_calls.h"

namespace kvhost {

// --fast-path-connections' default: a node's workers and schedulers, a
// mailbox each, with room to spare.
inline constexpr uint32_t kDefaultFastPathConnections = 128;
// --fast-path-connections-per-client's default: a node's 8 GPUs' workers
// and schedulers of one uid, twice over; an eighth of the default limit, so
// that one client leaves the rest to others.
inline constexpr uint32_t kDefaultFastPathConnectionsPerClient = 16;
// How long a mailbox thread sleeps on its doorbell before it checks its
// connection and Stop: the longest a dead client's mailbox outlives it.
inline constexpr absl::Duration kFastPathIdleCheck = absl::Milliseconds(100);

class FastPathServer;

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
  // The server whose counts (in all and its client's) this offer holds a
  // place in until it is destroyed (dropped unserved, or at the end of its
  // serving thread); null once moved from.
  FastPathServer* server_ = nullptr;
  std::string client_;  // the share it counts against ("uid 1000", "session ses-1-...")
  uint32_t uid_ = 0;
  TransientReservation memory_;  // its bytes against --memory-limit
  UniqueFd fd_;
  void* mapping_ = nullptr;
  uint64_t bytes_ = 0;
  FastPathMailbox mailbox_;
};

class FastPathServer {
 public:
  // Whether a worker session is open (the handoff request's session ids
  // pick the share only when one is).
  using SessionOpen = std::function<bool(const std::string& session_id)>;
  struct Limits {
    uint32_t max_connections = kDefaultFastPathConnections;  // 0: the fast path is off
    uint32_t per_client = kDefaultFastPathConnectionsPerClient;
    uint32_t capacity = kFastPathDefaultCapacity;  // bytes per mailbox area
  };
  // `calls` must outlive this; `registry` (null: mailboxes are not
  // counted against --memory-limit), `session_open` (null: every client
  // is its uid) and `metrics` (null: none) too.
  FastPathServer(FastPathCalls* calls, const Limits& limits, PoolRegistry* registry = nullptr,
                 SessionOpen session_open = nullptr, KvhostMetrics* metrics = nullptr);
  ~FastPathServer();
  FastPathServer(const FastPathServer&) = delete;
  FastPathServer& operator=(const FastPathServer&) = delete;

  // A new mailbox for the client at the other end of `connection` (a Unix
  // socket: its uid from SO_PEERCRED) naming `session_ids`, counted against
  // max_connections, the client's share and --memory-limit until its thread
  // ends (or the offer is dropped unserved). FAILED_PRECONDITION when the
  // fast path is off or stopped; RESOURCE_EXHAUSTED at max_connections or
  // the client's share (naming the flag) or past --memory-limit; INTERNAL
  // when the memfd cannot be made.
  absl::StatusOr<FastPathOffer> Open(int connection,
                                     const std::vector<std::string>& session_ids = {});
  // Serves `offer` on a thread of its own until `connection` (the client's
  // handoff connection, now owned) hangs up. `peer` is for logs.
  void Serve(FastPathOffer offer, UniqueFd connection, const std::string& peer);
  // Stops every mailbox thread (a call in progress finishes first) and
  // refuses new ones. Idempotent.
  void Stop();

  uint32_t connections() const { return reserved_.load(std::memory_order_relaxed); }
  uint32_t max_connections() const { return limits_.max_connections; }
  uint32_t capacity() const { return limits_.capacity; }
  // Mailboxes held now by `client` ("uid 1000", "session ses-1-ab12...").
  uint32_t connections_of(const std::string& client) const;

 private:
  friend class FastPathOffer;  // Release
  struct Worker {
    std::thread thread;
    std::atomic<bool> done{false};
    FastPathHeader* header = nullptr;  // for Stop's wake-up
  };
  void Loop(FastPathOffer offer, UniqueFd connection, std::string peer, Worker* worker);
  // One request of `mailbox`: copied out, handled, replied to.
  void Answer(const FastPathMailbox& mailbox, std::string* frame);
  // The share `session_ids` and the peer's `uid` count against.
  std::string ClientOf(uint32_t uid, const std::vector<std::string>& session_ids) const;
  // Takes a place in all and in `client`'s share, or says why not.
  absl::Status Reserve(const std::string& client);
  // Gives back what Reserve took (FastPathOffer's destructor).
  void Release(const std::string& client);
  // Joins threads that ended. REQUIRES mu_.
  void Reap() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  FastPathCalls* const calls_;
  const Limits limits_;
  PoolRegistry* const registry_;
  const SessionOpen session_open_;
  KvhostMetrics* const metrics_;
  LogLimit open_log_;
  LogLimit close_log_;
  std::atomic<uint32_t> reserved_{0};
  std::atomic<bool> stopping_{false};
  mutable absl::Mutex shares_mu_;
  std::map<std::string, uint32_t> shares_ ABSL_GUARDED_BY(shares_mu_);
  absl::Mutex mu_;
  std::list<Worker> workers_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvhost

#endif  // KVHOST_SERVER_SERVICE_FAST_PATH_SERVER_H_
