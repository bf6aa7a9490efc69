// Helpers of the GPU tests that play the worker against a kvhostd on the
// cuda backend (cuda_engine_gpu_test, worker_death_gpu_test): ASSERT_CUDA,
// how a test's kvhostd is told its transfer path (TransferPath,
// CudaDaemonFlags), and the worker's device KV buffers with the image of
// what they should hold (GpuBuffers, GpuKvPool).
//
// Header only, for test binaries built with the CUDA runtime; nothing here
// is thread-safe. A GpuBuffers owns its cudaMalloc allocations and frees
// them when it goes.
#ifndef KVHOST_TESTS_CUDA_TEST_UTIL_H_
#define KVHOST_TESTS_CUDA_TEST_UTIL_H_

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <iterator>
#include <ostream>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/str_cat.h"
#include "api_test_util.h"
#include "gtest/gtest.h"

#define ASSERT_CUDA(expr)                                                       \
  do {                                                                          \
    const cudaError_t e_ = (expr);                                              \
    ASSERT_EQ(e_, cudaSuccess) << #expr << ": " << cudaGetErrorName(e_) << " (" \
                               << cudaGetErrorString(e_) << ")";                \
  } while (0)

namespace kvhost::testing {

// ---------------------------------------------------------------------------
// Transfer paths.

// The GPU tests move larger rows than the integration tests' default Dims.
inline Dims GpuDims() {
  Dims d;
  d.layers = 3;
  d.heads = 4;
  d.head_dim = 64;
  d.lora_rank = 64;
  d.rope_dim = 16;
  return d;
}

// How kvhostd is told to choose its transfer path, and what its tickets must
// then report.
struct TransferPath {
  const char* flag;    // --transfer-path=<flag>; nullptr: the flag is left out
  const char* ticket;  // TransferStatus.path; nullptr: any of kCudaPathNames
  // Attachments with layer progress: loads return before they are queued,
  // the worker waits on the layer counters before each event.
  bool progress = false;
};

inline constexpr const char* kCudaPathNames[] = {"cuda-ce", "cuda-staged", "cuda-sm"};
// Device staging per stream for the staged path: two 512 KiB halves. Far
// below the default so that the tests' transfers fill it several times and
// the double buffering, with chunk edges inside pages and rows, runs.
inline constexpr uint64_t kStagingBytes = uint64_t{1} << 20;

inline bool IsCudaPathName(const std::string& name) {
  return std::find(std::begin(kCudaPathNames), std::end(kCudaPathNames), name) !=
         std::end(kCudaPathNames);
}

// kvhostd's flags for `path`, besides TestDaemon's own (which pass
// --backend=host first; the later flag wins).
inline std::vector<std::string> CudaDaemonFlags(const TransferPath& path) {
  std::vector<std::string> flags = {"--backend=cuda"};
  if (path.flag == nullptr) return flags;
  flags.push_back(absl::StrCat("--transfer-path=", path.flag));
  if (std::string_view(path.flag) == "staged") {
    flags.push_back(absl::StrCat("--staging-bytes=", kStagingBytes >> 20, "M"));
  }
  return flags;
}

inline std::string PathLabel(const TransferPath& path) {
  return absl::StrCat(path.flag != nullptr ? path.flag : "default",
                      path.progress ? "_progress" : "");
}

// gtest prints parameters with this in its messages.
inline void PrintTo(const TransferPath& path, std::ostream* os) { *os << PathLabel(path); }

// ---------------------------------------------------------------------------
// The worker's device pool.

// The worker's buffers: `buffers[b]` rows of row_bytes each, spread over two
// cudaMalloc allocations: the first (buffers + 1) / 2 in allocation 0, the
// rest in allocation 1. Buffers start after a lead-in and have gaps between
// them, so IPC offsets are not zero and stray writes show. `image` holds what
// each allocation should contain.
class GpuBuffers {
 public:
  static constexpr uint64_t kLead = 4096;
  static constexpr uint64_t kGap = 768;

  struct Shape {
    uint64_t rows;
    uint64_t row_bytes;
  };
  explicit GpuBuffers(std::vector<Shape> shapes)
      : GpuBuffers(
            std::move(shapes), [](size_t b) { return absl::StrCat("buffer ", b); },
            "outside every buffer") {}
  // `name(b)` names buffer b in failure messages, `outside` a byte in none.
  GpuBuffers(std::vector<Shape> shapes, std::function<std::string(size_t)> name,
             std::string outside)
      : shapes_(std::move(shapes)), name_(std::move(name)), outside_(std::move(outside)) {
    const size_t split = (shapes_.size() + 1) / 2;
    for (size_t b = 0; b < shapes_.size(); ++b) {
      const int a = b < split ? 0 : 1;
      alloc_of_.push_back(a);
      offsets_.push_back(bytes_[a] == 0 ? kLead : bytes_[a]);
      bytes_[a] = offsets_.back() + shapes_[b].rows * shapes_[b].row_bytes + kGap;
    }
  }
  ~GpuBuffers() {
    for (uint8_t* p : alloc_) {
      if (p != nullptr) cudaFree(p);
    }
  }

