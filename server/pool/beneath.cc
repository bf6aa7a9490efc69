#include "server/pool/beneath.h"

#include <fcntl.h>
#include <linux/openat2.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"

namespace kvhost {

std::string EscapedPath(const std::string& text) { return absl::CEscape(text); }

absl::Status CheckNoNul(const std::string& text, const std::string& what) {
  if (text.find('\0') == std::string::npos) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(what, " '", EscapedPath(text), "' holds a NUL byte"));
}

absl::Status OpenErrorStatus(int err, const std::string& what, const std::string& where) {
  const std::string text = absl::StrCat(what, " ", EscapedPath(where), ": ", std::strerror(err));
  switch (err) {
    case ENOENT:
      return absl::NotFoundError(absl::StrCat("no file ", EscapedPath(where)));
    case EEXIST:
      return absl::AlreadyExistsError(absl::StrCat(EscapedPath(where), " already exists"));
    case EMFILE:
    case ENFILE:
      return absl::ResourceExhaustedError(absl::StrCat("out of file descriptors (", text, ")"));
    case ENOSPC:
      return absl::ResourceExhaustedError(absl::StrCat(text, ": the file system is full"));
    case EACCES:
    case EPERM:
      return absl::PermissionDeniedError(text);
    case ENOTDIR:
    case EISDIR:
    case ENAMETOOLONG:
      return absl::InvalidArgumentError(text);
    default:
      return absl::FailedPreconditionError(text);
  }
}

namespace {

// What ELOOP / EXDEV mean beneath a directory: the path tried to leave it.
absl::Status OutsideStatus(const DirFd& dir, const std::string& relative, absl::string_view why) {
  return absl::PermissionDeniedError(absl::StrCat(EscapedPath(dir.Join(relative)), ": ", why,
                                                  " (refused: it may lead outside the ",
                                                  dir.label(), " ", EscapedPath(dir.path()), ")"));
}

constexpr absl::string_view kSymlinkOnTheWay = "a symbolic link on the way, which is not followed";

absl::Status StatusOfOpen(const DirFd& dir, const std::string& relative, int err) {
  if (err == ELOOP || err == EXDEV) return OutsideStatus(dir, relative, kSymlinkOnTheWay);
  return OpenErrorStatus(err, "cannot open", dir.Join(relative));
}

// The lexical refusals of the header, before any system call.
absl::Status CheckRelative(const DirFd& dir, const std::string& relative) {
  if (absl::Status s = CheckNoNul(relative, "path"); !s.ok()) return s;
  if (relative.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("empty path beneath the ", dir.label(), " ", EscapedPath(dir.path())));
  }
  if (relative.size() >= PATH_MAX) {
    return absl::InvalidArgumentError(absl::StrCat("path beneath the ", dir.label(), " has ",
                                                   relative.size(), " bytes, over ", PATH_MAX - 1));
  }
  if (relative[0] == '/') {
    return absl::InvalidArgumentError(
        absl::StrCat("path '", EscapedPath(relative), "' is not relative to the ", dir.label()));
  }
  for (absl::string_view part : absl::StrSplit(relative, '/')) {
    if (part.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("path '", EscapedPath(dir.Join(relative)),
                       "' has an empty component ('//' or a final '/')"));
    }
    if (part == "..") return OutsideStatus(dir, relative, "'..' is not allowed");
  }
  return absl::OkStatus();
}

// Whether openat2 works here: it may be missing (ENOSYS: kernels before 5.6,
// gVisor) or blocked by a seccomp filter that answers EPERM for system calls
// it does not know (older container runtimes). Probed once.
bool Openat2Works() {
  static const bool works = [] {
    struct open_how how = {};
    how.flags = O_RDONLY | O_DIRECTORY | O_CLOEXEC;
    const long fd = ::syscall(SYS_openat2, AT_FDCWD, "/", &how, sizeof(how));
    if (fd < 0) return errno != ENOSYS && errno != EPERM;
    ::close(static_cast<int>(fd));
    return true;
  }();
  return works;
}

// The open(2) mode argument only counts with O_CREAT / O_TMPFILE; openat2
// refuses a mode without them.
mode_t ModeFor(int flags, mode_t mode) {
  return (flags & O_CREAT) != 0 || (flags & O_TMPFILE) == O_TMPFILE ? mode : 0;
}

