// What `grpcurl -plaintext -unix <socket> list` and `describe
// kvhost.v1.PoolService` do, against a real kvhostd: server reflection
// (grpc.reflection.v1alpha) lists the services and serves descriptors that
// build into a usable pool; grpc.health.v1 answers SERVING.
#include <grpcpp/grpcpp.h>
#include <stdlib.h>

#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "daemon_fixture.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/descriptor.pb.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpc/reflection/v1alpha/reflection.grpc.pb.h"
#include "gtest/gtest.h"

namespace kvhost {
namespace {

using ::grpc::reflection::v1alpha::ServerReflection;
using ::grpc::reflection::v1alpha::ServerReflectionRequest;
using ::grpc::reflection::v1alpha::ServerReflectionResponse;
using ::kvhost::testing::TestDaemon;

// gRPC polls an idle client channel only from its backup poller (every 5 s by
// default), and kvhostd's graceful shutdown waits until our idle channels have
// seen its GOAWAY; poll often so each test's daemon stops at once.
[[maybe_unused]] const bool kFastBackupPoller = [] {
  ::setenv("GRPC_CLIENT_CHANNEL_BACKUP_POLL_INTERVAL_MS", "20", /*overwrite=*/0);
  return true;
}();

class ReflectionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<TestDaemon>> d = TestDaemon::Start(KVHOSTD_PATH);
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = *std::move(d);
    channel_ = grpc::CreateChannel(daemon_->address(), grpc::InsecureChannelCredentials());
    ASSERT_NE(channel_, nullptr);
  }
  void TearDown() override {
    if (daemon_ != nullptr && HasFailure()) {
      std::fprintf(stderr, "--- kvhostd log ---\n%s\n", daemon_->Log().c_str());
    }
  }

  // One reflection stream, as grpcurl opens: a request, its response.
  class Stream {
   public:
    explicit Stream(ServerReflection::Stub* stub) {
      context_.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
      stream_ = stub->ServerReflectionInfo(&context_);
    }
    bool Ask(const ServerReflectionRequest& request, ServerReflectionResponse* response) {
      return stream_->Write(request) && stream_->Read(response);
    }
    grpc::Status Close() {
      stream_->WritesDone();
      return stream_->Finish();
    }

   private:
    grpc::ClientContext context_;
    std::unique_ptr<grpc::ClientReaderWriter<ServerReflectionRequest, ServerReflectionResponse>>
        stream_;
  };

  // The files of a file_descriptor_response, built into `pool` (dependencies
  // first, as the server sends them or in any order we can resolve).
  static void BuildFiles(const ServerReflectionResponse& response,
                         google::protobuf::DescriptorPool* pool,
                         std::vector<google::protobuf::FileDescriptorProto>* files) {
    ASSERT_TRUE(response.has_file_descriptor_response())
        << "not a file_descriptor_response: " << response.DebugString();
    std::vector<google::protobuf::FileDescriptorProto> pending;
    for (const std::string& bytes : response.file_descriptor_response().file_descriptor_proto()) {
      google::protobuf::FileDescriptorProto file;
      ASSERT_TRUE(file.ParseFromString(bytes)) << "a file_descriptor_proto does not parse";
      files->push_back(file);
      pending.push_back(file);
    }
    // Build in dependency order.
    while (!pending.empty()) {
      bool progress = false;
      for (auto it = pending.begin(); it != pending.end();) {
        bool ready = true;
        for (const std::string& dep : it->dependency()) {
          if (pool->FindFileByName(dep) == nullptr) ready = false;
        }
        if (ready) {
          ASSERT_NE(pool->BuildFile(*it), nullptr) << "cannot build " << it->name();
          it = pending.erase(it);
          progress = true;
        } else {
          ++it;
        }
      }
      ASSERT_TRUE(progress) << "unresolvable dependencies among the returned files";
    }
  }

  std::unique_ptr<TestDaemon> daemon_;
  std::shared_ptr<grpc::Channel> channel_;
};

