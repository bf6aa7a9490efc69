#include "server/transfer/cuda/batch_copies.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/cuda_util.h"
#include "spdlog/spdlog.h"

namespace kvhost {

BatchCopier::BatchCopier(const CudaEngineOptions& options)
    : max_batch_(std::max<size_t>(options.max_batch, 1)),
      fan_out_min_piece_bytes_(options.fan_out_min_piece_bytes),
      fan_out_min_bytes_(options.fan_out_min_bytes) {}

const char* BatchCopier::Api() {
#if CUDART_VERSION >= 12080
  return "cudaMemcpyBatchAsync";
#else
  return "cudaMemcpyAsync";
#endif
}

bool BatchCopier::FanOut(const CudaLane& lane, size_t n, uint64_t bytes) const {
  if (lane.copy_streams.size() < 2 || n < 2) return false;
  return bytes >= fan_out_min_bytes_ && bytes / n >= fan_out_min_piece_bytes_;
}

absl::Status BatchCopier::Submit(CudaLane* lane, cudaStream_t stream, size_t n,
                                 const std::string& what) {
  if (n == 0) return absl::OkStatus();
  uint64_t total = 0;
  for (size_t i = 0; i < n; ++i) total += lane->sizes[i];
  if (!FanOut(*lane, n, total)) return SubmitRange(lane, stream, 0, n, what);
  // Contiguous ranges of about equal bytes, one per copy stream, each
  // starting after everything before it on `stream`.
  const size_t streams = lane->copy_streams.size();
  if (cudaError_t e = cudaEventRecord(lane->fork, stream); e != cudaSuccess) {
    cudaGetLastError();
    return absl::InternalError(absl::StrCat(what, ": cudaEventRecord (fork): ", CudaError(e)));
  }
  absl::Status status;
  size_t begin = 0;
  uint64_t done = 0;
  for (size_t k = 0; k < streams && begin < n; ++k) {
    const uint64_t target = total * (k + 1) / streams;
    size_t end = begin;
    while (end < n && (done < target || end == begin)) done += lane->sizes[end++];
    if (k + 1 == streams) end = n;
    cudaStream_t copy = lane->copy_streams[k];
    if (cudaError_t e = cudaStreamWaitEvent(copy, lane->fork, 0); e != cudaSuccess) {
      cudaGetLastError();
      status = absl::InternalError(absl::StrCat(what, ": cudaStreamWaitEvent: ", CudaError(e)));
      break;
    }
    status = SubmitRange(lane, copy, begin, end, what);
    // Joined back even after a failure, so that `stream` never runs ahead of
    // copies that were queued.
    cudaError_t e = cudaEventRecord(lane->join[k], copy);
    if (e == cudaSuccess) e = cudaStreamWaitEvent(stream, lane->join[k], 0);
    if (e != cudaSuccess) {
      cudaGetLastError();
      if (status.ok()) {
        status = absl::InternalError(
            absl::StrCat(what, ": joining copy stream ", k, ": ", CudaError(e)));
      }
    }
    if (!status.ok()) break;
    begin = end;
  }
  return status;
}

absl::Status BatchCopier::SubmitRange(CudaLane* lane, cudaStream_t stream, size_t begin, size_t end,
                                      const std::string& what) {
  const bool backup = lane->direction == Direction::kBackup;
  // One cudaMemcpyAsync per piece: the fallback where the batch API is
  // missing (CUDA < 12.8) or refused by the driver.
  auto one_by_one = [&](size_t from) -> absl::Status {
    for (size_t i = from; i < end; ++i) {
      const cudaError_t e =
          cudaMemcpyAsync(lane->dsts[i], lane->srcs[i], lane->sizes[i], cudaMemcpyDefault, stream);
      if (e != cudaSuccess) {
        cudaGetLastError();
        return absl::InternalError(absl::StrCat(what, ": cudaMemcpyAsync: ", CudaError(e)));
      }
    }
    return absl::OkStatus();
  };
#if CUDART_VERSION >= 12080
  if (!batch_ok_.load(std::memory_order_relaxed)) return one_by_one(begin);
  cudaMemcpyAttributes attr;
  std::memset(&attr, 0, sizeof(attr));
  // The host side is written or read in stream order like the device side:
  // a later job on this stream may reuse the same host slots.
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  cudaMemLocation host_loc;
  host_loc.type = cudaMemLocationTypeHost;
  host_loc.id = 0;
  cudaMemLocation device_loc;
  device_loc.type = cudaMemLocationTypeDevice;
  device_loc.id = lane->gpu;
  attr.srcLocHint = backup ? device_loc : host_loc;
  attr.dstLocHint = backup ? host_loc : device_loc;
  size_t attr_index = 0;
  for (size_t i = begin; i < end;) {
    const size_t n = std::min(max_batch_, end - i);
    // A hint to keep the copies off the SMs, which the worker needs.
    attr.flags = batch_flags_.load(std::memory_order_relaxed);
#if CUDART_VERSION >= 13000
    const cudaError_t e =
        cudaMemcpyBatchAsync(lane->dsts.data() + i, lane->srcs.data() + i, lane->sizes.data() + i,
                             n, &attr, &attr_index, 1, stream);
#else
    size_t fail_index = 0;
    const cudaError_t e =
        cudaMemcpyBatchAsync(lane->dsts.data() + i, lane->srcs.data() + i, lane->sizes.data() + i,
                             n, &attr, &attr_index, 1, &fail_index, stream);
#endif
    if (e == cudaSuccess) {
      i += n;
      continue;
    }
    cudaGetLastError();
    if (e == cudaErrorInvalidValue && attr.flags != 0) {
      // A driver that rejects the hint: retry this batch without it.
      batch_flags_.store(0, std::memory_order_relaxed);
      spdlog::warn(
          "cudaMemcpyBatchAsync refused cudaMemcpyFlagPreferOverlapWithCompute ({}); "
          "copying without it",
          CudaError(e));
      continue;
    }
    if (e == cudaErrorNotSupported || e == cudaErrorCallRequiresNewerDriver) {
      batch_ok_.store(false, std::memory_order_relaxed);
      spdlog::warn("cudaMemcpyBatchAsync unavailable ({}); one cudaMemcpyAsync per piece from now",
                   CudaError(e));
      return one_by_one(i);
    }
    return absl::InternalError(
        absl::StrCat(what, ": cudaMemcpyBatchAsync of ", n, " copies: ", CudaError(e)));
  }
  return absl::OkStatus();
#else
  return one_by_one(begin);
#endif
}

}  // namespace kvhost
