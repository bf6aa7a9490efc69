// TicketTable: the tickets of one TransferManager, by id — those in flight
// (with the attachment each was submitted on) and the last kRetained
// finished, which WaitTransfer may still ask after — and the counters over
// them.
//
// Ids are random (server/ids.h), so an id from before a restart names no
// ticket of this daemon. A ticket is found only by a caller its owner
// permits (server/transfer/caller.h); anyone else is told NOT_FOUND, as for
// an unknown or expired id.
//
// Thread safety: all methods may be called concurrently; the table has its
// own mutex. Lock order: TransferManager's mutex, then this table's, then a
// Ticket's; the table calls nothing else while it holds its mutex.
// Ownership: the table shares its tickets (and their owners) with the
// engine's jobs and the callers that asked for them.
#ifndef KVHOST_SERVER_TRANSFER_TICKET_TABLE_H_
#define KVHOST_SERVER_TRANSFER_TICKET_TABLE_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/transfer/caller.h"
#include "server/transfer/ticket.h"

namespace kvhost {

struct TransferCounters {
  uint64_t tickets_in_flight = 0;
  uint64_t tickets_done = 0;
  uint64_t tickets_failed = 0;
  uint64_t bytes[2] = {0, 0};  // by Direction
};

class TicketTable {
 public:
  // Finished tickets kept for WaitTransfer after they finish.
  static constexpr size_t kRetained = 65536;

  // A new ticket in flight (Ticket's arguments) with an id no ticket
  // of the table has, submitted on `attachment_id` and owned by `owner`.
  std::shared_ptr<Ticket> Open(const std::string& attachment_id, std::shared_ptr<const Owner> owner,
                               Direction direction, uint32_t layer_num, std::string path,
                               int32_t event_set, uint64_t layer_base = 0);
  // Ticket `id` has finished (OK or not) after `bytes`: counted, and kept
  // among the last kRetained finished. REQUIRES: in flight.
  void Retire(uint64_t id, Direction direction, bool ok, uint64_t bytes);

  // NOT_FOUND for an unknown or expired ticket, or one `caller` may not use.
  absl::StatusOr<std::shared_ptr<Ticket>> Find(const Caller& caller, uint64_t id) const;
  // The tickets in flight: all, or those submitted on any of `attachment_ids`.
  std::vector<std::shared_ptr<Ticket>> InFlight() const;
  std::vector<std::shared_ptr<Ticket>> InFlightOn(
      const std::vector<std::string>& attachment_ids) const;

  TransferCounters counters() const;

 private:
  struct Entry {
    std::shared_ptr<Ticket> ticket;
    std::shared_ptr<const Owner> owner;
  };

  mutable absl::Mutex mu_;
  // In flight and the last kRetained finished, by id.
  std::map<uint64_t, Entry> tickets_ ABSL_GUARDED_BY(mu_);
  // In flight: the attachment each was submitted on.
  std::map<uint64_t, std::string> in_flight_ ABSL_GUARDED_BY(mu_);
  // Finished, oldest first: the next to forget.
  std::deque<uint64_t> finished_ ABSL_GUARDED_BY(mu_);
  TransferCounters counters_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvhost

#endif  // KVHOST_SERVER_TRANSFER_TICKET_TABLE_H_
