// Tests of the host engine (server/transfer/host_engine.h): backups and loads
// of every layout, with and without helper threads and split jobs, are byte
// for byte what the naive per-head reference copies; jobs of one direction run
// in order and Drain waits for them; Open refuses bad buffers. Pools and
// emulated device pools live in a private directory under /dev/shm.
#include "server/transfer/host_engine.h"

#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "domain_test_util.h"
#include "kvhost/layout.h"
#include "server/pool/pool.h"
#include "server/tickets/ticket.h"
#include "server/transfer/layer_counters.h"
#include "server/transfer/runs.h"
#include "server/transfer/transfer_manager.h"
#include "transfer_test_util.h"

namespace kvhost {

namespace {

using ::kvhost::testing::AllShapes;
using ::kvhost::testing::DeviceFile;
using ::kvhost::testing::EngineFixture;
using ::kvhost::testing::Msg;
using ::kvhost::testing::NaiveCopy;
using ::kvhost::testing::RandomBytes;
using ::kvhost::testing::RandomPairs;
using ::kvhost::testing::SameBytes;
using ::kvhost::testing::Shape;
using ::kvhost::testing::SpecOf;
using ::testing::HasSubstr;
using ShmDir = ::kvhost::testing::TransferShmDir;

// `request` resolved against `pool`, as TransferManager::Attach does before
// the engine's Open.
ResolvedAttach Resolved(const Pool& pool, const AttachRequest& request) {
  absl::StatusOr<ResolvedAttach> resolved = ResolveAttachRequest(pool, request);
  EXPECT_TRUE(resolved.ok()) << resolved.status();
  return resolved.ok() ? *std::move(resolved) : ResolvedAttach();
}

// Ticket layers of an attachment of exactly the pool's layers.
std::vector<JobLayer> AllLayers(const Pool& pool) {
  std::vector<JobLayer> layers;
  for (uint32_t l = 0; l < pool.spec().layer_num; ++l)
    layers.push_back({static_cast<int32_t>(l), l});
  return layers;
}

struct EngineCase {
  Shape shape;
  int helper_threads;
  uint64_t min_split_bytes;
  uint64_t transfer_tokens;  // pairs per job
};

void PrintTo(const EngineCase& c, std::ostream* os) {
  *os << c.shape.name << "/helpers" << c.helper_threads << "/split" << c.min_split_bytes;
}

class HostEngineTest : public ::testing::TestWithParam<EngineCase> {};

TEST_P(HostEngineTest, BackupAndLoadAreExact) {
  const EngineCase& c = GetParam();
  ShmDir dir;
  ASSERT_FALSE(dir.path().empty());
  const PoolSpec spec = SpecOf(c.shape);
  ASSERT_TRUE(ValidateSpec(spec).ok());
  const uint64_t tokens = *ResolveSizeTokens(spec);
  absl::StatusOr<std::shared_ptr<Pool>> pool =
      Pool::Create("p", spec, tokens, absl::StrCat(dir.path(), "/kvhost.", ::getpid(), "."));
  ASSERT_TRUE(pool.ok()) << pool.status();
  const KvLayout& layout = (*pool)->layout();
  const uint64_t rows = tokens / 2 + 3;
  const uint64_t lead = 64;  // layers need not start at the file's start
  DeviceFile dev = DeviceFile::Create(dir.path() + "/device", layout, rows, lead);
  ASSERT_NE(dev.region, nullptr);

  HostEngineOptions options;
  options.shm_dir = dir.path();
  options.helper_threads = c.helper_threads;
  options.min_split_bytes = c.min_split_bytes;
  HostEngine engine(options);
  absl::StatusOr<std::unique_ptr<DeviceMapping>> opened =
      engine.Open(**pool, Resolved(**pool, dev.Request(layout.planes, lead)));
  ASSERT_TRUE(opened.ok()) << opened.status();
  std::shared_ptr<const DeviceMapping> mapping = *std::move(opened);
  ASSERT_EQ(mapping->component_count(), layout.planes);
  for (uint64_t plane = 0; plane < layout.planes; ++plane) {
    EXPECT_EQ(mapping->rows(plane).rows, rows);
    EXPECT_EQ(mapping->rows(plane).row_bytes, layout.token_bytes);
  }

  uint8_t* host = (*pool)->base();
  uint8_t* device = dev.region->data() + lead;
  const uint64_t host_bytes = layout.total_bytes();
  const uint64_t dev_bytes = layout.planes * layout.layers * rows * layout.token_bytes;
  std::mt19937_64 rng(std::hash<std::string>()(c.shape.name) + c.helper_threads);
  uint64_t next_id = 1;

  for (int round = 0; round < 4; ++round) {
    for (Direction dir_kind : {Direction::kBackup, Direction::kLoad}) {
      const bool backup = dir_kind == Direction::kBackup;
      auto [host_idx, dev_idx] = RandomPairs(rng, tokens, rows, c.transfer_tokens);
      std::vector<uint8_t> h0 = RandomBytes(rng, host_bytes);
      std::vector<uint8_t> d0 = RandomBytes(rng, dev_bytes);
      std::memcpy(host, h0.data(), host_bytes);
      std::memcpy(device, d0.data(), dev_bytes);
      NaiveCopy(
          layout, h0.data(),
          [&](uint64_t plane, uint64_t layer) { return d0.data() + dev.LayerOffset(plane, layer); },
          host_idx, dev_idx, backup);

      TransferJob job;
      job.direction = dir_kind;
      job.mapping = mapping;
      job.parts.resize(1);
      job.parts[0].pool = *pool;
      job.parts[0].mapping = mapping;
      job.parts[0].runs = CoalesceRuns(host_idx, dev_idx);
      job.parts[0].tokens = host_idx.size();
      job.parts[0].layers = AllLayers(**pool);
      job.ticket = std::make_shared<Ticket>(
          next_id++, dir_kind, static_cast<uint32_t>(layout.layers), engine.PathFor(job));
      std::shared_ptr<Ticket> ticket = job.ticket;
      std::atomic<int> callbacks{0};
      ticket->OnDone([&callbacks] { ++callbacks; });
      engine.Submit(std::move(job));
      ASSERT_TRUE(ticket->WaitUntil(absl::Now() + absl::Seconds(30)));
      const TicketStatus st = ticket->Snapshot();
      EXPECT_TRUE(st.done);
      EXPECT_TRUE(st.status.ok()) << st.status;
      EXPECT_EQ(st.layers_done, layout.layers);
      EXPECT_EQ(st.layer_num, layout.layers);
      EXPECT_EQ(st.bytes, host_idx.size() * layout.token_bytes * layout.planes * layout.layers);
      EXPECT_EQ(st.path, "host-memcpy");
      // Callbacks run on the finishing thread after waiters wake; Drain
      // returns only once the job, callbacks included, is over.
      engine.Drain();
      EXPECT_EQ(callbacks.load(), 1);
      ASSERT_TRUE(SameBytes(host, h0.data(), host_bytes))
          << (backup ? "backup" : "load") << " round " << round << " host";
      ASSERT_TRUE(SameBytes(device, d0.data(), dev_bytes))
          << (backup ? "backup" : "load") << " round " << round << " device";
    }
  }
}

std::vector<EngineCase> EngineCases() {
  std::vector<EngineCase> out;
  for (const Shape& s : AllShapes()) {
    // Default split: these small jobs run on the driver alone.
    out.push_back({s, 2, uint64_t{1} << 20, 1u << 30});
    // Tiny split size: every job fans out over all helpers, with cuts inside runs.
    out.push_back({s, 3, 1, 1u << 30});
  }
  // Large jobs split across threads (hundreds of KB per layer).
  out.push_back({{"MhaLayerFirstLarge", PoolKind::kMha, LayoutKind::kLayerFirst, 4, 8, 64, 16, 256},
                 4,
                 4096,
                 6000});
  out.push_back({{"MhaPageHeadLarge", PoolKind::kMha, LayoutKind::kPageHead, 4, 8, 64, 16, 256},
                 4,
                 4096,
                 6000});
  out.push_back(
      {{"MhaPageUnifiedLarge", PoolKind::kMha, LayoutKind::kPageUnified, 4, 8, 64, 16, 256, 4},
       4,
       4096,
       6000});
  out.push_back(
      {{"MlaPageFirstDirectLarge", PoolKind::kMla, LayoutKind::kPageFirstDirect, 6, 1, 510, 64, 64},
       3,
       8192,
       5000});
  out.push_back(
      {{"MhaNoHelpers", PoolKind::kMha, LayoutKind::kPageFirst, 2, 2, 16, 8, 64}, 0, 1, 400});
  return out;
}

INSTANTIATE_TEST_SUITE_P(Cases, HostEngineTest, ::testing::ValuesIn(EngineCases()),
                         [](const ::testing::TestParamInfo<EngineCase>& info) {
                           return absl::StrCat(info.param.shape.name, "_h",
                                               info.param.helper_threads, "_s",
                                               info.param.min_split_bytes);
                         });

TEST_F(EngineFixture, JobsOfOneDirectionRunInOrderAndDrainWaits) {
  HostEngine engine(Options());
  absl::StatusOr<std::unique_ptr<DeviceMapping>> opened =
      engine.Open(*pool_, Resolved(*pool_, dev_.Request(pool_->layout().planes)));
  ASSERT_TRUE(opened.ok()) << opened.status();
  std::shared_ptr<const DeviceMapping> mapping = *std::move(opened);
  const KvLayout& layout = pool_->layout();
  // Device row r holds the byte r everywhere.
  for (uint64_t plane = 0; plane < layout.planes; ++plane) {
    for (uint64_t layer = 0; layer < layout.layers; ++layer) {
      for (uint64_t r = 0; r < kRows; ++r) {
        std::memset(DeviceRow(plane, layer, r), static_cast<int>(r), dev_.row_bytes);
      }
    }
  }
  // 30 backups into host slots 0..15 from rows j..j+15: the last one wins.
  std::vector<std::shared_ptr<Ticket>> tickets;
  for (uint64_t j = 0; j < 30; ++j) {
    std::vector<int64_t> host, device;
    for (int64_t k = 0; k < 16; ++k) {
      host.push_back(k);
      device.push_back(static_cast<int64_t>((j + k) % kRows));
    }
    TransferJob job;
    job.direction = Direction::kBackup;
    job.mapping = mapping;
    job.parts.resize(1);
    job.parts[0].pool = pool_;
    job.parts[0].mapping = mapping;
    job.parts[0].runs = CoalesceRuns(host, device);
    job.parts[0].tokens = 16;
    job.parts[0].layers = AllLayers(*pool_);
    job.ticket = std::make_shared<Ticket>(j + 1, Direction::kBackup, layout.layers, "x");
    tickets.push_back(job.ticket);
    engine.Submit(std::move(job));
  }
  engine.Drain();
  for (const auto& t : tickets) {
    const TicketStatus st = t->Snapshot();
    EXPECT_TRUE(st.done) << "ticket " << st.id << " not done after Drain";
    EXPECT_TRUE(st.status.ok());
  }
  for (uint64_t plane = 0; plane < layout.planes; ++plane) {
    for (uint64_t layer = 0; layer < layout.layers; ++layer) {
      for (uint64_t k = 0; k < 16; ++k) {
        const uint8_t want = static_cast<uint8_t>((29 + k) % kRows);
        std::vector<uint8_t> row(HostRow(plane, layer, k),
                                 HostRow(plane, layer, k) + dev_.row_bytes);
        EXPECT_EQ(row, std::vector<uint8_t>(dev_.row_bytes, want))
            << "plane " << plane << " layer " << layer << " slot " << k;
      }
    }
  }
  // Drain with nothing queued returns at once.
  engine.Drain();
}

// Layer progress (TransferJob::layer_counters): a backup takes an event set
// in Prepare as a load does (RESOURCE_EXHAUSTED while the ring's one set is
// held), publishes each layer before its ticket counts it, and gives the set
// back with its counter at base + layers when it ends; so does a backup that
// fails midway, whose waiters are released too.
TEST_F(EngineFixture, ABackupWithLayerCountersTakesASetAndPublishesEveryLayer) {
  HostEngine engine(Options());
  AttachRequest request = dev_.Request(pool_->layout().planes);
  request.load_event_sets = 1;
  absl::StatusOr<std::unique_ptr<DeviceMapping>> opened =
      engine.Open(*pool_, Resolved(*pool_, request));
  ASSERT_TRUE(opened.ok()) << opened.status();
  std::shared_ptr<const DeviceMapping> mapping = *std::move(opened);
  absl::StatusOr<std::shared_ptr<LayerCounters>> made = LayerCounters::Create(1);
  ASSERT_TRUE(made.ok()) << made.status();
  const std::shared_ptr<LayerCounters> counters = *made;
  const uint32_t layers = static_cast<uint32_t>(pool_->layout().layers);
  std::vector<int64_t> host, device;
  for (int64_t k = 0; k < 16; ++k) host.push_back(k), device.push_back(k);
  // A job as TransferManager::Submit makes it: Prepare, then the base.
  auto prepare = [&](Direction direction, uint64_t id) -> absl::StatusOr<TransferJob> {
    TransferJob job;
    job.direction = direction;
    job.mapping = mapping;
    job.parts.resize(1);
    job.parts[0].pool = pool_;
    job.parts[0].mapping = mapping;
    job.parts[0].runs = CoalesceRuns(host, device);
    job.parts[0].tokens = 16;
    job.parts[0].layers = AllLayers(*pool_);
    job.layer_counters = counters;
    if (absl::Status s = engine.Prepare(&job); !s.ok()) return s;
    if (job.event_set >= 0) job.layer_base = counters->Reserve(0, layers);
    job.ticket =
        std::make_shared<Ticket>(id, direction, layers, "x", job.event_set, job.layer_base);
    return job;
  };
  uint64_t base = 0;
  for (uint64_t n = 1; n <= 3; ++n) {
    SCOPED_TRACE(absl::StrCat("backup ", n));
    absl::StatusOr<TransferJob> job = prepare(Direction::kBackup, n);
    ASSERT_TRUE(job.ok()) << job.status();
    ASSERT_EQ(job->event_set, 0);
    EXPECT_EQ(job->layer_base, base);
    // The one set is this backup's until it ends: neither a backup nor a
    // load may take it.
    for (Direction other : {Direction::kBackup, Direction::kLoad}) {
      absl::StatusOr<TransferJob> refused = prepare(other, 100 + n);
      EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
      EXPECT_THAT(std::string(refused.status().message()), HasSubstr("all 1 load event sets"));
    }
    const std::shared_ptr<Ticket> ticket = job->ticket;
    engine.Submit(*std::move(job));
    // The ticket never counts a layer the counter has not: Publish comes
    // first. So the ticket is read before the counter (the other order
    // races the engine between the two reads).
    while (!ticket->Snapshot().done) {
      const uint64_t done = ticket->Snapshot().layers_done;
      EXPECT_GE(counters->Recorded(0), base + done);
    }
    ASSERT_TRUE(ticket->Snapshot().status.ok()) << ticket->Snapshot().status;
    EXPECT_EQ(ticket->Snapshot().layers_done, layers);
    EXPECT_EQ(counters->Recorded(0), base + layers);
    base += layers;
  }
  // A backup that fails in layer 1 (V of layer 0 copied, the file cut
  // there) ends its counter at base + layers and frees its set.
  const int fd = ::open(dev_.region->path().c_str(), O_RDWR | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::ftruncate(fd, static_cast<off_t>(dev_.LayerOffset(1, 1))), 0);
  absl::StatusOr<TransferJob> failing = prepare(Direction::kBackup, 10);
  ASSERT_TRUE(failing.ok()) << failing.status();
  const std::shared_ptr<Ticket> failed = failing->ticket;
  engine.Submit(*std::move(failing));
  engine.Drain();
  EXPECT_EQ(failed->Snapshot().status.code(), absl::StatusCode::kFailedPrecondition)
      << failed->Snapshot().status;
  EXPECT_EQ(counters->Recorded(0), base + layers);
  ASSERT_EQ(::ftruncate(fd, static_cast<off_t>(dev_.region->size())), 0);
  ::close(fd);
  absl::StatusOr<TransferJob> after = prepare(Direction::kLoad, 11);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->layer_base, base + layers);
  engine.Submit(*std::move(after));
  engine.Drain();
  // Without counters a backup takes no set, as before.
  TransferJob plain;
  plain.direction = Direction::kBackup;
  plain.mapping = mapping;
  plain.parts.resize(1);
  plain.parts[0].pool = pool_;
  plain.parts[0].tokens = 16;
  ASSERT_TRUE(engine.Prepare(&plain).ok());
  EXPECT_EQ(plain.event_set, -1);
}

TEST_F(EngineFixture, OpenRefusesBadBuffers) {
  HostEngine engine(Options());
  const uint64_t planes = pool_->layout().planes;
  // Outside the shm dir.
  AttachRequest req = dev_.Request(planes);
  req.k_layers[1].shm_path = "/etc/hostname";
  absl::StatusOr<std::unique_ptr<DeviceMapping>> m = engine.Open(*pool_, Resolved(*pool_, req));
  EXPECT_EQ(m.status().code(), absl::StatusCode::kPermissionDenied) << m.status();
  EXPECT_THAT(Msg(m.status()), HasSubstr("k_layers[1]"));
  // Missing file.
  req = dev_.Request(planes);
  req.v_layers[0].shm_path = dir_.path() + "/missing";
  m = engine.Open(*pool_, Resolved(*pool_, req));
  EXPECT_EQ(m.status().code(), absl::StatusCode::kNotFound) << m.status();
  EXPECT_THAT(Msg(m.status()), HasSubstr("v_layers[0]"));
  // Buffer past the end of the file.
  req = dev_.Request(planes);
  req.v_layers[1].offset += 1;
  m = engine.Open(*pool_, Resolved(*pool_, req));
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument) << m.status();
  EXPECT_THAT(Msg(m.status()), HasSubstr("v_layers[1]"));
  // More rows than the file holds.
  req = dev_.Request(planes);
  req.device_size_tokens = kRows * 10;
  EXPECT_EQ(engine.Open(*pool_, Resolved(*pool_, req)).status().code(),
            absl::StatusCode::kInvalidArgument);
  // A CUDA buffer on the host backend.
  req = dev_.Request(planes);
  req.k_layers[0].kind = DeviceBufferRef::Kind::kCuda;
  EXPECT_EQ(engine.Open(*pool_, Resolved(*pool_, req)).status().code(),
            absl::StatusCode::kFailedPrecondition);
  // The good request opens.
  EXPECT_TRUE(engine.Open(*pool_, Resolved(*pool_, dev_.Request(planes))).ok());
}

}  // namespace
}  // namespace kvhost
