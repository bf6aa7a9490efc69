// Resolving a worker's AttachRequest against the pool it attaches to, into
// the ResolvedAttach an engine opens: the buffers as the worker spelled them
// (k_layers, v_layers, components by name) become one list per
// Pool::components() entry, the layer range and load event sets get their
// defaults, and every size is checked, before any engine opens a buffer.
//
// Thread safety: pure functions of their arguments. Nothing is owned.
#ifndef KVHOST_SERVER_TRANSFER_ATTACH_H_
#define KVHOST_SERVER_TRANSFER_ATTACH_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "server/pool/pool.h"
#include "server/transfer/engine.h"

namespace kvhost {

// Validates `request` against `pool` and resolves its buffers: k_layers /
// v_layers (components 0 and 1, see AttachDeviceRequest in
// proto/kvhost/v1/transfer.proto) and `named` become `components`, one per
// Pool::components() entry with layer_num() buffers each; a 0 / 0 layer
// range becomes the pool's, load_event_sets 0 the default. Ignores
// `request`'s entries, tp_rank, load_only and session_id. INVALID_ARGUMENT, naming the component
// and the counts, for an unknown or repeated component, a component given twice, a count other than
// the attached layers, buffers for a kind that takes none (LOGICAL); also for a bad layer range,
// device_size_tokens (0, too large, or not whole pages for a page-row component) or
// load_event_sets.
absl::StatusOr<ResolvedAttach> ResolveAttachRequest(const Pool& pool, AttachRequest request);

// "pool 'x' (MHA/PAGE_FIRST)", as messages about a pool's buffers name it.
std::string PoolWhat(const Pool& pool);

// A request's load_event_sets: 0 means kDefaultLoadEventSets; above
// kMaxLoadEventSets is INVALID_ARGUMENT.
absl::StatusOr<uint32_t> ResolveLoadEventSets(uint32_t sets);

}  // namespace kvhost

#endif  // KVHOST_SERVER_TRANSFER_ATTACH_H_
