#include "server/cache/node_cache.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"

namespace kvhost {

NodeCache::NodeCache(std::shared_ptr<Pool> pool, TransferManager* transfers, CacheLimits limits)
    : pool_(std::move(pool)), transfers_(transfers), index_(&pool_->allocator(), limits) {}

std::shared_ptr<NodeCache> NodeCache::Create(std::shared_ptr<Pool> pool, TransferManager* transfers,
                                             CacheLimits limits) {
  return std::shared_ptr<NodeCache>(new NodeCache(std::move(pool), transfers, limits));
}

absl::StatusOr<std::string> NodeCache::Holder(const Caller& caller) const {
  for (const std::string& session : caller.sessions) {
    if (transfers_->IsSessionOpen(session)) return session;
  }
  return absl::FailedPreconditionError(
      absl::StrCat("cache '", name(), "': the call names no open session (", caller.sessions.size(),
                   " named): cache calls are made within a worker session, whose end releases "
                   "what they hold"));
}

absl::Status NodeCache::CheckTarget(const Caller& caller, const std::string& attachment_id,
                                    size_t keys, absl::Span<const int64_t> device) const {
  if (device.size() != keys * pool_->page_size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cache '", name(), "': ", device.size(), " device rows for ", keys, " keys; want ",
        keys * pool_->page_size(), " (", pool_->page_size(), " rows, one page, per key)"));
  }
  absl::StatusOr<std::shared_ptr<Pool>> pool = transfers_->FindAttachedPool(caller, attachment_id);
  if (!pool.ok()) return pool.status();
  if (pool->get() != pool_.get()) {
    return absl::InvalidArgumentError(absl::StrCat("cache '", name(),
                                                   "': the attachment is of pool '",
                                                   (*pool)->name(), "', not of the cache's pool"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> NodeCache::OpenMove(const Caller& caller,
                                                const std::string& attachment_id,
                                                absl::Span<const std::string> keys,
                                                absl::Span<const int64_t> device) const {
  absl::StatusOr<std::string> holder = Holder(caller);
  if (!holder.ok()) return holder.status();
  if (absl::Status s = index_.CheckKeys(keys); !s.ok()) return s;
  if (absl::Status s = CheckTarget(caller, attachment_id, keys.size(), device); !s.ok()) return s;
  return holder;
}

std::vector<int64_t> NodeCache::Slots(absl::Span<const uint64_t> pages) const {
  const uint64_t ps = pool_->page_size();
  std::vector<int64_t> slots;
  slots.reserve(pages.size() * ps);
  for (uint64_t page : pages) {
    for (uint64_t t = 0; t < ps; ++t) slots.push_back(static_cast<int64_t>(page * ps + t));
  }
  return slots;
}

std::vector<int64_t> NodeCache::FirstSlots(absl::Span<const uint64_t> pages) const {
  std::vector<int64_t> slots;
  slots.reserve(pages.size());
  for (uint64_t page : pages) slots.push_back(static_cast<int64_t>(page * pool_->page_size()));
  return slots;
}

absl::StatusOr<CacheLookup> NodeCache::Lookup(const Caller& caller,
                                              absl::Span<const std::string> keys, bool pin) {
  if (!pin) return index_.Lookup(keys, nullptr);
  absl::StatusOr<std::string> holder = Holder(caller);
  if (!holder.ok()) return holder.status();
  absl::StatusOr<CacheLookup> found = index_.Lookup(keys, &*holder);
  if (!found.ok() || found->pin_id == 0) return found;
  {
    absl::MutexLock lock(&mu_);
    loose_pins_.emplace(found->pin_id, *holder);
  }
  // The session may have ended since Holder asked: then nothing releases the
  // pin later, so release it now.
  if (!transfers_->IsSessionOpen(*holder)) {
    SessionEnded(*holder);
    return absl::FailedPreconditionError(
        absl::StrCat("cache '", name(), "': session ended during the call"));
  }
  return found;
}

absl::Status NodeCache::ReleasePin(const Caller& caller, uint64_t pin_id) {
  absl::StatusOr<std::string> holder = Holder(caller);
  if (!holder.ok()) return holder.status();
  {
    absl::MutexLock lock(&mu_);
    auto it = loose_pins_.find(pin_id);
    if (it == loose_pins_.end() || it->second != *holder) {
      return absl::NotFoundError(
          absl::StrCat("cache '", name(), "': no pin ", pin_id, " of this session"));
    }
    loose_pins_.erase(it);
  }
  return index_.Unpin(pin_id, *holder);
}

absl::StatusOr<NodeCache::Stored> NodeCache::Store(const Caller& caller,
                                                   const std::string& attachment_id,
                                                   absl::Span<const std::string> keys,
                                                   absl::Span<const int64_t> device,
                                                   const std::string& ready_fence,
                                                   const CacheL3* write_through) {
  absl::StatusOr<std::string> holder = OpenMove(caller, attachment_id, keys, device);
  if (!holder.ok()) return holder.status();
  return StoreWith(*holder, keys, device, write_through,
                   [&](std::vector<int64_t> slots, std::vector<int64_t> rows) {
                     return transfers_->Submit(caller, attachment_id, Direction::kBackup, slots,
                                               rows, ready_fence);
                   });
}

absl::StatusOr<NodeCache::Stored> NodeCache::StoreFromPool(const Caller& caller,
                                                           const PoolSlots& source,
                                                           absl::Span<const std::string> keys,
                                                           const CacheL3* write_through) {
  // Held from before its slots are checked: no claim frees them meanwhile.
  std::shared_ptr<void> use = source.pool->UseSlots();
  absl::StatusOr<std::string> holder = OpenPoolMove(caller, source, keys, *pool_);
  if (!holder.ok()) return holder.status();
  return StoreWith(*holder, keys, source.slots, write_through,
                   [&](std::vector<int64_t> slots, std::vector<int64_t> rows) {
                     PoolCopyJob job;
                     job.from = source.pool;
                     job.from_use = use;
                     job.to = pool_;
                     job.from_slots = std::move(rows);
                     job.to_slots = std::move(slots);
                     return transfers_->SubmitPoolCopy(*holder, Direction::kBackup, std::move(job));
                   });
}

absl::StatusOr<std::string> NodeCache::OpenPoolMove(const Caller& caller, const PoolSlots& pool,
                                                    absl::Span<const std::string> keys,
                                                    Pool& written) const {
  absl::StatusOr<std::string> holder = Holder(caller);
  if (!holder.ok()) return holder.status();
  if (absl::Status s = index_.CheckKeys(keys); !s.ok()) return s;
  if (pool.pool.get() == pool_.get() || pool.pool->allocator_owner() == pool_.get()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cache '", name(), "': pool '", pool.pool->name(),
        "' is the cache's own pool (or follows it); name an index-addressed pool of its shape"));
  }
  if (absl::Status s = CheckPoolCopyShape(*pool.pool, *pool_); !s.ok()) return s;
  if (pool.slots.size() != keys.size() * pool_->page_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("cache '", name(), "': pool.host_indices has ", pool.slots.size(),
                     " slots for ", keys.size(), " keys; want ", keys.size() * pool_->page_size(),
                     " (", pool_->page_size(), " slots, one page, per key)"));
  }
  if (absl::Status s = CheckPoolCopySlots(*pool.pool, pool.slots, "pool.host_indices"); !s.ok()) {
    return s;
  }
  // The copy writes `written`: refused where a Backup into it would be.
  if (absl::Status s = written.ChangeAllocation(
          caller.sessions, [this](const std::string& id) { return transfers_->IsSessionOpen(id); },
          &written == pool_.get() ? "CacheStore" : "CacheRestore", [] { return absl::OkStatus(); });
      !s.ok()) {
    return s;
  }
  return holder;
}

