// Tests of TransferServiceImpl's shared call bodies
// (server/service/transfer_service.h) on the host engine, without a gRPC
// server: DoBackup, DoLoad and DoWaitTransfer move the bytes a ticket says;
// DoAllocBackup allocates, backs up and, refused, gives its slots back; every
// refusal (index counts over --max-indices-per-call, an unknown attachment,
// a wait_event_handle the host backend cannot wait on, worker_copy with a
// wait handle or pool_transfers, AllocBackup's own checks) leaves no ticket
// and the pool's free slots as they were (fixtures:
// transfer_manager_fixtures.h).
#include "server/service/transfer_service.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "transfer_manager_fixtures.h"

namespace kvhost {
namespace {

constexpr uint64_t kMaxIndices = 8;
constexpr uint64_t kReply = 1 << 20;

class TransferServiceTest : public ManagerTest {
 protected:
  void SetUp() override {
    ManagerTest::SetUp();
    if (HasFatalFailure()) return;
    service_ = std::make_unique<TransferServiceImpl>(manager_.get(), registry_.get(), kMaxIndices);
  }
  void TearDown() override {
    service_.reset();
    ManagerTest::TearDown();
  }

  v1::BackupRequest Backup(const std::string& att, const std::vector<int64_t>& host,
                           const std::vector<int64_t>& device) const {
    v1::BackupRequest r;
    r.set_attachment_id(att);
    for (int64_t h : host) r.add_host_indices(h);
    for (int64_t d : device) r.add_device_indices(d);
    return r;
  }
  v1::LoadRequest Load(const std::string& att, const std::vector<int64_t>& host,
                       const std::vector<int64_t>& device) const {
    v1::LoadRequest r;
    r.set_attachment_id(att);
    for (int64_t h : host) r.add_host_indices(h);
    for (int64_t d : device) r.add_device_indices(d);
    return r;
  }
  // The finished ticket's status (DoWaitTransfer, 30 s at most).
  v1::TransferStatus Wait(uint64_t ticket) {
    v1::WaitTransferRequest w;
    w.set_ticket_id(ticket);
    v1::TransferStatus st;
    const absl::Status s = service_->DoWaitTransfer({}, w, &st, absl::Seconds(30));
    EXPECT_TRUE(s.ok()) << s;
    return st;
  }
  uint64_t Available() const { return pool_->allocator().available_tokens(); }

