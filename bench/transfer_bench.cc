// kvhost_transfer_bench: GB/s of kvhostd's host transfer engine for every host
// layout and page size, both directions, next to the ceiling that a plain
// memcpy of the same bytes reaches on the same machine in the same run.
//
// The item is a realistic KV row: MHA 8 KV heads x 128 dims bf16 (2 KB per
// token and layer for each of K and V), MLA 512 + 64 dims bf16 (1152 bytes per
// token and layer), --layers layers. A transfer moves --tokens slots, whole
// pages picked at random on both sides (host slots in a pool of twice that
// many, device rows in an emulated device pool of twice that many), as a
// fragmented prefix cache would hand them over. Per layout and page size:
// one warm-up, then --repeats timed transfers per direction; the median is
// reported as engine GB/s (bytes over the ticket's accept-to-done time inside
// kvhostd) and client GB/s (bytes over submit to WaitTransfer return).
//
// The ceiling: memcpy of the same total bytes between two populated
// shared-memory buffers, by one thread and by as many threads as the engine
// runs per direction (--copy-threads helpers plus the direction's driver).
//
// Starts its own kvhostd (host backend, private socket and shm dir). Prints
// one progress line per case, then a table; --json-out writes the numbers as
// JSON; --quick runs a small subset for CI. Exit codes: 0 done, 1 a call
// failed, 2 bad flags.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "bench/bench_util.h"
#include "common/cli_flags.h"
#include "kvhost/client.h"
#include "tests/daemon_fixture.h"

ABSL_FLAG(std::string, kvhostd, KVHOSTD_PATH, "kvhostd binary to start.");
ABSL_FLAG(uint64_t, tokens, 8192, "Token slots per transfer; a multiple of every page size.");
ABSL_FLAG(uint32_t, layers, 32, "Layers of the pools.");
ABSL_FLAG(std::vector<std::string>, page_sizes, std::vector<std::string>({"1", "16", "64"}),
          "Page sizes to measure, comma separated.");
ABSL_FLAG(int, repeats, 3, "Timed transfers per case and direction, after one warm-up.");
ABSL_FLAG(int, copy_threads, 2, "kvhostd --copy-threads: helper threads per direction.");
ABSL_FLAG(int, memcpy_threads, 0,
          "Threads of the multi-threaded memcpy ceiling; 0 = --copy-threads + 1, the threads "
          "the engine runs per direction.");
ABSL_FLAG(uint64_t, seed, 1, "Seed of the random slot choice.");
ABSL_FLAG(bool, quick, false,
          "CI smoke run: 512 tokens, 4 layers, page size 16, one repeat, three layouts.");
ABSL_FLAG(std::string, json_out, "", "Write the results as JSON to this file.");

