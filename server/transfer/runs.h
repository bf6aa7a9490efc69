// IndexRun: the unit every transfer engine works in. A backup or load names
// token slots one by one (host_indices[i] <-> device_indices[i]); consecutive
// pairs that both step by one are merged into a run, so the engines issue one
// copy per run (or per layout-contiguous piece of it) instead of one per token.
//
// Pure functions; thread-safe.
#ifndef KVHOST_SERVER_TRANSFER_RUNS_H_
#define KVHOST_SERVER_TRANSFER_RUNS_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"

namespace kvhost {

struct IndexRun {
  uint64_t host = 0;    // first host slot
  uint64_t device = 0;  // first device row
  uint64_t count = 0;   // tokens
};

// Merges index pairs into maximal runs, in request order.
// REQUIRES: host.size() == device.size(), every index >= 0.
std::vector<IndexRun> CoalesceRuns(absl::Span<const int64_t> host,
                                   absl::Span<const int64_t> device);

// Checks that no two runs write the same destination slot (host slots for a
// backup, device rows for a load); INVALID_ARGUMENT naming the slot otherwise.
absl::Status CheckNoOverlap(std::vector<IndexRun> runs, bool host_side, const char* what);

}  // namespace kvhost

#endif  // KVHOST_SERVER_TRANSFER_RUNS_H_
