// The prologue every pool call shares (PoolService's per-pool calls,
// StorageService's StorePages / FetchPages), written once: the call's index
// lists counted against --max-indices-per-call, then its pool name resolved
// once, with the caller's owner token checked on what was found
// (PoolRegistry::Resolve; the rule is server/access/caller.h's). The call
// then acts on the pool returned (a group's name: its anchor pool), never on
// the name again.
//
// Functions over the registry; thread-safe as PoolRegistry is.
#ifndef KVHOST_SERVER_SERVICE_CALL_SCOPE_H_
#define KVHOST_SERVER_SERVICE_CALL_SCOPE_H_

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/pool/pool.h"
#include "server/pool/registry.h"
#include "server/storage/l3_secret.h"

namespace kvhost {

// --max-indices-per-call: INVALID_ARGUMENT naming `what`, the count and the
// limit when count > limit.
absl::Status CheckIndexCount(const std::string& what, uint64_t count, uint64_t limit);

// One index list of a call: what it is ("Free indices") and its length.
struct IndexCount {
  const char* what;
  uint64_t count;
};

// FAILED_PRECONDITION naming the pool when it is a node cache
// (PoolSpec::node_cache), whose pages no index-addressed call may touch: the
// cache allocates, publishes and evicts them (server/cache/node_cache.h).
absl::Status RefuseNodeCache(const Pool& pool);

// The prologue: each of `counts`, in order, against `max_indices` (the first
// over it: CheckIndexCount's INVALID_ARGUMENT, naming `pool`); then `pool`
// resolved by `registry` with `token` (null: none given) checked on the pool
// or group it names (NOT_FOUND, PERMISSION_DENIED), and refused if a node
// cache (RefuseNodeCache). Returns the pool, or a group's anchor pool, to act
// on. Changes nothing.
absl::StatusOr<std::shared_ptr<Pool>> OpenCallPool(const PoolRegistry& registry,
                                                   const std::string& pool,
                                                   const std::string* token, uint64_t max_indices,
                                                   std::initializer_list<IndexCount> counts = {});

// The L3 namespace an L3 call on `pool` stores and fetches in (StorePages,
// FetchPages, ExistPages, and a node cache's write-through and fetch): the
// public one for an unprotected pool, else the owner token's, checked again
// on this pool object (PERMISSION_DENIED for a token, or none, that does not
// open it).
absl::StatusOr<std::string> L3Namespace(const L3Secret& secret, const Pool& pool,
                                        const std::string* token);

}  // namespace kvhost

#endif  // KVHOST_SERVER_SERVICE_CALL_SCOPE_H_
