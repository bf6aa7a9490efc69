#include "server/service/cache_event_watches.h"

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/service/convert.h"

namespace kvhost {

// One WatchCacheEvents stream. Its state is guarded by mu_ (gRPC's reactions
// and the poller may run at once); gRPC is called with mu_ released.
class CacheEventWatch final : public grpc::ServerWriteReactor<v1::CacheEventBatch> {
 public:
  CacheEventWatch(CacheEventWatches* table, std::shared_ptr<NodeCache> cache, uint64_t after,
                  size_t max)
      : table_(table), cache_(std::move(cache)), after_(after), max_(max) {}

  // A stream refused before it started: never in the table.
  static CacheEventWatch* Refused(const absl::Status& status) {
    auto* watch = new CacheEventWatch(nullptr, nullptr, 0, 0);
    watch->Finish(ToGrpcStatus(status));
    return watch;
  }

  const NodeCache* cache() const { return cache_.get(); }

  // Sends the events after the resume point, if there are any and no write
  // is in flight; ends the watch when its cache's pool was deleted. May
  // delete this (through OnDone): nothing may touch it after.
  void Poll() {
    std::optional<grpc::Status> finish;
    {
      absl::MutexLock lock(&mu_);
      if (ended_ || writing_) return;
      if (cache_->pool()->retired()) {
        finish = EndLocked(grpc::Status(grpc::StatusCode::NOT_FOUND,
                                        absl::StrCat("cache '", cache_->name(), "' was deleted")));
      } else if (!NextBatchLocked()) {
        return;
      }
    }
    if (finish.has_value()) {
      Finish(*finish);
    } else {
      StartWrite(&batch_);  // batch_ is left alone until OnWriteDone
    }
  }

  void End(const grpc::Status& status) {
    std::optional<grpc::Status> finish;
    {
      absl::MutexLock lock(&mu_);
      finish = EndLocked(status);
    }
    if (finish.has_value()) Finish(*finish);
  }

  void OnWriteDone(bool ok) override {
    std::optional<grpc::Status> finish;
    {
      absl::MutexLock lock(&mu_);
      writing_ = false;
      if (ended_) {
        finish = pending_;  // End came during the write
      } else if (!ok) {
        finish = EndLocked(grpc::Status(grpc::StatusCode::CANCELLED, "the client went away"));
      }
    }
    if (finish.has_value()) {
      Finish(*finish);
      return;
    }
    Poll();  // a backlog drains at the stream's pace
  }

  void OnCancel() override {
    End(grpc::Status(grpc::StatusCode::CANCELLED, "WatchCacheEvents cancelled"));
  }

  void OnDone() override {
    if (table_ == nullptr) {
      delete this;
      return;
    }
    table_->Done(this);
  }

 private:
  // Fills batch_ with the next events (or a gap) and marks the write;
  // false when there is nothing to send.
  bool NextBatchLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const CacheEvents events = cache_->EventsSince(after_, max_);
    if (events.events.empty() && !events.gap) return false;
    batch_.Clear();
    for (const CacheEvent& e : events.events) {
      v1::CacheEvent* out = batch_.add_events();
      out->set_seq(e.seq);
      out->set_kind(e.kind == CacheEvent::Kind::kStored ? v1::CacheEvent::STORED
                                                        : v1::CacheEvent::EVICTED);
      out->set_key(e.key);
    }
    batch_.set_next_after(events.next_after);
    batch_.set_gap(events.gap);
    after_ = events.next_after;
    writing_ = true;
    return true;
  }

  // Marks the end; the status to Finish with now, or none (ended already,
  // or a write in flight: OnWriteDone finishes).
  std::optional<grpc::Status> EndLocked(const grpc::Status& status)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (ended_) return std::nullopt;
    ended_ = true;
    pending_ = status;
    if (writing_) return std::nullopt;
    return status;
  }

  CacheEventWatches* const table_;
  const std::shared_ptr<NodeCache> cache_;
  absl::Mutex mu_;
  uint64_t after_ ABSL_GUARDED_BY(mu_);
  const size_t max_;
  v1::CacheEventBatch batch_;  // written by whoever set writing_, read by gRPC until OnWriteDone
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool ended_ ABSL_GUARDED_BY(mu_) = false;
  grpc::Status pending_ ABSL_GUARDED_BY(mu_);
};

