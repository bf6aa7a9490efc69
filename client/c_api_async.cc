// The C ABI's asynchronous calls (kvhost/kvhost_c.h, "Asynchronous calls"):
// a kvhost_async is a kvhost::AsyncClient of its own plus the results of its
// requests, held by request id until taken. Request ids are the
// AsyncClient's submission numbers (1, 2, ...: every submit of the handle
// goes through its one AsyncClient, under the handle's lock), so request k
// is done exactly when AsyncClient::completed() >= k.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <future>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "c_api_internal.h"
#include "kvhost/async_client.h"

namespace kvhost::c_api {
namespace {

enum class RequestKind { kAlloc, kFree, kBackup, kLoad };

const char* KindName(RequestKind kind) {
  switch (kind) {
    case RequestKind::kAlloc:
      return "an alloc";
    case RequestKind::kFree:
      return "a free";
    case RequestKind::kBackup:
      return "a backup";
    case RequestKind::kLoad:
      return "a load";
  }
  return "a request";
}

// What a request's call returns: the status travels inside, so a waited
// transfer that failed still has its ticket id.
struct Outcome {
  absl::Status status;
  std::vector<int64_t> indices;  // an alloc's
  uint64_t value = 0;            // the slots freed, or a ticket id
  bool has_value = false;

  static Outcome Failed(absl::Status status) {
    Outcome outcome;
    outcome.status = std::move(status);
    return outcome;
  }
};

// A request from its submit until it is taken.
struct Request {
  RequestKind kind = RequestKind::kAlloc;
  bool done = false;
  Outcome outcome;
};

}  // namespace
}  // namespace kvhost::c_api

struct kvhost_async {
  using Outcome = kvhost::c_api::Outcome;
  using Request = kvhost::c_api::Request;
  using RequestKind = kvhost::c_api::RequestKind;

  explicit kvhost_async(kvhost::Client* client) : calls(client) {}

  // Queues `call` as the next request; its id into *request_id.
  absl::Status Submit(RequestKind kind, std::function<absl::StatusOr<Outcome>()> call,
                      uint64_t* request_id) {
    absl::MutexLock lock(&mu);
    if (requests.size() >= KVHOST_ASYNC_MAX_REQUESTS) {
      return absl::ResourceExhaustedError(
          absl::StrCat("the kvhost_async holds ", requests.size(), " requests, its bound ",
                       "(KVHOST_ASYNC_MAX_REQUESTS ", KVHOST_ASYNC_MAX_REQUESTS,
                       "), queued, running or finished and not taken; take finished ones first"));
    }
    const uint64_t id = calls.submitted() + 1;
    requests[id].kind = kind;
    std::future<absl::StatusOr<Outcome>> future = calls.Submit<Outcome>(
        std::move(call), [this, id](const absl::StatusOr<Outcome>& r) { Complete(id, r); });
    // A call that was accepted cannot have completed yet (Complete needs mu,
    // held here), so a ready future is a refusal.
    if (future.wait_for(std::chrono::seconds(0)) == std::future_status::ready) {
      requests.erase(id);
      return future.get().status();
    }
    if (request_id != nullptr) *request_id = id;
    return absl::OkStatus();
  }

  // On the executor thread: holds the result, then calls back.
  void Complete(uint64_t id, const absl::StatusOr<Outcome>& result) {
    kvhost_async_callback cb = nullptr;
    void* cb_user = nullptr;
    absl::Status status;
    {
      absl::MutexLock lock(&mu);
      Request& request = requests.at(id);  // held until done and taken
      try {
        request.outcome = result.ok() ? *result : Outcome::Failed(result.status());
      } catch (...) {  // a copy of the indices that did not fit in memory
        request.outcome = Outcome::Failed(absl::ResourceExhaustedError(
            absl::StrCat("out of memory holding the result of request ", id)));
      }
      request.done = true;
      status = request.outcome.status;
      cb = callback;
      cb_user = user;
      calling = cb != nullptr;
      executor = std::this_thread::get_id();
    }
    if (cb == nullptr) return;
    cb(id, static_cast<int>(status.code()), cb_user);
    absl::MutexLock lock(&mu);
    calling = false;
  }

