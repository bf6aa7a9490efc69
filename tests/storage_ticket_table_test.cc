// Tests of StorageTicketTable (server/tickets/storage_ticket_table.h), the
// tickets of detached StorageService calls: a done ticket returned to
// waiters and to every later Wait (a lost reply is asked again); a poll of a
// running ticket; found only through the pool object that made it;
// per-pool retention that drops a pool's own oldest finished ticket,
// counting only those no wait returned; a cancelled waiter; a deleted
// pool's tickets gone; concurrent finishes and waits.
#include "server/tickets/storage_ticket_table.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "pool_test_util.h"

namespace kvhost {
namespace {

PoolSpec Spec() {
  PoolSpec s;
  s.kind = PoolKind::kMha;
  s.layout = LayoutKind::kPageFirst;
  s.dtype = DType::kBf16;
  s.page_size = 4;
  s.layer_num = 1;
  s.head_num = 1;
  s.head_dim = 8;
  return s;
}

// A store's status with `pages` pages stored.
StorageTicketStatus Stored(uint64_t pages) {
  StorageTicketStatus s;
  s.call = StorageCall::kStore;
  s.pages.resize(pages, PageResult{PageOutcome::kStored, "", false});
  return s;
}

// A store of one page whose result's detail is `tag`, to tell tickets apart.
StorageTicketStatus Tagged(int tag) {
  StorageTicketStatus s;
  s.call = StorageCall::kStore;
  s.pages.push_back(PageResult{PageOutcome::kStored, absl::StrCat(tag), false});
  return s;
}

uint64_t StoredPages(const StorageTicketStatus& s) {
  EXPECT_EQ(s.call, StorageCall::kStore);
  return static_cast<uint64_t>(
      std::count_if(s.pages.begin(), s.pages.end(),
                    [](const PageResult& r) { return r.outcome == PageOutcome::kStored; }));
}

class StorageTicketTableTest : public ::testing::Test {
 protected:
  std::shared_ptr<Pool> MakePool(const std::string& name) {
    absl::StatusOr<std::shared_ptr<Pool>> pool =
        Pool::Create(name, Spec(), 64, absl::StrCat(dir_.path(), "/", ++made_, "."));
    EXPECT_TRUE(pool.ok()) << pool.status();
    return pool.ok() ? *pool : nullptr;
  }
  // Wait that records what its waiter got.
  struct Got {
    int calls = 0;
    StorageTicketStatus status;
  };
  absl::StatusOr<uint64_t> WaitInto(StorageTicketTable& tickets, const std::shared_ptr<Pool>& pool,
                                    uint64_t id, bool poll, Got* got, bool accept = true) {
    return tickets.Wait(pool, id, poll, [got, accept](const StorageTicketStatus& s) {
      ++got->calls;
      got->status = s;
      return accept;
    });
  }

