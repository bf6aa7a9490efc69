// Work descriptors of the CUDA engine's kernel paths (staged and SM
// copy), shared by the planner on the host (server/transfer/cuda/copy_plan.h),
// the copy kernel (kernels/copy_kernel.cu) and the tests that run the same
// item decoding on the CPU.
//
// A CopyTile names a block of items: `tokens` consecutive host slots
// starting at `host_token`, paired with as many consecutive device rows
// starting at `device_token`, for host layers [layer0, layer0 + layers) (plus
// the launch's layer shift) of one plane, and row pieces [piece0, piece0 +
// pieces) (KvLayout::RowPieces: a PAGE_HEAD row's heads, a PAGE_UNIFIED
// row's head groups; one piece, the whole row, in the other layouts).
// A launch addresses one KvLayout whose planes are pool components (a
// LayoutGroup, server/transfer/cuda/copy_plan.h: MHA's K and V, or any one
// component); for a page-row component the "tokens" are pages. An item is
// one contiguous piece that a warp (or, for items under a warp's 512 bytes
// per step, a group of lanes) copies: a token's whole row of one layer
// (`token_bytes`), or, where the layout splits rows (PAGE_HEAD with several
// heads, PAGE_UNIFIED with several head groups), one piece of it
// (KvLayout::RowPieceBytes).
//
// Addresses, one formula for host and device (DecodeCopyItem): an item's
// host offset is KvLayout::Offset; its device address is the layer buffer
// and the row; its offset in the other side (the staging buffer, or the pool
// itself through mapped memory) is
//   Offset(plane, token, first layer, piece's head) - bias + k * other_layer_stride
// for the tile's k-th layer (first layer = layer0 + layer shift). So the
// tile's first layer lies in the other buffer as in the pool (shifted by
// `bias`), and every further layer `other_layer_stride` bytes on. With the
// pool's own layer stride (LayerStride) the whole tile lies as in the pool:
// the SM copy path and the staged blocks that mirror the pool. A smaller
// stride packs the layers: the staged LAYER_FIRST chunks, whose layer k of a
// plane holds the chunk's tokens back to back (copy_plan.h).
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
  // Host offset minus offset in the other buffer, at the tile's first
  // layer; 0 for the pool itself.
  int64_t bias = 0;
  // Bytes between consecutive layers of the tile in the other buffer: the
  // pool's LayerStride where the other side lies as the pool, smaller where
  // a staged chunk packs the layers.
  uint64_t other_layer_stride = 0;
  uint32_t tokens = 0;
  uint32_t layer0 = 0;
  uint32_t layers = 0;
  uint16_t piece0 = 0;
  uint16_t pieces = 1;  // 1 unless the layout splits rows (KvLayout::RowPieces)
  uint16_t plane = 0;   // of the launch's layout (a component of its group)
};

// One item's addresses, as offsets.
struct CopyItem {
  uint64_t host_offset;    // from the pool base (KvLayout::Offset)
  uint64_t other_offset;   // from the other buffer's base
  uint64_t device_buffer;  // index of the layer buffer (see above)
  uint64_t device_offset;  // from that layer buffer's base
};

// Bytes of every item of `layout`.
KVHOST_HD inline uint64_t CopyItemBytes(const KvLayout& layout) { return layout.RowPieceBytes(); }

// Bytes between layers l and l + 1 of one (plane, token, head) in the pool:
// KvLayout::Offset is linear in the layer for every layout (0 for one layer).
KVHOST_HD inline uint64_t LayerStride(const KvLayout& layout) {
  return layout.layers > 1 ? layout.Offset(0, 0, 1, 0) - layout.Offset(0, 0, 0, 0) : 0;
}

// Lanes that copy one item of `item_bytes` (a multiple of 16) in 16-byte
// vectors: the fewest, a power of two up to a warp's 32, whose one step
// (16 B each) covers the item, so that an item under a warp's 512 B per step
// (PAGE_HEAD's heads of 256 B) leaves no lane idle and a warp copies
// 32 / lanes items at once. Unaligned items take the byte copy, a warp each.
KVHOST_HD inline uint32_t CopyLanesPerItem(uint64_t item_bytes) {
  uint32_t lanes = 1;
  while (lanes < 32 && uint64_t{16} * lanes < item_bytes) lanes *= 2;
  return lanes;
}

KVHOST_HD inline uint64_t TileItems(const CopyTile& s) {
  return uint64_t{s.tokens} * s.layers * s.pieces;
}

// Item `r` (0 <= r < TileItems(s)) of tile `s`, row pieces varying fastest,
// then tokens, then layers; `layer_shift` is added to every layer.
// REQUIRES: every host layer + device_layer_delta lies in
// [0, device_layers_per_plane).
KVHOST_HD inline CopyItem DecodeCopyItem(const KvLayout& layout, const CopyTile& s, uint64_t r,
                                         uint32_t layer_shift, uint64_t device_layers_per_plane,
                                         int64_t device_layer_delta) {
  const uint64_t piece = s.piece0 + r % s.pieces;
  const uint64_t head = layout.PieceHead(piece);
  r /= s.pieces;
  const uint64_t token = r % s.tokens;
  const uint64_t k = r / s.tokens;  // the tile's k-th layer
  const uint64_t first = s.layer0 + layer_shift;
  const uint64_t layer = first + k;
  CopyItem item;
  // The kernel uses only other_offset: the compiler drops host_offset there.
  item.host_offset = layout.Offset(s.plane, s.host_token + token, layer, head);
  item.other_offset = layout.Offset(s.plane, s.host_token + token, first, head) -
                      static_cast<uint64_t>(s.bias) + k * s.other_layer_stride;
  item.device_buffer = s.plane * device_layers_per_plane +
                       static_cast<uint64_t>(static_cast<int64_t>(layer) + device_layer_delta);
  item.device_offset =
      (s.device_token + token) * layout.token_bytes + piece * CopyItemBytes(layout);
  return item;
}

}  // namespace kvhost

#endif  // KVHOST_KERNELS_COPY_TILE_H_
