// HandoffStub: a stand-in for kvhostd's handoff socket (the other end of
// client/handoff.h) inside the test process, for the unit tests of the
// client modules that use it (handoff_test, layer_progress_test,
// deposit_test). A SOCK_SEQPACKET unix socket in a private directory; its
// thread takes one connection at a time, reads one kvhost.v1.HandoffRequest
// and the descriptors sent with it (recorded: the request, and each
// descriptor's inode; the descriptors are then closed), and answers as the
// test's handler says: a HandoffReply with descriptors, raw bytes, a close
// without a reply, or silence until the stub goes.
//
// Memfd and OpenMemfds: the files such tests hand over, and a count of the
// descriptors of this process that name one (no descriptor leaked).
//
// Header only, for test binaries. The handler runs on the stub's thread;
// requests() may be read from any thread. The descriptors an Answer names
// stay the test's (sendmsg copies them).
#ifndef KVHOST_TESTS_HANDOFF_STUB_H_
#define KVHOST_TESTS_HANDOFF_STUB_H_

#include <dirent.h>
#include <poll.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "kvhost/v1/handoff.pb.h"

namespace kvhost::testing {

// A memfd called `name` of `bytes` bytes (-1 when it cannot be made).
inline int Memfd(const std::string& name, uint64_t bytes) {
  const int fd = ::memfd_create(name.c_str(), MFD_CLOEXEC);
  if (fd >= 0 && ::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// How many descriptors of this process name a memfd called `name`; -1
// when /proc/self/fd cannot be read.
inline int OpenMemfds(const std::string& name) {
  DIR* dir = ::opendir("/proc/self/fd");
  if (dir == nullptr) return -1;
  int n = 0;
  const std::string want = absl::StrCat("/memfd:", name, " ");
  while (dirent* e = ::readdir(dir)) {
    char target[512] = {};
    const std::string link = absl::StrCat("/proc/self/fd/", e->d_name);
    if (::readlink(link.c_str(), target, sizeof(target) - 1) > 0 &&
        absl::StrContains(target, want)) {
      ++n;
    }
  }
  ::closedir(dir);
  return n;
}

class HandoffStub {
 public:
  struct Answer {
    enum class Kind { kReply, kRaw, kClose, kSilent };
    Kind kind = Kind::kReply;
    v1::HandoffReply reply;  // kReply
    std::string raw;         // kRaw: these bytes are the reply
    std::vector<int> fds;    // sent with the reply (kReply, kRaw)
  };
  // What one connection asked: its request and the inodes of the
  // descriptors that came with it, in order.
  struct Received {
    v1::HandoffRequest request;
    std::vector<ino_t> inodes;
  };
  using Handler = std::function<Answer(const Received&)>;

  explicit HandoffStub(Handler handler) : handler_(std::move(handler)) {
    std::string dir = "/tmp/kvhost-handoff-stub-XXXXXX";
    if (::mkdtemp(dir.data()) == nullptr) return;
    dir_ = dir;
    path_ = dir + "/handoff.sock";
    listener_ = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::memcpy(addr.sun_path, path_.c_str(), path_.size() + 1);
    if (listener_ < 0 || ::bind(listener_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
        ::listen(listener_, 16) != 0) {
      path_.clear();
      return;
    }
    thread_ = std::thread([this] { Serve(); });
  }
  ~HandoffStub() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
    for (int fd : silent_) ::close(fd);
    if (listener_ >= 0) ::close(listener_);
    std::error_code ec;
    if (!dir_.empty()) std::filesystem::remove_all(dir_, ec);
  }
  HandoffStub(const HandoffStub&) = delete;
  HandoffStub& operator=(const HandoffStub&) = delete;

  // The socket's path; empty when it could not be made.
  const std::string& path() const { return path_; }
  std::vector<Received> received() const {
    absl::MutexLock lock(&mu_);
    return received_;
  }

  // A reply with `code` and `message` (0: OK).
  static Answer Reply(int code, const std::string& message = "") {
    Answer a;
    a.reply.set_code(code);
    a.reply.set_message(message);
    return a;
  }

 private:
  void Serve() {
    while (!stop_) {
      pollfd ready = {listener_, POLLIN, 0};
      if (::poll(&ready, 1, 20) <= 0) continue;
      const int connection = ::accept4(listener_, nullptr, nullptr, SOCK_CLOEXEC);
      if (connection < 0) continue;
      pollfd in = {connection, POLLIN, 0};
      if (::poll(&in, 1, 5000) <= 0) {
        ::close(connection);
        continue;
      }
      Received got;
      std::vector<int> fds;
      char buffer[65536];
      iovec iov{buffer, sizeof(buffer)};
      alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 256)] = {};
      msghdr msg{};
      msg.msg_iov = &iov;
      msg.msg_iovlen = 1;
      msg.msg_control = control;
      msg.msg_controllen = sizeof(control);
      const ssize_t n = ::recvmsg(connection, &msg, MSG_CMSG_CLOEXEC);
      for (cmsghdr* c = CMSG_FIRSTHDR(&msg); n >= 0 && c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
        for (size_t i = 0; i < (c->cmsg_len - CMSG_LEN(0)) / sizeof(int); ++i) {
          int fd = -1;
          std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
          fds.push_back(fd);
        }
      }
      for (int fd : fds) {
        struct stat st {};
        got.inodes.push_back(::fstat(fd, &st) == 0 ? st.st_ino : 0);
        ::close(fd);
      }
      if (n > 0) got.request.ParseFromArray(buffer, static_cast<int>(n));
      {
        absl::MutexLock lock(&mu_);
        received_.push_back(got);
      }
      const Answer answer = handler_(got);
      if (answer.kind == Answer::Kind::kSilent) {
        silent_.push_back(connection);
        continue;
      }
      if (answer.kind != Answer::Kind::kClose) Send(connection, answer);
      ::close(connection);
    }
  }

  static void Send(int connection, const Answer& answer) {
    std::string bytes =
        answer.kind == Answer::Kind::kRaw ? answer.raw : answer.reply.SerializeAsString();
    iovec iov{bytes.data(), bytes.size()};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    std::vector<char> control(CMSG_SPACE(sizeof(int) * answer.fds.size()));
    if (!answer.fds.empty()) {
      msg.msg_control = control.data();
      msg.msg_controllen = control.size();
      cmsghdr* c = CMSG_FIRSTHDR(&msg);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int) * answer.fds.size());
      std::memcpy(CMSG_DATA(c), answer.fds.data(), sizeof(int) * answer.fds.size());
    }
    ::sendmsg(connection, &msg, MSG_NOSIGNAL);
  }

  const Handler handler_;
  std::string dir_;
  std::string path_;
  int listener_ = -1;
  std::atomic<bool> stop_{false};
  std::vector<int> silent_;  // the stub thread's until it is joined
  mutable absl::Mutex mu_;
  std::vector<Received> received_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

}  // namespace kvhost::testing

#endif  // KVHOST_TESTS_HANDOFF_STUB_H_
