#include "server/service/transfer_service.h"

#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <google/protobuf/io/coded_stream.h>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "server/access/credentials.h"
#include "server/safe_text.h"
#include "server/service/call_scope.h"
#include "server/service/convert.h"
#include "spdlog/spdlog.h"

namespace kvhost {
namespace {

// Holds a WaitTransfer call open until its ticket finishes or the call is
// cancelled. Whichever comes first finishes the call; the other finds the
// flag taken and leaves the reactor alone (it may already be deleted, which
// is why the flag lives in a shared object the ticket's callback owns too).
class WaitReactor final : public grpc::ServerUnaryReactor {
 public:
  WaitReactor(std::shared_ptr<Ticket> ticket, v1::TransferStatus* response)
      : ticket_(std::move(ticket)), response_(response), finished_(std::make_shared<Flag>()) {}

  void Start() {
    std::shared_ptr<Flag> finished = finished_;
    ticket_->OnDone([this, finished] {
      if (finished->taken.exchange(true)) return;
      const TicketStatus status = ticket_->Snapshot();
      if (status.status.ok()) ToProto(status, response_);
      Finish(ToGrpcStatus(status.status));
    });
  }

  void OnCancel() override {
    if (finished_->taken.exchange(true)) return;
    Finish(grpc::Status(grpc::StatusCode::CANCELLED,
                        "WaitTransfer cancelled before the ticket finished"));
  }
  void OnDone() override { delete this; }

