// CacheServiceImpl: kvhost.v1.CacheService (proto/kvhost/v1/cache.proto) over
// the daemon's NodeCaches. Translates and validates: the cache's name is
// resolved once with the caller's owner token checked on the pool found
// (PoolRegistry::Resolve), which must be a node cache; key and index lists
// are bounded (the cache's CacheLimits, --max-indices-per-call) before
// anything is looked at. The domain (server/cache/) does the rest; its
// tickets are the TransferManager's, so WaitTransfer serves them; event
// watches are CacheEventWatches' streams. With --l3-memcached, a Store's
// write_through and a Lookup's fetch_missing put the L3 tier behind the cache
// (NodeCache's CacheL3), in the namespace StorePages of the cache's pool
// would use; without it both are refused FAILED_PRECONDITION.
//
// Thread safety: handlers run concurrently on gRPC's threads.
#ifndef KVHOST_SERVER_SERVICE_CACHE_SERVICE_H_
#define KVHOST_SERVER_SERVICE_CACHE_SERVICE_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "kvhost/v1/cache.grpc.pb.h"
#include "server/access/caller.h"
#include "server/cache/node_caches.h"
#include "server/pool/registry.h"
#include "server/service/cache_event_watches.h"
#include "server/storage/storage_tier.h"

namespace kvhost {

class CacheServiceImpl final : public v1::CacheService::CallbackService {
 public:
  // `registry` and `caches` must outlive the service; `tier` null: no L3 tier.
  CacheServiceImpl(const PoolRegistry* registry, NodeCaches* caches, uint64_t max_indices_per_call,
                   std::shared_ptr<StorageTier> tier = nullptr)
      : registry_(registry),
        caches_(caches),
        max_indices_(max_indices_per_call),
        tier_(std::move(tier)) {}

  grpc::ServerUnaryReactor* Lookup(grpc::CallbackServerContext* context,
                                   const v1::CacheLookupRequest* request,
                                   v1::CacheLookupReply* response) override;
  grpc::ServerUnaryReactor* Store(grpc::CallbackServerContext* context,
                                  const v1::CacheStoreRequest* request,
                                  v1::CacheStoreReply* response) override;
  grpc::ServerUnaryReactor* Restore(grpc::CallbackServerContext* context,
                                    const v1::CacheRestoreRequest* request,
                                    v1::TransferTicket* response) override;
  grpc::ServerUnaryReactor* ReleasePin(grpc::CallbackServerContext* context,
                                       const v1::CacheReleasePinRequest* request,
                                       v1::CacheReleasePinReply* response) override;
  grpc::ServerUnaryReactor* Evict(grpc::CallbackServerContext* context,
                                  const v1::CacheEvictRequest* request,
                                  v1::CacheEvictReply* response) override;
  grpc::ServerUnaryReactor* GetCacheStats(grpc::CallbackServerContext* context,
                                          const v1::GetCacheStatsRequest* request,
                                          v1::CacheStats* response) override;
  grpc::ServerUnaryReactor* ReadCacheEvents(grpc::CallbackServerContext* context,
                                            const v1::ReadCacheEventsRequest* request,
                                            v1::CacheEventBatch* response) override;
  grpc::ServerWriteReactor<v1::CacheEventBatch>* WatchCacheEvents(
      grpc::CallbackServerContext* context, const v1::ReadCacheEventsRequest* request) override;

  // Ends every event watch (kvhostd stops; CacheEventWatches::EndAll).
  void EndWatches() { watches_.EndAll(); }

  // The bodies, for `caller`'s credentials (the fast path's future home).
  absl::Status DoLookup(const Caller& caller, const v1::CacheLookupRequest& request,
                        v1::CacheLookupReply* response);
  absl::Status DoStore(const Caller& caller, const v1::CacheStoreRequest& request,
                       v1::CacheStoreReply* response);
  absl::Status DoRestore(const Caller& caller, const v1::CacheRestoreRequest& request,
                         v1::TransferTicket* response);

 private:
  // The cache named `cache`: NOT_FOUND / PERMISSION_DENIED as Resolve,
  // FAILED_PRECONDITION for a pool that is not a node cache, INVALID_ARGUMENT
  // for a group's name; `device_indices` against --max-indices-per-call.
  absl::StatusOr<std::shared_ptr<NodeCache>> Open(const Caller& caller, const std::string& cache,
                                                  int device_indices = 0) const;
  // The L3 tier for a call on `cache` that asked for it (`flag` names the
  // request's field): FAILED_PRECONDITION without one.
  // The pool side of a Store or Restore (`pool`, its request's `pool`
  // field, given when `has_pool`): null for an attachment's call. The pool
  // is resolved once and its owner token checked, as an AttachDevice of it
  // would (PoolRegistry::Resolve). INVALID_ARGUMENT naming the fields unless
  // exactly one of attachment_id and pool is given, for device_indices or
  // `fence` (its field `fence_field`) beside a pool, a pool group's name,
  // and host_indices over --max-indices-per-call.
  absl::StatusOr<std::optional<NodeCache::PoolSlots>> PoolSideOf(
      const Caller& caller, bool has_pool, const v1::CachePoolSlots& pool,
      const std::string& attachment_id, int device_indices, const std::string& fence,
      const char* fence_field) const;
  absl::StatusOr<CacheL3> L3For(const Caller& caller, const NodeCache& cache,
                                const char* flag) const;

  const PoolRegistry* const registry_;
  NodeCaches* const caches_;
  const uint64_t max_indices_;
  const std::shared_ptr<StorageTier> tier_;
  CacheEventWatches watches_;
};

}  // namespace kvhost

#endif  // KVHOST_SERVER_SERVICE_CACHE_SERVICE_H_
