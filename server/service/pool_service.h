// PoolServiceImpl: kvhost.v1.PoolService over the pool registry. Translates
// and validates; the registry and pools do the work. The per-pool calls
// (Alloc, Free, the page calls) accept a pool group's name and act on its
// anchor pool. Calls that change a pool or read its data resolve its name
// once and check the owner token on the pool or group resolved
// (PoolRegistry::Resolve, in OpenPool) before they touch anything, then act
// on that object, never on the name again; so do the calls that
// name a pool's region files and offsets (GetPageBufferMeta,
// GetSplitHeadsPageBufferMeta, GetContiguousBufferInfos). Every reply whose
// size depends on the request or a pool's shape is estimated before it is
// built and refused above `max_message_bytes` (RESOURCE_EXHAUSTED naming the
// estimate, the limit and how to split the call). Callback (reactor) API:
// the unary handlers finish inline, but CreatePool, whose populate takes
// seconds, runs on a registry thread (PoolRegistry::CreateInBackground) and
// finishes from there; DeletePool returns once the name is free (the memory
// goes on the registry's releaser); ReadPages and WritePages are streaming
// reactors (server/service/page_streams.h) that hold one chunk at a time and
// never block a gRPC thread.
//
// Thread safety: handlers run concurrently on gRPC's threads; the registry
// and pools synchronise themselves.
#ifndef KVHOST_SERVER_SERVICE_POOL_SERVICE_H_
#define KVHOST_SERVER_SERVICE_POOL_SERVICE_H_

#include "kvhost/v1/pool.grpc.pb.h"
#include "server/access/caller.h"
#include "server/metrics/kvhost_metrics.h"
#include "server/pool/registry.h"
#include "server/service/call_scope.h"
#include "server/service/page_streams.h"

namespace kvhost {

class PoolServiceImpl final : public v1::PoolService::CallbackService {
 public:
  // `backend` names the transfer engine, shown in Pool.backend;
  // `max_message_bytes` is the server's largest response; `metrics`, if
  // given, counts Alloc and Free per pool and must outlive this;
  // `max_indices_per_call` bounds Alloc's num_tokens and every index list
  // (INVALID_ARGUMENT above it, nothing touched); `session_open` says
  // whether a worker session is open (ClaimPool's holders; null: none is).
  PoolServiceImpl(PoolRegistry* registry, const char* backend, int max_message_bytes = 64 << 20,
                  KvhostMetrics* metrics = nullptr,
                  uint64_t max_indices_per_call = kDefaultMaxIndicesPerCall,
                  SessionOpen session_open = nullptr)
      : registry_(registry),
        backend_(backend),
        max_message_bytes_(max_message_bytes),
        metrics_(metrics),
        max_indices_(max_indices_per_call),
        session_open_(session_open ? std::move(session_open)
                                   : [](const std::string&) { return false; }) {}

  grpc::ServerUnaryReactor* CreatePool(grpc::CallbackServerContext* context,
                                       const v1::CreatePoolRequest* request,
                                       v1::Pool* response) override;
  grpc::ServerUnaryReactor* GetPool(grpc::CallbackServerContext* context,
                                    const v1::GetPoolRequest* request, v1::Pool* response) override;
  grpc::ServerUnaryReactor* ListPools(grpc::CallbackServerContext* context,
                                      const v1::ListPoolsRequest* request,
                                      v1::ListPoolsResponse* response) override;
  grpc::ServerUnaryReactor* DeletePool(grpc::CallbackServerContext* context,
                                       const v1::DeletePoolRequest* request,
                                       v1::DeletePoolResponse* response) override;
  grpc::ServerUnaryReactor* Alloc(grpc::CallbackServerContext* context,
                                  const v1::AllocRequest* request,
                                  v1::AllocResponse* response) override;
  grpc::ServerUnaryReactor* AllocBatch(grpc::CallbackServerContext* context,
                                       const v1::AllocBatchRequest* request,
                                       v1::AllocBatchResponse* response) override;
  grpc::ServerUnaryReactor* Free(grpc::CallbackServerContext* context,
                                 const v1::FreeRequest* request,
                                 v1::FreeResponse* response) override;
  grpc::ServerUnaryReactor* GetPageBufferMeta(grpc::CallbackServerContext* context,
                                              const v1::GetPageBufferMetaRequest* request,
                                              v1::PageBufferMeta* response) override;
  grpc::ServerUnaryReactor* GetDataPage(grpc::CallbackServerContext* context,
                                        const v1::PageRequest* request,
                                        v1::PageData* response) override;
  grpc::ServerUnaryReactor* SetFromFlatDataPage(grpc::CallbackServerContext* context,
                                                const v1::SetPageRequest* request,
                                                v1::SetPageResponse* response) override;
  grpc::ServerWriteReactor<v1::PageData>* ReadPages(grpc::CallbackServerContext* context,
                                                    const v1::ReadPagesRequest* request) override;
  grpc::ServerReadReactor<v1::WritePagesChunk>* WritePages(
      grpc::CallbackServerContext* context, v1::WritePagesResponse* response) override;
  grpc::ServerUnaryReactor* GetPageShape(grpc::CallbackServerContext* context,
                                         const v1::GetPageShapeRequest* request,
                                         v1::PageShape* response) override;
  grpc::ServerUnaryReactor* GetSplitHeadsPageBufferMeta(grpc::CallbackServerContext* context,
                                                        const v1::SplitHeadsMetaRequest* request,
                                                        v1::PageBufferMeta* response) override;
  grpc::ServerUnaryReactor* IsStridePageAligned(grpc::CallbackServerContext* context,
                                                const v1::StrideAlignmentRequest* request,
                                                v1::StrideAlignment* response) override;
  grpc::ServerUnaryReactor* GetContiguousBufferInfos(
      grpc::CallbackServerContext* context, const v1::ContiguousBufferInfosRequest* request,
      v1::ContiguousBufferInfos* response) override;
  grpc::ServerUnaryReactor* CreatePoolGroup(grpc::CallbackServerContext* context,
                                            const v1::CreatePoolGroupRequest* request,
                                            v1::PoolGroup* response) override;
  grpc::ServerUnaryReactor* GetPoolGroup(grpc::CallbackServerContext* context,
                                         const v1::GetPoolGroupRequest* request,
                                         v1::PoolGroup* response) override;
  grpc::ServerUnaryReactor* ListPoolGroups(grpc::CallbackServerContext* context,
                                           const v1::ListPoolGroupsRequest* request,
                                           v1::ListPoolGroupsResponse* response) override;
  grpc::ServerUnaryReactor* DeletePoolGroup(grpc::CallbackServerContext* context,
                                            const v1::DeletePoolGroupRequest* request,
                                            v1::DeletePoolGroupResponse* response) override;
  grpc::ServerUnaryReactor* ClaimPool(grpc::CallbackServerContext* context,
                                      const v1::ClaimPoolRequest* request,
                                      v1::PoolClaim* response) override;

