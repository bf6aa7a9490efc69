// Worker-side helpers of the cuda backend: describe a GPU worker's device KV
// buffers as CUDA IPC buffers that kvhostd (another process) can open.
//
// A layer buffer is named by the IPC handle of the cudaMalloc allocation that
// contains it plus its byte offset from that allocation's base, so buffers
// carved out of one allocation (a caching allocator's segment, or one
// allocation for all layers) share one handle, which kvhostd opens once. The
// GPU is named by UUID, since device ordinals differ between processes.
// Memory from cuMemCreate (PyTorch's expandable segments) has no
// cudaIpcMemHandle_t and is refused here; it needs the file-descriptor path,
// which is not implemented yet.
//
// Part of kvhost_cuda_client, built only with CUDA. Needs a CUDA runtime and
// driver in the calling process; the functions change no device state (the
// calling thread's current device is left as it was). Thread-safe.
//
//   std::vector<void*> k(L), v(L);  // the worker's per-layer device buffers
//   auto request = kvhost::MakeCudaAttachRequest("llama", k, v, rows);
//   auto attachment = client->AttachDevice(*request);
#ifndef KVHOST_CLIENT_CUDA_EXPORT_H_
#define KVHOST_CLIENT_CUDA_EXPORT_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
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
// ExportCudaBuffer, naming the layer.
absl::StatusOr<v1::AttachDeviceRequest> MakeCudaAttachRequest(const std::string& pool,
                                                              absl::Span<void* const> k_layers,
                                                              absl::Span<void* const> v_layers,
                                                              uint64_t device_size_tokens);

}  // namespace kvhost

#endif  // KVHOST_CLIENT_CUDA_EXPORT_H_
