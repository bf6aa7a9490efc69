#include "server/access/caller.h"

#include "absl/strings/str_cat.h"
#include "common/constant_time.h"

namespace kvhost {

bool Permits(const Caller& caller, const Owner& owner) {
  if (owner.session_id.empty()) return true;
  for (const std::string& session : caller.sessions) {
    if (SecretEquals(session, owner.session_id)) return true;
  }
  if (!caller.token.has_value()) return false;
  // The token of every protected pool of the attachment, and one at least.
  bool opened = false;
  for (const std::weak_ptr<const Pool>& weak : owner.pools) {
    const std::shared_ptr<const Pool> pool = weak.lock();
    if (pool == nullptr) return false;  // deleted: no token opens it any more
    if (!pool->owner_protected()) continue;
    if (!CheckPoolOwner(*pool, &*caller.token).ok()) return false;
    opened = true;
  }
  return opened;
}

absl::Status CheckGroupOwner(const PoolGroup& group, const std::string* token) {
  for (const GroupEntry& e : group.entries()) {
    if (absl::Status s = CheckPoolOwner(*e.pool, token); !s.ok()) {
      return absl::PermissionDeniedError(
          absl::StrCat(s.message(), " (entry '", e.name, "' of group '", group.name(), "')"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckPoolOwner(const Pool& pool, const std::string* token) {
  if (!pool.owner_protected()) return absl::OkStatus();
  // A follower's token is the followed pool's.
  const Pool& owner = pool.token_owner();
  const std::string by = &owner == &pool ? ""
                                         : absl::StrCat(" (by the token of pool '", owner.name(),
                                                        "', which it follows)");
  if (token == nullptr) {
    return absl::PermissionDeniedError(
        absl::StrCat("pool '", pool.name(), "' is owner-protected", by,
                     ": the call needs its owner token in gRPC metadata 'kvhost-token'"));
  }
  if (!owner.OwnerTokenMatches(*token)) {
    return absl::PermissionDeniedError(absl::StrCat("pool '", pool.name(), "' is owner-protected",
                                                    by, ": the token given does not match"));
  }
  return absl::OkStatus();
}

absl::Status ValidateOwnerToken(const std::string& token) {
  if (token.size() > kMaxOwnerTokenBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "owner_token has ", token.size(), " bytes, over the limit of ", kMaxOwnerTokenBytes));
  }
  for (size_t i = 0; i < token.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(token[i]);
    if (c < 0x21 || c > 0x7e) {
      // The byte's position, never the token: messages reach logs.
      return absl::InvalidArgumentError(
          absl::StrCat("owner_token byte ", i,
                       " is outside printable ASCII 0x21-0x7E (no spaces, controls, NUL or "
                       "non-ASCII): gRPC metadata could not carry it, so the pool could never "
                       "be opened"));
    }
  }
  return absl::OkStatus();
}

}  // namespace kvhost
