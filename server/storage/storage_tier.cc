#include "server/storage/storage_tier.h"

#include <algorithm>
#include <random>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "spdlog/spdlog.h"

namespace kvhost {
namespace {

enum class StorageOp { kStore, kFetch, kExist };

const char* OpName(StorageOp op) {
  switch (op) {
    case StorageOp::kStore:
      return "store";
    case StorageOp::kFetch:
      return "fetch";
    case StorageOp::kExist:
      return "exist";
  }
  return "unknown";
}

}  // namespace

// One accepted call: its pages, their results, and the jobs still running.
struct StorageTier::Call {
  StorageOp op = StorageOp::kStore;
  std::shared_ptr<Pool> pool;
  // Store and Fetch: Pool::UseSlots until the call ends, so that no
  // ClaimPool frees the slots it reads or writes.
  std::shared_ptr<void> slot_use;
  std::string ns;  // the namespace of the keys
  PageShapeTag tag;
  std::vector<int64_t> indices;
  std::vector<std::string> keys;
  std::vector<PageResult> results;
  uint64_t prefix = 0;  // Exist
  PagesDone pages_done;
  PrefixDone prefix_done;
  std::atomic<size_t> jobs_left{0};
  absl::Time start;
};

namespace {

// Random per store, so that parts of two stores of one key differ.
uint64_t NewStoreId() {
  thread_local std::mt19937_64 rng(std::random_device{}());
  return rng();
}

PageResult Unavailable(std::string detail) {
  return {PageOutcome::kUnavailable, std::move(detail)};
}

}  // namespace

StorageTier::StorageTier(std::unique_ptr<StorageBackend> backend, const StorageTierOptions& options,
                         L3Secret secret, KvhostMetrics* metrics)
    : backend_(std::move(backend)),
      options_(options),
      secret_(secret),
      metrics_(metrics),
      queue_(std::max(1, options.threads)) {}

StorageTier::~StorageTier() = default;

absl::Status StorageTier::Reserve(const Pool& pool, uint64_t n) {
  const uint64_t max = options_.max_pages_in_flight;
  const uint64_t share = std::min(max, options_.max_pages_in_flight_per_pool);
  if (n > share) {
    return absl::ResourceExhaustedError(
        absl::StrCat("a call of ", n, " pages, over the bound of ", share, " pages in flight",
                     share < max ? " for one pool (--l3-max-pages-in-flight-per-pool)"
                                 : " (--l3-max-pages-in-flight)",
                     "; split it"));
  }
  const Pool* unit = &pool.token_owner();
  absl::MutexLock lock(&shares_mu_);
  auto it = shares_.find(unit);
  const uint64_t mine = it == shares_.end() ? 0 : it->second;
  const uint64_t now = in_flight_.load();
  if (now + n > max) {
    return absl::ResourceExhaustedError(
        absl::StrCat(n, " pages asked with ", now, " in flight, over the bound of ", max,
                     " pages in flight (--l3-max-pages-in-flight); retry when calls finish"));
  }
  if (mine + n > share) {
    return absl::ResourceExhaustedError(
        absl::StrCat(n, " pages asked with ", mine, " of pool '", pool.name(),
                     "' in flight, over its share of ", share,
                     " pages in flight (--l3-max-pages-in-flight-per-pool); retry when its calls "
                     "finish"));
  }
  shares_[unit] = mine + n;
  in_flight_.fetch_add(n);
  return absl::OkStatus();
}

void StorageTier::Release(const Pool& pool, uint64_t n) {
  absl::MutexLock lock(&shares_mu_);
  auto it = shares_.find(&pool.token_owner());
  if (it != shares_.end()) {
    it->second -= std::min(it->second, n);
    if (it->second == 0) shares_.erase(it);
  }
  in_flight_.fetch_sub(n);
}

absl::Status StorageTier::CheckPages(const Pool& pool, absl::Span<const int64_t> indices,
                                     absl::Span<const std::string> keys, PageShapeTag* tag) const {
  if (keys.size() != indices.size()) {
    return WithPool(pool.name(), absl::InvalidArgumentError(
                                     absl::StrCat(keys.size(), " keys for ", indices.size(),
                                                  " indices; give one key per page")));
  }
  for (size_t i = 0; i < keys.size(); ++i) {
    if (absl::Status s = CheckStorageKey(keys[i], absl::StrCat("keys[", i, "]")); !s.ok()) {
      return s;
    }
  }
  absl::StatusOr<PageShapeTag> shape = ShapeTagOf(pool);
  if (!shape.ok()) return shape.status();
  *tag = *shape;
  for (size_t i = 0; i < indices.size(); ++i) {
    if (absl::Status s = pool.CheckPage(indices[i]); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("indices[", i, "]: ", s.message()));
    }
  }
  return absl::OkStatus();
}

