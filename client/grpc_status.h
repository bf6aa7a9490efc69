// FromGrpc: a gRPC status as the client library's absl::Status (canonical
// codes line up one to one, as the daemon's ToGrpcStatus sends them). The
// one home of that conversion in client/; internal, not installed.
#ifndef KVHOST_CLIENT_GRPC_STATUS_H_
#define KVHOST_CLIENT_GRPC_STATUS_H_

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace kvhost {

inline absl::Status FromGrpc(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

}  // namespace kvhost

#endif  // KVHOST_CLIENT_GRPC_STATUS_H_
