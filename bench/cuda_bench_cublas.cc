#include "bench/cuda_bench_cublas.h"

#include <dlfcn.h>
#include <glob.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace kvhost::bench {
namespace {

// Values of the cuBLAS / CUDA enums the GEMM passes, as cublas_api.h and
// library_types.h (CUDA 13.0) define them; stable across cuBLAS 11-13.
constexpr int kCublasStatusSuccess = 0;  // CUBLAS_STATUS_SUCCESS
constexpr int kCublasOpN = 0;            // CUBLAS_OP_N
constexpr int kCudaR16Bf = 14;           // CUDA_R_16BF (cudaDataType)
constexpr int kCublasCompute32F = 68;    // CUBLAS_COMPUTE_32F (cublasComputeType_t)
constexpr int kCublasGemmDefault = -1;   // CUBLAS_GEMM_DEFAULT (cublasGemmAlgo_t)

// Library file names tried from the loader path, newest first.
const char* const kSonames[] = {"libcublas.so.13", "libcublas.so.12"};

std::vector<std::string> Glob(const std::string& pattern) {
  std::vector<std::string> out;
  glob_t g;
  if (::glob(pattern.c_str(), 0, nullptr, &g) == 0) {
    for (size_t i = 0; i < g.gl_pathc; ++i) out.push_back(g.gl_pathv[i]);
  }
  ::globfree(&g);
  return out;
}

// The site-packages folders where pip puts torch's nvidia-* wheels.
std::vector<std::string> SitePackages() {
  // /opt/*/.venv: where the GPU machine keeps torch's environment
  // (/opt/torch/.venv, whose python3 need not be on PATH).
  std::vector<std::string> patterns = {
      "/usr/local/lib/python3*/dist-packages", "/usr/local/lib/python3*/site-packages",
      "/usr/lib/python3/dist-packages", "/opt/*/.venv/lib/python3*/site-packages",
      "/opt/*/venv/lib/python3*/site-packages"};
  if (const char* home = std::getenv("HOME"); home != nullptr && *home != '\0') {
    patterns.push_back(absl::StrCat(home, "/.local/lib/python3*/site-packages"));
  }
  // The environment of the python3 found first on PATH (a venv's bin/).
  if (const char* path = std::getenv("PATH"); path != nullptr) {
    for (absl::string_view dir : absl::StrSplit(path, ':', absl::SkipEmpty())) {
      const std::string python = absl::StrCat(dir, "/python3");
      if (::access(python.c_str(), X_OK) != 0) continue;
      const std::string prefix = std::string(dir.substr(0, dir.rfind('/')));
      patterns.push_back(absl::StrCat(prefix, "/lib/python3*/site-packages"));
      break;
    }
  }
  std::vector<std::string> out;
  for (const std::string& p : patterns) {
    for (std::string& dir : Glob(p)) {
      if (std::find(out.begin(), out.end(), dir) == out.end()) out.push_back(std::move(dir));
    }
  }
  return out;
}

// libcublas needs libcublasLt, which the loader finds by name only where its
// directory is on the loader path (pip's copy finds it through its RUNPATH);
// loaded first from the candidate's own directory, it is found by soname.
void PreloadLt(const std::string& candidate) {
  const size_t slash = candidate.rfind('/');
  if (slash == std::string::npos) return;
  for (const std::string& lt : Glob(candidate.substr(0, slash) + "/libcublasLt.so.*")) {
    if (::dlopen(lt.c_str(), RTLD_NOW | RTLD_GLOBAL) != nullptr) return;
  }
  ::dlerror();  // a failure here shows again, better named, for libcublas itself
}

std::string DlError() {
  const char* e = ::dlerror();
  return e != nullptr ? e : "unknown dlopen error";
}

}  // namespace

// The entry points, declared as cublas_api.h declares them (handles and
// enums as the plain types they are in the C ABI).
struct Cublas::Api {
  using Create = int (*)(void** handle);
  using Destroy = int (*)(void* handle);
  using SetStream = int (*)(void* handle, cudaStream_t stream);
  using GemmEx = int (*)(void* handle, int transa, int transb, int m, int n, int k,
                         const void* alpha, const void* a, int a_type, int lda, const void* b,
                         int b_type, int ldb, const void* beta, void* c, int c_type, int ldc,
                         int compute_type, int algo);
  Create create = nullptr;
  Destroy destroy = nullptr;
  SetStream set_stream = nullptr;
  GemmEx gemm_ex = nullptr;
};

