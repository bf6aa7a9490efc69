#include "server/cache/cache_index.h"

#include <algorithm>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"

namespace kvhost {

CacheIndex::CacheIndex(PageAllocator* pages, CacheLimits limits) : pages_(pages), limits_(limits) {}

absl::Status CacheIndex::CheckKeys(absl::Span<const std::string> keys) const {
  if (keys.empty()) return absl::InvalidArgumentError("no keys");
  if (keys.size() > limits_.max_keys_per_call) {
    return absl::InvalidArgumentError(absl::StrCat(keys.size(), " keys, over the limit of ",
                                                   limits_.max_keys_per_call, " a call"));
  }
  absl::flat_hash_set<absl::string_view> seen;
  seen.reserve(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    if (keys[i].empty()) return absl::InvalidArgumentError(absl::StrCat("key ", i, " is empty"));
    if (keys[i].size() > limits_.max_key_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "key ", i, " has ", keys[i].size(), " bytes, over the limit of ", limits_.max_key_bytes));
    }
    if (!seen.insert(keys[i]).second) {
      return absl::InvalidArgumentError(absl::StrCat("key ", i, " repeats an earlier key"));
    }
  }
  return absl::OkStatus();
}

absl::Status CacheIndex::CheckHeld(const std::string& holder, uint64_t more) const {
  auto it = held_.find(holder);
  const uint64_t now = it == held_.end() ? 0 : it->second;
  if (more > limits_.max_held_pages_per_holder - std::min(now, limits_.max_held_pages_per_holder)) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the session holds ", now, " cache pages pinned or being written; ", more,
                     " more would pass its limit of ", limits_.max_held_pages_per_holder));
  }
  return absl::OkStatus();
}

void CacheIndex::MakeEvictable(const std::string* key, Entry* entry) {
  if (entry->in_lru) return;
  entry->lru = lru_.insert(lru_.end(), key);
  entry->in_lru = true;
}

void CacheIndex::MakeUnevictable(Entry* entry) {
  if (!entry->in_lru) return;
  lru_.erase(entry->lru);
  entry->in_lru = false;
}

void CacheIndex::FreePage(uint64_t page) {
  // The index allocated it and frees it once: FreePages cannot fail here.
  absl::Status s = pages_->FreePages(absl::MakeConstSpan(&page, 1));
  (void)s;
}

void CacheIndex::Log(CacheEvent::Kind kind, const std::string& key) {
  events_.push_back(CacheEvent{++last_seq_, kind, key});
  while (events_.size() > limits_.max_events) events_.pop_front();
}

void CacheIndex::EvictEntry(Entries::iterator it) {
  MakeUnevictable(&it->second);
  FreePage(it->second.page);
  Log(CacheEvent::Kind::kEvicted, it->first);
  ++counters_.evicted;
  --counters_.published;
  entries_.erase(it);
}

void CacheIndex::DropWriting(const std::string* key) {
  auto it = entries_.find(*key);
  FreePage(it->second.page);
  ++counters_.aborted;
  --counters_.writing;
  entries_.erase(it);
}

void CacheIndex::Publish(const std::string* key) {
  Entry& entry = entries_.find(*key)->second;
  entry.state = EntryState::kPublished;
  if (entry.pins == 0) MakeEvictable(key, &entry);
  Log(CacheEvent::Kind::kStored, *key);
  ++counters_.stored;
  --counters_.writing;
  ++counters_.published;
}

