// kvhost::WorkerCopier: the worker-assisted form of Backup and Load
// (kvhost.v1.BackupRequest.worker_copy, kvhostd --worker-copy). kvhostd
// validates the transfer and plans it; this process runs the copy: the SM
// copy kernel of kvhostd's own SM path (kernels/copy_kernel.h, the same
// tiles and address math), launched on the caller's stream with a small
// grid, reading and writing the pool's pinned host memory directly through
// this process's own mapping of the pool's regions. The regions come as
// descriptors over kvhostd's handoff socket (SCM_RIGHTS, never a path;
// HANDOFF_KIND_POOL_REGIONS), mapped MAP_SHARED read-write and registered
// with cudaHostRegister(Mapped | Portable). They are the whole pool's and
// outlive the attachment: the mapping stays until the copier is destroyed,
// and kvhostd holds the pool (a deleted one's bytes stay releasing) until
// the worker's session ends, so the attachment must be made within a
// worker session (Open is FAILED_PRECONDITION otherwise).
//
// When: docs/PERF.md run M measured this kind of copy at sglang's quota
// costing a GEMM worker +21 % (MHA) / +32 % (MLA) on back-to-back backups,
// against +6-10 % for kvhostd's staged path, which is why kvhostd serves it
// only with --worker-copy. It may pay where a worker's duty cycle is light,
// or on nodes without MPS with long transfers; measure first
// (kvhost_cuda_transfer_bench --paths=worker).
//
//   std::vector<kvhost::CudaComponentLayers> buffers = ...;  // as attached
//   auto request = kvhost::MakeCudaAttachRequest("llama", buffers, rows);
//   auto attachment = client->AttachDevice(*request);
//   auto copier = kvhost::WorkerCopier::Open(*client, *attachment, buffers);
//   auto load = (*copier)->Load(host, rows, stream);  // queued on `stream`
//   for (uint32_t l = 0; l < layers; ++l) {
//     (*copier)->WaitLayer(*load, l, compute);  // cudaStreamWaitEvent
//     // layer l's attention on `compute`
//   }
//   client->WaitTransfer(load->ticket_id);  // the daemon's view, once finished
//
// Ordering: a load's layer l is on the device once WaitLayer(l)'s event
// completes; the copy runs in layer order. A backup needs no wait event:
// its kernels run on `stream` after whatever the caller queued there before
// (the writes of the rows, if they were queued on that stream). A thread of
// the copier waits for each copy's end and tells kvhostd
// (FinishWorkerCopy, with the CUDA error if there was one); until then the
// ticket is in flight, and it fails if this process's session ends first.
// The host slots of a copy must stay allocated until its ticket finishes.
//
// Thread safety: Backup, Load, WaitLayer and Wait may be called
// concurrently. Ownership: the copier owns its mappings and registrations,
// the device layer tables and its completion thread; the destructor waits
// for every copy it started (and kvhostd's answer to each FinishWorkerCopy,
// at most ClientOptions::timeout each when kvhostd is gone), then
// unregisters and unmaps. It must run
// before the CUDA context goes. The device buffers stay the caller's and
// must outlive the copier. A WorkerTicket holds its copy's events and may
// outlive the copier.
#ifndef KVHOST_CLIENT_WORKER_COPY_H_
#define KVHOST_CLIENT_WORKER_COPY_H_

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kvhost/client.h"
#include "kvhost/cuda_export.h"
#include "kvhost/v1/handoff.pb.h"
#include "kvhost/v1/transfer.pb.h"

