#include "server/access/credentials.h"

namespace kvhost {
namespace {

// A request's session_ids and owner_token (empty: none), as a Caller.
template <typename Request>
Caller CallerOfRequest(const Request& request) {
  Caller caller;
  caller.sessions.assign(request.session_ids().begin(), request.session_ids().end());
  if (!request.owner_token().empty()) caller.token = request.owner_token();
  return caller;
}

}  // namespace

std::optional<std::string> OwnerToken(const grpc::ServerContextBase& context) {
  const auto& metadata = context.client_metadata();
  auto it = metadata.find(kOwnerTokenMetadata);
  if (it == metadata.end()) return std::nullopt;
  return std::string(it->second.data(), it->second.size());
}

Caller CallerOf(const grpc::ServerContextBase& context) {
  Caller caller;
  auto [begin, end] = context.client_metadata().equal_range(kSessionMetadata);
  for (auto it = begin; it != end; ++it) {
    caller.sessions.emplace_back(it->second.data(), it->second.size());
  }
  caller.token = OwnerToken(context);
  return caller;
}

Caller CallerOf(const v1::HandoffRequest& request) { return CallerOfRequest(request); }

Caller CallerOf(const v1::FastPathRequest& frame) { return CallerOfRequest(frame); }

}  // namespace kvhost
