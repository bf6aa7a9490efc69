#include "server/ids.h"

#include <sys/random.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <random>

#include "absl/strings/str_cat.h"

namespace kvhost {
namespace {

// `n` bytes from the kernel's random source (getrandom; std::random_device
// where that fails, e.g. a sandbox without the call).
void FillRandom(void* out, size_t n) {
  auto* p = static_cast<uint8_t*>(out);
  while (n > 0) {
    const ssize_t got = ::getrandom(p, n, 0);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) break;
    p += got;
    n -= static_cast<size_t>(got);
  }
  if (n == 0) return;
  std::random_device random;
  for (; n > 0; --n) *p++ = static_cast<uint8_t>(random());
}

}  // namespace

std::string RandomHex() {
  uint64_t bits[2] = {0, 0};
  FillRandom(bits, sizeof(bits));
  return absl::StrCat(absl::Hex(bits[0], absl::kZeroPad16), absl::Hex(bits[1], absl::kZeroPad16));
}

std::string CapabilityId(absl::string_view kind, uint64_t serial) {
  return absl::StrCat(kind, "-", serial, "-", RandomHex());
}

uint64_t RandomTicketId() {
  uint64_t id = 0;
  while (id == 0) FillRandom(&id, sizeof(id));
  return id;
}

std::string ShortId(const std::string& id) {
  // "att-<n>-" / "ses-<n>-" stay whole (they are no secret), then 4 digits.
  constexpr size_t kMaxPrefix = 24;
  constexpr size_t kShownDigits = 4;
  size_t keep = 0;
  // (npos, no dash, is never below kMaxPrefix.)
  if (const size_t dash = id.rfind('-'); dash < kMaxPrefix) {
    keep = dash + 1;
  }
  keep = std::min(id.size(), keep + kShownDigits);
  return absl::StrCat(id.substr(0, keep), "...");  // ASCII: status messages are ASCII
}

}  // namespace kvhost
