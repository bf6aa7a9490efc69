#include "server/declared_pools.h"

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/bytes.h"
#include "server/pool/host_memory.h"
#include "spdlog/spdlog.h"

namespace kvhost {
namespace {

// The pool `spec` follows, or "" for one that follows none (spec.follows
// means something only for the kinds that need it).
std::string Followed(const PoolSpec& spec) {
  return NeedsFollows(spec.kind) ? spec.follows : std::string();
}

// The declared pools' creations, shared by their callbacks.
struct DeclaredCreations {
  PoolRegistry* registry = nullptr;
  // The declared followers of each pool, by its name. Set before the first
  // creation starts; read-only afterwards.
  std::map<std::string, DeclaredPoolSpecs> followers;
  absl::Mutex mu;
  // What each pool's creation came to, once it has ended.
  std::map<std::string, absl::Status> done ABSL_GUARDED_BY(mu);
};

// Logs every declared pool that follows `name` (and those that follow them)
// as not created: `name` was not.
void AbandonFollowers(DeclaredCreations& creations, const std::string& name) {
  auto it = creations.followers.find(name);
  if (it == creations.followers.end()) return;
  for (const auto& [follower, spec] : it->second) {
    spdlog::error("declared pool '{}' was not created: pool '{}' that it follows was not", follower,
                  name);
    {
      absl::MutexLock lock(&creations.mu);
      creations.done[follower] = absl::FailedPreconditionError(
          absl::StrCat("pool '", name, "' that it follows was not created"));
    }
    AbandonFollowers(creations, follower);
  }
}

// The end of declared pool `name`'s creation, begun at `start`: records and
// logs it, then creates the declared pools that follow it (or abandons them).
// Runs on the registry's thread that created `name`, and creates the
// followers on it too: a thread the registry joins (CancelCreations), so no
// creation outlives the registry, and one that the shutdown cuts short.
void Finished(DeclaredCreations& creations, const std::string& name, const PoolSpec& spec,
              absl::Time start, const absl::StatusOr<std::shared_ptr<Pool>>& pool) {
  {
    absl::MutexLock lock(&creations.mu);
    creations.done[name] = pool.status();
  }
  if (!pool.ok()) {
    spdlog::error("declared pool '{}' was not created: {}", name,
                  std::string(pool.status().message()));
    AbandonFollowers(creations, name);
    return;
  }
  spdlog::info(
      "created declared pool '{}': {}, {} tokens, {} in {} ({})", name, DescribeSpec(spec),
      (*pool)->size_tokens(), FormatBytesExact((*pool)->bytes()),
      (*pool)->region_paths().empty() ? std::string("no region") : (*pool)->region_paths()[0],
      absl::FormatDuration(absl::Now() - start));
  auto it = creations.followers.find(name);
  if (it == creations.followers.end()) return;
  for (const auto& [follower, follower_spec] : it->second) {
    spdlog::info("creating declared pool '{}' (follows '{}'): {}", follower, name,
                 DescribeSpec(follower_spec));
    const absl::Time follower_start = absl::Now();
    Finished(creations, follower, follower_spec, follower_start,
             creations.registry->Create(follower, follower_spec));
  }
}

// Waits until declared pool `name` is admitted (being created) or its
// creation has ended; returns its refusal. The checks take microseconds.
absl::Status WaitAdmitted(DeclaredCreations& creations, const std::string& name) {
  for (;;) {
    {
      absl::MutexLock lock(&creations.mu);
      if (auto it = creations.done.find(name); it != creations.done.end()) return it->second;
    }
    if (creations.registry->GetCreating(name)) return absl::OkStatus();
    absl::SleepFor(absl::Milliseconds(1));
  }
}

}  // namespace

absl::Status CheckDeclaredFollows(const DeclaredPoolSpecs& pools) {
  std::map<std::string, const PoolSpec*> by_name;
  for (const auto& [name, spec] : pools) by_name[name] = &spec;
  for (const auto& [name, spec] : pools) {
    const std::string followed = Followed(spec);
    if (followed.empty()) continue;
    auto it = by_name.find(followed);
    if (it == by_name.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("declared pool '", name, "': spec.follows names pool '", followed,
                       "', which is not declared; no other pool exists at start, so declare it too "
                       "(in any order)"));
    }
    const PoolSpec& followed_spec = *it->second;
    if (!CanFollow(spec.kind, followed_spec.kind)) {
      return absl::InvalidArgumentError(
          absl::StrCat("declared pool '", name, "': spec.follows '", followed, "' is a ",
                       PoolKindName(followed_spec.kind), " pool; ", PoolKindName(spec.kind),
                       " follows ", FollowableKinds(spec.kind), " pools"));
    }
    // Walk the chain of pools followed back to `name`: a cycle. (A cycle
    // that `name` only leads into is reported at an entry of its own.)
    std::vector<std::string> chain = {name};
    for (std::string at = followed; !at.empty() && chain.size() <= pools.size();) {
      chain.push_back(at);
      if (at == name) {
        return absl::InvalidArgumentError(
            absl::StrCat("declared pools follow one another in a cycle: '",
                         absl::StrJoin(chain, "' follows '"), "'; one of them must follow none"));
      }
      auto next = by_name.find(at);
      at = next == by_name.end() ? std::string() : Followed(*next->second);
    }
  }
  return absl::OkStatus();
}

absl::Status CreateDeclaredPools(PoolRegistry* registry, const DeclaredPoolSpecs& pools) {
  if (absl::Status s = CheckDeclaredFollows(pools); !s.ok()) return s;
  auto creations = std::make_shared<DeclaredCreations>();
  creations->registry = registry;
  for (const auto& [name, spec] : pools) {
    const std::string followed = Followed(spec);
    if (!followed.empty()) creations->followers[followed].emplace_back(name, spec);
  }
  for (const auto& [name, spec] : pools) {
    if (!Followed(spec).empty()) {
      spdlog::info("declared pool '{}' follows '{}': created once that pool is", name,
                   Followed(spec));
      continue;
    }
    creations->registry->CreateInBackground(
        name, spec, /*abandoned=*/{}, /*owner_token=*/"", /*follows_token=*/std::nullopt,
        [creations, name = name, spec = spec,
         start = absl::Now()](absl::StatusOr<std::shared_ptr<Pool>> pool) {
          Finished(*creations, name, spec, start, pool);
        });
    if (absl::Status s = WaitAdmitted(*creations, name); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("declared pool '", name, "': ", s.message()));
    }
    spdlog::info("creating declared pool '{}': {}", name, DescribeSpec(spec));
  }
  return absl::OkStatus();
}

}  // namespace kvhost
