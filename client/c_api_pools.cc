// The C ABI's pool calls (kvhost/kvhost_c.h): pools and groups from JSON
// specs, Alloc / Free into the caller's index arrays, page metadata and
// flat pages (one at a time, or streamed) into the caller's buffers.
#include <algorithm>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "c_api_internal.h"

namespace kvhost::c_api {
namespace {

// The bytes of `pages` flat pages of `pool` (GetPageShape, which takes a
// group's name for its anchor), known before a page stream starts.
// OUT_OF_RANGE when the product does not fit a size_t.
absl::StatusOr<size_t> PagesBytes(Client& client, const std::string& pool, size_t pages) {
  absl::StatusOr<v1::PageShape> shape = client.GetPageShape(pool);
  if (!shape.ok()) return shape.status();
  const uint64_t page = shape->bytes();
  if (page != 0 && pages > std::numeric_limits<size_t>::max() / page) {
    return absl::OutOfRangeError(absl::StrCat(pages, " pages of ", page, " bytes of pool '", pool,
                                              "' do not fit one buffer"));
  }
  return static_cast<size_t>(page * pages);
}

}  // namespace
}  // namespace kvhost::c_api

using kvhost::c_api::ClientOf;
using kvhost::c_api::Indices;
using kvhost::c_api::Run;
using kvhost::c_api::Str;

extern "C" {

int kvhost_pool_create(kvhost_client* client, const char* name, const char* spec_json, char* err,
                       size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    absl::StatusOr<kvhost::Client*> c = ClientOf(client);
    if (!c.ok()) return c.status();
    absl::StatusOr<std::string> n = Str(name, "pool name");
    if (!n.ok()) return n.status();
    kvhost::v1::PoolSpec spec;
    if (absl::Status s = kvhost::c_api::FromJson(spec_json, &spec, "spec_json"); !s.ok()) return s;
    return (*c)->CreatePool(*n, spec).status();
  });
}

int kvhost_pool_get_json(kvhost_client* client, const char* name, char* out, size_t out_len,
                         size_t* needed, char* err, size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    absl::StatusOr<kvhost::Client*> c = ClientOf(client);
    if (!c.ok()) return c.status();
    absl::StatusOr<std::string> n = Str(name, "pool name");
    if (!n.ok()) return n.status();
    absl::StatusOr<kvhost::v1::Pool> pool = (*c)->GetPool(*n);
    if (!pool.ok()) return pool.status();
    return kvhost::c_api::WriteJson(*pool, out, out_len, needed,
                                    absl::StrCat("pool '", *n, "'").c_str());
  });
}

int kvhost_pool_list_json(kvhost_client* client, char* out, size_t out_len, size_t* needed,
                          char* err, size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    absl::StatusOr<kvhost::Client*> c = ClientOf(client);
    if (!c.ok()) return c.status();
    absl::StatusOr<std::vector<kvhost::v1::Pool>> pools = (*c)->ListPools();
    if (!pools.ok()) return pools.status();
    kvhost::v1::ListPoolsResponse list;
    for (kvhost::v1::Pool& p : *pools) *list.add_pools() = std::move(p);
    return kvhost::c_api::WriteJson(list, out, out_len, needed, "the pool list");
  });
}

int kvhost_pool_delete(kvhost_client* client, const char* name, uint64_t* bytes_released, char* err,
                       size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    absl::StatusOr<kvhost::Client*> c = ClientOf(client);
    if (!c.ok()) return c.status();
    absl::StatusOr<std::string> n = Str(name, "pool name");
    if (!n.ok()) return n.status();
    absl::StatusOr<uint64_t> bytes = (*c)->DeletePool(*n);
    if (!bytes.ok()) return bytes.status();
    if (bytes_released != nullptr) *bytes_released = *bytes;
    return absl::OkStatus();
  });
}

