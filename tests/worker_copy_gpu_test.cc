// Worker copies on a GPU (label gpu): kvhostd runs with --backend=cuda
// --worker-copy as its own process, and this test process is the worker that
// runs the copies itself through kvhost::WorkerCopier (kvhost/worker_copy.h):
// the pool's regions fetched over the handoff socket, mapped and registered
// here, the copy kernel launched on this process's stream.
//
// Every kind x layout of the round-trip tables (kCombos) at page sizes 1, 3
// and 16, with scattered host pages and device rows: a worker backup is
// checked by a load on kvhostd's own path (tested byte-exact against the
// seeds' offsets in cuda_engine_gpu_test.cc) into other rows, and a worker
// load into a third set of rows; after each, the whole device must equal the
// expected image (no stray byte). Tickets report path "worker" and every
// layer's bytes. Per-layer ordering: a worker load queued behind a long spin
// on its stream, and a consumer stream that reads layer l right after
// WaitLayer(l) sees the loaded bytes of every layer. A worker whose session
// ends with a worker copy in flight has it failed, and the daemon keeps
// serving.
//
// Skips where no GPU is usable; where one is, every CUDA or RPC error fails.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "api_test_util.h"
#include "cuda_test_util.h"
#include "daemon_fixture.h"
#include "gpu_worker_kernels.h"
#include "gtest/gtest.h"
#include "kvhost/client.h"
#include "kvhost/cuda_export.h"
#include "kvhost/worker_copy.h"
#include "layout_device.h"

namespace kvhost {
namespace {

using ::kvhost::testing::Combo;
using ::kvhost::testing::ComboName;
using ::kvhost::testing::Dims;
using ::kvhost::testing::FillRandomNonZero;
using ::kvhost::testing::kCombos;
using ::kvhost::testing::MakeSpec;
using ::kvhost::testing::OtherRows;
using ::kvhost::testing::PageSlots;
using ::kvhost::testing::SourceRows;
using ::kvhost::testing::TestDaemon;

using ::kvhost::testing::GpuDims;

constexpr absl::Duration kWait = absl::Seconds(60);

// The worker's device pool, any kind: per component of the pool one
// cudaMalloc holding its attached layers back to back (device_size_tokens /
// row_tokens rows of row_bytes each), with `image` what it should hold.
class DevicePool {
 public:
  DevicePool(const v1::Pool& pool, uint64_t rows) : rows_(rows) {
    layers_ = pool.spec().layer_num();
    for (const v1::PoolComponent& c : pool.components()) {
      Component& mine = components_.emplace_back();
      mine.name = c.name();
      mine.rows = rows / c.row_tokens();
      mine.row_bytes = c.row_bytes();
    }
  }
  ~DevicePool() {
    for (Component& c : components_) {
      if (c.base != nullptr) cudaFree(c.base);
    }
  }
  void Init(std::mt19937& rng) {
    for (Component& c : components_) {
      const uint64_t bytes = c.layer_bytes() * layers_;
      ASSERT_CUDA(cudaMalloc(reinterpret_cast<void**>(&c.base), bytes));
      c.image.resize(bytes);
      FillRandomNonZero(c.image.data(), bytes, rng);
    }
    Upload();
  }
  void Upload() {
    for (Component& c : components_) {
      ASSERT_CUDA(cudaMemcpy(c.base, c.image.data(), c.image.size(), cudaMemcpyHostToDevice));
    }
  }
  // The device equals the image; names the first few bad rows.
  void ExpectMatchesImage(const std::string& when) {
    for (Component& c : components_) {
      std::vector<uint8_t> got(c.image.size());
      ASSERT_CUDA(cudaMemcpy(got.data(), c.base, got.size(), cudaMemcpyDeviceToHost));
      int bad = 0;
      for (uint64_t row = 0; row < c.rows * layers_ && bad < 5; ++row) {
        const uint64_t off = row * c.row_bytes;
        if (std::memcmp(got.data() + off, c.image.data() + off, c.row_bytes) == 0) continue;
        ++bad;
        ADD_FAILURE() << when << ": component '" << c.name << "' layer " << row / c.rows << " row "
                      << row % c.rows << " differs";
      }
    }
  }
  // Component rows of `token_rows` (token indices; page-row components take
  // each page's first slot) copied from `from` to `to` in the image, or
  // zeroed with `from` empty.
  void MoveInImage(const std::vector<int64_t>& from, const std::vector<int64_t>& to,
                   const v1::Pool& pool) {
    for (size_t ci = 0; ci < components_.size(); ++ci) {
      Component& c = components_[ci];
      const uint32_t rt = pool.components(static_cast<int>(ci)).row_tokens();
      for (uint32_t l = 0; l < layers_; ++l) {
        for (size_t i = 0; i < to.size(); i += rt) {
          uint8_t* dst = c.row(l, static_cast<uint64_t>(to[i]) / rt);
          if (from.empty()) {
            std::memset(dst, 0, c.row_bytes);
          } else {
            std::memmove(dst, c.row(l, static_cast<uint64_t>(from[i]) / rt), c.row_bytes);
          }
        }
      }
    }
  }
  std::vector<CudaComponentLayers> Layers() const {
    std::vector<CudaComponentLayers> out;
    for (const Component& c : components_) {
      CudaComponentLayers& layers = out.emplace_back();
      layers.name = c.name;
      for (uint32_t l = 0; l < layers_; ++l) layers.layers.push_back(c.base + l * c.layer_bytes());
    }
    return out;
  }
  uint64_t rows() const { return rows_; }
  uint8_t* layer(size_t c, uint32_t l) const {
    return components_[c].base + l * components_[c].layer_bytes();
  }
  uint64_t layer_bytes(size_t c) const { return components_[c].layer_bytes(); }
  uint8_t* image_layer(size_t c, uint32_t l) {
    return components_[c].image.data() + l * components_[c].layer_bytes();
  }
  size_t components() const { return components_.size(); }