namespace kvhost {

struct WorkerCopierOptions {
  // Thread blocks of each copy kernel launch (8 warps of 32 threads each,
  // kernels/copy_kernel.h kCopyKernelWarpsPerBlock). 8 is the in-process
  // anchor's quota: sglang's 2 blocks of 1024 threads.
  int blocks = 8;
  // How long Open waits for the handoff socket.
  absl::Duration handoff_timeout = absl::Seconds(5);
};

// One worker copy: its ticket and layers, and (opaque) the copy's events.
struct WorkerTicket {
  uint64_t ticket_id = 0;
  uint32_t layers = 0;
  // The copy; null for a transfer that copied nothing (its ticket is
  // already finished).
  std::shared_ptr<const void> copy;
};

struct Handoff;  // what the handoff socket hands over (client/handoff.h, internal)

class WorkerCopier {
 public:
  // Fetches `attachment`'s pool regions with `client`'s credentials, maps
  // and registers them, and builds the device layer tables from
  // `components`: the buffers the attach request was made from
  // (MakeCudaAttachRequest), each pool component the daemon names by name
  // with one pointer per attached layer. The current device must be the
  // attachment's GPU. FAILED_PRECONDITION when kvhostd serves the
  // attachment no worker copies (Attachment.handoff_socket empty, or the
  // handoff's refusal: no --worker-copy, the host backend, a pool group);
  // INVALID_ARGUMENT for a component missing from `components` or with the
  // wrong number of layers; the handoff's errors; INTERNAL for CUDA or mmap
  // failures. `client` must outlive the copier.
  static absl::StatusOr<std::unique_ptr<WorkerCopier>> Open(
      Client& client, const v1::Attachment& attachment,
      absl::Span<const CudaComponentLayers> components, const WorkerCopierOptions& options = {});
  ~WorkerCopier();
  WorkerCopier(const WorkerCopier&) = delete;
  WorkerCopier& operator=(const WorkerCopier&) = delete;

  // Device rows -> host slots (BackupRequest.worker_copy), the copy queued
  // on `stream`. The daemon's errors (its validation: nothing is queued);
  // INTERNAL when the plan cannot be run here (then the ticket is failed
  // with the reason) or a CUDA call fails.
  absl::StatusOr<WorkerTicket> Backup(absl::Span<const int64_t> host_indices,
                                      absl::Span<const int64_t> device_indices,
                                      cudaStream_t stream);
  // Host slots -> device rows, layer by layer. Errors as Backup.
  absl::StatusOr<WorkerTicket> Load(absl::Span<const int64_t> host_indices,
                                    absl::Span<const int64_t> device_indices, cudaStream_t stream);
  // Makes `consumer` wait until layer `layer` of `ticket`'s copy is done
  // (cudaStreamWaitEvent). OK at once for a ticket that copied nothing;
  // INVALID_ARGUMENT for a layer out of range; INTERNAL for a CUDA error.
  absl::Status WaitLayer(const WorkerTicket& ticket, uint32_t layer, cudaStream_t consumer) const;
  // Blocks until the copy ended and kvhostd was told: OK, the copy's CUDA
  // error, or FinishWorkerCopy's. DEADLINE_EXCEEDED after `timeout`.
  absl::Status Wait(const WorkerTicket& ticket, absl::Duration timeout = absl::Minutes(1)) const;

  int blocks() const { return blocks_; }
  // The pool's host bytes mapped and registered here.
  uint64_t mapped_bytes() const;

 private:
  struct Region;
  struct Group;
  struct Copy;
  class Completion;

  WorkerCopier();
  // Open's steps: the handed-over regions mapped and registered, and one
  // launch group with its device layer table.
  absl::Status MapRegions(const Handoff& handoff, const std::string& socket);
  absl::Status AddGroup(const v1::WorkerCopyGroup& in, int index,
                        absl::Span<const CudaComponentLayers> components);
  absl::StatusOr<WorkerTicket> Run(bool load, const v1::TransferTicket& ticket,
                                   cudaStream_t stream);
  // Queues the plan's kernels and events on `stream` for `copy`.
  absl::Status Enqueue(bool load, const v1::WorkerCopyPlan& plan, Copy* copy, cudaStream_t stream);

  Client* client_ = nullptr;
  std::string attachment_id_;
  int device_ = 0;
  int blocks_ = 8;
  uint32_t layer_num_ = 0;
  std::vector<Region> regions_;
  std::vector<Group> groups_;
  std::unique_ptr<Completion> completion_;
};

}  // namespace kvhost

#endif  // KVHOST_CLIENT_WORKER_COPY_H_
