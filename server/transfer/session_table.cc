#include "server/transfer/session_table.h"

#include <algorithm>
#include <utility>

#include "absl/time/clock.h"
#include "server/ids.h"

namespace kvhost {

const SessionSnapshot& SessionTable::Open(const std::string& worker, int64_t pid,
                                          const std::string& peer) {
  SessionSnapshot session;
  session.id = CapabilityId("ses", next_serial_++);
  session.worker = worker;
  session.pid = pid;
  session.peer = peer;
  session.opened = absl::Now();
  const std::string id = session.id;
  return sessions_[id] = std::move(session);
}

bool SessionTable::IsOpen(const std::string& session_id) const {
  return sessions_.count(session_id) != 0;
}

bool SessionTable::AddAttachment(const std::string& session_id, const std::string& attachment_id) {
  auto session = sessions_.find(session_id);
  if (session == sessions_.end()) return false;
  session->second.attachments.push_back(attachment_id);
  return true;
}

void SessionTable::RemoveAttachment(const std::string& session_id,
                                    const std::string& attachment_id) {
  auto session = sessions_.find(session_id);
  if (session == sessions_.end()) return;
  std::vector<std::string>& ids = session->second.attachments;
  ids.erase(std::remove(ids.begin(), ids.end(), attachment_id), ids.end());
}

std::optional<SessionSnapshot> SessionTable::Close(const std::string& session_id) {
  auto it = sessions_.find(session_id);
  if (it == sessions_.end()) return std::nullopt;
  SessionSnapshot session = std::move(it->second);
  sessions_.erase(it);
  return session;
}

std::vector<SessionSnapshot> SessionTable::List() const {
  std::vector<SessionSnapshot> out;
  for (const auto& [id, session] : sessions_) out.push_back(session);
  return out;
}

}  // namespace kvhost
