// Deposits (server/service/deposits.h): a deposit keeps its descriptors
// under a capability id; Lend fills every cuMem chunk of a request (group
// entries too) from the deposits it names and changes nothing held on a
// refusal; UseUp closes them; the bounds (per deposit, per client, per uid,
// in all) hold, and a flood from one client leaves another's share whole; the
// bounds derive from RLIMIT_NOFILE; an expired deposit is closed by the
// sweeper and is NOT_FOUND like one never made.
#include "server/service/deposits.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace kvhost {
namespace {

// `n` fresh descriptors (memfds), each a distinct open file.
std::vector<UniqueFd> Fds(size_t n) {
  std::vector<UniqueFd> fds;
  for (size_t i = 0; i < n; ++i) fds.emplace_back(::memfd_create("deposit-test", MFD_CLOEXEC));
  return fds;
}

bool IsOpen(int fd) { return ::fcntl(fd, F_GETFD) != -1; }

DeviceBufferRef FdBuffer(const std::string& deposit, std::vector<uint32_t> indices) {
  DeviceBufferRef ref;
  ref.kind = DeviceBufferRef::Kind::kCudaFd;
  ref.gpu_uuid = "GPU-00000000-0000-0000-0000-000000000000";
  for (uint32_t i : indices) ref.chunks.push_back({deposit, i, 2 << 20, -1});
  return ref;
}

TEST(DepositsTest, PutLendUseUp) {
  Deposits deposits;
  std::vector<UniqueFd> fds = Fds(3);
  std::vector<int> raw;
  for (const UniqueFd& fd : fds) raw.push_back(fd.get());
  absl::StatusOr<std::string> id = deposits.Put(std::move(fds));
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_TRUE(absl::StartsWith(*id, "dep-")) << *id;
  EXPECT_EQ(deposits.descriptors(), 3u);
  EXPECT_EQ(deposits.deposits(), 1u);

  AttachRequest request;
  request.k_layers.push_back(FdBuffer(*id, {0, 1}));
  request.v_layers.push_back(FdBuffer(*id, {2}));
  DeviceBufferRef shm;  // other kinds are left alone
  request.v_layers.push_back(shm);
  EXPECT_TRUE(NamesDeposits(request));
  absl::StatusOr<Deposits::Lent> lent = deposits.Lend(&request);
  ASSERT_TRUE(lent.ok()) << lent.status();
  EXPECT_EQ(lent->ids, std::vector<std::string>{*id});
  EXPECT_EQ(request.k_layers[0].chunks[0].fd, raw[0]);
  EXPECT_EQ(request.k_layers[0].chunks[1].fd, raw[1]);
  EXPECT_EQ(request.v_layers[0].chunks[0].fd, raw[2]);
  EXPECT_EQ(request.v_layers[1].chunks.size(), 0u);

  deposits.UseUp(*lent);
  EXPECT_EQ(deposits.deposits(), 0u);
  EXPECT_EQ(deposits.descriptors(), 0u);
  // Still open while `lent` holds them; closed once it goes.
  EXPECT_TRUE(IsOpen(raw[0]));
  lent = absl::InternalError("gone");
  for (int fd : raw) EXPECT_FALSE(IsOpen(fd)) << fd;

  // Used up: a second attach naming it is NOT_FOUND.
  AttachRequest again;
  again.k_layers.push_back(FdBuffer(*id, {0}));
  absl::StatusOr<Deposits::Lent> second = deposits.Lend(&again);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(absl::StrContains(second.status().message(), "k_layers[0].chunks[0]"))
      << second.status();
}

TEST(DepositsTest, GroupEntriesAndNamedComponents) {
  Deposits deposits;
  absl::StatusOr<std::string> a = deposits.Put(Fds(1));
  absl::StatusOr<std::string> b = deposits.Put(Fds(2));
  ASSERT_TRUE(a.ok() && b.ok());
  AttachRequest request;
  AttachEntry entry;
  entry.entry = "mamba";
  ComponentBuffers named;
  named.name = "conv0";
  named.field = "components[0].layers";
  named.layers.push_back(FdBuffer(*b, {1}));
  entry.request.named.push_back(named);
  entry.request.k_layers.push_back(FdBuffer(*a, {0}));
  request.entries.push_back(entry);
  EXPECT_TRUE(NamesDeposits(request));
  absl::StatusOr<Deposits::Lent> lent = deposits.Lend(&request);
  ASSERT_TRUE(lent.ok()) << lent.status();
  EXPECT_EQ(lent->ids.size(), 2u);
  EXPECT_GE(request.entries[0].request.named[0].layers[0].chunks[0].fd, 0);
  EXPECT_GE(request.entries[0].request.k_layers[0].chunks[0].fd, 0);

  AttachRequest none;
  none.k_layers.push_back(DeviceBufferRef{});
  EXPECT_FALSE(NamesDeposits(none));
}

TEST(DepositsTest, RefusalsChangeNothing) {
  Deposits deposits;
  absl::StatusOr<std::string> id = deposits.Put(Fds(2));
  ASSERT_TRUE(id.ok());
  AttachRequest past;
  past.k_layers.push_back(FdBuffer(*id, {0}));
  past.k_layers.push_back(FdBuffer(*id, {2}));
  absl::StatusOr<Deposits::Lent> lent = deposits.Lend(&past);
  ASSERT_FALSE(lent.ok());
  EXPECT_EQ(lent.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(lent.status().message(), "k_layers[1].chunks[0]: index 2"))
      << lent.status();
  // A guessed id, and one that looks like a real one: NOT_FOUND, the id
  // shown short.
  AttachRequest guessed;
  guessed.v_layers.push_back(FdBuffer(*id + "0", {0}));
  lent = deposits.Lend(&guessed);
  ASSERT_FALSE(lent.ok());
  EXPECT_EQ(lent.status().code(), absl::StatusCode::kNotFound);
  EXPECT_FALSE(absl::StrContains(lent.status().message(), *id)) << lent.status();
  EXPECT_EQ(deposits.deposits(), 1u);
  EXPECT_EQ(deposits.descriptors(), 2u);

  // Empty and oversized deposits.
  absl::StatusOr<std::string> empty = deposits.Put({});
  EXPECT_EQ(empty.status().code(), absl::StatusCode::kInvalidArgument);
  std::vector<UniqueFd> many = Fds(KVHOST_MAX_DEPOSIT_DESCRIPTORS + 1);
  const int first = many[0].get();
  absl::StatusOr<std::string> big = deposits.Put(std::move(many));
  EXPECT_EQ(big.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(IsOpen(first));  // closed on the refusal
  EXPECT_EQ(deposits.descriptors(), 2u);
}

DepositLimits Limits(size_t in_all, size_t per_uid, size_t per_client) {
  DepositLimits limits;
  limits.descriptors = in_all;
  limits.per_uid = per_uid;
  limits.per_client = per_client;
  return limits;
}

Depositor Uid(uint32_t uid, std::vector<std::string> sessions = {}) {
  Depositor d;
  d.uid = uid;
  d.sessions = std::move(sessions);
  return d;
}

TEST(DepositsTest, BoundInAll) {
  Deposits deposits(Limits(5, 5, 5));
  ASSERT_TRUE(deposits.Put(Fds(3)).ok());
  absl::StatusOr<std::string> over = deposits.Put(Fds(3), Uid(1));
  ASSERT_FALSE(over.ok());
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(absl::StrContains(over.status().message(), "limit of 5")) << over.status();
  EXPECT_TRUE(deposits.Put(Fds(2), Uid(1)).ok());
  EXPECT_EQ(deposits.descriptors(), 5u);
}

// One client floods; another client of the same uid (its own session) and
// one of another uid still deposit, and what the flood held comes back
// when it is used up.
TEST(DepositsTest, AFloodFillsOnlyItsOwnShare) {
  const std::string victim_session = "ses-2-victim";
  Deposits deposits(Limits(100, 40, 10),
                    [&](const std::string& id) { return id == victim_session; });
  size_t flooded = 0;
  std::vector<std::string> ids;
  for (int i = 0; i < 50; ++i) {
    // A session not open counts as none: the uid's own share.
    absl::StatusOr<std::string> id = deposits.Put(Fds(3), Uid(1000, {"ses-9-made-up"}));
    if (!id.ok()) {
      EXPECT_EQ(id.status().code(), absl::StatusCode::kResourceExhausted);
      EXPECT_TRUE(absl::StrContains(id.status().message(), "uid 1000 holds 9")) << id.status();
      EXPECT_TRUE(absl::StrContains(id.status().message(), "client's share of 10")) << id.status();
      continue;
    }
    ids.push_back(*id);
    flooded += 3;
  }
  EXPECT_EQ(flooded, 9u);
  // The victim's session, same uid: a share of its own.
  absl::StatusOr<std::string> victim =
      deposits.Put(Fds(10), Uid(1000, {"ses-1-closed", victim_session}));
  ASSERT_TRUE(victim.ok()) << victim.status();
  absl::StatusOr<std::string> more = deposits.Put(Fds(1), Uid(1000, {victim_session}));
  ASSERT_FALSE(more.ok());
  EXPECT_TRUE(absl::StrContains(more.status().message(), "session ses-2-vi")) << more.status();
  EXPECT_FALSE(absl::StrContains(more.status().message(), victim_session)) << "a whole session id";
  // Another uid.
  EXPECT_TRUE(deposits.Put(Fds(10), Uid(2000)).ok());
  EXPECT_EQ(deposits.descriptors(), 29u);

  // Used up, the flood's share is free again.
  AttachRequest request;
  for (const std::string& id : ids) request.k_layers.push_back(FdBuffer(id, {0}));
  absl::StatusOr<Deposits::Lent> lent = deposits.Lend(&request);
  ASSERT_TRUE(lent.ok()) << lent.status();
  deposits.UseUp(*lent);
  EXPECT_TRUE(deposits.Put(Fds(10), Uid(1000)).ok());
}

// Many sessions of one uid fill at most the uid's share: another uid's
// deposits still fit.
TEST(DepositsTest, OneUidsSessionsShareItsBound) {
  Deposits deposits(Limits(100, 40, 10), [](const std::string&) { return true; });
  size_t held = 0;
  for (int s = 0; s < 20; ++s) {
    absl::StatusOr<std::string> id =
        deposits.Put(Fds(10), Uid(1000, {absl::StrCat("ses-", s, "-attacker")}));
    if (id.ok()) {
      held += 10;
    } else {
      EXPECT_TRUE(absl::StrContains(id.status().message(), "uid's share of 40")) << id.status();
    }
  }
  EXPECT_EQ(held, 40u);
  for (int s = 0; s < 6; ++s) {
    EXPECT_TRUE(deposits.Put(Fds(10), Uid(static_cast<uint32_t>(2000 + s))).ok()) << s;
  }
  EXPECT_EQ(deposits.descriptors(), 100u);
  absl::StatusOr<std::string> full = deposits.Put(Fds(1), Uid(3000));
  EXPECT_TRUE(absl::StrContains(full.status().message(), "limit of 100")) << full.status();
}

TEST(DepositsTest, LimitsFollowTheDescriptorLimit) {
  const DepositLimits systemd = DepositLimitsFor(524288);
  EXPECT_EQ(systemd.descriptors, 262144u);
  EXPECT_EQ(systemd.per_uid, 131072u);
  EXPECT_EQ(systemd.per_client, kMaxDepositDescriptorsPerClient);
  const DepositLimits low = DepositLimitsFor(16384);
  EXPECT_EQ(low.descriptors, 8192u);
  EXPECT_EQ(low.per_uid, 4096u);
  EXPECT_EQ(low.per_client, 2048u);
  // RLIM_INFINITY: bounded all the same.
  EXPECT_LE(DepositLimitsFor(~uint64_t{0}).descriptors, size_t{1} << 22);
}

TEST(DepositsTest, ExpiredDepositsAreClosed) {
  DepositLimits limits;
  limits.lifetime = absl::Milliseconds(100);
  Deposits deposits(limits);
  std::vector<UniqueFd> fds = Fds(1);
  const int raw = fds[0].get();
  absl::StatusOr<std::string> id = deposits.Put(std::move(fds));
  ASSERT_TRUE(id.ok());
  // The sweeper closes it without any call.
  for (absl::Time end = absl::Now() + absl::Seconds(10);
       deposits.deposits() != 0 && absl::Now() < end;) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(deposits.deposits(), 0u);
  EXPECT_EQ(deposits.descriptors(), 0u);
  EXPECT_FALSE(IsOpen(raw));
  AttachRequest request;
  request.k_layers.push_back(FdBuffer(*id, {0}));
  absl::StatusOr<Deposits::Lent> lent = deposits.Lend(&request);
  EXPECT_EQ(lent.status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(absl::StrContains(lent.status().message(), "expired")) << lent.status();
}

}  // namespace
}  // namespace kvhost
