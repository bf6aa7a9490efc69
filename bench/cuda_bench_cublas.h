// The few cuBLAS entry points the benchmark's GEMM worker calls, loaded at
// run time with dlopen: the benchmark is built where cuBLAS may be missing
// and runs from a bundle on a GPU machine where it comes with torch (a pip
// package's nvidia/*/lib) or with the CUDA toolkit. The C entry points are
// declared here, not taken from cublas_api.h, and the library is found by
// FindCublas.
//
// A Cublas is created once and used from one thread at a time (cuBLAS
// handles are not thread-safe); it owns the cuBLAS handle, released in the
// destructor (before the CUDA context goes). The library stays loaded.
#ifndef KVHOST_BENCH_CUDA_BENCH_CUBLAS_H_
#define KVHOST_BENCH_CUDA_BENCH_CUBLAS_H_

#include <cuda_runtime_api.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace kvhost::bench {

// Where FindCublas looks, in order: `flag` (--cublas) alone if set; else
// $KVHOST_CUBLAS, libcublas.so.13 and libcublas.so.12 from the loader path,
// then the libcublas.so.* under python site-packages nvidia/*/lib (system
// dist-packages, ~/.local, /opt/*/.venv and the environment of `python3` on
// PATH), then a CUDA toolkit's (/usr/local/cuda*).
std::vector<std::string> CublasCandidates(const std::string& flag);

class Cublas {
 public:
  // Opens the first candidate that loads and has every entry point, and
  // creates a handle on the current device. NOT_FOUND naming every
  // candidate tried and why it failed; INTERNAL when cublasCreate fails.
  static absl::StatusOr<std::unique_ptr<Cublas>> Load(const std::string& flag);
  ~Cublas();
  Cublas(const Cublas&) = delete;
  Cublas& operator=(const Cublas&) = delete;

  const std::string& path() const { return path_; }

  // Binds the handle to `stream`; INTERNAL on failure.
  absl::Status SetStream(cudaStream_t stream);
  // Enqueues C = A * B (column-major n x n bf16 matrices, fp32 accumulate,
  // the default algorithm) on the bound stream; INTERNAL on failure.
  absl::Status GemmBf16(int n, const void* a, const void* b, void* c);

 private:
  Cublas() = default;
  struct Api;
  std::string path_;
  std::unique_ptr<Api> api_;
  void* handle_ = nullptr;  // cublasHandle_t: an opaque pointer
};

}  // namespace kvhost::bench

#endif  // KVHOST_BENCH_CUDA_BENCH_CUBLAS_H_
