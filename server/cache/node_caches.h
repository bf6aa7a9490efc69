// NodeCaches: the daemon's node caches, one NodeCache per node-cache pool
// (PoolSpec::node_cache) of the registry. A cache is made on the first call
// that names its pool and kept while that pool object lives in the registry;
// a deleted (retired) pool's cache is dropped at the next call or session
// end, which releases the pool's memory (its in-flight tickets keep what they
// need, NodeCache's ownership rule). A pool made again under the same name is
// a new object with a new, empty cache.
//
// Thread safety: all methods may be called concurrently. Lock order: this
// table's mutex, then nothing: caches are called outside it.
#ifndef KVHOST_SERVER_CACHE_NODE_CACHES_H_
#define KVHOST_SERVER_CACHE_NODE_CACHES_H_

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "server/cache/node_cache.h"
#include "server/pool/pool.h"
#include "server/transfer/transfer_manager.h"

namespace kvhost {

class NodeCaches {
 public:
  // `transfers` must outlive the table and every cache it made.
  explicit NodeCaches(TransferManager* transfers, CacheLimits limits = {});

  // The cache of `pool`. REQUIRES: pool->spec().node_cache.
  std::shared_ptr<NodeCache> For(const std::shared_ptr<Pool>& pool);
  // The session ended: every cache releases what it held for it.
  void SessionEnded(const std::string& session_id);
  size_t size() const;

 private:
  // Drops the caches of retired pools; returns the live ones.
  std::vector<std::shared_ptr<NodeCache>> Prune() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  TransferManager* const transfers_;
  const CacheLimits limits_;
  mutable absl::Mutex mu_;
  std::map<const Pool*, std::shared_ptr<NodeCache>> caches_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvhost

#endif  // KVHOST_SERVER_CACHE_NODE_CACHES_H_
