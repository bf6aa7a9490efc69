// handoff_fuzz: the handoff socket's request path without the socket
// (server/service/handoff_server.h): an input is one message as a local
// client would send it on the SOCK_SEQPACKET socket (the first
// kMaxHandoffRequestBytes + 1 bytes arrive, as recvmsg's buffer holds;
// its whole size is the message's length), decoded and checked by
// DecodeHandoffRequest, its caller made by CallerOf (server/access/credentials.h), and the item
// looked up by the daemon's own source (TransferHandoffSource) over a
// TransferManager with the host engine and four attachments:
//   @A  pool "open", no session, layer progress: serves anyone;
//   @B  pool "open", session @0, layer progress;
//   @C  pool "locked" (owner token @T), session @1, layer progress;
//   @D  pool "open", session @0, no layer progress.
// Ids are random capabilities, so in a decoded request an attachment_id of
// "@A".."@D", a session id "@0" / "@1" and an owner token "@T" stand for the
// real ones (fuzz/make_handoff_seeds.sh writes seeds that use them); the
// real id with its last character dropped stands for "@A-".."@D-".
//
// Invariants:
//   * the decode succeeds exactly when the message is 1..4096 bytes, parses
//     as a kvhost.v1.HandoffRequest and names a kind; a failure is
//     INVALID_ARGUMENT with a message;
//   * a decoded request's caller carries exactly its session ids, and its
//     token when it has one;
//   * the lookup: a kind other than layer counters, pool regions and pool
//     map is INVALID_ARGUMENT (pool regions: FAILED_PRECONDITION where the id
//     serves the caller, this daemon serving no worker copies; pool map: the
//     pool's regions read-write, FAILED_PRECONDITION for an attachment
//     without a session); an id that names no
//     attachment, or one the caller may not use (the rule of
//     server/access/caller.h, modelled here independently), NOT_FOUND; an
//     attachment without layer progress FAILED_PRECONDITION; otherwise OK
//     with a read-only descriptor of the counters' size, one per load event
//     set;
//   * no message ever holds a capability (a session id, an attachment id or
//     the owner token) in full.
#include <fcntl.h>
#include <google/protobuf/stubs/logging.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "fuzz/fuzz_check.h"
#include "kvhost/v1/handoff.pb.h"
#include "server/access/credentials.h"
#include "server/pool/registry.h"
#include "server/service/handoff_server.h"
#include "server/transfer/host_engine.h"
#include "server/transfer/transfer_manager.h"

namespace kvhost::fuzz {
namespace {

constexpr char kToken[] = "handoff-fuzz-owner-token";
constexpr uint64_t kDeviceTokens = 16;

// One attachment of the harness, and who it serves.
struct Fixture {
  const char* placeholder;
  const char* pool;
  int session;  // index into sessions_, -1 for none
  bool progress;
  std::string id;
};

class Harness {
 public:
  Harness() {
    // Requests with invalid UTF-8 strings fail to parse, as in the server;
    // protobuf's log line for each is noise here.
    google::protobuf::SetLogHandler(nullptr);
    char dir[] = "/dev/shm/kvhost-handoff-fuzz.XXXXXX";
    if (mkdtemp(dir) == nullptr) Fail(__FILE__, __LINE__, "mkdtemp in /dev/shm failed");
    dir_ = dir;
    RegistryOptions options;
    options.shm_dir = dir_;
    options.memory_limit = 1 << 20;
    options.read_memory = [] {
      MemorySnapshot m;
      m.mem_total = uint64_t{64} << 30;
      m.mem_available = uint64_t{32} << 30;
      return absl::StatusOr<MemorySnapshot>(m);
    };
    registry_ = std::make_unique<PoolRegistry>(std::move(options));
    HostEngineOptions host;
    host.shm_dir = dir_;
    host.helper_threads = 0;
    manager_ = std::make_unique<TransferManager>(std::make_unique<HostEngine>(host));
    source_ = TransferHandoffSource(manager_.get());
    for (std::string& s : sessions_) s = manager_->OpenSession("handoff-fuzz", 1, "in-process");
    MakePool("open", "");
    MakePool("locked", kToken);
    for (Fixture& f : fixtures_) f.id = Attach(f);
    secrets_ = {sessions_[0], sessions_[1], kToken};
    for (const Fixture& f : fixtures_) secrets_.push_back(f.id);
  }

