#include "server/service/handoff_server.h"

#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/access/credentials.h"
#include "server/ids.h"
#include "server/pool/beneath.h"
#include "spdlog/spdlog.h"

namespace kvhost {
namespace {

// Connections waiting to be accepted (the kernel makes more connect calls
// wait): the loop accepts as fast as they come, so this is a burst's depth.
constexpr int kListenBacklog = 64;

int ToMillis(absl::Duration d) { return static_cast<int>(absl::ToInt64Milliseconds(d)); }

const char* KindName(v1::HandoffKind kind) {
  switch (kind) {
    case v1::HANDOFF_KIND_LAYER_COUNTERS:
      return "layer counters";
    case v1::HANDOFF_KIND_POOL_REGIONS:
      return "pool regions";
    case v1::HANDOFF_KIND_DEPOSIT:
      return "deposit";
    case v1::HANDOFF_KIND_FAST_PATH:
      return "fast-path mailbox";
    case v1::HANDOFF_KIND_POOL_MAP:
      return "pool map";
    default:
      return "an unknown kind";
  }
}

// The connection just accepted, waiting for its request until `deadline`,
// with its peer's SO_PEERCRED: the uid, and "pid 12, uid 1000, gid 1000"
// for the log.
WaitingConnection Waiting(int connection, absl::Time deadline) {
  WaitingConnection waiting{connection, std::numeric_limits<uint32_t>::max(), deadline, ""};
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (::getsockopt(connection, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    waiting.peer = absl::StrCat("peer unknown (SO_PEERCRED: ", std::strerror(errno), ")");
  } else {
    waiting.uid = cred.uid;
    waiting.peer = absl::StrCat("pid ", cred.pid, ", uid ", cred.uid, ", gid ", cred.gid);
  }
  return waiting;
}

// Whether `connection`'s request has arrived.
bool Readable(int connection) {
  pollfd ready{connection, POLLIN, 0};
  return ::poll(&ready, 1, 0) == 1 && ready.revents != 0;
}

// Sends `reply` (serialized: `bytes`), with `fds` attached (at most
// kMaxWorkerCopyRegions), without waiting: the connection's buffer is
// empty, so only a peer gone makes it fail. Returns errno's text on failure
// ("" on success).
std::string SendReply(int connection, std::string bytes, const std::vector<int>& fds) {
  iovec iov{bytes.data(), bytes.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxWorkerCopyRegions)] = {};
  if (!fds.empty()) {
    const size_t n = std::min<size_t>(fds.size(), kMaxWorkerCopyRegions);
    msg.msg_control = control;
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * n);
    cmsghdr* header = CMSG_FIRSTHDR(&msg);
    header->cmsg_level = SOL_SOCKET;
    header->cmsg_type = SCM_RIGHTS;
    header->cmsg_len = CMSG_LEN(sizeof(int) * n);
    std::memcpy(CMSG_DATA(header), fds.data(), sizeof(int) * n);
  }
  if (::sendmsg(connection, &msg, MSG_NOSIGNAL | MSG_DONTWAIT) < 0) return std::strerror(errno);
  return "";
}

// The pool regions of a worker copy's attachment: a new descriptor per
// region (closed when the item is), their sizes and the launch groups.
absl::StatusOr<HandoffItem> PoolRegionsItem(const WorkerRegions& regions) {
  const Pool& pool = *regions.pool;
  if (pool.region_count() > kMaxWorkerCopyRegions) {
    return absl::FailedPreconditionError(
        absl::StrCat("pool '", pool.name(), "' has ", pool.region_count(),
                     " regions, more than the ", kMaxWorkerCopyRegions, " one handoff carries"));
  }
  struct Held {
    std::shared_ptr<const Pool> pool;
    std::vector<UniqueFd> fds;
  };
  auto held = std::make_shared<Held>();
  held->pool = regions.pool;
  HandoffItem item;
  for (size_t r = 0; r < pool.region_count(); ++r) {
    absl::StatusOr<UniqueFd> fd = pool.OpenRegion(r);
    if (!fd.ok()) {
      return absl::Status(fd.status().code(), absl::StrCat("region ", r, " of pool '", pool.name(),
                                                           "': ", fd.status().message()));
    }
    item.fds.push_back(fd->get());
    held->fds.push_back(*std::move(fd));
    item.bytes += pool.region_bytes(r);
    item.pool_regions.add_region_bytes(pool.region_bytes(r));
  }
  item.count = static_cast<uint32_t>(pool.region_count());
  for (const LayoutGroup& g : regions.groups) {
    v1::WorkerCopyGroup* out = item.pool_regions.add_groups();
    out->set_layout(static_cast<uint32_t>(g.layout.kind));
    out->set_planes(g.layout.planes);
    out->set_layers(g.layout.layers);
    out->set_tokens(g.layout.tokens);
    out->set_page_size(g.layout.page_size);
    out->set_heads(g.layout.heads);
    out->set_head_bytes(g.layout.head_bytes);
    out->set_token_bytes(g.layout.token_bytes);
    out->set_plane_bytes(g.layout.plane_bytes);
    out->set_head_groups(static_cast<uint32_t>(g.layout.head_groups));
    out->set_interleaved_planes(static_cast<uint32_t>(g.layout.interleaved_planes));
    out->set_region(g.region);
    out->set_region_offset(g.region_offset);
    for (uint64_t p = 0; p < g.layout.planes; ++p) {
      out->add_components(pool.components()[g.first_component + p].name);
    }
  }
  item.keep = std::move(held);
  return item;
}

}  // namespace

