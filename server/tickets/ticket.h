// Ticket: one backup or load in flight, from acceptance to its end.
//
// The engine reports progress (bytes, layers completed in order) and the end
// (OK or an error status); waiters either block (Wait) or register a callback
// (OnDone) that runs exactly once, on the thread that finishes the ticket, or
// at once if it is already finished.
//
// Thread safety: all methods may be called concurrently.
#ifndef KVHOST_SERVER_TICKETS_TICKET_H_
#define KVHOST_SERVER_TICKETS_TICKET_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace kvhost {

enum class Direction : uint8_t { kBackup, kLoad };
const char* DirectionName(Direction direction);

struct TicketStatus {
  uint64_t id = 0;
  bool done = false;
  absl::Status status;  // the ticket's end, meaningful when done
  uint64_t bytes = 0;
  uint32_t layers_done = 0;
  uint32_t layer_num = 0;
  std::string path;
  uint64_t duration_us = 0;
  uint64_t first_layer_us = 0;  // acceptance to the first layer done (0 before)
  uint64_t enqueue_us = 0;      // acceptance to the end of Submit (0 before)
  int32_t event_set = -1;
};

class Ticket {
 public:
  // `event_set`: the load event set the job records (-1: none);
  // `layer_base`: its base in the attachment's layer counters (backups and
  // loads with layer progress; see LayerCounters), else 0.
  Ticket(uint64_t id, Direction direction, uint32_t layer_num, std::string path,
         int32_t event_set = -1, uint64_t layer_base = 0);

  uint64_t id() const { return id_; }
  int32_t event_set() const { return event_set_; }
  uint64_t layer_base() const { return layer_base_; }
  Direction direction() const { return direction_; }

  // Engine side: ticket layer's copies have finished (its bytes are in
  // place), not merely been enqueued (cuda/paths.h's LayerEnqueued).
  // REQUIRES: not finished.
  void LayerFinished(uint64_t bytes);
  // The transfer service: the engine has taken the job (its copies are
  // queued, for engines that queue them in Submit).
  void Enqueued();
  // Ends the ticket; callbacks run here. Later calls are ignored.
  void Finish(absl::Status status);

  // Asks the engine to stop the ticket early with `reason` (a non-OK
  // status, e.g. CANCELLED): an engine that copies on its own threads (the
  // host engine) checks CancelReason() before each ticket layer and
  // finishes the ticket with it; one that queued every copy at Submit (the
  // CUDA engine) lets the ticket run to its end. The first reason stays.
  void RequestCancel(absl::Status reason);
  // The reason RequestCancel gave, or OK while none was asked.
  absl::Status CancelReason() const;

  // Waiter side.
  TicketStatus Snapshot() const;
  // Blocks until finished or `deadline`; returns whether finished.
  bool WaitUntil(absl::Time deadline) const;
  void OnDone(std::function<void()> callback);
  // Runs `step` with the ticket's end inside Finish, before the ticket shows
  // as done to anyone (Snapshot, WaitUntil, OnDone callbacks): what must be
  // true of a finished ticket (a node cache's store published) is true when a
  // waiter sees it. Returns false, keeping nothing, when Finish has begun.
  // `step` must not call back into this ticket.
  bool BeforeDone(std::function<void(const absl::Status&)> step);

 private:
  const uint64_t id_;
  const Direction direction_;
  const uint32_t layer_num_;
  const std::string path_;
  const int32_t event_set_;
  const uint64_t layer_base_;
  const absl::Time accepted_;

  mutable absl::Mutex mu_;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  bool finishing_ ABSL_GUARDED_BY(mu_) = false;  // Finish has begun
  absl::Status cancel_ ABSL_GUARDED_BY(mu_);
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  uint64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint32_t layers_done_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Duration duration_ ABSL_GUARDED_BY(mu_);
  absl::Duration first_layer_ ABSL_GUARDED_BY(mu_);
  absl::Duration enqueued_ ABSL_GUARDED_BY(mu_);
  std::vector<std::function<void()>> callbacks_ ABSL_GUARDED_BY(mu_);
  std::vector<std::function<void(const absl::Status&)>> steps_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvhost

#endif  // KVHOST_SERVER_TICKETS_TICKET_H_
