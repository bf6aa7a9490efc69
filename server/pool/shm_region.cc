#include "server/pool/shm_region.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace kvhost {
namespace {

std::string ErrnoText(int err) { return std::strerror(err); }

}  // namespace

absl::StatusOr<std::unique_ptr<ShmRegion>> ShmRegion::Create(const std::string& path,
                                                             uint64_t bytes, uint32_t mode) {
  if (bytes == 0) return absl::InvalidArgumentError("shared-memory region of 0 bytes");
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, mode);
  if (fd < 0) {
    const int err = errno;
    if (err == EEXIST) {
      return absl::AlreadyExistsError(absl::StrCat("shared-memory file ", path, " already exists"));
    }
    return absl::FailedPreconditionError(
        absl::StrCat("cannot create shared-memory file ", path, ": ", ErrnoText(err)));
  }
  // fchmod: the umask must not narrow the mode the operator asked for.
  (void)::fchmod(fd, mode);
  // Held until the region goes: the file's owner is alive while it is.
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int lock_err = errno;
    ::close(fd);
    ::unlink(path.c_str());
    return absl::FailedPreconditionError(
        absl::StrCat("cannot lock shared-memory file ", path, ": ", ErrnoText(lock_err)));
  }
  int err = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  if (err != 0) {
    ::close(fd);
    ::unlink(path.c_str());
    if (err == ENOSPC || err == EFBIG) {
      return absl::ResourceExhaustedError(
          absl::StrCat("cannot reserve ", bytes, " bytes for ", path,
                       ": the file system is full (for /dev/shm, raise its size)"));
    }
    return absl::FailedPreconditionError(
        absl::StrCat("cannot reserve ", bytes, " bytes for ", path, ": ", ErrnoText(err)));
  }
  // Mapped through a second open file description, so that the lock's is
  // referenced by this process's descriptor table alone. A mapping keeps its
  // file description alive past the process: the CUDA driver holds a killed
  // process's memory (pinned by cudaHostRegister) for a while after it is
  // reaped, and a lock taken on the mapped description lingers with it.
  const int map_fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  void* data = map_fd < 0 ? MAP_FAILED
                          : ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                                   MAP_SHARED | MAP_POPULATE, map_fd, 0);
  err = errno;
  if (map_fd >= 0) ::close(map_fd);
  if (data == MAP_FAILED) {
    ::close(fd);
    ::unlink(path.c_str());
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot map ", bytes, " bytes of ", path, ": ", ErrnoText(err)));
  }
  return std::unique_ptr<ShmRegion>(
      new ShmRegion(path, static_cast<uint8_t*>(data), bytes, /*owner=*/true, fd));
}

absl::StatusOr<std::unique_ptr<ShmRegion>> ShmRegion::Open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    if (err == ENOENT) return absl::NotFoundError(absl::StrCat("no file ", path));
    return absl::PermissionDeniedError(absl::StrCat("cannot open ", path, ": ", ErrnoText(err)));
  }
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size <= 0) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat(path, " is not a non-empty regular file"));
  }
  const uint64_t bytes = static_cast<uint64_t>(st.st_size);
  // Populated: a worker's device buffers are copied to and from at once, and
  // page faults during a transfer would cost more than the copy itself.
  void* data = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  const int err = errno;
  ::close(fd);
  if (data == MAP_FAILED) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot map ", bytes, " bytes of ", path, ": ", ErrnoText(err)));
  }
  return std::unique_ptr<ShmRegion>(
      new ShmRegion(path, static_cast<uint8_t*>(data), bytes, /*owner=*/false, /*lock_fd=*/-1));
}

ShmRegion::~ShmRegion() {
  ::munmap(data_, size_);
  if (owner_) ::unlink(path_.c_str());
  if (lock_fd_ >= 0) ::close(lock_fd_);  // after the unlink: never an unlocked live file
}

bool IsRegionFileHeld(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  const bool held = ::flock(fd, LOCK_EX | LOCK_NB) != 0 && errno == EWOULDBLOCK;
  ::close(fd);
  return held;
}

void ShmRegion::Unlink() {
  if (!owner_) return;
  ::unlink(path_.c_str());
  owner_ = false;
}

absl::StatusOr<std::string> ResolvePathInside(const std::string& dir, const std::string& path) {
  char dir_real[PATH_MAX];
  char path_real[PATH_MAX];
  if (::realpath(dir.c_str(), dir_real) == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("shm dir ", dir, " is not usable: ", ErrnoText(errno)));
  }
  if (path.empty() || path[0] != '/') {
    return absl::InvalidArgumentError(absl::StrCat("path '", path, "' is not absolute"));
  }
  if (::realpath(path.c_str(), path_real) == nullptr) {
    const int err = errno;
    if (err == ENOENT) return absl::NotFoundError(absl::StrCat("no file ", path));
    return absl::PermissionDeniedError(absl::StrCat("cannot resolve ", path, ": ", ErrnoText(err)));
  }
  const std::string prefix = absl::StrCat(dir_real, dir_real[1] == '\0' ? "" : "/");
  if (!absl::StartsWith(path_real, prefix)) {
    return absl::PermissionDeniedError(
        absl::StrCat("path ", path, " (", path_real, ") is outside the shm dir ", dir_real));
  }
  return std::string(path_real);
}

}  // namespace kvhost
