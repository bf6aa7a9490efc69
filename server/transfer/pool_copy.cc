// Pool-to-pool copies (contract: pool_copy.h).
#include "server/transfer/pool_copy.h"

#include <cstring>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/transfer/attach.h"
#include "server/transfer/engine.h"
#include "server/transfer/runs.h"

namespace kvhost {
namespace {

absl::Status ShapeDiffers(const Pool& pool, const Pool& cache, const std::string& what,
                          const std::string& got, const std::string& want) {
  return absl::InvalidArgumentError(absl::StrCat(PoolWhat(pool), " is not of the shape of cache ",
                                                 PoolWhat(cache), ": its ", what, " is ", got,
                                                 ", the cache's ", want));
}

// The runs of `slots` against rows 0, 1, ... of a row buffer, in rows of
// component `c` (pages for a page-row component).
std::vector<IndexRun> RowRuns(const Component& c, absl::Span<const int64_t> slots) {
  std::vector<int64_t> rows(slots.size());
  for (size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<int64_t>(i);
  std::vector<IndexRun> runs = CoalesceRuns(slots, rows);
  return c.row_tokens > 1 ? PageRuns(runs, c.row_tokens) : runs;
}

}  // namespace

absl::Status CheckPoolCopyShape(const Pool& pool, const Pool& cache) {
  const PoolSpec& a = pool.spec();
  const PoolSpec& b = cache.spec();
  if (a.kind != b.kind)
    return ShapeDiffers(pool, cache, "kind", PoolKindName(a.kind), PoolKindName(b.kind));
  if (pool.components().empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(PoolWhat(pool), " holds no bytes (LOGICAL): nothing to copy to or from"));
  }
  if (a.dtype != b.dtype) {
    return ShapeDiffers(pool, cache, "dtype", DTypeName(a.dtype), DTypeName(b.dtype));
  }
  if (pool.page_size() != cache.page_size()) {
    return ShapeDiffers(pool, cache, "page size", absl::StrCat(pool.page_size()),
                        absl::StrCat(cache.page_size()));
  }
  if (pool.start_layer() != cache.start_layer() || pool.end_layer() != cache.end_layer()) {
    return ShapeDiffers(pool, cache, "layer range",
                        absl::StrCat("[", pool.start_layer(), ", ", pool.end_layer(), ")"),
                        absl::StrCat("[", cache.start_layer(), ", ", cache.end_layer(), ")"));
  }
  const std::vector<Component>& x = pool.components();
  const std::vector<Component>& y = cache.components();
  if (x.size() != y.size()) {
    return ShapeDiffers(pool, cache, "component count", absl::StrCat(x.size()),
                        absl::StrCat(y.size()));
  }
  for (size_t c = 0; c < x.size(); ++c) {
    if (x[c].name != y[c].name || x[c].row_bytes() != y[c].row_bytes() ||
        x[c].row_tokens != y[c].row_tokens) {
      return ShapeDiffers(pool, cache, absl::StrCat("component ", c),
                          absl::StrCat("'", x[c].name, "' (", x[c].row_bytes(), " bytes a row of ",
                                       x[c].row_tokens, " token(s))"),
                          absl::StrCat("'", y[c].name, "' (", y[c].row_bytes(), " bytes a row of ",
                                       y[c].row_tokens, " token(s))"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckPoolCopySlots(const Pool& pool, absl::Span<const int64_t> slots,
                                const char* field) {
  for (size_t i = 0; i < slots.size(); ++i) {
    if (slots[i] < 0 || static_cast<uint64_t>(slots[i]) >= pool.size_tokens()) {
      return absl::InvalidArgumentError(absl::StrCat(field, "[", i, "] = ", slots[i],
                                                     " out of range [0, ", pool.size_tokens(),
                                                     ") for pool '", pool.name(), "'"));
    }
  }
  if (absl::Status s = CheckWholePages(slots, pool.page_size(), field, PoolWhat(pool)); !s.ok()) {
    return s;
  }
  if (absl::Status s = CheckNoOverlap(CoalesceRuns(slots, slots), /*host_side=*/true,
                                      absl::StrCat(field, ": slot").c_str());
      !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("pool '", pool.name(), "': ", s.message()));
  }
  const Pool& owner = *pool.allocator_owner();
  if (absl::Status s = owner.allocator().CheckAllocated(slots); !s.ok()) {
    return WithPool(pool.name(), s);
  }
  return absl::OkStatus();
}

absl::Status RunPoolCopy(const PoolCopyJob& job) {
  const std::vector<Component>& from = job.from->components();
  const std::vector<Component>& to = job.to->components();
  std::vector<std::vector<IndexRun>> from_runs, to_runs;
  for (size_t c = 0; c < from.size(); ++c) {
    from_runs.push_back(RowRuns(from[c], job.from_slots));
    to_runs.push_back(RowRuns(to[c], job.to_slots));
  }
  const uint64_t tokens = job.from_slots.size();
  const uint64_t layer_bytes = HeldLayerBytes(*job.from, tokens);
  std::vector<uint8_t> rows;
  for (uint32_t l = 0; l < job.from->spec().layer_num; ++l) {
    if (absl::Status cancel = job.ticket->CancelReason(); !cancel.ok()) return cancel;
    for (size_t c = 0; c < from.size(); ++c) {
      rows.resize(tokens / from[c].row_tokens * from[c].row_bytes());
      const uint8_t* src = job.from->component_base(c);
      for (const IndexRun& run : from_runs[c]) {
        ForEachPiece(from[c], l, run, 0, run.count, [&](uint64_t host, uint64_t row, uint64_t n) {
          std::memcpy(rows.data() + row, src + host, n);
        });
      }
      uint8_t* dst = job.to->component_base(c);
      for (const IndexRun& run : to_runs[c]) {
        ForEachPiece(to[c], l, run, 0, run.count, [&](uint64_t host, uint64_t row, uint64_t n) {
          std::memcpy(dst + host, rows.data() + row, n);
        });
      }
    }
    job.ticket->LayerFinished(layer_bytes);
  }
  return absl::OkStatus();
}

PoolCopier::PoolCopier() : thread_([this] { Loop(); }) {}

PoolCopier::~PoolCopier() {
  Drain();
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  thread_.join();
}

void PoolCopier::Submit(PoolCopyJob job) {
  if (job.from_use == nullptr) job.from_use = job.from->UseSlots();
  if (job.to_use == nullptr) job.to_use = job.to->UseSlots();
  absl::MutexLock lock(&mu_);
  queue_.push_back(std::move(job));
}

void PoolCopier::Drain() {
  absl::MutexLock lock(&mu_);
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return queue_.empty() && !busy_; };
  mu_.Await(absl::Condition(&idle));
}

void PoolCopier::Loop() {
  while (true) {
    PoolCopyJob job;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]()
                       ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !queue_.empty() || stopping_; };
      mu_.Await(absl::Condition(&ready));
      if (queue_.empty()) return;
      job = std::move(queue_.front());
      queue_.pop_front();
      busy_ = true;
    }
    absl::Status status = RunPoolCopy(job);
    std::shared_ptr<Ticket> ticket = std::move(job.ticket);
    job = PoolCopyJob();  // the pools go before the ticket shows done
    ticket->Finish(std::move(status));
    ticket.reset();
    absl::MutexLock lock(&mu_);
    busy_ = false;
  }
}

}  // namespace kvhost
