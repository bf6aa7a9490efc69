#include "client/kvhostctl/progress_line.h"

#include <unistd.h>

#include <cstdio>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/kvhostctl/output.h"

namespace kvhost::ctl {

ProgressLine::ProgressLine(std::string label, Poll poll) {
  if (!::isatty(2)) return;
  thread_ =
      std::thread([this, label = std::move(label), poll = std::move(poll)] { Draw(label, poll); });
}

ProgressLine::~ProgressLine() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
}

void ProgressLine::Draw(const std::string& label, const Poll& poll) {
  bool drawn = false;
  while (!stop_.load()) {
    for (int i = 0; i < 20 && !stop_.load(); ++i) absl::SleepFor(absl::Milliseconds(10));
    if (stop_.load()) break;
    if (std::optional<std::pair<uint64_t, uint64_t>> p = poll(); p && p->second > 0) {
      std::fprintf(stderr, "\r%s: %s of %s GiB (%d %%)   ", label.c_str(), Gib(p->first).c_str(),
                   Gib(p->second).c_str(), static_cast<int>(100.0 * p->first / p->second));
      std::fflush(stderr);
      drawn = true;
    }
  }
  if (drawn) std::fprintf(stderr, "\r\033[K");
}

}  // namespace kvhost::ctl
