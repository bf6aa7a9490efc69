// Helpers shared by the pool domain's unit tests (pool_spec_test, pool_test,
// registry_test, pool_group_test): specs of every kind, a private directory
// under /dev/shm, host memory figures a test controls (FakeMemory, fed to the
// registry through RegistryOptions::read_memory / read_fs_free) and the
// registry fixtures built on them.
//
// Header only, for test binaries; nothing here is thread-safe.
#ifndef KVHOST_TESTS_POOL_TEST_UTIL_H_
#define KVHOST_TESTS_POOL_TEST_UTIL_H_

#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "server/pool/host_memory.h"
#include "server/pool/pool.h"
#include "server/pool/pool_spec.h"
#include "server/pool/registry.h"
#include "shm_dir.h"

namespace kvhost::testing {

inline PoolSpec MhaSpec() {
  PoolSpec s;
  s.kind = PoolKind::kMha;
  s.layout = LayoutKind::kLayerFirst;
  s.dtype = DType::kBf16;
  s.page_size = 16;
  s.layer_num = 4;
  s.head_num = 8;
  s.head_dim = 128;
  s.size_tokens = 1024;
  return s;
}

// Every PoolShmDir is /dev/shm/kvhost-pool-test-XXXXXX.
class PoolShmDir : public ShmDir {
 public:
  PoolShmDir() : ShmDir("kvhost-pool-test") {}
};

// Memory figures a test controls.
struct FakeMemory {
  MemorySnapshot snapshot;
  absl::Status error;
  int reads = 0;
  // The shm file system's free bytes (RegistryOptions::read_fs_free).
  uint64_t fs_free = UINT64_MAX;
};

inline RegistryOptions Options(const std::string& dir, FakeMemory* mem) {
  RegistryOptions o;
  o.shm_dir = dir;
  o.read_memory = [mem]() -> absl::StatusOr<MemorySnapshot> {
    ++mem->reads;
    if (!mem->error.ok()) return mem->error;
    return mem->snapshot;
  };
  o.read_fs_free = [mem](const DirFd&) -> absl::StatusOr<uint64_t> { return mem->fs_free; };
  return o;
}

// 1,000,000 bytes per token (MLA, uint8, 1000 x 1000), so sizes read in
// round GB: N tokens are N MB.
inline PoolSpec MegabyteTokenSpec(uint64_t tokens) {
  PoolSpec s;
  s.kind = PoolKind::kMla;
  s.layout = LayoutKind::kPageFirst;
  s.dtype = DType::kUint8;
  s.page_size = 16;
  s.layer_num = 1000;
  s.kv_lora_rank = 1000;
  s.size_tokens = tokens;
  return s;
}

inline constexpr uint64_t kGB = 1000000000;

class RegistryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_FALSE(dir_.path().empty());
    mem_.snapshot.mem_total = 1000 * kGB;
    mem_.snapshot.mem_available = 500 * kGB;
    ASSERT_EQ(BytesPerToken(MegabyteTokenSpec(16)), 1000000u);
  }
  PoolShmDir dir_;
  FakeMemory mem_;
};

// Valid specs of each kind (followers name "anchor").
inline PoolSpec KindSpec(PoolKind kind) {
  PoolSpec s;
  s.kind = kind;
  s.dtype = DType::kBf16;
  s.page_size = 4;
  s.layer_num = 2;
  s.size_tokens = 64;
  switch (kind) {
    case PoolKind::kMha:
      s.layout = LayoutKind::kPageFirst, s.head_num = 2, s.head_dim = 8;
      break;
    case PoolKind::kMhaAsymmetric:
      s.layout = LayoutKind::kPageFirst, s.head_num = 2, s.head_dim = 8, s.v_head_dim = 4;
      break;
    case PoolKind::kKOnly:
      s.layout = LayoutKind::kPageFirst, s.head_num = 2, s.head_dim = 8, s.follows = "anchor";
      s.size_tokens = 0;
      break;
    case PoolKind::kMla:
      s.layout = LayoutKind::kLayerFirst, s.kv_lora_rank = 8, s.qk_rope_head_dim = 4;
      break;
    case PoolKind::kDsa:
      s.layout = LayoutKind::kLayerFirst, s.kv_lora_rank = 8, s.qk_rope_head_dim = 4;
      s.index_head_dim = 16, s.index_quant_block_size = 8;
      break;
    case PoolKind::kDsaIndexer:
      s.layout = LayoutKind::kPageFirst, s.dtype = DType::kUint8, s.index_head_dim = 16;
      s.index_quant_block_size = 8, s.follows = "anchor", s.size_tokens = 0;
      break;
    case PoolKind::kMamba:
      s.layout = LayoutKind::kPageFirstDirect, s.page_size = 1;
      s.mamba.temporal = {2, 3}, s.mamba.temporal_dtype = DType::kFp32,
      s.mamba.conv = {{4}, {2, 2}};
      break;
    case PoolKind::kV4Paged:
      s.layout = LayoutKind::kPageFirst, s.dtype = DType::kUint8, s.item_bytes = 24;
      break;
    case PoolKind::kV4State:
      s.layout = LayoutKind::kPageFirst, s.dtype = DType::kUint8, s.ring_size = 3;
      s.state_slot_bytes = 8, s.follows = "anchor", s.size_tokens = 0;
      break;
    case PoolKind::kLogical:
      s.layout = LayoutKind::kLayerFirst, s.dtype = DType::kUint8, s.layer_num = 0;
      break;
  }
  return s;
}

inline const PoolKind kKinds[] = {PoolKind::kMha,    PoolKind::kMla,     PoolKind::kMhaAsymmetric,
                                  PoolKind::kKOnly,  PoolKind::kDsa,     PoolKind::kDsaIndexer,
                                  PoolKind::kMamba,  PoolKind::kV4Paged, PoolKind::kV4State,
                                  PoolKind::kLogical};

class KindRegistryTest : public RegistryTest {
 protected:
  std::shared_ptr<Pool> Make(PoolRegistry& reg, const std::string& name, PoolSpec s) {
    absl::StatusOr<std::shared_ptr<Pool>> p = reg.Create(name, s);
    EXPECT_TRUE(p.ok()) << p.status();
    return p.ok() ? *p : nullptr;
  }
};

}  // namespace kvhost::testing

#endif  // KVHOST_TESTS_POOL_TEST_UTIL_H_
