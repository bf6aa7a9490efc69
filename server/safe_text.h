// SafeText: text a client sent, made fit for a log line or a status message.
//
// Names, paths and worker names come from anyone who can reach the socket.
// Written raw, a newline or a NUL in one forges or cuts a log line, and a
// 10 KB name echoed in an error message makes gRPC's trailing metadata
// exceed its limit, so the client sees RESOURCE_EXHAUSTED "initial metadata
// size exceeds limit" instead of the error. SafeText escapes every byte
// outside printable ASCII (\n, \x00, \xc3 ...) and cuts the result to
// `max_bytes`, saying how much was left out.
//
// Header-only, no state; thread-safe.
#ifndef KVHOST_SERVER_SAFE_TEXT_H_
#define KVHOST_SERVER_SAFE_TEXT_H_

#include <cstddef>
#include <string>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace kvhost {

// Longest user text echoed in a log line or an error message; a valid pool
// name (64 characters) always fits whole.
inline constexpr size_t kMaxEchoedBytes = 128;
// Longest status message sent to a client: well inside gRPC's default 8 KiB
// metadata limit, which carries the message.
inline constexpr size_t kMaxStatusMessageBytes = 2048;

inline bool IsPlainText(absl::string_view text) {
  for (unsigned char c : text) {
    if (c < 0x20 || c > 0x7e) return false;
  }
  return true;
}

inline std::string SafeText(absl::string_view text, size_t max_bytes = kMaxEchoedBytes) {
  std::string out;
  size_t used = 0;
  for (; used < text.size(); ++used) {
    const unsigned char c = static_cast<unsigned char>(text[used]);
    std::string piece;
    if (c >= 0x20 && c <= 0x7e && c != '\\') {
      piece.assign(1, static_cast<char>(c));
    } else {
      piece = absl::CHexEscape(absl::string_view(&text[used], 1));
    }
    if (out.size() + piece.size() > max_bytes) break;
    out += piece;
  }
  if (used < text.size()) absl::StrAppend(&out, "...(", text.size(), " bytes in all)");
  return out;
}

}  // namespace kvhost

#endif  // KVHOST_SERVER_SAFE_TEXT_H_
