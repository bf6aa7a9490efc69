// TestDaemon: runs kvhostd as a subprocess on a private unix socket and a
// private shm directory, for integration tests and benchmarks. The daemon is
// stopped with SIGTERM when the object goes, and Stop() reports how it ended.
// StartKvhostd / StopKvhostd: a kvhostd on a socket the test picks, for
// restarts in its place; ReadFile: a whole file, for logs.
//
// Not thread-safe; one TestDaemon per test (or per suite, where its tests
// only read).
#ifndef KVHOST_TESTS_DAEMON_FIXTURE_H_
#define KVHOST_TESTS_DAEMON_FIXTURE_H_

#include <signal.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kvhost/client.h"

namespace kvhost::testing {

#ifdef KVHOSTD_BUILD_PATH
// The kvhostd to test: $KVHOST_KVHOSTD when set (a bundle run elsewhere than
// where it was built), else the one this build made.
inline const char* KvhostdPath() {
  static const std::string path = [] {
    const char* env = std::getenv("KVHOST_KVHOSTD");
    return std::string(env != nullptr && *env != '\0' ? env : KVHOSTD_BUILD_PATH);
  }();
  return path.c_str();
}
#endif

// gRPC polls an idle client channel only from its backup poller (every 5 s
// by default), and kvhostd's graceful shutdown waits until the idle channels
// have seen its GOAWAY: every program with a TestDaemon polls often, so each
// daemon stops at once. Set before main(), unless the environment sets it.
[[maybe_unused]] inline const bool kFastBackupPoller = [] {
  ::setenv("GRPC_CLIENT_CHANNEL_BACKUP_POLL_INTERVAL_MS", "20", /*overwrite=*/0);
  return true;
}();

// The whole file at `path`; empty when it cannot be read.
inline std::string ReadFile(const std::string& path) {
  std::string text;
  if (FILE* f = std::fopen(path.c_str(), "rb")) {
    char buf[4096];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) text.append(buf, n);
    std::fclose(f);
  }
  return text;
}

#ifdef KVHOSTD_PATH
// kvhostd on a socket the test picks, so that a second one can take the
// first one's place (a restart), logging to `log`; `config` names a --config
// file when not empty. No wait for it to serve; StopKvhostd ends it.
inline pid_t StartKvhostd(const std::string& socket, const std::string& shm_dir,
                          const std::string& log, const std::string& config = "") {
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGTERM);
    FILE* f = std::freopen(log.c_str(), "a", stderr);
    (void)f;
    std::vector<std::string> args = {KVHOSTD_PATH, absl::StrCat("--listen=unix://", socket),
                                     absl::StrCat("--shm-dir=", shm_dir), "--backend=host"};
    if (!config.empty()) args.push_back(absl::StrCat("--config=", config));
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  return pid;
}
#endif