  // Allocates, fills with random non-zero bytes and uploads.
  void Init(std::mt19937& rng) {
    for (int a = 0; a < 2; ++a) {
      if (bytes_[a] == 0) continue;
      ASSERT_CUDA(cudaMalloc(reinterpret_cast<void**>(&alloc_[a]), bytes_[a]));
      image[a].resize(bytes_[a]);
      FillRandomNonZero(image[a].data(), bytes_[a], rng);
    }
    Upload();
  }
  void Upload() {
    for (int a = 0; a < 2; ++a) {
      if (bytes_[a] != 0) {
        ASSERT_CUDA(cudaMemcpy(alloc_[a], image[a].data(), bytes_[a], cudaMemcpyHostToDevice));
      }
    }
  }
  // Compares the device with `image`, naming up to five bad rows or gaps per
  // allocation.
  void ExpectMatchesImage(const std::string& when) {
    for (int a = 0; a < 2; ++a) {
      if (bytes_[a] == 0) continue;
      std::vector<uint8_t> got(bytes_[a]);
      ASSERT_CUDA(cudaMemcpy(got.data(), alloc_[a], bytes_[a], cudaMemcpyDeviceToHost));
      if (std::memcmp(got.data(), image[a].data(), bytes_[a]) == 0) continue;
      int bad = 0;
      for (uint64_t i = 0; i < bytes_[a] && bad < 5; ++i) {
        if (got[i] == image[a][i]) continue;
        ++bad;
        ADD_FAILURE() << when << ": device allocation " << a << " byte " << i << " is "
                      << int{got[i]} << ", want " << int{image[a][i]} << " (" << Where(a, i) << ")";
        i = NextRegion(a, i);  // one report per row or gap
      }
      if (bad == 0) ADD_FAILURE() << when << ": device allocation " << a << " differs";
    }
  }

  void* buffer(size_t b) const { return alloc_[alloc_of_[b]] + offsets_[b]; }
  // The expected bytes of a row.
  uint8_t* image_row(size_t b, uint64_t row) {
    return image[alloc_of_[b]].data() + offsets_[b] + row * shapes_[b].row_bytes;
  }
  const Shape& shape(size_t b) const { return shapes_[b]; }
  uint64_t allocation_bytes(int a) const { return bytes_[a]; }

  std::vector<uint8_t> image[2];

 private:
  // The buffer holding byte i of allocation a, or -1.
  int BufferAt(int a, uint64_t i) const {
    for (size_t b = 0; b < shapes_.size(); ++b) {
      if (alloc_of_[b] == a && i >= offsets_[b] &&
          i < offsets_[b] + shapes_[b].rows * shapes_[b].row_bytes) {
        return static_cast<int>(b);
      }
    }
    return -1;
  }
  std::string Where(int a, uint64_t i) const {
    const int b = BufferAt(a, i);
    if (b < 0) return outside_;
    return absl::StrCat(name_(b), " row ", (i - offsets_[b]) / shapes_[b].row_bytes);
  }
  // The last byte of the row holding byte i of allocation a; i in a gap.
  uint64_t NextRegion(int a, uint64_t i) const {
    const int b = BufferAt(a, i);
    if (b < 0) return i;
    const uint64_t rb = shapes_[b].row_bytes;
    return offsets_[b] + ((i - offsets_[b]) / rb + 1) * rb - 1;
  }

  std::vector<Shape> shapes_;
  std::function<std::string(size_t)> name_;
  std::string outside_;
  std::vector<int> alloc_of_;
  std::vector<uint64_t> offsets_;
  uint64_t bytes_[2] = {0, 0};
  uint8_t* alloc_[2] = {nullptr, nullptr};
};

// Per plane and layer, `rows` rows of `row_bytes` in GPU memory: GpuBuffers
// with buffer plane x layers + layer for each, named by plane and layer.
class GpuKvPool : public GpuBuffers {
 public:
  GpuKvPool(uint32_t planes, uint32_t layers, uint64_t rows, uint64_t row_bytes)
      : GpuBuffers(
            std::vector<Shape>(planes * layers, Shape{rows, row_bytes}),
            [layers](size_t b) {
              return absl::StrCat("plane ", b / layers, " layer ", b % layers);
            },
            "outside every layer buffer"),
        planes_(planes),
        layers_(layers),
        rows_(rows),
        row_bytes_(row_bytes) {}

  uint8_t* layer(uint32_t plane, uint32_t layer) const {
    return static_cast<uint8_t*>(buffer(plane * layers_ + layer));
  }
  // The expected bytes of a row.
  uint8_t* image_row(uint32_t plane, uint32_t layer, uint64_t row) {
    return GpuBuffers::image_row(plane * layers_ + layer, row);
  }
  std::vector<void*> layers(uint32_t plane) const {
    std::vector<void*> out;
    if (plane >= planes_) return out;
    for (uint32_t l = 0; l < layers_; ++l) out.push_back(layer(plane, l));
    return out;
  }
  uint64_t rows() const { return rows_; }
  uint64_t row_bytes() const { return row_bytes_; }

 private:
  uint32_t planes_, layers_;
  uint64_t rows_, row_bytes_;
};

}  // namespace kvhost::testing

#endif  // KVHOST_TESTS_CUDA_TEST_UTIL_H_