  std::unique_ptr<TransferServiceImpl> service_;
};

TEST_F(TransferServiceTest, BackupThenLoadMoveTheRowsBytes) {
  ASSERT_TRUE(pool_->AllocPages(8).ok());  // slots 0..7
  const uint64_t row = dev_.row_bytes;
  ASSERT_GT(row, 0u);
  // Device rows 10..13 hold known bytes; back them up to slots 4..7.
  std::mt19937_64 rng(7);
  const std::vector<uint8_t> bytes = RandomBytes(rng, row);
  for (int64_t r = 10; r < 14; ++r) std::memcpy(DeviceRow(0, 1, r), bytes.data(), row);
  v1::TransferTicket t;
  ASSERT_TRUE(
      service_->DoBackup({}, Backup(att_, {4, 5, 6, 7}, {10, 11, 12, 13}), &t, kReply).ok());
  const v1::TransferStatus done = Wait(t.id());
  EXPECT_TRUE(done.done());
  EXPECT_EQ(done.ticket_id(), t.id());
  EXPECT_GT(done.bytes(), 0u);
  for (uint64_t slot = 4; slot < 8; ++slot) {
    EXPECT_EQ(std::memcmp(HostRow(0, 1, slot), bytes.data(), row), 0) << slot;
  }
  // Load slot 5 into device row 30, which held other bytes.
  std::memset(DeviceRow(0, 1, 30), 0, row);
  v1::TransferTicket l;
  ASSERT_TRUE(service_->DoLoad({}, Load(att_, {5}, {30}), &l, kReply).ok());
  EXPECT_NE(l.id(), t.id());
  EXPECT_TRUE(Wait(l.id()).done());
  EXPECT_EQ(std::memcmp(DeviceRow(0, 1, 30), bytes.data(), row), 0);
  EXPECT_EQ(manager_->counters().tickets_done, 2u);
}

TEST_F(TransferServiceTest, RefusalsLeaveNoTicket) {
  ASSERT_TRUE(pool_->AllocPages(8).ok());
  const uint64_t available = Available();
  const std::vector<int64_t> nine = {0, 1, 2, 3, 4, 5, 6, 7, 0};
  const std::vector<int64_t> four = {0, 1, 2, 3};
  struct Case {
    const char* what;
    bool load;
    v1::BackupRequest request;  // a load's fields are the same
    absl::StatusCode code;
    std::string message;
  };
  std::vector<Case> cases;
  cases.push_back({"host over the limit", false, Backup(att_, nine, nine),
                   absl::StatusCode::kInvalidArgument,
                   "Backup host_indices: 9 is over the daemon's limit of 8 per call"});
  cases.push_back({"device over the limit", true, Backup(att_, four, nine),
                   absl::StatusCode::kInvalidArgument,
                   "Load device_indices: 9 is over the daemon's limit of 8"});
  v1::BackupRequest entry = Backup(att_, {}, {});
  v1::PoolTransfer* pt = entry.add_pool_transfers();
  pt->set_name("kv");
  for (int64_t i : nine) pt->add_device_indices(i);
  cases.push_back({"pool_transfers over the limit", false, entry,
                   absl::StatusCode::kInvalidArgument,
                   "Backup pool_transfers 'kv' device_indices: 9 is over"});
  cases.push_back({"unknown attachment", false, Backup("att-nope", four, four),
                   absl::StatusCode::kNotFound, "att-nope"});
  cases.push_back({"unknown attachment on load", true, Backup("att-nope", four, four),
                   absl::StatusCode::kNotFound, "att-nope"});
  v1::BackupRequest waits = Backup(att_, four, four);
  waits.set_wait_event_handle(std::string(64, 'e'));
  cases.push_back({"wait_event_handle on the host backend", false, waits,
                   absl::StatusCode::kFailedPrecondition, "wait_event_handle is set, but the"});
  cases.push_back({"wait_event_handle on a host load", true, waits,
                   absl::StatusCode::kFailedPrecondition, "backend has no CUDA events"});
  v1::BackupRequest worker_wait = waits;
  worker_wait.set_worker_copy(true);
  cases.push_back({"worker_copy with a wait handle", false, worker_wait,
                   absl::StatusCode::kInvalidArgument,
                   "wait_event_handle must be empty with worker_copy"});
  v1::BackupRequest worker_entries = entry;
  worker_entries.mutable_pool_transfers(0)->clear_device_indices();
  worker_entries.set_worker_copy(true);
  cases.push_back({"worker_copy with pool_transfers", false, worker_entries,
                   absl::StatusCode::kFailedPrecondition, "worker copies serve plain pools only"});
  cases.push_back({"unallocated host slot", false, Backup(att_, {8}, {0}),
                   absl::StatusCode::kFailedPrecondition, "host slot 8"});
  for (const Case& c : cases) {
    v1::TransferTicket t;
    absl::Status s;
    if (c.load) {
      v1::LoadRequest l;
      l.set_attachment_id(c.request.attachment_id());
      *l.mutable_host_indices() = c.request.host_indices();
      *l.mutable_device_indices() = c.request.device_indices();
      l.set_wait_event_handle(c.request.wait_event_handle());
      *l.mutable_pool_transfers() = c.request.pool_transfers();
      l.set_worker_copy(c.request.worker_copy());
      s = service_->DoLoad({}, l, &t, kReply);
    } else {
      s = service_->DoBackup({}, c.request, &t, kReply);
    }
    EXPECT_EQ(s.code(), c.code) << c.what << ": " << s;
    EXPECT_THAT(Msg(s), HasSubstr(c.message)) << c.what;
    EXPECT_EQ(t.id(), 0u) << c.what;
    EXPECT_EQ(Available(), available) << c.what;
  }
  ExpectNoTickets();
}

TEST_F(TransferServiceTest, AllocBackupAllocatesAndBacksUp) {
  const uint64_t size = pool_->size_tokens();
  v1::AllocBackupRequest req;
  *req.mutable_backup() = Backup(att_, {}, {0, 1, 2, 3, 4, 5, 6, 7});
  v1::AllocBackupResponse resp;
  ASSERT_TRUE(service_->DoAllocBackup({}, req, &resp, kReply).ok());
  ASSERT_EQ(resp.host_indices_size(), 8);
  EXPECT_EQ(resp.available_tokens(), size - 8);
  EXPECT_EQ(Available(), size - 8);
  EXPECT_TRUE(Wait(resp.ticket().id()).done());
  // The slots are allocated: freeing them gives them back.
  absl::StatusOr<uint64_t> freed =
      pool_->Free(std::vector<int64_t>(resp.host_indices().begin(), resp.host_indices().end()));
  ASSERT_TRUE(freed.ok()) << freed.status();
  EXPECT_EQ(*freed, 8u);
}

TEST_F(TransferServiceTest, AllocBackupRefusalsChangeNothing) {
  const uint64_t size = pool_->size_tokens();
  struct Case {
    const char* what;
    v1::BackupRequest backup;
    uint64_t max_reply;
    absl::StatusCode code;
    std::string message;
  };
  std::vector<Case> cases;
  cases.push_back({"host_indices given", Backup(att_, {0, 1, 2, 3}, {0, 1, 2, 3}), kReply,
                   absl::StatusCode::kInvalidArgument, "backup.host_indices has 4 entries"});
  v1::BackupRequest worker = Backup(att_, {}, {0, 1, 2, 3});
  worker.set_worker_copy(true);
  cases.push_back({"worker_copy", worker, kReply, absl::StatusCode::kInvalidArgument,
                   "backup.pool_transfers and backup.worker_copy must be unset"});
  cases.push_back({"device over the limit", Backup(att_, {}, std::vector<int64_t>(12, 0)), kReply,
                   absl::StatusCode::kInvalidArgument,
                   "AllocBackup device_indices: 12 is over the daemon's limit of 8"});
  cases.push_back({"unknown attachment", Backup("att-nope", {}, {0, 1, 2, 3}), kReply,
                   absl::StatusCode::kNotFound, "att-nope"});
  cases.push_back({"reply over the limit", Backup(att_, {}, {0, 1, 2, 3}), 64,
                   absl::StatusCode::kResourceExhausted,
                   "AllocBackup of 4 tokens needs a reply of up to 68 bytes, over the 64-byte"});
  // Refused by the manager after the slots were allocated: they go back.
  cases.push_back({"device row out of range", Backup(att_, {}, {0, 1, 2, 40}), kReply,
                   absl::StatusCode::kInvalidArgument, "40"});
  v1::BackupRequest waits = Backup(att_, {}, {0, 1, 2, 3});
  waits.set_wait_event_handle(std::string(64, 'e'));
  cases.push_back({"wait_event_handle on the host backend", waits, kReply,
                   absl::StatusCode::kFailedPrecondition, "wait_event_handle is set"});
  cases.push_back({"more than the pool holds", Backup(att_, {}, std::vector<int64_t>(8, 0)), kReply,
                   absl::StatusCode::kResourceExhausted, "slots are free"});
  // The last case: the pool is full but for 4 slots.
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    if (i + 1 == cases.size()) {
      ASSERT_TRUE(pool_->AllocPages(size - 4).ok());
    }
    const uint64_t before = Available();
    v1::AllocBackupRequest req;
    *req.mutable_backup() = c.backup;
    v1::AllocBackupResponse resp;
    const absl::Status s = service_->DoAllocBackup({}, req, &resp, c.max_reply);
    EXPECT_EQ(s.code(), c.code) << c.what << ": " << s;
    EXPECT_THAT(Msg(s), HasSubstr(c.message)) << c.what;
    EXPECT_EQ(resp.host_indices_size(), 0) << c.what;
    EXPECT_FALSE(resp.has_ticket()) << c.what;
    EXPECT_EQ(Available(), before) << c.what;
  }
  ExpectNoTickets();
}

}  // namespace
}  // namespace kvhost
