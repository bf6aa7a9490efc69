#include "server/transfer/host_engine.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/blocking_counter.h"
#include "server/pool/shm_region.h"
#include "spdlog/spdlog.h"

namespace kvhost {
namespace {

// Device layer buffers mapped from the worker's shared-memory files; each
// file is mapped once even when many layers live in it.
class ShmDeviceMapping : public DeviceMapping {
 public:
  ShmDeviceMapping(const Pool& pool, const AttachRequest& request) : DeviceMapping(pool, request) {}

  // Maps `ref` as a buffer of component `component`; buffers are added
  // component-major.
  absl::Status Add(const std::string& shm_dir, size_t component, const DeviceBufferRef& ref,
                   const std::string& where) {
    if (ref.kind != DeviceBufferRef::Kind::kShm) {
      return absl::FailedPreconditionError(
          absl::StrCat(where,
                       " is a CUDA IPC buffer, but this daemon runs the host backend "
                       "(start kvhostd with --backend=cuda on a GPU machine)"));
    }
    absl::StatusOr<std::string> path = ResolvePathInside(shm_dir, ref.shm_path);
    if (!path.ok()) {
      return absl::Status(path.status().code(), absl::StrCat(where, ": ", path.status().message()));
    }
    auto it = files_.find(*path);
    if (it == files_.end()) {
      absl::StatusOr<std::unique_ptr<ShmRegion>> region = ShmRegion::Open(*path);
      if (!region.ok()) {
        return absl::Status(region.status().code(),
                            absl::StrCat(where, ": ", region.status().message()));
      }
      it = files_.emplace(*path, *std::move(region)).first;
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
  std::map<std::string, std::unique_ptr<ShmRegion>> files_;
};

// Copies tokens [from, to) of token run `r` of one ticket layer, in every
// component. Page-row components copy the same range in pages (every cut is
// on a page boundary, see RunJob).
void CopyPieces(const TransferJob& job, const JobLayer& layer, size_t r, uint64_t from,
                uint64_t to) {
  const std::vector<Component>& components = job.pool->components();
  for (size_t c = 0; c < components.size(); ++c) {
    const Component& component = components[c];
    const uint64_t per_row = component.row_tokens;
    const IndexRun& run = RunsFor(job, component)[r];
    uint8_t* host = job.pool->component_base(c);
    uint8_t* device = job.device->buffer(c, layer.device_layer);
    const bool backup = job.direction == Direction::kBackup;
    ForEachPiece(component, static_cast<uint64_t>(layer.host_layer), run, from / per_row,
                 to / per_row, [&](uint64_t host_off, uint64_t device_off, uint64_t bytes) {
                   if (backup) {
                     std::memcpy(host + host_off, device + device_off, bytes);
                   } else {
                     std::memcpy(device + device_off, host + host_off, bytes);
                   }
                 });
  }
}

}  // namespace

HostEngine::HostEngine(HostEngineOptions options) : options_(std::move(options)) {
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
                                                                const AttachRequest& request) {
  auto mapping = std::make_unique<ShmDeviceMapping>(pool, request);
  for (size_t c = 0; c < request.components.size(); ++c) {
    const ComponentBuffers& component = request.components[c];
    for (size_t l = 0; l < component.layers.size(); ++l) {
      absl::Status s = mapping->Add(options_.shm_dir, c, component.layers[l], component.Where(l));
      if (!s.ok()) return s;
    }
  }
  return mapping;
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
    RunJob(job);
    job = TransferJob();  // drop the mapping and pool before reporting idle
    absl::MutexLock lock(&lane->mu);
    lane->busy = false;
  }
}

void HostEngine::RunJob(const TransferJob& job) {
  const uint64_t layer_bytes = HeldLayerBytes(*job.pool, job.tokens);
  // Pieces per layer: as many threads as the layer's size justifies.
  const uint64_t max_parts = static_cast<uint64_t>(options_.helper_threads) + 1;
  const uint64_t parts = std::clamp<uint64_t>(
      layer_bytes / std::max<uint64_t>(options_.min_split_bytes, 1), 1, max_parts);
  // Token boundaries of each part, as (run, offset in run) pairs. With page
  // runs, every run is whole pages, so cutting at multiples of the page
  // keeps each page in one part.
  uint64_t unit = 1;
  for (const Component& c : job.pool->components()) unit = std::max(unit, c.row_tokens);
  std::vector<std::pair<size_t, uint64_t>> cuts;
  {
    const uint64_t per_part = ((job.tokens + parts - 1) / parts + unit - 1) / unit * unit;
    uint64_t next = 0;
    uint64_t seen = 0;
    for (size_t r = 0; r < job.runs.size(); ++r) {
      while (next < job.tokens && next < seen + job.runs[r].count) {
        cuts.emplace_back(r, next - seen);
        next += per_part;
      }
      seen += job.runs[r].count;
    }
    cuts.emplace_back(job.runs.size(), 0);
  }
  for (const JobLayer& layer : job.layers) {
    if (layer.host_layer < 0) {  // a device layer the pool does not hold
      job.ticket->LayerDone(0);
      continue;
    }
    auto copy_part = [&job, &cuts, &layer](size_t part) {
      auto [run, offset] = cuts[part];
      const auto [end_run, end_offset] = cuts[part + 1];
      for (; run < job.runs.size() && (run < end_run || (run == end_run && offset < end_offset));
           ++run, offset = 0) {
        const uint64_t to = run == end_run ? end_offset : job.runs[run].count;
        CopyPieces(job, layer, run, offset, to);
      }
    };
    if (cuts.size() <= 2) {
      if (cuts.size() == 2) copy_part(0);
    } else {
      std::vector<std::function<void()>> tasks;
      for (size_t part = 0; part + 1 < cuts.size(); ++part) {
        tasks.push_back([&copy_part, part] { copy_part(part); });
      }
      RunParallel(tasks);
    }
    job.ticket->LayerDone(layer_bytes);
  }
  job.ticket->Finish(absl::OkStatus());
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
