// TicketTable: the tickets of one TransferManager, by id — those in flight
// and the finished ones WaitTransfer may still ask after, each with the
// attachment it was submitted on — and the counters over them.
//
// Finished tickets are kept by per-attachment retention (retention.h): past
// `retention.finished` finished in all, the attachment that keeps the most
// (among equals, the one that finished a ticket last) loses its oldest. So
// one client's flood of tickets it never waits for drops only its own,
// while another attachment's finished ticket stays waitable as long as that
// attachment keeps fewer. Each drop is counted
// (kvhost_transfer_tickets_dropped_total) and logged with a rate limit.
//
// Ids are random (server/ids.h), so an id from before a restart names no
// ticket of this daemon. A ticket is found only by a caller its owner
// permits (server/access/caller.h); anyone else is told NOT_FOUND, as for
// an unknown or expired id.
//
// Thread safety: all methods may be called concurrently; the table has its
// own mutex. Lock order: TransferManager's mutex, then this table's, then a
// Ticket's; the table calls nothing else while it holds its mutex.
// Ownership: the table shares its tickets (and their owners) with the
// engine's jobs and the callers that asked for them.
#ifndef KVHOST_SERVER_TICKETS_TICKET_TABLE_H_
#define KVHOST_SERVER_TICKETS_TICKET_TABLE_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/access/caller.h"
#include "server/log_limit.h"
#include "server/metrics/kvhost_metrics.h"
#include "server/tickets/retention.h"
#include "server/tickets/ticket.h"

namespace kvhost {

// Since the daemon started, over every pool (deleted ones included).
struct TransferCounters {
  uint64_t tickets_in_flight = 0;
  uint64_t tickets_done = 0;    // the sum of done[]
  uint64_t tickets_failed = 0;  // the sum of failed[]
  // By Direction: tickets that completed OK, tickets that failed, and the
  // bytes of the OK ones.
  uint64_t done[2] = {0, 0};
  uint64_t failed[2] = {0, 0};
  uint64_t bytes[2] = {0, 0};
};

class TicketTable {
 public:
  // `retention`: how many finished tickets WaitTransfer may still find;
  // `metrics` (null: none) must outlive this.
  explicit TicketTable(PerAttachmentRetention retention = {}, KvhostMetrics* metrics = nullptr)
      : retained_(retention.finished), metrics_(metrics) {}
  TicketTable(const TicketTable&) = delete;
  TicketTable& operator=(const TicketTable&) = delete;

  // A new ticket in flight (Ticket's arguments) with an id no ticket
  // of the table has, submitted on `attachment_id` and owned by `owner`.
  std::shared_ptr<Ticket> Open(const std::string& attachment_id, std::shared_ptr<const Owner> owner,
                               Direction direction, uint32_t layer_num, std::string path,
                               int32_t event_set, uint64_t layer_base = 0);
  // Ticket `id` has finished (OK or not) after `bytes`: counted, and kept
  // with its attachment's finished tickets (the contract above says which
  // goes past the limit). REQUIRES: in flight.
  void Retire(uint64_t id, Direction direction, bool ok, uint64_t bytes);

  // NOT_FOUND for an unknown or expired ticket, or one `caller` may not use.
  absl::StatusOr<std::shared_ptr<Ticket>> Find(const Caller& caller, uint64_t id) const;
  // The tickets in flight: all, or those submitted on any of `attachment_ids`.
  std::vector<std::shared_ptr<Ticket>> InFlight() const;
  std::vector<std::shared_ptr<Ticket>> InFlightOn(
      const std::vector<std::string>& attachment_ids) const;

  TransferCounters counters() const;
  // Finished tickets dropped by the limit so far, and kept now.
  uint64_t dropped() const;
  size_t finished() const;

 private:
  struct Entry {
    std::shared_ptr<Ticket> ticket;
    std::shared_ptr<const Owner> owner;
  };
  // An attachment's finished tickets, oldest first, and when it last
  // finished one (a serial of Retire).
  struct Kept {
    std::deque<uint64_t> ids;
    uint64_t last = 0;
  };
  // Orders the holders by how many they keep, then by `last`: the greatest
  // is the next to lose its oldest.
  using Holder = std::tuple<size_t, uint64_t, std::string>;

  // Drops the oldest finished ticket of the greatest holder.
  void DropOne() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const size_t retained_;
  KvhostMetrics* const metrics_;
  LogLimit drop_log_;
  mutable absl::Mutex mu_;
  // In flight and the finished kept, by id.
  std::map<uint64_t, Entry> tickets_ ABSL_GUARDED_BY(mu_);
  // In flight: the attachment each was submitted on.
  std::map<uint64_t, std::string> in_flight_ ABSL_GUARDED_BY(mu_);
  // Finished, by the attachment each was submitted on.
  std::map<std::string, Kept> kept_ ABSL_GUARDED_BY(mu_);
  std::set<Holder> holders_ ABSL_GUARDED_BY(mu_);
  size_t finished_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t serial_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t dropped_ ABSL_GUARDED_BY(mu_) = 0;
  TransferCounters counters_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvhost

#endif  // KVHOST_SERVER_TICKETS_TICKET_TABLE_H_
