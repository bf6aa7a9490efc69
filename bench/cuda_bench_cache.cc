#include "bench/cuda_bench_cache.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "bench/bench_util.h"
#include "kvhost/cuda_export.h"

namespace kvhost::bench {
namespace {

using Clock = std::chrono::steady_clock;

// Keys a cache call may carry (the daemon's default bound, CacheIndex's
// max_keys_per_call): larger moves are split into calls of this many.
constexpr size_t kKeysPerCall = 4096;
// As the cases' transfers: a call not done by then hangs.
constexpr absl::Duration kCallTimeout = absl::Minutes(2);

// The node cache as this case uses it.
struct CacheSide {
  kvhost::Client& client;
  const PathRun& run;
  std::string cache;
  std::string attachment;
  uint32_t page_size = 0;
  uint64_t page_bytes = 0;
  uint64_t next_key = 0;  // keys are "bench-<n>", each stored once

  std::vector<std::string> NewKeys(uint64_t n) {
    std::vector<std::string> keys;
    keys.reserve(n);
    for (uint64_t i = 0; i < n; ++i) keys.push_back(absl::StrCat("bench-", next_key++));
    return keys;
  }
};

struct Moved {
  double wall_s = 0;    // the first call to the last wait's return
  double engine_s = 0;  // the tickets' duration_us, summed
  std::string path;     // the tickets' path
};

// Stores (`store`) or restores `keys` from / into device `rows` (page_size
// rows a key), in calls of at most kKeysPerCall keys, each waited for. A
// store must write every key: one it skipped (present or pending) fails.
absl::StatusOr<Moved> Move(CacheSide& c, bool store, const std::vector<std::string>& keys,
                           const std::vector<int64_t>& rows) {
  const Clock::time_point start = Clock::now();
  Moved m;
  for (size_t first = 0; first < keys.size(); first += kKeysPerCall) {
    const size_t n = std::min(kKeysPerCall, keys.size() - first);
    const std::vector<std::string> part(keys.begin() + first, keys.begin() + first + n);
    const absl::Span<const int64_t> part_rows =
        absl::MakeConstSpan(rows).subspan(first * c.page_size, n * c.page_size);
    uint64_t ticket = 0;
    if (store) {
      absl::StatusOr<v1::CacheStoreReply> reply =
          c.client.CacheStore(c.cache, c.attachment, part, part_rows);
      if (!reply.ok()) return reply.status();
      for (int i = 0; i < reply->states_size(); ++i) {
        if (reply->states(i) != v1::CACHE_KEY_ABSENT) {
          return absl::InternalError(absl::StrCat("the store skipped new key '", part[i], "' (",
                                                  v1::CacheKeyState_Name(reply->states(i)), ")"));
        }
      }
      if (!reply->has_ticket()) return absl::InternalError("a store of new keys has no ticket");
      ticket = reply->ticket().id();
    } else {
      absl::StatusOr<v1::TransferTicket> t =
          c.client.CacheRestore(c.cache, c.attachment, part, part_rows);
      if (!t.ok()) return t.status();
      ticket = t->id();
    }
    absl::StatusOr<v1::TransferStatus> st = c.client.WaitTransfer(ticket, kCallTimeout);
    if (!st.ok()) return st.status();
    if (st->bytes() != n * c.page_bytes) {
      return absl::InternalError(absl::StrCat(store ? "store" : "restore", " ticket ", ticket,
                                              " copied ", st->bytes(), " bytes, expected ",
                                              n * c.page_bytes));
    }
    if (!c.run.ticket_path.empty() && st->path() != c.run.ticket_path) {
      return absl::FailedPreconditionError(absl::StrCat(
          "kvhostd --transfer-path=", c.run.path, " ran ", store ? "store" : "restore", " ticket ",
          ticket, " on path '", st->path(), "', not '", c.run.ticket_path, "'"));
    }
    // duration_us has microsecond resolution; never divide by zero.
    m.engine_s += std::max<double>(st->duration_us(), 1) / 1e6;
    if (m.path.empty()) m.path = st->path();
  }
  m.wall_s = std::chrono::duration<double>(Clock::now() - start).count();
  return m;
}

// One direction: --repeats timed calls, then every worker's cost at every
// duty cycle. A store writes new keys each time (the cache evicts the
// oldest); a restore reads `stored`.
absl::StatusOr<CaseResult> RunCacheDirection(const Options& o, CacheSide& c, Worker& w,
                                             const Results& results, bool store,
                                             const std::vector<std::string>& stored,
                                             const std::vector<int64_t>& rows,
                                             const std::vector<int64_t>& other) {
  CaseResult r;
  r.path = c.run.path;
  r.kind = KindName(v1::MHA);
  r.layout = LayoutName(o.cache_layout);
  r.page_size = c.page_size;
  r.backup = store;
  r.bytes = stored.size() * c.page_bytes;
  r.timed = o.repeats;
  auto once = [&]() -> absl::StatusOr<Moved> {
    return store ? Move(c, true, c.NewKeys(stored.size()), rows) : Move(c, false, stored, other);
  };
  std::vector<double> engine_s, client_s;
  for (int i = 0; i < o.repeats; ++i) {
    absl::StatusOr<Moved> m = once();
    if (!m.ok()) return m.status();
    engine_s.push_back(m->engine_s);
    client_s.push_back(m->wall_s);
    r.ticket_path = m->path;
  }
  const double gb = static_cast<double>(r.bytes) / 1e9;
  r.engine_gbps = gb / Median(engine_s);
  r.client_gbps = gb / Median(client_s);
  r.vs_ceiling = r.engine_gbps / (store ? results.ceiling.d2h_gbps : results.ceiling.h2d_gbps);
  auto transfer = [&]() -> absl::Status { return once().status(); };
  if (absl::Status s = MeasureCosts(o, w, results, /*slow=*/false, transfer, r.costs); !s.ok()) {
    return s;
  }
  return r;
}

// Time to first layer of Restores of `stored` into `other`.
absl::Status RunRestoreTtfl(const Options& o, CacheSide& c, const v1::Attachment& att, Worker& w,
                            const std::vector<std::string>& stored,
                            const std::vector<int64_t>& other, double restore_s, Results& results) {
  TtflResult r;
  r.path = c.run.path;
  r.call = "Restore";
  r.layout = LayoutName(o.cache_layout);
  r.page_size = c.page_size;
  r.layers = o.layers;
  r.bytes = stored.size() * c.page_bytes;
  absl::StatusOr<std::unique_ptr<kvhost::LoadEvents>> events =
      kvhost::LoadEvents::Open(c.client, att);
  if (!events.ok()) return events.status();
  absl::StatusOr<std::unique_ptr<Events>> ev = Events::Create(4);
  if (!ev.ok()) return ev.status();
  if (stored.size() > kKeysPerCall) {
    return absl::InvalidArgumentError(
        absl::StrCat("the time to first layer of a Restore needs one call: ", stored.size(),
                     " keys at page size ", c.page_size, " are over ", kKeysPerCall));
  }
  const LayerLoadSubmit restore = [&]() -> absl::StatusOr<kvhost::LoadTicket> {
    absl::StatusOr<v1::TransferTicket> t =
        c.client.CacheRestore(c.cache, c.attachment, stored, other);
    if (!t.ok()) return t.status();
    return kvhost::LoadTicket{t->id(), t->event_set(), t->layer_base()};
  };
  const int samples = TtflSamples(restore_s);
  for (int i = 0; i <= samples; ++i) {  // the first warms up
    if (absl::Status s =
            TimedLayerLoad(o, c.run, c.client, **events, restore, w.stream(), **ev, r, i > 0);
        !s.ok()) {
      return s;
    }
  }
  // No empty-call floor: a node cache's attachment takes no Load, and a
  // Restore of no keys is refused.
  FinishTtfl(c.client, r);
  results.ttfl.push_back(r);
  return absl::OkStatus();
}

absl::Status CacheBody(const Options& o, CacheSide& c, const v1::Attachment& att, DeviceKv& dev,
                       Worker& w, std::mt19937_64& rng, uint64_t& fill_seed, Results& results,
                       Progress& progress, const std::string& what) {
  const uint64_t pages = o.tokens / c.page_size;
  const std::vector<uint64_t> device_pages = ShuffledPages(dev.rows() / c.page_size, rng);
  const std::vector<int64_t> rows = PageSlots(device_pages, 0, pages, c.page_size);
  const std::vector<int64_t> other = PageSlots(device_pages, pages, pages, c.page_size);
  // The byte check; its store and restore are the warm-ups.
  const uint64_t seed = ++fill_seed;
  if (absl::Status s = dev.Fill(seed, w.stream()); !s.ok()) return s;
  const std::vector<std::string> stored = c.NewKeys(pages);
  absl::StatusOr<Moved> warm_store = Move(c, true, stored, rows);
  if (!warm_store.ok()) return warm_store.status();
  absl::StatusOr<Moved> warm_restore = Move(c, false, stored, other);
  if (!warm_restore.ok()) return warm_restore.status();
  if (absl::Status s = dev.Check(seed, other, rows, w.stream()); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("tickets on ", warm_store->path, " / ",
                                               warm_restore->path, ": ", s.message()));
  }
  // Stores of new keys evict the oldest: the restores read keys stored
  // last, which the stores' cost loops then evict in turn, so each
  // direction's timed calls come before the next one's.
  for (bool store : o.directions) {
    std::vector<std::string> readable = stored;
    if (!store) {  // the last stores' keys: present whatever the stores evicted
      readable = c.NewKeys(pages);
      absl::StatusOr<Moved> refill = Move(c, true, readable, rows);
      if (!refill.ok()) return refill.status();
    }
    absl::StatusOr<CaseResult> r =
        RunCacheDirection(o, c, w, results, store, readable, rows, other);
    if (!r.ok()) return r.status();
    results.cache_cases.push_back(*r);
    ++progress.done;
    std::string costs;
    for (const Cost& k : r->costs) {
      absl::StrAppendFormat(&costs, " %s@%s %+.1f%%", k.worker, DutyName(k.duty), k.cost_pct);
    }
    absl::FPrintF(stderr, "[%d/%d %.0fs] %s %s: %.1f GB/s (%.2f),%s [%s]\n", progress.done,
                  progress.total, progress.elapsed_s(), what, store ? "store" : "restore",
                  r->engine_gbps, r->vs_ceiling, costs, r->ticket_path);
  }
  // The restore series reads keys stored last.
  const std::vector<std::string> last = c.NewKeys(pages);
  absl::StatusOr<Moved> refill = Move(c, true, last, rows);
  if (!refill.ok()) return refill.status();
  return RunRestoreTtfl(o, c, att, w, last, other, warm_restore->wall_s, results);
}

}  // namespace

