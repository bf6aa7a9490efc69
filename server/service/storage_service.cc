#include "server/service/storage_service.h"

#include <atomic>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/access/caller.h"
#include "server/access/credentials.h"
#include "server/service/call_scope.h"
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

void FillStore(const std::vector<PageResult>& results, uint64_t page_bytes,
               v1::StorePagesResponse* response) {
  const uint64_t stored = ToProto(results, PageOutcome::kStored, response->mutable_pages());
  response->set_stored_pages(stored);
  response->set_stored_bytes(stored * page_bytes);
}

void FillFetch(const std::vector<PageResult>& results, uint64_t page_bytes,
               v1::FetchPagesResponse* response) {
  const uint64_t hits = ToProto(results, PageOutcome::kHit, response->mutable_pages());
  response->set_hit_pages(hits);
  response->set_hit_bytes(hits * page_bytes);
}

// A detached call's results as its ticket keeps them: each detail cut as a
// reply cuts it, so that what the ticket keeps stays within
// StorageTicketTable::kBytesPerPage a page.
StorageTicketStatus Done(StorageCall call, std::vector<PageResult> results, uint64_t page_bytes) {
  for (PageResult& r : results) {
    if (r.detail.size() > StorageServiceImpl::kMaxDetailBytes) {
      r.detail = r.detail.substr(0, StorageServiceImpl::kMaxDetailBytes);
    }
  }
  StorageTicketStatus status;
  status.call = call;
  status.pages = std::move(results);
  status.page_bytes = page_bytes;
  return status;
}

// WaitStorage's reply: the ticket, and once done the response its call
// would have returned had it waited (its ticket_id set).
void ToProto(const StorageTicketStatus& status, v1::StorageTicketStatus* out) {
  out->set_ticket_id(status.id);
  out->set_done(status.done);
  if (!status.done) return;
  if (status.call == StorageCall::kStore) {
    FillStore(status.pages, status.page_bytes, out->mutable_store());
    out->mutable_store()->set_ticket_id(status.id);
  } else {
    FillFetch(status.pages, status.page_bytes, out->mutable_fetch());
    out->mutable_fetch()->set_ticket_id(status.id);
  }
}

// Holds a WaitStorage call open until its ticket is done or the call is
// cancelled; whichever comes first finishes it (the flag, shared with the
// waiter, says which), as TransferService's WaitTransfer does. A waiter
// that lost to a cancel says so (the ticket stays either way).
class StorageWaitReactor final : public grpc::ServerUnaryReactor {
 public:
  StorageWaitReactor(std::shared_ptr<StorageTicketTable> tickets, v1::StorageTicketStatus* response)
      : tickets_(std::move(tickets)), response_(response), shared_(std::make_shared<Shared>()) {}

  // Touches nothing of `this` after Wait: the waiter may have finished the
  // call, and gRPC deleted it, by then.
  void Start(const std::shared_ptr<Pool>& pool, uint64_t id, bool poll) {
    std::shared_ptr<Shared> shared = shared_;
    shared->id = id;
    absl::StatusOr<uint64_t> waiter =
        tickets_->Wait(pool, id, poll, [this, shared](const StorageTicketStatus& status) {
          if (shared->taken.exchange(true)) return false;
          ToProto(status, response_);
          Finish(grpc::Status::OK);
          return true;
        });
    if (!waiter.ok()) {
      if (!shared->taken.exchange(true)) Finish(ToGrpcStatus(waiter.status()));
      return;
    }
    shared->waiter.store(*waiter);
  }

  void OnCancel() override {
    if (shared_->taken.exchange(true)) return;
    tickets_->Unwait(shared_->id, shared_->waiter.load());
    Finish(grpc::Status(grpc::StatusCode::CANCELLED,
                        "WaitStorage cancelled before the ticket was done"));
  }
  void OnDone() override { delete this; }

 private:
  struct Shared {
    std::atomic<bool> taken{false};
    uint64_t id = 0;
    std::atomic<uint64_t> waiter{0};  // 0 until Wait returned
  };
  const std::shared_ptr<StorageTicketTable> tickets_;
  v1::StorageTicketStatus* const response_;
  const std::shared_ptr<Shared> shared_;
};

}  // namespace

absl::StatusOr<std::shared_ptr<Pool>> StorageServiceImpl::PagesPool(
    const grpc::CallbackServerContext& context, const std::string& pool, int indices,
    int keys) const {
  if (tier_ == nullptr) return NoTier();
  return OpenCallPool(
      *registry_, pool, TokenOf(OwnerToken(context)), max_indices_,
      {{"indices", static_cast<uint64_t>(indices)}, {"keys", static_cast<uint64_t>(keys)}});
}

absl::StatusOr<std::string> StorageServiceImpl::Namespace(
    const grpc::CallbackServerContext& context, const Pool& pool) const {
  const std::optional<std::string> token = OwnerToken(context);
  return L3Namespace(tier_->secret(), pool, TokenOf(token));
}

