#include "kvhost/layer_progress.h"

#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/handoff.h"

namespace kvhost {
namespace {

// Issue 15's bound on a layer's lateness is 100 us. A wait therefore spins
// while a layer is likely imminent (a layer of a 32-layer, 1 GiB load lands
// every ~0.6 ms at link speed, the first right after the Load call), then
// yields the core to the worker's other threads, then sleeps in steps that
// with Linux's default 50 us timer slack stay well inside the bound.
constexpr absl::Duration kSpinFor = absl::Microseconds(20);
constexpr absl::Duration kYieldFor = absl::Microseconds(200);
constexpr absl::Duration kSleepStep = absl::Microseconds(20);
// Counters of one attachment (kvhostd's kMaxLoadEventSets).
constexpr uint32_t kMaxCounters = 64;
}  // namespace

absl::StatusOr<std::unique_ptr<LayerProgress>> LayerProgress::Open(const Client& client,
                                                                   const v1::Attachment& attachment,
                                                                   absl::Duration timeout) {
  if (!attachment.layer_progress() || attachment.handoff_socket().empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "attachment of pool '", attachment.pool(),
        "' was not made with layer_progress (set AttachDeviceRequest.layer_progress)"));
  }
  return Open(attachment.handoff_socket(), attachment.id(), client.session_ids(),
              client.options().owner_token, timeout);
}

absl::StatusOr<std::unique_ptr<LayerProgress>> LayerProgress::Open(
    const std::string& handoff_socket, const std::string& attachment_id,
    const std::vector<std::string>& session_ids, const std::string& owner_token,
    absl::Duration timeout) {
  v1::HandoffRequest request;
  request.set_attachment_id(attachment_id);
  request.set_kind(v1::HANDOFF_KIND_LAYER_COUNTERS);
  for (const std::string& id : session_ids) request.add_session_ids(id);
  request.set_owner_token(owner_token);
  absl::StatusOr<Handoff> handoff = FetchHandoff(handoff_socket, request, timeout);
  if (!handoff.ok()) return handoff.status();
  // The descriptor closes with `handoff`: the mapping keeps the file.
  struct stat st {};
  if (handoff->count == 0 || handoff->count > kMaxCounters ||
      handoff->bytes != uint64_t{handoff->count} * sizeof(uint64_t) ||
      ::fstat(handoff->fd(), &st) != 0 || static_cast<uint64_t>(st.st_size) < handoff->bytes) {
    return absl::InternalError(absl::StrCat("handoff socket ", handoff_socket, ": ", handoff->count,
                                            " layer counters in ", handoff->bytes,
                                            " bytes do not match the descriptor"));
  }
  void* mapped = ::mmap(nullptr, handoff->bytes, PROT_READ, MAP_SHARED, handoff->fd(), 0);
  if (mapped == MAP_FAILED)
    return absl::InternalError(absl::StrCat("mmap of layer counters: ", std::strerror(errno)));
  std::unique_ptr<LayerProgress> progress(new LayerProgress());
  progress->sets_ = handoff->count;
  progress->bytes_ = handoff->bytes;
  progress->counters_ = static_cast<const uint64_t*>(mapped);
  return progress;
}

LayerProgress::~LayerProgress() {
  if (counters_ != nullptr) ::munmap(const_cast<uint64_t*>(counters_), bytes_);
}

uint64_t LayerProgress::Recorded(uint32_t set) const {
  return __atomic_load_n(&counters_[set], __ATOMIC_ACQUIRE);
}

absl::Status LayerProgress::WaitRecorded(int32_t set, uint64_t layer_base, uint32_t layer,
                                         absl::Duration timeout) const {
  if (set == -1) return absl::OkStatus();
  if (set < 0 || static_cast<uint32_t>(set) >= sets_) {
    return absl::InvalidArgumentError(
        absl::StrCat("event set ", set, " out of range [-1, ", sets_, ")"));
  }
  const uint64_t need = layer_base + layer + 1;
  const uint32_t s = static_cast<uint32_t>(set);
  if (Recorded(s) >= need) return absl::OkStatus();
  const absl::Time start = absl::Now();
  const absl::Time deadline = start + timeout;
  for (;;) {
    const absl::Time now = absl::Now();
    if (Recorded(s) >= need) return absl::OkStatus();
    if (now >= deadline) break;
    if (now - start < kSpinFor) continue;
    if (now - start < kYieldFor) {
      ::sched_yield();
    } else {
      absl::SleepFor(kSleepStep);
    }
  }
  return absl::DeadlineExceededError(
      absl::StrCat("layer ", layer, " of the load with layer_base ", layer_base, " on event set ",
                   set, " not recorded within ", absl::FormatDuration(timeout),
                   ": the counter is at ", Recorded(s), ", it needs ", need));
}

}  // namespace kvhost
