// grpcurl_lite: the part of grpcurl that the README and docs/OPERATIONS.md
// use, for the tests that run those examples as written (grpcurl is not
// packaged in Debian). Everything it knows of the API comes from the
// daemon's server reflection, exactly as grpcurl's does, so an example that
// works here works with grpcurl too.
//
//   grpcurl_lite -plaintext -unix SOCKET [-H 'key: value']... [-d JSON] list
//   grpcurl_lite ... describe SYMBOL
//   grpcurl_lite ... SERVICE/METHOD        (unary methods)
//
// Exit codes: 0 OK; 1 the call failed (grpcurl's "ERROR:\n  Code: ...\n
// Message: ..." on stderr); 2 a usage error or a symbol reflection does not
// know.
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <cstdio>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/descriptor.pb.h"
#include "google/protobuf/descriptor_database.h"
#include "google/protobuf/dynamic_message.h"
#include "google/protobuf/util/json_util.h"
#include "grpc/reflection/v1alpha/reflection.grpc.pb.h"

namespace {

using ::grpc::reflection::v1alpha::ServerReflection;
using ::grpc::reflection::v1alpha::ServerReflectionRequest;
using ::grpc::reflection::v1alpha::ServerReflectionResponse;

int Usage(const std::string& why) {
  std::fprintf(stderr,
               "grpcurl_lite: %s\nusage: grpcurl_lite -plaintext -unix SOCKET [-H 'k: v'] "
               "[-d JSON] (list | describe SYMBOL | SERVICE/METHOD)\n",
               why.c_str());
  return 2;
}

// One reflection stream; the files it returns go into `db`.
class Reflection {
 public:
  explicit Reflection(const std::shared_ptr<grpc::Channel>& channel)
      : stub_(ServerReflection::NewStub(channel)) {
    context_.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    stream_ = stub_->ServerReflectionInfo(&context_);
  }
  ~Reflection() {
    stream_->WritesDone();
    (void)stream_->Finish();
  }

  bool Ask(const ServerReflectionRequest& request, ServerReflectionResponse* response) {
    return stream_->Write(request) && stream_->Read(response);
  }

  std::vector<std::string> Services() {
    ServerReflectionRequest request;
    request.set_list_services("*");
    ServerReflectionResponse response;
    std::vector<std::string> out;
    if (!Ask(request, &response)) return out;
    for (const auto& s : response.list_services_response().service()) out.push_back(s.name());
    return out;
  }

  // Loads the file defining `symbol` and its dependencies; false if the
  // server does not know it.
  bool LoadSymbol(const std::string& symbol) {
    ServerReflectionRequest request;
    request.set_file_containing_symbol(symbol);
    return Load(request);
  }

  google::protobuf::SimpleDescriptorDatabase& db() { return db_; }

 private:
  bool Load(const ServerReflectionRequest& request) {
    ServerReflectionResponse response;
    if (!Ask(request, &response) || !response.has_file_descriptor_response()) return false;
    for (const std::string& bytes : response.file_descriptor_response().file_descriptor_proto()) {
      google::protobuf::FileDescriptorProto file;
      if (!file.ParseFromString(bytes)) return false;
      if (!loaded_.insert(file.name()).second) continue;
      db_.Add(file);
      for (const std::string& dep : file.dependency()) {
        if (loaded_.count(dep) != 0) continue;
        ServerReflectionRequest more;
        more.set_file_by_filename(dep);
        if (!Load(more)) return false;
      }
    }
    return true;
  }