  ::kvhost::testing::PoolShmDir dir_;
  int made_ = 0;
};

TEST_F(StorageTicketTableTest, FinishedTicketIsReturnedToEveryWait) {
  StorageTicketTable tickets;
  std::shared_ptr<Pool> pool = MakePool("a");
  const uint64_t id = *tickets.Open(pool, 1);
  EXPECT_NE(id, 0u);
  tickets.Finish(id, Stored(3), 3);
  for (int round = 0; round < 2; ++round) {  // the second: a client whose reply was lost
    Got got;
    ASSERT_TRUE(WaitInto(tickets, pool, id, false, &got).ok());
    EXPECT_EQ(got.calls, 1);
    EXPECT_TRUE(got.status.done);
    EXPECT_EQ(got.status.id, id);
    EXPECT_EQ(StoredPages(got.status), 3u);
  }
  EXPECT_EQ(tickets.size(), 1u);
  Got none;
  absl::StatusOr<uint64_t> unknown = WaitInto(tickets, pool, id + 1, false, &none);
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(unknown.status().message().find(std::to_string(id + 1)), std::string::npos)
      << unknown.status();
  EXPECT_EQ(none.calls, 0);
}

TEST_F(StorageTicketTableTest, WaiterGetsTheTicketWhenItFinishes) {
  StorageTicketTable tickets;
  std::shared_ptr<Pool> pool = MakePool("a");
  const uint64_t id = *tickets.Open(pool, 1);
  Got polled;
  ASSERT_TRUE(WaitInto(tickets, pool, id, true, &polled).ok());
  EXPECT_EQ(polled.calls, 1);
  EXPECT_FALSE(polled.status.done);
  EXPECT_EQ(polled.status.id, id);
  Got waited;
  ASSERT_TRUE(WaitInto(tickets, pool, id, false, &waited).ok());
  EXPECT_EQ(waited.calls, 0);
  tickets.Finish(id, Stored(2), 2);
  EXPECT_EQ(waited.calls, 1);
  EXPECT_TRUE(waited.status.done);
  EXPECT_EQ(StoredPages(waited.status), 2u);
  EXPECT_EQ(tickets.size(), 1u) << "a done ticket stays for the next wait";
}

TEST_F(StorageTicketTableTest, CancelledWaiterLeavesTheTicketForTheNextWait) {
  StorageTicketTable tickets;
  std::shared_ptr<Pool> pool = MakePool("a");
  const uint64_t id = *tickets.Open(pool, 1);
  // One waiter forgotten through Unwait, one that lost to its cancel.
  Got forgotten, cancelled;
  absl::StatusOr<uint64_t> w1 = WaitInto(tickets, pool, id, false, &forgotten);
  ASSERT_TRUE(w1.ok());
  tickets.Unwait(id, *w1);
  ASSERT_TRUE(WaitInto(tickets, pool, id, false, &cancelled, /*accept=*/false).ok());
  tickets.Finish(id, Stored(1), 1);
  EXPECT_EQ(forgotten.calls, 0);
  EXPECT_EQ(cancelled.calls, 1);
  Got got;
  ASSERT_TRUE(WaitInto(tickets, pool, id, false, &got).ok());
  EXPECT_EQ(StoredPages(got.status), 1u);
}

TEST_F(StorageTicketTableTest, OnlyThePoolObjectThatMadeItFindsIt) {
  StorageTicketTable tickets;
  std::shared_ptr<Pool> a = MakePool("a");
  std::shared_ptr<Pool> b = MakePool("b");
  const uint64_t id = *tickets.Open(a, 1);
  tickets.Finish(id, Stored(1), 1);
  Got got;
  EXPECT_EQ(WaitInto(tickets, b, id, false, &got).status().code(), absl::StatusCode::kNotFound);
  // A pool made again under the same name is another pool.
  std::shared_ptr<Pool> a_again = MakePool("a");
  EXPECT_EQ(WaitInto(tickets, a_again, id, true, &got).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(got.calls, 0);
  EXPECT_EQ(WaitInto(tickets, a, 0, false, &got).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(WaitInto(tickets, a, id + 1, false, &got).status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(WaitInto(tickets, a, id, false, &got).ok());
  EXPECT_EQ(got.calls, 1);
}

TEST_F(StorageTicketTableTest, APoolKeepsItsNewestFinishedTicketsWithinTheLimits) {
  KvhostMetrics metrics;
  StorageTicketTable tickets({/*finished_per_pool=*/3, /*pages_per_pool=*/10}, &metrics);
  std::shared_ptr<Pool> a = MakePool("a");
  std::shared_ptr<Pool> b = MakePool("b");
  const uint64_t b_id = *tickets.Open(b, 1);
  tickets.Finish(b_id, Stored(1), 1);
  std::vector<uint64_t> ids;
  for (int i = 0; i < 5; ++i) {
    ids.push_back(*tickets.Open(a, 1));
    tickets.Finish(ids.back(), Stored(1), 1);
  }
  EXPECT_EQ(tickets.dropped(), 2u);
  EXPECT_EQ(metrics.l3_tickets_dropped->WithLabels({})->value(), 2u);
  Got got;
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(WaitInto(tickets, a, ids[i], true, &got).status().code(), absl::StatusCode::kNotFound)
        << i;
  }
  for (int i = 2; i < 5; ++i) EXPECT_TRUE(WaitInto(tickets, a, ids[i], true, &got).ok()) << i;
  // Pages: 6 + 6 > 10 drops the first; one over the limit alone stays.
  const uint64_t six = *tickets.Open(a, 1);
  tickets.Finish(six, Stored(6), 6);
  const uint64_t six_more = *tickets.Open(a, 1);
  tickets.Finish(six_more, Stored(6), 6);
  EXPECT_EQ(WaitInto(tickets, a, six, true, &got).status().code(), absl::StatusCode::kNotFound);
  // ids[2..4] went too, but a wait had returned them: not counted as dropped.
  EXPECT_EQ(tickets.dropped(), 3u);
  const uint64_t big = *tickets.Open(a, 1);
  tickets.Finish(big, Stored(20), 20);
  EXPECT_TRUE(WaitInto(tickets, a, big, true, &got).ok());
  // Pool a's flood dropped none of b's.
  EXPECT_TRUE(WaitInto(tickets, b, b_id, true, &got).ok());
}

TEST_F(StorageTicketTableTest, ADeletedPoolsTicketsGo) {
  StorageTicketTable tickets;
  std::shared_ptr<Pool> a = MakePool("a");
  const uint64_t id = *tickets.Open(a, 1);
  tickets.Finish(id, Stored(1), 1);
  EXPECT_EQ(tickets.size(), 1u);
  a.reset();
  std::shared_ptr<Pool> b = MakePool("b");
  const uint64_t other = *tickets.Open(b, 1);  // sweeps
  EXPECT_EQ(tickets.size(), 1u);
  tickets.Discard(other);
  EXPECT_EQ(tickets.size(), 0u);
}

TEST_F(StorageTicketTableTest, ConcurrentFinishesAndWaitsDeliverEveryTicket) {
  constexpr int kTickets = 2000;
  StorageTicketTable tickets({/*finished_per_pool=*/kTickets, /*pages_per_pool=*/kTickets});
  std::shared_ptr<Pool> pool = MakePool("a");
  std::vector<uint64_t> ids;
  for (int i = 0; i < kTickets; ++i) ids.push_back(*tickets.Open(pool, 1));
  std::atomic<int> delivered{0};
  std::thread finisher([&] {
    for (int i = 0; i < kTickets; ++i) tickets.Finish(ids[i], Tagged(i), 1);
  });
  std::vector<std::thread> waiters;
  for (int t = 0; t < 2; ++t) {
    waiters.emplace_back([&, t] {
      for (int i = t; i < kTickets; i += 2) {
        absl::StatusOr<uint64_t> w =
            tickets.Wait(pool, ids[i], false, [&, i](const StorageTicketStatus& s) {
              EXPECT_EQ(s.id, ids[i]);
              EXPECT_TRUE(s.pages.size() == 1 && s.pages[0].detail == absl::StrCat(i)) << i;
              delivered.fetch_add(1);
              return true;
            });
        EXPECT_TRUE(w.ok()) << w.status();
      }
    });
  }
  finisher.join();
  for (std::thread& w : waiters) w.join();
  EXPECT_EQ(delivered.load(), kTickets);
  EXPECT_EQ(tickets.size(), static_cast<size_t>(kTickets));
  EXPECT_EQ(tickets.dropped(), 0u);
}

// Kept results are paid for by the memory budget (issue 29, finding 9): a
// ticket reserves its pages' results from Open until it is dropped, and a
// detached call whose results do not fit is refused with nothing kept.
TEST_F(StorageTicketTableTest, KeptResultsCountAgainstTheMemoryBudget) {
  auto ledger = std::make_shared<MemoryLedger>();
  constexpr uint64_t kBudget = 100 * StorageTicketTable::kBytesPerPage;
  StorageTicketTable::Reserve reserve =
      [ledger](uint64_t bytes, const std::string& what) -> absl::StatusOr<TransientReservation> {
    if (ledger->transient + bytes > kBudget) {
      return absl::ResourceExhaustedError(absl::StrCat(what, ": over the budget"));
    }
    ledger->transient += bytes;
    return TransientReservation(ledger, bytes);
  };
  StorageTicketTable tickets({/*finished_per_pool=*/2, /*pages_per_pool=*/1000}, nullptr, reserve);
  std::shared_ptr<Pool> a = MakePool("a");
  const uint64_t first = *tickets.Open(a, 60);
  EXPECT_EQ(ledger->transient.load(), 60 * StorageTicketTable::kBytesPerPage);
  absl::StatusOr<uint64_t> over = tickets.Open(a, 41);
  ASSERT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(absl::StrContains(over.status().message(), "41 pages of pool 'a'")) << over.status();
  EXPECT_EQ(tickets.size(), 1u);
  tickets.Finish(first, Stored(60), 60);
  // Dropped by the pool's limits: its bytes come back.
  const uint64_t second = *tickets.Open(a, 20);
  tickets.Finish(second, Stored(20), 20);
  const uint64_t third = *tickets.Open(a, 20);
  tickets.Finish(third, Stored(20), 20);
  EXPECT_EQ(ledger->transient.load(), 40 * StorageTicketTable::kBytesPerPage);
  // Discarded (a refused call) and gone with its pool: all of it back.
  tickets.Discard(*tickets.Open(a, 10));
  EXPECT_EQ(ledger->transient.load(), 40 * StorageTicketTable::kBytesPerPage);
  a.reset();
  std::shared_ptr<Pool> b = MakePool("b");
  tickets.Discard(*tickets.Open(b, 1));  // sweeps a's
  EXPECT_EQ(ledger->transient.load(), 0u);
}

}  // namespace
}  // namespace kvhost
