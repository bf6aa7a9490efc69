// status and health: the daemon as a whole.
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/kvhostctl/commands.h"
#include "client/kvhostctl/output.h"

namespace kvhost::ctl {
namespace {

void PrintStatusJson(const Context& ctx, const std::string& health, const v1::DaemonStatus& daemon,
                     const std::vector<v1::Pool>& pools) {
  std::vector<std::string> usage;
  for (const v1::Pool& pool : pools) usage.push_back(PoolUsageJson(pool).str());
  PrintLine(JsonObject()
                .Str("server", ctx.server)
                .Str("health", health)
                .Str("backend", daemon.backend())
                .Uint("pools", pools.size())
                .Uint("total_bytes", daemon.pool_bytes())
                .Raw("daemon", MessageJson(daemon))
                .Raw("pool_usage", absl::StrCat("[", absl::StrJoin(usage, ","), "]"))
                .str());
}

void PrintPoolUsage(const std::vector<v1::Pool>& pools) {
  PrintLine(absl::StrFormat("pools:   %d", pools.size()));
  if (pools.empty()) return;
  std::vector<std::vector<std::string>> rows = {
      {"POOL", "STATE", "USED", "AVAILABLE", "TOKENS", "USED%", "ATTACH"}};
  for (const v1::Pool& pool : pools) {
    rows.push_back(
        {pool.name(), StateOf(pool), absl::StrCat(UsedTokens(pool)),
         pool.state() == v1::CREATING ? std::string("-") : absl::StrCat(pool.available_tokens()),
         absl::StrCat(pool.size_tokens()), UsedPercentText(pool),
         absl::StrCat(pool.attachments())});
  }
  PrintTable(rows, "llrrrrr", "  ");
}

// "L3:      1 of 2 memcached server(s) up", then a line per server down.
void PrintL3(const v1::DaemonStatus& daemon) {
  if (daemon.l3_servers().empty()) {
    PrintLine("L3:      off (no --l3-memcached)");
    return;
  }
  int up = 0;
  for (const v1::L3Server& server : daemon.l3_servers()) up += server.up() ? 1 : 0;
  PrintLine(
      absl::StrFormat("L3:      %d of %d memcached server(s) up", up, daemon.l3_servers_size()));
  for (const v1::L3Server& server : daemon.l3_servers()) {
    if (server.up()) continue;
    PrintLine(absl::StrFormat("  %s down for %ds: %s", server.address(), server.since_s(),
                              server.error()));
  }
}

void PrintStatusText(const Context& ctx, const std::string& health, const v1::DaemonStatus& daemon,
                     const std::vector<v1::Pool>& pools) {
  PrintLine(absl::StrFormat("kvhostd %s at %s: %s (pid %d, up %ds)", daemon.version(), ctx.server,
                            health, daemon.pid(), daemon.uptime_s()));
  PrintLine(absl::StrCat("backend: ", daemon.backend(), " (", daemon.backend_detail(), ")"));
  PrintLine(absl::StrFormat(
      "memory:  %s GiB in pools, %s GiB more available (limit %s, reserve %s GiB)",
      Gib(daemon.pool_bytes()), Gib(daemon.memory_available_bytes()),
      daemon.memory_limit_bytes() > 0 ? absl::StrCat(Gib(daemon.memory_limit_bytes()), " GiB")
                                      : std::string("none"),
      Gib(daemon.memory_reserve_bytes())));
  PrintLine(absl::StrFormat(
      "transfers: %d attachment(s), %d ticket(s) in flight, %d done, %d "
      "failed; %s GiB backed up, %s GiB loaded",
      daemon.attachments(), daemon.tickets_in_flight(), daemon.tickets_done(),
      daemon.tickets_failed(), Gib(daemon.backup_bytes()), Gib(daemon.load_bytes())));
  PrintLine(absl::StrFormat(
      "instance: %s%s", daemon.instance_id(),
      daemon.declared_pools().empty()
          ? ""
          : absl::StrCat(" (declared pools: ", absl::StrJoin(daemon.declared_pools(), ", "), ")")));
  for (const v1::PoolProgress& p : daemon.pools_creating()) {
    PrintLine(absl::StrFormat(
        "filling: pool '%s', %s of %s GiB (%d %%)", p.name(), Gib(p.populated_bytes()),
        Gib(p.bytes()), p.bytes() ? static_cast<int>(100.0 * p.populated_bytes() / p.bytes()) : 0));
  }
  PrintL3(daemon);
  PrintLine(absl::StrFormat("sessions: %d", daemon.sessions_size()));
  for (const v1::SessionInfo& session : daemon.sessions()) {
    PrintLine(absl::StrFormat("  worker '%s' pid %d (%s), %d attachment(s), %ds old",
                              session.worker(), session.pid(), session.peer(),
                              session.attachment_count(), session.age_s()));
  }
  PrintPoolUsage(pools);
}

}  // namespace

absl::Status RunHealth(Context& ctx, const Args& args) {
  const std::string service = args.empty() ? "" : args[0];
  absl::StatusOr<std::string> health = ctx.client->Health(service);
  if (!health.ok()) return health.status();
  if (ctx.json) {
    PrintLine(JsonObject()
                  .Str("server", ctx.server)
                  .Str("service", service)
                  .Str("health", *health)
                  .str());
  } else {
    PrintLine(*health);
  }
  if (*health != "SERVING") {
    return absl::UnavailableError(
        absl::StrCat("kvhostd at ", ctx.server, " is ", *health,
                     service.empty() ? "" : absl::StrCat(" for ", service)));
  }
  return absl::OkStatus();
}

absl::Status RunStatus(Context& ctx, const Args&) {
  absl::StatusOr<std::string> health = ctx.client->Health();
  if (!health.ok()) return health.status();
  absl::StatusOr<v1::DaemonStatus> daemon = ctx.client->GetStatus();
  if (!daemon.ok()) return daemon.status();
  absl::StatusOr<std::vector<v1::Pool>> pools = ctx.client->ListPools();
  if (!pools.ok()) return pools.status();
  if (ctx.json) {
    PrintStatusJson(ctx, *health, *daemon, *pools);
  } else {
    PrintStatusText(ctx, *health, *daemon, *pools);
  }
  if (*health != "SERVING") {
    // Scripts wait for a usable daemon with `until kvhostctl status; ...`.
    return absl::UnavailableError(absl::StrCat("kvhostd at ", ctx.server, " reports ", *health));
  }
  return absl::OkStatus();
}

}  // namespace kvhost::ctl
