#include <cuda_runtime.h>

#include "copy_kernel.h"

namespace kvhost {
namespace {

// 16-byte loads in flight per lane before the stores: enough bytes on the
// way to cover PCIe latency with a small grid (8 warps x 32 lanes x 4 x 16 B
// = 16 KiB per block).
constexpr int kUnroll = 4;

template <bool kVector>
__device__ __forceinline__ void CopyItemBytesWarp(uint8_t* dst, const uint8_t* src, uint64_t n,
                                                  unsigned lane) {
  if constexpr (kVector) {
    constexpr uint64_t kStride = 32 * 16;
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
    for (uint64_t o = lane; o < n; o += 32) dst[o] = src[o];
  }
}

template <bool kVector>
__global__ void CopyKernel(CopyKernelArgs a) {
  const uint64_t warps_per_block = blockDim.x / 32;
  const uint64_t warps = gridDim.x * warps_per_block;
  const unsigned lane = threadIdx.x % 32;
  const uint64_t item_bytes = CopyItemBytes(a.layout);
  for (uint64_t i = blockIdx.x * warps_per_block + threadIdx.x / 32; i < a.item_count; i += warps) {
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
    uint8_t* other = a.other + (item.host_offset - static_cast<uint64_t>(s.bias));
    if (a.to_device) {
      CopyItemBytesWarp<kVector>(device, other, item_bytes, lane);
    } else {
      CopyItemBytesWarp<kVector>(other, device, item_bytes, lane);
    }
  }
}

}  // namespace

cudaError_t LaunchCopyKernel(const CopyKernelArgs& args, int max_blocks, cudaStream_t stream) {
  if (args.item_count == 0 || args.tile_count == 0) return cudaSuccess;
  const uint64_t needed =
      (args.item_count + kCopyKernelWarpsPerBlock - 1) / kCopyKernelWarpsPerBlock;
  const int blocks =
      static_cast<int>(needed < static_cast<uint64_t>(max_blocks) ? needed : max_blocks);
  const dim3 grid(blocks < 1 ? 1 : blocks);
  const dim3 block(32 * kCopyKernelWarpsPerBlock);
  if (args.aligned16 && CopyItemBytes(args.layout) % 16 == 0) {
    CopyKernel<true><<<grid, block, 0, stream>>>(args);
  } else {
    CopyKernel<false><<<grid, block, 0, stream>>>(args);
  }
  return cudaGetLastError();
}

}  // namespace kvhost
