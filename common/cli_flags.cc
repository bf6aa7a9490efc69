#include "common/cli_flags.h"

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <map>

#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/numeric/int128.h"
#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"

namespace kvhost {
namespace {

std::string Hyphens(absl::string_view name) { return absl::StrReplaceAll(name, {{"_", "-"}}); }

void PrintHelp(const std::string& usage, const std::string& flags_source) {
  std::printf("%s\n\nFlags:\n", usage.c_str());
  std::map<std::string, const absl::CommandLineFlag*> own;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (FlagDefinedIn(*flag, flags_source)) own[Hyphens(name)] = flag;
  }
  for (const auto& [name, flag] : own) {
    std::printf("  --%s (default: \"%s\")\n      %s\n", name.c_str(), flag->DefaultValue().c_str(),
                flag->Help().c_str());
  }
}

// Abseil reads flag files itself and knows only the underscore spelling;
// for a hyphenated name there it says "Unknown command line flag" and no
// more. So each flag file named on the command line is read first, and a
// hyphenated name in it stops the program with the spelling to use.
void CheckFlagFileSpelling(absl::string_view files) {
  for (absl::string_view file : absl::StrSplit(files, ',', absl::SkipEmpty())) {
    std::ifstream in{std::string(file)};
    std::string line;
    for (int number = 1; std::getline(in, line); ++number) {
      absl::string_view text = absl::StripAsciiWhitespace(line);
      if (!absl::StartsWith(text, "--")) continue;
      const absl::string_view name = text.substr(2, text.find('=') - 2);
      if (!absl::StrContains(name, '-')) continue;
      std::fprintf(stderr,
                   "ERROR: flag file %s, line %d: --%s: a flag file takes the underscore "
                   "spelling, --%s (hyphens work on the command line only)\n",
                   std::string(file).c_str(), number, std::string(name).c_str(),
                   absl::StrReplaceAll(name, {{"-", "_"}}).c_str());
      std::exit(1);
    }
  }
}

}  // namespace

bool FlagDefinedIn(const absl::CommandLineFlag& flag, absl::string_view flags_source) {
  const std::string filename = flag.Filename();
  if (!absl::EndsWith(flags_source, "/")) return absl::EndsWith(filename, flags_source);
  const size_t slash = filename.rfind('/');
  if (slash == std::string::npos) return false;
  return absl::EndsWith(absl::string_view(filename).substr(0, slash + 1), flags_source);
}

std::vector<std::string> ParseFlags(int argc, char** argv, const std::string& usage,
                                    const std::string& flags_source) {
  std::vector<std::string> args(argv, argv + argc);
  for (size_t i = 1; i < args.size(); ++i) {
    std::string& arg = args[i];
    if (arg == "--") break;
    if (arg == "--help" || arg == "-h" || arg == "-help") {
      PrintHelp(usage, flags_source);
      std::exit(0);
    }
    if (absl::StartsWith(arg, "--")) {
      const size_t end = arg.find('=');
      for (size_t j = 2; j < std::min(end, arg.size()); ++j) {
        if (arg[j] == '-') arg[j] = '_';
      }
      if (absl::StartsWith(arg, "--flagfile=")) CheckFlagFileSpelling(arg.substr(11));
    }
  }
  std::vector<char*> pointers;
  for (std::string& arg : args) pointers.push_back(arg.data());
  absl::SetProgramUsageMessage(usage);
  std::vector<char*> rest =
      absl::ParseCommandLine(static_cast<int>(pointers.size()), pointers.data());
  return std::vector<std::string>(rest.begin(), rest.end());
}

absl::StatusOr<uint64_t> ParseByteSize(absl::string_view text) {
  auto bad = [text](absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat("invalid byte size \"", absl::CHexEscape(text), "\": ", why));
  };
  constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();
  absl::string_view s = absl::StripAsciiWhitespace(text);
  size_t i = 0;

  uint64_t whole = 0;
  const size_t whole_begin = i;
  for (; i < s.size() && absl::ascii_isdigit(static_cast<unsigned char>(s[i])); ++i) {
    const uint64_t digit = static_cast<uint64_t>(s[i] - '0');
    if (whole > (kMax - digit) / 10) return bad("too large");
    whole = whole * 10 + digit;
  }
  if (i == whole_begin) return bad("expected a non-negative number");

  // Fraction digits past the 18th cannot change the truncated byte count
  // enough to matter and are dropped (10^18 still fits in 64 bits).
  bool has_fraction = false;
  uint64_t fraction = 0;
  uint64_t fraction_scale = 1;
  if (i < s.size() && s[i] == '.') {
    has_fraction = true;
    const size_t fraction_begin = ++i;
    for (; i < s.size() && absl::ascii_isdigit(static_cast<unsigned char>(s[i])); ++i) {
      if (i - fraction_begin < 18) {
        fraction = fraction * 10 + static_cast<uint64_t>(s[i] - '0');
        fraction_scale *= 10;
      }
    }
    if (i == fraction_begin) return bad("expected digits after '.'");
  }

  const std::string unit = absl::AsciiStrToLower(absl::StripLeadingAsciiWhitespace(s.substr(i)));
  if (unit.size() == 2 && unit[1] == 'b' && absl::StrContains("kmgt", unit[0])) {
    // "GB" is 10^9 bytes to some and 2^30 to others; a pool sized off by 7 %
    // is found late, so the ambiguous spelling is refused.
    const std::string prefix(1, absl::ascii_toupper(static_cast<unsigned char>(unit[0])));
    return bad(absl::StrCat("'", prefix, "B' is ambiguous (10^n or 2^n bytes?): write ", prefix,
                            " or ", prefix,
                            "iB for powers of 1024, or the number of bytes in "
                            "full for powers of 1000"));
  }
  uint64_t multiplier = 1;
  if (!unit.empty() && unit != "b") {
    switch (unit[0]) {
      case 'k':
        multiplier = uint64_t{1} << 10;
        break;
      case 'm':
        multiplier = uint64_t{1} << 20;
        break;
      case 'g':
        multiplier = uint64_t{1} << 30;
        break;
      case 't':
        multiplier = uint64_t{1} << 40;
        break;
      default:
        return bad("unknown unit (want K, M, G or T, optionally followed by iB)");
    }
    const absl::string_view suffix = absl::string_view(unit).substr(1);
    if (!suffix.empty() && suffix != "ib") {
      return bad("unknown unit (want K, M, G or T, optionally followed by iB)");
    }
  }
  if (has_fraction && multiplier == 1) return bad("a fraction needs a unit (K, M, G or T)");

  const absl::uint128 total =
      absl::uint128(whole) * multiplier + absl::uint128(fraction) * multiplier / fraction_scale;
  if (total > absl::uint128(kMax)) return bad("too large");
  return absl::Uint128Low64(total);
}

std::string FormatByteSize(uint64_t bytes) {
  static constexpr struct {
    unsigned shift;
    char unit;
  } kUnits[] = {{40, 'T'}, {30, 'G'}, {20, 'M'}, {10, 'K'}};
  for (const auto& u : kUnits) {
    const uint64_t unit = uint64_t{1} << u.shift;
    if (bytes != 0 && bytes % unit == 0) return absl::StrCat(bytes / unit, std::string(1, u.unit));
  }
  return absl::StrCat(bytes);
}

}  // namespace kvhost
