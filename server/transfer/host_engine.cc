#include "server/transfer/host_engine.h"

#include <setjmp.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <mutex>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/blocking_counter.h"
#include "server/pool/shm_region.h"
#include "spdlog/spdlog.h"

namespace kvhost {
namespace {

// A worker may shrink its shared-memory file while the daemon copies from
// its mapping; touching the pages past the new end raises SIGBUS, which
// would kill the daemon. Copies run under a guard instead: the handler
// jumps back to the copying thread's guard, and the copy reports failure.
// A SIGBUS outside a guard is a bug of ours: the handler restores the
// default action and returns, so the fault repeats and kills as before.
// Volatile, with signal fences around the copy: the compiler must neither
// drop the store (memcpy does not read it) nor move it past the copy.
thread_local sigjmp_buf* volatile copy_guard = nullptr;

void OnSigbus(int signal, siginfo_t* info, void* context) {
  if (sigjmp_buf* guard = copy_guard; guard != nullptr) siglongjmp(*guard, 1);
  ::signal(SIGBUS, SIG_DFL);
}

void InstallSigbusHandler() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction action = {};
    action.sa_sigaction = OnSigbus;
    action.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&action.sa_mask);
    ::sigaction(SIGBUS, &action, nullptr);
  });
}

// memcpy that returns false instead of dying when a mapping behind `dst`
// or `src` was truncated.
bool GuardedCopy(uint8_t* dst, const uint8_t* src, uint64_t bytes) {
  sigjmp_buf guard;
  // No signal mask saved (that would be a system call per copy): the
  // handler runs with SA_NODEFER, so SIGBUS is never left blocked.
  if (sigsetjmp(guard, 0) != 0) {
    copy_guard = nullptr;
    return false;
  }
  copy_guard = &guard;
  std::atomic_signal_fence(std::memory_order_seq_cst);
  std::memcpy(dst, src, bytes);
  std::atomic_signal_fence(std::memory_order_seq_cst);
  copy_guard = nullptr;
  return true;
}

// What every host mapping has besides its buffers: a ring of load event
// sets, taken only by the backups and loads of attachments with layer
// progress (the host backend has no events, but such a transfer's counter
// is per set, and a set serves one transfer at a time, as the CUDA engine's
// ring does). Not exported as load_event_sets(): attachments without layer
// progress see none.
class HostMapping : public DeviceMapping {
 public:
  using DeviceMapping::DeviceMapping;

  void SetRing(uint32_t sets) { set_busy_.assign(sets, false); }
  // The next free set in round-robin order, held until ReleaseSet;
  // RESOURCE_EXHAUSTED when all are held (the RPC does not wait: see
  // TransferService.Load).
  absl::StatusOr<int> AcquireSet() const {
    absl::MutexLock lock(&ring_mu_);
    const size_t sets = set_busy_.size();
    for (size_t k = 0; k < sets; ++k) {
      const size_t set = (next_set_ + k) % sets;
      if (set_busy_[set]) continue;
      set_busy_[set] = true;
      next_set_ = (set + 1) % sets;
      return static_cast<int>(set);
    }
    return absl::ResourceExhaustedError(absl::StrCat(
        "all ", sets,
        " load event sets are in use by transfers in flight; wait for one to finish or attach "
        "with more load_event_sets"));
  }
  void ReleaseSet(int set) const {
    absl::MutexLock lock(&ring_mu_);
    set_busy_[static_cast<size_t>(set)] = false;
  }

 private:
  mutable absl::Mutex ring_mu_;
  mutable std::vector<bool> set_busy_ ABSL_GUARDED_BY(ring_mu_);
  mutable size_t next_set_ ABSL_GUARDED_BY(ring_mu_) = 0;
};

// Device layer buffers mapped from the worker's shared-memory files; each
// file is mapped once even when many layers live in it.
class ShmDeviceMapping : public HostMapping {
 public:
  ShmDeviceMapping(const Pool& pool, const ResolvedAttach& attach) : HostMapping(pool, attach) {
    SetRing(attach.load_event_sets);
  }

