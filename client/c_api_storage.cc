// The C ABI's L3 calls (kvhost_l3_*; kvhost.v1.StorageService): the caller's
// key arrays into the C++ client's, its per-page results into outcome
// arrays.
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "c_api_internal.h"

namespace {

using kvhost::c_api::ClientOf;
using kvhost::c_api::Indices;
using kvhost::c_api::Keys;
using kvhost::c_api::Run;
using kvhost::c_api::Str;

// The outcomes of `pages` into outcomes[0, capacity); OUT_OF_RANGE when they
// do not all fit (those that fit are written).
absl::Status WriteOutcomes(const google::protobuf::RepeatedPtrField<kvhost::v1::PageResult>& pages,
                           int32_t* outcomes, size_t capacity) {
  if (outcomes == nullptr) return absl::OkStatus();
  const size_t n = static_cast<size_t>(pages.size());
  for (size_t i = 0; i < n && i < capacity; ++i) {
    outcomes[i] = static_cast<int32_t>(pages[static_cast<int>(i)].outcome());
  }
  if (n > capacity) {
    return absl::OutOfRangeError(absl::StrCat(n, " page outcomes for a buffer of ", capacity,
                                              "; the first ", capacity, " were written"));
  }
  return absl::OkStatus();
}

// The arguments kvhost_l3_store and kvhost_l3_fetch share.
struct PageArgs {
  kvhost::Client* client = nullptr;
  std::string pool;
  absl::Span<const int64_t> indices;
  std::vector<std::string> keys;
};

absl::StatusOr<PageArgs> ReadPageArgs(kvhost_client* client, const char* pool,
                                      const int64_t* indices, const void* const* keys,
                                      const size_t* key_lens, size_t num_pages) {
  PageArgs args;
  absl::StatusOr<kvhost::Client*> c = ClientOf(client);
  if (!c.ok()) return c.status();
  args.client = *c;
  absl::StatusOr<std::string> p = Str(pool, "pool name");
  if (!p.ok()) return p.status();
  args.pool = *std::move(p);
  absl::StatusOr<absl::Span<const int64_t>> in = Indices(indices, num_pages, "indices");
  if (!in.ok()) return in.status();
  args.indices = *in;
  absl::StatusOr<std::vector<std::string>> k = Keys(keys, key_lens, num_pages);
  if (!k.ok()) return k.status();
  args.keys = *std::move(k);
  return args;
}

}  // namespace

int kvhost_l3_store(kvhost_client* client, const char* pool, const int64_t* indices,
                    const void* const* keys, const size_t* key_lens, size_t num_pages,
                    int32_t* outcomes, uint64_t* stored_pages, char* err, size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    absl::StatusOr<PageArgs> a = ReadPageArgs(client, pool, indices, keys, key_lens, num_pages);
    if (!a.ok()) return a.status();
    absl::StatusOr<kvhost::v1::StorePagesResponse> r =
        a->client->StorePages(a->pool, a->indices, a->keys);
    if (!r.ok()) return r.status();
    if (stored_pages != nullptr) *stored_pages = r->stored_pages();
    return WriteOutcomes(r->pages(), outcomes, num_pages);
  });
}

int kvhost_l3_fetch(kvhost_client* client, const char* pool, const void* const* keys,
                    const size_t* key_lens, const int64_t* indices, size_t num_pages,
                    int32_t* outcomes, uint64_t* hit_pages, char* err, size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    absl::StatusOr<PageArgs> a = ReadPageArgs(client, pool, indices, keys, key_lens, num_pages);
    if (!a.ok()) return a.status();
    absl::StatusOr<kvhost::v1::FetchPagesResponse> r =
        a->client->FetchPages(a->pool, a->keys, a->indices);
    if (!r.ok()) return r.status();
    if (hit_pages != nullptr) *hit_pages = r->hit_pages();
    return WriteOutcomes(r->pages(), outcomes, num_pages);
  });
}

int kvhost_l3_exist(kvhost_client* client, const char* pool, const void* const* keys,
                    const size_t* key_lens, size_t num_keys, uint64_t* prefix_pages, char* err,
                    size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    absl::StatusOr<kvhost::Client*> c = ClientOf(client);
    if (!c.ok()) return c.status();
    if (absl::Status s = kvhost::c_api::NotNull(pool, "pool"); !s.ok()) return s;
    absl::StatusOr<std::vector<std::string>> k = Keys(keys, key_lens, num_keys);
    if (!k.ok()) return k.status();
    absl::StatusOr<uint64_t> prefix = (*c)->ExistPages(pool, *k);
    if (!prefix.ok()) return prefix.status();
    if (prefix_pages != nullptr) *prefix_pages = *prefix;
    return absl::OkStatus();
  });
}

int kvhost_l3_start_store(kvhost_client* client, const char* pool, const int64_t* indices,
                          const void* const* keys, const size_t* key_lens, size_t num_pages,
                          uint64_t* ticket, char* err, size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    if (absl::Status s = kvhost::c_api::NotNull(ticket, "ticket"); !s.ok()) return s;
    absl::StatusOr<PageArgs> a = ReadPageArgs(client, pool, indices, keys, key_lens, num_pages);
    if (!a.ok()) return a.status();
    absl::StatusOr<uint64_t> id = a->client->StartStorePages(a->pool, a->indices, a->keys);
    if (!id.ok()) return id.status();
    *ticket = *id;
    return absl::OkStatus();
  });
}

int kvhost_l3_start_fetch(kvhost_client* client, const char* pool, const void* const* keys,
                          const size_t* key_lens, const int64_t* indices, size_t num_pages,
                          uint64_t* ticket, char* err, size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    if (absl::Status s = kvhost::c_api::NotNull(ticket, "ticket"); !s.ok()) return s;
    absl::StatusOr<PageArgs> a = ReadPageArgs(client, pool, indices, keys, key_lens, num_pages);
    if (!a.ok()) return a.status();
    absl::StatusOr<uint64_t> id = a->client->StartFetchPages(a->pool, a->keys, a->indices);
    if (!id.ok()) return id.status();
    *ticket = *id;
    return absl::OkStatus();
  });
}

int kvhost_l3_wait(kvhost_client* client, const char* pool, uint64_t ticket, int poll, int* done,
                   int32_t* outcomes, size_t capacity, size_t* num_pages, uint64_t* good_pages,
                   char* err, size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    absl::StatusOr<kvhost::Client*> c = ClientOf(client);
    if (!c.ok()) return c.status();
    absl::StatusOr<std::string> p = Str(pool, "pool name");
    if (!p.ok()) return p.status();
    absl::StatusOr<kvhost::v1::StorageTicketStatus> status =
        (*c)->WaitStorage(*p, ticket, poll != 0);
    if (!status.ok()) return status.status();
    if (done != nullptr) *done = status->done() ? 1 : 0;
    if (!status->done()) return absl::OkStatus();
    const bool store = status->has_store();
    const auto& pages = store ? status->store().pages() : status->fetch().pages();
    if (num_pages != nullptr) *num_pages = static_cast<size_t>(pages.size());
    if (good_pages != nullptr) {
      *good_pages = store ? status->store().stored_pages() : status->fetch().hit_pages();
    }
    return WriteOutcomes(pages, outcomes, capacity);
  });
}
