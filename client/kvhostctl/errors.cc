#include "client/kvhostctl/errors.h"

#include <cstdio>

#include "absl/strings/cord.h"
#include "absl/strings/str_format.h"

namespace kvhost::ctl {
namespace {

constexpr char kUsagePayload[] = "kvhostctl/usage";
constexpr char kMismatchPayload[] = "kvhostctl/mismatch";

}  // namespace

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
  absl::FPrintF(stderr, "error: %s: %s\n", absl::StatusCodeToString(status.code()),
                status.message());
  return kExitRpc;
}

}  // namespace kvhost::ctl
