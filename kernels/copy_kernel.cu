#include <cuda_runtime.h>

#include "copy_kernel.h"

namespace kvhost {
namespace {

// 16-byte loads in flight per lane before the stores: enough bytes on the
// way to cover PCIe latency with a small grid (8 warps x 32 lanes x 4 x 16 B
// = 16 KiB per block).
constexpr int kUnroll = 4;

// `kLanes` lanes (a warp or a part of one) copy one item of `n` bytes;
// `lane` is the lane's index among them.
template <bool kVector, int kLanes>
__device__ __forceinline__ void CopyItemBytesGroup(uint8_t* dst, const uint8_t* src, uint64_t n,
                                                   unsigned lane) {
  if constexpr (kVector) {
    constexpr uint64_t kStride = kLanes * 16;
    for (uint64_t base = lane * 16ull; base < n; base += kStride * kUnroll) {
      uint4 v[kUnroll];
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        const uint64_t o = base + k * kStride;
        if (o < n) v[k] = *reinterpret_cast<const uint4*>(src + o);
      }
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        const uint64_t o = base + k * kStride;
        if (o < n) *reinterpret_cast<uint4*>(dst + o) = v[k];
      }
    }
  } else {
    for (uint64_t o = lane; o < n; o += kLanes) dst[o] = src[o];
  }
}

// One item per group of kLanes lanes, 32 / kLanes groups per warp; the
// groups of a warp take consecutive items.
template <bool kVector, int kLanes>
__global__ void CopyKernel(CopyKernelArgs a) {
  constexpr uint64_t kGroupsPerWarp = 32 / kLanes;
  const uint64_t groups = uint64_t{gridDim.x} * (blockDim.x / kLanes);
  const unsigned lane = threadIdx.x % kLanes;
  const uint64_t item_bytes = CopyItemBytes(a.layout);
  static_assert(32 % kLanes == 0, "a group is a power-of-two part of a warp");
  for (uint64_t i =
           uint64_t{blockIdx.x} * (blockDim.x / 32) * kGroupsPerWarp + threadIdx.x / kLanes;
       i < a.item_count; i += groups) {
    // The last tile whose first item is <= i.
    uint32_t lo = 0;
    uint32_t hi = a.tile_count;
    while (hi - lo > 1) {
      const uint32_t mid = (lo + hi) / 2;
      if (a.tiles[mid].first_item <= i) {
        lo = mid;
      } else {
        hi = mid;
      }
    }
    const CopyTile& s = a.tiles[lo];
    const CopyItem item = DecodeCopyItem(a.layout, s, i - s.first_item, a.layer_shift,
                                         a.device_layers_per_plane, a.device_layer_delta);
    uint8_t* device = a.device_layers[item.device_buffer] + item.device_offset;
    uint8_t* other = a.other + item.other_offset;
    if (a.to_device) {
      CopyItemBytesGroup<kVector, kLanes>(device, other, item_bytes, lane);
    } else {
      CopyItemBytesGroup<kVector, kLanes>(other, device, item_bytes, lane);
    }
  }
}

template <bool kVector, int kLanes>
cudaError_t Launch(const CopyKernelArgs& args, int max_blocks, cudaStream_t stream) {
  const uint64_t per_block = uint64_t{kCopyKernelWarpsPerBlock} * (32 / kLanes);
  const uint64_t needed = (args.item_count + per_block - 1) / per_block;
  const int blocks =
      static_cast<int>(needed < static_cast<uint64_t>(max_blocks) ? needed : max_blocks);
  const dim3 grid(blocks < 1 ? 1 : blocks);
  const dim3 block(32 * kCopyKernelWarpsPerBlock);
  CopyKernel<kVector, kLanes><<<grid, block, 0, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchCopyKernel(const CopyKernelArgs& args, int max_blocks, cudaStream_t stream) {
  if (args.item_count == 0 || args.tile_count == 0) return cudaSuccess;
  const uint64_t item_bytes = CopyItemBytes(args.layout);
  if (!args.aligned16 || item_bytes % 16 != 0) return Launch<false, 32>(args, max_blocks, stream);
  switch (CopyLanesPerItem(item_bytes)) {
    case 1:
      return Launch<true, 1>(args, max_blocks, stream);
    case 2:
      return Launch<true, 2>(args, max_blocks, stream);
    case 4:
      return Launch<true, 4>(args, max_blocks, stream);
    case 8:
      return Launch<true, 8>(args, max_blocks, stream);
    case 16:
      return Launch<true, 16>(args, max_blocks, stream);
    default:
      return Launch<true, 32>(args, max_blocks, stream);
  }
}

}  // namespace kvhost
