// Address math of host KV buffers: the one place that knows where a token's
// bytes live.
//
// A `KvLayout` describes a host buffer of token-major KV rows (MHA, MLA) in
// one of the four layouts of the seeds (SEED_INVENTORY.md §2) or sglang's
// page_unified. The buffer has `planes` planes (2 for MHA: K and V; 1 for
// MLA) of `plane_bytes` each; the (plane, token, layer, head) quadruple maps
// to a byte offset by the layout's strides, computed once at construction.
// In the seeds' four layouts the planes are the buffer's two halves (V at
// V_OFF = plane_bytes); PAGE_UNIFIED interleaves them inside every
// (page, head group, layer) block, one `plane_stride` apart, so that a
// page's head group is one contiguous range holding K and V of all layers.
//
// Everything here is plain arithmetic with no dependencies, usable from host
// code (pools, the host transfer engine, the page-metadata RPC, tests) and
// from CUDA kernels (`__host__ __device__`). A KvLayout is a value type; it
// is immutable after construction and safe to share between threads.
#ifndef KVHOST_KERNELS_LAYOUT_H_
#define KVHOST_KERNELS_LAYOUT_H_

#include <stdint.h>

#if defined(__CUDACC__)
#define KVHOST_HD __host__ __device__
#else
#define KVHOST_HD
#endif

namespace kvhost {

// Same numbering as kvhost.v1.Layout.
enum class LayoutKind : uint8_t {
  kLayerFirst = 1,       // (L, S, H, D)
  kPageFirst = 2,        // (S, L, H, D)
  kPageFirstDirect = 3,  // (P, L, ps, H, D)
  kPageHead = 4,         // (P, H, ps, L, D)
  kPageUnified = 5,      // (P, G, L, planes, ps, H / G, D)
};

// Token-major KV rows in one of the five layouts.
struct KvLayout {
  LayoutKind kind = LayoutKind::kLayerFirst;
  uint64_t planes = 0;      // 2 (K, V) or 1 (latent)
  uint64_t layers = 0;      // L
  uint64_t tokens = 0;      // S, a multiple of page_size
  uint64_t page_size = 0;   // ps
  uint64_t heads = 0;       // H (1 for MLA)
  uint64_t head_bytes = 0;  // D * dtype size
  // PAGE_UNIFIED: G, the head groups of a page (a divisor of H; one
  // tensor-parallel partition's heads each); 1 in the other layouts.
  uint64_t head_groups = 1;
  // PAGE_UNIFIED: the planes interleaved in every (page, group, layer) block,
  // the pool's plane count, also in the one-plane layout of one of its
  // components (whose plane 0 is then the pool's plane p, plane_stride * p
  // further on); equal to `planes` in the other layouts.
  uint64_t interleaved_planes = 0;

  // Derived once.
  uint64_t token_bytes = 0;   // one token's row of one layer: H * head_bytes
  uint64_t plane_bytes = 0;   // L * S * token_bytes: the bytes of one plane
  uint64_t page_bytes = 0;    // one page of one layer: ps * token_bytes
  uint64_t group_heads = 0;   // H / G
  uint64_t plane_stride = 0;  // Offset(p + 1, ...) - Offset(p, ...): the seeds'
                              // V_OFF = plane_bytes, PAGE_UNIFIED ps * (H / G) * head_bytes

