// LogLimit: a bound on how many lines one kind of log message may write,
// so that a client repeating what logs a line (opening and closing
// mailboxes, flooding tickets) cannot flood kvhostd's log.
//
// Each LogLimit allows `burst` lines per `window`; past that it stays quiet
// until the window ends, and the first line allowed after counts the lines
// it kept quiet (Allow's `suppressed`), so the log says how many there were.
//
// Thread safety: Allow may be called concurrently. Nothing is owned.
#ifndef KVHOST_SERVER_LOG_LIMIT_H_
#define KVHOST_SERVER_LOG_LIMIT_H_

#include <cstdint>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace kvhost {

class LogLimit {
 public:
  // A person reads a few lines a second; an operator's alert wants the
  // first of a burst and a count, not every line.
  explicit LogLimit(uint32_t burst = 10, absl::Duration window = absl::Seconds(1))
      : burst_(burst), window_(window) {}
  LogLimit(const LogLimit&) = delete;
  LogLimit& operator=(const LogLimit&) = delete;

  // Whether to write the line now. When true, `*suppressed` (if not null)
  // is set to the lines refused since the last one allowed (0 usually), for
  // the caller to append ("... and 41 more like it").
  bool Allow(uint64_t* suppressed = nullptr) {
    const absl::Time now = absl::Now();
    absl::MutexLock lock(&mu_);
    if (now - start_ >= window_) {
      start_ = now;
      lines_ = 0;
    }
    if (lines_ >= burst_) {
      ++suppressed_;
      return false;
    }
    ++lines_;
    if (suppressed != nullptr) *suppressed = suppressed_;
    suppressed_ = 0;
    return true;
  }

 private:
  const uint32_t burst_;
  const absl::Duration window_;
  absl::Mutex mu_;
  absl::Time start_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  uint32_t lines_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t suppressed_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvhost

#endif  // KVHOST_SERVER_LOG_LIMIT_H_
