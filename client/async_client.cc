// kvhost::AsyncClient (kvhost/async_client.h): the queue, its executor
// thread, and the typed calls over Client.
#include "kvhost/async_client.h"

#include <cstdio>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace kvhost {

AsyncClient::AsyncClient(Client* client, AsyncClientOptions options)
    : client_(client), options_(options) {
  executor_ = std::thread([this] { Loop(); });
}

AsyncClient::~AsyncClient() { Close(); }

void AsyncClient::Close() {
  absl::MutexLock close_lock(&close_mu_);
  if (!executor_.joinable()) return;
  if (std::this_thread::get_id() == executor_.get_id()) {
    // Joining itself would throw inside a destructor; say why before dying.
    std::fprintf(stderr,
                 "kvhost::AsyncClient closed or destroyed from one of its own callbacks; "
                 "callbacks must not do that (kvhost/async_client.h)\n");
    std::abort();
  }
  {
    absl::MutexLock lock(&mu_);
    closing_ = true;
  }
  executor_.join();
}

absl::Status AsyncClient::Enqueue(Job job) {
  absl::MutexLock lock(&mu_);
  if (closing_) {
    return absl::CancelledError("kvhost::AsyncClient is closed; the call was not submitted");
  }
  if (queue_.size() >= options_.max_queued) {
    return absl::ResourceExhaustedError(
        absl::StrCat("kvhost::AsyncClient's queue holds ", queue_.size(), " calls, its bound (",
                     options_.max_queued, "); wait for completions before submitting more"));
  }
  queue_.push_back(std::move(job));
  submitted_.fetch_add(1, std::memory_order_acq_rel);
  return absl::OkStatus();
}

void AsyncClient::Loop() {
  while (true) {
    Job job;
    bool cancel = false;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return !queue_.empty() || closing_; };
      mu_.Await(absl::Condition(&ready));
      if (queue_.empty()) return;  // closing, nothing left
      job = std::move(queue_.front());
      queue_.pop_front();
      cancel = closing_;
    }
    if (cancel) {
      job.cancel(absl::CancelledError(
          "kvhost::AsyncClient was closed before the call ran; it was not sent"));
    } else {
      job.run();
    }
    // Under mu_, so that WaitCompleted's Await sees the change.
    absl::MutexLock lock(&mu_);
    completed_.fetch_add(1, std::memory_order_acq_rel);
  }
}

absl::Status AsyncClient::WaitCompleted(uint64_t count, absl::Duration timeout) const {
  absl::MutexLock lock(&mu_);
  auto reached = [this, count]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return completed() >= count; };
  // AwaitWithDeadline: Debian's AwaitWithTimeout calls it, which the TSan
  // shim (tools/sanitizers/tsan_absl_sync.cc) would annotate twice.
  if (mu_.AwaitWithDeadline(absl::Condition(&reached), absl::Now() + timeout)) {
    return absl::OkStatus();
  }
  return absl::DeadlineExceededError(absl::StrCat("kvhost::AsyncClient: ", completed(), " of ",
                                                  count, " calls completed within ",
                                                  absl::FormatDuration(timeout)));
}

std::future<absl::StatusOr<std::vector<int64_t>>> AsyncClient::Alloc(
    std::string pool, uint64_t num_tokens, Callback<std::vector<int64_t>> on_done) {
  return Submit<std::vector<int64_t>>([client = client_, pool = std::move(pool),
                                       num_tokens] { return client->Alloc(pool, num_tokens); },
                                      std::move(on_done));
}

std::future<absl::StatusOr<uint64_t>> AsyncClient::Free(std::string pool,
                                                        absl::Span<const int64_t> indices,
                                                        Callback<uint64_t> on_done) {
  return Submit<uint64_t>(
      [client = client_, pool = std::move(pool),
       indices = std::vector<int64_t>(indices.begin(), indices.end())] {
        return client->Free(pool, indices);
      },
      std::move(on_done));
}

std::future<absl::StatusOr<v1::TransferTicket>> AsyncClient::SubmitBackup(
    const v1::BackupRequest& request, Callback<v1::TransferTicket> on_done) {
  return Submit<v1::TransferTicket>(
      [client = client_, request] { return client->SubmitBackup(request); }, std::move(on_done));
}

std::future<absl::StatusOr<v1::TransferTicket>> AsyncClient::SubmitLoad(
    const v1::LoadRequest& request, Callback<v1::TransferTicket> on_done) {
  return Submit<v1::TransferTicket>(
      [client = client_, request] { return client->SubmitLoad(request); }, std::move(on_done));
}

std::future<absl::StatusOr<v1::TransferStatus>> AsyncClient::WaitTransfer(
    uint64_t ticket_id, absl::Duration timeout, Callback<v1::TransferStatus> on_done) {
  return Submit<v1::TransferStatus>(
      [client = client_, ticket_id, timeout] { return client->WaitTransfer(ticket_id, timeout); },
      std::move(on_done));
}

}  // namespace kvhost
