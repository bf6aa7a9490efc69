#include "server/service/call_scope.h"

#include "absl/strings/str_cat.h"

namespace kvhost {

absl::Status CheckIndexCount(const std::string& what, uint64_t count, uint64_t limit) {
  if (count <= limit) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(what, ": ", count,
                                                 " is over the daemon's limit of ", limit,
                                                 " per call (--max-indices-per-call)"));
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
  return target->pool;
}

}  // namespace kvhost