namespace {

using Clock = std::chrono::steady_clock;
namespace bench = kvhost::bench;
namespace v1 = kvhost::v1;

struct Options {
  uint64_t tokens = 0;
  uint32_t layers = 0;
  std::vector<uint64_t> page_sizes;
  int repeats = 0;
  int copy_threads = 0;
  int memcpy_threads = 0;
  uint64_t seed = 0;
  bool quick = false;
};

struct Case {
  v1::PoolKind kind;
  v1::Layout layout;
  uint32_t page_size;
};

// One direction of one case.
struct Measured {
  uint64_t bytes = 0;
  double engine_gbps = 0;
  double client_gbps = 0;
};

struct CaseResult {
  Case c;
  Measured backup, load;
};

struct Ceiling {
  v1::PoolKind kind;
  uint64_t bytes = 0;
  double single_gbps = 0;
  double multi_gbps = 0;
};

absl::StatusOr<Options> OptionsFromFlags() {
  Options o;
  o.quick = absl::GetFlag(FLAGS_quick);
  o.tokens = o.quick ? 512 : absl::GetFlag(FLAGS_tokens);
  o.layers = o.quick ? 4 : absl::GetFlag(FLAGS_layers);
  o.repeats = o.quick ? 1 : absl::GetFlag(FLAGS_repeats);
  if (o.quick) {
    o.page_sizes = {16};
  } else {
    absl::StatusOr<std::vector<uint64_t>> sizes =
        bench::ParsePositiveList("page-sizes", absl::GetFlag(FLAGS_page_sizes));
    if (!sizes.ok()) return sizes.status();
    o.page_sizes = *sizes;
  }
  o.copy_threads = absl::GetFlag(FLAGS_copy_threads);
  o.memcpy_threads = absl::GetFlag(FLAGS_memcpy_threads);
  if (o.memcpy_threads == 0) o.memcpy_threads = o.copy_threads + 1;
  o.seed = absl::GetFlag(FLAGS_seed);
  if (o.tokens == 0 || o.layers == 0) {
    return absl::InvalidArgumentError("--tokens and --layers must be >= 1");
  }
  for (uint64_t ps : o.page_sizes) {
    if (o.tokens % ps != 0 || ps > UINT32_MAX) {
      return absl::InvalidArgumentError(
          absl::StrCat("--tokens ", o.tokens, " is not a multiple of page size ", ps));
    }
  }
  if (o.repeats < 1) return absl::InvalidArgumentError("--repeats must be >= 1");
  if (o.copy_threads < 0 || o.memcpy_threads < 1) {
    return absl::InvalidArgumentError("--copy-threads must be >= 0 and --memcpy-threads >= 1");
  }
  return o;
}

std::vector<Case> MakeCases(const Options& o) {
  struct Shape {
    v1::PoolKind kind;
    v1::Layout layout;
  };
  const std::vector<Shape> shapes =
      o.quick
          ? std::vector<Shape>{{v1::MHA, v1::PAGE_FIRST},
                               {v1::MHA, v1::PAGE_HEAD},
                               {v1::MLA, v1::LAYER_FIRST}}
          : std::vector<Shape>{{v1::MHA, v1::LAYER_FIRST},       {v1::MHA, v1::PAGE_FIRST},
                               {v1::MHA, v1::PAGE_FIRST_DIRECT}, {v1::MHA, v1::PAGE_HEAD},
                               {v1::MHA, v1::PAGE_UNIFIED},      {v1::MLA, v1::LAYER_FIRST},
                               {v1::MLA, v1::PAGE_FIRST},        {v1::MLA, v1::PAGE_FIRST_DIRECT},
                               {v1::MLA, v1::PAGE_UNIFIED}};
  std::vector<Case> cases;
  for (const Shape& s : shapes) {
    for (uint64_t ps : o.page_sizes) cases.push_back({s.kind, s.layout, static_cast<uint32_t>(ps)});
  }
  return cases;
}

v1::PoolSpec SpecFor(const Options& o, v1::PoolKind kind, v1::Layout layout, uint32_t page_size) {
  // Twice the transfer, so that the random half it moves is fragmented.
  return bench::BenchPoolSpec(kind, layout, page_size, o.layers, 2 * o.tokens);
}

uint64_t TransferBytes(const Options& o, v1::PoolKind kind) {
  const v1::PoolSpec spec = SpecFor(o, kind, v1::LAYER_FIRST, 1);
  const uint64_t planes = kind == v1::MLA ? 1 : 2;
  return o.tokens * kvhost::DeviceRowBytes(spec) * spec.layer_num() * planes;
}

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// Copies one buffer into another with N threads, each one contiguous slice:
// the caller's thread and N - 1 helpers kept alive between copies, as the
// engine keeps its helpers, so the ceiling does not pay for thread start-up.
class ParallelCopier {
 public:
  explicit ParallelCopier(int threads) : threads_(threads) {
    for (int i = 1; i < threads_; ++i) helpers_.emplace_back([this, i] { HelperLoop(i); });
  }
  ~ParallelCopier() {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    for (std::thread& t : helpers_) t.join();
  }
  ParallelCopier(const ParallelCopier&) = delete;
  ParallelCopier& operator=(const ParallelCopier&) = delete;