CacheEventWatches::CacheEventWatches() : poller_([this] { PollLoop(); }) {}

CacheEventWatches::~CacheEventWatches() {
  EndAll();
  poller_.join();
}

grpc::ServerWriteReactor<v1::CacheEventBatch>* CacheEventWatches::Start(
    absl::StatusOr<std::shared_ptr<NodeCache>> opened, uint64_t after_seq, size_t max_events) {
  if (!opened.ok()) return CacheEventWatch::Refused(opened.status());
  const std::shared_ptr<NodeCache>& cache = *opened;
  absl::Status refused;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) {
      refused = absl::UnavailableError("kvhostd is shutting down");
    } else if (live_.size() >= kMaxWatches) {
      refused = absl::ResourceExhaustedError(
          absl::StrCat(live_.size(), " event watches are open, the most kvhostd serves"));
    } else if (auto it = per_cache_.find(cache.get());
               it != per_cache_.end() && it->second >= kMaxPerCache) {
      refused = absl::ResourceExhaustedError(
          absl::StrCat("cache '", cache->name(), "' has ", kMaxPerCache,
                       " event watches open, the most one cache has; end one first"));
    } else {
      auto* watch = new CacheEventWatch(this, cache, after_seq, max_events);
      live_.emplace(watch, 0);
      ++per_cache_[cache.get()];
      wake_.Signal();
      return watch;
    }
  }
  return CacheEventWatch::Refused(refused);
}

void CacheEventWatches::Done(CacheEventWatch* watch) {
  {
    absl::MutexLock lock(&mu_);
    auto it = live_.find(watch);
    if (it == live_.end()) return;
    const int holds = it->second;
    live_.erase(it);
    auto c = per_cache_.find(watch->cache());
    if (c != per_cache_.end() && --c->second == 0) per_cache_.erase(c);
    if (holds > 0) {
      done_.emplace(watch, holds);  // the last Release deletes it
      return;
    }
  }
  delete watch;
}

std::vector<CacheEventWatch*> CacheEventWatches::HoldAll() {
  absl::MutexLock lock(&mu_);
  std::vector<CacheEventWatch*> held;
  held.reserve(live_.size());
  for (auto& [watch, holds] : live_) {
    ++holds;
    held.push_back(watch);
  }
  return held;
}

void CacheEventWatches::Release(const std::vector<CacheEventWatch*>& held) {
  std::vector<CacheEventWatch*> dead;
  {
    absl::MutexLock lock(&mu_);
    for (CacheEventWatch* watch : held) {
      if (auto it = live_.find(watch); it != live_.end()) {
        --it->second;
      } else if (auto d = done_.find(watch); d != done_.end() && --d->second == 0) {
        done_.erase(d);
        dead.push_back(watch);
      }
    }
  }
  for (CacheEventWatch* watch : dead) delete watch;
}

void CacheEventWatches::EndAll() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    wake_.Signal();
  }
  const std::vector<CacheEventWatch*> held = HoldAll();
  for (CacheEventWatch* watch : held) {
    watch->End(grpc::Status(grpc::StatusCode::UNAVAILABLE, "kvhostd is shutting down"));
  }
  Release(held);
}

size_t CacheEventWatches::size() const {
  absl::MutexLock lock(&mu_);
  return live_.size();
}

void CacheEventWatches::PollLoop() {
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      while (!stopping_ && live_.empty()) wake_.Wait(&mu_);
      if (stopping_) return;
    }
    const std::vector<CacheEventWatch*> held = HoldAll();
    for (CacheEventWatch* watch : held) watch->Poll();
    Release(held);
    absl::MutexLock lock(&mu_);
    if (!stopping_) wake_.WaitWithTimeout(&mu_, kPollInterval);
  }
}

}  // namespace kvhost
