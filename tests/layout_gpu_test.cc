// The layout math gives the same offsets in a CUDA kernel as on the host, for
// every kind x layout (label gpu). Skips where no GPU is usable; where one is,
// every mismatch fails.
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kvhost/layout.h"
#include "layout_device.h"

namespace kvhost {
namespace {

struct Shape {
  LayoutKind kind;
  uint64_t planes, layers, tokens, page_size, heads, head_bytes;
  uint64_t head_groups = 1;  // PAGE_UNIFIED
};

TEST(LayoutGpuTest, DeviceOffsetsMatchHost) {
  std::string why;
  if (CudaDeviceCount(&why) == 0) GTEST_SKIP() << "no usable CUDA GPU: " << why;
  const std::vector<Shape> shapes = {
      {LayoutKind::kLayerFirst, 2, 3, 12, 4, 2, 256},
      {LayoutKind::kPageFirst, 2, 3, 12, 4, 2, 256},
      {LayoutKind::kPageFirstDirect, 2, 3, 15, 5, 2, 16},
      {LayoutKind::kPageHead, 2, 3, 12, 3, 4, 8},
      {LayoutKind::kLayerFirst, 1, 4, 16, 1, 1, 1152},
      {LayoutKind::kPageFirst, 1, 4, 16, 16, 1, 1152},
      {LayoutKind::kPageFirstDirect, 1, 1, 32, 16, 1, 64},
      {LayoutKind::kPageHead, 2, 1, 8, 4, 1, 2},
      {LayoutKind::kPageUnified, 2, 3, 12, 4, 4, 8},
      {LayoutKind::kPageUnified, 2, 3, 12, 4, 4, 8, 2},
      {LayoutKind::kPageUnified, 2, 3, 15, 5, 3, 16, 3},
      {LayoutKind::kPageUnified, 1, 4, 16, 16, 1, 1152},
      {LayoutKind::kPageUnified, 1, 1, 32, 16, 1, 64},
  };
  for (const Shape& s : shapes) {
    const KvLayout layout(s.kind, s.planes, s.layers, s.tokens, s.page_size, s.heads, s.head_bytes,
                          s.head_groups);
    std::vector<uint64_t> offsets, contiguous;
    std::string error;
    ASSERT_TRUE(DeviceLayoutTable(layout, &offsets, &contiguous, &error)) << error;
    ASSERT_EQ(offsets.size(), s.planes * s.tokens * s.layers * s.heads);
    size_t i = 0;
    for (uint64_t p = 0; p < s.planes; ++p)
      for (uint64_t t = 0; t < s.tokens; ++t)
        for (uint64_t l = 0; l < s.layers; ++l)
          for (uint64_t h = 0; h < s.heads; ++h, ++i)
            ASSERT_EQ(offsets[i], layout.Offset(p, t, l, h))
                << "layout " << static_cast<int>(s.kind) << " plane " << p << " token " << t
                << " layer " << l << " head " << h;
    for (uint64_t t = 0; t < s.tokens; ++t) {
      ASSERT_EQ(contiguous[t], layout.ContiguousTokens(t)) << "token " << t;
    }
  }
}

}  // namespace
}  // namespace kvhost
