// The seeds' byte offsets: the oracle the layout code (kernels/kvhost/layout.h,
// the engines, the page RPCs) is checked against. Written straight from
// SEED_INVENTORY.md §2, the seeds' C-contiguous host buffers, and independent
// of the code under test: nothing here uses KvLayout or LayoutKind, so a bug
// there cannot hide behind the same bug here. sglang's page_unified (not in
// the seeds; sgl-project/sglang PRs 39606 and 39727) is written from its
// dims as those PRs give them: MHA (page, head_group, layer, 2, page_size,
// head_in_group, dim), MLA (page, layer, page_size, dim).
//
// Two forms, so that a wrong formula in one cannot hide a header bug either:
//   - SeedOffset: the "offset of (kv, t, l, h)" column of the §2 tables;
//   - SeedDims / SeedIndex / CContiguousOffset: the "dims" column, a numpy
//     index into it, and that index's offset from the shape's strides.
//
// One SeedBuffer describes every host buffer of §2:
//   - MHA: planes 2 (K, then V at V_OFF), heads H, dim D, itemsize b;
//   - K-only and each buffer of an asymmetric pool: the same with planes 1;
//   - MLA (and any token-row buffer of one "head": DSA's latent and index-K,
//     Mamba states): planes 1, heads 1, dim C (or the row's elements); the
//     seeds have no MLA PAGE_HEAD;
//   - page rows (DSA indexer, V4 paged / state): rows = pages, page_size 1,
//     heads 1, dim the row (G or R);
//   - page_unified: `groups` head groups of heads / groups heads each, the K/V
//     dimension (planes 2) inside the layer instead of leading.
//
// Header only, for test binaries; pure functions, thread-safe.
#ifndef KVHOST_TESTS_SEED_OFFSETS_H_
#define KVHOST_TESTS_SEED_OFFSETS_H_

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

namespace kvhost::testing {

// The seeds' layouts: lf, pf, pfd, ph; and sglang's page_unified (pu).
enum class SeedLayout { kLayerFirst, kPageFirst, kPageFirstDirect, kPageHead, kPageUnified };

// The seeds' layout of `layout`, a value of an enum of the code under test
// whose enumerators carry the seeds' names (kvhost::LayoutKind); a template,
// so that this header needs nothing of that code.
template <typename Layout>
SeedLayout SeedLayoutNamed(Layout layout) {
  switch (layout) {
    case Layout::kLayerFirst:
      return SeedLayout::kLayerFirst;
    case Layout::kPageFirst:
      return SeedLayout::kPageFirst;
    case Layout::kPageFirstDirect:
      return SeedLayout::kPageFirstDirect;
    case Layout::kPageHead:
      return SeedLayout::kPageHead;
    case Layout::kPageUnified:
      return SeedLayout::kPageUnified;
  }
  ADD_FAILURE() << "no seed layout for " << static_cast<int>(layout);
  return SeedLayout::kLayerFirst;
}

struct SeedBuffer {
  SeedLayout layout = SeedLayout::kLayerFirst;
  uint64_t planes = 1;     // 2: the MHA kv_buffer's [0] = K, [1] = V
  uint64_t layers = 0;     // L
  uint64_t rows = 0;       // S (token slots), or pages for page rows
  uint64_t page_size = 1;  // ps, rows per page; P = S / ps
  uint64_t heads = 1;      // H
  uint64_t dim = 0;        // D (C for MLA), in elements
  uint64_t itemsize = 1;   // b; 1 where dim is already in bytes
  uint64_t groups = 1;     // page_unified's head groups G (dividing H)

