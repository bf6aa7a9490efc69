// A GPU worker that dies mid-transfer (label gpu): kvhostd runs with
// --backend=cuda and a forced --transfer-path (ce, staged, sm; and staged
// with a layer-progress attachment), and kvhost_gpu_death_worker
// (tests/gpu_death_worker.cc), the process that owns the device memory, is
// killed with SIGKILL while kvhostd copies to and from it. CUDA keeps
// memory imported over IPC alive after its exporter dies, so the copies must
// complete (or fail cleanly), the session's close must take the attachment
// away, the mapping must close once its last copy is done, and nothing may
// leak.
//
// Timing, so that a fast machine cannot make the test pass without the
// copies really outliving the worker: the test holds its own GPU stream in a
// kernel that spins until the test sets a flag, records an interprocess
// event behind it, and gives the worker that event. The worker queues its
// loads (8 of 1 GiB; whether some were still running once the worker was
// reaped is printed, not checked: loads wait on nothing), then a backup that
// waits on the event (BackupRequest.wait_event_handle): that backup, and
// every backup queued behind it on kvhostd's backup lane, cannot start
// before the test lets it. The worker says so right after that backup's
// call returns: while the gate holds one of kvhostd's streams, a call of
// kvhostd's that synchronises its whole device (cudaFree does) waits too,
// so nothing of the test may depend on the worker getting further. After
// the kill and the reap (the worker's CUDA context is gone then), the
// waiting backup must still be in flight; the test checks that the session
// closed and the attachment is gone while it is, then opens the gate: the
// backups copy from the dead worker's memory, and the host slots must hold
// its bytes afterwards.
//
// Then: the daemon serves (a new client attaches anew and round-trips bytes
// exactly through the same pool), every ticket of the dead worker finished
// (none outlived --session-timeout), the pool's allocator has every page
// back once the test frees the dead worker's slots and its own, status and
// metrics show no attachment, session or ticket left, the dead worker's
// device memory comes back to the GPU (kvhostd's mapping closed), the
// deleted pool is unmapped (no job holds it), and kvhostd logged no error and
// no warning beyond the session's close.
//
// Skips where no GPU is usable; where one is, every CUDA or RPC error fails.
#include <cuda_runtime_api.h>
#include <signal.h>

#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "api_test_util.h"
#include "cuda_test_util.h"
#include "daemon_fixture.h"
#include "gpu_worker_kernels.h"
#include "gtest/gtest.h"
#include "kvhost/client.h"
#include "kvhost/cuda_export.h"
#include "layout_device.h"
#include "metrics_test_util.h"
#include "worker_process.h"

