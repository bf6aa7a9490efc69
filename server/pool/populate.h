// Populate: reserves a shared-memory file's backing pages and maps them into
// this process, in chunks, on several threads, with progress and a way out.
//
// A pool's region file must have every page before it is used: a page that a
// full tmpfs cannot give would otherwise SIGBUS the daemon on first touch, and
// page faults in a transfer cost more than the copy. MAP_POPULATE does this on
// one thread, uninterruptibly, with no progress; ReserveAndPopulate instead
// splits the file into chunks that worker threads take in turn: each chunk is
// first reserved (posix_fallocate, so a full file system fails here with
// RESOURCE_EXHAUSTED and never later) and then faulted in
// (madvise(MADV_POPULATE_WRITE), or a write of one byte per page on kernels
// without it). fallocate is serialised by the kernel per file; the threads
// overlap one chunk's reservation with other chunks' faulting.
//
// Thread safety: ReserveAndPopulate may be called concurrently for different
// files; `on_progress` and `cancelled` are called from its worker threads,
// concurrently, and must be thread-safe.
#ifndef KVHOST_SERVER_POOL_POPULATE_H_
#define KVHOST_SERVER_POOL_POPULATE_H_

#include <cstdint>
#include <functional>

#include "absl/status/status.h"

namespace kvhost {

// 64 MiB: large enough that the per-chunk syscalls are noise (a 4 GiB pool is
// 64 chunks), small enough that progress moves and a cancellation is seen
// within tens of milliseconds (one chunk's fallocate + fault is ~40 ms on a
// loaded 2-core VM, docs/PERF.md).
inline constexpr uint64_t kPopulateChunkBytes = uint64_t{64} << 20;
// More threads than this gain nothing: fallocate is serialised per file and
// the faulting is memory-bound.
inline constexpr int kMaxPopulateThreads = 4;

struct PopulateOptions {
  uint64_t chunk_bytes = kPopulateChunkBytes;
  // 0: min(kMaxPopulateThreads, hardware threads).
  int threads = 0;
  // Called with the bytes of each chunk once it is reserved and mapped.
  std::function<void(uint64_t)> on_progress;
  // Asked before each chunk; true stops the work (CANCELLED).
  std::function<bool()> cancelled;
  // Tests and the benchmark: skip MADV_POPULATE_WRITE, touch each page.
  bool force_touch = false;
};

// Reserves and maps bytes [0, bytes) of the file `fd`, which is mapped
// MAP_SHARED read-write at `data` (the mapping may lie past the file's end;
// the file grows as chunks are reserved). RESOURCE_EXHAUSTED when the file
// system is full, CANCELLED when `cancelled` said so (some chunks may be
// done), FAILED_PRECONDITION for other errors. `what` names the file in
// messages.
absl::Status ReserveAndPopulate(int fd, uint8_t* data, uint64_t bytes, const char* what,
                                const PopulateOptions& options = {});

// Threads ReserveAndPopulate uses for `bytes` (never more than the chunks).
int PopulateThreads(uint64_t bytes, const PopulateOptions& options);

// Unmaps `bytes` at `data` (from a ShmRegion, a multiple of the page size or
// its whole length). The page-table teardown of a mapping of gigabytes takes
// seconds; done chunk by chunk (MADV_DONTNEED, under the mm's read lock) on
// several threads, then the now empty mapping goes at once.
void ParallelUnmap(uint8_t* data, uint64_t bytes);

}  // namespace kvhost

#endif  // KVHOST_SERVER_POOL_POPULATE_H_