  // Maps `ref` as a buffer of component `component`; buffers are added
  // component-major.
  // The worker names the file by an absolute path; only the part after the
  // shm dir is looked at, and opened beneath the shm dir's descriptor.
  absl::Status Add(const DirFd& shm_dir, const RegionInodes* region_inodes, size_t component,
                   const DeviceBufferRef& ref, const std::string& where) {
    if (ref.kind != DeviceBufferRef::Kind::kShm) {
      return absl::FailedPreconditionError(
          absl::StrCat(where,
                       ref.kind == DeviceBufferRef::Kind::kCuda ? " is a CUDA IPC buffer"
                                                                : " is a cuMem buffer (cuda_fd)",
                       ", but this daemon runs the host backend "
                       "(start kvhostd with --backend=cuda on a GPU machine)"));
    }
    if (absl::Status s = CheckNoNul(ref.shm_path, "shm path"); !s.ok()) return Where(where, s);
    const std::string prefix = shm_dir.Join("");
    if (!absl::StartsWith(ref.shm_path, prefix)) {
      return absl::PermissionDeniedError(absl::StrCat(where, ": path ", EscapedPath(ref.shm_path),
                                                      " is outside the shm dir ",
                                                      EscapedPath(shm_dir.path())));
    }
    // "<dir>//file" (a client given "<dir>/" as its shm dir) means the same.
    const size_t start = ref.shm_path.find_first_not_of('/', prefix.size());
    if (start == std::string::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": path ", EscapedPath(ref.shm_path), " names no file"));
    }
    const std::string relative = ref.shm_path.substr(start);
    auto it = files_.find(relative);
    if (it == files_.end()) {
      absl::StatusOr<std::unique_ptr<ShmRegion>> region =
          ShmRegion::Open(shm_dir, relative, region_inodes);
      if (!region.ok()) return Where(where, region.status());
      it = files_.emplace(relative, *std::move(region)).first;
    }
    const ShmRegion& file = *it->second;
    const DeviceRows& rows = rows_[component];
    const uint64_t need = rows.total_bytes();
    if (ref.offset > file.size() || file.size() - ref.offset < need) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": offset ", ref.offset, " + ", rows.rows, " rows x ", rows.row_bytes,
                       " bytes exceeds ", ref.shm_path, " (", file.size(), " bytes)"));
    }
    layers_.push_back(file.data() + ref.offset);
    return absl::OkStatus();
  }

 private:
  static absl::Status Where(const std::string& where, const absl::Status& s) {
    return absl::Status(s.code(), absl::StrCat(where, ": ", s.message()));
  }

  // By the path beneath the shm dir: every layer naming it shares the file
  // mapped for the first.
  std::map<std::string, std::unique_ptr<ShmRegion>> files_;
};

// A pool group's mapping: its entries' mappings, kept open while the
// attachment or a job uses the group; no buffers or events of its own.
class GroupMapping : public HostMapping {
 public:
  GroupMapping(std::vector<std::shared_ptr<const DeviceMapping>> entries, uint32_t layer_num,
               uint32_t load_event_sets)
      : HostMapping(layer_num, 0, {}), entries_(std::move(entries)) {
    SetRing(load_event_sets);
  }

 private:
  const std::vector<std::shared_ptr<const DeviceMapping>> entries_;
};

// Copies tokens [from, to) of token run `r` of `part` in one ticket layer,
// in every component. Page-row components copy the same range in pages
// (every cut is on a page boundary, see PartCuts).
// Returns false when a copy hit a truncated mapping (the rest is skipped).
bool CopyPieces(const JobPart& part, Direction direction, const JobLayer& layer, size_t r,
                uint64_t from, uint64_t to) {
  const std::vector<Component>& components = part.pool->components();
  const bool backup = direction == Direction::kBackup;
  for (size_t c = 0; c < components.size(); ++c) {
    const Component& component = components[c];
    const uint64_t per_row = component.row_tokens;
    const IndexRun& run = RunsFor(part, component)[r];
    uint8_t* host = part.pool->component_base(c);
    uint8_t* device = part.mapping->buffer(c, layer.device_layer);
    bool ok = true;
    ForEachPiece(component, static_cast<uint64_t>(layer.host_layer), run, from / per_row,
                 to / per_row, [&](uint64_t host_off, uint64_t device_off, uint64_t bytes) {
                   if (!ok) return;
                   ok = backup ? GuardedCopy(host + host_off, device + device_off, bytes)
                               : GuardedCopy(device + device_off, host + host_off, bytes);
                 });
    if (!ok) return false;
  }
  return true;
}

// A place in a part's token runs: (run, token offset in that run).
using Cut = std::pair<size_t, uint64_t>;

