#include "server/pool/releaser.h"

#include <utility>

namespace kvhost {

Releaser::Releaser(int threads) {
  for (int i = 0; i < (threads < 1 ? 1 : threads); ++i) threads_.emplace_back([this] { Run(); });
}

Releaser::~Releaser() { Stop(); }

void Releaser::Post(std::function<void()> work) {
  {
    absl::MutexLock lock(&mu_);
    if (!stopping_) {
      queue_.push_back(std::move(work));
      return;
    }
  }
  work();
}

size_t Releaser::pending() const {
  absl::MutexLock lock(&mu_);
  return queue_.size() + running_;
}

void Releaser::Stop() {
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  for (std::thread& t : threads_) t.join();
}

void Releaser::Run() {
  for (;;) {
    std::function<void()> work;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](Releaser* r)
               ABSL_EXCLUSIVE_LOCKS_REQUIRED(r->mu_) { return !r->queue_.empty() || r->stopping_; },
          this));
      if (queue_.empty()) return;  // stopping, and nothing left
      work = std::move(queue_.front());
      queue_.pop_front();
      ++running_;
    }
    work();
    work = nullptr;  // what it captured goes before it counts as done
    absl::MutexLock lock(&mu_);
    --running_;
  }
}

}  // namespace kvhost
