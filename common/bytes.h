// Byte counts as people read them, for messages and logs: the one formatter
// of kvhostd (pool sizes, memory budgets, copy-engine piece and staging
// sizes). Binary units, the ones the flags take ("64G" is 64 GiB).
//
// Flag syntax is another thing: ParseByteSize / FormatByteSize
// (common/cli_flags.h) read and write byte sizes as a flag takes them.
//
// Thread safety: pure functions.
#ifndef KVHOST_COMMON_BYTES_H_
#define KVHOST_COMMON_BYTES_H_

#include <cstdint>
#include <string>

namespace kvhost {

// "512 bytes", "1 byte", "4.00 KiB", "68.72 GiB", "1.50 TiB": two decimals
// from 1 KiB on.
std::string FormatBytes(uint64_t bytes);
// FormatBytes and the exact count, where rounding would hide a difference:
// "8.00 GiB (8589934592 bytes)".
std::string FormatBytesExact(uint64_t bytes);

}  // namespace kvhost

#endif  // KVHOST_COMMON_BYTES_H_
