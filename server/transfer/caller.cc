#include "server/transfer/caller.h"

#include "server/pool/registry.h"

namespace kvhost {
namespace {

// Equality in time that depends only on the lengths (as Pool's token check).
bool SameSecret(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

}  // namespace

bool Permits(const Caller& caller, const Owner& owner) {
  if (owner.session_id.empty()) return true;
  for (const std::string& session : caller.sessions) {
    if (SameSecret(session, owner.session_id)) return true;
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
