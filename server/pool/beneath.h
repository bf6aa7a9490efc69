// Opening files beneath a directory without leaving it.
//
// The shm dir is writable by the workers that put their emulated device
// buffers there, so any name in it may be swapped for a symbolic link at any
// moment. Resolving a name first (realpath) and opening it afterwards lets a
// writer move the file between the two steps. Here a directory is opened once
// (DirFd) and every path beneath it is opened relative to that descriptor in
// one step that never follows a symbolic link and never climbs out:
// openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS) where the kernel has it, else
// (ENOSYS: older kernels, gVisor) a walk of openat(O_NOFOLLOW) one component
// at a time. What the caller then checks (file type, size, identity) is the
// descriptor it got, never the name.
//
// A relative path is refused before any system call when it is empty, starts
// with '/', holds a NUL byte, an empty component ("a//b", a trailing '/') or
// "..". "." components are allowed.
//
// Thread safety: a DirFd is immutable once opened; all functions may be
// called concurrently.
#ifndef KVHOST_SERVER_POOL_BENEATH_H_
#define KVHOST_SERVER_POOL_BENEATH_H_

#include <sys/types.h>

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/unique_fd.h"

namespace kvhost {

// The status of a failed open/openat/openat2 of `what` (for messages; the
// caller escapes it): NOT_FOUND (ENOENT), ALREADY_EXISTS (EEXIST),
// RESOURCE_EXHAUSTED "out of file descriptors (...)" (EMFILE, ENFILE) or
// "... file system is full" (ENOSPC), PERMISSION_DENIED (EACCES, EPERM, ELOOP,
// EXDEV: a symbolic link or a way out), INVALID_ARGUMENT (ENOTDIR, EISDIR,
// ENAMETOOLONG), FAILED_PRECONDITION otherwise.
absl::Status OpenErrorStatus(int err, const std::string& what, const std::string& where);

// `text` with control characters, NUL and non-ASCII bytes escaped (C style),
// for messages and logs.
std::string EscapedPath(const std::string& text);

// OK, or INVALID_ARGUMENT naming `text` (escaped) when it holds a NUL byte
// (protobuf strings may; the C calls would cut the path there).
absl::Status CheckNoNul(const std::string& text, const std::string& what);

class DirFd {
 public:
  // Opens directory `path` (symbolic links in `path` itself are followed: it
  // is the operator's). `label` names it in messages ("shm dir").
  // FAILED_PRECONDITION when it is not a usable directory, RESOURCE_EXHAUSTED
  // when out of file descriptors.
  static absl::StatusOr<DirFd> Open(const std::string& path, std::string label = "directory");

  DirFd(DirFd&&) = default;
  DirFd& operator=(DirFd&&) = default;

  int fd() const { return fd_.get(); }
  const std::string& path() const { return path_; }
  const std::string& label() const { return label_; }

  // Opens `relative` beneath this directory with open(2) `flags` (O_CLOEXEC
  // and O_NOFOLLOW are added) and `mode` for O_CREAT. Errors as
  // OpenErrorStatus; a path that would leave the directory (a symbolic link
  // anywhere on the way, "..") is PERMISSION_DENIED saying it is outside
  // the directory.
  absl::StatusOr<UniqueFd> OpenBeneath(const std::string& relative, int flags,
                                       mode_t mode = 0) const;
  // The two ways OpenBeneath may take, callable directly for tests.
  // OpenWithOpenat2 returns UNIMPLEMENTED when the kernel lacks openat2.
  absl::StatusOr<UniqueFd> OpenWithOpenat2(const std::string& relative, int flags,
                                           mode_t mode = 0) const;
  absl::StatusOr<UniqueFd> OpenByWalk(const std::string& relative, int flags,
                                      mode_t mode = 0) const;

  // `path()` + "/" + relative, for messages.
  std::string Join(const std::string& relative) const;

  // Bytes an unprivileged writer may still put on the directory's file
  // system (fstatvfs: f_bavail x f_frsize).
  absl::StatusOr<uint64_t> FreeBytes() const;

 private:
  DirFd(UniqueFd fd, std::string path, std::string label)
      : fd_(std::move(fd)), path_(std::move(path)), label_(std::move(label)) {}

  UniqueFd fd_;
  std::string path_;
  std::string label_;
};

}  // namespace kvhost

#endif  // KVHOST_SERVER_POOL_BENEATH_H_
