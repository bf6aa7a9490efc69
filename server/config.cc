#include "server/config.h"

#include <google/protobuf/util/json_util.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>
#include <set>
#include <utility>

#include "absl/flags/commandlineflag.h"
// WasPresentOnCommandLine: whether a flag came from argv or a --flagfile.
// Abseil 20220623 offers it only here; it is what its own legacy
// WasPresentOnCommandLine wrapper calls.
#include "absl/flags/internal/parse.h"
#include "absl/flags/reflection.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "server/pool/pool.h"
#include "server/service/convert.h"

namespace kvhost {
namespace {

// Keys of the file that are not flags.
constexpr char kPoolsKey[] = "pools";

absl::Status Error(const std::string& path, const YAML::Node& node, absl::string_view message) {
  return absl::InvalidArgumentError(absl::StrCat(path, ":", node.Mark().line + 1, ": ", message));
}

const char* TypeName(const YAML::Node& node) {
  switch (node.Type()) {
    case YAML::NodeType::Map:
      return "a map";
    case YAML::NodeType::Sequence:
      return "a list";
    case YAML::NodeType::Null:
      return "empty";
    default:
      return "a single value";
  }
}

std::string JsonString(const std::string& text) {
  std::string out = "\"";
  for (const char c : text) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      out += absl::StrCat("\\u00", absl::Hex(static_cast<unsigned char>(c), absl::kZeroPad2));
    } else {
      out += c;
    }
  }
  return out + "\"";
}

// A YAML scalar as JSON: plain true/false/null as themselves, plain integers
// as numbers (so an enum may be given by number), everything else as a
// string, which protobuf's JSON parser also accepts for numeric fields.
std::string ScalarToJson(const YAML::Node& node) {
  const std::string& text = node.Scalar();
  if (node.Tag() == "?") {  // plain, not quoted
    const std::string lower = absl::AsciiStrToLower(text);
    if (lower == "true" || lower == "false") return lower;
    if (lower == "null" || lower == "~") return "null";
    int64_t i;
    uint64_t u;
    if (absl::SimpleAtoi(text, &i)) return absl::StrCat(i);
    if (absl::SimpleAtoi(text, &u)) return absl::StrCat(u);
  }
  return JsonString(text);
}

absl::StatusOr<std::string> ToJson(const YAML::Node& node) {
  switch (node.Type()) {
    case YAML::NodeType::Scalar:
      return ScalarToJson(node);
    case YAML::NodeType::Null:
      return std::string("null");
    case YAML::NodeType::Sequence: {
      std::vector<std::string> items;
      for (const YAML::Node& item : node) {
        absl::StatusOr<std::string> json = ToJson(item);
        if (!json.ok()) return json.status();
        items.push_back(*std::move(json));
      }
      return absl::StrCat("[", absl::StrJoin(items, ","), "]");
    }
    case YAML::NodeType::Map: {
      std::vector<std::string> items;
      for (const auto& item : node) {
        absl::StatusOr<std::string> json = ToJson(item.second);
        if (!json.ok()) return json.status();
        items.push_back(absl::StrCat(JsonString(item.first.as<std::string>()), ":", *json));
      }
      return absl::StrCat("{", absl::StrJoin(items, ","), "}");
    }
    case YAML::NodeType::Undefined:
      break;
  }
  return absl::InvalidArgumentError("undefined YAML node");
}