absl::StatusOr<CacheLookup> CacheIndex::Lookup(absl::Span<const std::string> keys,
                                               const std::string* pin_holder, bool count) {
  if (absl::Status s = CheckKeys(keys); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  CacheLookup out;
  out.states.reserve(keys.size());
  bool in_prefix = true;
  for (const std::string& key : keys) {
    auto it = entries_.find(key);
    CacheKeyState state = CacheKeyState::kAbsent;
    if (it != entries_.end() && it->second.state != EntryState::kEvicting) {
      state = it->second.state == EntryState::kPublished ? CacheKeyState::kPresent
                                                         : CacheKeyState::kPending;
    }
    in_prefix = in_prefix && state == CacheKeyState::kPresent;
    if (in_prefix) out.pages.push_back(it->second.page);
    out.states.push_back(state);
  }
  out.prefix = out.pages.size();
  if (pin_holder != nullptr && out.prefix > 0) {
    if (absl::Status s = CheckHeld(*pin_holder, out.prefix); !s.ok()) return s;
    Pin pin{*pin_holder, {}};
    pin.keys.reserve(out.prefix);
    for (size_t i = 0; i < out.prefix; ++i) {
      auto it = entries_.find(keys[i]);
      MakeUnevictable(&it->second);
      if (it->second.pins++ == 0) ++counters_.pinned;
      pin.keys.push_back(&it->first);
    }
    held_[*pin_holder] += out.prefix;
    out.pin_id = next_id_++;
    pins_.emplace(out.pin_id, std::move(pin));
  }
  if (!count) return out;
  // Used now: the prefix (pinned or not) goes to the recently used end.
  for (size_t i = 0; i < out.prefix; ++i) {
    auto it = entries_.find(keys[i]);
    if (it->second.in_lru) lru_.splice(lru_.end(), lru_, it->second.lru);
  }
  counters_.hits += std::count(out.states.begin(), out.states.end(), CacheKeyState::kPresent);
  counters_.misses +=
      keys.size() - std::count(out.states.begin(), out.states.end(), CacheKeyState::kPresent);
  return out;
}

void CacheIndex::CountUse(absl::Span<const std::string> keys) {
  absl::MutexLock lock(&mu_);
  for (const std::string& key : keys) {
    auto it = entries_.find(key);
    if (it == entries_.end() || it->second.state != EntryState::kPublished) continue;
    if (it->second.in_lru) lru_.splice(lru_.end(), lru_, it->second.lru);
    ++counters_.hits;
  }
}

void CacheIndex::Release(const Pin& pin) {
  for (const std::string* key : pin.keys) {
    Entry& entry = entries_.find(*key)->second;
    if (--entry.pins > 0) continue;
    --counters_.pinned;
    if (entry.state == EntryState::kPublished) MakeEvictable(key, &entry);
  }
  auto held = held_.find(pin.holder);
  held->second -= pin.keys.size();
  if (held->second == 0) held_.erase(held);
}

absl::Status CacheIndex::Unpin(uint64_t pin_id, const std::string& holder) {
  absl::MutexLock lock(&mu_);
  auto it = pins_.find(pin_id);
  if (it == pins_.end() || it->second.holder != holder) {
    return absl::NotFoundError(absl::StrCat("no pin ", pin_id, " of this session"));
  }
  Release(it->second);
  pins_.erase(it);
  return absl::OkStatus();
}

absl::StatusOr<CacheStorePlan> CacheIndex::BeginStore(absl::Span<const std::string> keys,
                                                      const std::string& holder) {
  if (absl::Status s = CheckKeys(keys); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  CacheStorePlan plan;
  plan.states.reserve(keys.size());
  // This call's keys found present: skipped, so never its own victims.
  absl::flat_hash_set<const std::string*> own;
  for (size_t i = 0; i < keys.size(); ++i) {
    auto it = entries_.find(keys[i]);
    CacheKeyState state = CacheKeyState::kAbsent;
    if (it != entries_.end()) {
      // Another store's victim is left to that store: pending, like a key
      // being written.
      state = it->second.state == EntryState::kPublished ? CacheKeyState::kPresent
                                                         : CacheKeyState::kPending;
      if (it->second.in_lru) own.insert(&it->first);
    }
    if (state == CacheKeyState::kAbsent) plan.written.push_back(i);
    plan.states.push_back(state);
  }
  const uint64_t want = plan.written.size();
  if (want == 0) {
    counters_.skipped += keys.size();
    return plan;
  }
  if (absl::Status s = CheckHeld(holder, want); !s.ok()) return s;
  const uint64_t free = pages_->free_pages();
  const uint64_t evictable = lru_.size() - own.size();
  const uint64_t victims = want > free ? want - free : 0;
  if (victims > evictable) {
    return absl::ResourceExhaustedError(absl::StrCat(
        want, " cache pages wanted, but only ", free, " are free and ", evictable, " evictable (",
        entries_.size() - lru_.size(), " are pinned or being written) of ", pages_->page_num()));
  }
  Store store{holder, {}, {}, keys.size() - want, false};
  if (want > victims) {
    if (absl::Status s = pages_->Alloc((want - victims) * pages_->page_size(), &plan.pages);
        !s.ok()) {
      return s;  // cannot happen: the pages were counted free above, under this lock
    }
  }
  // Least recently used first, only as many as the store lacks: read as
  // absent from now on, evicted at CommitStore.
  for (auto it = lru_.begin(); store.victims.size() < victims;) {
    const std::string* key = *it++;
    if (own.contains(key)) continue;
    Entry& entry = entries_.find(*key)->second;
    MakeUnevictable(&entry);
    entry.state = EntryState::kEvicting;
    store.victims.push_back(key);
    plan.pages.push_back(entry.page);
  }
  plan.evicted = victims;
  store.keys.reserve(want);
  for (size_t j = 0; j < want; ++j) {
    auto [it, inserted] = entries_.try_emplace(keys[plan.written[j]]);
    it->second.page = plan.pages[j];
    store.keys.push_back(&it->first);
  }
  counters_.writing += want;
  held_[holder] += want;
  counters_.skipped += store.skipped;
  plan.store_id = next_id_++;
  stores_.emplace(plan.store_id, std::move(store));
  return plan;
}

absl::flat_hash_map<uint64_t, CacheIndex::Store>::iterator CacheIndex::FindStore(
    uint64_t store_id, const std::string& holder, bool committed) {
  auto it = stores_.find(store_id);
  if (it == stores_.end() || it->second.holder != holder || it->second.committed != committed) {
    return stores_.end();
  }
  return it;
}

absl::Status CacheIndex::CommitStore(uint64_t store_id, const std::string& holder) {
  absl::MutexLock lock(&mu_);
  auto it = FindStore(store_id, holder, /*committed=*/false);
  if (it == stores_.end()) {
    return absl::NotFoundError(absl::StrCat("no uncommitted store ", store_id, " of this session"));
  }
  for (const std::string* key : it->second.victims) {
    // Its page is the store's now: not freed.
    auto victim = entries_.find(*key);
    Log(CacheEvent::Kind::kEvicted, victim->first);
    ++counters_.evicted;
    --counters_.published;
    entries_.erase(victim);
  }
  it->second.victims.clear();
  it->second.committed = true;
  return absl::OkStatus();
}

void CacheIndex::Undo(const Store& store) {
  // The last victims.size() keys took the victims' pages; the others'
  // pages came from the allocator.
  const size_t from_allocator = store.keys.size() - store.victims.size();
  for (size_t j = 0; j < store.keys.size(); ++j) {
    auto it = entries_.find(*store.keys[j]);
    if (j < from_allocator) FreePage(it->second.page);
    entries_.erase(it);
  }
  // Back as the least recently used, in their order.
  for (auto v = store.victims.rbegin(); v != store.victims.rend(); ++v) {
    Entry& entry = entries_.find(**v)->second;
    entry.state = EntryState::kPublished;
    entry.lru = lru_.insert(lru_.begin(), *v);
    entry.in_lru = true;
  }
  counters_.writing -= store.keys.size();
  counters_.skipped -= store.skipped;
  auto held = held_.find(store.holder);
  held->second -= store.keys.size();
  if (held->second == 0) held_.erase(held);
}

absl::Status CacheIndex::CancelStore(uint64_t store_id, const std::string& holder) {
  absl::MutexLock lock(&mu_);
  auto it = FindStore(store_id, holder, /*committed=*/false);
  if (it == stores_.end()) {
    return absl::NotFoundError(absl::StrCat("no uncommitted store ", store_id, " of this session"));
  }
  Undo(it->second);
  stores_.erase(it);
  return absl::OkStatus();
}

absl::Status CacheIndex::FinishStore(uint64_t store_id, const std::string& holder, bool ok) {
  absl::MutexLock lock(&mu_);
  auto it = FindStore(store_id, holder, /*committed=*/true);
  if (it == stores_.end()) {
    return absl::NotFoundError(absl::StrCat("no committed store ", store_id, " of this session"));
  }
  for (const std::string* key : it->second.keys) {
    if (ok) {
      Publish(key);
    } else {
      DropWriting(key);
    }
  }
  auto held = held_.find(holder);
  held->second -= it->second.keys.size();
  if (held->second == 0) held_.erase(held);
  stores_.erase(it);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<CacheEvictOutcome>> CacheIndex::Evict(
    absl::Span<const std::string> keys) {
  if (absl::Status s = CheckKeys(keys); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  std::vector<CacheEvictOutcome> out;
  out.reserve(keys.size());
  for (const std::string& key : keys) {
    auto it = entries_.find(key);
    if (it == entries_.end()) {
      out.push_back(CacheEvictOutcome::kAbsent);
    } else if (!it->second.in_lru) {
      out.push_back(CacheEvictOutcome::kBusy);
    } else {
      EvictEntry(it);
      out.push_back(CacheEvictOutcome::kEvicted);
    }
  }
  return out;
}

void CacheIndex::ReleaseHolder(const std::string& holder) {
  absl::MutexLock lock(&mu_);
  for (auto it = pins_.begin(); it != pins_.end();) {
    if (it->second.holder == holder) {
      Release(it->second);
      pins_.erase(it++);
    } else {
      ++it;
    }
  }
  for (auto it = stores_.begin(); it != stores_.end();) {
    if (it->second.holder == holder) {
      if (it->second.committed) {
        for (const std::string* key : it->second.keys) DropWriting(key);
      } else {
        Undo(it->second);
      }
      stores_.erase(it++);
    } else {
      ++it;
    }
  }
  held_.erase(holder);
}

CacheEvents CacheIndex::EventsSince(uint64_t after_seq, size_t max) const {
  absl::MutexLock lock(&mu_);
  CacheEvents out;
  out.next_after = after_seq;
  if (after_seq > last_seq_) {
    // A sequence number this index never gave (the daemon restarted): the
    // reader resynchronises and resumes from now.
    out.gap = true;
    out.next_after = last_seq_;
    return out;
  }
  if (events_.empty() || after_seq == last_seq_) return out;
  const uint64_t first = events_.front().seq;
  out.gap = after_seq + 1 < first;
  size_t skip = after_seq < first ? 0 : after_seq + 1 - first;
  const size_t take = std::min({max, limits_.max_events_per_call, events_.size() - skip});
  out.events.assign(events_.begin() + skip, events_.begin() + skip + take);
  out.next_after = take > 0 ? out.events.back().seq : after_seq;
  return out;
}

CacheStats CacheIndex::stats() const {
  absl::MutexLock lock(&mu_);
  CacheStats out = counters_;
  out.page_num = pages_->page_num();
  out.free_pages = pages_->free_pages();
  return out;
}

}  // namespace kvhost
