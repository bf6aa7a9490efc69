// What `grpcurl -plaintext -unix <socket> list`, `describe
// kvhost.v1.PoolService` and `grpcurl ... grpc.health.v1.Health/Check` do,
// against a real kvhostd: server reflection (grpc.reflection.v1alpha, and
// v1, which current grpcurl asks for first, answering the same) lists
// the services and serves, for every one listed, descriptors that build into
// a usable pool; Health/Check called through messages built from those
// descriptors alone (as grpcurl calls) answers SERVING.
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/support/byte_buffer.h>
#include <stdlib.h>

#include <future>
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
#include "google/protobuf/dynamic_message.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpc/reflection/v1/reflection.grpc.pb.h"
#include "grpc/reflection/v1alpha/reflection.grpc.pb.h"
#include "gtest/gtest.h"

namespace kvhost {
namespace {

using ::grpc::reflection::v1alpha::ServerReflection;
using ::grpc::reflection::v1alpha::ServerReflectionRequest;
using ::grpc::reflection::v1alpha::ServerReflectionResponse;
using ::kvhost::testing::TestDaemon;

class ReflectionTest : public ::testing::Test {
 protected:
  // One kvhostd for the suite: its tests only read (reflection, health), so
  // none sees another's traces. ctest runs the suite in one process
  // (SHARED_SUITES in tests/CMakeLists.txt), so the daemon starts once.
  static void SetUpTestSuite() {
    absl::StatusOr<std::unique_ptr<TestDaemon>> d = TestDaemon::Start(KVHOSTD_PATH);
    shared_start_ = new absl::Status(d.status());
    if (d.ok()) shared_ = d->release();
  }
  static void TearDownTestSuite() {
    delete shared_;
    shared_ = nullptr;
    delete shared_start_;
    shared_start_ = nullptr;
  }

