// kvhost_gpu_death_worker: a GPU worker for worker_death_gpu_test, which
// kills it with SIGKILL while kvhostd (cuda backend) copies to and from the
// device memory this process owns. A program of its own, since a process
// that forked after gRPC or CUDA started may use neither.
//
//   kvhost_gpu_death_worker ADDRESS POOL TOKEN MODE TOKENS WAIT_EVENT BACKUPS LOADS
//
// POOL is an MHA pool protected by the owner token TOKEN (so the test, with
// the token, may look at this worker's attachment and tickets). The worker
// cudaMallocs one allocation for the K layers and one for the V layers,
// 2 x TOKENS rows per layer (only the first TOKENS are used: the rest makes
// the allocations large enough that the test sees them come back to the GPU
// once kvhostd's mapping closes), fills K with kFillK and V with kFillV,
// connects within a worker session (worker name "gpu-death-worker-MODE"),
// allocates TOKENS slots (one run: the pool has no other holes),
// attaches with 64 load event sets (MODE progress: with layer_progress, and
// opens the load events and layer counters as a worker would), backs rows
// [0, TOKENS) up into the slots and waits ("promised"). Then, never waiting
// for a ticket: LOADS loads of the slots into rows [0, TOKENS) (in MODE
// progress each load's stream waits on its layer 0, as a forward pass
// would); unless WAIT_EVENT is "-", one backup waiting on that interprocess
// event (cudaIpcEventHandle_t bytes in hex, the test's, recorded behind a
// kernel the test holds): it cannot finish before the test lets it, and every
// backup after it waits behind it on kvhostd's backup lane. It prints
//   busy gated <ticket> load <the last load's ticket> attachment <id>
// and then, in a loop, keeps up to LOADS loads and BACKUPS backups of the
// rows into the slots (the same bytes either way) in flight until it is
// killed. Output lines: "attached <id>", "slots
// <first> <count>", "promised", "busy ...". Exit 2 for a failed call (its
// status on stderr), 1 for bad arguments.
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "kvhost/client.h"
#include "kvhost/cuda_export.h"

