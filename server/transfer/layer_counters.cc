#include "server/transfer/layer_counters.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "server/transfer/engine.h"
#include "spdlog/spdlog.h"

#ifndef F_SEAL_FUTURE_WRITE
#define F_SEAL_FUTURE_WRITE 0x0010  // Linux 5.1; older headers lack it
#endif

namespace kvhost {
namespace {

absl::Status SysError(const std::string& call) {
  return absl::InternalError(absl::StrCat("layer counters: ", call, ": ", std::strerror(errno)));
}

}  // namespace

absl::StatusOr<std::shared_ptr<LayerCounters>> LayerCounters::Create(uint32_t sets) {
  if (sets == 0 || sets > kMaxLoadEventSets) {
    return absl::InvalidArgumentError(absl::StrCat("layer counters: ", sets,
                                                   " sets is outside [1, ", kMaxLoadEventSets,
                                                   "] (load_event_sets)"));
  }
  std::shared_ptr<LayerCounters> counters(new LayerCounters());
  counters->sets_ = sets;
  counters->reserved_ = std::make_unique<std::atomic<uint64_t>[]>(sets);
  for (uint32_t s = 0; s < sets; ++s) counters->reserved_[s].store(0);
  counters->fd_ = ::memfd_create("kvhost-layer-counters", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (counters->fd_ < 0) return SysError("memfd_create");
  const uint64_t bytes = counters->bytes();
  if (::ftruncate(counters->fd_, static_cast<off_t>(bytes)) != 0) return SysError("ftruncate");
  void* mapped = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, counters->fd_, 0);
  if (mapped == MAP_FAILED) return SysError("mmap");
  counters->counters_ = static_cast<uint64_t*>(mapped);
  // Nobody resizes the file (a worker's read past a shrunk end would fault)
  // or maps it writable from now on; our own mapping stays writable.
  // F_SEAL_FUTURE_WRITE needs Linux 5.1: without it the read-only
  // descriptor alone keeps workers from writing.
  const int seals = F_SEAL_SHRINK | F_SEAL_GROW;
  if (::fcntl(counters->fd_, F_ADD_SEALS, seals | F_SEAL_FUTURE_WRITE) != 0) {
    spdlog::debug("layer counters: F_SEAL_FUTURE_WRITE refused ({}); sealing size only",
                  std::strerror(errno));
    if (::fcntl(counters->fd_, F_ADD_SEALS, seals) != 0) return SysError("fcntl(F_ADD_SEALS)");
  }
  if (::fcntl(counters->fd_, F_ADD_SEALS, F_SEAL_SEAL) != 0) return SysError("fcntl(F_SEAL_SEAL)");
  // A new open file description of the same memfd, read-only: a dup of fd_
  // would share fd_'s write access.
  const std::string self = absl::StrCat("/proc/self/fd/", counters->fd_);
  counters->read_only_fd_ = ::open(self.c_str(), O_RDONLY | O_CLOEXEC);
  if (counters->read_only_fd_ < 0) return SysError(absl::StrCat("open(", self, ", O_RDONLY)"));
  return counters;
}

LayerCounters::~LayerCounters() {
  if (counters_ != nullptr) ::munmap(counters_, bytes());
  if (read_only_fd_ >= 0) ::close(read_only_fd_);
  if (fd_ >= 0) ::close(fd_);
}

uint64_t LayerCounters::Reserve(uint32_t set, uint32_t layers) {
  return reserved_[set].fetch_add(layers, std::memory_order_relaxed);
}

void LayerCounters::Publish(uint32_t set, uint64_t base, uint32_t layer) {
  StoreAtLeast(set, base + layer + 1);
}

void LayerCounters::Release(uint32_t set, uint64_t base, uint32_t layers) {
  StoreAtLeast(set, base + layers);
}

uint64_t LayerCounters::Recorded(uint32_t set) const {
  return __atomic_load_n(&counters_[set], __ATOMIC_ACQUIRE);
}

void LayerCounters::StoreAtLeast(uint32_t set, uint64_t value) {
  // The memory is shared with another process, so it is a plain uint64_t
  // accessed through the atomic builtins (lock-free on every 64-bit target),
  // not a std::atomic whose layout the worker would have to share.
  uint64_t* counter = &counters_[set];
  uint64_t now = __atomic_load_n(counter, __ATOMIC_RELAXED);
  while (now < value && !__atomic_compare_exchange_n(counter, &now, value, /*weak=*/true,
                                                     __ATOMIC_RELEASE, __ATOMIC_RELAXED)) {
  }
}

}  // namespace kvhost
