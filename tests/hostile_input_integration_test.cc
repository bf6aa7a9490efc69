// Input a hostile local client sends to kvhostd: names
// and worker names with control characters never reach the log raw; a huge
// name is INVALID_ARGUMENT with a bounded message (it used to come back as
// RESOURCE_EXHAUSTED "initial metadata size exceeds limit", the message
// echoing all of it); connections that never finish their HTTP/2 handshake
// are closed by the daemon.
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "api_test_util.h"
#include "daemon_fixture.h"
#include "gtest/gtest.h"
#include "kvhost/client.h"

namespace kvhost {
namespace {

using ::kvhost::testing::MakeSpec;
using ::kvhost::testing::TestDaemon;

v1::PoolSpec SmallSpec() { return MakeSpec(v1::MHA, v1::LAYER_FIRST, 16, 1024); }

std::unique_ptr<TestDaemon> StartDaemon() {
  absl::StatusOr<std::unique_ptr<TestDaemon>> d = TestDaemon::Start(KVHOSTD_PATH);
  EXPECT_TRUE(d.ok()) << d.status();
  return d.ok() ? *std::move(d) : nullptr;
}

// No line of the daemon's log starts with `marker` (a forged line would).
void ExpectNoForgedLine(const TestDaemon& d, const std::string& marker) {
  for (absl::string_view line : absl::StrSplit(d.Log(), '\n')) {
    EXPECT_FALSE(absl::StartsWith(line, marker)) << "forged log line: " << line;
  }
}

TEST(HostileInput, HugeNameIsInvalidArgumentWithABoundedMessage) {
  std::unique_ptr<TestDaemon> d = StartDaemon();
  ASSERT_NE(d, nullptr);
  const std::string name(10'000, 'n');
  absl::StatusOr<v1::Pool> pool = d->client().CreatePool(name, SmallSpec());
  ASSERT_FALSE(pool.ok());
  EXPECT_EQ(pool.status().code(), absl::StatusCode::kInvalidArgument) << pool.status();
  EXPECT_LT(pool.status().message().size(), 2100u);
  EXPECT_TRUE(absl::StrContains(pool.status().message(), "10000 bytes in all")) << pool.status();
  // Lookups of such a name: NOT_FOUND, never a metadata overflow.
  absl::StatusOr<v1::Pool> got = d->client().GetPool(name);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kNotFound) << got.status();
  absl::StatusOr<std::vector<int64_t>> alloc = d->client().Alloc(name, 16);
  EXPECT_EQ(alloc.status().code(), absl::StatusCode::kNotFound) << alloc.status();
  ASSERT_TRUE(d->client().ListPools().ok());
  EXPECT_TRUE(d->client().ListPools()->empty());
}

TEST(HostileInput, ControlCharactersInNamesNeverReachTheLogRaw) {
  std::unique_ptr<TestDaemon> d = StartDaemon();
  ASSERT_NE(d, nullptr);
  for (const std::string& name :
       {std::string("a\nFORGED critical: pool b deleted"), std::string("a\rFORGED x"),
        std::string("a\0FORGED", 8), std::string("\x1b[2Jx")}) {
    absl::StatusOr<v1::Pool> pool = d->client().CreatePool(name, SmallSpec());
    EXPECT_EQ(pool.status().code(), absl::StatusCode::kInvalidArgument) << pool.status();
    // The message escapes what it echoes.
    EXPECT_FALSE(absl::StrContains(pool.status().message(), "\n"));
    EXPECT_FALSE(absl::StrContains(pool.status().message(), "\r"));
    EXPECT_FALSE(absl::StrContains(pool.status().message(), std::string(1, '\0')));
  }
  EXPECT_TRUE(d->client().ListPools()->empty());
  ExpectNoForgedLine(*d, "FORGED");
  EXPECT_TRUE(absl::StrContains(d->Log(), "a\\nFORGED")) << d->Log();
}

TEST(HostileInput, WorkerNameWithControlCharactersIsRefused) {
  std::unique_ptr<TestDaemon> d = StartDaemon();
  ASSERT_NE(d, nullptr);
  for (const std::string& worker :
       {std::string("w\nFORGED session closed"), std::string(200, 'w')}) {
    ClientOptions options;
    options.address = d->address();
    options.timeout = absl::Seconds(10);
    options.worker_name = worker;
    absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(options);
    ASSERT_TRUE(client.ok()) << client.status();
    absl::Status s = (*client)->OpenSession(absl::Seconds(2));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  }
  absl::StatusOr<v1::DaemonStatus> status = d->client().GetStatus();
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(status->sessions_size(), 0);
  ExpectNoForgedLine(*d, "FORGED");
}

// A raw connection to the daemon's unix socket that sends `bytes` and then
// nothing: how long until the daemon closes it (read returns 0 or an error).
absl::Duration TimeUntilClosed(const std::string& socket_path, const std::string& bytes,
                               absl::Duration limit) {
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, socket_path.c_str(), sizeof(addr.sun_path) - 1);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ADD_FAILURE() << "connect " << socket_path << ": " << std::strerror(errno);
    ::close(fd);
    return absl::ZeroDuration();
  }
  if (!bytes.empty()) {
    EXPECT_EQ(::write(fd, bytes.data(), bytes.size()), static_cast<ssize_t>(bytes.size()));
  }
  timeval tv{};
  tv.tv_sec = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  const absl::Time start = absl::Now();
  char buf[4096];
  while (absl::Now() - start < limit) {
    const ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) break;
  }
  ::close(fd);
  return absl::Now() - start;
}

TEST(HostileInput, HalfOpenHandshakesAreClosed) {
  std::unique_ptr<TestDaemon> d = StartDaemon();
  ASSERT_NE(d, nullptr);
  const std::string socket = d->address().substr(strlen("unix://"));
  const absl::Duration limit = absl::Seconds(40);
  // Nothing at all; the HTTP/2 client preface without SETTINGS.
  const absl::Duration silent = TimeUntilClosed(socket, "", limit);
  const absl::Duration preface = TimeUntilClosed(socket, "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", limit);
  std::printf("half-open connections closed after %s (silent) and %s (preface only)\n",
              absl::FormatDuration(silent).c_str(), absl::FormatDuration(preface).c_str());
  EXPECT_LT(silent, absl::Seconds(20));
  EXPECT_LT(preface, absl::Seconds(20));
  // The daemon serves on.
  EXPECT_TRUE(d->client().GetStatus().ok());
}

}  // namespace
}  // namespace kvhost
