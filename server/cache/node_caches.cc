#include "server/cache/node_caches.h"

#include <utility>

namespace kvhost {

NodeCaches::NodeCaches(TransferManager* transfers, CacheLimits limits)
    : transfers_(transfers), limits_(limits) {}

std::vector<std::shared_ptr<NodeCache>> NodeCaches::Prune() {
  std::vector<std::shared_ptr<NodeCache>> live;
  for (auto it = caches_.begin(); it != caches_.end();) {
    if (it->second->pool()->retired()) {
      it = caches_.erase(it);
    } else {
      live.push_back(it->second);
      ++it;
    }
  }
  return live;
}

std::shared_ptr<NodeCache> NodeCaches::For(const std::shared_ptr<Pool>& pool) {
  absl::MutexLock lock(&mu_);
  Prune();
  auto [it, inserted] = caches_.try_emplace(pool.get());
  if (inserted) it->second = NodeCache::Create(pool, transfers_, limits_);
  return it->second;
}

void NodeCaches::SessionEnded(const std::string& session_id) {
  std::vector<std::shared_ptr<NodeCache>> live;
  {
    absl::MutexLock lock(&mu_);
    live = Prune();
  }
  for (const std::shared_ptr<NodeCache>& cache : live) cache->SessionEnded(session_id);
}

size_t NodeCaches::size() const {
  absl::MutexLock lock(&mu_);
  return caches_.size();
}

}  // namespace kvhost
