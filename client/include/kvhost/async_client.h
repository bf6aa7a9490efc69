// kvhost::AsyncClient: kvhost::Client's calls submitted without blocking the
// caller, for a scheduler whose thread must not wait on an RPC (what sglang's
// HiCache controller does with its ack queues).
//
// One executor thread, started by the constructor, runs the submitted calls
// one at a time in the order they were submitted (FIFO), each a blocking
// call of the Client underneath. So an Alloc submitted before a Backup that
// uses its slots reaches the daemon first, and a call that was submitted
// k-th completes k-th: completed() >= k means the first k are done.
// Each call completes three ways at once, in this order: its `on_done`
// callback (if any) runs, its std::future becomes ready, and completed()
// counts it. A call that fails completes with the daemon's (or the
// client's) code and message, as the synchronous call would have returned.
//
// Bounds: at most AsyncClientOptions::max_queued calls wait in the queue
// (not counting the one running); one more is refused: its future is ready
// at once with RESOURCE_EXHAUSTED naming the bound, its `on_done` is not
// called, and it counts in neither submitted() nor completed().
//
// Callbacks run on the executor thread, so they hold up every call behind
// them. REQUIRES of a callback: it does not block (no waiting on a future or
// on WaitCompleted of this AsyncClient: the executor would wait on itself),
// it does not throw, and it does not destroy or Close() this AsyncClient.
// It may Submit more calls.
//
// Close() (and the destructor) stops accepting calls, lets the call that is
// running finish (a blocking RPC cannot be taken back), completes every call
// still queued with CANCELLED (callbacks, futures and completed() as for any
// other completion, on the executor thread), then joins the executor. To
// have the queued calls run instead, wait for them first:
// WaitCompleted(submitted(), timeout).
//
// Thread safety: every method may be called from any thread at once.
// Ownership: the Client is the caller's and must outlive the AsyncClient;
// the calls share it with the caller's own synchronous calls.
//
//   kvhost::AsyncClient async(client.get());
//   auto slots = async.Alloc("llama", 64);   // returns at once
//   auto freed = async.Free("llama", old_slots, [](const auto& r) { ... });
//   ...
//   absl::StatusOr<std::vector<int64_t>> got = slots.get();
#ifndef KVHOST_CLIENT_ASYNC_CLIENT_H_
#define KVHOST_CLIENT_ASYNC_CLIENT_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <future>
#include <memory>
#include <new>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kvhost/client.h"

namespace kvhost {

// The default bound of the queue: far above what a scheduler has in flight
// (a step submits a few calls per request, a batch a few hundred requests),
// and small enough that a stalled daemon cannot make the queue hold more
// than a few MiB of calls.
inline constexpr size_t kMaxQueuedCalls = 65536;

struct AsyncClientOptions {
  // Calls that may wait in the queue; one more is RESOURCE_EXHAUSTED.
  size_t max_queued = kMaxQueuedCalls;
};

class AsyncClient {
 public:
  // REQUIRES: `client` is not null and outlives this object.
  explicit AsyncClient(Client* client, AsyncClientOptions options = {});
  // Close().
  ~AsyncClient();
  AsyncClient(const AsyncClient&) = delete;
  AsyncClient& operator=(const AsyncClient&) = delete;

  // Queues `call` to run on the executor after every call submitted before
  // it. `on_done` (may be empty) is called with its result on the executor
  // thread before the future is ready. An exception thrown by `call` is its
  // result as INTERNAL (RESOURCE_EXHAUSTED for std::bad_alloc). Refused
  // (a ready future, no callback, not counted): an empty `call`
  // (INVALID_ARGUMENT), a full queue (RESOURCE_EXHAUSTED), a closed
  // AsyncClient (CANCELLED).
  template <typename T>
  std::future<absl::StatusOr<T>> Submit(
      std::function<absl::StatusOr<T>()> call,
      std::function<void(const absl::StatusOr<T>&)> on_done = nullptr);

  template <typename T>
  using Callback = std::function<void(const absl::StatusOr<T>&)>;