  // The calls both paths serve (gRPC above, the fast path in
  // server/service/fast_path_calls.h): validation, owner check, the work
  // and the response, for `caller`'s credentials; a reply is refused above
  // `max_reply_bytes` before anything is allocated. A failed call changes
  // nothing (AllocBatch frees what it allocated before the failure).
  absl::Status DoAlloc(const Caller& caller, const v1::AllocRequest& request,
                       v1::AllocResponse* response, uint64_t max_reply_bytes);
  absl::Status DoAllocBatch(const Caller& caller, const v1::AllocBatchRequest& request,
                            v1::AllocBatchResponse* response, uint64_t max_reply_bytes);
  absl::Status DoFree(const Caller& caller, const v1::FreeRequest& request,
                      v1::FreeResponse* response);
  // ClaimPool (Pool::Claim) for the first of `caller`'s sessions that is
  // open; FAILED_PRECONDITION when none is.
  absl::Status DoClaimPool(const Caller& caller, const v1::ClaimPoolRequest& request,
                           v1::PoolClaim* response);
  // The holder of `pool` as GetPool shows it (instance id, generation,
  // live; never its session), or nothing for a pool never claimed.
  void SetHolder(const Pool& pool, v1::Pool* out) const;
  const SessionOpen& session_open() const { return session_open_; }
  // The largest reply this service sends (--max-message-bytes).
  uint64_t max_message_bytes() const { return static_cast<uint64_t>(max_message_bytes_); }

  // Data bytes per ReadPages message when the request leaves chunk_bytes 0.
  static constexpr uint64_t kDefaultChunkBytes = kDefaultPageChunkBytes;
  // GetDataPage: room kept in a message beside the page's bytes (index,
  // offset, page_bytes and their tags take under 40 bytes).
  static constexpr uint64_t kMessageOverheadBytes = 1024;
  // Longest ClaimPoolRequest.instance_id.
  static constexpr size_t kMaxInstanceIdBytes = 128;
  // DaemonOptions::max_indices_per_call's default.
  static constexpr uint64_t kDefaultMaxIndicesPerCall = uint64_t{1} << 22;

 private:
  // Every owner-checked call's prologue (OpenCallPool, call_scope.h): the
  // count of its index list (`counted` names it, e.g. "Free indices"; none
  // when null) against --max-indices-per-call (INVALID_ARGUMENT naming the
  // pool), then `pool` resolved once with `caller`'s token checked on what it
  // names. Returns the pool, or a group's anchor pool, to act on.
  absl::StatusOr<std::shared_ptr<Pool>> OpenPool(const Caller& caller, const std::string& pool,
                                                 const char* counted = nullptr,
                                                 uint64_t count = 0) const;
  // AllocBatch's allocations on `p`, all or nothing (those made before a
  // failure are freed again).
  absl::Status AllocRuns(Pool& p, const v1::AllocBatchRequest& request,
                         v1::AllocBatchResponse* response);
  // RESOURCE_EXHAUSTED naming the pool when Alloc's indices of `num_tokens`
  // slots could exceed `max_reply_bytes`.
  absl::Status CheckAllocReply(const Pool& pool, uint64_t num_tokens,
                               uint64_t max_reply_bytes) const;

  PoolRegistry* const registry_;
  const char* const backend_;
  const int max_message_bytes_;
  KvhostMetrics* const metrics_;
  const uint64_t max_indices_;
  const SessionOpen session_open_;
};

}  // namespace kvhost

#endif  // KVHOST_SERVER_SERVICE_POOL_SERVICE_H_
