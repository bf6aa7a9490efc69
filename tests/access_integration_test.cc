// Access control and request limits through kvhostd: unix
// socket mode and group, TLS and mutual TLS on TCP listeners (certificates
// made here with the openssl CLI), --insecure-tcp, owner tokens on every
// protected call (the pool exactly unchanged after a refusal), per-call
// index limits, the message size limit, and shm attach paths confined to
// --shm-dir.
#include <arpa/inet.h>
#include <grp.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "api_test_util.h"
#include "daemon_fixture.h"
#include "gtest/gtest.h"
#include "kvhost/client.h"

namespace kvhost {
namespace {

namespace fs = std::filesystem;
using ::kvhost::testing::IsError;
using ::kvhost::testing::MakeSpec;
using ::kvhost::testing::Range;
using ::kvhost::testing::ReadFile;
using ::kvhost::testing::StatusOf;
using ::kvhost::testing::TestDaemon;

constexpr char kToken[] = "s3cret-owner-token";
constexpr uint64_t kPageSize = 16;
constexpr uint64_t kPoolTokens = 1024;

// A loopback TCP port free a moment ago (kvhostd binds it right after).
int FreePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(fd);
  return ntohs(addr.sin_port);
}

// kvhostd with exactly the flags given (TestDaemon always listens on its own
// unix socket): for TCP listeners and for starts that must fail.
class RawDaemon {
 public:
  explicit RawDaemon(std::vector<std::string> flags) {
    char dir[] = "/tmp/kvhost-access-XXXXXX";
    dir_ = ::mkdtemp(dir);
    char shm[] = "/dev/shm/kvhost-access-XXXXXX";
    shm_ = ::mkdtemp(shm);
    log_ = dir_ + "/kvhostd.log";
    std::vector<std::string> args = {KVHOSTD_PATH, "--backend=host",
                                     absl::StrCat("--shm-dir=", shm_)};
    for (std::string& f : flags) args.push_back(std::move(f));
    pid_ = ::fork();
    if (pid_ == 0) {
      std::FILE* log = std::freopen(log_.c_str(), "w", stderr);
      (void)log;
      ::dup2(2, 1);
      std::vector<char*> argv;
      for (std::string& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      ::execv(argv[0], argv.data());
      ::_exit(127);
    }
  }
  ~RawDaemon() {
    if (pid_ > 0) {
      ::kill(pid_, SIGTERM);
      ::waitpid(pid_, nullptr, 0);
    }
    std::error_code ec;
    fs::remove_all(dir_, ec);
    fs::remove_all(shm_, ec);
  }
  // The exit code if it exits within `timeout`, else nullopt.
  std::optional<int> ExitWithin(absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    while (absl::Now() < deadline) {
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      }
      absl::SleepFor(absl::Milliseconds(20));
    }
    return std::nullopt;
  }
  std::string Log() const { return ReadFile(log_); }
  const std::string& dir() const { return dir_; }

 private:
  std::string dir_;
  std::string shm_;
  std::string log_;
  pid_t pid_ = -1;
};

// A CA, a second (wrong) CA, a server certificate for localhost / 127.0.0.1
// and a client certificate, both signed by the CA; made once per run.
class Certificates {
 public:
  static const Certificates& Get() {
    static const Certificates* certs = new Certificates();
    return *certs;
  }
  std::string Path(const std::string& name) const { return dir_ + "/" + name; }
  bool ok() const { return ok_; }