  void RunInput(const uint8_t* data, size_t size) {
    const size_t received = std::min(size, kMaxHandoffRequestBytes + 1);
    v1::HandoffRequest request;
    const absl::Status decoded = DecodeHandoffRequest(
        absl::string_view(reinterpret_cast<const char*>(data), received), size, &request);
    CheckDecode(data, size, decoded, request);
    if (!decoded.ok()) return;
    Substitute(&request);
    const Caller caller = CallerOf(request);
    FUZZ_CHECK(static_cast<int>(caller.sessions.size()) == request.session_ids_size(),
               caller.sessions.size());
    for (int i = 0; i < request.session_ids_size(); ++i) {
      FUZZ_CHECK(caller.sessions[static_cast<size_t>(i)] == request.session_ids(i), i);
    }
    FUZZ_CHECK(caller.token.has_value() == !request.owner_token().empty(), "token");
    if (caller.token.has_value()) FUZZ_CHECK(*caller.token == request.owner_token(), "token");
    CheckLookup(request, caller, source_(caller, request.attachment_id(), request.kind()));
  }

 private:
  void MakePool(const std::string& name, const std::string& token) {
    PoolSpec spec;
    spec.kind = PoolKind::kMha;
    spec.layout = LayoutKind::kPageFirst;
    spec.dtype = DType::kBf16;
    spec.page_size = 4;
    spec.layer_num = 2;
    spec.head_num = 1;
    spec.head_dim = 8;
    spec.size_tokens = 16;
    absl::StatusOr<std::shared_ptr<Pool>> pool = registry_->Create(name, spec, {}, token);
    FUZZ_CHECK(pool.ok(), name, ": ", pool.status().ToString());
  }

  // The attachment `f` describes, on a device file of its own.
  std::string Attach(const Fixture& f) {
    std::shared_ptr<Pool> pool = *registry_->Get(f.pool);
    const uint64_t row = pool->layout().token_bytes;
    const uint64_t layers = pool->layout().layers;
    const std::string path = absl::StrCat(dir_, "/dev-", f.placeholder + 1);
    const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    FUZZ_CHECK(
        fd >= 0 && ::ftruncate(fd, static_cast<off_t>(2 * layers * kDeviceTokens * row)) == 0,
        path);
    ::close(fd);
    AttachRequest request;
    request.device_size_tokens = kDeviceTokens;
    for (uint64_t l = 0; l < layers; ++l) {
      request.k_layers.push_back(
          {DeviceBufferRef::Kind::kShm, path, "", "", l * kDeviceTokens * row});
      request.v_layers.push_back(
          {DeviceBufferRef::Kind::kShm, path, "", "", (layers + l) * kDeviceTokens * row});
    }
    request.layer_progress = f.progress;
    if (f.session >= 0) request.session_id = sessions_[static_cast<size_t>(f.session)];
    absl::StatusOr<AttachmentInfo> info = manager_->Attach(PoolTarget{pool, nullptr}, request);
    FUZZ_CHECK(info.ok(), f.placeholder, ": ", info.status().ToString());
    return info->id;
  }

  void CheckDecode(const uint8_t* data, size_t size, const absl::Status& decoded,
                   const v1::HandoffRequest& request) {
    if (!decoded.ok()) {
      FUZZ_CHECK(IsErrorOf(decoded, {absl::StatusCode::kInvalidArgument}), decoded.ToString());
      if (size > kMaxHandoffRequestBytes) {
        FUZZ_CHECK(absl::StrContains(decoded.message(), "over the limit"), decoded.ToString());
      }
      return;
    }
    FUZZ_CHECK(size >= 1 && size <= kMaxHandoffRequestBytes, size);
    FUZZ_CHECK(request.kind() != v1::HANDOFF_KIND_UNSPECIFIED, "no kind");
    v1::HandoffRequest again;
    FUZZ_CHECK(again.ParseFromArray(data, static_cast<int>(size)), "parses");
    FUZZ_CHECK(again.SerializeAsString() == request.SerializeAsString(), "decoded as parsed");
  }

  // The placeholders of the file's comment, replaced by what they stand for.
  void Substitute(v1::HandoffRequest* request) const {
    for (const Fixture& f : fixtures_) {
      if (request->attachment_id() == f.placeholder) {
        request->set_attachment_id(f.id);
      } else if (request->attachment_id() == absl::StrCat(f.placeholder, "-")) {
        request->set_attachment_id(f.id.substr(0, f.id.size() - 1));
      }
    }
    for (int i = 0; i < request->session_ids_size(); ++i) {
      if (request->session_ids(i) == "@0") request->set_session_ids(i, sessions_[0]);
      if (request->session_ids(i) == "@1") request->set_session_ids(i, sessions_[1]);
    }
    if (request->owner_token() == "@T") request->set_owner_token(kToken);
  }

  // Whether `caller` may use attachment `f`, by the rule of
  // server/access/caller.h: no session serves anyone; a session serves
  // who names it, and, on an owner-protected pool, who presents its token.
  static bool Serves(const Fixture& f, const Caller& caller, const std::string& session) {
    if (f.session < 0) return true;
    for (const std::string& s : caller.sessions) {
      if (s == session) return true;
    }
    return std::string(f.pool) == "locked" && caller.token.has_value() && *caller.token == kToken;
  }

