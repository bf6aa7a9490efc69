// kvhost_l3_bench: the L3 tier (kvhost.v1.StorageService) against a local
// memcached cluster it starts (three servers on 127.0.0.1, as the
// integration tests do) and two kvhostds it starts on it, as two nodes.
//
//   1. Store: node A stores --pages pages in calls of --batch; GB/s of page
//      bytes and the time per page (call time / pages in the call), then
//      single-page calls: median and p99 latency. Twice: into fresh servers
//      (memcached takes memory for each new item), then the same keys again
//      (memory reused, as in a full cache that evicts).
//   2. Fetch: node B fetches them back (every page must be a hit, and is
//      compared byte for byte with what A stored); the same figures.
//   3. The ceiling, in the same run: libmemcached alone (no kvhostd, no
//      gRPC, no checksums), the same value sizes (page + record header),
//      batches and parallelism (--l3-threads handles, each a share of a
//      batch): memcached_set of keys that exist, memcached_mget. The store
//      again / fetch again rows are given as a ratio to it.
//   4. Prefix workload: --requests requests, each --shared-pages pages of
//      one of --prefixes shared prefixes then --own-pages pages of its own,
//      sent to the nodes in turn. A node serves the pages it holds locally
//      (its host pool), asks L3 for the longest stored prefix of the rest
//      (ExistPages), fetches it (FetchPages), computes the others and stores
//      them (StorePages). Reported: the L3 hit rate (pages fetched / pages
//      not held locally) and how many of node B's fetches A had stored.
//
// Figures are of this machine's loopback and memcached, not a network.
#include <libmemcached/memcached.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <tuple>
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
#include "server/storage/memcached_backend.h"
#include "server/storage/page_record.h"
#include "tests/daemon_fixture.h"
#include "tests/memcached_cluster.h"

ABSL_FLAG(std::string, kvhostd, KVHOSTD_PATH, "kvhostd binary to start (twice).");
ABSL_FLAG(uint32_t, layers, 4, "Layers of the MHA pool (8 heads x 128 dims, bf16, PAGE_FIRST).");
ABSL_FLAG(uint32_t, page_size, 16, "Tokens per page.");
ABSL_FLAG(uint64_t, pages, 256, "Pages stored and fetched in the bandwidth cases.");
ABSL_FLAG(uint64_t, batch, 32, "Pages per StorePages / FetchPages call in the bandwidth cases.");
ABSL_FLAG(uint64_t, single_calls, 100, "Single-page calls timed for the latency figures.");
ABSL_FLAG(uint64_t, requests, 200, "Requests of the prefix workload.");
ABSL_FLAG(uint64_t, prefixes, 8, "Distinct shared prefixes in the prefix workload.");
ABSL_FLAG(uint64_t, shared_pages, 8, "Pages of each shared prefix.");
ABSL_FLAG(uint64_t, own_pages, 2, "Pages of each request's own suffix.");
ABSL_FLAG(int, memcached_mb, 1024, "Memory of each memcached server (-m), MiB.");
ABSL_FLAG(int, l3_threads, 4, "kvhostd --l3-threads.");
ABSL_FLAG(bool, quick, false, "A few seconds in all (CI smoke run): small pages, few requests.");