// SIGTERM to a StartKvhostd daemon, then waits; its exit code (or 128 + signal).
inline int StopKvhostd(pid_t pid) {
  ::kill(pid, SIGTERM);
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

class TestDaemon {
 public:
  // Starts `kvhostd` (path) with `extra_flags` added; waits until it serves.
  // `descriptor_limit` > 0: its RLIMIT_NOFILE, soft and hard (so kvhostd
  // cannot raise it).
  static absl::StatusOr<std::unique_ptr<TestDaemon>> Start(
      const std::string& kvhostd, std::vector<std::string> extra_flags = {},
      rlim_t descriptor_limit = 0) {
    std::unique_ptr<TestDaemon> d(new TestDaemon());
    char dir_template[] = "/tmp/kvhost-test-XXXXXX";
    if (::mkdtemp(dir_template) == nullptr) return absl::InternalError("mkdtemp failed");
    d->dir_ = dir_template;
    char shm_template[] = "/dev/shm/kvhost-test-XXXXXX";
    if (::mkdtemp(shm_template) == nullptr)
      return absl::InternalError("mkdtemp in /dev/shm failed");
    d->shm_dir_ = shm_template;
    d->address_ = absl::StrCat("unix://", d->dir_, "/kvhost.sock");
    d->log_path_ = absl::StrCat(d->dir_, "/kvhostd.log");
    std::vector<std::string> args = {kvhostd, absl::StrCat("--listen=", d->address_),
                                     absl::StrCat("--shm-dir=", d->shm_dir_), "--backend=host",
                                     "--log-level=debug"};
    for (std::string& flag : extra_flags) args.push_back(std::move(flag));
    d->pid_ = ::fork();
    if (d->pid_ < 0) return absl::InternalError("fork failed");
    if (d->pid_ == 0) {
      // The daemon goes with the test, even when the test is killed.
      ::prctl(PR_SET_PDEATHSIG, SIGTERM);
      FILE* log = std::freopen(d->log_path_.c_str(), "w", stderr);
      (void)log;
      ::dup2(2, 1);
      const rlimit limit{descriptor_limit, descriptor_limit};
      if (descriptor_limit > 0 && ::setrlimit(RLIMIT_NOFILE, &limit) != 0) {
        std::perror("setrlimit RLIMIT_NOFILE");
        ::_exit(127);
      }
      std::vector<char*> argv;
      for (std::string& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      ::execv(argv[0], argv.data());
      std::perror("execv kvhostd");
      ::_exit(127);
    }
    // Connect once the socket exists: a channel that finds no socket backs
    // off for a second before it tries again.
    const std::string socket_path = d->address_.substr(7);
    for (int i = 0; i < 2000 && !std::filesystem::exists(socket_path); ++i) {
      int status = 0;
      if (::waitpid(d->pid_, &status, WNOHANG) == d->pid_) {
        d->pid_ = -1;
        return absl::UnavailableError(
            absl::StrCat("kvhostd exited during start\n--- kvhostd log ---\n", d->Log()));
      }
      absl::SleepFor(absl::Milliseconds(10));
    }
    ClientOptions options;
    options.address = d->address_;
    options.timeout = absl::Seconds(30);
    absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(options);
    if (!client.ok()) return client.status();
    d->client_ = *std::move(client);
    if (absl::Status s = d->client_->WaitForReady(absl::Seconds(20)); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat(s.message(), "\n--- kvhostd log ---\n", d->Log()));
    }
    return d;
  }

  ~TestDaemon() {
    if (pid_ > 0) (void)Stop();
    // A sanitized kvhostd (scripts/sanitize.sh) that reported an error fails
    // the test, even when the error did not change what the test saw.
    const std::string daemon_log = Log();
    const char* report = nullptr;
    for (const char* marker : {"ERROR: AddressSanitizer", "ERROR: LeakSanitizer",
                               "WARNING: ThreadSanitizer", ": runtime error: "}) {
      if (daemon_log.find(marker) != std::string::npos) report = marker;
    }
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
    std::filesystem::remove_all(shm_dir_, ec);
    if (report != nullptr) {
      std::fprintf(stderr, "kvhostd made a sanitizer report (%s)\n--- kvhostd log ---\n%s\n",
                   report, daemon_log.c_str());
      std::abort();
    }
  }

  // SIGTERM, then waits; returns the exit code (or 128 + signal).
  int Stop(int signal = SIGTERM) {
    if (pid_ <= 0) return exit_code_;
    ::kill(pid_, signal);
    int status = 0;
    ::waitpid(pid_, &status, 0);
    pid_ = -1;
    exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    return exit_code_;
  }

  std::string Log() const { return ReadFile(log_path_); }

  Client& client() { return *client_; }
  const std::string& address() const { return address_; }
  const std::string& shm_dir() const { return shm_dir_; }
  pid_t pid() const { return pid_; }

 private:
  TestDaemon() = default;
  std::string dir_, shm_dir_, address_, log_path_;
  pid_t pid_ = -1;
  int exit_code_ = -1;
  std::unique_ptr<Client> client_;
};

}  // namespace kvhost::testing

#endif  // KVHOST_TESTS_DAEMON_FIXTURE_H_