  void CheckLookup(const v1::HandoffRequest& request, const Caller& caller,
                   const absl::StatusOr<HandoffItem>& found) const {
    if (!found.ok()) {
      for (const std::string& secret : secrets_) {
        FUZZ_CHECK(!absl::StrContains(found.status().message(), secret),
                   "a capability in the message: ", found.status().ToString());
      }
    }
    if (request.kind() != v1::HANDOFF_KIND_LAYER_COUNTERS &&
        request.kind() != v1::HANDOFF_KIND_POOL_REGIONS &&
        request.kind() != v1::HANDOFF_KIND_POOL_MAP) {
      FUZZ_CHECK(IsErrorOf(found.status(), {absl::StatusCode::kInvalidArgument}),
                 found.status().ToString());
      return;
    }
    const Fixture* target = nullptr;
    for (const Fixture& f : fixtures_) {
      if (request.attachment_id() == f.id) target = &f;
    }
    const std::string session = target != nullptr && target->session >= 0
                                    ? sessions_[static_cast<size_t>(target->session)]
                                    : "";
    if (target == nullptr || !Serves(*target, caller, session)) {
      FUZZ_CHECK(IsErrorOf(found.status(), {absl::StatusCode::kNotFound}),
                 found.status().ToString());
      return;
    }
    // This daemon serves no worker copies (no --worker-copy, host engine).
    if (request.kind() == v1::HANDOFF_KIND_POOL_REGIONS) {
      FUZZ_CHECK(IsErrorOf(found.status(), {absl::StatusCode::kFailedPrecondition}),
                 found.status().ToString());
      return;
    }
    // The caller's own map: the pool's regions, read-write, for an
    // attachment made within a session only (nothing else ends the hold).
    if (request.kind() == v1::HANDOFF_KIND_POOL_MAP) {
      if (target->session < 0) {
        FUZZ_CHECK(IsErrorOf(found.status(), {absl::StatusCode::kFailedPrecondition}),
                   found.status().ToString());
        return;
      }
      FUZZ_CHECK(found.ok(), target->placeholder, ": ", found.status().ToString());
      FUZZ_CHECK(
          found->keep != nullptr && !found->fds.empty() && found->count == found->fds.size() &&
              static_cast<size_t>(found->pool_regions.region_bytes_size()) == found->fds.size(),
          target->placeholder);
      uint64_t total = 0;
      for (size_t r = 0; r < found->fds.size(); ++r) {
        struct stat st;
        FUZZ_CHECK(::fstat(found->fds[r], &st) == 0 &&
                       static_cast<uint64_t>(st.st_size) >=
                           found->pool_regions.region_bytes(static_cast<int>(r)),
                   r);
        FUZZ_CHECK((::fcntl(found->fds[r], F_GETFL) & O_ACCMODE) == O_RDWR, "read-write");
        total += found->pool_regions.region_bytes(static_cast<int>(r));
      }
      FUZZ_CHECK(found->bytes == total, found->bytes);
      return;
    }
    if (!target->progress) {
      FUZZ_CHECK(IsErrorOf(found.status(), {absl::StatusCode::kFailedPrecondition}),
                 found.status().ToString());
      return;
    }
    FUZZ_CHECK(found.ok(), target->placeholder, ": ", found.status().ToString());
    FUZZ_CHECK(found->fds.size() == 1 && found->fds[0] >= 0 && found->keep != nullptr,
               target->placeholder);
    const int fd = found->fds[0];
    FUZZ_CHECK(found->count == kDefaultLoadEventSets, found->count);
    FUZZ_CHECK(found->bytes >= uint64_t{8} * found->count, found->bytes);
    struct stat st;
    FUZZ_CHECK(::fstat(fd, &st) == 0 && static_cast<uint64_t>(st.st_size) == found->bytes,
               found->bytes);
    FUZZ_CHECK((::fcntl(fd, F_GETFL) & O_ACCMODE) == O_RDONLY, "read-only descriptor");
  }

  std::string dir_;
  std::unique_ptr<PoolRegistry> registry_;
  std::unique_ptr<TransferManager> manager_;
  HandoffSource source_;
  std::string sessions_[2];
  Fixture fixtures_[4] = {{"@A", "open", -1, true, ""},
                          {"@B", "open", 0, true, ""},
                          {"@C", "locked", 1, true, ""},
                          {"@D", "open", 0, false, ""}};
  std::vector<std::string> secrets_;
};

}  // namespace
}  // namespace kvhost::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // One manager for the process: its attachments and sessions are read,
  // never changed, by every input.
  static auto* harness = new kvhost::fuzz::Harness();
  harness->RunInput(data, size);
  return 0;
}
