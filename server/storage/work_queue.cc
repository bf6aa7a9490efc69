#include "server/storage/work_queue.h"

#include <utility>

namespace kvhost {

WorkQueue::WorkQueue(int threads) {
  for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { Run(); });
}

WorkQueue::~WorkQueue() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  for (std::thread& t : threads_) t.join();
}

void WorkQueue::Post(std::function<void()> job) {
  absl::MutexLock lock(&mu_);
  jobs_.push_back(std::move(job));
}

bool WorkQueue::HasWork() const { return stopping_ || !jobs_.empty(); }

void WorkQueue::Run() {
  for (;;) {
    std::function<void()> job;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(this, &WorkQueue::HasWork));
      if (jobs_.empty()) return;  // stopping, nothing left
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    job();
  }
}

}  // namespace kvhost
