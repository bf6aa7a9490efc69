// Output helpers shared by kvhostctl and the benchmarks: a small JSON object
// writer (keys in insertion order) for results that are not one daemon
// message, protobuf messages as one-line JSON, aligned text tables, and
// percentiles of latency samples.
//
// Header only; stateless functions, safe from any thread (output lines are
// written whole, but lines from several threads may interleave).
#ifndef KVHOST_CLIENT_CLI_OUTPUT_H_
#define KVHOST_CLIENT_CLI_OUTPUT_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/message.h"

namespace kvhost::cli {

inline std::string JsonQuote(absl::string_view text) {
  std::string out = "\"";
  for (char c : text) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          absl::StrAppendFormat(&out, "\\u%04x", static_cast<int>(c));
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

// One JSON object with its keys in insertion order, for the answers that are
// not a single daemon message.
class JsonObject {
 public:
  JsonObject& Str(absl::string_view key, absl::string_view value) {
    return Raw(key, JsonQuote(value));
  }
  JsonObject& Uint(absl::string_view key, uint64_t value) { return Raw(key, absl::StrCat(value)); }
  JsonObject& Int(absl::string_view key, int64_t value) { return Raw(key, absl::StrCat(value)); }
  // Rounded to `decimals`; null when not finite.
  JsonObject& Num(absl::string_view key, double value, int decimals = 3) {
    return Raw(key, std::isfinite(value) ? absl::StrFormat("%.*f", decimals, value) : "null");
  }
  JsonObject& Bool(absl::string_view key, bool value) { return Raw(key, value ? "true" : "false"); }
  // `json` must already be JSON (a message, an array, an object).
  JsonObject& Raw(absl::string_view key, absl::string_view json) {
    absl::StrAppend(&body_, body_.empty() ? "" : ",", JsonQuote(key), ":", json);
    return *this;
  }
  std::string str() const { return absl::StrCat("{", body_, "}"); }

 private:
  std::string body_;
};

// A daemon message as JSON on one line, with every field present and named
// as in the .proto (scripts should not guess at defaults). Unlike protobuf's
// JSON mapping, which writes 64-bit integers as strings, every integer is a
// JSON number, so `total_bytes` and `daemon.pool_bytes` read alike. Enums
// are their names, bytes base64.
inline std::string MessageJson(const google::protobuf::Message& message);

namespace cli_internal {

inline std::string FieldJson(const google::protobuf::Message& message,
                             const google::protobuf::FieldDescriptor* field, int index) {
  using google::protobuf::FieldDescriptor;
  const google::protobuf::Reflection* r = message.GetReflection();
  const bool rep = field->is_repeated();
  switch (field->cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32:
      return absl::StrCat(rep ? r->GetRepeatedInt32(message, field, index)
                              : r->GetInt32(message, field));
    case FieldDescriptor::CPPTYPE_INT64:
      return absl::StrCat(rep ? r->GetRepeatedInt64(message, field, index)
                              : r->GetInt64(message, field));
    case FieldDescriptor::CPPTYPE_UINT32:
      return absl::StrCat(rep ? r->GetRepeatedUInt32(message, field, index)
                              : r->GetUInt32(message, field));
    case FieldDescriptor::CPPTYPE_UINT64:
      return absl::StrCat(rep ? r->GetRepeatedUInt64(message, field, index)
                              : r->GetUInt64(message, field));
    case FieldDescriptor::CPPTYPE_DOUBLE: {
      const double v =
          rep ? r->GetRepeatedDouble(message, field, index) : r->GetDouble(message, field);
      return std::isfinite(v) ? absl::StrCat(v) : "null";
    }
    case FieldDescriptor::CPPTYPE_FLOAT: {
      const float v =
          rep ? r->GetRepeatedFloat(message, field, index) : r->GetFloat(message, field);
      return std::isfinite(v) ? absl::StrCat(v) : "null";
    }
    case FieldDescriptor::CPPTYPE_BOOL:
      return (rep ? r->GetRepeatedBool(message, field, index) : r->GetBool(message, field))
                 ? "true"
                 : "false";
    case FieldDescriptor::CPPTYPE_ENUM: {
      const google::protobuf::EnumValueDescriptor* v =
          rep ? r->GetRepeatedEnum(message, field, index) : r->GetEnum(message, field);
      return JsonQuote(v->name());
    }
    case FieldDescriptor::CPPTYPE_STRING: {
      const std::string v =
          rep ? r->GetRepeatedString(message, field, index) : r->GetString(message, field);
      return JsonQuote(field->type() == FieldDescriptor::TYPE_BYTES ? absl::Base64Escape(v) : v);
    }
    case FieldDescriptor::CPPTYPE_MESSAGE:
      return MessageJson(rep ? r->GetRepeatedMessage(message, field, index)
                             : r->GetMessage(message, field));
  }
  return "null";
}

}  // namespace cli_internal

inline std::string MessageJson(const google::protobuf::Message& message) {
  const google::protobuf::Descriptor* d = message.GetDescriptor();
  const google::protobuf::Reflection* r = message.GetReflection();
  JsonObject out;
  for (int i = 0; i < d->field_count(); ++i) {
    const google::protobuf::FieldDescriptor* field = d->field(i);
    if (field->is_repeated()) {
      std::vector<std::string> items;
      for (int j = 0; j < r->FieldSize(message, field); ++j) {
        items.push_back(cli_internal::FieldJson(message, field, j));
      }
      out.Raw(field->name(), absl::StrCat("[", absl::StrJoin(items, ","), "]"));
    } else if (field->cpp_type() == google::protobuf::FieldDescriptor::CPPTYPE_MESSAGE &&
               !r->HasField(message, field)) {
      out.Raw(field->name(), "null");
    } else {
      out.Raw(field->name(), cli_internal::FieldJson(message, field, 0));
    }
  }
  return out.str();
}

inline void PrintLine(const std::string& line) {
  std::fputs(line.c_str(), stdout);
  std::fputc('\n', stdout);
  std::fflush(stdout);
}

// Aligned columns: the first row is the header; `align` has one letter per
// column, 'l' or 'r'. One string per row, without the newline.
inline std::vector<std::string> TableLines(const std::vector<std::vector<std::string>>& rows,
                                           absl::string_view align, absl::string_view indent = "") {
  std::vector<size_t> width(align.size(), 0);
  for (const auto& row : rows) {
    for (size_t c = 0; c < row.size() && c < width.size(); ++c) {
      width[c] = std::max(width[c], row[c].size());
    }
  }
  std::vector<std::string> lines;
  lines.reserve(rows.size());
  for (const auto& row : rows) {
    std::string line(indent);
    for (size_t c = 0; c < row.size() && c < width.size(); ++c) {
      const std::string pad(width[c] - row[c].size(), ' ');
      if (c > 0) line += "  ";
      line += align[c] == 'r' ? pad + row[c] : (c + 1 == row.size() ? row[c] : row[c] + pad);
    }
    lines.push_back(std::move(line));
  }
  return lines;
}

// TableLines, printed.
inline void PrintTable(const std::vector<std::vector<std::string>>& rows, absl::string_view align,
                       absl::string_view indent = "") {
  for (const std::string& line : TableLines(rows, align, indent)) PrintLine(line);
}

inline std::string JsonArray(const std::vector<std::string>& items) {
  return absl::StrCat("[", absl::StrJoin(items, ","), "]");
}

// Nearest-rank percentile of `sorted` (ascending), q in (0, 1]; 0 when empty.
inline double Percentile(const std::vector<double>& sorted, double q) {
  if (sorted.empty()) return 0;
  const size_t rank = static_cast<size_t>(std::ceil(q * static_cast<double>(sorted.size())));
  return sorted[std::clamp<size_t>(rank, 1, sorted.size()) - 1];
}

}  // namespace kvhost::cli

#endif  // KVHOST_CLIENT_CLI_OUTPUT_H_
