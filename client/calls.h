// How Client's member functions make their calls (internal, not
// installed): every call carries the client's owner token; the session
// forms also carry its session ids; the fast forms go through the fast path
// when it takes the call (Client::TryFastPath), else over gRPC. The macros
// expand inside a Client member function (they use options_, SessionIds()
// and TryFastPath).
#ifndef KVHOST_CLIENT_CALLS_H_
#define KVHOST_CLIENT_CALLS_H_

#include <grpcpp/client_context.h>

#include <string>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/grpc_status.h"
#include "kvhost/client.h"

namespace kvhost {

// Every call carries the owner token, when the client has one (the daemon
// checks it on calls that change a protected pool or read its data).
inline void AddOwnerToken(const ClientOptions& options, grpc::ClientContext* context) {
  if (!options.owner_token.empty()) context->AddMetadata("kvhost-token", options.owner_token);
}

}  // namespace kvhost

#define KVHOST_CALL(stub, method, request, response, timeout)          \
  [&]() -> absl::Status {                                              \
    grpc::ClientContext context;                                       \
    context.set_deadline(absl::ToChronoTime(absl::Now() + (timeout))); \
    AddOwnerToken(options_, &context);                                 \
    return FromGrpc((stub)->method(&context, (request), (response)));  \
  }()

// KVHOST_CALL with the client's session ids, which the daemon requires for
// the attachments and tickets of a session and for the allocation calls and
// page writes on a pool a session holds (ClaimPool).
#define KVHOST_SESSION_CALL(stub, method, request, response, timeout)                     \
  [&]() -> absl::Status {                                                                 \
    grpc::ClientContext context;                                                          \
    context.set_deadline(absl::ToChronoTime(absl::Now() + (timeout)));                    \
    AddOwnerToken(options_, &context);                                                    \
    for (const std::string& id : SessionIds()) context.AddMetadata("kvhost-session", id); \
    return FromGrpc((stub)->method(&context, (request), (response)));                     \
  }()
#define KVHOST_TRANSFER_CALL(method, request, response, timeout) \
  KVHOST_SESSION_CALL(transfers_, method, request, response, timeout)

// KVHOST_CALL / KVHOST_TRANSFER_CALL through the fast path when it takes
// the call (Client::TryFastPath), else over gRPC.
#define KVHOST_FAST_CALL(fast, stub, method, request, response, timeout)               \
  [&]() -> absl::Status {                                                              \
    absl::Status fast_status;                                                          \
    if (TryFastPath(v1::fast, (request), (response), true, (timeout), &fast_status)) { \
      return fast_status;                                                              \
    }                                                                                  \
    return KVHOST_SESSION_CALL(stub, method, request, response, timeout);              \
  }()
#define KVHOST_FAST_TRANSFER_CALL(fast, method, request, response, timeout, wait)              \
  [&]() -> absl::Status {                                                                      \
    absl::Status fast_status;                                                                  \
    if (TryFastPath(v1::fast, (request), (response), true, (timeout), &fast_status, (wait))) { \
      return fast_status;                                                                      \
    }                                                                                          \
    return KVHOST_TRANSFER_CALL(method, request, response, timeout);                           \
  }()

#endif  // KVHOST_CLIENT_CALLS_H_