TEST_F(ReflectionTest, ListServices) {
  auto stub = ServerReflection::NewStub(channel_);
  Stream stream(stub.get());
  ServerReflectionRequest request;
  request.set_list_services("*");
  ServerReflectionResponse response;
  ASSERT_TRUE(stream.Ask(request, &response));
  ASSERT_TRUE(response.has_list_services_response()) << response.DebugString();
  std::set<std::string> names;
  for (const auto& service : response.list_services_response().service()) {
    names.insert(service.name());
  }
  for (const char* want :
       {"kvhost.v1.PoolService", "kvhost.v1.TransferService", "kvhost.v1.DaemonService",
        "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}) {
    EXPECT_TRUE(names.count(want)) << want << " not listed; got: " << absl::StrJoin(names, ", ");
  }
  EXPECT_TRUE(stream.Close().ok());
}

TEST_F(ReflectionTest, DescribePoolServiceAndTransferService) {
  auto stub = ServerReflection::NewStub(channel_);
  Stream stream(stub.get());
  google::protobuf::DescriptorPool pool;

  ServerReflectionRequest request;
  request.set_file_containing_symbol("kvhost.v1.PoolService");
  ServerReflectionResponse response;
  ASSERT_TRUE(stream.Ask(request, &response));
  std::vector<google::protobuf::FileDescriptorProto> files;
  BuildFiles(response, &pool, &files);
  if (HasFatalFailure()) return;

  // The raw FileDescriptorProto holds service PoolService with method Alloc.
  const google::protobuf::ServiceDescriptorProto* raw = nullptr;
  for (const auto& file : files) {
    for (const auto& service : file.service()) {
      if (file.package() == "kvhost.v1" && service.name() == "PoolService") raw = &service;
    }
  }
  ASSERT_NE(raw, nullptr) << "no file declares kvhost.v1.PoolService";
  bool has_alloc = false;
  for (const auto& method : raw->method()) {
    if (method.name() == "Alloc") {
      has_alloc = true;
      EXPECT_EQ(method.input_type(), ".kvhost.v1.AllocRequest");
      EXPECT_EQ(method.output_type(), ".kvhost.v1.AllocResponse");
    }
  }
  EXPECT_TRUE(has_alloc);

  // And it builds into a descriptor pool usable like grpcurl's.
  const google::protobuf::ServiceDescriptor* service =
      pool.FindServiceByName("kvhost.v1.PoolService");
  ASSERT_NE(service, nullptr);
  for (const char* method :
       {"CreatePool", "GetPool", "ListPools", "DeletePool", "Alloc", "Free", "GetPageBufferMeta"}) {
    EXPECT_NE(service->FindMethodByName(method), nullptr) << method;
  }
  const google::protobuf::Descriptor* spec = pool.FindMessageTypeByName("kvhost.v1.PoolSpec");
  ASSERT_NE(spec, nullptr);
  EXPECT_NE(spec->FindFieldByName("page_size"), nullptr);
  EXPECT_NE(pool.FindEnumTypeByName("kvhost.v1.Layout"), nullptr);

  // TransferService, on the same stream.
  request.set_file_containing_symbol("kvhost.v1.TransferService");
  ASSERT_TRUE(stream.Ask(request, &response));
  files.clear();
  google::protobuf::DescriptorPool pool2;
  BuildFiles(response, &pool2, &files);
  if (HasFatalFailure()) return;
  const google::protobuf::ServiceDescriptor* transfers =
      pool2.FindServiceByName("kvhost.v1.TransferService");
  ASSERT_NE(transfers, nullptr);
  for (const char* method : {"AttachDevice", "DetachDevice", "Backup", "Load", "WaitTransfer"}) {
    EXPECT_NE(transfers->FindMethodByName(method), nullptr) << method;
  }

  // A method symbol resolves too; an unknown symbol is NOT_FOUND.
  request.set_file_containing_symbol("kvhost.v1.PoolService.Alloc");
  ASSERT_TRUE(stream.Ask(request, &response));
  EXPECT_TRUE(response.has_file_descriptor_response()) << response.DebugString();
  request.set_file_containing_symbol("kvhost.v1.NoSuchService");
  ASSERT_TRUE(stream.Ask(request, &response));
  ASSERT_TRUE(response.has_error_response()) << response.DebugString();
  EXPECT_EQ(response.error_response().error_code(), static_cast<int>(grpc::StatusCode::NOT_FOUND));

  EXPECT_TRUE(stream.Close().ok());
}

TEST_F(ReflectionTest, HealthCheckIsServing) {
  auto health = grpc::health::v1::Health::NewStub(channel_);
  grpc::health::v1::HealthCheckRequest request;
  grpc::health::v1::HealthCheckResponse response;
  {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    grpc::Status s = health->Check(&context, request, &response);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(response.status(), grpc::health::v1::HealthCheckResponse::SERVING);
  }
  for (const char* service :
       {"kvhost.v1.PoolService", "kvhost.v1.TransferService", "kvhost.v1.DaemonService"}) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    request.set_service(service);
    grpc::Status s = health->Check(&context, request, &response);
    ASSERT_TRUE(s.ok()) << service << ": " << s.error_message();
    EXPECT_EQ(response.status(), grpc::health::v1::HealthCheckResponse::SERVING) << service;
  }
  {  // An unknown service is NOT_FOUND (grpc.health.v1 semantics).
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    request.set_service("no.such.Service");
    grpc::Status s = health->Check(&context, request, &response);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND) << s.error_message();
  }
  absl::StatusOr<std::string> via_client = daemon_->client().Health();
  ASSERT_TRUE(via_client.ok()) << via_client.status();
  EXPECT_EQ(*via_client, "SERVING");
}

}  // namespace
}  // namespace kvhost
