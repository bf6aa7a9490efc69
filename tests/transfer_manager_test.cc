// Tests of the transfer manager (server/transfer/transfer_manager.h) over the
// host engine: validation that leaves no ticket, round trips through a pool,
// attachments holding their pool, drain; ownership of attachments and tickets
// (a stranger's ids are refused); then every pool kind x allowed layout (per-component buffers,
// page-row components in whole pages, sharded pools and partial attachments,
// followers, TP ranks, LOGICAL) and pool groups (layer maps, pool_transfers,
// all-or-nothing validation), checked against SeedOffset, an address formula
// written from the seeds' tensor shapes. Pools and emulated device pools live
// in a private directory under /dev/shm.
#include "server/transfer/transfer_manager.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <ostream>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "domain_test_util.h"
#include "kvhost/layout.h"
#include "seed_offsets.h"
#include "server/pool/pool.h"
#include "server/pool/pool_group.h"
#include "server/pool/pool_spec.h"
#include "server/pool/registry.h"
#include "server/pool/shm_region.h"
#include "server/transfer/engine.h"
#include "server/transfer/host_engine.h"
#include "server/transfer/ticket.h"
#include "transfer_test_util.h"

namespace kvhost {

namespace {

using ::kvhost::testing::AttachByName;
using ::kvhost::testing::EngineFixture;
using ::kvhost::testing::Msg;
using ::kvhost::testing::RandomBytes;
using ::kvhost::testing::RandomPairs;
using ::kvhost::testing::RoomyRegistryOptions;
using ::kvhost::testing::SameBytes;
using ::testing::HasSubstr;
using ::testing::Not;
using ShmDir = ::kvhost::testing::TransferShmDir;

class ManagerTest : public EngineFixture {
 protected:
  void SetUp() override {
    EngineFixture::SetUp();
    registry_ = std::make_unique<PoolRegistry>(RoomyRegistryOptions(dir_.path()));
    absl::StatusOr<std::shared_ptr<Pool>> pool = registry_->Create("llama", spec_);
    ASSERT_TRUE(pool.ok()) << pool.status();
    pool_ = *pool;  // the registry's pool; the device file matches its layout
    manager_ = std::make_unique<TransferManager>(std::make_unique<HostEngine>(Options()));
    absl::StatusOr<AttachmentInfo> att =
        AttachByName(*manager_, *registry_, "llama", dev_.Request(pool_->layout().planes));
    ASSERT_TRUE(att.ok()) << att.status();
    att_ = att->id;
  }
  void TearDown() override {
    manager_.reset();
    registry_.reset();
  }

  // No ticket exists, none is in flight and none finished.
  void ExpectNoTickets() {
    const TransferCounters c = manager_->counters();
    EXPECT_EQ(c.tickets_in_flight, 0u);
    EXPECT_EQ(c.tickets_done, 0u);
    EXPECT_EQ(c.tickets_failed, 0u);
    EXPECT_EQ(c.bytes[0] + c.bytes[1], 0u);
    for (uint64_t id = 0; id < 20; ++id) {
      EXPECT_EQ(manager_->FindTicket({}, id).status().code(), absl::StatusCode::kNotFound) << id;
    }
  }

