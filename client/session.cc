// Client's worker session (DaemonService.OpenSession): one stream per
// client, held open and reopened with backoff by a background thread. The
// attachments the client makes within it are remembered, so that when the
// session breaks and opens again the client can say what was lost.
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <algorithm>
#include <deque>
#include <map>
#include <set>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "client/fast_path.h"
#include "client/grpc_status.h"
#include "kvhost/client.h"

namespace kvhost {

namespace {

// An attachment id as a log line shows it: the prefix and 4 digits, not the
// capability (the daemon's logs do the same).
std::string ShortAttachmentId(const std::string& id) {
  const size_t dash = id.rfind('-');
  const size_t keep = std::min(id.size(), (dash == std::string::npos ? 0 : dash + 1) + 4);
  return absl::StrCat(id.substr(0, keep), "...");
}

}  // namespace

std::string SessionLoss::Describe() const {
  std::vector<std::string> shown;
  for (const std::string& id : attachments) shown.push_back(ShortAttachmentId(id));
  std::string out = daemon_restarted ? absl::StrCat("kvhostd restarted (instance ", old_instance,
                                                    " -> ", new_instance, ")")
                                     : absl::StrCat("the session with kvhostd (instance ",
                                                    new_instance, ") broke and was reopened");
  absl::StrAppend(&out, "; ", attachments.size(), " attachment(s) lost",
                  shown.empty() ? "" : absl::StrCat(" (", absl::StrJoin(shown, ", "), ")"),
                  ", attach again");
  if (!pools_gone.empty()) {
    absl::StrAppend(&out, "; pools gone: ", absl::StrJoin(pools_gone, ", "));
  }
  if (!pools_recreated_empty.empty()) {
    absl::StrAppend(&out, "; pools recreated empty from the daemon's config (their data is lost): ",
                    absl::StrJoin(pools_recreated_empty, ", "));
  }
  return out;
}

// How long closing a session waits for kvhostd's answer before cancelling
// it: a daemon that answers does so in a millisecond.
constexpr absl::Duration kCloseWait = absl::Milliseconds(500);

class Client::SessionKeeper {
 public:
  explicit SessionKeeper(Client* client) : client_(client) {}