absl::Status RunCacheCase(const Options& o, const PathRun& run, uint32_t page_size,
                          kvhost::Client& client, Worker& w, uint64_t& fill_seed, Results& results,
                          Progress& progress) {
  absl::StatusOr<DeviceKv*> device = w.Pool(o, v1::MHA);
  if (!device.ok()) return device.status();
  const std::string name = absl::StrCat("bench-cache-ps", page_size);
  const std::string what =
      absl::StrCat(run.path, " node cache MHA ", LayoutName(o.cache_layout), " ps", page_size);
  std::mt19937_64 rng = CaseRng(o, v1::MHA, o.cache_layout, page_size);
  // Twice --tokens: a store's pages and the ones it may not evict yet.
  v1::PoolSpec spec = SpecFor(o, v1::MHA, o.cache_layout, page_size, o.tokens);
  spec.set_node_cache(true);
  absl::StatusOr<v1::Pool> pool = client.CreatePool(name, spec);
  if (!pool.ok())
    return absl::Status(pool.status().code(), absl::StrCat(what, ": ", pool.status().message()));
  absl::Status s = [&]() -> absl::Status {
    absl::StatusOr<v1::AttachDeviceRequest> request = kvhost::MakeCudaAttachRequest(
        name, (*device)->layers(0), (*device)->layers(1), (*device)->rows());
    if (!request.ok()) return request.status();
    request->set_layer_progress(true);
    absl::StatusOr<v1::Attachment> att = client.AttachDevice(*request);
    if (!att.ok()) return att.status();
    CacheSide c{client, run, name, att->id(), page_size, pool->bytes_per_token() * page_size};
    absl::Status body = CacheBody(o, c, *att, **device, w, rng, fill_seed, results, progress, what);
    absl::Status detached = client.DetachDevice(att->id());
    return body.ok() ? detached : body;
  }();
  absl::Status deleted = client.DeletePool(name).status();
  if (s.ok()) s = deleted;
  if (s.ok()) return s;
  return absl::Status(s.code(), absl::StrCat(what, ": ", s.message()));
}

}  // namespace kvhost::bench
