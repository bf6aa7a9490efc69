// Ids kvhostd makes, and how logs show them: one place for every id.
//
// Capability ids (attachment and session ids, the daemon's instance id) carry
// 128 random bits from the kernel's random source, so that none can be
// guessed from another; whoever holds one may use what it names. Ticket ids
// are 64 random bits (the wire type of TransferTicket.id), so that an id from
// before a restart names no ticket of this daemon but by a 2^-64 chance.
// ShortId is how logs and status messages show a capability: enough to tell
// ids apart, too little to use one.
//
// Thread safety: every function may be called concurrently. Nothing is owned.
#ifndef KVHOST_SERVER_IDS_H_
#define KVHOST_SERVER_IDS_H_

#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"

namespace kvhost {

// 32 hex digits (128 bits) from the kernel's random source (getrandom;
// std::random_device where that fails, e.g. a sandbox without the call).
std::string RandomHex();

// A capability id: "<kind>-<serial>-<RandomHex()>" ("att-3-3f9a..."). The
// kind and serial are no secret (they make logs readable); the hex is.
std::string CapabilityId(absl::string_view kind, uint64_t serial);

// 64 random bits, never 0 (0 is "no ticket" on the wire). The caller draws
// again when the id is taken.
uint64_t RandomTicketId();

// `id` (an attachment or session id) as logs and messages show it: its kind
// and serial whole, then the first 4 hex digits and "..." ("att-1-3f9a..."),
// at most a few dozen characters whatever the caller sent.
std::string ShortId(const std::string& id);

}  // namespace kvhost

#endif  // KVHOST_SERVER_IDS_H_
