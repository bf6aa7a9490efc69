#include "server/transfer/transfer_manager.h"

#include <unistd.h>

#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"

namespace kvhost {
namespace {

absl::Status CheckRange(absl::Span<const int64_t> indices, uint64_t limit, const char* field,
                        const std::string& what) {
  for (size_t i = 0; i < indices.size(); ++i) {
    if (indices[i] < 0 || static_cast<uint64_t>(indices[i]) >= limit) {
      return absl::InvalidArgumentError(absl::StrCat(field, "[", i, "] = ", indices[i],
                                                     " out of range [0, ", limit, ") for ", what));
    }
  }
  return absl::OkStatus();
}

}  // namespace

TransferManager::TransferManager(PoolRegistry* registry, std::unique_ptr<TransferEngine> engine,
                                 KvhostMetrics* metrics)
    : registry_(registry), metrics_(metrics), engine_(std::move(engine)) {}

TransferManager::~TransferManager() { Drain(); }

absl::StatusOr<AttachmentInfo> TransferManager::Attach(const std::string& pool_name,
                                                       const AttachRequest& request) {
  absl::StatusOr<std::shared_ptr<Pool>> pool = registry_->Get(pool_name);
  if (!pool.ok()) return pool.status();
  const PoolSpec& spec = (*pool)->spec();
  const size_t layers = spec.layer_num;
  const size_t want_v = PlaneCount(spec) == 2 ? layers : 0;
  if (request.k_layers.size() != layers) {
    return absl::InvalidArgumentError(absl::StrCat("k_layers has ", request.k_layers.size(),
                                                   " buffers but pool '", pool_name, "' has ",
                                                   layers, " layers"));
  }
  if (request.v_layers.size() != want_v) {
    return absl::InvalidArgumentError(absl::StrCat("v_layers has ", request.v_layers.size(),
                                                   " buffers but pool '", pool_name, "' (",
                                                   PoolKindName(spec.kind), ") needs ", want_v));
  }
  if (request.device_size_tokens == 0) {
    return absl::InvalidArgumentError("device_size_tokens must be >= 1");
  }
  if (request.device_size_tokens > (uint64_t{1} << 40)) {
    return absl::InvalidArgumentError(
        absl::StrCat("device_size_tokens ", request.device_size_tokens, " is too large"));
  }
  // A layer buffer's size (rows x row bytes) must not wrap, or the engine's
  // size check passes for any file and device offsets run past its end.
  const uint64_t row_bytes = (*pool)->layout().token_bytes;
  if (request.device_size_tokens > std::numeric_limits<uint64_t>::max() / row_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("device_size_tokens ",
                                                   request.device_size_tokens, " x ", row_bytes,
                                                   " bytes per row is too large"));
  }
  if (request.load_event_sets > kMaxLoadEventSets) {
    return absl::InvalidArgumentError(absl::StrCat("load_event_sets ", request.load_event_sets,
                                                   " is above the limit of ", kMaxLoadEventSets));
  }
  AttachRequest with_defaults = request;
  if (with_defaults.load_event_sets == 0) with_defaults.load_event_sets = kDefaultLoadEventSets;
  if (absl::Status s = (*pool)->AcquireAttachment(); !s.ok()) return s;
  absl::StatusOr<std::unique_ptr<DeviceMapping>> device = engine_->Open(**pool, with_defaults);
  if (!device.ok()) {
    (*pool)->ReleaseAttachment();
    return WithPool(pool_name, device.status());
  }
  Attachment attachment;
  attachment.info.id = absl::StrCat("att-", ::getpid(), "-", next_attachment_++);
  attachment.info.pool = pool_name;
  attachment.info.device_size_tokens = request.device_size_tokens;
  attachment.pool = *pool;
  attachment.device = std::shared_ptr<const DeviceMapping>(*std::move(device));
  attachment.info.load_event_handles = attachment.device->load_event_handles();
  attachment.info.load_event_sets = attachment.device->load_event_sets();
  AttachmentInfo info = attachment.info;
  {
    absl::MutexLock lock(&mu_);
    attachments_.emplace(info.id, std::move(attachment));
  }
  spdlog::info("attached {} to pool '{}' ({} layers, {} device rows, {} backend)", info.id,
               pool_name, layers, request.device_size_tokens, engine_->name());
  return info;
}

