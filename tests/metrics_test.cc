// Unit tests of server/metrics: the Prometheus text exposition format 0.0.4
// (HELP / TYPE lines, label escaping, cumulative histogram buckets with +Inf,
// _sum and _count), series removal, the process metrics, and the HTTP
// endpoint (status codes, HEAD, keep-alive, content type, idle connections,
// clients that never read, timeouts, stop).
#include "server/metrics/metrics.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "http_test_util.h"
#include "server/metrics/http_server.h"
#include "server/metrics/kvhost_metrics.h"
#include "server/metrics/process_metrics.h"

namespace kvhost {
namespace {

TEST(MetricsFormatTest, EscapesLabelValues) {
  EXPECT_EQ(EscapeLabelValue("plain"), "plain");
  EXPECT_EQ(EscapeLabelValue("a\\b"), "a\\\\b");
  EXPECT_EQ(EscapeLabelValue("say \"hi\""), "say \\\"hi\\\"");
  EXPECT_EQ(EscapeLabelValue("two\nlines"), "two\\nlines");
  EXPECT_EQ(EscapeLabelValue("\\\"\n"), "\\\\\\\"\\n");
}

TEST(MetricsFormatTest, FormatsValues) {
  EXPECT_EQ(FormatMetricValue(0), "0");
  EXPECT_EQ(FormatMetricValue(42), "42");
  EXPECT_EQ(FormatMetricValue(0.0005), "0.0005");
  EXPECT_EQ(FormatMetricValue(2.5), "2.5");
  EXPECT_EQ(FormatMetricValue(1e20), "1e+20");
  EXPECT_EQ(FormatMetricValue(1e-7), "1e-07");
  EXPECT_EQ(FormatMetricValue(-3.5), "-3.5");
  EXPECT_EQ(FormatMetricValue(68719476736), "68719476736");
  EXPECT_EQ(FormatMetricValue(1.0 / 0.0), "+Inf");
  EXPECT_EQ(FormatMetricValue(-1.0 / 0.0), "-Inf");
  EXPECT_EQ(FormatMetricValue(0.0 / 0.0), "NaN");
}

TEST(MetricsFormatTest, CounterWithEscapedLabelsAndHelp) {
  MetricsRegistry registry;
  CounterFamily* c =
      registry.AddCounter("test_requests_total", "Requests, by path.\nSecond \\ line.", {"path"});
  c->WithLabels({"a\"b\\c\nd"})->Increment(3);
  c->WithLabels({"plain"})->Increment();
  EXPECT_EQ(c->WithLabels({"plain"})->value(), 1u);
  EXPECT_EQ(registry.Render(),
            "# HELP test_requests_total Requests, by path.\\nSecond \\\\ line.\n"
            "# TYPE test_requests_total counter\n"
            "test_requests_total{path=\"a\\\"b\\\\c\\nd\"} 3\n"
            "test_requests_total{path=\"plain\"} 1\n");
}

TEST(MetricsFormatTest, CounterWithoutLabelsAndFamilyWithoutSeries) {
  MetricsRegistry registry;
  registry.AddCounter("test_empty_total", "Nothing yet.");
  CounterFamily* c = registry.AddCounter("test_plain_total", "No labels.");
  c->WithLabels({})->Increment(7);
  EXPECT_EQ(registry.Render(),
            "# HELP test_empty_total Nothing yet.\n"
            "# TYPE test_empty_total counter\n"
            "# HELP test_plain_total No labels.\n"
            "# TYPE test_plain_total counter\n"
            "test_plain_total 7\n");
}

TEST(MetricsFormatTest, HistogramBucketsAreCumulativeWithInfSumAndCount) {
  MetricsRegistry registry;
  HistogramFamily* h =
      registry.AddHistogram("test_seconds", "Durations.", {"op", "code"}, {0.5, 1, 2.5});
  Histogram* series = h->WithLabels({"x", "OK"});
  for (double v : {0.1, 0.5, 0.7, 1.0, 3.0, 100.0}) series->Observe(v);
  EXPECT_EQ(registry.Render(),
            "# HELP test_seconds Durations.\n"
            "# TYPE test_seconds histogram\n"
            "test_seconds_bucket{op=\"x\",code=\"OK\",le=\"0.5\"} 2\n"  // le is inclusive
            "test_seconds_bucket{op=\"x\",code=\"OK\",le=\"1\"} 4\n"
            "test_seconds_bucket{op=\"x\",code=\"OK\",le=\"2.5\"} 4\n"
            "test_seconds_bucket{op=\"x\",code=\"OK\",le=\"+Inf\"} 6\n"
            "test_seconds_sum{op=\"x\",code=\"OK\"} 105.3\n"
            "test_seconds_count{op=\"x\",code=\"OK\"} 6\n");
}

TEST(MetricsFormatTest, HistogramWithoutLabels) {
  MetricsRegistry registry;
  HistogramFamily* h = registry.AddHistogram("test_size", "Sizes.", {}, {10});
  h->WithLabels({})->Observe(20);
  EXPECT_EQ(registry.Render(),
            "# HELP test_size Sizes.\n"
            "# TYPE test_size histogram\n"
            "test_size_bucket{le=\"10\"} 0\n"
            "test_size_bucket{le=\"+Inf\"} 1\n"
            "test_size_sum 20\n"
            "test_size_count 1\n");
}

TEST(MetricsFormatTest, GaugesAreComputedAtScrape) {
  MetricsRegistry registry;
  double value = 1;
  registry.AddGauge("test_level", "A level.", {"pool"}, [&value] {
    return std::vector<GaugeSample>{{{"p"}, value}, {{"q"}, value * 2}};
  });
  EXPECT_EQ(registry.Render(),
            "# HELP test_level A level.\n"
            "# TYPE test_level gauge\n"
            "test_level{pool=\"p\"} 1\n"
            "test_level{pool=\"q\"} 2\n");
  value = 0.25;
  EXPECT_NE(registry.Render().find("test_level{pool=\"q\"} 0.5\n"), std::string::npos);
}

TEST(MetricsFormatTest, ConcurrentUpdatesAreAllCounted) {
  MetricsRegistry registry;
  CounterFamily* c = registry.AddCounter("test_total", "t", {"k"});
  HistogramFamily* h = registry.AddHistogram("test_h", "h", {"k"}, {1});
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 10000; ++i) {
        c->WithLabels({t % 2 == 0 ? "even" : "odd"})->Increment();
        h->WithLabels({"all"})->Observe(0.5);
        if (i % 1000 == 0) (void)registry.Render();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(c->WithLabels({"even"})->value(), 20000u);
  EXPECT_EQ(c->WithLabels({"odd"})->value(), 20000u);
  EXPECT_EQ(h->WithLabels({"all"})->Read().count, 40000u);
}

TEST(MetricsFormatTest, KvhostFamiliesRender) {
  KvhostMetrics metrics;
  metrics.transfer_seconds->WithLabels({"p", "backup", "host-memcpy"})->Observe(0.002);
  const std::string text = metrics.registry.Render();
  EXPECT_NE(text.find("# TYPE kvhost_transfer_duration_seconds histogram\n"), std::string::npos);
  EXPECT_NE(text.find("kvhost_transfer_duration_seconds_bucket{pool=\"p\",direction=\"backup\","
                      "path=\"host-memcpy\",le=\"0.0025\"} 1\n"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("le=\"10\"} 1\n"), std::string::npos) << text;
  // CreatePool takes tens of seconds on a small machine: RPC buckets reach 120 s.
  ASSERT_FALSE(kRpcSecondsBuckets.empty());
  EXPECT_GE(kRpcSecondsBuckets.back(), 120);
}

TEST(MetricsFormatTest, RetainSeriesRemovesTheRefusedAndKeepsPointersUsable) {
  MetricsRegistry registry;
  CounterFamily* c = registry.AddCounter("test_total", "t", {"pool"});
  HistogramFamily* h = registry.AddHistogram("test_h", "h", {"pool"}, {1});
  Counter* gone = c->WithLabels({"gone"});
  gone->Increment(5);
  c->WithLabels({"kept"})->Increment(2);
  h->WithLabels({"gone"})->Observe(0.5);
  h->WithLabels({"kept"})->Observe(0.5);
  const SeriesFilter kept = [](const LabelValues& v) { return v[0] == "kept"; };
  c->RetainSeries(kept);
  h->RetainSeries(kept);
  const std::string text = registry.Render();
  EXPECT_EQ(text.find("gone"), std::string::npos) << text;
  EXPECT_NE(text.find("test_total{pool=\"kept\"} 2\n"), std::string::npos) << text;
  EXPECT_NE(text.find("test_h_count{pool=\"kept\"} 1\n"), std::string::npos) << text;
  EXPECT_EQ(c->SeriesLabels(), std::vector<LabelValues>{{"kept"}});
  // A pointer taken before the removal still works (its count is lost)...
  gone->Increment();
  EXPECT_EQ(gone->value(), 6u);
  // ...and the series, asked for again, starts over at 0.
  EXPECT_EQ(c->WithLabels({"gone"})->value(), 0u);
  EXPECT_NE(registry.Render().find("test_total{pool=\"gone\"} 0\n"), std::string::npos);
}

// Kept in microseconds, named and shown in seconds (promtool wants base units).
TEST(MetricsFormatTest, CounterWithAUnitRendersInTheBaseUnit) {
  MetricsRegistry registry;
  CounterFamily* cpu =
      registry.AddCounter("test_cpu_seconds_total", "CPU.", {"uid"}, /*unit=*/1e-6);
  cpu->WithLabels({"7"})->Increment(1500000);
  cpu->WithLabels({"8"})->Increment(3);
  EXPECT_EQ(registry.Render(),
            "# HELP test_cpu_seconds_total CPU.\n"
            "# TYPE test_cpu_seconds_total counter\n"
            "test_cpu_seconds_total{uid=\"7\"} 1.5\n"
            "test_cpu_seconds_total{uid=\"8\"} 3e-06\n");
}

TEST(MetricsFormatTest, ComputedCounterHasCounterType) {
  MetricsRegistry registry;
  registry.AddComputedCounter("test_cpu_seconds_total", "CPU.", {}, [] {
    return std::vector<GaugeSample>{{{}, 1.5}};
  });
  EXPECT_EQ(registry.Render(),
            "# HELP test_cpu_seconds_total CPU.\n"
            "# TYPE test_cpu_seconds_total counter\n"
            "test_cpu_seconds_total 1.5\n");
}

TEST(ProcessMetricsTest, FiguresOfThisProcess) {
  const std::optional<ProcessStats> before = ReadProcessStats();
  ASSERT_TRUE(before.has_value());
  // Burn a little CPU; the figure must move and stay plausible.
  volatile uint64_t x = 0;
  const absl::Time end = absl::Now() + absl::Milliseconds(200);
  while (absl::Now() < end) x = x + 1;
  const std::optional<ProcessStats> after = ReadProcessStats();
  ASSERT_TRUE(after.has_value());
  EXPECT_GT(after->cpu_seconds, before->cpu_seconds);
  EXPECT_LT(after->cpu_seconds, 600);
  EXPECT_GT(after->resident_bytes, 1u << 20);
  const double now = absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch());
  EXPECT_LE(after->start_time_seconds, now + 1);
  EXPECT_GT(after->start_time_seconds, now - 3600);
  // One more descriptor open is one more counted.
  const int fd = ::dup(0);
  ASSERT_GE(fd, 0);
  EXPECT_EQ(ReadProcessStats()->open_fds, after->open_fds + 1);
  ::close(fd);

  MetricsRegistry registry;
  AddProcessMetrics(&registry);
  const std::string text = registry.Render();
  for (const char* line :
       {"# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total ",
        "# TYPE process_resident_memory_bytes gauge\nprocess_resident_memory_bytes ",
        "# TYPE process_open_fds gauge\nprocess_open_fds ",
        "# TYPE process_start_time_seconds gauge\nprocess_start_time_seconds "}) {
    EXPECT_NE(text.find(line), std::string::npos) << line << "\n" << text;
  }
}

// ---------------------------------------------------------------------------
// HTTP endpoint.

TEST(ParseHostPortTest, AcceptsAndRefuses) {
  std::string host;
  int port = -1;
  ASSERT_TRUE(ParseHostPort("127.0.0.1:9464", &host, &port).ok());
  EXPECT_EQ(host, "127.0.0.1");
  EXPECT_EQ(port, 9464);
  ASSERT_TRUE(ParseHostPort(":0", &host, &port).ok());
  EXPECT_EQ(host, "");
  EXPECT_EQ(port, 0);
  ASSERT_TRUE(ParseHostPort("[::1]:80", &host, &port).ok());
  EXPECT_EQ(host, "::1");
  EXPECT_EQ(port, 80);
  for (const char* bad : {"", "9464", "host:", "host:x", "host:65536", "host:-1", "::1:80",
                          "[::1]80", "[]:80", "h:123456"}) {
    absl::Status s = ParseHostPort(bad, &host, &port);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(s.message().find(absl::StrCat("'", bad, "'")), std::string::npos) << s;
  }
}

int Connect(int port) { return ::kvhost::testing::ConnectLoopback(port); }

std::string Exchange(int port, const std::string& request) {
  return ::kvhost::testing::HttpExchange(port, request);
}

// One response read from `fd` (headers, then Content-Length bytes unless
// `head`), with a 10 s read timeout; what arrived if the server closed first.
std::string ReadResponse(int fd, bool head = false) {
  timeval tv{10, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  std::string out;
  char c;
  while (out.find("\r\n\r\n") == std::string::npos && ::recv(fd, &c, 1, 0) == 1) out += c;
  const size_t at = out.find("Content-Length: ");
  size_t length = 0;
  if (!head && at != std::string::npos) length = std::stoul(out.substr(at + 16));
  std::string body(length, '\0');
  size_t got = 0;
  while (got < length) {
    const ssize_t n = ::recv(fd, body.data() + got, length - got, 0);
    if (n <= 0) break;
    got += static_cast<size_t>(n);
  }
  return out + body.substr(0, got);
}

constexpr char kGet[] = "GET /metrics HTTP/1.1\r\nHost: x\r\nAccept: */*\r\n\r\n";
constexpr char kGetClose[] = "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";

class HttpServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<MetricsHttpServer>> s = MetricsHttpServer::Start(
        "127.0.0.1:0", [] { return std::string("up 1\n"); }, absl::Seconds(1));
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = *std::move(s);
    ASSERT_GT(server_->port(), 0);
    EXPECT_EQ(server_->url(), absl::StrCat("http://127.0.0.1:", server_->port(), "/metrics"));
  }
  std::unique_ptr<MetricsHttpServer> server_;
};

TEST_F(HttpServerTest, ServesMetrics) {
  const std::string r = Exchange(server_->port(), kGetClose);
  EXPECT_EQ(r.rfind("HTTP/1.1 200 OK\r\n", 0), 0u) << r;
  EXPECT_NE(r.find("Content-Type: text/plain; version=0.0.4"), std::string::npos) << r;
  EXPECT_NE(r.find("Content-Length: 5\r\n"), std::string::npos) << r;
  EXPECT_EQ(r.substr(r.size() - 9), "\r\n\r\nup 1\n") << r;
  // A query string does not change the path; HTTP/1.0 closes after the answer.
  EXPECT_EQ(Exchange(server_->port(), "GET /metrics?x=1 HTTP/1.0\r\n\r\n").rfind("HTTP/1.", 0), 0u);
  EXPECT_NE(Exchange(server_->port(), "GET /metrics?x=1 HTTP/1.0\r\n\r\n").find(" 200 OK"),
            std::string::npos);
}

TEST_F(HttpServerTest, HeadAnswersHeadersWithoutBody) {
  const std::string r =
      Exchange(server_->port(), "HEAD /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  EXPECT_EQ(r.rfind("HTTP/1.1 200 OK\r\n", 0), 0u) << r;
  EXPECT_NE(r.find("Content-Type: text/plain; version=0.0.4"), std::string::npos) << r;
  EXPECT_NE(r.find("Content-Length: 5\r\n"), std::string::npos) << r;
  EXPECT_EQ(r.substr(r.size() - 4), "\r\n\r\n") << "HEAD sent a body: " << r;
}

TEST_F(HttpServerTest, KeepsTheConnectionForTheNextScrape) {
  const int fd = Connect(server_->port());
  ASSERT_GE(fd, 0);
  for (int i = 0; i < 3; ++i) {
    ASSERT_GT(::send(fd, kGet, sizeof(kGet) - 1, MSG_NOSIGNAL), 0);
    const std::string r = ReadResponse(fd);
    EXPECT_EQ(r.rfind("HTTP/1.1 200 OK\r\n", 0), 0u) << i << ": " << r;
    EXPECT_EQ(r.substr(r.size() - 5), "up 1\n") << r;
  }
  ::close(fd);
}

TEST_F(HttpServerTest, OtherPathsMethodsAndGarbage) {
  EXPECT_EQ(Exchange(server_->port(), "GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                .rfind("HTTP/1.1 404", 0),
            0u);
  EXPECT_EQ(
      Exchange(server_->port(), "GET /metricsx HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
          .rfind("HTTP/1.1 404", 0),
      0u);
  const std::string post = Exchange(server_->port(),
                                    "POST /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                                    "Content-Length: 3\r\n\r\nabc");
  EXPECT_EQ(post.rfind("HTTP/1.1 405", 0), 0u) << post;
  EXPECT_NE(post.find("Allow: GET, HEAD\r\n"), std::string::npos) << post;
  // A request line that is not HTTP: a 400, or the connection closed.
  const std::string garbage = Exchange(server_->port(), "hello\r\n\r\n");
  EXPECT_TRUE(garbage.empty() || garbage.rfind("HTTP/1.1 400", 0) == 0) << garbage;
  const std::string huge = Exchange(server_->port(), std::string(100000, 'a'));
  EXPECT_EQ(huge.rfind("HTTP/1.1 4", 0), 0u) << huge.substr(0, 200);
}

// Idle connections hold no thread: a scrape is answered at once while many
// clients sit connected without sending anything.
TEST_F(HttpServerTest, IdleConnectionsDoNotDelayAScrape) {
  std::vector<int> idle;
  for (int i = 0; i < 16; ++i) {
    idle.push_back(Connect(server_->port()));
    ASSERT_GE(idle.back(), 0);
  }
  absl::SleepFor(absl::Milliseconds(50));  // all accepted by now
  const absl::Time start = absl::Now();
  const std::string r = Exchange(server_->port(), kGetClose);
  const absl::Duration took = absl::Now() - start;
  EXPECT_EQ(r.rfind("HTTP/1.1 200", 0), 0u) << r;
  EXPECT_LT(took, absl::Seconds(1)) << "16 idle connections held up the scrape";
  std::printf("scrape with 16 idle connections open: %s\n", absl::FormatDuration(took).c_str());
  for (const int fd : idle) ::close(fd);
}

TEST_F(HttpServerTest, IdleClientIsDroppedAfterTheTimeout) {
  const int fd = Connect(server_->port());
  ASSERT_GE(fd, 0);
  timeval tv{10, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  const absl::Time start = absl::Now();
  char c;
  EXPECT_LE(::recv(fd, &c, 1, 0), 0);  // the server closes it (or resets)
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  ::close(fd);
}

TEST_F(HttpServerTest, StopsWhileAClientIsConnected) {
  const int stuck = Connect(server_->port());
  ASSERT_GE(stuck, 0);
  absl::SleepFor(absl::Milliseconds(50));
  const int port = server_->port();
  server_->Stop();
  server_->Stop();  // idempotent
  server_.reset();
  ::close(stuck);
  EXPECT_LT(Connect(port), 0) << "still listening after Stop";
}

// A client that asks for a large body and never reads it fills the socket
// buffers; the server neither blocks on it nor lets it delay Stop.
TEST(HttpServerStuckReaderTest, NeitherOtherScrapesNorStopWaitForIt) {
  const std::string big(64 << 20, 'x');
  absl::StatusOr<std::unique_ptr<MetricsHttpServer>> s = MetricsHttpServer::Start(
      "127.0.0.1:0", [&big] { return big; }, absl::Seconds(30));
  ASSERT_TRUE(s.ok()) << s.status();
  std::unique_ptr<MetricsHttpServer> server = *std::move(s);
  std::vector<int> stuck;
  for (unsigned i = 0; i < MetricsHttpServer::kThreads + 1; ++i) {
    stuck.push_back(Connect(server->port()));
    ASSERT_GE(stuck.back(), 0);
    ASSERT_GT(::send(stuck.back(), kGet, sizeof(kGet) - 1, MSG_NOSIGNAL), 0);
  }
  absl::SleepFor(absl::Milliseconds(500));  // their sockets are full by now
  const absl::Time scrape = absl::Now();
  const int fd = Connect(server->port());
  ASSERT_GE(fd, 0);
  ASSERT_GT(::send(fd, kGet, sizeof(kGet) - 1, MSG_NOSIGNAL), 0);
  const std::string r = ReadResponse(fd);
  EXPECT_EQ(r.rfind("HTTP/1.1 200 OK\r\n", 0), 0u) << r.substr(0, 200);
  EXPECT_TRUE(r.size() > big.size() && r.compare(r.size() - big.size(), big.size(), big) == 0)
      << "got " << r.size() << " bytes";
  EXPECT_LT(absl::Now() - scrape, absl::Seconds(10));
  ::close(fd);
  const absl::Time stop = absl::Now();
  server->Stop();
  EXPECT_LT(absl::Now() - stop, absl::Seconds(2)) << "Stop waited for clients that do not read";
  for (const int c : stuck) ::close(c);
}

TEST(HttpServerStartTest, ServesIpv6Loopback) {
  absl::StatusOr<std::unique_ptr<MetricsHttpServer>> s =
      MetricsHttpServer::Start("[::1]:0", [] { return std::string("up 1\n"); });
  if (!s.ok() && absl::IsUnavailable(s.status())) GTEST_SKIP() << "no ::1 here: " << s.status();
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ((*s)->url(), absl::StrCat("http://[::1]:", (*s)->port(), "/metrics"));
  const int fd = ::socket(AF_INET6, SOCK_STREAM, 0);
  sockaddr_in6 addr{};
  addr.sin6_family = AF_INET6;
  addr.sin6_port = htons(static_cast<uint16_t>((*s)->port()));
  addr.sin6_addr = in6addr_loopback;
  ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_GT(::send(fd, kGet, sizeof(kGet) - 1, MSG_NOSIGNAL), 0);
  const std::string r = ReadResponse(fd);
  EXPECT_EQ(r.rfind("HTTP/1.1 200 OK\r\n", 0), 0u) << r;
  ::close(fd);
}

TEST(HttpServerStartTest, PortInUseAndBadAddressNameTheAddress) {
  absl::StatusOr<std::unique_ptr<MetricsHttpServer>> first =
      MetricsHttpServer::Start("127.0.0.1:0", [] { return std::string(); });
  ASSERT_TRUE(first.ok()) << first.status();
  const std::string taken = absl::StrCat("127.0.0.1:", (*first)->port());
  absl::StatusOr<std::unique_ptr<MetricsHttpServer>> second =
      MetricsHttpServer::Start(taken, [] { return std::string(); });
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(second.status().message().find(taken), std::string::npos) << second.status();
  EXPECT_NE(second.status().message().find("in use"), std::string::npos) << second.status();

  absl::StatusOr<std::unique_ptr<MetricsHttpServer>> bad =
      MetricsHttpServer::Start("127.0.0.1:http", [] { return std::string(); });
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  absl::StatusOr<std::unique_ptr<MetricsHttpServer>> not_local =
      MetricsHttpServer::Start("192.0.2.1:0", [] { return std::string(); });
  EXPECT_FALSE(not_local.ok());
  EXPECT_NE(not_local.status().message().find("192.0.2.1:0"), std::string::npos)
      << not_local.status();
}

}  // namespace
}  // namespace kvhost