  ~SessionKeeper() {
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
      // The session's normal end: close it (half-close), which kvhostd
      // answers OK. A cancel, the fallback when no answer comes in time,
      // ends the call CANCELLED, as a worker that died does.
      if (open_stream_ != nullptr && open_stream_->WritesDone()) {
        auto ended = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return context_ == nullptr; };
        mu_.AwaitWithTimeout(absl::Condition(&ended), kCloseWait);
      }
      if (context_ != nullptr) context_->TryCancel();
    }
    if (thread_.joinable()) thread_.join();
  }

  absl::Status Open(absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    if (!thread_.joinable()) thread_ = std::thread([this] { Loop(); });
    const absl::Time deadline = absl::Now() + timeout;
    auto open = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return state_.open; };
    if (mu_.AwaitWithDeadline(absl::Condition(&open), deadline)) return absl::OkStatus();
    if (last_error_.ok()) {
      return absl::DeadlineExceededError(absl::StrCat("no worker session with kvhostd at ",
                                                      client_->options_.address, " within ",
                                                      absl::FormatDuration(timeout)));
    }
    return absl::Status(last_error_.code(),
                        absl::StrCat("cannot open a worker session with kvhostd at ",
                                     client_->options_.address, ": ", last_error_.message()));
  }

  SessionState state() const {
    absl::MutexLock lock(&mu_);
    return state_;
  }
  std::vector<SessionLoss> losses() const {
    absl::MutexLock lock(&mu_);
    return losses_;
  }
  void SetOnLoss(std::function<void(const SessionLoss&)> on_loss) {
    absl::MutexLock lock(&mu_);
    on_loss_ = std::move(on_loss);
  }
  // Attachments made within session `session_id`.
  void Remember(const std::string& session_id, const std::string& attachment,
                const std::string& pool) {
    absl::MutexLock lock(&mu_);
    if (session_id == state_.session_id) attachments_[attachment] = pool;
  }
  void Forget(const std::string& attachment) {
    absl::MutexLock lock(&mu_);
    attachments_.erase(attachment);
  }
  // A session a caller named in AttachDeviceRequest.session_id itself.
  void RememberGiven(const std::string& session_id) {
    absl::MutexLock lock(&mu_);
    if (std::find(given_.begin(), given_.end(), session_id) != given_.end()) return;
    given_.push_back(session_id);
    if (given_.size() > kRememberedSessions) given_.pop_front();
  }
  // Every session id the client's calls name: the current one, the ones it
  // held before (so a worker can still wait for a backup accepted before its
  // session broke) and the ones given.
  std::vector<std::string> Ids() const {
    absl::MutexLock lock(&mu_);
    std::vector<std::string> ids;
    if (!state_.session_id.empty()) ids.push_back(state_.session_id);
    ids.insert(ids.end(), past_.begin(), past_.end());
    ids.insert(ids.end(), given_.begin(), given_.end());
    return ids;
  }

 private:
  void Loop() {
    const ClientOptions& options = client_->options_;
    v1::SessionRequest hello;
    char host[256] = {};
    ::gethostname(host, sizeof(host) - 1);
    hello.set_worker(options.worker_name.empty() ? absl::StrCat(host, ":", ::getpid())
                                                 : options.worker_name);
    hello.set_pid(::getpid());
    absl::Duration backoff = absl::Milliseconds(50);
    while (true) {
      grpc::ClientContext context;
      {
        absl::MutexLock lock(&mu_);
        if (stopping_) return;
        context_ = &context;
      }
      std::unique_ptr<grpc::ClientReaderWriter<v1::SessionRequest, v1::SessionEvent>> stream =
          client_->daemon_->OpenSession(&context);
      v1::SessionEvent event;
      if (stream->Write(hello) && stream->Read(&event)) {
        {
          // From here on only ~SessionKeeper writes (its WritesDone). Set
          // before Opened tells a waiting Open the session is open, so that
          // a Client destroyed right after Open closes it (OK), never
          // finding no stream and cancelling it (CANCELLED).
          absl::MutexLock lock(&mu_);
          open_stream_ = stream.get();
        }
        Opened(event);
        backoff = absl::Milliseconds(50);
        // The daemon sends nothing more; Read returns when the stream ends
        // (the daemon went away, or ~SessionKeeper closed or cancelled it).
        while (stream->Read(&event)) {
        }
      }
      {
        absl::MutexLock lock(&mu_);
        open_stream_ = nullptr;
      }
      const grpc::Status status = stream->Finish();
      {
        absl::MutexLock lock(&mu_);
        context_ = nullptr;
        state_.open = false;
        last_error_ = status.ok() ? absl::UnavailableError("the daemon closed the session")
                                  : FromGrpc(status);
        if (stopping_) return;
        // Interruptible sleep: ~SessionKeeper sets stopping_.
        auto stopping = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stopping_; };
        mu_.AwaitWithTimeout(absl::Condition(&stopping), backoff);
        if (stopping_) return;
      }
      backoff = std::min(backoff * 2, options.reconnect_max_backoff);
    }
  }

  // A session is open (again): if one was open before, work out what the
  // worker lost and report it.
  void Opened(const v1::SessionEvent& event) {
    SessionLoss loss;
    bool report = false;
    std::set<std::string> pools;
    {
      absl::MutexLock lock(&mu_);
      if (!state_.session_id.empty()) {
        loss.when = absl::Now();
        loss.old_instance = state_.daemon_instance;
        loss.new_instance = event.daemon_instance();
        loss.daemon_restarted = loss.old_instance != loss.new_instance;
        for (const auto& [attachment, pool] : attachments_) {
          loss.attachments.push_back(attachment);
          pools.insert(pool);
        }
        report = loss.daemon_restarted || !loss.attachments.empty();
        ++state_.reconnects;
      }
      attachments_.clear();
    }
    if (report && loss.daemon_restarted && !pools.empty()) {
      // Which of the pools survived: a restarted daemon has only its
      // declared pools, recreated empty.
      absl::StatusOr<v1::DaemonStatus> status = client_->GetStatus();
      const std::set<std::string> declared =
          status.ok() ? std::set<std::string>(status->declared_pools().begin(),
                                              status->declared_pools().end())
                      : std::set<std::string>();
      for (const std::string& pool : pools) {
        if (declared.count(pool) != 0) {
          loss.pools_recreated_empty.push_back(pool);
        } else if (!client_->GetPool(pool).ok() && !client_->GetPoolGroup(pool).ok()) {
          loss.pools_gone.push_back(pool);
        }
      }
    }
    std::function<void(const SessionLoss&)> on_loss;
    {
      absl::MutexLock lock(&mu_);
      state_.open = true;
      if (!state_.session_id.empty() && state_.session_id != event.session_id()) {
        past_.push_front(state_.session_id);
        if (past_.size() > kRememberedSessions) past_.pop_back();
      }
      state_.session_id = event.session_id();
      state_.daemon_instance = event.daemon_instance();
      last_error_ = absl::OkStatus();
      if (report) losses_.push_back(loss);
      on_loss = on_loss_;
    }
    if (report && on_loss) on_loss(loss);
  }

  // Past and given session ids remembered, each (metadata is small).
  static constexpr size_t kRememberedSessions = 4;

  Client* const client_;
  std::thread thread_;
  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  grpc::ClientContext* context_ ABSL_GUARDED_BY(mu_) = nullptr;
  // The stream while a session is open on it, for ~SessionKeeper's close.
  grpc::ClientReaderWriter<v1::SessionRequest, v1::SessionEvent>* open_stream_
      ABSL_GUARDED_BY(mu_) = nullptr;
  SessionState state_ ABSL_GUARDED_BY(mu_);
  absl::Status last_error_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::string> attachments_ ABSL_GUARDED_BY(mu_);  // id -> pool
  std::vector<SessionLoss> losses_ ABSL_GUARDED_BY(mu_);
  std::deque<std::string> past_ ABSL_GUARDED_BY(mu_);  // newest first
  std::deque<std::string> given_ ABSL_GUARDED_BY(mu_);
  std::function<void(const SessionLoss&)> on_loss_ ABSL_GUARDED_BY(mu_);
};