 private:
  struct Component {
    std::string name;
    uint64_t rows = 0;
    uint64_t row_bytes = 0;
    uint8_t* base = nullptr;
    std::vector<uint8_t> image;
    uint64_t layer_bytes() const { return rows * row_bytes; }
    uint8_t* row(uint32_t l, uint64_t r) {
      return image.data() + l * layer_bytes() + r * row_bytes;
    }
  };
  uint64_t rows_;
  uint32_t layers_ = 0;
  std::vector<Component> components_;
};

class WorkerCopyGpuTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {}
  void SetUp() override {
    std::string why;
    if (CudaDeviceCount(&why) == 0) GTEST_SKIP() << "no usable CUDA GPU: " << why;
    ASSERT_CUDA(cudaSetDevice(0));
    if (Daemon() == nullptr) {
      absl::StatusOr<std::unique_ptr<TestDaemon>> d =
          TestDaemon::Start(KVHOSTD_PATH, {"--backend=cuda", "--worker-copy"});
      ASSERT_TRUE(d.ok()) << d.status();
      Daemon() = *std::move(d);
    }
    absl::StatusOr<v1::DaemonStatus> status = client().GetStatus();
    ASSERT_TRUE(status.ok()) << status.status();
    ASSERT_EQ(status->backend(), "cuda") << status->backend_detail();
    ASSERT_TRUE(status->worker_copy());
    ASSERT_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    ASSERT_CUDA(cudaStreamCreateWithFlags(&consumer_, cudaStreamNonBlocking));
  }
  void TearDown() override {
    copier_.reset();
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    if (consumer_ != nullptr) cudaStreamDestroy(consumer_);
    if (Daemon() != nullptr && HasFailure()) {
      std::string log = Daemon()->Log();
      if (log.size() > 12000) log = "..." + log.substr(log.size() - 12000);
      std::fprintf(stderr, "--- kvhostd log (tail) ---\n%s\n", log.c_str());
      Daemon().reset();  // the next test starts afresh
    }
  }
  static void TearDownTestSuite() { Daemon().reset(); }
  static std::unique_ptr<TestDaemon>& Daemon() {
    static auto* daemon = new std::unique_ptr<TestDaemon>();
    return *daemon;
  }
  Client& client() { return Daemon()->client(); }

