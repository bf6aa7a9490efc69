// cuMem memory on a GPU (label gpu): device KV buffers made with the CUDA
// virtual memory API (cuMemCreate with POSIX file descriptor handles, as
// PyTorch's expandable segments and vLLM's cumem allocator make them) attach
// to kvhostd through the descriptor path: the client exports each
// allocation a buffer spans, deposits the descriptors on the handoff socket,
// and kvhostd imports and maps them back to back.
//
// - Round trips on every transfer path (copy engines, staged, sm, auto) for
//   MHA LAYER_FIRST page 1 with K in cuMem memory (layer buffers straddling
//   allocation boundaries) and V in cudaMalloc memory in one attachment, and
//   MLA PAGE_FIRST page 16 wholly in cuMem memory: the loaded rows equal
//   the backed-up ones byte for byte, and no other byte changes.
// - Refusals: no size or no client for cuMem memory (FAILED_PRECONDITION),
//   a size past the mapped range (INVALID_ARGUMENT), a deposit used up by an
//   attach (NOT_FOUND on replay).
// - A worker whose session ends without detaching: kvhostd unmaps its
//   imports within the session timeout, and the GPU memory comes back once
//   the worker frees its own.
//
// Skips where no GPU is usable; where one is, every CUDA or RPC error fails.
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "api_test_util.h"
#include "common/cuda_vmm.h"
#include "cuda_test_util.h"
#include "daemon_fixture.h"
#include "gtest/gtest.h"
#include "kvhost/client.h"
#include "kvhost/cuda_export.h"
#include "layout_device.h"

namespace kvhost {
namespace {

using ::kvhost::testing::FillRandomNonZero;
using ::kvhost::testing::GpuDims;
using ::kvhost::testing::IsError;
using ::kvhost::testing::MakeSpec;
using ::kvhost::testing::StatusOf;
using ::kvhost::testing::TestDaemon;

constexpr absl::Duration kWait = absl::Seconds(60);

#define ASSERT_CU(expr)                                                  \
  do {                                                                   \
    const CUresult r_ = (expr);                                          \
    ASSERT_EQ(r_, CUDA_SUCCESS) << #expr << ": " << (*Vmm())->Error(r_); \
  } while (0)

// `chunks` cuMem allocations of the GPU's granularity (times `scale`) on
// device 0, exportable as POSIX descriptors, mapped back to back in one
// reserved range with read-write access: what an expandable segment is.
class VmmMemory {
 public:
  void Make(size_t chunks, size_t scale = 1) {
    absl::StatusOr<const VmmApi*> vmm = Vmm();
    ASSERT_TRUE(vmm.ok()) << vmm.status();
    api_ = *vmm;
    CUmemAllocationProp prop{};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    size_t granularity = 0;
    ASSERT_CU(
        api_->allocation_granularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
    chunk_ = granularity * scale;
    bytes_ = chunk_ * chunks;
    ASSERT_CU(api_->address_reserve(&base_, bytes_, 0, 0, 0));
    for (size_t c = 0; c < chunks; ++c) {
      CUmemGenericAllocationHandle handle = 0;
      ASSERT_CU(api_->create(&handle, chunk_, &prop, 0));
      handles_.push_back(handle);
      ASSERT_CU(api_->map(base_ + c * chunk_, chunk_, 0, handle, 0));
    }
    CUmemAccessDesc access{};
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = 0;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    ASSERT_CU(api_->set_access(base_, bytes_, &access, 1));
  }
  ~VmmMemory() { Free(); }
  void Free() {
    if (api_ == nullptr || base_ == 0) return;
    for (size_t c = 0; c < handles_.size(); ++c) {
      api_->unmap(base_ + c * chunk_, chunk_);
      api_->release(handles_[c]);
    }
    api_->address_free(base_, bytes_);
    base_ = 0;
    handles_.clear();
  }
  uint8_t* base() const { return reinterpret_cast<uint8_t*>(base_); }
  uint64_t bytes() const { return bytes_; }
  uint64_t chunk() const { return chunk_; }

 private:
  const VmmApi* api_ = nullptr;
  CUdeviceptr base_ = 0;
  uint64_t bytes_ = 0;
  uint64_t chunk_ = 0;
  std::vector<CUmemGenericAllocationHandle> handles_;
};

struct Case {
  const char* path;  // --transfer-path, nullptr for auto
};

std::string CaseName(const ::testing::TestParamInfo<Case>& info) {
  return info.param.path != nullptr ? info.param.path : "auto";
}

class CuMemGpuTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    std::string why;
    if (CudaDeviceCount(&why) == 0) GTEST_SKIP() << "no usable CUDA GPU: " << why;
    ASSERT_CUDA(cudaSetDevice(0));
    std::vector<std::string> flags = {"--backend=cuda"};
    if (GetParam().path != nullptr) {
      flags.push_back(absl::StrCat("--transfer-path=", GetParam().path));
      if (std::string(GetParam().path) == "staged") flags.push_back("--staging-bytes=1M");
    }
    absl::StatusOr<std::unique_ptr<TestDaemon>> d = TestDaemon::Start(KVHOSTD_PATH, flags);
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = *std::move(d);
    absl::StatusOr<v1::DaemonStatus> status = client().GetStatus();
    ASSERT_TRUE(status.ok()) << status.status();
    ASSERT_EQ(status->backend(), "cuda") << status->backend_detail();
    ASSERT_NE(status->handoff_socket(), "");
  }
  void TearDown() override {
    if (daemon_ != nullptr && HasFailure()) {
      std::string log = daemon_->Log();
      if (log.size() > 12000) log = "..." + log.substr(log.size() - 12000);
      std::fprintf(stderr, "--- kvhostd log (tail) ---\n%s\n", log.c_str());
    }
  }
  Client& client() { return daemon_->client(); }