  // Returns the seconds from the start until every slice is copied.
  double Copy(uint8_t* dst, const uint8_t* src, uint64_t bytes) {
    const Clock::time_point start = Clock::now();
    {
      absl::MutexLock lock(&mu_);
      dst_ = dst;
      src_ = src;
      bytes_ = bytes;
      pending_ = threads_ - 1;
      ++generation_;
    }
    CopySlice(0, dst, src, bytes);
    absl::MutexLock lock(&mu_);
    auto all_done = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return pending_ == 0; };
    mu_.Await(absl::Condition(&all_done));
    return Seconds(Clock::now() - start);
  }

 private:
  void CopySlice(int index, uint8_t* dst, const uint8_t* src, uint64_t bytes) const {
    // Slices on cache-line boundaries, so that no two threads write one line.
    const uint64_t slice = (bytes / threads_ + 63) / 64 * 64;
    const uint64_t begin = std::min(bytes, slice * index);
    const uint64_t end = std::min(bytes, begin + slice);
    std::memcpy(dst + begin, src + begin, end - begin);
  }

  void HelperLoop(int index) {
    uint64_t seen = 0;
    while (true) {
      uint8_t* dst;
      const uint8_t* src;
      uint64_t bytes;
      {
        absl::MutexLock lock(&mu_);
        auto ready = [this, seen]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          return stop_ || generation_ != seen;
        };
        mu_.Await(absl::Condition(&ready));
        if (stop_) return;
        seen = generation_;
        dst = dst_;
        src = src_;
        bytes = bytes_;
      }
      CopySlice(index, dst, src, bytes);
      absl::MutexLock lock(&mu_);
      --pending_;
    }
  }

  const int threads_;
  absl::Mutex mu_;
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  int pending_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  uint8_t* dst_ ABSL_GUARDED_BY(mu_) = nullptr;
  const uint8_t* src_ ABSL_GUARDED_BY(mu_) = nullptr;
  uint64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::thread> helpers_;
};

absl::StatusOr<Ceiling> MeasureCeiling(const Options& o, const std::string& shm_dir,
                                       v1::PoolKind kind) {
  Ceiling ceiling;
  ceiling.kind = kind;
  ceiling.bytes = TransferBytes(o, kind);
  absl::StatusOr<std::unique_ptr<bench::ShmScratch>> src =
      bench::ShmScratch::Create(shm_dir, ceiling.bytes);
  if (!src.ok()) return src.status();
  absl::StatusOr<std::unique_ptr<bench::ShmScratch>> dst =
      bench::ShmScratch::Create(shm_dir, ceiling.bytes);
  if (!dst.ok()) return dst.status();
  std::memset((*src)->data(), 0x5a, ceiling.bytes);
  // A ceiling is cheap to measure; at least three runs keep one slow run out.
  const int runs = std::max(o.repeats, 3);
  for (int threads : {1, o.memcpy_threads}) {
    ParallelCopier copier(threads);
    copier.Copy((*dst)->data(), (*src)->data(), ceiling.bytes);  // warm-up
    std::vector<double> seconds;
    for (int r = 0; r < runs; ++r) {
      seconds.push_back(copier.Copy((*dst)->data(), (*src)->data(), ceiling.bytes));
    }
    const double gbps = ceiling.bytes / bench::Median(seconds) / 1e9;
    (threads == 1 ? ceiling.single_gbps : ceiling.multi_gbps) = gbps;
  }
  return ceiling;
}

// `count` distinct pages out of `pages`, in random order, expanded to slots.
std::vector<int64_t> RandomPageSlots(uint64_t pages, uint64_t count, uint32_t page_size,
                                     std::mt19937_64& rng) {
  std::vector<uint64_t> ids(pages);
  for (uint64_t p = 0; p < pages; ++p) ids[p] = p;
  std::vector<int64_t> slots;
  slots.reserve(count * page_size);
  for (uint64_t i = 0; i < count; ++i) {
    std::uniform_int_distribution<uint64_t> pick(i, pages - 1);
    std::swap(ids[i], ids[pick(rng)]);
    for (uint32_t j = 0; j < page_size; ++j) {
      slots.push_back(static_cast<int64_t>(ids[i] * page_size + j));
    }
  }
  return slots;
}

