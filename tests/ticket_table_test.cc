// Tests of TicketTable (server/tickets/ticket_table.h): finished tickets
// are kept by per-attachment retention (server/tickets/retention.h), so that
// one attachment's flood of tickets no one waits for drops only its own,
// never another attachment's finished ticket; each drop is counted.
#include "server/tickets/ticket_table.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace kvhost {
namespace {

// A finished ticket submitted on `attachment`, owned by `session`.
uint64_t Finished(TicketTable* table, const std::string& attachment,
                  const std::string& session = "") {
  auto owner = std::make_shared<Owner>();
  owner->session_id = session;
  std::shared_ptr<Ticket> ticket =
      table->Open(attachment, std::move(owner), Direction::kBackup, 1, "none", -1);
  ticket->LayerFinished(4096);
  ticket->Finish(absl::OkStatus());
  table->Retire(ticket->id(), Direction::kBackup, true, 4096);
  return ticket->id();
}

Caller CallerIn(const std::string& session) {
  Caller caller;
  caller.sessions.push_back(session);
  return caller;
}

// The attack of issue 29: a victim's backup finished, not yet waited for;
// another client floods 1-page backups past the table's limit. Before,
// one FIFO of the last 65,536 made the victim's ticket NOT_FOUND.
TEST(TicketTableTest, AFloodOfFinishedTicketsKeepsAnotherAttachmentsTicket) {
  TicketTable table;
  const uint64_t victim = Finished(&table, "att-1-victim", "ses-1-victim");
  const uint64_t first = Finished(&table, "att-2-flood", "ses-2-flood");
  for (size_t i = 0; i < PerAttachmentRetention::kDefaultFinished + 1000; ++i) {
    Finished(&table, "att-2-flood", "ses-2-flood");
  }
  absl::StatusOr<std::shared_ptr<Ticket>> found = table.Find(CallerIn("ses-1-victim"), victim);
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_TRUE((*found)->Snapshot().done);
  EXPECT_TRUE((*found)->Snapshot().status.ok());
  // The flooder lost its own oldest.
  EXPECT_EQ(table.Find(CallerIn("ses-2-flood"), first).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(table.counters().tickets_done, PerAttachmentRetention::kDefaultFinished + 1002);
}

TEST(TicketTableTest, TheAttachmentKeepingTheMostLosesItsOldestAndDropsAreCounted) {
  KvhostMetrics metrics;
  TicketTable table({/*finished=*/8}, &metrics);
  std::vector<uint64_t> victim;
  for (int i = 0; i < 3; ++i) victim.push_back(Finished(&table, "att-v"));
  std::vector<uint64_t> flood;
  for (int i = 0; i < 100; ++i) flood.push_back(Finished(&table, "att-f"));
  EXPECT_EQ(table.finished(), 8u);
  EXPECT_EQ(table.dropped(), 95u);
  for (uint64_t id : victim) EXPECT_TRUE(table.Find(Caller{}, id).ok()) << id;
  // The flooder keeps its newest five.
  for (int i = 0; i < 100; ++i) {
    EXPECT_EQ(table.Find(Caller{}, flood[i]).ok(), i >= 95) << i;
  }
  EXPECT_NE(metrics.registry.Render().find("kvhost_transfer_tickets_dropped_total 95"),
            std::string::npos)
      << metrics.registry.Render();
}

// A flood spread over many attachments of one ticket each: among equals the
// attachment that finished last loses its ticket, so an attachment that
// finished earlier keeps its own.
TEST(TicketTableTest, AFloodOverManyAttachmentsDropsTheFloodersTickets) {
  TicketTable table({/*finished=*/4});
  const uint64_t victim = Finished(&table, "att-v");
  for (int i = 0; i < 1000; ++i) Finished(&table, "att-f" + std::to_string(i));
  EXPECT_TRUE(table.Find(Caller{}, victim).ok());
  EXPECT_EQ(table.finished(), 4u);
  EXPECT_EQ(table.dropped(), 997u);
}

TEST(TicketTableTest, InFlightTicketsAreNeverDropped) {
  TicketTable table({/*finished=*/2});
  auto owner = std::make_shared<Owner>();
  std::shared_ptr<Ticket> running = table.Open("att-r", owner, Direction::kLoad, 1, "none", -1);
  for (int i = 0; i < 50; ++i) Finished(&table, "att-r");
  EXPECT_TRUE(table.Find(Caller{}, running->id()).ok());
  ASSERT_EQ(table.InFlight().size(), 1u);
  EXPECT_EQ(table.finished(), 2u);
}

// The daemon-wide counters (GetStatus, kvhost_transfers_total): per
// direction and result, totals their sums, and outliving the kept tickets.
TEST(TicketTableTest, CountersByDirectionAndResult) {
  TicketTable table({/*finished=*/2});
  auto owner = std::make_shared<Owner>();
  for (int i = 0; i < 5; ++i) Finished(&table, "att-c");  // 5 backups OK, 4096 bytes each
  std::shared_ptr<Ticket> load = table.Open("att-c", owner, Direction::kLoad, 1, "none", -1);
  load->Finish(absl::InternalError("boom"));
  table.Retire(load->id(), Direction::kLoad, false, 0);
  const TransferCounters c = table.counters();
  const int backup = static_cast<int>(Direction::kBackup);
  const int loads = static_cast<int>(Direction::kLoad);
  EXPECT_EQ(c.done[backup], 5u);
  EXPECT_EQ(c.failed[backup], 0u);
  EXPECT_EQ(c.done[loads], 0u);
  EXPECT_EQ(c.failed[loads], 1u);
  EXPECT_EQ(c.bytes[backup], 5u * 4096);
  EXPECT_EQ(c.bytes[loads], 0u);
  EXPECT_EQ(c.tickets_done, 5u);
  EXPECT_EQ(c.tickets_failed, 1u);
  EXPECT_EQ(table.finished(), 2u);  // kept: 2; counted: all 6
}

}  // namespace
}  // namespace kvhost
