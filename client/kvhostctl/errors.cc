#include "client/kvhostctl/errors.h"

#include <grp.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>

#include "absl/strings/cord.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace kvhost::ctl {
namespace {

constexpr char kUsagePayload[] = "kvhostctl/usage";
constexpr char kMismatchPayload[] = "kvhostctl/mismatch";
constexpr char kPartialPayload[] = "kvhostctl/partial";

// The socket path of a unix address ("unix:///p" or "unix:/p"), else "".
std::string UnixPath(const std::string& server) {
  if (absl::StartsWith(server, "unix://")) return server.substr(7);
  if (absl::StartsWith(server, "unix:")) return server.substr(5);
  return "";
}

// What to do when the unix socket `path` could not be reached.
std::string UnixHint(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) {
    return absl::StrCat("no socket at ", path,
                        ": is kvhostd running? (systemctl status kvhostd; its --listen names "
                        "the socket; point kvhostctl there with --server or KVHOST_SERVER)");
  }
  // Connecting to a unix socket needs write permission on it.
  if (::access(path.c_str(), W_OK) != 0 && errno == EACCES) {
    const struct group* g = ::getgrgid(st.st_gid);
    const std::string group = g != nullptr ? g->gr_name : absl::StrCat(st.st_gid);
    return absl::StrCat("permission denied on ", path, " (group ", group,
                        "): join that group (sudo usermod -aG ", group,
                        " $USER, then log in again; kvhostd's --socket-group sets it) or run as "
                        "root");
  }
  return absl::StrCat(path,
                      " exists but nothing answers there: is kvhostd running? (a socket file "
                      "left by a daemon that was killed; systemctl status kvhostd)");
}

// What to do when `server` could not be reached or dropped the call.
std::string ServerHint(const std::string& server, const absl::Status& status) {
  if (absl::StrContains(status.message(), "keepalive watchdog")) {
    return "kvhostd closed the connection because this process did not answer its keepalive "
           "ping in time (half of kvhostd's --session-timeout): a node too loaded, or kvhostctl "
           "stopped; retry, or raise --session-timeout";
  }
  const std::string path = UnixPath(server);
  if (!path.empty()) return UnixHint(path);
  return absl::StrCat("is kvhostd listening on ", server,
                      " (its --listen; TCP needs --tls-* or --insecure on both sides)? Point "
                      "kvhostctl elsewhere with --server or KVHOST_SERVER");
}

}  // namespace

absl::Status WithServerHint(const std::string& server, absl::Status status) {
  if (status.code() != absl::StatusCode::kUnavailable) return status;
  if (status.GetPayload(kPartialPayload).has_value()) return status;  // kvhostd answered
  const std::string hint = ServerHint(server, status);
  absl::Status hinted(status.code(), absl::StrCat(status.message(), "\n  hint: ", hint));
  status.ForEachPayload(
      [&](absl::string_view url, const absl::Cord& payload) { hinted.SetPayload(url, payload); });
  return hinted;
}

absl::Status UsageError(absl::string_view message) {
  absl::Status status = absl::InvalidArgumentError(message);
  status.SetPayload(kUsagePayload, absl::Cord());
  return status;
}

absl::Status MismatchError(absl::string_view message) {
  absl::Status status = absl::DataLossError(message);
  status.SetPayload(kMismatchPayload, absl::Cord());
  return status;
}

absl::Status PartialError(absl::string_view message) {
  absl::Status status = absl::UnavailableError(message);
  status.SetPayload(kPartialPayload, absl::Cord());
  return status;
}

bool IsMismatch(const absl::Status& status) {
  return status.GetPayload(kMismatchPayload).has_value();
}

int Report(const absl::Status& status) {
  if (status.ok()) return 0;
  if (status.GetPayload(kUsagePayload).has_value()) {
    absl::FPrintF(stderr, "usage error: %s\n(kvhostctl --help lists commands and flags)\n",
                  status.message());
    return kExitUsage;
  }
  if (IsMismatch(status)) {
    absl::FPrintF(stderr, "error: verification failed: %s\n", status.message());
    return kExitMismatch;
  }
  if (status.GetPayload(kPartialPayload).has_value()) {
    absl::FPrintF(stderr, "error: %s\n", status.message());
    return kExitPartial;
  }
  absl::FPrintF(stderr, "error: %s: %s\n", absl::StatusCodeToString(status.code()),
                status.message());
  return kExitRpc;
}

}  // namespace kvhost::ctl
