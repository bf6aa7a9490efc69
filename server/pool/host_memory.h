// Host memory budget: how many bytes of host memory a new pool may take.
//
// The rule is tokenspeed's: the smaller of what the kernel says is available
// (MemAvailable) and what the process's memory cgroup has left (limit minus
// usage), each less a reserve kept for everything else on the machine:
//
//   available = min(max(MemAvailable - reserve, 0),
//                   max(cgroup_limit - cgroup_usage - reserve, 0))
//
// where the cgroup term counts only when a usable cgroup limit is known.
// `ReadMemorySnapshot` gathers the inputs from /proc/meminfo and the cgroup
// files (v2 first, then v1); `AvailableForPools` applies the rule. The other
// functions parse and format byte sizes for flags and messages.
//
// No shared state; every function here is thread-safe. `ReadMemorySnapshot`
// reads files on each call and is not meant for hot paths.
#ifndef KVHOST_SERVER_POOL_HOST_MEMORY_H_
#define KVHOST_SERVER_POOL_HOST_MEMORY_H_

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvhost {

// The inputs of the budget rule, read at one moment.
struct MemorySnapshot {
  uint64_t mem_total = 0;                // bytes
  uint64_t mem_available = 0;            // bytes
  std::optional<uint64_t> cgroup_limit;  // bytes, only when a usable limit exists
  uint64_t cgroup_usage = 0;             // bytes (meaningful only with cgroup_limit)
  std::string cgroup_source;             // "v2", "v1" or "" (for log lines)
};

// Reads MemTotal and MemAvailable from <root>/proc/meminfo and the memory
// cgroup's limit and usage from <root>/sys/fs/cgroup/memory.{max,current}
// (cgroup v2) or, when v2 gives no usable limit,
// <root>/sys/fs/cgroup/memory/memory.{limit_in_bytes,usage_in_bytes} (v1).
// `root` is "/" normally; tests pass a directory with the same relative paths.
//
// A cgroup value counts as none when its file is unreadable or empty, or
// reads "max", not an integer, <= 0 or >= 2^60. A limit >= MemTotal is
// ignored (the cgroup does not constrain more than the machine). When a limit
// is usable but its usage is none, the usage is taken as 0.
//
// FAILED_PRECONDITION naming the path if /proc/meminfo cannot be read or
// lacks MemTotal or MemAvailable; RESOURCE_EXHAUSTED "out of file
// descriptors (...)" when a file cannot be opened for want of descriptors
// (EMFILE, ENFILE), cgroup files included.
absl::StatusOr<MemorySnapshot> ReadMemorySnapshot(const std::string& root = "/");

// The default reserve: min(10 GiB, mem_total / 10).
uint64_t DefaultMemoryReserve(uint64_t mem_total);

// The budget rule above, in bytes; never negative (0 when the reserve takes
// everything). Uses `s.cgroup_limit` as given (ReadMemorySnapshot has
// already dropped limits that are not usable).
uint64_t AvailableForPools(const MemorySnapshot& s, uint64_t reserve);

// (Byte sizes in flags: ParseByteSize, common/cli_flags.h; byte counts in
// messages: FormatBytes, common/bytes.h.)

}  // namespace kvhost

#endif  // KVHOST_SERVER_POOL_HOST_MEMORY_H_
