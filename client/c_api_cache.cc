// The C ABI's node cache calls (kvhost_cache_*; kvhost.v1.CacheService): the
// caller's key arrays into the C++ client's, per-key states and outcomes
// into the caller's arrays, stats and events into its structs.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "c_api_internal.h"

namespace {

using kvhost::c_api::ClientOf;
using kvhost::c_api::Run;
using kvhost::c_api::Str;

// The enum numbers of a reply, one per key, into out[0, capacity);
// OUT_OF_RANGE when they do not all fit (those that fit are written).
absl::Status WriteStates(const google::protobuf::RepeatedField<int>& values, int32_t* out,
                         size_t capacity, const char* what) {
  if (out == nullptr) return absl::OkStatus();
  const size_t n = static_cast<size_t>(values.size());
  for (size_t i = 0; i < n && i < capacity; ++i) out[i] = values[static_cast<int>(i)];
  if (n > capacity) {
    return absl::OutOfRangeError(absl::StrCat(n, " ", what, " for a buffer of ", capacity,
                                              "; the first ", capacity, " were written"));
  }
  return absl::OkStatus();
}

// A TransferTicket as the ABI's kvhost_load_ticket.
void WriteTicket(const kvhost::v1::TransferTicket& t, kvhost_load_ticket* out) {
  if (out == nullptr) return;
  *out = kvhost_load_ticket{t.id(), t.event_set(), 0, t.layer_base()};
}

// What every call that names keys reads: the client, the cache, the keys.
struct KeyArgs {
  kvhost::Client* client = nullptr;
  std::string cache;
  std::vector<std::string> keys;
};

absl::StatusOr<KeyArgs> ReadKeyArgs(kvhost_client* client, const char* cache,
                                    const void* const* keys, const size_t* key_lens,
                                    size_t num_keys) {
  KeyArgs args;
  absl::StatusOr<kvhost::Client*> c = ClientOf(client);
  if (!c.ok()) return c.status();
  args.client = *c;
  absl::StatusOr<std::string> name = Str(cache, "cache name");
  if (!name.ok()) return name.status();
  args.cache = *std::move(name);
  absl::StatusOr<std::vector<std::string>> k = kvhost::c_api::Keys(keys, key_lens, num_keys);
  if (!k.ok()) return k.status();
  args.keys = *std::move(k);
  return args;
}

// What kvhost_cache_store and kvhost_cache_restore read besides the keys:
// the attachment, its device rows and the worker's event.
struct MoveArgs {
  KeyArgs base;
  std::string attachment_id;
  absl::Span<const int64_t> rows;
  std::string event;
};

absl::StatusOr<MoveArgs> ReadMoveArgs(kvhost_client* client, const char* cache,
                                      const kvhost_attachment* attachment, const void* const* keys,
                                      const size_t* key_lens, size_t num_keys,
                                      const int64_t* device_indices, size_t num_device,
                                      const void* event, size_t event_len, const char* event_what) {
  MoveArgs args;
  absl::StatusOr<KeyArgs> base = ReadKeyArgs(client, cache, keys, key_lens, num_keys);
  if (!base.ok()) return base.status();
  args.base = *std::move(base);
  absl::StatusOr<const kvhost::v1::Attachment*> a = kvhost::c_api::AttachmentOf(attachment);
  if (!a.ok()) return a.status();
  args.attachment_id = (*a)->id();
  absl::StatusOr<absl::Span<const int64_t>> rows =
      kvhost::c_api::Indices(device_indices, num_device, "device_indices");
  if (!rows.ok()) return rows.status();
  args.rows = *rows;
  absl::StatusOr<std::string> e = kvhost::c_api::EventHandle(event, event_len, event_what);
  if (!e.ok()) return e.status();
  args.event = *std::move(e);
  return args;
}

// What the pool calls read besides the keys: the pool and its slots.
struct PoolArgs {
  KeyArgs base;
  std::string pool;
  absl::Span<const int64_t> slots;
};

absl::StatusOr<PoolArgs> ReadPoolArgs(kvhost_client* client, const char* cache, const char* pool,
                                      const void* const* keys, const size_t* key_lens,
                                      size_t num_keys, const int64_t* host_indices,
                                      size_t num_host) {
  PoolArgs args;
  absl::StatusOr<KeyArgs> base = ReadKeyArgs(client, cache, keys, key_lens, num_keys);
  if (!base.ok()) return base.status();
  args.base = *std::move(base);
  absl::StatusOr<std::string> name = Str(pool, "pool name");
  if (!name.ok()) return name.status();
  args.pool = *std::move(name);
  absl::StatusOr<absl::Span<const int64_t>> slots =
      kvhost::c_api::Indices(host_indices, num_host, "host_indices");
  if (!slots.ok()) return slots.status();
  args.slots = *slots;
  return args;
}

// A store's reply into the caller's states, ticket and evicted count.
absl::Status WriteStored(const kvhost::v1::CacheStoreReply& r, size_t num_keys, int32_t* states,
                         kvhost_load_ticket* ticket, uint64_t* evicted) {
  // No ticket (every key skipped) reads as ticket 0 with no event set.
  kvhost::v1::TransferTicket none;
  none.set_event_set(-1);
  WriteTicket(r.has_ticket() ? r.ticket() : none, ticket);
  if (evicted != nullptr) *evicted = r.evicted();
  return WriteStates(r.states(), states, num_keys, "key states");
}

}  // namespace