  void SetCallback(kvhost_async_callback cb, void* cb_user) {
    absl::MutexLock lock(&mu);
    callback = cb;
    user = cb_user;
    // From inside a callback the one running is the caller's own.
    if (std::this_thread::get_id() == executor) return;
    auto idle = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu) { return !calling; };
    mu.Await(absl::Condition(&idle));
  }

  // NOT_FOUND for an id not held, saying whether it ever was.
  absl::Status NotHeld(uint64_t id) const ABSL_SHARED_LOCKS_REQUIRED(mu) {
    if (id == 0 || id > calls.submitted()) {
      return absl::NotFoundError(absl::StrCat("request ", id,
                                              " was not submitted to this kvhost_async (its last "
                                              "is ",
                                              calls.submitted(), ")"));
    }
    return absl::NotFoundError(
        absl::StrCat("request ", id, " of this kvhost_async was taken already"));
  }

  absl::Status Wait(uint64_t id, absl::Duration timeout) {
    absl::MutexLock lock(&mu);
    auto finished = [this, id]() ABSL_SHARED_LOCKS_REQUIRED(mu) {
      auto it = requests.find(id);
      return it == requests.end() || it->second.done;
    };
    if (!mu.AwaitWithDeadline(absl::Condition(&finished), absl::Now() + timeout)) {
      return absl::DeadlineExceededError(
          absl::StrCat("request ", id, " did not complete within ", absl::FormatDuration(timeout),
                       " (", calls.completed(), " of ", calls.submitted(), " requests completed)"));
    }
    auto it = requests.find(id);
    if (it == requests.end()) return NotHeld(id);
    return it->second.outcome.status;
  }

  // The finished request `id` for a take (`alloc`: by
  // kvhost_async_take_indices), or why it cannot be taken.
  absl::StatusOr<Request*> Finished(uint64_t id, bool alloc) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    auto it = requests.find(id);
    if (it == requests.end()) return NotHeld(id);
    Request& request = it->second;
    if (!request.done) {
      return absl::FailedPreconditionError(absl::StrCat(
          "request ", id, " (", KindName(request.kind),
          ") has not completed yet; kvhost_async_wait for it, or take it from its callback"));
    }
    if (request.outcome.status.ok() && (request.kind == RequestKind::kAlloc) != alloc) {
      return absl::InvalidArgumentError(
          absl::StrCat("request ", id, " is ", KindName(request.kind), "; take its result with ",
                       request.kind == RequestKind::kAlloc ? "kvhost_async_take_indices"
                                                           : "kvhost_async_take_value"));
    }
    return &request;
  }

  // kvhost_async_take_indices: the alloc's indices into the caller's buffer.
  absl::Status TakeIndices(uint64_t id, int64_t* indices, size_t capacity, size_t* count) {
    absl::MutexLock lock(&mu);
    absl::StatusOr<Request*> r = Finished(id, /*alloc=*/true);
    if (!r.ok()) return r.status();
    const Outcome& outcome = (*r)->outcome;
    if (!outcome.status.ok()) {
      absl::Status status = outcome.status;
      requests.erase(id);
      return status;
    }
    const size_t n = outcome.indices.size();
    if (count != nullptr) *count = n;
    if (n > 0 && (indices == nullptr || capacity < n)) {
      return absl::OutOfRangeError(absl::StrCat("request ", id, " allocated ", n,
                                                " slots; the buffer has room for ",
                                                indices == nullptr ? 0 : capacity));
    }
    std::copy(outcome.indices.begin(), outcome.indices.end(), indices);
    requests.erase(id);
    return absl::OkStatus();
  }

  // kvhost_async_take_value: the value (when there is one) and the status.
  absl::Status TakeValue(uint64_t id, uint64_t* value) {
    absl::MutexLock lock(&mu);
    absl::StatusOr<Request*> r = Finished(id, /*alloc=*/false);
    if (!r.ok()) return r.status();
    const Outcome& outcome = (*r)->outcome;
    if (value != nullptr && outcome.has_value) *value = outcome.value;
    absl::Status status = outcome.status;
    requests.erase(id);
    return status;
  }

  mutable absl::Mutex mu;
  std::unordered_map<uint64_t, Request> requests ABSL_GUARDED_BY(mu);
  kvhost_async_callback callback ABSL_GUARDED_BY(mu) = nullptr;
  void* user ABSL_GUARDED_BY(mu) = nullptr;
  // A callback is running (SetCallback waits for it to return).
  bool calling ABSL_GUARDED_BY(mu) = false;
  std::thread::id executor ABSL_GUARDED_BY(mu);
  // Last: destroyed (closed) first, while the results and the lock live.
  kvhost::AsyncClient calls;
};

