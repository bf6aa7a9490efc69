#include "common/bytes.h"

#include <iterator>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace kvhost {

std::string FormatBytes(uint64_t bytes) {
  static constexpr const char* kUnits[] = {"KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  if (bytes < 1024) return absl::StrCat(bytes, bytes == 1 ? " byte" : " bytes");
  double value = static_cast<double>(bytes) / 1024;
  int unit = 0;
  while (value >= 1024 && unit + 1 < static_cast<int>(std::size(kUnits))) {
    value /= 1024;
    ++unit;
  }
  return absl::StrFormat("%.2f %s", value, kUnits[unit]);
}

std::string FormatBytesExact(uint64_t bytes) {
  if (bytes < 1024) return FormatBytes(bytes);
  return absl::StrCat(FormatBytes(bytes), " (", bytes, " bytes)");
}

}  // namespace kvhost
