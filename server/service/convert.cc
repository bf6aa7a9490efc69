#include "server/service/convert.h"

#include "absl/strings/str_cat.h"

namespace kvhost {

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

absl::StatusOr<PoolSpec> FromProto(const v1::PoolSpec& in) {
  PoolSpec spec;
  if (in.kind() != v1::MHA && in.kind() != v1::MLA) {
    return absl::InvalidArgumentError(absl::StrCat("spec.kind ",
                                                   v1::PoolKind_Name(in.kind()).empty()
                                                       ? absl::StrCat(in.kind())
                                                       : v1::PoolKind_Name(in.kind()),
                                                   " is not supported; use MHA or MLA"));
  }
  if (in.layout() < v1::LAYER_FIRST || in.layout() > v1::PAGE_HEAD) {
    return absl::InvalidArgumentError(absl::StrCat(
        "spec.layout ",
        in.layout() == v1::LAYOUT_UNSPECIFIED ? "LAYOUT_UNSPECIFIED" : absl::StrCat(in.layout()),
        " is not a layout; use LAYER_FIRST, PAGE_FIRST, PAGE_FIRST_DIRECT or PAGE_HEAD"));
  }
  if (in.dtype() < v1::BF16 || in.dtype() > v1::UINT8) {
    return absl::InvalidArgumentError(absl::StrCat(
        "spec.dtype ",
        in.dtype() == v1::DTYPE_UNSPECIFIED ? "DTYPE_UNSPECIFIED" : absl::StrCat(in.dtype()),
        " is not a dtype; use BF16, FP16, FP32, FP8_E4M3, FP8_E5M2 or UINT8"));
  }
  spec.kind = static_cast<PoolKind>(in.kind());
  spec.layout = static_cast<LayoutKind>(in.layout());
  spec.dtype = static_cast<DType>(in.dtype());
  spec.page_size = in.page_size();
  spec.layer_num = in.layer_num();
  spec.head_num = in.head_num();
  spec.head_dim = in.head_dim();
  spec.v_head_dim = in.v_head_dim();
  spec.kv_lora_rank = in.kv_lora_rank();
  spec.qk_rope_head_dim = in.qk_rope_head_dim();
  spec.size_tokens = in.size_tokens();
  spec.size_bytes = in.size_bytes();
  spec.host_to_device_ratio = in.host_to_device_ratio();
  spec.device_size_tokens = in.device_size_tokens();
  return spec;
}

void ToProto(const PoolSpec& spec, v1::PoolSpec* out) {
  out->set_kind(static_cast<v1::PoolKind>(spec.kind));
  out->set_layout(static_cast<v1::Layout>(spec.layout));
  out->set_dtype(static_cast<v1::DType>(spec.dtype));
  out->set_page_size(spec.page_size);
  out->set_layer_num(spec.layer_num);
  out->set_head_num(spec.head_num);
  out->set_head_dim(spec.head_dim);
  out->set_v_head_dim(spec.v_head_dim);
  out->set_kv_lora_rank(spec.kv_lora_rank);
  out->set_qk_rope_head_dim(spec.qk_rope_head_dim);
  out->set_size_tokens(spec.size_tokens);
  out->set_size_bytes(spec.size_bytes);
  out->set_host_to_device_ratio(spec.host_to_device_ratio);
  out->set_device_size_tokens(spec.device_size_tokens);
}

void ToProto(const Pool& pool, const char* backend, v1::Pool* out) {
  out->set_name(pool.name());
  ToProto(pool.spec(), out->mutable_spec());
  out->set_size_tokens(pool.size_tokens());
  out->set_page_num(pool.page_num());
  out->set_available_tokens(pool.allocator().available_tokens());
  out->set_bytes(pool.bytes());
  for (const std::string& path : pool.region_paths()) out->add_region_paths(path);
  out->set_bytes_per_token(BytesPerToken(pool.spec()));
  out->set_attachments(pool.attachments());
  out->set_backend(backend);
}

namespace {

absl::StatusOr<DeviceBufferRef> FromProto(const v1::DeviceBuffer& in, const char* field,
                                          int index) {
  DeviceBufferRef ref;
  switch (in.location_case()) {
    case v1::DeviceBuffer::kShm:
      ref.kind = DeviceBufferRef::Kind::kShm;
      ref.shm_path = in.shm().path();
      ref.offset = in.shm().offset();
      return ref;
    case v1::DeviceBuffer::kCuda:
      ref.kind = DeviceBufferRef::Kind::kCuda;
      ref.ipc_handle = in.cuda().ipc_handle();
      ref.gpu_uuid = in.cuda().gpu_uuid();
      ref.offset = in.cuda().offset();
      return ref;
    case v1::DeviceBuffer::LOCATION_NOT_SET:
      break;
  }
  return absl::InvalidArgumentError(
      absl::StrCat(field, "[", index, "] has no location (set shm or cuda)"));
}

}  // namespace

absl::StatusOr<AttachRequest> FromProto(const v1::AttachDeviceRequest& in) {
  AttachRequest request;
  request.device_size_tokens = in.device_size_tokens();
  request.load_event_sets = in.load_event_sets();
  for (int i = 0; i < in.k_layers_size(); ++i) {
    absl::StatusOr<DeviceBufferRef> ref = FromProto(in.k_layers(i), "k_layers", i);
    if (!ref.ok()) return ref.status();
    request.k_layers.push_back(*std::move(ref));
  }
  for (int i = 0; i < in.v_layers_size(); ++i) {
    absl::StatusOr<DeviceBufferRef> ref = FromProto(in.v_layers(i), "v_layers", i);
    if (!ref.ok()) return ref.status();
    request.v_layers.push_back(*std::move(ref));
  }
  return request;
}

void ToProto(const TicketStatus& status, v1::TransferStatus* out) {
  out->set_ticket_id(status.id);
  out->set_done(status.done);
  out->set_bytes(status.bytes);
  out->set_layers_done(status.layers_done);
  out->set_layer_num(status.layer_num);
  out->set_path(status.path);
  out->set_duration_us(status.duration_us);
  out->set_first_layer_us(status.first_layer_us);
  out->set_enqueue_us(status.enqueue_us);
  out->set_event_set(status.event_set);
}

}  // namespace kvhost