// pools[i].spec -> v1::PoolSpec through protobuf's JSON mapping, one field at
// a time so that an error carries the line of its key.
absl::Status ParseSpec(const std::string& path, const std::string& where, const YAML::Node& node,
                       v1::PoolSpec* spec) {
  if (!node.IsMap()) {
    return Error(path, node,
                 absl::StrCat(where, ": spec must be a map of kvhost.v1.PoolSpec fields, not ",
                              TypeName(node)));
  }
  const google::protobuf::Descriptor* descriptor = v1::PoolSpec::descriptor();
  std::set<std::string> fields;
  for (const auto& item : node) {
    const std::string key = item.first.as<std::string>();
    if (!fields.insert(key).second) {
      return Error(path, item.first, absl::StrCat(where, ": spec.", key, " given twice"));
    }
    if (descriptor->FindFieldByName(key) == nullptr) {
      std::vector<std::string> names;
      for (int i = 0; i < descriptor->field_count(); ++i) {
        names.push_back(descriptor->field(i)->name());
      }
      return Error(path, item.first,
                   absl::StrCat(where, ": spec: unknown key '", key, "' (kvhost.v1.PoolSpec has ",
                                absl::StrJoin(names, ", "), ")"));
    }
    absl::StatusOr<std::string> value = ToJson(item.second);
    if (!value.ok()) return Error(path, item.second, value.status().message());
    v1::PoolSpec field;
    const auto status = google::protobuf::util::JsonStringToMessage(
        absl::StrCat("{", JsonString(key), ":", *value, "}"), &field);
    if (!status.ok()) {
      return Error(
          path, item.first,
          absl::StrCat(where, ": spec.", key, " ",
                       item.second.IsScalar() ? absl::StrCat("'", item.second.Scalar(), "'")
                                              : TypeName(item.second),
                       " is not a valid ", key, " (protobuf: ", std::string(status.message()),
                       ")"));
    }
    spec->MergeFrom(field);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<DeclaredPool>> ParsePools(const std::string& path,
                                                     const YAML::Node& node) {
  if (!node.IsSequence()) {
    return Error(path, node,
                 absl::StrCat("key 'pools' must be a list of {name, spec}, not ", TypeName(node)));
  }
  std::vector<DeclaredPool> pools;
  std::set<std::string> names;
  for (size_t i = 0; i < node.size(); ++i) {
    const YAML::Node entry = node[i];
    std::string where = absl::StrCat("pools[", i, "]");
    if (!entry.IsMap()) {
      return Error(path, entry,
                   absl::StrCat(where, " must be a map with name and spec, not ", TypeName(entry)));
    }
    DeclaredPool pool;
    bool has_spec = false;
    for (const auto& item : entry) {
      const std::string key = item.first.as<std::string>();
      if (key == "name") {
        if (!item.second.IsScalar()) {
          return Error(path, item.second,
                       absl::StrCat(where, ".name must be a string, not ", TypeName(item.second)));
        }
        pool.name = item.second.Scalar();
      } else if (key != "spec") {
        return Error(path, item.first,
                     absl::StrCat(where, ": unknown key '", key, "' (a pool has name and spec)"));
      }
    }
    if (pool.name.empty()) return Error(path, entry, absl::StrCat(where, " has no name"));
    where = absl::StrCat(where, " '", pool.name, "'");
    if (!names.insert(pool.name).second) {
      return Error(path, entry, absl::StrCat(where, ": pool '", pool.name, "' declared twice"));
    }
    for (const auto& item : entry) {
      if (item.first.as<std::string>() != "spec") continue;
      has_spec = true;
      if (absl::Status s = ParseSpec(path, where, item.second, &pool.proto); !s.ok()) return s;
      // CreatePool's own conversion, so its checks and messages apply.
      absl::StatusOr<PoolSpec> spec = FromProto(pool.proto);
      if (!spec.ok()) {
        return Error(path, item.second, WithPool(pool.name, spec.status()).message());
      }
      pool.spec = *spec;
    }
    if (!has_spec) return Error(path, entry, absl::StrCat(where, " has no spec"));
    pools.push_back(std::move(pool));
  }
  return pools;
}

// The flag's command-line text for `value`: a scalar as written; a list, for
// a flag holding a list, comma separated.
absl::StatusOr<std::string> FlagText(const std::string& path, const std::string& key,
                                     const absl::CommandLineFlag& flag, const YAML::Node& value) {
  const bool is_list = flag.IsOfType<std::vector<std::string>>();
  if (value.IsScalar()) return value.Scalar();
  if (value.IsSequence() && is_list) {
    std::vector<std::string> items;
    for (const YAML::Node& item : value) {
      if (!item.IsScalar()) {
        return Error(
            path, item,
            absl::StrCat("key '", key, "': list items must be strings, not ", TypeName(item)));
      }
      items.push_back(item.Scalar());
    }
    return absl::StrJoin(items, ",");
  }
  return Error(path, value,
               absl::StrCat("key '", key, "' takes ",
                            is_list ? "a string or a list of strings" : "a single value", ", not ",
                            TypeName(value), " (default: ", flag.DefaultValue(), ")"));
}

}  // namespace

absl::StatusOr<std::vector<DeclaredPool>> LoadConfigFile(const std::string& path,
                                                         const std::string& flags_file) {
  YAML::Node root;
  try {
    root = YAML::LoadFile(path);
  } catch (const YAML::BadFile&) {
    // Why, and for a missing file how to make one.
    std::FILE* f = std::fopen(path.c_str(), "r");
    const int err = f == nullptr ? errno : EISDIR;
    if (f != nullptr) std::fclose(f);
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": cannot read the config file: ", std::strerror(err),
        err == ENOENT ? " (kvhostd --print-config > FILE writes one with every setting to start "
                        "from; deploy/kvhostd.yaml is a commented example)"
                      : ""));
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(path, ":", e.mark.line + 1, ":",
                                                   e.mark.column + 1, ": not valid YAML: ", e.msg));
  }
  if (root.IsNull()) return std::vector<DeclaredPool>{};  // empty file
  if (!root.IsMap()) {
    return Error(path, root,
                 absl::StrCat("the config file must be a map of flag names to values, not ",
                              TypeName(root)));
  }
  try {
    std::vector<DeclaredPool> pools;
    std::map<std::string, int> seen;  // flag name -> line
    for (const auto& item : root) {
      if (!item.first.IsScalar()) {
        return Error(path, item.first,
                     absl::StrCat("a key must be a name, not ", TypeName(item.first)));
      }
      const std::string key = item.first.Scalar();
      const std::string name = absl::StrReplaceAll(key, {{"-", "_"}});
      if (auto [it, fresh] = seen.emplace(name, item.first.Mark().line + 1); !fresh) {
        return Error(path, item.first,
                     absl::StrCat("key '", key, "' given twice (also on line ", it->second, ")"));
      }
      if (name == kPoolsKey) {
        absl::StatusOr<std::vector<DeclaredPool>> parsed = ParsePools(path, item.second);
        if (!parsed.ok()) return parsed.status();
        pools = *std::move(parsed);
        continue;
      }
      absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
      if (flag == nullptr || !absl::EndsWith(flag->Filename(), flags_file)) {
        return Error(path, item.first,
                     absl::StrCat("unknown key '", key,
                                  "': not a kvhostd flag (see kvhostd --help) nor 'pools'"));
      }
      if (name == "config" || name == "print_config") {
        return Error(path, item.first,
                     absl::StrCat("key '", key, "' is only taken on the command line"));
      }
      absl::StatusOr<std::string> text = FlagText(path, key, *flag, item.second);
      if (!text.ok()) return text.status();
      // The value is checked even where the command line overrides it, so a
      // file that loads once loads everywhere.
      const bool overridden = absl::flags_internal::WasPresentOnCommandLine(name);
      const std::string given = flag->CurrentValue();
      std::string error;
      if (!flag->ParseFrom(*text, &error)) {
        return Error(
            path, item.second,
            absl::StrCat("key '", key, "': wrong type or value '", *text, "' (", error, ")"));
      }
      if (overridden) flag->ParseFrom(given, &error);  // the command line wins
    }
    return pools;
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(path, ":", e.mark.line + 1, ": ", e.msg));
  }
}

