#include <cuda_runtime.h>

#include "copy_kernel.h"

namespace kvhost {
namespace {

// 16-byte loads in flight per lane and item before the stores: enough bytes
// on the way to cover PCIe latency with a small grid (8 warps x 32 lanes x
// 4 x 16 B = 16 KiB per block and item).
constexpr int kUnroll = 4;

// Items a group of lanes copies at once in 16-byte vectors on a load (into
// device memory): their reads are all issued before the first store, so
// that with few warps (the worker's copy, a small SM-path grid) one item's
// address lookup and PCIe read overlap another's. On the H200 (docs/PERF.md,
// runs Q and R) that took the worker copy's MLA loads from 24-30 to 31-41
// GB/s and PAGE_HEAD's from 13-14 to 19-21; backups, whose host writes are
// posted, gained nothing and cost a GEMM worker more, so they copy one item
// at a time.
constexpr int kItemsAtOnce = 2;

// `kLanes` lanes (a warp or a part of one) copy the first `items` (<=
// kItems) of `dst` / `src` (n bytes each) in 16-byte vectors; `lane` is the lane's
// index among them.
template <int kLanes, int kItems>
__device__ __forceinline__ void CopyVectors(uint8_t* const (&dst)[kItemsAtOnce],
                                            const uint8_t* const (&src)[kItemsAtOnce], int items,
                                            uint64_t n, unsigned lane) {
  constexpr uint64_t kStride = kLanes * 16;
  for (uint64_t base = lane * 16ull; base < n; base += kStride * kUnroll) {
    uint4 v[kItems][kUnroll];
#pragma unroll
    for (int m = 0; m < kItems; ++m) {
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        const uint64_t o = base + k * kStride;
        if (m < items && o < n) v[m][k] = *reinterpret_cast<const uint4*>(src[m] + o);
      }
    }
#pragma unroll
    for (int m = 0; m < kItems; ++m) {
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        const uint64_t o = base + k * kStride;
        if (m < items && o < n) *reinterpret_cast<uint4*>(dst[m] + o) = v[m][k];
      }
    }
  }
}

// A warp copies an item of `n` bytes a byte per lane (unaligned items).
__device__ __forceinline__ void CopyBytes(uint8_t* dst, const uint8_t* src, uint64_t n,
                                          unsigned lane) {
  for (uint64_t o = lane; o < n; o += 32) dst[o] = src[o];
}

// The last tile of `a` whose first item is <= i (tiles are ordered by
// first_item, and tile 0's is 0).
__device__ __forceinline__ uint32_t TileOf(const CopyKernelArgs& a, uint64_t i) {
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
  return lo;
}

// One item per group of kLanes lanes, 32 / kLanes groups per warp. Each warp
// takes one contiguous span of items, its groups consecutive items within
// it: the warp searches the tiles once, for the span's first item, and then
// steps forward through them. A small grid (the worker's copy, the SM path)
// has few warps to hide latency with, and a tile search per item (a chain of
// dependent loads for each of thousands of single-token tiles) would bound
// its speed, not PCIe.
template <bool kVector, int kLanes, int kItems>
__global__ void CopyKernel(CopyKernelArgs a) {
  static_assert(kItems >= 1 && kItems <= kItemsAtOnce, "items at once");
  constexpr uint64_t kGroupsPerWarp = 32 / kLanes;
  static_assert(32 % kLanes == 0, "a group is a power-of-two part of a warp");
  const uint64_t warps = uint64_t{gridDim.x} * (blockDim.x / 32);
  const uint64_t warp = uint64_t{blockIdx.x} * (blockDim.x / 32) + threadIdx.x / 32;
  // Whole rounds of the warp's groups per span.
  const uint64_t rounds = (a.item_count + warps * kGroupsPerWarp - 1) / (warps * kGroupsPerWarp);
  const uint64_t begin = warp * rounds * kGroupsPerWarp;
  if (begin >= a.item_count) return;
  const uint64_t span_end = begin + rounds * kGroupsPerWarp;
  const uint64_t end = span_end < a.item_count ? span_end : a.item_count;
  const unsigned lane = threadIdx.x % kLanes;
  const uint64_t item_bytes = CopyItemBytes(a.layout);
  uint32_t t = TileOf(a, begin);
  for (uint64_t i = begin + (threadIdx.x % 32) / kLanes; i < end; i += kItems * kGroupsPerWarp) {
    uint8_t* dst[kItemsAtOnce] = {};
    const uint8_t* src[kItemsAtOnce] = {};
    int items = 0;
#pragma unroll
    for (int m = 0; m < kItems; ++m) {
      const uint64_t x = i + m * kGroupsPerWarp;
      if (x >= end) break;
      while (t + 1 < a.tile_count && a.tiles[t + 1].first_item <= x) ++t;
      const CopyTile& s = a.tiles[t];
      const CopyItem item = DecodeCopyItem(a.layout, s, x - s.first_item, a.layer_shift,
                                           a.device_layers_per_plane, a.device_layer_delta);
      uint8_t* device = a.device_layers[item.device_buffer] + item.device_offset;
      uint8_t* other = a.other + item.other_offset;
      dst[m] = a.to_device ? device : other;
      src[m] = a.to_device ? other : device;
      ++items;
    }
    if constexpr (kVector) {
      CopyVectors<kLanes, kItems>(dst, src, items, item_bytes, lane);
    } else {
      CopyBytes(dst[0], src[0], item_bytes, lane);
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
  if (kVector && args.to_device) {
    CopyKernel<kVector, kLanes, kItemsAtOnce><<<grid, block, 0, stream>>>(args);
  } else {
    CopyKernel<kVector, kLanes, 1><<<grid, block, 0, stream>>>(args);
  }
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
