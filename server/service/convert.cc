#include "server/service/convert.h"

#include "absl/strings/str_cat.h"
#include "server/safe_text.h"

namespace kvhost {

grpc::ServerUnaryReactor* FinishCall(grpc::CallbackServerContext* context,
                                     const absl::Status& status) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  // Messages echo what the client sent; raw, a long one would not fit in
  // the trailing metadata that carries it (see server/safe_text.h).
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()),
                      SafeText(status.message(), kMaxStatusMessageBytes));
}

namespace {

std::string EnumText(const std::string& name, int value, const char* unspecified) {
  if (value == 0) return unspecified;
  return name.empty() ? absl::StrCat(value) : name;
}

absl::StatusOr<DType> DTypeFromProto(v1::DType in, const char* field) {
  if (in < v1::BF16 || in > v1::UINT8) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " ", EnumText(v1::DType_Name(in), in, "DTYPE_UNSPECIFIED"),
                     " is not a dtype; use BF16, FP16, FP32, FP8_E4M3, FP8_E5M2 or UINT8"));
  }
  return static_cast<DType>(in);
}

std::vector<uint32_t> DimsFromProto(const v1::Shape& in) {
  return std::vector<uint32_t>(in.dims().begin(), in.dims().end());
}

void DimsToProto(const std::vector<uint32_t>& dims, v1::Shape* out) {
  for (uint32_t d : dims) out->add_dims(d);
}

}  // namespace

absl::StatusOr<PoolSpec> FromProto(const v1::PoolSpec& in) {
  PoolSpec spec;
  if (in.kind() < v1::MHA || in.kind() > v1::LOGICAL) {
    return absl::InvalidArgumentError(absl::StrCat(
        "spec.kind ", EnumText(v1::PoolKind_Name(in.kind()), in.kind(), "POOL_KIND_UNSPECIFIED"),
        " is not a pool kind; use MHA, MLA, MHA_ASYMMETRIC, K_ONLY, DSA, DSA_INDEXER, MAMBA, "
        "V4_PAGED, V4_STATE or LOGICAL"));
  }
  if (in.layout() < v1::LAYER_FIRST || in.layout() > v1::PAGE_UNIFIED) {
    return absl::InvalidArgumentError(absl::StrCat(
        "spec.layout ", EnumText(v1::Layout_Name(in.layout()), in.layout(), "LAYOUT_UNSPECIFIED"),
        " is not a layout; use LAYER_FIRST, PAGE_FIRST, PAGE_FIRST_DIRECT, PAGE_HEAD or "
        "PAGE_UNIFIED"));
  }
  absl::StatusOr<DType> dtype = DTypeFromProto(in.dtype(), "spec.dtype");
  if (!dtype.ok()) return dtype.status();
  spec.kind = static_cast<PoolKind>(in.kind());
  spec.layout = static_cast<LayoutKind>(in.layout());
  spec.dtype = *dtype;
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
  spec.follows = in.follows();
  spec.start_layer = in.start_layer();
  spec.index_head_dim = in.index_head_dim();
  spec.index_quant_block_size = in.index_quant_block_size();
  spec.index_row_bytes = in.index_row_bytes();
  spec.kv_cache_dim = in.kv_cache_dim();
  spec.item_bytes = in.item_bytes();
  spec.ring_size = in.ring_size();
  spec.state_slot_bytes = in.state_slot_bytes();
  spec.head_groups = in.head_groups();
  spec.node_cache = in.node_cache();
  const v1::MambaStates& mamba = in.mamba();
  spec.mamba.temporal = DimsFromProto(mamba.temporal());
  for (const v1::Shape& conv : mamba.conv()) spec.mamba.conv.push_back(DimsFromProto(conv));
  spec.mamba.temporal_dtype = spec.dtype;  // DTYPE_UNSPECIFIED: the spec's dtype
  if (mamba.temporal_dtype() != v1::DTYPE_UNSPECIFIED) {
    absl::StatusOr<DType> t = DTypeFromProto(mamba.temporal_dtype(), "spec.mamba.temporal_dtype");
    if (!t.ok()) return t.status();
    if (spec.kind != PoolKind::kMamba) {
      return absl::InvalidArgumentError(absl::StrCat(
          "spec.mamba is not used by ", v1::PoolKind_Name(in.kind()), "; leave it unset"));
    }
    spec.mamba.temporal_dtype = *t;
  }
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
  out->set_follows(spec.follows);
  out->set_start_layer(spec.start_layer);
  out->set_index_head_dim(spec.index_head_dim);
  out->set_index_quant_block_size(spec.index_quant_block_size);
  out->set_index_row_bytes(spec.index_row_bytes);
  out->set_kv_cache_dim(spec.kv_cache_dim);
  out->set_item_bytes(spec.item_bytes);
  out->set_ring_size(spec.ring_size);
  out->set_state_slot_bytes(spec.state_slot_bytes);
  out->set_head_groups(spec.head_groups);
  out->set_node_cache(spec.node_cache);
  if (spec.kind == PoolKind::kMamba) {
    v1::MambaStates* mamba = out->mutable_mamba();
    DimsToProto(spec.mamba.temporal, mamba->mutable_temporal());
    mamba->set_temporal_dtype(static_cast<v1::DType>(spec.mamba.temporal_dtype));
    for (const std::vector<uint32_t>& conv : spec.mamba.conv) {
      DimsToProto(conv, mamba->add_conv());
    }
  }
}