int kvhost_cache_lookup(kvhost_client* client, const char* cache, const void* const* keys,
                        const size_t* key_lens, size_t num_keys, int pin, uint32_t* prefix,
                        int32_t* states, uint64_t* pin_id, char* err, size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    absl::StatusOr<KeyArgs> a = ReadKeyArgs(client, cache, keys, key_lens, num_keys);
    if (!a.ok()) return a.status();
    absl::StatusOr<kvhost::v1::CacheLookupReply> r =
        a->client->CacheLookup(a->cache, a->keys, pin != 0);
    if (!r.ok()) return r.status();
    if (prefix != nullptr) *prefix = r->prefix();
    if (pin_id != nullptr) *pin_id = r->pin_id();
    return WriteStates(r->states(), states, num_keys, "key states");
  });
}

int kvhost_cache_store(kvhost_client* client, const char* cache,
                       const kvhost_attachment* attachment, const void* const* keys,
                       const size_t* key_lens, size_t num_keys, const int64_t* device_indices,
                       size_t num_device, const void* ready_event_handle,
                       size_t ready_event_handle_len, int32_t* states, kvhost_load_ticket* ticket,
                       uint64_t* evicted, char* err, size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    absl::StatusOr<MoveArgs> a =
        ReadMoveArgs(client, cache, attachment, keys, key_lens, num_keys, device_indices,
                     num_device, ready_event_handle, ready_event_handle_len, "ready_event_handle");
    if (!a.ok()) return a.status();
    absl::StatusOr<kvhost::v1::CacheStoreReply> r = a->base.client->CacheStore(
        a->base.cache, a->attachment_id, a->base.keys, a->rows, a->event);
    if (!r.ok()) return r.status();
    return WriteStored(*r, num_keys, states, ticket, evicted);
  });
}

int kvhost_cache_store_from_pool(kvhost_client* client, const char* cache, const char* pool,
                                 const void* const* keys, const size_t* key_lens, size_t num_keys,
                                 const int64_t* host_indices, size_t num_host, int32_t* states,
                                 kvhost_load_ticket* ticket, uint64_t* evicted, char* err,
                                 size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    absl::StatusOr<PoolArgs> a =
        ReadPoolArgs(client, cache, pool, keys, key_lens, num_keys, host_indices, num_host);
    if (!a.ok()) return a.status();
    absl::StatusOr<kvhost::v1::CacheStoreReply> r =
        a->base.client->CacheStoreFromPool(a->base.cache, a->pool, a->base.keys, a->slots);
    if (!r.ok()) return r.status();
    return WriteStored(*r, num_keys, states, ticket, evicted);
  });
}

int kvhost_cache_restore_to_pool(kvhost_client* client, const char* cache, const char* pool,
                                 const void* const* keys, const size_t* key_lens, size_t num_keys,
                                 const int64_t* host_indices, size_t num_host,
                                 kvhost_load_ticket* ticket, char* err, size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    absl::StatusOr<PoolArgs> a =
        ReadPoolArgs(client, cache, pool, keys, key_lens, num_keys, host_indices, num_host);
    if (!a.ok()) return a.status();
    absl::StatusOr<kvhost::v1::TransferTicket> t =
        a->base.client->CacheRestoreToPool(a->base.cache, a->pool, a->base.keys, a->slots);
    if (!t.ok()) return t.status();
    WriteTicket(*t, ticket);
    return absl::OkStatus();
  });
}

int kvhost_cache_restore(kvhost_client* client, const char* cache,
                         const kvhost_attachment* attachment, const void* const* keys,
                         const size_t* key_lens, size_t num_keys, const int64_t* device_indices,
                         size_t num_device, const void* wait_event_handle,
                         size_t wait_event_handle_len, kvhost_load_ticket* ticket, char* err,
                         size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    absl::StatusOr<MoveArgs> a =
        ReadMoveArgs(client, cache, attachment, keys, key_lens, num_keys, device_indices,
                     num_device, wait_event_handle, wait_event_handle_len, "wait_event_handle");
    if (!a.ok()) return a.status();
    absl::StatusOr<kvhost::v1::TransferTicket> t = a->base.client->CacheRestore(
        a->base.cache, a->attachment_id, a->base.keys, a->rows, a->event);
    if (!t.ok()) return t.status();
    WriteTicket(*t, ticket);
    return absl::OkStatus();
  });
}