int kvhost_group_create(kvhost_client* client, const char* name, const char* group_json, char* err,
                        size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    absl::StatusOr<kvhost::Client*> c = ClientOf(client);
    if (!c.ok()) return c.status();
    absl::StatusOr<std::string> n = Str(name, "group name");
    if (!n.ok()) return n.status();
    kvhost::v1::CreatePoolGroupRequest request;
    if (absl::Status s = kvhost::c_api::FromJson(group_json, &request, "group_json"); !s.ok()) {
      return s;
    }
    // One name, given once: a second one in the JSON could only disagree.
    if (!request.name().empty()) {
      return absl::InvalidArgumentError(absl::StrCat("group_json names the group '", request.name(),
                                                     "'; give the name as the argument only"));
    }
    std::vector<kvhost::v1::PoolEntry> entries(request.entries().begin(), request.entries().end());
    return (*c)->CreatePoolGroup(*n, request.layer_num(), entries).status();
  });
}

int kvhost_group_get_json(kvhost_client* client, const char* name, char* out, size_t out_len,
                          size_t* needed, char* err, size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    absl::StatusOr<kvhost::Client*> c = ClientOf(client);
    if (!c.ok()) return c.status();
    absl::StatusOr<std::string> n = Str(name, "group name");
    if (!n.ok()) return n.status();
    absl::StatusOr<kvhost::v1::PoolGroup> group = (*c)->GetPoolGroup(*n);
    if (!group.ok()) return group.status();
    return kvhost::c_api::WriteJson(*group, out, out_len, needed,
                                    absl::StrCat("group '", *n, "'").c_str());
  });
}

int kvhost_group_delete(kvhost_client* client, const char* name, char* err, size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    absl::StatusOr<kvhost::Client*> c = ClientOf(client);
    if (!c.ok()) return c.status();
    absl::StatusOr<std::string> n = Str(name, "group name");
    if (!n.ok()) return n.status();
    return (*c)->DeletePoolGroup(*n);
  });
}

int kvhost_pool_claim(kvhost_client* client, const char* pool, const char* instance_id,
                      uint64_t* generation, uint64_t* reclaimed_tokens, int32_t* renewed, char* err,
                      size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    absl::StatusOr<kvhost::Client*> c = ClientOf(client);
    if (!c.ok()) return c.status();
    absl::StatusOr<std::string> p = Str(pool, "pool name");
    if (!p.ok()) return p.status();
    absl::StatusOr<std::string> id = Str(instance_id, "instance id");
    if (!id.ok()) return id.status();
    absl::StatusOr<kvhost::v1::PoolClaim> claim = (*c)->ClaimPool(*p, *id);
    if (!claim.ok()) return claim.status();
    if (generation != nullptr) *generation = claim->generation();
    if (reclaimed_tokens != nullptr) *reclaimed_tokens = claim->reclaimed_tokens();
    if (renewed != nullptr) *renewed = claim->renewed() ? 1 : 0;
    return absl::OkStatus();
  });
}

int kvhost_alloc(kvhost_client* client, const char* pool, uint64_t num_tokens, int64_t* indices,
                 size_t capacity, size_t* count, char* err, size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    absl::StatusOr<kvhost::Client*> c = ClientOf(client);
    if (!c.ok()) return c.status();
    absl::StatusOr<std::string> p = Str(pool, "pool name");
    if (!p.ok()) return p.status();
    // Checked before the call, so a short buffer allocates nothing.
    if (count != nullptr) *count = num_tokens;
    if (capacity < num_tokens || (indices == nullptr && num_tokens > 0)) {
      return absl::OutOfRangeError(
          absl::StrCat("Alloc of ", num_tokens, " slots of pool '", *p, "' needs room for ",
                       num_tokens, " indices; the buffer has ", indices == nullptr ? 0 : capacity));
    }
    absl::StatusOr<std::vector<int64_t>> slots = (*c)->Alloc(*p, num_tokens);
    if (!slots.ok()) return slots.status();
    if (slots->size() > capacity) {
      // The daemon answered more than it was asked: give them back rather
      // than leave slots the caller cannot see.
      (void)(*c)->Free(*p, *slots);
      return absl::InternalError(absl::StrCat("Alloc of ", num_tokens, " slots of pool '", *p,
                                              "' returned ", slots->size(), " (freed again)"));
    }
    std::copy(slots->begin(), slots->end(), indices);
    if (count != nullptr) *count = slots->size();
    return absl::OkStatus();
  });
}

