#include "server/service/pool_service.h"

#include <google/protobuf/io/coded_stream.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/types/span.h"
#include "common/bytes.h"
#include "server/access/credentials.h"
#include "server/safe_text.h"
#include "server/service/convert.h"
#include "server/service/page_streams.h"
#include "spdlog/spdlog.h"

namespace kvhost {
namespace {

absl::Span<const int64_t> Indices(const google::protobuf::RepeatedField<int64_t>& field) {
  return absl::MakeConstSpan(field.data(), field.size());
}

absl::Span<uint8_t> Bytes(std::string* s) {
  return absl::MakeSpan(reinterpret_cast<uint8_t*>(s->data()), s->size());
}

absl::Span<const uint8_t> Bytes(const std::string& s) {
  return absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(s.data()), s.size());
}

void ToProto(absl::Span<const RegionRange> ranges, const Pool& pool, v1::PageBufferMeta* out) {
  for (const std::string& path : pool.region_paths()) out->add_region_paths(path);
  out->mutable_segments()->Reserve(static_cast<int>(ranges.size()));
  for (const RegionRange& s : ranges) {
    v1::RegionRange* range = out->add_segments();
    range->set_region_index(s.region);
    range->set_offset(s.offset);
    range->set_length(s.length);
  }
}

using google::protobuf::io::CodedOutputStream;

// Reply bounds. Every reply whose size depends on the request or on a pool's
// shape is estimated from the domain's entry counts (Pool::*Entries,
// PoolGroup::LayerMapValues) times the largest wire size of one entry, before
// anything is built, and refused above --max-message-bytes.

// Room in a reply for what no estimate below counts (its own framing).
constexpr uint64_t kReplyOverheadBytes = 64;
// A layer-map value at its largest: int32 -1, sign-extended, is a 10-byte
// varint.
constexpr uint64_t kLayerMapValueBytes = 10;

// Wire bytes of `m` as one element of a repeated field: tag (the field
// numbers of these replies are below 16: one byte), length, body.
uint64_t AsElement(const google::protobuf::MessageLite& m) {
  const uint64_t n = m.ByteSizeLong();
  return 1 + CodedOutputStream::VarintSize64(n) + n;
}

uint64_t StringElement(const std::string& s) {
  return 1 + CodedOutputStream::VarintSize64(s.size()) + s.size();
}

// The largest PageBufferMeta.segments element (every value at its maximum).
uint64_t MaxRangeBytes() {
  static const uint64_t bytes = [] {
    v1::RegionRange s;
    s.set_region_index(UINT32_MAX);
    s.set_offset(UINT64_MAX);
    s.set_length(UINT64_MAX);
    return AsElement(s);
  }();
  return bytes;
}

// region_paths of PageBufferMeta and ContiguousBufferInfos.
uint64_t RegionPathsBytes(const Pool& pool) {
  uint64_t bytes = 0;
  for (const std::string& path : pool.region_paths()) bytes += StringElement(path);
  return bytes;
}

size_t LongestComponentName(const Pool& pool) {
  size_t n = 0;
  for (const Component& c : pool.components()) n = std::max(n, c.name.size());
  return n;
}

// The largest ContiguousBufferInfos.infos element of `pool`.
uint64_t MaxBufferInfoBytes(const Pool& pool) {
  v1::ContiguousBufferInfo info;
  info.set_component(std::string(LongestComponentName(pool), 'x'));
  info.set_layer(UINT32_MAX);
  info.set_region_index(UINT32_MAX);
  info.set_offset(UINT64_MAX);
  info.set_length(UINT64_MAX);
  info.set_item_bytes(UINT64_MAX);
  return AsElement(info);
}

// The largest PageShape.parts element of `pool`.
uint64_t MaxPagePartBytes(const Pool& pool) {
  v1::PageShape::Part part;
  part.set_component(std::string(LongestComponentName(pool), 'x'));
  for (size_t d = 0; d < kMaxPagePartDims; ++d) part.add_dims(UINT64_MAX);
  part.set_dtype(v1::DType_MAX);
  part.set_bytes(UINT64_MAX);
  return AsElement(part);
}

// A PoolGroup reply's bytes without its layer-map values: the group named
// `name` with entries (name, pool name), every number at its maximum, each
// entry's packed layer_map tag and length for `layer_num` values.
uint64_t GroupShellBytes(const std::string& name, uint32_t layer_num,
                         const std::vector<std::pair<std::string, std::string>>& entries) {
  v1::PoolGroup g;
  g.set_name(name);
  g.set_layer_num(UINT32_MAX);
  g.set_attachments(UINT32_MAX);
  size_t anchor = 0;
  for (const auto& [entry, pool] : entries) {
    v1::PoolEntry* e = g.add_entries();
    e->set_name(entry);
    e->set_pool(pool);
    e->set_anchor(true);
    anchor = std::max(anchor, entry.size());
  }
  g.set_anchor(std::string(anchor, 'x'));
  const uint64_t map_bytes = uint64_t{layer_num} * kLayerMapValueBytes;
  // Each entry's message length grows by its map's tag, length and values.
  return g.ByteSizeLong() + entries.size() * (1 + CodedOutputStream::VarintSize64(map_bytes) + 5);
}

std::vector<std::pair<std::string, std::string>> EntryNames(const PoolGroup& group) {
  std::vector<std::pair<std::string, std::string>> out;
  for (const GroupEntry& e : group.entries()) out.emplace_back(e.name, e.pool->name());
  return out;
}

// The largest PoolGroup reply of `group`.
uint64_t GroupReplyBytes(const PoolGroup& group) {
  return GroupShellBytes(group.name(), group.layer_num(), EntryNames(group)) +
         group.layer_map_values() * kLayerMapValueBytes;
}

uint64_t SatMulAdd(uint64_t a, uint64_t b, uint64_t c) {
  if (b != 0 && a > (UINT64_MAX - c) / b) return UINT64_MAX;
  return a * b + c;
}

// Entries of `entry_bytes` that fit beside `fixed` bytes in one reply.
uint64_t EntriesThatFit(uint64_t entry_bytes, uint64_t fixed, int max_message_bytes) {
  const uint64_t limit = static_cast<uint64_t>(max_message_bytes);
  return limit > fixed ? (limit - fixed) / entry_bytes : 0;
}

// RESOURCE_EXHAUSTED naming the estimate and the limit when `entries`
// entries of up to `entry_bytes` each beside `fixed` bytes may not fit one
// reply; `what` names the reply's entries, `split` says how to ask for less.
absl::Status CheckReplySize(const std::string& pool, const std::string& what, uint64_t entries,
                            uint64_t entry_bytes, uint64_t fixed, int max_message_bytes,
                            const std::string& split) {
  if (entries <= EntriesThatFit(entry_bytes, fixed, max_message_bytes)) return absl::OkStatus();
  return WithPool(
      pool, absl::ResourceExhaustedError(absl::StrCat(
                what, " need a reply of up to ", SatMulAdd(entries, entry_bytes, fixed), " bytes (",
                entries, " entries of up to ", entry_bytes, " bytes), over the ", max_message_bytes,
                "-byte message limit (--max-message-bytes); ", split)));
}

// How many of `unit` (indices, pages) fit one reply when each brings
// `entries_per_unit` entries of `entry_bytes`.
uint64_t UnitsThatFit(uint64_t entries_per_unit, uint64_t entry_bytes, uint64_t fixed,
                      int max_message_bytes) {
  if (entries_per_unit == 0) return UINT64_MAX;
  return EntriesThatFit(entry_bytes, fixed, max_message_bytes) / entries_per_unit;
}
}  // namespace

