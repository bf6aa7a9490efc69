#include "kvhost/layer_progress.h"

#include <poll.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

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
// A reply is a status message, two numbers and, for pool regions, a few
// launch groups: the daemon's bound (kMaxHandoffReplyBytes).
constexpr size_t kMaxReplyBytes = 65536;
// Descriptors one reply may carry (the daemon's kMaxWorkerCopyRegions).
constexpr size_t kMaxReceivedFds = 16;

int ToMillis(absl::Duration d) {
  return static_cast<int>(std::max<int64_t>(0, absl::ToInt64Milliseconds(d)));
}

absl::Status Errno(absl::StatusCode code, const std::string& what) {
  return absl::Status(code, absl::StrCat(what, ": ", std::strerror(errno)));
}

// The reply of `fd`'s daemon and the descriptors it carried.
absl::Status ReceiveReply(int fd, const std::string& socket_path, absl::Duration timeout,
                          v1::HandoffReply* reply, std::vector<int>* received) {
  pollfd ready = {fd, POLLIN, 0};
  // A signal (the process's own timers, a debugger, a supervisor's SIGUSR1)
  // interrupts poll; that is no failure of the handoff: wait out the rest.
  const absl::Time deadline = absl::Now() + timeout;
  int n = 0;
  do {
    n = ::poll(&ready, 1, ToMillis(deadline - absl::Now()));
  } while (n < 0 && errno == EINTR);
  if (n == 0) {
    return absl::DeadlineExceededError(absl::StrCat(
        "handoff socket ", socket_path, ": no reply within ", absl::FormatDuration(timeout)));
  }
  if (n < 0) return Errno(absl::StatusCode::kInternal, "poll");
  std::vector<char> buffer(kMaxReplyBytes);
  iovec iov{buffer.data(), buffer.size()};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxReceivedFds)] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  const ssize_t got = ::recvmsg(fd, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
  if (got < 0) return Errno(absl::StatusCode::kUnavailable, "handoff socket: recvmsg");
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const size_t fds = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < fds; ++i) {
      int one = -1;
      std::memcpy(&one, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
      if (received->size() < kMaxReceivedFds) {
        received->push_back(one);
      } else {
        ::close(one);  // more than the protocol sends
      }
    }
  }
  if ((msg.msg_flags & MSG_CTRUNC) != 0) {
    for (int one : *received) ::close(one);
    received->clear();
    return absl::InternalError(
        absl::StrCat("handoff socket ", socket_path, ": more descriptors than ", kMaxReceivedFds));
  }
  if (got == 0 && received->empty()) {
    return absl::UnavailableError(
        absl::StrCat("handoff socket ", socket_path, " closed the connection without a reply"));
  }
  if ((msg.msg_flags & MSG_TRUNC) != 0 || !reply->ParseFromArray(buffer.data(), got)) {
    return absl::InternalError(
        absl::StrCat("handoff socket ", socket_path, ": the reply is not a HandoffReply"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<Handoff> FetchHandoff(const std::string& socket_path,
                                     const v1::HandoffRequest& request, absl::Duration timeout,
                                     absl::Span<const int> send_fds) {
  if (send_fds.size() > kMaxDepositDescriptors) {
    return absl::InvalidArgumentError(absl::StrCat(
        send_fds.size(), " descriptors in one handoff request; at most ", kMaxDepositDescriptors));
  }
  sockaddr_un addr{};
  if (socket_path.empty() || socket_path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(
        absl::StrCat("handoff socket path '", socket_path, "' is empty or too long"));
  }
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, socket_path.c_str(), socket_path.size() + 1);
  struct Closer {
    int fd = -1;
    ~Closer() {
      if (fd >= 0) ::close(fd);
    }
  } closer;
  std::string bytes = request.SerializeAsString();
  std::vector<char> control(CMSG_SPACE(sizeof(int) * send_fds.size()));
  // kvhostd pushes out a connection of a uid that has many waiting without
  // a request (a silent client's), and ours may be one of them in the
  // instant between connect and send, under load: the send then finds the
  // connection closed (EPIPE, ECONNRESET) with nothing of ours taken, so
  // connect again until the deadline.
  const absl::Time deadline = absl::Now() + timeout;
  absl::Duration backoff = absl::Milliseconds(1);
  while (true) {
    if (closer.fd >= 0) ::close(std::exchange(closer.fd, -1));
    closer.fd = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (closer.fd < 0) return Errno(absl::StatusCode::kInternal, "socket");
    const timeval send_timeout = absl::ToTimeval(timeout);
    ::setsockopt(closer.fd, SOL_SOCKET, SO_SNDTIMEO, &send_timeout, sizeof(send_timeout));
    if (::connect(closer.fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      return Errno(absl::StatusCode::kUnavailable,
                   absl::StrCat("handoff socket ", socket_path, ": connect"));
    }
    iovec iov{bytes.data(), bytes.size()};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    if (!send_fds.empty()) {
      msg.msg_control = control.data();
      msg.msg_controllen = control.size();
      cmsghdr* c = CMSG_FIRSTHDR(&msg);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int) * send_fds.size());
      std::memcpy(CMSG_DATA(c), send_fds.data(), sizeof(int) * send_fds.size());
    }
    if (::sendmsg(closer.fd, &msg, MSG_NOSIGNAL) == static_cast<ssize_t>(bytes.size())) break;
    const int err = errno;
    if ((err != EPIPE && err != ECONNRESET) || absl::Now() + backoff >= deadline) {
      errno = err;
      return Errno(absl::StatusCode::kUnavailable,
                   absl::StrCat("handoff socket ", socket_path, ": send"));
    }
    absl::SleepFor(backoff);
    backoff = std::min(backoff * 2, absl::Milliseconds(50));
  }
  const int fd = closer.fd;
  v1::HandoffReply reply;
  std::vector<int> received;
  absl::Status s = ReceiveReply(fd, socket_path, timeout, &reply, &received);
  if (s.ok() && reply.code() != 0) {
    s = absl::Status(static_cast<absl::StatusCode>(reply.code()), reply.message());
  } else if (s.ok() && received.empty() && request.kind() != v1::HANDOFF_KIND_DEPOSIT) {
    s = absl::InternalError(
        absl::StrCat("handoff socket ", socket_path, ": an OK reply without a descriptor"));
  }
  if (!s.ok()) {
    for (int one : received) ::close(one);
    return s;
  }
  Handoff handoff;
  handoff.deposit_id = reply.deposit_id();
  if (!received.empty()) handoff.fd = received[0];
  handoff.fds = std::move(received);
  handoff.bytes = reply.bytes();
  handoff.count = reply.count();
  handoff.pool_regions = std::move(*reply.mutable_pool_regions());
  if (request.kind() == v1::HANDOFF_KIND_FAST_PATH)
    handoff.connection = std::exchange(closer.fd, -1);
  return handoff;
}

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
  struct Closer {
    std::vector<int> fds;
    ~Closer() {
      for (int fd : fds) ::close(fd);
    }
  } closer{handoff->fds};  // the mapping keeps the file
  struct stat st {};
  if (handoff->count == 0 || handoff->count > kMaxCounters ||
      handoff->bytes != uint64_t{handoff->count} * sizeof(uint64_t) ||
      ::fstat(handoff->fd, &st) != 0 || static_cast<uint64_t>(st.st_size) < handoff->bytes) {
    return absl::InternalError(absl::StrCat("handoff socket ", handoff_socket, ": ", handoff->count,
                                            " layer counters in ", handoff->bytes,
                                            " bytes do not match the descriptor"));
  }
  void* mapped = ::mmap(nullptr, handoff->bytes, PROT_READ, MAP_SHARED, handoff->fd, 0);
  if (mapped == MAP_FAILED) return Errno(absl::StatusCode::kInternal, "mmap of layer counters");
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
