// BuildPart (contract: job_part.h).
#include "server/transfer/job_part.h"

#include "absl/strings/str_cat.h"
#include "server/transfer/attach.h"
#include "server/transfer/runs.h"

namespace kvhost {
namespace {

absl::Status CheckRange(absl::Span<const int64_t> indices, uint64_t limit, const char* field,
                        const std::string& what) {
  for (size_t i = 0; i < indices.size(); ++i) {
    if (indices[i] < 0 || static_cast<uint64_t>(indices[i]) >= limit) {
      return absl::InvalidArgumentError(absl::StrCat(field, "[", i, "] = ", indices[i],
                                                     " out of range [0, ", limit, ") for ", what));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status BuildPart(Direction direction, absl::Span<const int64_t> host,
                       absl::Span<const int64_t> device, const std::string& prefix,
                       const std::string& device_what, JobPart* part) {
  const Pool& pool = *part->pool;
  const std::string host_field = absl::StrCat(prefix, "host_indices");
  const std::string device_field = absl::StrCat(prefix, "device_indices");
  if (host.size() != device.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        host_field, " has ", host.size(), " entries but ", device_field, " has ", device.size()));
  }
  const std::string pool_what = absl::StrCat("pool '", pool.name(), "'");
  if (absl::Status s = CheckRange(host, pool.size_tokens(), host_field.c_str(), pool_what);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = CheckRange(device, part->mapping->device_size_tokens(), device_field.c_str(),
                                  device_what);
      !s.ok()) {
    return s;
  }
  // Page-row components copy whole page rows, so both sides must name whole
  // pages; kinds may also require it.
  uint64_t page_rows = 0;
  for (const Component& c : pool.components()) {
    if (c.row_tokens > 1) page_rows = c.row_tokens;
  }
  const uint64_t page_size =
      page_rows > 0 ? page_rows : pool.allocator_owner()->allocator().page_size();
  if (pool.whole_pages() || page_rows > 0) {
    const std::string what = PoolWhat(pool);
    if (absl::Status s = CheckWholePages(host, page_size, host_field.c_str(), what); !s.ok()) {
      return s;
    }
    if (absl::Status s = CheckWholePages(device, page_size, device_field.c_str(), what); !s.ok()) {
      return s;
    }
  }
  part->runs = CoalesceRuns(host, device);
  if (page_rows > 0) part->page_runs = PageRuns(part->runs, page_rows);
  const bool backup = direction == Direction::kBackup;
  if (absl::Status s =
          CheckNoOverlap(part->runs, /*host_side=*/backup, backup ? "host slot" : "device row");
      !s.ok()) {
    return absl::Status(s.code(), absl::StrCat(pool_what, ": ", s.message()));
  }
  const Pool& owner = *pool.allocator_owner();
  if (absl::Status s = owner.allocator().CheckAllocated(host); !s.ok()) {
    if (&owner == &pool) return WithPool(pool.name(), s);
    return WithPool(
        pool.name(),
        absl::Status(s.code(), absl::StrCat(s.message(), " (its slots are allocated in '",
                                            owner.name(), "', which it follows)")));
  }
  part->tokens = host.size();
  return absl::OkStatus();
}

}  // namespace kvhost