  KvLayout() = default;
  // REQUIRES: every argument >= 1, tokens % page_size == 0, heads %
  // head_groups_ == 0, head_groups_ == 1 unless k is PAGE_UNIFIED.
  // interleaved_planes_ 0 means planes_ (the whole buffer of a pool).
  KVHOST_HD KvLayout(LayoutKind k, uint64_t planes_, uint64_t layers_, uint64_t tokens_,
                     uint64_t page_size_, uint64_t heads_, uint64_t head_bytes_,
                     uint64_t head_groups_ = 1, uint64_t interleaved_planes_ = 0)
      : kind(k),
        planes(planes_),
        layers(layers_),
        tokens(tokens_),
        page_size(page_size_),
        heads(heads_),
        head_bytes(head_bytes_),
        head_groups(head_groups_),
        interleaved_planes(interleaved_planes_ != 0 ? interleaved_planes_ : planes_),
        token_bytes(heads_ * head_bytes_),
        plane_bytes(layers_ * tokens_ * heads_ * head_bytes_),
        page_bytes(page_size_ * heads_ * head_bytes_),
        group_heads(heads_ / head_groups_),
        plane_stride(k == LayoutKind::kPageUnified
                         ? page_size_ * (heads_ / head_groups_) * head_bytes_
                         : layers_ * tokens_ * heads_ * head_bytes_) {}

  // The bytes of the layout's planes.
  KVHOST_HD uint64_t total_bytes() const { return planes * plane_bytes; }
  // Bytes from byte 0 to the end of the last byte the layout addresses:
  // total_bytes(), except for a PAGE_UNIFIED layout of fewer planes than
  // are interleaved (one component of an MHA pool), whose range also holds
  // the other planes' bytes between its own.
  KVHOST_HD uint64_t extent_bytes() const {
    if (kind != LayoutKind::kPageUnified || planes == interleaved_planes) return total_bytes();
    const uint64_t chunks = page_num() * head_groups * layers * interleaved_planes;
    return (chunks - (interleaved_planes - planes)) * plane_stride;
  }
  KVHOST_HD uint64_t page_num() const { return tokens / page_size; }

  // Byte offset of head `head` of token `token` in layer `layer` of plane
  // `plane`, from the buffer's base.
  // REQUIRES: plane < planes, token < tokens, layer < layers, head < heads.
  KVHOST_HD uint64_t Offset(uint64_t plane, uint64_t token, uint64_t layer, uint64_t head) const {
    // The page and the slot in it only where the layout needs them: two
    // 64-bit divisions are most of this function's cost, and the planners
    // call it per piece (PAGE_UNIFIED adds a third, for the head group).
    uint64_t off = 0;
    switch (kind) {
      case LayoutKind::kLayerFirst:
        off = (layer * tokens + token) * token_bytes + head * head_bytes;
        break;
      case LayoutKind::kPageFirst:
        off = (token * layers + layer) * token_bytes + head * head_bytes;
        break;
      case LayoutKind::kPageFirstDirect: {
        const uint64_t p = token / page_size;
        const uint64_t o = token - p * page_size;
        off = ((p * layers + layer) * page_size + o) * token_bytes + head * head_bytes;
        break;
      }
      case LayoutKind::kPageHead: {
        const uint64_t p = token / page_size;
        const uint64_t o = token - p * page_size;
        off = (((p * heads + head) * page_size + o) * layers + layer) * head_bytes;
        break;
      }
      case LayoutKind::kPageUnified: {
        const uint64_t p = token / page_size;
        const uint64_t o = token - p * page_size;
        const uint64_t g = head / group_heads;
        const uint64_t h = head - g * group_heads;
        // The block of (p, g, layer) holds its planes' chunks back to back.
        const uint64_t block = (p * head_groups + g) * layers + layer;
        off = ((block * interleaved_planes * page_size + o) * group_heads + h) * head_bytes;
        break;
      }
    }
    return plane * plane_stride + off;
  }

  // The contiguous pieces a token's row of one layer (all heads) splits
  // into, each RowPieceBytes() long: 1, except PAGE_HEAD's heads (a head's
  // rows of a page are one block) and PAGE_UNIFIED's head groups.
  KVHOST_HD uint64_t RowPieces() const {
    switch (kind) {
      case LayoutKind::kPageHead:
        return heads;
      case LayoutKind::kPageUnified:
        return head_groups;
      default:
        return 1;
    }
  }
  KVHOST_HD uint64_t RowPieceBytes() const { return token_bytes / RowPieces(); }
  // The first head of row piece `piece` (its bytes are the row's
  // [piece * RowPieceBytes(), + RowPieceBytes()), at Offset(.., PieceHead(piece))).
  KVHOST_HD uint64_t PieceHead(uint64_t piece) const { return piece * (heads / RowPieces()); }
  // True when a token's row of one layer (all heads) is one contiguous range.
  KVHOST_HD bool RowContiguous() const { return RowPieces() == 1; }

