#include "server/pool/populate.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14; older kernels answer EINVAL
#endif

namespace kvhost {
namespace {

// Whether MADV_POPULATE_WRITE may work; cleared for the process at the first
// EINVAL (a kernel before 5.14).
std::atomic<bool> g_populate_write{true};

uint64_t PageBytes() {
  static const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  return page;
}

// Faults in [p, p + n) writable. The pages were reserved by fallocate, so a
// write cannot fail for want of memory; they are zero, so writing a zero
// keeps them so.
absl::Status Fault(uint8_t* p, uint64_t n, bool force_touch) {
  if (!force_touch && g_populate_write.load(std::memory_order_relaxed)) {
    if (::madvise(p, n, MADV_POPULATE_WRITE) == 0) return absl::OkStatus();
    const int err = errno;
    if (err != EINVAL) {
      return absl::FailedPreconditionError(
          absl::StrCat("madvise(MADV_POPULATE_WRITE): ", std::strerror(err)));
    }
    g_populate_write.store(false, std::memory_order_relaxed);
  }
  const uint64_t page = PageBytes();
  for (uint64_t off = 0; off < n; off += page) {
    volatile uint8_t* byte = p + off;
    *byte = *byte;
  }
  return absl::OkStatus();
}

}  // namespace

int PopulateThreads(uint64_t bytes, const PopulateOptions& options) {
  int threads = options.threads;
  if (threads <= 0) {
    threads = std::min<int>(kMaxPopulateThreads,
                            std::max<unsigned>(1, std::thread::hardware_concurrency()));
  }
  const uint64_t chunk = std::max<uint64_t>(options.chunk_bytes, 1);
  const uint64_t chunks = (bytes + chunk - 1) / chunk;
  return static_cast<int>(std::max<uint64_t>(1, std::min<uint64_t>(threads, chunks)));
}

absl::Status ReserveAndPopulate(int fd, uint8_t* data, uint64_t bytes, const char* what,
                                const PopulateOptions& options) {
  // Whole pages per chunk, so that each madvise range is page aligned.
  const uint64_t page = PageBytes();
  const uint64_t chunk = std::max<uint64_t>(
      page, (std::max<uint64_t>(options.chunk_bytes, 1) + page - 1) / page * page);
  const uint64_t chunks = (bytes + chunk - 1) / chunk;
  std::atomic<uint64_t> next{0};
  std::atomic<bool> stop{false};
  absl::Mutex mu;
  absl::Status first_error;  // guarded by mu
  auto fail = [&](absl::Status s) {
    absl::MutexLock lock(&mu);
    if (first_error.ok()) first_error = std::move(s);
    stop = true;
  };
  auto work = [&] {
    for (;;) {
      if (stop) return;
      if (options.cancelled && options.cancelled()) {
        fail(absl::CancelledError(absl::StrCat("populating ", what, " was cancelled")));
        return;
      }
      const uint64_t i = next.fetch_add(1);
      if (i >= chunks) return;
      const uint64_t off = i * chunk;
      const uint64_t n = std::min(chunk, bytes - off);
      const int err = ::posix_fallocate(fd, static_cast<off_t>(off), static_cast<off_t>(n));
      if (err != 0) {
        if (err == ENOSPC || err == EFBIG) {
          fail(absl::ResourceExhaustedError(
              absl::StrCat("cannot reserve ", bytes, " bytes for ", what,
                           ": the file system is full (for /dev/shm, raise its size)")));
        } else {
          fail(absl::FailedPreconditionError(absl::StrCat("cannot reserve ", bytes, " bytes for ",
                                                          what, ": ", std::strerror(err))));
        }
        return;
      }
      if (absl::Status s = Fault(data + off, n, options.force_touch); !s.ok()) {
        fail(absl::Status(s.code(), absl::StrCat("cannot map ", what, ": ", s.message())));
        return;
      }
      if (options.on_progress) options.on_progress(n);
    }
  };
  const int threads = PopulateThreads(bytes, options);
  std::vector<std::thread> helpers;
  helpers.reserve(threads - 1);
  for (int t = 1; t < threads; ++t) helpers.emplace_back(work);
  work();
  for (std::thread& t : helpers) t.join();
  absl::MutexLock lock(&mu);
  return first_error;
}

void ParallelUnmap(uint8_t* data, uint64_t bytes) {
  const uint64_t chunk = kPopulateChunkBytes;
  const uint64_t chunks = (bytes + chunk - 1) / chunk;
  const int threads = PopulateThreads(bytes, PopulateOptions());
  if (threads > 1) {
    std::atomic<uint64_t> next{0};
    auto work = [&] {
      for (uint64_t i = next.fetch_add(1); i < chunks; i = next.fetch_add(1)) {
        const uint64_t off = i * chunk;
        ::madvise(data + off, std::min(chunk, bytes - off), MADV_DONTNEED);
      }
    };
    std::vector<std::thread> helpers;
    for (int t = 1; t < threads; ++t) helpers.emplace_back(work);
    work();
    for (std::thread& t : helpers) t.join();
  }
  ::munmap(data, bytes);
}

}  // namespace kvhost
