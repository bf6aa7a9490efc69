// Pool and pool group names: what a name may be, checked in one place for
// both (a group and a pool share one name space in the registry).
//
// Thread safety: pure functions. Nothing is owned.
#ifndef KVHOST_SERVER_POOL_NAMES_H_
#define KVHOST_SERVER_POOL_NAMES_H_

#include <cstddef>
#include <string>

#include "absl/status/status.h"

namespace kvhost {

// Longest pool or group name: it becomes part of a region file's name.
inline constexpr size_t kMaxPoolName = 64;

// OK when `name` is 1-64 characters of [A-Za-z0-9._-] not starting with '.';
// INVALID_ARGUMENT naming the rule it breaks otherwise.
absl::Status ValidatePoolName(const std::string& name);

}  // namespace kvhost

#endif  // KVHOST_SERVER_POOL_NAMES_H_
