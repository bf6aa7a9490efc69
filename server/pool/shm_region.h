// ShmRegion: a shared-memory file mapped into this process.
//
// Host pools keep their bytes in such files so other local processes (storage
// connectors, tests, the host backend's emulated device pools) can map the
// same bytes. A region created by the daemon owns its file: it holds an
// exclusive flock on it for its whole life (so that a daemon in any pid
// namespace can tell a live region file from one a crashed daemon left:
// IsRegionFileHeld), and removes the file when it is destroyed. A region
// opened from an existing file (a worker's emulated device buffer) only maps
// it.
//
// Thread safety: the mapping is fixed for the region's life; the bytes are the
// callers' to synchronise.
#ifndef KVHOST_SERVER_POOL_SHM_REGION_H_
#define KVHOST_SERVER_POOL_SHM_REGION_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace kvhost {

class ShmRegion {
 public:
  // Creates `path` (which must not exist), reserves `bytes` of backing memory
  // (posix_fallocate, so a full tmpfs fails here with RESOURCE_EXHAUSTED rather
  // than with SIGBUS later) and maps it with every page touched.
  static absl::StatusOr<std::unique_ptr<ShmRegion>> Create(const std::string& path, uint64_t bytes,
                                                           uint32_t mode = 0600);
  // Maps an existing file read-write, whole.
  static absl::StatusOr<std::unique_ptr<ShmRegion>> Open(const std::string& path);

  ~ShmRegion();
  ShmRegion(const ShmRegion&) = delete;
  ShmRegion& operator=(const ShmRegion&) = delete;

  uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }
  const std::string& path() const { return path_; }

  // Removes the file now if this region owns it; the mapping stays valid. The
  // destructor then leaves the path alone (it may name a newer file by then).
  void Unlink();

 private:
  ShmRegion(std::string path, uint8_t* data, uint64_t size, bool owner, int lock_fd)
      : path_(std::move(path)), data_(data), size_(size), owner_(owner), lock_fd_(lock_fd) {}

  std::string path_;
  uint8_t* data_;
  uint64_t size_;
  bool owner_;
  int lock_fd_;  // the created file, flock'ed while the region lives; -1 for Open
};

// Whether some process holds the flock of a region file that ShmRegion::Create
// made (false too when the file cannot be opened).
bool IsRegionFileHeld(const std::string& path);

// Canonical form of `path` if it names an existing file inside directory
// `dir` (symlinks resolved on both); PERMISSION_DENIED naming both otherwise,
// NOT_FOUND when the file does not exist.
absl::StatusOr<std::string> ResolvePathInside(const std::string& dir, const std::string& path);

}  // namespace kvhost

#endif  // KVHOST_SERVER_POOL_SHM_REGION_H_
