#include "client/kvhostctl/interrupt.h"

#include <signal.h>

#include <atomic>

namespace kvhost::ctl {
namespace {

std::atomic<bool> g_interrupted{false};

void OnInterrupt(int) { g_interrupted.store(true); }

}  // namespace

void StopOn(int signal) {
  struct sigaction action = {};
  action.sa_handler = OnInterrupt;
  sigaction(signal, &action, nullptr);
}

bool Interrupted() { return g_interrupted.load(); }

}  // namespace kvhost::ctl
