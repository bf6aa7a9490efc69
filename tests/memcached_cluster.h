// MemcachedCluster: memcached servers on 127.0.0.1 free ports, run as
// subprocesses for the L3 tier's integration tests and benchmark, that a
// test may kill and restart (empty) one at a time. Each server is
// `memcached -p PORT -U 0 -l 127.0.0.1 -m 64` (with -u root when run as
// root); the binary is found on PATH or in /usr/bin.
//
// Not thread-safe; servers go with the object (SIGKILL) or with the test
// process (PR_SET_PDEATHSIG).
//
// L3SecretFile: the fleet secret every kvhostd with --l3-memcached needs
// (--l3-secret-file), written 0600 into a fresh temporary directory and
// removed with the object. kvhostds of one test share one, as a fleet does.
#ifndef KVHOST_TESTS_MEMCACHED_CLUSTER_H_
#define KVHOST_TESTS_MEMCACHED_CLUSTER_H_

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"

namespace kvhost::testing {

// The memcached binary, or "" when there is none (tests then skip).
inline std::string MemcachedBinary() {
  const char* path = std::getenv("PATH");
  std::vector<std::string> dirs = absl::StrSplit(path != nullptr ? path : "", ':');
  dirs.push_back("/usr/bin");
  for (const std::string& dir : dirs) {
    const std::string candidate = dir + "/memcached";
    if (!dir.empty() && ::access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return "";
}

inline constexpr char kNoMemcached[] =
    "no memcached binary on PATH or in /usr/bin (Debian package memcached; "
    "scripts/setup.sh installs it)";

// A TCP port on 127.0.0.1 nobody listens on now (the kernel's pick).
inline int FreePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  int port = -1;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
  ::close(fd);
  return port;
}

inline bool Accepts(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  const bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  ::close(fd);
  return ok;
}

class MemcachedCluster {
 public:
  // `servers` servers of `megabytes` MiB each, all accepting connections.
  static absl::StatusOr<std::unique_ptr<MemcachedCluster>> Start(int servers, int megabytes = 64) {
    std::unique_ptr<MemcachedCluster> c(new MemcachedCluster());
    c->binary_ = MemcachedBinary();
    if (c->binary_.empty()) return absl::NotFoundError(kNoMemcached);
    c->megabytes_ = megabytes;
    for (int i = 0; i < servers; ++i) {
      c->ports_.push_back(FreePort());
      c->pids_.push_back(-1);
      if (absl::Status s = c->Restart(i); !s.ok()) return s;
    }
    return c;
  }

  ~MemcachedCluster() {
    for (size_t i = 0; i < pids_.size(); ++i) Kill(static_cast<int>(i));
  }

  // "127.0.0.1:p1,127.0.0.1:p2,..." for --l3-memcached.
  std::string Servers() const {
    std::vector<std::string> out;
    for (const int port : ports_) out.push_back(absl::StrCat("127.0.0.1:", port));
    return absl::StrJoin(out, ",");
  }
  int port(int i) const { return ports_[i]; }
  int size() const { return static_cast<int>(ports_.size()); }

  // SIGKILL to server i (a crash: no goodbye to its clients).
  void Kill(int i) {
    if (pids_[i] <= 0) return;
    ::kill(pids_[i], SIGKILL);
    int status = 0;
    ::waitpid(pids_[i], &status, 0);
    pids_[i] = -1;
  }

  // SIGSTOP / SIGCONT to server i: a server that hangs (its port still
  // accepts, nothing answers) and comes back.
  void Pause(int i) {
    if (pids_[i] > 0) ::kill(pids_[i], SIGSTOP);
  }
  void Resume(int i) {
    if (pids_[i] > 0) ::kill(pids_[i], SIGCONT);
  }

  // Starts server i again on its port, empty; waits until it accepts.
  absl::Status Restart(int i) {
    Kill(i);
    std::vector<std::string> args = {binary_,     "-p", absl::StrCat(ports_[i]), "-U", "0", "-l",
                                     "127.0.0.1", "-m", absl::StrCat(megabytes_)};
    if (::geteuid() == 0) {
      args.push_back("-u");
      args.push_back("root");
    }
    const pid_t pid = ::fork();
    if (pid < 0) return absl::InternalError("fork failed");
    if (pid == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      std::vector<char*> argv;
      for (std::string& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      ::execv(argv[0], argv.data());
      ::_exit(127);
    }
    pids_[i] = pid;
    for (int tries = 0; tries < 500; ++tries) {
      if (Accepts(ports_[i])) return absl::OkStatus();
      int status = 0;
      if (::waitpid(pid, &status, WNOHANG) == pid) {
        pids_[i] = -1;
        return absl::UnavailableError(
            absl::StrCat("memcached on port ", ports_[i], " exited at start (port taken?)"));
      }
      absl::SleepFor(absl::Milliseconds(10));
    }
    return absl::DeadlineExceededError(
        absl::StrCat("memcached on port ", ports_[i], " does not accept connections"));
  }

 private:
  MemcachedCluster() = default;
  std::string binary_;
  int megabytes_ = 64;
  std::vector<int> ports_;
  std::vector<pid_t> pids_;
};

class L3SecretFile {
 public:
  static constexpr char kDefaultSecret[] = "kvhost test fleet secret: 32 bytes or more";

  // `mode` other than 0600: a file kvhostd must refuse.
  explicit L3SecretFile(std::string secret = kDefaultSecret, mode_t mode = 0600)
      : secret_(std::move(secret)) {
    std::string dir = (std::filesystem::temp_directory_path() / "kvhost-l3-XXXXXX").string();
    if (::mkdtemp(dir.data()) == nullptr) std::abort();
    dir_ = dir;
    path_ = dir_ + "/l3.secret";
    const int fd = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0 ||
        ::write(fd, secret_.data(), secret_.size()) != static_cast<ssize_t>(secret_.size())) {
      std::abort();
    }
    ::fchmod(fd, mode);
    ::close(fd);
  }
  ~L3SecretFile() {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  L3SecretFile(const L3SecretFile&) = delete;
  L3SecretFile& operator=(const L3SecretFile&) = delete;

  const std::string& path() const { return path_; }
  const std::string& secret() const { return secret_; }
  std::string Flag() const { return "--l3-secret-file=" + path_; }

 private:
  std::string secret_;
  std::string dir_;
  std::string path_;
};

}  // namespace kvhost::testing

#endif  // KVHOST_TESTS_MEMCACHED_CLUSTER_H_
