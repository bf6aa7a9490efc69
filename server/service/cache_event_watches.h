// CacheEventWatches: the streams of CacheService.WatchCacheEvents, each
// following one node cache's event log (NodeCache::EventsSince) from a
// sequence number and sending every new batch as a stream message, for
// cache-aware routers that track which node holds which prefix.
//
// One poller thread serves every watch: every kPollInterval it asks each
// watch with no write in flight for the events after its resume point and
// starts a write when there are some (or a gap to report); a watch whose
// write finished asks again at once, so a backlog drains at the stream's
// pace. The thread sleeps while no watch is open (no CPU while idle).
//
// A watch ends when its client cancels (or its connection drops), when the
// cache's pool is deleted (NOT_FOUND), or at EndAll (UNAVAILABLE: kvhostd is
// stopping, so that the server's shutdown does not wait for streams that
// never end on their own). Bounds: kMaxPerCache watches of one cache and
// kMaxWatches in all; a watch past them is refused RESOURCE_EXHAUSTED, with
// nothing else changed.
//
// Thread safety: all methods may be called concurrently. No lock is held
// while gRPC is called (StartWrite, Finish), whose reactions may run on the
// calling thread. Ownership: a watch is deleted once gRPC is done with it
// (OnDone) and neither the poller nor EndAll holds it; the table must
// outlive every watch (the service that owns it outlives the server).
#ifndef KVHOST_SERVER_SERVICE_CACHE_EVENT_WATCHES_H_
#define KVHOST_SERVER_SERVICE_CACHE_EVENT_WATCHES_H_

#include <grpcpp/grpcpp.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kvhost/v1/cache.pb.h"
#include "server/cache/node_cache.h"

namespace kvhost {

class CacheEventWatch;

class CacheEventWatches {
 public:
  static constexpr size_t kMaxPerCache = 64;
  static constexpr size_t kMaxWatches = 1024;
  static constexpr absl::Duration kPollInterval = absl::Milliseconds(20);

  CacheEventWatches();
  ~CacheEventWatches();
  CacheEventWatches(const CacheEventWatches&) = delete;
  CacheEventWatches& operator=(const CacheEventWatches&) = delete;

  // A stream of `cache`'s events after `after_seq`, at most `max_events` a
  // message. When `opened` is an error, or a bound is reached, the stream
  // ends at once with that status.
  grpc::ServerWriteReactor<v1::CacheEventBatch>* Start(
      absl::StatusOr<std::shared_ptr<NodeCache>> opened, uint64_t after_seq, size_t max_events);

  // Ends every watch with UNAVAILABLE and refuses new ones: kvhostd stops.
  void EndAll();

  size_t size() const;

 private:
  friend class CacheEventWatch;

  // OnDone: the watch leaves the table and is deleted, now or, while the
  // poller or EndAll is calling it, by them when they are done with it.
  void Done(CacheEventWatch* watch);
  // Every live watch, each held (not deleted) until Release.
  std::vector<CacheEventWatch*> HoldAll();
  void Release(const std::vector<CacheEventWatch*>& held);
  void PollLoop();

  mutable absl::Mutex mu_;
  absl::CondVar wake_;
  // Live watches and how many HoldAll callers hold each; a watch gRPC is
  // done with while held waits in done_ for its last Release.
  absl::flat_hash_map<CacheEventWatch*, int> live_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<CacheEventWatch*, int> done_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<const NodeCache*, size_t> per_cache_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread poller_;
};

}  // namespace kvhost

#endif  // KVHOST_SERVER_SERVICE_CACHE_EVENT_WATCHES_H_
