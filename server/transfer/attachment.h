// Attachment: what TransferManager holds for one attached worker (a plain
// pool's or a pool group's): the pools and the engine's mappings, the
// owner its tickets share, the layer counters, and what AttachDevice told
// the worker (AttachmentInfo). The manager's table of them is an
// AttachmentTable (attachment_table.h), its Attach / Detach are in
// attachments.cc; a transfer copies what it needs of one into a
// SubmitTarget (submission.h) under the manager's mutex.
//
// Thread safety: plain values; TransferManager's mutex guards its table.
// Ownership: an Attachment shares its pools, group and mappings with the
// jobs in flight on it, so releasing it (ReleaseAttachment) frees nothing a
// running job still uses.
#ifndef KVHOST_SERVER_TRANSFER_ATTACHMENT_H_
#define KVHOST_SERVER_TRANSFER_ATTACHMENT_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "server/access/caller.h"
#include "server/pool/pool.h"
#include "server/pool/pool_group.h"
#include "server/transfer/engine.h"
#include "server/transfer/layer_counters.h"

namespace kvhost {

struct AttachmentInfo {
  std::string id;
  // The pool; for a group attachment, the anchor entry's pool.
  std::string pool;
  // The group attached to; empty for a plain pool's attachment.
  std::string group;
  // Device slots of the pool's buffers (a group's: the anchor entry's).
  uint64_t device_size_tokens = 0;
  // Device layers attached, [start_layer, end_layer): a ticket's layers.
  // A group attachment counts model layers: [0, the group's layer_num).
  uint32_t start_layer = 0;
  uint32_t end_layer = 0;
  std::optional<uint32_t> tp_rank;
  bool load_only = false;
  // The worker session it belongs to ("" for none).
  std::string session_id;
  // The engine's exported load events (DeviceMapping::load_event_handles).
  // load_event_sets: their sets; with layer progress, the counters' sets
  // (the host backend's too, which has no events).
  std::vector<std::string> load_event_handles;
  uint32_t load_event_sets = 0;
  // AttachRequest::layer_progress: the attachment has LayerCounters.
  bool layer_progress = false;
};

// One pool of an attachment: a plain attachment has one, a group
// attachment one per group entry, in the group's order.
struct AttachedPool {
  std::string entry;  // the group entry's name; empty for a plain attachment
  std::shared_ptr<Pool> pool;
  std::shared_ptr<const DeviceMapping> mapping;
  // Per ticket layer: the pool's host layer and the mapping's layer.
  std::vector<JobLayer> layers;
};

struct Attachment {
  AttachmentInfo info;
  std::shared_ptr<const Owner> owner;  // set by Register; its tickets share it
  std::shared_ptr<PoolGroup> group;    // null for a plain attachment
  // The mapping jobs record their load events on (a group's: OpenGroup's).
  std::shared_ptr<const DeviceMapping> mapping;
  std::vector<AttachedPool> pools;
  std::shared_ptr<LayerCounters> layer_counters;  // null without layer progress
  uint32_t worker_copies = 0;                     // in flight (worker_copies.cc)
};

// Gives back what an attachment holds (its pools' and group's counts).
void ReleaseAttachment(const Attachment& attachment);

// The message of an attachment id the caller may not use, the same as for
// one that does not exist: the answer tells nothing about other sessions.
absl::Status AttachmentNotFound(const std::string& id);

// "a, b, c": a group's entry names, for messages.
std::string GroupEntryNames(const PoolGroup& group);

}  // namespace kvhost

#endif  // KVHOST_SERVER_TRANSFER_ATTACHMENT_H_