HandoffSource TransferHandoffSource(TransferManager* manager) {
  return [manager](const Caller& caller, const std::string& attachment_id,
                   v1::HandoffKind kind) -> absl::StatusOr<HandoffItem> {
    if (kind == v1::HANDOFF_KIND_POOL_REGIONS || kind == v1::HANDOFF_KIND_POOL_MAP) {
      absl::StatusOr<WorkerRegions> regions = manager->FindPoolRegions(
          caller, attachment_id,
          kind == v1::HANDOFF_KIND_POOL_MAP ? TransferManager::RegionUse::kMap
                                            : TransferManager::RegionUse::kWorkerCopy);
      if (!regions.ok()) return regions.status();
      return PoolRegionsItem(*regions);
    }
    if (kind != v1::HANDOFF_KIND_LAYER_COUNTERS) {
      return absl::InvalidArgumentError(
          absl::StrCat("handoff kind ", static_cast<int>(kind), " is not one kvhostd hands out"));
    }
    absl::StatusOr<std::shared_ptr<LayerCounters>> counters =
        manager->FindLayerCounters(caller, attachment_id);
    if (!counters.ok()) return counters.status();
    HandoffItem item;
    item.fds.push_back((*counters)->read_only_fd());
    item.bytes = (*counters)->bytes();
    item.count = (*counters)->sets();
    item.keep = *std::move(counters);
    return item;
  };
}

absl::StatusOr<std::unique_ptr<HandoffServer>> HandoffServer::Start(const std::string& path,
                                                                    HandoffSource source,
                                                                    Deposits* deposits,
                                                                    FastPathServer* fast_path) {
  std::unique_ptr<HandoffServer> server(new HandoffServer());
  server->path_ = path;
  server->source_ = std::move(source);
  server->deposits_ = deposits;
  server->fast_path_ = fast_path;
  auto failed = [&path](const char* call) {
    return absl::UnavailableError(
        absl::StrCat("handoff socket ", path, ": ", call, ": ", std::strerror(errno)));
  };
  sockaddr_un addr{};
  if (path.empty() || path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("handoff socket path '", path,
                                                   "' is empty or longer than ",
                                                   sizeof(addr.sun_path) - 1, " bytes"));
  }
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  server->listen_fd_ = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (server->listen_fd_ < 0) return failed("socket");
  if (::bind(server->listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    return failed("bind");
  }
  if (::listen(server->listen_fd_, kListenBacklog) != 0) return failed("listen");
  server->stop_fd_ = ::eventfd(0, EFD_CLOEXEC);
  if (server->stop_fd_ < 0) return failed("eventfd");
  server->thread_ = std::thread([s = server.get()] { s->Loop(); });
  ::pthread_setname_np(server->thread_.native_handle(), "kvhost-handoff");
  return server;
}

HandoffServer::~HandoffServer() {
  Stop();
  if (listen_fd_ >= 0) ::close(listen_fd_);
  if (stop_fd_ >= 0) ::close(stop_fd_);
}

void HandoffServer::Stop() {
  if (!thread_.joinable()) return;
  const uint64_t one = 1;
  if (::write(stop_fd_, &one, sizeof(one)) != sizeof(one)) {
    spdlog::error("handoff socket {}: cannot wake its thread: {}", path_, std::strerror(errno));
  }
  thread_.join();
}

HandoffWaiting::HandoffWaiting(size_t max_connections, size_t per_uid)
    : max_connections_(max_connections), per_uid_(per_uid) {}