absl::Status StorageTier::Store(std::shared_ptr<Pool> pool, std::string ns,
                                std::vector<int64_t> indices, std::vector<std::string> keys,
                                PagesDone done) {
  auto call = std::make_shared<Call>();
  if (absl::Status s = CheckPages(*pool, indices, keys, &call->tag); !s.ok()) return s;
  absl::flat_hash_map<int64_t, int> uses;
  for (size_t i = 0; i < indices.size(); ++i) {
    if (++uses[indices[i]] > kMaxKeysPerPage) {
      return WithPool(pool->name(), absl::InvalidArgumentError(
                                        absl::StrCat("indices[", i, "] = ", indices[i],
                                                     " is given more than ", kMaxKeysPerPage,
                                                     " times; a call stores a page under at "
                                                     "most ",
                                                     kMaxKeysPerPage, " keys")));
    }
  }
  if (absl::Status s = Reserve(*pool, indices.size()); !s.ok()) return s;
  call->op = StorageOp::kStore;
  call->slot_use = pool->UseSlots();
  call->pool = std::move(pool);
  call->ns = std::move(ns);
  call->indices = std::move(indices);
  call->keys = std::move(keys);
  call->pages_done = std::move(done);
  Launch(std::move(call));
  return absl::OkStatus();
}

absl::Status StorageTier::Fetch(std::shared_ptr<Pool> pool, std::string ns,
                                std::vector<std::string> keys, std::vector<int64_t> indices,
                                PagesDone done) {
  auto call = std::make_shared<Call>();
  if (absl::Status s = CheckPages(*pool, indices, keys, &call->tag); !s.ok()) return s;
  std::set<int64_t> seen;
  for (size_t i = 0; i < indices.size(); ++i) {
    if (!seen.insert(indices[i]).second) {
      return WithPool(pool->name(),
                      absl::InvalidArgumentError(absl::StrCat("indices[", i, "] = ", indices[i],
                                                              " is given twice; a page is "
                                                              "filled from one key")));
    }
  }
  if (absl::Status s = Reserve(*pool, indices.size()); !s.ok()) return s;
  call->op = StorageOp::kFetch;
  call->slot_use = pool->UseSlots();
  call->pool = std::move(pool);
  call->ns = std::move(ns);
  call->indices = std::move(indices);
  call->keys = std::move(keys);
  call->pages_done = std::move(done);
  Launch(std::move(call));
  return absl::OkStatus();
}

absl::Status StorageTier::Exist(std::shared_ptr<Pool> pool, std::string ns,
                                std::vector<std::string> keys, PrefixDone done) {
  for (size_t i = 0; i < keys.size(); ++i) {
    if (absl::Status s = CheckStorageKey(keys[i], absl::StrCat("keys[", i, "]")); !s.ok()) {
      return s;
    }
  }
  if (absl::Status s = Reserve(*pool, keys.size()); !s.ok()) return s;
  auto call = std::make_shared<Call>();
  call->op = StorageOp::kExist;
  call->pool = std::move(pool);
  call->ns = std::move(ns);
  call->keys = std::move(keys);
  call->prefix_done = std::move(done);
  Launch(std::move(call));
  return absl::OkStatus();
}

void StorageTier::Launch(std::shared_ptr<Call> call) {
  call->start = absl::Now();
  const size_t n = call->keys.size();
  call->results.resize(call->op == StorageOp::kExist ? 0 : n);
  if (call->op == StorageOp::kExist) {
    // One job: the keys after the first miss are not looked up.
    call->jobs_left = 1;
    queue_.Post([this, call] { RunJob(call, 0, call->keys.size()); });
    return;
  }
  const uint64_t page_bytes = std::max<uint64_t>(1, call->tag.page_bytes);
  const size_t per_job = static_cast<size_t>(std::clamp<uint64_t>(
      options_.job_bytes / page_bytes, 1, std::max<uint32_t>(1, options_.max_pages_per_job)));
  const size_t jobs = (n + per_job - 1) / per_job;
  if (jobs == 0) {
    call->jobs_left = 1;
    JobDone(call);
    return;
  }
  call->jobs_left = jobs;
  for (size_t begin = 0; begin < n; begin += per_job) {
    const size_t end = std::min(n, begin + per_job);
    queue_.Post([this, call, begin, end] { RunJob(call, begin, end); });
  }
}