// Here, where SessionKeeper is complete.
Client::Client(ClientOptions options, std::shared_ptr<grpc::Channel> channel)
    : options_(std::move(options)),
      channel_(std::move(channel)),
      daemon_(v1::DaemonService::NewStub(channel_)),
      pools_(v1::PoolService::NewStub(channel_)),
      transfers_(v1::TransferService::NewStub(channel_)),
      storage_(v1::StorageService::NewStub(channel_)),
      cache_(v1::CacheService::NewStub(channel_)),
      session_(new SessionKeeper(this)),
      fast_path_(std::make_unique<FastPath>()) {}

Client::~Client() {
  session_.reset();
  fast_path_.reset();
}

absl::Status Client::OpenSession(absl::Duration timeout) { return session_->Open(timeout); }

SessionState Client::session_state() const { return session_->state(); }

std::vector<SessionLoss> Client::session_losses() const { return session_->losses(); }

void Client::OnSessionLoss(std::function<void(const SessionLoss&)> on_loss) {
  session_->SetOnLoss(std::move(on_loss));
}

absl::StatusOr<v1::Attachment> Client::AttachDevice(const v1::AttachDeviceRequest& request) {
  if (!request.session_id().empty()) session_->RememberGiven(request.session_id());
  if (!options_.worker_session || !request.session_id().empty()) return AttachOnce(request);
  v1::AttachDeviceRequest in_session = request;
  for (int attempt = 0;; ++attempt) {
    if (absl::Status s = OpenSession(options_.timeout); !s.ok()) return s;
    const std::string session_id = session_->state().session_id;
    in_session.set_session_id(session_id);
    absl::StatusOr<v1::Attachment> attachment = AttachOnce(in_session);
    // The session broke between OpenSession and the call: once more in the
    // next one.
    if (!attachment.ok() && attachment.status().code() == absl::StatusCode::kNotFound &&
        absl::StrContains(attachment.status().message(), "session") && attempt == 0) {
      continue;
    }
    if (attachment.ok()) {
      session_->Remember(session_id, attachment->id(),
                         attachment->group().empty() ? attachment->pool() : attachment->group());
    }
    return attachment;
  }
}

void Client::ForgetAttachment(const std::string& attachment_id) { session_->Forget(attachment_id); }

std::vector<std::string> Client::SessionIds() const { return session_->Ids(); }

absl::Status Client::OpenWorkerSession(absl::string_view call) {
  if (!options_.worker_session) {
    return absl::FailedPreconditionError(absl::StrCat(
        call, " needs a worker session: this client was made without one (worker_session false)"));
  }
  return OpenSession(options_.timeout);
}

}  // namespace kvhost
