#include "server/transfer/submission.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "server/transfer/job_part.h"

namespace kvhost {

absl::StatusOr<std::vector<PartRows>> AssignRows(const SubmitTarget& target,
                                                 const std::string& short_id,
                                                 absl::Span<const int64_t> host,
                                                 absl::Span<const int64_t> device,
                                                 absl::Span<const EntryRows> pool_transfers) {
  const std::shared_ptr<PoolGroup>& group = target.group;
  const std::vector<AttachedPool>& pools = target.pools;
  if (group == nullptr && !pool_transfers.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("pool_transfers has ", pool_transfers.size(), " entries, but attachment '",
                     short_id, "' is of pool '", pools[0].pool->name(), "', not of a pool group"));
  }
  // The request's rows for a plain attachment or the group's anchor, each
  // pool_transfers entry's for the others.
  std::vector<PartRows> rows(pools.size());
  const size_t anchor = group == nullptr ? 0 : group->anchor_index();
  rows[anchor] = {host, device, "", true};
  for (size_t i = 0; i < pool_transfers.size(); ++i) {
    const EntryRows& t = pool_transfers[i];
    size_t e = 0;
    while (e < pools.size() && pools[e].entry != t.name) ++e;
    if (e == pools.size()) {
      return absl::InvalidArgumentError(absl::StrCat("pool_transfers[", i, "] names entry '",
                                                     t.name, "', but pool group '", group->name(),
                                                     "' has entries ", GroupEntryNames(*group)));
    }
    if (e == anchor) {
      return absl::InvalidArgumentError(absl::StrCat(
          "pool_transfers[", i, "] names entry '", t.name, "', the anchor of pool group '",
          group->name(), "'; its rows go in host_indices / device_indices"));
    }
    if (rows[e].given) {
      return absl::InvalidArgumentError(
          absl::StrCat("pool_transfers[", i, "] names entry '", t.name, "' a second time"));
    }
    rows[e] = {t.host, t.device, absl::StrCat("pool_transfers[", i, "]."), true};
  }
  return rows;
}

absl::StatusOr<TransferJob> BuildJob(const SubmitTarget& target, const std::string& short_id,
                                     Direction direction, const std::vector<PartRows>& rows) {
  const std::shared_ptr<PoolGroup>& group = target.group;
  std::vector<JobPart> parts(target.pools.size());
  for (size_t e = 0; e < target.pools.size(); ++e) {
    const AttachedPool& attached = target.pools[e];
    JobPart& part = parts[e];
    part.pool = attached.pool;
    part.slot_use = attached.pool->UseSlots();
    part.mapping = attached.mapping;
    part.layers = attached.layers;
    const std::string device_what =
        group == nullptr
            ? absl::StrCat("attachment '", short_id, "'")
            : absl::StrCat("attachment '", short_id, "' (entry '", attached.entry, "')");
    if (absl::Status s =
            BuildPart(direction, rows[e].host, rows[e].device, rows[e].prefix, device_what, &part);
        !s.ok()) {
      return s;
    }
  }
  TransferJob job;
  job.direction = direction;
  job.mapping = target.mapping;
  job.group = group;
  // A plain attachment's job has its one part; a group's, the parts with
  // rows to copy.
  for (JobPart& part : parts) {
    if (group == nullptr || (part.tokens > 0 && !part.pool->components().empty())) {
      job.parts.push_back(std::move(part));
    }
  }
  return job;
}

}  // namespace kvhost
