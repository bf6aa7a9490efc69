#include "server/service/fast_path_calls.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/access/credentials.h"

namespace kvhost {
namespace {

// Parses the frame's body as `Request`, runs `call` and serializes the
// response into `body` on success.
template <typename Request, typename Response, typename Call>
absl::Status Run(const v1::FastPathRequest& frame, std::string* body, Call&& call) {
  Request request;
  if (!request.ParseFromString(frame.body())) {
    return absl::InvalidArgumentError(
        absl::StrCat("fast path: the body of a ", FastPathMethodName(frame.method()), " call (",
                     frame.body().size(), " bytes) is not a ", Request::descriptor()->full_name()));
  }
  Response response;
  absl::Status status = call(request, &response);
  if (status.ok()) response.SerializeToString(body);
  return status;
}

}  // namespace

const char* FastPathGrpcMethod(v1::FastPathMethod method) {
  switch (method) {
    case v1::FAST_PATH_METHOD_ALLOC:
      return "kvhost.v1.PoolService/Alloc";
    case v1::FAST_PATH_METHOD_FREE:
      return "kvhost.v1.PoolService/Free";
    case v1::FAST_PATH_METHOD_ALLOC_BATCH:
      return "kvhost.v1.PoolService/AllocBatch";
    case v1::FAST_PATH_METHOD_BACKUP:
      return "kvhost.v1.TransferService/Backup";
    case v1::FAST_PATH_METHOD_LOAD:
      return "kvhost.v1.TransferService/Load";
    case v1::FAST_PATH_METHOD_ALLOC_BACKUP:
      return "kvhost.v1.TransferService/AllocBackup";
    case v1::FAST_PATH_METHOD_WAIT_TRANSFER:
      return "kvhost.v1.TransferService/WaitTransfer";
    case v1::FAST_PATH_METHOD_CACHE_LOOKUP:
      return "kvhost.v1.CacheService/Lookup";
    case v1::FAST_PATH_METHOD_CACHE_STORE:
      return "kvhost.v1.CacheService/Store";
    case v1::FAST_PATH_METHOD_CACHE_RESTORE:
      return "kvhost.v1.CacheService/Restore";
    default:
      return "unknown";
  }
}

const char* FastPathMethodName(v1::FastPathMethod method) {
  const char* full = FastPathGrpcMethod(method);
  const char* slash = std::strchr(full, '/');
  return slash == nullptr ? "unknown method" : slash + 1;
}

absl::Status FastPathCalls::Dispatch(const v1::FastPathRequest& frame, uint64_t reply_limit,
                                     std::string* body) {
  const Caller caller = CallerOf(frame);
  switch (frame.method()) {
    case v1::FAST_PATH_METHOD_ALLOC:
      return Run<v1::AllocRequest, v1::AllocResponse>(
          frame, body, [&](const auto& request, auto* response) {
            return pools_->DoAlloc(caller, request, response, reply_limit);
          });
    case v1::FAST_PATH_METHOD_FREE:
      return Run<v1::FreeRequest, v1::FreeResponse>(
          frame, body, [&](const auto& request, auto* response) {
            return pools_->DoFree(caller, request, response);
          });
    case v1::FAST_PATH_METHOD_ALLOC_BATCH:
      return Run<v1::AllocBatchRequest, v1::AllocBatchResponse>(
          frame, body, [&](const auto& request, auto* response) {
            return pools_->DoAllocBatch(caller, request, response, reply_limit);
          });
    case v1::FAST_PATH_METHOD_BACKUP:
      return Run<v1::BackupRequest, v1::TransferTicket>(
          frame, body, [&](const auto& request, auto* response) {
            return transfers_->DoBackup(caller, request, response, reply_limit);
          });
    case v1::FAST_PATH_METHOD_LOAD:
      return Run<v1::LoadRequest, v1::TransferTicket>(
          frame, body, [&](const auto& request, auto* response) {
            return transfers_->DoLoad(caller, request, response, reply_limit);
          });
    case v1::FAST_PATH_METHOD_ALLOC_BACKUP:
      return Run<v1::AllocBackupRequest, v1::AllocBackupResponse>(
          frame, body, [&](const auto& request, auto* response) {
            return transfers_->DoAllocBackup(caller, request, response, reply_limit);
          });
    case v1::FAST_PATH_METHOD_WAIT_TRANSFER: {
      if (frame.timeout_ms() > kFastPathMaxWaitMs) {
        return absl::InvalidArgumentError(absl::StrCat("fast path: WaitTransfer timeout_ms ",
                                                       frame.timeout_ms(), " is over the limit of ",
                                                       kFastPathMaxWaitMs));
      }
      const absl::Duration timeout =
          absl::Milliseconds(frame.timeout_ms() == 0 ? kFastPathDefaultWaitMs : frame.timeout_ms());
      return Run<v1::WaitTransferRequest, v1::TransferStatus>(
          frame, body, [&](const auto& request, auto* response) {
            return transfers_->DoWaitTransfer(caller, request, response, timeout);
          });
    }
    case v1::FAST_PATH_METHOD_CACHE_LOOKUP:
      if (caches_ == nullptr) break;
      return Run<v1::CacheLookupRequest, v1::CacheLookupReply>(
          frame, body, [&](const auto& request, auto* response) {
            return caches_->DoLookup(caller, request, response);
          });
    case v1::FAST_PATH_METHOD_CACHE_STORE:
      if (caches_ == nullptr) break;
      return Run<v1::CacheStoreRequest, v1::CacheStoreReply>(
          frame, body, [&](const auto& request, auto* response) {
            return caches_->DoStore(caller, request, response);
          });
    case v1::FAST_PATH_METHOD_CACHE_RESTORE:
      if (caches_ == nullptr) break;
      return Run<v1::CacheRestoreRequest, v1::TransferTicket>(
          frame, body, [&](const auto& request, auto* response) {
            return caches_->DoRestore(caller, request, response);
          });
    default:
      break;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "fast path: method ", static_cast<int>(frame.method()), " is not one kvhostd serves there"));
}

