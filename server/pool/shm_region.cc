#include "server/pool/shm_region.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "server/pool/populate.h"

namespace kvhost {
namespace {

std::string ErrnoText(int err) { return std::strerror(err); }

// `status` with `context` before its message, keeping the code.
absl::Status Prefixed(const std::string& context, const absl::Status& status) {
  return absl::Status(status.code(), absl::StrCat(context, status.message()));
}

}  // namespace

void RegionInodes::Add(dev_t dev, ino_t ino) {
  absl::MutexLock lock(&mu_);
  inodes_.emplace(dev, ino);
}

void RegionInodes::Remove(dev_t dev, ino_t ino) {
  absl::MutexLock lock(&mu_);
  inodes_.erase({dev, ino});
}

bool RegionInodes::Contains(dev_t dev, ino_t ino) const {
  absl::MutexLock lock(&mu_);
  return inodes_.count({dev, ino}) != 0;
}

size_t RegionInodes::size() const {
  absl::MutexLock lock(&mu_);
  return inodes_.size();
}

absl::StatusOr<std::unique_ptr<ShmRegion>> ShmRegion::Create(std::shared_ptr<const DirFd> dir,
                                                             const std::string& name,
                                                             uint64_t bytes,
                                                             const RegionFileOptions& options) {
  if (bytes == 0) return absl::InvalidArgumentError("shared-memory region of 0 bytes");
  const std::string path = dir->Join(name);
  const std::string escaped = EscapedPath(path);
  // O_EXCL with O_NOFOLLOW: a name someone else made (a file or a symbolic
  // link) is never opened, let alone truncated or chmod'ed.
  absl::StatusOr<UniqueFd> created =
      dir->OpenBeneath(name, O_RDWR | O_CREAT | O_EXCL | O_NONBLOCK, 0600);
  if (!created.ok()) {
    if (absl::IsAlreadyExists(created.status())) {
      return absl::AlreadyExistsError(
          absl::StrCat("shared-memory file ", escaped, " already exists"));
    }
    return Prefixed("cannot create shared-memory file: ", created.status());
  }
  // From here on the destructor undoes what was done: it removes the file
  // (if it is still this inode), closes it and forgets the inode.
  std::unique_ptr<ShmRegion> region(new ShmRegion());
  region->dir_ = std::move(dir);
  region->name_ = name;
  region->path_ = path;
  region->lock_fd_ = *std::move(created);
  const int fd = region->lock_fd_.get();
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot stat shared-memory file ", escaped, ": ", ErrnoText(errno)));
  }
  region->dev_ = st.st_dev;
  region->ino_ = st.st_ino;
  region->owner_ = true;
  if (options.inodes) {
    options.inodes->Add(st.st_dev, st.st_ino);
    region->inodes_ = options.inodes;
  }
  // The group first: fchown may clear mode bits, fchmod then sets them; and
  // fchmod so that the umask does not narrow the mode the operator asked for.
  if (options.gid >= 0 && ::fchown(fd, static_cast<uid_t>(-1), static_cast<gid_t>(options.gid))) {
    return absl::PermissionDeniedError(absl::StrCat("cannot give shared-memory file ", escaped,
                                                    " to group ", options.gid, ": ",
                                                    ErrnoText(errno)));
  }
  if (::fchmod(fd, options.mode) != 0) {
    return absl::FailedPreconditionError(absl::StrCat("cannot set the mode of shared-memory file ",
                                                      escaped, ": ", ErrnoText(errno)));
  }
  // Held until the region goes: the file's owner is alive while it is.
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot lock shared-memory file ", escaped, ": ", ErrnoText(errno)));
  }
  // Mapped through a second open file description, so that the lock's is
  // referenced by this process's descriptor table alone. A mapping keeps its
  // file description alive past the process: the CUDA driver holds a killed
  // process's memory (pinned by cudaHostRegister) for a while after it is
  // reaped, and a lock taken on the mapped description lingers with it.
  // The second description comes from /proc/self/fd, not from the name: it is
  // the same inode whatever has happened to the name since.
  const std::string self = absl::StrCat("/proc/self/fd/", fd);
  UniqueFd map_fd(::open(self.c_str(), O_RDWR | O_CLOEXEC));
  if (!map_fd.valid()) {
    return Prefixed(absl::StrCat("cannot map shared-memory file ", escaped, ": "),
                    OpenErrorStatus(errno, "cannot reopen", self));
  }
  struct stat again;
  if (::fstat(map_fd.get(), &again) != 0 || again.st_dev != st.st_dev ||
      again.st_ino != st.st_ino) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot map shared-memory file ", escaped, ": ", self,
                     " is not the file created (is /proc this process's?)"));
  }
  // Mapped before its pages exist (the file is still empty), then reserved
  // and faulted in chunk by chunk on several threads (server/pool/populate.h):
  // a full file system still fails before any page is touched, and the work
  // reports progress and can be cancelled.
  void* data = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, map_fd.get(), 0);
  if (data == MAP_FAILED) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot map ", bytes, " bytes of ", escaped, ": ", ErrnoText(errno)));
  }
  region->data_ = static_cast<uint8_t*>(data);
  region->size_ = bytes;
  PopulateOptions populate;
  populate.on_progress = options.on_progress;
  populate.cancelled = options.cancelled;
  if (absl::Status s =
          ReserveAndPopulate(map_fd.get(), region->data_, bytes, escaped.c_str(), populate);
      !s.ok()) {
    return s;
  }
  return region;
}

