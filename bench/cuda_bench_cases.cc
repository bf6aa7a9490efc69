#include "bench/cuda_bench_cases.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "bench/bench_util.h"
#include "kvhost/cuda_export.h"

namespace kvhost::bench {
namespace {

using Clock = std::chrono::steady_clock;
double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }
double NowS() { return Seconds(Clock::now().time_since_epoch()); }

// A transfer that has not finished by then is a hang, not a slow path: the
// slowest case measured on an H200 (PAGE_HEAD through the copy engines,
// 256-byte pieces, 0.27 GB/s) moves an 8192-token, 32-layer MHA transfer
// (1 GiB) in 4 s.
constexpr absl::Duration kTransferTimeout = absl::Minutes(2);
// Timed loads of a time-to-first-layer case (the first layer's time varies
// by a few ms from load to load, so a median of several), fewer where the
// loads are slow, so that a case takes about kTtflBudgetS.
constexpr int kFirstLayerSamples = 10;
constexpr int kMinFirstLayerSamples = 3;
constexpr double kTtflBudgetS = 2.0;
// The churn's largest request, as a share of the pool's pages (a request of
// 1 / 64 of the pool: 256 tokens of a 16384-slot page-1 pool).
constexpr uint64_t kChurnMaxShare = 64;

struct Done {
  double wall_s = 0;    // submit to WaitTransfer's return
  double engine_s = 0;  // the ticket's duration_us
  std::string path;     // the ticket's path
};

absl::StatusOr<Done> Transfer(kvhost::Client& client, const PathRun& run,
                              const std::string& attachment, bool backup,
                              const std::vector<int64_t>& host, const std::vector<int64_t>& rows,
                              uint64_t bytes) {
  const Clock::time_point start = Clock::now();
  absl::StatusOr<uint64_t> ticket;
  if (run.worker != nullptr && run.worker->copier != nullptr) {
    // The worker path: this process copies, on its copy stream.
    kvhost::WorkerCopier& copier = *run.worker->copier;
    absl::StatusOr<kvhost::WorkerTicket> t = backup ? copier.Backup(host, rows, run.worker->stream)
                                                    : copier.Load(host, rows, run.worker->stream);
    if (!t.ok()) return t.status();
    if (absl::Status s = copier.Wait(*t, kTransferTimeout); !s.ok()) return s;
    ticket = t->ticket_id;
  } else {
    ticket = backup ? client.Backup(attachment, host, rows) : client.Load(attachment, host, rows);
  }
  if (!ticket.ok()) return ticket.status();
  absl::StatusOr<v1::TransferStatus> st = client.WaitTransfer(*ticket, kTransferTimeout);
  if (!st.ok()) return st.status();
  Done d;
  d.wall_s = Seconds(Clock::now() - start);
  // duration_us has microsecond resolution; never divide by zero.
  d.engine_s = std::max<double>(st->duration_us(), 1) / 1e6;
  d.path = st->path();
  if (st->bytes() != bytes) {
    return absl::InternalError(absl::StrCat(DirName(backup), " ticket ", *ticket, " copied ",
                                            st->bytes(), " bytes, expected ", bytes));
  }
  if (!run.ticket_path.empty() && st->path() != run.ticket_path) {
    return absl::FailedPreconditionError(
        absl::StrCat("kvhostd --transfer-path=", run.path, " ran ", DirName(backup), " ticket ",
                     *ticket, " on path '", st->path(), "', not '", run.ticket_path, "'"));
  }
  return d;
}

// Random Alloc / Free calls on the pool, holding at most `cap_tokens`, as
// a serving engine's requests come and go; what stays allocated stays so.
absl::Status Churn(const Options& o, kvhost::Client& client, const std::string& name,
                   const v1::Pool& pool, uint64_t cap_tokens, std::mt19937_64& rng) {
  const uint64_t ps = pool.spec().page_size();
  const uint64_t max_pages = std::max<uint64_t>(1, pool.page_num() / kChurnMaxShare);
  std::vector<std::vector<int64_t>> held;
  uint64_t held_tokens = 0;
  for (uint64_t op = 0; op < o.churn_ops; ++op) {
    const uint64_t tokens = (1 + rng() % max_pages) * ps;
    const bool alloc = held.empty() || rng() % 2 == 0;
    if (alloc && held_tokens + tokens <= cap_tokens) {
      absl::StatusOr<std::vector<int64_t>> slots = client.Alloc(name, tokens);
      if (!slots.ok()) return slots.status();
      held_tokens += tokens;
      held.push_back(*std::move(slots));
    } else if (!held.empty()) {
      const size_t i = rng() % held.size();
      if (absl::StatusOr<uint64_t> freed = client.Free(name, held[i]); !freed.ok()) {
        return freed.status();
      }
      held_tokens -= held[i].size();
      std::swap(held[i], held.back());
      held.pop_back();
    }
  }
  return absl::OkStatus();
}

// The worker path's copier on `attachment` (nothing for the other paths):
// the device buffers by the pool's component names (K and V, or the latent).
absl::Status OpenCopier(kvhost::Client& client, const v1::Pool& pool,
                        const v1::Attachment& attachment, const DeviceKv& device,
                        WorkerSide* worker) {
  if (worker == nullptr) return absl::OkStatus();
  std::vector<kvhost::CudaComponentLayers> layers;
  for (int c = 0; c < pool.components_size(); ++c) {
    layers.push_back({pool.components(c).name(), device.layers(static_cast<uint32_t>(c))});
  }
  kvhost::WorkerCopierOptions options;
  options.blocks = worker->blocks;
  absl::StatusOr<std::unique_ptr<kvhost::WorkerCopier>> copier =
      kvhost::WorkerCopier::Open(client, attachment, layers, options);
  if (!copier.ok()) return copier.status();
  worker->copier = *std::move(copier);
  return absl::OkStatus();
}

// Creates a pool, attaches the worker's device pool (with layer progress
// when `layer_progress`: the worker waits on the layer counters, and its
// loads return before they are queued), runs `body` with the host slots,
// then detaches (the pool goes with WithHostSlots).
absl::Status WithAttachedPool(
    const Options& o, kvhost::Client& client, const std::string& name, const v1::PoolSpec& spec,
    uint64_t need_tokens, std::mt19937_64& rng, const DeviceKv& device,
    const std::function<absl::Status(const v1::Pool&, const v1::Attachment&,
                                     const std::vector<int64_t>&)>& body,
    bool layer_progress = false, WorkerSide* worker = nullptr) {
  return WithHostSlots(o, client, name, spec, need_tokens, rng,
                       [&](const v1::Pool& pool, const std::vector<int64_t>& host) -> absl::Status {
                         absl::StatusOr<v1::AttachDeviceRequest> request =
                             kvhost::MakeCudaAttachRequest(name, device.layers(0), device.layers(1),
                                                           device.rows());
                         if (!request.ok()) return request.status();
                         request->set_layer_progress(layer_progress);
                         absl::StatusOr<v1::Attachment> attachment = client.AttachDevice(*request);
                         if (!attachment.ok()) return attachment.status();
                         absl::Status s = OpenCopier(client, pool, *attachment, device, worker);
                         if (s.ok()) s = body(pool, *attachment, host);
                         if (worker != nullptr) worker->copier.reset();
                         absl::Status detached = client.DetachDevice(attachment->id());
                         return s.ok() ? detached : s;
                       });
}

absl::Status Prefixed(const absl::Status& s, const std::string& what) {
  if (s.ok() || absl::StartsWith(s.message(), what)) return s;
  return absl::Status(s.code(), absl::StrCat(what, ": ", s.message()));
}

}  // namespace

