#include "server/service/storage_tickets.h"

#include <algorithm>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace kvhost {

uint64_t StorageTickets::Open(const std::shared_ptr<Pool>& pool) {
  absl::MutexLock lock(&mu_);
  SweepGonePools();
  const uint64_t id = next_id_++;
  tickets_[id].pool = pool;
  return id;
}

void StorageTickets::Discard(uint64_t id) {
  absl::MutexLock lock(&mu_);
  tickets_.erase(id);
}

void StorageTickets::Finish(uint64_t id, v1::StorageTicketStatus status, uint64_t pages) {
  status.set_ticket_id(id);
  status.set_done(true);
  std::vector<std::pair<uint64_t, Waiter>> waiters;
  {
    absl::MutexLock lock(&mu_);
    auto it = tickets_.find(id);
    if (it == tickets_.end()) return;
    Ticket& ticket = it->second;
    ticket.done = true;
    ticket.pages = pages;
    ticket.status = status;
    waiters = std::move(ticket.waiters);
    ticket.waiters.clear();
    if (waiters.empty()) {
      Keep(id);
      return;
    }
  }
  bool delivered = false;
  for (auto& [unused, waiter] : waiters) delivered = waiter(status) || delivered;
  absl::MutexLock lock(&mu_);
  if (delivered) {
    Collect(id);
  } else {
    Keep(id);
  }
}

absl::StatusOr<uint64_t> StorageTickets::Wait(const std::shared_ptr<Pool>& pool, uint64_t id,
                                              bool poll, Waiter waiter) {
  v1::StorageTicketStatus now;
  bool done = false;
  {
    absl::MutexLock lock(&mu_);
    auto it = tickets_.find(id);
    if (it == tickets_.end() || it->second.pool.lock() != pool) {
      return absl::NotFoundError(absl::StrCat(
          "no storage ticket ", id, " of pool '", pool->name(),
          "' (never issued, already collected, dropped uncollected, or of another pool)"));
    }
    Ticket& ticket = it->second;
    done = ticket.done;
    if (!done && !poll) {
      const uint64_t number = next_waiter_++;
      ticket.waiters.emplace_back(number, std::move(waiter));
      return number;
    }
    if (done) {
      now = ticket.status;
    } else {
      now.set_ticket_id(id);
    }
  }
  if (waiter(now) && done) {
    absl::MutexLock lock(&mu_);
    Collect(id);
  }
  return 0;
}

void StorageTickets::Unwait(uint64_t id, uint64_t waiter) {
  absl::MutexLock lock(&mu_);
  auto it = tickets_.find(id);
  if (it == tickets_.end()) return;
  std::vector<std::pair<uint64_t, Waiter>>& waiters = it->second.waiters;
  waiters.erase(std::remove_if(waiters.begin(), waiters.end(),
                               [waiter](const auto& w) { return w.first == waiter; }),
                waiters.end());
}

size_t StorageTickets::size() const {
  absl::MutexLock lock(&mu_);
  return tickets_.size();
}

uint64_t StorageTickets::dropped() const {
  absl::MutexLock lock(&mu_);
  return dropped_;
}

void StorageTickets::Keep(uint64_t id) {
  auto it = tickets_.find(id);
  if (it == tickets_.end() || it->second.kept) return;
  it->second.kept = true;
  Kept& kept = kept_[it->second.pool];
  kept.ids.push_back(id);
  kept.pages += it->second.pages;
  // The newest stays even alone over the page limit.
  while (kept.ids.size() > 1 &&
         (kept.ids.size() > limits_.finished_per_pool || kept.pages > limits_.pages_per_pool)) {
    auto oldest = tickets_.find(kept.ids.front());
    kept.pages -= oldest->second.pages;
    tickets_.erase(oldest);
    kept.ids.pop_front();
    ++dropped_;
  }
}

void StorageTickets::Collect(uint64_t id) {
  auto it = tickets_.find(id);
  if (it == tickets_.end()) return;
  if (it->second.kept) {
    auto kept = kept_.find(it->second.pool);
    if (kept != kept_.end()) {
      std::deque<uint64_t>& ids = kept->second.ids;
      ids.erase(std::remove(ids.begin(), ids.end(), id), ids.end());
      kept->second.pages -= it->second.pages;
      if (ids.empty()) kept_.erase(kept);
    }
  }
  tickets_.erase(it);
}

void StorageTickets::SweepGonePools() {
  for (auto it = kept_.begin(); it != kept_.end();) {
    if (!it->first.expired()) {
      ++it;
      continue;
    }
    for (const uint64_t id : it->second.ids) tickets_.erase(id);
    it = kept_.erase(it);
  }
}

}  // namespace kvhost