// Boundaries of `pieces` near-equal pieces of `part`'s tokens, ending with
// (runs.size(), 0). With page runs every run is whole pages, so cutting at
// multiples of the page keeps each page in one piece.
std::vector<Cut> PartCuts(const JobPart& part, uint64_t pieces) {
  uint64_t unit = 1;
  for (const Component& c : part.pool->components()) unit = std::max(unit, c.row_tokens);
  const uint64_t per_piece = ((part.tokens + pieces - 1) / pieces + unit - 1) / unit * unit;
  std::vector<Cut> cuts;
  uint64_t next = 0;
  uint64_t seen = 0;
  for (size_t r = 0; r < part.runs.size(); ++r) {
    while (next < part.tokens && next < seen + part.runs[r].count) {
      cuts.emplace_back(r, next - seen);
      next += per_piece;
    }
    seen += part.runs[r].count;
  }
  cuts.emplace_back(part.runs.size(), 0);
  return cuts;
}

// Copies piece `piece` (between cuts[piece] and cuts[piece + 1]) of `part`
// in one ticket layer.
bool CopyPiece(const JobPart& part, Direction direction, const JobLayer& layer,
               const std::vector<Cut>& cuts, size_t piece) {
  auto [run, offset] = cuts[piece];
  const auto [end_run, end_offset] = cuts[piece + 1];
  for (; run < part.runs.size() && (run < end_run || (run == end_run && offset < end_offset));
       ++run, offset = 0) {
    const uint64_t to = run == end_run ? end_offset : part.runs[run].count;
    if (!CopyPieces(part, direction, layer, run, offset, to)) return false;
  }
  return true;
}

}  // namespace

HostEngine::HostEngine(HostEngineOptions options)
    : options_(std::move(options)), shm_dir_(DirFd::Open(options_.shm_dir, "shm dir")) {
  InstallSigbusHandler();
  for (Lane& lane : lanes_) lane.driver = std::thread([this, &lane] { DriverLoop(&lane); });
  const int helpers = std::max(0, options_.helper_threads) * 2;
  for (int i = 0; i < helpers; ++i) helpers_.emplace_back([this] { HelperLoop(); });
}

HostEngine::~HostEngine() {
  Drain();
  {
    absl::MutexLock lock(&stop_mu_);
    stopping_ = true;
  }
  for (Lane& lane : lanes_) {
    { absl::MutexLock lock(&lane.mu); }  // wake the driver
    lane.driver.join();
  }
  { absl::MutexLock lock(&helper_mu_); }
  for (std::thread& t : helpers_) t.join();
}

std::string HostEngine::PathFor(const TransferJob& job) const { return "host-memcpy"; }

absl::StatusOr<std::unique_ptr<DeviceMapping>> HostEngine::Open(const Pool& pool,
                                                                const ResolvedAttach& attach) {
  if (!shm_dir_.ok()) return shm_dir_.status();
  auto mapping = std::make_unique<ShmDeviceMapping>(pool, attach);
  for (size_t c = 0; c < attach.components.size(); ++c) {
    const ComponentBuffers& component = attach.components[c];
    for (size_t l = 0; l < component.layers.size(); ++l) {
      absl::Status s = mapping->Add(*shm_dir_, options_.region_inodes.get(), c, component.layers[l],
                                    component.Where(l));
      if (!s.ok()) return s;
    }
  }
  return mapping;
}

absl::StatusOr<std::unique_ptr<DeviceMapping>> HostEngine::OpenGroup(
    std::vector<std::shared_ptr<const DeviceMapping>> entries, uint32_t layer_num,
    uint32_t load_event_sets) {
  return std::make_unique<GroupMapping>(std::move(entries), layer_num, load_event_sets);
}

absl::Status HostEngine::Prepare(TransferJob* job) {
  if (absl::Status s = TransferEngine::Prepare(job); !s.ok()) return s;
  // Only a transfer with layer progress takes a set (its counter's); one of
  // no tokens finishes at once and takes nothing.
  if (job->layer_counters == nullptr || job->tokens() == 0) {
    return absl::OkStatus();
  }
  absl::StatusOr<int> set = static_cast<const HostMapping&>(*job->mapping).AcquireSet();
  if (!set.ok()) return set.status();
  job->event_set = *set;
  return absl::OkStatus();
}

void HostEngine::Submit(TransferJob job) {
  Lane& lane = lanes_[job.direction == Direction::kBackup ? 0 : 1];
  absl::MutexLock lock(&lane.mu);
  lane.queue.push_back(std::move(job));
}

void HostEngine::Drain() {
  for (Lane& lane : lanes_) {
    absl::MutexLock lock(&lane.mu);
    auto idle = [&lane]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(lane.mu) {
      return lane.queue.empty() && !lane.busy;
    };
    lane.mu.Await(absl::Condition(&idle));
  }
}