double Progress::elapsed_s() const { return NowS() - start_s; }

std::mt19937_64 CaseRng(const Options& o, v1::PoolKind kind, v1::Layout layout,
                        uint32_t page_size) {
  std::seed_seq seq{static_cast<uint64_t>(o.seed), static_cast<uint64_t>(kind),
                    static_cast<uint64_t>(layout), static_cast<uint64_t>(page_size)};
  return std::mt19937_64(seq);
}

std::vector<uint64_t> ShuffledPages(uint64_t n, std::mt19937_64& rng) {
  std::vector<uint64_t> pages(n);
  for (uint64_t p = 0; p < n; ++p) pages[p] = p;
  std::shuffle(pages.begin(), pages.end(), rng);
  return pages;
}

std::vector<int64_t> PageSlots(const std::vector<uint64_t>& pages, uint64_t first, uint64_t count,
                               uint32_t page_size) {
  std::vector<int64_t> slots;
  slots.reserve(count * page_size);
  for (uint64_t i = first; i < first + count; ++i) {
    for (uint32_t j = 0; j < page_size; ++j) {
      slots.push_back(static_cast<int64_t>(pages[i] * page_size + j));
    }
  }
  return slots;
}

absl::Status WithHostSlots(
    const Options& o, kvhost::Client& client, const std::string& name, const v1::PoolSpec& spec,
    uint64_t need_tokens, std::mt19937_64& rng,
    const std::function<absl::Status(const v1::Pool&, const std::vector<int64_t>&)>& body) {
  absl::StatusOr<v1::Pool> pool = client.CreatePool(name, spec);
  if (!pool.ok()) return pool.status();
  absl::Status result = [&]() -> absl::Status {
    std::vector<int64_t> host;
    if (o.host_slots == HostSlots::kRandom) {
      // Every slot allocated; whole pages picked at random among them.
      absl::StatusOr<std::vector<int64_t>> all = client.Alloc(name, pool->size_tokens());
      if (!all.ok()) return all.status();
      const uint32_t ps = spec.page_size();
      host = PageSlots(ShuffledPages(pool->page_num(), rng), 0, need_tokens / ps, ps);
    } else {
      if (o.host_slots == HostSlots::kChurned) {
        const uint64_t cap = pool->size_tokens() - need_tokens;
        if (absl::Status s = Churn(o, client, name, *pool, cap, rng); !s.ok()) return s;
      }
      absl::StatusOr<std::vector<int64_t>> slots = client.Alloc(name, need_tokens);
      if (!slots.ok()) return slots.status();
      host = *std::move(slots);
    }
    return body(*pool, host);
  }();
  absl::Status deleted = client.DeletePool(name).status();
  return result.ok() ? deleted : result;
}

