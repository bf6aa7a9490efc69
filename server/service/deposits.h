// Deposits: descriptors a worker hands kvhostd on the handoff socket
// (kvhost.v1.HANDOFF_KIND_DEPOSIT) before the AttachDevice call that names
// them: the POSIX file descriptors of cuMem allocations (PyTorch's
// expandable segments, vLLM's cumem allocator), which gRPC cannot carry.
//
// A deposit is kept under a new capability id (ids.h: 128 random bits, sent
// only to the depositor over its own connection) until an attach that names
// it succeeds (UseUp) or it expires, kDepositLifetime after it was made; a
// thread of its own closes expired deposits, so a worker that dies between
// its deposit and its attach pins its GPU memory for at most that long.
//
// Descriptors held are bounded three ways (DepositLimits), so that one
// client can neither starve the daemon of descriptors nor keep another
// client's attach out: in all, at half of kvhostd's RLIMIT_NOFILE at start;
// per uid (the peer's SO_PEERCRED), its sessions' deposits included; and per
// client, which is the worker session a deposit names (when open) or else
// its uid. A flood from one client fills its own share only.
//
// Thread safety: every method may be called concurrently. Lend's result
// keeps the deposits it names open (their descriptors valid) while it
// lives, even when they expire meanwhile.
#ifndef KVHOST_SERVER_SERVICE_DEPOSITS_H_
#define KVHOST_SERVER_SERVICE_DEPOSITS_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kvhost/defaults.h"
#include "server/log_limit.h"
#include "server/pool/beneath.h"
#include "server/transfer/engine.h"

namespace kvhost {

// Descriptors in one deposit: KVHOST_MAX_DEPOSIT_DESCRIPTORS
// (kvhost/defaults.h, the bound the client splits by).
// One client's share at most: a 2 GiB KV layer of PyTorch's expandable
// segments spans ~100 allocations of 20 MiB; 64 layers of K and V ~12800:
// one worker's attach fits.
inline constexpr size_t kMaxDepositDescriptorsPerClient = 16384;
// How long a deposit waits for its attach: a worker attaches right after
// it deposits, within one AttachDevice deadline.
inline constexpr absl::Duration kDepositLifetime = absl::Seconds(60);

// The bounds on what deposits hold (the defaults are tests' and tools';
// kvhostd derives its own, DepositLimitsFor).
struct DepositLimits {
  absl::Duration lifetime = kDepositLifetime;
  size_t descriptors = 16384;  // in all deposits
  size_t per_uid = 8192;       // in one uid's, its sessions' included
  size_t per_client = 4096;    // in one session's, or a uid's naming none
};

// The limits of a daemon that may open `nofile` descriptors: half of them
// for deposits (the other half is the daemon's own: connections, region
// files, mailboxes), half of that for one uid, and a quarter of it (at most
// kMaxDepositDescriptorsPerClient) for one client. Under systemd's 524288:
// 262144, 131072 and 16384; under 16384: 8192, 4096 and 2048.
DepositLimits DepositLimitsFor(uint64_t nofile);
// DepositLimitsFor this process's RLIMIT_NOFILE now; logs them.
DepositLimits DepositLimitsOfThisProcess();

// Who makes a deposit: the peer's uid (SO_PEERCRED) and the session ids its
// request names (HandoffRequest.session_ids, at most a few are looked at).
struct Depositor {
  uint32_t uid = 0;
  std::vector<std::string> sessions;
};

// Whether `session_id` is a worker session open now (TransferManager).
using SessionCheck = std::function<bool(const std::string& session_id)>;

// Whether `request` (or a group entry of it) has a cuMem buffer.
bool NamesDeposits(const AttachRequest& request);

class Deposits {
 public:
  // `session_open` tells which sessions a deposit may be counted under
  // (null: none; every deposit counts under its uid). It is called with
  // the deposits' mutex held, so it must not call back into them.
  explicit Deposits(DepositLimits limits = DepositLimits{}, SessionCheck session_open = nullptr);
  ~Deposits();
  Deposits(const Deposits&) = delete;
  Deposits& operator=(const Deposits&) = delete;

  // Keeps `fds` under a new id, which it returns, counted against
  // `depositor`'s client: the first of its sessions that is open, else its
  // uid. INVALID_ARGUMENT for none or more than KVHOST_MAX_DEPOSIT_DESCRIPTORS;
  // RESOURCE_EXHAUSTED (naming the bound and who holds how many) when they
  // would pass the client's share, the uid's or the bound in all. `fds` are
  // closed on any error.
  absl::StatusOr<std::string> Put(std::vector<UniqueFd> fds, const Depositor& depositor = {});

  // What Lend holds: the deposits an attach names, open while it lives.
  struct Lent {
    std::vector<std::string> ids;
    std::vector<std::shared_ptr<const void>> held;
  };
  // Sets FdChunk::fd of every cuMem buffer in `request` (group entries too)
  // from the deposits the chunks name. NOT_FOUND for an id not held (never
  // made, expired or used up: the message says which are possible and
  // shows the id as a ShortId); INVALID_ARGUMENT for an index past its
  // deposit's descriptors. Changes nothing held.
  absl::StatusOr<Lent> Lend(AttachRequest* request) const;
  // The attach that named `lent`'s deposits succeeded: closes them.
  void UseUp(const Lent& lent);

  // Descriptors held now, and deposits.
  size_t descriptors() const;
  size_t deposits() const;
  const DepositLimits& limits() const { return limits_; }

 private:
  struct Deposit {
    std::vector<UniqueFd> fds;
    absl::Time expires;
    std::string client;  // the key of by_client_
    uint32_t uid = 0;
  };
  // The client `depositor` counts as: "session <id>" or "uid <n>".
  std::string ClientOf(const Depositor& depositor) const;
  // RESOURCE_EXHAUSTED when `n` more descriptors of `client` (of `uid`)
  // would pass a bound.
  absl::Status CheckShares(size_t n, const std::string& client, uint32_t uid) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Forgets the deposit `it` names (its descriptors close with its last
  // holder).
  void Erase(std::map<std::string, std::shared_ptr<const Deposit>>::iterator it)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Sweep(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void SweepLoop();

  const DepositLimits limits_;
  const SessionCheck session_open_;
  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<const Deposit>> held_ ABSL_GUARDED_BY(mu_);
  size_t descriptors_ ABSL_GUARDED_BY(mu_) = 0;
  // Descriptors held per client and per uid (no entry for none).
  std::map<std::string, size_t> by_client_ ABSL_GUARDED_BY(mu_);
  std::map<uint32_t, size_t> by_uid_ ABSL_GUARDED_BY(mu_);
  uint64_t serial_ ABSL_GUARDED_BY(mu_) = 0;
  LogLimit expiry_log_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread sweeper_;
};

}  // namespace kvhost

#endif  // KVHOST_SERVER_SERVICE_DEPOSITS_H_