std::optional<WaitingConnection> HandoffWaiting::Add(WaitingConnection connection) {
  std::optional<WaitingConnection> out;
  const uint32_t uid = connection.uid;
  if (of_uid(uid) >= per_uid_) {
    for (size_t i = 0; i < waiting_.size(); ++i) {
      if (waiting_[i].uid == uid) {
        out = Take(i);
        break;
      }
    }
  } else if (waiting_.size() >= max_connections_ && !waiting_.empty()) {
    out = Take(0);
  }
  ++by_uid_[uid];
  waiting_.push_back(std::move(connection));
  return out;
}

WaitingConnection HandoffWaiting::Take(size_t i) {
  WaitingConnection taken = std::move(waiting_[i]);
  waiting_.erase(waiting_.begin() + static_cast<std::ptrdiff_t>(i));
  if (auto it = by_uid_.find(taken.uid); it != by_uid_.end() && --it->second == 0) {
    by_uid_.erase(it);
  }
  return taken;
}

size_t HandoffWaiting::of_uid(uint32_t uid) const {
  auto it = by_uid_.find(uid);
  return it == by_uid_.end() ? 0 : it->second;
}

void HandoffServer::Loop() {
  HandoffWaiting waiting;
  std::vector<pollfd> fds;
  while (true) {
    // The stop event; the listener unless accepting is backing off; then
    // every connection waiting for its request.
    const absl::Time before = absl::Now();
    const bool accepting = before >= accept_after_;
    fds.assign({{stop_fd_, POLLIN, 0}, {accepting ? listen_fd_ : -1, POLLIN, 0}});
    absl::Time wake = accepting ? absl::InfiniteFuture() : accept_after_;
    for (const WaitingConnection& w : waiting.connections()) {
      fds.push_back({w.fd, POLLIN, 0});
      wake = std::min(wake, w.deadline);
    }
    const int timeout =
        wake == absl::InfiniteFuture() ? -1 : std::max(0, ToMillis(wake - before) + 1);
    if (::poll(fds.data(), fds.size(), timeout) < 0) {
      if (errno == EINTR) continue;
      spdlog::error("handoff socket {}: poll: {}; no more handoffs", path_, std::strerror(errno));
      break;
    }
    if (fds[0].revents != 0) break;
    const absl::Time now = absl::Now();
    // Requests that arrived (and the late) first: a connection pushed out
    // by the next accept has had its chance.
    for (size_t i = waiting.connections().size(); i-- > 0;) {
      const short revents = fds[2 + i].revents;
      if (revents == 0 && now < waiting.connections()[i].deadline) continue;
      const WaitingConnection w = waiting.Take(i);
      Serve(w, revents != 0
                   ? absl::OkStatus()
                   : absl::DeadlineExceededError(absl::StrCat(
                         "no request within ", absl::FormatDuration(kHandoffRequestTimeout),
                         " of the connection")));
      ::close(w.fd);
    }
    if ((fds[1].revents & POLLIN) != 0) Accept(&waiting, now);
  }
  for (const WaitingConnection& w : waiting.connections()) ::close(w.fd);
}

void HandoffServer::Accept(HandoffWaiting* waiting, absl::Time now) {
  const int connection = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
  if (connection < 0) {
    const int error = errno;
    // Else the peer gave up before we accepted it (ECONNABORTED), or a
    // signal came: nothing to say.
    if (error == EMFILE || error == ENFILE || error == ENOBUFS || error == ENOMEM) {
      BackOff(error, now);
    }
    return;
  }
  if (failed_accepts_ != 0) {
    spdlog::info("handoff socket {}: accepting again, after {} failed accepts over {}", path_,
                 failed_accepts_, absl::FormatDuration(now - failing_since_));
    failed_accepts_ = 0;
  }
  std::optional<WaitingConnection> out =
      waiting->Add(Waiting(connection, now + kHandoffRequestTimeout));
  if (!out.has_value()) return;
  // Its request may have come since the poll.
  Serve(*out, Readable(out->fd)
                  ? absl::OkStatus()
                  : absl::ResourceExhaustedError(absl::StrCat(
                        "no request yet, and a newer connection took its place (at most ",
                        kMaxHandoffConnectionsPerUid, " of one uid and ", kMaxHandoffConnections,
                        " in all wait for their request)")));
  ::close(out->fd);
}

