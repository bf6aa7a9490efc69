// Command-line conventions shared by kvhostd and kvhostctl: flags are written
// with hyphens (--shm-dir) as operators expect, while Abseil names them with
// underscores (shm_dir); and --help lists the program's own flags in the
// hyphen form with their defaults.
//
// Call ParseFlags from main() before any thread starts.
#ifndef KVHOST_CLIENT_CLI_FLAGS_H_
#define KVHOST_CLIENT_CLI_FLAGS_H_

#include <string>
#include <vector>

namespace kvhost {

// Parses argv (accepting --foo-bar for --foo_bar). On --help / -h prints
// `usage` and every flag defined in a source file whose path ends with
// `flags_file` ("server/main.cc"), then exits 0. Returns the positional
// arguments (argv[0] first).
std::vector<std::string> ParseFlags(int argc, char** argv, const std::string& usage,
                                    const std::string& flags_file);

}  // namespace kvhost

#endif  // KVHOST_CLIENT_CLI_FLAGS_H_
