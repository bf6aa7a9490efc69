// demo: a self-checking workload against the host backend. It creates a pool
// and an emulated device pool in shared memory, runs backup / load cycles
// between them verified byte for byte, reports GB/s and RPC latency
// (demo_report.cc), and cleans up however the run ends.
#include "client/kvhostctl/demo.h"

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/kvhostctl/commands.h"
#include "client/kvhostctl/errors.h"
#include "client/kvhostctl/interrupt.h"
#include "client/kvhostctl/output.h"
#include "client/kvhostctl/parse.h"

ABSL_FLAG(std::string, shm_dir, "",
          "demo: directory of the emulated device pool's file; must be kvhostd's --shm-dir. "
          "'' = the daemon's, as GetStatus reports it.");
ABSL_FLAG(std::string, demo_pool, "demo", "demo: name of the pool it creates (and deletes).");
ABSL_FLAG(std::string, demo_kind, "mha",
          "demo: mha (8 heads x 128 dims) or mla (512 + 64 dims); bf16, page size 16.");
ABSL_FLAG(std::string, demo_layout, "page_first", "demo: host layout, as --layout.");
ABSL_FLAG(uint32_t, demo_layers, 8, "demo: layers.");
ABSL_FLAG(uint64_t, demo_tokens, 65536, "demo: host pool size in tokens.");
ABSL_FLAG(uint64_t, demo_device_tokens, 8192, "demo: rows per layer of the device pool.");
ABSL_FLAG(uint64_t, demo_batch_tokens, 2048,
          "demo: tokens moved each way per cycle, a multiple of the page size.");
ABSL_FLAG(int, demo_cycles, 20, "demo: backup / load / verify cycles.");
ABSL_FLAG(uint64_t, demo_seed, 1, "demo: seed of the device bytes and the rows chosen.");

namespace kvhost::ctl {
namespace {

using Clock = std::chrono::steady_clock;

// Page size of the demo pools: the common inference-engine page.
constexpr uint32_t kDemoPageSize = 16;

absl::Status CheckDemoOptions(const DemoOptions& o) {
  if (o.cycles < 1) return UsageError("--demo-cycles must be >= 1");
  if (o.batch_tokens == 0 || o.batch_tokens % kDemoPageSize != 0) {
    return UsageError(absl::StrCat("--demo-batch-tokens ", o.batch_tokens,
                                   " must be a positive multiple of the page size ",
                                   kDemoPageSize));
  }
  if (o.batch_tokens > o.device_tokens / kDemoPageSize * kDemoPageSize) {
    return UsageError(absl::StrCat("--demo-batch-tokens ", o.batch_tokens,
                                   " needs that many page-aligned rows in --demo-device-tokens ",
                                   o.device_tokens));
  }
  if (o.batch_tokens > o.spec.size_tokens()) {
    return UsageError(absl::StrCat("--demo-batch-tokens ", o.batch_tokens,
                                   " exceeds --demo-tokens ", o.spec.size_tokens()));
  }
  return absl::OkStatus();
}

absl::StatusOr<DemoOptions> DemoOptionsFromFlags() {
  DemoOptions o;
  o.pool = absl::GetFlag(FLAGS_demo_pool);
  absl::StatusOr<int> kind =
      ParseEnumFlag("demo_kind", absl::GetFlag(FLAGS_demo_kind), v1::PoolKind_descriptor());
  if (!kind.ok()) return kind.status();
  absl::StatusOr<int> layout =
      ParseEnumFlag("demo_layout", absl::GetFlag(FLAGS_demo_layout), v1::Layout_descriptor());
  if (!layout.ok()) return layout.status();
  o.spec.set_kind(static_cast<v1::PoolKind>(*kind));
  o.spec.set_layout(static_cast<v1::Layout>(*layout));
  o.spec.set_dtype(v1::BF16);
  o.spec.set_page_size(kDemoPageSize);
  o.spec.set_layer_num(absl::GetFlag(FLAGS_demo_layers));
  if (o.spec.kind() == v1::MLA) {
    // DeepSeek-V3's latent: 512 + 64 rotary.
    o.spec.set_kv_lora_rank(512);
    o.spec.set_qk_rope_head_dim(64);
  } else {
    o.spec.set_head_num(8);
    o.spec.set_head_dim(128);
  }
  o.spec.set_size_tokens(absl::GetFlag(FLAGS_demo_tokens));
  o.device_tokens = absl::GetFlag(FLAGS_demo_device_tokens);
  o.batch_tokens = absl::GetFlag(FLAGS_demo_batch_tokens);
  o.cycles = absl::GetFlag(FLAGS_demo_cycles);
  o.seed = absl::GetFlag(FLAGS_demo_seed);
  o.shm_dir = absl::GetFlag(FLAGS_shm_dir);
  if (absl::Status s = CheckDemoOptions(o); !s.ok()) return s;
  return o;
}

// Undoes what the demo set up in the daemon, newest first, however the run
// ends, so that a failed or interrupted demo leaves no attachment or pool.
class DemoCleanup {
 public:
  explicit DemoCleanup(Client* client) : client_(client) {}
  DemoCleanup(const DemoCleanup&) = delete;
  DemoCleanup& operator=(const DemoCleanup&) = delete;
  ~DemoCleanup() {
    if (!attachment_.empty()) {
      Warn(client_->DetachDevice(attachment_), absl::StrCat("detach ", attachment_));
    }
    if (!pool_.empty()) {
      Warn(client_->DeletePool(pool_).status(), absl::StrCat("delete pool '", pool_, "'"));
    }
  }
  void set_pool(const std::string& pool) { pool_ = pool; }
  void set_attachment(const std::string& id) { attachment_ = id; }