void HandoffServer::BackOff(int error, absl::Time now) {
  backoff_ = failed_accepts_ == 0 ? kMinHandoffAcceptBackoff
                                  : std::min(2 * backoff_, kMaxHandoffAcceptBackoff);
  accept_after_ = now + backoff_;
  if (failed_accepts_++ == 0) {
    failing_since_ = now;
    rlimit limit{};
    ::getrlimit(RLIMIT_NOFILE, &limit);
    spdlog::warn(
        "handoff socket {}: accept: {} (RLIMIT_NOFILE {}); accepting again in {}, then in pauses "
        "doubling up to {} while it lasts",
        path_, std::strerror(error), limit.rlim_cur, absl::FormatDuration(backoff_),
        absl::FormatDuration(kMaxHandoffAcceptBackoff));
  }
}

void HandoffServer::LogRefusal(const char* what, const std::string& peer,
                               const absl::Status& status) {
  if (const uint64_t n = refusal_log_.Tick(status.code()); n != 0) {
    spdlog::info("{} {}: {}{}", what, peer, status.ToString(), LogLimitNote(n));
  }
}

void HandoffServer::LogUnsent(const std::string& what, const std::string& peer,
                              const std::string& error) {
  if (const uint64_t n = unsent_log_.Tick(); n != 0) {
    spdlog::warn("handoff: {} to {} not sent: {}{}", what, peer, error, LogLimitNote(n));
  }
}

absl::Status DecodeHandoffRequest(absl::string_view received, size_t length,
                                  v1::HandoffRequest* request) {
  if (length == 0) return absl::InvalidArgumentError("the connection closed without a request");
  if (length > kMaxHandoffRequestBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "request of ", length, " bytes is over the limit of ", kMaxHandoffRequestBytes));
  }
  if (!request->ParseFromArray(received.data(), static_cast<int>(received.size()))) {
    return absl::InvalidArgumentError(
        absl::StrCat("request of ", length, " bytes is not a kvhost.v1.HandoffRequest"));
  }
  if (request->kind() == v1::HANDOFF_KIND_UNSPECIFIED) {
    return absl::InvalidArgumentError("request names no kind (HandoffRequest.kind)");
  }
  return absl::OkStatus();
}

absl::Status HandoffServer::ReadRequest(int connection, v1::HandoffRequest* request,
                                        std::vector<UniqueFd>* received) {
  // One byte more than the limit, and room for one deposit's descriptors.
  std::vector<char> buffer(kMaxHandoffRequestBytes + 1);
  iovec iov{buffer.data(), buffer.size()};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * KVHOST_MAX_DEPOSIT_DESCRIPTORS)] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  const ssize_t n = ::recvmsg(connection, &msg, MSG_DONTWAIT | MSG_TRUNC | MSG_CMSG_CLOEXEC);
  if (n < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot read the request: ", std::strerror(errno)));
  }
  // Every descriptor that arrived is owned from here on, so that none leaks
  // whatever is wrong with the request.
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const size_t fds = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < fds; ++i) {
      int one = -1;
      std::memcpy(&one, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
      received->emplace_back(one);
    }
  }
  if ((msg.msg_flags & MSG_CTRUNC) != 0) {
    received->clear();
    return absl::InvalidArgumentError(absl::StrCat("the request carried more than ",
                                                   KVHOST_MAX_DEPOSIT_DESCRIPTORS, " descriptors"));
  }
  // With MSG_TRUNC the count is the message's whole length; a message the
  // kernel cut is longer than the buffer in any case.
  size_t length = static_cast<size_t>(n);
  if ((msg.msg_flags & MSG_TRUNC) != 0) length = std::max(length, buffer.size() + 1);
  return DecodeHandoffRequest(absl::string_view(buffer.data(), std::min(length, buffer.size())),
                              length, request);
}

absl::Status HandoffServer::Deposit(std::vector<UniqueFd> received,
                                    const WaitingConnection& connection,
                                    const v1::HandoffRequest& request, v1::HandoffReply* reply) {
  if (deposits_ == nullptr) {
    return absl::FailedPreconditionError("this handoff socket takes no deposits");
  }
  const size_t n = received.size();
  Depositor depositor;
  depositor.uid = connection.uid;
  depositor.sessions.assign(request.session_ids().begin(), request.session_ids().end());
  absl::StatusOr<std::string> id = deposits_->Put(std::move(received), depositor);
  if (!id.ok()) return id.status();
  if (const uint64_t logged = deposit_log_.Tick(); logged != 0) {
    spdlog::info("handoff: deposit {} of {} descriptors from {}{}", ShortId(*id), n,
                 connection.peer, LogLimitNote(logged));
  }
  reply->set_deposit_id(*id);
  reply->set_count(static_cast<uint32_t>(n));
  return absl::OkStatus();
}