  // Client::Alloc / Free / SubmitBackup / SubmitLoad / WaitTransfer,
  // submitted. Every argument is copied in before the call returns (Free's
  // indices too), so the caller's buffers may go at once.
  std::future<absl::StatusOr<std::vector<int64_t>>> Alloc(
      std::string pool, uint64_t num_tokens, Callback<std::vector<int64_t>> on_done = nullptr);
  // Completes with the slots freed.
  std::future<absl::StatusOr<uint64_t>> Free(std::string pool, absl::Span<const int64_t> indices,
                                             Callback<uint64_t> on_done = nullptr);
  // These complete once the daemon accepted the transfer (its ticket), not
  // once it is done: WaitTransfer, submitted or not, waits for that.
  std::future<absl::StatusOr<v1::TransferTicket>> SubmitBackup(
      const v1::BackupRequest& request, Callback<v1::TransferTicket> on_done = nullptr);
  std::future<absl::StatusOr<v1::TransferTicket>> SubmitLoad(
      const v1::LoadRequest& request, Callback<v1::TransferTicket> on_done = nullptr);
  // Holds the executor until the ticket is done or `timeout` passed: every
  // call behind it waits as long.
  std::future<absl::StatusOr<v1::TransferStatus>> WaitTransfer(
      uint64_t ticket_id, absl::Duration timeout, Callback<v1::TransferStatus> on_done = nullptr);

  // Calls accepted so far (refused ones not counted). Monotonic.
  uint64_t submitted() const { return submitted_.load(std::memory_order_acquire); }
  // Calls completed so far, failed and cancelled ones included: the first
  // completed() calls accepted are done (FIFO). Monotonic.
  uint64_t completed() const { return completed_.load(std::memory_order_acquire); }
  // Blocks until completed() >= count (OK) or `timeout` passed
  // (DEADLINE_EXCEEDED saying how many had completed). REQUIRES: not called
  // from a callback of this AsyncClient with a count not yet reached.
  absl::Status WaitCompleted(uint64_t count, absl::Duration timeout) const;

  // Stops accepting calls, cancels the queued ones, waits for the executor
  // to finish and joins it (see the header comment). Idempotent. REQUIRES:
  // not called from a callback of this AsyncClient.
  void Close();

  Client& client() const { return *client_; }
  const AsyncClientOptions& options() const { return options_; }

 private:
  // One submitted call: `run` runs it and completes it; `cancel` completes
  // it with the given status instead. Both complete it exactly once.
  struct Job {
    std::function<void()> run;
    std::function<void(const absl::Status&)> cancel;
  };

  // Appends `job` to the queue and counts it, or says why not.
  absl::Status Enqueue(Job job);
  void Loop();

  // The call's result, or an exception it threw as a status.
  template <typename T>
  static absl::StatusOr<T> Guarded(const std::function<absl::StatusOr<T>()>& call);

  Client* const client_;
  const AsyncClientOptions options_;
  std::atomic<uint64_t> submitted_{0};
  std::atomic<uint64_t> completed_{0};
  mutable absl::Mutex mu_;
  std::deque<Job> queue_ ABSL_GUARDED_BY(mu_);
  bool closing_ ABSL_GUARDED_BY(mu_) = false;
  // Serialises Close() callers; the executor never takes it.
  absl::Mutex close_mu_;
  std::thread executor_;
};

template <typename T>
absl::StatusOr<T> AsyncClient::Guarded(const std::function<absl::StatusOr<T>()>& call) {
  try {
    return call();
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError("out of memory in a call of kvhost::AsyncClient");
  } catch (const std::exception& e) {
    return absl::InternalError(std::string("a call of kvhost::AsyncClient threw: ") + e.what());
  } catch (...) {
    return absl::InternalError("a call of kvhost::AsyncClient threw an exception of unknown type");
  }
}

template <typename T>
std::future<absl::StatusOr<T>> AsyncClient::Submit(
    std::function<absl::StatusOr<T>()> call,
    std::function<void(const absl::StatusOr<T>&)> on_done) {
  // shared_ptr: std::function needs copyable targets, and a promise is not.
  auto promise = std::make_shared<std::promise<absl::StatusOr<T>>>();
  std::future<absl::StatusOr<T>> future = promise->get_future();
  if (!call) {
    promise->set_value(absl::InvalidArgumentError("kvhost::AsyncClient::Submit of an empty call"));
    return future;
  }
  auto finish = [promise, on_done = std::move(on_done)](absl::StatusOr<T> result) {
    if (on_done) on_done(result);
    promise->set_value(std::move(result));
  };
  Job job;
  job.run = [call = std::move(call), finish] { finish(Guarded(call)); };
  job.cancel = [finish](const absl::Status& why) { finish(why); };
  if (absl::Status s = Enqueue(std::move(job)); !s.ok()) promise->set_value(std::move(s));
  return future;
}

}  // namespace kvhost

#endif  // KVHOST_CLIENT_ASYNC_CLIENT_H_
