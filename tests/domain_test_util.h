// Helpers shared by the unit tests of the domain (pool, registry, pool
// groups, populate, transfer, concurrency), which drive it without a daemon:
// a status's message as a string for matchers, a registry's options on a
// host with room for every pool a test creates, and AttachDevice's steps.
//
// Header only, for test binaries; the helpers keep no state.
#ifndef KVHOST_TESTS_DOMAIN_TEST_UTIL_H_
#define KVHOST_TESTS_DOMAIN_TEST_UTIL_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/pool/host_memory.h"
#include "server/pool/registry.h"

namespace kvhost::testing {

inline std::string Msg(const absl::Status& s) { return std::string(s.message()); }

// A registry's options for `shm_dir` on a host of 1 TiB, half of it
// available: room for every pool the tests create.
inline RegistryOptions RoomyRegistryOptions(const std::string& shm_dir) {
  RegistryOptions o;
  o.shm_dir = shm_dir;
  o.read_memory = []() -> absl::StatusOr<MemorySnapshot> {
    MemorySnapshot s;
    s.mem_total = uint64_t{1} << 40;
    s.mem_available = uint64_t{1} << 39;
    return s;
  };
  return o;
}

// AttachDevice's two steps without a daemon: `name` resolved and owner-checked
// once (PoolRegistry::Resolve with `token`, null for none), then what it
// resolved to attached (TransferManager::Attach; a template, so that tests
// without a transfer manager need not link one).
template <typename Manager, typename Request>
auto AttachByName(Manager& manager, const PoolRegistry& registry, const std::string& name,
                  const Request& request, const std::string* token = nullptr)
    -> decltype(manager.Attach(PoolTarget{}, request)) {
  absl::StatusOr<PoolTarget> target = registry.Resolve(name, token);
  if (!target.ok()) return target.status();
  return manager.Attach(*target, request);
}

}  // namespace kvhost::testing

#endif  // KVHOST_TESTS_DOMAIN_TEST_UTIL_H_
