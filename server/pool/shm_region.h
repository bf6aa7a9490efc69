// ShmRegion: a shared-memory file mapped into this process.
//
// Host pools keep their bytes in such files so other local processes (storage
// connectors, tests, the host backend's emulated device pools) can map the
// same bytes. A region created by the daemon owns its file: it holds an
// exclusive flock on it for its whole life (so that a daemon in any pid
// namespace can tell a live region file from one a crashed daemon left:
// IsRegionFileHeld), records the file's inode in a RegionInodes set while it
// lives, and removes the file when it is destroyed. A region opened from an
// existing file (a worker's emulated device buffer) only maps it.
//
// Every file is opened beneath its directory's descriptor, never by a path
// that follows symbolic links (server/pool/beneath.h); what is checked (type,
// size, identity) is the descriptor that is mapped.
//
// Thread safety: the mapping is fixed for the region's life; the bytes are the
// callers' to synchronise. RegionInodes is thread-safe.
#ifndef KVHOST_SERVER_POOL_SHM_REGION_H_
#define KVHOST_SERVER_POOL_SHM_REGION_H_

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/pool/beneath.h"

namespace kvhost {

// The (st_dev, st_ino) of the region files a daemon has created and not yet
// let go of: such a file must never be attached as a worker's device buffer
// (another pool's bytes would be read and written without its owner token).
class RegionInodes {
 public:
  void Add(dev_t dev, ino_t ino);
  void Remove(dev_t dev, ino_t ino);
  bool Contains(dev_t dev, ino_t ino) const;
  size_t size() const;

 private:
  mutable absl::Mutex mu_;
  std::set<std::pair<dev_t, ino_t>> inodes_ ABSL_GUARDED_BY(mu_);
};

// How region files are made.
struct RegionFileOptions {
  // Mode, applied with fchmod (the umask does not narrow it).
  uint32_t mode = 0600;
  // Group, applied with fchown; -1 keeps the process's.
  int64_t gid = -1;
  // Where the file's inode is recorded while the region lives; may be null.
  std::shared_ptr<RegionInodes> inodes;
  // Create's populate step (server/pool/populate.h): told the bytes of each
  // chunk reserved and mapped, asked before each chunk whether to stop
  // (Create then fails with CANCELLED and removes the file). Either may be
  // empty; both are called from several threads at once.
  std::function<void(uint64_t)> on_progress;
  std::function<bool()> cancelled;
};

class ShmRegion {
 public:
  // Creates file `name` in `dir` (it must not exist: ALREADY_EXISTS; a
  // symbolic link of that name counts as existing and is not followed),
  // gives it `options`' mode and group, reserves `bytes` of backing memory
  // (posix_fallocate, so a full tmpfs fails here with RESOURCE_EXHAUSTED rather
  // than with SIGBUS later) and maps it with every page touched, chunk by
  // chunk on several threads (ReserveAndPopulate). CANCELLED when
  // `options.cancelled` said so; the file is then gone.
  // REQUIRES: `name` is one path component.
  static absl::StatusOr<std::unique_ptr<ShmRegion>> Create(std::shared_ptr<const DirFd> dir,
                                                           const std::string& name, uint64_t bytes,
                                                           const RegionFileOptions& options);
  // For tests and tools: Create in the directory part of `path`, which is
  // opened by its name.
  static absl::StatusOr<std::unique_ptr<ShmRegion>> Create(const std::string& path, uint64_t bytes,
                                                           uint32_t mode = 0600);
  // Maps the existing file `relative` beneath `dir` read-write, whole.
  // INVALID_ARGUMENT unless it is a non-empty regular file; PERMISSION_DENIED
  // when it is one of the region files in `refused` (may be null) or the path
  // leaves `dir`; the errors of DirFd::OpenBeneath.
  static absl::StatusOr<std::unique_ptr<ShmRegion>> Open(const DirFd& dir,
                                                         const std::string& relative,
                                                         const RegionInodes* refused);

  ~ShmRegion();
  ShmRegion(const ShmRegion&) = delete;
  ShmRegion& operator=(const ShmRegion&) = delete;

  uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }
  const std::string& path() const { return path_; }

  // A new read-write open file description of a created region's file, for
  // a process the daemon hands it to (a worker copy's own mapping). New, not
  // a dup of the locked one, so that a mapping in that process never holds
  // this region's flock. FAILED_PRECONDITION for a region Open made (it
  // keeps no descriptor); the errors of the reopen otherwise.
  absl::StatusOr<UniqueFd> Reopen() const;

  // Removes the file now if this region owns it; the mapping stays valid. The
  // destructor then leaves the path alone (it may name a newer file by then).
  void Unlink();

 private:
  ShmRegion() = default;

  std::shared_ptr<const DirFd> dir_;  // the created file's directory; null for Open
  std::string name_;                  // the created file's name in dir_
  std::string path_;
  uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
  bool owner_ = false;
  UniqueFd lock_fd_;  // the created file, flock'ed while the region lives; none for Open
  dev_t dev_ = 0;
  ino_t ino_ = 0;
  std::shared_ptr<RegionInodes> inodes_;  // where dev_/ino_ are recorded, or null
};

// Whether some process holds the flock of region file `name` in `dir` that
// ShmRegion::Create made (false too when it cannot be opened or is not a
// regular file; symbolic links are not followed).
bool IsRegionFileHeld(const DirFd& dir, const std::string& name);

}  // namespace kvhost

#endif  // KVHOST_SERVER_POOL_SHM_REGION_H_
