// Page streams: the reactors of PoolService.ReadPages and WritePages.
//
// A stream holds at most one chunk of page bytes, never a whole page: each
// chunk is copied straight between its message and the pool's regions
// (Pool::ReadPageRange / WritePageRange), and the chunk's buffer is reserved
// against --memory-limit while the stream holds it
// (PoolRegistry::ReserveTransient; RESOURCE_EXHAUSTED when it does not fit).
// So a page read by ReadPages is consistent per chunk only, and a failed
// WritePages stream may leave its last page partly written (the page is the
// caller's own allocated slot). A pool deleted under a stream (DeletePool)
// ends the stream with ABORTED naming the pool, never OK: every chunk, and
// the final status, first checks Pool::retired().
//
// Ownership: gRPC owns each reactor until its OnDone, which deletes it. The
// registry must outlive the streams (the daemon stops its server first).
// Thread safety: gRPC runs one callback of a stream at a time.
#ifndef KVHOST_SERVER_SERVICE_PAGE_STREAMS_H_
#define KVHOST_SERVER_SERVICE_PAGE_STREAMS_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "kvhost/v1/pool.grpc.pb.h"
#include "server/pool/pool.h"
#include "server/pool/registry.h"

namespace kvhost {

// Data bytes per ReadPages message when the request leaves chunk_bytes 0.
inline constexpr uint64_t kDefaultPageChunkBytes = 4 << 20;

// ReadPages: every index is checked before the first message; then each page
// is sent in chunks of at most min(request.chunk_bytes() or the default,
// `chunk_limit`) bytes, one message in flight at a time. `pool`: the pool
// the caller's index-count and owner checks resolved (PoolRegistry::Resolve),
// which the stream reads, or their failure, which ends it before anything
// else (the indices are not even copied).
grpc::ServerWriteReactor<v1::PageData>* NewPageReader(PoolRegistry* registry,
                                                      const v1::ReadPagesRequest& request,
                                                      uint64_t chunk_limit,
                                                      absl::StatusOr<std::shared_ptr<Pool>> pool);

// WritePages: chunks are checked and written as they arrive; the first names
// the pool, resolved once with `token` (the call's kvhost-token metadata)
// checked on it (PoolRegistry::Resolve). `max_pages`: the most pages one stream may
// write (--max-indices-per-call). `sessions` (the caller's worker sessions)
// and `session_open`: a pool another live session holds (ClaimPool) takes
// no chunk, FAILED_PRECONDITION (Pool::ChangeAllocation).
grpc::ServerReadReactor<v1::WritePagesChunk>* NewPageWriter(
    PoolRegistry* registry, v1::WritePagesResponse* response, std::optional<std::string> token,
    uint64_t max_pages, std::vector<std::string> sessions, SessionOpen session_open);

}  // namespace kvhost

#endif  // KVHOST_SERVER_SERVICE_PAGE_STREAMS_H_
