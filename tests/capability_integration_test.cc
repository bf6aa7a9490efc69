// Capabilities through kvhostd: attachment
// and session ids are shown to nobody but their owner (GetStatus counts them,
// logs show a prefix); a stranger's attachment id is refused for Backup, Load,
// DetachDevice and WaitTransfer with NOT_FOUND and nothing changes, while the
// owner's session and the pool's token holder may act; a ticket id from
// before a daemon restart names no ticket of the new daemon; followers of a
// protected pool need the followed pool's token; owner tokens gRPC metadata
// cannot carry are refused; region files of protected pools are named only
// to the token's holder.
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "api_test_util.h"
#include "daemon_fixture.h"
#include "gtest/gtest.h"
#include "kvhost/client.h"
#include "kvhost/v1/pool.grpc.pb.h"

namespace kvhost {
namespace {

namespace fs = std::filesystem;
using ::kvhost::testing::Dims;
using ::kvhost::testing::IsError;
using ::kvhost::testing::MakeSpec;
using ::kvhost::testing::Range;
using ::kvhost::testing::ReadFile;
using ::kvhost::testing::StartKvhostd;
using ::kvhost::testing::StatusOf;
using ::kvhost::testing::StopKvhostd;
using ::kvhost::testing::TestDaemon;

constexpr char kToken[] = "capability-owner-token";
constexpr uint32_t kPageSize = 16;
constexpr uint64_t kPoolTokens = 256;
constexpr uint64_t kDeviceRows = 64;
constexpr char kRefused[] = "not this session's";

v1::PoolSpec Spec() { return MakeSpec(v1::MHA, v1::PAGE_FIRST, kPageSize, kPoolTokens); }

// A K_ONLY pool following `followed` (an MHA pool of Spec()'s dims).
v1::PoolSpec FollowerSpec(const std::string& followed) {
  const Dims dims;
  v1::PoolSpec spec;
  spec.set_kind(v1::K_ONLY);
  spec.set_layout(v1::PAGE_FIRST);
  spec.set_dtype(v1::BF16);
  spec.set_layer_num(dims.layers);
  spec.set_head_num(dims.heads);
  spec.set_head_dim(dims.head_dim);
  spec.set_follows(followed);
  return spec;
}

std::unique_ptr<Client> Connect(const std::string& address, const std::string& token,
                                bool worker_session) {
  ClientOptions options;
  options.address = address;
  options.timeout = absl::Seconds(10);
  options.owner_token = token;
  options.worker_session = worker_session;
  absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect(options);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *std::move(c) : nullptr;
}

// Every byte of a device pool's layer buffers.
std::string DeviceBytes(const ShmDevicePool& dev) {
  std::string out;
  for (uint32_t c = 0; c < dev.components(); ++c) {
    for (uint32_t l = 0; l < dev.layers(); ++l) {
      out.append(reinterpret_cast<const char*>(dev.layer(c, l)), dev.rows(c) * dev.row_bytes(c));
    }
  }
  return out;
}

void FillDevice(ShmDevicePool& dev, char value) {
  for (uint32_t c = 0; c < dev.components(); ++c) {
    for (uint32_t l = 0; l < dev.layers(); ++l) {
      std::memset(dev.layer(c, l), value + static_cast<char>(l), dev.rows(c) * dev.row_bytes(c));
    }
  }
}

class CapabilityTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<TestDaemon>> d = TestDaemon::Start(KVHOSTD_PATH);
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = *std::move(d);
    // The worker: a session, like every worker of the client library.
    worker_ = Connect(daemon_->address(), "", /*worker_session=*/true);
    absl::StatusOr<v1::Pool> pool = worker_->CreatePool("kv", Spec());
    ASSERT_TRUE(pool.ok()) << pool.status();
    absl::StatusOr<std::vector<int64_t>> slots = worker_->Alloc("kv", 2 * kPageSize);
    ASSERT_TRUE(slots.ok()) << slots.status();
    slots_ = *slots;
    absl::StatusOr<std::unique_ptr<ShmDevicePool>> dev =
        ShmDevicePool::Create(*pool, kDeviceRows, daemon_->shm_dir());
    ASSERT_TRUE(dev.ok()) << dev.status();
    dev_ = *std::move(dev);
    FillDevice(*dev_, 'a');
    absl::StatusOr<v1::Attachment> att = worker_->AttachDevice(dev_->MakeAttachRequest("kv"));
    ASSERT_TRUE(att.ok()) << att.status();
    att_ = *att;
    ASSERT_FALSE(att_.session_id().empty());
    ASSERT_EQ(att_.session_id(), worker_->session_state().session_id);
  }
  void TearDown() override {
    if (HasFailure() && daemon_ != nullptr) {
      std::fprintf(stderr, "--- kvhostd log ---\n%s\n", daemon_->Log().c_str());
    }
  }

