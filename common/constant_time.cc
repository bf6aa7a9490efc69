#include "common/constant_time.h"

#include <cstddef>

namespace kvhost {

bool SecretEquals(absl::string_view given, absl::string_view secret) {
  if (secret.empty()) return given.empty();
  unsigned char diff = given.size() == secret.size() ? 0 : 1;
  for (size_t i = 0; i < given.size(); ++i) {
    diff |= static_cast<unsigned char>(given[i] ^ secret[i % secret.size()]);
  }
  return diff == 0;
}

}  // namespace kvhost
