// Tests of worker copies in the transfer manager (server/transfer/
// worker_copy.h, TransferManager::SubmitWorkerCopy / FinishWorkerCopy /
// FindPoolRegions), without a GPU: the host engine under the name "cuda"
// (worker copies are refused on the host backend by name), and the worker's
// kernel replayed on the CPU with DecodeCopyItem, exactly the addressing the
// copy kernel uses, against the naive per-head reference copy. Then the
// ticket's life: in flight until FinishWorkerCopy, the caller rules, twice,
// a worker's error, the per-attachment limit, the reply bound, and the
// ends nobody finishes (detach, session close, drain); every refusal
// leaves no ticket. And the regions handed to a worker: held for its
// session (a deleted pool stays releasing until it ends), none without one.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "domain_test_util.h"
#include "kvhost/copy_tile.h"
#include "server/pool/registry.h"
#include "server/transfer/host_engine.h"
#include "server/transfer/transfer_manager.h"
#include "server/transfer/worker_copy.h"
#include "transfer_test_util.h"

namespace kvhost {
namespace {

using ::kvhost::testing::AllShapes;
using ::kvhost::testing::AttachByName;
using ::kvhost::testing::DeviceFile;
using ::kvhost::testing::Msg;
using ::kvhost::testing::NaiveCopy;
using ::kvhost::testing::RandomBytes;
using ::kvhost::testing::RandomPairs;
using ::kvhost::testing::RoomyRegistryOptions;
using ::kvhost::testing::SameBytes;
using ::kvhost::testing::Shape;
using ::kvhost::testing::SpecOf;
using ::kvhost::testing::TransferShmDir;
using ::testing::HasSubstr;

constexpr uint64_t kRows = 40;
constexpr uint64_t kNoLimit = uint64_t{1} << 40;

// The host engine as the manager sees a cuda one: worker copies are refused
// on an engine named "host", and these tests never let the engine copy a
// worker copy's rows.
class CudaNamedEngine : public TransferEngine {
 public:
  explicit CudaNamedEngine(HostEngineOptions options)
      : inner_(std::make_unique<HostEngine>(std::move(options))) {}
  const char* name() const override { return "cuda"; }
  std::string PathFor(const TransferJob& job) const override { return inner_->PathFor(job); }
  absl::StatusOr<std::unique_ptr<DeviceMapping>> Open(const Pool& pool,
                                                      const ResolvedAttach& attach) override {
    return inner_->Open(pool, attach);
  }
  absl::StatusOr<std::unique_ptr<DeviceMapping>> OpenGroup(
      std::vector<std::shared_ptr<const DeviceMapping>> entries, uint32_t layer_num,
      uint32_t load_event_sets) override {
    return inner_->OpenGroup(std::move(entries), layer_num, load_event_sets);
  }
  absl::Status Prepare(TransferJob* job) override { return inner_->Prepare(job); }
  void Submit(TransferJob job) override { inner_->Submit(std::move(job)); }
  void Drain() override { inner_->Drain(); }