namespace kvhost {
namespace {

using ::kvhost::testing::CudaDaemonFlags;
using ::kvhost::testing::Dims;
using ::kvhost::testing::Geo;
using ::kvhost::testing::GeoOf;
using ::kvhost::testing::GpuKvPool;
using ::kvhost::testing::IsError;
using ::kvhost::testing::MakeSpec;
using ::kvhost::testing::MappedFile;
using ::kvhost::testing::MetricsPort;
using ::kvhost::testing::OtherRows;
using ::kvhost::testing::PathLabel;
using ::kvhost::testing::Range;
using ::kvhost::testing::Scrape;
using ::kvhost::testing::ScrapeMetrics;
using ::kvhost::testing::SeriesValue;
using ::kvhost::testing::SourceRows;
using ::kvhost::testing::StatusOf;
using ::kvhost::testing::TestDaemon;
using ::kvhost::testing::TransferPath;
using ::kvhost::testing::WorkerProcess;

constexpr absl::Duration kWait = absl::Seconds(60);
// --session-timeout: how long the dead worker's transfers get to finish
// after its session closed (the reaper counts the later ones as late). The
// gate opens well within it (the test's checks between the reap and the gate
// take milliseconds), and what is in flight then (kWorkerBackups backups and
// up to kWorkerLoads loads of 1 GiB, both directions at once) takes about a
// quarter of a second at the 50 GB/s every path reaches on an H200 (PERF.md,
// run M; the staged path with kStagingFlag's buffer).
constexpr absl::Duration kSessionTimeout = absl::Seconds(4);
// The worker's rows, slots and tickets: 32768 tokens of 32 KiB (8 layers of
// 2 KiB K and V rows) make 1 GiB a ticket; its device allocations hold twice
// the rows (2 GiB in all), so that the test sees them come back to the GPU.
constexpr int64_t kWorkerTokens = 32768;
constexpr size_t kWorkerBackups = 3;
constexpr size_t kWorkerLoads = 8;
// The test's own slots and rows, for its round trips (whole pages of 64).
constexpr int64_t kOwnTokens = 1024;
// What gpu_death_worker.cc fills its K and V rows with.
constexpr uint8_t kWorkerFill[2] = {0xa5, 0x5a};
// GPU memory that may stay taken after the worker's 2 GiB came back: the
// daemon's own stream-ordered descriptor allocations may keep some.
constexpr uint64_t kDeviceSlack = uint64_t{512} << 20;
constexpr char kToken[] = "worker-death-test-token";
constexpr char kStagingFlag[] = "--staging-bytes=64M";
constexpr char kPool[] = "death";

// $KVHOST_GPU_DEATH_WORKER when set (a bundle run elsewhere than where it
// was built, as scripts/gpu_run.sh does), else the one this build made.
std::string DeathWorkerPath() {
  const char* env = std::getenv("KVHOST_GPU_DEATH_WORKER");
  return env != nullptr && *env != '\0' ? env : KVHOST_GPU_DEATH_WORKER_PATH;
}

struct DeathCase {
  TransferPath path;   // forced; path.progress: the worker attaches with layer progress
  uint32_t page_size;  // 64: whole-page pieces, as the copy engines like; 1: 2 KiB pieces
};

const DeathCase kCases[] = {
    {{"ce", "cuda-ce"}, 64},
    {{"staged", "cuda-staged"}, 1},
    {{"sm", "cuda-sm"}, 1},
    {{"staged", "cuda-staged", true}, 1},
};

std::string CaseName(const DeathCase& c) {
  return absl::StrCat(PathLabel(c.path), "_page", c.page_size);
}

void PrintTo(const DeathCase& c, std::ostream* os) { *os << CaseName(c); }

// A kernel of the test's own that holds a stream until Open(), and the
// interprocess event recorded behind it: a backup that waits on the event
// waits for Open().
class Gate {
 public:
  // Starts the kernel; its bound is a minute, in case the test fails
  // before it opens the gate.
  void Start() {
    ASSERT_CUDA(
        cudaHostAlloc(reinterpret_cast<void**>(&flag_), sizeof(uint32_t), cudaHostAllocMapped));
    *flag_ = 0;
    uint32_t* device_flag = nullptr;
    ASSERT_CUDA(cudaHostGetDevicePointer(reinterpret_cast<void**>(&device_flag), flag_, 0));
    int khz = 0;
    ASSERT_CUDA(cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, 0));
    ASSERT_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    ASSERT_CUDA(cudaEventCreateWithFlags(&event_, cudaEventInterprocess | cudaEventDisableTiming));
    ASSERT_CUDA(::kvhost::testing::LaunchWaitFlag(device_flag, 60LL * khz * 1000, stream_));
    ASSERT_CUDA(cudaEventRecord(event_, stream_));
    absl::StatusOr<std::string> handle = ExportEvent(event_);
    ASSERT_TRUE(handle.ok()) << handle.status();
    handle_hex_ = absl::BytesToHexString(*handle);
  }
  // Lets the kernel end; returns once it has.
  void Open() {
    if (flag_ == nullptr || open_) return;
    __atomic_store_n(flag_, 1u, __ATOMIC_SEQ_CST);
    open_ = true;
    ASSERT_CUDA(cudaStreamSynchronize(stream_));
  }
  ~Gate() {
    Open();
    if (event_ != nullptr) cudaEventDestroy(event_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    if (flag_ != nullptr) cudaFreeHost(flag_);
  }
  const std::string& handle_hex() const { return handle_hex_; }

 private:
  uint32_t* flag_ = nullptr;
  bool open_ = false;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t event_ = nullptr;
  std::string handle_hex_;
};

// The numbers after `marker` in the first line of `log` holding it, read
// with `format` (sscanf); false when there is none.
bool ScanLogLine(const std::string& log, const std::string& marker, const char* format, uint64_t* a,
                 uint64_t* b = nullptr, uint64_t* c = nullptr, uint64_t* d = nullptr) {
  const size_t at = log.find(marker);
  if (at == std::string::npos) return false;
  const std::string rest = log.substr(at + marker.size(), 200);
  uint64_t dummy = 0;
  const int want = 1 + (b != nullptr) + (c != nullptr) + (d != nullptr);
  return std::sscanf(rest.c_str(), format, a, b ? b : &dummy, c ? c : &dummy, d ? d : &dummy) ==
         want;
}

// Every kvhostd error or warning line that is not what a killed worker's
// session close may say (its close, a ticket cancelled, the environment's
// copy-engine and gate fallbacks).
std::vector<std::string> UnexpectedLogLines(const std::string& log) {
  static const char* const kExpectedWarnings[] = {
      " ended: ", "failed: CANCELLED", "cudaMemcpyBatchAsync", "loads queue all their copies"};
  std::vector<std::string> bad;
  std::istringstream lines(log);
  for (std::string line; std::getline(lines, line);) {
    const bool error =
        absl::StrContains(line, " E kvhostd ") || absl::StrContains(line, " C kvhostd ");
    bool warning = absl::StrContains(line, " W kvhostd ");
    for (const char* expected : kExpectedWarnings) {
      if (warning && absl::StrContains(line, expected)) warning = false;
    }
    if (error || warning) bad.push_back(line);
  }
  return bad;
}

uint64_t FreeDeviceBytes() {
  size_t free = 0, total = 0;
  if (cudaMemGetInfo(&free, &total) != cudaSuccess) return 0;
  return free;
}

class WorkerDeathTest : public ::testing::TestWithParam<DeathCase> {
 protected:
  void SetUp() override {
    std::string why;
    if (CudaDeviceCount(&why) == 0) GTEST_SKIP() << "no usable CUDA GPU: " << why;
    ASSERT_CUDA(cudaSetDevice(0));
    std::vector<std::string> flags = CudaDaemonFlags(GetParam().path);
    // The staged path at the rate it has in production, not with the round
    // trips' tiny staging buffer (the later flag wins): the dead worker's
    // 1 GiB tickets must finish well within --session-timeout.
    if (std::string_view(GetParam().path.flag) == "staged") flags.push_back(kStagingFlag);
    flags.push_back(absl::StrCat("--session-timeout=", absl::FormatDuration(kSessionTimeout)));
    flags.push_back("--metrics-listen=127.0.0.1:0");
    absl::StatusOr<std::unique_ptr<TestDaemon>> d = TestDaemon::Start(KVHOSTD_PATH, flags);
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = *std::move(d);
    metrics_port_ = MetricsPort(*daemon_);
    ASSERT_NE(metrics_port_, 0) << daemon_->Log();
    owner_ = Connect("worker-death-test");
    ASSERT_NE(owner_, nullptr);
    absl::StatusOr<v1::DaemonStatus> status = owner_->GetStatus();
    ASSERT_TRUE(status.ok()) << status.status();
    ASSERT_EQ(status->backend(), "cuda") << status->backend_detail();
  }
  void TearDown() override {
    if (daemon_ != nullptr && HasFailure()) {
      std::string log = daemon_->Log();
      if (log.size() > 12000) log = "..." + log.substr(log.size() - 12000);
      std::fprintf(stderr, "--- kvhostd log (tail) ---\n%s\n", log.c_str());
    }
  }

