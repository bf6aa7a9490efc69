#include "server/service/pool_service.h"

#include <google/protobuf/io/coded_stream.h>

#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "server/service/convert.h"
#include "spdlog/spdlog.h"

namespace kvhost {
namespace {

grpc::ServerUnaryReactor* Finish(grpc::CallbackServerContext* context, const absl::Status& status) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

absl::Span<const int64_t> Indices(const google::protobuf::RepeatedField<int64_t>& field) {
  return absl::MakeConstSpan(field.data(), field.size());
}

}  // namespace

grpc::ServerUnaryReactor* PoolServiceImpl::CreatePool(grpc::CallbackServerContext* context,
                                                      const v1::CreatePoolRequest* request,
                                                      v1::Pool* response) {
  absl::StatusOr<PoolSpec> spec = FromProto(request->spec());
  if (!spec.ok()) {
    return Finish(context, WithPool(request->name(), spec.status()));
  }
  absl::StatusOr<std::shared_ptr<Pool>> pool =
      registry_->Create(request->name(), *spec, [context] { return context->IsCancelled(); });
  if (!pool.ok()) {
    spdlog::warn("CreatePool '{}' refused: {}", request->name(), pool.status().ToString());
    return Finish(context, pool.status());
  }
  spdlog::info("created pool '{}': {}, {} tokens, {:.3f} GB in {}", request->name(),
               DescribeSpec(*spec), (*pool)->size_tokens(), (*pool)->bytes() / 1e9,
               (*pool)->region_paths()[0]);
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
  absl::StatusOr<std::shared_ptr<Pool>> pool = registry_->Get(request->pool());
  if (!pool.ok()) return Finish(context, pool.status());
  if (metrics_ != nullptr) metrics_->pool_alloc_calls->WithLabels({request->pool()})->Increment();
  const auto failed = [&](const absl::Status& status) {
    if (metrics_ != nullptr) {
      metrics_->pool_alloc_failures->WithLabels({request->pool()})->Increment();
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
      return failed(WithPool(
          request->pool(), absl::ResourceExhaustedError(absl::StrCat(
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
  absl::StatusOr<std::shared_ptr<Pool>> pool = registry_->Get(request->pool());
  if (!pool.ok()) return Finish(context, pool.status());
  if (metrics_ != nullptr) metrics_->pool_free_calls->WithLabels({request->pool()})->Increment();
  absl::StatusOr<uint64_t> freed = (*pool)->Free(Indices(request->indices()));
  if (!freed.ok()) return Finish(context, freed.status());
  response->set_freed(*freed);
  response->set_available_tokens((*pool)->allocator().available_tokens());
  return Finish(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* PoolServiceImpl::GetPageBufferMeta(
    grpc::CallbackServerContext* context, const v1::GetPageBufferMetaRequest* request,
    v1::PageBufferMeta* response) {
  absl::StatusOr<std::shared_ptr<Pool>> pool = registry_->Get(request->pool());
  if (!pool.ok()) return Finish(context, pool.status());
  absl::StatusOr<std::vector<RegionSegment>> segments =
      (*pool)->PageBufferMeta(Indices(request->indices()));
  if (!segments.ok()) return Finish(context, segments.status());
  for (const std::string& path : (*pool)->region_paths()) response->add_region_paths(path);
  response->mutable_segments()->Reserve(static_cast<int>(segments->size()));
  for (const RegionSegment& s : *segments) {
    v1::Segment* out = response->add_segments();
    out->set_region_index(s.region);
    out->set_offset(s.offset);
    out->set_length(s.length);
  }
  return Finish(context, absl::OkStatus());
}

}  // namespace kvhost
