// HandoffServer: kvhostd's handoff socket, where an attached worker fetches
// the descriptors gRPC cannot carry (kvhost.v1.HandoffRequest /
// HandoffReply in proto/kvhost/v1/transfer.proto): an attachment's layer
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
// request carries the descriptors, its reply the deposit's id; descriptors
// sent with any other request are closed and the request refused. The
// request must come within kHandoffRequestTimeout of the connection (else
// the reply is DEADLINE_EXCEEDED) and the reply goes out with the same
// bound. Up to kMaxHandoffConnections wait for their request at once, so a
// silent client delays no other; more wait in the listen backlog. Every fetch and refusal is logged
// with the peer's SO_PEERCRED (pid, uid, gid); a capability is shown as a ShortId.
// A fast-path request (HANDOFF_KIND_FAST_PATH) is the one whose connection
// stays open: its reply carries the mailbox and the connection goes to the
// FastPathServer, whose mailbox lives as long as it.
//
// Thread safety: one thread of its own accepts connections and serves each
// once its request is there, and never calls back into anything but the
// source, which must be thread-safe and must not block. Stop (or the destructor) joins it.
// Ownership: the server owns its listening socket; the socket file is the
// caller's (the daemon gives it its mode and group and removes it).
#ifndef KVHOST_SERVER_SERVICE_HANDOFF_SERVER_H_
#define KVHOST_SERVER_SERVICE_HANDOFF_SERVER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "kvhost/v1/transfer.pb.h"
#include "server/pool/beneath.h"
#include "server/service/deposits.h"
#include "server/service/fast_path_server.h"
#include "server/transfer/caller.h"
#include "server/transfer/transfer_manager.h"

namespace kvhost {

// A request carries an attachment id (~60 bytes), a few session ids of the
// same size and an owner token: a page is far more than any honest one.
inline constexpr size_t kMaxHandoffRequestBytes = 4096;
// A local client sends its request right after connecting; a second covers
// a loaded machine many times over and bounds what a silent one costs.
inline constexpr absl::Duration kHandoffRequestTimeout = absl::Seconds(1);
// Connections waiting for their request at once: a node's workers fetch
// once per attachment each, a few dozen at most at start.
inline constexpr size_t kMaxHandoffConnections = 64;

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
// of server/transfer/caller.h), FAILED_PRECONDITION for an attachment
// without that item. REQUIRES: kind is not HANDOFF_KIND_UNSPECIFIED.
using HandoffSource = std::function<absl::StatusOr<HandoffItem>(
    const Caller& caller, const std::string& attachment_id, v1::HandoffKind kind)>;

// The daemon's source: HANDOFF_KIND_LAYER_COUNTERS from `manager`
// (TransferManager::FindLayerCounters), HANDOFF_KIND_POOL_REGIONS from
// TransferManager::FindWorkerRegions (a new read-write descriptor per
// region, Pool::OpenRegion); other kinds INVALID_ARGUMENT.
// `manager` must outlive the source.
HandoffSource TransferHandoffSource(const TransferManager* manager);

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

// Who a decoded request says it is (server/transfer/caller.h): its session
// ids, and its owner token when it gives one.
Caller HandoffCaller(const v1::HandoffRequest& request);

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

  // Stops accepting, finishes the connection being served, joins the
  // thread. Idempotent.
  void Stop();
  const std::string& path() const { return path_; }

 private:
  HandoffServer() = default;
  void Loop();
  // One connection whose request is readable (or `refusal`, when not OK:
  // it came too late): read, looked up, answered.
  void Serve(int connection, const std::string& peer, absl::Status refusal);
  // The request of `connection` read without waiting and decoded into
  // `request` (DecodeHandoffRequest), with the descriptors it carried in
  // `received` (at most kMaxDepositDescriptors; all are closed when there
  // were more); INVALID_ARGUMENT naming why it cannot be.
  static absl::Status ReadRequest(int connection, v1::HandoffRequest* request,
                                  std::vector<UniqueFd>* received);
  // A deposit's reply: `received` kept by deposits_ under a new id.
  absl::Status Deposit(std::vector<UniqueFd> received, const std::string& peer,
                       v1::HandoffReply* reply);
  // A fast-path mailbox for `connection`: sent, then served on it.
  void OpenFastPath(int connection, const std::string& peer, const v1::HandoffRequest& request);

  std::string path_;
  HandoffSource source_;
  Deposits* deposits_ = nullptr;
  FastPathServer* fast_path_ = nullptr;
  int listen_fd_ = -1;
  int stop_fd_ = -1;  // eventfd: readable once Stop was called
  std::thread thread_;
};

}  // namespace kvhost

#endif  // KVHOST_SERVER_SERVICE_HANDOFF_SERVER_H_