  // A client with the pool's owner token and no worker session: it may see
  // the worker's attachment and tickets (the token opens them), and its own
  // attachments live until it detaches them.
  std::unique_ptr<Client> Connect(const std::string& name) {
    ClientOptions options;
    options.address = daemon_->address();
    options.owner_token = kToken;
    options.worker_session = false;
    options.worker_name = name;
    absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect(options);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? *std::move(c) : nullptr;
  }

  v1::DaemonStatus Status() {
    absl::StatusOr<v1::DaemonStatus> status = owner_->GetStatus();
    EXPECT_TRUE(status.ok()) << status.status();
    return status.ok() ? *status : v1::DaemonStatus();
  }

  // Polls Status() until `done` holds or `limit` passes; the last status.
  template <typename Done>
  v1::DaemonStatus AwaitStatus(Done done, absl::Duration limit, absl::Duration* took = nullptr) {
    const absl::Time start = absl::Now();
    v1::DaemonStatus status;
    do {
      status = Status();
      if (done(status)) break;
      absl::SleepFor(absl::Milliseconds(10));
    } while (absl::Now() - start < limit);
    if (took != nullptr) *took = absl::Now() - start;
    return status;
  }

  // A backup of `rows` into `slots` and a load of them back into other rows
  // on a new attachment of `dev`, through a client of its own: the device
  // must then hold exactly its image.
  void RoundTrip(GpuKvPool& dev, const std::vector<int64_t>& slots, std::mt19937& rng,
                 const std::string& when) {
    std::unique_ptr<Client> c = Connect("worker-death-test-after");
    ASSERT_NE(c, nullptr);
    absl::StatusOr<v1::AttachDeviceRequest> request =
        MakeCudaAttachRequest(kPool, dev.layers(0), dev.layers(1), dev.rows());
    ASSERT_TRUE(request.ok()) << request.status();
    absl::StatusOr<v1::Attachment> att = c->AttachDevice(*request);
    ASSERT_TRUE(att.ok()) << att.status();
    const std::vector<int64_t> src = SourceRows(rng, slots.size());
    ASSERT_LT(static_cast<uint64_t>(src.back()), dev.rows());
    const std::vector<int64_t> dst =
        OtherRows(rng, src.size(), dev.rows(), std::set<int64_t>(src.begin(), src.end()));
    for (bool backup : {true, false}) {
      absl::StatusOr<uint64_t> t =
          backup ? c->Backup(att->id(), slots, src) : c->Load(att->id(), slots, dst);
      ASSERT_TRUE(t.ok()) << t.status();
      absl::StatusOr<v1::TransferStatus> st = c->WaitTransfer(*t, kWait);
      ASSERT_TRUE(st.ok()) << when << ": " << st.status();
      EXPECT_EQ(st->path(), GetParam().path.ticket);
      EXPECT_EQ(st->bytes(), slots.size() * pool_.bytes_per_token());
    }
    const uint32_t layers = pool_.spec().layer_num();
    for (size_t i = 0; i < dst.size(); ++i) {
      for (uint32_t kv = 0; kv < 2; ++kv) {
        for (uint32_t l = 0; l < layers; ++l) {
          std::memcpy(dev.image_row(kv, l, static_cast<uint64_t>(dst[i])),
                      dev.image_row(kv, l, static_cast<uint64_t>(src[i])), dev.row_bytes());
        }
      }
    }
    dev.ExpectMatchesImage(when);
    ASSERT_TRUE(c->DetachDevice(att->id()).ok());
  }

