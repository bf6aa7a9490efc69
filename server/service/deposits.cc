#include "server/service/deposits.h"

#include <sys/resource.h>

#include <algorithm>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "server/ids.h"
#include "spdlog/spdlog.h"

namespace kvhost {
namespace {

// Session ids of a deposit looked up at most: the client sends its open
// session's and the few it held before.
constexpr size_t kMaxSessionsLookedUp = 8;
// Deposits hold at most this many descriptors, whatever the limit
// (RLIM_INFINITY): far more than any node's workers attach at once.
constexpr uint64_t kMaxDepositedDescriptors = uint64_t{1} << 22;

// A client as the log and messages show it: a session id is a capability,
// shown short.
std::string Shown(const std::string& client) {
  return absl::StartsWith(client, "session ") ? absl::StrCat("session ", ShortId(client.substr(8)))
                                              : client;
}

// How often expired deposits are closed, at most: a small part of their
// lifetime, so none outlives it by much.
absl::Duration SweepPeriod(absl::Duration lifetime) {
  return std::max(absl::Milliseconds(10), lifetime / 8);
}

// Calls `fn` on every buffer of `request` and of its group entries.
template <typename Fn>
absl::Status ForEachBuffer(AttachRequest* request, const std::string& prefix, Fn fn) {
  auto each = [&](std::vector<DeviceBufferRef>& buffers, const std::string& field) -> absl::Status {
    for (size_t i = 0; i < buffers.size(); ++i) {
      if (absl::Status s = fn(&buffers[i], absl::StrCat(prefix, field, "[", i, "]")); !s.ok()) {
        return s;
      }
    }
    return absl::OkStatus();
  };
  if (absl::Status s = each(request->k_layers, "k_layers"); !s.ok()) return s;
  if (absl::Status s = each(request->v_layers, "v_layers"); !s.ok()) return s;
  for (ComponentBuffers& named : request->named) {
    if (absl::Status s = each(named.layers, named.field); !s.ok()) return s;
  }
  for (size_t e = 0; e < request->entries.size(); ++e) {
    absl::Status s =
        ForEachBuffer(&request->entries[e].request, absl::StrCat(prefix, "entries[", e, "]."), fn);
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace

bool NamesDeposits(const AttachRequest& request) {
  AttachRequest copy = request;
  bool names = false;
  ForEachBuffer(&copy, "", [&](DeviceBufferRef* ref, const std::string&) {
    names = names || ref->kind == DeviceBufferRef::Kind::kCudaFd;
    return absl::OkStatus();
  }).IgnoreError();
  return names;
}

DepositLimits DepositLimitsFor(uint64_t nofile) {
  DepositLimits limits;
  limits.descriptors = static_cast<size_t>(std::min(nofile / 2, kMaxDepositedDescriptors));
  limits.per_uid = limits.descriptors / 2;
  limits.per_client = std::min(kMaxDepositDescriptorsPerClient, limits.per_uid / 2);
  return limits;
}

DepositLimits DepositLimitsOfThisProcess() {
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0) limit.rlim_cur = 1024;  // the usual soft limit
  const DepositLimits limits = DepositLimitsFor(limit.rlim_cur);
  spdlog::info(
      "deposits: at most {} descriptors held (half of RLIMIT_NOFILE {}), {} per uid, {} per "
      "client (session or uid)",
      limits.descriptors, limit.rlim_cur, limits.per_uid, limits.per_client);
  return limits;
}

Deposits::Deposits(DepositLimits limits, SessionCheck session_open)
    : limits_(limits), session_open_(std::move(session_open)) {
  sweeper_ = std::thread([this] { SweepLoop(); });
}

Deposits::~Deposits() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  sweeper_.join();
}

void Deposits::SweepLoop() {
  const absl::Duration period = SweepPeriod(limits_.lifetime);
  absl::MutexLock lock(&mu_);
  while (!stopping_) {
    mu_.AwaitWithTimeout(absl::Condition(&stopping_), period);
    Sweep(absl::Now());
  }
}

void Deposits::Erase(std::map<std::string, std::shared_ptr<const Deposit>>::iterator it) {
  const Deposit& deposit = *it->second;
  const size_t n = deposit.fds.size();
  descriptors_ -= n;
  if (auto c = by_client_.find(deposit.client); c != by_client_.end() && (c->second -= n) == 0) {
    by_client_.erase(c);
  }
  if (auto u = by_uid_.find(deposit.uid); u != by_uid_.end() && (u->second -= n) == 0) {
    by_uid_.erase(u);
  }
  held_.erase(it);
}

void Deposits::Sweep(absl::Time now) {
  for (auto it = held_.begin(); it != held_.end();) {
    if (it->second->expires > now) {
      ++it;
      continue;
    }
    if (const uint64_t n = expiry_log_.Tick(now); n != 0) {
      spdlog::info("deposit {} of {} descriptors of {} expired unused after {}{}",
                   ShortId(it->first), it->second->fds.size(), Shown(it->second->client),
                   absl::FormatDuration(limits_.lifetime), LogLimitNote(n));
    }
    Erase(it++);
  }
}

std::string Deposits::ClientOf(const Depositor& depositor) const {
  if (session_open_ != nullptr) {
    const size_t n = std::min(depositor.sessions.size(), kMaxSessionsLookedUp);
    for (size_t i = 0; i < n; ++i) {
      if (session_open_(depositor.sessions[i]))
        return absl::StrCat("session ", depositor.sessions[i]);
    }
  }
  return absl::StrCat("uid ", depositor.uid);
}

absl::Status Deposits::CheckShares(size_t n, const std::string& client, uint32_t uid) const {
  const std::string wait = absl::StrCat(
      "; deposits wait at most ", absl::FormatDuration(limits_.lifetime), " for their attach");
  auto held = [](const auto& map, const auto& key) -> size_t {
    auto it = map.find(key);
    return it == map.end() ? 0 : it->second;
  };
  const std::string who = Shown(client);
  if (const size_t mine = held(by_client_, client); mine + n > limits_.per_client) {
    return absl::ResourceExhaustedError(
        absl::StrCat(who, " holds ", mine, " deposited descriptors; ", n,
                     " more would pass a client's share of ", limits_.per_client,
                     " (a worker's open session has a share of its own)", wait));
  }
  if (const size_t theirs = held(by_uid_, uid); theirs + n > limits_.per_uid) {
    return absl::ResourceExhaustedError(
        absl::StrCat("uid ", uid, " holds ", theirs, " deposited descriptors; ", n,
                     " more would pass a uid's share of ", limits_.per_uid, wait));
  }
  if (descriptors_ + n > limits_.descriptors) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "kvhostd holds ", descriptors_, " deposited descriptors; ", n, " more would pass ",
        "its limit of ", limits_.descriptors, " (half its RLIMIT_NOFILE)", wait));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> Deposits::Put(std::vector<UniqueFd> fds, const Depositor& depositor) {
  if (fds.empty()) {
    return absl::InvalidArgumentError(
        "a deposit carries no descriptors (send them in the request's SCM_RIGHTS message)");
  }
  if (fds.size() > KVHOST_MAX_DEPOSIT_DESCRIPTORS) {
    return absl::InvalidArgumentError(absl::StrCat("a deposit of ", fds.size(),
                                                   " descriptors; at most ",
                                                   KVHOST_MAX_DEPOSIT_DESCRIPTORS, " in one"));
  }
  absl::MutexLock lock(&mu_);
  Sweep(absl::Now());
  std::string client = ClientOf(depositor);
  if (absl::Status s = CheckShares(fds.size(), client, depositor.uid); !s.ok()) return s;
  std::string id = CapabilityId("dep", ++serial_);
  auto deposit = std::make_shared<Deposit>();
  deposit->expires = absl::Now() + limits_.lifetime;
  descriptors_ += fds.size();
  by_client_[client] += fds.size();
  by_uid_[depositor.uid] += fds.size();
  deposit->fds = std::move(fds);
  deposit->client = std::move(client);
  deposit->uid = depositor.uid;
  held_.emplace(id, std::move(deposit));
  return id;
}

absl::StatusOr<Deposits::Lent> Deposits::Lend(AttachRequest* request) const {
  Lent lent;
  std::map<std::string, std::shared_ptr<const Deposit>> found;
  absl::MutexLock lock(&mu_);
  absl::Status s = ForEachBuffer(
      request, "", [&](DeviceBufferRef* ref, const std::string& where) -> absl::Status {
        if (ref->kind != DeviceBufferRef::Kind::kCudaFd) return absl::OkStatus();
        for (size_t c = 0; c < ref->chunks.size(); ++c) {
          FdChunk& chunk = ref->chunks[c];
          auto it = found.find(chunk.deposit_id);
          if (it == found.end()) {
            auto held = held_.find(chunk.deposit_id);
            if (held == held_.end() || held->second->expires <= absl::Now()) {
              return absl::NotFoundError(absl::StrCat(
                  where, ".chunks[", c, "]: deposit '", ShortId(chunk.deposit_id),
                  "' is not held: it was never made, an attachment used it up, or it expired (",
                  absl::FormatDuration(limits_.lifetime), " after it was made); deposit again"));
            }
            it = found.emplace(held->first, held->second).first;
          }
          if (chunk.index >= it->second->fds.size()) {
            return absl::InvalidArgumentError(
                absl::StrCat(where, ".chunks[", c, "]: index ", chunk.index, " is past deposit '",
                             ShortId(chunk.deposit_id), "', which holds ", it->second->fds.size(),
                             " descriptors"));
          }
          chunk.fd = it->second->fds[chunk.index].get();
        }
        return absl::OkStatus();
      });
  if (!s.ok()) return s;
  for (auto& [id, deposit] : found) {
    lent.ids.push_back(id);
    lent.held.push_back(deposit);
  }
  return lent;
}

void Deposits::UseUp(const Lent& lent) {
  absl::MutexLock lock(&mu_);
  for (const std::string& id : lent.ids) {
    auto it = held_.find(id);
    if (it == held_.end()) continue;  // expired meanwhile
    Erase(it);
  }
}

size_t Deposits::descriptors() const {
  absl::MutexLock lock(&mu_);
  return descriptors_;
}

size_t Deposits::deposits() const {
  absl::MutexLock lock(&mu_);
  return held_.size();
}

}  // namespace kvhost
