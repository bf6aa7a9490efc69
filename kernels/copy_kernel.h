// The copy kernel of the CUDA engine's staged and SM copy paths: items of
// kernels/kvhost/copy_tile.h in 16-byte vectors where every address and the
// item size allow it, each by CopyLanesPerItem lanes (a warp, or for items
// under 512 B a part of one, so that PAGE_HEAD's 256 B heads go two to a
// warp), and a warp per item in bytes otherwise, over a grid of at most
// `max_blocks` blocks (the seeds' block_quota: a small grid leaves the SMs to
// the worker; the staged path's device-to-device gathers use a full grid so
// that they end quickly).
//
// Thread-safe; the launch is asynchronous on `stream`.
#ifndef KVHOST_KERNELS_COPY_KERNEL_H_
#define KVHOST_KERNELS_COPY_KERNEL_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kvhost/copy_tile.h"

namespace kvhost {

struct CopyKernelArgs {
  // The launch's components as the planes of one layout (a LayoutGroup,
  // server/transfer/cuda/copy_plan.h); tiles name host layers of it.
  KvLayout layout;
  // Device memory: layout.planes x device_layers_per_plane layer buffer
  // bases, plane-major; host layer h of plane p is buffer
  // p * device_layers_per_plane + h + device_layer_delta
  // (kernels/kvhost/copy_tile.h).
  uint8_t* const* device_layers = nullptr;
  uint32_t device_layers_per_plane = 0;
  int32_t device_layer_delta = 0;
  // The other side: the group's plane 0 as the device sees it (SM copy path) or a
  // staging buffer (staged path).
  uint8_t* other = nullptr;
  // Device memory: `tile_count` tiles ordered by first_item.
  const CopyTile* tiles = nullptr;
  uint32_t tile_count = 0;
  uint64_t item_count = 0;
  uint32_t layer_shift = 0;
  bool to_device = false;  // other -> device (load) or device -> other (backup)
  // Every layer buffer, `other`, and every item's other offset are 16-byte
  // aligned where the item size is a multiple of 16 (the launcher checks
  // that size).
  bool aligned16 = false;
};

// Warps per block of the copy kernel.
inline constexpr int kCopyKernelWarpsPerBlock = 8;

// Launches the copy of args.item_count items on `stream` with at most
// `max_blocks` blocks (>= 1). Returns the launch error, if any.
cudaError_t LaunchCopyKernel(const CopyKernelArgs& args, int max_blocks, cudaStream_t stream);

}  // namespace kvhost

#endif  // KVHOST_KERNELS_COPY_KERNEL_H_