namespace {

// What every byte of the worker's K and V rows holds.
constexpr int kFillK = 0xa5;
constexpr int kFillV = 0x5a;
// Enough for every load the loop keeps in flight and more.
constexpr uint32_t kLoadEventSets = 64;

int Fail(const char* what, const absl::Status& status) {
  std::fprintf(stderr, "gpu_death_worker: %s: %s\n", what, status.ToString().c_str());
  return 2;
}

int FailCuda(const char* what, cudaError_t e) {
  std::fprintf(stderr, "gpu_death_worker: %s: %s\n", what, cudaGetErrorString(e));
  return 2;
}

void Say(const std::string& line) {
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
}

std::vector<int64_t> Range(int64_t first, int64_t count) {
  std::vector<int64_t> out(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) out[static_cast<size_t>(i)] = first + i;
  return out;
}

struct Args {
  std::string address, pool, token, mode, wait_event;
  int64_t tokens = 0;
  size_t backups = 0, loads = 0;
};

bool ParseArgs(int argc, char** argv, Args* a) {
  if (argc != 9) return false;
  a->address = argv[1];
  a->pool = argv[2];
  a->token = argv[3];
  a->mode = argv[4];
  if (!absl::SimpleAtoi(argv[5], &a->tokens) || a->tokens < 1) return false;
  const std::string hex = argv[6];
  if (hex != "-") {
    if (hex.empty() || hex.size() % 2 != 0 ||
        hex.find_first_not_of("0123456789abcdefABCDEF") != std::string::npos) {
      return false;
    }
    a->wait_event = absl::HexStringToBytes(hex);
  }
  if (!absl::SimpleAtoi(argv[7], &a->backups) || !absl::SimpleAtoi(argv[8], &a->loads)) {
    return false;
  }
  return (a->mode == "plain" || a->mode == "progress") && a->backups >= 1 && a->loads >= 1;
}

// Drops the finished tickets at the front of `tickets` (each direction's
// tickets finish in order); false with `error` set when one failed.
bool Retire(kvhost::Client& c, std::deque<uint64_t>* tickets, absl::Status* error) {
  while (!tickets->empty()) {
    absl::StatusOr<kvhost::v1::TransferStatus> st = c.PollTransfer(tickets->front());
    if (!st.ok()) {
      *error = st.status();
      return false;
    }
    if (!st->done()) return true;
    tickets->pop_front();
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  if (!ParseArgs(argc, argv, &args)) {
    std::fprintf(stderr,
                 "usage: %s ADDRESS POOL TOKEN plain|progress TOKENS WAIT_EVENT_HEX|- BACKUPS "
                 "LOADS\n",
                 argv[0]);
    return 1;
  }
  kvhost::ClientOptions options;
  options.address = args.address;
  options.owner_token = args.token;
  options.worker_name = "gpu-death-worker-" + args.mode;
  absl::StatusOr<std::unique_ptr<kvhost::Client>> client = kvhost::Client::Connect(options);
  if (!client.ok()) return Fail("connect", client.status());
  kvhost::Client& c = **client;
  absl::StatusOr<kvhost::v1::Pool> pool = c.GetPool(args.pool);
  if (!pool.ok()) return Fail("GetPool", pool.status());
  if (pool->spec().kind() != kvhost::v1::MHA) {
    return Fail("GetPool", absl::InvalidArgumentError("the pool is not MHA"));
  }
  const uint32_t layers = pool->spec().layer_num();
  const uint64_t row_bytes = pool->bytes_per_token() / (2 * uint64_t{layers});
  const uint64_t rows = 2 * static_cast<uint64_t>(args.tokens);

  if (cudaError_t e = cudaSetDevice(0); e != cudaSuccess) return FailCuda("cudaSetDevice", e);
  const uint64_t plane_bytes = uint64_t{layers} * rows * row_bytes;
  std::vector<void*> planes[2];
  for (int p = 0; p < 2; ++p) {
    void* base = nullptr;
    if (cudaError_t e = cudaMalloc(&base, plane_bytes); e != cudaSuccess) {
      return FailCuda("cudaMalloc", e);
    }
    if (cudaError_t e = cudaMemset(base, p == 0 ? kFillK : kFillV, plane_bytes); e != cudaSuccess) {
      return FailCuda("cudaMemset", e);
    }
    for (uint32_t l = 0; l < layers; ++l) {
      planes[p].push_back(static_cast<uint8_t*>(base) + uint64_t{l} * rows * row_bytes);
    }
  }
  if (cudaError_t e = cudaDeviceSynchronize(); e != cudaSuccess) {
    return FailCuda("cudaDeviceSynchronize", e);
  }

  absl::StatusOr<std::vector<int64_t>> slots =
      c.Alloc(args.pool, static_cast<uint64_t>(args.tokens));
  if (!slots.ok()) return Fail("Alloc", slots.status());
  if (*slots != Range(slots->front(), args.tokens)) {
    return Fail("Alloc", absl::FailedPreconditionError("the slots are not one run"));
  }
  Say(absl::StrCat("slots ", slots->front(), " ", args.tokens));
  absl::StatusOr<kvhost::v1::AttachDeviceRequest> request =
      kvhost::MakeCudaAttachRequest(args.pool, planes[0], planes[1], rows);
  if (!request.ok()) return Fail("MakeCudaAttachRequest", request.status());
  const bool progress = args.mode == "progress";
  request->set_layer_progress(progress);
  request->set_load_event_sets(kLoadEventSets);
  absl::StatusOr<kvhost::v1::Attachment> attachment = c.AttachDevice(*request);
  if (!attachment.ok()) return Fail("AttachDevice", attachment.status());
  Say(absl::StrCat("attached ", attachment->id()));
  std::unique_ptr<kvhost::LoadEvents> events;
  cudaStream_t stream = nullptr;
  if (progress) {
    absl::StatusOr<std::unique_ptr<kvhost::LoadEvents>> opened =
        kvhost::LoadEvents::Open(c, *attachment);
    if (!opened.ok()) return Fail("LoadEvents::Open", opened.status());
    events = *std::move(opened);
    if (cudaError_t e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
        e != cudaSuccess) {
      return FailCuda("cudaStreamCreate", e);
    }
  }

  const std::string& id = attachment->id();
  const std::vector<int64_t> device_rows = Range(0, args.tokens);
  absl::StatusOr<uint64_t> first = c.Backup(id, *slots, device_rows);
  if (!first.ok()) return Fail("Backup", first.status());
  if (absl::StatusOr<kvhost::v1::TransferStatus> done = c.WaitTransfer(*first); !done.ok()) {
    return Fail("WaitTransfer", done.status());
  }
  Say("promised");

  std::deque<uint64_t> backups, loads;
  absl::Status error;
  // A load, and the stream's wait for its layer 0 in MODE progress.
  auto load = [&]() -> absl::Status {
    absl::StatusOr<kvhost::LoadTicket> t = c.LoadWithEvents(id, *slots, device_rows);
    if (!t.ok()) return t.status();
    loads.push_back(t->ticket_id);
    // A forward pass's wait for layer 0 of this load on its own stream.
    if (events != nullptr) return events->WaitLayer(*t, 0, stream);
    return absl::OkStatus();
  };
  // The loads' queue filled first, then the backup behind the test's
  // event, and "busy" at once: while that backup waits, any call of
  // kvhostd's that synchronises its whole device (cudaFree does) waits too,
  // and the test must not depend on the loop below getting anywhere.
  for (size_t i = 0; i < args.loads; ++i) {
    if (absl::Status s = load(); !s.ok()) return Fail("Load", s);
  }
  uint64_t gated = 0;
  if (!args.wait_event.empty()) {
    absl::StatusOr<uint64_t> t = c.Backup(id, *slots, device_rows, args.wait_event);
    if (!t.ok()) return Fail("Backup waiting on the test's event", t.status());
    gated = *t;
    backups.push_back(gated);
  }
  Say(absl::StrCat("busy gated ", gated, " load ", loads.back(), " attachment ", id));
  while (true) {
    if (!Retire(c, &backups, &error)) return Fail("PollTransfer of a backup", error);
    if (!Retire(c, &loads, &error)) return Fail("PollTransfer of a load", error);
    bool submitted = false;
    if (loads.size() < args.loads) {
      if (absl::Status s = load(); !s.ok()) return Fail("Load", s);
      submitted = true;
    }
    if (backups.size() < args.backups) {
      absl::StatusOr<uint64_t> t = c.Backup(id, *slots, device_rows);
      if (!t.ok()) return Fail("Backup", t.status());
      backups.push_back(*t);
      submitted = true;
    }
    if (!submitted) ::usleep(1000);
  }
}
