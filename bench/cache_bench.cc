// kvhost_cache_bench: the node cache (kvhost.v1.CacheService) on the host
// backend, against one kvhostd it starts, with two engine instances (two
// clients, each with its worker session and its own shared-memory device
// pool attached to the cache's pool).
//
//   1. Latency of single-key calls on both paths, in the same run: over
//      gRPC (a third instance, ClientOptions::fast_path off) and over the
//      fast path (instance 0, proto/kvhost/v1/fast_path.proto): Lookup;
//      Store and Restore, the call (submit) and the call plus WaitTransfer
//      (done, its wait on the same path: at most 60 s, which the fast path
//      carries); beside them an index-addressed pool's Backup and Load of
//      one page, the calls a HiCache-style host pool makes for the same move.
//   2. Throughput: --pages new keys stored in calls of --batch (each waited
//      for), then restored into other device rows and compared byte for
//      byte; GB/s and pages/s against the ceiling of the same run, memcpy of
//      the same bytes between two shared-memory buffers in this process (the
//      host engine's copies are memcpys), and against the index-addressed
//      pool's Backup and Load of the same batches.
//   3. Prefix workload: --requests requests, each --shared-pages pages of one
//      of --prefixes shared prefixes then --own-pages pages of its own, sent
//      to the two instances in turn. An instance looks its keys up, restores
//      the present prefix and stores the rest. Once with one cache both
//      instances share, once with a private cache per instance of half the
//      pages (the same memory: the per-engine host pool of today's engines);
//      halfway through, instance 0 restarts, which a private, in-process pool
//      does not survive (its cache is made again, empty). Reported: the hit
//      rate (pages restored / pages asked) of each half, and how many of the
//      restored pages the other instance had stored.
//
// Figures are of this machine's memory and loopback; the cuda backend's GB/s
// are the transfer benchmarks' (the cache moves pages by the same paths).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "bench/bench_util.h"
#include "common/cli_flags.h"
#include "kvhost/client.h"
#include "tests/daemon_fixture.h"

ABSL_FLAG(std::string, kvhostd, KVHOSTD_PATH, "kvhostd binary to start.");
ABSL_FLAG(uint32_t, layers, 4, "Layers of the MHA pools (8 heads x 128 dims, bf16, PAGE_FIRST).");
ABSL_FLAG(uint32_t, page_size, 16, "Tokens per page.");
ABSL_FLAG(uint64_t, pages, 256, "Pages stored and restored in the throughput case.");
ABSL_FLAG(uint64_t, batch, 32, "Keys per Store / Restore call in the throughput case.");
ABSL_FLAG(uint64_t, single_calls, 200, "Single-key calls timed for the latency figures.");
ABSL_FLAG(uint64_t, requests, 400, "Requests of the prefix workload.");
ABSL_FLAG(uint64_t, prefixes, 16, "Distinct shared prefixes in the prefix workload.");
ABSL_FLAG(uint64_t, shared_pages, 8, "Pages of each shared prefix.");
ABSL_FLAG(uint64_t, own_pages, 2, "Pages of each request's own suffix.");
ABSL_FLAG(uint64_t, workload_cache_pages, 512,
          "Pages of the shared cache in the prefix workload (each private cache has half).");
ABSL_FLAG(bool, quick, false, "A few seconds in all (CI smoke run): small pages, few calls.");

