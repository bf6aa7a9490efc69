// kvhostctl: the operator's command line for kvhostd. It shows the daemon's
// health and pools, creates and deletes pools of every kind, allocates, frees
// and locates token slots, reads and writes flat pages, refreshes a live view of pools and
// transfers (watch), and runs a self-checking demo workload: backup / load cycles between an
// emulated device pool in shared memory and a host pool, verified byte for byte (host backend).
//
// Output is for people unless --json is given; then every command prints one
// JSON object on one line (watch: one per frame): the daemon's message with
// field names as in the .proto and every integer a JSON number
// (cli_output.h MessageJson), an object of the same naming style otherwise.
// Exit codes: errors.h.
//
// This file holds the global flags, checks the command line and dispatches
// through commands.h's table; each command's own flags live beside it.
#include <cmath>
#include <cstdlib>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "client/kvhostctl/commands.h"
#include "client/kvhostctl/errors.h"
#include "common/cli_flags.h"
#include "kvhost/client.h"

ABSL_FLAG(std::string, server, kvhost::kDefaultAddress,
          "kvhostd address: 'unix:///path.sock' or 'host:port'; when not given, the "
          "environment variable KVHOST_SERVER, else this default.");
ABSL_FLAG(bool, json, false, "Print one JSON object per command instead of text.");
ABSL_FLAG(double, timeout, 30, "Deadline of each RPC, in seconds.");
ABSL_FLAG(std::string, token, "",
          "Owner token sent as gRPC metadata 'kvhost-token' on every call (create-pool protects "
          "the new pool with it); default: the environment variable KVHOST_TOKEN.");
ABSL_FLAG(std::string, tls_ca, "",
          "TCP --server: PEM CA that signed kvhostd's certificate ('' = the system roots).");
ABSL_FLAG(std::string, tls_cert, "",
          "TCP --server: PEM client certificate, for a kvhostd with --tls-client-ca.");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls-cert.");
ABSL_FLAG(std::string, tls_server_name, "",
          "TCP --server: the name to check kvhostd's certificate against (default: its host).");
ABSL_FLAG(bool, insecure, false,
          "TCP --server: plaintext, for a kvhostd started with --insecure-tcp.");

