// kvhostd's YAML config file (--config): the same settings as the flags, plus
// pools to create at start.
//
// The file's top-level keys are flag names, in either spelling (memory_limit or
// memory-limit); each value is what the flag would take (a string, number or
// boolean; a flag holding a list, such as listen, also takes a YAML list).
// Precedence: a flag given on the command line (or in a --flagfile named
// there) wins over the file, and the file wins over the defaults. The key
// `pools` declares pools by name and kvhost.v1.PoolSpec (its proto field
// names); they are created as CreatePool would create them.
//
// Call from main() after ParseFlags and before any thread starts; not
// thread-safe (it sets Abseil flags).
#ifndef KVHOST_SERVER_CONFIG_H_
#define KVHOST_SERVER_CONFIG_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kvhost/v1/pool.pb.h"
#include "server/pool/pool_spec.h"

namespace kvhost {

// A pool the config file declares.
struct DeclaredPool {
  std::string name;
  v1::PoolSpec proto;  // as written in the file
  PoolSpec spec;       // proto converted as CreatePool converts it (FromProto)
};

// Reads the YAML file at `path` and sets every flag it names that was not
// given on the command line. Only flags defined in a source file whose path
// ends with `flags_file` ("server/main.cc") may appear, besides `pools`.
// Returns the declared pools. INVALID_ARGUMENT "<path>:<line>: ..." naming
// the key for an unreadable or malformed file, an unknown key, a value of the
// wrong type, or a pool spec FromProto refuses (flags may be half set then:
// the caller exits).
absl::StatusOr<std::vector<DeclaredPool>> LoadConfigFile(const std::string& path,
                                                         const std::string& flags_file);

// The effective configuration as YAML that LoadConfigFile accepts back: every
// flag of `flags_file` with its current value (except `skip`, e.g. config
// itself), then `pools`.
std::string FormatConfig(const std::string& flags_file, const std::vector<std::string>& skip,
                         const std::vector<DeclaredPool>& pools);

}  // namespace kvhost

#endif  // KVHOST_SERVER_CONFIG_H_