namespace kvhost::bench {
namespace {

using cli::Percentile;
using cli::PrintTable;

constexpr char kToken[] = "bench-token";

struct Options {
  uint32_t layers, page_size;
  uint64_t pages, batch, single_calls, requests, prefixes, shared_pages, own_pages, cache_pages;
};

absl::StatusOr<Options> OptionsFromFlags() {
  Options o{absl::GetFlag(FLAGS_layers),       absl::GetFlag(FLAGS_page_size),
            absl::GetFlag(FLAGS_pages),        absl::GetFlag(FLAGS_batch),
            absl::GetFlag(FLAGS_single_calls), absl::GetFlag(FLAGS_requests),
            absl::GetFlag(FLAGS_prefixes),     absl::GetFlag(FLAGS_shared_pages),
            absl::GetFlag(FLAGS_own_pages),    absl::GetFlag(FLAGS_workload_cache_pages)};
  if (absl::GetFlag(FLAGS_quick)) {
    o = {2, 4, 32, 8, 20, 40, 4, 4, 1, 64};
  }
  for (const auto& [name, value] : {std::pair{"layers", uint64_t{o.layers}},
                                    {"page_size", o.page_size},
                                    {"pages", o.pages},
                                    {"batch", o.batch},
                                    {"single_calls", o.single_calls},
                                    {"requests", o.requests},
                                    {"prefixes", o.prefixes},
                                    {"shared_pages", o.shared_pages},
                                    {"workload_cache_pages", o.cache_pages}}) {
    if (value == 0) return absl::InvalidArgumentError(absl::StrCat("--", name, " must be > 0"));
  }
  if (o.batch > 4096 || o.shared_pages + o.own_pages > 4096) {
    return absl::InvalidArgumentError("--batch and a request's pages: at most 4096 (keys a call)");
  }
  if (o.pages % o.batch != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--pages=", o.pages, " is not a multiple of --batch=", o.batch));
  }
  return o;
}

std::vector<int64_t> PageRows(uint64_t first_page, uint64_t pages, uint32_t page_size) {
  std::vector<int64_t> rows(pages * page_size);
  for (size_t r = 0; r < rows.size(); ++r) {
    rows[r] = static_cast<int64_t>(first_page * page_size + r);
  }
  return rows;
}

double Us(absl::Duration d) { return absl::ToDoubleMicroseconds(d); }

// One engine instance: a client, its device pool and an attachment of it
// to each pool it uses.
struct Instance {
  std::unique_ptr<Client> client;
  std::unique_ptr<ShmDevicePool> device;
  std::map<std::string, std::string> attachments;  // pool -> attachment