absl::StatusOr<Measured> MeasureDirection(kvhost::Client& client, const std::string& attachment,
                                          bool backup, const std::vector<int64_t>& host,
                                          const std::vector<int64_t>& device, uint64_t bytes,
                                          int repeats) {
  std::vector<double> engine_s, client_s;
  for (int run = 0; run <= repeats; ++run) {  // run 0 warms up
    const Clock::time_point start = Clock::now();
    absl::StatusOr<uint64_t> ticket =
        backup ? client.Backup(attachment, host, device) : client.Load(attachment, host, device);
    if (!ticket.ok()) return ticket.status();
    absl::StatusOr<v1::TransferStatus> status = client.WaitTransfer(*ticket);
    if (!status.ok()) return status.status();
    const double wall = Seconds(Clock::now() - start);
    if (status->bytes() != bytes) {
      return absl::InternalError(absl::StrCat("ticket ", *ticket, " copied ", status->bytes(),
                                              " bytes, expected ", bytes));
    }
    if (run == 0) continue;
    // duration_us has microsecond resolution; never divide by zero.
    engine_s.push_back(std::max<double>(status->duration_us(), 1) / 1e6);
    client_s.push_back(wall);
  }
  Measured m;
  m.bytes = bytes;
  m.engine_gbps = bytes / bench::Median(engine_s) / 1e9;
  m.client_gbps = bytes / bench::Median(client_s) / 1e9;
  return m;
}

// Device pools are per kind, reused by every case of that kind (the row shape
// does not depend on the host layout); the daemon maps one per attachment.
struct DevicePools {
  v1::PoolKind kind = v1::POOL_KIND_UNSPECIFIED;
  std::unique_ptr<kvhost::ShmDevicePool> pool;
};

// Allocates the whole pool and moves a random half of it each way.
absl::StatusOr<CaseResult> MeasureCase(const Options& o, const Case& c, kvhost::Client& client,
                                       const v1::Pool& pool, const kvhost::ShmDevicePool& device,
                                       const std::string& attachment, std::mt19937_64& rng) {
  absl::StatusOr<std::vector<int64_t>> all = client.Alloc(pool.name(), pool.size_tokens());
  if (!all.ok()) return all.status();
  const uint64_t pages = o.tokens / c.page_size;
  const std::vector<int64_t> host = RandomPageSlots(pool.page_num(), pages, c.page_size, rng);
  const std::vector<int64_t> rows =
      RandomPageSlots(device.rows() / c.page_size, pages, c.page_size, rng);
  const uint64_t bytes = o.tokens * pool.bytes_per_token();
  CaseResult r;
  r.c = c;
  absl::StatusOr<Measured> backup =
      MeasureDirection(client, attachment, /*backup=*/true, host, rows, bytes, o.repeats);
  if (!backup.ok()) return backup.status();
  absl::StatusOr<Measured> load =
      MeasureDirection(client, attachment, /*backup=*/false, host, rows, bytes, o.repeats);
  if (!load.ok()) return load.status();
  r.backup = *backup;
  r.load = *load;
  return r;
}