 private:
  Certificates() {
    char dir[] = "/tmp/kvhost-certs-XXXXXX";
    dir_ = ::mkdtemp(dir);
    const std::string script = absl::StrCat(
        "set -e; cd '", dir_, "'; ",
        "openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 2 "
        "-subj /CN=kvhost-test-ca; ",
        "openssl req -x509 -newkey rsa:2048 -nodes -keyout other.key -out other-ca.pem -days 2 "
        "-subj /CN=kvhost-other-ca; ",
        "openssl req -newkey rsa:2048 -nodes -keyout server.key -out server.csr -subj "
        "/CN=localhost; ",
        "printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\\n' > server.ext; ",
        "openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial "
        "-out server.pem -days 2 -extfile server.ext; ",
        "openssl req -newkey rsa:2048 -nodes -keyout client.key -out client.csr "
        "-subj /CN=kvhost-test-client; ",
        "openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial "
        "-out client.pem -days 2");
    ok_ = std::system(absl::StrCat("(", script, ") >'", dir_, "/openssl.log' 2>&1").c_str()) == 0;
  }
  std::string dir_;
  bool ok_ = false;
};

ClientOptions TcpClient(int port) {
  ClientOptions options;
  options.address = absl::StrCat("127.0.0.1:", port);
  options.timeout = absl::Seconds(5);
  options.worker_session = false;
  return options;
}

std::unique_ptr<Client> Connect(const ClientOptions& options) {
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(options);
  EXPECT_TRUE(client.ok()) << client.status();
  return client.ok() ? *std::move(client) : nullptr;
}

// ---------------------------------------------------------------------------
// Unix sockets.

TEST(AccessSocket, ModeAndGroupApplied) {
  // A supplementary group when the process has one, else its own.
  gid_t gid = ::getegid();
  std::vector<gid_t> groups(static_cast<size_t>(std::max(::getgroups(0, nullptr), 0)));
  if (!groups.empty() && ::getgroups(static_cast<int>(groups.size()), groups.data()) > 0) {
    for (gid_t g : groups) {
      if (g != gid) gid = g;
    }
  }
  absl::StatusOr<std::unique_ptr<TestDaemon>> d =
      TestDaemon::Start(KVHOSTD_PATH, {"--socket-mode=0640", absl::StrCat("--socket-group=", gid)});
  ASSERT_TRUE(d.ok()) << d.status();
  struct stat st;
  ASSERT_EQ(::stat((*d)->address().substr(7).c_str(), &st), 0);
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
  EXPECT_EQ(st.st_mode & 07777, 0640u) << absl::StrFormat("%04o", st.st_mode & 07777);
  EXPECT_EQ(st.st_gid, gid);
  EXPECT_TRUE(absl::StrContains((*d)->Log(), "mode 0640")) << (*d)->Log();
  EXPECT_TRUE((*d)->client().GetStatus().ok());
}

TEST(AccessSocket, DefaultModeIs0660) {
  absl::StatusOr<std::unique_ptr<TestDaemon>> d = TestDaemon::Start(KVHOSTD_PATH);
  ASSERT_TRUE(d.ok()) << d.status();
  struct stat st;
  ASSERT_EQ(::stat((*d)->address().substr(7).c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0660u) << absl::StrFormat("%04o", st.st_mode & 07777);
  EXPECT_EQ(st.st_gid, ::getegid());
}

TEST(AccessSocket, UnknownGroupFailsTheStart) {
  RawDaemon d(
      {"--listen=unix:///tmp/kvhost-access-nogroup.sock", "--socket-group=kvhost-no-such-group"});
  EXPECT_EQ(d.ExitWithin(absl::Seconds(20)), 2);
  EXPECT_TRUE(absl::StrContains(d.Log(), "kvhost-no-such-group")) << d.Log();
}

// ---------------------------------------------------------------------------
// TCP listeners.

TEST(AccessTcp, PlaintextListenerRefusedWithoutInsecureTcp) {
  const int port = FreePort();
  RawDaemon d({absl::StrCat("--listen=127.0.0.1:", port)});
  EXPECT_EQ(d.ExitWithin(absl::Seconds(20)), 2);
  const std::string log = d.Log();
  EXPECT_TRUE(absl::StrContains(log, "FAILED_PRECONDITION")) << log;
  EXPECT_TRUE(absl::StrContains(log, absl::StrCat("127.0.0.1:", port))) << log;
  EXPECT_TRUE(absl::StrContains(log, "--tls-cert/--tls-key or --insecure-tcp")) << log;
}

TEST(AccessTcp, InsecureTcpServesPlaintextAndWarns) {
  const int port = FreePort();
  RawDaemon d({absl::StrCat("--listen=127.0.0.1:", port), "--insecure-tcp"});
  ClientOptions options = TcpClient(port);
  options.insecure = true;
  std::unique_ptr<Client> client = Connect(options);
  ASSERT_NE(client, nullptr);
  ASSERT_TRUE(client->WaitForReady(absl::Seconds(20)).ok()) << d.Log();
  EXPECT_TRUE(client->GetStatus().ok());
  EXPECT_TRUE(absl::StrContains(d.Log(), "INSECURE")) << d.Log();
  // A TLS client cannot talk to it.
  std::unique_ptr<Client> tls = Connect(TcpClient(port));
  ASSERT_NE(tls, nullptr);
  EXPECT_EQ(tls->GetStatus().status().code(), absl::StatusCode::kUnavailable);
}

TEST(AccessTcp, UnreadableCertificateFailsTheStart) {
  RawDaemon d({absl::StrCat("--listen=127.0.0.1:", FreePort()), "--tls-cert=/nonexistent/c.pem",
               "--tls-key=/nonexistent/k.pem"});
  EXPECT_EQ(d.ExitWithin(absl::Seconds(20)), 2);
  EXPECT_TRUE(absl::StrContains(d.Log(), "/nonexistent/c.pem")) << d.Log();
}

TEST(AccessTcp, TlsServesAndChecksTheCa) {
  const Certificates& certs = Certificates::Get();
  ASSERT_TRUE(certs.ok()) << ReadFile(certs.Path("openssl.log"));
  const int port = FreePort();
  RawDaemon d({absl::StrCat("--listen=127.0.0.1:", port),
               absl::StrCat("--tls-cert=", certs.Path("server.pem")),
               absl::StrCat("--tls-key=", certs.Path("server.key"))});
  ClientOptions good = TcpClient(port);
  good.tls_ca_file = certs.Path("ca.pem");
  std::unique_ptr<Client> client = Connect(good);
  ASSERT_NE(client, nullptr);
  ASSERT_TRUE(client->WaitForReady(absl::Seconds(20)).ok()) << d.Log();
  EXPECT_TRUE(client->GetStatus().ok());
  // The name checked may be given (the certificate names localhost too).
  ClientOptions named = good;
  named.tls_server_name = "localhost";
  std::unique_ptr<Client> by_name = Connect(named);
  EXPECT_TRUE(by_name->GetStatus().ok());

  ClientOptions wrong_ca = good;
  wrong_ca.tls_ca_file = certs.Path("other-ca.pem");
  EXPECT_EQ(Connect(wrong_ca)->GetStatus().status().code(), absl::StatusCode::kUnavailable);
  ClientOptions plaintext = TcpClient(port);
  plaintext.insecure = true;
  EXPECT_EQ(Connect(plaintext)->GetStatus().status().code(), absl::StatusCode::kUnavailable);
  ClientOptions bad_file = good;
  bad_file.tls_ca_file = "/nonexistent/ca.pem";
  EXPECT_TRUE(IsError(StatusOf(Client::Connect(bad_file)), absl::StatusCode::kFailedPrecondition,
                      {"/nonexistent/ca.pem"}));
}

TEST(AccessTcp, MutualTlsNeedsAClientCertificate) {
  const Certificates& certs = Certificates::Get();
  ASSERT_TRUE(certs.ok()) << ReadFile(certs.Path("openssl.log"));
  const int port = FreePort();
  RawDaemon d({absl::StrCat("--listen=127.0.0.1:", port),
               absl::StrCat("--tls-cert=", certs.Path("server.pem")),
               absl::StrCat("--tls-key=", certs.Path("server.key")),
               absl::StrCat("--tls-client-ca=", certs.Path("ca.pem"))});
  ClientOptions with_cert = TcpClient(port);
  with_cert.tls_ca_file = certs.Path("ca.pem");
  with_cert.tls_cert_file = certs.Path("client.pem");
  with_cert.tls_key_file = certs.Path("client.key");
  std::unique_ptr<Client> client = Connect(with_cert);
  ASSERT_NE(client, nullptr);
  ASSERT_TRUE(client->WaitForReady(absl::Seconds(20)).ok()) << d.Log();
  EXPECT_TRUE(client->GetStatus().ok());

  ClientOptions no_cert = with_cert;
  no_cert.tls_cert_file.clear();
  no_cert.tls_key_file.clear();
  EXPECT_EQ(Connect(no_cert)->GetStatus().status().code(), absl::StatusCode::kUnavailable);
  // A certificate the daemon's client CA did not sign: the server's own CA
  // key pair stands in for a stranger's.
  ClientOptions stranger = with_cert;
  stranger.tls_cert_file = certs.Path("other-ca.pem");
  stranger.tls_key_file = certs.Path("other.key");
  EXPECT_EQ(Connect(stranger)->GetStatus().status().code(), absl::StatusCode::kUnavailable);
}

// ---------------------------------------------------------------------------
// Owner tokens.

class OwnerTokenTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<TestDaemon>> d = TestDaemon::Start(KVHOSTD_PATH);
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = *std::move(d);
    owner_ = ClientFor(kToken);
    anonymous_ = ClientFor("");
    stranger_ = ClientFor("not-the-token");
    absl::StatusOr<v1::Pool> pool =
        owner_->CreatePool("p", MakeSpec(v1::MHA, v1::PAGE_FIRST, kPageSize, kPoolTokens));
    ASSERT_TRUE(pool.ok()) << pool.status();
    pool_ = *pool;
    absl::StatusOr<std::vector<int64_t>> slots = owner_->Alloc("p", 2 * kPageSize);
    ASSERT_TRUE(slots.ok()) << slots.status();
    slots_ = *slots;
    page_.assign(pool_.bytes_per_page(), '\x5a');
    ASSERT_TRUE(owner_->SetFromFlatDataPage("p", slots_[0], page_).ok());
  }
  void TearDown() override {
    if (HasFailure() && daemon_ != nullptr) {
      std::fprintf(stderr, "--- kvhostd log ---\n%s\n", daemon_->Log().c_str());
    }
  }

