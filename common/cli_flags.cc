#include "common/cli_flags.h"

#include <cstdio>
#include <cstdlib>
#include <map>

#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/strings/match.h"
#include "absl/strings/str_replace.h"

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
    }
  }
  std::vector<char*> pointers;
  for (std::string& arg : args) pointers.push_back(arg.data());
  absl::SetProgramUsageMessage(usage);
  std::vector<char*> rest =
      absl::ParseCommandLine(static_cast<int>(pointers.size()), pointers.data());
  return std::vector<std::string>(rest.begin(), rest.end());
}

}  // namespace kvhost