int kvhost_cache_release_pin(kvhost_client* client, const char* cache, uint64_t pin_id, char* err,
                             size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    absl::StatusOr<KeyArgs> a = ReadKeyArgs(client, cache, nullptr, nullptr, 0);
    if (!a.ok()) return a.status();
    return a->client->CacheReleasePin(a->cache, pin_id);
  });
}

int kvhost_cache_evict(kvhost_client* client, const char* cache, const void* const* keys,
                       const size_t* key_lens, size_t num_keys, int32_t* outcomes,
                       uint64_t* evicted, char* err, size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    absl::StatusOr<KeyArgs> a = ReadKeyArgs(client, cache, keys, key_lens, num_keys);
    if (!a.ok()) return a.status();
    absl::StatusOr<kvhost::v1::CacheEvictReply> r = a->client->CacheEvict(a->cache, a->keys);
    if (!r.ok()) return r.status();
    if (evicted != nullptr) {
      uint64_t n = 0;
      for (int o : r->outcomes()) n += o == kvhost::v1::CacheEvictReply::EVICTED ? 1 : 0;
      *evicted = n;
    }
    return WriteStates(r->outcomes(), outcomes, num_keys, "evict outcomes");
  });
}

int kvhost_cache_get_stats(kvhost_client* client, const char* cache, kvhost_cache_stats* stats,
                           char* err, size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    if (absl::Status s = kvhost::c_api::NotNull(stats, "stats"); !s.ok()) return s;
    absl::StatusOr<KeyArgs> a = ReadKeyArgs(client, cache, nullptr, nullptr, 0);
    if (!a.ok()) return a.status();
    absl::StatusOr<kvhost::v1::CacheStats> s = a->client->GetCacheStats(a->cache);
    if (!s.ok()) return s.status();
    *stats = kvhost_cache_stats{s->page_num(),   s->free_pages(), s->published(), s->writing(),
                                s->pinned(),     s->hits(),       s->misses(),    s->stored(),
                                s->skipped(),    s->evicted(),    s->aborted(),   s->l3_written(),
                                s->l3_fetched(), s->l3_missed()};
    return absl::OkStatus();
  });
}

int kvhost_cache_read_events(kvhost_client* client, const char* cache, uint64_t after_seq,
                             uint32_t max_events, kvhost_cache_event* events, size_t capacity,
                             size_t* count, uint64_t* next_after, int32_t* gap, char* err,
                             size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    if (capacity == 0) {
      return absl::InvalidArgumentError("events capacity is 0; give room for at least one event");
    }
    if (absl::Status s = kvhost::c_api::NotNull(events, "events"); !s.ok()) return s;
    absl::StatusOr<KeyArgs> a = ReadKeyArgs(client, cache, nullptr, nullptr, 0);
    if (!a.ok()) return a.status();
    // Ask for no more than fit, so the batch's next_after never skips an
    // event this call could not return.
    const size_t want = max_events == 0 ? KVHOST_CACHE_MAX_EVENTS : max_events;
    const auto ask = static_cast<uint32_t>(std::min(want, capacity));
    absl::StatusOr<kvhost::v1::CacheEventBatch> b =
        a->client->ReadCacheEvents(a->cache, after_seq, ask);
    if (!b.ok()) return b.status();
    const size_t n = static_cast<size_t>(b->events_size());
    if (n > ask) {
      return absl::OutOfRangeError(absl::StrCat("cache '", a->cache, "': the daemon returned ", n,
                                                " events for a read of at most ", ask));
    }
    for (size_t i = 0; i < n; ++i) {
      const kvhost::v1::CacheEvent& e = b->events(static_cast<int>(i));
      if (e.key().size() > KVHOST_CACHE_MAX_KEY_BYTES) {
        return absl::OutOfRangeError(absl::StrCat("cache '", a->cache, "': event ", e.seq(),
                                                  "'s key has ", e.key().size(), " bytes, over ",
                                                  KVHOST_CACHE_MAX_KEY_BYTES));
      }
      kvhost_cache_event& out = events[i];
      out.seq = e.seq();
      out.kind = static_cast<int32_t>(e.kind());
      out.key_len = static_cast<uint32_t>(e.key().size());
      std::memcpy(out.key, e.key().data(), e.key().size());
    }
    if (count != nullptr) *count = n;
    if (next_after != nullptr) *next_after = b->next_after();
    if (gap != nullptr) *gap = b->gap() ? 1 : 0;
    return absl::OkStatus();
  });
}