  // A pool `name` of `combo` at page size `ps` with every page allocated,
  // some given back; `host` the pages kept, in shuffled order, as slots.
  void MakePool(const std::string& name, const Combo& combo, uint32_t ps, std::mt19937& rng) {
    v1::PoolSpec spec = MakeSpec(combo.kind, combo.layout, ps, 0, v1::BF16, GpuDims());
    const uint64_t pages = 12;
    spec.set_size_tokens(pages * ps);
    absl::StatusOr<v1::Pool> pool = client().CreatePool(name, spec);
    ASSERT_TRUE(pool.ok()) << pool.status();
    pool_ = *pool;
    absl::StatusOr<std::vector<int64_t>> all = client().Alloc(name, pages * ps);
    ASSERT_TRUE(all.ok()) << all.status();
    std::vector<uint64_t> order;
    for (uint64_t p = 0; p < pages; ++p) order.push_back(p);
    std::shuffle(order.begin(), order.end(), rng);
    const std::vector<uint64_t> freed(order.end() - 3, order.end());
    order.resize(order.size() - 3);
    ASSERT_TRUE(client().Free(name, PageSlots(freed, ps)).ok());
    host_ = PageSlots(order, ps);
  }
  // dev_ for pool_ with `rows` rows, attached, and copier_ on it.
  void Attach(uint64_t rows, std::mt19937& rng) {
    dev_ = std::make_unique<DevicePool>(pool_, rows);
    dev_->Init(rng);
    if (HasFatalFailure()) return;
    const std::vector<CudaComponentLayers> layers = dev_->Layers();
    absl::StatusOr<v1::AttachDeviceRequest> request =
        MakeCudaAttachRequest(pool_.name(), layers, rows);
    ASSERT_TRUE(request.ok()) << request.status();
    absl::StatusOr<v1::Attachment> att = client().AttachDevice(*request);
    ASSERT_TRUE(att.ok()) << att.status();
    att_ = *att;
    ASSERT_NE(att_.handoff_socket(), "");
    absl::StatusOr<std::unique_ptr<WorkerCopier>> copier =
        WorkerCopier::Open(client(), att_, layers);
    ASSERT_TRUE(copier.ok()) << copier.status();
    copier_ = *std::move(copier);
    EXPECT_GE(copier_->mapped_bytes(), pool_.bytes());
  }
  // A worker copy's ends: the copier's, then the daemon's ticket.
  void ExpectWorkerDone(const absl::StatusOr<WorkerTicket>& ticket, uint64_t tokens) {
    ASSERT_TRUE(ticket.ok()) << ticket.status();
    ASSERT_NE(ticket->copy, nullptr);
    ASSERT_TRUE(copier_->Wait(*ticket, kWait).ok());
    absl::StatusOr<v1::TransferStatus> st = client().WaitTransfer(ticket->ticket_id, kWait);
    ASSERT_TRUE(st.ok()) << st.status();
    EXPECT_TRUE(st->done());
    EXPECT_EQ(st->path(), "worker");
    EXPECT_EQ(st->bytes(), tokens * pool_.bytes_per_token());
    EXPECT_EQ(st->layers_done(), pool_.spec().layer_num());
  }
  void Cleanup() {
    copier_.reset();
    ASSERT_TRUE(client().DetachDevice(att_.id()).ok());
    ASSERT_TRUE(client().DeletePool(pool_.name()).ok());
  }

