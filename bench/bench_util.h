// Helpers shared by the kvhost benchmarks: medians, result files,
// comma-separated number lists and shared-memory scratch buffers (tables, JSON
// and percentiles come from client/cli_output.h, shared with kvhostctl).
//
// Header only. Nothing here is shared between threads: each benchmark thread
// keeps its own samples, merged once the threads have joined.
#ifndef KVHOST_BENCH_BENCH_UTIL_H_
#define KVHOST_BENCH_BENCH_UTIL_H_

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "client/cli_output.h"
#include "kvhost/v1/pool.pb.h"

namespace kvhost::bench {

using cli::JsonArray;
using cli::JsonObject;
using cli::Percentile;
using cli::PrintTable;

// Median of unsorted values; 0 when empty.
inline double Median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return Percentile(values, 0.5);
}

// Creates the file's folder first: an output path names where results go.
inline absl::Status WriteFile(const std::string& path, const std::string& text) {
  const std::filesystem::path parent = std::filesystem::path(path).parent_path();
  std::error_code ec;
  if (!parent.empty()) std::filesystem::create_directories(parent, ec);
  FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot write ", path, ": ", std::strerror(errno)));
  }
  const bool ok = std::fwrite(text.data(), 1, text.size(), f) == text.size();
  if (std::fclose(f) != 0 || !ok) {
    return absl::DataLossError(absl::StrCat("cannot write all of ", path));
  }
  return absl::OkStatus();
}

// Writes a benchmark's --json-out file and says so.
inline absl::Status WriteJsonOut(const std::string& path, const std::string& json) {
  if (absl::Status s = WriteFile(path, json + "\n"); !s.ok()) return s;
  absl::PrintF("wrote %s\n", path);
  return absl::OkStatus();
}

// "1,8" from a list flag: positive integers.
inline absl::StatusOr<std::vector<uint64_t>> ParsePositiveList(
    absl::string_view flag, const std::vector<std::string>& items) {
  std::vector<uint64_t> out;
  for (const std::string& item : items) {
    uint64_t value = 0;
    if (!absl::SimpleAtoi(item, &value) || value == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", flag, ": '", item, "' is not a positive integer"));
    }
    out.push_back(value);
  }
  if (out.empty()) return absl::InvalidArgumentError(absl::StrCat("--", flag, " is empty"));
  return out;
}

// What a benchmark's main() does after parsing flags: check them (exit 2 on a
// mistake), run (exit 1 with `error: CODE: message` on failure), else exit 0.
template <typename Options>
int Finish(const absl::StatusOr<Options>& options, absl::Status (*run)(const Options& options)) {
  if (!options.ok()) {
    absl::FPrintF(stderr, "usage error: %s\n", options.status().message());
    return 2;
  }
  const absl::Status status = run(*options);
  if (status.ok()) return 0;
  absl::FPrintF(stderr, "error: %s: %s\n", absl::StatusCodeToString(status.code()),
                status.message());
  return 1;
}

// A buffer in a shared-memory file (unlinked at once), populated: the same
// kind of memory as kvhostd's pools and the emulated device pools, so that a
// memcpy between two of them is a fair ceiling for the host engine (anonymous
// memory could get transparent huge pages, which tmpfs does not by default).
class ShmScratch {
 public:
  static absl::StatusOr<std::unique_ptr<ShmScratch>> Create(const std::string& dir,
                                                            uint64_t bytes) {
    std::string path = absl::StrCat(dir, "/kvhost-bench-scratch.", ::getpid(), ".XXXXXX");
    const int fd = ::mkstemp(path.data());
    if (fd < 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("cannot create a file in ", dir, ": ", std::strerror(errno)));
    }
    ::unlink(path.c_str());
    const int err = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes));
    if (err != 0) {
      ::close(fd);
      return absl::ResourceExhaustedError(
          absl::StrCat("cannot reserve ", bytes, " bytes in ", dir, ": ", std::strerror(err)));
    }
    void* data = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
    ::close(fd);
    if (data == MAP_FAILED) {
      return absl::ResourceExhaustedError(absl::StrCat("cannot map ", bytes, " bytes"));
    }
    return std::unique_ptr<ShmScratch>(new ShmScratch(static_cast<uint8_t*>(data), bytes));
  }
  ~ShmScratch() { ::munmap(data_, bytes_); }
  ShmScratch(const ShmScratch&) = delete;
  ShmScratch& operator=(const ShmScratch&) = delete;

  uint8_t* data() const { return data_; }
  uint64_t bytes() const { return bytes_; }

 private:
  ShmScratch(uint8_t* data, uint64_t bytes) : data_(data), bytes_(bytes) {}
  uint8_t* data_;
  uint64_t bytes_;
};

// The benchmarks' pool: MHA as Llama-3-70B on one of 8 tensor-parallel
// ranks (8 KV heads x 128 dims bf16, 2 KiB rows) or MLA as DeepSeek-V3's
// latent (512 + 64 rotary dims bf16, 1152-byte rows), `size_tokens` slots.
inline kvhost::v1::PoolSpec BenchPoolSpec(kvhost::v1::PoolKind kind, kvhost::v1::Layout layout,
                                          uint32_t page_size, uint32_t layers,
                                          uint64_t size_tokens) {
  kvhost::v1::PoolSpec spec;
  spec.set_kind(kind);
  spec.set_layout(layout);
  spec.set_dtype(kvhost::v1::BF16);
  spec.set_page_size(page_size);
  spec.set_layer_num(layers);
  if (kind == kvhost::v1::MLA) {
    spec.set_kv_lora_rank(512);
    spec.set_qk_rope_head_dim(64);
  } else {
    spec.set_head_num(8);
    spec.set_head_dim(128);
  }
  spec.set_size_tokens(size_tokens);
  return spec;
}

}  // namespace kvhost::bench

#endif  // KVHOST_BENCH_BENCH_UTIL_H_