absl::Status TransferManager::Detach(const std::string& attachment_id) {
  Attachment attachment;
  {
    absl::MutexLock lock(&mu_);
    auto it = attachments_.find(attachment_id);
    if (it == attachments_.end()) {
      return absl::NotFoundError(absl::StrCat("attachment '", attachment_id, "' not found"));
    }
    attachment = std::move(it->second);
    attachments_.erase(it);
  }
  // Jobs in flight hold the pool and the mapping; the pool can be deleted now
  // and its memory goes when they finish.
  attachment.pool->ReleaseAttachment();
  spdlog::info("detached {} from pool '{}'", attachment_id, attachment.info.pool);
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<TransferTicket>> TransferManager::Submit(
    const std::string& attachment_id, Direction direction, absl::Span<const int64_t> host,
    absl::Span<const int64_t> device, const std::string& wait_event_handle) {
  TransferJob job;
  job.direction = direction;
  job.wait_event_handle = wait_event_handle;
  {
    absl::MutexLock lock(&mu_);
    if (draining_) return absl::UnavailableError("kvhostd is shutting down; transfer refused");
    auto it = attachments_.find(attachment_id);
    if (it == attachments_.end()) {
      return absl::NotFoundError(absl::StrCat("attachment '", attachment_id, "' not found"));
    }
    job.pool = it->second.pool;
    job.device = it->second.device;
  }
  const Pool& pool = *job.pool;
  if (host.size() != device.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "host_indices has ", host.size(), " entries but device_indices has ", device.size()));
  }
  const std::string pool_what = absl::StrCat("pool '", pool.name(), "'");
  if (absl::Status s = CheckRange(host, pool.size_tokens(), "host_indices", pool_what); !s.ok()) {
    return s;
  }
  if (absl::Status s = CheckRange(device, job.device->rows().rows, "device_indices",
                                  absl::StrCat("attachment '", attachment_id, "'"));
      !s.ok()) {
    return s;
  }
  job.runs = CoalesceRuns(host, device);
  const bool backup = direction == Direction::kBackup;
  if (absl::Status s =
          CheckNoOverlap(job.runs, /*host_side=*/backup, backup ? "host slot" : "device row");
      !s.ok()) {
    return s;
  }
  if (absl::Status s = pool.allocator().CheckAllocated(host); !s.ok()) {
    return WithPool(pool.name(), s);
  }
  job.tokens = host.size();
  const uint64_t bytes =
      job.tokens * pool.layout().token_bytes * pool.layout().planes * pool.layout().layers;
  // Last, since what it reserves is released only by the job's end.
  if (absl::Status s = engine_->Prepare(&job); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("attachment '", attachment_id, "': ", s.message()));
  }
  job.ticket = std::make_shared<TransferTicket>(next_ticket_++, direction,
                                                static_cast<uint32_t>(pool.layout().layers),
                                                engine_->PathFor(job), job.event_set);
  std::shared_ptr<TransferTicket> ticket = job.ticket;
  {
    absl::MutexLock lock(&mu_);
    tickets_[ticket->id()] = ticket;
    ++counters_.tickets_in_flight;
  }
  ticket->OnDone([this, ticket, bytes, direction, pool_name = pool.name()] {
    Retire(ticket, bytes, direction, pool_name);
  });
  if (job.tokens == 0) {
    for (uint64_t l = 0; l < pool.layout().layers; ++l) ticket->LayerDone(0);
    ticket->Finish(absl::OkStatus());
    return ticket;
  }
  spdlog::debug("ticket {}: {} of {} tokens in {} runs, pool '{}', {}", ticket->id(),
                DirectionName(direction), job.tokens, job.runs.size(), pool.name(),
                ticket->Snapshot().path);
  engine_->Submit(std::move(job));
  ticket->Enqueued();
  return ticket;
}

void TransferManager::Retire(const std::shared_ptr<TransferTicket>& ticket, uint64_t bytes,
                             Direction direction, const std::string& pool) {
  const TicketStatus status = ticket->Snapshot();
  if (!status.status.ok()) {
    spdlog::warn("ticket {} ({}) failed: {}", ticket->id(), DirectionName(direction),
                 status.status.ToString());
  }
  if (metrics_ != nullptr) {
    const LabelValues labels = {pool, DirectionName(direction), status.path};
    if (status.status.ok()) {
      metrics_->transfer_bytes->WithLabels(labels)->Increment(bytes);
      metrics_->transfer_tickets_done->WithLabels(labels)->Increment();
    } else {
      metrics_->transfer_tickets_failed->WithLabels(labels)->Increment();
    }
    metrics_->transfer_seconds->WithLabels(labels)->Observe(status.duration_us / 1e6);
  }
  absl::MutexLock lock(&mu_);
  --counters_.tickets_in_flight;
  if (status.status.ok()) {
    ++counters_.tickets_done;
    counters_.bytes[static_cast<int>(direction)] += bytes;
  } else {
    ++counters_.tickets_failed;
  }
  finished_.push_back(ticket->id());
  while (finished_.size() > kRetainedTickets) {
    tickets_.erase(finished_.front());
    finished_.pop_front();
  }
}

absl::StatusOr<std::shared_ptr<TransferTicket>> TransferManager::FindTicket(uint64_t id) const {
  absl::MutexLock lock(&mu_);
  auto it = tickets_.find(id);
  if (it == tickets_.end()) {
    return absl::NotFoundError(absl::StrCat("ticket ", id, " is unknown or expired (the last ",
                                            kRetainedTickets, " finished tickets are kept)"));
  }
  return it->second;
}

void TransferManager::Drain() {
  {
    absl::MutexLock lock(&mu_);
    draining_ = true;
  }
  engine_->Drain();
}

std::vector<AttachmentInfo> TransferManager::ListAttachments() const {
  absl::MutexLock lock(&mu_);
  std::vector<AttachmentInfo> out;
  for (const auto& [id, attachment] : attachments_) out.push_back(attachment.info);
  return out;
}

TransferCounters TransferManager::counters() const {
  absl::MutexLock lock(&mu_);
  return counters_;
}

}  // namespace kvhost