absl::Status WaitForLayer(const kvhost::LoadEvents& events, const kvhost::LoadTicket& load,
                          uint32_t layer, cudaStream_t stream) {
  // With layer progress: the host waits until the layer's event is recorded
  // for this load, then the stream waits on the event.
  return events.WaitLayer(load, layer, stream, absl::Seconds(30));
}

// One direction of a case: the timed transfers, then the worker's costs.
absl::StatusOr<CaseResult> RunDirection(const Options& o, const PathRun& run, const Case& c,
                                        kvhost::Client& client, Worker& w, const Results& results,
                                        const std::string& attachment, bool backup,
                                        const std::vector<int64_t>& host,
                                        const std::vector<int64_t>& rows, uint64_t bytes,
                                        const Done& warm) {
  CaseResult r;
  r.path = run.path;
  r.kind = KindName(c.kind);
  r.layout = LayoutName(c.layout);
  r.page_size = c.page_size;
  r.backup = backup;
  r.bytes = bytes;
  r.warmup_s = warm.wall_s;
  r.slow = warm.wall_s > o.slow_case_s;
  r.timed = r.slow ? 1 : o.repeats;
  r.host = RunsOf(host, c.page_size);
  std::vector<double> engine_s, client_s;
  std::string path = warm.path;
  for (int i = 0; i < r.timed; ++i) {
    absl::StatusOr<Done> d = Transfer(client, run, attachment, backup, host, rows, bytes);
    if (!d.ok()) return d.status();
    engine_s.push_back(d->engine_s);
    client_s.push_back(d->wall_s);
    if (d->path != path) path = absl::StrCat(path, "+", d->path);  // auto changed its mind
  }
  r.ticket_path = path;
  const double gb = static_cast<double>(bytes) / 1e9;
  r.engine_gbps = gb / Median(engine_s);
  r.client_gbps = gb / Median(client_s);
  r.vs_ceiling = r.engine_gbps / (backup ? results.ceiling.d2h_gbps : results.ceiling.h2d_gbps);
  auto transfer = [&]() -> absl::Status {
    return Transfer(client, run, attachment, backup, host, rows, bytes).status();
  };
  if (absl::Status s = MeasureCosts(o, w, results, r.slow, transfer, r.costs); !s.ok()) return s;
  return r;
}

