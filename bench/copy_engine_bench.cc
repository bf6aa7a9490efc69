// kvhost_copy_engine_bench: what the copy engines alone do with scattered
// pieces, in this process (no kvhostd): cudaMemcpyBatchAsync of random
// pieces between a pinned host buffer and a device buffer, per piece size,
// number of streams a batch is split over, and direction; GB/s against the
// contiguous pinned cudaMemcpyAsync ceiling measured in the same run. The
// CUDA engine's auto thresholds (--ce-min-piece) and its copy streams per
// direction (--copy-streams) come from this table.
//
// Pieces: the buffers are cut into slots of the piece size; each transfer
// copies every slot once, host slot order and device slot order shuffled
// independently (as a scattered page table does), in batches of at most
// --max-batch copies, the batch split into contiguous ranges of equal
// bytes, one per stream, all streams started together and joined. Median of
// --repeats transfers after a warm-up. Progress on stderr; a table on
// stdout, JSON with --json-out. Exit 0 done, 1 a CUDA call failed, 2 bad
// flags, 77 no usable GPU.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "bench/bench_util.h"
#include "common/cli_flags.h"
#include "common/cuda_util.h"
#include "server/pool/host_memory.h"

ABSL_FLAG(std::string, bytes, "1G", "Bytes of each transfer (K/M/G suffixes are powers of 1024).");
ABSL_FLAG(std::vector<std::string>, pieces,
          std::vector<std::string>({"2K", "4K", "8K", "16K", "18K", "32K", "64K", "128K", "256K"}),
          "Piece sizes, comma separated.");
ABSL_FLAG(std::vector<std::string>, streams, std::vector<std::string>({"1", "2", "4", "8"}),
          "Streams a batch is split over, comma separated.");
ABSL_FLAG(int, repeats, 3, "Timed transfers per case after a warm-up.");
ABSL_FLAG(int, max_batch, 8192, "Most copies per cudaMemcpyBatchAsync call.");
ABSL_FLAG(std::string, json_out, "", "Write the results as JSON to this file.");

namespace {

using kvhost::bench::JsonArray;
using kvhost::bench::JsonObject;

std::string SizeText(uint64_t n) {
  if (n % (uint64_t{1} << 30) == 0) return absl::StrCat(n >> 30, "G");
  if (n % (uint64_t{1} << 20) == 0) return absl::StrCat(n >> 20, "M");
  if (n % (uint64_t{1} << 10) == 0) return absl::StrCat(n >> 10, "K");
  return absl::StrCat(n);
}

bool Check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return true;
  std::fprintf(stderr, "kvhost_copy_engine_bench: %s: %s\n", what, kvhost::CudaError(e).c_str());
  return false;
}

struct Buffers {
  uint8_t* host = nullptr;
  uint8_t* device = nullptr;
  uint64_t bytes = 0;
  std::vector<cudaStream_t> streams;
  std::vector<cudaEvent_t> done;
  cudaEvent_t start = nullptr;
  cudaEvent_t stop = nullptr;
};

// Submits copies [begin, end) on `stream` in batches.
bool SubmitBatches(void** dsts, void** srcs, size_t* sizes, size_t begin, size_t end, bool to_host,
                   int gpu, size_t max_batch, cudaStream_t stream) {
#if CUDART_VERSION >= 12080
  cudaMemcpyAttributes attr;
  std::memset(&attr, 0, sizeof(attr));
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  cudaMemLocation host_loc{};
  host_loc.type = cudaMemLocationTypeHost;
  cudaMemLocation device_loc{};
  device_loc.type = cudaMemLocationTypeDevice;
  device_loc.id = gpu;
  attr.srcLocHint = to_host ? device_loc : host_loc;
  attr.dstLocHint = to_host ? host_loc : device_loc;
  attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
  size_t attr_index = 0;
  for (size_t i = begin; i < end; i += max_batch) {
    const size_t n = std::min(max_batch, end - i);
#if CUDART_VERSION >= 13000
    if (!Check(
            cudaMemcpyBatchAsync(dsts + i, srcs + i, sizes + i, n, &attr, &attr_index, 1, stream),
            "cudaMemcpyBatchAsync")) {
      return false;
    }
#else
    size_t fail = 0;
    if (!Check(cudaMemcpyBatchAsync(dsts + i, srcs + i, sizes + i, n, &attr, &attr_index, 1, &fail,
                                    stream),
               "cudaMemcpyBatchAsync")) {
      return false;
    }
#endif
  }
  return true;
#else
  for (size_t i = begin; i < end; ++i) {
    if (!Check(cudaMemcpyAsync(dsts[i], srcs[i], sizes[i], cudaMemcpyDefault, stream),
               "cudaMemcpyAsync")) {
      return false;
    }
  }
  return true;
#endif
}

