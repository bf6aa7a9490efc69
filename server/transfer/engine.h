// TransferEngine: the seam between the transfer service and whatever moves
// the bytes (the host engine, the CUDA engine).
//
// An engine opens a worker's device layer buffers for a pool (DeviceMapping)
// and runs transfer jobs on them. Jobs of one direction run in submission
// order (like a CUDA stream per direction); backups and loads run
// concurrently. A job reports each finished layer to its ticket and finishes
// the ticket with OK or the error that stopped it.
//
// Everything is per component (Pool::components()): a device buffer holds one
// component's rows of one device layer, and a job copies, for every ticket
// layer, every component's runs (token runs, or page runs for page-row
// components). The ticket's layers are the attachment's device layers
// [start_layer, end_layer) in order; a layer the pool does not hold copies
// nothing but still counts as done. A pool group's attachment (OpenGroup)
// counts model layers instead, and its jobs have one part per pool: ticket
// layer l copies, in every part, the device layer that part's layer map
// gives (JobLayer), before layer l counts as done.
//
// Thread safety: Open and Submit may be called concurrently; Drain blocks
// until every submitted job has finished.
#ifndef KVHOST_SERVER_TRANSFER_ENGINE_H_
#define KVHOST_SERVER_TRANSFER_ENGINE_H_

#include <any>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "kvhost/layout.h"
#include "server/pool/pool.h"
#include "server/pool/pool_group.h"
#include "server/tickets/ticket.h"
#include "server/transfer/layer_counters.h"
#include "server/transfer/runs.h"

namespace kvhost {

// One physical allocation of a cuMem buffer (kvhost.v1.CudaFdChunk): its
// descriptor is entry `index` of deposit `deposit_id` (service/deposits.h),
// which lends it as `fd` for the attach call only.
// The most bytes a cuMem buffer's chunks may add up to: 256 TiB, far past
// any GPU's memory and far from overflowing an offset.
inline constexpr uint64_t kMaxFdBufferBytes = uint64_t{1} << 48;

struct FdChunk {
  std::string deposit_id;
  uint32_t index = 0;
  uint64_t bytes = 0;
  int fd = -1;  // borrowed; -1 until lent
};

// Where one device layer buffer lives, as the worker described it.
struct DeviceBufferRef {
  // kCuda: a cudaMalloc allocation's IPC handle; kCudaFd: cuMem allocations
  // imported from descriptors and mapped back to back.
  enum class Kind : uint8_t { kShm, kCuda, kCudaFd };
  Kind kind = Kind::kShm;
  std::string shm_path;              // kShm
  std::string ipc_handle;            // kCuda: cudaIpcMemHandle_t bytes
  std::string gpu_uuid;              // kCuda, kCudaFd
  uint64_t offset = 0;               // bytes from the file / allocation / first chunk start
  std::vector<FdChunk> chunks = {};  // kCudaFd, in address order
};

// One component's device buffers, one per attached layer.
struct ComponentBuffers {
  std::string name;                     // a Pool::components() name
  std::string field;                    // the request field, for messages: "k_layers",
                                        // "components[1].layers"; Where() appends "[i]"
  std::vector<DeviceBufferRef> layers;  // [attached layer] = device layer start_layer + i
  std::string Where(size_t layer) const { return absl::StrCat(field, "[", layer, "]"); }
};

struct AttachEntry;

// A worker's attach request as the service gives it (kvhost.v1.AttachDeviceRequest,
// service/convert.h): the buffers as the worker spelled them, the layer range
// maybe 0 / 0, load_event_sets maybe 0. ResolveAttachRequest (attach.h) checks it
// against the pool and turns it into a ResolvedAttach, which is what engines open.
struct AttachRequest {
  // k_layers and v_layers name components 0 and 1, `named` any component by name.
  std::vector<DeviceBufferRef> k_layers;
  std::vector<DeviceBufferRef> v_layers;
  std::vector<ComponentBuffers> named;
  // Token slots of the device pool; device indices lie in [0, this).
  uint64_t device_size_tokens = 0;
  // Device layers to attach, [start_layer, end_layer); 0 / 0 means the pool's range.
  uint32_t start_layer = 0;
  uint32_t end_layer = 0;
  std::optional<uint32_t> tp_rank;
  bool load_only = false;  // Backup refused (FAILED_PRECONDITION)
  // Sets of per-layer load events; 0 means kDefaultLoadEventSets.
  uint32_t load_event_sets = 0;
  // A pool group's attachment (kvhost.v1.DeviceEntry): per group entry, its
  // buffers as a plain request of that entry's pool. The buffer, size and
  // layer fields above are then empty / 0; tp_rank, load_only and
  // load_event_sets are the attachment's.
  std::vector<AttachEntry> entries;
  // The worker session the attachment belongs to (TransferManager); "" for none.
  std::string session_id;
  // The worker waits on the attachment's layer counters before each layer's
  // load event (kvhost.v1.AttachDeviceRequest.layer_progress; LayerCounters).
  bool layer_progress = false;
};

struct AttachEntry {
  std::string entry;  // the group entry's name (PoolEntry.name)
  AttachRequest request;
};

// One pool's device buffers as an engine opens them: an AttachRequest
// resolved against the pool (ResolveAttachRequest), every size checked. It
// holds only what the buffers are; who attaches (tp_rank, load_only,
// session) stays with the request.
struct ResolvedAttach {
  // One entry per Pool::components() entry, in that order, each with
  // layer_num() buffers.
  std::vector<ComponentBuffers> components;
  // Token slots of the device pool; device indices lie in [0, this). At
  // least 1, and a multiple of every component's row_tokens: a page-row
  // component's buffers hold device_size_tokens / row_tokens rows.
  uint64_t device_size_tokens = 0;
  // Device layers attached, [start_layer, end_layer): never empty.
  uint32_t start_layer = 0;
  uint32_t end_layer = 0;
  // Sets of per-layer load events (engines with interprocess events only),
  // in [1, kMaxLoadEventSets].
  uint32_t load_event_sets = 0;

