#include "server/transfer/cuda/mapping.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/cuda_util.h"
#include "spdlog/spdlog.h"

namespace kvhost {

CudaMapping::~CudaMapping() {
  // The handles were opened in this device's context and close there.
  if (!opened_.empty() || !load_events_.empty()) cudaSetDevice(gpu_);
  // Every load that recorded these has finished (each job holds the
  // mapping). A worker that still has them open keeps its own references:
  // destroying ours does not invalidate its waits.
  for (cudaEvent_t event : load_events_) cudaEventDestroy(event);
  if (layer_table_ != nullptr) cudaFree(layer_table_);
  for (const auto& [handle, allocation] : opened_) {
    if (cudaError_t e = cudaIpcCloseMemHandle(allocation.ptr); e != cudaSuccess) {
      cudaGetLastError();
      spdlog::error("cudaIpcCloseMemHandle on GPU {}: {}", gpu_, CudaError(e));
    }
  }
  for (uint8_t* base : pinned_) pins_->Release(base);
}

absl::Status CudaMapping::CreateLoadEvents(uint32_t sets, uint64_t layers) {
  for (uint64_t i = 0; i < uint64_t{sets} * layers; ++i) {
    cudaEvent_t event = nullptr;
    // Interprocess events must not time; they are only recorded here and
    // waited on by the worker's streams, never synchronised on by a host
    // thread of ours, so blocking sync does not matter.
    if (cudaError_t e =
            cudaEventCreateWithFlags(&event, cudaEventDisableTiming | cudaEventInterprocess);
        e != cudaSuccess) {
      cudaGetLastError();
      return absl::InternalError(absl::StrCat("creating load event ", i, " of ",
                                              uint64_t{sets} * layers, " on GPU ", gpu_, ": ",
                                              CudaError(e)));
    }
    load_events_.push_back(event);
    cudaIpcEventHandle_t handle;
    if (cudaError_t e = cudaIpcGetEventHandle(&handle, event); e != cudaSuccess) {
      cudaGetLastError();
      return absl::InternalError(
          absl::StrCat("cudaIpcGetEventHandle of load event ", i, ": ", CudaError(e)));
    }
    load_event_handles_.emplace_back(reinterpret_cast<const char*>(&handle), sizeof(handle));
  }
  load_event_sets_ = sets;
  set_busy_.assign(sets, false);
  return absl::OkStatus();
}

absl::StatusOr<int> CudaMapping::AcquireSet() const {
  absl::MutexLock lock(&ring_mu_);
  for (uint32_t k = 0; k < load_event_sets_; ++k) {
    const uint32_t set = (next_set_ + k) % load_event_sets_;
    if (set_busy_[set]) continue;
    set_busy_[set] = true;
    next_set_ = (set + 1) % load_event_sets_;
    return static_cast<int>(set);
  }
  return absl::ResourceExhaustedError(absl::StrCat(
      "all ", load_event_sets_,
      " load event sets are in use by loads in flight; wait for a load to finish or attach "
      "with more load_event_sets"));
}

absl::Status CudaMapping::AddLayer(size_t component, const DeviceBufferRef& ref,
                                   const std::string& where) {
  auto it = opened_.find(ref.ipc_handle);
  if (it == opened_.end()) {
    cudaIpcMemHandle_t handle;
    std::memcpy(&handle, ref.ipc_handle.data(), sizeof(handle));
    void* ptr = nullptr;
    if (cudaError_t e = cudaIpcOpenMemHandle(&ptr, handle, cudaIpcMemLazyEnablePeerAccess);
        e != cudaSuccess) {
      cudaGetLastError();
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": cudaIpcOpenMemHandle failed: ", CudaError(e),
          "; the handle must come from cudaIpcGetMemHandle on a live cudaMalloc allocation of "
          "another process"));
    }
    it = opened_.emplace(ref.ipc_handle, Allocation{static_cast<uint8_t*>(ptr), 0}).first;
    absl::StatusOr<PFN_cuMemGetAddressRange_v3020> range = AddressRangeFn();
    if (!range.ok()) return range.status();
    CUdeviceptr base = 0;
    size_t size = 0;
    if (CUresult r = (*range)(&base, &size, reinterpret_cast<CUdeviceptr>(ptr));
        r != CUDA_SUCCESS) {
      return absl::InternalError(absl::StrCat(
          where, ": cuMemGetAddressRange of the opened allocation failed: ", static_cast<int>(r)));
    }
    // The handle names the allocation's base, so ptr == base; the bytes
    // from ptr are what a layer may use either way.
    it->second.bytes = base + size - reinterpret_cast<CUdeviceptr>(ptr);
  }
  const DeviceRows& rows = rows_[component];
  const uint64_t need = rows.total_bytes();
  const uint64_t have = it->second.bytes;
  if (ref.offset > have || have - ref.offset < need) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": offset ", ref.offset, " + ", rows.rows, " rows x ", rows.row_bytes,
                     " bytes exceeds its CUDA allocation (", have, " bytes)"));
  }
  layers_.push_back(it->second.ptr + ref.offset);
  return absl::OkStatus();
}

absl::Status CudaMapping::Pin(const Pool& pool, std::shared_ptr<HostPins> pins) {
  pins_ = std::move(pins);
  for (size_t r = 0; r < pool.region_count(); ++r) {
    const std::string what =
        pool.region_count() == 1 ? pool.name() : absl::StrCat(pool.name(), "' region '", r);
    absl::Status s = pins_->Acquire(pool.region_base(r), pool.region_bytes(r), what);
    if (!s.ok()) return s;
    pinned_.push_back(pool.region_base(r));
  }
  return absl::OkStatus();
}

absl::Status CudaMapping::PrepareKernels(bool host_pointer_ok) {
  const size_t bytes = layers_.size() * sizeof(uint8_t*);
  if (cudaError_t e = cudaMalloc(&layer_table_, bytes); e != cudaSuccess) {
    cudaGetLastError();
    layer_table_ = nullptr;
    return absl::ResourceExhaustedError(
        absl::StrCat("GPU ", gpu_, ": cudaMalloc of the layer table: ", CudaError(e)));
  }
  if (cudaError_t e = cudaMemcpy(layer_table_, layers_.data(), bytes, cudaMemcpyHostToDevice);
      e != cudaSuccess) {
    cudaGetLastError();
    return absl::InternalError(
        absl::StrCat("GPU ", gpu_, ": uploading the layer table: ", CudaError(e)));
  }
  aligned16_ = true;
  for (uint8_t* layer : layers_) aligned16_ &= reinterpret_cast<uintptr_t>(layer) % 16 == 0;
  host_pointer_ok_ = host_pointer_ok;
  return absl::OkStatus();
}
}  // namespace kvhost
