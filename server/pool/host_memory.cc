#include "server/pool/host_memory.h"

#include <iterator>

#include <errno.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <iterator>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "absl/numeric/int128.h"
#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace kvhost {
namespace {

constexpr uint64_t kGiB = uint64_t{1} << 30;
// Cgroup values at or above this are "unlimited" sentinels (v1 reports
// 0x7ffffffffffff000 for no limit).
constexpr int64_t kCgroupValueCeiling = int64_t{1} << 60;

constexpr char kMeminfoPath[] = "proc/meminfo";
constexpr char kCgroupV2Limit[] = "sys/fs/cgroup/memory.max";
constexpr char kCgroupV2Usage[] = "sys/fs/cgroup/memory.current";
constexpr char kCgroupV1Limit[] = "sys/fs/cgroup/memory/memory.limit_in_bytes";
constexpr char kCgroupV1Usage[] = "sys/fs/cgroup/memory/memory.usage_in_bytes";

// `root` joined with a relative path: ("/", "proc/meminfo") -> "/proc/meminfo".
std::string JoinRoot(const std::string& root, absl::string_view rel) {
  absl::string_view r = root;
  while (!r.empty() && r.back() == '/') r.remove_suffix(1);
  return absl::StrCat(r, "/", rel);
}

bool OutOfDescriptors(int err) { return err == EMFILE || err == ENFILE; }

// RESOURCE_EXHAUSTED for a file `path` that could not be opened for want of
// descriptors: the host's memory is not the problem, and neither is the file.
absl::Status OutOfDescriptorsStatus(int err, const std::string& path) {
  return absl::ResourceExhaustedError(
      absl::StrCat("out of file descriptors (cannot open ", path, ": ", std::strerror(err), ")"));
}

// The whole file, or nullopt when it cannot be opened or read (plain POSIX
// reads: std::ifstream throws when reading a directory); then *err, if
// given, is the errno.
std::optional<std::string> ReadFile(const std::string& path, int* err = nullptr) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (err != nullptr) *err = errno;
    return std::nullopt;
  }
  std::string content;
  char buf[4096];
  for (;;) {
    const ssize_t n = read(fd, buf, sizeof(buf));
    if (n > 0) {
      content.append(buf, static_cast<size_t>(n));
    } else if (n == 0) {
      break;
    } else if (errno != EINTR) {
      if (err != nullptr) *err = errno;
      close(fd);
      return std::nullopt;
    }
  }
  close(fd);
  return content;
}

// One cgroup value in bytes, or nullopt for "none" (see the header); *err
// is set to the errno when the file could not be read.
std::optional<uint64_t> ReadCgroupValue(const std::string& path, int* err) {
  std::optional<std::string> content = ReadFile(path, err);
  if (!content.has_value()) return std::nullopt;
  absl::string_view text = absl::StripAsciiWhitespace(*content);
  if (text.empty() || text == "max") return std::nullopt;
  int64_t value = 0;
  if (!absl::SimpleAtoi(text, &value)) return std::nullopt;
  if (value <= 0 || value >= kCgroupValueCeiling) return std::nullopt;
  return static_cast<uint64_t>(value);
}

// Fills the cgroup fields of `s` from one cgroup version's files and returns
// true when they give a usable limit (< MemTotal). Out of descriptors, a
// limit must not silently count as none: RESOURCE_EXHAUSTED.
absl::StatusOr<bool> ReadCgroup(const std::string& root, absl::string_view limit_rel,
                                absl::string_view usage_rel, absl::string_view source,
                                MemorySnapshot* s) {
  const std::string limit_path = JoinRoot(root, limit_rel);
  int err = 0;
  std::optional<uint64_t> limit = ReadCgroupValue(limit_path, &err);
  if (OutOfDescriptors(err)) return OutOfDescriptorsStatus(err, limit_path);
  if (!limit.has_value() || *limit >= s->mem_total) return false;
  const std::string usage_path = JoinRoot(root, usage_rel);
  std::optional<uint64_t> usage = ReadCgroupValue(usage_path, &err);
  if (OutOfDescriptors(err)) return OutOfDescriptorsStatus(err, usage_path);
  s->cgroup_limit = *limit;
  s->cgroup_usage = usage.value_or(0);
  s->cgroup_source = std::string(source);
  return true;
}

