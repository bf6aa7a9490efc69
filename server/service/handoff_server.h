// HandoffServer: kvhostd's handoff socket, where an attached worker fetches
// the descriptors gRPC cannot carry (kvhost.v1.HandoffRequest /
// HandoffReply in proto/kvhost/v1/handoff.proto): an attachment's layer
// counters (server/transfer/layer_counters.h), and its pool's region
// descriptors for worker copies (server/transfer/worker_copy.h). The server
// knows nothing of what it hands out: a HandoffSource looks the item up for
// the caller.
//
// Protocol: a unix SOCK_SEQPACKET socket; per fetch one connection, one
// request message of at most kMaxHandoffRequestBytes, one reply message of
// at most kMaxHandoffReplyBytes, with the descriptors (SCM_RIGHTS, one
// message) on OK; then the server closes it. A deposit
// (HANDOFF_KIND_DEPOSIT, service/deposits.h) goes the other way: its
// request carries the descriptors, its reply the deposit's id, counted
// against the peer's share (its open session, else its uid); descriptors
// sent with any other request are closed and the request refused.
// A fast-path request (HANDOFF_KIND_FAST_PATH) is the one whose connection
// stays open: its reply carries the mailbox and the connection goes to the
// FastPathServer, whose mailbox lives as long as it.
//
// Silent clients (a slowloris): the request must come within
// kHandoffRequestTimeout of the accept (else the reply is
// DEADLINE_EXCEEDED). Up to kMaxHandoffConnections wait for their request at
// once, kMaxHandoffConnectionsPerUid of one uid (SO_PEERCRED); a new
// connection past a share pushes out the oldest waiting one of its uid (or,
// past the bound in all, of anyone), which is refused with
// RESOURCE_EXHAUSTED. Connections are accepted as fast as they come, so a
// flood of silent ones leaves no victim waiting in the listen backlog, and
// a request that has arrived is served before the next accept, so a fresh
// victim is not pushed out either. When descriptors run out (accept's EMFILE,
// ENFILE) the server stops accepting for a backoff that doubles up to
// kMaxHandoffAcceptBackoff, logging once per episode.
//
// Every fetch is logged with the peer's SO_PEERCRED (pid, uid, gid); a
// capability is shown as a ShortId. Refusals (per status code), deposits and
// unsent replies are logged through LogLimit (server/log_limit.h): the 1st,
// 2nd, 4th ... of a run, so a flood of them cannot flood the log.
//
// Thread safety: one thread of its own ("kvhost-handoff") waits for all
// connections at once (poll) and serves each once its request is there,
// without blocking (the reply goes out with MSG_DONTWAIT, into an empty
// socket buffer); it never calls back into anything but the source, the
// deposits and the fast path, which must be thread-safe and must not block.
// Stop (or the destructor) joins it.
// Ownership: the server owns its listening socket; the socket file is the
// caller's (the daemon gives it its mode and group and removes it).
#ifndef KVHOST_SERVER_SERVICE_HANDOFF_SERVER_H_
#define KVHOST_SERVER_SERVICE_HANDOFF_SERVER_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "kvhost/v1/handoff.pb.h"
#include "server/access/caller.h"
#include "server/log_limit.h"
#include "server/pool/beneath.h"
#include "server/service/deposits.h"
#include "server/service/fast_path_server.h"
#include "server/transfer/transfer_manager.h"

