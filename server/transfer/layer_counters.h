// LayerCounters: the host-visible progress of an attachment's loads (and
// backups: they count exactly as loads do, below), one counter of recorded
// layers per load event set, in shared memory that the attached worker maps
// read-only (AttachDeviceRequest.layer_progress).
//
// Why: a worker stream may wait on load event [set][l] (cudaStreamWaitEvent)
// only once this load has recorded it; a wait on an event not yet recorded
// binds to its previous record, a stale layer. A load of an attachment with
// layer progress may return before every layer is queued, so the worker
// first waits on this counter (a host load, no RPC) and then on the event.
// A backup of such an attachment takes a set too: its worker waits on its
// last layer the same way, so that its stream learns the backup finished.
//
// Counting: the counter of set s counts the layers recorded by the loads
// that took set s, monotonically over the attachment's life (64 bits do not
// wrap: 2^64 layers at a million a second is half a million years). A load
// of L ticket layers that took set s gets base = the layers reserved on s
// before it (Reserve, when the load is accepted, in acceptance order: a set
// is held by one load at a time, so the loads of one set run one after the
// other); layer l of it is recorded once the counter reaches base + l + 1.
// The engine stores that right after recording the layer's event (Publish),
// and base + L when the load ends early (failed, cancelled: Release), so a
// waiting worker is never stuck: it finds the error in the ticket. Every
// store is monotonic (a late Release never lowers what a later load of the
// set published) with release semantics; the worker loads with acquire.
//
// Memory: a memfd of sets() x uint64_t, counter s at byte offset 8 s,
// little-endian as the host is, mapped read-write here; sealed against
// growing, shrinking and any later writable mapping. The worker gets
// read_only_fd() (an O_RDONLY descriptor of the same file: it can neither
// write nor resize the daemon's memory) through the handoff socket
// (server/service/handoff_server.h); its mapping outlives this object.
//
// Thread safety: every method may be called concurrently. Ownership: the
// attachment and the jobs in flight on it share the object (shared_ptr);
// the destructor unmaps and closes both descriptors.
#ifndef KVHOST_SERVER_TRANSFER_LAYER_COUNTERS_H_
#define KVHOST_SERVER_TRANSFER_LAYER_COUNTERS_H_

#include <atomic>
#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"

namespace kvhost {

class LayerCounters {
 public:
  // Bytes of one counter in the file (a uint64_t, back to back).
  static constexpr uint64_t kCounterBytes = sizeof(uint64_t);

  // `sets` counters, all 0. INVALID_ARGUMENT for 0 sets or more than
  // kMaxLoadEventSets (engine.h); INTERNAL naming the system call that failed
  // (memfd_create, ftruncate, mmap, reopening it read-only through
  // /proc/self/fd).
  static absl::StatusOr<std::shared_ptr<LayerCounters>> Create(uint32_t sets);
  ~LayerCounters();
  LayerCounters(const LayerCounters&) = delete;
  LayerCounters& operator=(const LayerCounters&) = delete;

  uint32_t sets() const { return sets_; }
  // Size of the file (sets() x kCounterBytes).
  uint64_t bytes() const { return uint64_t{sets_} * kCounterBytes; }

  // The base of a load of `layers` ticket layers that took set `set`: the
  // layers reserved on the set before it; reserves `layers` more.
  // REQUIRES: set < sets(); the set is held by this load from now until it
  // ends (the engine's set ring), so that its loads run in Reserve's order.
  uint64_t Reserve(uint32_t set, uint32_t layers);
  // Layer `layer` (0-based) of the load with base `base` on `set` is
  // recorded: the counter becomes at least base + layer + 1 (release).
  // REQUIRES: set < sets().
  void Publish(uint32_t set, uint64_t base, uint32_t layer);
  // The load of `layers` layers with base `base` on `set` has ended (any
  // way): the counter becomes at least base + layers (release). Idempotent.
  // REQUIRES: set < sets().
  void Release(uint32_t set, uint64_t base, uint32_t layers);
  // The counter of `set` now (acquire). REQUIRES: set < sets().
  uint64_t Recorded(uint32_t set) const;

  // The read-only descriptor handed to workers (owned here: a sender
  // passes it with SCM_RIGHTS, which gives the receiver its own).
  int read_only_fd() const { return read_only_fd_; }

 private:
  LayerCounters() = default;
  // counter := max(counter, value), release.
  void StoreAtLeast(uint32_t set, uint64_t value);

  uint32_t sets_ = 0;
  int fd_ = -1;            // the memfd, read-write
  int read_only_fd_ = -1;  // the same file, O_RDONLY
  uint64_t* counters_ = nullptr;
  // Per set, the layers reserved so far (daemon-private: the worker sees
  // only what was recorded).
  std::unique_ptr<std::atomic<uint64_t>[]> reserved_;
};

}  // namespace kvhost

#endif  // KVHOST_SERVER_TRANSFER_LAYER_COUNTERS_H_