  cudaStream_t stream_ = nullptr;
  cudaStream_t consumer_ = nullptr;
  v1::Pool pool_;
  std::vector<int64_t> host_;
  std::unique_ptr<DevicePool> dev_;
  v1::Attachment att_;
  std::unique_ptr<WorkerCopier> copier_;
};

struct Case {
  int combo;
  uint32_t page_size;
};

std::vector<Case> Cases() {
  std::vector<Case> out;
  for (int c = 0; c < static_cast<int>(std::size(kCombos)); ++c) {
    for (uint32_t ps : {1u, 3u, 16u}) out.push_back({c, ps});
  }
  return out;
}

class WorkerCopyRoundTripTest : public WorkerCopyGpuTest,
                                public ::testing::WithParamInterface<Case> {};

TEST_P(WorkerCopyRoundTripTest, BackupThenLoadIsByteExact) {
  const Combo combo = kCombos[GetParam().combo];
  const uint32_t ps = GetParam().page_size;
  const std::string name = absl::StrCat("w-", ComboName(combo), "-ps", ps);
  std::mt19937 rng(100u * static_cast<uint32_t>(GetParam().combo) + ps);
  ASSERT_NO_FATAL_FAILURE(MakePool(name, combo, ps, rng));
  const uint64_t n = host_.size();
  ASSERT_NO_FATAL_FAILURE(Attach(8 * n + 16, rng));
  const std::vector<int64_t> src = SourceRows(rng, n);
  std::set<int64_t> used(src.begin(), src.end());
  const std::vector<int64_t> mid = OtherRows(rng, n, dev_->rows(), used);
  used.insert(mid.begin(), mid.end());
  const std::vector<int64_t> dst = OtherRows(rng, n, dev_->rows(), used);

  // The worker backs up src; kvhostd's own load of those slots into `mid`
  // must give src's bytes.
  ExpectWorkerDone(copier_->Backup(host_, src, stream_), n);
  if (HasFatalFailure()) return;
  dev_->ExpectMatchesImage("after the worker's backup (it must not write the device)");
  absl::StatusOr<uint64_t> own = client().Load(att_.id(), host_, mid);
  ASSERT_TRUE(own.ok()) << own.status();
  ASSERT_TRUE(client().WaitTransfer(*own, kWait).ok());
  dev_->MoveInImage(src, mid, pool_);
  dev_->ExpectMatchesImage("after kvhostd's load of the worker's backup");

  // The worker loads the slots into `dst`, zeroed first.
  dev_->MoveInImage({}, dst, pool_);
  dev_->Upload();
  ExpectWorkerDone(copier_->Load(host_, dst, stream_), n);
  if (HasFatalFailure()) return;
  dev_->MoveInImage(src, dst, pool_);
  dev_->ExpectMatchesImage("after the worker's load");
  Cleanup();
}

INSTANTIATE_TEST_SUITE_P(AllLayouts, WorkerCopyRoundTripTest, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return absl::StrCat(ComboName(kCombos[info.param.combo]), "_ps",
                                               info.param.page_size);
                         });

TEST_F(WorkerCopyGpuTest, AConsumerReadsEachLayerRightAfterItsWait) {
  std::mt19937 rng(5);
  ASSERT_NO_FATAL_FAILURE(MakePool("w-order", {v1::MHA, v1::LAYER_FIRST}, 16, rng));
  const uint64_t n = host_.size();
  ASSERT_NO_FATAL_FAILURE(Attach(8 * n + 16, rng));
  const std::vector<int64_t> src = SourceRows(rng, n);
  ExpectWorkerDone(copier_->Backup(host_, src, stream_), n);
  if (HasFatalFailure()) return;
  // Zero every row on the device, then load behind a ~50 ms spin: a read
  // not ordered by its layer's event would see zeros.
  std::vector<int64_t> every;
  for (uint64_t r = 0; r < dev_->rows(); ++r) every.push_back(static_cast<int64_t>(r));
  const std::vector<int64_t> loaded = src;
  std::vector<std::vector<uint8_t>> want;
  for (size_t c = 0; c < dev_->components(); ++c) {
    for (uint32_t l = 0; l < pool_.spec().layer_num(); ++l) {
      want.emplace_back(dev_->image_layer(c, l), dev_->image_layer(c, l) + dev_->layer_bytes(c));
    }
  }
  dev_->MoveInImage({}, every, pool_);
  dev_->Upload();
  int khz = 0;
  ASSERT_CUDA(cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, 0));
  ASSERT_CUDA(testing::LaunchSpin(static_cast<long long>(khz) * 50, stream_));
  absl::StatusOr<WorkerTicket> load = copier_->Load(host_, loaded, stream_);
  ASSERT_TRUE(load.ok()) << load.status();
  const uint32_t layers = pool_.spec().layer_num();
  std::vector<uint8_t*> snapshots;
  for (size_t c = 0; c < dev_->components(); ++c) {
    for (uint32_t l = 0; l < layers; ++l) {
      uint8_t* snap = nullptr;
      ASSERT_CUDA(cudaMalloc(reinterpret_cast<void**>(&snap), dev_->layer_bytes(c)));
      snapshots.push_back(snap);
    }
  }
  for (uint32_t l = 0; l < layers; ++l) {
    ASSERT_TRUE(copier_->WaitLayer(*load, l, consumer_).ok());
    for (size_t c = 0; c < dev_->components(); ++c) {
      ASSERT_CUDA(testing::LaunchCopyRows(snapshots[c * layers + l], dev_->layer(c, l),
                                          dev_->layer_bytes(c), consumer_));
    }
  }
  ASSERT_CUDA(cudaStreamSynchronize(consumer_));
  ExpectWorkerDone(load, n);
  for (size_t k = 0; k < snapshots.size(); ++k) {
    const size_t c = k / layers;
    std::vector<uint8_t> got(dev_->layer_bytes(c));
    ASSERT_CUDA(cudaMemcpy(got.data(), snapshots[k], got.size(), cudaMemcpyDeviceToHost));
    cudaFree(snapshots[k]);
    // The rows loaded hold their bytes; the rest are zero.
    const uint64_t row_bytes = got.size() / dev_->rows();
    for (int64_t r : loaded) {
      const uint64_t off = static_cast<uint64_t>(r) * row_bytes;
      EXPECT_EQ(std::memcmp(got.data() + off, want[k].data() + off, row_bytes), 0)
          << "component " << c << " layer " << k % layers << " row " << r
          << ": read before its layer landed";
    }
  }
  Cleanup();
}