absl::Status RunCase(const Options& o, const PathRun& run, const Case& c, kvhost::Client& client,
                     Worker& w, uint64_t& fill_seed, Results& results, Progress& progress) {
  absl::StatusOr<DeviceKv*> device = w.Pool(o, c.kind);
  if (!device.ok()) return device.status();
  DeviceKv& dev = **device;
  const std::string name =
      absl::StrCat("bench-", KindName(c.kind), "-", LayoutName(c.layout), "-ps", c.page_size);
  const std::string what =
      absl::StrCat(run.path, " ", KindName(c.kind), " ", LayoutName(c.layout), " ps", c.page_size);
  std::mt19937_64 rng = CaseRng(o, c.kind, c.layout, c.page_size);
  auto body = [&](const v1::Pool& pool, const v1::Attachment& att,
                  const std::vector<int64_t>& host) -> absl::Status {
    const uint64_t pages = o.tokens / c.page_size;
    const std::vector<uint64_t> device_pages = ShuffledPages(dev.rows() / c.page_size, rng);
    const std::vector<int64_t> rows = PageSlots(device_pages, 0, pages, c.page_size);
    const std::vector<int64_t> other = PageSlots(device_pages, pages, pages, c.page_size);
    const uint64_t bytes = o.tokens * pool.bytes_per_token();

    // The byte check; its backup and load are the warm-ups.
    const uint64_t seed = ++fill_seed;
    if (absl::Status s = dev.Fill(seed, w.stream()); !s.ok()) return s;
    absl::StatusOr<Done> warm_backup = Transfer(client, run, att.id(), true, host, rows, bytes);
    if (!warm_backup.ok()) return warm_backup.status();
    absl::StatusOr<Done> warm_load = Transfer(client, run, att.id(), false, host, other, bytes);
    if (!warm_load.ok()) return warm_load.status();
    if (absl::Status s = dev.Check(seed, other, rows, w.stream()); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat(what, " (tickets on ", warm_backup->path, " / ",
                                                 warm_load->path, "): ", s.message()));
    }
    for (bool backup : o.directions) {
      absl::StatusOr<CaseResult> r =
          RunDirection(o, run, c, client, w, results, att.id(), backup, host, rows, bytes,
                       backup ? *warm_backup : *warm_load);
      if (!r.ok()) return r.status();
      results.cases.push_back(*r);
      ++progress.done;
      std::string costs;
      for (const Cost& k : r->costs) {
        absl::StrAppendFormat(&costs, " %s@%s %+.1f%%", k.worker, DutyName(k.duty), k.cost_pct);
      }
      absl::FPrintF(stderr, "[%d/%d %.0fs] %s %s: %.1f GB/s (%.2f), run %.1f pages,%s%s%s\n",
                    progress.done, progress.total, progress.elapsed_s(), what, DirName(backup),
                    r->engine_gbps, r->vs_ceiling, r->host.MeanPages(), costs,
                    run.ticket_path.empty() ? absl::StrCat(" [", r->ticket_path, "]") : "",
                    r->slow ? absl::StrFormat(" (slow: warm-up %.2f s)", r->warmup_s) : "");
    }
    return absl::OkStatus();
  };
  return Prefixed(
      WithAttachedPool(o, client, name, SpecFor(o, c.kind, c.layout, c.page_size, o.tokens),
                       o.tokens, rng, dev, body, /*layer_progress=*/false, run.worker),
      what);
}

// ---------------------------------------------------------------------------
// Duplex.

