// Helpers shared by the tests that drive kvhostd through its API
// (integration_test, cuda_engine_gpu_test): status matchers, pool specs for
// every kind x layout, a pool's geometry for the seeds' address math
// (tests/seed_offsets.h, independent of kernels/kvhost/layout.h), random
// fills and a read-only mapping of a pool's region file, and WithDaemon, a
// fixture that runs a kvhostd per test.
//
// Header only, for test binaries; nothing here is thread-safe unless said.
#ifndef KVHOST_TESTS_API_TEST_UTIL_H_
#define KVHOST_TESTS_API_TEST_UTIL_H_

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "daemon_fixture.h"
#include "gtest/gtest.h"
#include "kvhost/client.h"
#include "seed_offsets.h"

namespace kvhost::testing {

// ---------------------------------------------------------------------------
// Status helpers.

inline absl::Status StatusOf(const absl::Status& s) { return s; }
template <typename T>
absl::Status StatusOf(const absl::StatusOr<T>& s) {
  return s.status();
}

// The code is `code` and the message holds every needle.
inline ::testing::AssertionResult IsError(const absl::Status& s, absl::StatusCode code,
                                          const std::vector<std::string>& needles) {
  if (s.code() != code) {
    return ::testing::AssertionFailure()
           << "code " << absl::StatusCodeToString(s.code()) << ", want "
           << absl::StatusCodeToString(code) << " (message: \"" << s.message() << "\")";
  }
  for (const std::string& needle : needles) {
    if (!absl::StrContains(s.message(), needle)) {
      return ::testing::AssertionFailure()
             << "message \"" << s.message() << "\" does not name \"" << needle << "\"";
    }
  }
  return ::testing::AssertionSuccess();
}

#define EXPECT_ERROR(expr, code, ...) \
  EXPECT_TRUE(IsError(StatusOf(expr), absl::StatusCode::code, {__VA_ARGS__})) << #expr

// ---------------------------------------------------------------------------
// Specs and a pool's geometry in the seeds' terms.

// Element size per dtype (pool.proto's DType comments).
inline uint64_t ElemBytes(v1::DType dtype) {
  switch (dtype) {
    case v1::BF16:
    case v1::FP16:
      return 2;
    case v1::FP32:
      return 4;
    case v1::FP8_E4M3:
    case v1::FP8_E5M2:
    case v1::UINT8:
      return 1;
    default:
      return 0;
  }
}

struct Combo {
  v1::PoolKind kind;
  v1::Layout layout;
};

// Every supported kind x layout.
inline const Combo kCombos[] = {
    {v1::MHA, v1::LAYER_FIRST}, {v1::MHA, v1::PAGE_FIRST},        {v1::MHA, v1::PAGE_FIRST_DIRECT},
    {v1::MHA, v1::PAGE_HEAD},   {v1::MHA, v1::PAGE_UNIFIED},      {v1::MLA, v1::LAYER_FIRST},
    {v1::MLA, v1::PAGE_FIRST},  {v1::MLA, v1::PAGE_FIRST_DIRECT}, {v1::MLA, v1::PAGE_UNIFIED},
};

inline std::string ComboName(const Combo& c) {
  std::string layout = v1::Layout_Name(c.layout);
  layout.erase(std::remove(layout.begin(), layout.end(), '_'), layout.end());
  return absl::StrCat(v1::PoolKind_Name(c.kind), "_", layout);
}

struct Dims {
  uint32_t layers = 3;
  uint32_t heads = 2;        // MHA
  uint32_t head_dim = 8;     // MHA
  uint32_t lora_rank = 12;   // MLA
  uint32_t rope_dim = 4;     // MLA
  uint32_t head_groups = 0;  // MHA PAGE_UNIFIED
};

inline v1::PoolSpec MakeSpec(v1::PoolKind kind, v1::Layout layout, uint32_t page_size,
                             uint64_t size_tokens, v1::DType dtype = v1::BF16,
                             const Dims& dims = {}) {
  v1::PoolSpec spec;
  spec.set_kind(kind);
  spec.set_layout(layout);
  spec.set_dtype(dtype);
  spec.set_page_size(page_size);
  spec.set_layer_num(dims.layers);
  if (kind == v1::MHA) {
    spec.set_head_num(dims.heads);
    spec.set_head_dim(dims.head_dim);
    spec.set_head_groups(dims.head_groups);
  } else {
    spec.set_kv_lora_rank(dims.lora_rank);
    spec.set_qk_rope_head_dim(dims.rope_dim);
  }
  spec.set_size_tokens(size_tokens);
  return spec;
}

// The seeds' name of a layout; every layout the API has is one of theirs.
inline SeedLayout SeedLayoutOf(v1::Layout layout) {
  switch (layout) {
    case v1::LAYER_FIRST:
      return SeedLayout::kLayerFirst;
    case v1::PAGE_FIRST:
      return SeedLayout::kPageFirst;
    case v1::PAGE_FIRST_DIRECT:
      return SeedLayout::kPageFirstDirect;
    case v1::PAGE_HEAD:
      return SeedLayout::kPageHead;
    case v1::PAGE_UNIFIED:
      return SeedLayout::kPageUnified;
    default:
      ADD_FAILURE() << "no layout";
      return SeedLayout::kLayerFirst;
  }
}

struct Geo {
  bool mla = false;
  v1::Layout layout = v1::LAYOUT_UNSPECIFIED;
  uint64_t L = 0, S = 0, ps = 0, H = 0, Db = 0;
  uint64_t G = 1;  // PAGE_UNIFIED's head groups