namespace {

// Whether a YAML reader would take `text`, written plain, for something other
// than the string it is: a number (`0660` is the octal 432 to a YAML 1.1
// reader such as PyYAML, 0660 or 660 to others), a boolean (`on`, `no`) or
// null. Such values of string flags are written quoted; kvhostd reads them
// back either way. Errs on the side of quoting (quotes never change what is
// read).
bool ReadsAsNonString(const std::string& text) {
  static const char* const kWords[] = {"y",   "n",    "yes", "no",   "true",  "false", "on",
                                       "off", "null", "~",   ".inf", "-.inf", "+.inf", ".nan"};
  const std::string lower = absl::AsciiStrToLower(text);
  for (const char* word : kWords) {
    if (lower == word) return true;
  }
  size_t i = (!text.empty() && (text[0] == '+' || text[0] == '-')) ? 1 : 0;
  if (i < text.size() && text[i] == '.') ++i;
  if (i >= text.size() || !absl::ascii_isdigit(static_cast<unsigned char>(text[i]))) return false;
  // Digits, and what numbers in some YAML spelling carry: hex and exponent
  // letters, the 0x / 0o / 0b prefixes, '_' separators, ':' (YAML 1.1's
  // base 60), signs and the point.
  return text.find_first_not_of("0123456789abcdefABCDEFoOxX_:.+-") == std::string::npos;
}

// A string flag's value (or a list flag's item), quoted where a plain
// scalar would be misread.
void EmitString(YAML::Emitter& out, const std::string& value) {
  if (ReadsAsNonString(value)) out << YAML::DoubleQuoted;
  out << value;
}

}  // namespace