// Creates the case's pool and attaches the kind's device pool, measures, and
// detaches and deletes the pool again whatever happened.
absl::StatusOr<CaseResult> RunCase(const Options& o, const Case& c, kvhost::Client& client,
                                   const std::string& shm_dir, DevicePools& devices,
                                   std::mt19937_64& rng) {
  const std::string name = absl::StrCat("xfer-", v1::PoolKind_Name(c.kind), "-",
                                        v1::Layout_Name(c.layout), "-ps", c.page_size);
  absl::StatusOr<v1::Pool> pool =
      client.CreatePool(name, SpecFor(o, c.kind, c.layout, c.page_size));
  if (!pool.ok()) return pool.status();
  absl::StatusOr<CaseResult> result = absl::UnknownError("not run");
  if (devices.kind != c.kind) {
    devices.pool.reset();  // the other kind's memory goes first
    devices.kind = v1::POOL_KIND_UNSPECIFIED;
    absl::StatusOr<std::unique_ptr<kvhost::ShmDevicePool>> created =
        kvhost::ShmDevicePool::Create(*pool, 2 * o.tokens, shm_dir);
    if (created.ok()) {
      devices.pool = *std::move(created);
      devices.kind = c.kind;
    } else {
      result = created.status();
    }
  }
  if (devices.pool != nullptr) {
    absl::StatusOr<v1::Attachment> attachment =
        client.AttachDevice(devices.pool->MakeAttachRequest(name));
    if (attachment.ok()) {
      result = MeasureCase(o, c, client, *pool, *devices.pool, attachment->id(), rng);
      absl::Status detached = client.DetachDevice(attachment->id());
      if (!detached.ok() && result.ok()) result = detached;
    } else {
      result = attachment.status();
    }
  }
  absl::Status deleted = client.DeletePool(name).status();
  if (!deleted.ok() && result.ok()) result = deleted;
  return result;
}

std::string KindName(v1::PoolKind kind) { return v1::PoolKind_Name(kind); }

