// Unit tests of server/metrics: the Prometheus text exposition format 0.0.4
// (HELP / TYPE lines, label escaping, cumulative histogram buckets with +Inf,
// _sum and _count) and the HTTP endpoint (status codes, content type,
// timeouts, stop).
#include "server/metrics/metrics.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "http_test_util.h"
#include "server/metrics/http_server.h"
#include "server/metrics/kvhost_metrics.h"

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

class HttpServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<MetricsHttpServer>> s = MetricsHttpServer::Start(
        "127.0.0.1:0", [] { return std::string("up 1\n"); }, absl::Milliseconds(300));
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = *std::move(s);
    ASSERT_GT(server_->port(), 0);
    EXPECT_EQ(server_->url(), absl::StrCat("http://127.0.0.1:", server_->port(), "/metrics"));
  }
  std::unique_ptr<MetricsHttpServer> server_;
};

TEST_F(HttpServerTest, ServesMetrics) {
  const std::string r =
      Exchange(server_->port(), "GET /metrics HTTP/1.1\r\nHost: x\r\nAccept: */*\r\n\r\n");
  EXPECT_EQ(r.rfind("HTTP/1.1 200 OK\r\n", 0), 0u) << r;
  EXPECT_NE(r.find("Content-Type: text/plain; version=0.0.4"), std::string::npos) << r;
  EXPECT_NE(r.find("Content-Length: 5\r\n"), std::string::npos) << r;
  EXPECT_NE(r.find("Connection: close\r\n"), std::string::npos) << r;
  EXPECT_EQ(r.substr(r.size() - 9), "\r\n\r\nup 1\n") << r;
  // A query string does not change the path.
  EXPECT_EQ(Exchange(server_->port(), "GET /metrics?x=1 HTTP/1.0\r\n\r\n").rfind("HTTP/1.1 200", 0),
            0u);
}

TEST_F(HttpServerTest, OtherPathsMethodsAndGarbage) {
  EXPECT_EQ(Exchange(server_->port(), "GET / HTTP/1.1\r\n\r\n").rfind("HTTP/1.1 404", 0), 0u);
  EXPECT_EQ(Exchange(server_->port(), "GET /metricsx HTTP/1.1\r\n\r\n").rfind("HTTP/1.1 404", 0),
            0u);
  const std::string post = Exchange(server_->port(), "POST /metrics HTTP/1.1\r\n\r\n");
  EXPECT_EQ(post.rfind("HTTP/1.1 405", 0), 0u) << post;
  EXPECT_NE(post.find("Allow: GET\r\n"), std::string::npos) << post;
  EXPECT_EQ(Exchange(server_->port(), "HEAD /metrics HTTP/1.1\r\n\r\n").rfind("HTTP/1.1 405", 0),
            0u);
  EXPECT_EQ(Exchange(server_->port(), "hello\r\n\r\n").rfind("HTTP/1.1 400", 0), 0u);
  EXPECT_EQ(Exchange(server_->port(), std::string(20000, 'a')).rfind("HTTP/1.1 431", 0), 0u);
}

TEST_F(HttpServerTest, StuckClientTimesOutAndOthersAreServed) {
  const int stuck = Connect(server_->port());  // sends nothing
  ASSERT_GE(stuck, 0);
  const absl::Time start = absl::Now();
  const std::string r = Exchange(server_->port(), "GET /metrics HTTP/1.1\r\n\r\n");
  EXPECT_EQ(r.rfind("HTTP/1.1 200", 0), 0u) << r;
  EXPECT_LT(absl::Now() - start, absl::Seconds(5)) << "the stuck client held the server";
  ::close(stuck);
}

TEST_F(HttpServerTest, StopsWhileAClientIsConnected) {
  const int stuck = Connect(server_->port());
  ASSERT_GE(stuck, 0);
  absl::SleepFor(absl::Milliseconds(50));  // the server is now reading from it
  const int port = server_->port();
  server_->Stop();
  server_->Stop();  // idempotent
  server_.reset();
  ::close(stuck);
  EXPECT_LT(Connect(port), 0) << "still listening after Stop";
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
