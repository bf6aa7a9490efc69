// CudaEngineOptions: the CUDA engine's settings (kvhostd's flags of the cuda
// backend), with the measurements behind their defaults.
//
// Plain data; Validate() checks the ranges, naming kvhostd's flags.
#ifndef KVHOST_SERVER_TRANSFER_CUDA_ENGINE_OPTIONS_H_
#define KVHOST_SERVER_TRANSFER_CUDA_ENGINE_OPTIONS_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "server/transfer/cuda/path_policy.h"

namespace kvhost {

struct CudaEngineOptions {
  // --transfer-path: every job's path, or kAuto to choose per job.
  CudaPath path = CudaPath::kAuto;
  // Device staging buffer per stream (two per GPU), split in two halves so
  // that one fills while the other drains; allocated on first use. Every
  // gather / scatter kernel from our context costs the worker a time-slice
  // switch (about 0.5 ms on the H200 without MPS, docs/PERF.md), so fewer,
  // larger chunks cost it less: a 512 MiB MHA job took +14 % of the
  // worker's time in 128 MiB chunks and +4.4 % in one 512 MiB chunk, at
  // 0.76 and 0.66 of the ceiling (PAGE_FIRST, page size 1).
  uint64_t staging_bytes = uint64_t{1} << 30;
  // Most blocks of an SM copy kernel (the seeds' block_quota); the SMs left
  // over stay with the worker.
  int sm_blocks = 16;
  // Most blocks of a staged gather / scatter kernel; 0 = 4 per SM, so that
  // the kernel is as short as possible.
  int staged_blocks = 0;
  // auto: the copy engines take a job whose layout-contiguous pieces average
  // at least this many bytes, the staged path the rest (the SM copy path
  // only under MPS where nothing stages; path_policy.h). Measured on the H200 with a GEMM worker
  // (docs/PERF.md, run K, 2026-12-02): the copy engines moved 72-128 KiB pieces at 0.87-0.95 of the
  // ceiling at +0-2 % of the worker's time, but 32 KiB pieces at 0.78-0.93 (loads 43 GB/s), 18 KiB
  // at 0.36-0.47, while the staged path moved every layout at page 16 at 0.88-0.96 for +3-9 % of
  // the worker's time back to back (+3-4 % at a 25 % duty cycle).
  uint64_t ce_min_piece_bytes = kDefaultCeMinPieceBytes;
  // Copy-engine streams per lane (direction and GPU) that a batch of large
  // pieces is split over: one stream's batch of 32 KiB pieces moved 45-46
  // GB/s on the H200, split over 4 streams 49.4-49.6; 64 KiB 42-46 -> 52.7-
  // 52.9 (issue 15's measurements, ceiling 55). 1 = no split.
  int copy_streams = 4;
  // A batch is split over the copy streams only when its pieces average at
  // least this many bytes (2 KiB pieces gained nothing from more streams)
  // and it moves at least fan_out_min_bytes (a small batch gains less than
  // the events cost).
  uint64_t fan_out_min_piece_bytes = uint64_t{32} << 10;
  uint64_t fan_out_min_bytes = uint64_t{4} << 20;

  // Largest host range pinned by one cudaHostRegister call (HostPins).
  uint64_t host_register_chunk = uint64_t{1} << 30;
  // Most copies per cudaMemcpyBatchAsync call; bounds the scratch arrays of a
  // layer with very many pieces (PAGE_HEAD at page size 1).
  size_t max_batch = 8192;

  // INVALID_ARGUMENT naming the flag and the value: sm_blocks < 1,
  // copy_streams outside [1, 16], staging_bytes below 64 KiB.
  absl::Status Validate() const;
};

}  // namespace kvhost

#endif  // KVHOST_SERVER_TRANSFER_CUDA_ENGINE_OPTIONS_H_
