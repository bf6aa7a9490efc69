// alloc and free: token slots of a pool, written as runs ("0-15,32-47").
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/kvhostctl/commands.h"
#include "client/kvhostctl/errors.h"
#include "client/kvhostctl/output.h"
#include "client/kvhostctl/parse.h"

namespace kvhost::ctl {

absl::Status RunAlloc(Context& ctx, const Args& args) {
  uint64_t tokens = 0;
  if (!absl::SimpleAtoi(args[1], &tokens) || tokens == 0) {
    return UsageError(absl::StrCat("alloc: N '", args[1], "' is not a positive number of tokens"));
  }
  absl::StatusOr<std::vector<int64_t>> slots = ctx.client->Alloc(args[0], tokens);
  if (!slots.ok()) return slots.status();
  if (ctx.json) {
    PrintLine(JsonObject()
                  .Str("pool", args[0])
                  .Raw("indices", absl::StrCat("[", absl::StrJoin(*slots, ","), "]"))
                  .Str("runs", FormatRuns(*slots))
                  .str());
  } else {
    // Just the runs, so that `free POOL "$(kvhostctl alloc POOL N)"` works.
    PrintLine(FormatRuns(*slots));
  }
  return absl::OkStatus();
}

absl::Status RunFree(Context& ctx, const Args& args) {
  absl::StatusOr<std::vector<int64_t>> slots = IndicesArg(args);
  if (!slots.ok()) return slots.status();
  absl::StatusOr<uint64_t> freed = ctx.client->Free(args[0], *slots);
  if (!freed.ok()) return freed.status();
  if (ctx.json) {
    PrintLine(JsonObject().Str("pool", args[0]).Uint("freed", *freed).str());
  } else {
    PrintLine(absl::StrFormat("freed %d token slot(s) of pool '%s'", *freed, args[0]));
  }
  return absl::OkStatus();
}

}  // namespace kvhost::ctl