void HostEngine::DriverLoop(Lane* lane) {
  while (true) {
    TransferJob job;
    {
      absl::MutexLock lock(&lane->mu);
      auto ready = [this, lane]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(lane->mu) {
        absl::MutexLock stop_lock(&stop_mu_);
        return !lane->queue.empty() || stopping_;
      };
      lane->mu.Await(absl::Condition(&ready));
      if (lane->queue.empty()) return;  // stopping, nothing left
      job = std::move(lane->queue.front());
      lane->queue.pop_front();
      lane->busy = true;
    }
    absl::Status status = RunJob(job);
    if (job.event_set >= 0) {
      // The worker's counter first (a failed load's waiters are released
      // too), then the set, then the ticket: a worker that waited for the
      // ticket may load again at once on a one-set ring.
      if (job.layer_counters != nullptr) {
        job.layer_counters->Release(static_cast<uint32_t>(job.event_set), job.layer_base,
                                    static_cast<uint32_t>(job.layer_num()));
      }
      static_cast<const HostMapping&>(*job.mapping).ReleaseSet(job.event_set);
    }
    job.ticket->Finish(std::move(status));
    job = TransferJob();  // drop the mapping and pool before reporting idle
    absl::MutexLock lock(&lane->mu);
    lane->busy = false;
  }
}

absl::Status HostEngine::RunJob(const TransferJob& job) {
  // Pieces per part and layer: as many threads as the part's layer size
  // justifies. A ticket layer's pieces of every part run together.
  const uint64_t max_pieces = static_cast<uint64_t>(options_.helper_threads) + 1;
  std::vector<std::vector<Cut>> cuts;
  for (const JobPart& part : job.parts) {
    const uint64_t layer_bytes = HeldLayerBytes(*part.pool, part.tokens);
    const uint64_t pieces = std::clamp<uint64_t>(
        layer_bytes / std::max<uint64_t>(options_.min_split_bytes, 1), 1, max_pieces);
    cuts.push_back(PartCuts(part, pieces));
  }
  std::vector<std::function<void()>> tasks;
  std::atomic<bool> truncated{false};
  for (size_t l = 0; l < job.layer_num(); ++l) {
    // A cancelled ticket stops between layers; the layers before stay copied.
    if (absl::Status cancel = job.ticket->CancelReason(); !cancel.ok()) return cancel;
    tasks.clear();
    for (size_t p = 0; p < job.parts.size(); ++p) {
      const JobPart& part = job.parts[p];
      const JobLayer& layer = part.layers[l];
      if (layer.host_layer < 0) continue;  // nothing of this part in this layer
      for (size_t piece = 0; piece + 1 < cuts[p].size(); ++piece) {
        tasks.push_back([&job, &part, &layer, &cuts, &truncated, p, piece] {
          if (!CopyPiece(part, job.direction, layer, cuts[p], piece)) truncated = true;
        });
      }
    }
    if (tasks.size() == 1) {
      tasks[0]();
    } else if (tasks.size() > 1) {
      RunParallel(tasks);
    }
    if (truncated) {
      return absl::FailedPreconditionError(absl::StrCat(
          "layer ", l, ": a device buffer's shared-memory file was truncated while the ",
          DirectionName(job.direction),
          " copied from its mapping (SIGBUS caught); the layers before it were copied"));
    }
    // The worker's view first, as the CUDA engine records the layer's event
    // before its own completion event.
    if (job.layer_counters != nullptr && job.event_set >= 0) {
      job.layer_counters->Publish(static_cast<uint32_t>(job.event_set), job.layer_base,
                                  static_cast<uint32_t>(l));
    }
    job.ticket->LayerFinished(TicketLayerBytes(job, l));
  }
  return absl::OkStatus();
}

void HostEngine::RunParallel(std::vector<std::function<void()>>& tasks) {
  absl::BlockingCounter pending(static_cast<int>(tasks.size()) - 1);
  {
    absl::MutexLock lock(&helper_mu_);
    for (size_t i = 1; i < tasks.size(); ++i) {
      helper_queue_.push_back([&tasks, &pending, i] {
        tasks[i]();
        pending.DecrementCount();
      });
    }
  }
  tasks[0]();
  pending.Wait();
}

void HostEngine::HelperLoop() {
  while (true) {
    std::function<void()> task;
    {
      absl::MutexLock lock(&helper_mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(helper_mu_) {
        absl::MutexLock stop_lock(&stop_mu_);
        return !helper_queue_.empty() || stopping_;
      };
      helper_mu_.Await(absl::Condition(&ready));
      if (helper_queue_.empty()) return;
      task = std::move(helper_queue_.front());
      helper_queue_.pop_front();
    }
    task();
  }
}

}  // namespace kvhost
