#include "server/service/deposits.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "server/ids.h"
#include "spdlog/spdlog.h"

namespace kvhost {
namespace {

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

Deposits::Deposits(absl::Duration lifetime, size_t max_descriptors)
    : lifetime_(lifetime), max_descriptors_(max_descriptors) {
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
  const absl::Duration period = SweepPeriod(lifetime_);
  absl::MutexLock lock(&mu_);
  while (!stopping_) {
    mu_.AwaitWithTimeout(absl::Condition(&stopping_), period);
    Sweep(absl::Now());
  }
}

void Deposits::Sweep(absl::Time now) {
  for (auto it = held_.begin(); it != held_.end();) {
    if (it->second->expires > now) {
      ++it;
      continue;
    }
    spdlog::info("deposit {} of {} descriptors expired unused after {}", ShortId(it->first),
                 it->second->fds.size(), absl::FormatDuration(lifetime_));
    descriptors_ -= it->second->fds.size();
    it = held_.erase(it);
  }
}

absl::StatusOr<std::string> Deposits::Put(std::vector<UniqueFd> fds) {
  if (fds.empty()) {
    return absl::InvalidArgumentError(
        "a deposit carries no descriptors (send them in the request's SCM_RIGHTS message)");
  }
  if (fds.size() > kMaxDepositDescriptors) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a deposit of ", fds.size(), " descriptors; at most ", kMaxDepositDescriptors, " in one"));
  }
  absl::MutexLock lock(&mu_);
  Sweep(absl::Now());
  if (descriptors_ + fds.size() > max_descriptors_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "kvhostd holds ", descriptors_, " deposited descriptors; ", fds.size(), " more would pass ",
        "its limit of ", max_descriptors_, " (deposits wait at most ",
        absl::FormatDuration(lifetime_), " for their attach)"));
  }
  std::string id = CapabilityId("dep", ++serial_);
  auto deposit = std::make_shared<Deposit>();
  deposit->expires = absl::Now() + lifetime_;
  descriptors_ += fds.size();
  deposit->fds = std::move(fds);
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
                  absl::FormatDuration(lifetime_), " after it was made); deposit again"));
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
    descriptors_ -= it->second->fds.size();
    held_.erase(it);
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