  // How many consecutive tokens, starting at `token`, have their rows of one
  // layer back to back, so that rows t..t+n-1 form one contiguous range that
  // matches n consecutive device rows. Always 1 when !RowContiguous(): such a
  // row is split in pieces, and the device row is not. The copy engines use
  // this to turn index runs into as few memory ranges as possible.
  // REQUIRES: token < tokens.
  KVHOST_HD uint64_t ContiguousTokens(uint64_t token) const {
    const uint64_t to_page_end = page_size - token % page_size;
    switch (kind) {
      case LayoutKind::kLayerFirst:
        return tokens - token;
      case LayoutKind::kPageFirst:
        return layers == 1 ? tokens - token : 1;
      case LayoutKind::kPageFirstDirect:
        return layers == 1 ? tokens - token : to_page_end;
      case LayoutKind::kPageHead:
        // (P, H, ps, L, D) with H = 1 and L = 1 is plain token order.
        return heads == 1 && layers == 1 ? tokens - token : 1;
      case LayoutKind::kPageUnified:
        // (P, G, L, planes, ps, H / G, D) with G = 1: a layer's rows of one
        // plane are one chunk per page; with one layer and one plane the
        // pages are back to back.
        if (head_groups > 1) return 1;
        return layers == 1 && interleaved_planes == 1 ? tokens - token : to_page_end;
    }
    return 1;
  }

  // The seeds' get_page_buffer_meta granularity: LAYER_FIRST describes a page
  // per layer (`page_size` rows of that layer), the seeds' page-major
  // layouts describe a page of all layers at once, per plane. PAGE_UNIFIED
  // describes a page per head group, every plane and layer in one range
  // ((L, planes, ps, H / G, D)): its planes are not separate ranges.
  KVHOST_HD bool MetaPerLayer() const { return kind == LayoutKind::kLayerFirst; }
  KVHOST_HD bool MetaPerHeadGroup() const { return kind == LayoutKind::kPageUnified; }
  // Length of one page-metadata range.
  KVHOST_HD uint64_t MetaRangeBytes() const {
    if (MetaPerHeadGroup()) return layers * interleaved_planes * plane_stride;
    return MetaPerLayer() ? page_bytes : page_bytes * layers;
  }
  // Start of the page-metadata range of the page starting at `first_token`:
  // of layer `layer` when MetaPerLayer(), of head group `group` when
  // MetaPerHeadGroup() (whose range starts with plane 0: `plane` ignored).
  // REQUIRES: first_token % page_size == 0, group < head_groups.
  KVHOST_HD uint64_t MetaRangeOffset(uint64_t plane, uint64_t first_token, uint64_t layer,
                                     uint64_t group = 0) const {
    if (MetaPerHeadGroup()) return Offset(0, first_token, 0, group * group_heads);
    return Offset(plane, first_token, MetaPerLayer() ? layer : 0, 0);
  }
};

// A device layer buffer as the engines' device pools hold it: `rows` rows of
// `row_bytes`, row r at r * row_bytes (one per layer and per K / V).
struct DeviceRows {
  uint64_t rows = 0;
  uint64_t row_bytes = 0;
  KVHOST_HD uint64_t Offset(uint64_t row) const { return row * row_bytes; }
  KVHOST_HD uint64_t total_bytes() const { return rows * row_bytes; }
};

}  // namespace kvhost

#endif  // KVHOST_KERNELS_LAYOUT_H_