int kvhost_alloc_batch(kvhost_client* client, const char* pool, const uint64_t* num_tokens,
                       size_t num_runs, int64_t* indices, size_t capacity, size_t* count, char* err,
                       size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    absl::StatusOr<kvhost::Client*> c = ClientOf(client);
    if (!c.ok()) return c.status();
    absl::StatusOr<std::string> p = Str(pool, "pool name");
    if (!p.ok()) return p.status();
    if (num_tokens == nullptr && num_runs > 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("num_tokens is NULL with ", num_runs, " runs"));
    }
    // The sum, checked against the buffer before the call, so a short
    // buffer allocates nothing; a sum that wraps is no count of slots.
    uint64_t total = 0;
    for (size_t i = 0; i < num_runs; ++i) {
      if (num_tokens[i] > std::numeric_limits<uint64_t>::max() - total) {
        return absl::InvalidArgumentError(
            absl::StrCat("num_tokens[", i, "] = ", num_tokens[i], " overflows the runs' sum"));
      }
      total += num_tokens[i];
    }
    if (count != nullptr) *count = total;
    if (capacity < total || (indices == nullptr && total > 0)) {
      return absl::OutOfRangeError(
          absl::StrCat("AllocBatch of ", total, " slots of pool '", *p, "' needs room for ", total,
                       " indices; the buffer has ", indices == nullptr ? 0 : capacity));
    }
    absl::StatusOr<std::vector<std::vector<int64_t>>> runs =
        (*c)->AllocBatch(*p, std::vector<uint64_t>(num_tokens, num_tokens + num_runs));
    if (!runs.ok()) return runs.status();
    std::vector<int64_t> all;
    all.reserve(total);
    bool as_asked = runs->size() == num_runs;
    for (size_t i = 0; i < runs->size(); ++i) {
      as_asked = as_asked && (*runs)[i].size() == num_tokens[i];
      all.insert(all.end(), (*runs)[i].begin(), (*runs)[i].end());
    }
    if (!as_asked) {
      // The daemon answered other runs than it was asked: give them back
      // rather than leave slots the caller cannot place.
      (void)(*c)->Free(*p, all);
      return absl::InternalError(absl::StrCat("AllocBatch of ", num_runs, " runs of pool '", *p,
                                              "' returned ", runs->size(),
                                              " runs of other sizes (freed again)"));
    }
    std::copy(all.begin(), all.end(), indices);
    return absl::OkStatus();
  });
}

int kvhost_free(kvhost_client* client, const char* pool, const int64_t* indices, size_t num_indices,
                uint64_t* freed, char* err, size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    absl::StatusOr<kvhost::Client*> c = ClientOf(client);
    if (!c.ok()) return c.status();
    absl::StatusOr<std::string> p = Str(pool, "pool name");
    if (!p.ok()) return p.status();
    absl::StatusOr<absl::Span<const int64_t>> in = Indices(indices, num_indices, "indices");
    if (!in.ok()) return in.status();
    absl::StatusOr<uint64_t> n = (*c)->Free(*p, *in);
    if (!n.ok()) return n.status();
    if (freed != nullptr) *freed = *n;
    return absl::OkStatus();
  });
}

