#include "server/metrics/http_server.h"

#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "server/metrics/metrics.h"

namespace kvhost {
namespace {

// A scrape request is a request line and a few headers; anything longer is
// not a scraper.
constexpr size_t kMaxRequestBytes = 8192;

enum class Wait { kReady, kTimeout, kStop };

// Waits until `fd` is ready for `events`, the deadline passes or Stop wakes us.
Wait WaitFor(int fd, short events, int wake_fd, absl::Time deadline) {
  for (;;) {
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) return Wait::kTimeout;
    pollfd fds[2] = {{fd, events, 0}, {wake_fd, POLLIN, 0}};
    const int ms = static_cast<int>(absl::ToInt64Milliseconds(left)) + 1;
    const int n = ::poll(fds, 2, ms);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return Wait::kTimeout;
    if (fds[1].revents != 0) return Wait::kStop;
    if (fds[0].revents != 0) return Wait::kReady;
  }
}

std::string Response(int code, const char* reason, const std::string& content_type,
                     const std::string& body, const char* extra_headers = "") {
  return absl::StrCat("HTTP/1.1 ", code, " ", reason, "\r\nContent-Type: ", content_type,
                      "\r\nContent-Length: ", body.size(), "\r\n", extra_headers,
                      "Connection: close\r\n\r\n", body);
}

}  // namespace

absl::Status ParseHostPort(const std::string& address, std::string* host, int* port) {
  const auto bad = [&address](const char* why) {
    return absl::InvalidArgumentError(absl::StrCat("--metrics-listen '", address, "': ", why,
                                                   " (want host:port, :port or [v6]:port)"));
  };
  std::string port_text;
  if (absl::StartsWith(address, "[")) {
    const size_t close = address.find(']');
    if (close == std::string::npos || close + 1 >= address.size() || address[close + 1] != ':') {
      return bad("malformed [v6]:port");
    }
    *host = address.substr(1, close - 1);
    port_text = address.substr(close + 2);
    if (host->empty()) return bad("empty IPv6 address");
  } else {
    const size_t colon = address.rfind(':');
    if (colon == std::string::npos) return bad("no port");
    *host = address.substr(0, colon);
    port_text = address.substr(colon + 1);
    if (host->find(':') != std::string::npos) return bad("an IPv6 address needs brackets");
  }
  int value = -1;
  if (port_text.empty() || port_text.size() > 5 ||
      !std::all_of(port_text.begin(), port_text.end(), absl::ascii_isdigit) ||
      !absl::SimpleAtoi(port_text, &value) || value > 65535) {
    return bad("port is not a number in [0, 65535]");
  }
  *port = value;
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const std::string& address, std::function<std::string()> render, absl::Duration io_timeout) {
  std::string host;
  int port = 0;
  if (absl::Status s = ParseHostPort(address, &host, &port); !s.ok()) return s;
  addrinfo hints{};
  hints.ai_family = host.empty() ? AF_INET : AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string port_text = std::to_string(port);
  if (const int rc =
          ::getaddrinfo(host.empty() ? nullptr : host.c_str(), port_text.c_str(), &hints, &found);
      rc != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--metrics-listen '", address, "': cannot resolve '", host, "': ", ::gai_strerror(rc)));
  }
  std::unique_ptr<MetricsHttpServer> server(new MetricsHttpServer());
  std::string error = "no address";
  for (addrinfo* ai = found; ai != nullptr; ai = ai->ai_next) {
    const int fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) {
      error = std::strerror(errno);
      continue;
    }
    const int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd, ai->ai_addr, ai->ai_addrlen) != 0 || ::listen(fd, 16) != 0) {
      error = std::strerror(errno);
      ::close(fd);
      continue;
    }
    server->listen_fd_ = fd;
    break;
  }
  ::freeaddrinfo(found);
  if (server->listen_fd_ < 0) {
    return absl::UnavailableError(
        absl::StrCat("--metrics-listen: cannot listen on ", address, ": ", error));
  }
  sockaddr_storage bound{};
  socklen_t len = sizeof(bound);
  ::getsockname(server->listen_fd_, reinterpret_cast<sockaddr*>(&bound), &len);
  server->port_ = bound.ss_family == AF_INET6
                      ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
                      : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  const std::string shown_host = host.empty() ? "0.0.0.0" : host;
  server->url_ = absl::StrCat(
      "http://",
      absl::StrContains(shown_host, ':') ? absl::StrCat("[", shown_host, "]") : shown_host, ":",
      server->port_, "/metrics");
  server->wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (server->wake_fd_ < 0) {
    return absl::InternalError(absl::StrCat("--metrics-listen: eventfd: ", std::strerror(errno)));
  }
  server->render_ = std::move(render);
  server->io_timeout_ = io_timeout;
  server->thread_ = std::thread([s = server.get()] { s->Run(); });
  return server;
}

