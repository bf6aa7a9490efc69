#include "server/service/transfer_service.h"

#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/safe_text.h"
#include "server/service/convert.h"

namespace kvhost {
namespace {

grpc::ServerUnaryReactor* Finish(grpc::CallbackServerContext* context, const absl::Status& status) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

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
  const std::optional<std::string> token = OwnerToken(*context);
  if (absl::Status s = registry_->CheckOwner({request->pool()}, token ? &*token : nullptr);
      !s.ok()) {
    return Finish(context, s);
  }
  absl::StatusOr<AttachRequest> attach = FromProto(*request);
  if (!attach.ok()) return Finish(context, attach.status());
  if (attach->layer_progress && handoff_socket_.empty()) {
    return Finish(context, absl::FailedPreconditionError(
                               "layer_progress needs kvhostd's handoff socket, and this kvhostd "
                               "has none (--handoff-socket='', or only TCP listeners)"));
  }
  // cuMem buffers: their descriptors, deposited on the handoff socket, are
  // lent for this call and used up if it succeeds.
  if (deposits_ == nullptr && NamesDeposits(*attach)) {
    return Finish(context, absl::FailedPreconditionError(
                               "cuda_fd buffers need kvhostd's handoff socket to deposit their "
                               "descriptors, and this kvhostd has none (--handoff-socket='', or "
                               "only TCP listeners)"));
  }
  absl::StatusOr<Deposits::Lent> lent =
      deposits_ != nullptr ? deposits_->Lend(&*attach) : Deposits::Lent{};
  if (!lent.ok()) return Finish(context, lent.status());
  absl::StatusOr<AttachmentInfo> info = manager_->Attach(request->pool(), *attach);
  if (!info.ok()) return Finish(context, info.status());
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
  if (info->layer_progress || manager_->ServesWorkerCopy(*info)) {
    response->set_handoff_socket(handoff_socket_);
  }
  return Finish(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* TransferServiceImpl::DetachDevice(grpc::CallbackServerContext* context,
                                                            const v1::DetachDeviceRequest* request,
                                                            v1::DetachDeviceResponse* response) {
  return Finish(context, manager_->Detach(CallerOf(*context), request->attachment_id()));
}

grpc::ServerUnaryReactor* TransferServiceImpl::Submit(
    grpc::CallbackServerContext* context, Direction direction, const std::string& attachment_id,
    const google::protobuf::RepeatedField<int64_t>& host,
    const google::protobuf::RepeatedField<int64_t>& device, const std::string& wait_event_handle,
    const google::protobuf::RepeatedPtrField<v1::PoolTransfer>& pool_transfers, bool worker_copy,
    v1::TransferTicket* response) {
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
  if (!counts.ok()) return Finish(context, counts);
  if (worker_copy) {
    return Finish(context, SubmitWorkerCopy(CallerOf(*context), direction, attachment_id,
                                            absl::MakeConstSpan(host.data(), host.size()),
                                            absl::MakeConstSpan(device.data(), device.size()),
                                            wait_event_handle, !pool_transfers.empty(), response));
  }
  std::vector<EntryRows> entries;
  entries.reserve(pool_transfers.size());
  for (const v1::PoolTransfer& t : pool_transfers) {
    entries.push_back({t.name(),
                       absl::MakeConstSpan(t.host_indices().data(), t.host_indices().size()),
                       absl::MakeConstSpan(t.device_indices().data(), t.device_indices().size())});
  }
  absl::StatusOr<std::shared_ptr<Ticket>> ticket = manager_->Submit(
      CallerOf(*context), attachment_id, direction, absl::MakeConstSpan(host.data(), host.size()),
      absl::MakeConstSpan(device.data(), device.size()), wait_event_handle, entries);
  if (!ticket.ok()) return Finish(context, ticket.status());
  response->set_id((*ticket)->id());
  response->set_event_set((*ticket)->event_set());
  response->set_layer_base((*ticket)->layer_base());
  return Finish(context, absl::OkStatus());
}

absl::Status TransferServiceImpl::SubmitWorkerCopy(
    const Caller& caller, Direction direction, const std::string& attachment_id,
    absl::Span<const int64_t> host, absl::Span<const int64_t> device,
    const std::string& wait_event_handle, bool pool_transfers, v1::TransferTicket* response) {
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
      manager_->SubmitWorkerCopy(caller, attachment_id, direction, host, device, max_reply_bytes_);
  if (!ticket.ok()) return ticket.status();
  response->set_id(ticket->ticket->id());
  response->set_event_set(-1);
  if (ticket->plan != nullptr) ToProto(*ticket->plan, response->mutable_worker_copy());
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* TransferServiceImpl::Backup(grpc::CallbackServerContext* context,
                                                      const v1::BackupRequest* request,
                                                      v1::TransferTicket* response) {
  return Submit(context, Direction::kBackup, request->attachment_id(), request->host_indices(),
                request->device_indices(), request->wait_event_handle(), request->pool_transfers(),
                request->worker_copy(), response);
}

grpc::ServerUnaryReactor* TransferServiceImpl::Load(grpc::CallbackServerContext* context,
                                                    const v1::LoadRequest* request,
                                                    v1::TransferTicket* response) {
  return Submit(context, Direction::kLoad, request->attachment_id(), request->host_indices(),
                request->device_indices(), /*wait_event_handle=*/"", request->pool_transfers(),
                request->worker_copy(), response);
}

grpc::ServerUnaryReactor* TransferServiceImpl::WaitTransfer(grpc::CallbackServerContext* context,
                                                            const v1::WaitTransferRequest* request,
                                                            v1::TransferStatus* response) {
  absl::StatusOr<std::shared_ptr<Ticket>> ticket =
      manager_->FindTicket(CallerOf(*context), request->ticket_id());
  if (!ticket.ok()) return Finish(context, ticket.status());
  const TicketStatus now = (*ticket)->Snapshot();
  if (now.done || request->poll()) {
    if (now.done && !now.status.ok()) return Finish(context, now.status);
    ToProto(now, response);
    return Finish(context, absl::OkStatus());
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
  return Finish(context,
                manager_->FinishWorkerCopy(CallerOf(*context), request->ticket_id(),
                                           request->error().empty()
                                               ? std::string()
                                               : SafeText(request->error(), kMaxEchoedBytes * 4)));
}

}  // namespace kvhost
