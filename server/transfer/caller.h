// Caller and Owner: who makes a transfer call, whose an attachment and its
// tickets are, and the one rule (Permits) that decides between them.
//
// An attachment made within a worker session, and its tickets, serve a caller
// naming that session, or presenting the owner token of the attachment's
// pools when they are owner-protected (every protected pool must match); an
// attachment made without a session serves whoever holds its id. Anyone else
// is told NOT_FOUND, as for an unknown id, so that an answer says nothing of
// other sessions.
//
// Thread safety: plain values; Permits may be called concurrently. An Owner
// holds its pools weakly, so that retained tickets keep no deleted pool
// mapped.
#ifndef KVHOST_SERVER_TRANSFER_CALLER_H_
#define KVHOST_SERVER_TRANSFER_CALLER_H_

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "server/pool/pool.h"

namespace kvhost {

// Who makes a transfer call (kvhost-session and kvhost-token metadata, see
// server/service/convert.h): the sessions it names and the token it presents.
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

}  // namespace kvhost

#endif  // KVHOST_SERVER_TRANSFER_CALLER_H_