namespace {

struct LoopResult {
  uint64_t transfers = 0;
  double seconds = 0;
  std::string path;
  absl::Status status;
};

// One direction back to back from `start` until `seconds` passed (at least
// one transfer).
LoopResult TransferLoop(kvhost::Client& client, const PathRun& run, const std::string& attachment,
                        bool backup, const std::vector<int64_t>& host,
                        const std::vector<int64_t>& rows, uint64_t bytes, Clock::time_point start,
                        double seconds) {
  LoopResult r;
  while (r.transfers == 0 || Seconds(Clock::now() - start) < seconds) {
    absl::StatusOr<Done> d = Transfer(client, run, attachment, backup, host, rows, bytes);
    if (!d.ok()) {
      r.status = d.status();
      return r;
    }
    if (r.path.empty()) r.path = d->path;
    ++r.transfers;
  }
  r.seconds = Seconds(Clock::now() - start);
  return r;
}

}  // namespace

absl::Status RunDuplex(const Options& o, const PathRun& run, kvhost::Client& client, Worker& w,
                       Results& results) {
  absl::StatusOr<DeviceKv*> device = w.Pool(o, v1::MHA);
  if (!device.ok()) return device.status();
  DuplexResult r;
  r.path = run.path;
  std::mt19937_64 rng = CaseRng(o, v1::MHA, v1::LAYER_FIRST, kProbePageSize);
  auto body = [&](const v1::Pool& pool, const v1::Attachment& att,
                  const std::vector<int64_t>& host) -> absl::Status {
    const uint64_t pages = o.tokens / kProbePageSize;
    const std::vector<uint64_t> device_pages =
        ShuffledPages((*device)->rows() / kProbePageSize, rng);
    // Backups: host half A <- device half A; loads: host half B -> device half B.
    const std::vector<int64_t> host_a(host.begin(), host.begin() + o.tokens);
    const std::vector<int64_t> host_b(host.begin() + o.tokens, host.end());
    const std::vector<int64_t> rows_a = PageSlots(device_pages, 0, pages, kProbePageSize);
    const std::vector<int64_t> rows_b = PageSlots(device_pages, pages, pages, kProbePageSize);
    r.bytes = o.tokens * pool.bytes_per_token();
    // Warm-ups; the first gives host half B the bytes of device half B, so
    // the loads move real data.
    for (int i = 0; i < 3; ++i) {
      const bool backup = i < 2;
      const bool a = i == 1;
      absl::StatusOr<Done> d = Transfer(client, run, att.id(), backup, a ? host_a : host_b,
                                        a ? rows_a : rows_b, r.bytes);
      if (!d.ok()) return d.status();
    }
    const double gb = static_cast<double>(r.bytes) / 1e9;
    for (bool backup : {true, false}) {
      LoopResult alone = TransferLoop(client, run, att.id(), backup, backup ? host_a : host_b,
                                      backup ? rows_a : rows_b, r.bytes, Clock::now(), o.duplex_s);
      if (!alone.status.ok()) return alone.status;
      (backup ? r.backup_alone_gbps : r.load_alone_gbps) = alone.transfers * gb / alone.seconds;
    }
    const Clock::time_point start = Clock::now();
    LoopResult backups, loads;
    std::thread backup_thread([&] {
      backups =
          TransferLoop(client, run, att.id(), true, host_a, rows_a, r.bytes, start, o.duplex_s);
    });
    loads = TransferLoop(client, run, att.id(), false, host_b, rows_b, r.bytes, start, o.duplex_s);
    backup_thread.join();
    if (!backups.status.ok()) return backups.status;
    if (!loads.status.ok()) return loads.status;
    r.backups = backups.transfers;
    r.loads = loads.transfers;
    r.seconds = std::max(backups.seconds, loads.seconds);
    r.backup_gbps = backups.transfers * gb / backups.seconds;
    r.load_gbps = loads.transfers * gb / loads.seconds;
    r.aggregate_gbps = (backups.transfers + loads.transfers) * gb / r.seconds;
    r.vs_one_direction = r.aggregate_gbps / std::max(r.backup_alone_gbps, r.load_alone_gbps);
    r.vs_ceiling = r.aggregate_gbps / results.ceiling.duplex_gbps;
    r.backup_path = backups.path;
    r.load_path = loads.path;
    return absl::OkStatus();
  };
  const v1::PoolSpec spec = SpecFor(o, v1::MHA, v1::LAYER_FIRST, kProbePageSize, 2 * o.tokens);
  absl::Status s =
      WithAttachedPool(o, client, "bench-duplex", spec, 2 * o.tokens, rng, **device, body);
  if (!s.ok()) return absl::Status(s.code(), absl::StrCat(run.path, " duplex: ", s.message()));
  results.duplex.push_back(r);
  absl::FPrintF(stderr,
                "duplex %s MHA LAYER_FIRST ps%d: %.1f GB/s (backup %.1f + load %.1f); alone %.1f "
                "/ %.1f; %.2fx one direction, %.2f of the duplex ceiling\n",
                run.path, kProbePageSize, r.aggregate_gbps, r.backup_gbps, r.load_gbps,
                r.backup_alone_gbps, r.load_alone_gbps, r.vs_one_direction, r.vs_ceiling);
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// Time to first layer.

absl::Status TimedLayerLoad(const Options& o, const PathRun& run, kvhost::Client& client,
                            const kvhost::LoadEvents& events, const LayerLoadSubmit& submit,
                            cudaStream_t stream, const Events& ev, TtflResult& r, bool keep) {
  // The start is recorded before the call: its time counts.
  if (absl::Status s = Cuda(cudaEventRecord(ev[0], stream), "cudaEventRecord"); !s.ok()) return s;
  absl::StatusOr<kvhost::LoadTicket> load = submit();
  if (!load.ok()) return load.status();
  if (load->event_set < 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(r.call, " ticket ", load->ticket_id, " names no load event set"));
  }
  // The stream is idle, so this one marks when the call returned: a first
  // layer later than that waited for copies, not for the call.
  absl::Status s = Cuda(cudaEventRecord(ev[1], stream), "cudaEventRecord");
  if (s.ok()) s = WaitForLayer(events, *load, 0, stream);
  if (s.ok()) s = Cuda(cudaEventRecord(ev[2], stream), "cudaEventRecord");
  if (s.ok()) s = WaitForLayer(events, *load, o.layers - 1, stream);
  if (s.ok()) s = Cuda(cudaEventRecord(ev[3], stream), "cudaEventRecord");
  if (s.ok()) s = Cuda(cudaEventSynchronize(ev[3]), "waiting on the load events");
  absl::StatusOr<v1::TransferStatus> st = client.WaitTransfer(load->ticket_id, kTransferTimeout);
  if (!s.ok()) return s;
  if (!st.ok()) return st.status();
  if (!run.ticket_path.empty() && st->path() != run.ticket_path) {
    return absl::FailedPreconditionError(
        absl::StrCat("kvhostd --transfer-path=", run.path, " ran ", r.call, " ticket ",
                     load->ticket_id, " on path '", st->path(), "', not '", run.ticket_path, "'"));
  }
  r.ticket_path = st->path();
  double ms[3];
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<double> t = ElapsedMs(ev[0], ev[i + 1]);
    if (!t.ok()) return t.status();
    ms[i] = *t;
  }
  if (!keep) return absl::OkStatus();
  r.rpc_ms.push_back(ms[0]);
  r.first_ms.push_back(ms[1]);
  r.total_ms.push_back(ms[2]);
  r.daemon_first_ms.push_back(st->first_layer_us() / 1e3);
  r.daemon_total_ms.push_back(st->duration_us() / 1e3);
  r.enqueue_ms.push_back(st->enqueue_us() / 1e3);
  return absl::OkStatus();
}

