// Worker-side helpers of the cuda backend: describe a GPU worker's device KV
// buffers as CUDA IPC buffers that kvhostd (another process) can open.
//
// A layer buffer is named by the IPC handle of the cudaMalloc allocation that
// contains it plus its byte offset from that allocation's base, so buffers
// carved out of one allocation (a caching allocator's segment, or one
// allocation for all layers) share one handle, which kvhostd opens once. The
// GPU is named by UUID, since device ordinals differ between processes.
// Memory from the CUDA virtual memory API (cuMemCreate: PyTorch's expandable
// segments, vLLM's cumem allocator, a raw cuMemMap) has no cudaIpcMemHandle_t.
// Such a buffer is described by the physical allocations that back it, in
// address order (CudaFdBuffer): each is exported once as a POSIX file
// descriptor (cuMemExportToShareableHandle), the descriptors are deposited on
// kvhostd's handoff socket (Client::DepositDescriptors, SCM_RIGHTS) and the
// request names them by deposit. kvhostd imports them and maps them back to
// back in its own address space. This needs the buffer's size (to know which
// allocations it spans) and the Client (to deposit): the builders below take
// both; one attachment may mix both kinds of memory.
//
// Part of kvhost_cuda_client, built only with CUDA. Needs a CUDA runtime and
// driver in the calling process; the functions change no device state (the
// calling thread's current device is left as it was). Thread-safe.
//
// Synchronisation (docs/DESIGN.md): LoadEvents opens an attachment's per-layer
// load events so the worker's stream can wait for one layer of a load right
// before using it; ExportEvent turns the worker's own interprocess event into
// the bytes a Backup waits on.
//
//   std::vector<void*> k(L), v(L);  // the worker's per-layer device buffers
//   auto request = kvhost::MakeCudaAttachRequest("llama", k, v, rows);
//   request->set_layer_progress(true);  // loads return once layer 0 is queued
//   auto attachment = client->AttachDevice(*request);
//   auto events = kvhost::LoadEvents::Open(*client, *attachment);  // events + counters
//   auto load = client->LoadWithEvents(attachment->id(), host, rows);
//   for (uint32_t l = 0; l < L; ++l) {
//     // Host: wait until this load recorded layer l's event (LayerProgress);
//     // then the stream waits on the event. Then layer l's attention.
//     (*events)->WaitLayer(*load, l, stream);
//   }
//   client->WaitTransfer(load->ticket_id);  // the load's outcome (a failed one
//                                           // still releases every wait)
//
// Without layer_progress a Load returns after every layer's event is
// recorded, and WaitLayer(load->event_set, l, stream) alone is right.
#ifndef KVHOST_CLIENT_CUDA_EXPORT_H_
#define KVHOST_CLIENT_CUDA_EXPORT_H_

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kvhost/client.h"
#include "kvhost/layer_progress.h"
#include "kvhost/v1/transfer.pb.h"

