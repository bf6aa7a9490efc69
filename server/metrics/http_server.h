// MetricsHttpServer: the smallest HTTP/1.1 server a Prometheus scrape needs.
//
// One thread accepts connections and serves them one at a time on blocking
// sockets: `GET /metrics` answers 200 with the body `render` returns (content
// type text/plain; version=0.0.4), other paths 404, other methods 405, a
// malformed request 400. Every response closes its connection. Reading the
// request and writing the response share one deadline (`io_timeout`), so a
// client that sends nothing or reads nothing delays other scrapes by at most
// that, and never hangs the server or its Stop().
//
// Thread safety: Stop may be called from any thread, more than once; `render`
// runs on the server's thread and must stay callable until Stop returns.
#ifndef KVHOST_SERVER_METRICS_HTTP_SERVER_H_
#define KVHOST_SERVER_METRICS_HTTP_SERVER_H_

#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace kvhost {

class MetricsHttpServer {
 public:
  // Listens on `address`: "host:port", ":port" (every IPv4 interface) or
  // "[v6 address]:port"; port 0 picks a free port (see port()). Errors name
  // the address: INVALID_ARGUMENT for a malformed one, UNAVAILABLE when it
  // cannot be bound (in use, not local, no permission).
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(
      const std::string& address, std::function<std::string()> render,
      absl::Duration io_timeout = absl::Seconds(5));
  ~MetricsHttpServer();

  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  // Stops accepting, ends the connection being served, joins the thread and
  // closes the socket.
  void Stop();

  // The port bound (port 0 resolved).
  int port() const { return port_; }
  // The scrape URL, e.g. "http://127.0.0.1:9464/metrics".
  const std::string& url() const { return url_; }

 private:
  MetricsHttpServer() = default;
  void Run();
  void Serve(int fd);

  std::function<std::string()> render_;
  absl::Duration io_timeout_;
  int listen_fd_ = -1;
  int wake_fd_ = -1;  // eventfd: readable once Stop is called
  int port_ = 0;
  std::string url_;
  std::thread thread_;
  bool stopped_ = false;
};

// Parses "host:port", ":port" or "[v6]:port" into host (without brackets;
// empty for ":port") and port; INVALID_ARGUMENT naming `address` otherwise.
absl::Status ParseHostPort(const std::string& address, std::string* host, int* port);

}  // namespace kvhost

#endif  // KVHOST_SERVER_METRICS_HTTP_SERVER_H_