  uint32_t layer_num() const { return end_layer - start_layer; }
};

// Bounds of ResolvedAttach::load_event_sets. Four sets cover a worker that
// overlaps a few loads with compute; 64 x layers events is still a small
// number next to the driver's limits.
inline constexpr uint32_t kDefaultLoadEventSets = 4;
inline constexpr uint32_t kMaxLoadEventSets = 64;

// Rows of component `c`'s device buffers for a device pool of
// `device_size_tokens` slots (a page-row component has a row per page).
inline DeviceRows DeviceRowsOf(const Component& c, uint64_t device_size_tokens) {
  return DeviceRows{device_size_tokens / c.row_tokens, c.row_bytes()};
}

// A worker's device layer buffers, opened by an engine. Closing happens in the
// destructor, which runs once no job uses the mapping any more.
class DeviceMapping {
 public:
  virtual ~DeviceMapping() = default;
  // Base of attached layer `layer` (device layer start_layer + layer) of
  // component `component`, in the engine's address space.
  uint8_t* buffer(size_t component, uint64_t layer) const {
    return layers_[component * layer_num_ + layer];
  }
  // Rows of component `component`'s buffers.
  const DeviceRows& rows(size_t component) const { return rows_[component]; }
  size_t component_count() const { return rows_.size(); }
  // Attached layers (= the ticket layers of every job on this mapping).
  uint64_t layer_num() const { return layer_num_; }
  uint64_t device_size_tokens() const { return device_size_tokens_; }
  // The exported handles of the per-layer load events, set-major (set s,
  // attached layer l at s * layer_num + l), as opaque bytes for the worker;
  // empty for an engine without interprocess events (host).
  const std::vector<std::string>& load_event_handles() const { return load_event_handles_; }
  uint32_t load_event_sets() const { return load_event_sets_; }