absl::Status Run(const Options& o) {
  absl::StatusOr<std::unique_ptr<kvhost::testing::TestDaemon>> daemon =
      kvhost::testing::TestDaemon::Start(
          absl::GetFlag(FLAGS_kvhostd),
          {"--log-level=warn", absl::StrCat("--copy-threads=", o.copy_threads)});
  if (!daemon.ok()) return daemon.status();
  kvhost::Client& client = (*daemon)->client();
  const std::vector<Case> cases = MakeCases(o);
  absl::PrintF(
      "kvhost_transfer_bench: kvhostd (host backend, %d copy threads per direction) at %s\n"
      "%d tokens per transfer, %d layers, %d timed repeats per case; %d hardware threads\n",
      o.copy_threads, (*daemon)->address(), o.tokens, o.layers, o.repeats,
      std::thread::hardware_concurrency());

  std::vector<Ceiling> ceilings;
  for (v1::PoolKind kind : {v1::MHA, v1::MLA}) {
    const bool used =
        std::any_of(cases.begin(), cases.end(), [&](const Case& c) { return c.kind == kind; });
    if (!used) continue;
    absl::PrintF("memcpy ceiling, %s transfer of %.3f GB: ", KindName(kind),
                 TransferBytes(o, kind) / 1e9);
    std::fflush(stdout);
    absl::StatusOr<Ceiling> ceiling = MeasureCeiling(o, (*daemon)->shm_dir(), kind);
    if (!ceiling.ok()) return ceiling.status();
    absl::PrintF("1 thread %.2f GB/s, %d threads %.2f GB/s\n", ceiling->single_gbps,
                 o.memcpy_threads, ceiling->multi_gbps);
    ceilings.push_back(*ceiling);
  }
  auto ceiling_of = [&](v1::PoolKind kind) -> const Ceiling& {
    return *std::find_if(ceilings.begin(), ceilings.end(),
                         [&](const Ceiling& c) { return c.kind == kind; });
  };

  std::mt19937_64 rng(o.seed);
  DevicePools devices;
  std::vector<CaseResult> results;
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    absl::PrintF("[%d/%d] %s %s page %d: ", i + 1, cases.size(), KindName(c.kind),
                 v1::Layout_Name(c.layout), c.page_size);
    std::fflush(stdout);
    absl::StatusOr<CaseResult> r = RunCase(o, c, client, (*daemon)->shm_dir(), devices, rng);
    if (!r.ok()) {
      absl::PrintF("failed\n");
      return r.status();
    }
    const Ceiling& ceiling = ceiling_of(c.kind);
    absl::PrintF("backup %.2f GB/s (%.2fx memcpy), load %.2f GB/s (%.2fx memcpy)\n",
                 r->backup.engine_gbps, r->backup.engine_gbps / ceiling.multi_gbps,
                 r->load.engine_gbps, r->load.engine_gbps / ceiling.multi_gbps);
    results.push_back(*r);
  }

  const std::string mt = absl::StrCat("/", o.memcpy_threads, "T");
  std::printf("\n");
  std::vector<std::vector<std::string>> rows = {
      {"KIND", "LAYOUT", "PAGE", "BACKUP GB/S", "/1T", mt, "LOAD GB/S", "/1T", mt}};
  std::vector<std::string> json_cases;
  for (const CaseResult& r : results) {
    const Ceiling& ceiling = ceiling_of(r.c.kind);
    rows.push_back({KindName(r.c.kind), v1::Layout_Name(r.c.layout), absl::StrCat(r.c.page_size),
                    absl::StrFormat("%.2f", r.backup.engine_gbps),
                    absl::StrFormat("%.2f", r.backup.engine_gbps / ceiling.single_gbps),
                    absl::StrFormat("%.2f", r.backup.engine_gbps / ceiling.multi_gbps),
                    absl::StrFormat("%.2f", r.load.engine_gbps),
                    absl::StrFormat("%.2f", r.load.engine_gbps / ceiling.single_gbps),
                    absl::StrFormat("%.2f", r.load.engine_gbps / ceiling.multi_gbps)});
    for (bool backup : {true, false}) {
      const Measured& m = backup ? r.backup : r.load;
      json_cases.push_back(bench::JsonObject()
                               .Str("kind", KindName(r.c.kind))
                               .Str("layout", v1::Layout_Name(r.c.layout))
                               .Uint("page_size", r.c.page_size)
                               .Str("direction", backup ? "backup" : "load")
                               .Uint("bytes", m.bytes)
                               .Num("engine_gb_per_s", m.engine_gbps)
                               .Num("client_gb_per_s", m.client_gbps)
                               .Num("vs_memcpy_1t", m.engine_gbps / ceiling.single_gbps)
                               .Num("vs_memcpy_mt", m.engine_gbps / ceiling.multi_gbps)
                               .str());
    }
  }
  bench::PrintTable(rows, "lllrrrrrr");
  absl::PrintF(
      "(engine GB/s: bytes over kvhostd's accept-to-done ticket time, median of %d; /1T and %s: "
      "ratio to memcpy of the same bytes by 1 and %d threads)\n",
      o.repeats, mt, o.memcpy_threads);

  const std::string json_out = absl::GetFlag(FLAGS_json_out);
  if (!json_out.empty()) {
    std::vector<std::string> json_ceilings;
    for (const Ceiling& c : ceilings) {
      json_ceilings.push_back(bench::JsonObject()
                                  .Str("kind", KindName(c.kind))
                                  .Uint("bytes", c.bytes)
                                  .Num("single_thread_gb_per_s", c.single_gbps)
                                  .Num("multi_thread_gb_per_s", c.multi_gbps)
                                  .str());
    }
    const std::string json = bench::JsonObject()
                                 .Str("benchmark", "kvhost_transfer_bench")
                                 .Uint("tokens", o.tokens)
                                 .Uint("layers", o.layers)
                                 .Uint("repeats", o.repeats)
                                 .Uint("copy_threads", o.copy_threads)
                                 .Uint("memcpy_threads", o.memcpy_threads)
                                 .Uint("hardware_threads", std::thread::hardware_concurrency())
                                 .Bool("quick", o.quick)
                                 .Raw("memcpy", bench::JsonArray(json_ceilings))
                                 .Raw("cases", bench::JsonArray(json_cases))
                                 .str();
    return bench::WriteJsonOut(json_out, json);
  }
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  kvhost::ParseFlags(argc, argv,
                     "kvhost_transfer_bench: GB/s of kvhostd's host transfer engine per layout, "
                     "page size and direction, against memcpy.\n"
                     "Usage: kvhost_transfer_bench [--quick] [--tokens=8192] [--layers=32] "
                     "[--page-sizes=1,16,64] [--json-out=FILE]",
                     "bench/transfer_bench.cc");
  return bench::Finish(OptionsFromFlags(), Run);
}
