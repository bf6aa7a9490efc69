#include "server/pool/names.h"

#include "absl/strings/str_cat.h"
#include "server/safe_text.h"

namespace kvhost {

absl::Status ValidatePoolName(const std::string& name) {
  if (name.empty() || name.size() > kMaxPoolName) {
    return absl::InvalidArgumentError(
        absl::StrCat("name '", SafeText(name), "' must be 1-", kMaxPoolName, " characters long"));
  }
  if (name[0] == '.') {
    return absl::InvalidArgumentError(
        absl::StrCat("name '", SafeText(name), "' must not start with '.'"));
  }
  for (char c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == '-';
    if (!ok) {
      return absl::InvalidArgumentError(absl::StrCat(
          "name '", SafeText(name), "' may hold only letters, digits, '.', '_' and '-'"));
    }
  }
  return absl::OkStatus();
}

}  // namespace kvhost
