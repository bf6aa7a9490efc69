#include "server/transfer/attachment_table.h"

#include <utility>

namespace kvhost {

void AttachmentTable::Add(Attachment attachment) {
  std::string id = attachment.info.id;
  attachments_.emplace(std::move(id), std::move(attachment));
}

Attachment* AttachmentTable::Find(const Caller& caller, const std::string& id) {
  return const_cast<Attachment*>(std::as_const(*this).Find(caller, id));
}

const Attachment* AttachmentTable::Find(const Caller& caller, const std::string& id) const {
  auto it = attachments_.find(id);
  if (it == attachments_.end() || !Permits(caller, *it->second.owner)) return nullptr;
  return &it->second;
}

Attachment* AttachmentTable::Get(const std::string& id) {
  auto it = attachments_.find(id);
  return it == attachments_.end() ? nullptr : &it->second;
}

bool AttachmentTable::Contains(const std::string& id) const { return attachments_.count(id) != 0; }

std::optional<Attachment> AttachmentTable::Take(const std::string& id) {
  auto it = attachments_.find(id);
  if (it == attachments_.end()) return std::nullopt;
  std::optional<Attachment> taken(std::move(it->second));
  attachments_.erase(it);
  return taken;
}

std::vector<AttachmentInfo> AttachmentTable::List() const {
  std::vector<AttachmentInfo> out;
  out.reserve(attachments_.size());
  for (const auto& [id, attachment] : attachments_) out.push_back(attachment.info);
  return out;
}

}  // namespace kvhost
