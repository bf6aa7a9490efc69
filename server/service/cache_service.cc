#include "server/service/cache_service.h"

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "server/access/credentials.h"
#include "server/service/call_scope.h"
#include "server/service/convert.h"

namespace kvhost {
namespace {

// The call's keys, counted against the cache's limit before they are copied.
absl::StatusOr<std::vector<std::string>> KeysOf(
    const NodeCache& cache, const google::protobuf::RepeatedPtrField<std::string>& keys) {
  const size_t limit = cache.limits().max_keys_per_call;
  if (static_cast<size_t>(keys.size()) > limit) {
    return absl::InvalidArgumentError(absl::StrCat("cache '", cache.name(), "': ", keys.size(),
                                                   " keys, over the limit of ", limit, " a call"));
  }
  return std::vector<std::string>(keys.begin(), keys.end());
}

absl::Status WithCache(const NodeCache& cache, const absl::Status& s) {
  if (s.ok() || absl::StrContains(s.message(), "cache '")) return s;
  return absl::Status(s.code(), absl::StrCat("cache '", cache.name(), "': ", s.message()));
}

v1::CacheKeyState ToProto(CacheKeyState state) {
  switch (state) {
    case CacheKeyState::kPresent:
      return v1::CACHE_KEY_PRESENT;
    case CacheKeyState::kPending:
      return v1::CACHE_KEY_PENDING;
    case CacheKeyState::kAbsent:
      break;
  }
  return v1::CACHE_KEY_ABSENT;
}

void SetTicket(const Ticket& ticket, v1::TransferTicket* out) {
  out->set_id(ticket.id());
  out->set_event_set(ticket.event_set());
  out->set_layer_base(ticket.layer_base());
}

// A read's or a watch batch's bound: the asked one, at most the cache's.
size_t MaxEvents(const NodeCache& cache, const v1::ReadCacheEventsRequest& request) {
  const size_t limit = cache.limits().max_events_per_call;
  return request.max_events() == 0 ? limit : std::min<size_t>(request.max_events(), limit);
}

}  // namespace

absl::StatusOr<std::shared_ptr<NodeCache>> CacheServiceImpl::Open(const Caller& caller,
                                                                  const std::string& cache,
                                                                  int device_indices) const {
  if (absl::Status s = CheckIndexCount(absl::StrCat("cache '", cache, "': device_indices"),
                                       static_cast<uint64_t>(device_indices), max_indices_);
      !s.ok()) {
    return s;
  }
  absl::StatusOr<PoolTarget> target = registry_->Resolve(cache, TokenOf(caller.token));
  if (!target.ok()) return target.status();
  if (target->group != nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", cache, "' names a pool group, not a node cache"));
  }
  if (!target->pool->spec().node_cache) {
    return absl::FailedPreconditionError(absl::StrCat(
        "pool '", cache, "' is not a node cache (create it with PoolSpec.node_cache)"));
  }
  return caches_->For(target->pool);
}

absl::StatusOr<CacheL3> CacheServiceImpl::L3For(const Caller& caller, const NodeCache& cache,
                                                const char* flag) const {
  if (tier_ == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("cache '", cache.name(), "': ", flag,
                     " needs an L3 tier, and this kvhostd has none: start it with "
                     "--l3-memcached=host:port,..."));
  }
  // As StorePages of the cache's pool.
  absl::StatusOr<std::string> ns =
      L3Namespace(tier_->secret(), *cache.pool(), TokenOf(caller.token));
  if (!ns.ok()) return ns.status();
  CacheL3 l3;
  l3.tier = tier_;
  l3.ns = *std::move(ns);
  return l3;
}