  std::unique_ptr<Client> ClientFor(const std::string& token) {
    ClientOptions options;
    options.address = daemon_->address();
    options.timeout = absl::Seconds(10);
    options.owner_token = token;
    options.worker_session = false;
    return Connect(options);
  }

  // What a refused call must leave as it was: the free count, the slots
  // allocated and a page's bytes.
  struct Snapshot {
    uint64_t available = 0;
    std::string page;
    bool operator==(const Snapshot& o) const { return available == o.available && page == o.page; }
  };
  Snapshot Take() {
    Snapshot s;
    absl::StatusOr<v1::Pool> pool = owner_->GetPool("p");
    EXPECT_TRUE(pool.ok()) << pool.status();
    if (pool.ok()) s.available = pool->available_tokens();
    absl::StatusOr<std::string> page = owner_->GetDataPage("p", slots_[0]);
    EXPECT_TRUE(page.ok()) << page.status();
    if (page.ok()) s.page = *page;
    return s;
  }

  std::unique_ptr<TestDaemon> daemon_;
  std::unique_ptr<Client> owner_, anonymous_, stranger_;
  v1::Pool pool_;
  std::vector<int64_t> slots_;
  std::string page_;
};

TEST_F(OwnerTokenTest, EveryProtectedCallNeedsTheToken) {
  const Snapshot before = Take();
  ASSERT_EQ(before.available, kPoolTokens - 2 * kPageSize);
  const std::string other_page(page_.size(), '\x11');
  absl::StatusOr<std::unique_ptr<ShmDevicePool>> dev =
      ShmDevicePool::Create(pool_, 64, daemon_->shm_dir());
  ASSERT_TRUE(dev.ok()) << dev.status();
  v1::PoolEntry entry;
  entry.set_name("kv");
  entry.set_pool("p");

  for (Client* c : {anonymous_.get(), stranger_.get()}) {
    const std::string why = c == anonymous_.get()
                                ? "needs its owner token in gRPC metadata 'kvhost-token'"
                                : "the token given does not match";
    SCOPED_TRACE(why);
    const std::vector<absl::Status> refused = {
        StatusOf(c->DeletePool("p")),
        StatusOf(c->Alloc("p", kPageSize)),
        StatusOf(c->Free("p", slots_)),
        c->SetFromFlatDataPage("p", slots_[0], other_page),
        StatusOf(c->WritePages("p", {slots_[0]}, {other_page})),
        StatusOf(c->GetDataPage("p", slots_[0])),
        StatusOf(c->ReadPages("p", {slots_[0]})),
        StatusOf(c->AttachDevice((*dev)->MakeAttachRequest("p"))),
        StatusOf(c->CreatePoolGroup("g", 3, {entry})),
    };
    for (size_t i = 0; i < refused.size(); ++i) {
      EXPECT_TRUE(IsError(refused[i], absl::StatusCode::kPermissionDenied,
                          {"pool 'p' is owner-protected", why}))
          << "call " << i;
    }
    EXPECT_TRUE(Take() == before);
  }
  // Page metadata names the region files and offsets: it needs the token.
  // Calls that neither change the pool nor locate or read its
  // data stay open.
  const std::vector<int64_t> first_page(slots_.begin(), slots_.begin() + kPageSize);
  EXPECT_TRUE(IsError(StatusOf(anonymous_->GetPageBufferMeta("p", first_page)),
                      absl::StatusCode::kPermissionDenied, {"pool 'p' is owner-protected"}));
  EXPECT_TRUE(anonymous_->GetPageShape("p").ok());
  EXPECT_TRUE(anonymous_->ListPools().ok());

  // The owner may do all of it.
  absl::StatusOr<std::vector<int64_t>> more = owner_->Alloc("p", kPageSize);
  ASSERT_TRUE(more.ok()) << more.status();
  EXPECT_TRUE(owner_->Free("p", *more).ok());
  const int64_t second_page = slots_[kPageSize];
  EXPECT_TRUE(owner_->WritePages("p", {second_page}, {other_page}).ok());
  absl::StatusOr<std::vector<std::string>> read = owner_->ReadPages("p", {second_page});
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ((*read)[0], other_page);
  absl::StatusOr<v1::Attachment> att = owner_->AttachDevice((*dev)->MakeAttachRequest("p"));
  ASSERT_TRUE(att.ok()) << att.status();
  EXPECT_TRUE(owner_->DetachDevice(att->id()).ok());
}

