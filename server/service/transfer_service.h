// TransferServiceImpl: kvhost.v1.TransferService over the TransferManager.
// Translates and validates; AttachDevice checks the pools' owner token. The
// attachment id then authorises Backup / Load / Detach / WaitTransfer of its
// tickets (it is the capability, never published), and for an attachment
// made within a worker session only together with that session's id in
// kvhost-session metadata or the pool's owner token in kvhost-token
// (TransferManager's Caller). WaitTransfer holds its call open without
// holding a thread, finishing when the ticket's completion callback fires (or
// the call is cancelled, e.g. by its deadline).
//
// Thread safety: handlers run concurrently on gRPC's threads.
#ifndef KVHOST_SERVER_SERVICE_TRANSFER_SERVICE_H_
#define KVHOST_SERVER_SERVICE_TRANSFER_SERVICE_H_

#include <cstdint>
#include <string>
#include <utility>

#include "absl/time/time.h"
#include "absl/types/span.h"

#include "kvhost/v1/transfer.grpc.pb.h"
#include "server/pool/registry.h"
#include "server/service/deposits.h"
#include "server/transfer/transfer_manager.h"

namespace kvhost {

class TransferServiceImpl final : public v1::TransferService::CallbackService {
 public:
  // `registry` answers AttachDevice's owner check; `max_indices_per_call`
  // bounds each index list of Backup / Load (INVALID_ARGUMENT above it);
  // `handoff_socket` is the handoff socket's path that attachments with
  // layer_progress (and those served worker copies) are told ("": none, so
  // layer_progress is FAILED_PRECONDITION); `max_reply_bytes` bounds a
  // worker copy's plan in its ticket (--max-message-bytes); `deposits`
  // (the handoff socket's, must outlive this; null: none) lend the
  // descriptors of cuMem buffers (cuda_fd) to the attach that names them.
  TransferServiceImpl(TransferManager* manager, const PoolRegistry* registry,
                      uint64_t max_indices_per_call, std::string handoff_socket = "",
                      uint64_t max_reply_bytes = uint64_t{64} << 20, Deposits* deposits = nullptr)
      : manager_(manager),
        registry_(registry),
        max_indices_(max_indices_per_call),
        handoff_socket_(std::move(handoff_socket)),
        max_reply_bytes_(max_reply_bytes),
        deposits_(deposits) {}

  grpc::ServerUnaryReactor* AttachDevice(grpc::CallbackServerContext* context,
                                         const v1::AttachDeviceRequest* request,
                                         v1::Attachment* response) override;
  grpc::ServerUnaryReactor* DetachDevice(grpc::CallbackServerContext* context,
                                         const v1::DetachDeviceRequest* request,
                                         v1::DetachDeviceResponse* response) override;
  grpc::ServerUnaryReactor* Backup(grpc::CallbackServerContext* context,
                                   const v1::BackupRequest* request,
                                   v1::TransferTicket* response) override;
  grpc::ServerUnaryReactor* Load(grpc::CallbackServerContext* context,
                                 const v1::LoadRequest* request,
                                 v1::TransferTicket* response) override;
  grpc::ServerUnaryReactor* AllocBackup(grpc::CallbackServerContext* context,
                                        const v1::AllocBackupRequest* request,
                                        v1::AllocBackupResponse* response) override;
  grpc::ServerUnaryReactor* WaitTransfer(grpc::CallbackServerContext* context,
                                         const v1::WaitTransferRequest* request,
                                         v1::TransferStatus* response) override;
  grpc::ServerUnaryReactor* FinishWorkerCopy(grpc::CallbackServerContext* context,
                                             const v1::FinishWorkerCopyRequest* request,
                                             v1::FinishWorkerCopyResponse* response) override;

  // The calls both paths serve (gRPC above, the fast path in
  // server/service/fast_path_calls.h), for `caller`'s credentials; replies
  // (a worker copy's plan, AllocBackup's slots) are refused above
  // `max_reply_bytes` before anything changes. A failed call changes
  // nothing: AllocBackup frees its slots when the backup is refused.
  absl::Status DoBackup(const Caller& caller, const v1::BackupRequest& request,
                        v1::TransferTicket* response, uint64_t max_reply_bytes);
  absl::Status DoLoad(const Caller& caller, const v1::LoadRequest& request,
                      v1::TransferTicket* response, uint64_t max_reply_bytes);
  absl::Status DoAllocBackup(const Caller& caller, const v1::AllocBackupRequest& request,
                             v1::AllocBackupResponse* response, uint64_t max_reply_bytes);
  // WaitTransfer on the calling thread: at once with poll, else until the
  // ticket finishes (its own error if it failed) or `timeout` passes
  // (DEADLINE_EXCEEDED).
  absl::Status DoWaitTransfer(const Caller& caller, const v1::WaitTransferRequest& request,
                              v1::TransferStatus* response, absl::Duration timeout);
  // The largest reply of the gRPC path (--max-message-bytes).
  uint64_t max_reply_bytes() const { return max_reply_bytes_; }

  // AllocBackup's reply beyond its slots: the ticket and the counts.
  static constexpr uint64_t kAllocBackupReplyOverhead = 64;

 private:
  absl::Status Submit(const Caller& caller, Direction direction, const std::string& attachment_id,
                      const google::protobuf::RepeatedField<int64_t>& host,
                      const google::protobuf::RepeatedField<int64_t>& device,
                      const std::string& wait_event_handle,
                      const google::protobuf::RepeatedPtrField<v1::PoolTransfer>& pool_transfers,
                      bool worker_copy, v1::TransferTicket* response, uint64_t max_reply_bytes);
  // AllocBackup's work once checked: `n` slots of `pool` allocated and the
  // backup into them submitted; on a refused backup the slots go back.
  absl::Status AllocThenBackUp(const Caller& caller, const v1::BackupRequest& backup, Pool& pool,
                               uint64_t n, v1::AllocBackupResponse* response);
  // Submit's worker copy (BackupRequest.worker_copy).
  absl::Status SubmitWorkerCopy(const Caller& caller, Direction direction,
                                const std::string& attachment_id, absl::Span<const int64_t> host,
                                absl::Span<const int64_t> device,
                                const std::string& wait_event_handle, bool pool_transfers,
                                v1::TransferTicket* response, uint64_t max_reply_bytes);

  TransferManager* const manager_;
  const PoolRegistry* const registry_;
  const uint64_t max_indices_;
  const std::string handoff_socket_;
  const uint64_t max_reply_bytes_;
  Deposits* const deposits_;
};

}  // namespace kvhost

#endif  // KVHOST_SERVER_SERVICE_TRANSFER_SERVICE_H_
