// TransferEngine: the seam between the transfer service and whatever moves
// the bytes (the host engine now; the CUDA engine next).
//
// An engine opens a worker's device layer buffers for a pool (DeviceMapping)
// and runs transfer jobs on them. Jobs of one direction run in submission
// order (like a CUDA stream per direction); backups and loads run
// concurrently. A job reports each finished layer to its ticket and finishes
// the ticket with OK or the error that stopped it.
//
// Thread safety: Open and Submit may be called concurrently; Drain blocks
// until every submitted job has finished.
#ifndef KVHOST_SERVER_TRANSFER_ENGINE_H_
#define KVHOST_SERVER_TRANSFER_ENGINE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "kvhost/layout.h"
#include "server/pool/pool.h"
#include "server/transfer/runs.h"
#include "server/transfer/ticket.h"

namespace kvhost {

// Where one device layer buffer lives, as the worker described it.
struct DeviceBufferRef {
  enum class Kind : uint8_t { kShm, kCuda };
  Kind kind = Kind::kShm;
  std::string shm_path;    // kShm
  std::string ipc_handle;  // kCuda: cudaIpcMemHandle_t bytes
  std::string gpu_uuid;    // kCuda
  uint64_t offset = 0;     // bytes from the file / allocation start
};

struct AttachRequest {
  std::vector<DeviceBufferRef> k_layers;  // one per layer (MHA K, MLA latent)
  std::vector<DeviceBufferRef> v_layers;  // one per layer for MHA, empty for MLA
  uint64_t device_size_tokens = 0;
  // Sets of per-layer load events (engines with interprocess events only).
  // REQUIRES: 1 <= load_event_sets <= kMaxLoadEventSets (the caller applies
  // the default).
  uint32_t load_event_sets = 0;
};

// Bounds of AttachRequest::load_event_sets. Four sets cover a worker that
// overlaps a few loads with compute; 64 x layers events is still a small
// number next to the driver's limits.
inline constexpr uint32_t kDefaultLoadEventSets = 4;
inline constexpr uint32_t kMaxLoadEventSets = 64;

// A worker's device layer buffers, opened by an engine. Closing happens in the
// destructor, which runs once no job uses the mapping any more.
class DeviceMapping {
 public:
  virtual ~DeviceMapping() = default;
  // Base of layer `layer` of plane `plane` (0 = K or latent, 1 = V), in the
  // engine's address space.
  uint8_t* layer(uint64_t plane, uint64_t layer) const {
    return layers_[plane * layer_num_ + layer];
  }
  const DeviceRows& rows() const { return rows_; }
  // The exported handles of the per-layer load events, set-major (set s,
  // layer l at s * layer_num + l), as opaque bytes for the worker; empty for
  // an engine without interprocess events (host).
  const std::vector<std::string>& load_event_handles() const { return load_event_handles_; }
  uint32_t load_event_sets() const { return load_event_sets_; }

 protected:
  DeviceMapping(uint64_t layer_num, DeviceRows rows) : layer_num_(layer_num), rows_(rows) {}
  uint64_t layer_num_;
  DeviceRows rows_;
  std::vector<uint8_t*> layers_;  // plane-major
  std::vector<std::string> load_event_handles_;
  uint32_t load_event_sets_ = 0;
};

// One backup or load, ready to run: validated, coalesced, with its ticket.
struct TransferJob {
  Direction direction = Direction::kBackup;
  std::shared_ptr<Pool> pool;
  std::shared_ptr<const DeviceMapping> device;
  std::vector<IndexRun> runs;
  uint64_t tokens = 0;
  std::shared_ptr<TransferTicket> ticket;
  // Loads: the load event set that Prepare reserved (-1: none).
  int event_set = -1;
  // Backups: the worker's exported event to wait on (empty: none), and what
  // Prepare opened from it; the job holds it until the ticket is finished.
  std::string wait_event_handle;
  std::shared_ptr<void> wait_event;
  // Engine-specific: the path Prepare chose for the job (PathFor names it)
  // and what it planned for that path.
  uint8_t path = 0;
  std::shared_ptr<const void> plan;
};

class TransferEngine {
 public:
  virtual ~TransferEngine() = default;
  // "host" or "cuda".
  virtual const char* name() const = 0;
  // The path a job would take ("host-memcpy", ...), shown in ticket status.
  virtual std::string PathFor(const TransferJob& job) const = 0;
  // Opens `request`'s buffers for `pool`. REQUIRES: the layer counts match
  // the pool and device_size_tokens >= 1 (checked by the caller). Errors:
  // INVALID_ARGUMENT for a buffer too small, PERMISSION_DENIED for a path the
  // engine may not open, FAILED_PRECONDITION for a buffer kind it cannot open.
  virtual absl::StatusOr<std::unique_ptr<DeviceMapping>> Open(const Pool& pool,
                                                              const AttachRequest& request) = 0;
  // Reserves what `job` needs beyond its buffers, synchronously, so that the
  // RPC can refuse it: a load's event set (job->event_set), the backup's
  // wait event (job->wait_event). Called right before the ticket is made and
  // the job submitted; a prepared job is always submitted, except one of no
  // tokens, which finishes at once and for which Prepare reserves nothing.
  // Default:
  // no events, so a wait_event_handle is FAILED_PRECONDITION.
  virtual absl::Status Prepare(TransferJob* job) {
    if (!job->wait_event_handle.empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "wait_event_handle is set, but the ", name(),
          " backend has no CUDA events to wait on; leave it empty (finish writing the rows "
          "before asking for their backup) or run kvhostd with --backend=cuda"));
    }
    return absl::OkStatus();
  }
  // Queues a prepared job. The engine finishes job.ticket exactly once.
  virtual void Submit(TransferJob job) = 0;
  // Blocks until every job submitted so far has finished.
  virtual void Drain() = 0;
};

// Calls fn(host_offset, device_offset, bytes) for every contiguous piece of
// tokens [from, to) of `run` in one layer and plane: host offsets from the
// pool's layout, device offsets into the layer's row buffer. Shared by every
// engine so the address math has one home (kernels/kvhost/layout.h).
// REQUIRES: from <= to <= run.count.
template <typename Fn>
void ForEachPiece(const KvLayout& layout, uint64_t plane, uint64_t layer, const IndexRun& run,
                  uint64_t from, uint64_t to, Fn&& fn) {
  const uint64_t row = layout.token_bytes;
  uint64_t t = from;
  while (t < to) {
    const uint64_t host_token = run.host + t;
    uint64_t n = layout.ContiguousTokens(host_token);
    if (n > to - t) n = to - t;
    const uint64_t device_off = (run.device + t) * row;
    if (layout.RowContiguous()) {
      fn(layout.Offset(plane, host_token, layer, 0), device_off, n * row);
    } else {
      for (uint64_t h = 0; h < layout.heads; ++h) {
        fn(layout.Offset(plane, host_token, layer, h), device_off + h * layout.head_bytes,
           layout.head_bytes);
      }
    }
    t += n;
  }
}

}  // namespace kvhost

#endif  // KVHOST_SERVER_TRANSFER_ENGINE_H_
