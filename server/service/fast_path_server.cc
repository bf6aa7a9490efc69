#include "server/service/fast_path_server.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/ids.h"
#include "spdlog/spdlog.h"

namespace kvhost {
namespace {

// How long a mailbox thread watches its doorbell before it sleeps on it: a
// client's next call often follows its last reply within microseconds
// (Alloc, then Free), sooner than a wake-up from sleep.
constexpr int64_t kServerSpinNs = 50'000;
// How long a mailbox thread rests after a ring that came before the last
// reply was read (not served): an honest client never rings so, and this
// bounds what a ring flood costs the daemon to a wake-up a millisecond per
// mailbox, whatever the flood's rate.
constexpr absl::Duration kEarlyRingRest = absl::Milliseconds(1);

// Whether the client's end of `connection` is gone.
bool HungUp(int connection) {
  pollfd p{connection, POLLRDHUP, 0};
  if (::poll(&p, 1, 0) < 0) return errno != EINTR;
  return (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) != 0;
}

// This thread's CPU time so far, in microseconds.
uint64_t ThreadCpuMicros() {
  timespec t{};
  if (::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t) != 0) return 0;
  return static_cast<uint64_t>(t.tv_sec) * 1000000 + static_cast<uint64_t>(t.tv_nsec) / 1000;
}

}  // namespace

FastPathOffer::FastPathOffer(FastPathOffer&& other) noexcept
    : server_(std::exchange(other.server_, nullptr)),
      client_(std::move(other.client_)),
      uid_(other.uid_),
      memory_(std::move(other.memory_)),
      fd_(std::move(other.fd_)),
      mapping_(std::exchange(other.mapping_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)),
      mailbox_(std::exchange(other.mailbox_, FastPathMailbox{})) {}

FastPathOffer::~FastPathOffer() {
  if (mapping_ != nullptr) ::munmap(mapping_, bytes_);
  if (server_ != nullptr) server_->Release(client_);
}

FastPathServer::FastPathServer(FastPathCalls* calls, const Limits& limits, PoolRegistry* registry,
                               SessionOpen session_open, KvhostMetrics* metrics)
    : calls_(calls),
      limits_(limits),
      registry_(registry),
      session_open_(std::move(session_open)),
      metrics_(metrics) {}

FastPathServer::~FastPathServer() { Stop(); }

std::string FastPathServer::ClientOf(uint32_t uid,
                                     const std::vector<std::string>& session_ids) const {
  if (session_open_ != nullptr) {
    // Only an open session: a made-up id would be a share of its own.
    for (const std::string& id : session_ids) {
      if (session_open_(id)) return absl::StrCat("session ", ShortId(id));
    }
  }
  return absl::StrCat("uid ", uid);
}

absl::Status FastPathServer::Reserve(const std::string& client) {
  uint32_t now = reserved_.load(std::memory_order_relaxed);
  do {
    if (now >= limits_.max_connections) {
      return absl::ResourceExhaustedError(absl::StrCat("kvhostd serves ", now,
                                                       " fast-path mailboxes already, its limit "
                                                       "(--fast-path-connections ",
                                                       limits_.max_connections, "); use gRPC"));
    }
  } while (!reserved_.compare_exchange_weak(now, now + 1, std::memory_order_relaxed));
  absl::MutexLock lock(&shares_mu_);
  uint32_t& held = shares_[client];
  if (held >= limits_.per_client) {
    if (held == 0) shares_.erase(client);
    reserved_.fetch_sub(1, std::memory_order_relaxed);
    return absl::ResourceExhaustedError(absl::StrCat(client, " holds ", held,
                                                     " fast-path mailboxes already, its share "
                                                     "(--fast-path-connections-per-client ",
                                                     limits_.per_client, "); use gRPC"));
  }
  ++held;
  return absl::OkStatus();
}

void FastPathServer::Release(const std::string& client) {
  {
    absl::MutexLock lock(&shares_mu_);
    auto it = shares_.find(client);
    if (it != shares_.end() && --it->second == 0) shares_.erase(it);
  }
  reserved_.fetch_sub(1, std::memory_order_relaxed);
}

uint32_t FastPathServer::connections_of(const std::string& client) const {
  absl::MutexLock lock(&shares_mu_);
  auto it = shares_.find(client);
  return it == shares_.end() ? 0 : it->second;
}

