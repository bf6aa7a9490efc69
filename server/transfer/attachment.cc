#include "server/transfer/attachment.h"

#include "absl/strings/str_cat.h"
#include "server/ids.h"

namespace kvhost {

void ReleaseAttachment(const Attachment& attachment) {
  // Jobs in flight hold the pools and the mappings; the pools can be deleted
  // now and their memory goes when they finish.
  if (attachment.group != nullptr) attachment.group->ReleaseAttachment();
  for (const AttachedPool& attached : attachment.pools) {
    attached.pool->ReleaseAttachment(attachment.info.tp_rank);
  }
}

absl::Status AttachmentNotFound(const std::string& id) {
  return absl::NotFoundError(
      absl::StrCat("attachment '", ShortId(id), "' not found (or not this session's)"));
}

std::string GroupEntryNames(const PoolGroup& group) {
  std::string names;
  for (const GroupEntry& e : group.entries()) {
    absl::StrAppend(&names, names.empty() ? "" : ", ", e.name);
  }
  return names;
}

}  // namespace kvhost