  std::unique_ptr<TestDaemon> daemon_;
};

// Device rows of `row_bytes` at `base` + r * row_bytes, `rows` of them per
// layer buffer; reads or writes the whole span.
std::vector<uint8_t> Download(const uint8_t* base, uint64_t bytes) {
  std::vector<uint8_t> out(bytes);
  EXPECT_EQ(cudaMemcpy(out.data(), base, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  return out;
}

// Backs up `dev` rows of every buffer to fresh host slots, zeroes the
// buffers, loads the slots back into the same rows and checks every byte:
// the rows as they were, everything else zero.
void RoundTrip(Client& client, const std::string& attachment, std::vector<uint8_t*> buffers,
               uint64_t buffer_bytes, uint64_t rows, uint64_t row_bytes, uint32_t page,
               std::mt19937& rng) {
  std::vector<std::vector<uint8_t>> before;
  for (uint8_t* b : buffers) {
    std::vector<uint8_t> bytes(buffer_bytes);
    FillRandomNonZero(bytes.data(), bytes.size(), rng);
    ASSERT_CUDA(cudaMemcpy(b, bytes.data(), bytes.size(), cudaMemcpyHostToDevice));
    before.push_back(std::move(bytes));
  }
  // Half the device pages, shuffled, into host slots in allocation order.
  std::vector<int64_t> pages;
  for (uint64_t p = 0; p < rows / page; ++p) pages.push_back(static_cast<int64_t>(p));
  std::shuffle(pages.begin(), pages.end(), rng);
  pages.resize(pages.size() / 2);
  std::vector<int64_t> device;
  for (int64_t p : pages) {
    for (uint32_t t = 0; t < page; ++t) device.push_back(p * page + t);
  }
  absl::StatusOr<std::vector<int64_t>> host = client.Alloc("cumem", device.size());
  ASSERT_TRUE(host.ok()) << host.status();
  absl::StatusOr<uint64_t> backup = client.Backup(attachment, *host, device);
  ASSERT_TRUE(backup.ok()) << backup.status();
  absl::StatusOr<v1::TransferStatus> done = client.WaitTransfer(*backup, kWait);
  ASSERT_TRUE(done.ok()) << done.status();
  ASSERT_TRUE(done->done());
  for (uint8_t* b : buffers) ASSERT_CUDA(cudaMemset(b, 0, buffer_bytes));
  ASSERT_CUDA(cudaDeviceSynchronize());
  absl::StatusOr<uint64_t> load = client.Load(attachment, *host, device);
  ASSERT_TRUE(load.ok()) << load.status();
  done = client.WaitTransfer(*load, kWait);
  ASSERT_TRUE(done.ok()) << done.status();
  ASSERT_TRUE(done->done());
  std::vector<bool> loaded(rows, false);
  for (int64_t r : device) loaded[static_cast<uint64_t>(r)] = true;
  for (size_t b = 0; b < buffers.size(); ++b) {
    const std::vector<uint8_t> got = Download(buffers[b], buffer_bytes);
    int bad = 0;
    for (uint64_t r = 0; r < rows && bad < 5; ++r) {
      const uint8_t* want = before[b].data() + r * row_bytes;
      const uint8_t* have = got.data() + r * row_bytes;
      const bool ok = loaded[r]
                          ? std::memcmp(want, have, row_bytes) == 0
                          : std::all_of(have, have + row_bytes, [](uint8_t x) { return x == 0; });
      if (!ok) {
        ++bad;
        ADD_FAILURE() << "buffer " << b << " row " << r
                      << (loaded[r] ? " (loaded)" : " (not loaded)") << " differs";
      }
    }
  }
  ASSERT_TRUE(client.Free("cumem", *host).ok());
}

TEST_P(CuMemGpuTest, MhaMixedWithCudaMalloc) {
  std::mt19937 rng(1);
  const uint64_t rows = 8192;
  v1::PoolSpec spec = MakeSpec(v1::MHA, v1::LAYER_FIRST, 1, 16384, v1::BF16, GpuDims());
  absl::StatusOr<v1::Pool> pool = client().CreatePool("cumem", spec);
  ASSERT_TRUE(pool.ok()) << pool.status();
  const uint64_t row_bytes = pool->components(0).row_bytes();
  const uint64_t layer_bytes = rows * row_bytes;
  const uint32_t layers = spec.layer_num();
  // K in cuMem memory: the layers back to back from a lead-in that is no
  // multiple of the allocation size, so buffers straddle allocations.
  VmmMemory vmm;
  const uint64_t lead = 4096 + 512;
  vmm.Make(1);
  const size_t chunks = (lead + layers * layer_bytes + vmm.chunk() - 1) / vmm.chunk() + 1;
  vmm.Free();
  vmm.Make(chunks);
  if (HasFatalFailure()) return;
  // V in cudaMalloc memory.
  uint8_t* v = nullptr;
  ASSERT_CUDA(cudaMalloc(reinterpret_cast<void**>(&v), layers * layer_bytes));
  std::vector<void*> k_layers, v_layers;
  std::vector<uint8_t*> buffers;
  for (uint32_t l = 0; l < layers; ++l) {
    k_layers.push_back(vmm.base() + lead + l * layer_bytes);
    buffers.push_back(vmm.base() + lead + l * layer_bytes);
  }
  for (uint32_t l = 0; l < layers; ++l) {
    v_layers.push_back(v + l * layer_bytes);
    buffers.push_back(v + l * layer_bytes);
  }
  absl::StatusOr<v1::AttachDeviceRequest> request =
      MakeCudaAttachRequest("cumem", k_layers, v_layers, rows, layer_bytes, &client());
  ASSERT_TRUE(request.ok()) << request.status();
  ASSERT_TRUE(request->k_layers(0).has_cuda_fd());
  ASSERT_TRUE(request->v_layers(0).has_cuda());
  EXPECT_GE(request->k_layers(0).cuda_fd().chunks_size(), 1);
  EXPECT_GE(request->k_layers(1).cuda_fd().chunks_size(), 2);  // straddles
  absl::StatusOr<v1::Attachment> att = client().AttachDevice(*request);
  ASSERT_TRUE(att.ok()) << att.status();
  RoundTrip(client(), att->id(), buffers, layer_bytes, rows, row_bytes, 1, rng);
  // The deposit was used up: the same request again is NOT_FOUND.
  EXPECT_TRUE(IsError(StatusOf(client().AttachDevice(*request)), absl::StatusCode::kNotFound,
                      {"k_layers[0].chunks[0]", "is not held"}));
  ASSERT_TRUE(client().DetachDevice(att->id()).ok());
  cudaFree(v);
}

TEST_P(CuMemGpuTest, MlaWhollyInCuMem) {
  std::mt19937 rng(2);
  const uint64_t rows = 4096;
  const uint32_t page = 16;
  v1::PoolSpec spec = MakeSpec(v1::MLA, v1::PAGE_FIRST, page, 8192, v1::BF16, GpuDims());
  absl::StatusOr<v1::Pool> pool = client().CreatePool("cumem", spec);
  ASSERT_TRUE(pool.ok()) << pool.status();
  const uint64_t row_bytes = pool->components(0).row_bytes();
  const uint64_t layer_bytes = rows * row_bytes;
  VmmMemory vmm;
  vmm.Make(1);
  const size_t chunks = (spec.layer_num() * layer_bytes + vmm.chunk() - 1) / vmm.chunk();
  vmm.Free();
  vmm.Make(chunks);
  if (HasFatalFailure()) return;
  CudaComponentLayers latent;
  latent.name = pool->components(0).name();
  latent.layer_bytes = layer_bytes;
  std::vector<uint8_t*> buffers;
  for (uint32_t l = 0; l < spec.layer_num(); ++l) {
    latent.layers.push_back(vmm.base() + l * layer_bytes);
    buffers.push_back(vmm.base() + l * layer_bytes);
  }
  absl::StatusOr<v1::AttachDeviceRequest> request =
      MakeCudaAttachRequest("cumem", {latent}, rows, &client());
  ASSERT_TRUE(request.ok()) << request.status();
  absl::StatusOr<v1::Attachment> att = client().AttachDevice(*request);
  ASSERT_TRUE(att.ok()) << att.status();
  RoundTrip(client(), att->id(), buffers, layer_bytes, rows, row_bytes, page, rng);
  ASSERT_TRUE(client().DetachDevice(att->id()).ok());
}

INSTANTIATE_TEST_SUITE_P(Paths, CuMemGpuTest,
                         ::testing::Values(Case{nullptr}, Case{"ce"}, Case{"staged"}, Case{"sm"}),
                         CaseName);

class CuMemRefusalGpuTest : public CuMemGpuTest {};

TEST_P(CuMemRefusalGpuTest, Refusals) {
  v1::PoolSpec spec = MakeSpec(v1::MLA, v1::LAYER_FIRST, 1, 1024, v1::BF16, GpuDims());
  absl::StatusOr<v1::Pool> pool = client().CreatePool("cumem", spec);
  ASSERT_TRUE(pool.ok()) << pool.status();
  const uint64_t rows = 1024;
  const uint64_t layer_bytes = rows * pool->components(0).row_bytes();
  VmmMemory vmm;
  vmm.Make(4);
  if (HasFatalFailure()) return;
  ASSERT_LE(spec.layer_num() * layer_bytes, vmm.bytes());
  std::vector<void*> layers;
  for (uint32_t l = 0; l < spec.layer_num(); ++l) layers.push_back(vmm.base() + l * layer_bytes);
  EXPECT_TRUE(IsError(StatusOf(MakeCudaAttachRequest("cumem", layers, {}, rows, layer_bytes)),
                      absl::StatusCode::kFailedPrecondition, {"k_layers[0]", "pass the Client"}));
  EXPECT_TRUE(IsError(StatusOf(MakeCudaAttachRequest("cumem", layers, {}, rows, 0, &client())),
                      absl::StatusCode::kFailedPrecondition, {"k_layers[0]", "layer_bytes"}));
  // The last layer's size runs past the mapped range.
  EXPECT_TRUE(
      IsError(StatusOf(MakeCudaAttachRequest("cumem", layers, {}, rows, vmm.bytes(), &client())),
              absl::StatusCode::kInvalidArgument, {"k_layers[1]", "is not mapped"}));
  // A chunk size the allocation does not have: the daemon's cuMemMap refuses.
  absl::StatusOr<v1::AttachDeviceRequest> request =
      MakeCudaAttachRequest("cumem", layers, {}, rows, layer_bytes, &client());
  ASSERT_TRUE(request.ok()) << request.status();
  v1::AttachDeviceRequest wrong = *request;
  wrong.mutable_k_layers(0)->mutable_cuda_fd()->mutable_chunks(0)->set_bytes(vmm.chunk() * 2);
  EXPECT_TRUE(IsError(StatusOf(client().AttachDevice(wrong)), absl::StatusCode::kInvalidArgument,
                      {"k_layers[0].chunks[0]", "cuMemMap"}));
  // Refused attaches use nothing up: the right request still attaches.
  absl::StatusOr<v1::Attachment> att = client().AttachDevice(*request);
  ASSERT_TRUE(att.ok()) << att.status();
  ASSERT_TRUE(client().DetachDevice(att->id()).ok());
}

INSTANTIATE_TEST_SUITE_P(Auto, CuMemRefusalGpuTest, ::testing::Values(Case{nullptr}), CaseName);

class CuMemSessionGpuTest : public CuMemGpuTest {};

// A worker whose session ends without detaching: kvhostd's imports go with
// the session, so once the worker frees its own mapping the memory is back.
TEST_P(CuMemSessionGpuTest, SessionEndReleasesImports) {
  v1::PoolSpec spec = MakeSpec(v1::MLA, v1::LAYER_FIRST, 1, 1024, v1::BF16, GpuDims());
  absl::StatusOr<v1::Pool> pool = client().CreatePool("cumem", spec);
  ASSERT_TRUE(pool.ok()) << pool.status();
  const uint64_t row_bytes = pool->components(0).row_bytes();
  size_t free_before = 0, total = 0;
  ASSERT_CUDA(cudaMemGetInfo(&free_before, &total));
  constexpr size_t kScale = 64;  // 128 MiB allocations: far above any noise
  auto vmm = std::make_unique<VmmMemory>();
  vmm->Make(4, kScale);
  if (HasFatalFailure()) return;
  const uint64_t rows = vmm->bytes() / spec.layer_num() / row_bytes;
  {
    ClientOptions options;
    options.address = daemon_->address();
    options.timeout = absl::Seconds(10);
    absl::StatusOr<std::unique_ptr<Client>> worker = Client::Connect(options);
    ASSERT_TRUE(worker.ok()) << worker.status();
    std::vector<void*> layers;
    for (uint32_t l = 0; l < spec.layer_num(); ++l) {
      layers.push_back(vmm->base() + l * rows * row_bytes);
    }
    absl::StatusOr<v1::AttachDeviceRequest> request =
        MakeCudaAttachRequest("cumem", layers, {}, rows, rows * row_bytes, worker->get());
    ASSERT_TRUE(request.ok()) << request.status();
    ASSERT_TRUE((*worker)->AttachDevice(*request).ok());
  }             // the worker's client goes: its session ends
  vmm.reset();  // our own mapping and handles: only the daemon's imports hold the memory now
  bool back = false;
  for (absl::Time end = absl::Now() + absl::Seconds(30); !back && absl::Now() < end;
       absl::SleepFor(absl::Milliseconds(100))) {
    size_t free_now = 0;
    ASSERT_CUDA(cudaMemGetInfo(&free_now, &total));
    back = free_now + (64u << 20) >= free_before;
  }
  EXPECT_TRUE(back) << "the imported memory was not released after the session ended";
  absl::StatusOr<v1::DaemonStatus> status = client().GetStatus();
  ASSERT_TRUE(status.ok());
  EXPECT_EQ(status->attachments(), 0u);
}

INSTANTIATE_TEST_SUITE_P(Auto, CuMemSessionGpuTest, ::testing::Values(Case{nullptr}), CaseName);

}  // namespace
}  // namespace kvhost