namespace kvhost::ctl {
namespace {

// Where kvhostctl's own flags are defined: every file of this folder.
constexpr char kFlagsSource[] = "client/kvhostctl/";

constexpr char kUsageHead[] =
    "kvhostctl: command line for kvhostd, the host KV-cache daemon.\n"
    "Usage: kvhostctl [--server=ADDR] [--json] [--timeout=SECONDS] COMMAND [ARGS]\n"
    "\n"
    "Commands:\n";
constexpr char kUsageTail[] =
    "\n"
    "Exit codes: 0 ok; 1 an RPC failed (stderr: error: CODE: message); 2 usage error;\n"
    "3 the demo read back different bytes; 4 l3-store / l3-fetch did fewer pages than asked.";

// --help's command list: "  NAME ARGS" in a column of kHelpColumn, each
// command's help beside it (below it, when NAME ARGS is wider).
std::string UsageText() {
  constexpr size_t kHelpColumn = 22;
  const std::string indent(kHelpColumn, ' ');
  std::string usage = kUsageHead;
  for (const Command& command : kCommands) {
    std::string synopsis = absl::StrCat("  ", command.name);
    if (*command.args != '\0') absl::StrAppend(&synopsis, " ", command.args);
    bool first = true;
    for (absl::string_view line : absl::StrSplit(command.help, '\n')) {
      if (first && synopsis.size() < kHelpColumn) {
        absl::StrAppend(&usage, synopsis, std::string(kHelpColumn - synopsis.size(), ' '), line,
                        "\n");
      } else {
        if (first) absl::StrAppend(&usage, synopsis, "\n");
        absl::StrAppend(&usage, indent, line, "\n");
      }
      first = false;
    }
  }
  return absl::StrCat(usage, kUsageTail);
}

// Abseil exits with 1 on an unknown flag or a bad flag value, and 1 means a
// failed RPC here; so kvhostctl's own flags are checked first, the way Abseil
// would read them, and reported as usage errors.
absl::StatusOr<GivenFlags> CheckFlags(int argc, char** argv) {
  GivenFlags given;
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    if (arg == "--") break;
    if (arg.size() < 2 || arg[0] != '-') continue;  // positional
    const bool double_dash = absl::StartsWith(arg, "--");
    absl::string_view body = arg.substr(double_dash ? 2 : 1);
    const size_t eq = body.find('=');
    std::string name(body.substr(0, eq));
    // cli_flags.cc turns --foo-bar into --foo_bar, but only with two dashes.
    if (double_dash) name = absl::StrReplaceAll(name, {{"-", "_"}});
    if (name == "help" || name == "h") continue;
    absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
    if (flag == nullptr && absl::StartsWith(name, "no") && eq == absl::string_view::npos) {
      absl::CommandLineFlag* negated = absl::FindCommandLineFlag(name.substr(2));
      if (negated != nullptr && negated->IsOfType<bool>()) continue;
    }
    if (flag == nullptr) {
      return UsageError(
          absl::StrCat("unknown flag ", double_dash ? "--" : "-", body.substr(0, eq)));
    }
    // Abseil's own flags (--flagfile, ...) are left to Abseil.
    if (!FlagDefinedIn(*flag, kFlagsSource)) continue;
    given.names.insert(std::string(flag->Name()));
    std::string value;
    if (eq != absl::string_view::npos) {
      value = std::string(body.substr(eq + 1));
    } else if (flag->IsOfType<bool>()) {
      continue;
    } else if (i + 1 < argc) {
      value = argv[++i];
    } else {
      return UsageError(absl::StrCat("flag --", flag->Name(), " needs a value"));
    }
    if (flag->Name() == "entry") given.entries.push_back(value);
    std::string error;
    if (!flag->ParseFrom(value, &error)) {
      return UsageError(absl::StrCat("--", absl::StrReplaceAll(flag->Name(), {{"_", "-"}}), "='",
                                     value, "': ", error));
    }
  }
  return given;
}

// The client's options from the global flags (--server, --timeout, access).
ClientOptions ClientOptionsFromFlags(const std::string& server, absl::Duration timeout) {
  ClientOptions options;
  options.address = server;
  options.timeout = timeout;
  options.owner_token = absl::GetFlag(FLAGS_token);
  if (options.owner_token.empty()) {
    if (const char* env = std::getenv("KVHOST_TOKEN"); env != nullptr) options.owner_token = env;
  }
  options.tls_ca_file = absl::GetFlag(FLAGS_tls_ca);
  options.tls_cert_file = absl::GetFlag(FLAGS_tls_cert);
  options.tls_key_file = absl::GetFlag(FLAGS_tls_key);
  options.tls_server_name = absl::GetFlag(FLAGS_tls_server_name);
  options.insecure = absl::GetFlag(FLAGS_insecure);
  return options;
}

absl::Status Dispatch(const std::vector<std::string>& positional, GivenFlags given) {
  if (positional.size() < 2) return UsageError("no command given");
  const std::string& name = positional[1];
  const Command* command = nullptr;
  for (const Command& c : kCommands) {
    if (name == c.name) command = &c;
  }
  if (command == nullptr) return UsageError(absl::StrCat("unknown command '", name, "'"));
  const Args args(positional.begin() + 2, positional.end());
  if (args.size() < command->min_args || args.size() > command->max_args) {
    return UsageError(absl::StrCat(command->name, " takes ",
                                   command->min_args == 0 ? "no arguments" : command->args,
                                   "; got ", args.size(), " argument(s)"));
  }

  Context ctx;
  ctx.json = absl::GetFlag(FLAGS_json);
  ctx.server = absl::GetFlag(FLAGS_server);
  // The flag wins over KVHOST_SERVER, which wins over the default.
  if (const char* env = std::getenv("KVHOST_SERVER"); env != nullptr && *env != '\0' &&
                                                      given.names.count("server") == 0 &&
                                                      ctx.server == kDefaultAddress) {
    ctx.server = env;
  }
  ctx.given = std::move(given);
  const double timeout = absl::GetFlag(FLAGS_timeout);
  if (ctx.server.empty()) return UsageError("--server is empty");
  if (absl::StartsWith(ctx.server, "/") || absl::StartsWith(ctx.server, ".")) {
    // gRPC would take it for a DNS name.
    return UsageError(absl::StrCat("--server '", ctx.server,
                                   "' is a file path: write a unix socket as unix://",
                                   ctx.server[0] == '/' ? ctx.server : "/ABSOLUTE/PATH"));
  }
  if (!(timeout > 0) || !std::isfinite(timeout)) {
    return UsageError(absl::StrCat("--timeout ", timeout, " must be a positive number of seconds"));
  }
  ctx.timeout = absl::Seconds(timeout);
  ctx.options = ClientOptionsFromFlags(ctx.server, ctx.timeout);
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(ctx.options);
  if (!client.ok()) return WithServerHint(ctx.server, client.status());
  ctx.client = client->get();
  return WithServerHint(ctx.server, command->run(ctx, args));
}

int Main(int argc, char** argv) {
  absl::StatusOr<GivenFlags> given = CheckFlags(argc, argv);
  if (!given.ok()) return Report(given.status());
  const std::vector<std::string> positional = ParseFlags(argc, argv, UsageText(), kFlagsSource);
  return Report(Dispatch(positional, *std::move(given)));
}

}  // namespace
}  // namespace kvhost::ctl

int main(int argc, char** argv) { return kvhost::ctl::Main(argc, argv); }
