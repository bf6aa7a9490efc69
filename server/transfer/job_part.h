// BuildPart: one pool's rows of a Backup or Load checked and turned into
// the JobPart an engine copies (runs, page runs, tokens). The checks, in
// order, each INVALID_ARGUMENT naming the field, the entry and the value
// (FAILED_PRECONDITION where the slot is not allocated): as many host as
// device indices; each in range (the pool's slots, the attachment's device
// rows); whole pages where the pool or a page-row component needs them; no
// slot written twice (host slots for a backup, device rows for a load);
// every host slot allocated in the pool's allocator (a follower's: the
// followed pool's). A failed check leaves `part` half filled and nothing
// else changed: the caller drops it.
//
// Thread safety: reads the pool's allocator under its own lock.
#ifndef KVHOST_SERVER_TRANSFER_JOB_PART_H_
#define KVHOST_SERVER_TRANSFER_JOB_PART_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "server/transfer/engine.h"

namespace kvhost {

// `prefix` starts the field names ("", "pool_transfers[1]."); `device_what`
// names the attachment (and entry) for device ranges. REQUIRES: part->pool
// and part->mapping set.
absl::Status BuildPart(Direction direction, absl::Span<const int64_t> host,
                       absl::Span<const int64_t> device, const std::string& prefix,
                       const std::string& device_what, JobPart* part);

}  // namespace kvhost

#endif  // KVHOST_SERVER_TRANSFER_JOB_PART_H_
