// Deposits: descriptors a worker hands kvhostd on the handoff socket
// (kvhost.v1.HANDOFF_KIND_DEPOSIT) before the AttachDevice call that names
// them: the POSIX file descriptors of cuMem allocations (PyTorch's
// expandable segments, vLLM's cumem allocator), which gRPC cannot carry.
//
// A deposit is kept under a new capability id (ids.h: 128 random bits, sent
// only to the depositor over its own connection) until an attach that names
// it succeeds (UseUp) or it expires, kDepositLifetime after it was made; a
// thread of its own closes expired deposits, so a worker that dies between
// its deposit and its attach pins its GPU memory for at most that long. The
// descriptors held at once are bounded (kMaxDepositedDescriptors) below
// kvhostd's descriptor limit, so deposits cannot starve the daemon of
// descriptors.
//
// Thread safety: every method may be called concurrently. Lend's result
// keeps the deposits it names open (their descriptors valid) while it
// lives, even when they expire meanwhile.
#ifndef KVHOST_SERVER_SERVICE_DEPOSITS_H_
#define KVHOST_SERVER_SERVICE_DEPOSITS_H_

#include <cstddef>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/pool/beneath.h"
#include "server/transfer/engine.h"

namespace kvhost {

// Descriptors in one deposit: one SCM_RIGHTS message (the kernel's
// SCM_MAX_FD is 253). The client splits larger sets (kvhost/client.h).
inline constexpr size_t kMaxDepositDescriptors = 250;
// Descriptors held in all deposits at once. A 2 GiB KV layer of PyTorch's
// expandable segments spans ~100 allocations of 20 MiB; 64 layers of K and V
// ~12800: one worker's attach fits, and the daemon (RLIMIT_NOFILE raised to
// its hard limit at start, 524288 under systemd) keeps plenty.
inline constexpr size_t kMaxDepositedDescriptors = 16384;
// How long a deposit waits for its attach: a worker attaches right after
// it deposits, within one AttachDevice deadline.
inline constexpr absl::Duration kDepositLifetime = absl::Seconds(60);

// Whether `request` (or a group entry of it) has a cuMem buffer.
bool NamesDeposits(const AttachRequest& request);

class Deposits {
 public:
  // `lifetime` and `max_descriptors` are the bounds above (tests pass
  // others).
  explicit Deposits(absl::Duration lifetime = kDepositLifetime,
                    size_t max_descriptors = kMaxDepositedDescriptors);
  ~Deposits();
  Deposits(const Deposits&) = delete;
  Deposits& operator=(const Deposits&) = delete;

  // Keeps `fds` under a new id, which it returns. INVALID_ARGUMENT for none
  // or more than kMaxDepositDescriptors; RESOURCE_EXHAUSTED when they would
  // pass max_descriptors. `fds` are closed on any error.
  absl::StatusOr<std::string> Put(std::vector<UniqueFd> fds);

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

 private:
  struct Deposit {
    std::vector<UniqueFd> fds;
    absl::Time expires;
  };
  void Sweep(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void SweepLoop();

  const absl::Duration lifetime_;
  const size_t max_descriptors_;
  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<const Deposit>> held_ ABSL_GUARDED_BY(mu_);
  size_t descriptors_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t serial_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread sweeper_;
};

}  // namespace kvhost

#endif  // KVHOST_SERVER_SERVICE_DEPOSITS_H_