int TtflSamples(double transfer_s) {
  return std::clamp(static_cast<int>(kTtflBudgetS / transfer_s), kMinFirstLayerSamples,
                    kFirstLayerSamples);
}

void FinishTtfl(const kvhost::Client& client, TtflResult& r) {
  r.rpc_median_ms = Median(r.rpc_ms);
  r.first_median_ms = Median(r.first_ms);
  r.total_median_ms = Median(r.total_ms);
  r.target_ms = r.total_median_ms / r.layers + kFirstLayerSlackMs;
  r.met = r.first_median_ms <= r.target_ms;
  r.daemon_first_median_ms = Median(r.daemon_first_ms);
  r.daemon_total_median_ms = Median(r.daemon_total_ms);
  r.enqueue_median_ms = Median(r.enqueue_ms);
  r.empty_rpc_median_ms = Median(r.empty_rpc_ms);
  r.fast_path = client.fast_path_open();
  absl::FPrintF(stderr,
                "ttfl %s %s MHA %s ps%d, %d layers (%s): call back at %.3f ms, first layer "
                "%.3f ms, all %.3f ms, target %.3f ms: %s; daemon side: first %.3f ms, all "
                "%.3f ms (queued in %.3f ms); an empty call takes %.3f ms\n",
                r.path, r.call, r.layout, r.page_size, r.layers, r.fast_path ? "fast path" : "gRPC",
                r.rpc_median_ms, r.first_median_ms, r.total_median_ms, r.target_ms,
                r.met ? "met" : "missed", r.daemon_first_median_ms, r.daemon_total_median_ms,
                r.enqueue_median_ms, r.empty_rpc_median_ms);
}

