// Helpers shared by the transfer path's unit tests (engine_test,
// host_engine_test, transfer_manager_fixtures.h's three): pool shapes of every
// layout, random index pairs and bytes, the naive per-head reference copy,
// byte comparisons, an emulated device pool in one shared-memory file (DeviceFile) and
// EngineFixture, one pool and one device file for single-shape engine and
// manager tests. Pools and device files live in a private directory under
// /dev/shm.
//
// Header only, for test binaries; nothing here is thread-safe.
#ifndef KVHOST_TESTS_TRANSFER_TEST_UTIL_H_
#define KVHOST_TESTS_TRANSFER_TEST_UTIL_H_

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <ostream>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "kvhost/layout.h"
#include "server/pool/pool.h"
#include "server/pool/pool_spec.h"
#include "server/pool/shm_region.h"
#include "server/transfer/engine.h"
#include "server/transfer/host_engine.h"
#include "shm_dir.h"

namespace kvhost::testing {

struct Shape {
  const char* name;
  PoolKind kind;
  LayoutKind layout;
  uint32_t layers;
  uint32_t heads;     // MHA
  uint32_t head_dim;  // MHA: elements; MLA: kv_lora_rank
  uint32_t page_size;
  uint64_t pages;
  uint32_t head_groups = 0;  // MHA PAGE_UNIFIED
};

inline void PrintTo(const Shape& s, std::ostream* os) { *os << s.name; }

inline PoolSpec SpecOf(const Shape& s) {
  PoolSpec spec;
  spec.kind = s.kind;
  spec.layout = s.layout;
  spec.dtype = DType::kBf16;
  spec.page_size = s.page_size;
  spec.layer_num = s.layers;
  if (s.kind == PoolKind::kMha) {
    spec.head_num = s.heads;
    spec.head_dim = s.head_dim;
    spec.head_groups = s.head_groups;
  } else {
    spec.kv_lora_rank = s.head_dim;
    spec.qk_rope_head_dim = 2;
  }
  spec.size_tokens = s.pages * s.page_size;
  return spec;
}

// Every layout of each kind, plus the degenerate shapes where whole runs of
// tokens are contiguous (one layer, one head), and PAGE_UNIFIED in head
// groups (a group per head, and groups of two heads).
inline std::vector<Shape> AllShapes() {
  std::vector<Shape> out;
  const struct {
    LayoutKind l;
    const char* n;
  } layouts[] = {{LayoutKind::kLayerFirst, "LayerFirst"},
                 {LayoutKind::kPageFirst, "PageFirst"},
                 {LayoutKind::kPageFirstDirect, "PageFirstDirect"},
                 {LayoutKind::kPageHead, "PageHead"},
                 {LayoutKind::kPageUnified, "PageUnified"}};
  static std::deque<std::string> names;  // keeps the c_str()s alive
  for (const auto& l : layouts) {
    names.push_back(absl::StrCat("Mha", l.n));
    out.push_back({names.back().c_str(), PoolKind::kMha, l.l, 3, 3, 5, 4, 16});
    names.push_back(absl::StrCat("Mha", l.n, "OneLayerOneHead"));
    out.push_back({names.back().c_str(), PoolKind::kMha, l.l, 1, 1, 4, 8, 8});
    names.push_back(absl::StrCat("Mha", l.n, "OneLayer"));
    out.push_back({names.back().c_str(), PoolKind::kMha, l.l, 1, 4, 2, 5, 10});
    if (l.l == LayoutKind::kPageUnified) {
      names.push_back(absl::StrCat("Mha", l.n, "Groups3"));
      out.push_back({names.back().c_str(), PoolKind::kMha, l.l, 3, 3, 5, 4, 16, 3});
      names.push_back(absl::StrCat("Mha", l.n, "OneLayerGroups2"));
      out.push_back({names.back().c_str(), PoolKind::kMha, l.l, 1, 4, 2, 5, 10, 2});
    }
    if (l.l == LayoutKind::kPageHead) continue;  // MLA has no PAGE_HEAD
    names.push_back(absl::StrCat("Mla", l.n));
    out.push_back({names.back().c_str(), PoolKind::kMla, l.l, 3, 1, 6, 4, 16});
    names.push_back(absl::StrCat("Mla", l.n, "OneLayer"));
    out.push_back({names.back().c_str(), PoolKind::kMla, l.l, 1, 1, 3, 16, 4});
  }
  return out;
}

// A random transfer: `n` distinct host slots in [0, tokens) paired with `n`
// distinct device rows in [0, rows), made of random-length consecutive
// stretches on each side so that runs form, cross pages and break.
inline std::pair<std::vector<int64_t>, std::vector<int64_t>> RandomPairs(std::mt19937_64& rng,
                                                                         uint64_t tokens,
                                                                         uint64_t rows,
                                                                         uint64_t n) {
  auto stretches = [&rng](uint64_t limit) {
    std::vector<std::vector<int64_t>> blocks;
    for (uint64_t t = 0; t < limit;) {
      const uint64_t len = std::min<uint64_t>(limit - t, 1 + rng() % 11);
      std::vector<int64_t> b;
      for (uint64_t k = 0; k < len; ++k) b.push_back(static_cast<int64_t>(t + k));
      blocks.push_back(std::move(b));
      t += len;
    }
    std::shuffle(blocks.begin(), blocks.end(), rng);
    std::vector<int64_t> flat;
    for (auto& b : blocks) flat.insert(flat.end(), b.begin(), b.end());
    return flat;
  };
  std::vector<int64_t> host = stretches(tokens), device = stretches(rows);
  n = std::min<uint64_t>({n, host.size(), device.size()});
  host.resize(n);
  device.resize(n);
  return {host, device};
}

inline std::vector<uint8_t> RandomBytes(std::mt19937_64& rng, uint64_t n) {
  std::vector<uint8_t> v(n);
  for (uint64_t i = 0; i < n; i += 8) {
    const uint64_t word = rng();
    std::memcpy(v.data() + i, &word, std::min<uint64_t>(8, n - i));
  }
  return v;
}

// The reference: one head of one token at a time, addressed by KvLayout::Offset.
// `device(plane, layer)` is that layer's row buffer.
template <typename DeviceFn>
void NaiveCopy(const KvLayout& layout, uint8_t* host, DeviceFn&& device,
               const std::vector<int64_t>& host_idx, const std::vector<int64_t>& dev_idx,
               bool backup) {
  for (uint64_t plane = 0; plane < layout.planes; ++plane) {
    for (uint64_t layer = 0; layer < layout.layers; ++layer) {
      uint8_t* dev = device(plane, layer);
      for (size_t i = 0; i < host_idx.size(); ++i) {
        for (uint64_t h = 0; h < layout.heads; ++h) {
          uint8_t* hp = host + layout.Offset(plane, static_cast<uint64_t>(host_idx[i]), layer, h);
          uint8_t* dp =
              dev + static_cast<uint64_t>(dev_idx[i]) * layout.token_bytes + h * layout.head_bytes;
          if (backup) {
            std::memcpy(hp, dp, layout.head_bytes);
          } else {
            std::memcpy(dp, hp, layout.head_bytes);
          }
        }
      }
    }
  }
}

// First differing byte, for readable failures.
inline ::testing::AssertionResult SameBytes(const uint8_t* got, const uint8_t* want, uint64_t n) {
  if (std::memcmp(got, want, n) == 0) return ::testing::AssertionSuccess();
  for (uint64_t i = 0; i < n; ++i) {
    if (got[i] != want[i]) {
      return ::testing::AssertionFailure()
             << "byte " << i << " of " << n << " is " << int{got[i]} << ", want " << int{want[i]};
    }
  }
  return ::testing::AssertionSuccess();
}

// Every TransferShmDir is /dev/shm/kvhost-transfer-test-XXXXXX.
class TransferShmDir : public ShmDir {
 public:
  TransferShmDir() : ShmDir("kvhost-transfer-test") {}
};

// An emulated device pool like kvhost::ShmDevicePool: per plane and layer,
// `rows` rows of the pool's row size, back to back, in one file.
struct DeviceFile {
  std::unique_ptr<ShmRegion> region;
  uint64_t layers = 0, rows = 0, row_bytes = 0;

