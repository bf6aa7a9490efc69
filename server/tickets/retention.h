// Retention: the two rules by which a ticket table keeps a finished ticket
// waitable after it finishes, and which one it drops past its limits. Both
// tables of server/tickets/ keep finished tickets because a waiter may come
// late (its earlier wait's reply lost, or never sent), and both bound them
// so that one client's flood of tickets it never waits for drops only its
// own.
//
//   per-attachment retention  TicketTable (transfer tickets): at most
//       `finished` finished tickets in all attachments together; past it, the
//       attachment that keeps the most (among equals, the one that finished a
//       ticket last) loses its oldest.
//   per-pool retention        StorageTicketTable (detached StorageService
//       calls): each pool keeps its newest `finished_per_pool` finished
//       tickets and at most `pages_per_pool` of their pages (its newest stays
//       even alone over the page limit); a deleted pool's go with it.
//
// Plain values; thread-compatible.
#ifndef KVHOST_SERVER_TICKETS_RETENTION_H_
#define KVHOST_SERVER_TICKETS_RETENTION_H_

#include <cstddef>
#include <cstdint>

namespace kvhost {

struct PerAttachmentRetention {
  // Each kept transfer ticket takes ~0.5 KiB: 32 MiB at most.
  static constexpr size_t kDefaultFinished = 65536;
  // Finished tickets kept, in all attachments together (tests use fewer).
  size_t finished = kDefaultFinished;
};

struct PerPoolRetention {
  // Finished tickets a pool keeps, and their pages.
  size_t finished_per_pool = 256;
  uint64_t pages_per_pool = 65536;
};

}  // namespace kvhost

#endif  // KVHOST_SERVER_TICKETS_RETENTION_H_