namespace kvhost::c_api {
namespace {

absl::StatusOr<kvhost_async*> AsyncOf(kvhost_async* async) {
  if (async == nullptr) return absl::InvalidArgumentError("async is NULL");
  return async;
}

// A backup or load request: its arguments checked and copied now, the
// calls made on the executor.
struct TransferArgs {
  std::string attachment_id;
  std::vector<int64_t> host;
  std::vector<int64_t> device;
  bool wait = false;
  absl::Duration wait_timeout;
};

absl::StatusOr<TransferArgs> CopyTransferArgs(const kvhost_attachment* attachment,
                                              const int64_t* host_indices, size_t num_host,
                                              const int64_t* device_indices, size_t num_device,
                                              uint32_t flags, int64_t wait_timeout_ms) {
  if (attachment == nullptr) return absl::InvalidArgumentError("attachment is NULL");
  absl::StatusOr<absl::Span<const int64_t>> host = Indices(host_indices, num_host, "host_indices");
  if (!host.ok()) return host.status();
  absl::StatusOr<absl::Span<const int64_t>> dev =
      Indices(device_indices, num_device, "device_indices");
  if (!dev.ok()) return dev.status();
  if ((flags & ~KVHOST_TRANSFER_WAIT) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown transfer flags 0x", absl::Hex(flags & ~KVHOST_TRANSFER_WAIT)));
  }
  absl::StatusOr<absl::Duration> timeout =
      Timeout(wait_timeout_ms, absl::Minutes(10), "wait_timeout");
  if (!timeout.ok()) return timeout.status();
  TransferArgs args;
  args.attachment_id = attachment->attachment.id();
  args.host.assign(host->begin(), host->end());
  args.device.assign(dev->begin(), dev->end());
  args.wait = (flags & KVHOST_TRANSFER_WAIT) != 0;
  args.wait_timeout = *timeout;
  return args;
}

// The ticket `ticket` gave, and with args.wait its wait's status too.
absl::StatusOr<Outcome> TicketOutcome(Client& client, const TransferArgs& args,
                                      const absl::StatusOr<uint64_t>& ticket) {
  if (!ticket.ok()) return ticket.status();
  Outcome outcome;
  outcome.value = *ticket;
  outcome.has_value = true;
  if (args.wait) outcome.status = client.WaitTransfer(*ticket, args.wait_timeout).status();
  return outcome;
}

}  // namespace
}  // namespace kvhost::c_api

using kvhost::c_api::AsyncOf;
using kvhost::c_api::ClientOf;
using kvhost::c_api::NotNull;
using kvhost::c_api::Outcome;
using kvhost::c_api::RequestKind;
using kvhost::c_api::Run;
using kvhost::c_api::Str;
using kvhost::c_api::TransferArgs;

extern "C" {

int kvhost_async_create(kvhost_client* client, kvhost_async** out, char* err, size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    if (absl::Status s = NotNull(out, "out"); !s.ok()) return s;
    *out = nullptr;
    absl::StatusOr<kvhost::Client*> c = ClientOf(client);
    if (!c.ok()) return c.status();
    *out = new kvhost_async(*c);
    return absl::OkStatus();
  });
}

void kvhost_async_destroy(kvhost_async* async) {
  if (async == nullptr) return;
  try {
    async->calls.Close();  // the queued requests called back with CANCELLED
    delete async;
  } catch (...) {  // a destructor that throws ends nothing else here
  }
}

int kvhost_async_set_callback(kvhost_async* async, kvhost_async_callback callback, void* user,
                              char* err, size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    absl::StatusOr<kvhost_async*> a = AsyncOf(async);
    if (!a.ok()) return a.status();
    (*a)->SetCallback(callback, user);
    return absl::OkStatus();
  });
}

int kvhost_async_alloc(kvhost_async* async, const char* pool, uint64_t num_tokens,
                       uint64_t* request_id, char* err, size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    absl::StatusOr<kvhost_async*> a = AsyncOf(async);
    if (!a.ok()) return a.status();
    absl::StatusOr<std::string> p = Str(pool, "pool name");
    if (!p.ok()) return p.status();
    kvhost::Client* client = &(*a)->calls.client();
    return (*a)->Submit(
        RequestKind::kAlloc,
        [client, pool = *std::move(p), num_tokens]() -> absl::StatusOr<Outcome> {
          absl::StatusOr<std::vector<int64_t>> slots = client->Alloc(pool, num_tokens);
          if (!slots.ok()) return slots.status();
          Outcome outcome;
          outcome.indices = *std::move(slots);
          return outcome;
        },
        request_id);
  });
}

