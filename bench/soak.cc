// kvhost_soak: soak and fault test of kvhostd. For
// --seconds it runs, against one daemon (its own, host backend, unless
// --address names one):
//
//  * scheduler threads (--clients), each with its own Client, doing random
//    Alloc / Free / GetPageBufferMeta / GetDataPage / SetFromFlatDataPage /
//    GetPool on pools of several kinds and page sizes, of which a share
//    (--invalid-share) are deliberately invalid requests, each checked for its
//    exact status code and for the pool being unchanged after it; beside
//    them, lookups of a node cache (valid: keys it does not hold; invalid:
//    an empty, too long or repeated key, too many keys, no token, a pool
//    that is not a node cache, an unknown cache), each invalid one checked
//    for its code and for the cache's figures being unchanged after it;
//  * worker processes (--workers; this binary again, with --worker), each
//    with its own Client in a worker session and a ShmDevicePool attached to
//    a pool: they write a pattern into device rows, back it up, journal what
//    WaitTransfer confirmed, load journaled slots back and compare the bytes;
//    their invalid requests include another worker's attachment id and
//    ticket (each worker leaves them in a file, as a leaked capability)
//    used by a second client without that worker's session: NOT_FOUND, and
//    the owner's own transfers and byte checks go on unharmed; and that
//    client's AttachDevice, without the token, on a protected pool while it
//    is being created (never OK); 8 silent connections of that client to
//    the handoff socket, behind which the worker's own handoff still gets
//    its reply; and that client's session asking for fast-path mailboxes
//    until it is refused (RESOURCE_EXHAUSTED naming its share), after which
//    the worker's session still gets one;
//  * faults: every --kill-every seconds (randomised) the driver SIGKILLs a
//    worker, half the time right after it submitted a Backup or Load, checks
//    that the daemon closes the dead worker's session and attachments within
//    --session-timeout + 1 s, removes its shm file and starts a replacement
//    that loads and verifies every slot the dead one journaled before it
//    takes the slots over.
//
// Host slots of the workers' pools are allocated by the driver (the
// scheduler's role in a serving stack) and handed to each worker in a lease
// file, so that the driver's ledger stays exact even when a worker dies
// between two calls. Conservation (allocated == what the ledgers hold) is
// checked after every invalid request, after every kill and every second.
// Any violation or unexpected status is a failure: printed at once, counted,
// and the exit code is 0 only when there were none.
//
// Threads: the scheduler threads share the ledgers under one reader / writer
// lock: valid requests hold it shared, invalid requests and the checks hold
// it exclusively, so that the pool's counts are exact while they look.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <shared_mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bench/bench_util.h"
#include "client/handoff.h"
#include "common/cli_flags.h"
#include "kvhost/client.h"
#include "kvhost/layer_progress.h"
#include "tests/daemon_fixture.h"

ABSL_FLAG(double, seconds, 60, "How long the soak runs.");
ABSL_FLAG(uint32_t, clients, 4, "Scheduler threads, each with its own Client.");
ABSL_FLAG(uint32_t, workers, 2, "Worker processes (each one device pool, one attachment).");
ABSL_FLAG(double, invalid_share, 0.15, "Share of requests that are deliberately invalid.");
ABSL_FLAG(double, kill_every, 3, "Mean seconds between worker kills (0: no kills).");
ABSL_FLAG(uint64_t, seed, 1, "Seed of every random choice (workers get seed + incarnation).");
ABSL_FLAG(std::string, address, "", "kvhostd to test ('unix:///path.sock'); empty: start one.");
ABSL_FLAG(std::string, kvhostd, KVHOSTD_PATH, "kvhostd binary to start when --address is empty.");
ABSL_FLAG(absl::Duration, session_timeout, absl::Seconds(2),
          "--session-timeout of the daemon started (or of the one at --address).");
ABSL_FLAG(std::string, memory_limit, "512M", "--memory-limit of the daemon started.");
ABSL_FLAG(std::string, json, "", "Also write the JSON summary to this file.");
// Worker mode: set by the driver when it starts a worker.
ABSL_FLAG(bool, worker, false, "Run as a worker process (started by the driver).");
ABSL_FLAG(std::string, pool, "", "Worker: the pool to attach to.");
ABSL_FLAG(std::string, shm_dir, "", "Worker: the daemon's --shm-dir.");
ABSL_FLAG(std::string, dir, "", "Worker: the driver's folder (lease, journal, stats files).");
ABSL_FLAG(uint32_t, index, 0, "Worker: its number.");
ABSL_FLAG(uint32_t, incarnation, 0, "Worker: how many workers of this number ran before it.");
ABSL_FLAG(int32_t, notify_fd, -1, "Worker: pipe to write a byte to after a submit on SIGUSR1.");