// Milliseconds of one transfer of `piece`-byte pieces over `streams` streams.
double TimeTransfer(Buffers& b, uint64_t piece, size_t streams, bool to_host, size_t max_batch,
                    std::mt19937_64& rng, bool* ok) {
  const size_t n = b.bytes / piece;
  std::vector<size_t> host_slot(n), device_slot(n);
  std::iota(host_slot.begin(), host_slot.end(), 0);
  std::iota(device_slot.begin(), device_slot.end(), 0);
  std::shuffle(host_slot.begin(), host_slot.end(), rng);
  std::shuffle(device_slot.begin(), device_slot.end(), rng);
  std::vector<void*> dsts(n), srcs(n);
  std::vector<size_t> sizes(n, piece);
  for (size_t i = 0; i < n; ++i) {
    void* h = b.host + host_slot[i] * piece;
    void* d = b.device + device_slot[i] * piece;
    dsts[i] = to_host ? h : d;
    srcs[i] = to_host ? d : h;
  }
  *ok = Check(cudaEventRecord(b.start, b.streams[0]), "cudaEventRecord");
  for (size_t k = 1; k < streams && *ok; ++k) {
    *ok = Check(cudaStreamWaitEvent(b.streams[k], b.start, 0), "cudaStreamWaitEvent");
  }
  for (size_t k = 0; k < streams && *ok; ++k) {
    const size_t begin = n * k / streams;
    const size_t end = n * (k + 1) / streams;
    *ok = SubmitBatches(dsts.data(), srcs.data(), sizes.data(), begin, end, to_host, 0, max_batch,
                        b.streams[k]);
    if (*ok && k > 0) {
      *ok = Check(cudaEventRecord(b.done[k], b.streams[k]), "cudaEventRecord") &&
            Check(cudaStreamWaitEvent(b.streams[0], b.done[k], 0), "cudaStreamWaitEvent");
    }
  }
  *ok = *ok && Check(cudaEventRecord(b.stop, b.streams[0]), "cudaEventRecord") &&
        Check(cudaEventSynchronize(b.stop), "cudaEventSynchronize");
  float ms = 0;
  *ok = *ok && Check(cudaEventElapsedTime(&ms, b.start, b.stop), "cudaEventElapsedTime");
  return ms;
}

}  // namespace