absl::Status RunTtfl(const Options& o, const PathRun& run, uint32_t page_size,
                     kvhost::Client& client, Worker& w, Results& results) {
  absl::StatusOr<DeviceKv*> device = w.Pool(o, v1::MHA);
  if (!device.ok()) return device.status();
  TtflResult r;
  r.path = run.path;
  r.page_size = page_size;
  r.layers = o.layers;
  std::mt19937_64 rng = CaseRng(o, v1::MHA, v1::LAYER_FIRST, page_size);
  auto body = [&](const v1::Pool& pool, const v1::Attachment& att,
                  const std::vector<int64_t>& host) -> absl::Status {
    const uint64_t pages = o.tokens / page_size;
    const std::vector<int64_t> rows =
        PageSlots(ShuffledPages((*device)->rows() / page_size, rng), 0, pages, page_size);
    r.bytes = o.tokens * pool.bytes_per_token();
    absl::StatusOr<Done> backup = Transfer(client, run, att.id(), true, host, rows, r.bytes);
    if (!backup.ok()) return backup.status();
    absl::StatusOr<std::unique_ptr<kvhost::LoadEvents>> events =
        kvhost::LoadEvents::Open(client, att);
    if (!events.ok()) return events.status();
    absl::StatusOr<std::unique_ptr<Events>> ev = Events::Create(4);
    if (!ev.ok()) return ev.status();
    const int samples = TtflSamples(backup->wall_s);
    const LayerLoadSubmit load = [&] { return client.LoadWithEvents(att.id(), host, rows); };
    for (int i = 0; i <= samples; ++i) {  // the first warms up
      if (absl::Status s =
              TimedLayerLoad(o, run, client, **events, load, w.stream(), **ev, r, i > 0);
          !s.ok()) {
        return s;
      }
    }
    for (int i = 0; i <= kFirstLayerSamples; ++i) {
      const auto start = std::chrono::steady_clock::now();
      absl::StatusOr<uint64_t> empty = client.Load(att.id(), {}, {});
      const auto end = std::chrono::steady_clock::now();
      if (!empty.ok()) return empty.status();
      if (i > 0)
        r.empty_rpc_ms.push_back(std::chrono::duration<double, std::milli>(end - start).count());
    }
    return absl::OkStatus();
  };
  const v1::PoolSpec spec = SpecFor(o, v1::MHA, v1::LAYER_FIRST, page_size, o.tokens);
  absl::Status s = WithAttachedPool(o, client, absl::StrCat("bench-ttfl-ps", page_size), spec,
                                    o.tokens, rng, **device, body, /*layer_progress=*/true);
  if (!s.ok()) {
    return absl::Status(
        s.code(), absl::StrCat(run.path, " time to first layer ps", page_size, ": ", s.message()));
  }
  FinishTtfl(client, r);
  results.ttfl.push_back(r);
  return absl::OkStatus();
}

}  // namespace kvhost::bench
