// Pool's ownership (ClaimPool): the holder, takeovers and the check that
// guards allocation changes. See "Ownership" in server/pool/pool.h.
#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/pool/pool.h"
#include "server/safe_text.h"

namespace kvhost {
namespace {

// "sglang instance 'a' (generation 3)": the holder as messages name it.
std::string HolderLabel(const PoolHolder& holder) {
  return absl::StrCat("sglang instance '", SafeText(holder.instance_id), "' (generation ",
                      holder.generation, ")");
}

// The allocator owners whose holder_mu_ this thread holds in ChangeAllocation. A change may check
// again inside itself (AllocBackup's change submits a backup, whose own check runs there); the
// inner check then runs under the lock already held, since a second reader lock of an absl::Mutex
// by one thread deadlocks behind a waiting Claim (and aborts a debug build).
thread_local std::vector<const Pool*> checking_owners;

}  // namespace

absl::StatusOr<PoolClaimResult> Pool::Claim(const std::string& instance_id,
                                            const std::string& session_id,
                                            const SessionOpen& open) {
  if (follows_) {
    return absl::FailedPreconditionError(absl::StrCat(Label(), " follows '", follows_->name(),
                                                      "' and has no allocator of its own; ",
                                                      "claim '", allocator_owner()->name(), "'"));
  }
  absl::MutexLock lock(&holder_mu_);
  const bool held = !holder_.session_id.empty() && open(holder_.session_id);
  if (held) {
    if (holder_.session_id == session_id && holder_.instance_id == instance_id) {
      return PoolClaimResult{holder_.generation, 0, /*renewed=*/true};
    }
    return absl::FailedPreconditionError(
        absl::StrCat("pool '", name_, "' is held by ", HolderLabel(holder_),
                     holder_.session_id == session_id ? " in the caller's own session"
                                                      : ", whose session is live",
                     ": a second owner is refused (instance '", SafeText(instance_id),
                     "'); the pool is released when that instance's session ends"));
  }
  // Jobs of the previous holder may still copy into its slots: freeing them
  // now would hand slots out that a late write then overwrites.
  if (const uint64_t users = slot_users_->load(); users > 0) {
    return absl::UnavailableError(absl::StrCat(
        "pool '", name_, "': ", users,
        " transfers or L3 jobs still use its slots; retry the claim once they end (a dead "
        "holder's end within kvhostd's --session-timeout)"));
  }
  const uint64_t reclaimed = size_tokens() - allocator_.available_tokens();
  allocator_.Clear();
  holder_.instance_id = instance_id;
  holder_.session_id = session_id;
  ++holder_.generation;
  return PoolClaimResult{holder_.generation, reclaimed, /*renewed=*/false};
}

absl::Status Pool::ChangeAllocation(absl::Span<const std::string> sessions, const SessionOpen& open,
                                    const char* what, absl::FunctionRef<absl::Status()> change) {
  Pool& owner = *allocator_owner();
  const bool nested =
      std::find(checking_owners.begin(), checking_owners.end(), &owner) != checking_owners.end();
  std::optional<absl::ReaderMutexLock> lock;
  if (!nested) lock.emplace(&owner.holder_mu_);
  owner.holder_mu_.AssertReaderHeld();
  const PoolHolder& holder = owner.holder_;
  if (!holder.session_id.empty() &&
      std::find(sessions.begin(), sessions.end(), holder.session_id) == sessions.end() &&
      open(holder.session_id)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "pool '", owner.name_, "' is held by ", HolderLabel(holder), ": ", what,
        " from another session is refused (the holder's calls must carry its worker session; "
        "the pool is released when that session ends)"));
  }
  if (nested) return change();
  checking_owners.push_back(&owner);
  absl::Status status = change();
  checking_owners.pop_back();
  return status;
}

PoolHolder Pool::holder() const {
  const Pool& owner = *allocator_owner();
  absl::ReaderMutexLock lock(&owner.holder_mu_);
  return owner.holder_;
}

std::shared_ptr<void> Pool::UseSlots() {
  std::shared_ptr<std::atomic<uint64_t>> users = allocator_owner()->slot_users_;
  users->fetch_add(1);
  return std::shared_ptr<void>(users.get(), [users](void*) { users->fetch_sub(1); });
}

}  // namespace kvhost