MetricsHttpServer::~MetricsHttpServer() {
  Stop();
  if (listen_fd_ >= 0) ::close(listen_fd_);
  if (wake_fd_ >= 0) ::close(wake_fd_);
}

void MetricsHttpServer::Stop() {
  if (stopped_) return;
  stopped_ = true;
  if (thread_.joinable()) {
    const uint64_t one = 1;
    while (::write(wake_fd_, &one, sizeof(one)) < 0 && errno == EINTR) {
    }
    thread_.join();
  }
}

void MetricsHttpServer::Run() {
  for (;;) {
    if (WaitFor(listen_fd_, POLLIN, wake_fd_, absl::InfiniteFuture()) == Wait::kStop) return;
    const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) {
      // EMFILE and friends: back off instead of spinning on a readable socket.
      if (errno != EINTR && errno != ECONNABORTED && errno != EAGAIN) {
        if (WaitFor(wake_fd_, POLLIN, wake_fd_, absl::Now() + absl::Milliseconds(100)) ==
            Wait::kStop) {
          return;
        }
      }
      continue;
    }
    Serve(fd);
    ::close(fd);
  }
}

void MetricsHttpServer::Serve(int fd) {
  const absl::Time deadline = absl::Now() + io_timeout_;
  std::string request;
  char buf[1024];
  size_t end = std::string::npos;
  while (end == std::string::npos) {
    if (request.size() >= kMaxRequestBytes) break;
    if (WaitFor(fd, POLLIN, wake_fd_, deadline) != Wait::kReady) return;
    const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (n <= 0) return;  // the client closed or failed before a whole request
    request.append(buf, static_cast<size_t>(n));
    end = request.find("\r\n\r\n");
    if (end == std::string::npos) end = request.find("\n\n");
  }

  std::string response;
  const size_t line_end = request.find_first_of("\r\n");
  const std::string line = request.substr(0, line_end);
  const size_t sp1 = line.find(' ');
  const size_t sp2 = sp1 == std::string::npos ? std::string::npos : line.find(' ', sp1 + 1);
  if (end == std::string::npos) {
    response =
        Response(431, "Request Header Fields Too Large", "text/plain", "request too large\n");
  } else if (sp2 == std::string::npos || !absl::StartsWith(line.substr(sp2 + 1), "HTTP/1.")) {
    response = Response(400, "Bad Request", "text/plain", "malformed request line\n");
  } else {
    const std::string method = line.substr(0, sp1);
    std::string target = line.substr(sp1 + 1, sp2 - sp1 - 1);
    target = target.substr(0, target.find('?'));
    if (method != "GET") {
      response = Response(405, "Method Not Allowed", "text/plain", "only GET is served\n",
                          "Allow: GET\r\n");
    } else if (target != "/metrics") {
      response = Response(404, "Not Found", "text/plain", "metrics are at /metrics\n");
    } else {
      response = Response(200, "OK", kPrometheusContentType, render_());
    }
  }

  size_t sent = 0;
  while (sent < response.size()) {
    if (WaitFor(fd, POLLOUT, wake_fd_, deadline) != Wait::kReady) return;
    const ssize_t n = ::send(fd, response.data() + sent, response.size() - sent, MSG_NOSIGNAL);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (n <= 0) return;
    sent += static_cast<size_t>(n);
  }
  // Half-close, then read what the client still sends until it closes (or
  // the deadline): closing with unread bytes would send a reset that can
  // discard the response before the client reads it.
  ::shutdown(fd, SHUT_WR);
  while (WaitFor(fd, POLLIN, wake_fd_, deadline) == Wait::kReady) {
    const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n == 0 || (n < 0 && errno != EINTR && errno != EAGAIN)) return;
  }
}

}  // namespace kvhost
