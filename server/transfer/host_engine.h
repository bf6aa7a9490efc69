// HostEngine: the transfer engine of the host backend (no GPU). A worker's
// "device" pool is emulated in shared-memory files under --shm-dir; backups
// and loads are memcpy between those files and the host pool, with the same
// run coalescing and layout math as the CUDA engine.
//
// Each direction has a driver thread with a FIFO queue (the CPU counterpart of
// one CUDA stream per direction). A driver copies a job ticket layer by
// ticket layer, in order: in every part (one per pool; several for a pool
// group), every component of the part's pool (token runs, or page runs for
// page-row components), nothing where the part's JobLayer says -1. It
// splits a large part's layer over the helper threads at page boundaries;
// after each ticket layer, every part's copies of it done, it publishes the
// layer in the attachment's layer counters (backups and loads with layer
// progress, TransferJob::layer_counters) and reports that layer's bytes over all parts
// to the ticket.
//
// Thread safety: as TransferEngine.
#ifndef KVHOST_SERVER_TRANSFER_HOST_ENGINE_H_
#define KVHOST_SERVER_TRANSFER_HOST_ENGINE_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/pool/beneath.h"
#include "server/pool/shm_region.h"
#include "server/transfer/engine.h"

namespace kvhost {

struct HostEngineOptions {
  // Only files beneath this directory may be attached: a buffer's path must
  // start with it (as given here) and '/', and the rest is opened beneath it
  // without following symbolic links (server/pool/beneath.h).
  std::string shm_dir = "/dev/shm";
  // The pools' region files, which are never attached (PERMISSION_DENIED);
  // the registry's RegistryOptions::region_inodes. Null: none refused.
  std::shared_ptr<const RegionInodes> region_inodes;
  // Copy threads per direction, besides the direction's driver thread.
  int helper_threads = 2;
  // A layer is split into pieces of at least this many bytes, so small
  // layers are not fanned out to threads for nothing.
  uint64_t min_split_bytes = uint64_t{1} << 20;
};

class HostEngine : public TransferEngine {
 public:
  explicit HostEngine(HostEngineOptions options);
  ~HostEngine() override;

  const char* name() const override { return "host"; }
  std::string PathFor(const TransferJob& job) const override;
  absl::StatusOr<std::unique_ptr<DeviceMapping>> Open(const Pool& pool,
                                                      const ResolvedAttach& attach) override;
  // Keeps `entries` open; no load events (the host backend has none).
  absl::StatusOr<std::unique_ptr<DeviceMapping>> OpenGroup(
      std::vector<std::shared_ptr<const DeviceMapping>> entries, uint32_t layer_num,
      uint32_t load_event_sets) override;
  // A backup or load with layer progress (TransferJob::layer_counters)
  // takes one of the mapping's load_event_sets sets until it ends
  // (RESOURCE_EXHAUSTED when all are held), as the CUDA engine's do; other
  // jobs as TransferEngine::Prepare.
  absl::Status Prepare(TransferJob* job) override;
  void Submit(TransferJob job) override;
  void Drain() override;

 private:
  // One direction: its queue, its driver thread.
  struct Lane {
    absl::Mutex mu;
    std::deque<TransferJob> queue ABSL_GUARDED_BY(mu);
    bool busy ABSL_GUARDED_BY(mu) = false;
    std::thread driver;
  };

  void DriverLoop(Lane* lane);
  // Copies `job` layer by layer; its end (OK, cancelled, failed), for the
  // driver to finish the ticket with.
  absl::Status RunJob(const TransferJob& job);
  void RunParallel(std::vector<std::function<void()>>& tasks);
  void HelperLoop();

  const HostEngineOptions options_;
  // options_.shm_dir, opened once; Open fails with its error if it could not be.
  const absl::StatusOr<DirFd> shm_dir_;

  absl::Mutex stop_mu_;
  bool stopping_ = false;
  Lane lanes_[2];

  absl::Mutex helper_mu_;
  std::deque<std::function<void()>> helper_queue_ ABSL_GUARDED_BY(helper_mu_);
  std::vector<std::thread> helpers_;
};

}  // namespace kvhost

#endif  // KVHOST_SERVER_TRANSFER_HOST_ENGINE_H_