  std::unique_ptr<ServerReflection::Stub> stub_;
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReaderWriter<ServerReflectionRequest, ServerReflectionResponse>>
      stream_;
  google::protobuf::SimpleDescriptorDatabase db_;
  std::set<std::string> loaded_;
};

std::string ToString(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  std::string out;
  if (!buffer.Dump(&slices).ok()) return out;
  for (const grpc::Slice& s : slices)
    out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

int Fail(const grpc::Status& status) {
  static const char* const kCodes[] = {
      "OK",       "Canceled",       "Unknown",          "InvalidArgument",   "DeadlineExceeded",
      "NotFound", "AlreadyExists",  "PermissionDenied", "ResourceExhausted", "FailedPrecondition",
      "Aborted",  "OutOfRange",     "Unimplemented",    "Internal",          "Unavailable",
      "DataLoss", "Unauthenticated"};
  const int code = static_cast<int>(status.error_code());
  std::fprintf(stderr, "ERROR:\n  Code: %s\n  Message: %s\n",
               code >= 0 && code <= 16 ? kCodes[code] : "?", status.error_message().c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  std::string socket, data, verb, symbol;
  std::vector<std::pair<std::string, std::string>> headers;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "-plaintext") continue;
    if ((arg == "-unix" || arg == "-H" || arg == "-d") && i + 1 >= argc) {
      return Usage(absl::StrCat(arg, " needs a value"));
    }
    if (arg == "-unix") {
      socket = argv[++i];
    } else if (arg == "-H") {
      std::pair<std::string, std::string> kv = absl::StrSplit(argv[++i], absl::MaxSplits(':', 1));
      headers.emplace_back(std::string(absl::StripAsciiWhitespace(kv.first)),
                           std::string(absl::StripAsciiWhitespace(kv.second)));
    } else if (arg == "-d") {
      data = argv[++i];
    } else if (verb.empty()) {
      verb = arg;
    } else if (symbol.empty()) {
      symbol = arg;
    } else {
      return Usage(absl::StrCat("unexpected argument '", arg, "'"));
    }
  }
  if (socket.empty()) return Usage("-unix SOCKET is required (only unix sockets are supported)");
  if (verb.empty()) return Usage("no verb or method");
  std::shared_ptr<grpc::Channel> channel =
      grpc::CreateChannel(absl::StrCat("unix://", socket), grpc::InsecureChannelCredentials());
  Reflection reflection(channel);

  if (verb == "list") {
    for (const std::string& service : reflection.Services()) std::printf("%s\n", service.c_str());
    return 0;
  }
  if (verb == "describe") {
    if (symbol.empty()) return Usage("describe needs a symbol");
    if (!reflection.LoadSymbol(symbol)) return Usage(absl::StrCat("symbol not found: ", symbol));
    google::protobuf::DescriptorPool pool(&reflection.db());
    if (const auto* s = pool.FindServiceByName(symbol)) {
      std::printf("%s is a service:\n%s", symbol.c_str(), s->DebugString().c_str());
    } else if (const auto* m = pool.FindMessageTypeByName(symbol)) {
      std::printf("%s is a message:\n%s", symbol.c_str(), m->DebugString().c_str());
    } else if (const auto* e = pool.FindEnumTypeByName(symbol)) {
      std::printf("%s is an enum:\n%s", symbol.c_str(), e->DebugString().c_str());
    } else {
      return Usage(absl::StrCat("symbol not found: ", symbol));
    }
    return 0;
  }

  // SERVICE/METHOD (grpcurl also takes SERVICE.METHOD).
  std::string service_name, method_name;
  if (size_t slash = verb.rfind('/'); slash != std::string::npos) {
    service_name = verb.substr(0, slash);
    method_name = verb.substr(slash + 1);
  } else if (size_t dot = verb.rfind('.'); dot != std::string::npos) {
    service_name = verb.substr(0, dot);
    method_name = verb.substr(dot + 1);
  } else {
    return Usage(absl::StrCat("'", verb, "' is not list, describe or SERVICE/METHOD"));
  }
  if (!reflection.LoadSymbol(service_name)) {
    return Usage(absl::StrCat("service not found: ", service_name));
  }
  google::protobuf::DescriptorPool pool(&reflection.db());
  const google::protobuf::ServiceDescriptor* service = pool.FindServiceByName(service_name);
  const google::protobuf::MethodDescriptor* method =
      service == nullptr ? nullptr : service->FindMethodByName(method_name);
  if (method == nullptr) return Usage(absl::StrCat("method not found: ", verb));
  if (method->client_streaming() || method->server_streaming()) {
    return Usage(absl::StrCat(verb, " is a streaming method; grpcurl_lite calls unary ones"));
  }
  google::protobuf::DynamicMessageFactory factory(&pool);
  std::unique_ptr<google::protobuf::Message> request(
      factory.GetPrototype(method->input_type())->New());
  if (!data.empty()) {
    if (auto s = google::protobuf::util::JsonStringToMessage(data, request.get()); !s.ok()) {
      return Usage(absl::StrCat("-d is not a ", method->input_type()->full_name(), ": ",
                                std::string(s.message())));
    }
  }
  std::string bytes;
  request->SerializeToString(&bytes);
  grpc::Slice slice(bytes);
  grpc::ByteBuffer request_buffer(&slice, 1);
  grpc::ByteBuffer response_buffer;
  grpc::GenericStub stub(channel);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
  for (const auto& [key, value] : headers) context.AddMetadata(key, value);
  grpc::CompletionQueue cq;
  std::unique_ptr<grpc::GenericClientAsyncResponseReader> call = stub.PrepareUnaryCall(
      &context, absl::StrCat("/", service_name, "/", method_name), request_buffer, &cq);
  call->StartCall();
  grpc::Status status;
  call->Finish(&response_buffer, &status, reinterpret_cast<void*>(1));
  void* tag = nullptr;
  bool ok = false;
  if (!cq.Next(&tag, &ok) || !ok) return Fail(grpc::Status(grpc::StatusCode::UNKNOWN, "no reply"));
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
  if (!status.ok()) return Fail(status);
  std::unique_ptr<google::protobuf::Message> response(
      factory.GetPrototype(method->output_type())->New());
  if (!response->ParseFromString(ToString(response_buffer))) {
    return Fail(grpc::Status(grpc::StatusCode::INTERNAL, "the response does not parse"));
  }
  google::protobuf::util::JsonPrintOptions options;
  options.add_whitespace = true;
  options.preserve_proto_field_names = false;
  std::string json;
  (void)google::protobuf::util::MessageToJsonString(*response, &json, options);
  std::printf("%s", json.c_str());
  return 0;
}