  static DeviceFile Create(const std::string& path, const KvLayout& layout, uint64_t rows,
                           uint64_t lead = 0) {
    DeviceFile f;
    f.layers = layout.layers;
    f.rows = rows;
    f.row_bytes = layout.token_bytes;
    absl::StatusOr<std::unique_ptr<ShmRegion>> r =
        ShmRegion::Create(path, lead + layout.planes * layout.layers * rows * layout.token_bytes);
    if (r.ok()) f.region = *std::move(r);
    return f;
  }
  uint64_t LayerOffset(uint64_t plane, uint64_t layer) const {
    return (plane * layers + layer) * rows * row_bytes;
  }
  AttachRequest Request(uint64_t planes, uint64_t lead = 0) const {
    AttachRequest req;
    req.device_size_tokens = rows;
    for (uint64_t l = 0; l < layers; ++l) {
      req.k_layers.push_back(
          {DeviceBufferRef::Kind::kShm, region->path(), "", "", lead + LayerOffset(0, l)});
      if (planes == 2) {
        req.v_layers.push_back(
            {DeviceBufferRef::Kind::kShm, region->path(), "", "", lead + LayerOffset(1, l)});
      }
    }
    return req;
  }
};

// Fixture for single-shape engine and manager tests.
class EngineFixture : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_FALSE(dir_.path().empty());
    spec_ = SpecOf({"m", PoolKind::kMha, LayoutKind::kPageFirst, 2, 2, 8, 4, 16});
    tokens_ = *ResolveSizeTokens(spec_);
    absl::StatusOr<std::shared_ptr<Pool>> pool =
        Pool::Create("p", spec_, tokens_, absl::StrCat(dir_.path(), "/kvhost.", ::getpid(), "."));
    ASSERT_TRUE(pool.ok()) << pool.status();
    pool_ = *pool;
    dev_ = DeviceFile::Create(dir_.path() + "/device", pool_->layout(), kRows);
    ASSERT_NE(dev_.region, nullptr);
  }
  HostEngineOptions Options() const {
    HostEngineOptions o;
    o.shm_dir = dir_.path();
    return o;
  }
  // A device row's bytes of one layer and plane.
  uint8_t* DeviceRow(uint64_t plane, uint64_t layer, uint64_t row) {
    return dev_.region->data() + dev_.LayerOffset(plane, layer) + row * dev_.row_bytes;
  }
  uint8_t* HostRow(uint64_t plane, uint64_t layer, uint64_t slot) {
    return pool_->base() + pool_->layout().Offset(plane, slot, layer, 0);
  }

  static constexpr uint64_t kRows = 40;
  TransferShmDir dir_;
  PoolSpec spec_;
  uint64_t tokens_ = 0;
  std::shared_ptr<Pool> pool_;
  DeviceFile dev_;
};

}  // namespace kvhost::testing

#endif  // KVHOST_TESTS_TRANSFER_TEST_UTIL_H_