absl::StatusOr<NodeCache::Stored> NodeCache::StoreWith(const std::string& holder,
                                                       absl::Span<const std::string> keys,
                                                       absl::Span<const int64_t> rows_in,
                                                       const CacheL3* write_through,
                                                       const SubmitCopy& submit) {
  Stored out;
  absl::StatusOr<CacheStorePlan> plan = index_.BeginStore(keys, holder);
  if (!plan.ok()) return plan.status();
  out.plan = *std::move(plan);
  if (out.plan.store_id == 0) return out;  // every key present or being written
  const uint64_t store_id = out.plan.store_id;
  {
    InFlightStore in_flight{holder, false, std::nullopt, {}};
    if (write_through != nullptr) {
      in_flight.write_through = *write_through;
      for (size_t key : out.plan.written) in_flight.keys.push_back(keys[key]);
    }
    absl::MutexLock lock(&mu_);
    stores_.emplace(store_id, std::move(in_flight));
  }
  const uint64_t ps = pool_->page_size();
  std::vector<int64_t> rows;
  rows.reserve(out.plan.written.size() * ps);
  for (size_t key : out.plan.written) {
    rows.insert(rows.end(), rows_in.begin() + key * ps, rows_in.begin() + (key + 1) * ps);
  }
  absl::StatusOr<std::shared_ptr<Ticket>> ticket = submit(Slots(out.plan.pages), std::move(rows));
  if (!ticket.ok()) {
    // Refused (bad rows, a fence this backend cannot wait on, no event set
    // free): the cache is as before the call, its victims published again.
    {
      absl::MutexLock lock(&mu_);
      stores_.erase(store_id);
    }
    (void)index_.CancelStore(store_id, holder);
    return ticket.status();
  }
  // Submitted: the victims' pages are being written now.
  (void)index_.CommitStore(store_id, holder);
  out.ticket = *ticket;
  // Published before a waiter sees the ticket done; a ticket that finished
  // already (its copies were quick) publishes as soon as its end is known.
  if (!out.ticket->BeforeDone([self = shared_from_this(), store_id](const absl::Status& end) {
        self->StoreEnded(store_id, end);
      })) {
    out.ticket->OnDone([self = shared_from_this(), store_id, t = out.ticket.get()] {
      self->StoreEnded(store_id, t->Snapshot().status);
    });
  }
  // As in Lookup: a session that ended meanwhile abandons the store.
  if (!transfers_->IsSessionOpen(holder)) SessionEnded(holder);
  return out;
}