namespace kvhost {

// The IPC description of the device memory at `device_ptr`: the handle of its
// allocation's base, the offset of `device_ptr` from that base, and the UUID
// of the GPU holding it ("GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", as
// nvidia-smi prints it). INVALID_ARGUMENT for a null pointer or one that is
// not device memory; FAILED_PRECONDITION when the allocation cannot be
// exported (not from cudaMalloc); INTERNAL for other CUDA failures.
absl::StatusOr<v1::CudaIpcBuffer> ExportCudaBuffer(const void* device_ptr);

// The AttachDevice request for per-layer device buffers: `k_layers` (MHA K,
// or the MLA latent) and `v_layers` (MHA V; empty for MLA), each holding
// `device_size_tokens` rows. Each allocation is exported once. Errors as
// ExportCudaBuffer, naming the layer. For cuMem memory (above) give each
// buffer's size in `layer_bytes` and the `client` to deposit with;
// FAILED_PRECONDITION names the layer when either is missing, and the
// deposit's errors (Client::DepositDescriptors) come back as they are.
absl::StatusOr<v1::AttachDeviceRequest> MakeCudaAttachRequest(
    const std::string& pool, absl::Span<void* const> k_layers, absl::Span<void* const> v_layers,
    uint64_t device_size_tokens, uint64_t layer_bytes = 0, Client* client = nullptr);

// One pool component's device buffers, one per attached layer (for the
// components overload below).
struct CudaComponentLayers {
  std::string name;           // a Pool.components name ("k", "index_k", "conv0", ...)
  std::vector<void*> layers;  // one per attached layer
  // Bytes of each layer buffer from its pointer; 0 (unknown) serves
  // cudaMalloc memory only (cuMem memory needs it, see above).
  uint64_t layer_bytes = 0;
};

// The AttachDevice request for any pool kind: every component's buffers in
// AttachDeviceRequest.components, by name, in the order given. A token-row
// component's buffers hold `device_size_tokens` rows, a page-row
// component's device_size_tokens / page_size. Set start_layer / end_layer
// on the result to attach a layer range other than the pool's. Each
// allocation is exported once. Errors as ExportCudaBuffer, naming the
// component and layer; cuMem memory as the overload above (its size from
// CudaComponentLayers::layer_bytes, deposited with `client`).
absl::StatusOr<v1::AttachDeviceRequest> MakeCudaAttachRequest(
    const std::string& pool, absl::Span<const CudaComponentLayers> components,
    uint64_t device_size_tokens, Client* client = nullptr);

// One pool group entry's device buffers (for MakeCudaGroupAttachRequest):
// as the components overload above gives a plain pool's. Its layers are
// device layers [start_layer, end_layer) of the entry's pool (0 / 0: the
// pool's range), which must include every layer the entry's layer_map
// names.
struct CudaGroupEntry {
  std::string entry;  // PoolEntry.name
  std::vector<CudaComponentLayers> components;
  uint64_t device_size_tokens = 0;
  uint32_t start_layer = 0;
  uint32_t end_layer = 0;
};

// The AttachDevice request for the pool group `group`: one
// AttachDeviceRequest.entries element per entry, in the order given (every
// buffer on one GPU). Set load_event_sets / tp_rank / load_only on the
// result as for a plain pool. Each allocation is exported once over all
// entries. Errors as ExportCudaBuffer, naming the entry, component and
// layer; cuMem memory as above, deposited with `client`.
absl::StatusOr<v1::AttachDeviceRequest> MakeCudaGroupAttachRequest(
    const std::string& group, absl::Span<const CudaGroupEntry> entries, Client* client = nullptr);

// The bytes of `event`'s cudaIpcEventHandle_t, for BackupRequest.
// wait_event_handle. The event must have been created with
// cudaEventInterprocess | cudaEventDisableTiming; record it on the stream
// that writes the rows before calling Backup, and keep it alive until the
// backup's ticket finishes. INVALID_ARGUMENT for a null event or one that
// cannot be exported.
absl::StatusOr<std::string> ExportEvent(cudaEvent_t event);

// An attachment's load events, opened in the worker's process. Each event is
// opened once (cudaIpcOpenEventHandle) and closed in the destructor, which
// must run before the worker's CUDA context goes; the daemon's events may be
// destroyed (detach) before or after. Thread-safe after Open (WaitLayer only
// reads).
class LoadEvents {
 public:
  // Opens every handle of `attachment` on the current device (the
  // attachment's GPU). FAILED_PRECONDITION when the attachment has no events
  // (host backend); INVALID_ARGUMENT for a malformed list or a handle that
  // will not open.
  static absl::StatusOr<std::unique_ptr<LoadEvents>> Open(const v1::Attachment& attachment);
  // The same, and for an attachment with layer_progress also its layer
  // counters, fetched with `client`'s credentials (LayerProgress::Open, and
  // its errors).
  static absl::StatusOr<std::unique_ptr<LoadEvents>> Open(const Client& client,
                                                          const v1::Attachment& attachment);
  ~LoadEvents();
  LoadEvents(const LoadEvents&) = delete;
  LoadEvents& operator=(const LoadEvents&) = delete;

  uint32_t sets() const { return sets_; }
  uint32_t layers() const { return layers_; }
  cudaEvent_t event(int set, uint32_t layer) const {
    return events_[static_cast<size_t>(set) * layers_ + layer];
  }
  // Makes `stream` wait until layer `layer` of the load that records set
  // `set` (LoadTicket::event_set) is on the device. Call after the Load RPC
  // returned. INVALID_ARGUMENT for a set or layer out of range (a set of -1:
  // there is nothing to wait for; callers skip the wait), INTERNAL for a
  // CUDA failure.
  absl::Status WaitLayer(int set, uint32_t layer, cudaStream_t stream) const;
  // Layer `layer` of the load `ticket`: with layer counters (the Open
  // overload above, attachment with layer_progress), first waits on the
  // host until the load recorded the layer's event (LayerProgress::
  // WaitRecorded, DEADLINE_EXCEEDED after `timeout`), then WaitLayer(set,
  // layer, stream). OK at once for a ticket without a set.
  absl::Status WaitLayer(const LoadTicket& ticket, uint32_t layer, cudaStream_t stream,
                         absl::Duration timeout = absl::Seconds(10)) const;
  // The layer counters, or null (attachment without layer_progress).
  const LayerProgress* progress() const { return progress_.get(); }

 private:
  LoadEvents() = default;
  std::unique_ptr<LayerProgress> progress_;
  uint32_t sets_ = 0;
  uint32_t layers_ = 0;
  std::vector<cudaEvent_t> events_;  // set-major
};

}  // namespace kvhost

#endif  // KVHOST_CLIENT_CUDA_EXPORT_H_
