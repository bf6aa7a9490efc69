// Ctrl-C for the long-running commands (demo, watch): a signal handler that
// only sets a flag, which their loops poll between steps so that they finish
// cleanly (the demo cleans up in the daemon, watch restores the cursor).
//
// Interrupted() is safe from any thread; call StopOn from the main thread.
#ifndef KVHOST_CLIENT_KVHOSTCTL_INTERRUPT_H_
#define KVHOST_CLIENT_KVHOSTCTL_INTERRUPT_H_

namespace kvhost::ctl {

// From now on `signal` (SIGINT, SIGTERM) sets the flag instead of ending the
// process.
void StopOn(int signal);

// Whether one of those signals has arrived.
bool Interrupted();

}  // namespace kvhost::ctl

#endif  // KVHOST_CLIENT_KVHOSTCTL_INTERRUPT_H_
