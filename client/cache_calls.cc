// Client's CacheService calls (kvhost/client.h, "CacheService"): the node
// cache, pages addressed by key. Lookup, Store and Restore go through the
// fast path when it takes them (Client::TryFastPath), else over gRPC.
#include <grpcpp/grpcpp.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/calls.h"
#include "kvhost/client.h"
#include "kvhost/v1/fast_path.pb.h"

namespace kvhost {
namespace {

template <typename Request>
void SetKeys(const std::vector<std::string>& keys, Request* request) {
  request->mutable_keys()->Reserve(static_cast<int>(keys.size()));
  for (const std::string& k : keys) request->add_keys(k);
}

template <typename Request>
void SetRows(absl::Span<const int64_t> rows, Request* request) {
  request->mutable_device_indices()->Add(rows.begin(), rows.end());
}

template <typename Request>
void SetPool(const std::string& pool, absl::Span<const int64_t> slots, Request* request) {
  v1::CachePoolSlots* out = request->mutable_pool();
  out->set_pool(pool);
  out->mutable_host_indices()->Add(slots.begin(), slots.end());
}

}  // namespace

absl::StatusOr<v1::CacheLookupReply> Client::CacheLookup(const std::string& cache,
                                                         const std::vector<std::string>& keys,
                                                         bool pin, bool fetch_missing) {
  if (pin) {
    if (absl::Status s =
            OpenWorkerSession(absl::StrCat("a pinning CacheLookup of cache '", cache, "'"));
        !s.ok()) {
      return s;
    }
  }
  v1::CacheLookupRequest request;
  request.set_cache(cache);
  SetKeys(keys, &request);
  request.set_pin(pin);
  request.set_fetch_missing(fetch_missing);
  v1::CacheLookupReply response;
  absl::Status s = KVHOST_FAST_CALL(FAST_PATH_METHOD_CACHE_LOOKUP, cache_, Lookup, request,
                                    &response, options_.timeout);
  if (!s.ok()) return s;
  return response;
}

absl::StatusOr<v1::CacheStoreReply> Client::CacheStore(const std::string& cache,
                                                       const std::string& attachment_id,
                                                       const std::vector<std::string>& keys,
                                                       absl::Span<const int64_t> device_indices,
                                                       const std::string& ready_event_handle,
                                                       bool write_through) {
  if (absl::Status s = OpenWorkerSession(absl::StrCat("CacheStore into cache '", cache, "'"));
      !s.ok()) {
    return s;
  }
  v1::CacheStoreRequest request;
  request.set_cache(cache);
  request.set_attachment_id(attachment_id);
  SetKeys(keys, &request);
  SetRows(device_indices, &request);
  request.set_ready_event_handle(ready_event_handle);
  request.set_write_through(write_through);
  v1::CacheStoreReply response;
  absl::Status s = KVHOST_FAST_CALL(FAST_PATH_METHOD_CACHE_STORE, cache_, Store, request, &response,
                                    options_.timeout);
  if (!s.ok()) return s;
  return response;
}

absl::StatusOr<v1::TransferTicket> Client::CacheRestore(const std::string& cache,
                                                        const std::string& attachment_id,
                                                        const std::vector<std::string>& keys,
                                                        absl::Span<const int64_t> device_indices,
                                                        const std::string& wait_event_handle) {
  if (absl::Status s = OpenWorkerSession(absl::StrCat("CacheRestore from cache '", cache, "'"));
      !s.ok()) {
    return s;
  }
  v1::CacheRestoreRequest request;
  request.set_cache(cache);
  request.set_attachment_id(attachment_id);
  SetKeys(keys, &request);
  SetRows(device_indices, &request);
  request.set_wait_event_handle(wait_event_handle);
  v1::TransferTicket response;
  absl::Status s = KVHOST_FAST_CALL(FAST_PATH_METHOD_CACHE_RESTORE, cache_, Restore, request,
                                    &response, options_.timeout);
  if (!s.ok()) return s;
  return response;
}

absl::StatusOr<v1::CacheStoreReply> Client::CacheStoreFromPool(
    const std::string& cache, const std::string& pool, const std::vector<std::string>& keys,
    absl::Span<const int64_t> host_indices, bool write_through) {
  if (absl::Status s = OpenWorkerSession(absl::StrCat("CacheStore into cache '", cache, "'"));
      !s.ok()) {
    return s;
  }
  v1::CacheStoreRequest request;
  request.set_cache(cache);
  SetKeys(keys, &request);
  SetPool(pool, host_indices, &request);
  request.set_write_through(write_through);
  v1::CacheStoreReply response;
  absl::Status s = KVHOST_FAST_CALL(FAST_PATH_METHOD_CACHE_STORE, cache_, Store, request, &response,
                                    options_.timeout);
  if (!s.ok()) return s;
  return response;
}

absl::StatusOr<v1::TransferTicket> Client::CacheRestoreToPool(
    const std::string& cache, const std::string& pool, const std::vector<std::string>& keys,
    absl::Span<const int64_t> host_indices) {
  if (absl::Status s = OpenWorkerSession(absl::StrCat("CacheRestore from cache '", cache, "'"));
      !s.ok()) {
    return s;
  }
  v1::CacheRestoreRequest request;
  request.set_cache(cache);
  SetKeys(keys, &request);
  SetPool(pool, host_indices, &request);
  v1::TransferTicket response;
  absl::Status s = KVHOST_FAST_CALL(FAST_PATH_METHOD_CACHE_RESTORE, cache_, Restore, request,
                                    &response, options_.timeout);
  if (!s.ok()) return s;
  return response;
}

absl::Status Client::CacheReleasePin(const std::string& cache, uint64_t pin_id) {
  v1::CacheReleasePinRequest request;
  request.set_cache(cache);
  request.set_pin_id(pin_id);
  v1::CacheReleasePinReply response;
  return KVHOST_SESSION_CALL(cache_, ReleasePin, request, &response, options_.timeout);
}

absl::StatusOr<v1::CacheEvictReply> Client::CacheEvict(const std::string& cache,
                                                       const std::vector<std::string>& keys) {
  v1::CacheEvictRequest request;
  request.set_cache(cache);
  SetKeys(keys, &request);
  v1::CacheEvictReply response;
  absl::Status s = KVHOST_CALL(cache_, Evict, request, &response, options_.timeout);
  if (!s.ok()) return s;
  return response;
}

absl::StatusOr<v1::CacheStats> Client::GetCacheStats(const std::string& cache) {
  v1::GetCacheStatsRequest request;
  request.set_cache(cache);
  v1::CacheStats response;
  absl::Status s = KVHOST_CALL(cache_, GetCacheStats, request, &response, options_.timeout);
  if (!s.ok()) return s;
  return response;
}

absl::StatusOr<v1::CacheEventBatch> Client::ReadCacheEvents(const std::string& cache,
                                                            uint64_t after_seq,
                                                            uint32_t max_events) {
  v1::ReadCacheEventsRequest request;
  request.set_cache(cache);
  request.set_after_seq(after_seq);
  request.set_max_events(max_events);
  v1::CacheEventBatch response;
  absl::Status s = KVHOST_CALL(cache_, ReadCacheEvents, request, &response, options_.timeout);
  if (!s.ok()) return s;
  return response;
}

}  // namespace kvhost