  // The random part of an id ("att-1-<32 hex>"): what must never show.
  static std::string Secret(const std::string& id) { return id.substr(id.rfind('-') + 1); }

  std::unique_ptr<TestDaemon> daemon_;
  std::unique_ptr<Client> worker_;
  std::unique_ptr<ShmDevicePool> dev_;
  v1::Attachment att_;
  std::vector<int64_t> slots_;
};

// Regression test: GetStatus listed every session with its attachment ids.
TEST_F(CapabilityTest, GetStatusShowsNoSessionOrAttachmentId) {
  const std::string session = worker_->session_state().session_id;
  EXPECT_EQ(Secret(att_.id()).size(), 32u) << att_.id();
  EXPECT_EQ(Secret(session).size(), 32u) << session;
  std::unique_ptr<Client> anyone = Connect(daemon_->address(), "", /*worker_session=*/false);
  absl::StatusOr<v1::DaemonStatus> status = anyone->GetStatus();
  ASSERT_TRUE(status.ok()) << status.status();
  ASSERT_EQ(status->sessions_size(), 1);
  EXPECT_EQ(status->sessions(0).attachment_count(), 1u);
  EXPECT_EQ(status->attachments(), 1u);
  const std::string wire = status->SerializeAsString();
  for (const std::string& secret : {Secret(att_.id()), Secret(session)}) {
    EXPECT_FALSE(absl::StrContains(wire, secret)) << secret;
    EXPECT_FALSE(absl::StrContains(wire, secret.substr(0, 8))) << secret;
  }
  // Nor do the pool calls or the log (a prefix of 4 digits at most).
  absl::StatusOr<std::vector<v1::Pool>> pools = anyone->ListPools();
  ASSERT_TRUE(pools.ok());
  for (const v1::Pool& p : *pools) {
    EXPECT_FALSE(absl::StrContains(p.SerializeAsString(), Secret(att_.id()).substr(0, 8)));
  }
  ASSERT_TRUE(worker_->DetachDevice(att_.id()).ok());
  const std::string log = daemon_->Log();
  EXPECT_TRUE(absl::StrContains(log, absl::StrCat(Secret(att_.id()).substr(0, 4), "...")));
  for (const std::string& secret : {Secret(att_.id()), Secret(session)}) {
    EXPECT_FALSE(absl::StrContains(log, secret.substr(0, 5))) << secret;
  }
}

