#include "server/service/pool_service.h"

#include <google/protobuf/io/coded_stream.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/types/span.h"
#include "server/safe_text.h"
#include "server/service/convert.h"
#include "spdlog/spdlog.h"

namespace kvhost {
namespace {

grpc::ServerUnaryReactor* Finish(grpc::CallbackServerContext* context, const absl::Status& status) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

// The owner check of a call on `names` (PoolRegistry::CheckOwner) with the
// call's kvhost-token metadata.
absl::Status Authorize(const PoolRegistry& registry, const grpc::CallbackServerContext& context,
                       std::vector<std::string> names) {
  const std::optional<std::string> token = OwnerToken(context);
  return registry.CheckOwner(names, token ? &*token : nullptr);
}

absl::Span<const int64_t> Indices(const google::protobuf::RepeatedField<int64_t>& field) {
  return absl::MakeConstSpan(field.data(), field.size());
}

absl::Span<uint8_t> Bytes(std::string* s) {
  return absl::MakeSpan(reinterpret_cast<uint8_t*>(s->data()), s->size());
}

absl::Span<const uint8_t> Bytes(const std::string& s) {
  return absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(s.data()), s.size());
}

void ToProto(absl::Span<const RegionSegment> segments, const Pool& pool,
             v1::PageBufferMeta* out) {
  for (const std::string& path : pool.region_paths()) out->add_region_paths(path);
  out->mutable_segments()->Reserve(static_cast<int>(segments.size()));
  for (const RegionSegment& s : segments) {
    v1::Segment* segment = out->add_segments();
    segment->set_region_index(s.region);
    segment->set_offset(s.offset);
    segment->set_length(s.length);
  }
}

// ReadPages: every index is checked before the first message; then each page
// is copied out whole (so each page is one consistent read) and sent in
// chunks, one message in flight at a time.
class PageReader final : public grpc::ServerWriteReactor<v1::PageData> {
 public:
  // `authorized`: the caller's owner check of request.pool(), done before
  // anything else (the indices are not even copied when it failed).
  PageReader(PoolRegistry* registry, const v1::ReadPagesRequest& request, uint64_t chunk_limit,
             const absl::Status& authorized)
      : indices_(authorized.ok() ? request.indices().begin() : request.indices().end(),
                 request.indices().end()) {
    absl::Status status = authorized.ok() ? Start(registry, request, chunk_limit) : authorized;
    if (!status.ok()) {
      Finish(ToGrpcStatus(status));
      return;
    }
    NextWrite();
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "ReadPages: the client went away"));
      return;
    }
    NextWrite();
  }

  void OnDone() override { delete this; }

 private:
  absl::Status Start(PoolRegistry* registry, const v1::ReadPagesRequest& request,
                     uint64_t chunk_limit) {
    absl::StatusOr<std::shared_ptr<Pool>> pool = registry->GetPoolOrAnchor(request.pool());
    if (!pool.ok()) return pool.status();
    pool_ = *std::move(pool);
    std::set<int64_t> seen;
    for (int64_t index : indices_) {
      if (absl::Status s = pool_->CheckPage(index); !s.ok()) return s;
      if (!seen.insert(index).second) {
        return WithPool(pool_->name(), absl::InvalidArgumentError(absl::StrCat(
                                           "ReadPages: page ", index, " is listed twice")));
      }
    }
    const uint64_t asked = request.chunk_bytes() == 0 ? PoolServiceImpl::kDefaultChunkBytes
                                                      : uint64_t{request.chunk_bytes()};
    chunk_bytes_ = std::max<uint64_t>(1, std::min(asked, chunk_limit));
    page_.resize(pool_->flat_page_bytes());
    return absl::OkStatus();
  }

  // Sends the next chunk, reading the next page first when the last one is
  // sent; finishes after the last page.
  void NextWrite() {
    if (offset_ >= page_.size() && sent_page_) {
      ++next_;
      offset_ = 0;
      sent_page_ = false;
    }
    if (next_ >= indices_.size()) {
      Finish(grpc::Status::OK);
      return;
    }
    const int64_t index = indices_[next_];
    if (offset_ == 0 && !sent_page_) {
      if (absl::Status s = pool_->ReadPage(index, absl::MakeSpan(page_)); !s.ok()) {
        Finish(ToGrpcStatus(s));
        return;
      }
    }
    const uint64_t n = std::min<uint64_t>(chunk_bytes_, page_.size() - offset_);
    message_.set_index(index);
    message_.set_offset(offset_);
    message_.set_page_bytes(page_.size());
    message_.set_data(page_.data() + offset_, n);
    offset_ += n;
    sent_page_ = true;  // a page of 0 bytes still gets its one message
    StartWrite(&message_);
  }

  const std::vector<int64_t> indices_;
  std::shared_ptr<Pool> pool_;
  uint64_t chunk_bytes_ = 0;
  std::vector<uint8_t> page_;
  size_t next_ = 0;         // indices_[next_] is the page being sent
  uint64_t offset_ = 0;     // bytes of it sent
  bool sent_page_ = false;  // a message of it went out
  v1::PageData message_;    // valid until OnWriteDone
};