int kvhost_async_free(kvhost_async* async, const char* pool, const int64_t* indices,
                      size_t num_indices, uint64_t* request_id, char* err, size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    absl::StatusOr<kvhost_async*> a = AsyncOf(async);
    if (!a.ok()) return a.status();
    absl::StatusOr<std::string> p = Str(pool, "pool name");
    if (!p.ok()) return p.status();
    absl::StatusOr<absl::Span<const int64_t>> in =
        kvhost::c_api::Indices(indices, num_indices, "indices");
    if (!in.ok()) return in.status();
    kvhost::Client* client = &(*a)->calls.client();
    return (*a)->Submit(
        RequestKind::kFree,
        [client, pool = *std::move(p),
         slots = std::vector<int64_t>(in->begin(), in->end())]() -> absl::StatusOr<Outcome> {
          absl::StatusOr<uint64_t> freed = client->Free(pool, slots);
          if (!freed.ok()) return freed.status();
          Outcome outcome;
          outcome.value = *freed;
          outcome.has_value = true;
          return outcome;
        },
        request_id);
  });
}

int kvhost_async_backup(kvhost_async* async, const kvhost_attachment* attachment,
                        const int64_t* host_indices, size_t num_host, const int64_t* device_indices,
                        size_t num_device, const void* wait_event_handle,
                        size_t wait_event_handle_len, uint32_t flags, int64_t wait_timeout_ms,
                        uint64_t* request_id, char* err, size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    absl::StatusOr<kvhost_async*> a = AsyncOf(async);
    if (!a.ok()) return a.status();
    if (wait_event_handle == nullptr && wait_event_handle_len != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("wait_event_handle is NULL with a length of ", wait_event_handle_len));
    }
    std::string handle =
        wait_event_handle == nullptr
            ? std::string()
            : std::string(static_cast<const char*>(wait_event_handle), wait_event_handle_len);
    absl::StatusOr<TransferArgs> args = kvhost::c_api::CopyTransferArgs(
        attachment, host_indices, num_host, device_indices, num_device, flags, wait_timeout_ms);
    if (!args.ok()) return args.status();
    kvhost::Client* client = &(*a)->calls.client();
    return (*a)->Submit(
        RequestKind::kBackup,
        [client, args = *std::move(args), handle = std::move(handle)] {
          return kvhost::c_api::TicketOutcome(
              *client, args, client->Backup(args.attachment_id, args.host, args.device, handle));
        },
        request_id);
  });
}

int kvhost_async_load(kvhost_async* async, const kvhost_attachment* attachment,
                      const int64_t* host_indices, size_t num_host, const int64_t* device_indices,
                      size_t num_device, uint32_t flags, int64_t wait_timeout_ms,
                      uint64_t* request_id, char* err, size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    absl::StatusOr<kvhost_async*> a = AsyncOf(async);
    if (!a.ok()) return a.status();
    absl::StatusOr<TransferArgs> args = kvhost::c_api::CopyTransferArgs(
        attachment, host_indices, num_host, device_indices, num_device, flags, wait_timeout_ms);
    if (!args.ok()) return args.status();
    kvhost::Client* client = &(*a)->calls.client();
    return (*a)->Submit(
        RequestKind::kLoad,
        [client, args = *std::move(args)] {
          return kvhost::c_api::TicketOutcome(
              *client, args, client->Load(args.attachment_id, args.host, args.device));
        },
        request_id);
  });
}

uint64_t kvhost_async_completed(const kvhost_async* async) {
  return async == nullptr ? 0 : async->calls.completed();
}

int kvhost_async_wait(kvhost_async* async, uint64_t request_id, int64_t timeout_ms, char* err,
                      size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    absl::StatusOr<kvhost_async*> a = AsyncOf(async);
    if (!a.ok()) return a.status();
    absl::StatusOr<absl::Duration> timeout =
        kvhost::c_api::Timeout(timeout_ms, absl::Minutes(10), "timeout");
    if (!timeout.ok()) return timeout.status();
    return (*a)->Wait(request_id, *timeout);
  });
}

int kvhost_async_take_indices(kvhost_async* async, uint64_t request_id, int64_t* indices,
                              size_t capacity, size_t* count, char* err, size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    absl::StatusOr<kvhost_async*> a = AsyncOf(async);
    if (!a.ok()) return a.status();
    return (*a)->TakeIndices(request_id, indices, capacity, count);
  });
}

int kvhost_async_take_value(kvhost_async* async, uint64_t request_id, uint64_t* value, char* err,
                            size_t err_len) {
  return Run(err, err_len, [&]() -> absl::Status {
    absl::StatusOr<kvhost_async*> a = AsyncOf(async);
    if (!a.ok()) return a.status();
    return (*a)->TakeValue(request_id, value);
  });
}

}  // extern "C"
