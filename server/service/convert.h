// Translation between the public API (kvhost.v1 protobuf) and the domain, and
// the one place absl::Status becomes grpc::Status. Service code calls these
// and nothing below it sees protobuf.
//
// Pure functions; thread-safe.
#ifndef KVHOST_SERVER_SERVICE_CONVERT_H_
#define KVHOST_SERVER_SERVICE_CONVERT_H_

#include <grpcpp/server_context.h>
#include <grpcpp/support/server_callback.h>
#include <grpcpp/support/status.h>

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvhost/v1/pool.pb.h"
#include "kvhost/v1/transfer.pb.h"
#include "server/pool/pool.h"
#include "server/pool/pool_group.h"
#include "server/pool/registry.h"
#include "server/tickets/ticket.h"
#include "server/transfer/engine.h"
#include "server/transfer/transfer_manager.h"
#include "server/transfer/worker_copy.h"

namespace kvhost {

// Canonical codes line up one to one.
grpc::Status ToGrpcStatus(const absl::Status& status);

// A unary reactor finished from another thread once the work is done;
// gRPC calls OnDone after Finish, and it deletes itself.
class OwnedUnaryReactor final : public grpc::ServerUnaryReactor {
 public:
  void OnDone() override { delete this; }
};

// A callback call finished at once with `status` (its default reactor).
grpc::ServerUnaryReactor* FinishCall(grpc::CallbackServerContext* context,
                                     const absl::Status& status);

// INVALID_ARGUMENT naming the field for an enum value outside the domain.
absl::StatusOr<PoolSpec> FromProto(const v1::PoolSpec& spec);
void ToProto(const PoolSpec& spec, v1::PoolSpec* out);
// `region_paths`: whether Pool.region_paths is filled (GetPool / ListPools
// leave it empty for a protected pool the caller's token does not open).
void ToProto(const Pool& pool, const char* backend, v1::Pool* out, bool region_paths = true);
// A pool being created: name, spec, bytes, backend, state CREATING and its
// progress (nothing else exists yet).
void ToProto(const CreatingPool& pool, const char* backend, v1::Pool* out);
// CreatePoolGroup's entries (pools unresolved; the registry checks them).
std::vector<GroupEntrySpec> FromProto(
    const google::protobuf::RepeatedPtrField<v1::PoolEntry>& entries);
// Layer maps spelled out, the anchor flagged on its entry and named.
void ToProto(const PoolGroup& group, v1::PoolGroup* out);
absl::StatusOr<AttachRequest> FromProto(const v1::AttachDeviceRequest& request);
void ToProto(const TicketStatus& status, v1::TransferStatus* out);
// A worker copy's plan (kvhost.v1.WorkerCopyPlan).
void ToProto(const WorkerCopyPlan& plan, v1::WorkerCopyPlan* out);

}  // namespace kvhost

#endif  // KVHOST_SERVER_SERVICE_CONVERT_H_
