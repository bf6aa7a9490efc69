#include "server/service/fast_path_server.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"

namespace kvhost {
namespace {

// How long a mailbox thread watches its doorbell before it sleeps on it: a
// client's next call often follows its last reply within microseconds
// (Alloc, then Free), sooner than a wake-up from sleep.
constexpr int64_t kServerSpinNs = 50'000;

// Whether the client's end of `connection` is gone.
bool HungUp(int connection) {
  pollfd p{connection, POLLRDHUP, 0};
  if (::poll(&p, 1, 0) < 0) return errno != EINTR;
  return (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) != 0;
}

}  // namespace

FastPathOffer::FastPathOffer(FastPathOffer&& other) noexcept
    : reservation_(std::exchange(other.reservation_, nullptr)),
      fd_(std::move(other.fd_)),
      mapping_(std::exchange(other.mapping_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)),
      mailbox_(std::exchange(other.mailbox_, FastPathMailbox{})) {}

FastPathOffer::~FastPathOffer() {
  if (mapping_ != nullptr) ::munmap(mapping_, bytes_);
  if (reservation_ != nullptr) reservation_->fetch_sub(1, std::memory_order_relaxed);
}

FastPathServer::FastPathServer(FastPathCalls* calls, uint32_t max_connections, uint32_t capacity,
                               KvhostMetrics* metrics)
    : calls_(calls), max_connections_(max_connections), capacity_(capacity), metrics_(metrics) {}

FastPathServer::~FastPathServer() { Stop(); }

absl::StatusOr<FastPathOffer> FastPathServer::Open() {
  if (max_connections_ == 0) {
    return absl::FailedPreconditionError(
        "the fast path is off on this kvhostd (--fast-path-connections 0); use gRPC");
  }
  if (stopping_.load()) return absl::FailedPreconditionError("kvhostd is stopping");
  uint32_t now = reserved_.load(std::memory_order_relaxed);
  do {
    if (now >= max_connections_) {
      return absl::ResourceExhaustedError(absl::StrCat("kvhostd serves ", now,
                                                       " fast-path mailboxes already, its limit "
                                                       "(--fast-path-connections ",
                                                       max_connections_, "); use gRPC"));
    }
  } while (!reserved_.compare_exchange_weak(now, now + 1, std::memory_order_relaxed));
  FastPathOffer offer;
  offer.reservation_ = &reserved_;
  offer.bytes_ = FastPathMailboxBytes(capacity_);
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
  offer.mailbox_ = FastPathMailbox::Over(mapping, capacity_);
  offer.mailbox_.header->version = kFastPathVersion;
  offer.mailbox_.header->capacity = capacity_;
  return offer;
}

void FastPathServer::Serve(FastPathOffer offer, UniqueFd connection, const std::string& peer) {
  absl::MutexLock lock(&mu_);
  Reap();
  if (stopping_.load()) return;  // the offer's destructor gives its slot back
  workers_.emplace_back();
  Worker* worker = &workers_.back();
  worker->header = offer.mailbox().header;
  worker->thread = std::thread(
      [this, offer = std::move(offer), connection = std::move(connection), peer, worker]() mutable {
        Loop(std::move(offer), std::move(connection), std::move(peer), worker);
      });
}

void FastPathServer::Loop(FastPathOffer offer, UniqueFd connection, std::string peer,
                          Worker* worker) {
  const FastPathMailbox& mailbox = offer.mailbox();
  spdlog::info("fast path: mailbox opened for {} ({} of at most {})", peer, connections(),
               max_connections_);
  std::string frame;
  // A fresh mailbox's sequence starts at 0; the client may have rung for
  // its first call before this thread began.
  uint32_t seen = 0;
  uint64_t calls = 0;
  const int64_t slice_ns = absl::ToInt64Nanoseconds(kFastPathIdleCheck);
  while (true) {
    bool hung_up = false;
    const uint32_t cpu = CpuHint();
    mailbox.header->server_cpu.store(cpu, std::memory_order_relaxed);
    const bool spin = SpinFor(mailbox.header->client_cpu.load(std::memory_order_relaxed), cpu);
    const uint32_t seq =
        WaitForChange(&mailbox.header->request_seq, seen, spin ? kServerSpinNs : 0, slice_ns, [&] {
          hung_up = HungUp(connection.get());
          return !hung_up && !stopping_.load();
        });
    if (seq == seen) break;  // hung up or stopping
    seen = seq;
    Answer(mailbox, &frame);
    ++calls;
    mailbox.header->reply_seq.store(seq, std::memory_order_release);
    FutexWake(&mailbox.header->reply_seq);
  }
  spdlog::info("fast path: mailbox of {} closed after {} calls ({})", peer, calls,
               stopping_.load() ? "kvhostd stopping" : "the client closed its connection");
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
    const char* name = FastPathMethodName(method);
    metrics_->fast_path_calls->WithLabels({name, absl::StatusCodeToString(code)})->Increment();
    metrics_->fast_path_seconds->WithLabels({name})->Observe(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
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