 private:
  struct Flag {
    std::atomic<bool> taken{false};
  };
  std::shared_ptr<Ticket> ticket_;
  v1::TransferStatus* response_;
  std::shared_ptr<Flag> finished_;
};

}  // namespace

grpc::ServerUnaryReactor* TransferServiceImpl::AttachDevice(grpc::CallbackServerContext* context,
                                                            const v1::AttachDeviceRequest* request,
                                                            v1::Attachment* response) {
  // Resolved once, the token checked on the pool or group that is then
  // attached (the name is not looked up again).
  const std::optional<std::string> token = OwnerToken(*context);
  absl::StatusOr<PoolTarget> target = registry_->Resolve(request->pool(), TokenOf(token));
  if (!target.ok()) return FinishCall(context, target.status());
  absl::StatusOr<AttachRequest> attach = FromProto(*request);
  if (!attach.ok()) return FinishCall(context, attach.status());
  if (attach->layer_progress && handoff_socket_.empty()) {
    return FinishCall(context,
                      absl::FailedPreconditionError(
                          "layer_progress needs kvhostd's handoff socket, and this kvhostd "
                          "has none (--handoff-socket='', or only TCP listeners)"));
  }
  // cuMem buffers: their descriptors, deposited on the handoff socket, are
  // lent for this call and used up if it succeeds.
  if (deposits_ == nullptr && NamesDeposits(*attach)) {
    return FinishCall(context,
                      absl::FailedPreconditionError(
                          "cuda_fd buffers need kvhostd's handoff socket to deposit their "
                          "descriptors, and this kvhostd has none (--handoff-socket='', or "
                          "only TCP listeners)"));
  }
  absl::StatusOr<Deposits::Lent> lent =
      deposits_ != nullptr ? deposits_->Lend(&*attach) : Deposits::Lent{};
  if (!lent.ok()) return FinishCall(context, lent.status());
  absl::StatusOr<AttachmentInfo> info = manager_->Attach(*target, *attach);
  if (!info.ok()) return FinishCall(context, info.status());
  if (deposits_ != nullptr) deposits_->UseUp(*lent);
  response->set_id(info->id);
  response->set_pool(info->pool);
  response->set_device_size_tokens(info->device_size_tokens);
  response->set_backend(manager_->backend());
  for (const std::string& handle : info->load_event_handles)
    response->add_load_event_handles(handle);
  response->set_load_event_sets(info->load_event_sets);
  response->set_start_layer(info->start_layer);
  response->set_end_layer(info->end_layer);
  if (info->tp_rank.has_value()) response->set_tp_rank(*info->tp_rank);
  response->set_load_only(info->load_only);
  response->set_group(info->group);
  response->set_session_id(info->session_id);
  response->set_layer_progress(info->layer_progress);
  // Where the caller fetches what it maps: layer counters, a worker copy's
  // regions, or its own view of the pool (a plain pool attached within a
  // session, HANDOFF_KIND_POOL_MAP).
  const bool maps_pool = !info->session_id.empty() && info->group.empty();
  if (info->layer_progress || maps_pool || manager_->ServesWorkerCopy(*info)) {
    response->set_handoff_socket(handoff_socket_);
  }
  return FinishCall(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* TransferServiceImpl::DetachDevice(grpc::CallbackServerContext* context,
                                                            const v1::DetachDeviceRequest* request,
                                                            v1::DetachDeviceResponse* response) {
  return FinishCall(context, manager_->Detach(CallerOf(*context), request->attachment_id()));
}

absl::Status TransferServiceImpl::Submit(
    const Caller& caller, Direction direction, const std::string& attachment_id,
    const google::protobuf::RepeatedField<int64_t>& host,
    const google::protobuf::RepeatedField<int64_t>& device, const std::string& wait_event_handle,
    const google::protobuf::RepeatedPtrField<v1::PoolTransfer>& pool_transfers, bool worker_copy,
    v1::TransferTicket* response, uint64_t max_reply_bytes) {
  const char* call = direction == Direction::kBackup ? "Backup" : "Load";
  absl::Status counts =
      CheckIndexCount(absl::StrCat(call, " host_indices"), host.size(), max_indices_);
  if (counts.ok()) {
    counts = CheckIndexCount(absl::StrCat(call, " device_indices"), device.size(), max_indices_);
  }
  for (const v1::PoolTransfer& t : pool_transfers) {
    if (!counts.ok()) break;
    counts = CheckIndexCount(absl::StrCat(call, " pool_transfers '", t.name(), "' host_indices"),
                             t.host_indices_size(), max_indices_);
    if (counts.ok()) {
      counts =
          CheckIndexCount(absl::StrCat(call, " pool_transfers '", t.name(), "' device_indices"),
                          t.device_indices_size(), max_indices_);
    }
  }
  if (!counts.ok()) return counts;
  // A node cache's pages move only by key (CacheService); a group's
  // entries are never node caches (PoolRegistry::CreateGroup refuses them).
  if (absl::StatusOr<std::shared_ptr<Pool>> pool =
          manager_->FindAttachedPool(caller, attachment_id);
      pool.ok()) {
    if (absl::Status s = RefuseNodeCache(**pool); !s.ok()) return s;
  }
  if (worker_copy) {
    return SubmitWorkerCopy(caller, direction, attachment_id,
                            absl::MakeConstSpan(host.data(), host.size()),
                            absl::MakeConstSpan(device.data(), device.size()), wait_event_handle,
                            !pool_transfers.empty(), response, max_reply_bytes);
  }
  std::vector<EntryRows> entries;
  entries.reserve(pool_transfers.size());
  for (const v1::PoolTransfer& t : pool_transfers) {
    entries.push_back({t.name(),
                       absl::MakeConstSpan(t.host_indices().data(), t.host_indices().size()),
                       absl::MakeConstSpan(t.device_indices().data(), t.device_indices().size())});
  }
  absl::StatusOr<std::shared_ptr<Ticket>> ticket = manager_->Submit(
      caller, attachment_id, direction, absl::MakeConstSpan(host.data(), host.size()),
      absl::MakeConstSpan(device.data(), device.size()), wait_event_handle, entries);
  if (!ticket.ok()) return ticket.status();
  response->set_id((*ticket)->id());
  response->set_event_set((*ticket)->event_set());
  response->set_layer_base((*ticket)->layer_base());
  return absl::OkStatus();
}

absl::Status TransferServiceImpl::DoBackup(const Caller& caller, const v1::BackupRequest& request,
                                           v1::TransferTicket* response, uint64_t max_reply_bytes) {
  return Submit(caller, Direction::kBackup, request.attachment_id(), request.host_indices(),
                request.device_indices(), request.wait_event_handle(), request.pool_transfers(),
                request.worker_copy(), response, max_reply_bytes);
}

absl::Status TransferServiceImpl::DoLoad(const Caller& caller, const v1::LoadRequest& request,
                                         v1::TransferTicket* response, uint64_t max_reply_bytes) {
  return Submit(caller, Direction::kLoad, request.attachment_id(), request.host_indices(),
                request.device_indices(), request.wait_event_handle(), request.pool_transfers(),
                request.worker_copy(), response, max_reply_bytes);
}

absl::Status TransferServiceImpl::DoAllocBackup(const Caller& caller,
                                                const v1::AllocBackupRequest& request,
                                                v1::AllocBackupResponse* response,
                                                uint64_t max_reply_bytes) {
  const v1::BackupRequest& backup = request.backup();
  if (!backup.host_indices().empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("AllocBackup: backup.host_indices has ", backup.host_indices_size(),
                     " entries; leave it empty, kvhostd allocates them"));
  }
  if (!backup.pool_transfers().empty() || backup.worker_copy()) {
    return absl::InvalidArgumentError(
        "AllocBackup serves a plain pool's attachment: backup.pool_transfers and "
        "backup.worker_copy must be unset (use Alloc, then Backup)");
  }
  if (absl::Status s =
          CheckIndexCount("AllocBackup device_indices", backup.device_indices_size(), max_indices_);
      !s.ok()) {
    return s;
  }
  absl::StatusOr<std::shared_ptr<Pool>> found =
      manager_->FindAttachedPool(caller, backup.attachment_id());
  if (!found.ok()) return found.status();
  Pool& pool = **found;
  const std::string name = pool.name();
  if (absl::Status s = RefuseNodeCache(pool); !s.ok()) return s;
  // On the attached pool itself, not on whatever bears its name.
  if (absl::Status s = CheckPoolOwner(pool, TokenOf(caller.token)); !s.ok()) {
    return s;
  }
  const uint64_t n = static_cast<uint64_t>(backup.device_indices_size());
  using google::protobuf::io::CodedOutputStream;
  const uint64_t reply_bytes =
      n * CodedOutputStream::VarintSize64(pool.size_tokens()) + kAllocBackupReplyOverhead;
  if (reply_bytes > max_reply_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "pool '", name, "': AllocBackup of ", n, " tokens needs a reply of up to ", reply_bytes,
        " bytes, over the ", max_reply_bytes, "-byte limit; back up in smaller batches"));
  }
  // Another session's AllocBackup on a pool an sglang instance holds is
  // refused as its Alloc is (ClaimPool).
  return pool.ChangeAllocation(
      caller.sessions, [this](const std::string& id) { return manager_->IsSessionOpen(id); },
      "AllocBackup", [&] { return AllocThenBackUp(caller, backup, pool, n, response); });
}

