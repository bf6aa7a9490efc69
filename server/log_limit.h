// LogLimit: which occurrences of one kind of event get a log line, so that a
// flood (a local attacker's refused requests, results dropped uncollected)
// says so without flooding the log: the 1st, 2nd, 4th, 8th ... of a run, each
// line giving its number in the run. A run ends after kLogLimitQuiet without
// an occurrence, so the next one, long after a flood, is logged at once.
// One attacker thread refused in a loop (~100,000 times a second) then
// writes ~17 lines a second's run, not 100,000.
//
// IsLoggedOccurrence is the rule alone, for a count kept elsewhere (a
// metric's); LogLimitByCode keeps one LogLimit per canonical status code,
// for refusals logged by reason, so one reason's flood hides no other.
//
// Header-only. Thread-safe: each limit has a mutex of its own, held for a
// few instructions.
#ifndef KVHOST_SERVER_LOG_LIMIT_H_
#define KVHOST_SERVER_LOG_LIMIT_H_

#include <array>
#include <cstdint>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace kvhost {

// How long a run of occurrences lasts without one: a flood that pauses
// less than this goes on counting.
inline constexpr absl::Duration kLogLimitQuiet = absl::Minutes(1);

// Whether the `n`th occurrence (counting from 1) gets a line: n is a power
// of two.
inline bool IsLoggedOccurrence(uint64_t n) { return n != 0 && (n & (n - 1)) == 0; }

// What a line of the `n`th occurrence of its run adds: nothing for the 1st,
// else its number and what was left out.
inline std::string LogLimitNote(uint64_t n) {
  if (n <= 1) return "";
  return absl::StrCat(" (", n, " so far in this run; the log keeps the 1st, 2nd, 4th ...)");
}

class LogLimit {
 public:
  // Counts one occurrence at `now`: its number in its run when it gets a
  // line (IsLoggedOccurrence), else 0.
  uint64_t Tick(absl::Time now = absl::Now()) {
    absl::MutexLock lock(&mu_);
    if (now - last_ >= kLogLimitQuiet) run_ = 0;
    last_ = now;
    ++total_;
    const uint64_t n = ++run_;
    return IsLoggedOccurrence(n) ? n : 0;
  }
  // Occurrences counted, in every run.
  uint64_t total() const {
    absl::MutexLock lock(&mu_);
    return total_;
  }

 private:
  mutable absl::Mutex mu_;
  absl::Time last_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  uint64_t run_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t total_ ABSL_GUARDED_BY(mu_) = 0;
};

class LogLimitByCode {
 public:
  // LogLimit::Tick of `code`'s limit.
  uint64_t Tick(absl::StatusCode code, absl::Time now = absl::Now()) {
    const size_t i = static_cast<size_t>(code);
    return limits_[i < limits_.size() ? i : static_cast<size_t>(absl::StatusCode::kUnknown)].Tick(
        now);
  }

 private:
  // Every canonical code, 0 (OK) to 16 (UNAUTHENTICATED).
  std::array<LogLimit, 17> limits_;
};

}  // namespace kvhost

#endif  // KVHOST_SERVER_LOG_LIMIT_H_
