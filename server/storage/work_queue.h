// WorkQueue: the L3 tier's own threads, running queued jobs in order of
// arrival, so that cache round trips never hold a gRPC or transfer-engine
// thread. Bounds are the tier's (pages in flight), not the queue's.
//
// Thread safety: Post may be called from any thread. The destructor runs
// the jobs already queued, then joins the threads; Post after it started is
// a bug.
#ifndef KVHOST_SERVER_STORAGE_WORK_QUEUE_H_
#define KVHOST_SERVER_STORAGE_WORK_QUEUE_H_

#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace kvhost {

class WorkQueue {
 public:
  // REQUIRES: threads >= 1.
  explicit WorkQueue(int threads);
  ~WorkQueue();
  WorkQueue(const WorkQueue&) = delete;
  WorkQueue& operator=(const WorkQueue&) = delete;

  void Post(std::function<void()> job);

 private:
  void Run();
  bool HasWork() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  absl::Mutex mu_;
  std::deque<std::function<void()>> jobs_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace kvhost

#endif  // KVHOST_SERVER_STORAGE_WORK_QUEUE_H_
