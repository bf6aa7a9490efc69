#include "server/service/reflection_v1.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/descriptor.pb.h"

namespace kvhost {
namespace {

namespace rv1 = ::grpc::reflection::v1;
using ::google::protobuf::DescriptorPool;
using ::google::protobuf::FileDescriptor;

void NotFound(const std::string& what, rv1::ServerReflectionResponse* out) {
  rv1::ErrorResponse* error = out->mutable_error_response();
  error->set_error_code(static_cast<int32_t>(grpc::StatusCode::NOT_FOUND));
  error->set_error_message(what);
}

// `file` and every file it depends on, each once (`sent`: this reply's).
void AddFiles(const FileDescriptor* file, std::vector<std::string>* sent,
              rv1::FileDescriptorResponse* out) {
  if (std::find(sent->begin(), sent->end(), file->name()) != sent->end()) return;
  sent->push_back(file->name());
  google::protobuf::FileDescriptorProto proto;
  file->CopyTo(&proto);
  out->add_file_descriptor_proto(proto.SerializeAsString());
  for (int i = 0; i < file->dependency_count(); ++i) AddFiles(file->dependency(i), sent, out);
}

class Reactor final
    : public grpc::ServerBidiReactor<rv1::ServerReflectionRequest, rv1::ServerReflectionResponse> {
 public:
  explicit Reactor(const ReflectionV1Service* service) : service_(service) { StartRead(&request_); }

  void OnReadDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status::OK);  // the client closed its side
      return;
    }
    response_ = service_->Answer(request_);
    StartWrite(&response_);
  }
  void OnWriteDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, "the client went away"));
      return;
    }
    StartRead(&request_);
  }
  void OnDone() override { delete this; }

 private:
  const ReflectionV1Service* service_;
  rv1::ServerReflectionRequest request_;
  rv1::ServerReflectionResponse response_;
};

}  // namespace

ReflectionV1Service::ReflectionV1Service(std::vector<std::string> services)
    : services_(std::move(services)) {}

grpc::ServerBidiReactor<rv1::ServerReflectionRequest, rv1::ServerReflectionResponse>*
ReflectionV1Service::ServerReflectionInfo(grpc::CallbackServerContext* /*context*/) {
  return new Reactor(this);
}

rv1::ServerReflectionResponse ReflectionV1Service::Answer(
    const rv1::ServerReflectionRequest& request) const {
  const DescriptorPool* pool = DescriptorPool::generated_pool();
  std::vector<std::string> files;  // sent in this reply
  std::vector<std::string>* sent = &files;
  rv1::ServerReflectionResponse out;
  out.set_valid_host(request.host());
  *out.mutable_original_request() = request;
  switch (request.message_request_case()) {
    case rv1::ServerReflectionRequest::kListServices:
      for (const std::string& name : services_) {
        out.mutable_list_services_response()->add_service()->set_name(name);
      }
      break;
    case rv1::ServerReflectionRequest::kFileByFilename: {
      const FileDescriptor* file = pool->FindFileByName(request.file_by_filename());
      if (file == nullptr) {
        NotFound(absl::StrCat("file '", request.file_by_filename(), "' not found"), &out);
      } else {
        AddFiles(file, sent, out.mutable_file_descriptor_response());
      }
      break;
    }
    case rv1::ServerReflectionRequest::kFileContainingSymbol: {
      const FileDescriptor* file = pool->FindFileContainingSymbol(request.file_containing_symbol());
      if (file == nullptr) {
        NotFound(absl::StrCat("symbol '", request.file_containing_symbol(), "' not found"), &out);
      } else {
        AddFiles(file, sent, out.mutable_file_descriptor_response());
      }
      break;
    }
    case rv1::ServerReflectionRequest::kFileContainingExtension: {
      const rv1::ExtensionRequest& ext = request.file_containing_extension();
      const google::protobuf::Descriptor* type = pool->FindMessageTypeByName(ext.containing_type());
      const google::protobuf::FieldDescriptor* field =
          type == nullptr ? nullptr : pool->FindExtensionByNumber(type, ext.extension_number());
      if (field == nullptr) {
        NotFound(absl::StrCat("extension ", ext.extension_number(), " of '", ext.containing_type(),
                              "' not found"),
                 &out);
      } else {
        AddFiles(field->file(), sent, out.mutable_file_descriptor_response());
      }
      break;
    }
    case rv1::ServerReflectionRequest::kAllExtensionNumbersOfType: {
      const google::protobuf::Descriptor* type =
          pool->FindMessageTypeByName(request.all_extension_numbers_of_type());
      if (type == nullptr) {
        NotFound(absl::StrCat("type '", request.all_extension_numbers_of_type(), "' not found"),
                 &out);
        break;
      }
      std::vector<const google::protobuf::FieldDescriptor*> extensions;
      pool->FindAllExtensions(type, &extensions);
      rv1::ExtensionNumberResponse* numbers = out.mutable_all_extension_numbers_response();
      numbers->set_base_type_name(type->full_name());
      for (const auto* field : extensions) numbers->add_extension_number(field->number());
      break;
    }
    default: {
      rv1::ErrorResponse* error = out.mutable_error_response();
      error->set_error_code(static_cast<int32_t>(grpc::StatusCode::UNIMPLEMENTED));
      error->set_error_message("the request names none of the reflection calls");
      break;
    }
  }
  return out;
}

}  // namespace kvhost