void NodeCache::StoreEnded(uint64_t store_id, const absl::Status& status) {
  InFlightStore store;
  bool publish = status.ok();
  {
    absl::MutexLock lock(&mu_);
    auto it = stores_.find(store_id);
    if (it == stores_.end()) return;
    store = std::move(it->second);
    publish = publish && !store.abandoned;
    stores_.erase(it);
  }
  // The store is this cache's and still open: FinishStore cannot fail.
  absl::Status s = index_.FinishStore(store_id, store.holder, publish);
  if (s.ok() && publish && store.write_through.has_value()) {
    WriteThrough(*store.write_through, std::move(store.keys));
  }
}

std::string NodeCache::L3Holder(const char* what) {
  return absl::StrCat("kvhostd/l3-", what, "/", next_l3_call_.fetch_add(1));
}

void NodeCache::WriteThrough(const CacheL3& l3, std::vector<std::string> keys) {
  std::shared_ptr<StorageTier> tier = l3.tier.lock();
  if (tier == nullptr || keys.empty()) return;
  const std::string holder = L3Holder("write");
  // Pinned while the tier reads them; a key evicted since its publish (and
  // the keys after it) is not written.
  absl::StatusOr<CacheLookup> found = index_.Lookup(keys, &holder, /*count=*/false);
  if (!found.ok() || found->pin_id == 0) return;
  keys.resize(found->prefix);
  const uint64_t pin_id = found->pin_id;
  absl::Status accepted =
      tier->Store(pool_, l3.ns, FirstSlots(found->pages), std::move(keys),
                  [self = shared_from_this(), pin_id, holder](std::vector<PageResult> results) {
                    uint64_t stored = 0;
                    for (const PageResult& r : results)
                      stored += r.outcome == PageOutcome::kStored ? 1 : 0;
                    self->l3_written_.fetch_add(stored);
                    (void)self->index_.Unpin(pin_id, holder);
                  });
  if (!accepted.ok()) {
    (void)index_.Unpin(pin_id, holder);
    spdlog::warn("cache '{}': L3 write-through of {} key(s) refused: {}", name(), found->prefix,
                 std::string(accepted.message()));
  }
}