void HandoffServer::OpenFastPath(int connection, const std::string& peer,
                                 const v1::HandoffRequest& request) {
  absl::StatusOr<FastPathOffer> offer =
      fast_path_ != nullptr
          ? fast_path_->Open(connection, CallerOf(request).sessions)
          : absl::StatusOr<FastPathOffer>(absl::FailedPreconditionError(
                "this handoff socket serves no fast path (kvhostd --fast-path-connections 0)"));
  // The mailbox thread's own copy of the connection: the loop closes this
  // one after the reply.
  UniqueFd kept;
  if (offer.ok()) {
    kept = UniqueFd(::fcntl(connection, F_DUPFD_CLOEXEC, 0));
    if (!kept.valid()) {
      offer =
          absl::InternalError(absl::StrCat("cannot keep the connection: ", std::strerror(errno)));
    }
  }
  v1::HandoffReply reply;
  if (offer.ok()) {
    reply.set_bytes(offer->bytes());
    reply.set_count(1);
  }
  reply.set_code(static_cast<int32_t>(offer.status().code()));
  reply.set_message(std::string(offer.status().message()));
  const std::string sent =
      SendReply(connection, reply.SerializeAsString(),
                offer.ok() ? std::vector<int>{offer->fd()} : std::vector<int>{});
  if (!offer.ok()) {
    LogRefusal("handoff refused to", peer, offer.status());
  } else if (!sent.empty()) {
    LogUnsent("fast-path mailbox", peer, sent);
  } else {
    fast_path_->Serve(*std::move(offer), std::move(kept), peer);
  }
}

void HandoffServer::Serve(const WaitingConnection& waiting, absl::Status refusal) {
  const int connection = waiting.fd;
  const std::string& peer = waiting.peer;
  v1::HandoffRequest request;
  std::vector<UniqueFd> received;
  absl::Status status =
      refusal.ok() ? ReadRequest(connection, &request, &received) : std::move(refusal);
  if (status.ok() && request.kind() == v1::HANDOFF_KIND_DEPOSIT) {
    v1::HandoffReply reply;
    status = Deposit(std::move(received), waiting, request, &reply);
    if (!status.ok()) reply.Clear();
    reply.set_code(static_cast<int32_t>(status.code()));
    reply.set_message(std::string(status.message()));
    if (std::string sent = SendReply(connection, reply.SerializeAsString(), {}); !sent.empty()) {
      // The id never reached the depositor: the deposit expires unused.
      LogUnsent("deposit reply", peer, sent);
    } else if (!status.ok()) {
      LogRefusal("handoff deposit refused to", peer, status);
    }
    return;
  }
  if (status.ok() && received.empty() && request.kind() == v1::HANDOFF_KIND_FAST_PATH) {
    OpenFastPath(connection, peer, request);
    return;
  }
  if (status.ok() && !received.empty()) {
    status = absl::InvalidArgumentError(
        absl::StrCat("a request for ", KindName(request.kind()), " carried ", received.size(),
                     " descriptors; only a deposit (HANDOFF_KIND_DEPOSIT) sends any"));
  }
  received.clear();
  HandoffItem item;
  if (status.ok()) {
    absl::StatusOr<HandoffItem> found =
        source_(CallerOf(request), request.attachment_id(), request.kind());
    if (found.ok()) {
      item = *std::move(found);
    } else {
      status = found.status();
    }
  }
  v1::HandoffReply reply;
  if (status.ok()) {
    reply.set_bytes(item.bytes);
    reply.set_count(item.count);
    *reply.mutable_pool_regions() = std::move(item.pool_regions);
    if (reply.ByteSizeLong() > kMaxHandoffReplyBytes) {
      status = absl::ResourceExhaustedError(absl::StrCat("the reply of ", reply.ByteSizeLong(),
                                                         " bytes exceeds the limit of ",
                                                         kMaxHandoffReplyBytes));
      reply.Clear();
    }
  }
  reply.set_code(static_cast<int32_t>(status.code()));
  reply.set_message(std::string(status.message()));
  const std::string sent =
      SendReply(connection, reply.SerializeAsString(), status.ok() ? item.fds : std::vector<int>{});
  const std::string what =
      absl::StrCat(KindName(request.kind()), " of ", ShortId(request.attachment_id()));
  if (status.ok() && sent.empty()) {
    spdlog::info("handoff: {} to {}", what, peer);
  } else if (status.ok()) {
    LogUnsent(what, peer, sent);
  } else {
    LogRefusal("handoff refused to", peer, status);
  }
}

}  // namespace kvhost
