// ProgressLine: while it lives, redraws "<label>: 1.50 of 4.00 GiB (37 %)" on
// stderr every 200 ms from what `poll` returns (done, total bytes); only on a
// terminal. The line is cleared when it stops.
//
// `poll` runs on the line's own thread, so it must be safe to call there
// while the owner goes on; the destructor stops and joins that thread.
#ifndef KVHOST_CLIENT_KVHOSTCTL_PROGRESS_LINE_H_
#define KVHOST_CLIENT_KVHOSTCTL_PROGRESS_LINE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <thread>
#include <utility>

namespace kvhost::ctl {

class ProgressLine {
 public:
  // Done and total bytes; nullopt when there is nothing to show this time.
  using Poll = std::function<std::optional<std::pair<uint64_t, uint64_t>>()>;

  ProgressLine(std::string label, Poll poll);
  ~ProgressLine();
  ProgressLine(const ProgressLine&) = delete;
  ProgressLine& operator=(const ProgressLine&) = delete;

 private:
  void Draw(const std::string& label, const Poll& poll);

  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace kvhost::ctl

#endif  // KVHOST_CLIENT_KVHOSTCTL_PROGRESS_LINE_H_