  std::unique_ptr<PoolRegistry> registry_;
  std::unique_ptr<TransferManager> manager_;
  std::string att_;
};

TEST_F(ManagerTest, ValidationErrorsLeaveNoTicket) {
  ASSERT_TRUE(pool_->AllocPages(8).ok());  // slots 0..7 allocated
  const int64_t size = static_cast<int64_t>(pool_->size_tokens());
  const int64_t rows = static_cast<int64_t>(kRows);
  struct Bad {
    const char* what;
    std::string att;
    Direction dir;
    std::vector<int64_t> host, device;
    absl::StatusCode code;
    const char* message;
  } cases[] = {
      {"lengths differ",
       att_,
       Direction::kBackup,
       {0, 1},
       {0},
       absl::StatusCode::kInvalidArgument,
       "host_indices has 2"},
      {"negative host",
       att_,
       Direction::kBackup,
       {0, -1},
       {0, 1},
       absl::StatusCode::kInvalidArgument,
       "host_indices[1] = -1"},
      {"host past end",
       att_,
       Direction::kLoad,
       {size},
       {0},
       absl::StatusCode::kInvalidArgument,
       "host_indices[0]"},
      {"device past end",
       att_,
       Direction::kBackup,
       {0, 1},
       {0, rows},
       absl::StatusCode::kInvalidArgument,
       "device_indices[1]"},
      {"negative device",
       att_,
       Direction::kLoad,
       {0},
       {-3},
       absl::StatusCode::kInvalidArgument,
       "device_indices[0] = -3"},
      {"backup repeats a host slot",
       att_,
       Direction::kBackup,
       {0, 1, 2, 1},
       {0, 1, 2, 3},
       absl::StatusCode::kInvalidArgument,
       "host slot 1"},
      {"load repeats a device row",
       att_,
       Direction::kLoad,
       {0, 1, 2, 3},
       {5, 6, 7, 6},
       absl::StatusCode::kInvalidArgument,
       "device row 6"},
      {"unallocated host slot",
       att_,
       Direction::kBackup,
       {6, 7, 8},
       {0, 1, 2},
       absl::StatusCode::kFailedPrecondition,
       "host slot 8"},
      {"unallocated on load",
       att_,
       Direction::kLoad,
       {40},
       {0},
       absl::StatusCode::kFailedPrecondition,
       "host slot 40"},
      {"unknown attachment",
       "att-nope",
       Direction::kBackup,
       {0},
       {0},
       absl::StatusCode::kNotFound,
       "att-nope"},
  };
  for (const Bad& b : cases) {
    absl::StatusOr<std::shared_ptr<Ticket>> t =
        manager_->Submit({}, b.att, b.dir, b.host, b.device);
    EXPECT_EQ(t.status().code(), b.code) << b.what << ": " << t.status();
    EXPECT_THAT(Msg(t.status()), HasSubstr(b.message)) << b.what;
  }
  ExpectNoTickets();
  // A load may read one host slot twice (only destinations must be unique).
  absl::StatusOr<std::shared_ptr<Ticket>> ok =
      manager_->Submit({}, att_, Direction::kLoad, {3, 3}, {0, 1});
  ASSERT_TRUE(ok.ok()) << ok.status();
  ASSERT_TRUE((*ok)->WaitUntil(absl::Now() + absl::Seconds(30)));
  EXPECT_TRUE((*ok)->Snapshot().status.ok());
  EXPECT_TRUE(manager_->FindTicket({}, (*ok)->id()).ok());
}

TEST_F(ManagerTest, RoundTripThroughThePool) {
  const KvLayout& layout = pool_->layout();
  absl::StatusOr<std::vector<uint64_t>> pages = pool_->AllocPages(12);  // pages 0..2
  ASSERT_TRUE(pages.ok());
  std::mt19937_64 rng(9);
  std::vector<uint8_t> original = RandomBytes(rng, dev_.region->size());
  std::memcpy(dev_.region->data(), original.data(), original.size());
  // Device rows 20..31 -> host slots 8..11, 0..7 (two runs), then back to rows 0..11.
  std::vector<int64_t> host = {8, 9, 10, 11, 0, 1, 2, 3, 4, 5, 6, 7};
  std::vector<int64_t> from(12), to(12);
  for (int i = 0; i < 12; ++i) from[i] = 20 + i, to[i] = i;
  absl::StatusOr<std::shared_ptr<Ticket>> b =
      manager_->Submit({}, att_, Direction::kBackup, host, from);
  ASSERT_TRUE(b.ok()) << b.status();
  ASSERT_TRUE((*b)->WaitUntil(absl::Now() + absl::Seconds(30)));
  absl::StatusOr<std::shared_ptr<Ticket>> l =
      manager_->Submit({}, att_, Direction::kLoad, host, to);
  ASSERT_TRUE(l.ok()) << l.status();
  ASSERT_TRUE((*l)->WaitUntil(absl::Now() + absl::Seconds(30)));
  EXPECT_NE((*b)->id(), (*l)->id());
  const uint64_t bytes = 12 * layout.token_bytes * layout.planes * layout.layers;
  for (const auto& t : {*b, *l}) {
    const TicketStatus st = t->Snapshot();
    EXPECT_TRUE(st.status.ok()) << st.status;
    EXPECT_EQ(st.bytes, bytes);
    EXPECT_EQ(st.layers_done, layout.layers);
  }
  for (uint64_t plane = 0; plane < layout.planes; ++plane) {
    for (uint64_t layer = 0; layer < layout.layers; ++layer) {
      const uint64_t off = dev_.LayerOffset(plane, layer);
      // Rows 0..11 now equal rows 20..31; rows 12.. untouched.
      EXPECT_TRUE(SameBytes(dev_.region->data() + off, original.data() + off + 20 * dev_.row_bytes,
                            12 * dev_.row_bytes));
      EXPECT_TRUE(SameBytes(dev_.region->data() + off + 12 * dev_.row_bytes,
                            original.data() + off + 12 * dev_.row_bytes,
                            (kRows - 12) * dev_.row_bytes));
    }
  }
  // Counters: each ticket retired once with its bytes. Retiring is a ticket
  // callback, which runs after waiters wake, so wait for it.
  TransferCounters c = manager_->counters();
  for (absl::Time end = absl::Now() + absl::Seconds(10);
       c.tickets_in_flight != 0 && absl::Now() < end; c = manager_->counters()) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_EQ(c.tickets_in_flight, 0u);
  EXPECT_EQ(c.tickets_done, 2u);
  EXPECT_EQ(c.tickets_failed, 0u);
  EXPECT_EQ(c.bytes[static_cast<int>(Direction::kBackup)], bytes);
  EXPECT_EQ(c.bytes[static_cast<int>(Direction::kLoad)], bytes);
  // An empty transfer finishes at once with every layer reported.
  absl::StatusOr<std::shared_ptr<Ticket>> empty =
      manager_->Submit({}, att_, Direction::kBackup, {}, {});
  ASSERT_TRUE(empty.ok());
  const TicketStatus st = (*empty)->Snapshot();
  EXPECT_TRUE(st.done);
  EXPECT_EQ(st.layers_done, layout.layers);
  EXPECT_EQ(st.bytes, 0u);
}

TEST_F(ManagerTest, AttachmentsHoldThePool) {
  EXPECT_EQ(pool_->attachments(), 1u);
  EXPECT_EQ(manager_->ListAttachments().size(), 1u);
  EXPECT_EQ(registry_->Delete("llama").status().code(), absl::StatusCode::kFailedPrecondition);
  // A malformed attach takes no attachment.
  AttachRequest bad = dev_.Request(pool_->layout().planes);
  bad.v_layers.pop_back();
  EXPECT_EQ(AttachByName(*manager_, *registry_, "llama", bad).status().code(),
            absl::StatusCode::kInvalidArgument);
  bad = dev_.Request(pool_->layout().planes);
  bad.k_layers[0].shm_path = "/etc/hostname";
  EXPECT_EQ(AttachByName(*manager_, *registry_, "llama", bad).status().code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(AttachByName(*manager_, *registry_, "nope", dev_.Request(2)).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(pool_->attachments(), 1u);

  ASSERT_TRUE(manager_->Detach({}, att_).ok());
  EXPECT_EQ(manager_->Detach({}, att_).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(pool_->attachments(), 0u);
  ASSERT_TRUE(pool_->AllocPages(4).ok());
  EXPECT_EQ(manager_->Submit({}, att_, Direction::kBackup, {0}, {0}).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_TRUE(registry_->Delete("llama").ok());
  ExpectNoTickets();
}

TEST_F(ManagerTest, RefusedAfterDrain) {
  ASSERT_TRUE(pool_->AllocPages(4).ok());
  absl::StatusOr<std::shared_ptr<Ticket>> before =
      manager_->Submit({}, att_, Direction::kBackup, {0, 1, 2, 3}, {0, 1, 2, 3});
  ASSERT_TRUE(before.ok());
  manager_->Drain();
  // Accepted work finished before Drain returned.
  EXPECT_TRUE((*before)->Snapshot().done);
  absl::StatusOr<std::shared_ptr<Ticket>> after =
      manager_->Submit({}, att_, Direction::kLoad, {0, 1, 2, 3}, {0, 1, 2, 3});
  EXPECT_EQ(after.status().code(), absl::StatusCode::kUnavailable) << after.status();
  const TransferCounters c = manager_->counters();
  EXPECT_EQ(c.tickets_done, 1u);
  EXPECT_EQ(c.tickets_in_flight, 0u);
  EXPECT_EQ(manager_->FindTicket({}, (*before)->id() + 1).status().code(),
            absl::StatusCode::kNotFound);
}

// Layer progress (AttachRequest::layer_progress): the attachment's
// LayerCounters, a set and a base per load and per backup, every layer
// published before the ticket counts it, the counter at base + layers once
// the ticket is done; none of it for an attachment without the opt-in.
class LayerProgressManagerTest : public ManagerTest {
 protected:
  void SetUp() override {
    ManagerTest::SetUp();
    if (HasFatalFailure()) return;
    AttachRequest request = dev_.Request(pool_->layout().planes);
    request.layer_progress = true;
    request.load_event_sets = 2;
    absl::StatusOr<AttachmentInfo> att = AttachByName(*manager_, *registry_, "llama", request);
    ASSERT_TRUE(att.ok()) << att.status();
    EXPECT_TRUE(att->layer_progress);
    EXPECT_EQ(att->load_event_sets, 2u);  // the counters' (the host engine has no events)
    progress_ = att->id;
    absl::StatusOr<std::shared_ptr<LayerCounters>> counters =
        manager_->FindLayerCounters({}, progress_);
    ASSERT_TRUE(counters.ok()) << counters.status();
    counters_ = *counters;
    ASSERT_TRUE(pool_->AllocPages(16).ok());  // slots 0..15
  }
  std::string progress_;
  std::shared_ptr<LayerCounters> counters_;
};

TEST_F(LayerProgressManagerTest, EachTransferTakesASetAndABaseAndEndsAtBasePlusLayers) {
  const uint32_t layers = pool_->layout().layers;
  uint64_t next[2] = {0, 0};
  std::vector<int64_t> host(16), device(16);
  for (int i = 0; i < 16; ++i) host[i] = i, device[i] = 39 - i;
  for (int n = 0; n < 5; ++n) {
    absl::StatusOr<std::shared_ptr<Ticket>> t =
        manager_->Submit({}, progress_, Direction::kLoad, host, device);
    ASSERT_TRUE(t.ok()) << t.status();
    const int32_t set = (*t)->event_set();
    ASSERT_TRUE(set == 0 || set == 1) << set;
    EXPECT_EQ((*t)->layer_base(), next[set]);
    // The ticket never counts a layer the counter has not: Publish comes
    // first. Checked while the load runs, then at its end.
    while (!(*t)->Snapshot().done) {
      const uint32_t counted = (*t)->Snapshot().layers_done;
      EXPECT_GE(counters_->Recorded(static_cast<uint32_t>(set)), (*t)->layer_base() + counted);
    }
    ASSERT_TRUE((*t)->Snapshot().status.ok());
    EXPECT_EQ(counters_->Recorded(static_cast<uint32_t>(set)), (*t)->layer_base() + layers);
    next[set] += layers;
  }
  EXPECT_EQ(next[0] + next[1], 5u * layers);
  // A backup takes a set and a base in the same count, and ends there too.
  for (int n = 0; n < 2; ++n) {
    absl::StatusOr<std::shared_ptr<Ticket>> backup =
        manager_->Submit({}, progress_, Direction::kBackup, host, device);
    ASSERT_TRUE(backup.ok()) << backup.status();
    const int32_t set = (*backup)->event_set();
    ASSERT_TRUE(set == 0 || set == 1) << set;
    EXPECT_EQ((*backup)->layer_base(), next[set]);
    ASSERT_TRUE((*backup)->WaitUntil(absl::Now() + absl::Seconds(30)));
    ASSERT_TRUE((*backup)->Snapshot().status.ok());
    EXPECT_EQ(counters_->Recorded(static_cast<uint32_t>(set)), next[set] + layers);
    next[set] += layers;
  }
  // Backups and loads of no rows take no set and leave the counters alone.
  for (Direction direction : {Direction::kBackup, Direction::kLoad}) {
    absl::StatusOr<std::shared_ptr<Ticket>> empty =
        manager_->Submit({}, progress_, direction, {}, {});
    ASSERT_TRUE(empty.ok());
    EXPECT_EQ((*empty)->event_set(), -1);
  }
  EXPECT_EQ(counters_->Recorded(0) + counters_->Recorded(1), 7u * layers);
  // An attachment without layer progress: no set, no base, no counters.
  for (Direction direction : {Direction::kBackup, Direction::kLoad}) {
    absl::StatusOr<std::shared_ptr<Ticket>> plain =
        manager_->Submit({}, att_, direction, host, device);
    ASSERT_TRUE(plain.ok());
    EXPECT_EQ((*plain)->event_set(), -1);
    EXPECT_EQ((*plain)->layer_base(), 0u);
  }
  EXPECT_EQ(manager_->FindLayerCounters({}, att_).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(manager_->FindLayerCounters({}, "att-nope").status().code(),
            absl::StatusCode::kNotFound);
}

TEST_F(LayerProgressManagerTest, ACancelledLoadStillEndsAtBasePlusLayers) {
  const uint32_t layers = pool_->layout().layers;
  // Cancelled right after it is accepted: the engine stops it before its
  // next layer (unless it was done already); either way its waiters go.
  std::vector<std::shared_ptr<Ticket>> tickets;
  for (int n = 0; n < 2; ++n) {
    absl::StatusOr<std::shared_ptr<Ticket>> t =
        manager_->Submit({}, progress_, Direction::kLoad, {0, 1, 2, 3}, {0, 1, 2, 3});
    ASSERT_TRUE(t.ok()) << t.status();
    (*t)->RequestCancel(absl::CancelledError("test"));
    tickets.push_back(*t);
  }
  for (const std::shared_ptr<Ticket>& t : tickets) {
    ASSERT_TRUE(t->WaitUntil(absl::Now() + absl::Seconds(30)));
    EXPECT_GE(counters_->Recorded(static_cast<uint32_t>(t->event_set())), t->layer_base() + layers);
  }
  // The sets are free again: two more loads are accepted at once.
  for (int n = 0; n < 2; ++n) {
    absl::StatusOr<std::shared_ptr<Ticket>> t =
        manager_->Submit({}, progress_, Direction::kLoad, {0, 1, 2, 3}, {0, 1, 2, 3});
    ASSERT_TRUE(t.ok()) << t.status();
    ASSERT_TRUE((*t)->WaitUntil(absl::Now() + absl::Seconds(30)));
  }
  // The counters outlive the detach for whoever still holds them.
  ASSERT_TRUE(manager_->Detach({}, progress_).ok());
  EXPECT_EQ(counters_->Recorded(0) + counters_->Recorded(1), 4u * layers);
  EXPECT_EQ(manager_->FindLayerCounters({}, progress_).status().code(),
            absl::StatusCode::kNotFound);
}

// Ids are random capabilities, a session's attachment and
// tickets serve that session (or the pool's token holder) and nobody else.
TEST(RandomIdTest, IdsAre128BitsAndLogsShowAPrefix) {
  const std::string a = RandomHex();
  const std::string b = RandomHex();
  EXPECT_EQ(a.size(), 32u);
  EXPECT_EQ(a.find_first_not_of("0123456789abcdef"), std::string::npos) << a;
  EXPECT_NE(a, b);
  const std::string id = absl::StrCat("att-12-", a);
  const std::string shown = ShortId(id);
  EXPECT_EQ(shown, absl::StrCat("att-12-", a.substr(0, 4), "..."));
  EXPECT_EQ(shown.find(a.substr(0, 8)), std::string::npos);
  // A caller's junk id is bounded too.
  EXPECT_LT(ShortId(std::string(10000, 'x')).size(), 16u);
}

class OwnershipTest : public ManagerTest {
 protected:
  void SetUp() override {
    ManagerTest::SetUp();
    ASSERT_TRUE(pool_->AllocPages(8).ok());
    mine_ = manager_->OpenSession("mine", 1, "test");
    theirs_ = manager_->OpenSession("theirs", 2, "test");
    AttachRequest req = dev_.Request(pool_->layout().planes);
    req.session_id = mine_;
    absl::StatusOr<AttachmentInfo> att = AttachByName(*manager_, *registry_, "llama", req);
    ASSERT_TRUE(att.ok()) << att.status();
    EXPECT_EQ(att->session_id, mine_);
    in_session_ = att->id;
  }
  // Every way a caller other than the owner may present itself.
  std::vector<Caller> Strangers() const {
    return {Caller{}, Caller{{theirs_}, std::nullopt}, Caller{{theirs_, "ses-1-0"}, std::nullopt},
            Caller{{mine_.substr(0, mine_.size() - 1)}, std::nullopt},
            Caller{{}, std::string("any-token")}};
  }
  uint64_t Tickets() const {
    const TransferCounters c = manager_->counters();
    return c.tickets_in_flight + c.tickets_done + c.tickets_failed;
  }

  std::string mine_, theirs_, in_session_;
};

TEST_F(OwnershipTest, ASessionsAttachmentServesOnlyThatSession) {
  const Caller owner{{mine_}, std::nullopt};
  absl::StatusOr<std::shared_ptr<Ticket>> ticket =
      manager_->Submit(owner, in_session_, Direction::kBackup, {0, 1, 2, 3}, {0, 1, 2, 3});
  ASSERT_TRUE(ticket.ok()) << ticket.status();
  ASSERT_TRUE((*ticket)->WaitUntil(absl::Now() + absl::Seconds(30)));
  const uint64_t tickets = Tickets();
  // What an unknown id gets, and what a stranger gets: the same words.
  const absl::Status unknown =
      manager_->Submit({}, "att-1-0123456789abcdef0123456789abcdef", Direction::kLoad, {0}, {0})
          .status();
  ASSERT_EQ(unknown.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(Msg(unknown), HasSubstr("not found (or not this session's)"));
  for (const Caller& stranger : Strangers()) {
    for (Direction d : {Direction::kBackup, Direction::kLoad}) {
      const absl::Status s = manager_->Submit(stranger, in_session_, d, {4}, {4}).status();
      EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
      EXPECT_THAT(Msg(s), HasSubstr("not found (or not this session's)"));
      EXPECT_THAT(Msg(s), Not(HasSubstr(in_session_)));
    }
    const absl::Status detach = manager_->Detach(stranger, in_session_);
    EXPECT_EQ(detach.code(), absl::StatusCode::kNotFound) << detach;
    const absl::Status find = manager_->FindTicket(stranger, (*ticket)->id()).status();
    EXPECT_EQ(find.code(), absl::StatusCode::kNotFound) << find;
  }
  // Nothing changed: no ticket, the attachment and its pool count stay.
  EXPECT_EQ(Tickets(), tickets);
  EXPECT_EQ(manager_->ListAttachments().size(), 2u);
  EXPECT_EQ(pool_->attachments(), 2u);
  // The owner, also among other sessions of its own, still acts.
  const Caller several{{theirs_, mine_}, std::nullopt};
  EXPECT_TRUE(manager_->FindTicket(owner, (*ticket)->id()).ok());
  EXPECT_TRUE(manager_->FindTicket(several, (*ticket)->id()).ok());
  EXPECT_TRUE(manager_->Submit(several, in_session_, Direction::kLoad, {0}, {8}).ok());
  EXPECT_TRUE(manager_->Detach(owner, in_session_).ok());
  EXPECT_EQ(pool_->attachments(), 1u);
  // The ticket is still its session's after the attachment went.
  EXPECT_TRUE(manager_->FindTicket(owner, (*ticket)->id()).ok());
  EXPECT_EQ(manager_->FindTicket({}, (*ticket)->id()).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(OwnershipTest, AnAttachmentWithoutSessionServesWhoeverHoldsItsId) {
  for (const Caller& anyone : Strangers()) {
    absl::StatusOr<std::shared_ptr<Ticket>> t =
        manager_->Submit(anyone, att_, Direction::kBackup, {0}, {0});
    ASSERT_TRUE(t.ok()) << t.status();
    EXPECT_TRUE(manager_->FindTicket(anyone, (*t)->id()).ok());
    ASSERT_TRUE((*t)->WaitUntil(absl::Now() + absl::Seconds(30)));
  }
  EXPECT_TRUE(manager_->Detach(Caller{{theirs_}, std::nullopt}, att_).ok());
}

TEST_F(OwnershipTest, TheOwnerTokenOfAProtectedPoolOpensItsSessionsAttachments) {
  absl::StatusOr<std::shared_ptr<Pool>> owned = registry_->Create("owned", spec_, {}, "tok");
  ASSERT_TRUE(owned.ok()) << owned.status();
  const std::string kOwnedToken = "tok";
  ASSERT_TRUE((*owned)->AllocPages(4).ok());
  AttachRequest req = dev_.Request(pool_->layout().planes);
  req.session_id = mine_;
  absl::StatusOr<AttachmentInfo> att =
      AttachByName(*manager_, *registry_, "owned", req, &kOwnedToken);
  ASSERT_TRUE(att.ok()) << att.status();
  const Caller holder{{}, std::string("tok")};
  const Caller wrong{{theirs_}, std::string("tok2")};
  absl::StatusOr<std::shared_ptr<Ticket>> t =
      manager_->Submit(holder, att->id, Direction::kBackup, {0, 1}, {0, 1});
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_TRUE(manager_->FindTicket(holder, (*t)->id()).ok());
  EXPECT_EQ(manager_->FindTicket(wrong, (*t)->id()).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(manager_->Submit(wrong, att->id, Direction::kLoad, {0}, {0}).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(manager_->Detach(wrong, att->id).code(), absl::StatusCode::kNotFound);
  // The token of "owned" opens nothing of the unprotected pool's session.
  EXPECT_EQ(manager_->Submit(holder, in_session_, Direction::kLoad, {0}, {0}).status().code(),
            absl::StatusCode::kNotFound);
  ASSERT_TRUE((*t)->WaitUntil(absl::Now() + absl::Seconds(30)));
  EXPECT_TRUE(manager_->Detach(holder, att->id).ok());
  EXPECT_EQ((*owned)->attachments(), 0u);
}

// Regression test: ticket ids restarted at 1, so an old client's WaitTransfer
// found another client's ticket after a restart.
TEST_F(OwnershipTest, TicketIdsAreRandomAndNameNothingInAnotherInstance) {
  std::vector<uint64_t> ids;
  for (int i = 0; i < 500; ++i) {
    absl::StatusOr<std::shared_ptr<Ticket>> t =
        manager_->Submit({}, att_, Direction::kBackup, {}, {});
    ASSERT_TRUE(t.ok()) << t.status();
    ids.push_back((*t)->id());
  }
  uint64_t high = 0;
  size_t sequential = 0;
  for (size_t i = 0; i < ids.size(); ++i) {
    EXPECT_NE(ids[i], 0u);
    high |= ids[i] >> 48;
    if (i > 0 && ids[i] == ids[i - 1] + 1) ++sequential;
  }
  EXPECT_EQ(sequential, 0u);
  EXPECT_NE(high, 0u);  // the top bits are used, not a counter's
  std::vector<uint64_t> sorted = ids;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(std::unique(sorted.begin(), sorted.end()), sorted.end());
  // A new manager (a restarted daemon) on the same pools knows none of them
  // and hands out other ids.
  TransferManager restarted(std::make_unique<HostEngine>(Options()));
  absl::StatusOr<AttachmentInfo> att =
      AttachByName(restarted, *registry_, "llama", dev_.Request(pool_->layout().planes));
  ASSERT_TRUE(att.ok()) << att.status();
  for (int i = 0; i < 500; ++i)
    ASSERT_TRUE(restarted.Submit({}, att->id, Direction::kLoad, {}, {}).ok());
  for (uint64_t id : ids) {
    EXPECT_EQ(restarted.FindTicket({}, id).status().code(), absl::StatusCode::kNotFound) << id;
  }
  for (uint64_t id = 1; id <= 500; ++id) {
    EXPECT_EQ(restarted.FindTicket({}, id).status().code(), absl::StatusCode::kNotFound) << id;
  }
}

// The offset of row `row` (a token slot, or a page of a page-row
// component), layer `layer`, head `head` in a one-plane component of shape
// `c`, from the seeds' C-contiguous tensor shapes (tests/seed_offsets.h),
// apart from KvLayout::Offset.
uint64_t SeedOffset(const KvLayout& c, uint64_t row, uint64_t layer, uint64_t head) {
  testing::SeedBuffer b;
  b.layout = testing::SeedLayoutNamed(c.kind);
  // A PAGE_UNIFIED component is plane 0 of the buffer whose planes
  // interleave (its region offset places the others).
  if (c.kind == LayoutKind::kPageUnified) b.planes = c.interleaved_planes, b.groups = c.head_groups;
  b.layers = c.layers;
  b.rows = c.tokens;
  b.page_size = c.page_size;
  b.heads = c.heads;
  b.dim = c.head_bytes;
  return testing::SeedOffset(b, /*kv=*/0, row, layer, head);
}

PoolSpec BaseSpec(PoolKind kind, LayoutKind layout, uint32_t ps, uint32_t layers,
                  uint64_t size_tokens, DType dtype = DType::kBf16) {
  PoolSpec s;
  s.kind = kind;
  s.layout = layout;
  s.dtype = dtype;
  s.page_size = ps;
  s.layer_num = layers;
  s.size_tokens = size_tokens;
  return s;
}
PoolSpec MhaSpec(LayoutKind layout, uint32_t ps = 3) {
  PoolSpec s = BaseSpec(PoolKind::kMha, layout, ps, 3, 12 * ps);
  s.head_num = 2;
  s.head_dim = 5;
  return s;
}
PoolSpec MlaSpec(LayoutKind layout, uint32_t ps = 5) {
  PoolSpec s = BaseSpec(PoolKind::kMla, layout, ps, 2, 10 * ps);
  s.kv_lora_rank = 7;
  s.qk_rope_head_dim = 2;
  return s;
}
PoolSpec V4PagedSpec(LayoutKind layout, uint32_t ps = 3) {
  PoolSpec s = BaseSpec(PoolKind::kV4Paged, layout, ps, 3, 12 * ps, DType::kUint8);
  s.item_bytes = 13;
  return s;
}
PoolSpec LogicalSpec(uint32_t ps = 3) {
  return BaseSpec(PoolKind::kLogical, LayoutKind::kLayerFirst, ps, 0, 12 * ps, DType::kUint8);
}
// A follower of the pool named "anchor": its size and page size are the
// anchor's.
PoolSpec FollowerSpec(PoolSpec s) {
  s.follows = "anchor";
  s.size_tokens = 0;
  s.page_size = 0;
  return s;
}

struct KindCase {
  std::string name;
  PoolSpec spec;  // follows "anchor" when anchor is set
  std::optional<PoolSpec> anchor;
  uint32_t att_start = 0, att_end = 0;  // the attachment's device layers (0 / 0: the pool's)
};

void PrintTo(const KindCase& c, std::ostream* os) { *os << c.name; }

std::vector<KindCase> KindCases() {
  const LayoutKind kAll[] = {LayoutKind::kLayerFirst, LayoutKind::kPageFirst,
                             LayoutKind::kPageFirstDirect, LayoutKind::kPageHead,
                             LayoutKind::kPageUnified};
  const LayoutKind kThree[] = {LayoutKind::kLayerFirst, LayoutKind::kPageFirst,
                               LayoutKind::kPageFirstDirect};
  // MLA and K_ONLY take PAGE_UNIFIED too.
  const LayoutKind kFour[] = {LayoutKind::kLayerFirst, LayoutKind::kPageFirst,
                              LayoutKind::kPageFirstDirect, LayoutKind::kPageUnified};
  const LayoutKind kPageMajor[] = {LayoutKind::kPageFirst, LayoutKind::kPageFirstDirect};
  auto name = [](const char* kind, LayoutKind l) { return absl::StrCat(kind, "_", LayoutName(l)); };
  std::vector<KindCase> out;
  for (LayoutKind l : kAll) out.push_back({name("MHA", l), MhaSpec(l), std::nullopt});
  for (LayoutKind l : kFour) out.push_back({name("MLA", l), MlaSpec(l), std::nullopt});
  for (LayoutKind l : kPageMajor) {
    PoolSpec s = BaseSpec(PoolKind::kMhaAsymmetric, l, 3, 3, 36);
    s.head_num = 2;
    s.head_dim = 5;
    s.v_head_dim = 3;
    out.push_back({name("MHA_ASYMMETRIC", l), s, std::nullopt});
  }
  for (LayoutKind l : kFour) {
    PoolSpec s = BaseSpec(PoolKind::kKOnly, l, 3, 2, 0, DType::kFp16);
    s.head_num = 3;
    s.head_dim = 3;
    out.push_back({name("K_ONLY", l), FollowerSpec(s), MhaSpec(LayoutKind::kPageFirst)});
  }
  {
    // PAGE_UNIFIED in head groups: a group per head (split rows), and a K_ONLY
    // follower of a PAGE_UNIFIED MHA pool.
    PoolSpec s = MhaSpec(LayoutKind::kPageUnified);
    s.head_groups = 2;
    out.push_back({"MHA_PAGE_UNIFIED_groups2", s, std::nullopt});
    PoolSpec k = BaseSpec(PoolKind::kKOnly, LayoutKind::kPageUnified, 3, 2, 0, DType::kFp16);
    k.head_num = 3;
    k.head_dim = 3;
    k.head_groups = 3;
    out.push_back({"K_ONLY_PAGE_UNIFIED_groups3", FollowerSpec(k), s});
  }
  {
    PoolSpec s = BaseSpec(PoolKind::kDsa, LayoutKind::kLayerFirst, 3, 3, 36);
    s.kv_lora_rank = 7;
    s.qk_rope_head_dim = 2;
    s.index_head_dim = 16;
    s.index_quant_block_size = 8;
    out.push_back({"DSA_LAYER_FIRST", s, std::nullopt});
    s.index_head_dim = 0;
    s.index_quant_block_size = 0;
    s.index_row_bytes = 21;
    out.push_back({"DSA_LAYER_FIRST_index_row_bytes", s, std::nullopt});
  }
  for (LayoutKind l : kThree) {
    PoolSpec s = BaseSpec(PoolKind::kDsaIndexer, l, 0, 2, 0, DType::kUint8);
    s.index_head_dim = 16;
    s.index_quant_block_size = 8;
    out.push_back({name("DSA_INDEXER", l), FollowerSpec(s), MlaSpec(LayoutKind::kLayerFirst, 3)});
  }
  {
    PoolSpec s = BaseSpec(PoolKind::kMamba, LayoutKind::kPageFirstDirect, 1, 2, 20);
    s.mamba.temporal = {2, 3};
    s.mamba.temporal_dtype = DType::kFp32;
    s.mamba.conv = {{5}, {2, 3}};  // 5 bf16: an odd row of 10 bytes
    out.push_back({"MAMBA_PAGE_FIRST_DIRECT", s, std::nullopt});
  }
  for (LayoutKind l : kThree) out.push_back({name("V4_PAGED", l), V4PagedSpec(l), std::nullopt});
  for (LayoutKind l : kThree) {
    PoolSpec s = BaseSpec(PoolKind::kV4State, l, 0, 2, 0, DType::kUint8);
    s.ring_size = 3;
    s.state_slot_bytes = 5;
    out.push_back({name("V4_STATE", l), FollowerSpec(s), V4PagedSpec(LayoutKind::kPageFirst)});
    if (l == LayoutKind::kLayerFirst) {
      out.push_back({"V4_STATE_LAYER_FIRST_follows_LOGICAL", FollowerSpec(s), LogicalSpec()});
    }
  }
  // Sharded pools (device layers [2, 5)) attached over device layers [1, 6):
  // layers 1 and 5 copy nothing.
  {
    PoolSpec s = MhaSpec(LayoutKind::kPageFirstDirect);
    s.start_layer = 2;
    out.push_back({"MHA_PAGE_FIRST_DIRECT_sharded", s, std::nullopt, 1, 6});
    s = V4PagedSpec(LayoutKind::kLayerFirst);
    s.start_layer = 2;
    out.push_back({"V4_PAGED_LAYER_FIRST_sharded", s, std::nullopt, 1, 6});
    s = MlaSpec(LayoutKind::kPageFirst);
    s.start_layer = 2;
    s.layer_num = 3;
    out.push_back({"MLA_PAGE_FIRST_sharded_tail", s, std::nullopt, 4, 6});
    s = MhaSpec(LayoutKind::kPageUnified);
    s.start_layer = 2;
    out.push_back({"MHA_PAGE_UNIFIED_sharded", s, std::nullopt, 1, 6});
  }
  return out;
}

// An emulated device pool for any kind: per component and attached layer,
// rows(c) rows of the component's row bytes, all in one shared-memory file.
class DevicePool {
 public:
  static std::unique_ptr<DevicePool> Create(const std::string& path, const Pool& pool,
                                            uint64_t device_tokens, uint32_t layers) {
    auto d = std::unique_ptr<DevicePool>(new DevicePool);
    d->layers_ = layers;
    d->device_tokens_ = device_tokens;
    uint64_t offset = 48;  // layer buffers need not start at the file's start
    for (const Component& c : pool.components()) {
      d->rows_.push_back(device_tokens / c.row_tokens);
      d->row_bytes_.push_back(c.row_bytes());
      d->names_.push_back(c.name);
      d->offsets_.emplace_back();
      for (uint32_t l = 0; l < layers; ++l) {
        d->offsets_.back().push_back(offset);
        offset += d->rows_.back() * c.row_bytes() + 8;  // a gap the copies must not touch
      }
    }
    absl::StatusOr<std::unique_ptr<ShmRegion>> r = ShmRegion::Create(path, offset);
    if (!r.ok()) return nullptr;
    d->region_ = *std::move(r);
    return d;
  }
  // Every component by name.
  AttachRequest Request(uint32_t start = 0, uint32_t end = 0) const {
    AttachRequest req;
    req.device_size_tokens = device_tokens_;
    req.start_layer = start;
    req.end_layer = end;
    for (size_t c = 0; c < names_.size(); ++c) req.named.push_back(Buffers(c));
    return req;
  }
  ComponentBuffers Buffers(size_t c) const {
    ComponentBuffers b;
    b.name = names_[c];
    for (uint64_t off : offsets_[c]) {
      b.layers.push_back({DeviceBufferRef::Kind::kShm, region_->path(), "", "", off});
    }
    return b;
  }
  uint8_t* Row(size_t c, uint32_t layer, uint64_t row) const {
    return region_->data() + offsets_[c][layer] + row * row_bytes_[c];
  }
  uint8_t* data() const { return region_->data(); }
  uint64_t size() const { return region_->size(); }
  uint64_t offset(size_t c, uint32_t layer) const { return offsets_[c][layer]; }

 private:
  DevicePool() = default;
  std::unique_ptr<ShmRegion> region_;
  uint32_t layers_ = 0;
  uint64_t device_tokens_ = 0;
  std::vector<uint64_t> rows_, row_bytes_;
  std::vector<std::string> names_;
  std::vector<std::vector<uint64_t>> offsets_;  // [component][attached layer]
};

// A registry and a manager on the host engine, in a private directory.
class KindFixture {
 public:
  KindFixture() {
    registry_ = std::make_unique<PoolRegistry>(RoomyRegistryOptions(dir_.path()));
    HostEngineOptions e;
    e.shm_dir = dir_.path();
    e.helper_threads = 2;
    e.min_split_bytes = 64;  // split layers over threads, cutting inside runs
    manager_ = std::make_unique<TransferManager>(std::make_unique<HostEngine>(e));
  }
  ~KindFixture() {
    manager_.reset();
    registry_.reset();
  }
  absl::StatusOr<std::shared_ptr<Pool>> Create(const KindCase& c) {
    if (c.anchor.has_value()) {
      absl::StatusOr<std::shared_ptr<Pool>> anchor = registry_->Create("anchor", *c.anchor);
      if (!anchor.ok()) return anchor.status();
    }
    return registry_->Create("p", c.spec);
  }
  // Runs a transfer to the end; its final status.
  TicketStatus Run(const std::string& att, Direction d, const std::vector<int64_t>& host,
                   const std::vector<int64_t>& device) {
    absl::StatusOr<std::shared_ptr<Ticket>> t = manager_->Submit({}, att, d, host, device);
    EXPECT_TRUE(t.ok()) << t.status();
    if (!t.ok()) return TicketStatus{};
    EXPECT_TRUE((*t)->WaitUntil(absl::Now() + absl::Seconds(30)));
    return (*t)->Snapshot();
  }
  void ExpectNoTickets() {
    const TransferCounters c = manager_->counters();
    EXPECT_EQ(c.tickets_in_flight + c.tickets_done + c.tickets_failed, 0u);
    EXPECT_EQ(manager_->FindTicket({}, 1).status().code(), absl::StatusCode::kNotFound);
  }

  ShmDir dir_;
  std::unique_ptr<PoolRegistry> registry_;
  std::unique_ptr<TransferManager> manager_;
};

// Host bytes of every region, for before / after comparisons.
std::vector<std::vector<uint8_t>> HostBytes(const Pool& pool) {
  std::vector<std::vector<uint8_t>> out;
  for (size_t r = 0; r < pool.region_count(); ++r) {
    const uint8_t* base = pool.region_base(r);
    out.emplace_back(base, base + pool.region_bytes(r));
  }
  return out;
}

// Slot pairs for a transfer of `pages` whole pages (shuffled, so runs form
// and break), or of `tokens` single slots.
std::pair<std::vector<int64_t>, std::vector<int64_t>> PickPairs(std::mt19937_64& rng,
                                                                bool whole_pages, uint64_t ps,
                                                                uint64_t host_tokens,
                                                                uint64_t device_tokens,
                                                                uint64_t n) {
  if (!whole_pages) return RandomPairs(rng, host_tokens, device_tokens, n);
  auto pages = [&rng](uint64_t count) {
    std::vector<int64_t> p(count);
    for (uint64_t i = 0; i < count; ++i) p[i] = static_cast<int64_t>(i);
    std::shuffle(p.begin(), p.end(), rng);
    return p;
  };
  std::vector<int64_t> hp = pages(host_tokens / ps), dp = pages(device_tokens / ps);
  const uint64_t np = std::min<uint64_t>({n / ps, hp.size(), dp.size()});
  std::vector<int64_t> host, device;
  for (uint64_t k = 0; k < np; ++k) {
    for (uint64_t j = 0; j < ps; ++j) {
      host.push_back(hp[k] * static_cast<int64_t>(ps) + static_cast<int64_t>(j));
      device.push_back(dp[k] * static_cast<int64_t>(ps) + static_cast<int64_t>(j));
    }
  }
  return {host, device};
}

// The reference copy of one transfer: one head of one row of one layer at a
// time, at SeedOffset on the host and row x row_bytes + head x head_bytes on
// the device; a page-row component moves the page row of each page once.
// `host` holds each region's bytes; `device(c, attached layer)` a layer
// buffer's base; `host_layer(a)` the host layer of attached layer a or -1.
template <typename DeviceFn, typename LayerFn>
void SeedCopy(const Pool& pool, std::vector<std::vector<uint8_t>>& host, DeviceFn&& device,
              uint32_t attached, LayerFn&& host_layer, const std::vector<int64_t>& host_idx,
              const std::vector<int64_t>& dev_idx, bool backup) {
  for (size_t c = 0; c < pool.components().size(); ++c) {
    const Component& comp = pool.components()[c];
    const KvLayout& shape = comp.layout;
    for (uint32_t a = 0; a < attached; ++a) {
      const int64_t l = host_layer(a);
      if (l < 0) continue;
      for (size_t i = 0; i < host_idx.size(); ++i) {
        if (static_cast<uint64_t>(host_idx[i]) % comp.row_tokens != 0) continue;
        const uint64_t hrow = static_cast<uint64_t>(host_idx[i]) / comp.row_tokens;
        const uint64_t drow = static_cast<uint64_t>(dev_idx[i]) / comp.row_tokens;
        for (uint64_t h = 0; h < shape.heads; ++h) {
          uint8_t* hp = host[comp.region].data() + comp.region_offset +
                        SeedOffset(shape, hrow, static_cast<uint64_t>(l), h);
          uint8_t* dp = device(c, a) + drow * shape.heads * shape.head_bytes + h * shape.head_bytes;
          if (backup) {
            std::memcpy(hp, dp, shape.head_bytes);
          } else {
            std::memcpy(dp, hp, shape.head_bytes);
          }
        }
      }
    }
  }
}

class KindTransferTest : public ::testing::TestWithParam<KindCase> {};

TEST_P(KindTransferTest, BackupThenLoadIsByteExact) {
  const KindCase& kc = GetParam();
  KindFixture f;
  ASSERT_FALSE(f.dir_.path().empty());
  absl::StatusOr<std::shared_ptr<Pool>> created = f.Create(kc);
  ASSERT_TRUE(created.ok()) << created.status();
  Pool& pool = **created;
  ASSERT_FALSE(pool.components().empty());
  const PoolSpec& spec = pool.spec();
  const uint64_t ps = pool.allocator_owner()->allocator().page_size();
  const uint64_t S = pool.size_tokens();
  const bool whole_pages = MovesWholePages(spec.kind);
  const uint32_t att_start = kc.att_end == 0 ? spec.start_layer : kc.att_start;
  const uint32_t att_end = kc.att_end == 0 ? spec.start_layer + spec.layer_num : kc.att_end;
  const uint32_t attached = att_end - att_start;
  auto host_layer = [&](uint32_t a) -> int64_t {
    const uint32_t d = att_start + a;
    return d >= spec.start_layer && d < spec.start_layer + spec.layer_num
               ? static_cast<int64_t>(d - spec.start_layer)
               : -1;
  };
  uint32_t held = 0;
  for (uint32_t a = 0; a < attached; ++a) held += host_layer(a) >= 0 ? 1 : 0;

  // A device pool of more pages than half the host's, not a multiple of it.
  const uint64_t device_tokens = (S / ps / 2 + 3) * ps;
  std::unique_ptr<DevicePool> dev =
      DevicePool::Create(f.dir_.path() + "/device", pool, device_tokens, attached);
  ASSERT_NE(dev, nullptr);
  absl::StatusOr<AttachmentInfo> att =
      AttachByName(*f.manager_, *f.registry_, "p", dev->Request(kc.att_start, kc.att_end));
  ASSERT_TRUE(att.ok()) << att.status();
  EXPECT_EQ(att->start_layer, att_start);
  EXPECT_EQ(att->end_layer, att_end);
  // Every slot allocated, in the pool that owns the page space.
  ASSERT_TRUE(pool.allocator_owner()->AllocPages(S).ok());

  std::mt19937_64 rng(std::hash<std::string>()(kc.name));
  for (int round = 0; round < 3; ++round) {
    // Random non-zero bytes everywhere, host and device.
    std::vector<std::vector<uint8_t>> h0;
    for (size_t r = 0; r < pool.region_count(); ++r) {
      std::vector<uint8_t> bytes = RandomBytes(rng, pool.region_bytes(r));
      for (uint8_t& b : bytes) b |= 1;
      std::memcpy(pool.region_base(r), bytes.data(), bytes.size());
      h0.push_back(std::move(bytes));
    }
    std::vector<uint8_t> d0 = RandomBytes(rng, dev->size());
    for (uint8_t& b : d0) b |= 1;
    std::memcpy(dev->data(), d0.data(), d0.size());

    auto [host_idx, src] = PickPairs(rng, whole_pages, ps, S, device_tokens, S / 2 + 1);
    ASSERT_FALSE(host_idx.empty());
    const uint64_t tokens = host_idx.size();
    // Bytes of one held layer, from the seeds' page size: a page of all
    // layers is BytesPerPage.
    const uint64_t want_bytes = tokens * BytesPerPage(spec) / ps / spec.layer_num * held;

    // Backup: device rows src -> host slots host_idx.
    std::vector<std::vector<uint8_t>> h1 = h0;
    SeedCopy(
        pool, h1, [&](size_t c, uint32_t a) { return d0.data() + dev->offset(c, a); }, attached,
        host_layer, host_idx, src, /*backup=*/true);
    TicketStatus st = f.Run(att->id, Direction::kBackup, host_idx, src);
    EXPECT_TRUE(st.status.ok()) << st.status;
    EXPECT_EQ(st.layer_num, attached);
    EXPECT_EQ(st.layers_done, attached);
    EXPECT_EQ(st.bytes, want_bytes);
    for (size_t r = 0; r < pool.region_count(); ++r) {
      ASSERT_TRUE(SameBytes(pool.region_base(r), h1[r].data(), h1[r].size()))
          << "backup round " << round << " region " << r;
    }
    ASSERT_TRUE(SameBytes(dev->data(), d0.data(), d0.size())) << "a backup wrote the device";

    // Load: host slots host_idx -> other device rows.
    auto [unused, dst] = PickPairs(rng, whole_pages, ps, S, device_tokens, tokens);
    dst.resize(std::min(dst.size(), host_idx.size()));
    std::vector<int64_t> load_host(host_idx.begin(), host_idx.begin() + dst.size());
    std::vector<uint8_t> d1 = d0;
    SeedCopy(
        pool, h1, [&](size_t c, uint32_t a) { return d1.data() + dev->offset(c, a); }, attached,
        host_layer, load_host, dst, /*backup=*/false);
    st = f.Run(att->id, Direction::kLoad, load_host, dst);
    EXPECT_TRUE(st.status.ok()) << st.status;
    EXPECT_EQ(st.layers_done, attached);
    ASSERT_TRUE(SameBytes(dev->data(), d1.data(), d1.size())) << "load round " << round;
    // The round trip, without any layout math: device row dst[i] of a held
    // layer now holds what row src[i] held, other layers are untouched.
    for (size_t c = 0; c < pool.components().size(); ++c) {
      const Component& comp = pool.components()[c];
      for (uint32_t a = 0; a < attached; ++a) {
        for (size_t i = 0; i < dst.size(); i += comp.row_tokens) {
          const uint64_t from = static_cast<uint64_t>(src[i]) / comp.row_tokens;
          const uint64_t to = static_cast<uint64_t>(dst[i]) / comp.row_tokens;
          const uint8_t* want = host_layer(a) >= 0
                                    ? d0.data() + dev->offset(c, a) + from * comp.row_bytes()
                                    : d0.data() + dev->offset(c, a) + to * comp.row_bytes();
          ASSERT_TRUE(SameBytes(dev->Row(c, a, to), want, comp.row_bytes()))
              << comp.name << " attached layer " << a << " pair " << i;
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(EveryKind, KindTransferTest, ::testing::ValuesIn(KindCases()),
                         [](const ::testing::TestParamInfo<KindCase>& info) {
                           return info.param.name;
                         });

// A DSA_INDEXER following an MLA pool: page-row rows, whole pages only.
class PageRowTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_FALSE(f_.dir_.path().empty());
    PoolSpec s = BaseSpec(PoolKind::kDsaIndexer, LayoutKind::kPageFirst, 0, 2, 0, DType::kUint8);
    s.index_head_dim = 16;
    s.index_quant_block_size = 8;
    absl::StatusOr<std::shared_ptr<Pool>> p =
        f_.Create({"indexer", FollowerSpec(s), MlaSpec(LayoutKind::kLayerFirst, 4)});
    ASSERT_TRUE(p.ok()) << p.status();
    pool_ = *p;
    ASSERT_EQ(pool_->components().size(), 1u);
    ASSERT_EQ(pool_->components()[0].row_tokens, 4u);
    dev_ = DevicePool::Create(f_.dir_.path() + "/device", *pool_, kDeviceTokens, 2);
    ASSERT_NE(dev_, nullptr);
    std::mt19937_64 rng(3);
    std::vector<uint8_t> bytes = RandomBytes(rng, dev_->size());
    std::memcpy(dev_->data(), bytes.data(), bytes.size());
  }
  std::string DeviceBytes() const {
    return std::string(reinterpret_cast<const char*>(dev_->data()), dev_->size());
  }

  static constexpr uint64_t kDeviceTokens = 32;  // 8 device pages
  KindFixture f_;
  std::shared_ptr<Pool> pool_;
  std::unique_ptr<DevicePool> dev_;
};

TEST_F(PageRowTest, AttachErrorsTakeNoAttachment) {
  struct Bad {
    const char* what;
    std::function<void(AttachRequest&)> edit;
    const char* needle1;
    const char* needle2;
  } cases[] = {
      {"unknown component", [](AttachRequest& r) { r.named[0].name = "index"; }, "'index'",
       "index_k"},
      {"given twice", [this](AttachRequest& r) { r.named.push_back(dev_->Buffers(0)); },
       "given twice", "index_k"},
      {"too few layers", [](AttachRequest& r) { r.named[0].layers.pop_back(); }, "has 1 buffers",
       "needs 2"},
      {"missing component", [](AttachRequest& r) { r.named.clear(); }, "index_k", "needs 2"},
      {"k_layers on a kind without it",
       [](AttachRequest& r) {
         r.k_layers = r.named[0].layers;
         r.named.clear();
       },
       "k_layers", "DSA_INDEXER"},
      {"v_layers on a kind without it", [](AttachRequest& r) { r.v_layers = r.named[0].layers; },
       "v_layers", "needs 0"},
      {"partial device page", [](AttachRequest& r) { r.device_size_tokens = 30; }, "30",
       "multiple of 4"},
      {"no device slots", [](AttachRequest& r) { r.device_size_tokens = 0; }, "device_size_tokens",
       ">= 1"},
      {"empty layer range",
       [](AttachRequest& r) {
         r.start_layer = 3;
         r.end_layer = 3;
       },
       "start_layer 3", "end_layer 3"},
      {"more layers than buffers",
       [](AttachRequest& r) {
         r.start_layer = 0;
         r.end_layer = 3;
       },
       "has 2 buffers", "needs 3"},
  };
  for (const Bad& b : cases) {
    AttachRequest req = dev_->Request();
    b.edit(req);
    absl::StatusOr<AttachmentInfo> att = AttachByName(*f_.manager_, *f_.registry_, "p", req);
    EXPECT_EQ(att.status().code(), absl::StatusCode::kInvalidArgument)
        << b.what << ": " << att.status();
    EXPECT_THAT(Msg(att.status()), HasSubstr(b.needle1)) << b.what;
    EXPECT_THAT(Msg(att.status()), HasSubstr(b.needle2)) << b.what;
  }
  EXPECT_EQ(pool_->attachments(), 0u);
  EXPECT_TRUE(f_.manager_->ListAttachments().empty());
  EXPECT_TRUE(AttachByName(*f_.manager_, *f_.registry_, "p", dev_->Request()).ok());
  EXPECT_EQ(pool_->attachments(), 1u);
}

TEST_F(PageRowTest, PartialPagesAreRefusedAndChangeNothing) {
  absl::StatusOr<AttachmentInfo> att =
      AttachByName(*f_.manager_, *f_.registry_, "p", dev_->Request());
  ASSERT_TRUE(att.ok()) << att.status();
  // The follower has no allocator; pages 0..3 (slots 0..15) in the MLA pool.
  EXPECT_EQ(pool_->AllocPages(4).status().code(), absl::StatusCode::kFailedPrecondition);
  absl::StatusOr<std::shared_ptr<Pool>> anchor = f_.registry_->Get("anchor");
  ASSERT_TRUE(anchor.ok());
  ASSERT_TRUE((*anchor)->AllocPages(16).ok());
  const std::vector<std::vector<uint8_t>> host_before = HostBytes(*pool_);
  const std::string device_before = DeviceBytes();
  auto r = [](int64_t from, int64_t n) {
    std::vector<int64_t> v;
    for (int64_t i = 0; i < n; ++i) v.push_back(from + i);
    return v;
  };
  auto cat = [](std::vector<int64_t> a, const std::vector<int64_t>& b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
  };
  struct Bad {
    const char* what;
    Direction dir;
    std::vector<int64_t> host, device;
    absl::StatusCode code;
    const char* needle;
    bool names_kind = false;  // the whole-page errors name the pool's kind
  } cases[] = {
      {"host not a page start", Direction::kBackup, r(2, 4), r(0, 4),
       absl::StatusCode::kInvalidArgument, "host_indices[0] = 2 does not start a page", true},
      {"device not a page start", Direction::kLoad, r(0, 4), r(5, 4),
       absl::StatusCode::kInvalidArgument, "device_indices[0] = 5 does not start a page", true},
      {"part of a page", Direction::kBackup, r(0, 6), r(8, 6), absl::StatusCode::kInvalidArgument,
       "not a multiple of 4", true},
      {"page broken in the middle", Direction::kBackup, cat(r(4, 2), r(7, 2)), r(0, 4),
       absl::StatusCode::kInvalidArgument, "host_indices[2] = 7 breaks the page 4..7", true},
      {"second page broken on the device", Direction::kLoad, r(0, 8),
       cat(r(0, 4), {12, 13, 15, 14}), absl::StatusCode::kInvalidArgument, "device_indices[6] = 15",
       true},
      {"device page past the end", Direction::kLoad, r(0, 4), r(32, 4),
       absl::StatusCode::kInvalidArgument, "device_indices[0] = 32 out of range"},
      {"page twice", Direction::kBackup, cat(r(4, 4), r(4, 4)), r(0, 8),
       absl::StatusCode::kInvalidArgument, "host slot 4"},
      {"page not allocated in the followed pool", Direction::kBackup, r(16, 4), r(0, 4),
       absl::StatusCode::kFailedPrecondition, "anchor"},
  };
  for (const Bad& b : cases) {
    absl::StatusOr<std::shared_ptr<Ticket>> t =
        f_.manager_->Submit({}, att->id, b.dir, b.host, b.device);
    EXPECT_EQ(t.status().code(), b.code) << b.what << ": " << t.status();
    EXPECT_THAT(Msg(t.status()), HasSubstr(b.needle)) << b.what;
    if (b.names_kind) {
      EXPECT_THAT(Msg(t.status()), HasSubstr("DSA_INDEXER")) << b.what;
    }
  }
  f_.ExpectNoTickets();
  EXPECT_EQ(HostBytes(*pool_), host_before);
  EXPECT_EQ(DeviceBytes(), device_before);
  // Whole pages in any order go through: pages 3, 1 -> device pages 7, 0.
  const TicketStatus st =
      f_.Run(att->id, Direction::kBackup, cat(r(12, 4), r(4, 4)), cat(r(28, 4), r(0, 4)));
  EXPECT_TRUE(st.status.ok()) << st.status;
  const Component& c = pool_->components()[0];
  EXPECT_EQ(st.bytes, 2 * c.row_bytes() * 2);  // 2 pages x 2 layers
  for (uint32_t l = 0; l < 2; ++l) {
    EXPECT_TRUE(SameBytes(pool_->component_base(0) + SeedOffset(c.layout, 3, l, 0),
                          dev_->Row(0, l, 7), c.row_bytes()));
    EXPECT_TRUE(SameBytes(pool_->component_base(0) + SeedOffset(c.layout, 1, l, 0),
                          dev_->Row(0, l, 0), c.row_bytes()));
  }
}

TEST(FollowerTest, KOnlyTransfersSlotsAllocatedInTheMhaPool) {
  KindFixture f;
  PoolSpec s = BaseSpec(PoolKind::kKOnly, LayoutKind::kPageFirst, 0, 2, 0);
  s.head_num = 1;
  s.head_dim = 4;
  absl::StatusOr<std::shared_ptr<Pool>> p =
      f.Create({"k_only", FollowerSpec(s), MhaSpec(LayoutKind::kLayerFirst)});
  ASSERT_TRUE(p.ok()) << p.status();
  std::shared_ptr<Pool> anchor = *f.registry_->Get("anchor");
  EXPECT_EQ((*p)->size_tokens(), anchor->size_tokens());
  std::unique_ptr<DevicePool> dev = DevicePool::Create(f.dir_.path() + "/device", **p, 9, 2);
  ASSERT_NE(dev, nullptr);
  // k_layers is K_ONLY's spelling too.
  AttachRequest req = dev->Request();
  req.k_layers = req.named[0].layers;
  req.named.clear();
  absl::StatusOr<AttachmentInfo> att = AttachByName(*f.manager_, *f.registry_, "p", req);
  ASSERT_TRUE(att.ok()) << att.status();
  EXPECT_EQ((*p)->AllocPages(3).status().code(), absl::StatusCode::kFailedPrecondition);
  absl::StatusOr<std::shared_ptr<Ticket>> t =
      f.manager_->Submit({}, att->id, Direction::kBackup, {4, 0}, {1, 2});
  EXPECT_EQ(t.status().code(), absl::StatusCode::kFailedPrecondition) << t.status();
  EXPECT_THAT(Msg(t.status()), HasSubstr("'anchor'"));
  f.ExpectNoTickets();
  ASSERT_TRUE(anchor->AllocPages(6).ok());  // slots 0..5
  std::memset(dev->Row(0, 1, 2), 0x5a, (*p)->components()[0].row_bytes());
  const TicketStatus st = f.Run(att->id, Direction::kBackup, {4, 0}, {1, 2});
  EXPECT_TRUE(st.status.ok()) << st.status;
  const Component& k = (*p)->components()[0];
  EXPECT_TRUE(SameBytes((*p)->component_base(0) + SeedOffset(k.layout, 0, 1, 0), dev->Row(0, 1, 2),
                        k.row_bytes()));
  EXPECT_EQ(dev->Row(0, 1, 2)[0], 0x5a);
}

TEST(TpRankTest, ReplicatedKindsShareOtherKindsRefuseASecondRank) {
  KindFixture f;
  absl::StatusOr<std::shared_ptr<Pool>> mla =
      f.registry_->Create("p", MlaSpec(LayoutKind::kPageFirst));
  ASSERT_TRUE(mla.ok()) << mla.status();
  absl::StatusOr<std::shared_ptr<Pool>> mha =
      f.registry_->Create("m", MhaSpec(LayoutKind::kPageFirst));
  ASSERT_TRUE(mha.ok()) << mha.status();
  std::unique_ptr<DevicePool> d0 = DevicePool::Create(f.dir_.path() + "/d0", **mla, 20, 2);
  std::unique_ptr<DevicePool> d1 = DevicePool::Create(f.dir_.path() + "/d1", **mla, 20, 2);
  std::unique_ptr<DevicePool> dm = DevicePool::Create(f.dir_.path() + "/dm", **mha, 9, 3);
  ASSERT_TRUE(d0 && d1 && dm);
  AttachRequest r0 = d0->Request();
  r0.tp_rank = 0;
  AttachRequest r1 = d1->Request();
  r1.tp_rank = 1;
  r1.load_only = true;
  absl::StatusOr<AttachmentInfo> a0 = AttachByName(*f.manager_, *f.registry_, "p", r0);
  absl::StatusOr<AttachmentInfo> a1 = AttachByName(*f.manager_, *f.registry_, "p", r1);
  ASSERT_TRUE(a0.ok()) << a0.status();
  ASSERT_TRUE(a1.ok()) << a1.status();
  EXPECT_EQ(a1->tp_rank, std::optional<uint32_t>(1));
  EXPECT_TRUE(a1->load_only);
  EXPECT_FALSE(a0->load_only);
  EXPECT_EQ((*mla)->replica_ranks(), 2u);
  ASSERT_TRUE((*mla)->AllocPages(10).ok());
  // Rank 1 only loads.
  absl::StatusOr<std::shared_ptr<Ticket>> refused =
      f.manager_->Submit({}, a1->id, Direction::kBackup, {0}, {0});
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_THAT(Msg(refused.status()), HasSubstr("load_only"));
  f.ExpectNoTickets();
  // Rank 0 backs up, rank 1 loads the same bytes.
  std::vector<int64_t> host = {7, 8, 9, 0, 1}, from = {3, 4, 5, 19, 0}, to = {10, 11, 12, 2, 6};
  std::mt19937_64 rng(11);
  std::vector<uint8_t> bytes = RandomBytes(rng, d0->size());
  std::memcpy(d0->data(), bytes.data(), bytes.size());
  EXPECT_TRUE(f.Run(a0->id, Direction::kBackup, host, from).status.ok());
  EXPECT_TRUE(f.Run(a1->id, Direction::kLoad, host, to).status.ok());
  const uint64_t row = (*mla)->components()[0].row_bytes();
  for (uint32_t l = 0; l < 2; ++l) {
    for (size_t i = 0; i < host.size(); ++i) {
      EXPECT_TRUE(SameBytes(d1->Row(0, l, static_cast<uint64_t>(to[i])),
                            d0->Row(0, l, static_cast<uint64_t>(from[i])), row))
          << "layer " << l << " pair " << i;
    }
  }
  // MHA holds one rank's heads.
  AttachRequest m0 = dm->Request();
  m0.tp_rank = 0;
  AttachRequest m1 = dm->Request();
  m1.tp_rank = 1;
  ASSERT_TRUE(AttachByName(*f.manager_, *f.registry_, "m", m0).ok());
  absl::StatusOr<AttachmentInfo> second = AttachByName(*f.manager_, *f.registry_, "m", m1);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition) << second.status();
  EXPECT_EQ((*mha)->attachments(), 1u);
  EXPECT_TRUE(
      AttachByName(*f.manager_, *f.registry_, "m", m0).ok());  // the same rank again is fine
  EXPECT_EQ((*mha)->attachments(), 2u);
}

TEST(LogicalTest, TakesNoBuffersAndFinishesWithNoBytes) {
  KindFixture f;
  absl::StatusOr<std::shared_ptr<Pool>> p = f.registry_->Create("p", LogicalSpec(4));
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_TRUE((*p)->components().empty());
  AttachRequest req;
  req.device_size_tokens = 16;
  req.k_layers.push_back({DeviceBufferRef::Kind::kShm, "x", "", "", 0});
  absl::StatusOr<AttachmentInfo> bad = AttachByName(*f.manager_, *f.registry_, "p", req);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << bad.status();
  EXPECT_THAT(Msg(bad.status()), HasSubstr("LOGICAL"));
  EXPECT_EQ((*p)->attachments(), 0u);
  req.k_layers.clear();
  absl::StatusOr<AttachmentInfo> att = AttachByName(*f.manager_, *f.registry_, "p", req);
  ASSERT_TRUE(att.ok()) << att.status();
  // Validated like any other: unallocated slots and bad ranges are refused.
  EXPECT_EQ(f.manager_->Submit({}, att->id, Direction::kBackup, {0}, {0}).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(f.manager_->Submit({}, att->id, Direction::kLoad, {0}, {16}).status().code(),
            absl::StatusCode::kInvalidArgument);
  f.ExpectNoTickets();
  ASSERT_TRUE((*p)->AllocPages(8).ok());
  const TicketStatus st = f.Run(att->id, Direction::kBackup, {0, 1, 2, 3}, {4, 5, 6, 7});
  EXPECT_TRUE(st.done);
  EXPECT_TRUE(st.status.ok()) << st.status;
  EXPECT_EQ(st.bytes, 0u);
  EXPECT_EQ(st.layer_num, 0u);
}

TEST(ComponentSpellingTest, KLayersAndNamedComponentsMix) {
  // DSA: k_layers is the latent, the index_k goes by name; MHA_ASYMMETRIC:
  // k_layers / v_layers are K and V. The same bytes move either way.
  KindFixture f;
  PoolSpec dsa = BaseSpec(PoolKind::kDsa, LayoutKind::kLayerFirst, 2, 2, 8);
  dsa.kv_lora_rank = 3;
  dsa.qk_rope_head_dim = 1;
  dsa.index_row_bytes = 5;
  absl::StatusOr<std::shared_ptr<Pool>> p = f.registry_->Create("p", dsa);
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_EQ((*p)->components().size(), 2u);
  std::unique_ptr<DevicePool> dev = DevicePool::Create(f.dir_.path() + "/device", **p, 4, 2);
  ASSERT_NE(dev, nullptr);
  AttachRequest req = dev->Request();
  req.k_layers = req.named[0].layers;
  req.named.erase(req.named.begin());
  ASSERT_TRUE(AttachByName(*f.manager_, *f.registry_, "p", req).ok());
  // Both spellings for the latent: refused, naming both.
  AttachRequest twice = dev->Request();
  twice.k_layers = twice.named[0].layers;
  absl::StatusOr<AttachmentInfo> bad = AttachByName(*f.manager_, *f.registry_, "p", twice);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Msg(bad.status()), HasSubstr("k_layers"));
  EXPECT_THAT(Msg(bad.status()), HasSubstr("components[0]"));
  // v_layers is not DSA's.
  AttachRequest v = req;
  v.v_layers = v.named[0].layers;
  v.named.clear();
  EXPECT_EQ(AttachByName(*f.manager_, *f.registry_, "p", v).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*p)->attachments(), 1u);
}

// ---------------------------------------------------------------------------
// Pool groups through the manager and the host engine: per model layer, every
// entry with rows copies the device layer its layer_map names.

// One entry of a group under test: its pool, an emulated device pool over
// its attached device layers [att_start, att_start + layers) and its layer
// map.
struct Member {
  std::string entry;
  std::shared_ptr<Pool> pool;
  std::unique_ptr<DevicePool> dev;
  uint32_t att_start = 0;
  uint32_t attached = 0;
  std::vector<int32_t> map;

  // Host layer of attached layer `a` when some model layer maps its device
  // layer, else -1: what a group transfer touches, written from the map.
  int64_t MappedHostLayer(uint32_t a) const {
    const int32_t d = static_cast<int32_t>(att_start + a);
    if (std::find(map.begin(), map.end(), d) == map.end()) return -1;
    return d - static_cast<int32_t>(pool->start_layer());
  }
  uint32_t mapped_layers() const {
    uint32_t n = 0;
    for (int32_t d : map) n += d >= 0 ? 1 : 0;
    return n;
  }
  std::vector<uint8_t> DeviceBytes() const {
    return std::vector<uint8_t>(dev->data(), dev->data() + dev->size());
  }
  // The host and device images after moving rows host[i] <-> device[i] of
  // the mapped layers, from `host0` / `device0`.
  void Expect(bool backup, const std::vector<int64_t>& host, const std::vector<int64_t>& device,
              std::vector<std::vector<uint8_t>>* host0, std::vector<uint8_t>* device0) const {
    SeedCopy(
        *pool, *host0, [&](size_t c, uint32_t a) { return device0->data() + dev->offset(c, a); },
        attached, [this](uint32_t a) { return MappedHostLayer(a); }, host, device, backup);
  }
};

// Allocates `tokens` slots of `pool` (whole pages); the slots, page by page.
std::vector<int64_t> AllocSlots(Pool& pool, uint64_t tokens) {
  absl::StatusOr<std::vector<uint64_t>> pages = pool.AllocPages(tokens);
  EXPECT_TRUE(pages.ok()) << pages.status();
  if (!pages.ok()) return {};
  const uint64_t ps = pool.allocator().page_size();
  std::vector<int64_t> slots;
  for (uint64_t page : *pages) {
    for (uint64_t j = 0; j < ps; ++j) slots.push_back(static_cast<int64_t>(page * ps + j));
  }
  return slots;
}

class GroupTest : public ::testing::Test {
 protected:
  // attn: MHA PAGE_FIRST holding device layers [1, 4), ps 3, rows of
  // 2 heads x 5 x bf16 = 20 bytes for K and for V. ssm: MAMBA with a
  // temporal state of 2 x 3 fp32 (24 bytes) and conv states of 5 and 2 x 3
  // bf16 (10 and 12 bytes), 2 layers. The group has 4 model layers:
  // kv = [3, -1, 1, -1] (attn's device layer 2 unmapped), ssm = [-1, 1, -1, 0].
  static constexpr uint64_t kKvTokenBytes = 2 * 2 * 5 * 2;
  static constexpr uint64_t kSsmTokenBytes = 2 * 3 * 4 + 5 * 2 + 2 * 3 * 2;

  void SetUp() override {
    ASSERT_FALSE(f_.dir_.path().empty());
    PoolSpec attn = BaseSpec(PoolKind::kMha, LayoutKind::kPageFirst, 3, 3, 36);
    attn.head_num = 2;
    attn.head_dim = 5;
    attn.start_layer = 1;
    PoolSpec ssm = BaseSpec(PoolKind::kMamba, LayoutKind::kPageFirstDirect, 1, 2, 20);
    ssm.mamba.temporal = {2, 3};
    ssm.mamba.temporal_dtype = DType::kFp32;
    ssm.mamba.conv = {{5}, {2, 3}};
    absl::StatusOr<std::shared_ptr<Pool>> a = f_.registry_->Create("attn", attn);
    absl::StatusOr<std::shared_ptr<Pool>> m = f_.registry_->Create("ssm", ssm);
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(m.ok()) << m.status();
    kv_ = Make("kv", *a, 12, 1, 3, {3, -1, 1, -1});
    ssm_ = Make("ssm", *m, 8, 0, 2, {-1, 1, -1, 0});
    ASSERT_NE(kv_.dev, nullptr);
    ASSERT_NE(ssm_.dev, nullptr);
    absl::StatusOr<std::shared_ptr<PoolGroup>> g = f_.registry_->CreateGroup(
        "hybrid", 4, {{"kv", "attn", kv_.map, true}, {"ssm", "ssm", ssm_.map, false}});
    ASSERT_TRUE(g.ok()) << g.status();
    group_ = *g;
    std::mt19937_64 rng(17);
    Scramble(rng);
  }

  Member Make(const std::string& entry, std::shared_ptr<Pool> pool, uint64_t device_tokens,
              uint32_t att_start, uint32_t attached, std::vector<int32_t> map) {
    Member m;
    m.entry = entry;
    m.dev = DevicePool::Create(absl::StrCat(f_.dir_.path(), "/device-", entry, "-", ++devices_),
                               *pool, device_tokens, attached);
    m.pool = std::move(pool);
    m.att_start = att_start;
    m.attached = attached;
    m.map = std::move(map);
    return m;
  }
  // Random non-zero bytes in every host pool and device pool.
  void Scramble(std::mt19937_64& rng) {
    for (Member* m : {&kv_, &ssm_}) {
      for (size_t c = 0; c < m->pool->components().size(); ++c) {
        std::vector<uint8_t> bytes = RandomBytes(rng, m->pool->components()[c].bytes());
        for (uint8_t& b : bytes) b |= 1;
        std::memcpy(m->pool->component_base(c), bytes.data(), bytes.size());
      }
      std::vector<uint8_t> d = RandomBytes(rng, m->dev->size());
      for (uint8_t& b : d) b |= 1;
      std::memcpy(m->dev->data(), d.data(), d.size());
    }
  }
  AttachRequest GroupRequest(const Member& kv, const Member& ssm) const {
    AttachRequest req;
    req.entries.push_back({kv.entry, kv.dev->Request()});
    req.entries.push_back({ssm.entry, ssm.dev->Request()});
    return req;
  }
  TicketStatus Run(const std::string& att, Direction d, const std::vector<int64_t>& host,
                   const std::vector<int64_t>& device, const std::vector<EntryRows>& others) {
    absl::StatusOr<std::shared_ptr<Ticket>> t =
        f_.manager_->Submit({}, att, d, host, device, "", others);
    EXPECT_TRUE(t.ok()) << t.status();
    if (!t.ok()) return TicketStatus{};
    EXPECT_TRUE((*t)->WaitUntil(absl::Now() + absl::Seconds(30)));
    return (*t)->Snapshot();
  }
  std::vector<int64_t> Alloc(Pool& pool, uint64_t tokens) { return AllocSlots(pool, tokens); }

  KindFixture f_;
  int devices_ = 0;
  Member kv_, ssm_;
  std::shared_ptr<PoolGroup> group_;
};

TEST_F(GroupTest, LayerProgressCountsModelLayers) {
  AttachRequest request = GroupRequest(kv_, ssm_);
  request.layer_progress = true;
  request.load_event_sets = 3;
  absl::StatusOr<AttachmentInfo> att = AttachByName(*f_.manager_, *f_.registry_, "hybrid", request);
  ASSERT_TRUE(att.ok()) << att.status();
  EXPECT_TRUE(att->layer_progress);
  EXPECT_EQ(att->load_event_sets, 3u);
  absl::StatusOr<std::shared_ptr<LayerCounters>> counters =
      f_.manager_->FindLayerCounters({}, att->id);
  ASSERT_TRUE(counters.ok()) << counters.status();
  const std::vector<int64_t> kv_host = Alloc(*kv_.pool, 3);
  const std::vector<int64_t> ssm_host = Alloc(*ssm_.pool, 2);
  const std::vector<int64_t> ssm_rows = {4, 1};
  const std::vector<EntryRows> ssm = {{"ssm", ssm_host, ssm_rows}};
  for (int n = 0; n < 4; ++n) {
    absl::StatusOr<std::shared_ptr<Ticket>> t =
        f_.manager_->Submit({}, att->id, Direction::kLoad, kv_host, {0, 1, 2}, "", ssm);
    ASSERT_TRUE(t.ok()) << t.status();
    ASSERT_TRUE((*t)->WaitUntil(absl::Now() + absl::Seconds(30)));
    ASSERT_TRUE((*t)->Snapshot().status.ok()) << (*t)->Snapshot().status;
    ASSERT_GE((*t)->event_set(), 0);
    // Four model layers per load, on sets 0, 1, 2, then 0 again.
    EXPECT_EQ((*t)->event_set(), n % 3);
    EXPECT_EQ((*t)->layer_base(), n < 3 ? 0u : 4u);
    EXPECT_EQ((*counters)->Recorded(static_cast<uint32_t>((*t)->event_set())),
              (*t)->layer_base() + 4);
  }
  ASSERT_TRUE(f_.manager_->Detach({}, att->id).ok());
}

TEST_F(GroupTest, BackupThenLoadFollowTheLayerMaps) {
  absl::StatusOr<AttachmentInfo> att =
      AttachByName(*f_.manager_, *f_.registry_, "hybrid", GroupRequest(kv_, ssm_));
  ASSERT_TRUE(att.ok()) << att.status();
  EXPECT_EQ(att->group, "hybrid");
  EXPECT_EQ(att->pool, "attn");  // the anchor
  EXPECT_EQ(att->start_layer, 0u);
  EXPECT_EQ(att->end_layer, 4u);
  EXPECT_EQ(att->device_size_tokens, 12u);
  EXPECT_TRUE(att->load_event_handles.empty());
  EXPECT_EQ(group_->attachments(), 1u);
  EXPECT_EQ(kv_.pool->attachments(), 1u);
  EXPECT_EQ(ssm_.pool->attachments(), 1u);

  // Two attn pages (shuffled rows, runs that break) and three ssm slots.
  const std::vector<int64_t> kv_host = Alloc(*kv_.pool, 6);
  const std::vector<int64_t> ssm_host = Alloc(*ssm_.pool, 3);
  ASSERT_EQ(kv_host.size(), 6u);
  ASSERT_EQ(ssm_host.size(), 3u);
  const std::vector<int64_t> kv_dev = {7, 8, 2, 11, 0, 1};
  const std::vector<int64_t> ssm_dev = {5, 1, 6};
  const uint64_t want_bytes = kv_.mapped_layers() * kv_host.size() * kKvTokenBytes +
                              ssm_.mapped_layers() * ssm_host.size() * kSsmTokenBytes;

  // Backup: host rows of the mapped layers take the device rows; nothing
  // else changes (attn's device layer 2 is no model layer's).
  std::vector<std::vector<uint8_t>> kv_h = HostBytes(*kv_.pool), ssm_h = HostBytes(*ssm_.pool);
  std::vector<uint8_t> kv_d = kv_.DeviceBytes(), ssm_d = ssm_.DeviceBytes();
  kv_.Expect(true, kv_host, kv_dev, &kv_h, &kv_d);
  ssm_.Expect(true, ssm_host, ssm_dev, &ssm_h, &ssm_d);
  ASSERT_NE(kv_h, HostBytes(*kv_.pool));
  TicketStatus st = Run(att->id, Direction::kBackup, kv_host, kv_dev, {{"ssm", ssm_host, ssm_dev}});
  EXPECT_TRUE(st.done);
  EXPECT_TRUE(st.status.ok()) << st.status;
  EXPECT_EQ(st.layer_num, 4u);
  EXPECT_EQ(st.layers_done, 4u);
  EXPECT_EQ(st.bytes, want_bytes);
  EXPECT_TRUE(HostBytes(*kv_.pool) == kv_h) << "attn host bytes";
  EXPECT_TRUE(HostBytes(*ssm_.pool) == ssm_h) << "ssm host bytes";
  EXPECT_TRUE(kv_.DeviceBytes() == kv_d);
  EXPECT_TRUE(ssm_.DeviceBytes() == ssm_d);

  // Load the same host rows into other device rows (fresh device bytes).
  std::mt19937_64 rng(5);
  for (Member* m : {&kv_, &ssm_}) {
    std::vector<uint8_t> d = RandomBytes(rng, m->dev->size());
    std::memcpy(m->dev->data(), d.data(), d.size());
  }
  const std::vector<int64_t> kv_dev2 = {0, 1, 2, 9, 10, 11};
  const std::vector<int64_t> ssm_dev2 = {0, 7, 2};
  kv_d = kv_.DeviceBytes();
  ssm_d = ssm_.DeviceBytes();
  kv_.Expect(false, kv_host, kv_dev2, &kv_h, &kv_d);
  ssm_.Expect(false, ssm_host, ssm_dev2, &ssm_h, &ssm_d);
  ASSERT_NE(kv_d, kv_.DeviceBytes());
  st = Run(att->id, Direction::kLoad, kv_host, kv_dev2, {{"ssm", ssm_host, ssm_dev2}});
  EXPECT_TRUE(st.status.ok()) << st.status;
  EXPECT_EQ(st.layer_num, 4u);
  EXPECT_EQ(st.layers_done, 4u);
  EXPECT_EQ(st.bytes, want_bytes);
  EXPECT_TRUE(kv_.DeviceBytes() == kv_d) << "attn device bytes";
  EXPECT_TRUE(ssm_.DeviceBytes() == ssm_d) << "ssm device bytes";
  // The loaded rows of a mapped layer hold what the backup took from the
  // first device image; attn's attached layer 1 (device layer 2) kept its own.
  EXPECT_TRUE(HostBytes(*kv_.pool) == kv_h);

  // Only another entry's rows (the anchor's lists empty): its layers alone.
  st = Run(att->id, Direction::kBackup, {}, {}, {{"ssm", ssm_host, ssm_dev2}});
  EXPECT_TRUE(st.status.ok()) << st.status;
  EXPECT_EQ(st.layer_num, 4u);
  EXPECT_EQ(st.layers_done, 4u);
  EXPECT_EQ(st.bytes, ssm_.mapped_layers() * ssm_host.size() * kSsmTokenBytes);
  // No rows at all: a ticket of 4 layers and no bytes.
  st = Run(att->id, Direction::kLoad, {}, {}, {});
  EXPECT_TRUE(st.status.ok()) << st.status;
  EXPECT_EQ(st.layers_done, 4u);
  EXPECT_EQ(st.bytes, 0u);

  // Detach releases the group and both pools.
  EXPECT_EQ(f_.registry_->DeleteGroup("hybrid").code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(f_.manager_->Detach({}, att->id).ok());
  EXPECT_EQ(group_->attachments(), 0u);
  EXPECT_EQ(kv_.pool->attachments(), 0u);
  EXPECT_EQ(ssm_.pool->attachments(), 0u);
}

TEST_F(GroupTest, RefusedTransfersLeaveNoTicketAndChangeNothing) {
  absl::StatusOr<AttachmentInfo> att =
      AttachByName(*f_.manager_, *f_.registry_, "hybrid", GroupRequest(kv_, ssm_));
  ASSERT_TRUE(att.ok()) << att.status();
  const std::vector<int64_t> kv_host = Alloc(*kv_.pool, 3);
  const std::vector<int64_t> ssm_host = Alloc(*ssm_.pool, 2);
  ASSERT_EQ(ssm_host.size(), 2u);
  const std::vector<int64_t> kv_dev = {3, 4, 5};
  const std::vector<int64_t> ssm_dev = {1, 2};
  // The free ssm slot that is not allocated.
  int64_t free_slot = 0;
  while (std::find(ssm_host.begin(), ssm_host.end(), free_slot) != ssm_host.end()) ++free_slot;
  const std::vector<int64_t> one_ssm = {ssm_host[0]};
  struct Bad {
    const char* what;
    std::vector<EntryRows> others;
    absl::StatusCode code;
    const char* needle;
  };
  const std::vector<int64_t> bad_dev = {1, 8};  // ssm's device has 8 rows
  const std::vector<int64_t> bad_host = {ssm_host[0], free_slot};
  const std::vector<int64_t> neg = {-1, 2};
  const std::vector<int64_t> dup_dev = {2, 2};
  const Bad cases[] = {
      {"unknown entry",
       {{"mamba", ssm_host, ssm_dev}},
       absl::StatusCode::kInvalidArgument,
       "'mamba'"},
      {"the anchor", {{"kv", kv_host, kv_dev}}, absl::StatusCode::kInvalidArgument, "anchor"},
      {"a name twice",
       {{"ssm", ssm_host, ssm_dev}, {"ssm", ssm_host, ssm_dev}},
       absl::StatusCode::kInvalidArgument,
       "pool_transfers[1]"},
      {"device row out of range",
       {{"ssm", ssm_host, bad_dev}},
       absl::StatusCode::kInvalidArgument,
       "pool_transfers[0].device_indices[1] = 8"},
      {"negative host slot",
       {{"ssm", neg, ssm_dev}},
       absl::StatusCode::kInvalidArgument,
       "pool_transfers[0].host_indices[0] = -1"},
      {"lengths differ",
       {{"ssm", one_ssm, ssm_dev}},
       absl::StatusCode::kInvalidArgument,
       "pool_transfers[0].host_indices has 1"},
      {"device row twice (load)",
       {{"ssm", ssm_host, dup_dev}},
       absl::StatusCode::kInvalidArgument,
       "device row 2"},
      {"host slot not allocated",
       {{"ssm", bad_host, ssm_dev}},
       absl::StatusCode::kFailedPrecondition,
       "ssm"},
  };
  const std::vector<std::vector<uint8_t>> kv_h = HostBytes(*kv_.pool);
  const std::vector<std::vector<uint8_t>> ssm_h = HostBytes(*ssm_.pool);
  const std::vector<uint8_t> kv_d = kv_.DeviceBytes(), ssm_d = ssm_.DeviceBytes();
  for (const Bad& b : cases) {
    for (Direction d : {Direction::kBackup, Direction::kLoad}) {
      if (std::string(b.what) == "device row twice (load)" && d == Direction::kBackup) continue;
      absl::StatusOr<std::shared_ptr<Ticket>> t =
          f_.manager_->Submit({}, att->id, d, kv_host, kv_dev, "", b.others);
      EXPECT_EQ(t.status().code(), b.code) << b.what << ": " << t.status();
      EXPECT_THAT(Msg(t.status()), HasSubstr(b.needle)) << b.what;
    }
  }
  // pool_transfers on a plain attachment.
  std::unique_ptr<DevicePool> plain =
      DevicePool::Create(f_.dir_.path() + "/plain", *kv_.pool, 12, 3);
  ASSERT_NE(plain, nullptr);
  absl::StatusOr<AttachmentInfo> plain_att =
      AttachByName(*f_.manager_, *f_.registry_, "attn", plain->Request());
  ASSERT_TRUE(plain_att.ok()) << plain_att.status();
  EXPECT_TRUE(plain_att->group.empty());
  absl::StatusOr<std::shared_ptr<Ticket>> t = f_.manager_->Submit(
      {}, plain_att->id, Direction::kBackup, kv_host, kv_dev, "", {{"ssm", ssm_host, ssm_dev}});
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << t.status();
  EXPECT_THAT(Msg(t.status()), HasSubstr("not of a pool group"));

  f_.ExpectNoTickets();
  EXPECT_TRUE(HostBytes(*kv_.pool) == kv_h);
  EXPECT_TRUE(HostBytes(*ssm_.pool) == ssm_h);
  EXPECT_TRUE(kv_.DeviceBytes() == kv_d);
  EXPECT_TRUE(ssm_.DeviceBytes() == ssm_d);
}

TEST_F(GroupTest, AttachErrorsHoldNothing) {
  struct Bad {
    const char* what;
    std::function<void(AttachRequest&)> edit;
    const char* needle1;
    const char* needle2;
  } cases[] = {
      {"missing entry", [](AttachRequest& r) { r.entries.pop_back(); }, "'ssm'",
       "one per group entry"},
      {"unknown entry", [](AttachRequest& r) { r.entries[1].entry = "mamba"; }, "'mamba'",
       "kv, ssm"},
      {"entry twice", [](AttachRequest& r) { r.entries[1] = r.entries[0]; }, "'kv'", "given twice"},
      {"no entries", [](AttachRequest& r) { r.entries.clear(); }, "'kv'", "one per group entry"},
      {"range without a mapped layer",
       [this](AttachRequest& r) {
         // attn attached at device layers [2, 4): model layer 2 maps device layer 1.
         r.entries[0].request = kv_.dev->Request(2, 4);
         r.entries[0].request.named.clear();
         for (size_t c = 0; c < 2; ++c) {
           ComponentBuffers b = kv_.dev->Buffers(c);
           b.layers.pop_back();
           r.entries[0].request.named.push_back(b);
         }
       },
       "device layer 1", "layer_map[2]"},
      {"bad buffers in an entry",
       [](AttachRequest& r) { r.entries[1].request.named[0].layers.pop_back(); }, "entry 'ssm'",
       "needs 2"},
      {"plain buffers with a group's name",
       [this](AttachRequest& r) { r.named = kv_.dev->Request().named; }, "'hybrid' is a pool group",
       "entries"},
      {"device slots with a group's name", [](AttachRequest& r) { r.device_size_tokens = 12; },
       "'hybrid' is a pool group", "device_size_tokens"},
  };
  for (const Bad& b : cases) {
    AttachRequest req = GroupRequest(kv_, ssm_);
    b.edit(req);
    absl::StatusOr<AttachmentInfo> att = AttachByName(*f_.manager_, *f_.registry_, "hybrid", req);
    EXPECT_EQ(att.status().code(), absl::StatusCode::kInvalidArgument)
        << b.what << ": " << att.status();
    EXPECT_THAT(Msg(att.status()), HasSubstr(b.needle1)) << b.what;
    EXPECT_THAT(Msg(att.status()), HasSubstr(b.needle2)) << b.what;
  }
  // Entries on a plain pool's name.
  absl::StatusOr<AttachmentInfo> plain =
      AttachByName(*f_.manager_, *f_.registry_, "attn", GroupRequest(kv_, ssm_));
  EXPECT_EQ(plain.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Msg(plain.status()), HasSubstr("not a pool group"));
  EXPECT_EQ(
      AttachByName(*f_.manager_, *f_.registry_, "nope", GroupRequest(kv_, ssm_)).status().code(),
      absl::StatusCode::kNotFound);
  EXPECT_EQ(group_->attachments(), 0u);
  EXPECT_EQ(kv_.pool->attachments(), 0u);
  EXPECT_EQ(ssm_.pool->attachments(), 0u);
  EXPECT_TRUE(f_.manager_->ListAttachments().empty());
  // A wider range that holds every mapped layer is fine.
  AttachRequest wide = GroupRequest(kv_, ssm_);
  std::unique_ptr<DevicePool> wider =
      DevicePool::Create(f_.dir_.path() + "/wide", *kv_.pool, 12, 5);
  ASSERT_NE(wider, nullptr);
  wide.entries[0].request = wider->Request(0, 5);
  EXPECT_TRUE(AttachByName(*f_.manager_, *f_.registry_, "hybrid", wide).ok());
}

TEST_F(GroupTest, DeletesRefusedWhileGroupedOrAttached) {
  EXPECT_EQ(f_.registry_->Delete("attn").status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(f_.registry_->Delete("ssm").status().code(), absl::StatusCode::kFailedPrecondition);
  absl::StatusOr<AttachmentInfo> att =
      AttachByName(*f_.manager_, *f_.registry_, "hybrid", GroupRequest(kv_, ssm_));
  ASSERT_TRUE(att.ok()) << att.status();
  absl::Status del = f_.registry_->DeleteGroup("hybrid");
  EXPECT_EQ(del.code(), absl::StatusCode::kFailedPrecondition) << del;
  EXPECT_TRUE(f_.registry_->GetGroup("hybrid").ok());
  ASSERT_TRUE(f_.manager_->Detach({}, att->id).ok());
  EXPECT_TRUE(f_.registry_->DeleteGroup("hybrid").ok());
  EXPECT_TRUE(f_.registry_->Delete("ssm").ok());
}

// A group with a page-row entry: V4_PAGED rows move in whole pages, mapped
// per model layer like any other entry.
TEST(GroupPageRowTest, WholePagesFollowTheMapAndPartialPagesChangeNothing) {
  KindFixture f;
  ASSERT_FALSE(f.dir_.path().empty());
  absl::StatusOr<std::shared_ptr<Pool>> mla =
      f.registry_->Create("mla", MlaSpec(LayoutKind::kLayerFirst, 3));
  absl::StatusOr<std::shared_ptr<Pool>> v4 =
      f.registry_->Create("v4", V4PagedSpec(LayoutKind::kPageFirst));
  ASSERT_TRUE(mla.ok()) << mla.status();
  ASSERT_TRUE(v4.ok()) << v4.status();
  ASSERT_EQ((*v4)->components().size(), 1u);
  ASSERT_EQ((*v4)->components()[0].row_tokens, 3u);
  Member a, b;
  a.entry = "latent";
  a.pool = *mla;
  a.attached = 2;
  a.map = {1, -1, 0};
  a.dev = DevicePool::Create(f.dir_.path() + "/dev-mla", *a.pool, 9, 2);
  b.entry = "paged";
  b.pool = *v4;
  b.attached = 3;
  b.map = {-1, 2, 0};
  b.dev = DevicePool::Create(f.dir_.path() + "/dev-v4", *b.pool, 12, 3);
  ASSERT_NE(a.dev, nullptr);
  ASSERT_NE(b.dev, nullptr);
  ASSERT_TRUE(
      f.registry_
          ->CreateGroup("mixed", 3, {{"latent", "mla", a.map, false}, {"paged", "v4", b.map, true}})
          .ok());
  AttachRequest req;
  req.entries.push_back({"paged", b.dev->Request()});
  req.entries.push_back({"latent", a.dev->Request()});  // any order
  absl::StatusOr<AttachmentInfo> att = AttachByName(*f.manager_, *f.registry_, "mixed", req);
  ASSERT_TRUE(att.ok()) << att.status();
  EXPECT_EQ(att->pool, "v4");
  EXPECT_EQ(att->end_layer, 3u);
  std::mt19937_64 rng(9);
  for (Member* m : {&a, &b}) {
    std::vector<uint8_t> d = RandomBytes(rng, m->dev->size());
    for (uint8_t& x : d) x |= 1;
    std::memcpy(m->dev->data(), d.data(), d.size());
  }
  // Two whole v4 pages against device pages 3 and 1.
  std::vector<int64_t> v4_host = AllocSlots(*b.pool, 6);
  std::vector<int64_t> mla_host = AllocSlots(*a.pool, 3);
  ASSERT_EQ(v4_host.size(), 6u);
  ASSERT_EQ(mla_host.size(), 3u);
  std::vector<int64_t> v4_dev = {9, 10, 11, 3, 4, 5};
  std::vector<int64_t> mla_dev = {8, 0, 4};

  // A partial v4 page: refused, no ticket, nothing changed.
  const std::vector<std::vector<uint8_t>> v4_before = HostBytes(*b.pool);
  const std::vector<int64_t> partial_host(v4_host.begin(), v4_host.begin() + 2);
  const std::vector<int64_t> partial_dev = {9, 10};
  absl::StatusOr<std::shared_ptr<Ticket>> refused =
      f.manager_->Submit({}, att->id, Direction::kBackup, partial_host, partial_dev, "",
                         {{"latent", mla_host, mla_dev}});
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  EXPECT_THAT(Msg(refused.status()), HasSubstr("whole pages"));
  f.ExpectNoTickets();
  EXPECT_TRUE(HostBytes(*b.pool) == v4_before);

  // Backup, then load into other device rows, byte-exact per entry.
  std::vector<std::vector<uint8_t>> ah = HostBytes(*a.pool), bh = HostBytes(*b.pool);
  std::vector<uint8_t> ad = a.DeviceBytes(), bd = b.DeviceBytes();
  a.Expect(true, mla_host, mla_dev, &ah, &ad);
  b.Expect(true, v4_host, v4_dev, &bh, &bd);
  absl::StatusOr<std::shared_ptr<Ticket>> t = f.manager_->Submit(
      {}, att->id, Direction::kBackup, v4_host, v4_dev, "", {{"latent", mla_host, mla_dev}});
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_TRUE((*t)->WaitUntil(absl::Now() + absl::Seconds(30)));
  TicketStatus st = (*t)->Snapshot();
  EXPECT_TRUE(st.status.ok()) << st.status;
  EXPECT_EQ(st.layer_num, 3u);
  EXPECT_EQ(st.layers_done, 3u);
  // MLA rows: (7 + 2) bf16 per token; V4_PAGED: one item_bytes (13) row per page.
  const uint64_t want = a.mapped_layers() * mla_host.size() * (7 + 2) * 2 +
                        b.mapped_layers() * (v4_host.size() / 3) * 13;
  EXPECT_EQ(st.bytes, want);
  EXPECT_TRUE(HostBytes(*a.pool) == ah) << "mla host bytes";
  EXPECT_TRUE(HostBytes(*b.pool) == bh) << "v4 host bytes";

  for (Member* m : {&a, &b}) {
    std::vector<uint8_t> d = RandomBytes(rng, m->dev->size());
    std::memcpy(m->dev->data(), d.data(), d.size());
  }
  std::vector<int64_t> v4_dev2 = {0, 1, 2, 6, 7, 8};
  std::vector<int64_t> mla_dev2 = {1, 2, 3};
  ad = a.DeviceBytes();
  bd = b.DeviceBytes();
  a.Expect(false, mla_host, mla_dev2, &ah, &ad);
  b.Expect(false, v4_host, v4_dev2, &bh, &bd);
  t = f.manager_->Submit({}, att->id, Direction::kLoad, v4_host, v4_dev2, "",
                         {{"latent", mla_host, mla_dev2}});
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_TRUE((*t)->WaitUntil(absl::Now() + absl::Seconds(30)));
  st = (*t)->Snapshot();
  EXPECT_TRUE(st.status.ok()) << st.status;
  EXPECT_EQ(st.bytes, want);
  EXPECT_TRUE(a.DeviceBytes() == ad) << "mla device bytes";
  EXPECT_TRUE(b.DeviceBytes() == bd) << "v4 device bytes";
}

}  // namespace
}  // namespace kvhost