absl::StatusOr<std::unique_ptr<ShmRegion>> ShmRegion::Create(const std::string& path,
                                                             uint64_t bytes, uint32_t mode) {
  const size_t slash = path.rfind('/');
  const std::string dir_path =
      slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
  const std::string name = slash == std::string::npos ? path : path.substr(slash + 1);
  absl::StatusOr<DirFd> dir = DirFd::Open(dir_path, "directory");
  if (!dir.ok()) return dir.status();
  RegionFileOptions options;
  options.mode = mode;
  return Create(std::make_shared<const DirFd>(*std::move(dir)), name, bytes, options);
}

absl::StatusOr<std::unique_ptr<ShmRegion>> ShmRegion::Open(const DirFd& dir,
                                                           const std::string& relative,
                                                           const RegionInodes* refused) {
  const std::string escaped = EscapedPath(dir.Join(relative));
  // O_NONBLOCK: a FIFO put in the file's place must not hang the daemon.
  absl::StatusOr<UniqueFd> fd = dir.OpenBeneath(relative, O_RDWR | O_NONBLOCK);
  if (!fd.ok()) return fd.status();
  struct stat st;
  if (::fstat(fd->get(), &st) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot stat ", escaped, ": ", ErrnoText(errno)));
  }
  if (refused != nullptr && refused->Contains(st.st_dev, st.st_ino)) {
    return absl::PermissionDeniedError(
        absl::StrCat(escaped,
                     " is a kvhostd pool region file; a pool's memory cannot serve as a device "
                     "buffer"));
  }
  if (!S_ISREG(st.st_mode) || st.st_size <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(escaped, " is not a non-empty regular file"));
  }
  const uint64_t bytes = static_cast<uint64_t>(st.st_size);
  // Populated: a worker's device buffers are copied to and from at once, and
  // page faults during a transfer would cost more than the copy itself.
  void* data =
      ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd->get(), 0);
  if (data == MAP_FAILED) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot map ", bytes, " bytes of ", escaped, ": ", ErrnoText(errno)));
  }
  std::unique_ptr<ShmRegion> region(new ShmRegion());
  region->path_ = dir.Join(relative);
  region->data_ = static_cast<uint8_t*>(data);
  region->size_ = bytes;
  return region;
}

absl::StatusOr<UniqueFd> ShmRegion::Reopen() const {
  if (!lock_fd_.valid()) {
    return absl::FailedPreconditionError(
        absl::StrCat(EscapedPath(path_), " was opened, not created, by kvhostd"));
  }
  // As Create's mapping: through /proc/self/fd, so the same inode whatever
  // happened to the name, checked after the open.
  const std::string self = absl::StrCat("/proc/self/fd/", lock_fd_.get());
  UniqueFd fd(::open(self.c_str(), O_RDWR | O_CLOEXEC));
  if (!fd.valid()) return OpenErrorStatus(errno, "cannot reopen", self);
  struct stat st;
  if (::fstat(fd.get(), &st) != 0 || st.st_dev != dev_ || st.st_ino != ino_) {
    return absl::FailedPreconditionError(
        absl::StrCat(self, " is not the region file of ", EscapedPath(path_)));
  }
  return fd;
}

ShmRegion::~ShmRegion() {
  if (data_ != nullptr) ParallelUnmap(data_, size_);
  Unlink();
  lock_fd_.Reset();  // after the unlink: never an unlocked live file
  // Only now may the inode number name another file.
  if (inodes_) inodes_->Remove(dev_, ino_);
}

void ShmRegion::Unlink() {
  if (!owner_) return;
  owner_ = false;
  // Only the file this region made: whoever can write the directory may have
  // put something else under the name since.
  struct stat st;
  if (::fstatat(dir_->fd(), name_.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 && st.st_dev == dev_ &&
      st.st_ino == ino_) {
    ::unlinkat(dir_->fd(), name_.c_str(), 0);
  }
}

bool IsRegionFileHeld(const DirFd& dir, const std::string& name) {
  absl::StatusOr<UniqueFd> fd = dir.OpenBeneath(name, O_RDONLY | O_NONBLOCK);
  if (!fd.ok()) return false;
  struct stat st;
  if (::fstat(fd->get(), &st) != 0 || !S_ISREG(st.st_mode)) return false;
  return ::flock(fd->get(), LOCK_EX | LOCK_NB) != 0 && errno == EWOULDBLOCK;
}

}  // namespace kvhost
