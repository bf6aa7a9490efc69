// Submission: the pure steps of a transfer between finding its attachment
// and reserving the engine, testable without a manager, sessions or an
// engine. TransferManager::Submit (transfer_manager.cc) runs them in order:
//   FindTarget  (manager)  the attachment, copied into a SubmitTarget;
//   AssignRows  (here)     each attached pool's rows from the request;
//   BuildJob    (here)     each pool's rows validated into a JobPart
//                          (job_part.h) and the parts into a TransferJob;
//   Reserve     (manager)  the engine's Prepare, layer counters, the ticket;
//   Launch      (manager)  the job handed to the engine.
// Every pool's rows are validated before anything is reserved, so a refused
// transfer holds nothing.
//
// Thread safety: pure functions over values the caller owns.
#ifndef KVHOST_SERVER_TRANSFER_SUBMISSION_H_
#define KVHOST_SERVER_TRANSFER_SUBMISSION_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "server/transfer/attachment.h"
#include "server/transfer/engine.h"

namespace kvhost {

// One group entry's rows in a transfer on a group attachment
// (kvhost.v1.PoolTransfer).
struct EntryRows {
  std::string name;  // PoolEntry.name
  absl::Span<const int64_t> host;
  absl::Span<const int64_t> device;
};

// What a transfer needs of its attachment, copied under the manager's
// mutex so that the rest of Submit runs without it.
struct SubmitTarget {
  std::shared_ptr<const Owner> owner;
  std::shared_ptr<PoolGroup> group;  // null for a plain attachment
  std::shared_ptr<const DeviceMapping> mapping;
  std::vector<AttachedPool> pools;
  std::string label;  // the metrics' pool label: the pool's or the group's name
  std::shared_ptr<LayerCounters> layer_counters;
};

// One attached pool's rows in a transfer, and the prefix of their field
// names in messages ("", "pool_transfers[1].").
struct PartRows {
  absl::Span<const int64_t> host, device;
  std::string prefix;
  bool given = false;
};

// The rows of each of target.pools, in its order: `host` / `device` for a
// plain attachment or the group's anchor, each pool_transfers entry's for
// the entry it names. INVALID_ARGUMENT for pool_transfers on a plain
// attachment, an unknown entry name, the anchor's, or a name twice.
// `short_id`: the attachment's, for messages.
absl::StatusOr<std::vector<PartRows>> AssignRows(const SubmitTarget& target,
                                                 const std::string& short_id,
                                                 absl::Span<const int64_t> host,
                                                 absl::Span<const int64_t> device,
                                                 absl::Span<const EntryRows> pool_transfers);

// The job of `rows` (AssignRows'), each pool's validated by BuildPart: a
// plain attachment's job has its one part, a group's the parts with rows
// to copy. The first part's error is returned, naming the entry.
absl::StatusOr<TransferJob> BuildJob(const SubmitTarget& target, const std::string& short_id,
                                     Direction direction, const std::vector<PartRows>& rows);

}  // namespace kvhost

#endif  // KVHOST_SERVER_TRANSFER_SUBMISSION_H_
