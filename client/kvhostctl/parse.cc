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
  auto bad = [&](absl::string_view why) {
    return UsageError(absl::StrCat(FlagName(flag), " '", text, "' ", why,
                                   " (expected a number with an optional K, M, G or T suffix, "
                                   "e.g. 10G)"));
  };
  absl::string_view number = absl::StripAsciiWhitespace(text);
  if (absl::EndsWithIgnoreCase(number, "ib")) {
    number.remove_suffix(2);
  } else if (absl::EndsWithIgnoreCase(number, "b")) {
    number.remove_suffix(1);
  }
  // K, M, G, T: the unit's position in kUnits, times ten, is its power of two.
  constexpr absl::string_view kUnits = "KMGT";
  const size_t unit =
      number.empty() ? absl::string_view::npos : kUnits.find(absl::ascii_toupper(number.back()));
  int shift = 0;
  if (unit != absl::string_view::npos) {
    shift = 10 * static_cast<int>(unit + 1);
    number.remove_suffix(1);
  }
  if (number.empty() || number[0] == '-' || number[0] == '+') return bad("is not a size");
  if (absl::StrContains(number, '.')) {
    double value = 0;
    if (!absl::SimpleAtod(number, &value) || !std::isfinite(value)) return bad("is not a size");
    const double bytes = std::floor(std::ldexp(value, shift));
    // 2^64 is exactly representable; anything at or past it does not fit.
    if (bytes >= 18446744073709551616.0) return bad("is too large");
    return static_cast<uint64_t>(bytes);
  }
  uint64_t value = 0;
  if (!absl::SimpleAtoi(number, &value)) return bad("is not a size");
  if (value > (std::numeric_limits<uint64_t>::max() >> shift)) return bad("is too large");
  return value << shift;
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