int main(int argc, char** argv) {
  kvhost::ParseFlags(argc, argv,
                     "kvhost_copy_engine_bench: copy-engine GB/s of scattered pieces by piece "
                     "size and stream count, against the pinned memcpy ceiling.",
                     "bench/copy_engine_bench.cc");
  absl::StatusOr<uint64_t> parsed = kvhost::ParseByteSize(absl::GetFlag(FLAGS_bytes));
  if (!parsed.ok() || *parsed == 0) {
    std::fprintf(stderr, "--bytes: '%s' is not a size (e.g. 1G)\n",
                 absl::GetFlag(FLAGS_bytes).c_str());
    return 2;
  }
  const uint64_t bytes = *parsed;
  std::vector<uint64_t> pieces;
  for (const std::string& s : absl::GetFlag(FLAGS_pieces)) {
    absl::StatusOr<uint64_t> p = kvhost::ParseByteSize(s);
    if (!p.ok() || *p == 0 || *p > bytes) {
      std::fprintf(stderr, "--pieces: '%s' is not a size in (0, --bytes]\n", s.c_str());
      return 2;
    }
    pieces.push_back(*p);
  }
  std::vector<size_t> stream_counts;
  for (const std::string& s : absl::GetFlag(FLAGS_streams)) {
    int n = 0;
    if (!absl::SimpleAtoi(s, &n) || n < 1 || n > 64) {
      std::fprintf(stderr, "--streams: '%s' is not in [1, 64]\n", s.c_str());
      return 2;
    }
    stream_counts.push_back(static_cast<size_t>(n));
  }
  const int repeats = std::max(absl::GetFlag(FLAGS_repeats), 1);
  const size_t max_batch = static_cast<size_t>(std::max(absl::GetFlag(FLAGS_max_batch), 1));
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::fprintf(stderr, "kvhost_copy_engine_bench: no usable CUDA GPU; skipped\n");
    return 77;
  }
  Buffers b;
  b.bytes = bytes;
  const size_t most_streams = *std::max_element(stream_counts.begin(), stream_counts.end());
  b.streams.resize(most_streams);
  b.done.resize(most_streams);
  bool ok = Check(cudaHostAlloc(reinterpret_cast<void**>(&b.host), b.bytes, cudaHostAllocDefault),
                  "cudaHostAlloc") &&
            Check(cudaMalloc(reinterpret_cast<void**>(&b.device), b.bytes), "cudaMalloc") &&
            Check(cudaMemset(b.device, 1, b.bytes), "cudaMemset") &&
            Check(cudaEventCreate(&b.start), "cudaEventCreate") &&
            Check(cudaEventCreate(&b.stop), "cudaEventCreate");
  if (ok) std::memset(b.host, 2, b.bytes);
  for (size_t k = 0; k < most_streams && ok; ++k) {
    ok = Check(cudaStreamCreateWithFlags(&b.streams[k], cudaStreamNonBlocking), "stream") &&
         Check(cudaEventCreateWithFlags(&b.done[k], cudaEventDisableTiming), "event");
  }
  if (!ok) return 1;
  std::mt19937_64 rng(1);
  // The ceiling: one contiguous copy each way, same bytes.
  double ceiling[2] = {0, 0};
  for (int dir = 0; dir < 2 && ok; ++dir) {
    std::vector<double> ms;
    for (int r = 0; r <= repeats && ok; ++r) {
      const double t = TimeTransfer(b, b.bytes, 1, dir == 0, max_batch, rng, &ok);
      if (r > 0) ms.push_back(t);
    }
    ceiling[dir] = b.bytes / (kvhost::bench::Median(ms) * 1e6);
    std::fprintf(stderr, "ceiling %s: %.1f GB/s\n", dir == 0 ? "D2H" : "H2D", ceiling[dir]);
  }
  std::vector<std::string> cases;
  std::vector<std::vector<std::string>> rows = {
      {"piece", "streams", "D2H GB/s (ratio)", "H2D GB/s (ratio)"}};
  for (uint64_t piece : pieces) {
    for (size_t streams : stream_counts) {
      double gbs[2] = {0, 0};
      for (int dir = 0; dir < 2 && ok; ++dir) {
        std::vector<double> ms;
        for (int r = 0; r <= repeats && ok; ++r) {
          const double t = TimeTransfer(b, piece, streams, dir == 0, max_batch, rng, &ok);
          if (r > 0) ms.push_back(t);
        }
        gbs[dir] = (b.bytes / piece * piece) / (kvhost::bench::Median(ms) * 1e6);
      }
      if (!ok) return 1;
      std::fprintf(stderr, "piece %s, %zu stream(s): D2H %.1f, H2D %.1f GB/s\n",
                   SizeText(piece).c_str(), streams, gbs[0], gbs[1]);
      rows.push_back({SizeText(piece), absl::StrCat(streams),
                      absl::StrFormat("%.1f (%.2f)", gbs[0], gbs[0] / ceiling[0]),
                      absl::StrFormat("%.1f (%.2f)", gbs[1], gbs[1] / ceiling[1])});
      cases.push_back(JsonObject()
                          .Uint("piece_bytes", piece)
                          .Uint("streams", streams)
                          .Num("d2h_gbs", gbs[0], 2)
                          .Num("h2d_gbs", gbs[1], 2)
                          .str());
    }
  }
  std::printf("Ceiling (contiguous pinned copy of %s): D2H %.1f GB/s, H2D %.1f GB/s\n\n",
              SizeText(b.bytes).c_str(), ceiling[0], ceiling[1]);
  kvhost::bench::PrintTable(rows, "rrrr");
  const std::string out = absl::GetFlag(FLAGS_json_out);
  if (!out.empty()) {
    const std::string json = JsonObject()
                                 .Str("bench", "kvhost_copy_engine_bench")
                                 .Uint("bytes", b.bytes)
                                 .Num("ceiling_d2h_gbs", ceiling[0], 2)
                                 .Num("ceiling_h2d_gbs", ceiling[1], 2)
                                 .Raw("cases", JsonArray(cases))
                                 .str();
    if (absl::Status s = kvhost::bench::WriteJsonOut(out, json); !s.ok()) {
      std::fprintf(stderr, "%s\n", std::string(s.message()).c_str());
      return 1;
    }
  }
  return 0;
}
