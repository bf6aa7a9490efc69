// The fast path through a real kvhostd (host backend): the client's calls
// take the mailbox and give what gRPC gives, errors included (same codes,
// same messages, nothing changed); the batched calls on both paths; a
// client killed mid-request leaves every pool consistent and its mailbox
// closed; fast-path and gRPC clients on one pool never share a slot; the
// mailbox refuses what a hostile client writes into it; the limit, the
// switch and the fallback to gRPC; the node cache's Lookup, Store and
// Restore over the mailbox, byte-exact, refused alike on both paths.
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "api_test_util.h"
#include "cache_instance.h"
#include "client/handoff.h"
#include "common/fast_path_mailbox.h"
#include "daemon_fixture.h"
#include "gtest/gtest.h"
#include "kvhost/client.h"
#include "kvhost/layer_progress.h"
#include "kvhost/v1/fast_path.pb.h"
#include "kvhost/v1/transfer.grpc.pb.h"
#include "time_scale.h"

namespace kvhost {
namespace {

using ::kvhost::testing::IsError;
using ::kvhost::testing::kTimeScale;
using ::kvhost::testing::MakeSpec;
using ::kvhost::testing::StatusOf;
using ::kvhost::testing::TestDaemon;

// The child of KilledClientLeavesPoolsConsistent: this binary run again
// with KVHOST_FAST_PATH_CHILD=<address>, allocating and freeing over the
// fast path until it is killed. Runs before main, so no test runs in it.
[[maybe_unused]] const bool kChild = [] {
  const char* address = std::getenv("KVHOST_FAST_PATH_CHILD");
  if (address == nullptr) return false;
  ClientOptions options;
  options.address = address;
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(options);
  if (!client.ok()) std::_Exit(2);
  std::vector<int64_t> held;
  for (uint64_t i = 0;; ++i) {
    absl::StatusOr<std::vector<int64_t>> slots = (*client)->Alloc("p", 4);
    if (slots.ok()) held.insert(held.end(), slots->begin(), slots->end());
    if (held.size() >= 64 || !slots.ok()) {
      if (!(*client)->Free("p", held).ok()) std::_Exit(3);
      held.clear();
    }
    if (i == 100) {
      // Tell the parent the mailbox serves.
      if (!(*client)->fast_path_open()) std::_Exit(4);
      std::fputs("serving\n", stdout);
      std::fflush(stdout);
    }
  }
}();

// A mailbox asked for and driven by hand, as a hostile client would.
class RawMailbox {
 public:
  // Asks `socket` for a mailbox naming `sessions`; the status is the daemon's.
  static absl::StatusOr<std::unique_ptr<RawMailbox>> Open(
      const std::string& socket, const std::vector<std::string>& sessions = {}) {
    v1::HandoffRequest ask;
    ask.set_kind(v1::HANDOFF_KIND_FAST_PATH);
    for (const std::string& id : sessions) ask.add_session_ids(id);
    absl::StatusOr<Handoff> handoff = FetchHandoff(socket, ask, absl::Seconds(5));
    if (!handoff.ok()) return handoff.status();
    std::unique_ptr<RawMailbox> box(new RawMailbox());
    box->handoff_ = std::move(*handoff);
    const Handoff& held = box->handoff_;
    void* mapped = ::mmap(nullptr, held.bytes, PROT_READ | PROT_WRITE, MAP_SHARED, held.fd(), 0);
    if (mapped == MAP_FAILED) return absl::InternalError("mmap");
    box->mapped_ = mapped;
    box->capacity_ = static_cast<uint32_t>((held.bytes - kFastPathHeaderBytes) / 2);
    box->box_ = FastPathMailbox::Over(mapped, box->capacity_);
    box->seq_ = box->box_.header->request_seq.load();
    return box;
  }
  ~RawMailbox() {
    if (mapped_ != nullptr) ::munmap(mapped_, handoff_.bytes);
  }  // then handoff_ closes the mailbox's descriptor and the connection

  const Handoff& handoff() const { return handoff_; }
  const FastPathMailbox& box() const { return box_; }
  uint32_t capacity() const { return capacity_; }

  // Writes `bytes` as a request of `length` bytes and rings, without
  // waiting. Returns the seq rung.
  uint32_t Ring(const std::string& bytes, uint32_t length) {
    std::memcpy(box_.request, bytes.data(), std::min<size_t>(bytes.size(), capacity_));
    box_.header->request_bytes.store(length);
    box_.header->request_seq.store(++seq_);
    FutexWake(&box_.header->request_seq);
    return seq_;
  }
  uint32_t Ring(const std::string& bytes) {
    return Ring(bytes, static_cast<uint32_t>(bytes.size()));
  }
  // Rings again for the request already there.
  uint32_t RingAgain() {
    box_.header->request_seq.store(++seq_);
    FutexWake(&box_.header->request_seq);
    return seq_;
  }
  // Whether the reply to `seq` came within `timeout`.
  bool WaitReply(uint32_t seq, absl::Duration timeout = absl::Seconds(5)) {
    const absl::Time deadline = absl::Now() + timeout;
    while (box_.header->reply_seq.load() != seq && absl::Now() < deadline) {
      absl::SleepFor(absl::Microseconds(200));
    }
    return box_.header->reply_seq.load() == seq;
  }
  // The reply there now, read and acknowledged as the protocol asks.
  v1::FastPathReply Read() {
    v1::FastPathReply reply;
    EXPECT_TRUE(
        reply.ParseFromArray(box_.reply, static_cast<int>(box_.header->reply_bytes.load())));
    box_.header->reply_read.store(box_.header->reply_seq.load());
    return reply;
  }
  // A whole call: ring, wait, read.
  v1::FastPathReply Ask(const std::string& bytes, uint32_t length) {
    const uint32_t seq = Ring(bytes, length);
    EXPECT_TRUE(WaitReply(seq)) << "no reply";
    return Read();
  }
  v1::FastPathReply Ask(const std::string& bytes) {
    return Ask(bytes, static_cast<uint32_t>(bytes.size()));
  }