grpc::ServerUnaryReactor* PoolServiceImpl::CreatePool(grpc::CallbackServerContext* context,
                                                      const v1::CreatePoolRequest* request,
                                                      v1::Pool* response) {
  absl::StatusOr<PoolSpec> spec = FromProto(request->spec());
  if (!spec.ok()) {
    return FinishCall(context, WithPool(request->name(), spec.status()));
  }
  // The token also opens a protected pool this one follows.
  std::optional<std::string> token = OwnerToken(*context);
  // Populating gigabytes takes seconds: done on a registry thread, and the
  // call finished from there, so no gRPC thread waits for it.
  // A reactor of our own: gRPC's default reactor is meant to be finished
  // from the handler (finishing it later from another thread crashed the
  // next call in gRPC 1.51).
  auto* reactor = new OwnedUnaryReactor();
  registry_->CreateInBackground(
      request->name(), *spec, [context] { return context->IsCancelled(); }, request->owner_token(),
      std::move(token),
      [this, reactor, request, response, spec = *spec](absl::StatusOr<std::shared_ptr<Pool>> pool) {
        if (!pool.ok()) {
          spdlog::warn("CreatePool '{}' refused: {}", SafeText(request->name()),
                       SafeText(pool.status().ToString(), kMaxStatusMessageBytes));
          reactor->Finish(ToGrpcStatus(pool.status()));
          return;
        }
        const std::vector<std::string> paths = (*pool)->region_paths();  // none for LOGICAL
        spdlog::info("created pool '{}': {}, {} tokens, {} in {}{}", request->name(),
                     DescribeSpec(spec), (*pool)->size_tokens(), FormatBytesExact((*pool)->bytes()),
                     paths.empty() ? std::string("no region") : absl::StrJoin(paths, ", "),
                     (*pool)->owner_protected() ? ", owner-protected" : "");
        ToProto(**pool, backend_, response);
        reactor->Finish(grpc::Status::OK);
      });
  return reactor;
}

