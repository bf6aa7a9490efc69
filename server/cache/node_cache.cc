#include "server/cache/node_cache.h"

#include <utility>

#include "absl/strings/str_cat.h"

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
                                                   const std::string& ready_fence) {
  absl::StatusOr<std::string> holder = OpenMove(caller, attachment_id, keys, device);
  if (!holder.ok()) return holder.status();
  Stored out;
  absl::StatusOr<CacheStorePlan> plan = index_.BeginStore(keys, *holder);
  if (!plan.ok()) return plan.status();
  out.plan = *std::move(plan);
  if (out.plan.store_id == 0) return out;  // every key present or being written
  const uint64_t store_id = out.plan.store_id;
  {
    absl::MutexLock lock(&mu_);
    stores_.emplace(store_id, InFlightStore{*holder, false});
  }
  const uint64_t ps = pool_->page_size();
  std::vector<int64_t> rows;
  rows.reserve(out.plan.written.size() * ps);
  for (size_t key : out.plan.written) {
    rows.insert(rows.end(), device.begin() + key * ps, device.begin() + (key + 1) * ps);
  }
  absl::StatusOr<std::shared_ptr<Ticket>> ticket = transfers_->Submit(
      caller, attachment_id, Direction::kBackup, Slots(out.plan.pages), rows, ready_fence);
  if (!ticket.ok()) {
    // Refused (bad rows, a fence this backend cannot wait on, no event set
    // free): the cache is as before the call, its victims published again.
    {
      absl::MutexLock lock(&mu_);
      stores_.erase(store_id);
    }
    (void)index_.CancelStore(store_id, *holder);
    return ticket.status();
  }
  // Submitted: the victims' pages are being written now.
  (void)index_.CommitStore(store_id, *holder);
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
  if (!transfers_->IsSessionOpen(*holder)) SessionEnded(*holder);
  return out;
}

void NodeCache::StoreEnded(uint64_t store_id, const absl::Status& status) {
  std::string holder;
  bool publish = status.ok();
  {
    absl::MutexLock lock(&mu_);
    auto it = stores_.find(store_id);
    if (it == stores_.end()) return;
    holder = std::move(it->second.holder);
    publish = publish && !it->second.abandoned;
    stores_.erase(it);
  }
  // The store is this cache's and still open: FinishStore cannot fail.
  absl::Status s = index_.FinishStore(store_id, holder, publish);
  (void)s;
}

absl::StatusOr<std::shared_ptr<Ticket>> NodeCache::Restore(const Caller& caller,
                                                           const std::string& attachment_id,
                                                           absl::Span<const std::string> keys,
                                                           absl::Span<const int64_t> device,
                                                           const std::string& wait_fence) {
  absl::StatusOr<std::string> holder = OpenMove(caller, attachment_id, keys, device);
  if (!holder.ok()) return holder.status();
  absl::StatusOr<CacheLookup> found = index_.Lookup(keys, &*holder);
  if (!found.ok()) return found.status();
  const uint64_t pin_id = found->pin_id;
  auto unpin = [self = shared_from_this(), pin_id, h = *holder] {
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
  absl::StatusOr<std::shared_ptr<Ticket>> ticket = transfers_->Submit(
      caller, attachment_id, Direction::kLoad, Slots(found->pages), device, wait_fence);
  if (!ticket.ok()) {
    unpin();
    return ticket.status();
  }
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
