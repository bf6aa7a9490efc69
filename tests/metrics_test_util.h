// Scraping kvhostd's Prometheus endpoint (--metrics-listen) in tests: the
// port a TestDaemon logged, one GET, and the exposition parsed into series
// (name plus labels, as exposed) and their values. Used by
// metrics_integration_test and worker_death_gpu_test.
//
// Header only, for test binaries; not thread-safe.
#ifndef KVHOST_TESTS_METRICS_TEST_UTIL_H_
#define KVHOST_TESTS_METRICS_TEST_UTIL_H_

#include <map>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "daemon_fixture.h"
#include "gtest/gtest.h"
#include "http_test_util.h"

namespace kvhost::testing {

// The port from the daemon's "metrics on http://127.0.0.1:PORT/metrics" line
// (written before health says SERVING, so present once TestDaemon::Start
// returns; polled briefly all the same). 0 if not found.
inline int MetricsPort(const TestDaemon& daemon) {
  const std::string marker = "metrics on http://127.0.0.1:";
  for (int i = 0; i < 100; ++i) {
    const std::string log = daemon.Log();
    const size_t at = log.find(marker);
    if (at != std::string::npos) {
      const size_t start = at + marker.size();
      const size_t end = log.find('/', start);
      int port = 0;
      if (end != std::string::npos && absl::SimpleAtoi(log.substr(start, end - start), &port)) {
        return port;
      }
    }
    absl::SleepFor(absl::Milliseconds(50));
  }
  return 0;
}

// One HTTP/1.1 request on a connection of its own; the whole response, or
// "connect failed".
inline std::string HttpGet(int port, const std::string& path, const std::string& method = "GET") {
  return HttpExchange(
      port,
      absl::StrCat(method, " ", path,
                   " HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: */*\r\nConnection: close\r\n\r\n"));
}

// Series (name plus labels, as exposed) -> value.
using Scrape = std::map<std::string, double>;

inline Scrape ScrapeMetrics(int port, std::string* raw = nullptr) {
  const std::string response = HttpGet(port, "/metrics");
  EXPECT_TRUE(absl::StartsWith(response, "HTTP/1.1 200 OK\r\n")) << response;
  EXPECT_TRUE(absl::StrContains(response, "Content-Type: text/plain; version=0.0.4"));
  const size_t body = response.find("\r\n\r\n");
  Scrape out;
  if (body == std::string::npos) return out;
  if (raw != nullptr) *raw = response.substr(body + 4);
  for (absl::string_view line : absl::StrSplit(response.substr(body + 4), '\n')) {
    if (line.empty() || line[0] == '#') continue;
    const size_t sp = line.rfind(' ');
    double value = 0;
    EXPECT_TRUE(sp != absl::string_view::npos && absl::SimpleAtod(line.substr(sp + 1), &value))
        << line;
    out[std::string(line.substr(0, sp))] = value;
  }
  return out;
}

inline double SeriesValue(const Scrape& s, const std::string& series) {
  auto it = s.find(series);
  return it == s.end() ? 0 : it->second;
}

}  // namespace kvhost::testing

#endif  // KVHOST_TESTS_METRICS_TEST_UTIL_H_