namespace kvhost {

// A request carries an attachment id (~60 bytes), a few session ids of the
// same size and an owner token: a page is far more than any honest one.
inline constexpr size_t kMaxHandoffRequestBytes = 4096;
// A local client sends its request right after connecting, in the next
// system call: a tenth of a second is a scheduler's preemption many times
// over, and bounds what a silent connection holds.
inline constexpr absl::Duration kHandoffRequestTimeout = absl::Milliseconds(100);
// Connections waiting for their request at once, and of one uid: a node's
// workers fetch once per attachment each (and deposit a few times before
// it), a few dozen at once at most at start.
inline constexpr size_t kMaxHandoffConnections = 256;
inline constexpr size_t kMaxHandoffConnectionsPerUid = 32;
// After accept fails for want of descriptors: the first pause, and the
// longest it doubles to while the shortage lasts.
inline constexpr absl::Duration kMinHandoffAcceptBackoff = absl::Milliseconds(10);
inline constexpr absl::Duration kMaxHandoffAcceptBackoff = absl::Seconds(1);

// A reply carries a status message, two numbers and, for pool regions, a
// few launch groups with their component names: far under a page per
// group. The client's receive buffer is the same size.
inline constexpr size_t kMaxHandoffReplyBytes = 65536;

// What a source hands out: `fds` (at most kMaxWorkerCopyRegions, valid
// while `keep` lives; the server sends them and closes nothing), the
// files' size and the item count, and for pool regions their description.
struct HandoffItem {
  std::vector<int> fds;
  std::shared_ptr<const void> keep;
  uint64_t bytes = 0;
  uint32_t count = 0;
  v1::PoolRegions pool_regions;
};

// Looks up the item of `kind` of attachment `attachment_id` for `caller`:
// NOT_FOUND (as for an unknown id) for one the caller may not use (the rule
// of server/access/caller.h), FAILED_PRECONDITION for an attachment
// without that item. REQUIRES: kind is not HANDOFF_KIND_UNSPECIFIED.
using HandoffSource = std::function<absl::StatusOr<HandoffItem>(
    const Caller& caller, const std::string& attachment_id, v1::HandoffKind kind)>;

// The daemon's source: HANDOFF_KIND_LAYER_COUNTERS from `manager`
// (TransferManager::FindLayerCounters), HANDOFF_KIND_POOL_REGIONS and
// HANDOFF_KIND_POOL_MAP from TransferManager::FindPoolRegions (a new
// read-write descriptor per region, Pool::OpenRegion); other kinds
// INVALID_ARGUMENT.
// `manager` must outlive the source.
HandoffSource TransferHandoffSource(TransferManager* manager);

// The request of one handoff connection, decoded and checked without a
// socket: `received` the bytes that arrived (at most the first
// kMaxHandoffRequestBytes + 1 of the message), `length` the message's whole
// length (recvmsg's count with MSG_TRUNC). INVALID_ARGUMENT naming why it is
// no request: none (length 0), over kMaxHandoffRequestBytes, not a
// kvhost.v1.HandoffRequest, or naming no kind; `request` is then not to be
// used. REQUIRES: received.size() == min(length, kMaxHandoffRequestBytes + 1).
// Pure; thread-safe.
absl::Status DecodeHandoffRequest(absl::string_view received, size_t length,
                                  v1::HandoffRequest* request);

// A connection accepted and waiting for its request.
struct WaitingConnection {
  int fd = -1;
  uint32_t uid = 0;  // SO_PEERCRED's; UINT32_MAX when unknown
  absl::Time deadline;
  std::string peer;  // "pid 12, uid 1000, gid 1000", for the log
};

// The connections waiting for their request, oldest first, and which one a
// new connection pushes out (the rule in the header's paragraph). Knows
// nothing of sockets: the caller answers and closes what comes out.
// Not thread-safe.
class HandoffWaiting {
 public:
  explicit HandoffWaiting(size_t max_connections = kMaxHandoffConnections,
                          size_t per_uid = kMaxHandoffConnectionsPerUid);
  // Adds `connection`; returns the one it pushes out, if any: the oldest of
  // its uid when that uid holds per_uid, else the oldest of all when
  // max_connections wait.
  std::optional<WaitingConnection> Add(WaitingConnection connection);
  // Removes connection `i` (in connections()'s order) and returns it.
  WaitingConnection Take(size_t i);
  const std::vector<WaitingConnection>& connections() const { return waiting_; }
  // Connections of `uid` waiting.
  size_t of_uid(uint32_t uid) const;