 private:
  static void Warn(const absl::Status& status, const std::string& what) {
    if (status.ok()) return;
    absl::FPrintF(stderr, "warning: cleanup could not %s: %s\n", what, status.ToString());
  }
  Client* const client_;
  std::string pool_;
  std::string attachment_;
};

// Fills every device row with random bytes that are never zero, so that a row
// the load failed to write (left zeroed) can never pass verification.
void FillNonZero(const ShmDevicePool& device, std::mt19937_64& rng) {
  const uint64_t layer_bytes = device.rows() * device.row_bytes();
  for (uint32_t plane = 0; plane < device.planes(); ++plane) {
    for (uint32_t layer = 0; layer < device.layers(); ++layer) {
      uint8_t* p = device.layer(plane, layer);
      for (uint64_t off = 0; off < layer_bytes; off += 8) {
        const uint64_t word = rng() | 0x0101010101010101ULL;
        std::memcpy(p + off, &word, std::min<uint64_t>(8, layer_bytes - off));
      }
    }
  }
}

// Where row `i` of `rows` of (plane, layer) is kept in the saved copy.
uint64_t SavedOffset(const ShmDevicePool& device, uint32_t plane, uint32_t layer, size_t rows,
                     size_t i) {
  return ((uint64_t{plane} * device.layers() + layer) * rows + i) * device.row_bytes();
}

// Copies the chosen device rows into `saved`, then zeroes them, so that the
// load must bring them back.
void SaveAndClear(const ShmDevicePool& device, const std::vector<int64_t>& rows,
                  std::vector<uint8_t>* saved) {
  const uint64_t rb = device.row_bytes();
  for (uint32_t plane = 0; plane < device.planes(); ++plane) {
    for (uint32_t layer = 0; layer < device.layers(); ++layer) {
      for (size_t i = 0; i < rows.size(); ++i) {
        uint8_t* row = device.row(plane, layer, rows[i]);
        std::memcpy(saved->data() + SavedOffset(device, plane, layer, rows.size(), i), row, rb);
        std::memset(row, 0, rb);
      }
    }
  }
}

// Compares every chosen device row with its saved copy; names the first
// differing byte.
absl::Status Verify(const ShmDevicePool& device, const std::vector<int64_t>& host,
                    const std::vector<int64_t>& rows, const std::vector<uint8_t>& saved,
                    int cycle) {
  const uint64_t rb = device.row_bytes();
  for (uint32_t plane = 0; plane < device.planes(); ++plane) {
    for (uint32_t layer = 0; layer < device.layers(); ++layer) {
      for (size_t i = 0; i < rows.size(); ++i) {
        const uint8_t* got = device.row(plane, layer, rows[i]);
        const uint8_t* want = saved.data() + SavedOffset(device, plane, layer, rows.size(), i);
        if (std::memcmp(got, want, rb) == 0) continue;
        uint64_t b = 0;
        while (got[b] == want[b]) ++b;
        return MismatchError(absl::StrFormat(
            "cycle %d: device row %d (host slot %d), %s, layer %d, byte %d of the row: wrote "
            "0x%02x, read back 0x%02x",
            cycle, rows[i], host[i], device.planes() == 2 ? (plane == 0 ? "K" : "V") : "latent",
            layer, b, want[b], got[b]));
      }
    }
  }
  return absl::OkStatus();
}

// Runs one ticket to its end; adds its bytes and its submit -> done time.
absl::Status Transfer(Client& client, const Context& ctx, bool backup,
                      const std::string& attachment, const std::vector<int64_t>& host,
                      const std::vector<int64_t>& device, uint64_t expected_bytes,
                      DemoReport* report) {
  const Clock::time_point start = Clock::now();
  absl::StatusOr<uint64_t> ticket =
      backup ? client.Backup(attachment, host, device) : client.Load(attachment, host, device);
  const Clock::time_point submitted = Clock::now();
  if (!ticket.ok()) return ticket.status();
  (backup ? report->backup_submit : report->load_submit).Add(submitted - start);
  absl::StatusOr<v1::TransferStatus> status = client.WaitTransfer(*ticket, ctx.timeout);
  const Clock::time_point done = Clock::now();
  if (!status.ok()) return status.status();
  report->wait.Add(done - submitted);
  if (status->bytes() != expected_bytes) {
    return MismatchError(absl::StrCat(backup ? "backup" : "load", " ticket ", *ticket, " reports ",
                                      status->bytes(), " bytes copied, expected ", expected_bytes));
  }
  DirectionTotals& totals = backup ? report->backup : report->load;
  totals.bytes += status->bytes();
  totals.seconds += std::chrono::duration<double>(done - start).count();
  return absl::OkStatus();
}

// Random distinct device pages, as their rows: a partial Fisher-Yates shuffle
// of `device_pages`.
std::vector<int64_t> PickRows(uint64_t batch_pages, uint64_t page_size,
                              std::vector<uint64_t>& device_pages, std::mt19937_64& rng) {
  std::vector<int64_t> rows;
  rows.reserve(batch_pages * page_size);
  for (uint64_t i = 0; i < batch_pages; ++i) {
    std::uniform_int_distribution<uint64_t> pick(i, device_pages.size() - 1);
    std::swap(device_pages[i], device_pages[pick(rng)]);
    for (uint64_t j = 0; j < page_size; ++j) {
      rows.push_back(static_cast<int64_t>(device_pages[i] * page_size + j));
    }
  }
  return rows;
}

absl::Status DemoCycles(Context& ctx, const DemoOptions& o, const v1::Pool& pool,
                        const ShmDevicePool& device, const std::string& attachment,
                        std::mt19937_64& rng, DemoReport* report) {
  Client& client = *ctx.client;
  const uint64_t ps = o.spec.page_size();
  const uint64_t transfer_bytes = o.batch_tokens * pool.bytes_per_token();
  std::vector<uint64_t> device_pages(device.rows() / ps);
  for (uint64_t p = 0; p < device_pages.size(); ++p) device_pages[p] = p;
  std::vector<uint8_t> saved(o.batch_tokens * device.planes() * device.layers() *
                             device.row_bytes());
  const int every = std::max(1, (o.cycles + 4) / 5);
  FILE* progress = ctx.json ? stderr : stdout;

  for (int cycle = 1; cycle <= o.cycles; ++cycle) {
    if (Interrupted()) return absl::CancelledError("interrupted");
    Clock::time_point t = Clock::now();
    absl::StatusOr<std::vector<int64_t>> host = client.Alloc(o.pool, o.batch_tokens);
    if (!host.ok()) return host.status();
    report->alloc.Add(Clock::now() - t);
    const std::vector<int64_t> rows = PickRows(o.batch_tokens / ps, ps, device_pages, rng);

    absl::Status s =
        Transfer(client, ctx, /*backup=*/true, attachment, *host, rows, transfer_bytes, report);
    if (!s.ok()) return s;
    SaveAndClear(device, rows, &saved);
    s = Transfer(client, ctx, /*backup=*/false, attachment, *host, rows, transfer_bytes, report);
    if (!s.ok()) return s;
    s = Verify(device, *host, rows, saved, cycle);
    if (!s.ok()) return s;

    t = Clock::now();
    absl::StatusOr<uint64_t> freed = client.Free(o.pool, *host);
    if (!freed.ok()) return freed.status();
    report->free.Add(Clock::now() - t);
    report->cycles_done = cycle;
    if (cycle % every == 0 || cycle == o.cycles) {
      absl::FPrintF(progress, "cycle %d/%d: backup %.2f GB/s, load %.2f GB/s, %d tokens verified\n",
                    cycle, o.cycles, report->backup.GbPerS(), report->load.GbPerS(),
                    o.batch_tokens * cycle);
      std::fflush(progress);
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status RunDemo(Context& ctx, const Args&) {
  absl::StatusOr<DemoOptions> options = DemoOptionsFromFlags();
  if (!options.ok()) return options.status();
  const DemoOptions& o = *options;
  Client& client = *ctx.client;
  std::mt19937_64 rng(o.seed);

  // Declared before the cleanup so that the file outlives the attachment.
  std::unique_ptr<ShmDevicePool> device;
  DemoCleanup cleanup(&client);
  absl::StatusOr<v1::Pool> pool = client.CreatePool(o.pool, o.spec);
  if (!pool.ok()) return pool.status();
  cleanup.set_pool(o.pool);
  // The daemon attaches shm buffers from its own --shm-dir only.
  std::string shm_dir = o.shm_dir;
  if (shm_dir.empty()) {
    absl::StatusOr<v1::DaemonStatus> status = client.GetStatus();
    if (!status.ok()) return status.status();
    shm_dir = status->shm_dir();
  }
  absl::StatusOr<std::unique_ptr<ShmDevicePool>> created =
      ShmDevicePool::Create(*pool, o.device_tokens, shm_dir);
  if (!created.ok()) return created.status();
  device = *std::move(created);
  FillNonZero(*device, rng);
  absl::StatusOr<v1::Attachment> attachment =
      client.AttachDevice(device->MakeAttachRequest(o.pool));
  if (!attachment.ok()) return attachment.status();
  cleanup.set_attachment(attachment->id());

  FILE* progress = ctx.json ? stderr : stdout;
  absl::FPrintF(progress,
                "demo: pool '%s' %s, %d layers, %s, %d tokens (%s GiB); device pool of %d rows "
                "(%s GiB) in %s; %d cycles of %d tokens\n",
                o.pool, ShapeOf(o.spec), o.spec.layer_num(), DimsOf(o.spec), pool->size_tokens(),
                Gib(pool->bytes()), device->rows(), Gib(device->bytes()), device->path(), o.cycles,
                o.batch_tokens);
  std::fflush(progress);

  StopOn(SIGINT);
  DemoReport report;
  absl::Status result = DemoCycles(ctx, o, *pool, *device, attachment->id(), rng, &report);
  report.fast_path = client.fast_path_open();
  // A failed RPC is reported as an error alone; numbers are shown for a
  // finished run or one that read back wrong bytes.
  if (result.ok() || IsMismatch(result)) PrintDemoReport(ctx, o, *pool, report, result);
  return result;
}

}  // namespace kvhost::ctl