TEST_F(OwnerTokenTest, GroupCallsNeedTheTokenOfEveryProtectedEntry) {
  v1::PoolEntry entry;
  entry.set_name("kv");
  entry.set_pool("p");
  ASSERT_TRUE(owner_->CreatePoolGroup("g", 3, {entry}).ok());
  const Snapshot before = Take();
  EXPECT_TRUE(IsError(StatusOf(anonymous_->Alloc("g", kPageSize)),
                      absl::StatusCode::kPermissionDenied, {"pool 'p'", "group 'g'"}));
  EXPECT_TRUE(IsError(StatusOf(stranger_->Free("g", slots_)), absl::StatusCode::kPermissionDenied,
                      {"pool 'p'", "does not match"}));
  EXPECT_TRUE(IsError(anonymous_->DeletePoolGroup("g"), absl::StatusCode::kPermissionDenied,
                      {"pool 'p'", "group 'g'"}));
  EXPECT_TRUE(Take() == before);
  EXPECT_TRUE(owner_->GetPoolGroup("g").ok());
  EXPECT_TRUE(owner_->DeletePoolGroup("g").ok());
  EXPECT_TRUE(owner_->DeletePool("p").ok());
}

TEST_F(OwnerTokenTest, TokenIsNeverShownAndHasALimit) {
  absl::StatusOr<v1::Pool> pool = anonymous_->GetPool("p");
  ASSERT_TRUE(pool.ok()) << pool.status();
  EXPECT_TRUE(pool->owner_protected());
  EXPECT_FALSE(absl::StrContains(pool->SerializeAsString(), kToken));
  absl::StatusOr<std::vector<v1::Pool>> pools = anonymous_->ListPools();
  ASSERT_TRUE(pools.ok());
  ASSERT_EQ(pools->size(), 1u);
  EXPECT_TRUE((*pools)[0].owner_protected());
  EXPECT_FALSE(absl::StrContains(daemon_->Log(), kToken));

  // An unprotected pool says so.
  absl::StatusOr<v1::Pool> open =
      anonymous_->CreatePool("open", MakeSpec(v1::MHA, v1::PAGE_FIRST, kPageSize, kPoolTokens));
  ASSERT_TRUE(open.ok()) << open.status();
  EXPECT_FALSE(open->owner_protected());
  EXPECT_TRUE(stranger_->Alloc("open", kPageSize).ok());

  std::unique_ptr<Client> long_token = ClientFor(std::string(257, 't'));
  EXPECT_TRUE(IsError(StatusOf(long_token->CreatePool(
                          "long", MakeSpec(v1::MHA, v1::PAGE_FIRST, kPageSize, kPoolTokens))),
                      absl::StatusCode::kInvalidArgument, {"257", "256"}));
  EXPECT_TRUE(IsError(StatusOf(anonymous_->GetPool("long")), absl::StatusCode::kNotFound, {}));

  // A follower of a protected pool needs its token.
  v1::PoolSpec follower = MakeSpec(v1::MHA, v1::PAGE_FIRST, kPageSize, 0);
  follower.set_kind(v1::K_ONLY);
  follower.clear_size_tokens();
  follower.clear_page_size();
  follower.set_follows("p");
  EXPECT_TRUE(IsError(StatusOf(anonymous_->CreatePool("f", follower)),
                      absl::StatusCode::kPermissionDenied, {"pool 'p' is owner-protected"}));
  EXPECT_TRUE(IsError(StatusOf(anonymous_->GetPool("f")), absl::StatusCode::kNotFound, {}));
  absl::StatusOr<v1::Pool> followed_by_owner = owner_->CreatePool("f", follower);
  EXPECT_TRUE(followed_by_owner.ok()) << followed_by_owner.status();
}