// Regression test: with an attachment id, anyone could Backup into, Load from or
// Detach a stranger's attachment.
TEST_F(CapabilityTest, AStrangersAttachmentIdIsRefusedAndTheOwnerStillWorks) {
  absl::StatusOr<uint64_t> backup =
      worker_->Backup(att_.id(), Range(slots_[0], kPageSize), Range(0, kPageSize));
  ASSERT_TRUE(backup.ok()) << backup.status();
  ASSERT_TRUE(worker_->WaitTransfer(*backup).ok());
  absl::StatusOr<std::vector<std::string>> host = worker_->ReadPages("kv", {slots_[0]});
  ASSERT_TRUE(host.ok()) << host.status();
  const std::string device = DeviceBytes(*dev_);

  // A stranger with a session of its own, one without any, and one naming
  // a made-up session.
  std::unique_ptr<Client> with_session = Connect(daemon_->address(), "", true);
  ASSERT_TRUE(with_session->OpenSession().ok());
  std::unique_ptr<Client> without = Connect(daemon_->address(), "", false);
  std::unique_ptr<Client> forged = Connect(daemon_->address(), "", false);
  v1::AttachDeviceRequest bogus = dev_->MakeAttachRequest("kv");
  bogus.set_session_id("ses-1-00000000000000000000000000000000");
  EXPECT_EQ(forged->AttachDevice(bogus).status().code(), absl::StatusCode::kNotFound);
  for (Client* stranger : {with_session.get(), without.get(), forged.get()}) {
    const std::vector<absl::Status> refused = {
        StatusOf(
            stranger->Backup(att_.id(), Range(slots_[kPageSize], kPageSize), Range(0, kPageSize))),
        StatusOf(stranger->Load(att_.id(), Range(slots_[kPageSize], kPageSize),
                                Range(kPageSize, kPageSize))),
        stranger->DetachDevice(att_.id()),
        StatusOf(stranger->WaitTransfer(*backup, absl::Seconds(5))),
        StatusOf(stranger->PollTransfer(*backup)),
    };
    for (size_t i = 0; i < refused.size(); ++i) {
      EXPECT_TRUE(IsError(refused[i], absl::StatusCode::kNotFound, {}))
          << "call " << i << ": " << refused[i];
      EXPECT_FALSE(absl::StrContains(refused[i].message(), Secret(att_.id()))) << refused[i];
    }
    EXPECT_TRUE(absl::StrContains(refused[0].message(), kRefused)) << refused[0];
  }
  // Nothing changed: the attachment is there, the device and host bytes too.
  absl::StatusOr<v1::Pool> pool = worker_->GetPool("kv");
  ASSERT_TRUE(pool.ok());
  EXPECT_EQ(pool->attachments(), 1u);
  EXPECT_EQ(DeviceBytes(*dev_), device);
  absl::StatusOr<std::vector<std::string>> after = worker_->ReadPages("kv", {slots_[0]});
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(*after, *host);
  // The owner's calls all work.
  EXPECT_TRUE(worker_->PollTransfer(*backup).ok());
  absl::StatusOr<uint64_t> load =
      worker_->Load(att_.id(), Range(slots_[0], kPageSize), Range(kPageSize, kPageSize));
  ASSERT_TRUE(load.ok()) << load.status();
  EXPECT_TRUE(worker_->WaitTransfer(*load).ok());
  EXPECT_TRUE(worker_->DetachDevice(att_.id()).ok());
}