  uint64_t planes() const { return mla ? 1 : 2; }
  uint64_t row_bytes() const { return H * Db; }
  // V_OFF, the same for every layout of the seeds (PAGE_UNIFIED interleaves
  // K and V instead: Offset places them).
  uint64_t v_off() const { return L * S * H * Db; }
  uint64_t bytes_per_token() const { return planes() * L * H * Db; }
  uint64_t total_bytes() const { return planes() * v_off(); }

  // The pool as one of the seeds' buffers (tests/seed_offsets.h).
  SeedBuffer Seed() const {
    SeedBuffer b;
    b.layout = SeedLayoutOf(layout);
    b.planes = planes();
    b.layers = L;
    b.rows = S;
    b.page_size = ps;
    b.heads = H;
    b.dim = Db;
    b.groups = G;
    return b;
  }
  // SEED_INVENTORY §2: offset of (kv, t, l, h).
  uint64_t Offset(uint64_t kv, uint64_t t, uint64_t l, uint64_t h) const {
    return SeedOffset(Seed(), kv, t, l, h);
  }
};

inline Geo GeoOf(const v1::Pool& pool) {
  const v1::PoolSpec& s = pool.spec();
  const uint64_t b = ElemBytes(s.dtype());
  Geo g;
  g.mla = s.kind() == v1::MLA;
  g.layout = s.layout();
  g.L = s.layer_num();
  g.S = pool.size_tokens();
  g.ps = s.page_size();
  g.H = g.mla ? 1 : s.head_num();
  g.G = s.layout() == v1::PAGE_UNIFIED && s.head_groups() > 1 ? s.head_groups() : 1;
  g.Db =
      g.mla ? (uint64_t{s.kv_lora_rank()} + s.qk_rope_head_dim()) * b : uint64_t{s.head_dim()} * b;
  return g;
}

// Slots of whole pages, each page's slots in order.
inline std::vector<int64_t> PageSlots(const std::vector<uint64_t>& pages, uint64_t ps) {
  std::vector<int64_t> slots;
  for (uint64_t p : pages) {
    for (uint64_t j = 0; j < ps; ++j) slots.push_back(static_cast<int64_t>(p * ps + j));
  }
  return slots;
}

inline std::vector<int64_t> Range(int64_t first, int64_t count) {
  std::vector<int64_t> v(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) v[static_cast<size_t>(i)] = first + i;
  return v;
}

// Random bytes, never zero (a zero host byte means "not written"); eight
// bytes per draw, since the large test fills over a GiB.
inline void FillRandomNonZero(uint8_t* p, uint64_t n, std::mt19937& seed) {
  std::mt19937_64 rng(seed());
  for (uint64_t i = 0; i < n; i += 8) {
    uint64_t v = rng();
    for (uint64_t k = 0; k < 8 && i + k < n; ++k, v >>= 8) {
      const uint8_t byte = static_cast<uint8_t>(v);
      p[i + k] = byte == 0 ? 0x5a : byte;
    }
  }
}

// A file mapped read-only (stays readable after the file is unlinked).
class MappedFile {
 public:
  static std::unique_ptr<MappedFile> Open(const std::string& path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return nullptr;
    struct stat st;
    if (::fstat(fd, &st) != 0 || st.st_size <= 0) {
      ::close(fd);
      return nullptr;
    }
    void* data = ::mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ, MAP_SHARED, fd, 0);
    ::close(fd);
    if (data == MAP_FAILED) return nullptr;
    auto f = std::unique_ptr<MappedFile>(new MappedFile());
    f->data_ = static_cast<const uint8_t*>(data);
    f->size_ = static_cast<uint64_t>(st.st_size);
    return f;
  }
  ~MappedFile() { ::munmap(const_cast<uint8_t*>(data_), size_); }
  const uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }

 private:
  MappedFile() = default;
  const uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
};