  // Sampled slots of [first, first + count) hold the worker's fill in every
  // plane, layer and head.
  void ExpectWorkerBytes(int64_t first, int64_t count) {
    std::unique_ptr<MappedFile> region = MappedFile::Open(pool_.region_paths(0));
    ASSERT_NE(region, nullptr) << pool_.region_paths(0);
    const Geo g = GeoOf(pool_);
    uint64_t bad = 0;
    for (int64_t t = first; t < first + count; t += 997) {
      for (uint64_t kv = 0; kv < 2; ++kv) {
        for (uint64_t l = 0; l < g.L; ++l) {
          for (uint64_t h = 0; h < g.H; ++h) {
            const uint8_t* row = region->data() + g.Offset(kv, static_cast<uint64_t>(t), l, h);
            for (uint64_t j = 0; j < g.Db; ++j) {
              if (row[j] != kWorkerFill[kv] && bad++ < 5) {
                ADD_FAILURE() << "slot " << t << " plane " << kv << " layer " << l << " head " << h
                              << " byte " << j << " is " << int{row[j]} << ", want "
                              << int{kWorkerFill[kv]} << " (the dead worker's)";
              }
            }
          }
        }
      }
    }
    EXPECT_EQ(bad, 0u);
  }

  std::unique_ptr<TestDaemon> daemon_;
  std::unique_ptr<Client> owner_;
  int metrics_port_ = 0;
  v1::Pool pool_;
};

INSTANTIATE_TEST_SUITE_P(Paths, WorkerDeathTest, ::testing::ValuesIn(kCases),
                         [](const ::testing::TestParamInfo<DeathCase>& info) {
                           return CaseName(info.param);
                         });

TEST_P(WorkerDeathTest, KilledMidTransferLeavesNothingBehind) {
  const DeathCase& param = GetParam();
  Dims dims;
  dims.layers = 8;
  dims.heads = 8;
  dims.head_dim = 128;  // BF16: 2 KiB rows, 32 KiB a token
  const uint64_t size = kWorkerTokens + kOwnTokens;
  absl::StatusOr<v1::Pool> pool = owner_->CreatePool(
      kPool, MakeSpec(v1::MHA, v1::LAYER_FIRST, param.page_size, size, v1::BF16, dims));
  ASSERT_TRUE(pool.ok()) << pool.status();
  ASSERT_TRUE(pool->owner_protected());
  pool_ = *pool;
  const Geo g = GeoOf(pool_);

  // The test's own attachment first: kvhostd's CUDA context, lanes and
  // staging exist and the pool is pinned before the baseline is taken, and
  // the attachment must outlive the worker's death untouched.
  absl::StatusOr<std::vector<int64_t>> own = owner_->Alloc(kPool, kOwnTokens);
  ASSERT_TRUE(own.ok()) << own.status();
  std::mt19937 rng(23);
  GpuKvPool dev(2, dims.layers, 4 * kOwnTokens, g.row_bytes());
  dev.Init(rng);
  if (HasFatalFailure()) return;
  RoundTrip(dev, *own, rng, "before the worker");
  if (HasFatalFailure()) return;
  absl::StatusOr<v1::AttachDeviceRequest> own_request =
      MakeCudaAttachRequest(kPool, dev.layers(0), dev.layers(1), dev.rows());
  ASSERT_TRUE(own_request.ok()) << own_request.status();
  absl::StatusOr<v1::Attachment> own_att = owner_->AttachDevice(*own_request);
  ASSERT_TRUE(own_att.ok()) << own_att.status();
  const uint64_t free_before = FreeDeviceBytes();
  const v1::DaemonStatus before = Status();

  Gate gate;
  gate.Start();
  if (HasFatalFailure()) return;
  WorkerProcess worker({DeathWorkerPath(), daemon_->address(), kPool, kToken,
                        param.path.progress ? "progress" : "plain", absl::StrCat(kWorkerTokens),
                        gate.handle_hex(), absl::StrCat(kWorkerBackups),
                        absl::StrCat(kWorkerLoads)});
  ASSERT_GT(worker.pid(), 0);
  const std::string slots_line = worker.WaitFor("slots ", kWait);
  int64_t first = -1, count = 0;
  ASSERT_EQ(std::sscanf(slots_line.c_str(), "slots %" SCNd64 " %" SCNd64, &first, &count), 2)
      << worker.output();
  ASSERT_EQ(count, kWorkerTokens);
  ASSERT_NE(worker.WaitFor("promised", kWait), "") << worker.output();
  const std::string busy = worker.WaitFor("busy ", kWait);
  ASSERT_NE(busy, "") << worker.output();
  const std::vector<std::string> words = absl::StrSplit(busy, ' ');
  ASSERT_EQ(words.size(), 7u) << busy;
  uint64_t gated = 0, load = 0;
  ASSERT_TRUE(absl::SimpleAtoi(words[2], &gated) && gated != 0) << busy;
  ASSERT_TRUE(absl::SimpleAtoi(words[4], &load)) << busy;
  const std::string worker_att = words[6];

  // Alive: its session and attachment are listed, the gated backup waits.
  v1::DaemonStatus alive = Status();
  ASSERT_EQ(alive.sessions_size(), 1);
  EXPECT_EQ(alive.sessions(0).pid(), worker.pid());
  EXPECT_EQ(alive.sessions(0).attachment_count(), 1u);
  EXPECT_EQ(alive.attachments(), 2u);
  absl::StatusOr<v1::TransferStatus> st = owner_->PollTransfer(gated);
  ASSERT_TRUE(st.ok()) << st.status();
  ASSERT_FALSE(st->done()) << "the backup behind the gate finished before the gate opened";

  worker.Kill();
  ASSERT_EQ(worker.Wait(), 128 + SIGKILL) << worker.output();
  const absl::Time reaped = absl::Now();
  // The worker and its CUDA context are gone; kvhostd still has the backup
  // behind the gate to copy from its memory.
  st = owner_->PollTransfer(gated);
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_FALSE(st->done()) << "the gated backup finished while the gate was closed";
  const uint64_t load_bytes_at_reap = Status().load_bytes();
  absl::StatusOr<v1::TransferStatus> load_st = owner_->PollTransfer(load);
  const bool load_running_at_reap = load_st.ok() && !load_st->done();

  // The session closes as soon as its stream breaks: the attachment goes,
  // its tickets stay in flight behind the gate.
  absl::Duration closed_after;
  v1::DaemonStatus closed = AwaitStatus(
      [](const v1::DaemonStatus& s) { return s.sessions_size() == 0 && s.attachments() == 1; },
      kSessionTimeout, &closed_after);
  EXPECT_EQ(closed.sessions_size(), 0);
  EXPECT_EQ(closed.attachments(), 1u) << "the test's own attachment alone";
  EXPECT_GE(closed.tickets_in_flight(), 1u) << "the gated backup";
  // Messages name the id by its prefix (the id is a capability).
  const std::string att_prefix = worker_att.substr(0, worker_att.rfind('-') + 5);
  EXPECT_ERROR(owner_->DetachDevice(worker_att), kNotFound, att_prefix);
  EXPECT_ERROR(owner_->Backup(worker_att, Range(first, 8), Range(0, 8)), kNotFound, att_prefix);
  absl::StatusOr<v1::Pool> after_close = owner_->GetPool(kPool);
  ASSERT_TRUE(after_close.ok()) << after_close.status();
  EXPECT_EQ(after_close->attachments(), 1u);
  st = owner_->PollTransfer(gated);
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_FALSE(st->done());

  // Open: the backups copy from the dead worker's memory.
  gate.Open();
  const absl::Time opened = absl::Now();
  absl::Duration drained_after;
  v1::DaemonStatus drained =
      AwaitStatus([](const v1::DaemonStatus& s) { return s.tickets_in_flight() == 0; },
                  kSessionTimeout + absl::Seconds(20), &drained_after);
  ASSERT_EQ(drained.tickets_in_flight(), 0u) << "the dead worker's tickets hang";
  st = owner_->PollTransfer(gated);
  ASSERT_TRUE(st.ok()) << "the gated backup: " << st.status();
  EXPECT_TRUE(st->done());
  EXPECT_EQ(st->path(), param.path.ticket);
  EXPECT_EQ(st->bytes(), static_cast<uint64_t>(kWorkerTokens) * pool_.bytes_per_token());
  EXPECT_EQ(st->layers_done(), dims.layers);
  load_st = owner_->PollTransfer(load);
  EXPECT_TRUE(load_st.ok() || IsError(load_st.status(), absl::StatusCode::kCancelled, {}))
      << "the load in flight at the kill: " << load_st.status();
  std::printf(
      "[ death ] %s: session closed %s after the reap; the gate opened %s after it; the dead "
      "worker's tickets done %s later; at the reap a load was %s and %" PRIu64
      " load bytes finished after it\n",
      CaseName(param).c_str(), absl::FormatDuration(closed_after).c_str(),
      absl::FormatDuration(opened - reaped).c_str(), absl::FormatDuration(drained_after).c_str(),
      load_running_at_reap ? "still running" : "already done",
      drained.load_bytes() - load_bytes_at_reap);
  ExpectWorkerBytes(first, kWorkerTokens);

  // What the daemon said of the session: the close, with the transfers in
  // flight, and the reaper's tally, none late.
  std::string log;
  uint64_t in_flight = 0, of = 0, ok = 0, failed = 0, late = 0;
  for (int i = 0; i < 200; ++i) {
    log = daemon_->Log();
    if (ScanLogLine(log, "closed: of its ",
                    "%" SCNu64 " transfer(s) in flight %" SCNu64 " finished, %" SCNu64
                    " failed or were cancelled, %" SCNu64,
                    &of, &ok, &failed, &late)) {
      break;
    }
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_TRUE(absl::StrContains(log, "of worker 'gpu-death-worker-")) << log;
  EXPECT_TRUE(ScanLogLine(log, "closed 1 attachment(s), ", "%" SCNu64, &in_flight)) << log;
  EXPECT_GE(in_flight, 1u);
  EXPECT_EQ(of, in_flight) << log;
  EXPECT_EQ(late, 0u) << "tickets outlived --session-timeout\n" << log;
  EXPECT_EQ(ok + failed, of);
  std::printf("[ death ] %s: %" PRIu64 " transfer(s) in flight at the close, %" PRIu64
              " finished, %" PRIu64 " failed or cancelled\n",
              CaseName(param).c_str(), of, ok, failed);
  if (HasFatalFailure()) return;

  // The daemon serves: a new client's new attachment round-trips exactly.
  RoundTrip(dev, *own, rng, "after the worker died");
  if (HasFatalFailure()) return;
  ASSERT_TRUE(owner_->DetachDevice(own_att->id()).ok());

  // The allocator: the dead worker's slots are still its (nothing freed
  // behind the test's back); freeing them and the test's own gives every
  // slot back.
  absl::StatusOr<v1::Pool> now = owner_->GetPool(kPool);
  ASSERT_TRUE(now.ok()) << now.status();
  EXPECT_EQ(now->attachments(), 0u);
  EXPECT_EQ(now->available_tokens(), size - kWorkerTokens - kOwnTokens);
  absl::StatusOr<uint64_t> freed = owner_->Free(kPool, Range(first, kWorkerTokens));
  ASSERT_TRUE(freed.ok()) << freed.status();
  EXPECT_EQ(*freed, static_cast<uint64_t>(kWorkerTokens));
  freed = owner_->Free(kPool, *own);
  ASSERT_TRUE(freed.ok()) << freed.status();
  EXPECT_EQ(*freed, static_cast<uint64_t>(kOwnTokens));
  now = owner_->GetPool(kPool);
  ASSERT_TRUE(now.ok()) << now.status();
  EXPECT_EQ(now->available_tokens(), now->size_tokens());

  // Status and metrics: nothing attached, no session, no ticket.
  const v1::DaemonStatus end = Status();
  EXPECT_EQ(end.attachments(), 0u);
  EXPECT_EQ(end.sessions_size(), 0);
  EXPECT_EQ(end.tickets_in_flight(), 0u);
  EXPECT_GE(end.tickets_done(), before.tickets_done() + 2);
  const Scrape metrics = ScrapeMetrics(metrics_port_);
  const std::string p = absl::StrCat("{pool=\"", kPool, "\"}");
  EXPECT_EQ(SeriesValue(metrics, "kvhost_attachments"), 0);
  EXPECT_EQ(SeriesValue(metrics, "kvhost_sessions"), 0);
  EXPECT_EQ(SeriesValue(metrics, "kvhost_transfer_tickets_in_flight"), 0);
  EXPECT_EQ(SeriesValue(metrics, "kvhost_pool_attachments" + p), 0);
  EXPECT_EQ(SeriesValue(metrics, "kvhost_pool_used_tokens" + p), 0);

  // The dead worker's 2 GiB come back to the GPU once kvhostd closed its
  // mapping (the test's own buffers are still allocated, as at the baseline).
  uint64_t free_after = 0;
  for (int i = 0; i < 500 && free_after + kDeviceSlack < free_before; ++i) {
    free_after = FreeDeviceBytes();
    if (free_after + kDeviceSlack >= free_before) break;
    absl::SleepFor(absl::Milliseconds(20));
  }
  std::printf("[ death ] %s: GPU memory free %.2f GiB before the worker, %.2f GiB after\n",
              CaseName(param).c_str(), free_before / 1073741824.0, free_after / 1073741824.0);
  EXPECT_GE(free_after + kDeviceSlack, free_before)
      << "the dead worker's device memory did not come back: kvhostd keeps its mapping";

  // The pool deleted is unmapped at once: no job holds it any more.
  ASSERT_TRUE(owner_->DeletePool(kPool).ok());
  const v1::DaemonStatus gone = AwaitStatus(
      [](const v1::DaemonStatus& s) { return s.pools() == 0 && s.pool_bytes_releasing() == 0; },
      absl::Seconds(10));
  EXPECT_EQ(gone.pools(), 0u);
  EXPECT_EQ(gone.pool_bytes_releasing(), 0u);

  for (const std::string& line : UnexpectedLogLines(daemon_->Log())) {
    ADD_FAILURE() << "kvhostd logged: " << line;
  }
}

}  // namespace
}  // namespace kvhost