// One FetchMissing call: its holder and its stores (one a key), and the
// tier's results if they came before the stores were committed.
struct NodeCache::L3Fetch {
  std::string holder;
  std::vector<uint64_t> stores;
  absl::Mutex mu;
  bool committed ABSL_GUARDED_BY(mu) = false;
  std::optional<std::vector<PageResult>> early ABSL_GUARDED_BY(mu);
};

absl::StatusOr<std::vector<size_t>> NodeCache::FetchMissing(const CacheL3& l3,
                                                            absl::Span<const std::string> keys) {
  std::shared_ptr<StorageTier> tier = l3.tier.lock();
  if (tier == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("cache '", name(), "': the L3 tier is gone (kvhostd is stopping)"));
  }
  if (absl::Status s = index_.CheckKeys(keys); !s.ok()) return s;
  auto fetch = std::make_shared<L3Fetch>();
  fetch->holder = L3Holder("fetch");
  std::vector<size_t> fetched;
  std::vector<std::string> names;
  std::vector<uint64_t> pages;
  const auto cancel = [&] {
    for (auto it = fetch->stores.rbegin(); it != fetch->stores.rend(); ++it) {
      (void)index_.CancelStore(*it, fetch->holder);
    }
  };
  // One store a key, so that each publishes or drops on its own.
  for (size_t i = 0; i < keys.size(); ++i) {
    absl::StatusOr<CacheStorePlan> plan = index_.BeginStore(keys.subspan(i, 1), fetch->holder);
    if (!plan.ok()) {
      cancel();
      return plan.status();
    }
    if (plan->store_id == 0) continue;  // present, or another store writes it
    fetch->stores.push_back(plan->store_id);
    fetched.push_back(i);
    names.push_back(keys[i]);
    pages.push_back(plan->pages[0]);
  }
  if (fetched.empty()) return fetched;
  absl::Status accepted =
      tier->Fetch(pool_, l3.ns, std::move(names), FirstSlots(pages),
                  [self = shared_from_this(), fetch](std::vector<PageResult> results) {
                    {
                      absl::MutexLock lock(&fetch->mu);
                      if (!fetch->committed) {
                        fetch->early = std::move(results);
                        return;
                      }
                    }
                    self->FetchEnded(*fetch, results);
                  });
  if (!accepted.ok()) {
    cancel();
    return absl::Status(accepted.code(),
                        absl::StrCat("cache '", name(), "': L3 fetch of ", fetched.size(),
                                     " key(s): ", accepted.message()));
  }
  // Accepted: the victims' pages are being written now.
  for (uint64_t store : fetch->stores) (void)index_.CommitStore(store, fetch->holder);
  std::optional<std::vector<PageResult>> early;
  {
    absl::MutexLock lock(&fetch->mu);
    fetch->committed = true;
    early = std::move(fetch->early);
  }
  if (early.has_value()) FetchEnded(*fetch, *early);
  return fetched;
}

void NodeCache::FetchEnded(const L3Fetch& fetch, const std::vector<PageResult>& results) {
  uint64_t hits = 0;
  for (size_t i = 0; i < fetch.stores.size(); ++i) {
    // A page is published only once the tier wrote it, whole and verified.
    const bool hit = i < results.size() && results[i].outcome == PageOutcome::kHit;
    hits += hit ? 1 : 0;
    (void)index_.FinishStore(fetch.stores[i], fetch.holder, hit);
  }
  l3_fetched_.fetch_add(hits);
  l3_missed_.fetch_add(fetch.stores.size() - hits);
}