// An intermediate symbolic link refused by O_NOFOLLOW shows as ELOOP or,
// with O_DIRECTORY, as ENOTDIR: say which it was, as openat2 does (ELOOP).
int WalkErrno(int at, const std::string& name, int err) {
  struct stat st;
  if ((err == ENOTDIR || err == ELOOP) &&
      ::fstatat(at, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0) {
    return S_ISLNK(st.st_mode) ? ELOOP : ENOTDIR;
  }
  return err;
}

}  // namespace

absl::StatusOr<DirFd> DirFd::Open(const std::string& path, std::string label) {
  if (absl::Status s = CheckNoNul(path, label); !s.ok()) return s;
  std::string trimmed = path;
  while (trimmed.size() > 1 && trimmed.back() == '/') trimmed.pop_back();
  const int fd = ::open(trimmed.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    if (err == EMFILE || err == ENFILE) return OpenErrorStatus(err, "cannot open", trimmed);
    return absl::FailedPreconditionError(
        absl::StrCat(label, " ", EscapedPath(trimmed), " is not usable: ", std::strerror(err)));
  }
  return DirFd(UniqueFd(fd), std::move(trimmed), std::move(label));
}

std::string DirFd::Join(const std::string& relative) const {
  return absl::StrCat(path_, path_ == "/" ? "" : "/", relative);
}

absl::StatusOr<UniqueFd> DirFd::OpenBeneath(const std::string& relative, int flags,
                                            mode_t mode) const {
  if (Openat2Works()) return OpenWithOpenat2(relative, flags, mode);
  return OpenByWalk(relative, flags, mode);
}

absl::StatusOr<UniqueFd> DirFd::OpenWithOpenat2(const std::string& relative, int flags,
                                                mode_t mode) const {
  if (absl::Status s = CheckRelative(*this, relative); !s.ok()) return s;
  if (!Openat2Works()) return absl::UnimplementedError("this kernel has no usable openat2");
  struct open_how how = {};
  how.flags = static_cast<uint64_t>(flags | O_CLOEXEC | O_NOFOLLOW);
  how.mode = ModeFor(flags, mode);
  how.resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS;
  // EAGAIN: a rename elsewhere in the file system raced the lookup (the
  // kernel cannot then vouch for RESOLVE_BENEATH); trying again is safe.
  constexpr int kAttempts = 8;
  int err = EAGAIN;
  for (int i = 0; i < kAttempts && err == EAGAIN; ++i) {
    const long fd = ::syscall(SYS_openat2, fd_.get(), relative.c_str(), &how, sizeof(how));
    if (fd >= 0) return UniqueFd(static_cast<int>(fd));
    err = errno;
  }
  return StatusOfOpen(*this, relative, err);
}

absl::StatusOr<UniqueFd> DirFd::OpenByWalk(const std::string& relative, int flags,
                                           mode_t mode) const {
  if (absl::Status s = CheckRelative(*this, relative); !s.ok()) return s;
  const std::vector<std::string> parts = absl::StrSplit(relative, '/');
  UniqueFd held;  // the current intermediate directory, once below fd_
  int at = fd_.get();
  for (size_t i = 0; i + 1 < parts.size(); ++i) {
    if (parts[i] == ".") continue;
    const int next =
        ::openat(at, parts[i].c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (next < 0) return StatusOfOpen(*this, relative, WalkErrno(at, parts[i], errno));
    held = UniqueFd(next);
    at = next;
  }
  const int fd =
      ::openat(at, parts.back().c_str(), flags | O_CLOEXEC | O_NOFOLLOW, ModeFor(flags, mode));
  // The last component's errno as the kernel gives it: openat2 gives the
  // same (ENOTDIR for a symbolic link opened with O_DIRECTORY).
  if (fd < 0) return StatusOfOpen(*this, relative, errno);
  return UniqueFd(fd);
}

absl::StatusOr<uint64_t> DirFd::FreeBytes() const {
  struct statvfs vfs;
  if (::fstatvfs(fd_.get(), &vfs) != 0) {
    return absl::FailedPreconditionError(absl::StrCat("cannot read the free space of ", label_, " ",
                                                      EscapedPath(path_), ": ",
                                                      std::strerror(errno)));
  }
  const uint64_t blocks = vfs.f_bavail;
  const uint64_t block_bytes = vfs.f_frsize != 0 ? vfs.f_frsize : vfs.f_bsize;
  if (block_bytes != 0 && blocks > UINT64_MAX / block_bytes) return UINT64_MAX;
  return blocks * block_bytes;
}

}  // namespace kvhost