 private:
  const size_t max_connections_;
  const size_t per_uid_;
  std::vector<WaitingConnection> waiting_;
  std::map<uint32_t, size_t> by_uid_;
};

class HandoffServer {
 public:
  // Listens on the unix socket `path` and starts serving. REQUIRES: `path`
  // is absolute, fits sockaddr_un, its directory exists and nothing is
  // there (the daemon's PrepareSocketPath). The file is made with the
  // process's umask. UNAVAILABLE naming the path and the system call that
  // failed.
  // Deposits (HANDOFF_KIND_DEPOSIT) go to `deposits` (null: refused with
  // FAILED_PRECONDITION), which must outlive the server; fast-path
  // mailboxes (HANDOFF_KIND_FAST_PATH) come from `fast_path` (null: refused
  // with FAILED_PRECONDITION), which must outlive it too and then owns
  // the connection.
  static absl::StatusOr<std::unique_ptr<HandoffServer>> Start(const std::string& path,
                                                              HandoffSource source,
                                                              Deposits* deposits = nullptr,
                                                              FastPathServer* fast_path = nullptr);
  ~HandoffServer();
  HandoffServer(const HandoffServer&) = delete;
  HandoffServer& operator=(const HandoffServer&) = delete;

  // Stops accepting, finishes the connection being served, closes those
  // waiting, joins the thread. Idempotent.
  void Stop();
  const std::string& path() const { return path_; }

 private:
  HandoffServer() = default;
  void Loop();
  // Accepts one connection into `waiting`, answering the one it pushes out;
  // after EMFILE or ENFILE, backs off instead.
  void Accept(HandoffWaiting* waiting, absl::Time now);
  // accept failed with `error` at `now`: no accept until accept_after_.
  void BackOff(int error, absl::Time now);
  // One connection whose request is readable (or `refusal`, when not OK:
  // it came too late, or was pushed out): read, looked up, answered.
  void Serve(const WaitingConnection& connection, absl::Status refusal);
  // The request of `connection` read without waiting and decoded into
  // `request` (DecodeHandoffRequest), with the descriptors it carried in
  // `received` (at most KVHOST_MAX_DEPOSIT_DESCRIPTORS; all are closed when there
  // were more); INVALID_ARGUMENT naming why it cannot be.
  static absl::Status ReadRequest(int connection, v1::HandoffRequest* request,
                                  std::vector<UniqueFd>* received);
  // A deposit's reply: `received` kept by deposits_ under a new id, counted
  // against `connection`'s uid or the session `request` names.
  absl::Status Deposit(std::vector<UniqueFd> received, const WaitingConnection& connection,
                       const v1::HandoffRequest& request, v1::HandoffReply* reply);
  // A fast-path mailbox for `connection`: sent, then served on it.
  void OpenFastPath(int connection, const std::string& peer, const v1::HandoffRequest& request);
  // Logs "`what` `peer`: `status`" unless LogLimit leaves it out.
  void LogRefusal(const char* what, const std::string& peer, const absl::Status& status);
  // Logs a reply that could not be sent unless LogLimit leaves it out.
  void LogUnsent(const std::string& what, const std::string& peer, const std::string& error);

  std::string path_;
  HandoffSource source_;
  Deposits* deposits_ = nullptr;
  FastPathServer* fast_path_ = nullptr;
  int listen_fd_ = -1;
  int stop_fd_ = -1;  // eventfd: readable once Stop was called
  std::thread thread_;
  // The accept backoff (Loop's thread only): no accept before
  // accept_after_; the pause now, and the failures of this episode.
  absl::Time accept_after_ = absl::InfinitePast();
  absl::Duration backoff_ = absl::ZeroDuration();
  uint64_t failed_accepts_ = 0;
  absl::Time failing_since_;
  LogLimitByCode refusal_log_;
  LogLimit deposit_log_;
  LogLimit unsent_log_;
};

}  // namespace kvhost

#endif  // KVHOST_SERVER_SERVICE_HANDOFF_SERVER_H_
