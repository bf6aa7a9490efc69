// Parsing of kvhostctl's command-line values: enum names as flags write them,
// byte sizes with K/M/G/T suffixes, and token slots written as runs
// ("0-15,32-47"). Every refusal is a UsageError naming the bad value.
//
// Stateless functions; safe from any thread.
#ifndef KVHOST_CLIENT_KVHOSTCTL_PARSE_H_
#define KVHOST_CLIENT_KVHOSTCTL_PARSE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "google/protobuf/descriptor.h"

namespace kvhost::ctl {

// "--size-bytes" for "size_bytes": a flag as the user writes it.
std::string FlagName(absl::string_view underscored);

// An enum value written the way flags are: "page_first" or "page-first" for
// PAGE_FIRST, any case; the *_UNSPECIFIED value is refused. `flag` is the
// underscored flag name, for the message.
absl::StatusOr<int> ParseEnumFlag(absl::string_view flag, const std::string& text,
                                  const google::protobuf::EnumDescriptor* type);

// "10G", "512M", "1.5T", "4096", "64KiB": bytes, read as kvhostd reads its
// flags (ParseByteSize in common/cli_flags.h: K, M, G and T are powers of
// 1024; "GB" is refused as ambiguous); a usage error naming `flag`.
absl::StatusOr<uint64_t> ParseByteSize(absl::string_view flag, absl::string_view text);

// Token slots written as runs of consecutive slots ("0-15,32-47") and single
// slots ("5"), comma separated, in list order.
absl::StatusOr<std::vector<int64_t>> ParseRuns(absl::string_view text);

// The inverse of ParseRuns: maximal runs of consecutive slots, in list order.
std::string FormatRuns(absl::Span<const int64_t> slots);

// INDICES, the arguments after POOL: runs that may be split over several
// arguments ("0-15 32-47").
absl::StatusOr<std::vector<int64_t>> IndicesArg(const std::vector<std::string>& args);

// INDEX: one slot, the first of a page.
absl::StatusOr<int64_t> IndexArg(const std::string& text);

}  // namespace kvhost::ctl

#endif  // KVHOST_CLIENT_KVHOSTCTL_PARSE_H_