void StorageTier::RunJob(const std::shared_ptr<Call>& call, size_t begin, size_t end) {
  try {
    switch (call->op) {
      case StorageOp::kStore:
        StoreJob(*call, begin, end);
        break;
      case StorageOp::kFetch:
        FetchJob(*call, begin, end);
        break;
      case StorageOp::kExist: {
        std::vector<std::string> keys;
        keys.reserve(call->keys.size());
        for (const std::string& k : call->keys) {
          keys.push_back(PartKey(secret_.CacheKey(call->ns, k), 0));
        }
        const std::vector<bool> present = backend_->ExistPrefix(keys);
        call->prefix = static_cast<uint64_t>(std::find(present.begin(), present.end(), false) -
                                             present.begin());
        break;
      }
    }
  } catch (const std::exception& e) {
    // Out of memory, most likely: the job's pages fail, the tier goes on.
    spdlog::error("L3 {} job of pool '{}' failed: {}", OpName(call->op), call->pool->name(),
                  e.what());
    for (size_t i = begin; i < end && i < call->results.size(); ++i) {
      call->results[i] = Unavailable("the tier failed this job (out of memory?); see the log");
    }
    call->prefix = 0;
  } catch (...) {
    spdlog::error("L3 {} job of pool '{}' failed", OpName(call->op), call->pool->name());
    for (size_t i = begin; i < end && i < call->results.size(); ++i) {
      call->results[i] = Unavailable("the tier failed this job; see the log");
    }
    call->prefix = 0;
  }
  JobDone(call);
}

void StorageTier::StoreJob(Call& call, size_t begin, size_t end) {
  const uint64_t item_bytes = backend_->max_item_bytes();
  // Parts 1.. of every page first, then the part 0s of the pages whose other
  // parts are all stored: Exist counts a page by its part 0.
  std::vector<std::vector<std::string>> pages(end - begin);
  std::vector<std::string> bases(end - begin);
  std::vector<StorageItem> rest;
  std::vector<size_t> rest_page;
  std::vector<size_t> rest_part;  // the part of rest[r]
  for (size_t i = begin; i < end; ++i) {
    const std::string& base = bases[i - begin] = secret_.CacheKey(call.ns, call.keys[i]);
    const RecordScope scope{&secret_, call.ns, call.keys[i]};
    absl::StatusOr<std::vector<std::string>> items =
        EncodePage(*call.pool, call.indices[i], call.tag, scope, NewStoreId(), item_bytes);
    if (!items.ok()) {
      call.results[i] = Unavailable(absl::StrCat("reading the page: ", items.status().message()));
      continue;
    }
    pages[i - begin] = *std::move(items);
    for (size_t p = 1; p < pages[i - begin].size(); ++p) {
      rest.push_back({PartKey(base, static_cast<uint32_t>(p)), std::move(pages[i - begin][p])});
      rest_page.push_back(i);
      rest_part.push_back(p);
    }
    call.results[i].outcome = PageOutcome::kStored;
  }
  const std::vector<absl::Status> rest_status = backend_->Set(rest);
  for (size_t r = 0; r < rest.size(); ++r) {
    PageResult& result = call.results[rest_page[r]];
    if (!rest_status[r].ok() && result.outcome == PageOutcome::kStored) {
      // The part, not its cache key: the caller knows the page by its own key.
      result = Unavailable(absl::StrCat("part ", rest_part[r], ": ", rest_status[r].message()));
    }
  }
  std::vector<StorageItem> firsts;
  std::vector<size_t> first_page;
  for (size_t i = begin; i < end; ++i) {
    if (call.results[i].outcome != PageOutcome::kStored) continue;
    firsts.push_back({PartKey(bases[i - begin], 0), std::move(pages[i - begin][0])});
    first_page.push_back(i);
  }
  const std::vector<absl::Status> first_status = backend_->Set(firsts);
  for (size_t f = 0; f < firsts.size(); ++f) {
    if (!first_status[f].ok()) {
      call.results[first_page[f]] =
          Unavailable(absl::StrCat("part 0: ", first_status[f].message()));
    }
  }
}

