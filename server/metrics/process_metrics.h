// The process metrics every Prometheus client library exports (the names of
// the Prometheus "process collector"), read from /proc at scrape time:
// process_cpu_seconds_total, process_resident_memory_bytes, process_open_fds,
// process_start_time_seconds.
//
// Thread safety: the callbacks only read /proc; any number may run at once.
#ifndef KVHOST_SERVER_METRICS_PROCESS_METRICS_H_
#define KVHOST_SERVER_METRICS_PROCESS_METRICS_H_

#include <cstdint>
#include <optional>

#include "server/metrics/metrics.h"

namespace kvhost {

struct ProcessStats {
  double cpu_seconds = 0;       // user + system time of every thread
  uint64_t resident_bytes = 0;  // includes the shared memory of pools the process touched
  uint64_t open_fds = 0;
  double start_time_seconds = 0;  // since the Unix epoch
};

// This process's figures; nullopt where /proc cannot be read.
std::optional<ProcessStats> ReadProcessStats();

// Adds the four families; a scrape that cannot read /proc shows them without
// samples.
void AddProcessMetrics(MetricsRegistry* registry);

}  // namespace kvhost

#endif  // KVHOST_SERVER_METRICS_PROCESS_METRICS_H_