// ---------------------------------------------------------------------------
// Request limits.

class LimitsTest : public ::testing::Test {
 protected:
  static constexpr uint64_t kLimit = 32;
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<TestDaemon>> d = TestDaemon::Start(
        KVHOSTD_PATH,
        {absl::StrCat("--max-indices-per-call=", kLimit), "--max-message-bytes=65536"});
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = *std::move(d);
    ClientOptions options;
    options.address = daemon_->address();
    options.timeout = absl::Seconds(10);
    options.worker_session = false;
    client_ = Connect(options);
    absl::StatusOr<v1::Pool> pool =
        client_->CreatePool("p", MakeSpec(v1::MHA, v1::PAGE_FIRST, kPageSize, kPoolTokens));
    ASSERT_TRUE(pool.ok()) << pool.status();
    pool_ = *pool;
  }
  uint64_t Available() {
    absl::StatusOr<v1::Pool> pool = client_->GetPool("p");
    return pool.ok() ? pool->available_tokens() : 0;
  }

  std::unique_ptr<TestDaemon> daemon_;
  std::unique_ptr<Client> client_;
  v1::Pool pool_;
};

TEST_F(LimitsTest, OverTheIndexLimitIsInvalidArgumentAndChangesNothing) {
  absl::StatusOr<std::vector<int64_t>> slots = client_->Alloc("p", kLimit);  // at the limit: OK
  ASSERT_TRUE(slots.ok()) << slots.status();
  const uint64_t available = Available();
  const std::vector<int64_t> over = Range(0, kLimit + kPageSize);  // whole pages, 48 slots
  const std::string n = absl::StrCat(over.size());
  const std::string limit = absl::StrCat(kLimit);

  EXPECT_TRUE(IsError(StatusOf(client_->Alloc("p", over.size())),
                      absl::StatusCode::kInvalidArgument, {"num_tokens", n, limit}));
  EXPECT_TRUE(IsError(StatusOf(client_->Free("p", over)), absl::StatusCode::kInvalidArgument,
                      {"Free", n, limit}));
  EXPECT_TRUE(IsError(StatusOf(client_->GetPageBufferMeta("p", over)),
                      absl::StatusCode::kInvalidArgument, {n, limit}));
  std::vector<int64_t> page_starts;
  for (uint64_t i = 0; i <= kLimit; ++i) page_starts.push_back(static_cast<int64_t>(i * kPageSize));
  EXPECT_TRUE(IsError(StatusOf(client_->ReadPages("p", page_starts)),
                      absl::StatusCode::kInvalidArgument,
                      {"ReadPages", absl::StrCat(kLimit + 1), limit}));
  EXPECT_EQ(Available(), available);

  absl::StatusOr<std::unique_ptr<ShmDevicePool>> dev =
      ShmDevicePool::Create(pool_, 64, daemon_->shm_dir());
  ASSERT_TRUE(dev.ok()) << dev.status();
  absl::StatusOr<v1::Attachment> att = client_->AttachDevice((*dev)->MakeAttachRequest("p"));
  ASSERT_TRUE(att.ok()) << att.status();
  EXPECT_TRUE(IsError(StatusOf(client_->Backup(att->id(), over, over)),
                      absl::StatusCode::kInvalidArgument, {"Backup host_indices", n, limit}));
  EXPECT_TRUE(IsError(StatusOf(client_->Load(att->id(), over, over)),
                      absl::StatusCode::kInvalidArgument, {"Load host_indices", n, limit}));
  // At the limit, the same calls go through.
  absl::StatusOr<uint64_t> ticket = client_->Backup(att->id(), *slots, Range(0, kLimit));
  ASSERT_TRUE(ticket.ok()) << ticket.status();
  EXPECT_TRUE(client_->WaitTransfer(*ticket).ok());
  EXPECT_EQ(Available(), available);
}