// A /proc/meminfo value ("24683656 kB") in bytes.
std::optional<uint64_t> ParseMeminfoValue(absl::string_view text) {
  std::vector<absl::string_view> parts =
      absl::StrSplit(text, absl::ByAnyChar(" \t"), absl::SkipEmpty());
  if (parts.empty() || parts.size() > 2) return std::nullopt;
  uint64_t value = 0;
  if (!absl::SimpleAtoi(parts[0], &value)) return std::nullopt;
  if (parts.size() == 1) return value;
  if (parts[1] != "kB") return std::nullopt;
  if (value > std::numeric_limits<uint64_t>::max() / 1024) return std::nullopt;
  return value * 1024;
}

}  // namespace

absl::StatusOr<MemorySnapshot> ReadMemorySnapshot(const std::string& root) {
  const std::string meminfo_path = JoinRoot(root, kMeminfoPath);
  int err = 0;
  std::optional<std::string> meminfo = ReadFile(meminfo_path, &err);
  if (!meminfo.has_value()) {
    if (OutOfDescriptors(err)) return OutOfDescriptorsStatus(err, meminfo_path);
    return absl::FailedPreconditionError(absl::StrCat("cannot read ", meminfo_path));
  }
  std::optional<uint64_t> mem_total;
  std::optional<uint64_t> mem_available;
  for (absl::string_view line : absl::StrSplit(*meminfo, '\n', absl::SkipEmpty())) {
    std::pair<absl::string_view, absl::string_view> kv =
        absl::StrSplit(line, absl::MaxSplits(':', 1));
    std::optional<uint64_t>* field = nullptr;
    if (kv.first == "MemTotal") {
      field = &mem_total;
    } else if (kv.first == "MemAvailable") {
      field = &mem_available;
    } else {
      continue;
    }
    *field = ParseMeminfoValue(kv.second);
    if (!field->has_value()) {
      return absl::FailedPreconditionError(
          absl::StrCat("malformed line in ", meminfo_path, ": \"", absl::CHexEscape(line), "\""));
    }
  }
  if (!mem_total.has_value()) {
    return absl::FailedPreconditionError(absl::StrCat(meminfo_path, " lacks MemTotal"));
  }
  if (!mem_available.has_value()) {
    return absl::FailedPreconditionError(absl::StrCat(meminfo_path, " lacks MemAvailable"));
  }

  MemorySnapshot s;
  s.mem_total = *mem_total;
  s.mem_available = *mem_available;
  absl::StatusOr<bool> v2 = ReadCgroup(root, kCgroupV2Limit, kCgroupV2Usage, "v2", &s);
  if (!v2.ok()) return v2.status();
  if (!*v2) {
    absl::StatusOr<bool> v1 = ReadCgroup(root, kCgroupV1Limit, kCgroupV1Usage, "v1", &s);
    if (!v1.ok()) return v1.status();
  }
  return s;
}

uint64_t DefaultMemoryReserve(uint64_t mem_total) { return std::min(10 * kGiB, mem_total / 10); }

uint64_t AvailableForPools(const MemorySnapshot& s, uint64_t reserve) {
  uint64_t available = s.mem_available > reserve ? s.mem_available - reserve : 0;
  if (s.cgroup_limit.has_value()) {
    const uint64_t limit = *s.cgroup_limit;
    const uint64_t cgroup_free = limit > s.cgroup_usage ? limit - s.cgroup_usage : 0;
    available = std::min(available, cgroup_free > reserve ? cgroup_free - reserve : 0);
  }
  return available;
}

}  // namespace kvhost
