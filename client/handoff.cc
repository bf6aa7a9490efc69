#include "client/handoff.h"

#include <poll.h>
#include <sys/socket.h>
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
#include "common/unique_fd.h"
#include "kvhost/client.h"

namespace kvhost {
namespace {

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
                          v1::HandoffReply* reply, std::vector<UniqueFd>* received) {
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
      int raw = -1;
      std::memcpy(&raw, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
      UniqueFd one(raw);
      // More than the protocol sends closes with `one`.
      if (received->size() < kMaxReceivedFds) received->push_back(std::move(one));
    }
  }
  if ((msg.msg_flags & MSG_CTRUNC) != 0) {
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
  UniqueFd connection;
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
    connection.Reset();  // before socket(), whose errno the message reads
    connection = UniqueFd(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
    if (!connection.valid()) return Errno(absl::StatusCode::kInternal, "socket");
    const timeval send_timeout = absl::ToTimeval(timeout);
    ::setsockopt(connection.get(), SOL_SOCKET, SO_SNDTIMEO, &send_timeout, sizeof(send_timeout));
    if (::connect(connection.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
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
    if (::sendmsg(connection.get(), &msg, MSG_NOSIGNAL) == static_cast<ssize_t>(bytes.size()))
      break;
    const int err = errno;
    if ((err != EPIPE && err != ECONNRESET) || absl::Now() + backoff >= deadline) {
      errno = err;
      return Errno(absl::StatusCode::kUnavailable,
                   absl::StrCat("handoff socket ", socket_path, ": send"));
    }
    absl::SleepFor(backoff);
    backoff = std::min(backoff * 2, absl::Milliseconds(50));
  }
  const int fd = connection.get();
  v1::HandoffReply reply;
  std::vector<UniqueFd> received;
  absl::Status s = ReceiveReply(fd, socket_path, timeout, &reply, &received);
  if (s.ok() && reply.code() != 0) {
    s = absl::Status(static_cast<absl::StatusCode>(reply.code()), reply.message());
  } else if (s.ok() && received.empty() && request.kind() != v1::HANDOFF_KIND_DEPOSIT) {
    s = absl::InternalError(
        absl::StrCat("handoff socket ", socket_path, ": an OK reply without a descriptor"));
  }
  if (!s.ok()) return s;  // `received` closes what came
  Handoff handoff;
  handoff.deposit_id = reply.deposit_id();
  handoff.fds = std::move(received);
  handoff.bytes = reply.bytes();
  handoff.count = reply.count();
  handoff.pool_regions = std::move(*reply.mutable_pool_regions());
  if (request.kind() == v1::HANDOFF_KIND_FAST_PATH) handoff.connection = std::move(connection);
  return handoff;
}

}  // namespace kvhost
