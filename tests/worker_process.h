// WorkerProcess: a worker program the test starts as a child of its own
// (execv, never a fork that keeps running gRPC), with its stdout on a pipe
// the test reads line by line, so that the test can wait for what the worker
// says it has done and then kill it. The child gets SIGKILL when the test
// process dies (PR_SET_PDEATHSIG); the destructor kills and reaps it.
//
// Used by session_integration_test (a host-backend worker killed
// mid-transfer) and worker_death_gpu_test (a GPU worker that owns the device
// memory, killed while kvhostd copies to and from it).
//
// Not thread-safe; one thread drives a WorkerProcess.
#ifndef KVHOST_TESTS_WORKER_PROCESS_H_
#define KVHOST_TESTS_WORKER_PROCESS_H_

#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace kvhost::testing {

class WorkerProcess {
 public:
  // Starts args[0] with `args` (pid() is -1 when fork or pipe failed).
  explicit WorkerProcess(const std::vector<std::string>& args) {
    int fds[2];
    if (::pipe(fds) != 0) return;
    pid_ = ::fork();
    if (pid_ == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      ::dup2(fds[1], 1);
      ::close(fds[0]);
      ::close(fds[1]);
      std::vector<std::string> copy = args;
      std::vector<char*> argv;
      for (std::string& a : copy) argv.push_back(a.data());
      argv.push_back(nullptr);
      ::execv(argv[0], argv.data());
      std::perror("execv worker");
      ::_exit(127);
    }
    ::close(fds[1]);
    out_ = fds[0];
  }
  ~WorkerProcess() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
    if (out_ >= 0) ::close(out_);
  }
  WorkerProcess(const WorkerProcess&) = delete;
  WorkerProcess& operator=(const WorkerProcess&) = delete;

  // Reads stdout until a line starting with `prefix` that no earlier call
  // returned (returned) or EOF / `timeout` ("" then; all output so far in
  // output()).
  std::string WaitFor(const std::string& prefix, absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    while (true) {
      size_t start = 0;
      for (size_t nl; (nl = output_.find('\n', start)) != std::string::npos; start = nl + 1) {
        std::string line = output_.substr(start, nl - start);
        if (absl::StartsWith(line, prefix) && seen_.insert(start).second) return line;
      }
      const int left = static_cast<int>(absl::ToInt64Milliseconds(deadline - absl::Now()));
      if (left <= 0) return "";
      pollfd p{out_, POLLIN, 0};
      if (::poll(&p, 1, left) <= 0) return "";
      char buf[4096];
      const ssize_t n = ::read(out_, buf, sizeof(buf));
      if (n <= 0) return "";
      output_.append(buf, static_cast<size_t>(n));
    }
  }
  // Exit status (or 128 + signal) once it ends.
  int Wait() {
    int status = 0;
    ::waitpid(pid_, &status, 0);
    pid_ = -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }
  void Kill() { ::kill(pid_, SIGKILL); }
  pid_t pid() const { return pid_; }
  const std::string& output() const { return output_; }

 private:
  pid_t pid_ = -1;
  int out_ = -1;
  std::string output_;
  std::set<size_t> seen_;
};

}  // namespace kvhost::testing

#endif  // KVHOST_TESTS_WORKER_PROCESS_H_
