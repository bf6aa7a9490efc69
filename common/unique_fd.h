// UniqueFd: an owned file descriptor, closed when it goes; -1 holds none.
// The one owner of a descriptor in kvhostd and in the client library, so
// that no early return leaks one and none is closed twice.
//
// Thread safety: as an int: one owner at a time; moving hands it over.
#ifndef KVHOST_COMMON_UNIQUE_FD_H_
#define KVHOST_COMMON_UNIQUE_FD_H_

#include <unistd.h>

namespace kvhost {

class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  ~UniqueFd() { Reset(); }
  UniqueFd(UniqueFd&& other) noexcept : fd_(other.Release()) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept {
    if (this != &other) {
      Reset();
      fd_ = other.Release();
    }
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  // Hands the descriptor over (the caller closes it); holds none after.
  int Release() {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }
  // Closes the descriptor held, if any.
  void Reset() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

}  // namespace kvhost

#endif  // KVHOST_COMMON_UNIQUE_FD_H_
