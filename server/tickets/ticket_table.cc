#include "server/tickets/ticket_table.h"

#include <algorithm>
#include <iterator>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/ids.h"
#include "spdlog/spdlog.h"

namespace kvhost {

std::shared_ptr<Ticket> TicketTable::Open(const std::string& attachment_id,
                                          std::shared_ptr<const Owner> owner, Direction direction,
                                          uint32_t layer_num, std::string path, int32_t event_set,
                                          uint64_t layer_base) {
  absl::MutexLock lock(&mu_);
  uint64_t id = RandomTicketId();
  while (tickets_.count(id) != 0) id = RandomTicketId();
  auto ticket =
      std::make_shared<Ticket>(id, direction, layer_num, std::move(path), event_set, layer_base);
  tickets_[id] = Entry{ticket, std::move(owner)};
  in_flight_[id] = attachment_id;
  ++counters_.tickets_in_flight;
  return ticket;
}

void TicketTable::Retire(uint64_t id, Direction direction, bool ok, uint64_t bytes) {
  uint64_t dropped = 0, total = 0;
  {
    absl::MutexLock lock(&mu_);
    --counters_.tickets_in_flight;
    auto flying = in_flight_.find(id);
    const std::string attachment = std::move(flying->second);
    in_flight_.erase(flying);
    const int d = static_cast<int>(direction);
    if (ok) {
      ++counters_.tickets_done;
      ++counters_.done[d];
      counters_.bytes[d] += bytes;
    } else {
      ++counters_.tickets_failed;
      ++counters_.failed[d];
    }
    Kept& kept = kept_[attachment];
    holders_.erase(Holder{kept.ids.size(), kept.last, attachment});
    kept.ids.push_back(id);
    kept.last = ++serial_;
    holders_.insert(Holder{kept.ids.size(), kept.last, attachment});
    ++finished_;
    const uint64_t before = dropped_;
    while (finished_ > retained_) DropOne();
    dropped = dropped_ - before;
    total = dropped_;
  }
  if (dropped == 0) return;
  if (metrics_ != nullptr) metrics_->transfer_tickets_dropped->WithLabels({})->Increment(dropped);
  if (const uint64_t n = drop_log_.Tick(); n != 0) {
    spdlog::warn(
        "transfer tickets: dropped a finished ticket no one may have waited for yet ({} so far; "
        "kvhostd keeps {} finished tickets, the attachment that keeps the most losing its "
        "oldest){}",
        total, retained_, LogLimitNote(n));
  }
}

void TicketTable::DropOne() {
  auto greatest = std::prev(holders_.end());
  const std::string attachment = std::get<2>(*greatest);
  holders_.erase(greatest);
  auto it = kept_.find(attachment);
  Kept& kept = it->second;
  tickets_.erase(kept.ids.front());
  kept.ids.pop_front();
  --finished_;
  ++dropped_;
  if (kept.ids.empty()) {
    kept_.erase(it);
  } else {
    holders_.insert(Holder{kept.ids.size(), kept.last, attachment});
  }
}

absl::StatusOr<std::shared_ptr<Ticket>> TicketTable::Find(const Caller& caller, uint64_t id) const {
  absl::MutexLock lock(&mu_);
  auto it = tickets_.find(id);
  if (it == tickets_.end() || !Permits(caller, *it->second.owner)) {
    return absl::NotFoundError(
        absl::StrCat("ticket ", id, " is unknown or expired (", retained_,
                     " finished tickets are kept, the attachment that keeps the most losing its "
                     "oldest first) or not this session's"));
  }
  return it->second.ticket;
}

std::vector<std::shared_ptr<Ticket>> TicketTable::InFlight() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::shared_ptr<Ticket>> out;
  for (const auto& [id, attachment] : in_flight_) out.push_back(tickets_.at(id).ticket);
  return out;
}

std::vector<std::shared_ptr<Ticket>> TicketTable::InFlightOn(
    const std::vector<std::string>& attachment_ids) const {
  absl::MutexLock lock(&mu_);
  std::vector<std::shared_ptr<Ticket>> out;
  for (const auto& [id, attachment] : in_flight_) {
    if (std::find(attachment_ids.begin(), attachment_ids.end(), attachment) !=
        attachment_ids.end()) {
      out.push_back(tickets_.at(id).ticket);
    }
  }
  return out;
}

TransferCounters TicketTable::counters() const {
  absl::MutexLock lock(&mu_);
  return counters_;
}

uint64_t TicketTable::dropped() const {
  absl::MutexLock lock(&mu_);
  return dropped_;
}

size_t TicketTable::finished() const {
  absl::MutexLock lock(&mu_);
  return finished_;
}

}  // namespace kvhost
