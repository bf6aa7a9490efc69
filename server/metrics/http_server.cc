#include "server/metrics/http_server.h"

#include <microhttpd.h>
#include <netdb.h>
#include <netinet/in.h>
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
#include "server/metrics/metrics.h"

namespace kvhost {
namespace {

// Queues a response with `body` (copied) and its content type; MHD adds
// Content-Length, and for HEAD sends the headers alone.
MHD_Result Respond(MHD_Connection* connection, unsigned status, const char* content_type,
                   const std::string& body, const char* allow = nullptr) {
  MHD_Response* response = MHD_create_response_from_buffer(
      body.size(), const_cast<char*>(body.data()), MHD_RESPMEM_MUST_COPY);
  if (response == nullptr) return MHD_NO;
  MHD_add_response_header(response, MHD_HTTP_HEADER_CONTENT_TYPE, content_type);
  if (allow != nullptr) MHD_add_response_header(response, MHD_HTTP_HEADER_ALLOW, allow);
  const MHD_Result queued = MHD_queue_response(connection, status, response);
  MHD_destroy_response(response);
  return queued;
}

// MHD_AccessHandlerCallback. MHD calls it once the headers are in, then
// for each piece of a body, then once more: answering in the last call lets
// the connection stay open for the next scrape (an answer before the request
// is read whole closes it). A body, which no scrape has, is read and dropped.
// `cls` is the server's render function.
MHD_Result Answer(void* cls, MHD_Connection* connection, const char* path, const char* method,
                  const char* /*version*/, const char* /*upload_data*/, size_t* upload_data_size,
                  void** request_state) {
  static char headers_seen;
  if (*request_state == nullptr) {
    *request_state = &headers_seen;
    return MHD_YES;
  }
  if (*upload_data_size != 0) {
    *upload_data_size = 0;
    return MHD_YES;
  }
  if (std::strcmp(path, "/metrics") != 0) {
    return Respond(connection, MHD_HTTP_NOT_FOUND, "text/plain", "metrics are at /metrics\n");
  }
  const bool head = std::strcmp(method, MHD_HTTP_METHOD_HEAD) == 0;
  if (!head && std::strcmp(method, MHD_HTTP_METHOD_GET) != 0) {
    return Respond(connection, MHD_HTTP_METHOD_NOT_ALLOWED, "text/plain",
                   "only GET and HEAD are served\n", "GET, HEAD");
  }
  // HEAD renders too: its Content-Length is the body's a GET would get.
  const auto& render = *static_cast<const std::function<std::string()>*>(cls);
  return Respond(connection, MHD_HTTP_OK, kPrometheusContentType, render());
}

// A socket bound to `address` and listening, or an error naming it.
absl::StatusOr<int> Listen(const std::string& address, const std::string& host, int port) {
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
  std::string error = "no address";
  int listening = -1;
  for (addrinfo* ai = found; ai != nullptr && listening < 0; ai = ai->ai_next) {
    const int fd =
        ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol);
    if (fd < 0) {
      error = std::strerror(errno);
      continue;
    }
    const int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (ai->ai_family == AF_INET6) ::setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &one, sizeof(one));
    if (::bind(fd, ai->ai_addr, ai->ai_addrlen) != 0 || ::listen(fd, SOMAXCONN) != 0) {
      error = std::strerror(errno);
      ::close(fd);
      continue;
    }
    listening = fd;
  }
  ::freeaddrinfo(found);
  if (listening < 0) {
    return absl::UnavailableError(
        absl::StrCat("--metrics-listen: cannot listen on ", address, ": ", error));
  }
  return listening;
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
    const std::string& address, std::function<std::string()> render, absl::Duration idle_timeout) {
  std::string host;
  int port = 0;
  if (absl::Status s = ParseHostPort(address, &host, &port); !s.ok()) return s;
  // The socket is ours, not MHD's, so that errors name their cause (MHD only
  // says it failed) and any address getaddrinfo resolves works.
  absl::StatusOr<int> fd = Listen(address, host, port);
  if (!fd.ok()) return fd.status();

  std::unique_ptr<MetricsHttpServer> server(new MetricsHttpServer());
  sockaddr_storage bound{};
  socklen_t len = sizeof(bound);
  ::getsockname(*fd, reinterpret_cast<sockaddr*>(&bound), &len);
  server->port_ = bound.ss_family == AF_INET6
                      ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
                      : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  const std::string shown_host = host.empty() ? "0.0.0.0" : host;
  server->url_ = absl::StrCat(
      "http://",
      absl::StrContains(shown_host, ':') ? absl::StrCat("[", shown_host, "]") : shown_host, ":",
      server->port_, "/metrics");
  server->render_ = std::move(render);

  const unsigned timeout_s = static_cast<unsigned>(
      std::max<int64_t>(1, absl::ToInt64Seconds(absl::Ceil(idle_timeout, absl::Seconds(1)))));
  // Error log off: MHD would write to stderr past kvhostd's logger, and the
  // errors it reports are the clients' (resets, timeouts).
  MHD_Daemon* daemon =
      MHD_start_daemon(MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_EPOLL, /*port=*/0, /*apc=*/nullptr,
                       /*apc_cls=*/nullptr, &Answer, &server->render_,          //
                       MHD_OPTION_LISTEN_SOCKET, static_cast<MHD_socket>(*fd),  //
                       MHD_OPTION_THREAD_POOL_SIZE, kThreads,                   //
                       MHD_OPTION_CONNECTION_LIMIT, kMaxConnections,            //
                       MHD_OPTION_CONNECTION_TIMEOUT, timeout_s,                //
                       MHD_OPTION_END);
  if (daemon == nullptr) {
    ::close(*fd);
    return absl::InternalError(
        absl::StrCat("--metrics-listen: libmicrohttpd did not start on ", address));
  }
  absl::MutexLock lock(&server->mu_);
  server->daemon_ = daemon;
  return server;
}

MetricsHttpServer::~MetricsHttpServer() { Stop(); }

void MetricsHttpServer::Stop() {
  absl::MutexLock lock(&mu_);
  // MHD_stop_daemon joins the threads and closes the connections and the
  // listening socket.
  if (daemon_ != nullptr) MHD_stop_daemon(daemon_);
  daemon_ = nullptr;
}

}  // namespace kvhost