std::string FastPathCalls::Handle(absl::string_view frame, uint32_t capacity,
                                  v1::FastPathMethod* method, absl::StatusCode* code) {
  v1::FastPathRequest request;
  std::string body;
  absl::Status status;
  if (!request.ParseFromArray(frame.data(), static_cast<int>(frame.size()))) {
    request.Clear();
    status = absl::InvalidArgumentError(absl::StrCat("fast path: a request frame of ", frame.size(),
                                                     " bytes is not a kvhost.v1.FastPathRequest"));
  } else if (request.session_ids_size() > kMaxCallerSessions) {
    status = absl::InvalidArgumentError(
        absl::StrCat("fast path: a request frame names ", request.session_ids_size(),
                     " session ids, over the limit of ", kMaxCallerSessions,
                     " (what a gRPC call's metadata holds)"));
  } else {
    // The services bound their replies by this; the frame's own bytes fit
    // in the rest.
    const uint64_t limit =
        std::min(uint64_t{capacity} - std::min<uint64_t>(capacity, kFastPathReplyFraming),
                 pools_->max_message_bytes());
    status = Dispatch(request, limit, &body);
  }
  if (method != nullptr) *method = request.method();
  v1::FastPathReply reply;
  reply.set_code(static_cast<int32_t>(status.code()));
  reply.set_message(std::string(status.message()));
  if (status.ok()) reply.set_body(std::move(body));
  if (reply.ByteSizeLong() > capacity) {
    // Only a message longer than the mailbox gets here (the services bound
    // every body): say so instead.
    status = absl::ResourceExhaustedError(absl::StrCat("fast path: a reply of ",
                                                       reply.ByteSizeLong(), " bytes exceeds the ",
                                                       capacity, "-byte mailbox"));
    reply.Clear();
    reply.set_code(static_cast<int32_t>(status.code()));
    reply.set_message(std::string(status.message()));
  }
  if (code != nullptr) *code = status.code();
  return reply.SerializeAsString();
}

}  // namespace kvhost
