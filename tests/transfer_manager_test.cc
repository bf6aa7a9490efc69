// Tests of the transfer manager (server/transfer/transfer_manager.h) over the
// host engine, its own room (transfer_manager.cc): round trips through a pool,
// drain, layer progress (an event set and a base per transfer), ticket and
// attachment ownership (a stranger's ids are refused); every pool kind x
// allowed layout backed up and loaded byte-exact (per-component buffers,
// page-row components, sharded pools and partial attachments, followers,
// LOGICAL), and a pool group's transfers following its layer maps, checked
// against SeedOffset. Attach and Detach are attachments_test.cc's, a
// transfer's validation submission_test.cc's (fixtures:
// transfer_manager_fixtures.h).
#include "server/transfer/transfer_manager.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "transfer_manager_fixtures.h"

namespace kvhost {
namespace {

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

}  // namespace
}  // namespace kvhost
