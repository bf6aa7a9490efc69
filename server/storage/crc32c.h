// CRC32C (Castagnoli, reflected polynomial 0x82F63B78, as iSCSI and ext4
// use it): the checksum of every page the L3 tier stores
// (server/storage/page_record.h).
//
// Crc32c(data) is the CRC of `data`; Crc32cExtend(crc, data) continues a CRC
// over more bytes, so Crc32cExtend(Crc32c(a), b) == Crc32c(a + b). The x86
// SSE4.2 crc32 instruction is used where the CPU has it (about 10x the
// table's speed), else an 8-table slicing loop; both give the same values.
//
// Thread safety: pure functions.
#ifndef KVHOST_SERVER_STORAGE_CRC32C_H_
#define KVHOST_SERVER_STORAGE_CRC32C_H_

#include <cstdint>

#include "absl/types/span.h"

namespace kvhost {

uint32_t Crc32cExtend(uint32_t crc, absl::Span<const uint8_t> data);
inline uint32_t Crc32c(absl::Span<const uint8_t> data) { return Crc32cExtend(0, data); }

// The portable loop alone, for tests that compare the two paths.
uint32_t Crc32cExtendPortable(uint32_t crc, absl::Span<const uint8_t> data);

}  // namespace kvhost

#endif  // KVHOST_SERVER_STORAGE_CRC32C_H_
