// The L3 tier's commands (kvhost.v1.StorageService; kvhostd --l3-memcached):
// l3-store and l3-fetch move pages between a pool and the cache, each page
// given as INDEX=KEY (its first slot and its key); l3-exist prints how many
// of the keys, from the first, are stored in the pool's namespace. A store or
// fetch that did fewer pages than asked exits 4 (errors.h), after every
// page's outcome.
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/kvhostctl/commands.h"
#include "client/kvhostctl/errors.h"
#include "client/kvhostctl/output.h"
#include "client/kvhostctl/parse.h"

namespace kvhost::ctl {
namespace {

struct PageKeys {
  std::vector<int64_t> indices;
  std::vector<std::string> keys;
};

// args[1..] as INDEX=KEY (the key is everything after the first '=').
absl::StatusOr<PageKeys> ParsePageKeys(const char* command, const Args& args) {
  PageKeys out;
  for (size_t i = 1; i < args.size(); ++i) {
    const size_t eq = args[i].find('=');
    if (eq == std::string::npos || eq + 1 == args[i].size()) {
      return UsageError(
          absl::StrCat(command, ": '", args[i], "' is not INDEX=KEY (a page's first slot = key)"));
    }
    absl::StatusOr<int64_t> index = IndexArg(args[i].substr(0, eq));
    if (!index.ok()) return index.status();
    out.indices.push_back(*index);
    out.keys.push_back(args[i].substr(eq + 1));
  }
  return out;
}

// One line per page (or a JSON object with a "pages" array), then the count.
void PrintPages(const Context& ctx, const std::string& pool, const PageKeys& pages,
                const google::protobuf::RepeatedPtrField<v1::PageResult>& results,
                const char* count_name, uint64_t count, uint64_t bytes) {
  if (ctx.json) {
    std::vector<std::string> items;
    for (int i = 0; i < results.size(); ++i) {
      items.push_back(JsonObject()
                          .Int("index", pages.indices[i])
                          .Str("key", pages.keys[i])
                          .Str("outcome", v1::PageOutcome_Name(results[i].outcome()))
                          .Str("detail", results[i].detail())
                          .str());
    }
    PrintLine(JsonObject()
                  .Str("pool", pool)
                  .Raw("pages", cli::JsonArray(items))
                  .Uint(count_name, count)
                  .Uint("bytes", bytes)
                  .str());
    return;
  }
  for (int i = 0; i < results.size(); ++i) {
    const v1::PageResult& r = results[i];
    PrintLine(absl::StrFormat("  %d = %s: %s%s", pages.indices[i], pages.keys[i],
                              v1::PageOutcome_Name(r.outcome()),
                              r.detail().empty() ? "" : absl::StrCat(" (", r.detail(), ")")));
  }
  PrintLine(absl::StrFormat("%d of %d page(s) %s, %d bytes (pool '%s')", count, results.size(),
                            count_name, bytes, pool));
}

// OK when all `asked` pages were `done` ("stored", "hit"), else the exit-4
// error naming how many were not.
absl::Status AllPages(const char* command, const char* done, uint64_t count, int asked) {
  if (count >= static_cast<uint64_t>(asked)) return absl::OkStatus();
  return PartialError(absl::StrFormat("%s: %d of %d page(s) not %s (see each page's outcome)",
                                      command, asked - static_cast<int>(count), asked, done));
}

}  // namespace

absl::Status RunL3Store(Context& ctx, const Args& args) {
  absl::StatusOr<PageKeys> pages = ParsePageKeys("l3-store", args);
  if (!pages.ok()) return pages.status();
  absl::StatusOr<v1::StorePagesResponse> r =
      ctx.client->StorePages(args[0], pages->indices, pages->keys);
  if (!r.ok()) return r.status();
  PrintPages(ctx, args[0], *pages, r->pages(), "stored", r->stored_pages(), r->stored_bytes());
  return AllPages("l3-store", "stored", r->stored_pages(), static_cast<int>(pages->indices.size()));
}

absl::Status RunL3Fetch(Context& ctx, const Args& args) {
  absl::StatusOr<PageKeys> pages = ParsePageKeys("l3-fetch", args);
  if (!pages.ok()) return pages.status();
  absl::StatusOr<v1::FetchPagesResponse> r =
      ctx.client->FetchPages(args[0], pages->keys, pages->indices);
  if (!r.ok()) return r.status();
  PrintPages(ctx, args[0], *pages, r->pages(), "hit", r->hit_pages(), r->hit_bytes());
  return AllPages("l3-fetch", "fetched", r->hit_pages(), static_cast<int>(pages->indices.size()));
}

absl::Status RunL3Exist(Context& ctx, const Args& args) {
  const std::vector<std::string> keys(args.begin() + 1, args.end());
  absl::StatusOr<uint64_t> prefix = ctx.client->ExistPages(args[0], keys);
  if (!prefix.ok()) return prefix.status();
  if (ctx.json) {
    PrintLine(JsonObject().Uint("prefix_pages", *prefix).Uint("keys", keys.size()).str());
  } else {
    PrintLine(absl::StrFormat("%d of %d key(s) stored, from the first", *prefix, keys.size()));
  }
  return absl::OkStatus();
}

}  // namespace kvhost::ctl
