// Address math of host KV buffers: the one place that knows where a token's
// bytes live.
//
// A `KvLayout` describes a host buffer of token-major KV rows (MHA, MLA) in
// one of the four layouts of the seeds (SEED_INVENTORY.md §2). The buffer has
// `planes` equal parts (2 for MHA: K then V; 1 for MLA), each
// `plane_bytes` long; inside a plane, the (token, layer, head) triple maps to
// a byte offset by the layout's strides, computed once at construction.
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
};

// Token-major KV rows in one of the four layouts.
struct KvLayout {
  LayoutKind kind = LayoutKind::kLayerFirst;
  uint64_t planes = 0;      // 2 (K, V) or 1 (latent)
  uint64_t layers = 0;      // L
  uint64_t tokens = 0;      // S, a multiple of page_size
  uint64_t page_size = 0;   // ps
  uint64_t heads = 0;       // H (1 for MLA)
  uint64_t head_bytes = 0;  // D * dtype size

  // Derived once.
  uint64_t token_bytes = 0;  // one token's row of one layer: H * head_bytes
  uint64_t plane_bytes = 0;  // L * S * token_bytes (the seeds' V_OFF)
  uint64_t page_bytes = 0;   // one page of one layer: ps * token_bytes

  KvLayout() = default;
  // REQUIRES: every argument >= 1, tokens % page_size == 0.
  KVHOST_HD KvLayout(LayoutKind k, uint64_t planes_, uint64_t layers_, uint64_t tokens_,
                     uint64_t page_size_, uint64_t heads_, uint64_t head_bytes_)
      : kind(k),
        planes(planes_),
        layers(layers_),
        tokens(tokens_),
        page_size(page_size_),
        heads(heads_),
        head_bytes(head_bytes_),
        token_bytes(heads_ * head_bytes_),
        plane_bytes(layers_ * tokens_ * heads_ * head_bytes_),
        page_bytes(page_size_ * heads_ * head_bytes_) {}

  KVHOST_HD uint64_t total_bytes() const { return planes * plane_bytes; }
  KVHOST_HD uint64_t page_num() const { return tokens / page_size; }

  // Byte offset of head `head` of token `token` in layer `layer` of plane
  // `plane`, from the buffer's base.
  // REQUIRES: plane < planes, token < tokens, layer < layers, head < heads.
  KVHOST_HD uint64_t Offset(uint64_t plane, uint64_t token, uint64_t layer, uint64_t head) const {
    // The page and the slot in it only where the layout needs them: two
    // 64-bit divisions are most of this function's cost, and the planners
    // call it per piece.
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
    }
    return plane * plane_bytes + off;
  }

  // True when a token's row of one layer (all heads) is one contiguous range.
  // Only PAGE_HEAD splits a row by head.
  KVHOST_HD bool RowContiguous() const { return kind != LayoutKind::kPageHead || heads == 1; }

  // How many consecutive tokens, starting at `token`, have their rows of one
  // layer back to back, so that rows t..t+n-1 form one contiguous range that
  // matches n consecutive device rows. Always 1 when !RowContiguous(): a
  // PAGE_HEAD row is split by head, and the device row is not. The copy
  // engines use this to turn index runs into as few memory ranges as possible.
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
    }
    return 1;
  }

  // The seeds' get_page_buffer_meta granularity: LAYER_FIRST describes a page
  // per layer (`page_size` rows of that layer), the page-major layouts
  // describe a page of all layers at once.
  KVHOST_HD bool MetaPerLayer() const { return kind == LayoutKind::kLayerFirst; }
  // Length of one page-metadata range.
  KVHOST_HD uint64_t MetaRangeBytes() const {
    return MetaPerLayer() ? page_bytes : page_bytes * layers;
  }
  // Start of the page-metadata range of the page starting at `first_token`
  // (layer ignored unless MetaPerLayer()).
  // REQUIRES: first_token % page_size == 0.
  KVHOST_HD uint64_t MetaRangeOffset(uint64_t plane, uint64_t first_token, uint64_t layer) const {
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
