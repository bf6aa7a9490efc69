// BatchCopier: how the CUDA engine hands copy-engine copies to the driver.
// A lane's scratch arrays (dsts / srcs / sizes) hold the copies of one
// submission; they go out as cudaMemcpyBatchAsync calls of at most
// max_batch copies (one cudaMemcpyAsync each where the batch API is missing
// or refused), and a submission of large pieces is split by bytes over the
// lane's copy streams, forked from and joined back to the stream it was
// submitted on, so that everything after it on that stream (a layer's
// events, the next job) still follows every copy.
//
// Thread safety: Submit may be called concurrently for different lanes; a
// lane's submissions are serialised by its submit_mu (held by the caller).
// The fallbacks it learns (the batch API refused, the overlap hint refused)
// are process-wide atomics.
#ifndef KVHOST_SERVER_TRANSFER_CUDA_BATCH_COPIES_H_
#define KVHOST_SERVER_TRANSFER_CUDA_BATCH_COPIES_H_

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "server/transfer/cuda/engine_options.h"
#include "server/transfer/cuda/lane.h"

namespace kvhost {

class BatchCopier {
 public:
  explicit BatchCopier(const CudaEngineOptions& options);

  // Submits copies lane->dsts[i] <- lane->srcs[i] of lane->sizes[i] bytes,
  // i < n, on `stream` (a stream of `lane`), split over the lane's copy
  // streams when the pieces are large (CudaEngineOptions::copy_streams).
  // `what` names the copies in errors. REQUIRES: lane->submit_mu held.
  absl::Status Submit(CudaLane* lane, cudaStream_t stream, size_t n, const std::string& what);

  // "cudaMemcpyBatchAsync", or "cudaMemcpyAsync" where the batch API is
  // missing from this build.
  static const char* Api();

 private:
  // Copies [begin, end) of the lane's arrays on `stream`.
  absl::Status SubmitRange(CudaLane* lane, cudaStream_t stream, size_t begin, size_t end,
                           const std::string& what);
  // Whether copies [0, n), `bytes` in all, are worth splitting over the
  // copy streams.
  bool FanOut(const CudaLane& lane, size_t n, uint64_t bytes) const;

  const size_t max_batch_;
  const uint64_t fan_out_min_piece_bytes_;
  const uint64_t fan_out_min_bytes_;
  // Whether cudaMemcpyBatchAsync works here, and the flags it accepts;
  // cleared for good on the first refusal (an older driver).
  std::atomic<bool> batch_ok_{true};
  std::atomic<unsigned> batch_flags_{1};  // cudaMemcpyFlagPreferOverlapWithCompute
};

}  // namespace kvhost

#endif  // KVHOST_SERVER_TRANSFER_CUDA_BATCH_COPIES_H_
