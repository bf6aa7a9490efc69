// AttachmentTable: the attachments of one TransferManager (a plain pool's
// and a pool group's alike), by id. It finds an attachment for a caller only
// when the attachment's owner permits that caller (server/access/caller.h):
// anyone else gets null, as for an unknown id, so a lookup tells nothing
// about other sessions' attachments. The manager's own steps (a session's
// close, worker-copy counts, Submit's recheck) look up by id alone.
//
// Thread safety: none of its own. TransferManager holds its mutex around
// every call, as for its SessionTable, so that a session and its attachments
// change in one step (lock order: TransferManager, TicketTable, Ticket).
// Ownership: the table owns its Attachments; Take hands one back to the
// caller, which releases it (ReleaseAttachment) outside the mutex. Pointers
// from Find and Get stay valid until that attachment is taken.
#ifndef KVHOST_SERVER_TRANSFER_ATTACHMENT_TABLE_H_
#define KVHOST_SERVER_TRANSFER_ATTACHMENT_TABLE_H_

#include <cstddef>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "server/access/caller.h"
#include "server/transfer/attachment.h"

namespace kvhost {

class AttachmentTable {
 public:
  // Records `attachment` under attachment.info.id. REQUIRES: its owner set,
  // and no attachment of the table with that id.
  void Add(Attachment attachment);

  // The attachment `id` if `caller` may use it, else null.
  Attachment* Find(const Caller& caller, const std::string& id);
  const Attachment* Find(const Caller& caller, const std::string& id) const;
  // The attachment `id`, whoever asks; null for an unknown id.
  Attachment* Get(const std::string& id);
  bool Contains(const std::string& id) const;

  // Removes attachment `id` from the table and returns it; nullopt for an
  // unknown id.
  std::optional<Attachment> Take(const std::string& id);

  // What each attachment told its worker, in id order.
  std::vector<AttachmentInfo> List() const;
  size_t size() const { return attachments_.size(); }

 private:
  std::map<std::string, Attachment> attachments_;
};

}  // namespace kvhost

#endif  // KVHOST_SERVER_TRANSFER_ATTACHMENT_TABLE_H_
