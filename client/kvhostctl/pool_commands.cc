// pools, pool, create-pool, delete-pool.
#include <unistd.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/kvhostctl/commands.h"
#include "client/kvhostctl/output.h"
#include "client/kvhostctl/progress_line.h"
#include "client/kvhostctl/spec_flags.h"

namespace kvhost::ctl {
namespace {

void PrintComponents(const v1::Pool& pool) {
  if (pool.components_size() == 0) return;
  std::vector<std::vector<std::string>> rows = {
      {"COMPONENT", "REGION", "OFFSET", "BYTES", "ROW", "PER"}};
  for (const v1::PoolComponent& c : pool.components()) {
    rows.push_back({c.name(), absl::StrCat(c.region_index()), absl::StrCat(c.offset()),
                    absl::StrCat(c.bytes()), absl::StrCat(c.row_bytes()),
                    c.row_tokens() > 1 ? absl::StrCat("page (", c.row_tokens(), " slots)")
                                       : std::string("token")});
  }
  PrintTable(rows, "lrrrrl", "  ");
}

void PrintPool(const v1::Pool& pool) {
  const v1::PoolSpec& spec = pool.spec();
  PrintLine(absl::StrFormat("pool '%s': %s, page %d, %d layers, %s", pool.name(), ShapeOf(spec),
                            spec.page_size(), spec.layer_num(), DimsOf(spec)));
  if (pool.state() == v1::CREATING) {
    PrintLine(absl::StrFormat("  state %s: %s of %s GiB reserved and mapped", StateOf(pool),
                              Gib(pool.populated_bytes()), Gib(pool.bytes())));
  }
  PrintLine(absl::StrFormat(
      "  %d tokens (%d pages), %d available, %d bytes per token, %d bytes per page, %s GiB",
      pool.size_tokens(), pool.page_num(), pool.available_tokens(), pool.bytes_per_token(),
      pool.bytes_per_page(), Gib(pool.bytes())));
  if (pool.end_layer() > pool.start_layer() && pool.start_layer() != 0) {
    PrintLine(absl::StrFormat("  device layers [%d,%d)", pool.start_layer(), pool.end_layer()));
  }
  if (!pool.follows().empty()) {
    PrintLine(absl::StrFormat("  follows '%s' (its page space; no allocator of its own)",
                              pool.follows()));
  } else if (spec.kind() == v1::V4_STATE) {
    PrintLine("  no allocator");
  }
  if (!pool.followers().empty()) {
    PrintLine(absl::StrCat("  followed by ", absl::StrJoin(pool.followers(), ", ")));
  }
  if (!pool.group().empty()) {
    PrintLine(absl::StrFormat("  in group '%s' (delete the group before the pool)", pool.group()));
  }
  if (pool.owner_protected()) {
    PrintLine("  owner-protected (changes and data reads need its token: --token / KVHOST_TOKEN)");
  }
  if (pool.has_holder()) {
    const v1::PoolHolder& holder = pool.holder();
    PrintLine(absl::StrFormat("  held by sglang instance '%s', generation %d (%s)",
                              holder.instance_id(), holder.generation(),
                              holder.live() ? "live: other sessions' Alloc / Free refused"
                                            : "its session ended: the next claim reclaims"));
  }
  if (pool.replica_ranks() > 0) {
    PrintLine(absl::StrFormat("  replicas %d (TP ranks attached), %s GiB saved",
                              pool.replica_ranks(), Gib(pool.bytes_saved())));
  }
  for (const std::string& path : pool.region_paths()) PrintLine(absl::StrCat("  region: ", path));
  PrintComponents(pool);
  PrintLine(absl::StrFormat("  backend: %s, %d attachment(s)", pool.backend(), pool.attachments()));
}

void ShowPool(const Context& ctx, const v1::Pool& pool) {
  if (ctx.json) {
    PrintLine(MessageJson(pool));
  } else {
    PrintPool(pool);
  }
}

// The slowest fill a CreatePool deadline allows for: a quarter of what the
// 2-core dev VM did (8 GiB in 24.7 s, ~330 MiB/s; issue 31), for a machine
// busier than that.
constexpr double kSlowestFillBytesPerSecond = 80.0 * (1 << 20);

// CreatePool's deadline: --timeout when given; else the default --timeout
// plus the time to fill the pool at kSlowestFillBytesPerSecond, the pool's
// bytes being --size-bytes when given and otherwise at most what the daemon
// has available (no larger pool is admitted).
absl::Duration CreateDeadline(Context& ctx, const v1::PoolSpec& spec) {
  if (ctx.given.names.count("timeout") > 0) return ctx.timeout;
  uint64_t bytes = spec.size_bytes();
  if (bytes == 0) {
    absl::StatusOr<v1::DaemonStatus> daemon = ctx.client->GetStatus();
    if (daemon.ok()) bytes = daemon->memory_available_bytes();
  }
  return ctx.timeout + absl::Seconds(static_cast<double>(bytes) / kSlowestFillBytesPerSecond);
}

// CreatePool, with a progress line while kvhostd fills the pool, on a client
// whose deadline is CreateDeadline's.
absl::StatusOr<v1::Pool> CreateWithProgress(Context& ctx, const std::string& name,
                                            const v1::PoolSpec& spec) {
  ClientOptions options = ctx.options;
  options.timeout = CreateDeadline(ctx, spec);
  absl::StatusOr<std::unique_ptr<Client>> creator = Client::Connect(options);
  if (!creator.ok()) return creator.status();
  // GetPool shows the pool CREATING with its populated bytes meanwhile;
  // polled on a client of its own, the CreatePool call runs on this one.
  absl::StatusOr<std::unique_ptr<Client>> poller = Client::Connect(ctx.options);
  ProgressLine line(absl::StrCat("creating pool '", name, "'"),
                    [&]() -> std::optional<std::pair<uint64_t, uint64_t>> {
                      if (!poller.ok()) return std::nullopt;
                      absl::StatusOr<v1::Pool> p = (*poller)->GetPool(name);
                      if (!p.ok() || p->state() != v1::CREATING) return std::nullopt;
                      return std::make_pair(p->populated_bytes(), p->bytes());
                    });
  return (*creator)->CreatePool(name, spec);
}

// The name is free at once; the memory is unmapped in the background. On a
// terminal, show it go (GetStatus pool_bytes_releasing), for at most the call
// timeout.
void ShowRelease(Context& ctx, const std::string& name, uint64_t released) {
  const absl::Time until = absl::Now() + ctx.timeout;
  ProgressLine line(absl::StrCat("releasing pool '", name, "'"),
                    [&]() -> std::optional<std::pair<uint64_t, uint64_t>> {
                      absl::StatusOr<v1::DaemonStatus> d = ctx.client->GetStatus();
                      if (!d.ok()) return std::nullopt;
                      const uint64_t left = std::min(d->pool_bytes_releasing(), released);
                      return std::make_pair(released - left, released);
                    });
  for (;;) {
    absl::StatusOr<v1::DaemonStatus> d = ctx.client->GetStatus();
    if (!d.ok() || d->pool_bytes_releasing() == 0 || absl::Now() > until) break;
    absl::SleepFor(absl::Milliseconds(100));
  }
}

}  // namespace

absl::Status RunPools(Context& ctx, const Args&) {
  absl::StatusOr<std::vector<v1::Pool>> pools = ctx.client->ListPools();
  if (!pools.ok()) return pools.status();
  if (ctx.json) {
    v1::ListPoolsResponse response;
    for (const v1::Pool& pool : *pools) *response.add_pools() = pool;
    PrintLine(MessageJson(response));
    return absl::OkStatus();
  }
  if (pools->empty()) {
    PrintLine("no pools");
    return absl::OkStatus();
  }
  std::vector<std::vector<std::string>> rows = {{"NAME", "STATE", "KIND/LAYOUT/DTYPE", "PAGE",
                                                 "LAYERS", "TOKENS", "USED%", "GIB", "ATTACH",
                                                 "GROUP", "FOLLOWS"}};
  for (const v1::Pool& pool : *pools) {
    rows.push_back(
        {pool.name(), StateOf(pool), ShapeOf(pool.spec()), absl::StrCat(pool.spec().page_size()),
         LayersOf(pool), absl::StrCat(pool.size_tokens()), UsedPercentText(pool), Gib(pool.bytes()),
         absl::StrCat(pool.attachments()), pool.group().empty() ? std::string("-") : pool.group(),
         pool.follows().empty() ? std::string("-") : pool.follows()});
  }
  PrintTable(rows, "lllrrrrrrll");
  return absl::OkStatus();
}

absl::Status RunPool(Context& ctx, const Args& args) {
  absl::StatusOr<v1::Pool> pool = ctx.client->GetPool(args[0]);
  if (!pool.ok()) return pool.status();
  ShowPool(ctx, *pool);
  return absl::OkStatus();
}

absl::Status RunCreatePool(Context& ctx, const Args& args) {
  absl::StatusOr<v1::PoolSpec> spec = SpecFromFlags(ctx.given.names);
  if (!spec.ok()) return spec.status();
  if (absl::Status s = CheckSpecComplete(*spec); !s.ok()) return s;
  absl::StatusOr<v1::Pool> pool = CreateWithProgress(ctx, args[0], *spec);
  if (pool.status().code() == absl::StatusCode::kDeadlineExceeded) {
    // kvhostd stops populating within a chunk once the call is given up, and
    // the pool is then not created.
    return absl::DeadlineExceededError(absl::StrCat(
        pool.status().message(), "; pool '", args[0],
        "' was not created (the machine fills pools slower than the deadline allowed: give a "
        "longer --timeout, in seconds)"));
  }
  if (!pool.ok()) return pool.status();
  ShowPool(ctx, *pool);
  return absl::OkStatus();
}

absl::Status RunDeletePool(Context& ctx, const Args& args) {
  absl::StatusOr<uint64_t> released = ctx.client->DeletePool(args[0]);
  if (!released.ok()) return released.status();
  if (ctx.json) {
    v1::DeletePoolResponse response;
    response.set_bytes_released(*released);
    PrintLine(MessageJson(response));
  } else {
    PrintLine(absl::StrFormat("deleted pool '%s' (%s GiB released)", args[0], Gib(*released)));
  }
  if (::isatty(2) && *released > 0) ShowRelease(ctx, args[0], *released);
  return absl::OkStatus();
}

}  // namespace kvhost::ctl
