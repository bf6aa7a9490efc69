#include "server/metrics/process_metrics.h"

#include <dirent.h>
#include <unistd.h>

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"

namespace kvhost {
namespace {

std::optional<std::string> ReadFile(const char* path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// The boot time, seconds since the epoch ("btime" of /proc/stat).
std::optional<uint64_t> BootTime() {
  const std::optional<std::string> stat = ReadFile("/proc/stat");
  if (!stat) return std::nullopt;
  for (absl::string_view line : absl::StrSplit(*stat, '\n')) {
    uint64_t value = 0;
    if (absl::ConsumePrefix(&line, "btime ") && absl::SimpleAtoi(line, &value)) return value;
  }
  return std::nullopt;
}

uint64_t CountOpenFds() {
  DIR* dir = ::opendir("/proc/self/fd");
  if (dir == nullptr) return 0;
  uint64_t n = 0;
  while (const dirent* entry = ::readdir(dir)) {
    if (entry->d_name[0] != '.') ++n;
  }
  ::closedir(dir);
  return n - 1;  // the directory's own descriptor
}

}  // namespace

std::optional<ProcessStats> ReadProcessStats() {
  // /proc/self/stat: "pid (comm) state ...", comm may hold spaces and
  // parentheses, so the fields are counted from the last ')': field 3
  // (state) is the first after it; utime 14, stime 15, starttime 22, in
  // clock ticks (proc(5)).
  const std::optional<std::string> stat = ReadFile("/proc/self/stat");
  const std::optional<std::string> statm = ReadFile("/proc/self/statm");
  const std::optional<uint64_t> boot = BootTime();
  if (!stat || !statm || !boot) return std::nullopt;
  const size_t paren = stat->rfind(')');
  if (paren == std::string::npos) return std::nullopt;
  const std::vector<absl::string_view> fields =
      absl::StrSplit(absl::string_view(*stat).substr(paren + 1), ' ', absl::SkipEmpty());
  const auto field = [&fields](size_t n, uint64_t* value) {
    return n - 3 < fields.size() && absl::SimpleAtoi(fields[n - 3], value);
  };
  uint64_t utime = 0, stime = 0, start = 0;
  if (!field(14, &utime) || !field(15, &stime) || !field(22, &start)) return std::nullopt;
  // /proc/self/statm: size resident ... in pages.
  const std::vector<absl::string_view> pages = absl::StrSplit(*statm, ' ');
  uint64_t resident = 0;
  if (pages.size() < 2 || !absl::SimpleAtoi(pages[1], &resident)) return std::nullopt;

  const double ticks = static_cast<double>(::sysconf(_SC_CLK_TCK));
  ProcessStats s;
  s.cpu_seconds = static_cast<double>(utime + stime) / ticks;
  s.resident_bytes = resident * static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  s.open_fds = CountOpenFds();
  s.start_time_seconds = static_cast<double>(*boot) + static_cast<double>(start) / ticks;
  return s;
}

void AddProcessMetrics(MetricsRegistry* registry) {
  const auto sample = [](double (*value)(const ProcessStats&)) {
    return [value] {
      const std::optional<ProcessStats> s = ReadProcessStats();
      return s ? std::vector<GaugeSample>{{{}, value(*s)}} : std::vector<GaugeSample>{};
    };
  };
  registry->AddComputedCounter("process_cpu_seconds_total",
                               "User and system CPU time of the process, in seconds.", {},
                               sample([](const ProcessStats& s) { return s.cpu_seconds; }));
  registry->AddGauge(
      "process_resident_memory_bytes",
      "Resident memory of the process, in bytes (pool memory it touched included).", {},
      sample([](const ProcessStats& s) { return static_cast<double>(s.resident_bytes); }));
  registry->AddGauge("process_open_fds", "File descriptors the process has open.", {},
                     sample([](const ProcessStats& s) { return static_cast<double>(s.open_fds); }));
  registry->AddGauge("process_start_time_seconds",
                     "When the process started, in seconds since the Unix epoch.", {},
                     sample([](const ProcessStats& s) { return s.start_time_seconds; }));
}

}  // namespace kvhost
