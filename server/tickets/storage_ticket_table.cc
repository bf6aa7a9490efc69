#include "server/tickets/storage_ticket_table.h"

#include <algorithm>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "server/log_limit.h"
#include "spdlog/spdlog.h"

namespace kvhost {

absl::StatusOr<uint64_t> StorageTicketTable::Open(const std::shared_ptr<Pool>& pool,
                                                  uint64_t pages) {
  TransientReservation memory;
  if (reserve_ != nullptr) {
    absl::StatusOr<TransientReservation> r = reserve_(
        pages * kBytesPerPage,
        absl::StrCat("the results of a detached L3 call of ", pages, " pages of pool '",
                     pool->name(), "' (kept until its oldest finished tickets are dropped)"));
    if (!r.ok()) return r.status();
    memory = *std::move(r);
  }
  absl::MutexLock lock(&mu_);
  SweepGonePools();
  const uint64_t id = next_id_++;
  Ticket& ticket = tickets_[id];
  ticket.pool = pool;
  ticket.memory = std::move(memory);
  return id;
}

void StorageTicketTable::Discard(uint64_t id) {
  absl::MutexLock lock(&mu_);
  tickets_.erase(id);
}

void StorageTicketTable::Finish(uint64_t id, StorageTicketStatus status, uint64_t pages) {
  status.id = id;
  status.done = true;
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
    Keep(id);
  }
  bool delivered = false;
  for (auto& [unused, waiter] : waiters) delivered = waiter(status) || delivered;
  if (delivered) Delivered(id);
}

absl::StatusOr<uint64_t> StorageTicketTable::Wait(const std::shared_ptr<Pool>& pool, uint64_t id,
                                                  bool poll, Waiter waiter) {
  StorageTicketStatus now;
  {
    absl::MutexLock lock(&mu_);
    auto it = tickets_.find(id);
    if (it == tickets_.end() || it->second.pool.lock() != pool) {
      return absl::NotFoundError(
          absl::StrCat("no storage ticket ", id, " of pool '", pool->name(),
                       "' (never issued, dropped by the pool's limits on finished tickets, "
                       "or of another pool)"));
    }
    Ticket& ticket = it->second;
    if (ticket.done) {
      now = ticket.status;
    } else if (poll) {
      now.id = id;
    } else {
      const uint64_t number = next_waiter_++;
      ticket.waiters.emplace_back(number, std::move(waiter));
      return number;
    }
  }
  if (waiter(now) && now.done) Delivered(id);
  return 0;
}

void StorageTicketTable::Delivered(uint64_t id) {
  absl::MutexLock lock(&mu_);
  auto it = tickets_.find(id);
  if (it != tickets_.end()) it->second.delivered = true;
}

void StorageTicketTable::Unwait(uint64_t id, uint64_t waiter) {
  absl::MutexLock lock(&mu_);
  auto it = tickets_.find(id);
  if (it == tickets_.end()) return;
  std::vector<std::pair<uint64_t, Waiter>>& waiters = it->second.waiters;
  waiters.erase(std::remove_if(waiters.begin(), waiters.end(),
                               [waiter](const auto& w) { return w.first == waiter; }),
                waiters.end());
}

size_t StorageTicketTable::size() const {
  absl::MutexLock lock(&mu_);
  return tickets_.size();
}

uint64_t StorageTicketTable::dropped() const {
  absl::MutexLock lock(&mu_);
  return dropped_;
}

void StorageTicketTable::Keep(uint64_t id) {
  auto it = tickets_.find(id);
  if (it == tickets_.end()) return;
  Kept& kept = kept_[it->second.pool];
  kept.ids.push_back(id);
  kept.pages += it->second.pages;
  // The newest stays even alone over the page limit.
  const std::weak_ptr<Pool> pool = it->second.pool;
  while (kept.ids.size() > 1 && (kept.ids.size() > retention_.finished_per_pool ||
                                 kept.pages > retention_.pages_per_pool)) {
    const uint64_t gone = kept.ids.front();
    auto oldest = tickets_.find(gone);
    kept.pages -= oldest->second.pages;
    const bool delivered = oldest->second.delivered;
    tickets_.erase(oldest);
    kept.ids.pop_front();
    if (delivered) continue;
    ++dropped_;
    if (metrics_ != nullptr) metrics_->l3_tickets_dropped->WithLabels({})->Increment();
    // The 1st, 2nd, 4th, 8th ... drop: a flood says so without flooding the log.
    if (IsLoggedOccurrence(dropped_)) {
      const std::shared_ptr<Pool> p = pool.lock();
      spdlog::warn(
          "L3: dropped the results of detached call {} of pool '{}' before any wait returned "
          "them ({} so far; a pool keeps its newest {} finished tickets and {} of their pages)",
          gone, p != nullptr ? p->name() : "(deleted)", dropped_, retention_.finished_per_pool,
          retention_.pages_per_pool);
    }
  }
}

void StorageTicketTable::SweepGonePools() {
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
