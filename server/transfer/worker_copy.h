// Worker copies (kvhost.v1.BackupRequest.worker_copy, kvhostd --worker-copy):
// the daemon validates and plans, the worker launches. The plan is exactly
// the SM copy path's (copy_plan.h PlanSmCopy over the pool's launch groups,
// GroupComponents), which the worker runs with its own pointers: its device
// layer buffers, and its own mapping of the pool's regions, whose
// descriptors it fetched from the handoff socket
// (HANDOFF_KIND_POOL_REGIONS). One mechanism, no second copy of the
// address math: the worker's kernel is kernels/copy_kernel.h's, addressing
// through kernels/kvhost/copy_tile.h.
//
// The descriptors handed out are read-write, of every region of the
// attached pool (a plain attachment covers all its components, and a region
// file holds every layer: no narrower grain exists), and they outlive
// DetachDevice and DeletePool. TransferManager::FindPoolRegions therefore
// serves only an attachment made within a session and holds the pool for
// that session until it ends, so a deleted pool's bytes stay releasing
// (counted against --memory-limit) while a worker may still map them.
//
// Why it exists and why it is off by default: docs/PERF.md run M measured
// an in-worker zero-copy kernel at sglang's quota (2 blocks of 1024
// threads) costing a GEMM worker +21 % (MHA) / +32 % (MLA) on back-to-back
// backups against +6-10 % for the daemon's staged path; it may still pay
// where a worker's duty cycle is light or transfers are long on a node
// without MPS, which only a measurement of that node can tell.
//
// Pure functions of their arguments; thread-safe.
#ifndef KVHOST_SERVER_TRANSFER_WORKER_COPY_H_
#define KVHOST_SERVER_TRANSFER_WORKER_COPY_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "server/pool/pool.h"
#include "server/transfer/cuda/copy_plan.h"
#include "server/transfer/engine.h"

namespace kvhost {

// The ticket path of a worker copy (TransferStatus.path, logs, metrics).
inline constexpr char kWorkerCopyPath[] = "worker";

// Worker copies one attachment may have in flight: a worker overlaps a few
// transfers with compute; 64 also bounds what a worker that never calls
// FinishWorkerCopy holds until its session ends.
inline constexpr uint32_t kMaxWorkerCopiesPerAttachment = 64;

// Regions a worker copy hands over in one SCM_RIGHTS message: the most any
// pool kind has (a MAMBA pool's temporal state and its conv states) with
// room to spare, far under the kernel's SCM_MAX_FD (253).
inline constexpr uint32_t kMaxWorkerCopyRegions = 16;

// The plan of one worker copy: the SM copy plan of the job's one part, and
// per ticket layer the host layer it copies (-1: none) and the attached
// layer (JobLayer).
struct WorkerCopyPlan {
  SmCopyPlan sm;
  std::vector<JobLayer> layers;
};

// REQUIRES: `job` has exactly one part (a plain attachment's) whose pool
// has components.
WorkerCopyPlan PlanWorkerCopy(const TransferJob& job);

// An upper bound of the plan's encoded size in a TransferTicket
// (kvhost.v1.WorkerCopyPlan), for the reply bound.
uint64_t WorkerCopyPlanBytes(const WorkerCopyPlan& plan);

// What a worker needs to address a pool itself
// (HANDOFF_KIND_POOL_REGIONS): the pool (its regions and components) and
// its launch groups, the ones every plan on it names.
struct WorkerRegions {
  std::shared_ptr<const Pool> pool;
  std::vector<LayoutGroup> groups;
};

}  // namespace kvhost

#endif  // KVHOST_SERVER_TRANSFER_WORKER_COPY_H_