  void SetUp() override {
    ASSERT_TRUE(shared_start_->ok()) << *shared_start_;
    daemon_ = shared_;
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

  TestDaemon* daemon_ = nullptr;  // the suite's
  std::shared_ptr<grpc::Channel> channel_;

 private:
  static inline TestDaemon* shared_ = nullptr;
  static inline absl::Status* shared_start_ = nullptr;
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
        "kvhost.v1.StorageService", "kvhost.v1.CacheService", "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection"}) {
    EXPECT_TRUE(names.count(want)) << want << " not listed; got: " << absl::StrJoin(names, ", ");
  }
  EXPECT_TRUE(stream.Close().ok());
}

// grpcurl's first steps for any call: list, then file_containing_symbol for
// the service; each listed service must resolve and build (Health
// was listed, but "Symbol not found").
TEST_F(ReflectionTest, EveryListedServiceHasItsDescriptor) {
  auto stub = ServerReflection::NewStub(channel_);
  Stream stream(stub.get());
  ServerReflectionRequest request;
  request.set_list_services("*");
  ServerReflectionResponse response;
  ASSERT_TRUE(stream.Ask(request, &response));
  ASSERT_TRUE(response.has_list_services_response()) << response.DebugString();
  std::vector<std::string> names;
  for (const auto& service : response.list_services_response().service()) {
    names.push_back(service.name());
  }
  ASSERT_GE(names.size(), 5u) << absl::StrJoin(names, ", ");
  for (const std::string& name : names) {
    SCOPED_TRACE(name);
    request.set_file_containing_symbol(name);
    ASSERT_TRUE(stream.Ask(request, &response));
    ASSERT_FALSE(response.has_error_response()) << response.error_response().error_message();
    google::protobuf::DescriptorPool pool;
    std::vector<google::protobuf::FileDescriptorProto> files;
    BuildFiles(response, &pool, &files);
    if (HasFatalFailure()) return;
    const google::protobuf::ServiceDescriptor* service = pool.FindServiceByName(name);
    ASSERT_NE(service, nullptr) << "the returned files do not declare it";
    EXPECT_GT(service->method_count(), 0);
  }
  // grpcurl's other way in: the file by name.
  request.set_file_by_filename("grpc/health/v1/health.proto");
  ASSERT_TRUE(stream.Ask(request, &response));
  EXPECT_TRUE(response.has_file_descriptor_response()) << response.DebugString();
  EXPECT_TRUE(stream.Close().ok());
}

// `grpcurl -plaintext -unix <socket> grpc.health.v1.Health/Check`: the
// request and response types come from reflection only, the call goes
// through a generic stub with serialized dynamic messages.
TEST_F(ReflectionTest, HealthCheckThroughReflectedDescriptors) {
  auto stub = ServerReflection::NewStub(channel_);
  Stream stream(stub.get());
  ServerReflectionRequest request;
  request.set_file_containing_symbol("grpc.health.v1.Health");
  ServerReflectionResponse response;
  ASSERT_TRUE(stream.Ask(request, &response));
  google::protobuf::DescriptorPool pool;
  std::vector<google::protobuf::FileDescriptorProto> files;
  BuildFiles(response, &pool, &files);
  if (HasFatalFailure()) return;
  EXPECT_TRUE(stream.Close().ok());
  const google::protobuf::ServiceDescriptor* service =
      pool.FindServiceByName("grpc.health.v1.Health");
  ASSERT_NE(service, nullptr);
  const google::protobuf::MethodDescriptor* check = service->FindMethodByName("Check");
  ASSERT_NE(check, nullptr);

  google::protobuf::DynamicMessageFactory factory(&pool);
  for (const std::string service_name : {"", "kvhost.v1.PoolService"}) {
    SCOPED_TRACE(service_name);
    std::unique_ptr<google::protobuf::Message> in(factory.GetPrototype(check->input_type())->New());
    const google::protobuf::FieldDescriptor* service_field =
        check->input_type()->FindFieldByName("service");
    ASSERT_NE(service_field, nullptr);
    in->GetReflection()->SetString(in.get(), service_field, service_name);
    const std::string bytes = in->SerializeAsString();
    grpc::Slice slice(bytes);
    grpc::ByteBuffer request_buffer(&slice, 1);
    grpc::ByteBuffer response_buffer;

    grpc::GenericStub generic(channel_);
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    std::promise<grpc::Status> done;
    generic.UnaryCall(&context, absl::StrCat("/", service->full_name(), "/", check->name()),
                      grpc::StubOptions(), &request_buffer, &response_buffer,
                      [&done](grpc::Status s) { done.set_value(std::move(s)); });
    const grpc::Status status = done.get_future().get();
    ASSERT_TRUE(status.ok()) << status.error_message();

    std::vector<grpc::Slice> slices;
    ASSERT_TRUE(response_buffer.Dump(&slices).ok());
    std::string out_bytes;
    for (const grpc::Slice& s : slices) {
      out_bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
    }
    std::unique_ptr<google::protobuf::Message> out(
        factory.GetPrototype(check->output_type())->New());
    ASSERT_TRUE(out->ParseFromString(out_bytes));
    const google::protobuf::FieldDescriptor* status_field =
        check->output_type()->FindFieldByName("status");
    ASSERT_NE(status_field, nullptr);
    const google::protobuf::EnumValueDescriptor* value =
        out->GetReflection()->GetEnum(*out, status_field);
    EXPECT_EQ(value->name(), "SERVING") << out->DebugString();
  }
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

// handoff.proto declares no service, so no listed service leads to it; a
// client still finds the handoff socket's messages by file name and by symbol.
TEST_F(ReflectionTest, DescribeHandoffMessages) {
  auto stub = ServerReflection::NewStub(channel_);
  Stream stream(stub.get());
  ServerReflectionRequest request;
  ServerReflectionResponse response;
  for (bool by_name : {true, false}) {
    SCOPED_TRACE(by_name ? "file_by_filename" : "file_containing_symbol");
    if (by_name) {
      request.set_file_by_filename("kvhost/v1/handoff.proto");
    } else {
      request.set_file_containing_symbol("kvhost.v1.HandoffRequest");
    }
    ASSERT_TRUE(stream.Ask(request, &response));
    ASSERT_FALSE(response.has_error_response()) << response.error_response().error_message();
    google::protobuf::DescriptorPool pool;
    std::vector<google::protobuf::FileDescriptorProto> files;
    BuildFiles(response, &pool, &files);
    if (HasFatalFailure()) return;
    const google::protobuf::Descriptor* handoff =
        pool.FindMessageTypeByName("kvhost.v1.HandoffRequest");
    ASSERT_NE(handoff, nullptr);
    EXPECT_EQ(handoff->file()->name(), "kvhost/v1/handoff.proto");
    EXPECT_NE(pool.FindMessageTypeByName("kvhost.v1.HandoffReply"), nullptr);
    EXPECT_NE(pool.FindMessageTypeByName("kvhost.v1.PoolRegions"), nullptr);
    EXPECT_NE(pool.FindEnumTypeByName("kvhost.v1.HandoffKind"), nullptr);
  }
  EXPECT_TRUE(stream.Close().ok());
}

// grpc.reflection.v1 (kvhostd's own, beside gRPC's v1alpha plugin) answers
// what v1alpha answers: the same services, and for each of them, a file by
// name and an extension lookup, the same descriptor files byte for byte; an
// unknown symbol is an error_response NOT_FOUND naming it, and the stream
// goes on.
TEST_F(ReflectionTest, V1AnswersAsV1alpha) {
  namespace rv1 = ::grpc::reflection::v1;
  auto alpha_stub = ServerReflection::NewStub(channel_);
  auto v1_stub = rv1::ServerReflection::NewStub(channel_);
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
  auto v1 = v1_stub->ServerReflectionInfo(&context);
  // The same request to both, v1 on one stream throughout and v1alpha on a
  // stream of its own each time (gRPC 1.51's v1alpha appends every earlier
  // reply's files to a later one on the same stream); the v1 reply converted
  // (the wire formats are one) for comparison.
  auto ask = [&](const ServerReflectionRequest& request, ServerReflectionResponse* a,
                 ServerReflectionResponse* b) {
    Stream alpha(alpha_stub.get());
    ASSERT_TRUE(alpha.Ask(request, a));
    ASSERT_TRUE(alpha.Close().ok());
    rv1::ServerReflectionRequest v1_request;
    ASSERT_TRUE(v1_request.ParseFromString(request.SerializeAsString()));
    rv1::ServerReflectionResponse v1_response;
    ASSERT_TRUE(v1->Write(v1_request) && v1->Read(&v1_response)) << "v1 stream failed";
    ASSERT_TRUE(b->ParseFromString(v1_response.SerializeAsString()));
  };
  ServerReflectionRequest request;
  ServerReflectionResponse a, b;
  request.set_list_services("*");
  ASSERT_NO_FATAL_FAILURE(ask(request, &a, &b));
  std::set<std::string> alpha_names, v1_names;
  for (const auto& service : a.list_services_response().service())
    alpha_names.insert(service.name());
  for (const auto& service : b.list_services_response().service()) v1_names.insert(service.name());
  EXPECT_EQ(v1_names, alpha_names);
  EXPECT_TRUE(v1_names.count("grpc.reflection.v1.ServerReflection"));
  for (const std::string& name : v1_names) {
    SCOPED_TRACE(name);
    request.set_file_containing_symbol(name);
    ASSERT_NO_FATAL_FAILURE(ask(request, &a, &b));
    ASSERT_TRUE(b.has_file_descriptor_response()) << b.DebugString();
    EXPECT_EQ(b.file_descriptor_response().SerializeAsString(),
              a.file_descriptor_response().SerializeAsString());
    EXPECT_EQ(b.original_request().SerializeAsString(), request.SerializeAsString());
  }
  request.set_file_by_filename("kvhost/v1/transfer.proto");
  ASSERT_NO_FATAL_FAILURE(ask(request, &a, &b));
  EXPECT_GE(b.file_descriptor_response().file_descriptor_proto_size(), 1);
  EXPECT_EQ(b.file_descriptor_response().SerializeAsString(),
            a.file_descriptor_response().SerializeAsString());
  request.set_all_extension_numbers_of_type("google.protobuf.FieldOptions");
  ASSERT_NO_FATAL_FAILURE(ask(request, &a, &b));
  EXPECT_EQ(b.all_extension_numbers_response().base_type_name(), "google.protobuf.FieldOptions");
  request.set_file_containing_symbol("kvhost.v1.NoSuchService");
  ASSERT_NO_FATAL_FAILURE(ask(request, &a, &b));
  ASSERT_TRUE(b.has_error_response()) << b.DebugString();
  EXPECT_EQ(b.error_response().error_code(), a.error_response().error_code());
  EXPECT_EQ(b.error_response().error_code(), static_cast<int>(grpc::StatusCode::NOT_FOUND));
  EXPECT_NE(b.error_response().error_message().find("kvhost.v1.NoSuchService"), std::string::npos)
      << b.error_response().error_message();
  // The stream goes on after an error.
  request.set_list_services("*");
  ASSERT_NO_FATAL_FAILURE(ask(request, &a, &b));
  EXPECT_TRUE(b.has_list_services_response());
  EXPECT_TRUE(v1->WritesDone());
  EXPECT_TRUE(v1->Finish().ok());
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
  // This daemon has no L3 tier: StorageService, every call of which would be
  // FAILED_PRECONDITION, is NOT_SERVING; the others serve.
  for (const char* service :
       {"kvhost.v1.PoolService", "kvhost.v1.TransferService", "kvhost.v1.DaemonService",
        "kvhost.v1.StorageService", "kvhost.v1.CacheService"}) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    request.set_service(service);
    grpc::Status s = health->Check(&context, request, &response);
    ASSERT_TRUE(s.ok()) << service << ": " << s.error_message();
    EXPECT_EQ(response.status(), std::string(service) == "kvhost.v1.StorageService"
                                     ? grpc::health::v1::HealthCheckResponse::NOT_SERVING
                                     : grpc::health::v1::HealthCheckResponse::SERVING)
        << service;
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