absl::Status TransferServiceImpl::AllocThenBackUp(const Caller& caller,
                                                  const v1::BackupRequest& backup, Pool& pool,
                                                  uint64_t n, v1::AllocBackupResponse* response) {
  const std::string& name = pool.name();
  absl::StatusOr<std::vector<uint64_t>> pages = pool.AllocPages(n);
  if (!pages.ok()) return pages.status();
  const uint64_t ps = pool.layout().page_size;
  auto* host = response->mutable_host_indices();
  host->Reserve(static_cast<int>(n));
  for (uint64_t page : *pages) {
    for (uint64_t j = 0; j < ps; ++j) host->AddAlreadyReserved(static_cast<int64_t>(page * ps + j));
  }
  absl::StatusOr<std::shared_ptr<Ticket>> ticket = manager_->Submit(
      caller, backup.attachment_id(), Direction::kBackup,
      absl::MakeConstSpan(host->data(), host->size()),
      absl::MakeConstSpan(backup.device_indices().data(), backup.device_indices().size()),
      backup.wait_event_handle());
  if (!ticket.ok()) {
    // Refused before anything was queued: the slots go back.
    if (absl::StatusOr<uint64_t> freed = pool.Free(absl::MakeConstSpan(host->data(), host->size()));
        !freed.ok()) {
      spdlog::error("AllocBackup on pool '{}': cannot free the {} slots of a refused backup: {}",
                    name, n, freed.status().ToString());
    }
    response->Clear();
    return ticket.status();
  }
  v1::TransferTicket* out = response->mutable_ticket();
  out->set_id((*ticket)->id());
  out->set_event_set((*ticket)->event_set());
  out->set_layer_base((*ticket)->layer_base());
  response->set_available_tokens(pool.allocator().available_tokens());
  return absl::OkStatus();
}