 private:
  std::unique_ptr<HostEngine> inner_;
};

// What a worker does with a plan, on the CPU: per ticket layer and launch,
// every item of the launch's tiles, decoded as the copy kernel decodes it.
// `device(component, attached layer)` is that layer buffer's base.
template <typename DeviceFn>
void Replay(const WorkerCopyPlan& plan, const WorkerRegions& regions, uint64_t layer_num, bool load,
            DeviceFn&& device) {
  for (const JobLayer& layer : plan.layers) {
    if (layer.host_layer < 0) continue;
    const int64_t delta = int64_t{layer.device_layer} - layer.host_layer;
    for (const TileLaunch& launch : plan.sm.launches) {
      const LayoutGroup& g = regions.groups[launch.group];
      uint8_t* other = regions.pool->region_base(g.region) + g.region_offset;
      const uint64_t bytes = CopyItemBytes(g.layout);
      uint64_t items = 0;
      for (size_t t = launch.tile_begin; t < launch.tile_end; ++t) {
        const CopyTile& tile = plan.sm.tiles[t];
        EXPECT_EQ(tile.first_item, items);
        for (uint64_t r = 0; r < TileItems(tile); ++r, ++items) {
          const CopyItem item = DecodeCopyItem(
              g.layout, tile, r, static_cast<uint32_t>(layer.host_layer), layer_num, delta);
          const uint64_t plane = item.device_buffer / layer_num;
          uint8_t* dev = device(g.first_component + plane, item.device_buffer % layer_num) +
                         item.device_offset;
          if (load) {
            std::memcpy(dev, other + item.other_offset, bytes);
          } else {
            std::memcpy(other + item.other_offset, dev, bytes);
          }
        }
      }
      EXPECT_EQ(items, launch.items);
    }
  }
}

// The pieces of one test, usable twice in one test (the fixture is one).
struct Harness {
  // A pool "p" of `shape` with every slot allocated, a device file, a
  // manager serving worker copies (unless `enable` is false), a session
  // and an attachment in it.
  void Make(const Shape& shape, bool enable = true) {
    ASSERT_FALSE(dir_.path().empty());
    registry_ = std::make_unique<PoolRegistry>(RoomyRegistryOptions(dir_.path()));
    absl::StatusOr<std::shared_ptr<Pool>> pool = registry_->Create("p", SpecOf(shape));
    ASSERT_TRUE(pool.ok()) << pool.status();
    pool_ = *pool;
    ASSERT_TRUE(pool_->AllocPages(pool_->size_tokens()).ok());
    dev_ = DeviceFile::Create(dir_.path() + "/device", pool_->layout(), kRows);
    ASSERT_NE(dev_.region, nullptr);
    HostEngineOptions options;
    options.shm_dir = dir_.path();
    manager_ = std::make_unique<TransferManager>(std::make_unique<CudaNamedEngine>(options));
    if (enable) manager_->EnableWorkerCopy();
    session_ = manager_->OpenSession("worker", 1, "test");
    owner_ = Caller{{session_}, std::nullopt};
    AttachRequest request = dev_.Request(pool_->layout().planes);
    request.session_id = session_;
    absl::StatusOr<AttachmentInfo> att = AttachByName(*manager_, *registry_, "p", request);
    ASSERT_TRUE(att.ok()) << att.status();
    att_ = att->id;
  }

  uint8_t* DeviceLayer(uint64_t component, uint64_t layer) {
    return dev_.region->data() + dev_.LayerOffset(component, layer);
  }
  uint64_t Tickets() const {
    const TransferCounters c = manager_->counters();
    return c.tickets_in_flight + c.tickets_done + c.tickets_failed;
  }
  absl::StatusOr<WorkerCopyTicket> Copy(Direction d, std::vector<int64_t> host,
                                        std::vector<int64_t> device,
                                        uint64_t max_plan_bytes = kNoLimit) {
    return manager_->SubmitWorkerCopy(owner_, att_, d, host, device, max_plan_bytes);
  }