namespace {

using Clock = std::chrono::steady_clock;
namespace v1 = kvhost::v1;
namespace bench = kvhost::bench;

constexpr int kCodes = 17;  // absl::StatusCode values 0..16
// Most pages one scheduler thread holds in one pool; pools are sized from it.
constexpr uint64_t kMaxHeldPages = 24;
// Rows of a worker's device pool: the first half are backup sources, the
// second half load destinations.
constexpr uint64_t kDeviceRows = 64;
// Host slots leased to each worker, and most slots in one transfer.
constexpr uint64_t kLeaseSlots = 96;
constexpr uint64_t kMaxTransferSlots = 16;

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// ---------------------------------------------------------------------------
// Deterministic byte patterns.

uint64_t SplitMix(uint64_t& x) {
  uint64_t z = (x += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

void FillPattern(uint64_t seed, uint8_t* out, size_t n) {
  uint64_t x = seed;
  for (size_t i = 0; i < n; i += 8) {
    const uint64_t v = SplitMix(x);
    std::memcpy(out + i, &v, std::min<size_t>(8, n - i));
  }
}

// Offset of the first byte that differs from the pattern, or -1.
int64_t CheckPattern(uint64_t seed, const uint8_t* data, size_t n) {
  uint64_t x = seed;
  for (size_t i = 0; i < n; i += 8) {
    const uint64_t v = SplitMix(x);
    const size_t len = std::min<size_t>(8, n - i);
    if (std::memcmp(data + i, &v, len) != 0) return static_cast<int64_t>(i);
  }
  return -1;
}

// Seed of a worker's device row: host slot, generation, component, layer.
uint64_t RowSeed(int64_t slot, uint64_t generation, uint32_t component, uint32_t layer) {
  uint64_t x = static_cast<uint64_t>(slot) * 0x100000001b3ULL ^ generation;
  x = SplitMix(x) ^ (static_cast<uint64_t>(component) << 40) ^ (static_cast<uint64_t>(layer) << 48);
  return SplitMix(x);
}

// ---------------------------------------------------------------------------
// Counters and failures, shared by the scheduler threads and the driver.

struct Counters {
  std::atomic<uint64_t> requests{0};
  std::atomic<uint64_t> invalid{0};
  std::atomic<uint64_t> verified_bytes{0};
  std::atomic<uint64_t> conservation_checks{0};
  std::array<std::atomic<uint64_t>, kCodes> codes{};

  void Count(const absl::Status& s) {
    requests.fetch_add(1, std::memory_order_relaxed);
    const int code = static_cast<int>(s.code());
    codes[code >= 0 && code < kCodes ? code : static_cast<int>(absl::StatusCode::kUnknown)]
        .fetch_add(1, std::memory_order_relaxed);
  }
};

class Failures {
 public:
  void Add(const std::string& what) {
    absl::MutexLock lock(&mu_);
    ++count_;
    absl::FPrintF(stderr, "FAILURE %d: %s\n", count_, what);
    if (first_.size() < 20) first_.push_back(what);
  }
  // Failures a worker process counted (printed there).
  void AddCount(uint64_t n) {
    absl::MutexLock lock(&mu_);
    count_ += n;
  }
  uint64_t count() const {
    absl::MutexLock lock(&mu_);
    return count_;
  }
  std::vector<std::string> first() const {
    absl::MutexLock lock(&mu_);
    return first_;
  }

 private:
  mutable absl::Mutex mu_;
  uint64_t count_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::string> first_ ABSL_GUARDED_BY(mu_);
};

std::string StatusText(const absl::Status& s) {
  return absl::StrCat(absl::StatusCodeToString(s.code()), ": ", s.message());
}

// ---------------------------------------------------------------------------
// Pools.

struct PoolPlan {
  std::string suffix;
  v1::PoolKind kind;
  v1::Layout layout;
  uint32_t page_size;
  uint32_t layers;
  uint64_t size_tokens;
};

v1::PoolSpec SpecOf(const PoolPlan& plan) {
  v1::PoolSpec spec;
  spec.set_kind(plan.kind);
  spec.set_layout(plan.layout);
  spec.set_dtype(v1::BF16);
  spec.set_page_size(plan.page_size);
  spec.set_layer_num(plan.layers);
  if (plan.kind == v1::MLA) {
    spec.set_kv_lora_rank(32);
    spec.set_qk_rope_head_dim(16);
  } else {
    spec.set_head_num(2);
    spec.set_head_dim(32);
  }
  spec.set_size_tokens(plan.size_tokens);
  return spec;
}

// A scheduler pool: its shape, and which pages some scheduler thread holds
// (1) as the driver saw Alloc return them, to catch a page handed out twice.
struct SchedPool {
  std::string name;
  uint64_t page_size = 1;
  uint64_t size_tokens = 0;
  uint64_t page_num = 0;
  uint64_t page_bytes = 0;
  std::unique_ptr<std::atomic<uint8_t>[]> held;
};

// What one scheduler thread holds in one pool: page first slots, and the
// seed of the bytes it last wrote to a page (absent: never written).
struct Ledger {
  std::vector<int64_t> pages;
  std::map<int64_t, uint64_t> content;
};

struct Shared {
  std::shared_mutex mu;  // shared: valid requests; exclusive: invalid ones, checks
  std::vector<SchedPool> pools;
  std::string cache;  // the node cache's name
  // [thread][pool], written only by its thread while it holds `mu` shared.
  std::vector<std::vector<Ledger>> ledgers;
  Counters counters;
  Failures failures;
  std::atomic<bool> stop{false};

  // REQUIRES: `mu` held exclusively.
  uint64_t HeldPages(size_t pool) const {
    uint64_t n = 0;
    for (const auto& thread : ledgers) n += thread[pool].pages.size();
    return n;
  }
};

// The invalid requests, each with the code it must get.
enum class Invalid {
  kAllocZero,
  kAllocUnaligned,
  kAllocHuge,
  kAllocOverCallLimit,
  kAllocUnknownPool,
  kFreeOutOfRange,
  kFreeNegative,
  kFreeRepeated,
  kFreeUnaligned,
  kFreeBrokenRun,
  kFreeEmpty,
  kFreeNotAllocated,
  kMetaOutOfRange,
  kMetaNegative,
  kPageNotAllocated,
  kPageUnaligned,
  kPageNegative,
  kPageOutOfRange,
  kSetWrongSize,
  kSetUnknownPool,
  kGetPoolUnknown,
  kCacheEmptyKey,
  kCacheKeyTooLong,
  kCacheKeyRepeated,
  kCacheTooManyKeys,
  kCacheNoToken,
  kCacheNotACache,
  kCacheUnknown,
  kCount,
};

constexpr int kInvalidKinds = static_cast<int>(Invalid::kCount);

// JSON names of the kinds, in enum order.
constexpr const char* kInvalidNames[kInvalidKinds] = {
    "alloc_zero_tokens",          "alloc_not_page_multiple",   "alloc_more_than_pool",
    "alloc_over_call_limit",      "alloc_unknown_pool",        "free_index_out_of_range",
    "free_negative_index",        "free_page_twice",           "free_not_page_start",
    "free_broken_page_run",       "free_empty_list",           "free_unallocated_page",
    "meta_index_out_of_range",    "meta_negative_index",       "get_page_unallocated",
    "get_page_not_page_start",    "get_page_negative",         "get_page_out_of_range",
    "set_page_wrong_size",        "set_page_unknown_pool",     "get_pool_unknown",
    "cache_lookup_empty_key",     "cache_lookup_key_too_long", "cache_evict_repeated_key",
    "cache_lookup_too_many_keys", "cache_lookup_no_token",     "cache_lookup_not_a_cache",
    "cache_stats_unknown_cache",
};

// The node cache the schedulers look into, and its owner token.
constexpr char kCacheSuffix[] = "node-cache";
constexpr char kCacheToken[] = "soak-cache-token";

const char* InvalidName(Invalid kind) { return kInvalidNames[static_cast<int>(kind)]; }

// Worker-side invalid transfers, counted with the scheduler's kinds.
const char* const kWorkerInvalidNames[] = {"backup_host_out_of_range",
                                           "backup_device_out_of_range",
                                           "load_length_mismatch",
                                           "load_device_row_twice",
                                           "backup_unknown_attachment",
                                           "stolen_attachment_id",
                                           "stolen_ticket_id",
                                           "attach_region_file",
                                           "attach_through_swapped_symlink",
                                           "attach_pool_being_created",
                                           "handoff_behind_silent_connections",
                                           "fast_path_mailbox_grab"};
constexpr int kWorkerInvalidKinds = 12;
// Silent connections all workers' thieves hold on the handoff socket at
// most (handoff_behind_silent_connections): 8 each with two workers. Every
// client of the soak has one uid, and past kvhostd's share of waiting
// connections per uid (32) a new one pushes out the oldest of its uid, which
// could be another worker's own handoff; below it none is. The 5 s a
// worker's handoff is given is no timing check (issue 29 measured about 1 s
// behind silent connections before the fix; HandoffTest checks 300 ms):
// the soak checks that it is served at all.
constexpr int kSilentHandoffConnections = 16;
// Most fast-path mailboxes the thief asks for (fast_path_mailbox_grab): past
// the daemon's per-client share (16 by default).
constexpr int kMailboxGrab = 64;

// One scheduler thread.
class Scheduler {
 public:
  // `cache_client` presents the node cache's token; `client` none.
  Scheduler(Shared* shared, size_t id, std::unique_ptr<kvhost::Client> client,
            std::unique_ptr<kvhost::Client> cache_client, uint64_t seed, double invalid_share)
      : shared_(shared),
        id_(id),
        client_(std::move(client)),
        cache_client_(std::move(cache_client)),
        rng_(seed),
        invalid_share_(invalid_share) {}

  void Run() {
    // Invalid whenever the share so far is below the target: the calls that
    // check after an invalid request count as requests too.
    while (!shared_->stop.load(std::memory_order_relaxed)) {
      const Counters& c = shared_->counters;
      if (c.invalid.load(std::memory_order_relaxed) <
          invalid_share_ * (c.requests.load(std::memory_order_relaxed) + 1)) {
        InvalidRequest();
      } else {
        ValidRequest();
      }
    }
  }

  // Frees everything this thread holds (at the end of the run).
  void ReleaseAll() {
    std::shared_lock lock(shared_->mu);
    for (size_t p = 0; p < shared_->pools.size(); ++p) {
      Ledger& ledger = mine(p);
      if (!ledger.pages.empty()) FreePages(p, ledger.pages);
    }
  }

  uint64_t fast_path_calls() const { return client_->fast_path_calls(); }
  const std::array<std::atomic<uint64_t>, kInvalidKinds>& invalid_kinds() const {
    return invalid_kinds_;
  }

 private:
  Ledger& mine(size_t pool) { return shared_->ledgers[id_][pool]; }

  void Fail(const std::string& what) {
    shared_->failures.Add(absl::StrCat("client ", id_, ": ", what));
  }

  // A successful-path call must be OK.
  bool ExpectOk(const absl::Status& s, const std::string& what) {
    shared_->counters.Count(s);
    if (s.ok()) return true;
    Fail(absl::StrCat(what, " failed: ", StatusText(s)));
    return false;
  }

  std::vector<int64_t> PageSlots(const SchedPool& pool, absl::Span<const int64_t> pages) {
    std::vector<int64_t> slots;
    for (int64_t first : pages) {
      for (uint64_t j = 0; j < pool.page_size; ++j) slots.push_back(first + j);
    }
    return slots;
  }

  // Random pages this thread holds (1..max, in random order).
  std::vector<int64_t> SomeHeld(size_t p, size_t max) {
    std::vector<int64_t> pages = mine(p).pages;
    std::shuffle(pages.begin(), pages.end(), rng_);
    pages.resize(std::min(pages.size(), 1 + rng_() % max));
    return pages;
  }

  // REQUIRES: `mu` held (shared or exclusive).
  void FreePages(size_t p, std::vector<int64_t> pages) {
    const SchedPool& pool = shared_->pools[p];
    Ledger& ledger = mine(p);
    for (int64_t first : pages) pool.held[first / pool.page_size].store(0);
    const std::vector<int64_t> slots = PageSlots(pool, pages);
    absl::StatusOr<uint64_t> freed = client_->Free(pool.name, slots);
    if (!ExpectOk(freed.status(), absl::StrCat("Free of ", pages.size(), " pages of ", pool.name)))
      return;
    if (*freed != slots.size()) {
      Fail(absl::StrCat("Free of ", slots.size(), " slots of ", pool.name, " freed ", *freed));
    }
    for (int64_t first : pages) {
      ledger.pages.erase(std::find(ledger.pages.begin(), ledger.pages.end(), first));
      ledger.content.erase(first);
    }
  }

  // Keys the cache never holds (nothing stores into it): all absent.
  std::vector<std::string> CacheKeys(size_t n) {
    std::vector<std::string> keys;
    for (size_t i = 0; i < n; ++i) keys.push_back(absl::StrCat("soak-", id_, "-", rng_(), "-", i));
    return keys;
  }

  void ValidCacheRequest() {
    std::shared_lock lock(shared_->mu);
    absl::StatusOr<v1::CacheLookupReply> found =
        cache_client_->CacheLookup(shared_->cache, CacheKeys(1 + rng_() % 8));
    if (!ExpectOk(found.status(), "CacheLookup")) return;
    if (found->prefix() != 0) Fail(absl::StrCat("CacheLookup found ", found->prefix(), " keys"));
  }

  void ValidRequest() {
    if (rng_() % 8 == 0) {
      ValidCacheRequest();
      return;
    }
    std::shared_lock lock(shared_->mu);
    const size_t p = rng_() % shared_->pools.size();
    SchedPool& pool = shared_->pools[p];
    Ledger& ledger = mine(p);
    int op = static_cast<int>(rng_() % 100);
    if (ledger.pages.empty()) op = 0;
    if (ledger.pages.size() >= kMaxHeldPages && op < 25) op = 30;
    if (op < 25) {  // Alloc
      const uint64_t want = std::min<uint64_t>(1 + rng_() % 4, kMaxHeldPages - ledger.pages.size());
      absl::StatusOr<std::vector<int64_t>> slots = client_->Alloc(pool.name, want * pool.page_size);
      if (!ExpectOk(slots.status(), absl::StrCat("Alloc of ", want, " pages of ", pool.name)))
        return;
      if (slots->size() != want * pool.page_size) {
        Fail(absl::StrCat("Alloc of ", want * pool.page_size, " slots of ", pool.name, " returned ",
                          slots->size()));
        return;
      }
      for (size_t i = 0; i < slots->size(); i += pool.page_size) {
        const int64_t first = (*slots)[i];
        bool run = first >= 0 && static_cast<uint64_t>(first) < pool.size_tokens &&
                   first % static_cast<int64_t>(pool.page_size) == 0;
        for (uint64_t j = 1; run && j < pool.page_size; ++j)
          run = (*slots)[i + j] == first + static_cast<int64_t>(j);
        if (!run) {
          Fail(absl::StrCat("Alloc of ", pool.name, " returned a malformed page at position ", i,
                            " (first slot ", first, ")"));
          continue;
        }
        if (pool.held[first / pool.page_size].exchange(1) != 0) {
          Fail(absl::StrCat("Alloc of ", pool.name, " handed out page ", first / pool.page_size,
                            " (slot ", first, "), which another client holds"));
          continue;
        }
        ledger.pages.push_back(first);
      }
    } else if (op < 45) {  // Free
      FreePages(p, SomeHeld(p, 4));
    } else if (op < 60) {  // GetPageBufferMeta, pages held or not
      std::vector<int64_t> pages = SomeHeld(p, 4);
      if (rng_() % 2 == 0) pages = {static_cast<int64_t>(rng_() % pool.page_num * pool.page_size)};
      absl::StatusOr<v1::PageBufferMeta> meta =
          client_->GetPageBufferMeta(pool.name, PageSlots(pool, pages));
      if (ExpectOk(meta.status(), absl::StrCat("GetPageBufferMeta of ", pool.name)) &&
          meta->segments_size() == 0) {
        Fail(absl::StrCat("GetPageBufferMeta of ", pool.name, " returned no segments"));
      }
    } else if (op < 75) {  // GetDataPage of a held page
      const int64_t first = SomeHeld(p, 1)[0];
      CheckPage(p, first, "GetDataPage");
    } else if (op < 90) {  // SetFromFlatDataPage of a held page
      const int64_t first = SomeHeld(p, 1)[0];
      const uint64_t seed = rng_();
      std::string data(pool.page_bytes, '\0');
      FillPattern(seed, reinterpret_cast<uint8_t*>(data.data()), data.size());
      if (ExpectOk(client_->SetFromFlatDataPage(pool.name, first, data),
                   absl::StrCat("SetFromFlatDataPage of ", pool.name, " page ", first))) {
        ledger.content[first] = seed;
      }
    } else {  // GetPool
      absl::StatusOr<v1::Pool> got = client_->GetPool(pool.name);
      if (ExpectOk(got.status(), absl::StrCat("GetPool ", pool.name)) &&
          got->available_tokens() > pool.size_tokens) {
        Fail(absl::StrCat("GetPool ", pool.name, ": available_tokens ", got->available_tokens(),
                          " > size ", pool.size_tokens));
      }
    }
  }

  // Reads a held page and compares it with what this thread wrote there.
  void CheckPage(size_t p, int64_t first, const std::string& why) {
    const SchedPool& pool = shared_->pools[p];
    absl::StatusOr<std::string> data = client_->GetDataPage(pool.name, first);
    if (!ExpectOk(data.status(),
                  absl::StrCat(why, ": GetDataPage of ", pool.name, " page ", first)))
      return;
    if (data->size() != pool.page_bytes) {
      Fail(absl::StrCat(why, ": GetDataPage of ", pool.name, " returned ", data->size(),
                        " bytes, not ", pool.page_bytes));
      return;
    }
    auto it = mine(p).content.find(first);
    if (it == mine(p).content.end()) return;
    const int64_t bad =
        CheckPattern(it->second, reinterpret_cast<const uint8_t*>(data->data()), data->size());
    if (bad >= 0) {
      Fail(absl::StrCat(why, ": page ", first, " of ", pool.name, " differs at byte ", bad,
                        " from what was written"));
    } else {
      shared_->counters.verified_bytes.fetch_add(data->size(), std::memory_order_relaxed);
    }
  }

  // One invalid call of the node cache, `kind` one of the kCache kinds, on
  // a quiet cache: its code must be the kind's, and afterwards every figure
  // of the cache as before it (a refused lookup counts no hit or miss).
  // REQUIRES: `mu` held exclusively.
  void InvalidCacheRequest(Invalid kind, const std::string& not_a_cache) {
    const std::string& cache = shared_->cache;
    absl::StatusOr<v1::CacheStats> before = cache_client_->GetCacheStats(cache);
    if (!ExpectOk(before.status(), "GetCacheStats")) return;
    absl::StatusCode expected = absl::StatusCode::kInvalidArgument;
    absl::Status status;
    std::vector<std::string> keys = CacheKeys(1 + rng_() % 4);
    switch (kind) {
      case Invalid::kCacheEmptyKey:
        keys[rng_() % keys.size()].clear();
        status = cache_client_->CacheLookup(cache, keys).status();
        break;
      case Invalid::kCacheKeyTooLong:
        keys[rng_() % keys.size()] = std::string(257, 'k');
        status = cache_client_->CacheLookup(cache, keys).status();
        break;
      case Invalid::kCacheKeyRepeated:
        keys.push_back(keys.front());
        status = cache_client_->CacheEvict(cache, keys).status();
        break;
      case Invalid::kCacheTooManyKeys:
        status = cache_client_->CacheLookup(cache, CacheKeys(4097)).status();
        break;
      case Invalid::kCacheNoToken:
        expected = absl::StatusCode::kPermissionDenied;
        status = client_->CacheLookup(cache, keys).status();
        break;
      case Invalid::kCacheNotACache:
        expected = absl::StatusCode::kFailedPrecondition;
        status = cache_client_->CacheLookup(not_a_cache, keys).status();
        break;
      default:
        expected = absl::StatusCode::kNotFound;
        status = cache_client_->GetCacheStats(absl::StrCat(cache, "-missing")).status();
        break;
    }
    shared_->counters.Count(status);
    shared_->counters.invalid.fetch_add(1, std::memory_order_relaxed);
    invalid_kinds_[static_cast<int>(kind)].fetch_add(1, std::memory_order_relaxed);
    if (status.code() != expected) {
      Fail(absl::StrCat(InvalidName(kind), ": expected ", absl::StatusCodeToString(expected),
                        ", got ", StatusText(status)));
    }
    absl::StatusOr<v1::CacheStats> after = cache_client_->GetCacheStats(cache);
    if (!ExpectOk(after.status(), "GetCacheStats")) return;
    shared_->counters.conservation_checks.fetch_add(1, std::memory_order_relaxed);
    if (after->SerializeAsString() != before->SerializeAsString()) {
      Fail(absl::StrCat("after ", InvalidName(kind), " the cache's figures changed: ",
                        before->ShortDebugString(), " -> ", after->ShortDebugString()));
    }
  }

  // One invalid request on a quiet pool: its code must be `expected`, and
  // afterwards the pool's free count and this thread's pages unchanged.
  void InvalidRequest() {
    std::unique_lock lock(shared_->mu);
    const size_t p = rng_() % shared_->pools.size();
    const SchedPool& pool = shared_->pools[p];
    Ledger& ledger = mine(p);
    Invalid kind = static_cast<Invalid>(rng_() % kInvalidKinds);
    if (kind >= Invalid::kCacheEmptyKey) {
      InvalidCacheRequest(kind, pool.name);
      return;
    }
    const bool paged = pool.page_size > 1;
    if (!paged && (kind == Invalid::kAllocUnaligned || kind == Invalid::kFreeUnaligned ||
                   kind == Invalid::kFreeBrokenRun || kind == Invalid::kPageUnaligned)) {
      kind = Invalid::kFreeOutOfRange;
    }
    if (ledger.pages.empty() &&
        (kind == Invalid::kFreeRepeated || kind == Invalid::kSetWrongSize)) {
      kind = Invalid::kAllocZero;
    }
    if (kind == Invalid::kFreeNotAllocated || kind == Invalid::kPageNotAllocated) {
      if (shared_->HeldPages(p) >= pool.page_num) kind = Invalid::kMetaNegative;
    }
    const int64_t ps = static_cast<int64_t>(pool.page_size);
    const int64_t size = static_cast<int64_t>(pool.size_tokens);
    // Held pages some of the requests carry too: a request that fails must
    // not free them.
    const std::vector<int64_t> held =
        ledger.pages.empty() ? std::vector<int64_t>{} : SomeHeld(p, 2);
    std::vector<int64_t> slots = PageSlots(pool, held);
    const std::string unknown = absl::StrCat(pool.name, "-missing");
    absl::StatusCode expected = absl::StatusCode::kInvalidArgument;
    absl::Status status;
    switch (kind) {
      case Invalid::kAllocZero:
        status = client_->Alloc(pool.name, 0).status();
        break;
      case Invalid::kAllocUnaligned:
        status = client_->Alloc(pool.name, pool.page_size + 1).status();
        break;
      case Invalid::kAllocHuge:
        expected = absl::StatusCode::kResourceExhausted;
        status = client_->Alloc(pool.name, pool.size_tokens + pool.page_size).status();
        break;
      case Invalid::kAllocOverCallLimit:  // --max-indices-per-call (4 Mi by default)
        status = client_->Alloc(pool.name, uint64_t{1} << 40).status();
        break;
      case Invalid::kAllocUnknownPool:
        expected = absl::StatusCode::kNotFound;
        status = client_->Alloc(unknown, pool.page_size).status();
        break;
      case Invalid::kFreeOutOfRange:
      case Invalid::kFreeNegative:
      case Invalid::kFreeUnaligned:
      case Invalid::kFreeBrokenRun: {
        std::vector<int64_t> bad;
        const int64_t first = kind == Invalid::kFreeOutOfRange  ? size + ps * (rng_() % 4)
                              : kind == Invalid::kFreeNegative  ? -ps * (1 + rng_() % 4)
                              : kind == Invalid::kFreeUnaligned ? 1 + ps * (rng_() % pool.page_num)
                                                                : ps * (rng_() % pool.page_num);
        for (int64_t j = 0; j < ps; ++j) bad.push_back(first + j);
        if (kind == Invalid::kFreeUnaligned) bad.back() = first;  // keep the list length
        if (kind == Invalid::kFreeBrokenRun) bad.back() += 1;
        slots.insert(slots.begin() + (rng_() % (slots.size() + 1)) / ps * ps, bad.begin(),
                     bad.end());
        status = client_->Free(pool.name, slots).status();
        break;
      }
      case Invalid::kFreeRepeated:
        slots.insert(slots.end(), slots.begin(), slots.begin() + ps);
        status = client_->Free(pool.name, slots).status();
        break;
      case Invalid::kFreeEmpty:
        status = client_->Free(pool.name, {}).status();
        break;
      case Invalid::kFreeNotAllocated:
      case Invalid::kPageNotAllocated: {
        expected = absl::StatusCode::kFailedPrecondition;
        std::vector<int64_t> free_pages;
        for (uint64_t page = 0; page < pool.page_num; ++page) {
          if (pool.held[page].load() == 0) free_pages.push_back(static_cast<int64_t>(page) * ps);
        }
        const int64_t first = free_pages[rng_() % free_pages.size()];
        if (kind == Invalid::kPageNotAllocated) {
          status = client_->GetDataPage(pool.name, first).status();
        } else {
          for (int64_t j = 0; j < ps; ++j) slots.push_back(first + j);
          status = client_->Free(pool.name, slots).status();
        }
        break;
      }
      case Invalid::kMetaOutOfRange:
      case Invalid::kMetaNegative: {
        const int64_t first = kind == Invalid::kMetaOutOfRange ? size : -ps;
        for (int64_t j = 0; j < ps; ++j) slots.push_back(first + j);
        status = client_->GetPageBufferMeta(pool.name, slots).status();
        break;
      }
      case Invalid::kPageUnaligned:
        status = client_->GetDataPage(pool.name, ps * (rng_() % pool.page_num) + 1).status();
        break;
      case Invalid::kPageNegative:
        status = client_->GetDataPage(pool.name, -1 - static_cast<int64_t>(rng_() % 100)).status();
        break;
      case Invalid::kPageOutOfRange:
        status = client_->GetDataPage(pool.name, size + ps * (rng_() % 4)).status();
        break;
      case Invalid::kSetWrongSize: {
        const int64_t delta = rng_() % 2 == 0 ? -1 : 1;
        std::string data(pool.page_bytes + delta, '\x5a');
        status = client_->SetFromFlatDataPage(pool.name, held[0], data);
        break;
      }
      case Invalid::kSetUnknownPool:
        expected = absl::StatusCode::kNotFound;
        status = client_->SetFromFlatDataPage(unknown, 0, std::string(pool.page_bytes, '\0'));
        break;
      case Invalid::kGetPoolUnknown:
        expected = absl::StatusCode::kNotFound;
        status = client_->GetPool(unknown).status();
        break;
      case Invalid::kCacheEmptyKey:  // InvalidCacheRequest's
      case Invalid::kCacheKeyTooLong:
      case Invalid::kCacheKeyRepeated:
      case Invalid::kCacheTooManyKeys:
      case Invalid::kCacheNoToken:
      case Invalid::kCacheNotACache:
      case Invalid::kCacheUnknown:
      case Invalid::kCount:
        break;
    }
    shared_->counters.Count(status);
    shared_->counters.invalid.fetch_add(1, std::memory_order_relaxed);
    invalid_kinds_[static_cast<int>(kind)].fetch_add(1, std::memory_order_relaxed);
    if (status.code() != expected) {
      Fail(absl::StrCat(InvalidName(kind), " on ", pool.name, ": expected ",
                        absl::StatusCodeToString(expected), ", got ", StatusText(status)));
    }
    // Unchanged: the free count matches the ledgers, and the held pages the
    // request named are still allocated with their bytes.
    absl::StatusOr<v1::Pool> after = client_->GetPool(pool.name);
    shared_->counters.Count(after.status());
    shared_->counters.conservation_checks.fetch_add(1, std::memory_order_relaxed);
    const uint64_t want_free = pool.size_tokens - shared_->HeldPages(p) * pool.page_size;
    if (!after.ok()) {
      Fail(absl::StrCat("GetPool ", pool.name, " after ", InvalidName(kind), ": ",
                        StatusText(after.status())));
    } else if (after->available_tokens() != want_free) {
      Fail(absl::StrCat("after ", InvalidName(kind), " on ", pool.name, ": available_tokens ",
                        after->available_tokens(), ", the ledgers say ", want_free));
    }
    for (int64_t first : held) CheckPage(p, first, absl::StrCat("after ", InvalidName(kind)));
  }

  Shared* shared_;
  size_t id_;
  std::unique_ptr<kvhost::Client> client_;
  std::unique_ptr<kvhost::Client> cache_client_;
  std::mt19937_64 rng_;
  double invalid_share_;
  std::array<std::atomic<uint64_t>, kInvalidKinds> invalid_kinds_{};
};

// ---------------------------------------------------------------------------
// Files shared by the driver and the workers.

std::string LeasePath(const std::string& dir, uint32_t index) {
  return absl::StrCat(dir, "/worker-", index, ".lease");
}
std::string JournalPath(const std::string& dir, uint32_t index) {
  return absl::StrCat(dir, "/worker-", index, ".journal");
}
// The worker's attachment id and last ticket id, left for the other workers
// to steal (a leaked capability must not work for a stranger).
std::string AttachmentPath(const std::string& dir, uint32_t index) {
  return absl::StrCat(dir, "/worker-", index, ".attachment");
}
std::string TicketPath(const std::string& dir, uint32_t index) {
  return absl::StrCat(dir, "/worker-", index, ".ticket");
}
std::string StatsPath(const std::string& dir, uint32_t index, uint32_t incarnation) {
  return absl::StrCat(dir, "/worker-", index, ".", incarnation, ".stats");
}

std::string ReadText(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

absl::Status WriteAtomically(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  if (absl::Status s = bench::WriteFile(tmp, text); !s.ok()) return s;
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::InternalError(absl::StrCat("rename ", tmp, ": ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

std::vector<int64_t> ParseSlots(const std::string& text) {
  std::vector<int64_t> slots;
  for (absl::string_view word : absl::StrSplit(text, absl::ByAnyChar(" \n"), absl::SkipEmpty())) {
    int64_t v = 0;
    if (absl::SimpleAtoi(word, &v)) slots.push_back(v);
  }
  return slots;
}

// The journal: "B <slot> <generation>" once a backup of the slot was
// confirmed by WaitTransfer, "D <slot>" once the slot's bytes are no longer
// promised (before it is backed up again, or freed). A torn last line (the
// writer was killed) is ignored. Returns slot -> generation.
std::map<int64_t, uint64_t> ReadJournal(const std::string& path) {
  std::map<int64_t, uint64_t> valid;
  const std::string text = ReadText(path);
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    std::vector<absl::string_view> f = absl::StrSplit(line, ' ', absl::SkipEmpty());
    int64_t slot = 0;
    uint64_t gen = 0;
    if (f.size() == 3 && f[0] == "B" && absl::SimpleAtoi(f[1], &slot) &&
        absl::SimpleAtoi(f[2], &gen)) {
      valid[slot] = gen;
    } else if (f.size() == 2 && f[0] == "D" && absl::SimpleAtoi(f[1], &slot)) {
      valid.erase(slot);
    }
  }
  return valid;
}

bool AppendAll(int fd, const std::string& text) {
  return ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
}

// What a worker process reports (its stats file, rewritten as it goes).
struct WorkerStats {
  uint64_t requests = 0, invalid = 0, backups = 0, loads = 0, verified_bytes = 0;
  uint64_t recovered_slots = 0, recovered_bytes = 0, failures = 0;
  uint64_t fast_path_calls = 0;  // the worker's calls through the fast path
  // attach_through_swapped_symlink attempts that caught the real directory.
  uint64_t swap_attached = 0;
  bool ready = false;
  std::array<uint64_t, kCodes> codes{};
  std::array<uint64_t, kWorkerInvalidKinds> invalid_kinds{};

  std::string Format() const {
    std::string out = absl::StrCat(
        "requests ", requests, "\ninvalid ", invalid, "\nbackups ", backups, "\nloads ", loads,
        "\nverified_bytes ", verified_bytes, "\nrecovered_slots ", recovered_slots,
        "\nrecovered_bytes ", recovered_bytes, "\nfailures ", failures, "\nfast_path_calls ",
        fast_path_calls, "\nswap_attached ", swap_attached, "\nready ", ready ? 1 : 0, "\n");
    for (int c = 0; c < kCodes; ++c) absl::StrAppend(&out, "code", c, " ", codes[c], "\n");
    for (int k = 0; k < kWorkerInvalidKinds; ++k) {
      absl::StrAppend(&out, "kind", k, " ", invalid_kinds[k], "\n");
    }
    return out;
  }

  static WorkerStats Parse(const std::string& text) {
    WorkerStats s;
    for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
      std::pair<std::string, std::string> kv = absl::StrSplit(line, ' ');
      uint64_t v = 0;
      if (!absl::SimpleAtoi(kv.second, &v)) continue;
      const std::string& k = kv.first;
      if (k == "requests") s.requests = v;
      if (k == "invalid") s.invalid = v;
      if (k == "backups") s.backups = v;
      if (k == "loads") s.loads = v;
      if (k == "verified_bytes") s.verified_bytes = v;
      if (k == "recovered_slots") s.recovered_slots = v;
      if (k == "recovered_bytes") s.recovered_bytes = v;
      if (k == "failures") s.failures = v;
      if (k == "swap_attached") s.swap_attached = v;
      if (k == "fast_path_calls") s.fast_path_calls = v;
      if (k == "ready") s.ready = v != 0;
      int i = 0;
      if (absl::StartsWith(k, "code") && absl::SimpleAtoi(k.substr(4), &i) && i >= 0 &&
          i < kCodes) {
        s.codes[i] = v;
      }
      if (absl::StartsWith(k, "kind") && absl::SimpleAtoi(k.substr(4), &i) && i >= 0 &&
          i < kWorkerInvalidKinds) {
        s.invalid_kinds[i] = v;
      }
    }
    return s;
  }
};

// ---------------------------------------------------------------------------
// Worker process.

volatile sig_atomic_t g_stop = 0;
volatile sig_atomic_t g_notify = 0;

class Worker {
 public:
  absl::Status Run() {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    struct sigaction sa {};
    sa.sa_handler = [](int) { g_stop = 1; };
    ::sigaction(SIGTERM, &sa, nullptr);
    sa.sa_handler = [](int) { g_notify = 1; };
    ::sigaction(SIGUSR1, &sa, nullptr);

    dir_ = absl::GetFlag(FLAGS_dir);
    index_ = absl::GetFlag(FLAGS_index);
    incarnation_ = absl::GetFlag(FLAGS_incarnation);
    notify_fd_ = absl::GetFlag(FLAGS_notify_fd);
    pool_name_ = absl::GetFlag(FLAGS_pool);
    rng_.seed(absl::GetFlag(FLAGS_seed) * 1000003 + index_ * 1009 + incarnation_);
    invalid_share_ = absl::GetFlag(FLAGS_invalid_share);
    stats_path_ = StatsPath(dir_, index_, incarnation_);

    kvhost::ClientOptions options;
    options.address = absl::GetFlag(FLAGS_address);
    options.timeout = absl::Seconds(20);
    options.worker_session = true;
    options.worker_name = absl::StrCat("soak-worker-", index_, ".", incarnation_);
    absl::StatusOr<std::unique_ptr<kvhost::Client>> client = kvhost::Client::Connect(options);
    if (!client.ok()) return client.status();
    client_ = *std::move(client);
    absl::StatusOr<v1::Pool> pool = client_->GetPool(pool_name_);
    if (!Expect(pool.status())) return pool.status();
    absl::StatusOr<std::unique_ptr<kvhost::ShmDevicePool>> device =
        kvhost::ShmDevicePool::Create(*pool, kDeviceRows, absl::GetFlag(FLAGS_shm_dir));
    if (!device.ok()) return device.status();
    device_ = *std::move(device);
    absl::StatusOr<v1::Attachment> attachment =
        client_->AttachDevice(device_->MakeAttachRequest(pool_name_));
    if (!Expect(attachment.status())) return attachment.status();
    attachment_ = attachment->id();
    (void)WriteAtomically(AttachmentPath(dir_, index_), attachment_);
    // The thief: a second client of this process, in a session of its own,
    // so that a stranger's ids get it nothing. Its own session, not none: a
    // kill between its attach and detach of the swap racer's file must not
    // leave an attachment that no session closes (a session-less attachment
    // lives until someone detaches it, and the kill check counts them all).
    options.worker_name = absl::StrCat("soak-thief-", index_, ".", incarnation_);
    client = kvhost::Client::Connect(options);
    if (!client.ok()) return client.status();
    thief_ = *std::move(client);
    // Open now, so that its mailboxes count as its session's, not the uid's.
    if (absl::Status s = thief_->OpenSession(); !Expect(s)) return s;
    // The victim of attach_pool_being_created: a client with a token of this
    // worker's, creating a small protected pool of this pool's shape. A
    // predecessor killed mid-race may have left it behind: deleted first.
    options.worker_session = false;
    options.owner_token = absl::StrCat("soak-victim-token-", index_);
    client = kvhost::Client::Connect(options);
    if (!client.ok()) return client.status();
    victim_ = *std::move(client);
    race_pool_ = absl::StrCat(pool_name_, "-race", index_);
    race_spec_ = pool->spec();
    race_spec_.set_size_tokens(uint64_t{race_spec_.page_size()} * 4);
    (void)victim_->DeletePool(race_pool_);
    workers_ = std::max<uint32_t>(1, absl::GetFlag(FLAGS_workers));
    region_path_ = pool->region_paths().empty() ? "" : pool->region_paths(0);
    absl::StatusOr<v1::DaemonStatus> daemon = client_->GetStatus();
    if (!Expect(daemon.status())) return daemon.status();
    handoff_socket_ = daemon->handoff_socket();
    if (absl::Status s = StartSwapRacer(absl::GetFlag(FLAGS_shm_dir)); !s.ok()) return s;

    lease_ = ParseSlots(ReadText(LeasePath(dir_, index_)));
    journaled_ = ReadJournal(JournalPath(dir_, index_));
    journal_fd_ = ::open(JournalPath(dir_, index_).c_str(), O_WRONLY | O_APPEND | O_CREAT, 0644);
    if (journal_fd_ < 0) return absl::InternalError("cannot open the journal");

    if (absl::Status s = Recover(); !s.ok()) return Finish(s);
    stats_.ready = true;
    WriteStats();
    while (!g_stop) {
      if (absl::Status s = Step(); !s.ok()) return Finish(s);
      WriteStats();
    }
    (void)client_->DetachDevice(attachment_);
    return Finish(absl::OkStatus());
  }

 private:
  void WriteStats() {
    stats_.fast_path_calls =
        (client_ ? client_->fast_path_calls() : 0) + (thief_ ? thief_->fast_path_calls() : 0);
    (void)WriteAtomically(stats_path_, stats_.Format());
  }

  absl::Status Finish(absl::Status s) {
    if (!s.ok()) {
      ++stats_.failures;
      absl::FPrintF(stderr, "FAILURE worker %d.%d (pid %d): %s\n", index_, incarnation_, ::getpid(),
                    StatusText(s));
    }
    WriteStats();
    return s;
  }

  // Counts the call's code; true when it is OK.
  bool Expect(const absl::Status& s) {
    ++stats_.requests;
    const int code = static_cast<int>(s.code());
    ++stats_.codes[code < kCodes ? code : static_cast<int>(absl::StatusCode::kUnknown)];
    return s.ok();
  }

  // After a Backup or Load was submitted: tell the driver, if it asked, so
  // that it kills this process while the ticket may still run.
  void MaybeNotify() {
    if (g_notify && notify_fd_ >= 0) {
      g_notify = 0;
      const char byte = 'k';
      (void)::write(notify_fd_, &byte, 1);
    }
  }

  absl::Status Transfer(bool backup, const std::vector<int64_t>& host,
                        const std::vector<int64_t>& rows) {
    absl::StatusOr<uint64_t> ticket =
        backup ? client_->Backup(attachment_, host, rows) : client_->Load(attachment_, host, rows);
    if (!Expect(ticket.status())) {
      return absl::Status(ticket.status().code(),
                          absl::StrCat(backup ? "Backup" : "Load", " of ", host.size(),
                                       " slots: ", ticket.status().message()));
    }
    MaybeNotify();
    (void)WriteAtomically(TicketPath(dir_, index_), absl::StrCat(*ticket));
    absl::StatusOr<v1::TransferStatus> done = client_->WaitTransfer(*ticket, absl::Seconds(30));
    if (!Expect(done.status())) {
      return absl::Status(done.status().code(), absl::StrCat("WaitTransfer of ticket ", *ticket,
                                                             ": ", done.status().message()));
    }
    ++(backup ? stats_.backups : stats_.loads);
    return absl::OkStatus();
  }

  void WriteRows(const std::vector<int64_t>& host, const std::vector<int64_t>& rows,
                 uint64_t generation) {
    for (size_t i = 0; i < host.size(); ++i) {
      for (uint32_t c = 0; c < device_->components(); ++c) {
        for (uint32_t l = 0; l < device_->layers(); ++l) {
          FillPattern(RowSeed(host[i], generation, c, l), device_->row(c, l, rows[i]),
                      device_->row_bytes(c));
        }
      }
    }
  }

  // Loads `host` into the load rows and compares each with its journaled
  // generation. Returns the bytes compared, or DATA_LOSS naming the first
  // differing row.
  absl::StatusOr<uint64_t> LoadAndVerify(const std::vector<int64_t>& host) {
    std::vector<int64_t> rows;
    for (size_t i = 0; i < host.size(); ++i) rows.push_back(kDeviceRows / 2 + i);
    for (int64_t r : rows) {  // stale bytes must not pass as loaded ones
      for (uint32_t c = 0; c < device_->components(); ++c) {
        for (uint32_t l = 0; l < device_->layers(); ++l) {
          std::memset(device_->row(c, l, r), 0xee, device_->row_bytes(c));
        }
      }
    }
    if (absl::Status s = Transfer(false, host, rows); !s.ok()) return s;
    uint64_t bytes = 0;
    for (size_t i = 0; i < host.size(); ++i) {
      const uint64_t gen = journaled_.at(host[i]);
      for (uint32_t c = 0; c < device_->components(); ++c) {
        for (uint32_t l = 0; l < device_->layers(); ++l) {
          const int64_t bad = CheckPattern(RowSeed(host[i], gen, c, l), device_->row(c, l, rows[i]),
                                           device_->row_bytes(c));
          if (bad >= 0) {
            return absl::DataLossError(absl::StrCat(
                "pool '", pool_name_, "' host slot ", host[i], " (generation ", gen,
                ") loaded wrong: component ", c, " layer ", l, " differs at byte ", bad));
          }
          bytes += device_->row_bytes(c);
        }
      }
    }
    return bytes;
  }

  // A replacement's first job: every slot its predecessors journaled must
  // load back intact.
  absl::Status Recover() {
    std::vector<int64_t> slots;
    const std::set<int64_t> lease(lease_.begin(), lease_.end());
    for (const auto& [slot, gen] : journaled_) {
      if (lease.count(slot) == 0) {
        return absl::FailedPreconditionError(
            absl::StrCat("journaled slot ", slot, " is not in the lease"));
      }
      slots.push_back(slot);
    }
    for (size_t i = 0; i < slots.size(); i += kDeviceRows / 2) {
      std::vector<int64_t> batch(slots.begin() + i,
                                 slots.begin() + std::min(slots.size(), i + kDeviceRows / 2));
      absl::StatusOr<uint64_t> bytes = LoadAndVerify(batch);
      if (!bytes.ok()) return bytes.status();
      stats_.recovered_slots += batch.size();
      stats_.recovered_bytes += *bytes;
      stats_.verified_bytes += *bytes;
    }
    return absl::OkStatus();
  }

  // Deliberately invalid transfer requests, each with its expected code.
  absl::Status InvalidTransfer() {
    const int kind = static_cast<int>(rng_() % kWorkerInvalidKinds);
    const int64_t slot = lease_[rng_() % lease_.size()];
    absl::StatusCode expected = absl::StatusCode::kInvalidArgument;
    absl::Status status;
    switch (kind) {
      case 0:
        status = client_->Backup(attachment_, {int64_t{1} << 40}, {0}).status();
        break;
      case 1:
        status = client_->Backup(attachment_, {slot}, {static_cast<int64_t>(kDeviceRows)}).status();
        break;
      case 2:
        status = client_->Load(attachment_, {slot, slot}, {0}).status();
        break;
      case 3:
        status = client_->Load(attachment_, {slot, slot}, {1, 1}).status();
        break;
      case 4:
        expected = absl::StatusCode::kNotFound;
        status = client_->Backup("no-such-attachment", {slot}, {0}).status();
        break;
      case 5: {
        // The next worker's attachment (this one's when it is alone): a
        // Backup, Load or Detach by a client without its session. A Detach
        // that worked would fail the owner's next transfer.
        expected = absl::StatusCode::kNotFound;
        const std::string stolen = ReadText(AttachmentPath(dir_, (index_ + 1) % workers_));
        switch (rng_() % 3) {
          case 0:
            status = thief_->Backup(stolen, {slot}, {0}).status();
            break;
          case 1:
            status = thief_->Load(stolen, {slot}, {static_cast<int64_t>(kDeviceRows) - 1}).status();
            break;
          default:
            status = thief_->DetachDevice(stolen);
            break;
        }
        break;
      }
      case 6: {
        // The next worker's last ticket (a predecessor's, of a session
        // closed since, when that worker was replaced).
        expected = absl::StatusCode::kNotFound;
        uint64_t stolen = 0;
        (void)absl::SimpleAtoi(ReadText(TicketPath(dir_, (index_ + 1) % workers_)), &stolen);
        status = thief_->PollTransfer(stolen).status();
        break;
      }
      case 7:
        // The pool's own region file as the "device": it would read and
        // write other tenants' bytes past any owner token.
        expected = absl::StatusCode::kPermissionDenied;
        status = thief_->AttachDevice(RequestOnFile(region_path_)).status();
        break;
      case 9:
        if (absl::Status s = AttachWhileCreated(&status); !s.ok()) return s;
        expected = absl::IsResourceExhausted(status) ? absl::StatusCode::kResourceExhausted
                                                     : absl::StatusCode::kPermissionDenied;
        break;
      case 10: {
        SignalsHeld held;
        status = HandoffBehindSilentConnections();
        break;
      }
      case 11: {
        SignalsHeld held;
        expected = absl::StatusCode::kResourceExhausted;
        if (absl::Status s = GrabMailboxes(&status); !s.ok()) return s;
        break;
      }
      default: {
        // While the racer swaps swap_path_ between a directory and a
        // symlink out of the shm dir: either the file inside is attached
        // (then loaded into and detached) or the attach is refused; the
        // decoy outside never changes.
        absl::StatusOr<v1::Attachment> att = thief_->AttachDevice(RequestOnFile(swap_file_));
        status = att.status();
        if (status.code() == absl::StatusCode::kPermissionDenied ||
            status.code() == absl::StatusCode::kNotFound) {
          expected = status.code();
        } else if (att.ok()) {
          expected = absl::StatusCode::kOk;
          absl::StatusOr<uint64_t> ticket = thief_->Load(att->id(), {slot}, {0});
          if (ticket.ok()) (void)thief_->WaitTransfer(*ticket);
          (void)thief_->DetachDevice(att->id());
          ++stats_.swap_attached;
        }
        if (ReadText(decoy_file_) != decoy_bytes_) {
          return absl::InternalError(
              absl::StrCat("attach_through_swapped_symlink: the decoy ", decoy_file_,
                           " outside the shm dir changed: a Load wrote through the symlink"));
        }
        break;
      }
    }
    Expect(status);
    ++stats_.invalid;
    ++stats_.invalid_kinds[kind];
    if (status.code() != expected) {
      return absl::InternalError(absl::StrCat(kWorkerInvalidNames[kind], ": expected ",
                                              absl::StatusCodeToString(expected), ", got ",
                                              StatusText(status)));
    }
    return absl::OkStatus();
  }

  absl::Status Step() {
    if (stats_.invalid < invalid_share_ * (stats_.requests + 1)) return InvalidTransfer();
    // Back up a few slots with a new generation; their old bytes stop being
    // promised first.
    std::vector<int64_t> slots = lease_;
    std::shuffle(slots.begin(), slots.end(), rng_);
    slots.resize(1 + rng_() % kMaxTransferSlots);
    std::string drop;
    for (int64_t s : slots) {
      if (journaled_.erase(s) > 0) absl::StrAppend(&drop, "D ", s, "\n");
    }
    if (!drop.empty() && !AppendAll(journal_fd_, drop)) {
      return absl::InternalError("journal write failed");
    }
    const uint64_t gen = (uint64_t{incarnation_} << 32) | ++counter_;
    std::vector<int64_t> rows;
    for (size_t i = 0; i < slots.size(); ++i) rows.push_back(i);
    WriteRows(slots, rows, gen);
    if (absl::Status s = Transfer(true, slots, rows); !s.ok()) return s;
    std::string done;
    for (int64_t s : slots) {
      journaled_[s] = gen;
      absl::StrAppend(&done, "B ", s, " ", gen, "\n");
    }
    if (!AppendAll(journal_fd_, done)) return absl::InternalError("journal write failed");

    // Load some journaled slots back and compare.
    std::vector<int64_t> known;
    for (const auto& entry : journaled_) known.push_back(entry.first);
    std::shuffle(known.begin(), known.end(), rng_);
    known.resize(std::min<size_t>(known.size(), 1 + rng_() % kMaxTransferSlots));
    absl::StatusOr<uint64_t> bytes = LoadAndVerify(known);
    if (!bytes.ok()) return bytes.status();
    stats_.verified_bytes += *bytes;

    // Drop one slot now and then (its bytes are no longer promised).
    if (rng_() % 4 == 0 && !journaled_.empty()) {
      auto it = journaled_.begin();
      std::advance(it, rng_() % journaled_.size());
      const std::string line = absl::StrCat("D ", it->first, "\n");
      journaled_.erase(it);
      if (!AppendAll(journal_fd_, line)) return absl::InternalError("journal write failed");
    }
    return absl::OkStatus();
  }

  // attach_pool_being_created (issue 29): the victim creates its protected
  // pool while the thief, without its token, attaches by the pool's name, in
  // a loop until the pool exists and once more after. Every attempt must be
  // refused whatever the moment (NOT_FOUND before, FAILED_PRECONDITION while
  // it is being created, PERMISSION_DENIED after), and the victim must then
  // be able to delete its pool; a failure otherwise. `last`: the attempt
  // after the pool exists, or the victim's RESOURCE_EXHAUSTED when it did not fit.
  absl::Status AttachWhileCreated(absl::Status* last) {
    std::atomic<bool> done{false};
    absl::Status created;
    std::thread creator([&] {
      created = victim_->CreatePool(race_pool_, race_spec_).status();
      done = true;
    });
    const v1::AttachDeviceRequest request = device_->MakeAttachRequest(race_pool_);
    absl::Status refused;
    bool after = false;  // the attempt after the pool exists
    while (!after) {
      after = done.load();
      absl::StatusOr<v1::Attachment> att = thief_->AttachDevice(request);
      if (att.ok()) (void)thief_->DetachDevice(att->id());
      refused = att.status();
      const absl::StatusCode code = refused.code();
      if (att.ok() ||
          (code != absl::StatusCode::kNotFound && code != absl::StatusCode::kFailedPrecondition &&
           code != absl::StatusCode::kPermissionDenied)) {
        creator.join();
        (void)victim_->DeletePool(race_pool_);
        return absl::InternalError(absl::StrCat(
            "attach_pool_being_created: an attach without the token got ",
            att.ok() ? "OK: it attached the victim's protected pool" : StatusText(refused)));
      }
    }
    creator.join();
    Expect(created);
    if (absl::IsResourceExhausted(created)) {
      *last = created;
      return absl::OkStatus();
    }
    if (!created.ok()) {
      return absl::InternalError(
          absl::StrCat("attach_pool_being_created: CreatePool: ", StatusText(created)));
    }
    if (absl::Status deleted = victim_->DeletePool(race_pool_).status(); !deleted.ok()) {
      return absl::InternalError(absl::StrCat(
          "attach_pool_being_created: the victim cannot delete its pool: ", StatusText(deleted)));
    }
    *last = refused;
    return absl::OkStatus();
  }

  // SIGUSR1 and SIGTERM held while it lives: FetchHandoff's poll ends
  // INTERNAL on EINTR, and a driver's signal is no fault of the daemon's. They
  // arrive (g_notify, g_stop) when it ends.
  struct SignalsHeld {
    SignalsHeld() {
      sigset_t set;
      sigemptyset(&set);
      sigaddset(&set, SIGUSR1);
      sigaddset(&set, SIGTERM);
      ::pthread_sigmask(SIG_BLOCK, &set, &old);
    }
    ~SignalsHeld() { ::pthread_sigmask(SIG_SETMASK, &old, nullptr); }
    sigset_t old;
  };

  // handoff_behind_silent_connections (issue 29, finding 11): the thief
  // holds its part of kSilentHandoffConnections connections to the handoff
  // socket that send nothing, while this worker's own handoff (a deposit of
  // no descriptors: refused, INVALID_ARGUMENT, and nothing held) must still
  // get its reply; DEADLINE_EXCEEDED after 5 s would mean it waited behind
  // them.
  absl::Status HandoffBehindSilentConnections() {
    if (handoff_socket_.empty()) {
      return absl::FailedPreconditionError("no handoff socket (the daemon runs without one)");
    }
    std::vector<int> silent;
    const int n = std::max<int>(1, kSilentHandoffConnections / static_cast<int>(workers_));
    for (int i = 0; i < n; ++i) {
      const int fd = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
      if (fd < 0) break;
      sockaddr_un addr{};
      addr.sun_family = AF_UNIX;
      std::strncpy(addr.sun_path, handoff_socket_.c_str(), sizeof(addr.sun_path) - 1);
      if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
        ::close(fd);  // a full backlog: the connections held so far do
        break;
      }
      silent.push_back(fd);
    }
    v1::HandoffRequest request;
    request.set_kind(v1::HANDOFF_KIND_DEPOSIT);
    for (const std::string& id : client_->session_ids()) request.add_session_ids(id);
    const absl::Status status =
        kvhost::FetchHandoff(handoff_socket_, request, absl::Seconds(5)).status();
    for (int fd : silent) ::close(fd);
    return status;
  }

  // One fast-path mailbox for `session_ids`: its connection (the mailbox
  // lives as long as it), or the daemon's refusal.
  absl::StatusOr<int> OpenMailbox(const std::vector<std::string>& session_ids) {
    v1::HandoffRequest request;
    request.set_kind(v1::HANDOFF_KIND_FAST_PATH);
    for (const std::string& id : session_ids) request.add_session_ids(id);
    absl::StatusOr<kvhost::Handoff> handoff =
        kvhost::FetchHandoff(handoff_socket_, request, absl::Seconds(10));
    if (!handoff.ok()) return handoff.status();
    return handoff->connection.Release();  // the mailbox's descriptor closes with `handoff`
  }

  // fast_path_mailbox_grab (issue 29, finding 10): the thief's session asks
  // for mailboxes until it is refused, RESOURCE_EXHAUSTED naming
  // --fast-path-connections-per-client (`refused`); while it holds them,
  // this worker's own session still gets one. A failure otherwise.
  absl::Status GrabMailboxes(absl::Status* refused) {
    std::vector<int> held;
    absl::Status failure;
    for (int i = 0; i < kMailboxGrab && refused->ok(); ++i) {
      absl::StatusOr<int> connection = OpenMailbox(thief_->session_ids());
      if (connection.ok()) held.push_back(*connection);
      *refused = connection.status();
    }
    if (refused->ok()) {
      failure = absl::InternalError(absl::StrCat("fast_path_mailbox_grab: one client got all ",
                                                 held.size(), " mailboxes it asked for"));
    } else if (absl::IsResourceExhausted(*refused) &&
               !absl::StrContains(refused->message(), "--fast-path-connections-per-client")) {
      failure = absl::InternalError(absl::StrCat(
          "fast_path_mailbox_grab: refused for another bound than the client's share: ",
          StatusText(*refused)));
    } else if (absl::IsResourceExhausted(*refused)) {
      absl::StatusOr<int> mine = OpenMailbox(client_->session_ids());
      Expect(mine.status());
      if (mine.ok()) {
        ::close(*mine);
      } else {
        failure = absl::InternalError(absl::StrCat(
            "fast_path_mailbox_grab: with ", held.size(),
            " mailboxes held by another client, this worker's session was refused one: ",
            StatusText(mine.status())));
      }
    }
    for (int fd : held) ::close(fd);
    return failure;
  }

  // An attach request for this worker's pool whose every buffer is `path`
  // at offset 0 (big enough: see StartSwapRacer).
  v1::AttachDeviceRequest RequestOnFile(const std::string& path) const {
    v1::AttachDeviceRequest request = device_->MakeAttachRequest(pool_name_);
    for (auto* layers : {request.mutable_k_layers(), request.mutable_v_layers()}) {
      for (v1::DeviceBuffer& b : *layers) {
        b.mutable_shm()->set_path(path);
        b.mutable_shm()->set_offset(0);
      }
    }
    for (v1::DeviceComponent& c : *request.mutable_components()) {
      for (v1::DeviceBuffer& b : *c.mutable_layers()) {
        b.mutable_shm()->set_path(path);
        b.mutable_shm()->set_offset(0);
      }
    }
    return request;
  }

  // <shm>/soak-swap-<index>/dev is a real file (one device layer's worth of
  // bytes, zeroed); /tmp/kvhost-soak-decoy-<index>/dev is a decoy with the
  // same name and size and known bytes. A thread renames a symlink to the
  // decoy's directory and the real directory in turn over swap_path_, as
  // fast as it can, until the worker exits.
  absl::Status StartSwapRacer(const std::string& shm_dir) {
    const uint64_t bytes = device_->bytes();
    swap_path_ = absl::StrCat(shm_dir, "/soak-swap-", index_);
    swap_file_ = swap_path_ + "/dev";
    const std::string real = absl::StrCat(swap_path_, ".dir"), link = swap_path_ + ".link";
    const std::string decoy_dir = absl::StrCat("/tmp/kvhost-soak-decoy-", index_);
    decoy_file_ = decoy_dir + "/dev";
    std::error_code ec;
    for (const std::string& p : {swap_path_, real, link, decoy_dir}) {
      std::filesystem::remove_all(p, ec);
    }
    std::filesystem::create_directories(real, ec);
    std::filesystem::create_directories(decoy_dir, ec);
    decoy_bytes_.assign(bytes, 'D');
    if (!WriteAtomically(decoy_file_, decoy_bytes_).ok() ||
        !WriteAtomically(real + "/dev", std::string(bytes, '\0')).ok()) {
      return absl::InternalError("cannot write the swap racer's files");
    }
    std::filesystem::create_directory_symlink(decoy_dir, link, ec);
    if (ec) return absl::InternalError(absl::StrCat("symlink ", link, ": ", ec.message()));
    std::filesystem::rename(real, swap_path_, ec);
    racer_ = std::thread([this, real, link] {
      bool is_dir = true;
      while (!racer_stop_.load(std::memory_order_relaxed) && !g_stop) {
        // The current occupant moves back to its own name; the other
        // takes swap_path_.
        if (::rename(swap_path_.c_str(), (is_dir ? real : link).c_str()) != 0) break;
        if (::rename((is_dir ? link : real).c_str(), swap_path_.c_str()) != 0) break;
        is_dir = !is_dir;
      }
    });
    return absl::OkStatus();
  }

 public:
  ~Worker() {
    racer_stop_ = true;
    if (racer_.joinable()) racer_.join();
    std::error_code ec;
    for (const std::string& p : {swap_path_, swap_path_ + ".dir", swap_path_ + ".link",
                                 absl::StrCat("/tmp/kvhost-soak-decoy-", index_)}) {
      if (!swap_path_.empty()) std::filesystem::remove_all(p, ec);
    }
  }

 private:
  std::string handoff_socket_;
  std::string region_path_, swap_path_, swap_file_, decoy_file_, decoy_bytes_;
  std::thread racer_;
  std::atomic<bool> racer_stop_{false};
  std::string dir_, pool_name_, stats_path_, attachment_;
  uint32_t index_ = 0, incarnation_ = 0, workers_ = 1;
  int notify_fd_ = -1, journal_fd_ = -1;
  double invalid_share_ = 0;
  uint64_t counter_ = 0;
  std::mt19937_64 rng_;
  std::unique_ptr<kvhost::Client> client_;
  std::unique_ptr<kvhost::Client> thief_;   // its own session: tries the stolen ids
  std::unique_ptr<kvhost::Client> victim_;  // owner of race_pool_ (attach_pool_being_created)
  std::string race_pool_;
  v1::PoolSpec race_spec_;
  std::unique_ptr<kvhost::ShmDevicePool> device_;
  std::vector<int64_t> lease_;
  std::map<int64_t, uint64_t> journaled_;
  WorkerStats stats_;
};

// ---------------------------------------------------------------------------
// Driver.

struct WorkerSlot {
  uint32_t index = 0;
  uint32_t incarnation = 0;
  size_t pool = 0;  // into Driver::worker_pools_
  pid_t pid = -1;
  int notify_read = -1, notify_write = -1;
  std::vector<int64_t> lease;  // host slots leased to it, whole pages
};

struct WorkerPool {
  std::string name;
  uint64_t page_size = 1;
  uint64_t size_tokens = 0;
};

class Driver {
 public:
  absl::Status Run() {
    const std::string address_flag = absl::GetFlag(FLAGS_address);
    session_timeout_ = absl::GetFlag(FLAGS_session_timeout);
    if (address_flag.empty()) {
      absl::StatusOr<std::unique_ptr<kvhost::testing::TestDaemon>> daemon =
          kvhost::testing::TestDaemon::Start(
              absl::GetFlag(FLAGS_kvhostd),
              {"--log-level=info",
               absl::StrCat("--session-timeout=", absl::FormatDuration(session_timeout_)),
               absl::StrCat("--memory-limit=", absl::GetFlag(FLAGS_memory_limit))});
      if (!daemon.ok()) return daemon.status();
      daemon_ = *std::move(daemon);
      address_ = daemon_->address();
    } else {
      address_ = address_flag;
    }
    absl::StatusOr<std::unique_ptr<kvhost::Client>> client = MakeClient(0);
    if (!client.ok()) return client.status();
    client_ = *std::move(client);
    absl::StatusOr<v1::DaemonStatus> status = client_->GetStatus();
    if (!status.ok()) return status.status();
    shm_dir_ = status->shm_dir();
    char dir_template[] = "/tmp/kvhost-soak-XXXXXX";
    if (::mkdtemp(dir_template) == nullptr) return absl::InternalError("mkdtemp failed");
    dir_ = dir_template;
    prefix_ = absl::StrCat("soak", ::getpid(), "-");

    if (absl::Status s = CreatePools(); !s.ok()) return s;
    absl::PrintF(
        "kvhost_soak: kvhostd %s at %s (backend %s), %d scheduler clients, %d workers, "
        "invalid share %.2f, kill every %.1f s, session timeout %s, %.0f s\n",
        status->version(), address_, status->backend(), absl::GetFlag(FLAGS_clients),
        absl::GetFlag(FLAGS_workers), absl::GetFlag(FLAGS_invalid_share),
        absl::GetFlag(FLAGS_kill_every), absl::FormatDuration(session_timeout_),
        absl::GetFlag(FLAGS_seconds));
    std::fflush(stdout);

    if (absl::Status s = StartSchedulers(); !s.ok()) return s;
    for (WorkerSlot& w : workers_) {
      if (absl::Status s = Spawn(w); !s.ok()) return s;
    }
    for (WorkerSlot& w : workers_) WaitReady(w);
    start_ = Clock::now();
    Loop();
    return Finish();
  }

 private:
  // `token`: the owner token it presents (the node cache's, or none).
  absl::StatusOr<std::unique_ptr<kvhost::Client>> MakeClient(int distinct,
                                                             const std::string& token = "") {
    kvhost::ClientOptions options;
    options.address = address_;
    options.owner_token = token;
    options.timeout = absl::Seconds(30);
    options.worker_session = false;
    // Distinct channel arguments: each client gets its own connection.
    options.max_message_bytes -= distinct;
    absl::StatusOr<std::unique_ptr<kvhost::Client>> client = kvhost::Client::Connect(options);
    if (!client.ok()) return client.status();
    if (absl::Status s = (*client)->WaitForReady(absl::Seconds(20)); !s.ok()) return s;
    return client;
  }

  absl::Status CreatePools() {
    const uint64_t clients = absl::GetFlag(FLAGS_clients);
    const uint64_t workers = absl::GetFlag(FLAGS_workers);
    // Scheduler pools: twice what the threads can hold, so that a free page
    // always exists for the "not allocated" requests.
    const uint64_t pages = 2 * std::max<uint64_t>(clients, 1) * kMaxHeldPages + 16;
    const std::vector<PoolPlan> sched = {
        {"mha-p1", v1::MHA, v1::LAYER_FIRST, 1, 2, pages},
        {"mla-p16", v1::MLA, v1::PAGE_FIRST_DIRECT, 16, 2, pages * 16},
        {"mha-p4-head", v1::MHA, v1::PAGE_HEAD, 4, 3, pages * 4},
    };
    for (const PoolPlan& plan : sched) {
      absl::StatusOr<v1::Pool> pool = client_->CreatePool(prefix_ + plan.suffix, SpecOf(plan));
      if (!pool.ok()) return pool.status();
      SchedPool p;
      p.name = pool->name();
      p.page_size = plan.page_size;
      p.size_tokens = pool->size_tokens();
      p.page_num = pool->page_num();
      p.page_bytes = pool->bytes_per_page();
      p.held.reset(new std::atomic<uint8_t>[p.page_num]);
      for (uint64_t i = 0; i < p.page_num; ++i) p.held[i].store(0);
      shared_.pools.push_back(std::move(p));
    }
    // The node cache, protected by its token (the schedulers' lookups).
    absl::StatusOr<std::unique_ptr<kvhost::Client>> owner = MakeClient(0, kCacheToken);
    if (!owner.ok()) return owner.status();
    v1::PoolSpec cache_spec = SpecOf({kCacheSuffix, v1::MHA, v1::PAGE_FIRST, 16, 2, 64 * 16});
    cache_spec.set_node_cache(true);
    absl::StatusOr<v1::Pool> cache = (*owner)->CreatePool(prefix_ + kCacheSuffix, cache_spec);
    if (!cache.ok()) return cache.status();
    shared_.cache = cache->name();
    // Worker pools: each worker's lease twice over (leases are replaced
    // page by page after kills).
    const uint64_t worker_tokens = (workers + 1) * kLeaseSlots * 2;
    const std::vector<PoolPlan> worker_plans = {
        {"w-mha-p1", v1::MHA, v1::LAYER_FIRST, 1, 4, worker_tokens},
        {"w-mla-p16", v1::MLA, v1::PAGE_FIRST, 16, 4, worker_tokens},
    };
    for (const PoolPlan& plan : worker_plans) {
      absl::StatusOr<v1::Pool> pool = client_->CreatePool(prefix_ + plan.suffix, SpecOf(plan));
      if (!pool.ok()) return pool.status();
      worker_pools_.push_back({pool->name(), plan.page_size, pool->size_tokens()});
    }
    for (uint32_t i = 0; i < workers; ++i) {
      WorkerSlot w;
      w.index = i;
      w.pool = i % worker_pools_.size();
      absl::StatusOr<std::vector<int64_t>> slots =
          client_->Alloc(worker_pools_[w.pool].name, kLeaseSlots);
      if (!slots.ok()) return slots.status();
      w.lease = *slots;
      workers_.push_back(std::move(w));
    }
    return absl::OkStatus();
  }

  absl::Status StartSchedulers() {
    const uint32_t n = absl::GetFlag(FLAGS_clients);
    shared_.ledgers.assign(n, std::vector<Ledger>(shared_.pools.size()));
    for (uint32_t i = 0; i < n; ++i) {
      absl::StatusOr<std::unique_ptr<kvhost::Client>> client = MakeClient(1 + i);
      if (!client.ok()) return client.status();
      absl::StatusOr<std::unique_ptr<kvhost::Client>> cache_client =
          MakeClient(1 + n + i, kCacheToken);
      if (!cache_client.ok()) return cache_client.status();
      schedulers_.push_back(std::make_unique<Scheduler>(
          &shared_, i, *std::move(client), *std::move(cache_client),
          absl::GetFlag(FLAGS_seed) * 7919 + i, absl::GetFlag(FLAGS_invalid_share)));
    }
    for (auto& s : schedulers_) threads_.emplace_back([p = s.get()] { p->Run(); });
    return absl::OkStatus();
  }

  absl::Status Spawn(WorkerSlot& w) {
    std::string lease = absl::StrJoin(w.lease, " ");
    if (absl::Status s = WriteAtomically(LeasePath(dir_, w.index), lease); !s.ok()) return s;
    int fds[2];
    if (::pipe2(fds, O_CLOEXEC | O_NONBLOCK) != 0) return absl::InternalError("pipe2 failed");
    w.notify_read = fds[0];
    w.notify_write = fds[1];
    std::vector<std::string> args = {
        self_,
        "--worker",
        absl::StrCat("--address=", address_),
        absl::StrCat("--pool=", worker_pools_[w.pool].name),
        absl::StrCat("--shm_dir=", shm_dir_),
        absl::StrCat("--dir=", dir_),
        absl::StrCat("--index=", w.index),
        absl::StrCat("--workers=", absl::GetFlag(FLAGS_workers)),
        absl::StrCat("--incarnation=", w.incarnation),
        absl::StrCat("--notify_fd=", w.notify_write),
        absl::StrCat("--seed=", absl::GetFlag(FLAGS_seed)),
        absl::StrCat("--invalid_share=", absl::GetFlag(FLAGS_invalid_share))};
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    const pid_t pid = ::fork();
    if (pid < 0) return absl::InternalError("fork failed");
    if (pid == 0) {
      ::fcntl(fds[1], F_SETFD, 0);  // the worker keeps the write end
      ::execv(argv[0], argv.data());
      ::_exit(127);
    }
    ::close(fds[1]);
    w.notify_write = -1;
    w.pid = pid;
    return absl::OkStatus();
  }

  // Waits until the worker attached and verified its journal.
  void WaitReady(WorkerSlot& w) {
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    while (absl::Now() < deadline) {
      const WorkerStats s = WorkerStats::Parse(ReadText(StatsPath(dir_, w.index, w.incarnation)));
      if (s.ready) return;
      int status = 0;
      if (::waitpid(w.pid, &status, WNOHANG) == w.pid) {
        shared_.failures.Add(absl::StrCat("worker ", w.index, ".", w.incarnation, " (pid ", w.pid,
                                          ") exited during start: status ", status));
        w.pid = -1;
        return;
      }
      absl::SleepFor(absl::Milliseconds(20));
    }
    shared_.failures.Add(absl::StrCat("worker ", w.index, ".", w.incarnation,
                                      " not ready after 30 s (attach + journal verification)"));
  }

  // Workers attached now (one attachment each), other than `except`.
  uint32_t LiveWorkers(const WorkerSlot* except, size_t pool = SIZE_MAX) const {
    uint32_t n = 0;
    for (const WorkerSlot& w : workers_) {
      if (&w != except && w.pid > 0 && (pool == SIZE_MAX || w.pool == pool)) ++n;
    }
    return n;
  }

  void Kill(WorkerSlot& w) {
    // Half the kills land right after the worker submitted a transfer.
    const bool mid_transfer = rng_() % 2 == 0;
    char drain[64];
    while (::read(w.notify_read, drain, sizeof(drain)) > 0) {
    }
    bool notified = false;
    if (mid_transfer) {
      ::kill(w.pid, SIGUSR1);
      pollfd pfd{w.notify_read, POLLIN, 0};
      notified = ::poll(&pfd, 1, 2000) == 1;
    }
    ::kill(w.pid, SIGKILL);
    const absl::Time killed = absl::Now();
    int status = 0;
    ::waitpid(w.pid, &status, 0);
    ++kills_;
    if (notified) ++mid_transfer_kills_;
    const pid_t dead = w.pid;
    w.pid = -1;
    ::close(w.notify_read);
    w.notify_read = -1;

    // The daemon must close the session and its attachment in time.
    const absl::Time deadline = killed + session_timeout_ + absl::Seconds(1);
    const uint32_t want_attachments = LiveWorkers(&w);
    const uint32_t want_on_pool = LiveWorkers(&w, w.pool);
    std::string last;
    bool closed = false;
    while (true) {
      absl::StatusOr<v1::DaemonStatus> st = client_->GetStatus();
      absl::StatusOr<v1::Pool> pool = client_->GetPool(worker_pools_[w.pool].name);
      shared_.counters.Count(st.status());
      shared_.counters.Count(pool.status());
      if (st.ok() && pool.ok()) {
        bool session_left = false;
        for (const v1::SessionInfo& s : st->sessions()) session_left |= s.pid() == dead;
        last = absl::StrCat("sessions ", st->sessions_size(),
                            session_left ? " (the dead one's still open)" : "", ", attachments ",
                            st->attachments(), " (want ", want_attachments, "), pool attachments ",
                            pool->attachments(), " (want ", want_on_pool, ")");
        if (!session_left && st->attachments() == want_attachments &&
            pool->attachments() == want_on_pool) {
          closed = true;
          break;
        }
      } else {
        last = StatusText(st.ok() ? pool.status() : st.status());
      }
      if (absl::Now() > deadline) break;
      absl::SleepFor(absl::Milliseconds(50));
    }
    const double close_s = absl::ToDoubleSeconds(absl::Now() - killed);
    max_close_s_ = std::max(max_close_s_, close_s);
    if (!closed) {
      shared_.failures.Add(absl::StrCat("worker ", w.index, ".", w.incarnation, " (pid ", dead,
                                        ") killed; after ", close_s,
                                        " s the daemon still shows: ", last));
      // Let it finish closing before the replacement touches the slots.
      absl::SleepFor(session_timeout_);
    }

    // Leftover device file of the dead worker.
    const std::string leftover = absl::StrCat("kvhost-dev.", dead, ".");
    std::error_code ec;
    for (const auto& entry : std::filesystem::directory_iterator(shm_dir_, ec)) {
      if (absl::StartsWith(entry.path().filename().string(), leftover)) {
        std::filesystem::remove(entry.path(), ec);
        ++shm_files_removed_;
      }
    }

    // Now and then the scheduler takes back a third of the lease (the
    // journal first: those bytes are no longer promised) and leases fresh
    // pages instead.
    if (rng_() % 2 == 0) ReplaceLeasePages(w);
    CheckConservation();

    ++w.incarnation;
    ++restarts_;
    if (absl::Status s = Spawn(w); !s.ok()) {
      shared_.failures.Add(absl::StrCat("restart of worker ", w.index, ": ", StatusText(s)));
      return;
    }
    WaitReady(w);
  }

  void ReplaceLeasePages(WorkerSlot& w) {
    const WorkerPool& pool = worker_pools_[w.pool];
    std::vector<int64_t> pages;
    for (int64_t s : w.lease) {
      if (s % static_cast<int64_t>(pool.page_size) == 0) pages.push_back(s);
    }
    std::shuffle(pages.begin(), pages.end(), rng_);
    pages.resize(std::max<size_t>(1, pages.size() / 3));
    std::vector<int64_t> slots;
    std::string drop;
    for (int64_t first : pages) {
      for (uint64_t j = 0; j < pool.page_size; ++j) {
        slots.push_back(first + j);
        absl::StrAppend(&drop, "D ", first + j, "\n");
      }
    }
    const int fd = ::open(JournalPath(dir_, w.index).c_str(), O_WRONLY | O_APPEND | O_CREAT, 0644);
    const bool written = fd >= 0 && AppendAll(fd, drop);
    if (fd >= 0) ::close(fd);
    if (!written) {
      shared_.failures.Add("cannot append to a worker's journal");
      return;
    }
    absl::StatusOr<uint64_t> freed = client_->Free(pool.name, slots);
    shared_.counters.Count(freed.status());
    if (!freed.ok()) {
      shared_.failures.Add(absl::StrCat("Free of a dead worker's ", slots.size(), " slots of ",
                                        pool.name, ": ", StatusText(freed.status())));
      return;
    }
    const std::set<int64_t> gone(slots.begin(), slots.end());
    w.lease.erase(std::remove_if(w.lease.begin(), w.lease.end(),
                                 [&](int64_t s) { return gone.count(s) > 0; }),
                  w.lease.end());
    absl::StatusOr<std::vector<int64_t>> fresh = client_->Alloc(pool.name, slots.size());
    shared_.counters.Count(fresh.status());
    if (!fresh.ok()) {
      shared_.failures.Add(absl::StrCat("Alloc of ", slots.size(), " slots of ", pool.name,
                                        " for a replacement: ", StatusText(fresh.status())));
      return;
    }
    w.lease.insert(w.lease.end(), fresh->begin(), fresh->end());
    ++lease_replacements_;
  }

  // Every pool's free count against the ledgers (scheduler threads paused).
  void CheckConservation() {
    std::unique_lock lock(shared_.mu);
    for (size_t p = 0; p < shared_.pools.size(); ++p) {
      const SchedPool& pool = shared_.pools[p];
      CheckPool(pool.name, pool.size_tokens, shared_.HeldPages(p) * pool.page_size);
    }
    for (size_t p = 0; p < worker_pools_.size(); ++p) {
      uint64_t leased = 0;
      for (const WorkerSlot& w : workers_) {
        if (w.pool == p) leased += w.lease.size();
      }
      CheckPool(worker_pools_[p].name, worker_pools_[p].size_tokens, leased);
    }
  }

  void CheckPool(const std::string& name, uint64_t size, uint64_t held) {
    absl::StatusOr<v1::Pool> pool = client_->GetPool(name);
    shared_.counters.Count(pool.status());
    shared_.counters.conservation_checks.fetch_add(1, std::memory_order_relaxed);
    if (!pool.ok()) {
      shared_.failures.Add(absl::StrCat("GetPool ", name, ": ", StatusText(pool.status())));
    } else if (pool->size_tokens() != size || pool->available_tokens() + held != size) {
      shared_.failures.Add(absl::StrCat("pool ", name, ": available_tokens ",
                                        pool->available_tokens(), " + held by the ledgers ", held,
                                        " != size ", pool->size_tokens()));
    }
  }

  WorkerStats SumWorkerStats() const {
    WorkerStats sum;
    for (const WorkerSlot& w : workers_) {
      for (uint32_t i = 0; i <= w.incarnation; ++i) {
        const WorkerStats s = WorkerStats::Parse(ReadText(StatsPath(dir_, w.index, i)));
        sum.requests += s.requests;
        sum.invalid += s.invalid;
        sum.backups += s.backups;
        sum.loads += s.loads;
        sum.verified_bytes += s.verified_bytes;
        sum.recovered_slots += s.recovered_slots;
        sum.recovered_bytes += s.recovered_bytes;
        sum.failures += s.failures;
        sum.swap_attached += s.swap_attached;
        sum.fast_path_calls += s.fast_path_calls;
        for (int c = 0; c < kCodes; ++c) sum.codes[c] += s.codes[c];
        for (int k = 0; k < kWorkerInvalidKinds; ++k) sum.invalid_kinds[k] += s.invalid_kinds[k];
      }
    }
    return sum;
  }

  void Progress(double elapsed) {
    const WorkerStats ws = SumWorkerStats();
    const uint64_t requests = shared_.counters.requests.load() + ws.requests;
    const uint64_t invalid = shared_.counters.invalid.load() + ws.invalid;
    absl::PrintF(
        "[%6.0f s] requests %d (invalid %.1f %%), kills %d (%d mid-transfer), restarts %d, "
        "verified %.1f MB, recovered slots %d, failures %d\n",
        elapsed, requests, requests > 0 ? 100.0 * invalid / requests : 0.0, kills_,
        mid_transfer_kills_, restarts_,
        (shared_.counters.verified_bytes.load() + ws.verified_bytes) / 1e6, ws.recovered_slots,
        shared_.failures.count() + ws.failures);
    std::fflush(stdout);
  }

  // A worker that exited on its own is a failure; it is started again.
  void ReapUnexpected() {
    for (WorkerSlot& w : workers_) {
      int status = 0;
      if (w.pid > 0 && ::waitpid(w.pid, &status, WNOHANG) == w.pid) {
        shared_.failures.Add(absl::StrCat("worker ", w.index, ".", w.incarnation, " (pid ", w.pid,
                                          ") exited by itself: status ", status));
        w.pid = -1;
        ::close(w.notify_read);
        absl::SleepFor(session_timeout_ + absl::Milliseconds(500));
        ++w.incarnation;
        ++restarts_;
        if (Spawn(w).ok()) WaitReady(w);
      }
    }
  }

  void Loop() {
    const double seconds = absl::GetFlag(FLAGS_seconds);
    const double kill_every = absl::GetFlag(FLAGS_kill_every);
    std::uniform_real_distribution<double> jitter(0.5, 1.5);
    const Clock::time_point end = start_ + std::chrono::duration_cast<Clock::duration>(
                                               std::chrono::duration<double>(seconds));
    auto after = [](double s) {
      return Clock::now() +
             std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
    };
    Clock::time_point next_kill = kill_every > 0 ? after(kill_every * jitter(rng_)) : end;
    Clock::time_point next_check = after(1);
    Clock::time_point next_progress = after(10);
    while (Clock::now() < end) {
      ReapUnexpected();
      if (Clock::now() >= next_kill && LiveWorkers(nullptr) > 0) {
        WorkerSlot* w = nullptr;
        while (w == nullptr || w->pid <= 0) w = &workers_[rng_() % workers_.size()];
        Kill(*w);
        next_kill = after(kill_every * jitter(rng_));
      }
      if (Clock::now() >= next_check) {
        CheckConservation();
        next_check = after(1);
      }
      if (Clock::now() >= next_progress) {
        Progress(Seconds(Clock::now() - start_));
        next_progress = after(10);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }

  absl::Status Finish() {
    shared_.stop = true;
    for (std::thread& t : threads_) t.join();
    // Workers stop at SIGTERM after their current step.
    for (WorkerSlot& w : workers_) {
      if (w.pid > 0) ::kill(w.pid, SIGTERM);
    }
    for (WorkerSlot& w : workers_) {
      if (w.pid <= 0) continue;
      int status = 0;
      ::waitpid(w.pid, &status, 0);
      if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        shared_.failures.Add(absl::StrCat("worker ", w.index, ".", w.incarnation,
                                          " ended with status ", status, " at SIGTERM"));
      }
      w.pid = -1;
      if (w.notify_read >= 0) ::close(w.notify_read);
    }
    CheckConservation();
    // Give everything back: every pool must then be entirely free.
    for (auto& s : schedulers_) s->ReleaseAll();
    for (WorkerSlot& w : workers_) {
      absl::StatusOr<uint64_t> freed = client_->Free(worker_pools_[w.pool].name, w.lease);
      shared_.counters.Count(freed.status());
      if (!freed.ok()) shared_.failures.Add(StatusText(freed.status()));
      w.lease.clear();
    }
    {
      std::unique_lock lock(shared_.mu);
      for (const SchedPool& pool : shared_.pools) CheckPool(pool.name, pool.size_tokens, 0);
      for (const WorkerPool& pool : worker_pools_) CheckPool(pool.name, pool.size_tokens, 0);
    }
    for (const SchedPool& pool : shared_.pools) (void)client_->DeletePool(pool.name);
    for (const WorkerPool& pool : worker_pools_) (void)client_->DeletePool(pool.name);
    if (absl::StatusOr<std::unique_ptr<kvhost::Client>> owner = MakeClient(0, kCacheToken);
        owner.ok()) {
      (void)(*owner)->DeletePool(shared_.cache);
    }
    const double elapsed = Seconds(Clock::now() - start_);
    Progress(elapsed);

    const WorkerStats ws = SumWorkerStats();
    shared_.failures.AddCount(ws.failures);
    const uint64_t requests = shared_.counters.requests.load() + ws.requests;
    const uint64_t invalid = shared_.counters.invalid.load() + ws.invalid;
    bench::JsonObject codes;
    for (int c = 0; c < kCodes; ++c) {
      const uint64_t n = shared_.counters.codes[c].load() + ws.codes[c];
      if (n > 0) codes.Uint(absl::StatusCodeToString(static_cast<absl::StatusCode>(c)), n);
    }
    bench::JsonObject kinds;
    for (int k = 0; k < kInvalidKinds; ++k) {
      uint64_t n = 0;
      for (const auto& s : schedulers_) n += s->invalid_kinds()[k].load();
      kinds.Uint(InvalidName(static_cast<Invalid>(k)), n);
    }
    for (int k = 0; k < kWorkerInvalidKinds; ++k)
      kinds.Uint(kWorkerInvalidNames[k], ws.invalid_kinds[k]);
    // The schedulers' and the workers' calls through the fast path: on a
    // unix socket it is the clients' default, so the checks above held for
    // it; none at all means it never opened.
    uint64_t fast_path_calls = ws.fast_path_calls;
    for (const auto& s : schedulers_) fast_path_calls += s->fast_path_calls();
    if (absl::StartsWith(address_, "unix:") && fast_path_calls == 0) {
      shared_.failures.Add("no call went through the fast path on a unix socket");
    }
    std::vector<std::string> failures;
    for (const std::string& f : shared_.failures.first()) {
      failures.push_back(kvhost::cli::JsonQuote(f));
    }
    const std::string json =
        bench::JsonObject()
            .Str("benchmark", "kvhost_soak")
            .Str("server", address_)
            .Bool("own_daemon", daemon_ != nullptr)
            .Num("duration_s", elapsed, 1)
            .Uint("clients", absl::GetFlag(FLAGS_clients))
            .Uint("workers", absl::GetFlag(FLAGS_workers))
            .Uint("seed", absl::GetFlag(FLAGS_seed))
            .Uint("requests", requests)
            .Uint("invalid_requests", invalid)
            .Num("invalid_share", requests > 0 ? static_cast<double>(invalid) / requests : 0, 4)
            .Raw("codes", codes.str())
            .Raw("invalid_kinds", kinds.str())
            .Uint("kills", kills_)
            .Uint("mid_transfer_kills", mid_transfer_kills_)
            .Uint("restarts", restarts_)
            .Num("max_session_close_s", max_close_s_, 3)
            .Uint("shm_files_removed", shm_files_removed_)
            .Uint("lease_replacements", lease_replacements_)
            .Uint("backups", ws.backups)
            .Uint("loads", ws.loads)
            .Uint("swap_race_attaches_inside", ws.swap_attached)
            .Uint("backups_verified_after_restart", ws.recovered_slots)
            .Uint("bytes_verified_after_restart", ws.recovered_bytes)
            .Uint("bytes_verified", shared_.counters.verified_bytes.load() + ws.verified_bytes)
            .Uint("conservation_checks", shared_.counters.conservation_checks.load())
            .Uint("fast_path_calls", fast_path_calls)
            .Uint("failures", shared_.failures.count())
            .Raw("first_failures", bench::JsonArray(failures))
            .str();
    std::printf("%s\n", json.c_str());
    const std::string json_path = absl::GetFlag(FLAGS_json);
    if (!json_path.empty()) {
      if (absl::Status s = bench::WriteJsonOut(json_path, json); !s.ok()) return s;
    }
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
    if (shared_.failures.count() > 0) {
      return absl::InternalError(absl::StrCat(shared_.failures.count(), " failures"));
    }
    return absl::OkStatus();
  }

 public:
  explicit Driver(std::string self) : self_(std::move(self)), rng_(absl::GetFlag(FLAGS_seed)) {}

 private:
  const std::string self_;
  std::mt19937_64 rng_;
  Clock::time_point start_ = Clock::now();
  absl::Duration session_timeout_;
  std::unique_ptr<kvhost::testing::TestDaemon> daemon_;
  std::string address_, shm_dir_, dir_, prefix_;
  std::unique_ptr<kvhost::Client> client_;
  Shared shared_;
  std::vector<std::unique_ptr<Scheduler>> schedulers_;
  std::vector<std::thread> threads_;
  std::vector<WorkerPool> worker_pools_;
  std::vector<WorkerSlot> workers_;
  uint64_t kills_ = 0, mid_transfer_kills_ = 0, restarts_ = 0, shm_files_removed_ = 0;
  uint64_t lease_replacements_ = 0;
  double max_close_s_ = 0;
};

}  // namespace

int main(int argc, char** argv) {
  kvhost::ParseFlags(
      argc, argv,
      "kvhost_soak: soak and fault test of kvhostd: scheduler clients with invalid requests,\n"
      "worker processes killed with SIGKILL and restarted, conservation and byte checks.\n"
      "Usage: kvhost_soak [--seconds=60] [--clients=4] [--workers=2] [--invalid-share=0.15]\n"
      "                   [--kill-every=3] [--seed=1] [--address=unix:///path.sock] [--json=FILE]",
      "bench/soak.cc");
  if (absl::GetFlag(FLAGS_worker)) {
    const absl::Status s = Worker().Run();
    return s.ok() ? 0 : 1;
  }
  std::error_code ec;
  const std::string self = std::filesystem::read_symlink("/proc/self/exe", ec).string();
  if (ec) {
    std::fprintf(stderr, "error: cannot find this program's path: %s\n", ec.message().c_str());
    return 1;
  }
  if (absl::GetFlag(FLAGS_clients) == 0 || absl::GetFlag(FLAGS_invalid_share) < 0 ||
      absl::GetFlag(FLAGS_invalid_share) >= 1 || absl::GetFlag(FLAGS_seconds) <= 0) {
    std::fprintf(stderr,
                 "usage error: --clients must be >= 1, --invalid-share in [0, 1), --seconds > 0\n");
    return 2;
  }
  const absl::Status s = Driver(self).Run();
  if (s.ok()) return 0;
  absl::FPrintF(stderr, "error: %s\n", StatusText(s));
  return 1;
}