TEST_F(LimitsTest, TooLargeMessageIsResourceExhausted) {
  absl::StatusOr<std::vector<int64_t>> slots = client_->Alloc("p", kPageSize);
  ASSERT_TRUE(slots.ok()) << slots.status();
  const std::string huge(100000, 'x');  // over --max-message-bytes=65536
  EXPECT_EQ(client_->SetFromFlatDataPage("p", (*slots)[0], huge).code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(client_->GetStatus().ok());
}

// ---------------------------------------------------------------------------
// Shared-memory device paths only from --shm-dir.

TEST(AccessShm, AttachPathsOutsideTheShmDirAreRefused) {
  absl::StatusOr<std::unique_ptr<TestDaemon>> d = TestDaemon::Start(KVHOSTD_PATH);
  ASSERT_TRUE(d.ok()) << d.status();
  Client& client = (*d)->client();
  absl::StatusOr<v1::Pool> pool =
      client.CreatePool("p", MakeSpec(v1::MHA, v1::PAGE_FIRST, kPageSize, kPoolTokens));
  ASSERT_TRUE(pool.ok()) << pool.status();
  // The device pool made outside the shm dir, and reached three ways.
  char outside_dir[] = "/dev/shm/kvhost-outside-XXXXXX";
  ASSERT_NE(::mkdtemp(outside_dir), nullptr);
  absl::StatusOr<std::unique_ptr<ShmDevicePool>> dev =
      ShmDevicePool::Create(*pool, 64, outside_dir);
  ASSERT_TRUE(dev.ok()) << dev.status();
  const std::string file = fs::path((*dev)->path()).filename();
  const std::string link = absl::StrCat((*d)->shm_dir(), "/link-", file);
  fs::create_symlink((*dev)->path(), link);
  for (const std::string& path :
       {(*dev)->path(),
        absl::StrCat((*d)->shm_dir(), "/../", fs::path(outside_dir).filename().string(), "/", file),
        link}) {
    SCOPED_TRACE(path);
    v1::AttachDeviceRequest request = (*dev)->MakeAttachRequest("p");
    for (v1::DeviceBuffer& b : *request.mutable_k_layers()) b.mutable_shm()->set_path(path);
    for (v1::DeviceBuffer& b : *request.mutable_v_layers()) b.mutable_shm()->set_path(path);
    EXPECT_TRUE(IsError(StatusOf(client.AttachDevice(request)), absl::StatusCode::kPermissionDenied,
                        {"outside the shm dir"}));
  }
  absl::StatusOr<v1::Pool> after = client.GetPool("p");
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->attachments(), 0u);
  dev->reset();
  std::error_code ec;
  fs::remove_all(outside_dir, ec);
}

}  // namespace
}  // namespace kvhost
