// InProcessServer: a gRPC server in the test process that serves the
// services it is given to channels of this process
// (grpc::Server::InProcessChannel), so that a service's unit test drives it
// through real calls (metadata, reactors, streams, status codes) without a
// kvhostd process (storage_service_test, daemon_service_test); optionally
// on an address too ("unix:///dir/grpc.sock"), for a kvhost::Client, which
// connects by address (session_test, deposit_test).
//
// Header only, for test binaries. The services must outlive the server; its
// destructor shuts it down (calls still open get a second, then are
// cancelled) and waits.
#ifndef KVHOST_TESTS_IN_PROCESS_SERVER_H_
#define KVHOST_TESTS_IN_PROCESS_SERVER_H_

#include <grpcpp/grpcpp.h>

#include "absl/status/status.h"

#include <chrono>
#include <initializer_list>
#include <memory>
#include <string>

namespace kvhost::testing {

class InProcessServer {
 public:
  // `listen`: an address to listen on too, plaintext ("": none).
  explicit InProcessServer(std::initializer_list<grpc::Service*> services,
                           const std::string& listen = "") {
    grpc::ServerBuilder builder;
    for (grpc::Service* service : services) builder.RegisterService(service);
    if (!listen.empty()) builder.AddListeningPort(listen, grpc::InsecureServerCredentials());
    server_ = builder.BuildAndStart();
  }
  ~InProcessServer() {
    if (server_ == nullptr) return;
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
    server_->Wait();
  }
  InProcessServer(const InProcessServer&) = delete;
  InProcessServer& operator=(const InProcessServer&) = delete;

  // Whether the server started (BuildAndStart may fail).
  bool ok() const { return server_ != nullptr; }
  // A new channel to the server. REQUIRES: ok().
  std::shared_ptr<grpc::Channel> Channel() const {
    return server_->InProcessChannel(grpc::ChannelArguments());
  }

 private:
  std::unique_ptr<grpc::Server> server_;
};

// A call's status as absl's (the codes are the same numbers), so that the
// tests' matchers on absl::Status read it.
inline absl::Status AbslStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

// A client context with gRPC metadata `key`: `value` when `value` is not
// empty (kvhost-token, kvhost-session), and a deadline of `seconds`.
inline std::unique_ptr<grpc::ClientContext> ContextWith(const std::string& key = "",
                                                        const std::string& value = "",
                                                        int seconds = 30) {
  auto context = std::make_unique<grpc::ClientContext>();
  if (!key.empty() && !value.empty()) context->AddMetadata(key, value);
  context->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(seconds));
  return context;
}

}  // namespace kvhost::testing

#endif  // KVHOST_TESTS_IN_PROCESS_SERVER_H_
