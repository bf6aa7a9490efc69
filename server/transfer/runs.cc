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

absl::Status CheckNoOverlap(std::vector<IndexRun> runs, bool host_side, const char* what) {
  auto start = [host_side](const IndexRun& r) { return host_side ? r.host : r.device; };
  std::sort(runs.begin(), runs.end(),
            [&](const IndexRun& a, const IndexRun& b) { return start(a) < start(b); });
  for (size_t i = 1; i < runs.size(); ++i) {
    const uint64_t prev_end = start(runs[i - 1]) + runs[i - 1].count;
    if (start(runs[i]) < prev_end) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, " ", start(runs[i]), " is written more than once"));
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
