// Declared pools: the pools kvhostd creates at start (the config file's
// `pools`, DaemonOptions::pools), in an order that works whatever the file's.
//
// A pool that follows none is admitted at once (name, spec and memory budget
// checked by the registry) and fills in the background, so the daemon serves
// while large pools fill. A follower (spec.follows) needs the pool it follows
// filled (the registry refuses a follower of a pool still being created), so
// it is created once that pool's creation has ended, on the same background
// thread: until then GetPool answers NOT_FOUND for it and GetStatus lists it
// among `declared_pools`; while it fills, it is CREATING like any other. A
// pool whose creation fails is logged as an error and is absent, and so is
// every declared pool that follows it.
//
// CheckDeclaredFollows is the start's structural check (a follower of a pool
// the file does not declare, a cycle, a kind that cannot follow the other);
// the registry makes every other check when it creates the pool.
// Thread safety: CreateDeclaredPools is called once, before the server
// starts; the creations it leaves running, followers included, run on the
// registry's threads (PoolRegistry::CancelCreations stops and joins them).
#ifndef KVHOST_SERVER_DECLARED_POOLS_H_
#define KVHOST_SERVER_DECLARED_POOLS_H_

#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "server/pool/pool_spec.h"
#include "server/pool/registry.h"

namespace kvhost {

using DeclaredPoolSpecs = std::vector<std::pair<std::string, PoolSpec>>;

// INVALID_ARGUMENT naming the pool when a declared follower follows a pool
// that is not declared (no other pool exists at start), when followers form
// a cycle, or when its kind cannot follow the followed pool's kind.
absl::Status CheckDeclaredFollows(const DeclaredPoolSpecs& pools);

// CheckDeclaredFollows, then admits every declared pool that follows none,
// in the file's order, and arranges each follower's creation for when the
// pool it follows has been created. Returns the first refusal ("declared
// pool 'x': ..."); the pools admitted before it are left to the registry.
// REQUIRES: `registry` outlives the creations (its destructor joins them).
absl::Status CreateDeclaredPools(PoolRegistry* registry, const DeclaredPoolSpecs& pools);

}  // namespace kvhost

#endif  // KVHOST_SERVER_DECLARED_POOLS_H_
