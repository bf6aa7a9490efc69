#include "server/transfer/cuda/mapping.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/cuda_util.h"
#include "common/cuda_vmm.h"
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
  if (!imported_.empty()) {
    absl::StatusOr<const VmmApi*> vmm = Vmm();  // resolved already: imports used it
    for (const ImportedRange& range : imported_) {
      for (const auto& [address, bytes] : range.mapped) {
        if (CUresult r = (*vmm)->unmap(address, bytes); r != CUDA_SUCCESS) {
          spdlog::error("cuMemUnmap of an imported chunk on GPU {}: {}", gpu_, (*vmm)->Error(r));
        }
      }
      if (CUresult r = (*vmm)->address_free(range.base, range.bytes); r != CUDA_SUCCESS) {
        spdlog::error("cuMemAddressFree on GPU {}: {}", gpu_, (*vmm)->Error(r));
      }
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
      " load event sets are in use by transfers in flight; wait for one to finish or attach "
      "with more load_event_sets"));
}

absl::StatusOr<CudaMapping::Allocation> CudaMapping::Import(const DeviceBufferRef& ref,
                                                            const std::string& where) {
  std::string key;
  uint64_t total = 0;  // bounded by kMaxFdBufferBytes (service/convert.cc)
  for (const FdChunk& chunk : ref.chunks) {
    absl::StrAppend(&key, "|", chunk.deposit_id, "/", chunk.index, "/", chunk.bytes);
    total += chunk.bytes;
  }
  if (auto it = imported_by_chunks_.find(key); it != imported_by_chunks_.end()) {
    return it->second;
  }
  absl::StatusOr<const VmmApi*> vmm = Vmm();
  if (!vmm.ok()) return vmm.status();
  const VmmApi& api = **vmm;
  CUdeviceptr base = 0;
  if (CUresult r = api.address_reserve(&base, total, 0, 0, 0); r != CUDA_SUCCESS) {
    return absl::ResourceExhaustedError(absl::StrCat(where, ": cuMemAddressReserve of ", total,
                                                     " bytes on GPU ", gpu_, ": ", api.Error(r)));
  }
  // From here the destructor unmaps and frees what was made.
  imported_.push_back({base, total, {}});
  ImportedRange& range = imported_.back();
  uint64_t offset = 0;
  for (size_t c = 0; c < ref.chunks.size(); ++c) {
    const FdChunk& chunk = ref.chunks[c];
    const std::string what = absl::StrCat(where, ".chunks[", c, "]");
    if (chunk.fd < 0) {
      return absl::InternalError(absl::StrCat(what, ": its descriptor was not lent"));
    }
    CUmemGenericAllocationHandle handle = 0;
    if (CUresult r = api.import_from_shareable_handle(
            &handle, reinterpret_cast<void*>(static_cast<uintptr_t>(chunk.fd)),
            CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
        r != CUDA_SUCCESS) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": cuMemImportFromShareableHandle: ", api.Error(r),
                       "; the descriptor must come from cuMemExportToShareableHandle "
                       "(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) of a live allocation"));
    }
    // The mapping holds the allocation from here; our handle goes either way.
    const CUresult mapped = api.map(base + offset, chunk.bytes, 0, handle, 0);
    api.release(handle);
    if (mapped != CUDA_SUCCESS) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": cuMemMap of ", chunk.bytes, " bytes at offset ", offset, ": ",
                       api.Error(mapped), "; bytes must be the allocation's whole size"));
    }
    range.mapped.emplace_back(base + offset, chunk.bytes);
    offset += chunk.bytes;
  }
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = gpu_;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  if (CUresult r = api.set_access(base, total, &access, 1); r != CUDA_SUCCESS) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": cuMemSetAccess for GPU ", gpu_, " on ", ref.chunks.size(), " imported chunks of ",
        total, " bytes: ", api.Error(r), "; is the memory on the GPU ", ref.gpu_uuid, "?"));
  }
  Allocation allocation{reinterpret_cast<uint8_t*>(base), total};
  imported_by_chunks_.emplace(std::move(key), allocation);
  return allocation;
}

absl::Status CudaMapping::AddLayer(size_t component, const DeviceBufferRef& ref,
                                   const std::string& where) {
  if (ref.kind == DeviceBufferRef::Kind::kCudaFd) {
    absl::StatusOr<Allocation> imported = Import(ref, where);
    if (!imported.ok()) return imported.status();
    return AddBuffer(component, *imported, ref.offset, where);
  }
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
  return AddBuffer(component, it->second, ref.offset, where);
}

absl::Status CudaMapping::AddBuffer(size_t component, const Allocation& allocation, uint64_t offset,
                                    const std::string& where) {
  const DeviceRows& rows = rows_[component];
  const uint64_t need = rows.total_bytes();
  const uint64_t have = allocation.bytes;
  if (offset > have || have - offset < need) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": offset ", offset, " + ", rows.rows, " rows x ", rows.row_bytes,
                     " bytes exceeds its CUDA allocation (", have, " bytes)"));
  }
  layers_.push_back(allocation.ptr + offset);
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
