// Access: who makes a call (Caller), whose a thing is (Owner, a pool's owner
// token), and the rules that decide between them. The one home of kvhostd's
// access checks: every service, the handoff socket and the fast path ask
// here, on the objects they will use (a name is resolved once, then its pool
// is checked). Where a caller's credentials come from (gRPC metadata, a
// handoff request, a fast-path frame): server/access/credentials.h.
//
// Owner tokens (kvhost.v1.CreatePoolRequest.owner_token): a pool created
// with one is owner-protected, and a call touching it must present that
// token (CheckPoolOwner); a follower is protected by the token of the pool it
// follows. Tokens are compared in constant time (SecretEquals,
// common/constant_time.h) and never shown: messages name the pool only.
//
// Attachments and tickets (Permits): an attachment made within a worker
// session, and its tickets, serve a caller naming that session, or
// presenting the owner token of the attachment's pools when they are
// owner-protected (every protected pool must match); an attachment made
// without a session serves whoever holds its id. Anyone else is told
// NOT_FOUND, as for an unknown id, so that an answer says nothing of other
// sessions.
//
// Thread safety: plain values and pure functions; all may be called
// concurrently. An Owner holds its pools weakly, so that retained tickets
// keep no deleted pool mapped.
#ifndef KVHOST_SERVER_ACCESS_CALLER_H_
#define KVHOST_SERVER_ACCESS_CALLER_H_

#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "server/pool/pool.h"
#include "server/pool/pool_group.h"

namespace kvhost {

// Who makes a call (server/access/credentials.h reads it): the sessions it
// names and the owner token it presents.
struct Caller {
  std::vector<std::string> sessions;
  std::optional<std::string> token;
};

// Whose an attachment and its tickets are: its session ("" for none) and its
// pools.
struct Owner {
  std::string session_id;
  std::vector<std::weak_ptr<const Pool>> pools;
};

// Whether `caller` may use what `owner` owns (the rule above). A deleted
// pool's token opens nothing any more.
bool Permits(const Caller& caller, const Owner& owner);

// Longest CreatePoolRequest.owner_token.
inline constexpr size_t kMaxOwnerTokenBytes = 256;

// The token a call presents, as the checks below take it: null for none.
inline const std::string* TokenOf(const std::optional<std::string>& token) {
  return token ? &*token : nullptr;
}

// PERMISSION_DENIED unless `token` (null: none given) opens `pool` (a
// follower: the pool it follows); OK for a pool without an owner token. The
// message names the pool, never a token.
absl::Status CheckPoolOwner(const Pool& pool, const std::string* token);
// The same for every entry's pool of `group` (the message names the entry).
absl::Status CheckGroupOwner(const PoolGroup& group, const std::string* token);

// INVALID_ARGUMENT (naming its length, or the byte's position, never the
// token) unless `token` has at most kMaxOwnerTokenBytes and every byte is
// printable ASCII 0x21-0x7E: what gRPC metadata carries unchanged
// (kvhost-token), so that the pool's owner can always present it.
absl::Status ValidateOwnerToken(const std::string& token);

}  // namespace kvhost

#endif  // KVHOST_SERVER_ACCESS_CALLER_H_