int kvhost_page_buffer_meta_json(kvhost_client* client, const char* pool, const int64_t* indices,
                                 size_t num_indices, char* out, size_t out_len, size_t* needed,
                                 char* err, size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    absl::StatusOr<kvhost::Client*> c = ClientOf(client);
    if (!c.ok()) return c.status();
    absl::StatusOr<std::string> p = Str(pool, "pool name");
    if (!p.ok()) return p.status();
    absl::StatusOr<absl::Span<const int64_t>> in = Indices(indices, num_indices, "indices");
    if (!in.ok()) return in.status();
    absl::StatusOr<kvhost::v1::PageBufferMeta> meta = (*c)->GetPageBufferMeta(*p, *in);
    if (!meta.ok()) return meta.status();
    return kvhost::c_api::WriteJson(*meta, out, out_len, needed, "the page buffer meta");
  });
}

int kvhost_page_shape_json(kvhost_client* client, const char* pool, char* out, size_t out_len,
                           size_t* needed, char* err, size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    absl::StatusOr<kvhost::Client*> c = ClientOf(client);
    if (!c.ok()) return c.status();
    absl::StatusOr<std::string> p = Str(pool, "pool name");
    if (!p.ok()) return p.status();
    absl::StatusOr<kvhost::v1::PageShape> shape = (*c)->GetPageShape(*p);
    if (!shape.ok()) return shape.status();
    return kvhost::c_api::WriteJson(*shape, out, out_len, needed, "the page shape");
  });
}

int kvhost_stride_alignment_json(kvhost_client* client, const char* pool, uint64_t alignment,
                                 char* out, size_t out_len, size_t* needed, char* err,
                                 size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    absl::StatusOr<kvhost::Client*> c = ClientOf(client);
    if (!c.ok()) return c.status();
    absl::StatusOr<std::string> p = Str(pool, "pool name");
    if (!p.ok()) return p.status();
    absl::StatusOr<kvhost::v1::StrideAlignment> aligned = (*c)->IsStridePageAligned(*p, alignment);
    if (!aligned.ok()) return aligned.status();
    return kvhost::c_api::WriteJson(*aligned, out, out_len, needed, "the stride alignment");
  });
}

int kvhost_contiguous_buffer_infos_json(kvhost_client* client, const char* pool, char* out,
                                        size_t out_len, size_t* needed, char* err, size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    absl::StatusOr<kvhost::Client*> c = ClientOf(client);
    if (!c.ok()) return c.status();
    absl::StatusOr<std::string> p = Str(pool, "pool name");
    if (!p.ok()) return p.status();
    absl::StatusOr<kvhost::v1::ContiguousBufferInfos> infos = (*c)->GetContiguousBufferInfos(*p);
    if (!infos.ok()) return infos.status();
    return kvhost::c_api::WriteJson(*infos, out, out_len, needed, "the contiguous buffer infos");
  });
}

int kvhost_get_data_page(kvhost_client* client, const char* pool, int64_t index, void* data,
                         size_t data_len, size_t* size, char* err, size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    absl::StatusOr<kvhost::Client*> c = ClientOf(client);
    if (!c.ok()) return c.status();
    absl::StatusOr<std::string> p = Str(pool, "pool name");
    if (!p.ok()) return p.status();
    absl::StatusOr<std::string> page = (*c)->GetDataPage(*p, index);
    if (!page.ok()) return page.status();
    return kvhost::c_api::WriteBytes(*page, data, data_len, size,
                                     absl::StrCat("page ", index, " of pool '", *p, "'").c_str());
  });
}

int kvhost_set_from_flat_data_page(kvhost_client* client, const char* pool, int64_t index,
                                   const void* data, size_t data_len, char* err, size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    absl::StatusOr<kvhost::Client*> c = ClientOf(client);
    if (!c.ok()) return c.status();
    absl::StatusOr<std::string> p = Str(pool, "pool name");
    if (!p.ok()) return p.status();
    if (data == nullptr && data_len != 0) {
      return absl::InvalidArgumentError(absl::StrCat("data is NULL with a length of ", data_len));
    }
    return (*c)->SetFromFlatDataPage(*p, index,
                                     absl::string_view(static_cast<const char*>(data), data_len));
  });
}

