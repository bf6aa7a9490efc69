// grpc.reflection.v1.ServerReflection, served beside gRPC's own
// grpc.reflection.v1alpha (Debian's gRPC 1.51 ships only the latter, and
// grpcurl, Postman and other current clients ask for v1 first). The answers
// are those of gRPC's v1alpha service: the listed services, and for a file
// name, a symbol or an extension, the FileDescriptorProto of the file that
// holds it with every file it depends on (each reply whole, so a client may
// build it alone, as v1alpha's), from
// protobuf's generated pool (the same descriptors v1alpha serves). A lookup
// that finds nothing answers an error_response NOT_FOUND naming what was
// asked, and the stream goes on, as v1alpha does. host is echoed as
// valid_host.
//
// One reactor per stream, one reply in flight: a client that does not read
// holds only its own stream (gRPC's flow control bounds what it buffers).
// Thread-safe: the service is immutable after construction.
#ifndef KVHOST_SERVER_SERVICE_REFLECTION_V1_H_
#define KVHOST_SERVER_SERVICE_REFLECTION_V1_H_

#include <string>
#include <vector>

#include "grpc/reflection/v1/reflection.grpc.pb.h"

namespace kvhost {

class ReflectionV1Service final : public grpc::reflection::v1::ServerReflection::CallbackService {
 public:
  // `services`: the full names list_services answers (the daemon's).
  explicit ReflectionV1Service(std::vector<std::string> services);

  grpc::ServerBidiReactor<grpc::reflection::v1::ServerReflectionRequest,
                          grpc::reflection::v1::ServerReflectionResponse>*
  ServerReflectionInfo(grpc::CallbackServerContext* context) override;

  // The reply to one request.
  grpc::reflection::v1::ServerReflectionResponse Answer(
      const grpc::reflection::v1::ServerReflectionRequest& request) const;

 private:
  std::vector<std::string> services_;
};

}  // namespace kvhost

#endif  // KVHOST_SERVER_SERVICE_REFLECTION_V1_H_
