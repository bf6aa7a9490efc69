// The C ABI's CUDA calls in a library built without CUDA: each is
// UNIMPLEMENTED saying so, so a caller on a CPU-only build learns why
// rather than crashing (kvhost_built_with_cuda() says it up front).
#include "absl/strings/str_cat.h"
#include "c_api_internal.h"

struct kvhost_worker_copier {};
struct kvhost_worker_ticket {};

namespace kvhost::c_api {
namespace {

absl::Status NoCuda(const char* call) {
  return absl::UnimplementedError(
      absl::StrCat(call, ": this libkvhost_c was built without CUDA (KVHOST_WITH_CUDA=OFF)"));
}

}  // namespace

absl::StatusOr<std::shared_ptr<LoadEvents>> OpenCudaLoadEvents(Client&, const v1::Attachment&) {
  return NoCuda("kvhost_load_events_open of a cuda attachment");
}

absl::Status WaitCudaLayer(const LoadEvents&, const LoadTicket&, uint32_t, void*, absl::Duration) {
  return NoCuda("kvhost_wait_layer");
}

}  // namespace kvhost::c_api

using kvhost::c_api::NoCuda;
using kvhost::c_api::Run;

extern "C" {

int kvhost_attach_cuda(kvhost_client*, const char*, size_t, const char* const*, uint32_t,
                       void* const*, const uint64_t*, uint64_t, const char*,
                       kvhost_attachment** out, char* err, size_t err_len) {
  if (out != nullptr) *out = nullptr;
  return Run(err, err_len, [] { return NoCuda("kvhost_attach_cuda"); });
}

int kvhost_attach_group_cuda(kvhost_client*, const char*, size_t, const kvhost_cuda_group_entry*,
                             const char*, kvhost_attachment** out, char* err, size_t err_len) {
  if (out != nullptr) *out = nullptr;
  return Run(err, err_len, [] { return NoCuda("kvhost_attach_group_cuda"); });
}

int kvhost_cuda_export_event(void*, void*, size_t, size_t*, char* err, size_t err_len) {
  return Run(err, err_len, [] { return NoCuda("kvhost_cuda_export_event"); });
}

int kvhost_worker_copier_open(kvhost_client*, const kvhost_attachment*, int32_t,
                              kvhost_worker_copier** out, char* err, size_t err_len) {
  if (out != nullptr) *out = nullptr;
  return Run(err, err_len, [] { return NoCuda("kvhost_worker_copier_open"); });
}

void kvhost_worker_copier_destroy(kvhost_worker_copier* copier) { delete copier; }

int kvhost_worker_copy_backup(kvhost_worker_copier*, const int64_t*, size_t, const int64_t*, size_t,
                              void*, kvhost_worker_ticket** out, char* err, size_t err_len) {
  if (out != nullptr) *out = nullptr;
  return Run(err, err_len, [] { return NoCuda("kvhost_worker_copy_backup"); });
}

int kvhost_worker_copy_load(kvhost_worker_copier*, const int64_t*, size_t, const int64_t*, size_t,
                            void*, kvhost_worker_ticket** out, char* err, size_t err_len) {
  if (out != nullptr) *out = nullptr;
  return Run(err, err_len, [] { return NoCuda("kvhost_worker_copy_load"); });
}

int kvhost_worker_ticket_info(const kvhost_worker_ticket*, uint64_t*, uint32_t*, char* err,
                              size_t err_len) {
  return Run(err, err_len, [] { return NoCuda("kvhost_worker_ticket_info"); });
}

int kvhost_worker_copy_wait_layer(const kvhost_worker_copier*, const kvhost_worker_ticket*,
                                  uint32_t, void*, char* err, size_t err_len) {
  return Run(err, err_len, [] { return NoCuda("kvhost_worker_copy_wait_layer"); });
}

int kvhost_worker_copy_wait(const kvhost_worker_copier*, const kvhost_worker_ticket*, int64_t,
                            char* err, size_t err_len) {
  return Run(err, err_len, [] { return NoCuda("kvhost_worker_copy_wait"); });
}

void kvhost_worker_ticket_destroy(kvhost_worker_ticket* ticket) { delete ticket; }

}  // extern "C"