int kvhost_read_pages(kvhost_client* client, const char* pool, const int64_t* indices,
                      size_t num_indices, uint32_t chunk_bytes, void* data, size_t data_len,
                      size_t* size, char* err, size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    absl::StatusOr<kvhost::Client*> c = ClientOf(client);
    if (!c.ok()) return c.status();
    absl::StatusOr<std::string> p = Str(pool, "pool name");
    if (!p.ok()) return p.status();
    absl::StatusOr<absl::Span<const int64_t>> in = Indices(indices, num_indices, "indices");
    if (!in.ok()) return in.status();
    // The size first, so that a short buffer costs no stream.
    absl::StatusOr<size_t> needed = kvhost::c_api::PagesBytes(**c, *p, num_indices);
    if (!needed.ok()) return needed.status();
    if (size != nullptr) *size = *needed;
    const std::string what = absl::StrCat(num_indices, " pages of pool '", *p, "'");
    if (*needed > 0 && (data == nullptr || data_len < *needed)) {
      return absl::OutOfRangeError(absl::StrCat(what, " need ", *needed, " bytes; the buffer has ",
                                                data == nullptr ? 0 : data_len));
    }
    absl::StatusOr<std::vector<std::string>> pages = (*c)->ReadPages(*p, *in, chunk_bytes);
    if (!pages.ok()) return pages.status();
    // The pool may have been replaced between the two calls: its pages are
    // checked against the buffer again, and nothing is written unless all fit.
    size_t total = 0;
    for (const std::string& page : *pages) total += page.size();
    if (size != nullptr) *size = total;
    if (total > 0 && (data == nullptr || data_len < total)) {
      return absl::OutOfRangeError(absl::StrCat(what, " need ", total, " bytes; the buffer has ",
                                                data == nullptr ? 0 : data_len));
    }
    auto* out = static_cast<char*>(data);
    for (const std::string& page : *pages) {
      if (!page.empty()) std::memcpy(out, page.data(), page.size());
      out += page.size();
    }
    return absl::OkStatus();
  });
}

int kvhost_write_pages(kvhost_client* client, const char* pool, const int64_t* indices,
                       size_t num_indices, const void* data, size_t data_len, uint32_t chunk_bytes,
                       uint64_t* pages_written, char* err, size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    absl::StatusOr<kvhost::Client*> c = ClientOf(client);
    if (!c.ok()) return c.status();
    absl::StatusOr<std::string> p = Str(pool, "pool name");
    if (!p.ok()) return p.status();
    absl::StatusOr<absl::Span<const int64_t>> in = Indices(indices, num_indices, "indices");
    if (!in.ok()) return in.status();
    if (data == nullptr && data_len != 0) {
      return absl::InvalidArgumentError(absl::StrCat("data is NULL with a length of ", data_len));
    }
    // Every page's size before anything is sent: a stream that found out
    // at the second page would leave the first one written.
    absl::StatusOr<size_t> needed = kvhost::c_api::PagesBytes(**c, *p, num_indices);
    if (!needed.ok()) return needed.status();
    if (data_len != *needed) {
      return absl::InvalidArgumentError(absl::StrCat(
          "data has ", data_len, " bytes; ", num_indices, " pages of pool '", *p, "' have ",
          *needed, " (", num_indices == 0 ? 0 : *needed / num_indices, " each)"));
    }
    std::vector<std::string> pages;
    pages.reserve(num_indices);
    const size_t page = num_indices == 0 ? 0 : *needed / num_indices;
    for (size_t i = 0; i < num_indices; ++i) {
      pages.emplace_back(static_cast<const char*>(data) + i * page, page);
    }
    absl::StatusOr<uint64_t> written = (*c)->WritePages(*p, *in, pages, chunk_bytes);
    if (!written.ok()) return written.status();
    if (pages_written != nullptr) *pages_written = *written;
    return absl::OkStatus();
  });
}

}  // extern "C"