  uint64_t pages() const { return rows / page_size; }
  uint64_t head_bytes() const { return dim * itemsize; }
  uint64_t token_stride() const { return heads * head_bytes(); }   // TS
  uint64_t layout_dim() const { return token_stride() * layers; }  // LD
  // V_OFF = L·S·H·D·b, the same for every layout (S1:545-551).
  uint64_t v_off() const { return layers * rows * heads * head_bytes(); }
  uint64_t total_bytes() const { return planes * v_off(); }
  uint64_t group_heads() const { return heads / groups; }
};

// The §2 offset of head `h` of row `t` of layer `l` in plane `kv`.
inline uint64_t SeedOffset(const SeedBuffer& s, uint64_t kv, uint64_t t, uint64_t l, uint64_t h) {
  const uint64_t L = s.layers, S = s.rows, ps = s.page_size, H = s.heads;
  const uint64_t D = s.dim, b = s.itemsize;
  const uint64_t p = t / ps, o = t % ps;
  switch (s.layout) {
    case SeedLayout::kLayerFirst:  // (2, L, S, H, D)
      return kv * s.v_off() + ((l * S + t) * H + h) * D * b;
    case SeedLayout::kPageFirst:  // (2, S, L, H, D)
      return kv * s.v_off() + t * s.layout_dim() + l * s.token_stride() + h * D * b;
    case SeedLayout::kPageFirstDirect:  // (2, P, L, ps, H, D)
      return kv * s.v_off() + (((p * L + l) * ps + o) * H + h) * D * b;
    case SeedLayout::kPageHead:  // (2, P, H, ps, L, D)
      return kv * s.v_off() + (((p * H + h) * ps + o) * L + l) * D * b;
    case SeedLayout::kPageUnified: {  // (P, G, L, 2, ps, H / G, D)
      const uint64_t G = s.groups, Hg = s.group_heads(), K = s.planes;
      const uint64_t g = h / Hg, hg = h % Hg;
      return ((((((p * G + g) * L + l) * K + kv) * ps + o) * Hg + hg) * D) * b;
    }
  }
  ADD_FAILURE() << "no seed layout " << static_cast<int>(s.layout);
  return 0;
}

using SeedShape = std::vector<uint64_t>;

// The §2 dims tuple of the buffer (the seeds' `init_kv_buffer` dims), with
// the leading 2 only for two planes.
inline SeedShape SeedDims(const SeedBuffer& s) {
  const uint64_t L = s.layers, S = s.rows, P = s.pages(), ps = s.page_size, H = s.heads;
  const uint64_t D = s.dim;
  SeedShape dims;
  switch (s.layout) {
    case SeedLayout::kLayerFirst:
      dims = {L, S, H, D};
      break;
    case SeedLayout::kPageFirst:
      dims = {S, L, H, D};
      break;
    case SeedLayout::kPageFirstDirect:
      dims = {P, L, ps, H, D};
      break;
    case SeedLayout::kPageHead:
      dims = {P, H, ps, L, D};
      break;
    case SeedLayout::kPageUnified:  // the K/V dimension sits inside the layer
      dims = {P, s.groups, L, s.planes, ps, s.group_heads(), D};
      if (s.planes == 1) dims.erase(dims.begin() + 3);
      return dims;
  }
  if (s.planes == 2) dims.insert(dims.begin(), 2);
  return dims;
}

// The numpy index of element `d` of (kv, t, l, h) in SeedDims.
inline SeedShape SeedIndex(const SeedBuffer& s, uint64_t kv, uint64_t t, uint64_t l, uint64_t h,
                           uint64_t d) {
  const uint64_t p = t / s.page_size, o = t % s.page_size;
  SeedShape index;
  switch (s.layout) {
    case SeedLayout::kLayerFirst:
      index = {l, t, h, d};
      break;
    case SeedLayout::kPageFirst:
      index = {t, l, h, d};
      break;
    case SeedLayout::kPageFirstDirect:
      index = {p, l, o, h, d};
      break;
    case SeedLayout::kPageHead:
      index = {p, h, o, l, d};
      break;
    case SeedLayout::kPageUnified:
      index = {p, h / s.group_heads(), l, kv, o, h % s.group_heads(), d};
      if (s.planes == 1) index.erase(index.begin() + 3);
      return index;
  }
  if (s.planes == 2) index.insert(index.begin(), kv);
  return index;
}

inline uint64_t Product(const SeedShape& dims) {
  uint64_t n = 1;
  for (uint64_t d : dims) n *= d;
  return n;
}

// Element offset of `index` in a C-contiguous array of shape `dims`, from
// its strides (last dimension fastest), as numpy / torch compute it.
inline uint64_t CContiguousOffset(const SeedShape& dims, const SeedShape& index) {
  EXPECT_EQ(dims.size(), index.size());
  SeedShape strides(dims.size(), 1);
  for (size_t i = dims.size(); i-- > 1;) strides[i - 1] = strides[i] * dims[i];
  uint64_t off = 0;
  for (size_t i = 0; i < dims.size() && i < index.size(); ++i) {
    EXPECT_LT(index[i], dims[i]) << "index out of the shape at dim " << i;
    off += index[i] * strides[i];
  }
  return off;
}

}  // namespace kvhost::testing

#endif  // KVHOST_TESTS_SEED_OFFSETS_H_