// WritePages: chunks are checked as they arrive; a page is buffered until its
// last byte came and then written in one WritePage call, so a failed stream
// leaves every page either fully written or untouched.
class PageWriter final : public grpc::ServerReadReactor<v1::WritePagesChunk> {
 public:
  // `token`: the call's kvhost-token metadata; `max_pages`: the most pages
  // one stream may write (--max-indices-per-call).
  PageWriter(PoolRegistry* registry, v1::WritePagesResponse* response,
             std::optional<std::string> token, uint64_t max_pages)
      : registry_(registry), response_(response), token_(std::move(token)), max_pages_(max_pages) {
    StartRead(&chunk_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // the client finished sending (or went away)
      if (pool_ != nullptr && in_page_) {
        Fail(absl::InvalidArgumentError(absl::StrCat(
            "the stream ended with page ", index_, " incomplete (", offset_, " of ", page_.size(),
            " bytes)")));
        return;
      }
      response_->set_pages_written(written_);
      Finish(grpc::Status::OK);
      return;
    }
    if (absl::Status s = Take(chunk_); !s.ok()) {
      Fail(s);
      return;
    }
    chunk_.Clear();
    StartRead(&chunk_);
  }

  void OnDone() override { delete this; }

 private:
  absl::Status Take(const v1::WritePagesChunk& chunk) {
    if (pool_ == nullptr) {
      if (chunk.pool().empty()) {
        return absl::InvalidArgumentError("WritePages: the first chunk must name the pool");
      }
      if (absl::Status s = registry_->CheckOwner({chunk.pool()}, token_ ? &*token_ : nullptr);
          !s.ok()) {
        return s;
      }
      absl::StatusOr<std::shared_ptr<Pool>> pool = registry_->GetPoolOrAnchor(chunk.pool());
      if (!pool.ok()) return pool.status();
      pool_ = *std::move(pool);
      name_ = chunk.pool();
      page_.resize(pool_->flat_page_bytes());
    } else if (!chunk.pool().empty() && chunk.pool() != name_) {
      return absl::InvalidArgumentError(absl::StrCat("WritePages: chunk names pool '", chunk.pool(),
                                                     "' in a stream for pool '", name_, "'"));
    }
    if (!in_page_) {
      if (absl::Status s =
              CheckIndexCount("WritePages: pages in one stream", pages_started_ + 1, max_pages_);
          !s.ok()) {
        return WithPool(pool_->name(), s);
      }
      if (absl::Status s = pool_->CheckPage(chunk.index()); !s.ok()) return s;
      if (chunk.offset() != 0) {
        return WithPool(pool_->name(), absl::InvalidArgumentError(absl::StrCat(
                                           "WritePages: page ", chunk.index(),
                                           " starts at offset ", chunk.offset(), ", not 0")));
      }
      index_ = chunk.index();
      offset_ = 0;
      in_page_ = true;
      ++pages_started_;
    } else if (chunk.index() != index_ || chunk.offset() != offset_) {
      return WithPool(pool_->name(),
                      absl::InvalidArgumentError(absl::StrCat(
                          "WritePages: got page ", chunk.index(), " offset ", chunk.offset(),
                          " while page ", index_, " needs its bytes from offset ", offset_)));
    }
    if (chunk.data().size() > page_.size() - offset_) {
      return WithPool(pool_->name(),
                      absl::InvalidArgumentError(absl::StrCat(
                          "WritePages: page ", index_, " chunk at offset ", offset_, " has ",
                          chunk.data().size(), " bytes; a page of ", pool_->Label(), " has ",
                          page_.size())));
    }
    std::copy(chunk.data().begin(), chunk.data().end(), page_.begin() + offset_);
    offset_ += chunk.data().size();
    if (offset_ < page_.size()) return absl::OkStatus();
    in_page_ = false;
    if (absl::Status s = pool_->WritePage(index_, page_); !s.ok()) return s;
    ++written_;
    return absl::OkStatus();
  }