void ToProto(const CreatingPool& pool, const char* backend, v1::Pool* out) {
  out->set_name(pool.name);
  ToProto(pool.spec, out->mutable_spec());
  out->set_size_tokens(pool.size_tokens);
  out->set_bytes(pool.bytes);
  out->set_bytes_per_token(BytesPerToken(pool.spec));
  out->set_backend(backend);
  out->set_state(v1::CREATING);
  out->set_populated_bytes(pool.populated_bytes);
}

void ToProto(const Pool& pool, const char* backend, v1::Pool* out, bool region_paths) {
  out->set_name(pool.name());
  ToProto(pool.spec(), out->mutable_spec());
  out->set_size_tokens(pool.size_tokens());
  out->set_page_num(pool.page_num());
  out->set_available_tokens(pool.allocator().available_tokens());
  out->set_bytes(pool.bytes());
  out->set_state(v1::READY);
  out->set_populated_bytes(pool.bytes());
  if (region_paths) {
    for (const std::string& path : pool.region_paths()) out->add_region_paths(path);
  }
  out->set_bytes_per_token(BytesPerToken(pool.spec()));
  out->set_attachments(pool.attachments());
  out->set_backend(backend);
  for (const Component& c : pool.components()) {
    v1::PoolComponent* pc = out->add_components();
    pc->set_name(c.name);
    pc->set_region_index(c.region);
    pc->set_offset(c.region_offset);
    pc->set_bytes(c.bytes());
    pc->set_row_bytes(c.row_bytes());
    pc->set_row_tokens(static_cast<uint32_t>(c.row_tokens));
  }
  if (pool.follows()) out->set_follows(pool.follows()->name());
  for (const std::string& name : pool.followers()) out->add_followers(name);
  out->set_start_layer(pool.start_layer());
  out->set_end_layer(pool.end_layer());
  out->set_bytes_per_page(pool.bytes_per_page());
  out->set_replica_ranks(pool.replica_ranks());
  out->set_bytes_saved(pool.bytes_saved());
  out->set_group(pool.group());
  out->set_owner_protected(pool.owner_protected());
}

std::vector<GroupEntrySpec> FromProto(
    const google::protobuf::RepeatedPtrField<v1::PoolEntry>& entries) {
  std::vector<GroupEntrySpec> out;
  out.reserve(entries.size());
  for (const v1::PoolEntry& e : entries) {
    out.push_back(GroupEntrySpec{e.name(), e.pool(),
                                 std::vector<int32_t>(e.layer_map().begin(), e.layer_map().end()),
                                 e.anchor()});
  }
  return out;
}

void ToProto(const PoolGroup& group, v1::PoolGroup* out) {
  out->set_name(group.name());
  out->set_layer_num(group.layer_num());
  for (size_t i = 0; i < group.entries().size(); ++i) {
    const GroupEntry& e = group.entries()[i];
    v1::PoolEntry* entry = out->add_entries();
    entry->set_name(e.name);
    entry->set_pool(e.pool->name());
    for (int32_t v : e.layer_map) entry->add_layer_map(v);
    entry->set_anchor(i == group.anchor_index());
  }
  out->set_anchor(group.anchor().name);
  out->set_attachments(group.attachments());
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
    case v1::DeviceBuffer::kCudaFd: {
      ref.kind = DeviceBufferRef::Kind::kCudaFd;
      ref.gpu_uuid = in.cuda_fd().gpu_uuid();
      ref.offset = in.cuda_fd().offset();
      const auto& chunks = in.cuda_fd().chunks();
      if (chunks.empty()) {
        return absl::InvalidArgumentError(
            absl::StrCat(field, "[", index, "].cuda_fd has no chunks (the allocations it spans)"));
      }
      uint64_t total = 0;
      for (int c = 0; c < chunks.size(); ++c) {
        const uint64_t bytes = chunks[c].bytes();
        // A chunk is at least a page of GPU memory; the sum must stay
        // far from overflowing any offset computed from it.
        if (bytes == 0 || bytes > kMaxFdBufferBytes - total) {
          return absl::InvalidArgumentError(absl::StrCat(
              field, "[", index, "].cuda_fd.chunks[", c, "].bytes is ", bytes,
              bytes == 0 ? ""
                         : absl::StrCat("; the chunks would pass ", kMaxFdBufferBytes, " bytes"),
              bytes == 0 ? " (an allocation has at least one byte)" : ""));
        }
        total += bytes;
        ref.chunks.push_back({chunks[c].deposit_id(), chunks[c].index(), bytes, -1});
      }
      return ref;
    }
    case v1::DeviceBuffer::LOCATION_NOT_SET:
      break;
  }
  return absl::InvalidArgumentError(
      absl::StrCat(field, "[", index, "] has no location (set shm, cuda or cuda_fd)"));
}

}  // namespace