namespace kvhost::bench {
namespace {

struct Options {
  uint32_t layers, page_size;
  uint64_t pages, batch, single_calls, requests, prefixes, shared_pages, own_pages;
  int memcached_mb, l3_threads;
};

absl::StatusOr<Options> OptionsFromFlags() {
  Options o{absl::GetFlag(FLAGS_layers),       absl::GetFlag(FLAGS_page_size),
            absl::GetFlag(FLAGS_pages),        absl::GetFlag(FLAGS_batch),
            absl::GetFlag(FLAGS_single_calls), absl::GetFlag(FLAGS_requests),
            absl::GetFlag(FLAGS_prefixes),     absl::GetFlag(FLAGS_shared_pages),
            absl::GetFlag(FLAGS_own_pages),    absl::GetFlag(FLAGS_memcached_mb),
            absl::GetFlag(FLAGS_l3_threads)};
  if (absl::GetFlag(FLAGS_quick)) {
    o.layers = 1, o.pages = 32, o.batch = 8, o.single_calls = 10, o.requests = 20;
    o.prefixes = 3, o.shared_pages = 4, o.memcached_mb = 64;
  }
  if (o.layers == 0 || o.page_size == 0 || o.pages == 0 || o.batch == 0 || o.prefixes == 0) {
    return absl::InvalidArgumentError("--layers, --page-size, --pages, --batch, --prefixes >= 1");
  }
  return o;
}

v1::PoolSpec Spec(const Options& o, uint64_t pages) {
  v1::PoolSpec spec;
  spec.set_kind(v1::MHA);
  spec.set_layout(v1::PAGE_FIRST);
  spec.set_dtype(v1::BF16);
  spec.set_page_size(o.page_size);
  spec.set_layer_num(o.layers);
  spec.set_head_num(8);
  spec.set_head_dim(128);
  spec.set_size_tokens(pages * o.page_size);
  return spec;
}

std::vector<int64_t> PageStarts(Client& client, uint64_t pages, uint32_t ps) {
  absl::StatusOr<std::vector<int64_t>> slots = client.Alloc("p", pages * ps);
  std::vector<int64_t> out;
  for (size_t i = 0; slots.ok() && i < slots->size(); i += ps) out.push_back((*slots)[i]);
  return out;
}

struct Phase {
  double gbps = 0;
  double us_per_page = 0;  // batched calls
  double single_p50_us = 0, single_p99_us = 0;
};

// Times `call(first, n)` over all pages in batches, then single pages.
template <typename Call>
absl::StatusOr<Phase> Measure(const Options& o, uint64_t page_bytes, Call call) {
  Phase phase;
  const absl::Time start = absl::Now();
  for (uint64_t first = 0; first < o.pages; first += o.batch) {
    if (absl::Status s = call(first, std::min(o.batch, o.pages - first)); !s.ok()) return s;
  }
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  phase.gbps = static_cast<double>(o.pages * page_bytes) / seconds / 1e9;
  phase.us_per_page = seconds * 1e6 / static_cast<double>(o.pages);
  std::vector<double> single;
  for (uint64_t i = 0; i < o.single_calls; ++i) {
    const absl::Time t = absl::Now();
    if (absl::Status s = call(i % o.pages, 1); !s.ok()) return s;
    single.push_back(absl::ToDoubleMicroseconds(absl::Now() - t));
  }
  std::sort(single.begin(), single.end());
  phase.single_p50_us = Percentile(single, 0.5);
  phase.single_p99_us = Percentile(single, 0.99);
  return phase;
}

template <typename T>
std::vector<T> Slice(const std::vector<T>& v, uint64_t first, uint64_t n) {
  return std::vector<T>(v.begin() + static_cast<std::ptrdiff_t>(first),
                        v.begin() + static_cast<std::ptrdiff_t>(first + n));
}

// One libmemcached handle on the cluster, set up as kvhostd's (ketama,
// binary protocol, no delay).
memcached_st* RawHandle(const testing::MemcachedCluster& cluster) {
  memcached_st* mc = memcached_create(nullptr);
  for (int i = 0; i < cluster.size(); ++i) {
    memcached_server_add(mc, "127.0.0.1", static_cast<in_port_t>(cluster.port(i)));
  }
  memcached_behavior_set(mc, MEMCACHED_BEHAVIOR_BINARY_PROTOCOL, 1);
  memcached_behavior_set(mc, MEMCACHED_BEHAVIOR_DISTRIBUTION,
                         MEMCACHED_DISTRIBUTION_CONSISTENT_KETAMA);
  memcached_behavior_set(mc, MEMCACHED_BEHAVIOR_TCP_NODELAY, 1);
  return mc;
}

// The ceiling's store and fetch: `threads` handles, each taking an equal
// share of every batch, as the tier's jobs do.
struct RawCluster {
  std::vector<memcached_st*> handles;
  std::vector<std::string> keys;  // `parts` per page, in page order
  uint64_t parts = 1;
  std::string value;  // one part
  ~RawCluster() {
    for (memcached_st* mc : handles) memcached_free(mc);
  }
  // Runs `op(handle, first, n)` on each handle's share of [first, first+n).
  template <typename Op>
  absl::Status Split(uint64_t first, uint64_t n, Op op) {
    const uint64_t t = std::min<uint64_t>(handles.size(), n);
    std::vector<absl::Status> status(t);
    std::vector<std::thread> threads;
    for (uint64_t i = 0; i < t; ++i) {
      const uint64_t begin = first + n * i / t, end = first + n * (i + 1) / t;
      threads.emplace_back([&, i, begin, end] { status[i] = op(handles[i], begin, end - begin); });
    }
    for (std::thread& th : threads) th.join();
    for (const absl::Status& s : status) {
      if (!s.ok()) return s;
    }
    return absl::OkStatus();
  }
  absl::Status Set(memcached_st* mc, uint64_t first, uint64_t n) {
    for (uint64_t i = first * parts; i < (first + n) * parts; ++i) {
      const memcached_return_t rc =
          memcached_set(mc, keys[i].data(), keys[i].size(), value.data(), value.size(), 0, 0);
      if (rc != MEMCACHED_SUCCESS) {
        return absl::UnavailableError(absl::StrCat("set: ", memcached_strerror(mc, rc)));
      }
    }
    return absl::OkStatus();
  }
  absl::Status Get(memcached_st* mc, uint64_t first, uint64_t n) {
    std::vector<const char*> ptrs;
    std::vector<size_t> lengths;
    for (uint64_t i = first * parts; i < (first + n) * parts; ++i) {
      ptrs.push_back(keys[i].data());
      lengths.push_back(keys[i].size());
    }
    memcached_return_t rc = memcached_mget(mc, ptrs.data(), lengths.data(), ptrs.size());
    if (rc != MEMCACHED_SUCCESS) {
      return absl::UnavailableError(absl::StrCat("mget: ", memcached_strerror(mc, rc)));
    }
    uint64_t got = 0;
    memcached_result_st result;
    memcached_result_create(mc, &result);
    while (memcached_fetch_result(mc, &result, &rc) != nullptr) {
      if (memcached_result_length(&result) == value.size()) ++got;
    }
    memcached_result_free(&result);
    return got == n * parts
               ? absl::OkStatus()
               : absl::DataLossError(absl::StrCat("mget got ", got, " of ", n * parts, " values"));
  }
};

struct Workload {
  uint64_t pages = 0, local = 0, l3_hits = 0, computed = 0;
  // Pages of shared prefixes a node did not hold, and those L3 served.
  uint64_t shared_missing = 0, shared_hits = 0;
  uint64_t cross_hits = 0;  // L3 hits on pages the other node stored
};

// One request at a node: local pages, then L3's longest prefix, then the rest
// computed and stored.
absl::Status Serve(Client& node, std::set<std::string>* local, std::map<std::string, int>* owner,
                   int node_id, const std::vector<std::string>& keys, uint64_t shared, uint32_t ps,
                   Workload* w) {
  size_t k = 0;
  while (k < keys.size() && local->count(keys[k])) ++k;
  w->pages += keys.size();
  w->local += k;
  std::vector<std::string> rest(keys.begin() + static_cast<std::ptrdiff_t>(k), keys.end());
  if (rest.empty()) return absl::OkStatus();
  absl::StatusOr<uint64_t> prefix = node.ExistPages("p", rest);
  if (!prefix.ok()) return prefix.status();
  std::vector<int64_t> slots = PageStarts(node, rest.size(), ps);
  if (slots.size() != rest.size()) return absl::ResourceExhaustedError("pool full; raise --pages");
  uint64_t hits = 0;
  if (*prefix > 0) {
    absl::StatusOr<v1::FetchPagesResponse> got =
        node.FetchPages("p", Slice(rest, 0, *prefix), Slice(slots, 0, *prefix));
    if (!got.ok()) return got.status();
    while (hits < *prefix && got->pages(static_cast<int>(hits)).outcome() == v1::PAGE_HIT) ++hits;
    for (uint64_t i = 0; i < hits; ++i) {
      if ((*owner)[rest[i]] != node_id) ++w->cross_hits;
    }
  }
  w->l3_hits += hits;
  const uint64_t shared_rest = shared > k ? shared - k : 0;
  w->shared_missing += shared_rest;
  w->shared_hits += std::min<uint64_t>(hits, shared_rest);
  const uint64_t compute = rest.size() - hits;
  w->computed += compute;
  if (compute > 0) {
    absl::StatusOr<v1::StorePagesResponse> stored =
        node.StorePages("p", Slice(slots, hits, compute), Slice(rest, hits, compute));
    if (!stored.ok()) return stored.status();
    for (uint64_t i = hits; i < rest.size(); ++i) owner->emplace(rest[i], node_id);
  }
  for (const std::string& key : rest) local->insert(key);
  return node
      .Free("p",
            [&] {
              std::vector<int64_t> all;
              for (int64_t s : slots) {
                for (uint32_t t = 0; t < ps; ++t) all.push_back(s + t);
              }
              return all;
            }())
      .status();
}

absl::StatusOr<Workload> PrefixWorkload(const Options& o, Client* nodes[2]) {
  std::mt19937_64 rng(7);
  const std::string run = absl::StrCat(rng());
  Workload w;
  std::set<std::string> local[2];
  std::map<std::string, int> owner;
  for (uint64_t r = 0; r < o.requests; ++r) {
    const uint64_t prefix = rng() % o.prefixes;
    std::vector<std::string> keys;
    for (uint64_t i = 0; i < o.shared_pages; ++i) {
      keys.push_back(absl::StrCat(run, "/prefix", prefix, "/", i));
    }
    for (uint64_t i = 0; i < o.own_pages; ++i) keys.push_back(absl::StrCat(run, "/req", r, "/", i));
    const int node = static_cast<int>(r % 2);
    if (absl::Status s =
            Serve(*nodes[node], &local[node], &owner, node, keys, o.shared_pages, o.page_size, &w);
        !s.ok()) {
      return s;
    }
  }
  return w;
}

absl::Status Run(const Options& o) {
  absl::StatusOr<std::unique_ptr<testing::MemcachedCluster>> cluster =
      testing::MemcachedCluster::Start(3, o.memcached_mb);
  if (!cluster.ok()) return cluster.status();
  const testing::L3SecretFile secret;  // both nodes: one fleet
  const std::vector<std::string> flags = {
      "--log-level=warn", absl::StrCat("--l3-memcached=", (*cluster)->Servers()),
      absl::StrCat("--l3-threads=", o.l3_threads), secret.Flag()};
  std::unique_ptr<testing::TestDaemon> node[2];
  Client* clients[2];
  const uint64_t pool_pages = o.pages + o.shared_pages + o.own_pages + 8;
  for (int i = 0; i < 2; ++i) {
    absl::StatusOr<std::unique_ptr<testing::TestDaemon>> d =
        testing::TestDaemon::Start(absl::GetFlag(FLAGS_kvhostd), flags);
    if (!d.ok()) return d.status();
    node[i] = *std::move(d);
    clients[i] = &node[i]->client();
    if (absl::StatusOr<v1::Pool> p = clients[i]->CreatePool("p", Spec(o, pool_pages)); !p.ok()) {
      return p.status();
    }
  }
  const std::vector<int64_t> src = PageStarts(*clients[0], o.pages, o.page_size);
  const std::vector<int64_t> dst = PageStarts(*clients[1], o.pages, o.page_size);
  absl::StatusOr<std::string> first = clients[0]->GetDataPage("p", src.at(0));
  if (!first.ok()) return first.status();
  const uint64_t page_bytes = first->size();
  std::mt19937 rng(1);
  std::vector<std::string> keys;
  std::vector<std::string> bytes;
  for (uint64_t i = 0; i < o.pages; ++i) {
    keys.push_back(absl::StrCat("bench/", rng(), "/", i));
    std::string data(page_bytes, '\0');
    for (char& c : data) c = static_cast<char>(rng());
    if (absl::Status s = clients[0]->SetFromFlatDataPage("p", src[i], data); !s.ok()) return s;
    bytes.push_back(std::move(data));
  }
  absl::PrintF(
      "kvhost_l3_bench: 3 memcached servers (%d MiB each) on 127.0.0.1, two kvhostds; "
      "pages of %d bytes (MHA PAGE_FIRST bf16, %u layers x 8 heads x 128 x %u tokens)\n",
      o.memcached_mb, page_bytes, o.layers, o.page_size);
  auto store_call = [&](uint64_t f, uint64_t n) {
    absl::StatusOr<v1::StorePagesResponse> r =
        clients[0]->StorePages("p", Slice(src, f, n), Slice(keys, f, n));
    if (!r.ok()) return r.status();
    return r->stored_pages() == n
               ? absl::OkStatus()
               : absl::DataLossError(absl::StrCat("stored ", r->stored_pages(), " of ", n,
                                                  " pages: ", r->pages(0).detail()));
  };
  // Fresh servers first take memory for every new item (memcached touches
  // its slab pages then); storing the same keys again reuses it, as a full
  // cache that evicts does.
  absl::StatusOr<Phase> cold = Measure(o, page_bytes, store_call);
  if (!cold.ok()) return cold.status();
  absl::StatusOr<Phase> store = Measure(o, page_bytes, store_call);
  if (!store.ok()) return store.status();
  auto fetch_call = [&](uint64_t f, uint64_t n) {
    absl::StatusOr<v1::FetchPagesResponse> r =
        clients[1]->FetchPages("p", Slice(keys, f, n), Slice(dst, f, n));
    if (!r.ok()) return r.status();
    if (r->hit_pages() != n) {
      return absl::DataLossError(absl::StrCat("fetched ", r->hit_pages(), " of ", n, " pages"));
    }
    return absl::OkStatus();
  };
  absl::StatusOr<Phase> fetch = Measure(o, page_bytes, fetch_call);
  if (!fetch.ok()) return fetch.status();
  absl::StatusOr<Phase> refetch = Measure(o, page_bytes, fetch_call);
  if (!refetch.ok()) return refetch.status();
  for (uint64_t i = 0; i < o.pages; ++i) {
    absl::StatusOr<std::string> got = clients[1]->GetDataPage("p", dst[i]);
    if (!got.ok() || *got != bytes[i]) {
      return absl::DataLossError(absl::StrCat("page ", i, " fetched by node B differs"));
    }
  }
  // The ceiling: the same items through libmemcached alone. A page is split
  // as kvhostd splits it (items of up to the default --l3-item-bytes, each a
  // part behind the record header); the keys are new, set once untimed so
  // that the timed sets, like "store again", find them.
  RawCluster raw;
  const uint64_t room = kDefaultMemcachedItemBytes - kPartHeaderBytes;
  raw.parts = (page_bytes + room - 1) / room;
  raw.value.assign((page_bytes + raw.parts - 1) / raw.parts + kPartHeaderBytes, 'x');
  for (uint64_t i = 0; i < o.pages; ++i) {
    for (uint64_t p = 0; p < raw.parts; ++p) {
      raw.keys.push_back(absl::StrCat("ceiling/", keys[i], ".", p));
    }
  }
  for (int i = 0; i < o.l3_threads; ++i) raw.handles.push_back(RawHandle(**cluster));
  auto raw_set = [&](uint64_t f, uint64_t n) {
    return raw.Split(f, n,
                     [&](memcached_st* mc, uint64_t b, uint64_t m) { return raw.Set(mc, b, m); });
  };
  auto raw_get = [&](uint64_t f, uint64_t n) {
    return raw.Split(f, n,
                     [&](memcached_st* mc, uint64_t b, uint64_t m) { return raw.Get(mc, b, m); });
  };
  if (absl::Status s = raw_set(0, o.pages); !s.ok()) return s;
  absl::StatusOr<Phase> raw_store = Measure(o, page_bytes, raw_set);
  if (!raw_store.ok()) return raw_store.status();
  absl::StatusOr<Phase> raw_fetch = Measure(o, page_bytes, raw_get);
  if (!raw_fetch.ok()) return raw_fetch.status();

  std::vector<std::vector<std::string>> rows = {
      {"op", "GB/s", "of ceiling", "us/page (batch)", "p50 us (1 page)", "p99 us (1 page)"}};
  const double store_ceiling = raw_store->gbps, fetch_ceiling = raw_fetch->gbps;
  for (const auto& [name, p, ceiling] : {std::tuple{"store, fresh servers (node A)", *cold, 0.0},
                                         {"store again (node A)", *store, store_ceiling},
                                         {"fetch (node B)", *fetch, 0.0},
                                         {"fetch again (node B)", *refetch, fetch_ceiling},
                                         {"ceiling: libmemcached set, keys exist", *raw_store, 0.0},
                                         {"ceiling: libmemcached mget", *raw_fetch, 0.0}}) {
    rows.push_back({name, absl::StrFormat("%.3f", p.gbps),
                    ceiling > 0 ? absl::StrFormat("%.2f", p.gbps / ceiling) : "",
                    absl::StrFormat("%.0f", p.us_per_page),
                    absl::StrFormat("%.0f", p.single_p50_us),
                    absl::StrFormat("%.0f", p.single_p99_us)});
  }
  absl::PrintF(
      "%d pages in calls of %d, byte-exact on node B; the ceiling (same run, same values, "
      "batches and %d handles) without kvhostd:\n",
      o.pages, o.batch, o.l3_threads);
  PrintTable(rows, "lrrrrr", "  ");

  absl::StatusOr<Workload> w = PrefixWorkload(o, clients);
  if (!w.ok()) return w.status();
  const uint64_t not_local = w->pages - w->local;
  auto percent = [](uint64_t a, uint64_t b) {
    return b ? 100.0 * static_cast<double>(a) / static_cast<double>(b) : 0.0;
  };
  absl::PrintF(
      "prefix workload: %d requests over 2 nodes in turn, %d prefixes of %d pages + %d own pages "
      "each\n  pages %d: held locally %d, from L3 %d, computed %d\n"
      "  L3 hit rate: %.1f%% of the pages a node did not hold; %.1f%% of the shared-prefix pages "
      "it did not hold (%d of %d); %d hits on pages the other node stored\n",
      o.requests, o.prefixes, o.shared_pages, o.own_pages, w->pages, w->local, w->l3_hits,
      w->computed, percent(w->l3_hits, not_local), percent(w->shared_hits, w->shared_missing),
      w->shared_hits, w->shared_missing, w->cross_hits);
  return absl::OkStatus();
}

}  // namespace
}  // namespace kvhost::bench

int main(int argc, char** argv) {
  kvhost::ParseFlags(argc, argv,
                     "kvhost_l3_bench: the L3 tier's store / fetch GB/s and latency against a "
                     "local 3-server memcached cluster, and a two-node prefix workload's hit "
                     "rate.\nUsage: kvhost_l3_bench [--pages=256] [--batch=32] [--layers=4] "
                     "[--requests=200] [--quick]",
                     "bench/l3_bench.cc");
  if (kvhost::testing::MemcachedBinary().empty()) {  // ctest reads 77 as skipped
    absl::FPrintF(stderr, "SKIP: %s\n", kvhost::testing::kNoMemcached);
    return 77;
  }
  return kvhost::bench::Finish(kvhost::bench::OptionsFromFlags(), kvhost::bench::Run);
}