void StorageTier::FetchJob(Call& call, size_t begin, size_t end) {
  const uint64_t item_bytes = backend_->max_item_bytes();
  // Round 1: every page's part 0, whose header says how many parts follow.
  std::vector<std::string> bases;
  std::vector<std::string> keys;
  for (size_t i = begin; i < end; ++i) {
    bases.push_back(secret_.CacheKey(call.ns, call.keys[i]));
    keys.push_back(PartKey(bases.back(), 0));
  }
  std::vector<FetchedItem> firsts = backend_->Get(keys);
  std::vector<std::vector<std::optional<std::string>>> parts(end - begin);
  std::vector<std::string> more;
  std::vector<std::pair<size_t, uint32_t>> more_at;  // (page in job, part)
  for (size_t j = 0; j < firsts.size(); ++j) {
    if (!firsts[j].found) {
      call.results[begin + j] = {PageOutcome::kMiss,
                                 firsts[j].error.empty() ? "not stored" : firsts[j].error};
      continue;
    }
    parts[j].push_back(std::move(firsts[j].value));
    absl::StatusOr<PartHeader> h = DecodePartHeader(*parts[j][0]);
    // Part 0's header is not yet authenticated: only the count that a page
    // of this pool has in items of this size is believed (so what is asked
    // for is bounded by the pool's page, never by the record); any other
    // is left for CheckPage to refuse, without asking for its parts.
    if (!h.ok() || !PlausibleFirstPart(*h, call.tag, item_bytes)) continue;
    parts[j].resize(h->count);
    for (uint32_t p = 1; p < h->count; ++p) {
      more.push_back(PartKey(bases[j], p));
      more_at.emplace_back(j, p);
    }
  }
  // Round 2: the other parts of multi-part pages.
  std::vector<FetchedItem> rest = backend_->Get(more);
  for (size_t r = 0; r < rest.size(); ++r) {
    if (rest[r].found) parts[more_at[r].first][more_at[r].second] = std::move(rest[r].value);
  }
  for (size_t j = 0; j < parts.size(); ++j) {
    if (parts[j].empty()) continue;  // a miss, set above
    const RecordScope scope{&secret_, call.ns, call.keys[begin + j]};
    PageResult result = CheckPage(call.tag, scope, item_bytes, parts[j]);
    if (result.outcome == PageOutcome::kHit) {
      absl::Status s = WriteCheckedPage(*call.pool, call.indices[begin + j], parts[j]);
      if (!s.ok()) result = Unavailable(absl::StrCat("writing the page: ", s.message()));
    }
    call.results[begin + j] = std::move(result);
    if (call.results[begin + j].unauthenticated) NoteUnauthenticated(call, begin + j);
  }
}

void StorageTier::NoteUnauthenticated(const Call& call, size_t page) {
  const uint64_t n = unauthenticated_.fetch_add(1) + 1;
  // The 1st, 2nd, 4th, 8th ...: a flood of forgeries says so without
  // flooding the log.
  if ((n & (n - 1)) != 0) return;
  spdlog::warn(
      "L3: a record fetched for pool '{}' (keys[{}]) failed its MAC: forged in the cache, or "
      "stored under another --l3-secret-file; treated as a miss ({} so far)",
      call.pool->name(), page, n);
}

void StorageTier::JobDone(const std::shared_ptr<Call>& call) {
  if (call->jobs_left.fetch_sub(1) != 1) return;
  const uint64_t n = call->keys.size();
  if (metrics_ != nullptr) {
    const char* op = OpName(call->op);
    metrics_->l3_seconds->WithLabels({op})->Observe(
        absl::ToDoubleSeconds(absl::Now() - call->start));
    uint64_t good = 0;
    for (const PageResult& r : call->results) {
      metrics_->l3_pages
          ->WithLabels({op, r.unauthenticated ? "unauthenticated" : PageOutcomeName(r.outcome)})
          ->Increment();
      if (r.outcome == PageOutcome::kStored || r.outcome == PageOutcome::kHit) ++good;
    }
    if (call->op == StorageOp::kExist) {
      metrics_->l3_pages->WithLabels({op, "hit"})->Increment(call->prefix);
      if (call->prefix < n) metrics_->l3_pages->WithLabels({op, "miss"})->Increment();
    } else {
      metrics_->l3_bytes->WithLabels({op})->Increment(good * call->tag.page_bytes);
    }
  }
  // The bound is released before `done` runs, so a caller that is told its
  // call finished may start the next one at once.
  Release(*call->pool, n);
  try {
    if (call->op == StorageOp::kExist) {
      call->prefix_done(call->prefix);
    } else {
      call->pages_done(std::move(call->results));
    }
  } catch (const std::exception& e) {
    spdlog::error("L3 {} call of pool '{}': its reply failed: {}", OpName(call->op),
                  call->pool->name(), e.what());
  }
}

}  // namespace kvhost
