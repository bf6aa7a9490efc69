#include "server/tickets/ticket.h"

#include <utility>

namespace kvhost {

const char* DirectionName(Direction direction) {
  return direction == Direction::kBackup ? "backup" : "load";
}

Ticket::Ticket(uint64_t id, Direction direction, uint32_t layer_num, std::string path,
               int32_t event_set, uint64_t layer_base)
    : id_(id),
      direction_(direction),
      layer_num_(layer_num),
      path_(std::move(path)),
      event_set_(event_set),
      layer_base_(layer_base),
      accepted_(absl::Now()) {}

void Ticket::LayerFinished(uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  bytes_ += bytes;
  if (++layers_done_ == 1) first_layer_ = absl::Now() - accepted_;
}

void Ticket::Enqueued() {
  absl::MutexLock lock(&mu_);
  enqueued_ = absl::Now() - accepted_;
}

void Ticket::Finish(absl::Status status) {
  std::vector<std::function<void(const absl::Status&)>> steps;
  {
    absl::MutexLock lock(&mu_);
    if (finishing_) return;
    finishing_ = true;
    steps.swap(steps_);
  }
  for (auto& step : steps) step(status);
  std::vector<std::function<void()>> callbacks;
  {
    absl::MutexLock lock(&mu_);
    done_ = true;
    status_ = std::move(status);
    duration_ = absl::Now() - accepted_;
    callbacks.swap(callbacks_);
  }
  for (auto& callback : callbacks) callback();
}

bool Ticket::BeforeDone(std::function<void(const absl::Status&)> step) {
  absl::MutexLock lock(&mu_);
  if (finishing_) return false;
  steps_.push_back(std::move(step));
  return true;
}

void Ticket::RequestCancel(absl::Status reason) {
  absl::MutexLock lock(&mu_);
  if (cancel_.ok()) cancel_ = std::move(reason);
}

absl::Status Ticket::CancelReason() const {
  absl::MutexLock lock(&mu_);
  return cancel_;
}

TicketStatus Ticket::Snapshot() const {
  absl::MutexLock lock(&mu_);
  TicketStatus s;
  s.event_set = event_set_;
  s.id = id_;
  s.done = done_;
  s.status = status_;
  s.bytes = bytes_;
  s.layers_done = layers_done_;
  s.layer_num = layer_num_;
  s.path = path_;
  s.duration_us = done_ ? static_cast<uint64_t>(absl::ToInt64Microseconds(duration_)) : 0;
  s.first_layer_us = static_cast<uint64_t>(absl::ToInt64Microseconds(first_layer_));
  s.enqueue_us = static_cast<uint64_t>(absl::ToInt64Microseconds(enqueued_));
  return s;
}

bool Ticket::WaitUntil(absl::Time deadline) const {
  absl::MutexLock lock(&mu_);
  auto finished = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return done_; };
  return mu_.AwaitWithDeadline(absl::Condition(&finished), deadline);
}

void Ticket::OnDone(std::function<void()> callback) {
  {
    absl::MutexLock lock(&mu_);
    if (!done_) {
      callbacks_.push_back(std::move(callback));
      return;
    }
  }
  callback();
}

}  // namespace kvhost
