// Work descriptors of the CUDA engine's kernel paths (staged and SM
// copy), shared by the planner on the host (server/transfer/copy_plan.h),
// the copy kernel (kernels/copy_kernel.cu) and the tests that run the same
// item decoding on the CPU.
//
// A CopyTile names a block of items: `tokens` consecutive host slots
// starting at `host_token`, paired with as many consecutive device rows
// starting at `device_token`, for host layers [layer0, layer0 + layers) (plus
// the launch's layer shift) of one plane, and heads [head0, head0 + heads).
// A launch addresses one KvLayout whose planes are pool components (a
// LayoutGroup, server/transfer/copy_plan.h: MHA's K and V, or any one
// component); for a page-row component the "tokens" are pages. An item is
// one contiguous piece that a warp copies: a token's whole row of one layer
// (`token_bytes`), or, where the layout splits rows by head (PAGE_HEAD with
// several heads), one head of it (`head_bytes`). Its host offset comes from
// KvLayout::Offset, its device address from the layer buffer and the row, and
// the address of its other side (the staging buffer, or the pool itself
// through mapped memory) is `other + host offset - bias`.
//
// Device layer buffers are a table of `device_layers_per_plane` buffers per
// plane (the attached layers); host layer h of plane p lives in buffer
// p * device_layers_per_plane + h + device_layer_delta, the delta being the
// attachment's first device layer's offset from the pool's (layer sharding;
// 0 when both hold the same layers).
//
// Plain data, no dependencies beyond layout.h; usable from host and device.
#ifndef KVHOST_KERNELS_COPY_TILE_H_
#define KVHOST_KERNELS_COPY_TILE_H_

#include <stdint.h>

#include "kvhost/layout.h"

namespace kvhost {

struct CopyTile {
  uint64_t host_token = 0;
  uint64_t device_token = 0;
  // Items of the launch before this tile's first one (tiles of one
  // launch are ordered by it).
  uint64_t first_item = 0;
  // Host offset minus offset in the other buffer; 0 for the pool itself.
  int64_t bias = 0;
  uint32_t tokens = 0;
  uint32_t layer0 = 0;
  uint32_t layers = 0;
  uint16_t head0 = 0;
  uint16_t heads = 1;  // 1 unless the layout splits rows by head
  uint16_t plane = 0;  // of the launch's layout (a component of its group)
};

// One item's addresses, as offsets.
struct CopyItem {
  uint64_t host_offset;    // from the pool base (KvLayout::Offset)
  uint64_t device_buffer;  // index of the layer buffer (see above)
  uint64_t device_offset;  // from that layer buffer's base
};

// Bytes of every item of `layout`.
KVHOST_HD inline uint64_t CopyItemBytes(const KvLayout& layout) {
  return layout.RowContiguous() ? layout.token_bytes : layout.head_bytes;
}

KVHOST_HD inline uint64_t TileItems(const CopyTile& s) {
  return uint64_t{s.tokens} * s.layers * s.heads;
}

// Item `r` (0 <= r < TileItems(s)) of tile `s`, heads varying fastest,
// then tokens, then layers; `layer_shift` is added to every layer.
// REQUIRES: every host layer + device_layer_delta lies in
// [0, device_layers_per_plane).
KVHOST_HD inline CopyItem DecodeCopyItem(const KvLayout& layout, const CopyTile& s, uint64_t r,
                                         uint32_t layer_shift, uint64_t device_layers_per_plane,
                                         int64_t device_layer_delta) {
  const uint64_t head = s.head0 + r % s.heads;
  r /= s.heads;
  const uint64_t token = r % s.tokens;
  const uint64_t layer = s.layer0 + layer_shift + r / s.tokens;
  CopyItem item;
  item.host_offset = layout.Offset(s.plane, s.host_token + token, layer, head);
  item.device_buffer = s.plane * device_layers_per_plane +
                       static_cast<uint64_t>(static_cast<int64_t>(layer) + device_layer_delta);
  item.device_offset = (s.device_token + token) * layout.token_bytes +
                       (layout.RowContiguous() ? 0 : head * layout.head_bytes);
  return item;
}

}  // namespace kvhost

#endif  // KVHOST_KERNELS_COPY_TILE_H_
