// ShmDevicePool (kvhost/client.h): the host backend's stand-in for a GPU
// worker's device KV pool, in one shared-memory file; and the attach and
// transfer request builders of device pools (MakeGroupAttachRequest,
// MakePoolTransfer).
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/unique_fd.h"
#include "kvhost/client.h"

namespace kvhost {

namespace {

// kvhost.v1.AttachDeviceRequest: kinds whose first components travel in
// k_layers (and v_layers).
int KvComponents(v1::PoolKind kind) {
  switch (kind) {
    case v1::MHA:
    case v1::MHA_ASYMMETRIC:
      return 2;
    case v1::MLA:
    case v1::K_ONLY:
    case v1::DSA:
      return 1;
    default:
      return 0;
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<ShmDevicePool>> ShmDevicePool::Create(const v1::Pool& pool,
                                                                     uint64_t device_size_tokens,
                                                                     const std::string& shm_dir,
                                                                     uint32_t start_layer,
                                                                     uint32_t end_layer) {
  const v1::PoolSpec& spec = pool.spec();
  if (spec.layer_num() == 0 && spec.kind() != v1::LOGICAL) {
    return absl::InvalidArgumentError(
        absl::StrCat("pool '", pool.name(), "' has no layers; pass the Pool the daemon returned"));
  }
  if (device_size_tokens == 0) return absl::InvalidArgumentError("device_size_tokens must be >= 1");
  std::unique_ptr<ShmDevicePool> dev(new ShmDevicePool());
  dev->kind_ = spec.kind();
  dev->device_size_tokens_ = device_size_tokens;
  dev->explicit_range_ = start_layer != 0 || end_layer != 0;
  if (dev->explicit_range_) {
    dev->start_layer_ = start_layer;
    dev->end_layer_ = end_layer;
  } else {
    dev->start_layer_ = spec.start_layer();
    dev->end_layer_ = spec.start_layer() + spec.layer_num();
  }
  if (dev->end_layer_ <= dev->start_layer_ && spec.kind() != v1::LOGICAL) {
    return absl::InvalidArgumentError(
        absl::StrCat("device layers [", dev->start_layer_, ", ", dev->end_layer_, ") are empty"));
  }
  std::vector<Buffer>& buffers = dev->buffers_;
  for (const v1::PoolComponent& c : pool.components()) {
    Buffer b;
    b.name = c.name();
    b.row_bytes = c.row_bytes();
    b.row_tokens = std::max<uint64_t>(1, c.row_tokens());
    if (device_size_tokens % b.row_tokens != 0) {
      return absl::InvalidArgumentError(absl::StrCat("device_size_tokens ", device_size_tokens,
                                                     " is not a multiple of component '", b.name,
                                                     "''s ", b.row_tokens, " slots per row"));
    }
    b.rows = device_size_tokens / b.row_tokens;
    buffers.push_back(std::move(b));
  }
  if (buffers.empty() && (spec.kind() == v1::MHA || spec.kind() == v1::MLA)) {
    // A daemon that does not list its components: K and V, or the latent.
    const uint64_t row_bytes = DeviceRowBytes(spec);
    for (const char* name : {"k", "v"}) {
      if (spec.kind() == v1::MLA && buffers.size() == 1) break;
      buffers.push_back(
          Buffer{spec.kind() == v1::MLA ? "latent" : name, device_size_tokens, row_bytes, 1, 0});
    }
  }
  const uint64_t layers = dev->layers();
  for (Buffer& b : buffers) {
    // Checked: device_size_tokens is the caller's, and a wrapped size would
    // map a small file that layer() then addresses far past its end.
    uint64_t layer_bytes = 0;
    uint64_t bytes = 0;
    if (__builtin_mul_overflow(b.rows, b.row_bytes, &layer_bytes) ||
        __builtin_mul_overflow(layers, layer_bytes, &bytes) ||
        __builtin_add_overflow(dev->bytes_, bytes, &dev->bytes_) ||
        dev->bytes_ > static_cast<uint64_t>(std::numeric_limits<off_t>::max())) {
      return absl::InvalidArgumentError(
          absl::StrCat("device_size_tokens ", device_size_tokens, ": component '", b.name, "''s ",
                       layers, " layers x ", b.rows, " rows x ", b.row_bytes,
                       " bytes (with the components before it) do not fit a file size"));
    }
    b.offset = dev->bytes_ - bytes;
  }
  if (dev->bytes_ == 0) return dev;  // LOGICAL: nothing to hold
  static std::atomic<uint64_t> counter{0};
  dev->path_ = absl::StrCat(shm_dir, "/kvhost-dev.", ::getpid(), ".", counter++, ".", pool.name());
  UniqueFd fd(::open(dev->path_.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
  if (!fd.valid()) {
    const std::string path = std::exchange(dev->path_, "");
    return absl::FailedPreconditionError(
        absl::StrCat("cannot create ", path, ": ", std::strerror(errno)));
  }
  if (int err = ::posix_fallocate(fd.get(), 0, static_cast<off_t>(dev->bytes_)); err != 0) {
    return absl::ResourceExhaustedError(absl::StrCat("cannot reserve ", dev->bytes_, " bytes for ",
                                                     dev->path_, ": ", std::strerror(err)));
  }
  void* data = ::mmap(nullptr, dev->bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
  fd.Reset();  // the mapping keeps the file
  if (data == MAP_FAILED) {
    return absl::ResourceExhaustedError(absl::StrCat("cannot map ", dev->path_));
  }
  dev->data_ = static_cast<uint8_t*>(data);
  return dev;
}

ShmDevicePool::~ShmDevicePool() {
  if (data_ != nullptr) ::munmap(data_, bytes_);
  if (!path_.empty()) ::unlink(path_.c_str());
}

uint8_t* ShmDevicePool::layer(uint32_t c, uint32_t layer) const {
  const Buffer& b = buffers_[c];
  return data_ + b.offset + uint64_t{layer} * b.rows * b.row_bytes;
}

namespace {

// Fills `out` (AttachDeviceRequest or DeviceEntry: the same buffer fields)
// with the layer buffers of `dev`.
template <typename Out>
void FillBuffers(const ShmDevicePool& dev, v1::PoolKind kind, Out* out) {
  const int kv = KvComponents(kind);
  const uint8_t* base = dev.layers() > 0 && dev.components() > 0 ? dev.layer(0, 0) : nullptr;
  for (uint32_t c = 0; c < dev.components(); ++c) {
    google::protobuf::RepeatedPtrField<v1::DeviceBuffer>* buffers;
    if (static_cast<int>(c) < kv) {
      buffers = c == 0 ? out->mutable_k_layers() : out->mutable_v_layers();
    } else {
      v1::DeviceComponent* component = out->add_components();
      component->set_name(dev.component_name(c));
      buffers = component->mutable_layers();
    }
    for (uint32_t l = 0; l < dev.layers(); ++l) {
      v1::SharedMemoryBuffer* shm = buffers->Add()->mutable_shm();
      shm->set_path(dev.path());
      // Component 0's layer 0 is at offset 0 of the file.
      shm->set_offset(static_cast<uint64_t>(dev.layer(c, l) - base));
    }
  }
}

}  // namespace

v1::AttachDeviceRequest ShmDevicePool::MakeAttachRequest(const std::string& pool_name,
                                                         const AttachOptions& options) const {
  v1::AttachDeviceRequest request;
  request.set_pool(pool_name);
  request.set_device_size_tokens(device_size_tokens_);
  if (explicit_range_) {
    request.set_start_layer(start_layer_);
    request.set_end_layer(end_layer_);
  }
  if (options.tp_rank.has_value()) request.set_tp_rank(*options.tp_rank);
  request.set_load_only(options.load_only);
  request.set_layer_progress(options.layer_progress);
  FillBuffers(*this, kind_, &request);
  return request;
}

v1::DeviceEntry ShmDevicePool::MakeDeviceEntry(const std::string& entry) const {
  v1::DeviceEntry out;
  out.set_entry(entry);
  out.set_device_size_tokens(device_size_tokens_);
  if (explicit_range_) {
    out.set_start_layer(start_layer_);
    out.set_end_layer(end_layer_);
  }
  FillBuffers(*this, kind_, &out);
  return out;
}

v1::AttachDeviceRequest MakeGroupAttachRequest(const std::string& group,
                                               absl::Span<const GroupDevice> devices,
                                               const AttachOptions& options) {
  v1::AttachDeviceRequest request;
  request.set_pool(group);
  if (options.tp_rank.has_value()) request.set_tp_rank(*options.tp_rank);
  request.set_load_only(options.load_only);
  request.set_layer_progress(options.layer_progress);
  for (const GroupDevice& d : devices) *request.add_entries() = d.device->MakeDeviceEntry(d.entry);
  return request;
}

v1::PoolTransfer MakePoolTransfer(const std::string& entry, absl::Span<const int64_t> host_indices,
                                  absl::Span<const int64_t> device_indices) {
  v1::PoolTransfer t;
  t.set_name(entry);
  t.mutable_host_indices()->Add(host_indices.begin(), host_indices.end());
  t.mutable_device_indices()->Add(device_indices.begin(), device_indices.end());
  return t;
}

}  // namespace kvhost
