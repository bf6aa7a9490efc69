// kvhost_session_worker: a worker process for session_integration_test. It is
// a separate program because the test kills it with SIGKILL and a process
// that forked after gRPC started may not use gRPC.
//
//   kvhost_session_worker ADDRESS SHM_DIR POOL MODE FIRST_SLOT COUNT
//
// Both modes attach a ShmDevicePool of 2 * COUNT rows to POOL (an MHA / MLA
// pool whose slots [FIRST_SLOT, FIRST_SLOT + COUNT) the caller allocated)
// within a worker session (the client's default).
//   backup: writes a pattern into rows [0, COUNT), backs them up into the
//           slots and waits: "promised" once done; then queues 32 loads of
//           the slots into rows [COUNT, 2 COUNT) and 32 more backups of the
//           same rows (the same bytes), prints "queued", and waits to be
//           killed.
//   verify: loads the slots into rows [0, COUNT) and checks the pattern;
//           prints "verified <bytes>" and exits 0, or exits 3 naming the
//           first wrong row.
// Exit 2 for a failed call, with its status on stderr.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "kvhost/client.h"

namespace {

// Byte j of device row r, layer l, component c.
uint8_t PatternByte(uint32_t c, uint32_t l, uint64_t r, uint64_t j) {
  uint64_t x = (uint64_t{c} << 56) ^ (uint64_t{l} << 40) ^ (r << 8) ^ j;
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 29;
  return static_cast<uint8_t>(x);
}

int Fail(const char* what, const absl::Status& status) {
  std::fprintf(stderr, "session_worker: %s: %s\n", what, status.ToString().c_str());
  return 2;
}

std::vector<int64_t> Range(int64_t first, int64_t count) {
  std::vector<int64_t> out(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) out[static_cast<size_t>(i)] = first + i;
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t first = 0;
  int64_t count = 0;
  if (argc != 7 || !absl::SimpleAtoi(argv[5], &first) || !absl::SimpleAtoi(argv[6], &count) ||
      count < 1) {
    std::fprintf(stderr, "usage: %s ADDRESS SHM_DIR POOL backup|verify FIRST_SLOT COUNT\n",
                 argv[0]);
    return 1;
  }
  const std::string pool_name = argv[3];
  const std::string mode = argv[4];
  kvhost::ClientOptions options;
  options.address = argv[1];
  options.worker_name = "session_worker-" + mode;
  absl::StatusOr<std::unique_ptr<kvhost::Client>> client = kvhost::Client::Connect(options);
  if (!client.ok()) return Fail("connect", client.status());
  kvhost::Client& c = **client;
  absl::StatusOr<kvhost::v1::Pool> pool = c.GetPool(pool_name);
  if (!pool.ok()) return Fail("GetPool", pool.status());
  absl::StatusOr<std::unique_ptr<kvhost::ShmDevicePool>> device =
      kvhost::ShmDevicePool::Create(*pool, static_cast<uint64_t>(2 * count), argv[2]);
  if (!device.ok()) return Fail("ShmDevicePool::Create", device.status());
  kvhost::ShmDevicePool& dev = **device;
  const std::vector<int64_t> slots = Range(first, count);
  const std::vector<int64_t> rows = Range(0, count);
  const std::vector<int64_t> upper = Range(count, count);

  if (mode == "backup") {
    for (uint32_t k = 0; k < dev.components(); ++k) {
      for (uint32_t l = 0; l < dev.layers(); ++l) {
        for (int64_t r = 0; r < count; ++r) {
          uint8_t* row = dev.row(k, l, static_cast<uint64_t>(r));
          for (uint64_t j = 0; j < dev.row_bytes(k); ++j) row[j] = PatternByte(k, l, r, j);
        }
      }
    }
  }
  absl::StatusOr<kvhost::v1::Attachment> attachment =
      c.AttachDevice(dev.MakeAttachRequest(pool_name));
  if (!attachment.ok()) return Fail("AttachDevice", attachment.status());
  std::printf("attached %s session %s\n", attachment->id().c_str(),
              c.session_state().session_id.c_str());
  std::fflush(stdout);

  if (mode == "backup") {
    absl::StatusOr<uint64_t> ticket = c.Backup(attachment->id(), slots, rows);
    if (!ticket.ok()) return Fail("Backup", ticket.status());
    absl::StatusOr<kvhost::v1::TransferStatus> done = c.WaitTransfer(*ticket);
    if (!done.ok()) return Fail("WaitTransfer", done.status());
    std::printf("promised\n");
    std::fflush(stdout);
    for (int i = 0; i < 32; ++i) {
      if (absl::StatusOr<uint64_t> t = c.Load(attachment->id(), slots, upper); !t.ok()) {
        return Fail("Load", t.status());
      }
      if (absl::StatusOr<uint64_t> t = c.Backup(attachment->id(), slots, rows); !t.ok()) {
        return Fail("Backup", t.status());
      }
    }
    std::printf("queued\n");
    std::fflush(stdout);
    while (true) ::pause();
  }
  if (mode != "verify") {
    std::fprintf(stderr, "session_worker: mode '%s' is not backup or verify\n", mode.c_str());
    return 1;
  }
  absl::StatusOr<uint64_t> ticket = c.Load(attachment->id(), slots, rows);
  if (!ticket.ok()) return Fail("Load", ticket.status());
  absl::StatusOr<kvhost::v1::TransferStatus> done = c.WaitTransfer(*ticket);
  if (!done.ok()) return Fail("WaitTransfer", done.status());
  uint64_t bytes = 0;
  for (uint32_t k = 0; k < dev.components(); ++k) {
    for (uint32_t l = 0; l < dev.layers(); ++l) {
      for (int64_t r = 0; r < count; ++r) {
        const uint8_t* row = dev.row(k, l, static_cast<uint64_t>(r));
        for (uint64_t j = 0; j < dev.row_bytes(k); ++j) {
          if (row[j] != PatternByte(k, l, r, j)) {
            std::fprintf(stderr,
                         "session_worker: component %u layer %u row %lld byte %llu differs from "
                         "what was backed up\n",
                         k, l, static_cast<long long>(r), static_cast<unsigned long long>(j));
            return 3;
          }
        }
        bytes += dev.row_bytes(k);
      }
    }
  }
  std::printf("verified %llu\n", static_cast<unsigned long long>(bytes));
  return 0;
}