 private:
  RawMailbox() = default;
  Handoff handoff_;
  void* mapped_ = nullptr;
  uint32_t capacity_ = 0;
  FastPathMailbox box_;
  uint32_t seq_ = 0;
};

// A frame allocating `tokens` of pool `pool`, naming `sessions` session ids.
std::string AllocFrame(const std::string& pool, uint64_t tokens, int sessions = 0) {
  v1::FastPathRequest alloc;
  alloc.set_method(v1::FAST_PATH_METHOD_ALLOC);
  v1::AllocRequest a;
  a.set_pool(pool);
  a.set_num_tokens(tokens);
  alloc.set_body(a.SerializeAsString());
  for (int i = 0; i < sessions; ++i) {
    alloc.add_session_ids(absl::StrCat("ses-", i, "-0123456789abcdef0123456789abcdef"));
  }
  return alloc.SerializeAsString();
}

class FastPathTest : public ::testing::Test {
 protected:
  void SetUp() override { StartDaemon({}); }
  void StartDaemon(std::vector<std::string> flags) {
    absl::StatusOr<std::unique_ptr<TestDaemon>> d =
        TestDaemon::Start(KVHOSTD_PATH, std::move(flags));
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = *std::move(d);
    ASSERT_TRUE(client().CreatePool("p", MakeSpec(v1::MHA, v1::LAYER_FIRST, 4, 256)).ok());
    grpc_ = Connect(false);
    ASSERT_NE(grpc_, nullptr);
  }
  void TearDown() override {
    if (daemon_ != nullptr && HasFailure()) {
      std::fprintf(stderr, "--- kvhostd log ---\n%s\n", daemon_->Log().c_str());
    }
  }
  // The fixture's client: fast path on (the default).
  Client& client() { return daemon_->client(); }
  std::unique_ptr<Client> Connect(bool fast_path, const std::string& token = "") {
    ClientOptions options;
    options.address = daemon_->address();
    options.fast_path = fast_path;
    options.owner_token = token;
    // Attachments without a session serve both clients alike.
    options.worker_session = false;
    absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect(options);
    return c.ok() ? *std::move(c) : nullptr;
  }
  uint64_t Available(const std::string& pool = "p") {
    absl::StatusOr<v1::Pool> p = client().GetPool(pool);
    EXPECT_TRUE(p.ok()) << p.status();
    return p.ok() ? p->available_tokens() : 0;
  }
  v1::DaemonStatus Status() {
    absl::StatusOr<v1::DaemonStatus> s = client().GetStatus();
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? *s : v1::DaemonStatus();
  }