  TransferShmDir dir_;
  std::unique_ptr<PoolRegistry> registry_;
  std::shared_ptr<Pool> pool_;
  DeviceFile dev_;
  std::unique_ptr<TransferManager> manager_;
  std::string session_, att_;
  Caller owner_;
};

class WorkerCopyFixture : public ::testing::Test, public Harness {};

class WorkerCopyPlanTest : public WorkerCopyFixture, public ::testing::WithParamInterface<Shape> {};

TEST_P(WorkerCopyPlanTest, TheWorkersReplayIsByteExact) {
  ASSERT_NO_FATAL_FAILURE(Make(GetParam()));
  const KvLayout& layout = pool_->layout();
  std::mt19937_64 rng(7);
  const std::pair<std::vector<int64_t>, std::vector<int64_t>> pairs =
      RandomPairs(rng, layout.tokens, kRows, 24);
  const std::vector<int64_t>& host = pairs.first;
  const std::vector<int64_t>& device = pairs.second;
  const std::vector<uint8_t> bytes = RandomBytes(rng, dev_.region->size());
  std::memcpy(dev_.region->data(), bytes.data(), bytes.size());
  absl::StatusOr<WorkerRegions> regions =
      manager_->FindPoolRegions(owner_, att_, TransferManager::RegionUse::kWorkerCopy);
  ASSERT_TRUE(regions.ok()) << regions.status();
  auto device_fn = [&](uint64_t plane, uint64_t layer) { return DeviceLayer(plane, layer); };

  // Backup: the replay writes the pool as the reference would.
  std::vector<uint8_t> want(pool_->base(), pool_->base() + layout.total_bytes());
  NaiveCopy(layout, want.data(), device_fn, host, device, /*backup=*/true);
  absl::StatusOr<WorkerCopyTicket> backup = Copy(Direction::kBackup, host, device);
  ASSERT_TRUE(backup.ok()) << backup.status();
  ASSERT_NE(backup->plan, nullptr);
  EXPECT_EQ(backup->ticket->Snapshot().path, "worker");
  Replay(*backup->plan, *regions, layout.layers, /*load=*/false, device_fn);
  EXPECT_TRUE(SameBytes(pool_->base(), want.data(), want.size()));
  ASSERT_TRUE(manager_->FinishWorkerCopy(owner_, backup->ticket->id(), "").ok());

  // Load into a cleared device: the rows come back, nothing else changes.
  std::memset(dev_.region->data(), 0, dev_.region->size());
  std::vector<uint8_t> want_dev(dev_.region->size(), 0);
  NaiveCopy(
      layout, pool_->base(),
      [&](uint64_t plane, uint64_t layer) {
        return want_dev.data() + dev_.LayerOffset(plane, layer);
      },
      host, device, /*backup=*/false);
  absl::StatusOr<WorkerCopyTicket> load = Copy(Direction::kLoad, host, device);
  ASSERT_TRUE(load.ok()) << load.status();
  Replay(*load->plan, *regions, layout.layers, /*load=*/true, device_fn);
  EXPECT_TRUE(SameBytes(dev_.region->data(), want_dev.data(), want_dev.size()));
  ASSERT_TRUE(manager_->FinishWorkerCopy(owner_, load->ticket->id(), "").ok());
  const TicketStatus done = load->ticket->Snapshot();
  EXPECT_TRUE(done.done);
  EXPECT_TRUE(done.status.ok()) << done.status;
  EXPECT_EQ(done.layers_done, layout.layers);
  EXPECT_EQ(done.bytes, host.size() * layout.token_bytes * layout.planes * layout.layers);
}

INSTANTIATE_TEST_SUITE_P(AllLayouts, WorkerCopyPlanTest, ::testing::ValuesIn(AllShapes()),
                         [](const ::testing::TestParamInfo<Shape>& info) {
                           return std::string(info.param.name);
                         });

const Shape kMha = {"m", PoolKind::kMha, LayoutKind::kPageFirst, 2, 2, 8, 4, 16};

class WorkerTicketTest : public WorkerCopyFixture {
 protected:
  void SetUp() override { ASSERT_NO_FATAL_FAILURE(Make(kMha)); }
  static TicketStatus Settled(const std::shared_ptr<Ticket>& ticket) {
    EXPECT_TRUE(ticket->WaitUntil(absl::Now() + absl::Seconds(30)));
    return ticket->Snapshot();
  }
  // Whether the registry's releasing bytes reach `bytes` within `timeout`.
  bool ReleasingReaches(uint64_t bytes, absl::Duration timeout) const {
    const absl::Time deadline = absl::Now() + timeout;
    while (registry_->releasing_bytes() != bytes) {
      if (absl::Now() >= deadline) return false;
      absl::SleepFor(absl::Milliseconds(5));
    }
    return true;
  }
};

TEST_F(WorkerTicketTest, InFlightUntilTheWorkerFinishesIt) {
  absl::StatusOr<WorkerCopyTicket> copy = Copy(Direction::kBackup, {0, 1, 2, 3}, {4, 5, 6, 7});
  ASSERT_TRUE(copy.ok()) << copy.status();
  const uint64_t id = copy->ticket->id();
  EXPECT_FALSE(copy->ticket->Snapshot().done);
  EXPECT_EQ(copy->ticket->Snapshot().event_set, -1);
  EXPECT_EQ(manager_->counters().tickets_in_flight, 1u);
  // Only its owner finishes it; strangers and unknown ids look alike.
  const Caller stranger{{"ses-1-0123"}, std::nullopt};
  absl::Status s = manager_->FinishWorkerCopy(stranger, id, "");
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  s = manager_->FinishWorkerCopy(owner_, id + 1, "");
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_FALSE(copy->ticket->Snapshot().done);
  ASSERT_TRUE(manager_->FinishWorkerCopy(owner_, id, "").ok());
  const TicketStatus done = Settled(copy->ticket);
  EXPECT_TRUE(done.status.ok()) << done.status;
  EXPECT_EQ(manager_->counters().bytes[0], done.bytes);
  EXPECT_GT(done.bytes, 0u);
  // Twice: refused, nothing changes.
  s = manager_->FinishWorkerCopy(owner_, id, "");
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(Msg(s), HasSubstr("already finished"));
  EXPECT_EQ(manager_->counters().tickets_done, 1u);
}

TEST_F(WorkerTicketTest, AWorkersErrorFailsTheTicket) {
  absl::StatusOr<WorkerCopyTicket> copy = Copy(Direction::kLoad, {0, 1}, {0, 1});
  ASSERT_TRUE(copy.ok()) << copy.status();
  ASSERT_TRUE(manager_->FinishWorkerCopy(owner_, copy->ticket->id(), "illegal address").ok());
  const TicketStatus done = Settled(copy->ticket);
  EXPECT_EQ(done.status.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(Msg(done.status), HasSubstr("illegal address"));
  EXPECT_EQ(manager_->counters().tickets_failed, 1u);
}

TEST_F(WorkerTicketTest, TheDaemonsOwnTicketsAreNotTheWorkers) {
  absl::StatusOr<std::shared_ptr<Ticket>> own =
      manager_->Submit(owner_, att_, Direction::kBackup, {0, 1}, {0, 1});
  ASSERT_TRUE(own.ok()) << own.status();
  const absl::Status s = manager_->FinishWorkerCopy(owner_, (*own)->id(), "");
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  Settled(*own);
}

TEST_F(WorkerTicketTest, RefusalsLeaveNoTicket) {
  const uint64_t before = Tickets();
  struct Bad {
    const char* what;
    std::vector<int64_t> host, device;
    uint64_t max_plan_bytes;
    absl::StatusCode code;
    const char* message;
  } cases[] = {
      {"lengths differ", {0, 1}, {0}, kNoLimit, absl::StatusCode::kInvalidArgument, "has 2"},
      {"device out of range", {0}, {40}, kNoLimit, absl::StatusCode::kInvalidArgument, "[0, 40)"},
      {"row twice", {0, 1}, {3, 3}, kNoLimit, absl::StatusCode::kInvalidArgument, "device row"},
      {"plan too large",
       {0, 2, 4, 6},
       {0, 2, 4, 6},
       128,
       absl::StatusCode::kResourceExhausted,
       "--max-message-bytes"},
  };
  for (const Bad& c : cases) {
    const absl::Status s = Copy(Direction::kLoad, c.host, c.device, c.max_plan_bytes).status();
    EXPECT_EQ(s.code(), c.code) << c.what << ": " << s;
    EXPECT_THAT(Msg(s), HasSubstr(c.message)) << c.what;
  }
  absl::Status s =
      manager_
          ->SubmitWorkerCopy(Caller{}, att_, Direction::kBackup, std::vector<int64_t>{0},
                             std::vector<int64_t>{0}, kNoLimit)
          .status();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_EQ(Tickets(), before);
  EXPECT_EQ(manager_->FindPoolRegions(Caller{}, att_, TransferManager::RegionUse::kWorkerCopy)
                .status()
                .code(),
            absl::StatusCode::kNotFound);
}

TEST_F(WorkerTicketTest, OffOrOnTheHostEngineItIsRefused) {
  Harness off;
  ASSERT_NO_FATAL_FAILURE(off.Make(kMha, /*enable=*/false));
  absl::Status s = off.Copy(Direction::kBackup, {0}, {0}).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(Msg(s), HasSubstr("--worker-copy"));
  EXPECT_EQ(
      off.manager_->FindPoolRegions(off.owner_, off.att_, TransferManager::RegionUse::kWorkerCopy)
          .status()
          .code(),
      absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(off.Tickets(), 0u);
  // A caller's own view of the pool (HANDOFF_KIND_POOL_MAP) needs no
  // --worker-copy: the same regions, the same session hold.
  absl::StatusOr<WorkerRegions> mapped =
      off.manager_->FindPoolRegions(off.owner_, off.att_, TransferManager::RegionUse::kMap);
  ASSERT_TRUE(mapped.ok()) << mapped.status();
  EXPECT_EQ(mapped->pool->region_count(), off.pool_->region_count());
  EXPECT_EQ(off.manager_->FindPoolRegions(Caller{}, off.att_, TransferManager::RegionUse::kMap)
                .status()
                .code(),
            absl::StatusCode::kNotFound);

  auto registry = std::make_unique<PoolRegistry>(RoomyRegistryOptions(dir_.path()));
  HostEngineOptions options;
  options.shm_dir = dir_.path();
  TransferManager host(std::make_unique<HostEngine>(options));
  host.EnableWorkerCopy();
  s = host.SubmitWorkerCopy({}, "att-1-00", Direction::kLoad, std::vector<int64_t>{0},
                            std::vector<int64_t>{0}, kNoLimit)
          .status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(Msg(s), HasSubstr("cuda backend"));
}

TEST_F(WorkerTicketTest, TheRegionsAreThePoolsLaunchGroups) {
  absl::StatusOr<WorkerRegions> regions =
      manager_->FindPoolRegions(owner_, att_, TransferManager::RegionUse::kWorkerCopy);
  ASSERT_TRUE(regions.ok()) << regions.status();
  EXPECT_EQ(regions->pool, pool_);
  ASSERT_EQ(regions->groups.size(), 1u);  // MHA's K and V: one group of two planes
  EXPECT_EQ(regions->groups[0].layout.planes, 2u);
}

// A worker's mapping of the regions outlives DetachDevice and DeletePool:
// the deleted pool's bytes stay releasing (counted against --memory-limit)
// until the worker's session ends, then they leave.
TEST_F(WorkerTicketTest, HandedRegionsKeepADeletedPoolReleasingUntilTheSessionEnds) {
  const uint64_t bytes = pool_->bytes();
  ASSERT_TRUE(
      manager_->FindPoolRegions(owner_, att_, TransferManager::RegionUse::kWorkerCopy).ok());
  ASSERT_TRUE(manager_->FindPoolRegions(owner_, att_, TransferManager::RegionUse::kWorkerCopy)
                  .ok());  // held once
  ASSERT_TRUE(manager_->Detach(owner_, att_).ok());
  pool_.reset();
  absl::StatusOr<uint64_t> deleted = registry_->Delete("p");
  ASSERT_TRUE(deleted.ok()) << deleted.status();
  // Nothing else holds the pool: unheld, the releaser would unmap it now.
  EXPECT_FALSE(ReleasingReaches(0, absl::Seconds(1)));
  EXPECT_EQ(registry_->releasing_bytes(), bytes);
  manager_->CloseSession(session_, "the worker exited", absl::Seconds(5));
  EXPECT_TRUE(ReleasingReaches(0, absl::Seconds(30)));
}

// Descriptors nothing would ever take back: an attachment without a session
// gets none.
TEST_F(WorkerTicketTest, AnAttachmentWithoutASessionGetsNoRegions) {
  absl::StatusOr<AttachmentInfo> att = AttachByName(*manager_, *registry_, "p", dev_.Request(2));
  ASSERT_TRUE(att.ok()) << att.status();
  absl::Status s =
      manager_->FindPoolRegions(Caller{}, att->id, TransferManager::RegionUse::kWorkerCopy)
          .status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(Msg(s), HasSubstr("without a session"));
  s = manager_->FindPoolRegions(Caller{}, att->id, TransferManager::RegionUse::kMap).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  // The refusal held nothing: detached, the pool goes at once.
  ASSERT_TRUE(manager_->Detach(Caller{}, att->id).ok());
  ASSERT_TRUE(manager_->Detach(owner_, att_).ok());
  pool_.reset();
  ASSERT_TRUE(registry_->Delete("p").ok());
  EXPECT_TRUE(ReleasingReaches(0, absl::Seconds(30)));
}

TEST_F(WorkerTicketTest, OneAttachmentHoldsABoundedNumber) {
  std::vector<uint64_t> ids;
  for (uint32_t i = 0; i < kMaxWorkerCopiesPerAttachment; ++i) {
    absl::StatusOr<WorkerCopyTicket> copy = Copy(Direction::kLoad, {0}, {0});
    ASSERT_TRUE(copy.ok()) << i << ": " << copy.status();
    ids.push_back(copy->ticket->id());
  }
  const uint64_t before = Tickets();
  absl::Status s = Copy(Direction::kLoad, {0}, {0}).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_THAT(Msg(s), HasSubstr("64"));
  EXPECT_EQ(Tickets(), before);
  // A copy of nothing takes no place and is finished at once.
  absl::StatusOr<WorkerCopyTicket> empty = Copy(Direction::kLoad, {}, {});
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_EQ(empty->plan, nullptr);
  EXPECT_TRUE(empty->ticket->Snapshot().done);
  ASSERT_TRUE(manager_->FinishWorkerCopy(owner_, ids[0], "").ok());
  EXPECT_TRUE(Copy(Direction::kLoad, {0}, {0}).ok());
}

TEST_F(WorkerTicketTest, AClosedSessionFailsItsWorkerCopiesAndServingGoesOn) {
  absl::StatusOr<WorkerCopyTicket> copy = Copy(Direction::kBackup, {0, 1}, {0, 1});
  ASSERT_TRUE(copy.ok()) << copy.status();
  manager_->CloseSession(session_, "the worker died", absl::Seconds(5));
  const TicketStatus done = Settled(copy->ticket);
  EXPECT_EQ(done.status.code(), absl::StatusCode::kCancelled);
  EXPECT_THAT(Msg(done.status), HasSubstr("before the worker finished"));
  EXPECT_EQ(manager_->FinishWorkerCopy(owner_, copy->ticket->id(), "").code(),
            absl::StatusCode::kFailedPrecondition);
  // Another worker attaches and copies.
  const std::string next = manager_->OpenSession("next", 2, "test");
  AttachRequest request = dev_.Request(2);
  request.session_id = next;
  absl::StatusOr<AttachmentInfo> att = AttachByName(*manager_, *registry_, "p", request);
  ASSERT_TRUE(att.ok()) << att.status();
  const Caller caller{{next}, std::nullopt};
  absl::StatusOr<WorkerCopyTicket> again =
      manager_->SubmitWorkerCopy(caller, att->id, Direction::kLoad, std::vector<int64_t>{0},
                                 std::vector<int64_t>{0}, kNoLimit);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(manager_->FinishWorkerCopy(caller, again->ticket->id(), "").ok());
}

TEST_F(WorkerTicketTest, DetachAndDrainFailWhatIsLeft) {
  absl::StatusOr<WorkerCopyTicket> first = Copy(Direction::kLoad, {0}, {0});
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_TRUE(manager_->Detach(owner_, att_).ok());
  EXPECT_EQ(Settled(first->ticket).status.code(), absl::StatusCode::kCancelled);
  AttachRequest request = dev_.Request(2);
  request.session_id = session_;
  absl::StatusOr<AttachmentInfo> att = AttachByName(*manager_, *registry_, "p", request);
  ASSERT_TRUE(att.ok()) << att.status();
  att_ = att->id;
  absl::StatusOr<WorkerCopyTicket> second = Copy(Direction::kLoad, {0}, {0});
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(manager_->Drain(absl::Milliseconds(50)), 1u);
  const TicketStatus done = Settled(second->ticket);
  EXPECT_EQ(done.status.code(), absl::StatusCode::kCancelled);
  EXPECT_THAT(Msg(done.status), HasSubstr("shutting down"));
}

}  // namespace
}  // namespace kvhost