  static absl::StatusOr<std::unique_ptr<Instance>> Start(const testing::TestDaemon& d,
                                                         const v1::Pool& shape,
                                                         uint64_t device_tokens,
                                                         bool fast_path = true) {
    auto i = std::make_unique<Instance>();
    ClientOptions options;
    options.address = d.address();
    options.owner_token = kToken;
    options.fast_path = fast_path;
    absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(options);
    if (!client.ok()) return client.status();
    i->client = *std::move(client);
    absl::StatusOr<std::unique_ptr<ShmDevicePool>> device =
        ShmDevicePool::Create(shape, device_tokens, d.shm_dir());
    if (!device.ok()) return device.status();
    i->device = *std::move(device);
    return i;
  }
  absl::StatusOr<std::string> AttachmentOf(const std::string& pool) {
    if (auto it = attachments.find(pool); it != attachments.end()) return it->second;
    absl::StatusOr<v1::Attachment> att = client->AttachDevice(device->MakeAttachRequest(pool));
    if (!att.ok()) return att.status();
    attachments[pool] = att->id();
    return att->id();
  }
  // Fills device page `page` with bytes only `seed` decides.
  void FillPage(uint64_t page, uint32_t page_size, uint32_t seed) const {
    for (uint32_t c = 0; c < device->components(); ++c) {
      for (uint32_t l = 0; l < device->layers(); ++l) {
        uint8_t* row = device->row(c, l, page * page_size);
        for (uint64_t b = 0; b < page_size * device->row_bytes(c); ++b) {
          row[b] = static_cast<uint8_t>(seed * 131 + c * 7 + l * 3 + b);
        }
      }
    }
  }
  bool SamePages(uint64_t a, uint64_t b, uint64_t pages, uint32_t page_size) const {
    for (uint32_t c = 0; c < device->components(); ++c) {
      for (uint32_t l = 0; l < device->layers(); ++l) {
        if (std::memcmp(device->row(c, l, a * page_size), device->row(c, l, b * page_size),
                        pages * page_size * device->row_bytes(c)) != 0) {
          return false;
        }
      }
    }
    return true;
  }
};

// The latency table's waits: the fast path's longest (fast_path.proto's
// FastPathRequest.timeout_ms bound), so that a fast-path client's waits take
// its mailbox too; a longer one (WaitTransfer's default, 10 min) goes over
// gRPC.
constexpr absl::Duration kTimedWait = absl::Seconds(60);

// A call that returns a ticket (0: none to wait for), and its wait.
absl::Status Wait(Client& client, absl::StatusOr<uint64_t> ticket,
                  absl::Duration timeout = absl::Minutes(10)) {
  if (!ticket.ok()) return ticket.status();
  if (*ticket == 0) return absl::OkStatus();
  return client.WaitTransfer(*ticket, timeout).status();
}

absl::StatusOr<uint64_t> StoreTicket(Instance& i, const std::string& cache,
                                     const std::vector<std::string>& keys, uint64_t first_page,
                                     uint32_t page_size) {
  absl::StatusOr<std::string> att = i.AttachmentOf(cache);
  if (!att.ok()) return att.status();
  absl::StatusOr<v1::CacheStoreReply> stored =
      i.client->CacheStore(cache, *att, keys, PageRows(first_page, keys.size(), page_size));
  if (!stored.ok()) return stored.status();
  return stored->has_ticket() ? stored->ticket().id() : 0;
}

absl::StatusOr<uint64_t> RestoreTicket(Instance& i, const std::string& cache,
                                       const std::vector<std::string>& keys, uint64_t first_page,
                                       uint32_t page_size) {
  absl::StatusOr<std::string> att = i.AttachmentOf(cache);
  if (!att.ok()) return att.status();
  absl::StatusOr<v1::TransferTicket> ticket =
      i.client->CacheRestore(cache, *att, keys, PageRows(first_page, keys.size(), page_size));
  if (!ticket.ok()) return ticket.status();
  return ticket->id();
}

struct Latency {
  std::vector<double> submit_us, done_us;
};

std::vector<std::string> LatencyRow(const char* name, Latency& l) {
  std::sort(l.submit_us.begin(), l.submit_us.end());
  std::sort(l.done_us.begin(), l.done_us.end());
  auto us = [](const std::vector<double>& v, double q) {
    return v.empty() ? std::string("") : absl::StrFormat("%.0f", Percentile(v, q));
  };
  return {name, us(l.submit_us, 0.5), us(l.submit_us, 0.99), us(l.done_us, 0.5),
          us(l.done_us, 0.99)};
}

// Times `n` calls of `call(k)`, which returns a ticket to wait for (0: none).
template <typename Call>
absl::StatusOr<Latency> TimeCalls(Client& client, uint64_t n, Call call) {
  Latency l;
  for (uint64_t k = 0; k < n; ++k) {
    const absl::Time start = absl::Now();
    absl::StatusOr<uint64_t> ticket = call(k);
    if (!ticket.ok()) return ticket.status();
    l.submit_us.push_back(Us(absl::Now() - start));
    if (*ticket == 0) continue;
    if (absl::Status s = Wait(client, *ticket, kTimedWait); !s.ok()) return s;
    l.done_us.push_back(Us(absl::Now() - start));
  }
  return l;
}

// The five single-key figures of one instance's path: cache Lookup, Store,
// Restore, pool Backup, Load. `tag` keeps each path's stored keys apart.
absl::StatusOr<std::vector<Latency>> TimePath(const Options& o, Instance& a,
                                              const std::string& plain, const std::string& tag) {
  const uint32_t ps = o.page_size;
  // Keys to find and restore: stored once beforehand.
  if (absl::Status s = Wait(*a.client, StoreTicket(a, "cache", {"warm"}, 0, ps)); !s.ok()) {
    return s;
  }
  absl::StatusOr<std::string> att = a.AttachmentOf(plain);
  if (!att.ok()) return att.status();
  const std::vector<int64_t> host = PageRows(0, 1, ps), dev = PageRows(0, 1, ps);
  using Call = std::function<absl::StatusOr<uint64_t>(uint64_t)>;
  const Call calls[] = {
      [&](uint64_t) -> absl::StatusOr<uint64_t> {
        absl::StatusOr<v1::CacheLookupReply> r = a.client->CacheLookup("cache", {"warm"});
        if (!r.ok()) return r.status();
        if (r->prefix() != 1) return absl::InternalError("warm not found");
        return 0;
      },
      [&](uint64_t k) { return StoreTicket(a, "cache", {absl::StrCat(tag, "-", k)}, 0, ps); },
      [&](uint64_t) { return RestoreTicket(a, "cache", {"warm"}, 1, ps); },
      [&](uint64_t) { return a.client->Backup(*att, host, dev); },
      [&](uint64_t) { return a.client->Load(*att, host, dev); }};
  std::vector<Latency> out;
  for (const Call& call : calls) {
    absl::StatusOr<Latency> l = TimeCalls(*a.client, o.single_calls, call);
    if (!l.ok()) return l.status();
    out.push_back(*std::move(l));
  }
  return out;
}

// `grpc` has the fast path off, `fast` on; each path's rows side by side.
absl::Status RunLatency(const Options& o, Instance& grpc, Instance& fast,
                        const std::string& plain) {
  absl::StatusOr<std::vector<Latency>> slow = TimePath(o, grpc, plain, "lat-grpc");
  if (!slow.ok()) return slow.status();
  const uint64_t fast_before = fast.client->fast_path_calls();
  absl::StatusOr<std::vector<Latency>> quick = TimePath(o, fast, plain, "lat-fast");
  if (!quick.ok()) return quick.status();
  // Every timed call and wait of the fast instance should have taken the
  // mailbox; say so when it did not (no handoff socket, refused, busy).
  const uint64_t fast_calls = fast.client->fast_path_calls() - fast_before;
  const char* fast_name = fast.client->fast_path_open() ? "fast path" : "fast path (not open)";
  const char* names[] = {"cache Lookup (hit)", "cache Store (new key)", "cache Restore",
                         "pool Backup, one page (index-addressed)",
                         "pool Load, one page (index-addressed)"};
  std::vector<std::vector<std::string>> rows = {
      {"call", "path", "call p50", "call p99", "done p50", "done p99"}};
  for (size_t c = 0; c < std::size(names); ++c) {
    for (auto& [path, figures] : {std::pair{"gRPC", &*slow}, std::pair{fast_name, &*quick}}) {
      std::vector<std::string> row = LatencyRow(names[c], (*figures)[c]);
      row.insert(row.begin() + 1, path);
      rows.push_back(std::move(row));
    }
  }
  absl::PrintF("single-key calls, %d each, on both paths (us); %d calls took the fast path:\n",
               o.single_calls, fast_calls);
  PrintTable(rows, "llrrrr", "  ");
  return absl::OkStatus();
}

struct Rate {
  double gbps = 0, pages_per_s = 0;
};

Rate RateOf(uint64_t pages, uint64_t page_bytes, absl::Duration d) {
  const double s = absl::ToDoubleSeconds(d);
  return {static_cast<double>(pages * page_bytes) / s / 1e9, static_cast<double>(pages) / s};
}

absl::Status RunThroughput(const Options& o, Instance& a, const std::string& plain,
                           uint64_t page_bytes) {
  const uint32_t ps = o.page_size;
  for (uint64_t p = 0; p < 2 * o.batch; ++p) a.FillPage(p, ps, static_cast<uint32_t>(p));
  // Store: batch after batch of new keys from device pages [0, batch).
  absl::Time start = absl::Now();
  for (uint64_t b = 0; b < o.pages / o.batch; ++b) {
    std::vector<std::string> keys;
    for (uint64_t k = 0; k < o.batch; ++k) keys.push_back(absl::StrCat("tp-", b, "-", k));
    if (absl::Status s = Wait(*a.client, StoreTicket(a, "cache", keys, 0, ps)); !s.ok()) return s;
  }
  const Rate store = RateOf(o.pages, page_bytes, absl::Now() - start);
  // Restore them into device pages [batch, 2 batch), each batch checked.
  start = absl::Now();
  absl::Duration checking;
  for (uint64_t b = 0; b < o.pages / o.batch; ++b) {
    std::vector<std::string> keys;
    for (uint64_t k = 0; k < o.batch; ++k) keys.push_back(absl::StrCat("tp-", b, "-", k));
    if (absl::Status s = Wait(*a.client, RestoreTicket(a, "cache", keys, o.batch, ps)); !s.ok()) {
      return s;
    }
    const absl::Time check = absl::Now();
    if (!a.SamePages(0, o.batch, o.batch, ps)) {
      return absl::DataLossError(absl::StrCat("batch ", b, " restored other bytes than stored"));
    }
    for (uint64_t p = o.batch; p < 2 * o.batch; ++p) a.FillPage(p, ps, 0xEE);
    checking += absl::Now() - check;
  }
  const Rate restore = RateOf(o.pages, page_bytes, absl::Now() - start - checking);
  // The same batches through the index-addressed pool.
  absl::StatusOr<std::string> att = a.AttachmentOf(plain);
  if (!att.ok()) return att.status();
  const std::vector<int64_t> dev = PageRows(0, o.batch, ps);
  auto pool_rate = [&](bool backup) -> absl::StatusOr<Rate> {
    const absl::Time t = absl::Now();
    for (uint64_t b = 0; b < o.pages / o.batch; ++b) {
      const std::vector<int64_t> host = PageRows(b * o.batch, o.batch, ps);
      absl::StatusOr<uint64_t> ticket =
          backup ? a.client->Backup(*att, host, dev) : a.client->Load(*att, host, dev);
      if (absl::Status s = Wait(*a.client, ticket); !s.ok()) return s;
    }
    return RateOf(o.pages, page_bytes, absl::Now() - t);
  };
  absl::StatusOr<Rate> backup = pool_rate(true);
  if (!backup.ok()) return backup.status();
  absl::StatusOr<Rate> load = pool_rate(false);
  if (!load.ok()) return load.status();
  // The ceiling: memcpy of the same bytes, batch by batch, between two
  // shared-memory buffers.
  const uint64_t batch_bytes = o.batch * page_bytes;
  absl::StatusOr<std::unique_ptr<ShmScratch>> from = ShmScratch::Create("/dev/shm", batch_bytes);
  if (!from.ok()) return from.status();
  absl::StatusOr<std::unique_ptr<ShmScratch>> to =
      ShmScratch::Create("/dev/shm", o.pages * page_bytes);
  if (!to.ok()) return to.status();
  start = absl::Now();
  for (uint64_t b = 0; b < o.pages / o.batch; ++b) {
    std::memcpy((*to)->data() + b * batch_bytes, (*from)->data(), batch_bytes);
  }
  const Rate ceiling = RateOf(o.pages, page_bytes, absl::Now() - start);
  auto row = [&](const char* name, const Rate& r) {
    return std::vector<std::string>{name, absl::StrFormat("%.2f", r.gbps),
                                    absl::StrFormat("%.2f", r.gbps / ceiling.gbps),
                                    absl::StrFormat("%.0f", r.pages_per_s)};
  };
  absl::PrintF(
      "%d pages of %d KiB in calls of %d keys (each waited for), restored byte-exact; ceiling: "
      "memcpy of the same bytes in this process, same run:\n",
      o.pages, page_bytes / 1024, o.batch);
  PrintTable({{"op", "GB/s", "of ceiling", "pages/s"},
              row("cache Store", store),
              row("cache Restore", restore),
              row("pool Backup (index-addressed)", *backup),
              row("pool Load (index-addressed)", *load),
              row("ceiling: memcpy", ceiling)},
             "lrrr", "  ");
  return absl::OkStatus();
}

struct Half {
  uint64_t asked = 0, restored = 0, cross = 0;
};

// The prefix workload on the caches `cache_of[i]` of instance i (the same
// name twice: shared); `restart` makes instance 0 anew halfway.
absl::StatusOr<std::pair<Half, Half>> PrefixWorkload(
    const Options& o, std::vector<std::unique_ptr<Instance>>& instances,
    const std::vector<std::string>& cache_of, const std::function<absl::Status()>& restart) {
  const uint32_t ps = o.page_size;
  const uint64_t pages = o.shared_pages + o.own_pages;
  std::mt19937_64 rng(7);
  std::map<std::string, int> stored_by;  // key -> instance (shared cache: who stored it)
  std::pair<Half, Half> halves;
  for (uint64_t r = 0; r < o.requests; ++r) {
    if (r == o.requests / 2) {
      if (absl::Status s = restart(); !s.ok()) return s;
    }
    Half& half = r < o.requests / 2 ? halves.first : halves.second;
    const int who = static_cast<int>(r % 2);
    Instance& in = *instances[who];
    const std::string& cache = cache_of[who];
    const uint64_t prefix = rng() % o.prefixes;
    std::vector<std::string> keys;
    for (uint64_t j = 0; j < o.shared_pages; ++j) keys.push_back(absl::StrCat("p", prefix, "-", j));
    for (uint64_t j = 0; j < o.own_pages; ++j) keys.push_back(absl::StrCat("r", r, "-", j));
    absl::StatusOr<v1::CacheLookupReply> found = in.client->CacheLookup(cache, keys);
    if (!found.ok()) return found.status();
    const uint64_t n = found->prefix();
    half.asked += pages;
    half.restored += n;
    if (n > 0) {
      const std::vector<std::string> hit(keys.begin(), keys.begin() + n);
      for (const std::string& k : hit) half.cross += stored_by[cache + "/" + k] != who ? 1 : 0;
      if (absl::Status s = Wait(*in.client, RestoreTicket(in, cache, hit, 0, ps)); !s.ok()) {
        return s;
      }
    }
    if (n < pages) {
      const std::vector<std::string> rest(keys.begin() + n, keys.end());
      for (const std::string& k : rest) stored_by[cache + "/" + k] = who;
      if (absl::Status s = Wait(*in.client, StoreTicket(in, cache, rest, n, ps)); !s.ok()) {
        return s;
      }
    }
  }
  return halves;
}

absl::Status Run(const Options& o) {
  absl::StatusOr<std::unique_ptr<testing::TestDaemon>> started =
      testing::TestDaemon::Start(absl::GetFlag(FLAGS_kvhostd));
  if (!started.ok()) return started.status();
  testing::TestDaemon& d = **started;
  ClientOptions options;
  options.address = d.address();
  options.owner_token = kToken;
  options.worker_session = false;
  absl::StatusOr<std::unique_ptr<Client>> admin_client = Client::Connect(options);
  if (!admin_client.ok()) return admin_client.status();
  Client& admin = **admin_client;
  auto create = [&](const std::string& name, uint64_t pages,
                    bool node_cache) -> absl::StatusOr<v1::Pool> {
    v1::PoolSpec spec =
        BenchPoolSpec(v1::MHA, v1::PAGE_FIRST, o.page_size, o.layers, pages * o.page_size);
    spec.set_node_cache(node_cache);
    return admin.CreatePool(name, spec);
  };
  // The throughput keys, each path's single-key stores and "warm".
  const uint64_t bench_pages = o.pages + 2 * o.single_calls + 1;
  absl::StatusOr<v1::Pool> cache = create("cache", bench_pages, true);
  if (!cache.ok()) return cache.status();
  absl::StatusOr<v1::Pool> plain = create("plain", o.pages, false);
  if (!plain.ok()) return plain.status();
  if (absl::StatusOr<std::vector<int64_t>> all = admin.Alloc("plain", o.pages * o.page_size);
      !all.ok()) {
    return all.status();
  }
  const uint64_t page_bytes = cache->bytes_per_token() * o.page_size;
  const uint64_t device_pages = std::max(2 * o.batch, o.shared_pages + o.own_pages);
  std::vector<std::unique_ptr<Instance>> instances(2);
  for (auto& i : instances) {
    absl::StatusOr<std::unique_ptr<Instance>> started_i =
        Instance::Start(d, *cache, device_pages * o.page_size);
    if (!started_i.ok()) return started_i.status();
    i = *std::move(started_i);
  }
  absl::PrintF(
      "kvhostd %s, host backend; MHA PAGE_FIRST bf16, %d layers x 8 heads x 128, %d "
      "tokens a page (%d KiB)\n\n",
      d.address(), o.layers, o.page_size, page_bytes / 1024);
  // The latency table's gRPC side: an instance with the fast path off.
  absl::StatusOr<std::unique_ptr<Instance>> grpc_only =
      Instance::Start(d, *cache, device_pages * o.page_size, /*fast_path=*/false);
  if (!grpc_only.ok()) return grpc_only.status();
  if (absl::Status s = RunLatency(o, **grpc_only, *instances[0], "plain"); !s.ok()) return s;
  grpc_only->reset();
  absl::PrintF("\n");
  if (absl::Status s = RunThroughput(o, *instances[0], "plain", page_bytes); !s.ok()) return s;

  // The prefix workload: shared, then private caches of half the pages.
  for (const char* name : {"shared", "private-0", "private-1"}) {
    absl::StatusOr<v1::Pool> made =
        create(name, std::string(name) == "shared" ? o.cache_pages : o.cache_pages / 2, true);
    if (!made.ok()) return made.status();
  }
  auto restart_instance = [&]() -> absl::Status {
    instances[0].reset();
    absl::StatusOr<std::unique_ptr<Instance>> again =
        Instance::Start(d, *cache, device_pages * o.page_size);
    if (!again.ok()) return again.status();
    instances[0] = *std::move(again);
    return absl::OkStatus();
  };
  absl::StatusOr<std::pair<Half, Half>> shared =
      PrefixWorkload(o, instances, {"shared", "shared"}, restart_instance);
  if (!shared.ok()) return shared.status();
  // A private pool lives in its engine's process: the restart loses it.
  absl::StatusOr<std::pair<Half, Half>> priv =
      PrefixWorkload(o, instances, {"private-0", "private-1"}, [&]() -> absl::Status {
        if (absl::Status s = restart_instance(); !s.ok()) return s;
        if (absl::StatusOr<uint64_t> gone = admin.DeletePool("private-0"); !gone.ok()) {
          return gone.status();
        }
        return create("private-0", o.cache_pages / 2, true).status();
      });
  if (!priv.ok()) return priv.status();
  auto pct = [](uint64_t a, uint64_t b) {
    return b ? absl::StrFormat("%.1f%%", 100.0 * static_cast<double>(a) / static_cast<double>(b))
             : std::string("-");
  };
  auto row = [&](const char* name, const Half& first, const Half& second) {
    return std::vector<std::string>{
        name, pct(first.restored, first.asked), pct(second.restored, second.asked),
        pct(first.cross + second.cross, first.restored + second.restored)};
  };
  absl::PrintF(
      "\nprefix workload: %d requests to 2 instances in turn, %d prefixes of %d pages + %d own "
      "pages each; instance 0 restarts after request %d; %d cache pages in all:\n",
      o.requests, o.prefixes, o.shared_pages, o.own_pages, o.requests / 2, o.cache_pages);
  PrintTable({{"caches", "hit rate, 1st half", "2nd half (after restart)",
               "restored pages the other stored"},
              row("one shared node cache", shared->first, shared->second),
              row("a private pool per instance (baseline)", priv->first, priv->second)},
             "lrrr", "  ");
  return absl::OkStatus();
}

}  // namespace
}  // namespace kvhost::bench

int main(int argc, char** argv) {
  kvhost::ParseFlags(argc, argv,
                     "kvhost_cache_bench: the node cache's call latency, pages/s against memcpy, "
                     "and a two-instance prefix workload's hit rate against private pools.\n"
                     "Usage: kvhost_cache_bench [--pages=256] [--batch=32] [--layers=4] "
                     "[--requests=400] [--quick]",
                     "bench/cache_bench.cc");
  return kvhost::bench::Finish(kvhost::bench::OptionsFromFlags(), kvhost::bench::Run);
}
