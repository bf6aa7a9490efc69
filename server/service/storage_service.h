// StorageServiceImpl: kvhost.v1.StorageService (proto/kvhost/v1/storage.proto)
// over the L3 tier. Translates and validates: StorePages, FetchPages and
// ExistPages read or write a pool's data (or what it may see), so they
// check its owner token first (PoolRegistry::Resolve, as the page RPCs of
// PoolService do) and accept a pool group's name for its anchor pool. The
// keys of a call live in the pool's namespace: its owner token's
// (L3Secret::TokenNamespace), the public one for an unprotected pool. The
// tier validates the pages and runs the work on its own threads; each call
// is a reactor finished from there, so no gRPC thread waits on the cache.
// A detached call returns at once with a ticket (StorageTicketTable, its kept
// results reserved against --memory-limit) that WaitStorage, under the
// same pool checks, answers.
//
// Thread safety: handlers run concurrently on gRPC's threads; the tier and
// the registry synchronise themselves.
#ifndef KVHOST_SERVER_SERVICE_STORAGE_SERVICE_H_
#define KVHOST_SERVER_SERVICE_STORAGE_SERVICE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "kvhost/v1/storage.grpc.pb.h"
#include "server/pool/registry.h"
#include "server/storage/storage_tier.h"
#include "server/tickets/storage_ticket_table.h"

namespace kvhost {

class StorageServiceImpl final : public v1::StorageService::CallbackService {
 public:
  // `tier` null: kvhostd runs without an L3 tier and every call is
  // FAILED_PRECONDITION saying so. `max_indices_per_call` bounds each list
  // (INVALID_ARGUMENT above it). Both must outlive this.
  // `metrics` (null: none) too. `session_open`: whether a worker session is
  // open, for FetchPages into a pool another live session holds (ClaimPool:
  // FAILED_PRECONDITION, Pool::ChangeAllocation); null: no session is open.
  StorageServiceImpl(PoolRegistry* registry, StorageTier* tier, uint64_t max_indices_per_call,
                     KvhostMetrics* metrics = nullptr,
                     const PerPoolRetention& ticket_retention = {},
                     SessionOpen session_open = nullptr)
      : registry_(registry),
        tier_(tier),
        max_indices_(max_indices_per_call),
        session_open_(session_open ? std::move(session_open)
                                   : [](const std::string&) { return false; }),
        tickets_(std::make_shared<StorageTicketTable>(
            ticket_retention, metrics, [registry](uint64_t bytes, const std::string& what) {
              return registry->ReserveTransient(bytes, what);
            })) {}

  grpc::ServerUnaryReactor* StorePages(grpc::CallbackServerContext* context,
                                       const v1::StorePagesRequest* request,
                                       v1::StorePagesResponse* response) override;
  grpc::ServerUnaryReactor* FetchPages(grpc::CallbackServerContext* context,
                                       const v1::FetchPagesRequest* request,
                                       v1::FetchPagesResponse* response) override;
  grpc::ServerUnaryReactor* ExistPages(grpc::CallbackServerContext* context,
                                       const v1::ExistPagesRequest* request,
                                       v1::ExistPagesResponse* response) override;
  grpc::ServerUnaryReactor* WaitStorage(grpc::CallbackServerContext* context,
                                        const v1::WaitStorageRequest* request,
                                        v1::StorageTicketStatus* response) override;

  // A PageResult's detail is cut to this many bytes in a reply, so a reply
  // stays within pages x (this + a few bytes).
  static constexpr size_t kMaxDetailBytes = 240;

 private:
  // The checks StorePages and FetchPages share: the tier exists, the list
  // sizes, the owner token; then the pool (or a group's anchor).
  absl::StatusOr<std::shared_ptr<Pool>> PagesPool(const grpc::CallbackServerContext& context,
                                                  const std::string& pool, int indices,
                                                  int keys) const;
  // The namespace of `pool`'s keys for a call with `context`'s owner token:
  // the token's for a protected pool (PERMISSION_DENIED unless the token
  // opens that very object), else the public one.
  absl::StatusOr<std::string> Namespace(const grpc::CallbackServerContext& context,
                                        const Pool& pool) const;

  PoolRegistry* const registry_;
  StorageTier* const tier_;
  const uint64_t max_indices_;
  const SessionOpen session_open_;
  // Shared with the detached calls' callbacks, which the tier may run after
  // this service is gone (daemon shutdown).
  const std::shared_ptr<StorageTicketTable> tickets_;
};

}  // namespace kvhost

#endif  // KVHOST_SERVER_SERVICE_STORAGE_SERVICE_H_