absl::Status CacheServiceImpl::DoLookup(const Caller& caller, const v1::CacheLookupRequest& request,
                                        v1::CacheLookupReply* response) {
  absl::StatusOr<std::shared_ptr<NodeCache>> cache = Open(caller, request.cache());
  if (!cache.ok()) return cache.status();
  absl::StatusOr<std::vector<std::string>> keys = KeysOf(**cache, request.keys());
  if (!keys.ok()) return keys.status();
  std::optional<CacheL3> l3;
  if (request.fetch_missing()) {
    absl::StatusOr<CacheL3> got = L3For(caller, **cache, "fetch_missing");
    if (!got.ok()) return got.status();
    l3 = *std::move(got);
  }
  absl::StatusOr<CacheLookup> found = (*cache)->Lookup(caller, *keys, request.pin());
  if (!found.ok()) return WithCache(**cache, found.status());
  // The run of absent keys from the first one on: what a prefix restore
  // would need next.
  const auto first = std::find(found->states.begin(), found->states.end(), CacheKeyState::kAbsent);
  const auto end = std::find_if(first, found->states.end(),
                                [](CacheKeyState s) { return s != CacheKeyState::kAbsent; });
  if (l3.has_value() && first != end) {
    const size_t from = static_cast<size_t>(first - found->states.begin());
    absl::StatusOr<std::vector<size_t>> fetching = (*cache)->FetchMissing(
        *l3, absl::MakeConstSpan(*keys).subspan(from, static_cast<size_t>(end - first)));
    if (!fetching.ok()) {
      if (found->pin_id != 0) (void)(*cache)->ReleasePin(caller, found->pin_id);
      return WithCache(**cache, fetching.status());
    }
    for (size_t i : *fetching) found->states[from + i] = CacheKeyState::kPending;
    response->set_fetching(static_cast<uint32_t>(fetching->size()));
  }
  response->set_prefix(static_cast<uint32_t>(found->prefix));
  for (CacheKeyState state : found->states) response->add_states(ToProto(state));
  response->set_pin_id(found->pin_id);
  return absl::OkStatus();
}

absl::StatusOr<std::optional<NodeCache::PoolSlots>> CacheServiceImpl::PoolSideOf(
    const Caller& caller, bool has_pool, const v1::CachePoolSlots& pool,
    const std::string& attachment_id, int device_indices, const std::string& fence,
    const char* fence_field) const {
  if (!has_pool) {
    if (!attachment_id.empty()) return std::nullopt;
    return absl::InvalidArgumentError(
        "neither attachment_id nor pool is given; give exactly one: an attachment's device rows "
        "or a pool's host_indices");
  }
  if (!attachment_id.empty() || device_indices > 0) {
    return absl::InvalidArgumentError(
        "both attachment_id / device_indices and pool are given; give exactly one: an "
        "attachment's device rows or a pool's host_indices");
  }
  if (!fence.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(fence_field,
                     " is set beside pool: a pool copy runs inside kvhostd on host memory, "
                     "and waits on no device event"));
  }
  if (absl::Status s =
          CheckIndexCount(absl::StrCat("pool '", pool.pool(), "': host_indices"),
                          static_cast<uint64_t>(pool.host_indices_size()), max_indices_);
      !s.ok()) {
    return s;
  }
  absl::StatusOr<PoolTarget> target = registry_->Resolve(pool.pool(), TokenOf(caller.token));
  if (!target.ok()) return target.status();
  if (target->group != nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "pool.pool '", pool.pool(), "' names a pool group; name one of its entries' pools"));
  }
  return NodeCache::PoolSlots{
      target->pool, absl::MakeConstSpan(pool.host_indices().data(), pool.host_indices().size())};
}

