// groups, group, create-group, delete-group: pool groups, one model's pools
// under one name.
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "client/kvhostctl/commands.h"
#include "client/kvhostctl/errors.h"
#include "client/kvhostctl/output.h"
#include "client/kvhostctl/spec_flags.h"

// Repeatable: main.cc's CheckFlags collects every value (GivenFlags::entries).
ABSL_FLAG(std::string, entry, "",
          "create-group: one entry NAME:POOL[:anchor][:map=L0,L1,...] (a device layer of POOL "
          "or -1 per model layer; no map: the identity); repeat the flag per entry.");

namespace kvhost::ctl {
namespace {

// "0,-1,1" as a layer map.
std::string MapText(const v1::PoolEntry& entry) { return absl::StrJoin(entry.layer_map(), ","); }

void PrintGroup(const v1::PoolGroup& g) {
  PrintLine(absl::StrFormat("group '%s': %d model layers, %d entries, anchor '%s'", g.name(),
                            g.layer_num(), g.entries_size(), g.anchor()));
  std::vector<std::vector<std::string>> rows = {{"ENTRY", "POOL", "ANCHOR", "LAYER_MAP"}};
  for (const v1::PoolEntry& e : g.entries()) {
    rows.push_back({e.name(), e.pool(), e.anchor() ? "yes" : "-", MapText(e)});
  }
  PrintTable(rows, "llll", "  ");
  PrintLine(absl::StrFormat("  %d attachment(s)", g.attachments()));
}

void ShowGroup(const Context& ctx, const v1::PoolGroup& group) {
  if (ctx.json) {
    PrintLine(MessageJson(group));
  } else {
    PrintGroup(group);
  }
}

// "--entry" NAME:POOL[:anchor][:map=0,-1,1]
absl::StatusOr<v1::PoolEntry> ParseEntry(const std::string& text) {
  const auto bad = [&](absl::string_view why) {
    return UsageError(
        absl::StrCat("--entry '", text, "': ", why, "; write NAME:POOL[:anchor][:map=0,-1,1,...]"));
  };
  std::vector<std::string> parts = absl::StrSplit(text, ':');
  if (parts.size() < 2 || parts[0].empty() || parts[1].empty()) {
    return bad("needs an entry name and a pool");
  }
  v1::PoolEntry entry;
  entry.set_name(parts[0]);
  entry.set_pool(parts[1]);
  bool mapped = false;
  for (size_t i = 2; i < parts.size(); ++i) {
    const std::string& part = parts[i];
    if (part == "anchor" && !entry.anchor()) {
      entry.set_anchor(true);
    } else if (absl::StartsWith(part, "map=") && !mapped) {
      mapped = true;
      for (absl::string_view v : absl::StrSplit(part.substr(4), ',')) {
        int32_t layer = 0;
        if (!absl::SimpleAtoi(v, &layer)) {
          return bad(absl::StrCat("map value '", v, "' is not a layer number or -1"));
        }
        entry.add_layer_map(layer);
      }
    } else {
      return bad(absl::StrCat("'", part, "' is not 'anchor' or 'map=...' (each at most once)"));
    }
  }
  return entry;
}

}  // namespace

absl::Status RunGroups(Context& ctx, const Args&) {
  absl::StatusOr<std::vector<v1::PoolGroup>> groups = ctx.client->ListPoolGroups();
  if (!groups.ok()) return groups.status();
  if (ctx.json) {
    v1::ListPoolGroupsResponse response;
    for (const v1::PoolGroup& g : *groups) *response.add_groups() = g;
    PrintLine(MessageJson(response));
    return absl::OkStatus();
  }
  if (groups->empty()) {
    PrintLine("no pool groups");
    return absl::OkStatus();
  }
  std::vector<std::vector<std::string>> rows = {{"NAME", "LAYERS", "ANCHOR", "ATTACH", "ENTRIES"}};
  for (const v1::PoolGroup& g : *groups) {
    std::vector<std::string> entries;
    for (const v1::PoolEntry& e : g.entries()) entries.push_back(e.name() + "=" + e.pool());
    rows.push_back({g.name(), absl::StrCat(g.layer_num()), g.anchor(),
                    absl::StrCat(g.attachments()), absl::StrJoin(entries, " ")});
  }
  PrintTable(rows, "lrlrl");
  return absl::OkStatus();
}

absl::Status RunGroup(Context& ctx, const Args& args) {
  absl::StatusOr<v1::PoolGroup> group = ctx.client->GetPoolGroup(args[0]);
  if (!group.ok()) return group.status();
  ShowGroup(ctx, *group);
  return absl::OkStatus();
}

absl::Status RunCreateGroup(Context& ctx, const Args& args) {
  const uint32_t layers = absl::GetFlag(FLAGS_layers);
  if (layers == 0) return UsageError("create-group needs --layers (the model's layers)");
  if (ctx.given.entries.empty()) {
    return UsageError("create-group needs --entry=NAME:POOL[:anchor][:map=...] per pool");
  }
  std::vector<v1::PoolEntry> entries;
  for (const std::string& text : ctx.given.entries) {
    absl::StatusOr<v1::PoolEntry> entry = ParseEntry(text);
    if (!entry.ok()) return entry.status();
    entries.push_back(*std::move(entry));
  }
  absl::StatusOr<v1::PoolGroup> group = ctx.client->CreatePoolGroup(args[0], layers, entries);
  if (!group.ok()) return group.status();
  ShowGroup(ctx, *group);
  return absl::OkStatus();
}

absl::Status RunDeleteGroup(Context& ctx, const Args& args) {
  if (absl::Status s = ctx.client->DeletePoolGroup(args[0]); !s.ok()) return s;
  if (ctx.json) {
    PrintLine(JsonObject().Str("deleted_group", args[0]).str());
  } else {
    PrintLine(absl::StrFormat("deleted pool group '%s' (its pools stay)", args[0]));
  }
  return absl::OkStatus();
}

}  // namespace kvhost::ctl
