#include "server/transfer/ticket_table.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/ids.h"

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
  absl::MutexLock lock(&mu_);
  --counters_.tickets_in_flight;
  in_flight_.erase(id);
  if (ok) {
    ++counters_.tickets_done;
    counters_.bytes[static_cast<int>(direction)] += bytes;
  } else {
    ++counters_.tickets_failed;
  }
  finished_.push_back(id);
  while (finished_.size() > kRetained) {
    tickets_.erase(finished_.front());
    finished_.pop_front();
  }
}

absl::StatusOr<std::shared_ptr<Ticket>> TicketTable::Find(const Caller& caller, uint64_t id) const {
  absl::MutexLock lock(&mu_);
  auto it = tickets_.find(id);
  if (it == tickets_.end() || !Permits(caller, *it->second.owner)) {
    return absl::NotFoundError(absl::StrCat("ticket ", id, " is unknown or expired (the last ",
                                            kRetained,
                                            " finished tickets are kept) or not this session's"));
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

}  // namespace kvhost
