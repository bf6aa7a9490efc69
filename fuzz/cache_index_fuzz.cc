// cache_index_fuzz: a sequence of node-cache calls on a CacheIndex (the
// bookkeeping behind kvhost.v1.CacheService: Lookup with or without a pin,
// Unpin, BeginStore then CommitStore or CancelStore, FinishStore ok or
// failed, Evict, ReleaseHolder, EventsSince) with fuzzed key lists: keys
// from a small alphabet (so calls collide), empty keys, keys one byte over
// the bound, repeated keys, lists over the per-call bound, three holders
// with a small per-holder bound, and a small event log. A shadow model holds
// each key's state (published, writing) and every pin and store.
//
// Checked after every call:
//   * a refused call has a documented code (INVALID_ARGUMENT, NOT_FOUND,
//     RESOURCE_EXHAUSTED) and a message, and changed nothing: the stats and
//     the event log are as before (a refused Lookup counts no hit or miss);
//   * Lookup reports each key's state as the model has it, and its prefix;
//   * a store writes exactly the model's absent keys, never a key it found
//     present, and evicts only published, unpinned keys (never one of its
//     own), as many as it lacked free pages;
//   * a cancelled store leaves the stats and the log as they were;
//   * free + published + writing == page_num, pinned and writing match the
//     model, and the event log replayed gives the model's published set.
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "fuzz/fuzz_check.h"
#include "server/cache/cache_index.h"
#include "server/pool/allocator.h"

