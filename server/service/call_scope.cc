#include "server/service/call_scope.h"

#include "absl/strings/str_cat.h"
#include "server/access/caller.h"

namespace kvhost {

absl::Status CheckIndexCount(const std::string& what, uint64_t count, uint64_t limit) {
  if (count <= limit) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(what, ": ", count,
                                                 " is over the daemon's limit of ", limit,
                                                 " per call (--max-indices-per-call)"));
}

absl::Status RefuseNodeCache(const Pool& pool) {
  if (!pool.spec().node_cache) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "pool '", pool.name(),
      "' is a node cache: its pages are addressed by key, through kvhost.v1.CacheService "
      "(Lookup, Store, Restore), not by slot"));
}

absl::StatusOr<std::shared_ptr<Pool>> OpenCallPool(const PoolRegistry& registry,
                                                   const std::string& pool,
                                                   const std::string* token, uint64_t max_indices,
                                                   std::initializer_list<IndexCount> counts) {
  for (const IndexCount& counted : counts) {
    if (absl::Status s = CheckIndexCount(counted.what, counted.count, max_indices); !s.ok()) {
      return WithPool(pool, s);
    }
  }
  absl::StatusOr<PoolTarget> target = registry.Resolve(pool, token);
  if (!target.ok()) return target.status();
  if (absl::Status s = RefuseNodeCache(*target->pool); !s.ok()) return s;
  return target->pool;
}

absl::StatusOr<std::string> L3Namespace(const L3Secret& secret, const Pool& pool,
                                        const std::string* token) {
  if (!pool.owner_protected()) return secret.PublicNamespace();
  // Checked again on the object whose namespace it picks: a token that
  // passed for the name but does not open this pool gets no namespace.
  if (absl::Status s = CheckPoolOwner(pool, token); !s.ok()) return s;
  return secret.TokenNamespace(*token);
}

}  // namespace kvhost