grpc::ServerUnaryReactor* StorageServiceImpl::StorePages(grpc::CallbackServerContext* context,
                                                         const v1::StorePagesRequest* request,
                                                         v1::StorePagesResponse* response) {
  absl::StatusOr<std::shared_ptr<Pool>> pool =
      PagesPool(*context, request->pool(), request->indices_size(), request->keys_size());
  if (!pool.ok()) return FinishCall(context, pool.status());
  absl::StatusOr<std::string> ns = Namespace(*context, **pool);
  if (!ns.ok()) return FinishCall(context, ns.status());
  const uint64_t page_bytes = (*pool)->flat_page_bytes();
  const uint64_t pages = static_cast<uint64_t>(request->indices_size());
  if (request->detach()) {
    absl::StatusOr<uint64_t> opened = tickets_->Open(*pool, pages);
    if (!opened.ok()) return FinishCall(context, opened.status());
    const uint64_t id = *opened;
    absl::Status accepted = tier_->Store(
        *pool, *ns, Indices(request->indices()), Keys(request->keys()),
        [tickets = tickets_, id, page_bytes, pages](std::vector<PageResult> results) {
          tickets->Finish(id, Done(StorageCall::kStore, std::move(results), page_bytes), pages);
        });
    if (!accepted.ok()) {
      tickets_->Discard(id);
      return FinishCall(context, accepted);
    }
    response->set_ticket_id(id);
    return FinishCall(context, absl::OkStatus());
  }
  auto* reactor = new OwnedUnaryReactor();
  absl::Status accepted =
      tier_->Store(*pool, *std::move(ns), Indices(request->indices()), Keys(request->keys()),
                   [reactor, response, page_bytes](std::vector<PageResult> results) {
                     FillStore(results, page_bytes, response);
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
  absl::StatusOr<std::string> ns = Namespace(*context, **pool);
  if (!ns.ok()) return FinishCall(context, ns.status());
  // A fetch writes the pool's pages later, on the tier's threads: checked
  // here, as a Backup is when submitted.
  if (absl::Status s = (*pool)->ChangeAllocation(CallerOf(*context).sessions, session_open_,
                                                 "FetchPages", [] { return absl::OkStatus(); });
      !s.ok()) {
    return FinishCall(context, s);
  }
  const uint64_t page_bytes = (*pool)->flat_page_bytes();
  const uint64_t pages = static_cast<uint64_t>(request->indices_size());
  if (request->detach()) {
    absl::StatusOr<uint64_t> opened = tickets_->Open(*pool, pages);
    if (!opened.ok()) return FinishCall(context, opened.status());
    const uint64_t id = *opened;
    absl::Status accepted = tier_->Fetch(
        *pool, *ns, Keys(request->keys()), Indices(request->indices()),
        [tickets = tickets_, id, page_bytes, pages](std::vector<PageResult> results) {
          tickets->Finish(id, Done(StorageCall::kFetch, std::move(results), page_bytes), pages);
        });
    if (!accepted.ok()) {
      tickets_->Discard(id);
      return FinishCall(context, accepted);
    }
    response->set_ticket_id(id);
    return FinishCall(context, absl::OkStatus());
  }
  auto* reactor = new OwnedUnaryReactor();
  absl::Status accepted =
      tier_->Fetch(*pool, *std::move(ns), Keys(request->keys()), Indices(request->indices()),
                   [reactor, response, page_bytes](std::vector<PageResult> results) {
                     FillFetch(results, page_bytes, response);
                     reactor->Finish(grpc::Status::OK);
                   });
  if (!accepted.ok()) reactor->Finish(ToGrpcStatus(accepted));
  return reactor;
}

grpc::ServerUnaryReactor* StorageServiceImpl::ExistPages(grpc::CallbackServerContext* context,
                                                         const v1::ExistPagesRequest* request,
                                                         v1::ExistPagesResponse* response) {
  if (tier_ == nullptr) return FinishCall(context, NoTier());
  if (request->pool().empty()) {
    return FinishCall(context, absl::InvalidArgumentError(
                                   "ExistPages names no pool: give the pool whose namespace to "
                                   "look in (a protected pool's keys are its owner token's)"));
  }
  absl::StatusOr<std::shared_ptr<Pool>> pool =
      PagesPool(*context, request->pool(), 0, request->keys_size());
  if (!pool.ok()) return FinishCall(context, pool.status());
  absl::StatusOr<std::string> ns = Namespace(*context, **pool);
  if (!ns.ok()) return FinishCall(context, ns.status());
  auto* reactor = new OwnedUnaryReactor();
  absl::Status accepted = tier_->Exist(*pool, *std::move(ns), Keys(request->keys()),
                                       [reactor, response](uint64_t prefix) {
                                         response->set_prefix_pages(prefix);
                                         reactor->Finish(grpc::Status::OK);
                                       });
  if (!accepted.ok()) reactor->Finish(ToGrpcStatus(accepted));
  return reactor;
}

grpc::ServerUnaryReactor* StorageServiceImpl::WaitStorage(grpc::CallbackServerContext* context,
                                                          const v1::WaitStorageRequest* request,
                                                          v1::StorageTicketStatus* response) {
  absl::StatusOr<std::shared_ptr<Pool>> pool = PagesPool(*context, request->pool(), 0, 0);
  if (!pool.ok()) return FinishCall(context, pool.status());
  auto* reactor = new StorageWaitReactor(tickets_, response);
  reactor->Start(*pool, request->ticket_id(), request->poll());
  return reactor;
}

}  // namespace kvhost