CacheStats NodeCache::stats() const {
  CacheStats s = index_.stats();
  s.l3_written = l3_written_.load();
  s.l3_fetched = l3_fetched_.load();
  s.l3_missed = l3_missed_.load();
  return s;
}

absl::StatusOr<std::shared_ptr<Ticket>> NodeCache::Restore(const Caller& caller,
                                                           const std::string& attachment_id,
                                                           absl::Span<const std::string> keys,
                                                           absl::Span<const int64_t> device,
                                                           const std::string& wait_fence) {
  absl::StatusOr<std::string> holder = OpenMove(caller, attachment_id, keys, device);
  if (!holder.ok()) return holder.status();
  return RestoreWith(
      *holder, keys, device, [&](std::vector<int64_t> slots, std::vector<int64_t> rows) {
        return transfers_->Submit(caller, attachment_id, Direction::kLoad, slots, rows, wait_fence);
      });
}

absl::StatusOr<std::shared_ptr<Ticket>> NodeCache::RestoreToPool(
    const Caller& caller, const PoolSlots& target, absl::Span<const std::string> keys) {
  // Held from before its slots are checked: no claim frees them meanwhile.
  std::shared_ptr<void> use = target.pool->UseSlots();
  absl::StatusOr<std::string> holder = OpenPoolMove(caller, target, keys, *target.pool);
  if (!holder.ok()) return holder.status();
  return RestoreWith(*holder, keys, target.slots,
                     [&](std::vector<int64_t> slots, std::vector<int64_t> rows) {
                       PoolCopyJob job;
                       job.from = pool_;
                       job.to = target.pool;
                       job.to_use = use;
                       job.from_slots = std::move(slots);
                       job.to_slots = std::move(rows);
                       return transfers_->SubmitPoolCopy(*holder, Direction::kLoad, std::move(job));
                     });
}

absl::StatusOr<std::shared_ptr<Ticket>> NodeCache::RestoreWith(const std::string& holder,
                                                               absl::Span<const std::string> keys,
                                                               absl::Span<const int64_t> rows,
                                                               const SubmitCopy& submit) {
  // Counted once the copies are accepted: a refused restore changes no
  // counter.
  absl::StatusOr<CacheLookup> found = index_.Lookup(keys, &holder, /*count=*/false);
  if (!found.ok()) return found.status();
  const uint64_t pin_id = found->pin_id;
  auto unpin = [self = shared_from_this(), pin_id, h = holder] {
    if (pin_id != 0) (void)self->index_.Unpin(pin_id, h);
  };
  if (found->prefix < keys.size()) {
    unpin();
    const size_t first = found->prefix;
    return absl::FailedPreconditionError(absl::StrCat(
        "cache '", name(), "': key ", first, " is ",
        found->states[first] == CacheKeyState::kPending ? "still being stored" : "not present",
        " (", first, " of ", keys.size(),
        " keys present from the first); restore a prefix "
        "Lookup found"));
  }
  absl::StatusOr<std::shared_ptr<Ticket>> ticket =
      submit(Slots(found->pages), std::vector<int64_t>(rows.begin(), rows.end()));
  if (!ticket.ok()) {
    unpin();
    return ticket.status();
  }
  index_.CountUse(keys);
  if (!(*ticket)->BeforeDone([unpin](const absl::Status&) { unpin(); })) (*ticket)->OnDone(unpin);
  return ticket;
}

void NodeCache::SessionEnded(const std::string& session_id) {
  std::vector<uint64_t> pins;
  {
    absl::MutexLock lock(&mu_);
    for (auto it = loose_pins_.begin(); it != loose_pins_.end();) {
      if (it->second == session_id) {
        pins.push_back(it->first);
        loose_pins_.erase(it++);
      } else {
        ++it;
      }
    }
    for (auto& [id, store] : stores_) {
      if (store.holder == session_id) store.abandoned = true;
    }
  }
  for (uint64_t pin : pins) (void)index_.Unpin(pin, session_id);
}

}  // namespace kvhost
