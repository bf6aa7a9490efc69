// MetricsHttpServer: the Prometheus scrape endpoint, on GNU libmicrohttpd
// (Debian's libmicrohttpd-dev).
//
// `GET /metrics` answers 200 with the body `render` returns (content type
// text/plain; version=0.0.4), `HEAD /metrics` the same headers and no body;
// other paths 404, other methods on /metrics 405. libmicrohttpd parses the
// requests (malformed ones get its 4xx answers) and keeps connections alive
// across scrapes.
//
// Threads: kThreads threads, each waiting in epoll without a timeout while
// nothing happens, so an idle endpoint costs no CPU. Sockets are non-blocking:
// a client that sends nothing or reads nothing holds only its connection,
// never a thread, and is dropped after `idle_timeout` without progress; at
// most kMaxConnections connections are open at once (more are refused).
// Stop closes every connection at once, whatever its clients do.
//
// Thread safety: Stop may be called from any thread, more than once; `render`
// runs on the server's threads, possibly several at once, and must stay
// callable until Stop returns.
#ifndef KVHOST_SERVER_METRICS_HTTP_SERVER_H_
#define KVHOST_SERVER_METRICS_HTTP_SERVER_H_

#include <functional>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

struct MHD_Daemon;

namespace kvhost {

class MetricsHttpServer {
 public:
  // Scrapes are rare (one per scraper every few seconds) and a render takes
  // well under a millisecond; a few threads let a slow render (a busy pool
  // registry) not hold up the others.
  static constexpr unsigned kThreads = 4;
  static constexpr unsigned kMaxConnections = 256;

  // Listens on `address`: "host:port", ":port" (every IPv4 interface) or
  // "[v6 address]:port"; port 0 picks a free port (see port()). Errors name
  // the address: INVALID_ARGUMENT for a malformed one, UNAVAILABLE when it
  // cannot be bound (in use, not local, no permission). `idle_timeout` is
  // rounded up to whole seconds (libmicrohttpd's unit).
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(
      const std::string& address, std::function<std::string()> render,
      absl::Duration idle_timeout = absl::Seconds(10));
  ~MetricsHttpServer();

  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  // Closes the listening socket and every connection, and joins the threads.
  void Stop();

  // The port bound (port 0 resolved).
  int port() const { return port_; }
  // The scrape URL, e.g. "http://127.0.0.1:9464/metrics".
  const std::string& url() const { return url_; }

 private:
  MetricsHttpServer() = default;

  std::function<std::string()> render_;
  int port_ = 0;
  std::string url_;
  absl::Mutex mu_;
  MHD_Daemon* daemon_ ABSL_GUARDED_BY(mu_) = nullptr;
};

// Parses "host:port", ":port" or "[v6]:port" into host (without brackets;
// empty for ":port") and port; INVALID_ARGUMENT naming `address` otherwise.
absl::Status ParseHostPort(const std::string& address, std::string* host, int* port);

}  // namespace kvhost

#endif  // KVHOST_SERVER_METRICS_HTTP_SERVER_H_
