#include "server/transfer/runs.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace kvhost {

std::vector<IndexRun> CoalesceRuns(absl::Span<const int64_t> host,
                                   absl::Span<const int64_t> device) {
  std::vector<IndexRun> runs;
  for (size_t i = 0; i < host.size(); ++i) {
    const auto h = static_cast<uint64_t>(host[i]);
    const auto d = static_cast<uint64_t>(device[i]);
    if (!runs.empty()) {
      IndexRun& last = runs.back();
      if (last.host + last.count == h && last.device + last.count == d) {
        ++last.count;
        continue;
      }
    }
    runs.push_back({h, d, 1});
  }
  return runs;
}

absl::Status CheckNoOverlap(const std::vector<IndexRun>& runs, bool host_side, const char* what) {
  auto start = [host_side](const IndexRun& r) { return host_side ? r.host : r.device; };
  auto overlap = [what](uint64_t slot) {
    return absl::InvalidArgumentError(absl::StrCat(what, " ", slot, " is written more than once"));
  };
  auto by_start = [&](const IndexRun& a, const IndexRun& b) { return start(a) < start(b); };
  uint64_t end = 0;
  uint64_t slots = 0;
  for (const IndexRun& r : runs) {
    end = std::max(end, start(r) + r.count);
    slots += r.count;
  }
  // Runs in order of their start (a contiguity-keeping allocator's host
  // slots) need one pass; scattered ones (a load's device rows at page 1)
  // a bitmap of the range they span where it is not much larger than they
  // are, else a sort: at 8192 one-row runs the sort cost a Load call 0.5 ms.
  if (std::is_sorted(runs.begin(), runs.end(), by_start)) {
    for (size_t i = 1; i < runs.size(); ++i) {
      if (start(runs[i]) < start(runs[i - 1]) + runs[i - 1].count) return overlap(start(runs[i]));
    }
    return absl::OkStatus();
  }
  constexpr uint64_t kBitmapSlotsPerSlot = 64;  // at most 8 bits of bitmap per slot written
  if (end <= kBitmapSlotsPerSlot * slots) {
    std::vector<uint64_t> seen((end + 63) / 64, 0);
    for (const IndexRun& r : runs) {
      for (uint64_t t = start(r); t < start(r) + r.count; ++t) {
        uint64_t& word = seen[t / 64];
        const uint64_t bit = uint64_t{1} << (t % 64);
        if ((word & bit) != 0) return overlap(t);
        word |= bit;
      }
    }
    return absl::OkStatus();
  }
  std::vector<IndexRun> sorted = runs;
  std::sort(sorted.begin(), sorted.end(), by_start);
  for (size_t i = 1; i < sorted.size(); ++i) {
    if (start(sorted[i]) < start(sorted[i - 1]) + sorted[i - 1].count) {
      return overlap(start(sorted[i]));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckWholePages(absl::Span<const int64_t> indices, uint64_t page_size,
                             const char* field, const std::string& what) {
  if (indices.size() % page_size != 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, " transfers whole pages of ", page_size,
                                                   ": ", field, " has ", indices.size(),
                                                   " entries, not a multiple of ", page_size));
  }
  for (size_t i = 0; i < indices.size(); i += page_size) {
    const int64_t first = indices[i];
    if (first % static_cast<int64_t>(page_size) != 0) {
      return absl::InvalidArgumentError(absl::StrCat(what, " transfers whole pages of ", page_size,
                                                     ": ", field, "[", i, "] = ", first,
                                                     " does not start a page"));
    }
    for (uint64_t j = 1; j < page_size; ++j) {
      const int64_t want = first + static_cast<int64_t>(j);
      if (indices[i + j] != want) {
        return absl::InvalidArgumentError(
            absl::StrCat(what, " transfers whole pages of ", page_size, ": ", field, "[", i + j,
                         "] = ", indices[i + j], " breaks the page ", first, "..",
                         first + page_size - 1, " (want ", want, ")"));
      }
    }
  }
  return absl::OkStatus();
}

std::vector<IndexRun> PageRuns(const std::vector<IndexRun>& runs, uint64_t page_size) {
  std::vector<IndexRun> pages;
  pages.reserve(runs.size());
  for (const IndexRun& r : runs) {
    pages.push_back({r.host / page_size, r.device / page_size, r.count / page_size});
  }
  return pages;
}

}  // namespace kvhost
