// SessionTable: the worker sessions open on one TransferManager
// (kvhost.v1.DaemonService.OpenSession), by id, each with the ids of the
// attachments made within it, so that closing a session finds what to detach.
//
// Session ids are capabilities (server/ids.h): "ses-<n>-<128 random bits>".
//
// Thread safety: none of its own. TransferManager holds its mutex around
// every call, so that a session and its attachments change in one step (an
// attachment registered while its session closes is refused, never left
// behind). Ownership: plain values; attachments are named, not held.
#ifndef KVHOST_SERVER_TRANSFER_SESSION_TABLE_H_
#define KVHOST_SERVER_TRANSFER_SESSION_TABLE_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/time/time.h"

namespace kvhost {

// A worker session (kvhost.v1.SessionInfo).
struct SessionSnapshot {
  std::string id;
  std::string worker;
  int64_t pid = 0;
  std::string peer;
  absl::Time opened;
  std::vector<std::string> attachments;
};

class SessionTable {
 public:
  // A new session, opened now with a new id; returns it.
  const SessionSnapshot& Open(const std::string& worker, int64_t pid, const std::string& peer);
  bool IsOpen(const std::string& session_id) const;
  // Records `attachment_id` as made within `session_id`; false (and nothing
  // recorded) when the session is not open.
  bool AddAttachment(const std::string& session_id, const std::string& attachment_id);
  // Forgets a detached attachment of `session_id` (a session not open, or
  // "", is ignored).
  void RemoveAttachment(const std::string& session_id, const std::string& attachment_id);
  // Removes the session and returns it; nullopt for a session not open.
  std::optional<SessionSnapshot> Close(const std::string& session_id);
  std::vector<SessionSnapshot> List() const;

 private:
  uint64_t next_serial_ = 1;
  std::map<std::string, SessionSnapshot> sessions_;
};

}  // namespace kvhost

#endif  // KVHOST_SERVER_TRANSFER_SESSION_TABLE_H_