// The pool's owner token opens its session's attachments to a tool of the
// owner's (kvhostctl, a scheduler) that holds the token but not the session.
TEST_F(CapabilityTest, ThePoolsTokenHolderMayActOnASessionsAttachment) {
  std::unique_ptr<Client> owner = Connect(daemon_->address(), kToken, true);
  absl::StatusOr<v1::Pool> pool = owner->CreatePool("owned", Spec());
  ASSERT_TRUE(pool.ok()) << pool.status();
  absl::StatusOr<std::vector<int64_t>> slots = owner->Alloc("owned", kPageSize);
  ASSERT_TRUE(slots.ok());
  absl::StatusOr<std::unique_ptr<ShmDevicePool>> dev =
      ShmDevicePool::Create(*pool, kDeviceRows, daemon_->shm_dir());
  ASSERT_TRUE(dev.ok());
  absl::StatusOr<v1::Attachment> att = owner->AttachDevice((*dev)->MakeAttachRequest("owned"));
  ASSERT_TRUE(att.ok()) << att.status();
  ASSERT_FALSE(att->session_id().empty());

  std::unique_ptr<Client> wrong = Connect(daemon_->address(), "not-the-token", false);
  absl::StatusOr<uint64_t> t = wrong->Backup(att->id(), *slots, Range(0, kPageSize));
  EXPECT_TRUE(IsError(StatusOf(t), absl::StatusCode::kNotFound, {kRefused}));
  EXPECT_EQ(wrong->DetachDevice(att->id()).code(), absl::StatusCode::kNotFound);
  // The token of "owned" opens nothing of the unprotected pool's session.
  std::unique_ptr<Client> holder = Connect(daemon_->address(), kToken, false);
  EXPECT_EQ(
      StatusOf(holder->Backup(att_.id(), Range(slots_[0], kPageSize), Range(0, kPageSize))).code(),
      absl::StatusCode::kNotFound);
  t = holder->Backup(att->id(), *slots, Range(0, kPageSize));
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_TRUE(holder->WaitTransfer(*t).ok());
  EXPECT_EQ(wrong->PollTransfer(*t).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(owner->WaitTransfer(*t).ok());
  EXPECT_TRUE(holder->DetachDevice(att->id()).ok());
}

// Regression test: followers of a protected pool could be read, written and
// deleted without the token.
TEST_F(CapabilityTest, AFollowerOfAProtectedPoolNeedsTheFollowedPoolsToken) {
  std::unique_ptr<Client> owner = Connect(daemon_->address(), kToken, false);
  std::unique_ptr<Client> anonymous = Connect(daemon_->address(), "", false);
  std::unique_ptr<Client> stranger = Connect(daemon_->address(), "not-the-token", false);
  ASSERT_TRUE(owner->CreatePool("anchor", Spec()).ok());
  // Creating it takes the followed pool's token.
  EXPECT_EQ(StatusOf(anonymous->CreatePool("idx", FollowerSpec("anchor"))).code(),
            absl::StatusCode::kPermissionDenied);
  absl::StatusOr<v1::Pool> idx = owner->CreatePool("idx", FollowerSpec("anchor"));
  ASSERT_TRUE(idx.ok()) << idx.status();
  EXPECT_TRUE(idx->owner_protected());
  absl::StatusOr<std::vector<int64_t>> slots = owner->Alloc("anchor", kPageSize);
  ASSERT_TRUE(slots.ok());
  const std::string page(idx->bytes_per_page(), '\x42');
  ASSERT_TRUE(owner->WritePages("idx", {(*slots)[0]}, {page}).ok());

  absl::StatusOr<std::unique_ptr<ShmDevicePool>> dev =
      ShmDevicePool::Create(*idx, kDeviceRows, daemon_->shm_dir());
  ASSERT_TRUE(dev.ok()) << dev.status();
  const std::string other(page.size(), '\x17');
  for (Client* c : {anonymous.get(), stranger.get()}) {
    const std::vector<absl::Status> refused = {
        StatusOf(c->Alloc("idx", kPageSize)),
        StatusOf(c->Free("idx", *slots)),
        StatusOf(c->ReadPages("idx", {(*slots)[0]})),
        StatusOf(c->GetDataPage("idx", (*slots)[0])),
        StatusOf(c->WritePages("idx", {(*slots)[0]}, {other})),
        c->SetFromFlatDataPage("idx", (*slots)[0], other),
        StatusOf(c->AttachDevice((*dev)->MakeAttachRequest("idx"))),
        StatusOf(c->DeletePool("idx")),
    };
    for (size_t i = 0; i < refused.size(); ++i) {
      EXPECT_TRUE(IsError(refused[i], absl::StatusCode::kPermissionDenied, {"'idx'", "'anchor'"}))
          << "call " << i;
    }
  }
  // The token opens it: Alloc / Free get past the owner check (a follower
  // has no allocator of its own), the pages and DeletePool work.
  EXPECT_TRUE(IsError(StatusOf(owner->Alloc("idx", kPageSize)),
                      absl::StatusCode::kFailedPrecondition, {"anchor"}));
  EXPECT_TRUE(IsError(StatusOf(owner->Free("idx", *slots)), absl::StatusCode::kFailedPrecondition,
                      {"anchor"}));
  absl::StatusOr<std::vector<std::string>> read = owner->ReadPages("idx", {(*slots)[0]});
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ((*read)[0], page);  // unchanged by the refused writes
  // Its own different token is refused; the followed pool's is taken.
  v1::PoolSpec spec = FollowerSpec("anchor");
  std::unique_ptr<Client> other_token = Connect(daemon_->address(), "another-token", false);
  EXPECT_EQ(StatusOf(other_token->CreatePool("idx2", spec)).code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(owner->CreatePool("idx2", spec).ok());  // owner_token = the followed pool's
  EXPECT_TRUE(owner->DeletePool("idx2").ok());
  EXPECT_TRUE(owner->DeletePool("idx").ok());
  EXPECT_TRUE(owner->DeletePool("anchor").ok());
}

// Regression test: a token metadata cannot carry made a pool nobody could open.
TEST_F(CapabilityTest, OwnerTokensMetadataCannotCarryAreRefused) {
  auto channel = grpc::CreateChannel(daemon_->address(), grpc::InsecureChannelCredentials());
  std::unique_ptr<v1::PoolService::Stub> stub = v1::PoolService::NewStub(channel);
  const std::string bad[] = {std::string("nul\0inside", 10), "non-ascii-\xc3\xa9", "a space",
                             "tab\tin", std::string("\x01", 1)};
  for (const std::string& token : bad) {
    v1::CreatePoolRequest request;
    request.set_name("bad");
    *request.mutable_spec() = Spec();
    request.set_owner_token(token);
    v1::Pool response;
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    const grpc::Status s = stub->CreatePool(&context, request, &response);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
    EXPECT_TRUE(absl::StrContains(s.error_message(), "printable ASCII")) << s.error_message();
    EXPECT_FALSE(absl::StrContains(s.error_message(), token)) << s.error_message();
  }
  EXPECT_EQ(worker_->GetPool("bad").status().code(), absl::StatusCode::kNotFound);
}

// Regression test: GetPool named a protected pool's region files to
// anyone, who could then attach them as a "device" and read the bytes.
TEST_F(CapabilityTest, RegionPathsOfAProtectedPoolAreShownOnlyWithItsToken) {
  std::unique_ptr<Client> owner = Connect(daemon_->address(), kToken, false);
  std::unique_ptr<Client> anonymous = Connect(daemon_->address(), "", false);
  std::unique_ptr<Client> stranger = Connect(daemon_->address(), "not-the-token", false);
  absl::StatusOr<v1::Pool> created = owner->CreatePool("p", Spec());
  ASSERT_TRUE(created.ok()) << created.status();
  ASSERT_EQ(created->region_paths_size(), 1);  // the creator is told
  const std::string path = created->region_paths(0);
  ASSERT_TRUE(owner->CreatePool("f", FollowerSpec("p")).ok());
  for (Client* c : {anonymous.get(), stranger.get()}) {
    for (const char* name : {"p", "f"}) {
      absl::StatusOr<v1::Pool> got = c->GetPool(name);
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_TRUE(got->owner_protected()) << name;
      EXPECT_EQ(got->region_paths_size(), 0) << name;
      EXPECT_GT(got->bytes(), 0u);  // the rest is still shown
    }
    absl::StatusOr<std::vector<v1::Pool>> pools = c->ListPools();
    ASSERT_TRUE(pools.ok());
    for (const v1::Pool& p : *pools) {
      EXPECT_EQ(p.region_paths_size(), p.owner_protected() ? 0 : 1) << p.name();
      EXPECT_FALSE(absl::StrContains(p.SerializeAsString(), path)) << p.name();
    }
  }
  for (const char* name : {"p", "f"}) {
    absl::StatusOr<v1::Pool> got = owner->GetPool(name);
    ASSERT_TRUE(got.ok());
    EXPECT_EQ(got->region_paths_size(), 1) << name;
  }
  EXPECT_EQ(owner->GetPool("p")->region_paths(0), path);
  absl::StatusOr<std::vector<v1::Pool>> pools = owner->ListPools();
  ASSERT_TRUE(pools.ok());
  for (const v1::Pool& p : *pools) EXPECT_EQ(p.region_paths_size(), 1) << p.name();
  // An unprotected pool's are shown to anyone.
  absl::StatusOr<v1::Pool> kv = anonymous->GetPool("kv");
  ASSERT_TRUE(kv.ok());
  EXPECT_EQ(kv->region_paths_size(), 1);
}

// Regression test: ticket ids restarted at 1, and an old client's WaitTransfer
// returned OK for another client's ticket of the new daemon.
TEST(RestartTest, AnOldTicketIdIsNotFoundAfterARestart) {
  char dir_template[] = "/tmp/kvhost-capability-XXXXXX";
  ASSERT_NE(::mkdtemp(dir_template), nullptr);
  const std::string dir = dir_template;
  char shm_template[] = "/dev/shm/kvhost-capability-XXXXXX";
  ASSERT_NE(::mkdtemp(shm_template), nullptr);
  const std::string shm_dir = shm_template;
  const std::string socket = dir + "/kvhost.sock";
  const std::string address = absl::StrCat("unix://", socket);
  const std::string log = dir + "/kvhostd.log";
  constexpr int kTickets = 20;

  // Backs up `kTickets` times through a new pool "kv" and attachment of
  // `c`; returns the ticket ids.
  auto backups = [&](Client& c, std::unique_ptr<ShmDevicePool>* dev) {
    std::vector<uint64_t> ids;
    absl::StatusOr<v1::Pool> pool = c.CreatePool("kv", Spec());
    EXPECT_TRUE(pool.ok()) << pool.status() << ReadFile(log);
    if (!pool.ok()) return ids;
    absl::StatusOr<std::vector<int64_t>> slots = c.Alloc("kv", kPageSize);
    absl::StatusOr<std::unique_ptr<ShmDevicePool>> d =
        ShmDevicePool::Create(*pool, kDeviceRows, shm_dir);
    EXPECT_TRUE(slots.ok() && d.ok());
    if (!slots.ok() || !d.ok()) return ids;
    *dev = *std::move(d);
    absl::StatusOr<v1::Attachment> att = c.AttachDevice((*dev)->MakeAttachRequest("kv"));
    EXPECT_TRUE(att.ok()) << att.status();
    if (!att.ok()) return ids;
    for (int i = 0; i < kTickets; ++i) {
      absl::StatusOr<uint64_t> t = c.Backup(att->id(), *slots, Range(0, kPageSize));
      EXPECT_TRUE(t.ok()) << t.status();
      if (!t.ok()) continue;
      EXPECT_TRUE(c.WaitTransfer(*t).ok());
      ids.push_back(*t);
    }
    return ids;
  };

  pid_t first = StartKvhostd(socket, shm_dir, log);
  std::unique_ptr<Client> old_client = Connect(address, "", /*worker_session=*/false);
  ASSERT_TRUE(old_client->WaitForReady(absl::Seconds(20)).ok()) << ReadFile(log);
  std::unique_ptr<ShmDevicePool> old_dev;
  const std::vector<uint64_t> old_ids = backups(*old_client, &old_dev);
  ASSERT_EQ(old_ids.size(), static_cast<size_t>(kTickets));
  EXPECT_EQ(StopKvhostd(first), 0) << ReadFile(log);

  pid_t second = StartKvhostd(socket, shm_dir, log);
  std::unique_ptr<Client> new_client = Connect(address, "", /*worker_session=*/false);
  ASSERT_TRUE(new_client->WaitForReady(absl::Seconds(20)).ok()) << ReadFile(log);
  std::unique_ptr<ShmDevicePool> new_dev;
  const std::vector<uint64_t> new_ids = backups(*new_client, &new_dev);
  ASSERT_EQ(new_ids.size(), static_cast<size_t>(kTickets));
  // The old client, reconnected to the new daemon, finds none of its ids,
  // not even a ticket that is neither's (ids 1..kTickets of a counter).
  ASSERT_TRUE(old_client->WaitForReady(absl::Seconds(20)).ok());
  for (uint64_t id : old_ids) {
    EXPECT_EQ(old_client->WaitTransfer(id, absl::Seconds(5)).status().code(),
              absl::StatusCode::kNotFound)
        << id;
    EXPECT_EQ(old_client->PollTransfer(id).status().code(), absl::StatusCode::kNotFound) << id;
  }
  for (uint64_t id = 1; id <= kTickets; ++id) {
    EXPECT_EQ(old_client->PollTransfer(id).status().code(), absl::StatusCode::kNotFound) << id;
  }
  for (uint64_t id : new_ids) EXPECT_TRUE(new_client->PollTransfer(id).ok()) << id;
  EXPECT_EQ(StopKvhostd(second), 0) << ReadFile(log);
  old_dev.reset();
  new_dev.reset();
  std::error_code ec;
  fs::remove_all(dir, ec);
  fs::remove_all(shm_dir, ec);
}

}  // namespace
}  // namespace kvhost