absl::Status CacheServiceImpl::DoStore(const Caller& caller, const v1::CacheStoreRequest& request,
                                       v1::CacheStoreReply* response) {
  absl::StatusOr<std::shared_ptr<NodeCache>> cache =
      Open(caller, request.cache(), request.device_indices_size());
  if (!cache.ok()) return cache.status();
  absl::StatusOr<std::vector<std::string>> keys = KeysOf(**cache, request.keys());
  if (!keys.ok()) return keys.status();
  absl::StatusOr<std::optional<NodeCache::PoolSlots>> source =
      PoolSideOf(caller, request.has_pool(), request.pool(), request.attachment_id(),
                 request.device_indices_size(), request.ready_event_handle(), "ready_event_handle");
  if (!source.ok()) return WithCache(**cache, source.status());
  std::optional<CacheL3> l3;
  if (request.write_through()) {
    absl::StatusOr<CacheL3> got = L3For(caller, **cache, "write_through");
    if (!got.ok()) return got.status();
    l3 = *std::move(got);
    // Checked now: the tier refuses a key it cannot hold only after publish.
    for (size_t i = 0; i < keys->size(); ++i) {
      if (absl::Status s = CheckStorageKey((*keys)[i], absl::StrCat("keys[", i, "]")); !s.ok()) {
        return WithCache(**cache,
                         absl::Status(s.code(), absl::StrCat(s.message(), " (write_through)")));
      }
    }
  }
  const CacheL3* write_through = l3.has_value() ? &*l3 : nullptr;
  absl::StatusOr<NodeCache::Stored> stored =
      source->has_value() ? (*cache)->StoreFromPool(caller, **source, *keys, write_through)
                          : (*cache)->Store(caller, request.attachment_id(), *keys,
                                            absl::MakeConstSpan(request.device_indices().data(),
                                                                request.device_indices().size()),
                                            request.ready_event_handle(), write_through);
  if (!stored.ok()) return WithCache(**cache, stored.status());
  for (CacheKeyState state : stored->plan.states) response->add_states(ToProto(state));
  if (stored->ticket != nullptr) SetTicket(*stored->ticket, response->mutable_ticket());
  response->set_evicted(stored->plan.evicted);
  return absl::OkStatus();
}