grpc::ServerUnaryReactor* PoolServiceImpl::GetPool(grpc::CallbackServerContext* context,
                                                   const v1::GetPoolRequest* request,
                                                   v1::Pool* response) {
  if (std::optional<CreatingPool> creating = registry_->GetCreating(request->name())) {
    ToProto(*creating, backend_, response);
    return FinishCall(context, absl::OkStatus());
  }
  absl::StatusOr<std::shared_ptr<Pool>> pool = registry_->Get(request->name());
  if (pool.ok()) {
    // A protected pool's region files hold its bytes: named to its owner only.
    const std::optional<std::string> token = OwnerToken(*context);
    ToProto(**pool, backend_, response,
            /*region_paths=*/CheckPoolOwner(**pool, TokenOf(token)).ok());
    SetHolder(**pool, response);
  }
  return FinishCall(context, pool.status());
}

grpc::ServerUnaryReactor* PoolServiceImpl::ListPools(grpc::CallbackServerContext* context,
                                                     const v1::ListPoolsRequest* request,
                                                     v1::ListPoolsResponse* response) {
  // Each pool's entry is small; the running total stops the reply at the limit.
  uint64_t bytes = kReplyOverheadBytes;
  const auto fits = [&](const v1::Pool& added) {
    bytes += AsElement(added);
    return bytes <= static_cast<uint64_t>(max_message_bytes_);
  };
  const absl::Status too_big = absl::ResourceExhaustedError(
      absl::StrCat("ListPools: the pools' reply passes ", max_message_bytes_,
                   " bytes (--max-message-bytes); use GetPool per name"));
  const std::optional<std::string> token = OwnerToken(*context);
  for (const std::shared_ptr<Pool>& pool : registry_->List()) {
    v1::Pool* out = response->add_pools();
    ToProto(*pool, backend_, out,
            /*region_paths=*/CheckPoolOwner(*pool, TokenOf(token)).ok());
    SetHolder(*pool, out);
    if (!fits(*out)) {
      response->Clear();
      return FinishCall(context, too_big);
    }
  }
  // Then the pools still being created (state CREATING).
  for (const CreatingPool& creating : registry_->ListCreating()) {
    v1::Pool* out = response->add_pools();
    ToProto(creating, backend_, out);
    if (!fits(*out)) {
      response->Clear();
      return FinishCall(context, too_big);
    }
  }
  return FinishCall(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* PoolServiceImpl::DeletePool(grpc::CallbackServerContext* context,
                                                      const v1::DeletePoolRequest* request,
                                                      v1::DeletePoolResponse* response) {
  absl::StatusOr<PoolTarget> target =
      registry_->Resolve(request->name(), TokenOf(OwnerToken(*context)));
  if (!target.ok()) return FinishCall(context, target.status());
  // The pool checked, not whatever bears the name now; a group's name is no
  // pool's (NOT_FOUND, as before).
  absl::StatusOr<uint64_t> bytes =
      target->group ? absl::NotFoundError(absl::StrCat("pool '", request->name(), "' not found ('",
                                                       request->name(),
                                                       "' is a pool group: DeletePoolGroup)"))
                    : registry_->Delete(request->name(), target->pool.get());
  if (bytes.ok()) {
    response->set_bytes_released(*bytes);
    spdlog::info("deleted pool '{}' ({})", request->name(), FormatBytesExact(*bytes));
  }
  return FinishCall(context, bytes.status());
}

namespace {

// The slots of `pages` of a pool of page size `ps`, page by page.
void AddSlots(absl::Span<const uint64_t> pages, uint64_t ps,
              google::protobuf::RepeatedField<int64_t>* out) {
  out->Reserve(out->size() + static_cast<int>(pages.size() * ps));
  for (uint64_t page : pages) {
    for (uint64_t j = 0; j < ps; ++j) out->AddAlreadyReserved(static_cast<int64_t>(page * ps + j));
  }
}

}  // namespace

absl::StatusOr<std::shared_ptr<Pool>> PoolServiceImpl::OpenPool(const Caller& caller,
                                                                const std::string& pool,
                                                                const char* counted,
                                                                uint64_t count) const {
  const std::string* token = TokenOf(caller.token);
  if (counted == nullptr) return OpenCallPool(*registry_, pool, token, max_indices_);
  return OpenCallPool(*registry_, pool, token, max_indices_, {{counted, count}});
}

absl::Status PoolServiceImpl::CheckAllocReply(const Pool& pool, uint64_t num_tokens,
                                              uint64_t max_reply_bytes) const {
  // The indices must fit in one response: refuse before allocating, since a
  // response that cannot be sent would leave the slots allocated and unknown.
  const uint64_t size = pool.size_tokens();
  if (num_tokens > size) return absl::OkStatus();  // the allocator refuses it
  using google::protobuf::io::CodedOutputStream;
  const uint64_t response_bytes = num_tokens * CodedOutputStream::VarintSize64(size - 1) + 32;
  if (response_bytes <= max_reply_bytes) return absl::OkStatus();
  return WithPool(pool.name(), absl::ResourceExhaustedError(absl::StrCat(
                                   "num_tokens ", num_tokens, " needs a response of up to ",
                                   response_bytes, " bytes, over the ", max_reply_bytes,
                                   "-byte message limit; allocate in smaller batches")));
}

absl::Status PoolServiceImpl::DoAlloc(const Caller& caller, const v1::AllocRequest& request,
                                      v1::AllocResponse* response, uint64_t max_reply_bytes) {
  absl::StatusOr<std::shared_ptr<Pool>> pool =
      OpenPool(caller, request.pool(), "Alloc num_tokens", request.num_tokens());
  if (!pool.ok()) return pool.status();
  // A group's name acts on its anchor, which the metrics count.
  const std::string& name = (*pool)->name();
  if (metrics_ != nullptr) metrics_->pool_alloc_calls->WithLabels({name})->Increment();
  const auto failed = [&](const absl::Status& status) {
    if (metrics_ != nullptr && !status.ok()) {
      metrics_->pool_alloc_failures->WithLabels({name})->Increment();
    }
    return status;
  };
  if (absl::Status s = CheckAllocReply(**pool, request.num_tokens(), max_reply_bytes); !s.ok()) {
    return failed(s);
  }
  return failed((*pool)->ChangeAllocation(caller.sessions, session_open_, "Alloc", [&] {
    absl::StatusOr<std::vector<uint64_t>> pages = (*pool)->AllocPages(request.num_tokens());
    if (!pages.ok()) return pages.status();
    AddSlots(*pages, (*pool)->layout().page_size, response->mutable_indices());
    response->set_available_tokens((*pool)->allocator().available_tokens());
    return absl::OkStatus();
  }));
}

absl::Status PoolServiceImpl::DoAllocBatch(const Caller& caller,
                                           const v1::AllocBatchRequest& request,
                                           v1::AllocBatchResponse* response,
                                           uint64_t max_reply_bytes) {
  // The sum, without wrapping: each term is checked against the limit first.
  uint64_t total = 0;
  for (uint64_t n : request.num_tokens()) {
    if (absl::Status s = CheckIndexCount("AllocBatch num_tokens", n, max_indices_); !s.ok()) {
      return WithPool(request.pool(), s);
    }
    total += n;
    if (absl::Status s = CheckIndexCount("AllocBatch total num_tokens", total, max_indices_);
        !s.ok()) {
      return WithPool(request.pool(), s);
    }
  }
  absl::StatusOr<std::shared_ptr<Pool>> pool =
      OpenPool(caller, request.pool());  // counts checked above
  if (!pool.ok()) return pool.status();
  Pool& p = **pool;
  const std::string& name = p.name();
  if (metrics_ != nullptr) metrics_->pool_alloc_calls->WithLabels({name})->Increment();
  const auto failed = [&](const absl::Status& status) {
    if (status.ok()) return status;
    if (metrics_ != nullptr) metrics_->pool_alloc_failures->WithLabels({name})->Increment();
    response->Clear();
    return status;
  };
  if (request.num_tokens().empty()) {
    return failed(WithPool(
        name, absl::InvalidArgumentError("AllocBatch names no allocation (num_tokens is empty)")));
  }
  // Every run's framing (tag, length) beside the indices.
  const uint64_t framing = uint64_t{12} * static_cast<uint64_t>(request.num_tokens_size());
  if (absl::Status s =
          CheckAllocReply(p, total, max_reply_bytes - std::min(max_reply_bytes, framing));
      !s.ok()) {
    return failed(s);
  }
  return failed(p.ChangeAllocation(caller.sessions, session_open_, "AllocBatch",
                                   [&] { return AllocRuns(p, request, response); }));
}

absl::Status PoolServiceImpl::AllocRuns(Pool& p, const v1::AllocBatchRequest& request,
                                        v1::AllocBatchResponse* response) {
  const std::string& name = p.name();
  const uint64_t ps = p.layout().page_size;
  std::vector<uint64_t> taken;  // every page allocated so far, to undo
  for (int i = 0; i < request.num_tokens_size(); ++i) {
    absl::StatusOr<std::vector<uint64_t>> pages = p.AllocPages(request.num_tokens(i));
    if (!pages.ok()) {
      std::vector<int64_t> slots;
      slots.reserve(taken.size() * ps);
      for (uint64_t page : taken) {
        for (uint64_t j = 0; j < ps; ++j) slots.push_back(static_cast<int64_t>(page * ps + j));
      }
      if (absl::StatusOr<uint64_t> undone = p.Free(slots); !undone.ok()) {
        spdlog::error(
            "AllocBatch on pool '{}': cannot free the {} slots it allocated before "
            "failing: {}",
            name, slots.size(), undone.status().ToString());
      }
      return absl::Status(pages.status().code(),
                          absl::StrCat("AllocBatch allocation ", i, " of ",
                                       request.num_tokens_size(), ": ", pages.status().message()));
    }
    AddSlots(*pages, ps, response->add_runs()->mutable_indices());
    taken.insert(taken.end(), pages->begin(), pages->end());
  }
  response->set_available_tokens(p.allocator().available_tokens());
  return absl::OkStatus();
}

absl::Status PoolServiceImpl::DoFree(const Caller& caller, const v1::FreeRequest& request,
                                     v1::FreeResponse* response) {
  absl::StatusOr<std::shared_ptr<Pool>> pool =
      OpenPool(caller, request.pool(), "Free indices", request.indices_size());
  if (!pool.ok()) return pool.status();
  if (metrics_ != nullptr) metrics_->pool_free_calls->WithLabels({(*pool)->name()})->Increment();
  return (*pool)->ChangeAllocation(caller.sessions, session_open_, "Free", [&] {
    absl::StatusOr<uint64_t> freed = (*pool)->Free(Indices(request.indices()));
    if (!freed.ok()) return freed.status();
    response->set_freed(*freed);
    response->set_available_tokens((*pool)->allocator().available_tokens());
    return absl::OkStatus();
  });
}

absl::Status PoolServiceImpl::DoClaimPool(const Caller& caller, const v1::ClaimPoolRequest& request,
                                          v1::PoolClaim* response) {
  const std::string& instance = request.instance_id();
  if (instance.empty() || instance.size() > kMaxInstanceIdBytes || !IsPlainText(instance)) {
    return WithPool(request.pool(),
                    absl::InvalidArgumentError(absl::StrCat(
                        "ClaimPool instance_id '", SafeText(instance), "' (", instance.size(),
                        " bytes) must be 1-", kMaxInstanceIdBytes, " printable ASCII characters")));
  }
  absl::StatusOr<std::shared_ptr<Pool>> pool = OpenPool(caller, request.pool());
  if (!pool.ok()) return pool.status();
  // The caller's current session comes first in its metadata.
  const auto session = std::find_if(caller.sessions.begin(), caller.sessions.end(),
                                    [&](const std::string& id) { return session_open_(id); });
  if (session == caller.sessions.end()) {
    return WithPool((*pool)->name(),
                    absl::FailedPreconditionError(
                        "ClaimPool needs the caller's worker session (kvhost-session metadata "
                        "naming an open session; a kvhost client made with a session sends it)"));
  }
  absl::StatusOr<PoolClaimResult> claim = (*pool)->Claim(instance, *session, session_open_);
  if (!claim.ok()) {
    spdlog::warn("ClaimPool '{}' by instance '{}' refused: {}", (*pool)->name(), SafeText(instance),
                 SafeText(claim.status().ToString(), kMaxStatusMessageBytes));
    return claim.status();
  }
  response->set_generation(claim->generation);
  response->set_reclaimed_tokens(claim->reclaimed_tokens);
  response->set_available_tokens((*pool)->allocator().available_tokens());
  response->set_renewed(claim->renewed);
  if (!claim->renewed) {
    spdlog::info("pool '{}' claimed by instance '{}' (generation {}): {} slots reclaimed",
                 (*pool)->name(), SafeText(instance), claim->generation, claim->reclaimed_tokens);
  }
  return absl::OkStatus();
}

void PoolServiceImpl::SetHolder(const Pool& pool, v1::Pool* out) const {
  const PoolHolder holder = pool.holder();
  if (holder.generation == 0) return;
  v1::PoolHolder* h = out->mutable_holder();
  h->set_instance_id(holder.instance_id);
  h->set_generation(holder.generation);
  h->set_live(session_open_(holder.session_id));
}

grpc::ServerUnaryReactor* PoolServiceImpl::Alloc(grpc::CallbackServerContext* context,
                                                 const v1::AllocRequest* request,
                                                 v1::AllocResponse* response) {
  return FinishCall(context, DoAlloc(CallerOf(*context), *request, response, max_message_bytes_));
}

grpc::ServerUnaryReactor* PoolServiceImpl::AllocBatch(grpc::CallbackServerContext* context,
                                                      const v1::AllocBatchRequest* request,
                                                      v1::AllocBatchResponse* response) {
  return FinishCall(context,
                    DoAllocBatch(CallerOf(*context), *request, response, max_message_bytes_));
}

grpc::ServerUnaryReactor* PoolServiceImpl::Free(grpc::CallbackServerContext* context,
                                                const v1::FreeRequest* request,
                                                v1::FreeResponse* response) {
  return FinishCall(context, DoFree(CallerOf(*context), *request, response));
}

grpc::ServerUnaryReactor* PoolServiceImpl::ClaimPool(grpc::CallbackServerContext* context,
                                                     const v1::ClaimPoolRequest* request,
                                                     v1::PoolClaim* response) {
  return FinishCall(context, DoClaimPool(CallerOf(*context), *request, response));
}

grpc::ServerUnaryReactor* PoolServiceImpl::GetPageBufferMeta(
    grpc::CallbackServerContext* context, const v1::GetPageBufferMetaRequest* request,
    v1::PageBufferMeta* response) {
  // Region files and offsets are the pool's data's address: owner-checked.
  absl::StatusOr<std::shared_ptr<Pool>> pool = OpenPool(
      CallerOf(*context), request->pool(), "GetPageBufferMeta indices", request->indices_size());
  if (!pool.ok()) return FinishCall(context, pool.status());
  const Pool& p = **pool;
  const uint64_t fixed = RegionPathsBytes(p) + kReplyOverheadBytes;
  const uint64_t per_page = p.PageBufferMetaEntries(p.page_size());
  if (absl::Status s = CheckReplySize(
          p.name(),
          absl::StrCat("GetPageBufferMeta: ", request->indices_size(), " indices (", per_page,
                       " segments per page)"),
          p.PageBufferMetaEntries(request->indices_size()), MaxRangeBytes(), fixed,
          max_message_bytes_,
          absl::StrCat(
              "split the call: at most ",
              UnitsThatFit(per_page, MaxRangeBytes(), fixed, max_message_bytes_) * p.page_size(),
              " indices per call"));
      !s.ok()) {
    return FinishCall(context, s);
  }
  absl::StatusOr<std::vector<RegionRange>> ranges =
      (*pool)->PageBufferMeta(Indices(request->indices()));
  if (!ranges.ok()) return FinishCall(context, ranges.status());
  ToProto(*ranges, **pool, response);
  return FinishCall(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* PoolServiceImpl::GetDataPage(grpc::CallbackServerContext* context,
                                                       const v1::PageRequest* request,
                                                       v1::PageData* response) {
  absl::StatusOr<std::shared_ptr<Pool>> pool = OpenPool(CallerOf(*context), request->pool());
  if (!pool.ok()) return FinishCall(context, pool.status());
  if (absl::Status s = (*pool)->CheckPage(request->index()); !s.ok()) return FinishCall(context, s);
  const uint64_t bytes = (*pool)->flat_page_bytes();
  if (bytes + kMessageOverheadBytes > static_cast<uint64_t>(max_message_bytes_)) {
    return FinishCall(
        context,
        WithPool((*pool)->name(), absl::ResourceExhaustedError(absl::StrCat(
                                      "a page has ", bytes, " bytes, over the ", max_message_bytes_,
                                      "-byte message limit; use ReadPages"))));
  }
  response->set_index(request->index());
  response->set_page_bytes(bytes);
  std::string* data = response->mutable_data();
  data->resize(bytes);
  return FinishCall(context, (*pool)->ReadPage(request->index(), Bytes(data)));
}

grpc::ServerUnaryReactor* PoolServiceImpl::SetFromFlatDataPage(grpc::CallbackServerContext* context,
                                                               const v1::SetPageRequest* request,
                                                               v1::SetPageResponse* response) {
  const Caller caller = CallerOf(*context);
  absl::StatusOr<std::shared_ptr<Pool>> pool = OpenPool(caller, request->pool());
  if (!pool.ok()) return FinishCall(context, pool.status());
  // WritePage checks the page and the data's size first.
  return FinishCall(
      context,
      (*pool)->ChangeAllocation(caller.sessions, session_open_, "SetFromFlatDataPage", [&] {
        return (*pool)->WritePage(request->index(), Bytes(request->data()));
      }));
}

grpc::ServerWriteReactor<v1::PageData>* PoolServiceImpl::ReadPages(
    grpc::CallbackServerContext* context, const v1::ReadPagesRequest* request) {
  // Half the message limit leaves room for the message's other fields and
  // keeps a chunk well inside what either side accepts.
  return NewPageReader(
      registry_, *request, static_cast<uint64_t>(max_message_bytes_) / 2,
      OpenPool(CallerOf(*context), request->pool(), "ReadPages indices", request->indices_size()));
}

grpc::ServerReadReactor<v1::WritePagesChunk>* PoolServiceImpl::WritePages(
    grpc::CallbackServerContext* context, v1::WritePagesResponse* response) {
  const Caller caller = CallerOf(*context);
  return NewPageWriter(registry_, response, caller.token, max_indices_, caller.sessions,
                       session_open_);
}

grpc::ServerUnaryReactor* PoolServiceImpl::GetPageShape(grpc::CallbackServerContext* context,
                                                        const v1::GetPageShapeRequest* request,
                                                        v1::PageShape* response) {
  absl::StatusOr<std::shared_ptr<Pool>> pool = registry_->GetPoolOrAnchor(request->pool());
  if (!pool.ok()) return FinishCall(context, pool.status());
  if (absl::Status s =
          CheckReplySize((*pool)->name(), "GetPageShape: the page's parts",
                         (*pool)->components().size(), MaxPagePartBytes(**pool),
                         kReplyOverheadBytes, max_message_bytes_, "raise --max-message-bytes");
      !s.ok()) {
    return FinishCall(context, s);
  }
  absl::StatusOr<std::vector<PagePart>> parts = (*pool)->PageShape();
  if (!parts.ok()) return FinishCall(context, parts.status());
  uint64_t bytes = 0;
  for (const PagePart& part : *parts) {
    v1::PageShape::Part* out = response->add_parts();
    out->set_component(part.component);
    for (uint64_t d : part.dims) out->add_dims(d);
    out->set_dtype(static_cast<v1::DType>(part.dtype));
    out->set_bytes(part.bytes);
    bytes += part.bytes;
  }
  response->set_bytes(bytes);
  return FinishCall(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* PoolServiceImpl::GetSplitHeadsPageBufferMeta(
    grpc::CallbackServerContext* context, const v1::SplitHeadsMetaRequest* request,
    v1::PageBufferMeta* response) {
  absl::StatusOr<std::shared_ptr<Pool>> pool =
      OpenPool(CallerOf(*context), request->pool(), "GetSplitHeadsPageBufferMeta indices",
               request->indices_size());
  if (!pool.ok()) return FinishCall(context, pool.status());
  const Pool& p = **pool;
  const uint64_t fixed = RegionPathsBytes(p) + kReplyOverheadBytes;
  const uint64_t per_page = p.SplitHeadsMetaEntries(p.page_size(), request->split_factor());
  if (absl::Status s = CheckReplySize(
          p.name(),
          absl::StrCat("GetSplitHeadsPageBufferMeta: ", request->indices_size(), " indices (",
                       per_page, " segments per page)"),
          p.SplitHeadsMetaEntries(request->indices_size(), request->split_factor()),
          MaxRangeBytes(), fixed, max_message_bytes_,
          absl::StrCat(
              "split the call: at most ",
              UnitsThatFit(per_page, MaxRangeBytes(), fixed, max_message_bytes_) * p.page_size(),
              " indices per call"));
      !s.ok()) {
    return FinishCall(context, s);
  }
  absl::StatusOr<std::vector<RegionRange>> ranges =
      (*pool)->SplitHeadsMeta(Indices(request->indices()), request->split_factor());
  if (!ranges.ok()) return FinishCall(context, ranges.status());
  ToProto(*ranges, **pool, response);
  return FinishCall(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* PoolServiceImpl::IsStridePageAligned(
    grpc::CallbackServerContext* context, const v1::StrideAlignmentRequest* request,
    v1::StrideAlignment* response) {
  absl::StatusOr<std::shared_ptr<Pool>> pool = registry_->GetPoolOrAnchor(request->pool());
  if (!pool.ok()) return FinishCall(context, pool.status());
  absl::StatusOr<StrideCheck> check = (*pool)->StrideAlignment(request->alignment());
  if (!check.ok()) return FinishCall(context, check.status());
  response->set_aligned(check->aligned);
  for (uint64_t stride : check->page_strides) response->add_page_strides(stride);
  return FinishCall(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* PoolServiceImpl::GetContiguousBufferInfos(
    grpc::CallbackServerContext* context, const v1::ContiguousBufferInfosRequest* request,
    v1::ContiguousBufferInfos* response) {
  absl::StatusOr<std::shared_ptr<Pool>> pool = OpenPool(CallerOf(*context), request->pool());
  if (!pool.ok()) return FinishCall(context, pool.status());
  if (absl::Status s =
          CheckReplySize((*pool)->name(),
                         absl::StrCat("GetContiguousBufferInfos: ", (*pool)->spec().layer_num,
                                      " layers x ", (*pool)->components().size(), " components"),
                         (*pool)->ContiguousBufferInfoEntries(), MaxBufferInfoBytes(**pool),
                         RegionPathsBytes(**pool) + kReplyOverheadBytes, max_message_bytes_,
                         "the call cannot be split; raise --max-message-bytes");
      !s.ok()) {
    return FinishCall(context, s);
  }
  absl::StatusOr<std::vector<BufferInfo>> infos = (*pool)->ContiguousBufferInfos();
  if (!infos.ok()) return FinishCall(context, infos.status());
  for (const std::string& path : (*pool)->region_paths()) response->add_region_paths(path);
  for (const BufferInfo& info : *infos) {
    v1::ContiguousBufferInfo* out = response->add_infos();
    out->set_component(info.component);
    out->set_layer(info.layer);
    out->set_region_index(info.range.region);
    out->set_offset(info.range.offset);
    out->set_length(info.range.length);
    out->set_item_bytes(info.item_bytes);
  }
  return FinishCall(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* PoolServiceImpl::CreatePoolGroup(
    grpc::CallbackServerContext* context, const v1::CreatePoolGroupRequest* request,
    v1::PoolGroup* response) {
  // A group whose replies (its layer maps spelled out) could not be sent is
  // never created.
  std::vector<GroupEntrySpec> specs = FromProto(request->entries());
  std::vector<std::pair<std::string, std::string>> names;
  for (const GroupEntrySpec& e : specs) names.emplace_back(e.name, e.pool);
  const uint64_t max_values = EntriesThatFit(
      kLayerMapValueBytes,
      GroupShellBytes(request->name(), request->layer_num(), names) + kReplyOverheadBytes,
      max_message_bytes_);
  absl::StatusOr<std::shared_ptr<PoolGroup>> group = registry_->CreateGroup(
      request->name(), request->layer_num(), specs, max_values, TokenOf(OwnerToken(*context)));
  if (!group.ok()) {
    spdlog::warn("CreatePoolGroup '{}' refused: {}", SafeText(request->name()),
                 SafeText(group.status().ToString(), kMaxStatusMessageBytes));
    return FinishCall(context, group.status());
  }
  ToProto(**group, response);
  std::vector<std::string> entries;
  for (const GroupEntry& e : (*group)->entries()) {
    entries.push_back(absl::StrCat(e.name, "=", e.pool->name()));
  }
  spdlog::info("created pool group '{}': {} model layers, entries {}, anchor '{}'", request->name(),
               request->layer_num(), absl::StrJoin(entries, ", "), (*group)->anchor().name);
  return FinishCall(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* PoolServiceImpl::GetPoolGroup(grpc::CallbackServerContext* context,
                                                        const v1::GetPoolGroupRequest* request,
                                                        v1::PoolGroup* response) {
  absl::StatusOr<std::shared_ptr<PoolGroup>> group = registry_->GetGroup(request->name());
  if (!group.ok()) return FinishCall(context, group.status());
  // CreatePoolGroup admits only groups that fit; this holds the line should
  // the limit differ (a daemon restarted with a smaller one keeps no groups).
  const uint64_t bytes = GroupReplyBytes(**group) + kReplyOverheadBytes;
  if (bytes > static_cast<uint64_t>(max_message_bytes_)) {
    return FinishCall(context, absl::ResourceExhaustedError(absl::StrCat(
                                   "group '", request->name(), "': its reply needs up to ", bytes,
                                   " bytes, over the ", max_message_bytes_,
                                   "-byte message limit (--max-message-bytes)")));
  }
  ToProto(**group, response);
  return FinishCall(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* PoolServiceImpl::ListPoolGroups(grpc::CallbackServerContext* context,
                                                          const v1::ListPoolGroupsRequest* request,
                                                          v1::ListPoolGroupsResponse* response) {
  const std::vector<std::shared_ptr<PoolGroup>> groups = registry_->ListGroups();
  uint64_t bytes = kReplyOverheadBytes;  // the sum of each group's bound, element framed
  for (const std::shared_ptr<PoolGroup>& group : groups) {
    const uint64_t one = GroupReplyBytes(*group);
    bytes += 1 + CodedOutputStream::VarintSize64(one) + one;
  }
  if (bytes > static_cast<uint64_t>(max_message_bytes_)) {
    return FinishCall(
        context, absl::ResourceExhaustedError(absl::StrCat(
                     "ListPoolGroups: ", groups.size(), " groups need a reply of up to ", bytes,
                     " bytes, over the ", max_message_bytes_,
                     "-byte message limit (--max-message-bytes); use GetPoolGroup "
                     "per name")));
  }
  for (const std::shared_ptr<PoolGroup>& group : groups) ToProto(*group, response->add_groups());
  return FinishCall(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* PoolServiceImpl::DeletePoolGroup(
    grpc::CallbackServerContext* context, const v1::DeletePoolGroupRequest* request,
    v1::DeletePoolGroupResponse* response) {
  absl::StatusOr<PoolTarget> target =
      registry_->Resolve(request->name(), TokenOf(OwnerToken(*context)));
  if (!target.ok()) return FinishCall(context, target.status());
  // The group checked, not whatever bears the name now; a pool's name is no
  // group's.
  absl::Status status =
      target->group ? registry_->DeleteGroup(request->name(), target->group.get())
                    : absl::NotFoundError(absl::StrCat("group '", request->name(), "' not found"));
  if (status.ok()) spdlog::info("deleted pool group '{}'", request->name());
  return FinishCall(context, status);
}

}  // namespace kvhost
