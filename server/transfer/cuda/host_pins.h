// HostPins: pool memory registered with CUDA (pinned and mapped), keyed by
// the pool's base address and counted by the mappings that use it.
//
// Why counted by mappings, not tied to the Pool: the engine sees a pool only
// through `const Pool&` in Open, and the Pool unmaps its memory when its last
// shared_ptr goes. Every holder of a mapping (the attachment, each job)
// holds the pool too and declares the pool first, so the mapping is
// destroyed, and the memory unregistered, before the pool can unmap it. The
// registry is shared by the engine and its mappings so that either can go
// last. cudaHostRegisterPortable makes one registration serve every GPU's
// context, so a pool attached on several GPUs is registered once, not once
// per device (a second registration of the same range would fail with
// cudaErrorHostMemoryAlreadyRegistered).
//
// A pool is registered in chunks of `chunk` bytes (registering hundreds of
// GiB at once is slow and runs into driver limits; sglang's allocator does
// the same), and copies never straddle a chunk boundary, since a range
// spanning two registrations is not guaranteed to be treated as pinned.
//
// Thread-safe: one mutex, held while registering (seconds for a large pool)
// so that two attachments of one pool never register it twice.
#ifndef KVHOST_SERVER_TRANSFER_CUDA_HOST_PINS_H_
#define KVHOST_SERVER_TRANSFER_CUDA_HOST_PINS_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

namespace kvhost {

class HostPins {
 public:
  explicit HostPins(uint64_t chunk);

  uint64_t chunk() const { return chunk_; }

  // Registers [base, base + bytes) on first use, else counts one more user.
  // RESOURCE_EXHAUSTED when CUDA runs out of memory pinning it, INTERNAL for
  // other failures; nothing stays registered then.
  absl::Status Acquire(uint8_t* base, uint64_t bytes, const std::string& pool);
  // One user fewer; the last unregisters. REQUIRES: acquired.
  void Release(uint8_t* base);

 private:
  struct Entry {
    uint64_t bytes;
    size_t chunks;
    int users;
  };

  void Unregister(uint8_t* base, size_t chunks);

  const uint64_t chunk_;
  absl::Mutex mu_;
  std::map<uint8_t*, Entry> entries_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvhost

#endif  // KVHOST_SERVER_TRANSFER_CUDA_HOST_PINS_H_