 protected:
  // `rows`: one per component of the pool.
  DeviceMapping(uint64_t layer_num, uint64_t device_size_tokens, std::vector<DeviceRows> rows)
      : layer_num_(layer_num), device_size_tokens_(device_size_tokens), rows_(std::move(rows)) {}
  // Rows of every component of `pool` for `attach`.
  DeviceMapping(const Pool& pool, const ResolvedAttach& attach)
      : layer_num_(attach.layer_num()), device_size_tokens_(attach.device_size_tokens) {
    for (const Component& c : pool.components()) {
      rows_.push_back(DeviceRowsOf(c, attach.device_size_tokens));
    }
  }
  uint64_t layer_num_;
  uint64_t device_size_tokens_;
  std::vector<DeviceRows> rows_;  // per component
  std::vector<uint8_t*> layers_;  // component-major: [c * layer_num_ + l]
  std::vector<std::string> load_event_handles_;
  uint32_t load_event_sets_ = 0;
};

// What one ticket layer of a job part copies: host layer `host_layer` of the
// part's pool (-1: nothing, the pool does not hold that layer or the group
// maps no layer of it there) to or from attached layer `device_layer` of the
// part's mapping.
struct JobLayer {
  int32_t host_layer = -1;
  uint32_t device_layer = 0;
};

// One pool's share of a job: a plain attachment's job has exactly one part;
// a pool group's has one per entry with rows in the transfer.
struct JobPart {
  std::shared_ptr<Pool> pool;
  // Pool::UseSlots while the job lives: no ClaimPool frees the slots it
  // copies (destroyed before `pool`).
  std::shared_ptr<void> slot_use;
  // That pool's buffers (for a plain attachment, the job's own `mapping`).
  std::shared_ptr<const DeviceMapping> mapping;
  // Token runs (host slot, device slot), and for pools with page-row
  // components the same runs in pages (host / ps, device / ps, count / ps);
  // page_runs is filled only then (every run is whole pages).
  std::vector<IndexRun> runs;
  std::vector<IndexRun> page_runs;
  uint64_t tokens = 0;
  // Per ticket layer, in order (size = the job's layer_num()).
  std::vector<JobLayer> layers;
};

// One backup or load, ready to run: validated, coalesced, with its ticket.
struct TransferJob {
  Direction direction = Direction::kBackup;
  // The attachment's mapping: its layer_num() is the ticket's, and a job
  // with an event set records its load events (per ticket layer, after
  // every part's copies of that layer). For a plain attachment,
  // parts[0].mapping; for a group, the mapping OpenGroup made.
  std::shared_ptr<const DeviceMapping> mapping;
  std::vector<JobPart> parts;
  // A group attachment's job holds its group, and with it the pool of every
  // entry, those without rows in this job included: the group mapping pins
  // them all, and the pools must outlive it.
  std::shared_ptr<const PoolGroup> group;
  std::shared_ptr<Ticket> ticket;
  // The load event set that Prepare reserved (-1: none): every load's on an
  // engine with events, and a backup's or load's with layer counters (below).
  int event_set = -1;
  // Backups and loads with an event set on an attachment with layer progress
  // (AttachDeviceRequest.layer_progress; null otherwise): the attachment's
  // counters (set before Prepare, which takes them as the sign to reserve
  // an event set; cleared when it reserved none) and this job's base there
  // (LayerCounters::Reserve, made by the manager right after Prepare). The
  // worker waits on the counter before each layer's event (a backup's
  // worker: before its last layer's, to learn the backup finished), so the
  // engine may return from Submit before every layer is queued. Both
  // directions take the one route: the engine calls
  // layer_counters->Publish(event_set, layer_base, l) right after load event
  // [event_set][l] is recorded after layer l's copies (host: after layer l
  // is copied). The manager calls Release(event_set, layer_base,
  // layer_num()) when the ticket finishes, however it ended, so a worker is
  // never left waiting (an engine may release earlier); both are monotonic,
  // and the next transfer of the set reserves past this one's layers, so a
  // late Release lowers nothing.
  std::shared_ptr<LayerCounters> layer_counters;
  uint64_t layer_base = 0;
  // The worker's exported event the copies wait on (empty: none; a backup's
  // after the rows' writes, a load's after the work the load must follow),
  // and what Prepare opened from it; the job holds it until the ticket is
  // finished.
  std::string wait_event_handle;
  std::shared_ptr<void> wait_event;
  // What the engine's Prepare decided for the job (the path PathFor names,
  // and that path's plan), of a type only the engine knows: it reads it
  // back with std::any_cast, which checks the type.
  std::any plan;

