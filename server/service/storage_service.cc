#include "server/service/storage_service.h"

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/service/convert.h"

namespace kvhost {
namespace {

absl::Status NoTier() {
  return absl::FailedPreconditionError(
      "this kvhostd has no L3 tier: start it with --l3-memcached=host:port,...");
}

std::vector<std::string> Keys(const google::protobuf::RepeatedPtrField<std::string>& keys) {
  return std::vector<std::string>(keys.begin(), keys.end());
}

std::vector<int64_t> Indices(const google::protobuf::RepeatedField<int64_t>& indices) {
  return std::vector<int64_t>(indices.begin(), indices.end());
}

// Fills `pages` from `results`; returns the pages whose outcome is `good`.
uint64_t ToProto(const std::vector<PageResult>& results, PageOutcome good,
                 google::protobuf::RepeatedPtrField<v1::PageResult>* pages) {
  uint64_t count = 0;
  pages->Reserve(static_cast<int>(results.size()));
  for (const PageResult& r : results) {
    v1::PageResult* page = pages->Add();
    page->set_outcome(static_cast<v1::PageOutcome>(r.outcome));
    page->set_detail(r.detail.substr(0, StorageServiceImpl::kMaxDetailBytes));
    if (r.outcome == good) ++count;
  }
  return count;
}

}  // namespace

absl::StatusOr<std::shared_ptr<Pool>> StorageServiceImpl::PagesPool(
    const grpc::CallbackServerContext& context, const std::string& pool, int indices,
    int keys) const {
  if (tier_ == nullptr) return NoTier();
  if (absl::Status s = CheckIndexCount("indices", static_cast<uint64_t>(indices), max_indices_);
      !s.ok()) {
    return WithPool(pool, s);
  }
  if (absl::Status s = CheckIndexCount("keys", static_cast<uint64_t>(keys), max_indices_);
      !s.ok()) {
    return WithPool(pool, s);
  }
  const std::optional<std::string> token = OwnerToken(context);
  if (absl::Status s = registry_->CheckOwner({pool}, token ? &*token : nullptr); !s.ok()) {
    return s;
  }
  return registry_->GetPoolOrAnchor(pool);
}

grpc::ServerUnaryReactor* StorageServiceImpl::StorePages(grpc::CallbackServerContext* context,
                                                         const v1::StorePagesRequest* request,
                                                         v1::StorePagesResponse* response) {
  absl::StatusOr<std::shared_ptr<Pool>> pool =
      PagesPool(*context, request->pool(), request->indices_size(), request->keys_size());
  if (!pool.ok()) return FinishCall(context, pool.status());
  auto* reactor = new OwnedUnaryReactor();
  const uint64_t page_bytes = (*pool)->flat_page_bytes();
  absl::Status accepted = tier_->Store(
      *pool, Indices(request->indices()), Keys(request->keys()),
      [reactor, response, page_bytes](std::vector<PageResult> results) {
        const uint64_t stored = ToProto(results, PageOutcome::kStored, response->mutable_pages());
        response->set_stored_pages(stored);
        response->set_stored_bytes(stored * page_bytes);
        reactor->Finish(grpc::Status::OK);
      });
  if (!accepted.ok()) reactor->Finish(ToGrpcStatus(accepted));
  return reactor;
}

grpc::ServerUnaryReactor* StorageServiceImpl::FetchPages(grpc::CallbackServerContext* context,
                                                         const v1::FetchPagesRequest* request,
                                                         v1::FetchPagesResponse* response) {
  absl::StatusOr<std::shared_ptr<Pool>> pool =
      PagesPool(*context, request->pool(), request->indices_size(), request->keys_size());
  if (!pool.ok()) return FinishCall(context, pool.status());
  auto* reactor = new OwnedUnaryReactor();
  const uint64_t page_bytes = (*pool)->flat_page_bytes();
  absl::Status accepted = tier_->Fetch(
      *pool, Keys(request->keys()), Indices(request->indices()),
      [reactor, response, page_bytes](std::vector<PageResult> results) {
        const uint64_t hits = ToProto(results, PageOutcome::kHit, response->mutable_pages());
        response->set_hit_pages(hits);
        response->set_hit_bytes(hits * page_bytes);
        reactor->Finish(grpc::Status::OK);
      });
  if (!accepted.ok()) reactor->Finish(ToGrpcStatus(accepted));
  return reactor;
}

grpc::ServerUnaryReactor* StorageServiceImpl::ExistPages(grpc::CallbackServerContext* context,
                                                         const v1::ExistPagesRequest* request,
                                                         v1::ExistPagesResponse* response) {
  if (tier_ == nullptr) return FinishCall(context, NoTier());
  if (absl::Status s =
          CheckIndexCount("keys", static_cast<uint64_t>(request->keys_size()), max_indices_);
      !s.ok()) {
    return FinishCall(context, s);
  }
  auto* reactor = new OwnedUnaryReactor();
  absl::Status accepted = tier_->Exist(Keys(request->keys()), [reactor, response](uint64_t prefix) {
    response->set_prefix_pages(prefix);
    reactor->Finish(grpc::Status::OK);
  });
  if (!accepted.ok()) reactor->Finish(ToGrpcStatus(accepted));
  return reactor;
}

}  // namespace kvhost