std::string FormatConfig(const std::string& flags_file, const std::vector<std::string>& skip,
                         const std::vector<DeclaredPool>& pools) {
  std::map<std::string, const absl::CommandLineFlag*> own;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (!absl::EndsWith(flag->Filename(), flags_file)) continue;
    if (std::find(skip.begin(), skip.end(), name) != skip.end()) continue;
    own[std::string(name)] = flag;
  }
  YAML::Emitter out;
  out << YAML::BeginMap;
  for (const auto& [name, flag] : own) {
    out << YAML::Key << name << YAML::Value;
    if (absl::optional<std::vector<std::string>> list = flag->TryGet<std::vector<std::string>>()) {
      out << YAML::BeginSeq;
      for (const std::string& item : *list) EmitString(out, item);
      out << YAML::EndSeq;
    } else if (flag->IsOfType<std::string>()) {
      EmitString(out, flag->CurrentValue());
    } else {
      out << flag->CurrentValue();  // numbers, booleans, durations: as the flag spells them
    }
  }
  if (!pools.empty()) {
    out << YAML::Key << kPoolsKey << YAML::Value << YAML::BeginSeq;
    for (const DeclaredPool& pool : pools) {
      out << YAML::BeginMap << YAML::Key << "name" << YAML::Value << pool.name;
      out << YAML::Key << "spec" << YAML::Value << YAML::Flow << YAML::BeginMap;
      // protobuf's JSON mapping (enum names, field names as in the proto),
      // which ParseSpec reads back; 64-bit numbers come as strings there.
      std::string json;
      google::protobuf::util::JsonPrintOptions options;
      options.preserve_proto_field_names = true;
      (void)google::protobuf::util::MessageToJsonString(pool.proto, &json, options);
      for (const auto& item : YAML::Load(json)) {
        out << YAML::Key << item.first.Scalar() << YAML::Value << item.second.Scalar();
      }
      out << YAML::EndMap << YAML::EndMap;
    }
    out << YAML::EndSeq;
  }
  out << YAML::EndMap;
  return absl::StrCat("# kvhostd --print-config: kvhostd --config=FILE reads this back.\n",
                      out.c_str(), "\n");
}

}  // namespace kvhost