absl::Status TransferServiceImpl::DoWaitTransfer(const Caller& caller,
                                                 const v1::WaitTransferRequest& request,
                                                 v1::TransferStatus* response,
                                                 absl::Duration timeout) {
  absl::StatusOr<std::shared_ptr<Ticket>> ticket =
      manager_->FindTicket(caller, request.ticket_id());
  if (!ticket.ok()) return ticket.status();
  if (!request.poll()) {
    struct Done {
      absl::Mutex mu;
      bool done ABSL_GUARDED_BY(mu) = false;
    };
    auto done = std::make_shared<Done>();
    (*ticket)->OnDone([done] {
      absl::MutexLock lock(&done->mu);
      done->done = true;
    });
    absl::MutexLock lock(&done->mu);
    if (!done->mu.AwaitWithTimeout(absl::Condition(&done->done), timeout)) {
      return absl::DeadlineExceededError(absl::StrCat("ticket ", request.ticket_id(),
                                                      " did not finish within ",
                                                      absl::FormatDuration(timeout)));
    }
  }
  const TicketStatus now = (*ticket)->Snapshot();
  if (now.done && !now.status.ok()) return now.status;
  ToProto(now, response);
  return absl::OkStatus();
}

absl::Status TransferServiceImpl::SubmitWorkerCopy(
    const Caller& caller, Direction direction, const std::string& attachment_id,
    absl::Span<const int64_t> host, absl::Span<const int64_t> device,
    const std::string& wait_event_handle, bool pool_transfers, v1::TransferTicket* response,
    uint64_t max_reply_bytes) {
  if (!wait_event_handle.empty()) {
    return absl::InvalidArgumentError(
        "wait_event_handle must be empty with worker_copy: the worker's copy runs on its own "
        "stream, after its writes");
  }
  if (pool_transfers) {
    return absl::FailedPreconditionError(
        "pool_transfers with worker_copy: worker copies serve plain pools only (leave "
        "worker_copy unset for a pool group's transfers)");
  }
  absl::StatusOr<WorkerCopyTicket> ticket =
      manager_->SubmitWorkerCopy(caller, attachment_id, direction, host, device, max_reply_bytes);
  if (!ticket.ok()) return ticket.status();
  response->set_id(ticket->ticket->id());
  response->set_event_set(-1);
  if (ticket->plan != nullptr) ToProto(*ticket->plan, response->mutable_worker_copy());
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* TransferServiceImpl::Backup(grpc::CallbackServerContext* context,
                                                      const v1::BackupRequest* request,
                                                      v1::TransferTicket* response) {
  return FinishCall(context, DoBackup(CallerOf(*context), *request, response, max_reply_bytes_));
}

grpc::ServerUnaryReactor* TransferServiceImpl::Load(grpc::CallbackServerContext* context,
                                                    const v1::LoadRequest* request,
                                                    v1::TransferTicket* response) {
  return FinishCall(context, DoLoad(CallerOf(*context), *request, response, max_reply_bytes_));
}

grpc::ServerUnaryReactor* TransferServiceImpl::AllocBackup(grpc::CallbackServerContext* context,
                                                           const v1::AllocBackupRequest* request,
                                                           v1::AllocBackupResponse* response) {
  return FinishCall(context,
                    DoAllocBackup(CallerOf(*context), *request, response, max_reply_bytes_));
}

grpc::ServerUnaryReactor* TransferServiceImpl::WaitTransfer(grpc::CallbackServerContext* context,
                                                            const v1::WaitTransferRequest* request,
                                                            v1::TransferStatus* response) {
  absl::StatusOr<std::shared_ptr<Ticket>> ticket =
      manager_->FindTicket(CallerOf(*context), request->ticket_id());
  if (!ticket.ok()) return FinishCall(context, ticket.status());
  const TicketStatus now = (*ticket)->Snapshot();
  if (now.done || request->poll()) {
    if (now.done && !now.status.ok()) return FinishCall(context, now.status);
    ToProto(now, response);
    return FinishCall(context, absl::OkStatus());
  }
  auto* reactor = new WaitReactor(*std::move(ticket), response);
  reactor->Start();
  return reactor;
}

grpc::ServerUnaryReactor* TransferServiceImpl::FinishWorkerCopy(
    grpc::CallbackServerContext* context, const v1::FinishWorkerCopyRequest* request,
    v1::FinishWorkerCopyResponse* response) {
  // The worker's text ends in the ticket's status, which WaitTransfer sends
  // as a status message: escaped and bounded.
  return FinishCall(
      context, manager_->FinishWorkerCopy(CallerOf(*context), request->ticket_id(),
                                          request->error().empty()
                                              ? std::string()
                                              : SafeText(request->error(), kMaxEchoedBytes * 4)));
}

}  // namespace kvhost