namespace {

// The buffers, size and layer range of a plain attachment or of one group
// entry (v1::AttachDeviceRequest and v1::DeviceEntry spell them alike).
// `prefix` ("", "entries[1].") starts the field names in messages.
template <typename Message>
absl::Status BuffersFromProto(const Message& in, const std::string& prefix, AttachRequest* out) {
  out->device_size_tokens = in.device_size_tokens();
  const std::string k_field = absl::StrCat(prefix, "k_layers");
  for (int i = 0; i < in.k_layers_size(); ++i) {
    absl::StatusOr<DeviceBufferRef> ref = FromProto(in.k_layers(i), k_field.c_str(), i);
    if (!ref.ok()) return ref.status();
    out->k_layers.push_back(*std::move(ref));
  }
  const std::string v_field = absl::StrCat(prefix, "v_layers");
  for (int i = 0; i < in.v_layers_size(); ++i) {
    absl::StatusOr<DeviceBufferRef> ref = FromProto(in.v_layers(i), v_field.c_str(), i);
    if (!ref.ok()) return ref.status();
    out->v_layers.push_back(*std::move(ref));
  }
  for (int c = 0; c < in.components_size(); ++c) {
    const v1::DeviceComponent& component = in.components(c);
    ComponentBuffers buffers;
    buffers.name = component.name();
    // Relative to the entry: the manager names the entry in its messages.
    buffers.field = absl::StrCat("components[", c, "].layers");
    const std::string field = absl::StrCat(prefix, buffers.field);
    for (int i = 0; i < component.layers_size(); ++i) {
      absl::StatusOr<DeviceBufferRef> ref = FromProto(component.layers(i), field.c_str(), i);
      if (!ref.ok()) return ref.status();
      buffers.layers.push_back(*std::move(ref));
    }
    out->named.push_back(std::move(buffers));
  }
  out->start_layer = in.start_layer();
  out->end_layer = in.end_layer();
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<AttachRequest> FromProto(const v1::AttachDeviceRequest& in) {
  AttachRequest request;
  request.session_id = in.session_id();
  if (absl::Status s = BuffersFromProto(in, "", &request); !s.ok()) return s;
  request.load_event_sets = in.load_event_sets();
  if (in.has_tp_rank()) request.tp_rank = in.tp_rank();
  request.load_only = in.load_only();
  request.layer_progress = in.layer_progress();
  for (int e = 0; e < in.entries_size(); ++e) {
    AttachEntry entry;
    entry.entry = in.entries(e).entry();
    if (absl::Status s =
            BuffersFromProto(in.entries(e), absl::StrCat("entries[", e, "]."), &entry.request);
        !s.ok()) {
      return s;
    }
    request.entries.push_back(std::move(entry));
  }
  return request;
}

void ToProto(const WorkerCopyPlan& plan, v1::WorkerCopyPlan* out) {
  out->set_tile_bytes(sizeof(CopyTile));
  out->set_tiles(reinterpret_cast<const char*>(plan.sm.tiles.data()),
                 plan.sm.tiles.size() * sizeof(CopyTile));
  for (const TileLaunch& launch : plan.sm.launches) {
    v1::WorkerCopyLaunch* l = out->add_launches();
    l->set_group(launch.group);
    l->set_tile_begin(launch.tile_begin);
    l->set_tile_end(launch.tile_end);
    l->set_items(launch.items);
  }
  for (const JobLayer& layer : plan.layers) {
    v1::WorkerCopyLayer* l = out->add_layers();
    l->set_host_layer(layer.host_layer);
    l->set_device_layer_delta(
        layer.host_layer < 0
            ? 0
            : static_cast<int32_t>(int64_t{layer.device_layer} - layer.host_layer));
  }
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
