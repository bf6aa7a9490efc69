#include "client/kvhostctl/parse.h"

#include <cmath>
#include <limits>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "client/kvhostctl/errors.h"
#include "common/cli_flags.h"

namespace kvhost::ctl {
namespace {

// Index lists past this many entries would exceed the client's 64 MiB message
// limit anyway; refusing them here keeps a typo ("0-99999999999") from
// exhausting memory first.
constexpr uint64_t kMaxListedSlots = uint64_t{1} << 26;

}  // namespace

std::string FlagName(absl::string_view underscored) {
  return absl::StrCat("--", absl::StrReplaceAll(underscored, {{"_", "-"}}));
}

absl::StatusOr<int> ParseEnumFlag(absl::string_view flag, const std::string& text,
                                  const google::protobuf::EnumDescriptor* type) {
  const std::string name = absl::AsciiStrToUpper(absl::StrReplaceAll(text, {{"-", "_"}}));
  const google::protobuf::EnumValueDescriptor* value = type->FindValueByName(name);
  if (value != nullptr && value->number() != 0) return value->number();
  std::vector<std::string> names;
  for (int i = 0; i < type->value_count(); ++i) {
    if (type->value(i)->number() != 0)
      names.push_back(absl::AsciiStrToLower(type->value(i)->name()));
  }
  return UsageError(
      absl::StrCat(FlagName(flag), " '", text, "' is not one of ", absl::StrJoin(names, ", ")));
}

absl::StatusOr<uint64_t> ParseByteSize(absl::string_view flag, absl::string_view text) {
  // kvhostd's flags and kvhostctl's read sizes the same way (one parser).
  absl::StatusOr<uint64_t> bytes = ::kvhost::ParseByteSize(text);
  if (!bytes.ok()) {
    return UsageError(absl::StrCat(FlagName(flag), ": ", bytes.status().message(),
                                   " (e.g. 10G, 512MiB or 4096)"));
  }
  return bytes;
}

absl::StatusOr<std::vector<int64_t>> ParseRuns(absl::string_view text) {
  std::vector<int64_t> slots;
  for (absl::string_view item : absl::StrSplit(text, ',')) {
    auto bad = [&](absl::string_view why) {
      return UsageError(absl::StrCat("INDICES '", text, "': '", item, "' ", why,
                                     " (write runs and slots like 0-15,32-47,64)"));
    };
    if (item.empty()) return bad("is empty");
    const std::vector<absl::string_view> ends = absl::StrSplit(item, absl::MaxSplits('-', 1));
    int64_t first = 0;
    int64_t last = 0;
    if (!absl::SimpleAtoi(ends[0], &first) || first < 0 || ends[0][0] == '+') {
      return bad("is not a slot or a run");
    }
    last = first;
    if (ends.size() == 2 && (!absl::SimpleAtoi(ends[1], &last) || ends[1].empty() ||
                             ends[1][0] == '+' || ends[1][0] == '-')) {
      return bad("is not a slot or a run");
    }
    if (last < first) return bad("runs backwards");
    if (slots.size() + static_cast<uint64_t>(last - first) + 1 > kMaxListedSlots) {
      return bad(absl::StrCat("makes the list longer than ", kMaxListedSlots, " slots"));
    }
    for (int64_t slot = first; slot <= last; ++slot) slots.push_back(slot);
  }
  return slots;
}

std::string FormatRuns(absl::Span<const int64_t> slots) {
  std::string out;
  for (size_t i = 0; i < slots.size();) {
    size_t j = i + 1;
    while (j < slots.size() && slots[j] == slots[j - 1] + 1) ++j;
    if (!out.empty()) out += ',';
    absl::StrAppend(&out, slots[i]);
    if (j - i > 1) absl::StrAppend(&out, "-", slots[j - 1]);
    i = j;
  }
  return out;
}

absl::StatusOr<std::vector<int64_t>> IndicesArg(const std::vector<std::string>& args) {
  return ParseRuns(absl::StrJoin(args.begin() + 1, args.end(), ","));
}

absl::StatusOr<int64_t> IndexArg(const std::string& text) {
  int64_t index = 0;
  if (!absl::SimpleAtoi(text, &index) || index < 0) {
    return UsageError(absl::StrCat("INDEX '", text, "' is not a slot (the first slot of a page)"));
  }
  return index;
}

}  // namespace kvhost::ctl