absl::Status CacheServiceImpl::DoRestore(const Caller& caller,
                                         const v1::CacheRestoreRequest& request,
                                         v1::TransferTicket* response) {
  absl::StatusOr<std::shared_ptr<NodeCache>> cache =
      Open(caller, request.cache(), request.device_indices_size());
  if (!cache.ok()) return cache.status();
  absl::StatusOr<std::vector<std::string>> keys = KeysOf(**cache, request.keys());
  if (!keys.ok()) return keys.status();
  absl::StatusOr<std::optional<NodeCache::PoolSlots>> target =
      PoolSideOf(caller, request.has_pool(), request.pool(), request.attachment_id(),
                 request.device_indices_size(), request.wait_event_handle(), "wait_event_handle");
  if (!target.ok()) return WithCache(**cache, target.status());
  absl::StatusOr<std::shared_ptr<Ticket>> ticket =
      target->has_value() ? (*cache)->RestoreToPool(caller, **target, *keys)
                          : (*cache)->Restore(caller, request.attachment_id(), *keys,
                                              absl::MakeConstSpan(request.device_indices().data(),
                                                                  request.device_indices().size()),
                                              request.wait_event_handle());
  if (!ticket.ok()) return WithCache(**cache, ticket.status());
  SetTicket(**ticket, response);
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* CacheServiceImpl::Lookup(grpc::CallbackServerContext* context,
                                                   const v1::CacheLookupRequest* request,
                                                   v1::CacheLookupReply* response) {
  return FinishCall(context, DoLookup(CallerOf(*context), *request, response));
}

grpc::ServerUnaryReactor* CacheServiceImpl::Store(grpc::CallbackServerContext* context,
                                                  const v1::CacheStoreRequest* request,
                                                  v1::CacheStoreReply* response) {
  return FinishCall(context, DoStore(CallerOf(*context), *request, response));
}

grpc::ServerUnaryReactor* CacheServiceImpl::Restore(grpc::CallbackServerContext* context,
                                                    const v1::CacheRestoreRequest* request,
                                                    v1::TransferTicket* response) {
  return FinishCall(context, DoRestore(CallerOf(*context), *request, response));
}

grpc::ServerUnaryReactor* CacheServiceImpl::ReleasePin(grpc::CallbackServerContext* context,
                                                       const v1::CacheReleasePinRequest* request,
                                                       v1::CacheReleasePinReply* /*response*/) {
  const Caller caller = CallerOf(*context);
  absl::StatusOr<std::shared_ptr<NodeCache>> cache = Open(caller, request->cache());
  if (!cache.ok()) return FinishCall(context, cache.status());
  return FinishCall(context, (*cache)->ReleasePin(caller, request->pin_id()));
}

grpc::ServerUnaryReactor* CacheServiceImpl::Evict(grpc::CallbackServerContext* context,
                                                  const v1::CacheEvictRequest* request,
                                                  v1::CacheEvictReply* response) {
  absl::StatusOr<std::shared_ptr<NodeCache>> cache = Open(CallerOf(*context), request->cache());
  if (!cache.ok()) return FinishCall(context, cache.status());
  absl::StatusOr<std::vector<std::string>> keys = KeysOf(**cache, request->keys());
  if (!keys.ok()) return FinishCall(context, keys.status());
  absl::StatusOr<std::vector<CacheEvictOutcome>> outcomes = (*cache)->Evict(*keys);
  if (!outcomes.ok()) return FinishCall(context, WithCache(**cache, outcomes.status()));
  for (CacheEvictOutcome outcome : *outcomes) {
    response->add_outcomes(outcome == CacheEvictOutcome::kEvicted ? v1::CacheEvictReply::EVICTED
                           : outcome == CacheEvictOutcome::kBusy  ? v1::CacheEvictReply::BUSY
                                                                  : v1::CacheEvictReply::ABSENT);
  }
  return FinishCall(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* CacheServiceImpl::GetCacheStats(grpc::CallbackServerContext* context,
                                                          const v1::GetCacheStatsRequest* request,
                                                          v1::CacheStats* response) {
  absl::StatusOr<std::shared_ptr<NodeCache>> cache = Open(CallerOf(*context), request->cache());
  if (!cache.ok()) return FinishCall(context, cache.status());
  const CacheStats s = (*cache)->stats();
  response->set_page_num(s.page_num);
  response->set_free_pages(s.free_pages);
  response->set_published(s.published);
  response->set_writing(s.writing);
  response->set_pinned(s.pinned);
  response->set_hits(s.hits);
  response->set_misses(s.misses);
  response->set_stored(s.stored);
  response->set_skipped(s.skipped);
  response->set_evicted(s.evicted);
  response->set_aborted(s.aborted);
  response->set_l3_written(s.l3_written);
  response->set_l3_fetched(s.l3_fetched);
  response->set_l3_missed(s.l3_missed);
  return FinishCall(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* CacheServiceImpl::ReadCacheEvents(
    grpc::CallbackServerContext* context, const v1::ReadCacheEventsRequest* request,
    v1::CacheEventBatch* response) {
  absl::StatusOr<std::shared_ptr<NodeCache>> cache = Open(CallerOf(*context), request->cache());
  if (!cache.ok()) return FinishCall(context, cache.status());
  const CacheEvents events =
      (*cache)->EventsSince(request->after_seq(), MaxEvents(**cache, *request));
  for (const CacheEvent& e : events.events) {
    v1::CacheEvent* out = response->add_events();
    out->set_seq(e.seq);
    out->set_kind(e.kind == CacheEvent::Kind::kStored ? v1::CacheEvent::STORED
                                                      : v1::CacheEvent::EVICTED);
    out->set_key(e.key);
  }
  response->set_next_after(events.next_after);
  response->set_gap(events.gap);
  return FinishCall(context, absl::OkStatus());
}

grpc::ServerWriteReactor<v1::CacheEventBatch>* CacheServiceImpl::WatchCacheEvents(
    grpc::CallbackServerContext* context, const v1::ReadCacheEventsRequest* request) {
  absl::StatusOr<std::shared_ptr<NodeCache>> cache = Open(CallerOf(*context), request->cache());
  const size_t max = cache.ok() ? MaxEvents(**cache, *request) : 0;
  return watches_.Start(std::move(cache), request->after_seq(), max);
}

}  // namespace kvhost
