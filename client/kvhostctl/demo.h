// The demo's parts shared by its run (demo.cc) and its report
// (demo_report.cc): the options the --demo-* flags give, and what a run
// measured. Plain data; used from the main thread only.
#ifndef KVHOST_CLIENT_KVHOSTCTL_DEMO_H_
#define KVHOST_CLIENT_KVHOSTCTL_DEMO_H_

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "client/kvhostctl/commands.h"
#include "kvhost/v1/pool.pb.h"

namespace kvhost::ctl {

struct DemoOptions {
  std::string pool;
  v1::PoolSpec spec;
  uint64_t device_tokens = 0;
  uint64_t batch_tokens = 0;
  int cycles = 0;
  uint64_t seed = 0;
  std::string shm_dir;
};

// Client-side latencies of one kind of call, in microseconds.
class LatencyLog {
 public:
  void Add(std::chrono::steady_clock::duration d) {
    samples_.push_back(std::chrono::duration<double, std::micro>(d).count());
  }
  // Nearest-rank percentile, q in (0, 1]; 0 when empty.
  double Percentile(double q) const;
  size_t count() const { return samples_.size(); }

 private:
  std::vector<double> samples_;
};

struct DirectionTotals {
  uint64_t bytes = 0;
  // Sum over tickets of submit -> WaitTransfer return, client side.
  double seconds = 0;
  double GbPerS() const { return seconds > 0 ? bytes / seconds / 1e9 : 0; }
};

struct DemoReport {
  int cycles_done = 0;
  DirectionTotals backup, load;
  LatencyLog alloc, free, backup_submit, load_submit, wait;
  // Whether the calls went over the fast path (else gRPC).
  bool fast_path = false;
};

// GB/s per direction and RPC latencies (a table, or one JSON object with
// --json), then whether the bytes read back were those written (`result`).
void PrintDemoReport(const Context& ctx, const DemoOptions& o, const v1::Pool& pool,
                     const DemoReport& r, const absl::Status& result);

}  // namespace kvhost::ctl

#endif  // KVHOST_CLIENT_KVHOSTCTL_DEMO_H_