std::vector<std::string> CublasCandidates(const std::string& flag) {
  if (!flag.empty()) return {flag};
  std::vector<std::string> out;
  if (const char* env = std::getenv("KVHOST_CUBLAS"); env != nullptr && *env != '\0') {
    out.push_back(env);
  }
  for (const char* soname : kSonames) out.push_back(soname);
  std::vector<std::string> patterns;
  for (const std::string& site : SitePackages()) {
    patterns.push_back(site + "/nvidia/*/lib/libcublas.so.*");  // nvidia/cu13/lib, ...
    patterns.push_back(site + "/nvidia/cublas/lib/libcublas.so.*");
  }
  // A CUDA toolkit whose lib directory is not on the loader path.
  patterns.push_back("/usr/local/cuda/lib64/libcublas.so.*");
  patterns.push_back("/usr/local/cuda-*/targets/*/lib/libcublas.so.*");
  for (const std::string& p : patterns) {
    for (std::string& lib : Glob(p)) {
      if (std::find(out.begin(), out.end(), lib) == out.end()) out.push_back(std::move(lib));
    }
  }
  return out;
}

absl::StatusOr<std::unique_ptr<Cublas>> Cublas::Load(const std::string& flag) {
  std::vector<std::string> tried;
  for (const std::string& candidate : CublasCandidates(flag)) {
    PreloadLt(candidate);
    void* lib = ::dlopen(candidate.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      tried.push_back(absl::StrCat(candidate, " (", DlError(), ")"));
      continue;
    }
    auto api = std::make_unique<Api>();
    api->create = reinterpret_cast<Api::Create>(::dlsym(lib, "cublasCreate_v2"));
    api->destroy = reinterpret_cast<Api::Destroy>(::dlsym(lib, "cublasDestroy_v2"));
    api->set_stream = reinterpret_cast<Api::SetStream>(::dlsym(lib, "cublasSetStream_v2"));
    api->gemm_ex = reinterpret_cast<Api::GemmEx>(::dlsym(lib, "cublasGemmEx"));
    if (api->create == nullptr || api->destroy == nullptr || api->set_stream == nullptr ||
        api->gemm_ex == nullptr) {
      tried.push_back(absl::StrCat(candidate, " (lacks a cublas*_v2 or cublasGemmEx symbol)"));
      ::dlclose(lib);
      continue;
    }
    std::unique_ptr<Cublas> c(new Cublas());
    c->path_ = candidate;
    c->api_ = std::move(api);
    if (const int s = c->api_->create(&c->handle_); s != kCublasStatusSuccess) {
      c->handle_ = nullptr;
      return absl::InternalError(absl::StrCat("cublasCreate from ", candidate, " returned ", s));
    }
    return c;
  }
  return absl::NotFoundError(absl::StrCat(
      "no usable cuBLAS for the GEMM worker (pass --cublas=PATH, set KVHOST_CUBLAS, or leave "
      "gemm out of --workers); tried: ",
      tried.empty() ? "nothing" : absl::StrJoin(tried, "; ")));
}

Cublas::~Cublas() {
  if (handle_ != nullptr) api_->destroy(handle_);
  // The library stays loaded: cuBLAS registers process-exit work with the
  // CUDA runtime, which must not find its code unmapped.
}

absl::Status Cublas::SetStream(cudaStream_t stream) {
  if (const int s = api_->set_stream(handle_, stream); s != kCublasStatusSuccess) {
    return absl::InternalError(absl::StrCat("cublasSetStream returned ", s));
  }
  return absl::OkStatus();
}

absl::Status Cublas::GemmBf16(int n, const void* a, const void* b, void* c) {
  const float alpha = 1.0f, beta = 0.0f;  // fp32 scalars, as CUBLAS_COMPUTE_32F takes
  const int s =
      api_->gemm_ex(handle_, kCublasOpN, kCublasOpN, n, n, n, &alpha, a, kCudaR16Bf, n, b,
                    kCudaR16Bf, n, &beta, c, kCudaR16Bf, n, kCublasCompute32F, kCublasGemmDefault);
  if (s != kCublasStatusSuccess) {
    return absl::InternalError(absl::StrCat("cublasGemmEx (", n, "^3 bf16) returned ", s));
  }
  return absl::OkStatus();
}

}  // namespace kvhost::bench
