// kvhost::LayerProgress: the worker's view of an attachment's layer
// counters (AttachDeviceRequest.layer_progress), so that it waits for layer
// l of a load to be recorded before it waits on the layer's load event.
//
// Why: a load of such an attachment may return before every layer is
// queued. A cudaStreamWaitEvent on load event [set][l] before this load
// recorded it would bind to the event's previous record (stale rows); the
// counter of the set says when the record happened. Counter s is a uint64
// in shared memory that kvhostd increments as the loads of set s record
// their layers; a load's layer l is recorded once it reaches
// LoadTicket::layer_base + l + 1, and a load that fails still takes it to
// layer_base + layers (WaitTransfer then returns the error).
//
// The counters come from kvhostd's handoff socket (Attachment.
// handoff_socket; kvhost.v1.HandoffRequest), mapped read-only. No CUDA
// here, so the host backend (which publishes the counters too) serves tests
// and tools; kvhost::LoadEvents (cuda_export.h) combines it with the
// events. The worker's sequence:
//
//   auto request = ...;                  // MakeCudaAttachRequest / MakeAttachRequest
//   request->set_layer_progress(true);
//   auto attachment = client->AttachDevice(*request);
//   auto progress = kvhost::LayerProgress::Open(*client, *attachment);
//   auto load = client->LoadWithEvents(attachment->id(), host, rows);
//   for (uint32_t l = 0; l < layers; ++l) {
//     (*progress)->WaitRecorded(*load, l, absl::Seconds(10));  // host side, no RPC
//     // cuda: cudaStreamWaitEvent(stream, event [load->event_set][l]) — or
//     // LoadEvents::WaitLayer(*load, l, stream), which does both — then layer l's attention.
//   }
//   client->WaitTransfer(load->ticket_id);  // the load's outcome
//
// Thread safety: after Open, every method may be called concurrently (they
// only read the mapping). Ownership: the object owns its read-only mapping,
// which stays valid after a detach or a daemon exit (it then counts no
// further).
#ifndef KVHOST_CLIENT_LAYER_PROGRESS_H_
#define KVHOST_CLIENT_LAYER_PROGRESS_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kvhost/client.h"
#include "kvhost/v1/transfer.pb.h"

namespace kvhost {

class LayerProgress {
 public:
  // Fetches and maps the counters of `attachment` with `client`'s
  // credentials (its session ids and owner token, as its TransferService
  // calls carry them). FAILED_PRECONDITION for an attachment without
  // layer_progress; errors of FetchHandoff otherwise, and INTERNAL when the
  // descriptor is not what the reply says.
  static absl::StatusOr<std::unique_ptr<LayerProgress>> Open(
      const Client& client, const v1::Attachment& attachment,
      absl::Duration timeout = absl::Seconds(5));
  // The same with explicit credentials.
  static absl::StatusOr<std::unique_ptr<LayerProgress>> Open(
      const std::string& handoff_socket, const std::string& attachment_id,
      const std::vector<std::string>& session_ids, const std::string& owner_token,
      absl::Duration timeout = absl::Seconds(5));
  ~LayerProgress();
  LayerProgress(const LayerProgress&) = delete;
  LayerProgress& operator=(const LayerProgress&) = delete;

  // Counters: one per load event set (Attachment.load_event_sets).
  uint32_t sets() const { return sets_; }
  // Layers recorded so far by the loads of `set` (acquire load).
  // REQUIRES: set < sets().
  uint64_t Recorded(uint32_t set) const;
  // Returns once layer `layer` of the load with `layer_base` on `set` is
  // recorded (counter >= layer_base + layer + 1): it spins a few
  // microseconds, then yields, then sleeps in short steps. OK at once for
  // set -1 (a load of no rows: nothing to wait on). INVALID_ARGUMENT for a
  // set outside [-1, sets()); DEADLINE_EXCEEDED naming the set, the layer
  // and the counter after `timeout`. A recorded layer of a failed load is
  // "recorded" too: check the ticket.
  absl::Status WaitRecorded(int32_t set, uint64_t layer_base, uint32_t layer,
                            absl::Duration timeout) const;
  absl::Status WaitRecorded(const LoadTicket& ticket, uint32_t layer,
                            absl::Duration timeout) const {
    return WaitRecorded(ticket.event_set, ticket.layer_base, layer, timeout);
  }

 private:
  LayerProgress() = default;
  uint32_t sets_ = 0;
  uint64_t bytes_ = 0;
  const uint64_t* counters_ = nullptr;  // read-only shared mapping
};

}  // namespace kvhost

#endif  // KVHOST_CLIENT_LAYER_PROGRESS_H_
