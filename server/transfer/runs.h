// IndexRun: the unit every transfer engine works in. A backup or load names
// token slots one by one (host_indices[i] <-> device_indices[i]); consecutive
// pairs that both step by one are merged into a run, so the engines issue one
// copy per run (or per layout-contiguous piece of it) instead of one per token.
//
// Pure functions; thread-safe.
#ifndef KVHOST_SERVER_TRANSFER_RUNS_H_
#define KVHOST_SERVER_TRANSFER_RUNS_H_

#include <cstdint>
#include <string>
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

// Checks that `indices` are whole pages of `page_size` slots: the length a
// multiple of page_size, and each group of page_size entries one page's
// slots in order, starting at a multiple of page_size (any order of pages,
// repeats left to CheckNoOverlap). INVALID_ARGUMENT naming `field`, the
// position and the value; `what` ("pool 'x' (DSA_INDEXER)") starts the
// message. An empty list is whole pages.
absl::Status CheckWholePages(absl::Span<const int64_t> indices, uint64_t page_size,
                             const char* field, const std::string& what);

// `runs` counted in pages of `page_size`: {host / ps, device / ps, count / ps}.
// REQUIRES: every run starts on page boundaries on both sides and counts
// whole pages (CoalesceRuns of two CheckWholePages lists).
std::vector<IndexRun> PageRuns(const std::vector<IndexRun>& runs, uint64_t page_size);

// Checks that no two runs write the same destination slot (host slots for a
// backup, device rows for a load); INVALID_ARGUMENT naming the slot otherwise.
absl::Status CheckNoOverlap(const std::vector<IndexRun>& runs, bool host_side, const char* what);

}  // namespace kvhost

#endif  // KVHOST_SERVER_TRANSFER_RUNS_H_
