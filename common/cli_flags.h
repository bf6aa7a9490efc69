// Command-line conventions shared by kvhostd, kvhostctl and the benchmarks:
// flags are written with hyphens (--shm-dir) as operators expect, while Abseil
// names them with underscores (shm_dir); and --help lists the program's own
// flags in the hyphen form with their defaults.
//
// A program names its own flags by where they are defined: one source file
// ("server/main.cc"), or a folder ("client/kvhostctl/") for a program whose
// flags live in several files.
//
// A flag file (--flagfile) takes the underscore spelling only; ParseFlags
// says so, naming the line, instead of Abseil's "Unknown command line flag".
// Byte sizes in flags (ParseByteSize) are in powers of 1024.
//
// Call ParseFlags from main() before any thread starts.
#ifndef KVHOST_COMMON_CLI_FLAGS_H_
#define KVHOST_COMMON_CLI_FLAGS_H_

#include <string>
#include <vector>

#include <cstdint>

#include "absl/flags/commandlineflag.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvhost {

// Whether `flag` is defined in `flags_source`: a source file whose path ends
// with it ("server/main.cc"), or, when it ends with '/', a file directly in a
// folder whose path ends with it ("client/kvhostctl/").
bool FlagDefinedIn(const absl::CommandLineFlag& flag, absl::string_view flags_source);

// Parses argv (accepting --foo-bar for --foo_bar). On --help / -h prints
// `usage` and every flag defined in `flags_source` (FlagDefinedIn), then
// exits 0. Returns the positional arguments (argv[0] first).
std::vector<std::string> ParseFlags(int argc, char** argv, const std::string& usage,
                                    const std::string& flags_source);

// Parses a byte size for flags: "0", "123", "64K", "10G", "10GiB", "1.5G",
// "512MiB", "2T". K, M, G and T are powers of 1024, optionally followed by
// "iB"; a bare "B" means bytes; case-insensitive; surrounding whitespace and
// spaces before the unit are allowed. "KB", "MB", "GB" and "TB" are refused
// as ambiguous (powers of 1000 to some), the message saying what to write. A fraction needs a unit
// and is truncated to whole bytes. INVALID_ARGUMENT naming the text on bad or
// negative input or when the value does not fit in 64 bits.
absl::StatusOr<uint64_t> ParseByteSize(absl::string_view text);

// `bytes` as ParseByteSize reads it back exactly, in the largest unit that
// divides it: 1073741824 -> "1G", 65536 -> "64K", 1000 -> "1000" (a flag's
// default written from the option struct that holds it).
std::string FormatByteSize(uint64_t bytes);

}  // namespace kvhost

#endif  // KVHOST_COMMON_CLI_FLAGS_H_
