// Releaser: a background thread that destroys what is handed to it, so that
// unmapping gigabytes and removing their files (seconds for a large pool)
// never runs on the thread that dropped the last reference (a gRPC thread).
//
// The registry gives every pool it creates a deleter that posts the pool
// here (PoolRegistry::Delete then returns at once). Stop() runs what is
// queued, several items at once, and joins; after it, Post runs its work
// inline.
//
// Thread safety: Post and pending() may be called from any thread; Stop
// once, from one thread (the destructor calls it).
#ifndef KVHOST_SERVER_POOL_RELEASER_H_
#define KVHOST_SERVER_POOL_RELEASER_H_

#include <cstddef>
#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace kvhost {

class Releaser {
 public:
  // `threads` work items at once (at least 1).
  explicit Releaser(int threads = 2);
  ~Releaser();
  Releaser(const Releaser&) = delete;
  Releaser& operator=(const Releaser&) = delete;

  // Runs `work` on a releaser thread soon (inline once Stop has begun).
  void Post(std::function<void()> work);
  // Items posted and not yet finished.
  size_t pending() const;
  // Runs everything posted so far and ends the threads.
  void Stop();

 private:
  void Run();

  mutable absl::Mutex mu_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  size_t running_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace kvhost

#endif  // KVHOST_SERVER_POOL_RELEASER_H_
