#include "server/transfer/caller.h"

#include "common/constant_time.h"
#include "server/pool/registry.h"

namespace kvhost {

bool Permits(const Caller& caller, const Owner& owner) {
  if (owner.session_id.empty()) return true;
  for (const std::string& session : caller.sessions) {
    if (SecretEquals(session, owner.session_id)) return true;
  }
  if (!caller.token.has_value()) return false;
  // The token of every protected pool of the attachment, and one at least.
  bool opened = false;
  for (const std::weak_ptr<const Pool>& weak : owner.pools) {
    const std::shared_ptr<const Pool> pool = weak.lock();
    if (pool == nullptr) return false;  // deleted: no token opens it any more
    if (!pool->owner_protected()) continue;
    if (!CheckPoolOwner(*pool, &*caller.token).ok()) return false;
    opened = true;
  }
  return opened;
}

}  // namespace kvhost