// The daemon's pool region files ("kvhost.<pid>.<pool>.<region>") in `dir`.
// Non-contiguous rows from `first`: runs of 2-7 and singletons, with gaps.
inline std::vector<int64_t> SourceRows(std::mt19937& rng, uint64_t n, int64_t first = 0) {
  std::vector<int64_t> rows;
  int64_t pos = first + static_cast<int64_t>(rng() % 3);
  while (rows.size() < n) {
    const uint64_t run = rng() % 3 == 0 ? 1 : 2 + rng() % 6;
    for (uint64_t k = 0; k < run && rows.size() < n; ++k) rows.push_back(pos++);
    pos += 1 + static_cast<int64_t>(rng() % 3);
  }
  return rows;
}

// n rows of [0, limit) not in `avoid`, as runs and singletons in shuffled
// chunk order.
inline std::vector<int64_t> OtherRows(std::mt19937& rng, uint64_t n, uint64_t limit,
                                      const std::set<int64_t>& avoid) {
  std::vector<int64_t> free_rows;
  for (uint64_t r = 0; r < limit; ++r) {
    if (!avoid.count(static_cast<int64_t>(r))) free_rows.push_back(static_cast<int64_t>(r));
  }
  std::shuffle(free_rows.begin(), free_rows.end(), rng);
  free_rows.resize(n);
  std::sort(free_rows.begin(), free_rows.end());
  std::vector<std::vector<int64_t>> chunks;
  for (size_t i = 0; i < free_rows.size();) {
    const size_t len = std::min<size_t>(free_rows.size() - i, 1 + rng() % 6);
    chunks.emplace_back(free_rows.begin() + static_cast<std::ptrdiff_t>(i),
                        free_rows.begin() + static_cast<std::ptrdiff_t>(i + len));
    i += len;
  }
  std::shuffle(chunks.begin(), chunks.end(), rng);
  std::vector<int64_t> out;
  for (const auto& c : chunks) out.insert(out.end(), c.begin(), c.end());
  return out;
}

// A gtest fixture (Base: ::testing::Test or ::testing::TestWithParam<T>)
// with a kvhostd of its own per test (host backend); a failed test prints the
// tail of its log.
template <typename Base>
class WithDaemon : public Base {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<TestDaemon>> d = TestDaemon::Start(KVHOSTD_PATH);
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = *std::move(d);
  }
  void TearDown() override {
    if (daemon_ != nullptr && this->HasFailure()) {
      std::string log = daemon_->Log();
      if (log.size() > 6000) log = "..." + log.substr(log.size() - 6000);
      std::fprintf(stderr, "--- kvhostd log (tail) ---\n%s\n", log.c_str());
    }
  }
  Client& client() { return daemon_->client(); }
  const std::string& shm_dir() const { return daemon_->shm_dir(); }

  std::unique_ptr<TestDaemon> daemon_;
};

}  // namespace kvhost::testing

#endif  // KVHOST_TESTS_API_TEST_UTIL_H_