TEST_F(WorkerCopyGpuTest, ASessionThatEndsFailsItsWorkerCopy) {
  std::mt19937 rng(9);
  ASSERT_NO_FATAL_FAILURE(MakePool("w-gone", {v1::MLA, v1::PAGE_FIRST}, 1, rng));
  absl::StatusOr<v1::DaemonStatus> before = client().GetStatus();
  ASSERT_TRUE(before.ok()) << before.status();
  // Freed only after the session that attached it is gone.
  DevicePool dev(pool_, 64);
  dev.Init(rng);
  if (HasFatalFailure()) return;
  {
    // A second worker: its own session, a worker copy it never finishes.
    ClientOptions options;
    options.address = Daemon()->address();
    absl::StatusOr<std::unique_ptr<Client>> worker = Client::Connect(options);
    ASSERT_TRUE(worker.ok()) << worker.status();
    absl::StatusOr<v1::AttachDeviceRequest> request =
        MakeCudaAttachRequest(pool_.name(), dev.Layers(), 64);
    ASSERT_TRUE(request.ok()) << request.status();
    absl::StatusOr<v1::Attachment> att = (*worker)->AttachDevice(*request);
    ASSERT_TRUE(att.ok()) << att.status();
    v1::BackupRequest backup;
    backup.set_attachment_id(att->id());
    backup.mutable_host_indices()->Add(host_.begin(), host_.begin() + 4);
    for (int64_t r = 0; r < 4; ++r) backup.add_device_indices(r);
    backup.set_worker_copy(true);
    absl::StatusOr<v1::TransferTicket> ticket = (*worker)->SubmitBackup(backup);
    ASSERT_TRUE(ticket.ok()) << ticket.status();
    EXPECT_TRUE(ticket->has_worker_copy());
    EXPECT_GT(ticket->worker_copy().tiles().size(), 0u);
  }  // the worker goes: its session ends
  bool failed = false;
  for (absl::Time end = absl::Now() + absl::Seconds(20); !failed && absl::Now() < end;
       absl::SleepFor(absl::Milliseconds(20))) {
    absl::StatusOr<v1::DaemonStatus> now = client().GetStatus();
    ASSERT_TRUE(now.ok()) << now.status();
    failed = now->tickets_failed() == before->tickets_failed() + 1 && now->tickets_in_flight() == 0;
  }
  EXPECT_TRUE(failed) << Daemon()->Log();
  EXPECT_TRUE(absl::StrContains(Daemon()->Log(), "before the worker finished"));
  // The daemon serves on: this worker copies.
  const uint64_t n = host_.size();
  ASSERT_NO_FATAL_FAILURE(Attach(8 * n + 16, rng));
  ExpectWorkerDone(copier_->Backup(host_, SourceRows(rng, n), stream_), n);
  Cleanup();
}

}  // namespace
}  // namespace kvhost