absl::StatusOr<FastPathOffer> FastPathServer::Open(int connection,
                                                   const std::vector<std::string>& session_ids) {
  if (limits_.max_connections == 0) {
    return absl::FailedPreconditionError(
        "the fast path is off on this kvhostd (--fast-path-connections 0); use gRPC");
  }
  if (stopping_.load()) return absl::FailedPreconditionError("kvhostd is stopping");
  ucred cred{};
  socklen_t cred_len = sizeof(cred);
  if (::getsockopt(connection, SOL_SOCKET, SO_PEERCRED, &cred, &cred_len) != 0) {
    return absl::InternalError(
        absl::StrCat("fast path mailbox: SO_PEERCRED: ", std::strerror(errno)));
  }
  const std::string client = ClientOf(cred.uid, session_ids);
  if (absl::Status s = Reserve(client); !s.ok()) return s;
  FastPathOffer offer;
  offer.server_ = this;
  offer.client_ = client;
  offer.uid_ = cred.uid;
  offer.bytes_ = FastPathMailboxBytes(limits_.capacity);
  if (registry_ != nullptr) {
    absl::StatusOr<TransientReservation> memory = registry_->ReserveTransient(
        offer.bytes_, absl::StrCat("the fast-path mailbox of ", client));
    if (!memory.ok()) return memory.status();
    offer.memory_ = *std::move(memory);
  }
  const auto failed = [](const char* call) {
    return absl::InternalError(
        absl::StrCat("fast path mailbox: ", call, ": ", std::strerror(errno)));
  };
  offer.fd_ = UniqueFd(::memfd_create("kvhost-fast-path", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!offer.fd_.valid()) return failed("memfd_create");
  if (::ftruncate(offer.fd_.get(), static_cast<off_t>(offer.bytes_)) != 0) {
    return failed("ftruncate");
  }
  // Sealed at its size: the client's ftruncate cannot pull pages from
  // under the daemon's mapping.
  if (::fcntl(offer.fd_.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    return failed("F_ADD_SEALS");
  }
  void* mapping =
      ::mmap(nullptr, offer.bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, offer.fd_.get(), 0);
  if (mapping == MAP_FAILED) return failed("mmap");
  offer.mapping_ = mapping;
  offer.mailbox_ = FastPathMailbox::Over(mapping, limits_.capacity);
  offer.mailbox_.header->version = kFastPathVersion;
  offer.mailbox_.header->capacity = limits_.capacity;
  return offer;
}

void FastPathServer::Serve(FastPathOffer offer, UniqueFd connection, const std::string& peer) {
  absl::MutexLock lock(&mu_);
  Reap();
  if (stopping_.load()) return;  // the offer's destructor gives its slot back
  workers_.emplace_back();
  Worker* worker = &workers_.back();
  worker->header = offer.mailbox().header;
  worker->thread = std::thread([this, offer = std::move(offer), connection = std::move(connection),
                                peer = peer, worker]() mutable {
    Loop(std::move(offer), std::move(connection), std::move(peer), worker);
  });
}

void FastPathServer::Loop(FastPathOffer offer, UniqueFd connection, std::string peer,
                          Worker* worker) {
  const FastPathMailbox& mailbox = offer.mailbox();
  if (const uint64_t n = open_log_.Tick(); n != 0) {
    spdlog::info("fast path: mailbox opened for {}, {} ({} of at most {}){}", peer, offer.client_,
                 connections(), limits_.max_connections, LogLimitNote(n));
  }
  const std::string uid = std::to_string(offer.uid_);
  std::string frame;
  // A fresh mailbox's sequence starts at 0; the client may have rung for
  // its first call before this thread began.
  uint32_t seen = 0;
  uint32_t answered = 0;  // the seq of the last reply written
  // Whether the client reads each reply before it rings again: only then
  // is its CPU hint honoured (a client that does not wait gets no spin).
  bool waits = true;
  uint64_t calls = 0, ignored = 0, cpu_us = 0;
  uint64_t cpu_mark = ThreadCpuMicros();
  const int64_t slice_ns = absl::ToInt64Nanoseconds(kFastPathIdleCheck);
  while (true) {
    bool hung_up = false;
    const uint32_t cpu = CpuHint();
    mailbox.header->server_cpu.store(cpu, std::memory_order_relaxed);
    const bool spin =
        waits && SpinFor(mailbox.header->client_cpu.load(std::memory_order_relaxed), cpu);
    const uint32_t seq =
        WaitForChange(&mailbox.header->request_seq, seen, spin ? kServerSpinNs : 0, slice_ns, [&] {
          hung_up = HungUp(connection.get());
          return !hung_up && !stopping_.load();
        });
    if (seq == seen) break;  // hung up or stopping
    seen = seq;
    if (calls > 0 && mailbox.header->reply_read.load(std::memory_order_acquire) != answered) {
      // Rung again before the last reply was read: not served (the reply
      // it would overwrite is unread), and no more spinning for this one.
      ++ignored;
      waits = false;
      if (metrics_ != nullptr) metrics_->fast_path_rings_ignored->WithLabels({uid})->Increment();
      absl::SleepFor(kEarlyRingRest);
    } else {
      Answer(mailbox, &frame);
      ++calls;
      answered = seq;
      mailbox.header->reply_seq.store(seq, std::memory_order_release);
      FutexWake(&mailbox.header->reply_seq);
    }
    const uint64_t mark = ThreadCpuMicros();
    if (metrics_ != nullptr && mark > cpu_mark) {
      metrics_->fast_path_cpu->WithLabels({uid})->Increment(mark - cpu_mark);
    }
    cpu_us += mark - std::min(mark, cpu_mark);
    cpu_mark = mark;
  }
  if (const uint64_t n = close_log_.Tick(); n != 0) {
    spdlog::info(
        "fast path: mailbox of {}, {} closed after {} calls, {} rings before a reply was read "
        "(not served), {:.3f} s of CPU ({}){}",
        peer, offer.client_, calls, ignored, cpu_us / 1e6,
        stopping_.load() ? "kvhostd stopping" : "the client closed its connection",
        LogLimitNote(n));
  }
  // The offer gives its connection slot back as it goes.
  worker->done.store(true);
}

void FastPathServer::Answer(const FastPathMailbox& mailbox, std::string* frame) {
  const auto start = std::chrono::steady_clock::now();
  // Read once: the client may rewrite it at any time.
  const uint32_t length = mailbox.header->request_bytes.load(std::memory_order_relaxed);
  std::string reply;
  v1::FastPathMethod method = v1::FAST_PATH_METHOD_UNSPECIFIED;
  absl::StatusCode code = absl::StatusCode::kOk;
  if (length > mailbox.capacity) {
    const absl::Status refused = absl::InvalidArgumentError(
        absl::StrCat("fast path: a request of ", length, " bytes is over the mailbox's ",
                     mailbox.capacity, "-byte capacity; make the call over gRPC"));
    v1::FastPathReply out;
    out.set_code(static_cast<int32_t>(refused.code()));
    out.set_message(std::string(refused.message()));
    reply = out.SerializeAsString();
    code = refused.code();
  } else {
    frame->assign(reinterpret_cast<const char*>(mailbox.request), length);
    reply = calls_->Handle(*frame, mailbox.capacity, &method, &code);
  }
  std::memcpy(mailbox.reply, reply.data(), reply.size());
  mailbox.header->reply_bytes.store(static_cast<uint32_t>(reply.size()), std::memory_order_relaxed);
  if (metrics_ != nullptr) {
    const char* name = FastPathGrpcMethod(method);
    metrics_->rpcs->WithLabels({kTransportFastPath, name, absl::StatusCodeToString(code)})
        ->Increment();
    metrics_->rpc_seconds->WithLabels({kTransportFastPath, name})
        ->Observe(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
}

void FastPathServer::Reap() {
  for (auto it = workers_.begin(); it != workers_.end();) {
    if (it->done.load()) {
      it->thread.join();
      it = workers_.erase(it);
    } else {
      ++it;
    }
  }
}

void FastPathServer::Stop() {
  stopping_.store(true);
  std::list<Worker> workers;
  {
    absl::MutexLock lock(&mu_);
    workers.splice(workers.end(), workers_);
  }
  for (Worker& w : workers) {
    // Wakes a thread asleep on its doorbell at once (it then sees
    // stopping_ at its next check).
    FutexWake(&w.header->request_seq);
  }
  for (Worker& w : workers) w.thread.join();
}

}  // namespace kvhost
