// Credentials: the Caller (server/access/caller.h) of a call, read from
// what each way into kvhostd carries: gRPC metadata (kvhost-session,
// kvhost-token), a handoff request, a fast-path frame. The three read the
// same two things, so that a session or token opens the same objects on
// every path.
//
// Pure functions; thread-safe.
#ifndef KVHOST_SERVER_ACCESS_CREDENTIALS_H_
#define KVHOST_SERVER_ACCESS_CREDENTIALS_H_

#include <grpcpp/server_context.h>

#include <optional>
#include <string>

#include "kvhost/v1/fast_path.pb.h"
#include "kvhost/v1/handoff.pb.h"
#include "server/access/caller.h"

namespace kvhost {

// The gRPC metadata key carrying a pool's owner token.
inline constexpr char kOwnerTokenMetadata[] = "kvhost-token";
// The call's owner token (kOwnerTokenMetadata), or nullopt when it carries
// none.
std::optional<std::string> OwnerToken(const grpc::ServerContextBase& context);
// The gRPC metadata key carrying the caller's worker session id
// (SessionEvent.session_id): the client library sends it on every
// TransferService call once it has a session. An attachment made within a
// session, and its tickets, serve only callers naming that session here (or
// presenting the pool's owner token; see Permits).
inline constexpr char kSessionMetadata[] = "kvhost-session";
// Who makes a gRPC call: every kSessionMetadata value it carries (a client
// may name more than one of its sessions) and its owner token.
Caller CallerOf(const grpc::ServerContextBase& context);
// Who a decoded handoff request says it is: its session ids, and its owner
// token when it gives one.
Caller CallerOf(const v1::HandoffRequest& request);
// Who a fast-path frame says it is, read as the handoff request is.
Caller CallerOf(const v1::FastPathRequest& frame);

}  // namespace kvhost

#endif  // KVHOST_SERVER_ACCESS_CREDENTIALS_H_