  std::unique_ptr<TestDaemon> daemon_;
  std::unique_ptr<Client> grpc_;  // fast path off
};

TEST_F(FastPathTest, CallsTakeTheMailbox) {
  absl::StatusOr<std::vector<int64_t>> slots = client().Alloc("p", 8);
  ASSERT_TRUE(slots.ok()) << slots.status();
  EXPECT_TRUE(client().fast_path_open());
  EXPECT_EQ(client().fast_path_calls(), 1u);
  EXPECT_EQ(Status().fast_path_connections(), 1u);
  EXPECT_EQ(Status().fast_path_max_connections(), 128u);
  absl::StatusOr<uint64_t> freed = client().Free("p", *slots);
  ASSERT_TRUE(freed.ok()) << freed.status();
  EXPECT_EQ(*freed, 8u);
  EXPECT_EQ(client().fast_path_calls(), 2u);
  // The gRPC-only client opens none.
  ASSERT_TRUE(grpc_->Alloc("p", 4).ok());
  EXPECT_FALSE(grpc_->fast_path_open());
  EXPECT_EQ(Status().fast_path_connections(), 1u);
}

TEST_F(FastPathTest, AllocBatchOnBothPaths) {
  for (Client* c : {&client(), grpc_.get()}) {
    const uint64_t before = Available();
    const std::vector<uint64_t> wanted = {4, 12, 8};
    absl::StatusOr<std::vector<std::vector<int64_t>>> runs = c->AllocBatch("p", wanted);
    ASSERT_TRUE(runs.ok()) << runs.status();
    ASSERT_EQ(runs->size(), 3u);
    std::set<int64_t> all;
    for (size_t i = 0; i < runs->size(); ++i) {
      EXPECT_EQ((*runs)[i].size(), wanted[i]);
      all.insert((*runs)[i].begin(), (*runs)[i].end());
    }
    EXPECT_EQ(all.size(), 24u) << "no slot twice";
    EXPECT_EQ(Available(), before - 24);
    // All or nothing: the third allocation does not fit, the first two go back.
    EXPECT_ERROR(c->AllocBatch("p", std::vector<uint64_t>{4, 8, 1024}), kResourceExhausted,
                 "AllocBatch allocation 2 of 3");
    EXPECT_EQ(Available(), before - 24);
    for (const std::vector<int64_t>& run : *runs) ASSERT_TRUE(c->Free("p", run).ok());
    EXPECT_EQ(Available(), before);
  }
  EXPECT_GE(client().fast_path_calls(), 2u);
}

// Every refusal the fast path gives is gRPC's, to the byte, and leaves the
// pool as it was.
TEST_F(FastPathTest, ErrorsMatchGrpc) {
  std::unique_ptr<Client> owner = Connect(true, "owner-secret");
  ASSERT_TRUE(owner->CreatePool("owned", MakeSpec(v1::MHA, v1::LAYER_FIRST, 4, 64)).ok());
  absl::StatusOr<std::vector<int64_t>> held = client().Alloc("p", 8);
  ASSERT_TRUE(held.ok());
  absl::StatusOr<std::unique_ptr<ShmDevicePool>> dev =
      ShmDevicePool::Create(*client().GetPool("p"), 16, daemon_->shm_dir());
  ASSERT_TRUE(dev.ok()) << dev.status();
  // Made without a session, so that both clients may use it.
  absl::StatusOr<v1::Attachment> att = grpc_->AttachDevice((*dev)->MakeAttachRequest("p"));
  ASSERT_TRUE(att.ok()) << att.status();
  const std::string id = att->id();

  using Call = std::function<absl::Status(Client&)>;
  const std::vector<std::pair<std::string, Call>> calls = {
      {"Alloc unknown pool", [](Client& c) { return StatusOf(c.Alloc("nope", 4)); }},
      {"Alloc 0", [](Client& c) { return StatusOf(c.Alloc("p", 0)); }},
      {"Alloc not whole pages", [](Client& c) { return StatusOf(c.Alloc("p", 6)); }},
      {"Alloc too many", [](Client& c) { return StatusOf(c.Alloc("p", 512)); }},
      {"Alloc wrong owner", [](Client& c) { return StatusOf(c.Alloc("owned", 4)); }},
      {"Free unallocated",
       [](Client& c) {
         return StatusOf(c.Free("p", std::vector<int64_t>{200, 201, 202, 203}));
       }},
      {"Free page twice",
       [&](Client& c) {
         std::vector<int64_t> twice(held->begin(), held->begin() + 4);
         twice.insert(twice.end(), held->begin(), held->begin() + 4);
         return StatusOf(c.Free("p", twice));
       }},
      {"Free misaligned",
       [](Client& c) {
         return StatusOf(c.Free("p", std::vector<int64_t>{1, 2, 3, 4}));
       }},
      {"Free out of range",
       [](Client& c) {
         return StatusOf(c.Free("p", std::vector<int64_t>{-4, -3, -2, -1}));
       }},
      {"AllocBatch empty",
       [](Client& c) { return StatusOf(c.AllocBatch("p", std::vector<uint64_t>{})); }},
      {"AllocBatch bad entry",
       [](Client& c) {
         return StatusOf(c.AllocBatch("p", std::vector<uint64_t>{4, 3}));
       }},
      {"Backup unknown attachment",
       [](Client& c) {
         return StatusOf(c.Backup("att-nope", std::vector<int64_t>{0}, std::vector<int64_t>{0}));
       }},
      {"Backup lengths differ",
       [&](Client& c) {
         return StatusOf(c.Backup(id, std::vector<int64_t>(held->begin(), held->begin() + 4),
                                  std::vector<int64_t>{0, 1}));
       }},
      {"Backup unallocated host slots",
       [&](Client& c) {
         return StatusOf(c.Backup(id, std::vector<int64_t>{100, 101, 102, 103},
                                  std::vector<int64_t>{0, 1, 2, 3}));
       }},
      {"Load device row out of range",
       [&](Client& c) {
         return StatusOf(c.Load(id, std::vector<int64_t>(held->begin(), held->begin() + 4),
                                std::vector<int64_t>{0, 1, 2, 99}));
       }},
      {"AllocBackup with host_indices",
       [&](Client& c) {
         v1::AllocBackupRequest r;
         r.mutable_backup()->set_attachment_id(id);
         r.mutable_backup()->add_host_indices(0);
         r.mutable_backup()->add_device_indices(0);
         return StatusOf(c.AllocBackup(r));
       }},
      {"AllocBackup unknown attachment",
       [](Client& c) {
         v1::AllocBackupRequest r;
         r.mutable_backup()->set_attachment_id("att-nope");
         for (int i = 0; i < 4; ++i) r.mutable_backup()->add_device_indices(i);
         return StatusOf(c.AllocBackup(r));
       }},
      {"AllocBackup device row out of range",
       [&](Client& c) {
         v1::AllocBackupRequest r;
         r.mutable_backup()->set_attachment_id(id);
         for (int i = 0; i < 4; ++i) r.mutable_backup()->add_device_indices(14 + i);
         return StatusOf(c.AllocBackup(r));
       }},
      {"WaitTransfer unknown ticket",
       [](Client& c) { return StatusOf(c.WaitTransfer(12345, absl::Seconds(1))); }},
      {"PollTransfer unknown ticket", [](Client& c) { return StatusOf(c.PollTransfer(12345)); }},
  };
  for (const auto& [what, call] : calls) {
    SCOPED_TRACE(what);
    const uint64_t before = Available();
    const uint64_t fast_before = client().fast_path_calls();
    const absl::Status fast = call(client());
    EXPECT_EQ(client().fast_path_calls(), fast_before + 1) << "went over gRPC";
    const absl::Status slow = call(*grpc_);
    EXPECT_FALSE(fast.ok());
    EXPECT_EQ(fast, slow);
    EXPECT_EQ(Available(), before) << "a failed call changed the pool";
  }
}

TEST_F(FastPathTest, AllocBackupRoundTripsByteExact) {
  absl::StatusOr<v1::Pool> pool = client().GetPool("p");
  ASSERT_TRUE(pool.ok());
  absl::StatusOr<std::unique_ptr<ShmDevicePool>> made =
      ShmDevicePool::Create(*pool, 32, daemon_->shm_dir());
  ASSERT_TRUE(made.ok()) << made.status();
  ShmDevicePool& dev = **made;
  std::mt19937 rng(11);
  ::kvhost::testing::FillRandomNonZero(dev.layer(0, 0), dev.bytes(), rng);
  absl::StatusOr<v1::Attachment> att = grpc_->AttachDevice(dev.MakeAttachRequest("p"));
  ASSERT_TRUE(att.ok()) << att.status();
  for (Client* c : {&client(), grpc_.get()}) {
    const uint64_t before = Available();
    v1::AllocBackupRequest request;
    request.mutable_backup()->set_attachment_id(att->id());
    const std::vector<int64_t> rows = {3, 7, 1, 30, 12, 5, 9, 0};
    request.mutable_backup()->mutable_device_indices()->Add(rows.begin(), rows.end());
    absl::StatusOr<v1::AllocBackupResponse> done = c->AllocBackup(request);
    ASSERT_TRUE(done.ok()) << done.status();
    ASSERT_EQ(done->host_indices_size(), 8);
    EXPECT_EQ(done->available_tokens(), before - 8);
    ASSERT_TRUE(c->WaitTransfer(done->ticket().id(), absl::Seconds(30)).ok());
    // Back into other rows, then compare every component and layer.
    const std::vector<int64_t> host(done->host_indices().begin(), done->host_indices().end());
    const std::vector<int64_t> into = {16, 17, 18, 19, 20, 21, 22, 23};
    absl::StatusOr<uint64_t> load = c->Load(att->id(), host, into);
    ASSERT_TRUE(load.ok()) << load.status();
    ASSERT_TRUE(c->WaitTransfer(*load, absl::Seconds(30)).ok());
    for (uint32_t comp = 0; comp < dev.components(); ++comp) {
      for (uint32_t l = 0; l < dev.layers(); ++l) {
        for (size_t i = 0; i < rows.size(); ++i) {
          ASSERT_EQ(
              std::memcmp(dev.row(comp, l, static_cast<uint64_t>(rows[i])),
                          dev.row(comp, l, static_cast<uint64_t>(into[i])), dev.row_bytes(comp)),
              0)
              << "component " << comp << " layer " << l << " row " << rows[i];
        }
      }
    }
    ASSERT_TRUE(c->Free("p", host).ok());
    std::memset(dev.row(0, 0, 16), 0, 8 * dev.row_bytes(0));  // changed again by the next load
  }
  EXPECT_GE(client().fast_path_calls(), 4u);
}

TEST_F(FastPathTest, KilledClientLeavesPoolsConsistent) {
  for (int round = 0; round < 3; ++round) {
    int out[2];
    ASSERT_EQ(::pipe(out), 0);
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      ::dup2(out[1], 1);
      ::setenv("KVHOST_FAST_PATH_CHILD", daemon_->address().c_str(), 1);
      ::execl("/proc/self/exe", "fast_path_child", static_cast<char*>(nullptr));
      std::_Exit(5);
    }
    ::close(out[1]);
    char line[16] = {};
    const ssize_t n = ::read(out[0], line, sizeof(line) - 1);
    ::close(out[0]);
    ASSERT_GT(n, 0) << "the child never served (exit status below)";
    // Mid-request, most likely: it calls back to back.
    absl::SleepFor(absl::Milliseconds(20 + 30 * round));
    ::kill(child, SIGKILL);
    int status = 0;
    ::waitpid(child, &status, 0);
    ASSERT_TRUE(WIFSIGNALED(status)) << "child exited with " << WEXITSTATUS(status);
    // Its mailbox closes within the idle check (100 ms).
    uint32_t open = 1;
    for (int i = 0; i < 100 && open > 0; ++i) {
      absl::SleepFor(absl::Milliseconds(20));
      open = Status().fast_path_connections() - (client().fast_path_open() ? 1 : 0);
    }
    EXPECT_EQ(open, 0u);
  }
  // Consistent: whatever the children held stays allocated, everything
  // else can be allocated once, no slot twice, and goes back.
  const uint64_t available = Available();
  absl::StatusOr<std::vector<int64_t>> rest = client().Alloc("p", available);
  ASSERT_TRUE(rest.ok()) << rest.status();
  EXPECT_EQ(std::set<int64_t>(rest->begin(), rest->end()).size(), available);
  EXPECT_ERROR(client().Alloc("p", 4), kResourceExhausted, "p");
  absl::StatusOr<uint64_t> freed = client().Free("p", *rest);
  ASSERT_TRUE(freed.ok()) << freed.status();
  EXPECT_EQ(*freed, available);
}

TEST_F(FastPathTest, MixedClientsNeverShareASlot) {
  std::mutex mu;
  std::set<int64_t> taken;
  std::atomic<int> twice{0}, failed{0};
  std::vector<std::thread> threads;
  std::vector<std::unique_ptr<Client>> clients;
  for (int t = 0; t < 4; ++t) clients.push_back(Connect(t % 2 == 0));
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, c = clients[t].get(), t] {
      std::mt19937 rng(t);
      std::vector<int64_t> held;
      for (int i = 0; i < 400; ++i) {
        absl::StatusOr<std::vector<int64_t>> slots = c->Alloc("p", 4);
        if (slots.ok()) {
          std::lock_guard<std::mutex> lock(mu);
          for (int64_t s : *slots) twice += taken.insert(s).second ? 0 : 1;
          held.insert(held.end(), slots->begin(), slots->end());
        } else if (slots.status().code() != absl::StatusCode::kResourceExhausted) {
          ++failed;
        }
        if (held.size() >= 32 || (rng() % 4 == 0 && !held.empty())) {
          {
            std::lock_guard<std::mutex> lock(mu);
            for (int64_t s : held) taken.erase(s);
          }
          if (!c->Free("p", held).ok()) ++failed;
          held.clear();
        }
      }
      if (!held.empty()) {
        std::lock_guard<std::mutex> lock(mu);
        for (int64_t s : held) taken.erase(s);
      }
      if (!held.empty() && !c->Free("p", held).ok()) ++failed;
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(twice.load(), 0);
  EXPECT_EQ(failed.load(), 0);
  EXPECT_EQ(Available(), 256u);
  EXPECT_TRUE(clients[0]->fast_path_open());
  EXPECT_GT(clients[0]->fast_path_calls(), 0u);
  EXPECT_FALSE(clients[1]->fast_path_open());
}

// A client that ignores the protocol reaches nothing but its own replies.
TEST_F(FastPathTest, TheMailboxRefusesWhatAHostileClientWrites) {
  absl::StatusOr<std::unique_ptr<RawMailbox>> raw = RawMailbox::Open(Status().handoff_socket());
  ASSERT_TRUE(raw.ok()) << raw.status();
  RawMailbox& m = **raw;
  ASSERT_GE(m.handoff().connection.get(), 0);
  // Sealed: it cannot shrink under the daemon's mapping.
  EXPECT_NE(::ftruncate(m.handoff().fd(), 4096), 0);
  EXPECT_EQ(errno, EPERM);
  const uint32_t capacity = m.capacity();
  EXPECT_EQ(m.box().header->version, kFastPathVersion);
  EXPECT_EQ(m.box().header->capacity, capacity);
  v1::FastPathReply r = m.Ask("", capacity + 1);
  EXPECT_EQ(r.code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_NE(r.message().find("over the mailbox"), std::string::npos) << r.message();
  r = m.Ask(std::string(64, '\xff'));
  EXPECT_EQ(r.code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_NE(r.message().find("not a kvhost.v1.FastPathRequest"), std::string::npos) << r.message();
  v1::FastPathRequest unknown;
  unknown.set_method(static_cast<v1::FastPathMethod>(99));
  r = m.Ask(unknown.SerializeAsString());
  EXPECT_EQ(r.code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_NE(r.message().find("method 99"), std::string::npos) << r.message();
  v1::FastPathRequest bad_body;
  bad_body.set_method(v1::FAST_PATH_METHOD_ALLOC);
  bad_body.set_body(std::string(8, '\xff'));
  r = m.Ask(bad_body.SerializeAsString());
  EXPECT_EQ(r.code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_NE(r.message().find("kvhost.v1.AllocRequest"), std::string::npos) << r.message();
  v1::FastPathRequest wait;
  wait.set_method(v1::FAST_PATH_METHOD_WAIT_TRANSFER);
  wait.set_timeout_ms(60001);
  r = m.Ask(wait.SerializeAsString());
  EXPECT_EQ(r.code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
  // Still serving, and the pool untouched.
  r = m.Ask(AllocFrame("p", 4));
  EXPECT_EQ(r.code(), 0) << r.message();
  EXPECT_EQ(Available(), 252u);
}

// Issue 29: a frame carrying 20,000 forged session ids was parsed and
// copied on every ring. A frame may name as many as a gRPC call's metadata
// holds, and no more.
TEST_F(FastPathTest, AFrameWithTooManySessionIdsIsRefused) {
  absl::StatusOr<std::unique_ptr<RawMailbox>> raw = RawMailbox::Open(Status().handoff_socket());
  ASSERT_TRUE(raw.ok()) << raw.status();
  v1::FastPathReply r = (*raw)->Ask(AllocFrame("p", 4, kMaxCallerSessions + 1));
  EXPECT_EQ(r.code(), static_cast<int>(absl::StatusCode::kInvalidArgument)) << r.message();
  EXPECT_NE(r.message().find(absl::StrCat("names ", kMaxCallerSessions + 1,
                                          " session ids, over "
                                          "the limit of ",
                                          kMaxCallerSessions)),
            std::string::npos)
      << r.message();
  r = (*raw)->Ask(AllocFrame("p", 4, 20000));
  EXPECT_EQ(r.code(), static_cast<int>(absl::StatusCode::kInvalidArgument)) << r.message();
  EXPECT_EQ(Available(), 256u);
  r = (*raw)->Ask(AllocFrame("p", 4, kMaxCallerSessions));
  EXPECT_EQ(r.code(), 0) << r.message();
  EXPECT_EQ(Available(), 252u);
  // gRPC takes a call naming as many (its metadata's default bound), and
  // its transport refuses one naming twice the bound: the two paths agree.
  auto grpc_with = [&](int sessions) {
    std::shared_ptr<grpc::Channel> channel =
        grpc::CreateChannel(daemon_->address(), grpc::InsecureChannelCredentials());
    std::unique_ptr<v1::TransferService::Stub> stub = v1::TransferService::NewStub(channel);
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    for (int i = 0; i < sessions; ++i) {
      context.AddMetadata("kvhost-session",
                          absl::StrCat("ses-", i % 10, "-0123456789abcdef0123456789abcdef"));
    }
    v1::WaitTransferRequest request;
    request.set_ticket_id(12345);
    request.set_poll(true);
    v1::TransferStatus response;
    return stub->WaitTransfer(&context, request, &response).error_code();
  };
  EXPECT_EQ(grpc_with(kMaxCallerSessions), grpc::StatusCode::NOT_FOUND);
  EXPECT_NE(grpc_with(2 * kMaxCallerSessions), grpc::StatusCode::NOT_FOUND);
}

// Issue 29: every ring was served, so a client ringing without reading its
// replies kept a daemon thread busy. A ring before the last reply was read
// is not served; once the client reads it, the next ring is.
TEST_F(FastPathTest, ARingFloodIsServedOncePerReplyRead) {
  absl::StatusOr<std::unique_ptr<RawMailbox>> raw = RawMailbox::Open(Status().handoff_socket());
  ASSERT_TRUE(raw.ok()) << raw.status();
  RawMailbox& m = **raw;
  const std::string alloc = AllocFrame("p", 4);
  ASSERT_EQ(m.Ask(alloc).code(), 0);
  ASSERT_EQ(Available(), 252u);
  // The first ring is served (the last reply was read); the rest, rung
  // before its reply is read, are not.
  uint32_t seq = m.Ring(alloc);
  ASSERT_TRUE(m.WaitReply(seq));
  for (int i = 0; i < 2000; ++i) {
    m.Ring(alloc);
    if (i % 100 == 0) absl::SleepFor(absl::Microseconds(200));
  }
  absl::SleepFor(absl::Milliseconds(200) * kTimeScale);
  EXPECT_EQ(Available(), 248u) << "rings before a reply was read were served";
  EXPECT_EQ(m.box().header->reply_seq.load(), seq);
  // Read: the next ring is served, once.
  EXPECT_EQ(m.Read().code(), 0);
  seq = m.Ring(alloc);
  ASSERT_TRUE(m.WaitReply(seq));
  EXPECT_EQ(m.Read().code(), 0);
  EXPECT_EQ(Available(), 244u);
}

// Issue 29: one attacker ringing its mailboxes with frames of 20,000
// forged session ids took a victim's gRPC from 1,309 to 17 calls/s. Now a
// ring before the last reply was read costs a wake-up: the victim keeps a
// fair part of its rate. The bound is loose (the attacker's threads share
// this machine's CPUs with the victim and the daemon; on the 2-core dev VM
// under load the victim kept 1/5 to 6/7 of its rate, and 1/59 before the
// fix).
TEST(FastPathFloodTest, AVictimsGrpcRateHoldsUnderARingFlood) {
  absl::StatusOr<std::unique_ptr<TestDaemon>> d =
      TestDaemon::Start(KVHOSTD_PATH, {"--fast-path-connections-per-client=64"});
  ASSERT_TRUE(d.ok()) << d.status();
  Client& admin = (*d)->client();
  ASSERT_TRUE(admin.CreatePool("p", MakeSpec(v1::MLA, v1::LAYER_FIRST, 1, 4096)).ok());
  ClientOptions options;
  options.address = (*d)->address();
  options.fast_path = false;
  options.worker_session = false;
  absl::StatusOr<std::unique_ptr<Client>> victim = Client::Connect(options);
  ASSERT_TRUE(victim.ok());
  auto rate = [&](absl::Duration span) {
    uint64_t calls = 0;
    const absl::Time end = absl::Now() + span;
    while (absl::Now() < end) {
      absl::StatusOr<std::vector<int64_t>> slots = (*victim)->Alloc("p", 1);
      EXPECT_TRUE(slots.ok()) << slots.status();
      if (!slots.ok()) break;
      EXPECT_TRUE((*victim)->Free("p", *slots).ok());
      calls += 2;
    }
    return static_cast<double>(calls) / absl::ToDoubleSeconds(span);
  };
  const double before = rate(absl::Seconds(1));
  const std::string socket = admin.GetStatus()->handoff_socket();
  constexpr int kMailboxes = 16;
  std::vector<std::unique_ptr<RawMailbox>> boxes;
  for (int i = 0; i < kMailboxes; ++i) {
    absl::StatusOr<std::unique_ptr<RawMailbox>> box = RawMailbox::Open(socket);
    ASSERT_TRUE(box.ok()) << box.status();
    boxes.push_back(*std::move(box));
  }
  // The frame of the report: valid, 20,000 forged session ids (~900 KB).
  const std::string frame = AllocFrame("nope", 1, 20000);
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> rings{0};
  std::vector<std::thread> attackers;
  for (int t = 0; t < 4; ++t) {
    attackers.emplace_back([&, t] {
      for (int i = t; i < kMailboxes; i += 4) boxes[i]->Ring(frame);
      while (!stop.load()) {
        for (int i = t; i < kMailboxes; i += 4) {
          boxes[i]->RingAgain();
          rings.fetch_add(1);
        }
        absl::SleepFor(absl::Microseconds(50));
      }
    });
  }
  absl::SleepFor(absl::Milliseconds(100));
  const double during = rate(absl::Seconds(1));
  stop.store(true);
  for (std::thread& t : attackers) t.join();
  std::fprintf(stderr, "victim gRPC: %.0f calls/s before, %.0f during %lu rings\n", before, during,
               static_cast<unsigned long>(rings.load()));
  EXPECT_GT(rings.load(), 1000u);
  EXPECT_GE(during, before / (10 * kTimeScale));
}
TEST_F(FastPathTest, LargeCallsGoOverGrpc) {
  // An Alloc whose reply could outgrow the mailbox (about 1 MiB), and a
  // Free list over its capacity, go over gRPC; a small one then takes it.
  ASSERT_TRUE(client().CreatePool("big", MakeSpec(v1::MLA, v1::LAYER_FIRST, 1, 500000)).ok());
  absl::StatusOr<std::vector<int64_t>> many = client().Alloc("big", 400000);
  ASSERT_TRUE(many.ok()) << many.status();
  EXPECT_EQ(client().fast_path_calls(), 0u);
  absl::StatusOr<uint64_t> freed = client().Free("big", *many);
  ASSERT_TRUE(freed.ok()) << freed.status();
  EXPECT_EQ(*freed, 400000u);
  EXPECT_EQ(client().fast_path_calls(), 0u);
  ASSERT_TRUE(client().Alloc("big", 16).ok());
  EXPECT_EQ(client().fast_path_calls(), 1u);
}

// A node cache's instance with the fast path on stores, looks up (pinning)
// and restores through the mailbox, one fast-path call each, byte-exact.
TEST_F(FastPathTest, CacheCallsTakeTheMailbox) {
  using ::kvhost::testing::CacheSpec;
  using ::kvhost::testing::Instance;
  using ::kvhost::testing::kCache;
  using ::kvhost::testing::Keys;
  using ::kvhost::testing::kToken;
  using ::kvhost::testing::PageRows;
  std::unique_ptr<Client> admin = Connect(false, kToken);
  ASSERT_TRUE(admin->CreatePool(kCache, CacheSpec(64)).ok());
  absl::StatusOr<std::unique_ptr<Instance>> i =
      Instance::Start(daemon_->address(), daemon_->shm_dir());
  ASSERT_TRUE(i.ok()) << i.status();
  Client& c = *(*i)->client;
  for (uint64_t p = 0; p < 4; ++p) (*i)->FillPage(p, static_cast<uint8_t>(60 + p));

  uint64_t calls = c.fast_path_calls();
  absl::StatusOr<v1::CacheStoreReply> stored =
      c.CacheStore(kCache, (*i)->attachment, Keys("f", 0, 4), PageRows(0, 4));
  ASSERT_TRUE(stored.ok()) << stored.status();
  ASSERT_TRUE(stored->has_ticket());
  EXPECT_EQ(c.fast_path_calls(), ++calls);
  ASSERT_TRUE(c.WaitTransfer(stored->ticket().id()).ok());
  calls = c.fast_path_calls();

  absl::StatusOr<v1::CacheLookupReply> found = c.CacheLookup(kCache, Keys("f", 0, 5), true);
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_EQ(c.fast_path_calls(), ++calls);
  EXPECT_EQ(found->prefix(), 4u);
  EXPECT_NE(found->pin_id(), 0u);

  absl::StatusOr<v1::TransferTicket> ticket =
      c.CacheRestore(kCache, (*i)->attachment, Keys("f", 0, 4), PageRows(8, 4));
  ASSERT_TRUE(ticket.ok()) << ticket.status();
  EXPECT_EQ(c.fast_path_calls(), ++calls);
  ASSERT_TRUE(c.WaitTransfer(ticket->id()).ok());
  for (uint64_t p = 0; p < 4; ++p) {
    EXPECT_TRUE((*i)->PageIs(8 + p, static_cast<uint8_t>(60 + p))) << "page " << p;
  }
  ASSERT_TRUE(c.CacheReleasePin(kCache, found->pin_id()).ok());
}

// A refused cache call gets the same code and message on both paths, and
// the fast one was carried by the mailbox.
TEST_F(FastPathTest, CacheErrorsMatchGrpc) {
  using ::kvhost::testing::CacheSpec;
  using ::kvhost::testing::Instance;
  using ::kvhost::testing::kCache;
  using ::kvhost::testing::Keys;
  using ::kvhost::testing::kToken;
  using ::kvhost::testing::PageRows;
  std::unique_ptr<Client> admin = Connect(false, kToken);
  ASSERT_TRUE(admin->CreatePool(kCache, CacheSpec(64)).ok());
  absl::StatusOr<std::unique_ptr<Instance>> fast =
      Instance::Start(daemon_->address(), daemon_->shm_dir(), true);
  ASSERT_TRUE(fast.ok()) << fast.status();
  absl::StatusOr<std::unique_ptr<Instance>> slow =
      Instance::Start(daemon_->address(), daemon_->shm_dir(), false);
  ASSERT_TRUE(slow.ok()) << slow.status();
  // With worker sessions, which a store and a restore need.
  auto wrong_token = [&](bool fast_path) {
    ClientOptions options;
    options.address = daemon_->address();
    options.fast_path = fast_path;
    options.owner_token = "wrong-token";
    absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect(options);
    return c.ok() ? *std::move(c) : nullptr;
  };
  std::unique_ptr<Client> wrong_fast = wrong_token(true);
  std::unique_ptr<Client> wrong_grpc = wrong_token(false);
  ASSERT_NE(wrong_fast, nullptr);
  ASSERT_NE(wrong_grpc, nullptr);

  using Call = std::function<absl::Status(Client&, const std::string& attachment)>;
  const std::vector<std::string> twice = {"k0", "k1", "k0"};
  const std::vector<std::pair<std::string, Call>> calls = {
      {"Lookup a key twice",
       [&](Client& c, const std::string&) { return StatusOf(c.CacheLookup(kCache, twice)); }},
      {"Lookup an empty key",
       [&](Client& c, const std::string&) {
         return StatusOf(c.CacheLookup(kCache, {"k0", ""}, true));
       }},
      {"Lookup too many keys",
       [&](Client& c, const std::string&) {
         return StatusOf(c.CacheLookup(kCache, Keys("k", 0, 4097)));
       }},
      {"Store a key twice",
       [&](Client& c, const std::string& att) {
         return StatusOf(c.CacheStore(kCache, att, twice, PageRows(0, 3)));
       }},
      {"Store rows not a page a key",
       [&](Client& c, const std::string& att) {
         return StatusOf(c.CacheStore(kCache, att, Keys("k", 0, 2), PageRows(0, 1)));
       }},
      {"Restore an absent key",
       [&](Client& c, const std::string& att) {
         return StatusOf(c.CacheRestore(kCache, att, Keys("absent", 0, 2), PageRows(0, 2)));
       }},
      {"Restore a key twice",
       [&](Client& c, const std::string& att) {
         return StatusOf(c.CacheRestore(kCache, att, twice, PageRows(0, 3)));
       }},
      {"Lookup unknown cache",
       [&](Client& c, const std::string&) { return StatusOf(c.CacheLookup("nope", {"k0"})); }},
  };
  for (const auto& [name, call] : calls) {
    const uint64_t before = (*fast)->client->fast_path_calls();
    const absl::Status on_fast = call(*(*fast)->client, (*fast)->attachment);
    const absl::Status on_grpc = call(*(*slow)->client, (*slow)->attachment);
    EXPECT_EQ((*fast)->client->fast_path_calls(), before + 1) << name;
    EXPECT_FALSE(on_fast.ok()) << name;
    EXPECT_EQ(on_fast.code(), on_grpc.code()) << name << ": " << on_fast << " vs " << on_grpc;
    EXPECT_EQ(on_fast.message(), on_grpc.message()) << name;
  }
  // The wrong owner token, on each of the three calls.
  const std::vector<std::pair<std::string, std::function<absl::Status(Client&)>>> wrong = {
      {"Lookup", [&](Client& c) { return StatusOf(c.CacheLookup(kCache, {"k0"})); }},
      {"Store",
       [&](Client& c) {
         return StatusOf(c.CacheStore(kCache, (*fast)->attachment, {"k0"}, PageRows(0, 1)));
       }},
      {"Restore",
       [&](Client& c) {
         return StatusOf(c.CacheRestore(kCache, (*fast)->attachment, {"k0"}, PageRows(0, 1)));
       }},
  };
  for (const auto& [name, call] : wrong) {
    const uint64_t before = wrong_fast->fast_path_calls();
    const absl::Status on_fast = call(*wrong_fast);
    const absl::Status on_grpc = call(*wrong_grpc);
    EXPECT_EQ(wrong_fast->fast_path_calls(), before + 1) << name;
    EXPECT_EQ(on_fast.code(), absl::StatusCode::kPermissionDenied) << name << ": " << on_fast;
    EXPECT_EQ(on_fast.code(), on_grpc.code()) << name;
    EXPECT_EQ(on_fast.message(), on_grpc.message()) << name;
  }
  absl::StatusOr<v1::CacheStats> stats = admin->GetCacheStats(kCache);
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->published(), 0u);
  EXPECT_EQ(stats->pinned(), 0u);
}

TEST_F(FastPathTest, AStoppedDaemonEndsCallsPromptly) {
  ASSERT_TRUE(client().Alloc("p", 4).ok());
  ASSERT_TRUE(client().fast_path_open());
  daemon_->Stop();
  const absl::Time start = absl::Now();
  absl::StatusOr<std::vector<int64_t>> after = client().Alloc("p", 4);
  EXPECT_FALSE(after.ok());
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_FALSE(client().fast_path_open());
}

TEST(FastPathLimitTest, MailboxesOverTheLimitAreRefusedAndClientsUseGrpc) {
  absl::StatusOr<std::unique_ptr<TestDaemon>> d =
      TestDaemon::Start(KVHOSTD_PATH, {"--fast-path-connections=1"});
  ASSERT_TRUE(d.ok()) << d.status();
  Client& first = (*d)->client();
  ASSERT_TRUE(first.CreatePool("p", MakeSpec(v1::MLA, v1::LAYER_FIRST, 1, 64)).ok());
  ASSERT_TRUE(first.Alloc("p", 1).ok());
  EXPECT_TRUE(first.fast_path_open());
  v1::HandoffRequest ask;
  ask.set_kind(v1::HANDOFF_KIND_FAST_PATH);
  absl::StatusOr<v1::DaemonStatus> status = first.GetStatus();
  ASSERT_TRUE(status.ok());
  EXPECT_ERROR(FetchHandoff(status->handoff_socket(), ask, absl::Seconds(5)), kResourceExhausted,
               "--fast-path-connections 1");
  ClientOptions options;
  options.address = (*d)->address();
  absl::StatusOr<std::unique_ptr<Client>> second = Client::Connect(options);
  ASSERT_TRUE(second.ok());
  ASSERT_TRUE((*second)->Alloc("p", 1).ok());
  EXPECT_FALSE((*second)->fast_path_open());
}

TEST(FastPathLimitTest, OffMeansGrpcOnly) {
  absl::StatusOr<std::unique_ptr<TestDaemon>> d =
      TestDaemon::Start(KVHOSTD_PATH, {"--fast-path-connections=0"});
  ASSERT_TRUE(d.ok()) << d.status();
  Client& c = (*d)->client();
  ASSERT_TRUE(c.CreatePool("p", MakeSpec(v1::MLA, v1::LAYER_FIRST, 1, 64)).ok());
  ASSERT_TRUE(c.Alloc("p", 1).ok());
  EXPECT_FALSE(c.fast_path_open());
  absl::StatusOr<v1::DaemonStatus> status = c.GetStatus();
  ASSERT_TRUE(status.ok());
  EXPECT_EQ(status->fast_path_max_connections(), 0u);
  v1::HandoffRequest ask;
  ask.set_kind(v1::HANDOFF_KIND_FAST_PATH);
  EXPECT_ERROR(FetchHandoff(status->handoff_socket(), ask, absl::Seconds(5)), kFailedPrecondition,
               "--fast-path-connections 0");
}

// Issue 29: 128 mailboxes for all clients, taken by one in 117 ms. A
// client (its open session, else its uid) holds at most its share; a
// second client still gets one.
TEST(FastPathLimitTest, OneClientCannotTakeMoreThanItsShare) {
  absl::StatusOr<std::unique_ptr<TestDaemon>> d = TestDaemon::Start(
      KVHOSTD_PATH, {"--fast-path-connections=8", "--fast-path-connections-per-client=3"});
  ASSERT_TRUE(d.ok()) << d.status();
  Client& admin = (*d)->client();
  const std::string socket = admin.GetStatus()->handoff_socket();
  // The attacker: no session (its uid's share), then forged session ids.
  std::vector<std::unique_ptr<RawMailbox>> held;
  absl::Status refused;
  for (int i = 0; i < 8; ++i) {
    absl::StatusOr<std::unique_ptr<RawMailbox>> box =
        RawMailbox::Open(socket, {absl::StrCat("ses-", i, "-0123456789abcdef0123456789abcdef")});
    if (!box.ok()) {
      refused = box.status();
      break;
    }
    held.push_back(*std::move(box));
  }
  EXPECT_EQ(held.size(), 3u);
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_NE(refused.message().find("--fast-path-connections-per-client 3"), std::string::npos)
      << refused;
  // A worker with a session of its own gets its mailbox, and its calls take it.
  ClientOptions options;
  options.address = (*d)->address();
  options.worker_session = true;
  absl::StatusOr<std::unique_ptr<Client>> worker = Client::Connect(options);
  ASSERT_TRUE(worker.ok());
  ASSERT_TRUE((*worker)->OpenSession().ok());
  ASSERT_TRUE(admin.CreatePool("p", MakeSpec(v1::MLA, v1::LAYER_FIRST, 1, 64)).ok());
  ASSERT_TRUE((*worker)->Alloc("p", 1).ok());
  EXPECT_TRUE((*worker)->fast_path_open());
  // The attacker's mailboxes closed, its share is free again.
  held.clear();
  absl::StatusOr<std::unique_ptr<RawMailbox>> again;
  for (int i = 0; i < 100; ++i) {
    again = RawMailbox::Open(socket);
    if (again.ok()) break;
    absl::SleepFor(absl::Milliseconds(50));  // its threads notice the hang-up
  }
  EXPECT_TRUE(again.ok()) << again.status();
}

// Each mailbox (2 MiB + 4 KiB by default) counts against --memory-limit.
TEST(FastPathLimitTest, MailboxesCountAgainstTheMemoryLimit) {
  absl::StatusOr<std::unique_ptr<TestDaemon>> d =
      TestDaemon::Start(KVHOSTD_PATH, {"--memory-limit=5M"});
  ASSERT_TRUE(d.ok()) << d.status();
  const std::string socket = (*d)->client().GetStatus()->handoff_socket();
  absl::StatusOr<std::unique_ptr<RawMailbox>> first = RawMailbox::Open(socket);
  ASSERT_TRUE(first.ok()) << first.status();
  absl::StatusOr<std::unique_ptr<RawMailbox>> second = RawMailbox::Open(socket);
  ASSERT_TRUE(second.ok()) << second.status();
  absl::StatusOr<std::unique_ptr<RawMailbox>> third = RawMailbox::Open(socket);
  ASSERT_FALSE(third.ok());
  EXPECT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted) << third.status();
  EXPECT_NE(third.status().message().find("--memory-limit"), std::string::npos) << third.status();
}

}  // namespace
}  // namespace kvhost