  // Ticket layers.
  uint64_t layer_num() const { return mapping->layer_num(); }
  // Token rows over every part.
  uint64_t tokens() const {
    uint64_t n = 0;
    for (const JobPart& part : parts) n += part.tokens;
    return n;
  }
};

// The runs a part copies for component `c` of its pool: page runs for a
// page-row component, token runs otherwise.
inline const std::vector<IndexRun>& RunsFor(const JobPart& part, const Component& c) {
  return c.row_tokens > 1 ? part.page_runs : part.runs;
}

// Bytes one held layer of `tokens` rows of `pool` moves: every component's
// rows (tokens, or tokens / row_tokens pages) x row bytes.
inline uint64_t HeldLayerBytes(const Pool& pool, uint64_t tokens) {
  uint64_t bytes = 0;
  for (const Component& c : pool.components()) bytes += tokens / c.row_tokens * c.row_bytes();
  return bytes;
}

// Bytes ticket layer `i` of `part` moves (0 where it copies nothing).
inline uint64_t PartLayerBytes(const JobPart& part, size_t i) {
  return part.layers[i].host_layer < 0 ? 0 : HeldLayerBytes(*part.pool, part.tokens);
}

// Bytes ticket layer `i` of `job` moves, over every part.
inline uint64_t TicketLayerBytes(const TransferJob& job, size_t i) {
  uint64_t bytes = 0;
  for (const JobPart& part : job.parts) bytes += PartLayerBytes(part, i);
  return bytes;
}

class TransferEngine {
 public:
  virtual ~TransferEngine() = default;
  // "host" or "cuda".
  virtual const char* name() const = 0;
  // The path a job would take ("host-memcpy", ...), shown in ticket status.
  virtual std::string PathFor(const TransferJob& job) const = 0;
  // Opens `attach.components`' buffers for `pool`. REQUIRES: `attach` was
  // resolved against `pool` (ResolveAttachRequest; see ResolvedAttach).
  // Errors: INVALID_ARGUMENT for a buffer too small (naming
  // ComponentBuffers::Where), PERMISSION_DENIED for a path the engine may not
  // open, FAILED_PRECONDITION for a buffer kind, pool kind or layer range it
  // cannot serve.
  virtual absl::StatusOr<std::unique_ptr<DeviceMapping>> Open(const Pool& pool,
                                                              const ResolvedAttach& attach) = 0;
  // A pool group's mapping: `entries` (mappings this engine opened, one per
  // group entry, in the group's order) kept alive, and load events per model
  // layer: layer_num() is `layer_num`, load_event_sets() `load_event_sets`
  // (REQUIRES: as ResolvedAttach::load_event_sets). It holds no buffers of
  // its own (component_count() 0); jobs copy through their parts' mappings.
  // Errors: INVALID_ARGUMENT for entries the engine cannot serve together
  // (cuda: on different GPUs), FAILED_PRECONDITION for an engine without
  // groups.
  virtual absl::StatusOr<std::unique_ptr<DeviceMapping>> OpenGroup(
      std::vector<std::shared_ptr<const DeviceMapping>> entries, uint32_t layer_num,
      uint32_t load_event_sets) = 0;
  // Reserves what `job` needs beyond its buffers, synchronously, so that the
  // RPC can refuse it: an event set (job->event_set) for a load, or for a
  // backup with layer counters (RESOURCE_EXHAUSTED when every set is held),
  // the worker's wait event (job->wait_event). Called right before the
  // ticket is made and the job submitted; a prepared job is always
  // submitted, except one of no tokens, which finishes at once and for
  // which Prepare reserves nothing.
  // The default reserves nothing: it has no events, so a job with a
  // wait_event_handle is FAILED_PRECONDITION.
  virtual absl::Status Prepare(TransferJob* job) {
    if (!job->wait_event_handle.empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "wait_event_handle is set, but the ", name(),
          " backend has no CUDA events to wait on; leave it empty (finish the work the "
          "transfer must follow before asking for it) or run kvhostd with --backend=cuda"));
    }
    return absl::OkStatus();
  }
  // Queues a prepared job. The engine finishes job.ticket exactly once.
  virtual void Submit(TransferJob job) = 0;
  // Blocks until every job submitted so far has finished.
  virtual void Drain() = 0;
};

// Calls fn(host_offset, device_offset, bytes) for every contiguous piece of
// rows [from, to) of `run` in one layer and plane: host offsets from the
// layout, device offsets into the layer's row buffer. Shared by every engine
// so the address math has one home (kernels/kvhost/layout.h).
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
      // A split row (PAGE_HEAD's heads, PAGE_UNIFIED's head groups): its
      // pieces lie apart on the host, together in the device row.
      const uint64_t piece_bytes = layout.RowPieceBytes();
      for (uint64_t k = 0; k < layout.RowPieces(); ++k) {
        fn(layout.Offset(plane, host_token, layer, layout.PieceHead(k)),
           device_off + k * piece_bytes, piece_bytes);
      }
    }
    t += n;
  }
}

// The same over one component of a pool: host offsets from
// Pool::component_base(c), device offsets into the component's buffer of one
// layer. `run` is a token run for a token-row component and a page run for a
// page-row one (RunsFor); `layer` is the host layer.
template <typename Fn>
void ForEachPiece(const Component& c, uint64_t layer, const IndexRun& run, uint64_t from,
                  uint64_t to, Fn&& fn) {
  ForEachPiece(c.layout, 0, layer, run, from, to, fn);
}

}  // namespace kvhost

#endif  // KVHOST_SERVER_TRANSFER_ENGINE_H_
