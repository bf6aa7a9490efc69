#include "client/fast_path_channel.h"

#include <poll.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/handoff.h"
#include "kvhost/layer_progress.h"

namespace kvhost {
namespace {

// How long a caller watches the reply word before it sleeps: the daemon
// answers an Alloc in a few microseconds when its thread is awake on
// another core.
constexpr int64_t kClientSpinNs = 50'000;
// How often a sleeping caller checks that the daemon's end is still there.
constexpr int64_t kClientSliceNs = 20'000'000;
// Capacities a daemon may offer: from a page to a gigabyte.
constexpr uint64_t kMinCapacity = 4096;
constexpr uint64_t kMaxCapacity = uint64_t{1} << 30;

bool HungUp(int connection) {
  pollfd p{connection, POLLRDHUP, 0};
  if (::poll(&p, 1, 0) < 0) return errno != EINTR;
  return (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) != 0;
}

}  // namespace

absl::StatusOr<std::unique_ptr<FastPathChannel>> FastPathChannel::Open(
    const std::string& handoff_socket, absl::Duration timeout,
    const std::vector<std::string>& session_ids) {
  v1::HandoffRequest request;
  request.set_kind(v1::HANDOFF_KIND_FAST_PATH);
  for (const std::string& id : session_ids) request.add_session_ids(id);
  absl::StatusOr<Handoff> handoff = FetchHandoff(handoff_socket, request, timeout);
  if (!handoff.ok()) return handoff.status();
  std::unique_ptr<FastPathChannel> channel(new FastPathChannel());
  channel->connection_ = std::move(handoff->connection);
  // The mailbox's descriptor closes with `handoff`: the mapping keeps the file.
  const uint64_t capacity =
      handoff->bytes > kFastPathHeaderBytes ? (handoff->bytes - kFastPathHeaderBytes) / 2 : 0;
  struct stat st {};
  if (handoff->fds.size() != 1 || capacity < kMinCapacity || capacity > kMaxCapacity ||
      FastPathMailboxBytes(static_cast<uint32_t>(capacity)) != handoff->bytes ||
      ::fstat(handoff->fd(), &st) != 0 || static_cast<uint64_t>(st.st_size) != handoff->bytes) {
    return absl::InternalError(absl::StrCat("handoff socket ", handoff_socket,
                                            ": a fast-path mailbox of ", handoff->bytes,
                                            " bytes does not match its descriptor"));
  }
  void* mapped =
      ::mmap(nullptr, handoff->bytes, PROT_READ | PROT_WRITE, MAP_SHARED, handoff->fd(), 0);
  if (mapped == MAP_FAILED) {
    return absl::InternalError(
        absl::StrCat("mmap of the fast-path mailbox: ", std::strerror(errno)));
  }
  channel->mapping_ = mapped;
  channel->bytes_ = handoff->bytes;
  channel->mailbox_ = FastPathMailbox::Over(mapped, static_cast<uint32_t>(capacity));
  if (channel->mailbox_.header->version != kFastPathVersion) {
    return absl::FailedPreconditionError(absl::StrCat("the daemon's fast-path mailbox is version ",
                                                      channel->mailbox_.header->version,
                                                      "; this client speaks ", kFastPathVersion));
  }
  channel->seq_ = channel->mailbox_.header->request_seq.load(std::memory_order_acquire);
  return channel;
}

FastPathChannel::~FastPathChannel() {
  if (mapping_ != nullptr) ::munmap(mapping_, bytes_);
}

absl::Status FastPathChannel::Call(const v1::FastPathRequest& request, v1::FastPathReply* reply,
                                   absl::Time deadline) {
  if (broken_) return absl::UnavailableError("the fast-path mailbox broke earlier");
  const size_t length = request.ByteSizeLong();
  if (length > mailbox_.capacity) {
    return absl::InvalidArgumentError(absl::StrCat("a request of ", length,
                                                   " bytes is over the fast-path mailbox's ",
                                                   mailbox_.capacity, " bytes"));
  }
  request.SerializeWithCachedSizesToArray(mailbox_.request);
  mailbox_.header->request_bytes.store(static_cast<uint32_t>(length), std::memory_order_relaxed);
  const uint32_t seq = ++seq_;
  const uint32_t before = mailbox_.header->reply_seq.load(std::memory_order_acquire);
  const uint32_t cpu = CpuHint();
  mailbox_.header->client_cpu.store(cpu, std::memory_order_relaxed);
  const int64_t spin_ns =
      SpinFor(mailbox_.header->server_cpu.load(std::memory_order_relaxed), cpu) ? kClientSpinNs : 0;
  mailbox_.header->request_seq.store(seq, std::memory_order_release);
  FutexWake(&mailbox_.header->request_seq);
  absl::Status failure;
  uint32_t now = before;
  while (now != seq) {
    now = WaitForChange(&mailbox_.header->reply_seq, now, spin_ns, kClientSliceNs, [&] {
      if (HungUp(connection_.get())) {
        failure = absl::UnavailableError("kvhostd closed the fast-path mailbox (it stopped?)");
      } else if (absl::Now() >= deadline) {
        failure = absl::DeadlineExceededError("no fast-path reply before the call's deadline");
      }
      return failure.ok();
    });
    if (!failure.ok()) {
      broken_ = true;
      return failure;
    }
  }
  const uint32_t got = mailbox_.header->reply_bytes.load(std::memory_order_relaxed);
  if (got > mailbox_.capacity ||
      !reply->ParseFromArray(mailbox_.reply, static_cast<int>(std::min(got, mailbox_.capacity)))) {
    broken_ = true;
    return absl::InternalError(
        absl::StrCat("a fast-path reply of ", got, " bytes is not a kvhost.v1.FastPathReply"));
  }
  // Read: the daemon serves the next ring only after this.
  mailbox_.header->reply_read.store(seq, std::memory_order_release);
  return absl::OkStatus();
}

}  // namespace kvhost
