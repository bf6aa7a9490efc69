// kvhostctl's exit codes and the statuses it makes itself. Exit codes: 0
// done; 1 an RPC failed ("error: CODE: message" on stderr); 2 a usage error;
// 3 the demo read back other bytes than it had written; 4 a page call
// (l3-store, l3-fetch) answered, but stored or fetched fewer pages than
// asked (each page's outcome is on stdout).
//
// Statuses made here rather than by the daemon carry a payload that says
// which of these they are, so that Report can turn any status into its exit
// code. Stateless; safe from any thread.
#ifndef KVHOST_CLIENT_KVHOSTCTL_ERRORS_H_
#define KVHOST_CLIENT_KVHOSTCTL_ERRORS_H_

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace kvhost::ctl {

constexpr int kExitRpc = 1;
constexpr int kExitUsage = 2;
constexpr int kExitMismatch = 3;
constexpr int kExitPartial = 4;

// A bad command line: exit code 2.
absl::Status UsageError(absl::string_view message);

// The demo read back other bytes than it wrote: exit code 3.
absl::Status MismatchError(absl::string_view message);
bool IsMismatch(const absl::Status& status);

// A page call did fewer pages than asked: exit code 4.
absl::Status PartialError(absl::string_view message);

// `status` of a call to kvhostd at `server` (kvhostctl's --server), with
// what to do appended when it is UNAVAILABLE because nothing could be
// reached there: no socket file (is kvhostd running, and where does it
// listen?), a socket nobody listens on, one this user may not open (join its
// group), or a TCP address that does not answer. Other statuses unchanged.
absl::Status WithServerHint(const std::string& server, absl::Status status);

// Prints why `status` failed (nothing when ok) and returns the exit code it
// stands for.
int Report(const absl::Status& status);

}  // namespace kvhost::ctl

#endif  // KVHOST_CLIENT_KVHOSTCTL_ERRORS_H_
