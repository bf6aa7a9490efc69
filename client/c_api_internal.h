// The C ABI's side of its handles (kvhost/kvhost_c.h) and the helpers every
// c_api*.cc file converts with: one status-and-message boundary (Run), the
// caller's output buffers, JSON in and out, timeouts, index arrays.
//
// Private to libkvhost_c; nothing here is exported. The handles only hold
// the C++ client's objects: the ABI keeps no state of its own.
#ifndef KVHOST_CLIENT_C_API_INTERNAL_H_
#define KVHOST_CLIENT_C_API_INTERNAL_H_

#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "google/protobuf/message.h"
#include "kvhost/client.h"
#include "kvhost/kvhost_c.h"
#include "kvhost/layer_progress.h"

namespace kvhost {
class LoadEvents;  // kvhost/cuda_export.h, in CUDA builds only
}

struct kvhost_client_options {
  kvhost::ClientOptions options;
};

struct kvhost_client {
  std::unique_ptr<kvhost::Client> client;
};

struct kvhost_shm_device_pool {
  std::unique_ptr<kvhost::ShmDevicePool> pool;
};

// What kvhost_attach_cuda attached: kvhost_worker_copier_open builds the
// copier's device layers from it (kvhost::CudaComponentLayers, without
// needing cuda_export.h here).
struct kvhost_cuda_component {
  std::string name;
  std::vector<void*> layers;
  uint64_t layer_bytes = 0;  // each layer buffer's size; 0: not given
};

struct kvhost_attachment {
  kvhost::v1::Attachment attachment;
  std::vector<kvhost_cuda_component> cuda_components;  // empty unless attached from CUDA
};

// At least one of the two is set. shared_ptr: LoadEvents is incomplete
// outside the CUDA file, and shared_ptr's deleter is fixed where it is made.
struct kvhost_load_events {
  std::unique_ptr<kvhost::LayerProgress> progress;
  std::shared_ptr<kvhost::LoadEvents> cuda;
};

namespace kvhost::c_api {

// Copies `message` into the caller's error buffer, truncated, always
// NUL-terminated; nothing when `err` is null or `err_len` 0.
void WriteError(absl::string_view message, char* err, size_t err_len);

// The ABI boundary of every call: runs `body` (returning absl::Status),
// turns an exception into INTERNAL (RESOURCE_EXHAUSTED for bad_alloc),
// writes the message (or "") and returns the code.
template <typename Body>
int Run(char* err, size_t err_len, Body&& body) noexcept {
  absl::Status status;
  try {
    status = std::forward<Body>(body)();
  } catch (const std::bad_alloc&) {
    status = absl::ResourceExhaustedError("out of memory in the kvhost C ABI");
  } catch (const std::exception& e) {
    status = absl::InternalError(std::string("unexpected C++ exception: ") + e.what());
  } catch (...) {
    status = absl::InternalError("unexpected C++ exception of unknown type");
  }
  try {
    WriteError(status.message(), err, err_len);
  } catch (...) {
    WriteError("", err, err_len);
  }
  return static_cast<int>(status.code());
}

// INVALID_ARGUMENT "`what` is NULL" for a null pointer.
absl::Status NotNull(const void* p, const char* what);
// A C string argument, required non-null.
absl::StatusOr<std::string> Str(const char* s, const char* what);
// `s` with its NUL into out[0, out_len): OUT_OF_RANGE naming `what` and the
// bytes needed when it does not fit (nothing written); *needed (if not
// null) gets s.size() + 1 either way.
absl::Status WriteString(absl::string_view s, char* out, size_t out_len, size_t* needed,
                         const char* what);
// `bytes` into out[0, out_len), as WriteString but with no terminator.
absl::Status WriteBytes(absl::string_view bytes, void* out, size_t out_len, size_t* size,
                        const char* what);
// Protobuf JSON of `message`: .proto field names, every field printed.
absl::StatusOr<std::string> ToJson(const google::protobuf::Message& message);
// ToJson into the caller's buffer.
absl::Status WriteJson(const google::protobuf::Message& message, char* out, size_t out_len,
                       size_t* needed, const char* what);
// Parses `json` into `message`; INVALID_ARGUMENT naming `what` and the
// parser's reason. Null or "" leaves `message` as it is when `optional`.
absl::Status FromJson(const char* json, google::protobuf::Message* message, const char* what,
                      bool optional = false);
// A millisecond timeout of the ABI: 0 is `fallback`; negative is
// INVALID_ARGUMENT.
absl::StatusOr<absl::Duration> Timeout(int64_t ms, absl::Duration fallback, const char* what);
// The caller's index array; null is fine only for n == 0.
absl::StatusOr<absl::Span<const int64_t>> Indices(const int64_t* p, size_t n, const char* what);
// The client of a handle, or INVALID_ARGUMENT for a null one.
absl::StatusOr<Client*> ClientOf(kvhost_client* client);
// The caller's keys (keys[i] of key_lens[i] bytes) as strings; the arrays
// may be null only for n == 0. The daemon checks their count and lengths.
absl::StatusOr<std::vector<std::string>> Keys(const void* const* keys, const size_t* key_lens,
                                              size_t n);
// The attachment of a handle, or INVALID_ARGUMENT for a null one.
absl::StatusOr<const v1::Attachment*> AttachmentOf(const kvhost_attachment* attachment);
// A worker's event handle bytes (none: empty); `what` names the argument
// when it is NULL with a length.
absl::StatusOr<std::string> EventHandle(const void* handle, size_t len, const char* what);

// Sets on `request` the non-buffer fields of an attach's options_json
// (kvhost_c.h); start_layer / end_layer only where `layer_range`.
absl::Status AttachOptions(const char* options_json, bool layer_range,
                           v1::AttachDeviceRequest* request);
// The end of every kvhost_attach_*: options_json applied to `request`
// (AttachOptions), the AttachDevice call, and the attachment stored in
// `handle`, which goes to `*out`. Nothing is set on failure.
absl::Status Attach(Client& client, v1::AttachDeviceRequest request, const char* options_json,
                    bool layer_range, std::unique_ptr<kvhost_attachment> handle,
                    kvhost_attachment** out);

// CUDA side (c_api_cuda.cc; c_api_no_cuda.cc answers UNIMPLEMENTED):
// the load events of a cuda attachment, and one layer's wait on them.
absl::StatusOr<std::shared_ptr<LoadEvents>> OpenCudaLoadEvents(Client& client,
                                                               const v1::Attachment& attachment);
absl::Status WaitCudaLayer(const LoadEvents& events, const LoadTicket& ticket, uint32_t layer,
                           void* cuda_stream, absl::Duration timeout);

}  // namespace kvhost::c_api

#endif  // KVHOST_CLIENT_C_API_INTERNAL_H_