namespace kvhost::fuzz {
namespace {

constexpr int kMaxOps = 128;
constexpr uint64_t kPages = 8;
constexpr uint64_t kPageSize = 4;

CacheLimits Limits() {
  CacheLimits limits;
  limits.max_key_bytes = 8;
  limits.max_keys_per_call = 6;
  limits.max_held_pages_per_holder = 5;
  limits.max_events = 1 << 20;  // the replay below needs every event
  limits.max_events_per_call = 7;
  return limits;
}

struct Model {
  std::map<std::string, bool> keys;  // key -> published (else writing)
  std::map<std::string, int> pins;   // key -> pins
  std::map<uint64_t, std::pair<std::string, std::vector<std::string>>> pin_ids;
  std::map<uint64_t, std::pair<std::string, std::vector<std::string>>> stores;
};

std::vector<std::string> FuzzKeys(FuzzedDataProvider& in, const CacheLimits& limits) {
  std::vector<std::string> keys;
  const size_t n = in.ConsumeIntegralInRange<size_t>(0, limits.max_keys_per_call + 1);
  for (size_t i = 0; i < n; ++i) {
    switch (in.ConsumeIntegralInRange<int>(0, 9)) {
      case 0:
        keys.emplace_back();  // empty
        break;
      case 1:
        keys.emplace_back(limits.max_key_bytes + 1, 'k');  // one byte too long
        break;
      default:
        keys.push_back(std::string(1, static_cast<char>('a' + in.ConsumeIntegralInRange(0, 11))));
    }
  }
  return keys;
}

bool ValidKeys(const std::vector<std::string>& keys, const CacheLimits& limits) {
  if (keys.empty() || keys.size() > limits.max_keys_per_call) return false;
  std::set<std::string> seen;
  for (const std::string& k : keys) {
    if (k.empty() || k.size() > limits.max_key_bytes || !seen.insert(k).second) return false;
  }
  return true;
}

uint64_t Held(const Model& m, const std::string& holder) {
  uint64_t held = 0;
  for (const auto& [id, pin] : m.pin_ids) held += pin.first == holder ? pin.second.size() : 0;
  for (const auto& [id, store] : m.stores) held += store.first == holder ? store.second.size() : 0;
  return held;
}

std::vector<CacheEvent> AllEvents(const CacheIndex& index) {
  std::vector<CacheEvent> all;
  uint64_t after = 0;
  for (;;) {
    CacheEvents batch = index.EventsSince(after, 1000);
    FUZZ_CHECK(!batch.gap, "the log dropped events after ", after);
    if (batch.events.empty()) return all;
    all.insert(all.end(), batch.events.begin(), batch.events.end());
    after = batch.next_after;
  }
}

bool SameStats(const CacheStats& a, const CacheStats& b) {
  return a.free_pages == b.free_pages && a.published == b.published && a.writing == b.writing &&
         a.pinned == b.pinned && a.hits == b.hits && a.misses == b.misses && a.stored == b.stored &&
         a.skipped == b.skipped && a.evicted == b.evicted && a.aborted == b.aborted;
}

void CheckModel(const CacheIndex& index, const Model& m) {
  const CacheStats s = index.stats();
  uint64_t published = 0, writing = 0, pinned = 0;
  for (const auto& [key, is_published] : m.keys) (is_published ? published : writing)++;
  for (const auto& [key, n] : m.pins) pinned += n > 0 ? 1 : 0;
  FUZZ_CHECK(s.published == published, "published ", s.published, " model ", published);
  FUZZ_CHECK(s.writing == writing, "writing ", s.writing, " model ", writing);
  FUZZ_CHECK(s.pinned == pinned, "pinned ", s.pinned, " model ", pinned);
  FUZZ_CHECK(s.free_pages + s.published + s.writing == s.page_num, "pages not conserved: free ",
             s.free_pages, " published ", s.published, " writing ", s.writing);
  std::set<std::string> replayed;
  for (const CacheEvent& e : AllEvents(index)) {
    if (e.kind == CacheEvent::Kind::kStored) {
      FUZZ_CHECK(replayed.insert(e.key).second, "stored twice without an eviction: ", e.key);
    } else {
      FUZZ_CHECK(replayed.erase(e.key) == 1, "evicted a key not stored: ", e.key);
    }
  }
  for (const auto& [key, is_published] : m.keys) {
    if (is_published) FUZZ_CHECK(replayed.count(key) == 1, "published key not in the log: ", key);
  }
  FUZZ_CHECK(replayed.size() == published, "the log replays to ", replayed.size(), " keys, not ",
             published);
}

void Refused(const absl::Status& s, const CacheIndex& index, const CacheStats& before,
             size_t events_before) {
  FUZZ_CHECK(IsErrorOf(s, {absl::StatusCode::kInvalidArgument, absl::StatusCode::kNotFound,
                           absl::StatusCode::kResourceExhausted}),
             s.ToString());
  FUZZ_CHECK(SameStats(index.stats(), before), "a refused call changed the stats: ", s.ToString());
  FUZZ_CHECK(AllEvents(index).size() == events_before, "a refused call logged events");
}

void DoLookup(FuzzedDataProvider& in, CacheIndex& index, Model& m, const std::string& holder) {
  const std::vector<std::string> keys = FuzzKeys(in, index.limits());
  const bool pin = in.ConsumeBool();
  const CacheStats before = index.stats();
  const size_t events = AllEvents(index).size();
  absl::StatusOr<CacheLookup> found = index.Lookup(keys, pin ? &holder : nullptr);
  size_t prefix = 0;
  if (ValidKeys(keys, index.limits())) {
    while (prefix < keys.size() && m.keys.count(keys[prefix]) && m.keys[keys[prefix]]) ++prefix;
  }
  if (!found.ok()) {
    const bool over =
        pin && prefix > 0 && Held(m, holder) + prefix > index.limits().max_held_pages_per_holder;
    FUZZ_CHECK(!ValidKeys(keys, index.limits()) || over, "refused: ", found.status().ToString());
    Refused(found.status(), index, before, events);
    return;
  }
  FUZZ_CHECK(ValidKeys(keys, index.limits()), "accepted bad keys");
  FUZZ_CHECK(found->prefix == prefix, "prefix ", found->prefix, " model ", prefix);
  for (size_t i = 0; i < keys.size(); ++i) {
    auto it = m.keys.find(keys[i]);
    const CacheKeyState want = it == m.keys.end() ? CacheKeyState::kAbsent
                               : it->second       ? CacheKeyState::kPresent
                                                  : CacheKeyState::kPending;
    FUZZ_CHECK(found->states[i] == want, "key ", keys[i], " state ",
               static_cast<int>(found->states[i]), " model ", static_cast<int>(want));
  }
  if (found->pin_id != 0) {
    const std::vector<std::string> pinned(keys.begin(), keys.begin() + prefix);
    for (const std::string& k : pinned) ++m.pins[k];
    m.pin_ids[found->pin_id] = {holder, pinned};
  }
}

void DoStore(FuzzedDataProvider& in, CacheIndex& index, Model& m, const std::string& holder) {
  const std::vector<std::string> keys = FuzzKeys(in, index.limits());
  const CacheStats before = index.stats();
  const size_t events = AllEvents(index).size();
  absl::StatusOr<CacheStorePlan> plan = index.BeginStore(keys, holder);
  if (!plan.ok()) {
    if (ValidKeys(keys, index.limits())) {
      // Refused for room: the holder's bound, or too few free and evictable
      // pages (published, unpinned, not this call's).
      uint64_t want = 0, evictable = 0;
      for (const std::string& k : keys) want += m.keys.count(k) == 0 ? 1 : 0;
      for (const auto& [k, published] : m.keys) {
        const bool own = std::find(keys.begin(), keys.end(), k) != keys.end();
        evictable += published && m.pins[k] == 0 && !own ? 1 : 0;
      }
      const bool held = Held(m, holder) + want > index.limits().max_held_pages_per_holder;
      FUZZ_CHECK(held || want > before.free_pages + evictable,
                 "store refused with room: ", plan.status().ToString());
    }
    Refused(plan.status(), index, before, events);
    return;
  }
  FUZZ_CHECK(ValidKeys(keys, index.limits()), "accepted bad keys");
  std::vector<std::string> written;
  for (size_t i = 0; i < keys.size(); ++i) {
    const bool absent = m.keys.count(keys[i]) == 0;
    FUZZ_CHECK(absent == (plan->states[i] == CacheKeyState::kAbsent), "key ", keys[i],
               " absent in model ", absent);
    if (absent) written.push_back(keys[i]);
  }
  FUZZ_CHECK(plan->written.size() == written.size(), "wrote ", plan->written.size(), " model ",
             written.size());
  if (plan->store_id == 0) return;
  const uint64_t lacked =
      written.size() > before.free_pages ? written.size() - before.free_pages : 0;
  FUZZ_CHECK(plan->evicted == lacked, "evicted ", plan->evicted, " but lacked ", lacked);
  if (in.ConsumeBool()) {
    FUZZ_CHECK(index.CancelStore(plan->store_id, holder).ok(), "cancel");
    FUZZ_CHECK(SameStats(index.stats(), before), "a cancelled store changed the stats");
    FUZZ_CHECK(AllEvents(index).size() == events, "a cancelled store logged events");
    return;
  }
  FUZZ_CHECK(index.CommitStore(plan->store_id, holder).ok(), "commit");
  // The victims: published keys, unpinned, none of this call's.
  const std::vector<CacheEvent> all = AllEvents(index);
  FUZZ_CHECK(all.size() == events + lacked, "commit logged ", all.size() - events, " events");
  for (size_t e = events; e < all.size(); ++e) {
    const std::string& victim = all[e].key;
    FUZZ_CHECK(all[e].kind == CacheEvent::Kind::kEvicted, "commit logged a store");
    FUZZ_CHECK(m.keys.count(victim) && m.keys[victim], "evicted a key not published: ", victim);
    FUZZ_CHECK(m.pins[victim] == 0, "evicted a pinned key: ", victim);
    FUZZ_CHECK(std::find(keys.begin(), keys.end(), victim) == keys.end(),
               "a store evicted its own key ", victim);
    m.keys.erase(victim);
  }
  for (const std::string& k : written) m.keys[k] = false;
  m.stores[plan->store_id] = {holder, written};
}

void DoFinish(FuzzedDataProvider& in, CacheIndex& index, Model& m) {
  if (m.stores.empty()) return;
  auto it = m.stores.begin();
  std::advance(it, in.ConsumeIntegralInRange<size_t>(0, m.stores.size() - 1));
  const bool ok = in.ConsumeBool();
  FUZZ_CHECK(index.FinishStore(it->first, it->second.first, ok).ok(), "finish");
  for (const std::string& k : it->second.second) {
    if (ok) {
      m.keys[k] = true;
    } else {
      m.keys.erase(k);
    }
  }
  m.stores.erase(it);
}

void DoUnpin(FuzzedDataProvider& in, CacheIndex& index, Model& m, const std::string& holder) {
  const CacheStats before = index.stats();
  const size_t events = AllEvents(index).size();
  const uint64_t id =
      m.pin_ids.empty() || in.ConsumeBool()
          ? in.ConsumeIntegral<uint64_t>()
          : std::next(m.pin_ids.begin(), in.ConsumeIntegralInRange<size_t>(0, m.pin_ids.size() - 1))
                ->first;
  const absl::Status s = index.Unpin(id, holder);
  auto it = m.pin_ids.find(id);
  if (it == m.pin_ids.end() || it->second.first != holder) {
    FUZZ_CHECK(!s.ok(), "unpinned pin ", id, " of another holder or none");
    Refused(s, index, before, events);
    return;
  }
  FUZZ_CHECK(s.ok(), s.ToString());
  for (const std::string& k : it->second.second) --m.pins[k];
  m.pin_ids.erase(it);
}

void DoEvict(FuzzedDataProvider& in, CacheIndex& index, Model& m) {
  const std::vector<std::string> keys = FuzzKeys(in, index.limits());
  const CacheStats before = index.stats();
  const size_t events = AllEvents(index).size();
  absl::StatusOr<std::vector<CacheEvictOutcome>> out = index.Evict(keys);
  if (!out.ok()) {
    FUZZ_CHECK(!ValidKeys(keys, index.limits()), out.status().ToString());
    Refused(out.status(), index, before, events);
    return;
  }
  for (size_t i = 0; i < keys.size(); ++i) {
    auto it = m.keys.find(keys[i]);
    const CacheEvictOutcome want = it == m.keys.end() ? CacheEvictOutcome::kAbsent
                                   : (it->second && m.pins[keys[i]] == 0)
                                       ? CacheEvictOutcome::kEvicted
                                       : CacheEvictOutcome::kBusy;
    FUZZ_CHECK((*out)[i] == want, "evict ", keys[i], ": ", static_cast<int>((*out)[i]), " model ",
               static_cast<int>(want));
    if (want == CacheEvictOutcome::kEvicted) m.keys.erase(it);
  }
}

void DoRelease(CacheIndex& index, Model& m, const std::string& holder) {
  index.ReleaseHolder(holder);
  for (auto it = m.pin_ids.begin(); it != m.pin_ids.end();) {
    if (it->second.first != holder) {
      ++it;
      continue;
    }
    for (const std::string& k : it->second.second) --m.pins[k];
    it = m.pin_ids.erase(it);
  }
  for (auto it = m.stores.begin(); it != m.stores.end();) {
    if (it->second.first != holder) {
      ++it;
      continue;
    }
    for (const std::string& k : it->second.second) m.keys.erase(k);
    it = m.stores.erase(it);
  }
}

}  // namespace
}  // namespace kvhost::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvhost::fuzz;  // NOLINT(google-build-using-namespace)
  FuzzedDataProvider in(data, size);
  kvhost::PageAllocator pages(kPages, kPageSize);
  kvhost::CacheIndex index(&pages, Limits());
  Model m;
  const std::string holders[] = {"h0", "h1", "h2"};
  for (int op = 0; op < kMaxOps && in.remaining_bytes() > 0; ++op) {
    const std::string& holder = holders[in.ConsumeIntegralInRange(0, 2)];
    switch (in.ConsumeIntegralInRange(0, 6)) {
      case 0:
        DoLookup(in, index, m, holder);
        break;
      case 1:
        DoStore(in, index, m, holder);
        break;
      case 2:
        DoFinish(in, index, m);
        break;
      case 3:
        DoUnpin(in, index, m, holder);
        break;
      case 4:
        DoEvict(in, index, m);
        break;
      case 5:
        DoRelease(index, m, holder);
        break;
      default: {
        const kvhost::CacheEvents e = index.EventsSince(in.ConsumeIntegral<uint64_t>(),
                                                        in.ConsumeIntegralInRange<size_t>(0, 20));
        FUZZ_CHECK(e.events.size() <= Limits().max_events_per_call, "a read over its bound");
      }
    }
    CheckModel(index, m);
  }
  return 0;
}