  void Fail(const absl::Status& status) {
    if (pool_ == nullptr) {  // nothing could have been written
      Finish(ToGrpcStatus(status));
      return;
    }
    Finish(ToGrpcStatus(absl::Status(
        status.code(), absl::StrCat(status.message(), " (", written_,
                                    written_ == 1 ? " page" : " pages",
                                    " written before this error stay written)"))));
  }

  PoolRegistry* const registry_;
  v1::WritePagesResponse* const response_;
  const std::optional<std::string> token_;
  const uint64_t max_pages_;
  uint64_t pages_started_ = 0;
  v1::WritePagesChunk chunk_;
  std::shared_ptr<Pool> pool_;
  std::string name_;  // as the first chunk named it (a pool, or a group for its anchor)
  std::vector<uint8_t> page_;
  bool in_page_ = false;
  int64_t index_ = 0;
  uint64_t offset_ = 0;
  uint64_t written_ = 0;
};

}  // namespace

grpc::ServerUnaryReactor* PoolServiceImpl::CreatePool(grpc::CallbackServerContext* context,
                                                      const v1::CreatePoolRequest* request,
                                                      v1::Pool* response) {
  absl::StatusOr<PoolSpec> spec = FromProto(request->spec());
  if (!spec.ok()) {
    return Finish(context, WithPool(request->name(), spec.status()));
  }
  // The token also opens a protected pool this one follows.
  const std::optional<std::string> token = OwnerToken(*context);
  absl::StatusOr<std::shared_ptr<Pool>> pool = registry_->Create(
      request->name(), *spec, [context] { return context->IsCancelled(); }, request->owner_token(),
      token ? &*token : nullptr);
  if (!pool.ok()) {
    spdlog::warn("CreatePool '{}' refused: {}", SafeText(request->name()),
                 SafeText(pool.status().ToString(), kMaxStatusMessageBytes));
    return Finish(context, pool.status());
  }
  const std::vector<std::string> paths = (*pool)->region_paths();  // none for LOGICAL
  spdlog::info("created pool '{}': {}, {} tokens, {:.3f} GB in {}{}", request->name(),
               DescribeSpec(*spec), (*pool)->size_tokens(), (*pool)->bytes() / 1e9,
               paths.empty() ? std::string("no region") : absl::StrJoin(paths, ", "),
               (*pool)->owner_protected() ? ", owner-protected" : "");
  ToProto(**pool, backend_, response);
  return Finish(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* PoolServiceImpl::GetPool(grpc::CallbackServerContext* context,
                                                   const v1::GetPoolRequest* request,
                                                   v1::Pool* response) {
  absl::StatusOr<std::shared_ptr<Pool>> pool = registry_->Get(request->name());
  if (pool.ok()) ToProto(**pool, backend_, response);
  return Finish(context, pool.status());
}

grpc::ServerUnaryReactor* PoolServiceImpl::ListPools(grpc::CallbackServerContext* context,
                                                     const v1::ListPoolsRequest* request,
                                                     v1::ListPoolsResponse* response) {
  for (const std::shared_ptr<Pool>& pool : registry_->List()) {
    ToProto(*pool, backend_, response->add_pools());
  }
  return Finish(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* PoolServiceImpl::DeletePool(grpc::CallbackServerContext* context,
                                                      const v1::DeletePoolRequest* request,
                                                      v1::DeletePoolResponse* response) {
  if (absl::Status s = Authorize(*registry_, *context, {request->name()}); !s.ok()) {
    return Finish(context, s);
  }
  absl::StatusOr<uint64_t> bytes = registry_->Delete(request->name());
  if (bytes.ok()) {
    response->set_bytes_released(*bytes);
    spdlog::info("deleted pool '{}' ({:.3f} GB)", request->name(), *bytes / 1e9);
  }
  return Finish(context, bytes.status());
}

grpc::ServerUnaryReactor* PoolServiceImpl::Alloc(grpc::CallbackServerContext* context,
                                                 const v1::AllocRequest* request,
                                                 v1::AllocResponse* response) {
  if (absl::Status s = CheckIndexCount("Alloc num_tokens", request->num_tokens(), max_indices_);
      !s.ok()) {
    return Finish(context, WithPool(request->pool(), s));
  }
  if (absl::Status s = Authorize(*registry_, *context, {request->pool()}); !s.ok()) {
    return Finish(context, s);
  }
  absl::StatusOr<std::shared_ptr<Pool>> pool = registry_->GetPoolOrAnchor(request->pool());
  if (!pool.ok()) return Finish(context, pool.status());
  // A group's name acts on its anchor, which the metrics count.
  const std::string& name = (*pool)->name();
  if (metrics_ != nullptr) metrics_->pool_alloc_calls->WithLabels({name})->Increment();
  const auto failed = [&](const absl::Status& status) {
    if (metrics_ != nullptr) {
      metrics_->pool_alloc_failures->WithLabels({name})->Increment();
    }
    return Finish(context, status);
  };
  // The indices must fit in one response: refuse before allocating, since a
  // response gRPC cannot send would leave the slots allocated and unknown.
  const uint64_t size = (*pool)->size_tokens();
  if (request->num_tokens() <= size) {
    using google::protobuf::io::CodedOutputStream;
    const uint64_t response_bytes =
        request->num_tokens() * CodedOutputStream::VarintSize64(size - 1) + 32;
    if (response_bytes > static_cast<uint64_t>(max_message_bytes_)) {
      return failed(
          WithPool(name, absl::ResourceExhaustedError(absl::StrCat(
                             "num_tokens ", request->num_tokens(), " needs a response of up to ",
                             response_bytes, " bytes, over the ", max_message_bytes_,
                             "-byte message limit; allocate in smaller batches"))));
    }
  }
  absl::StatusOr<std::vector<uint64_t>> pages = (*pool)->AllocPages(request->num_tokens());
  if (!pages.ok()) return failed(pages.status());
  const uint64_t ps = (*pool)->layout().page_size;
  auto* indices = response->mutable_indices();
  indices->Reserve(static_cast<int>(pages->size() * ps));
  for (uint64_t page : *pages) {
    for (uint64_t j = 0; j < ps; ++j)
      indices->AddAlreadyReserved(static_cast<int64_t>(page * ps + j));
  }
  response->set_available_tokens((*pool)->allocator().available_tokens());
  return Finish(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* PoolServiceImpl::Free(grpc::CallbackServerContext* context,
                                                const v1::FreeRequest* request,
                                                v1::FreeResponse* response) {
  if (absl::Status s = CheckIndexCount("Free indices", request->indices_size(), max_indices_);
      !s.ok()) {
    return Finish(context, WithPool(request->pool(), s));
  }
  if (absl::Status s = Authorize(*registry_, *context, {request->pool()}); !s.ok()) {
    return Finish(context, s);
  }
  absl::StatusOr<std::shared_ptr<Pool>> pool = registry_->GetPoolOrAnchor(request->pool());
  if (!pool.ok()) return Finish(context, pool.status());
  if (metrics_ != nullptr) metrics_->pool_free_calls->WithLabels({(*pool)->name()})->Increment();
  absl::StatusOr<uint64_t> freed = (*pool)->Free(Indices(request->indices()));
  if (!freed.ok()) return Finish(context, freed.status());
  response->set_freed(*freed);
  response->set_available_tokens((*pool)->allocator().available_tokens());
  return Finish(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* PoolServiceImpl::GetPageBufferMeta(
    grpc::CallbackServerContext* context, const v1::GetPageBufferMetaRequest* request,
    v1::PageBufferMeta* response) {
  if (absl::Status s =
          CheckIndexCount("GetPageBufferMeta indices", request->indices_size(), max_indices_);
      !s.ok()) {
    return Finish(context, WithPool(request->pool(), s));
  }
  absl::StatusOr<std::shared_ptr<Pool>> pool = registry_->GetPoolOrAnchor(request->pool());
  if (!pool.ok()) return Finish(context, pool.status());
  absl::StatusOr<std::vector<RegionSegment>> segments =
      (*pool)->PageBufferMeta(Indices(request->indices()));
  if (!segments.ok()) return Finish(context, segments.status());
  ToProto(*segments, **pool, response);
  return Finish(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* PoolServiceImpl::GetDataPage(grpc::CallbackServerContext* context,
                                                       const v1::PageRequest* request,
                                                       v1::PageData* response) {
  if (absl::Status s = Authorize(*registry_, *context, {request->pool()}); !s.ok()) {
    return Finish(context, s);
  }
  absl::StatusOr<std::shared_ptr<Pool>> pool = registry_->GetPoolOrAnchor(request->pool());
  if (!pool.ok()) return Finish(context, pool.status());
  if (absl::Status s = (*pool)->CheckPage(request->index()); !s.ok()) return Finish(context, s);
  const uint64_t bytes = (*pool)->flat_page_bytes();
  if (bytes + kMessageOverheadBytes > static_cast<uint64_t>(max_message_bytes_)) {
    return Finish(context, WithPool((*pool)->name(), absl::ResourceExhaustedError(absl::StrCat(
                                                         "a page has ", bytes, " bytes, over the ",
                                                         max_message_bytes_,
                                                         "-byte message limit; use ReadPages"))));
  }
  response->set_index(request->index());
  response->set_page_bytes(bytes);
  std::string* data = response->mutable_data();
  data->resize(bytes);
  return Finish(context, (*pool)->ReadPage(request->index(), Bytes(data)));
}

grpc::ServerUnaryReactor* PoolServiceImpl::SetFromFlatDataPage(
    grpc::CallbackServerContext* context, const v1::SetPageRequest* request,
    v1::SetPageResponse* response) {
  if (absl::Status s = Authorize(*registry_, *context, {request->pool()}); !s.ok()) {
    return Finish(context, s);
  }
  absl::StatusOr<std::shared_ptr<Pool>> pool = registry_->GetPoolOrAnchor(request->pool());
  if (!pool.ok()) return Finish(context, pool.status());
  // WritePage checks the page and the data's size first.
  return Finish(context, (*pool)->WritePage(request->index(), Bytes(request->data())));
}

grpc::ServerWriteReactor<v1::PageData>* PoolServiceImpl::ReadPages(
    grpc::CallbackServerContext* context, const v1::ReadPagesRequest* request) {
  // Half the message limit leaves room for the message's other fields and
  // keeps a chunk well inside what either side accepts.
  absl::Status authorized =
      CheckIndexCount("ReadPages indices", request->indices_size(), max_indices_);
  if (!authorized.ok()) {
    authorized = WithPool(request->pool(), authorized);
  } else {
    authorized = Authorize(*registry_, *context, {request->pool()});
  }
  return new PageReader(registry_, *request, static_cast<uint64_t>(max_message_bytes_) / 2,
                        authorized);
}

grpc::ServerReadReactor<v1::WritePagesChunk>* PoolServiceImpl::WritePages(
    grpc::CallbackServerContext* context, v1::WritePagesResponse* response) {
  return new PageWriter(registry_, response, OwnerToken(*context), max_indices_);
}

grpc::ServerUnaryReactor* PoolServiceImpl::GetPageShape(grpc::CallbackServerContext* context,
                                                        const v1::GetPageShapeRequest* request,
                                                        v1::PageShape* response) {
  absl::StatusOr<std::shared_ptr<Pool>> pool = registry_->GetPoolOrAnchor(request->pool());
  if (!pool.ok()) return Finish(context, pool.status());
  absl::StatusOr<std::vector<PagePart>> parts = (*pool)->PageShape();
  if (!parts.ok()) return Finish(context, parts.status());
  uint64_t bytes = 0;
  for (const PagePart& part : *parts) {
    v1::PageShape::Part* out = response->add_parts();
    out->set_component(part.component);
    for (uint64_t d : part.dims) out->add_dims(d);
    out->set_dtype(static_cast<v1::DType>(part.dtype));
    out->set_bytes(part.bytes);
    bytes += part.bytes;
  }
  response->set_bytes(bytes);
  return Finish(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* PoolServiceImpl::GetSplitHeadsPageBufferMeta(
    grpc::CallbackServerContext* context, const v1::SplitHeadsMetaRequest* request,
    v1::PageBufferMeta* response) {
  if (absl::Status s = CheckIndexCount("GetSplitHeadsPageBufferMeta indices",
                                       request->indices_size(), max_indices_);
      !s.ok()) {
    return Finish(context, WithPool(request->pool(), s));
  }
  absl::StatusOr<std::shared_ptr<Pool>> pool = registry_->GetPoolOrAnchor(request->pool());
  if (!pool.ok()) return Finish(context, pool.status());
  absl::StatusOr<std::vector<RegionSegment>> segments =
      (*pool)->SplitHeadsMeta(Indices(request->indices()), request->split_factor());
  if (!segments.ok()) return Finish(context, segments.status());
  ToProto(*segments, **pool, response);
  return Finish(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* PoolServiceImpl::IsStridePageAligned(
    grpc::CallbackServerContext* context, const v1::StrideAlignmentRequest* request,
    v1::StrideAlignment* response) {
  absl::StatusOr<std::shared_ptr<Pool>> pool = registry_->GetPoolOrAnchor(request->pool());
  if (!pool.ok()) return Finish(context, pool.status());
  absl::StatusOr<StrideCheck> check = (*pool)->StrideAlignment(request->alignment());
  if (!check.ok()) return Finish(context, check.status());
  response->set_aligned(check->aligned);
  for (uint64_t stride : check->page_strides) response->add_page_strides(stride);
  return Finish(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* PoolServiceImpl::GetContiguousBufferInfos(
    grpc::CallbackServerContext* context, const v1::ContiguousBufferInfosRequest* request,
    v1::ContiguousBufferInfos* response) {
  absl::StatusOr<std::shared_ptr<Pool>> pool = registry_->GetPoolOrAnchor(request->pool());
  if (!pool.ok()) return Finish(context, pool.status());
  absl::StatusOr<std::vector<BufferInfo>> infos = (*pool)->ContiguousBufferInfos();
  if (!infos.ok()) return Finish(context, infos.status());
  for (const std::string& path : (*pool)->region_paths()) response->add_region_paths(path);
  for (const BufferInfo& info : *infos) {
    v1::ContiguousBufferInfo* out = response->add_infos();
    out->set_component(info.component);
    out->set_layer(info.layer);
    out->set_region_index(info.range.region);
    out->set_offset(info.range.offset);
    out->set_length(info.range.length);
    out->set_item_bytes(info.item_bytes);
  }
  return Finish(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* PoolServiceImpl::CreatePoolGroup(
    grpc::CallbackServerContext* context, const v1::CreatePoolGroupRequest* request,
    v1::PoolGroup* response) {
  std::vector<std::string> pools;
  for (const v1::PoolEntry& entry : request->entries()) pools.push_back(entry.pool());
  if (absl::Status s = Authorize(*registry_, *context, std::move(pools)); !s.ok()) {
    return Finish(context, s);
  }
  absl::StatusOr<std::shared_ptr<PoolGroup>> group =
      registry_->CreateGroup(request->name(), request->layer_num(), FromProto(request->entries()));
  if (!group.ok()) {
    spdlog::warn("CreatePoolGroup '{}' refused: {}", SafeText(request->name()),
                 SafeText(group.status().ToString(), kMaxStatusMessageBytes));
    return Finish(context, group.status());
  }
  ToProto(**group, response);
  std::vector<std::string> entries;
  for (const GroupEntry& e : (*group)->entries()) {
    entries.push_back(absl::StrCat(e.name, "=", e.pool->name()));
  }
  spdlog::info("created pool group '{}': {} model layers, entries {}, anchor '{}'", request->name(),
               request->layer_num(), absl::StrJoin(entries, ", "), (*group)->anchor().name);
  return Finish(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* PoolServiceImpl::GetPoolGroup(grpc::CallbackServerContext* context,
                                                        const v1::GetPoolGroupRequest* request,
                                                        v1::PoolGroup* response) {
  absl::StatusOr<std::shared_ptr<PoolGroup>> group = registry_->GetGroup(request->name());
  if (group.ok()) ToProto(**group, response);
  return Finish(context, group.status());
}

grpc::ServerUnaryReactor* PoolServiceImpl::ListPoolGroups(grpc::CallbackServerContext* context,
                                                          const v1::ListPoolGroupsRequest* request,
                                                          v1::ListPoolGroupsResponse* response) {
  for (const std::shared_ptr<PoolGroup>& group : registry_->ListGroups()) {
    ToProto(*group, response->add_groups());
  }
  return Finish(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* PoolServiceImpl::DeletePoolGroup(
    grpc::CallbackServerContext* context, const v1::DeletePoolGroupRequest* request,
    v1::DeletePoolGroupResponse* response) {
  if (absl::Status s = Authorize(*registry_, *context, {request->name()}); !s.ok()) {
    return Finish(context, s);
  }
  absl::Status status = registry_->DeleteGroup(request->name());
  if (status.ok()) spdlog::info("deleted pool group '{}'", request->name());
  return Finish(context, status);
}

}  // namespace kvhost
