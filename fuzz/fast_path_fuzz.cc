// fast_path_fuzz: the fast path's request decoding and dispatch
// (FastPathCalls::Handle, what every mailbox thread runs on the bytes a
// client wrote) over real services: PoolServiceImpl and TransferServiceImpl
// on a TransferManager with the host engine, a PoolRegistry in a scratch
// directory, an owner-protected pool and a plain one, an attachment of the
// plain one.
//
// An input is a sequence of frames, each `mode byte, length byte, bytes`:
// mode bit 0 set sends the bytes as they are (a raw frame); clear builds a
// FastPathRequest of method (mode >> 1) % 9 with the bytes as its body and
// credentials chosen by mode bit 5 / 6 (owner token right or wrong, the
// attachment's id substituted into a Backup / Load / AllocBackup body the
// fuzzer cannot guess). After every frame:
//   * the reply is a FastPathReply no larger than the capacity given;
//   * its code is one a client can act on, and an error has a message;
//   * a failed call left every pool's allocated pages as they were;
//   * an OK Alloc / AllocBatch / AllocBackup allocated exactly what its
//     reply names, an OK Free freed exactly what it names;
//   * every pool keeps free + allocated == page_num;
//   * a frame naming more than kMaxCallerSessions session ids is
//     INVALID_ARGUMENT naming the bound (seed too_many_sessions).
// After each input everything allocated is freed and tickets drained, so
// inputs do not depend on each other.
#include <fuzzer/FuzzedDataProvider.h>
#include <google/protobuf/stubs/logging.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "fuzz/fuzz_check.h"
#include "kvhost/v1/fast_path.pb.h"
#include "server/pool/registry.h"
#include "server/service/convert.h"
#include "server/service/fast_path_calls.h"
#include "server/service/pool_service.h"
#include "server/service/transfer_service.h"
#include "server/transfer/host_engine.h"
#include "server/transfer/transfer_manager.h"

namespace kvhost::fuzz {
namespace {

constexpr uint64_t kMemoryLimit = 1 << 20;
constexpr uint64_t kMaxIndices = 4096;
// Small, so that reply bounds are reached.
constexpr uint32_t kCapacity = 4096;
constexpr int kMaxFrames = 16;
constexpr char kToken[] = "fuzz-owner";

// Every pool's allocated pages (by name).
using Allocated = std::map<std::string, std::set<uint64_t>>;

class Fixture {
 public:
  Fixture() {
    google::protobuf::SetLogHandler(nullptr);
    char dir[] = "/dev/shm/kvhost-fast-path-fuzz-XXXXXX";
    if (mkdtemp(dir) == nullptr) Fail(__FILE__, __LINE__, "mkdtemp in /dev/shm failed");
    dir_ = dir;
    static std::string scratch = dir_;
    atexit([] { rmdir(scratch.c_str()); });
    RegistryOptions options;
    options.shm_dir = dir_;
    options.memory_limit = kMemoryLimit;
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
    pools_ =
        std::make_unique<PoolServiceImpl>(registry_.get(), "host", 64 << 20, nullptr, kMaxIndices);
    transfers_ =
        std::make_unique<TransferServiceImpl>(manager_.get(), registry_.get(), kMaxIndices);
    calls_ = std::make_unique<FastPathCalls>(pools_.get(), transfers_.get());
    Make("p", "");
    Make("owned", kToken);
    // A device pool in the scratch dir for "p": 16 rows per layer buffer.
    AttachRequest attach;
    absl::StatusOr<std::shared_ptr<Pool>> p = registry_->Get("p");
    FUZZ_CHECK(p.ok(), p.status().ToString());
    const uint64_t row = (*p)->components()[0].row_bytes();
    const uint32_t layers = (*p)->spec().layer_num;
    device_path_ = dir_ + "/device";
    FILE* f = fopen(device_path_.c_str(), "wb");
    FUZZ_CHECK(f != nullptr, "cannot make ", device_path_);
    const std::string zeros(row * 16 * layers * 2, '\0');
    fwrite(zeros.data(), 1, zeros.size(), f);
    fclose(f);
    v1::AttachDeviceRequest request;
    request.set_pool("p");
    request.set_device_size_tokens(16);
    for (uint32_t l = 0; l < 2 * layers; ++l) {
      v1::DeviceBuffer* b = l < layers ? request.add_k_layers() : request.add_v_layers();
      b->mutable_shm()->set_path(device_path_);
      b->mutable_shm()->set_offset(row * 16 * l);
    }
    absl::StatusOr<AttachRequest> parsed = FromProto(request);
    FUZZ_CHECK(parsed.ok(), parsed.status().ToString());
    absl::StatusOr<AttachmentInfo> info = manager_->Attach(PoolTarget{*p, nullptr}, *parsed);
    FUZZ_CHECK(info.ok(), info.status().ToString());
    attachment_ = info->id;
  }

  void Run(const uint8_t* data, size_t size) {
    FuzzedDataProvider in(data, size);
    for (int i = 0; i < kMaxFrames && in.remaining_bytes() > 0; ++i) {
      const uint8_t mode = in.ConsumeIntegral<uint8_t>();
      const std::string bytes = in.ConsumeBytesAsString(in.ConsumeIntegral<uint8_t>());
      One(mode, bytes);
    }
    Reset();
  }

 private:
  void Make(const std::string& name, const std::string& token) {
    v1::PoolSpec spec;
    spec.set_kind(v1::MHA);
    spec.set_layout(v1::LAYER_FIRST);
    spec.set_dtype(v1::BF16);
    spec.set_page_size(4);
    spec.set_layer_num(2);
    spec.set_head_num(1);
    spec.set_head_dim(4);
    spec.set_size_tokens(64);
    absl::StatusOr<PoolSpec> s = FromProto(spec);
    FUZZ_CHECK(s.ok(), s.status().ToString());
    absl::StatusOr<std::shared_ptr<Pool>> made = registry_->Create(name, *s, {}, token);
    FUZZ_CHECK(made.ok(), made.status().ToString());
  }

  Allocated Take() const {
    Allocated out;
    for (const std::shared_ptr<Pool>& pool : registry_->List()) {
      const PageAllocator& a = pool->allocator();
      std::set<uint64_t>& pages = out[pool->name()];
      for (uint64_t p = 0; p < pool->page_num(); ++p) {
        const int64_t slot[1] = {static_cast<int64_t>(p * pool->page_size())};
        if (a.CheckAllocated(slot).ok()) pages.insert(p);
      }
      FUZZ_CHECK(a.free_pages() + pages.size() == pool->page_num(), pool->Label(), ": free ",
                 a.free_pages(), " + allocated ", pages.size(), " != ", pool->page_num());
    }
    return out;
  }

  // The frame of `mode` and `bytes` (see the top).
  std::string Frame(uint8_t mode, const std::string& bytes) const {
    if ((mode & 1) != 0) return bytes;
    v1::FastPathRequest request;
    request.set_method(static_cast<v1::FastPathMethod>((mode >> 1) % 9));
    request.set_body(bytes);
    if ((mode & 0x20) != 0) request.set_owner_token((mode & 0x40) != 0 ? kToken : "wrong");
    request.set_timeout_ms((mode & 0x80) != 0 ? 1 : 0);
    // Give transfers the attachment: parse what the fuzzer wrote and name it.
    switch (request.method()) {
      case v1::FAST_PATH_METHOD_BACKUP: {
        v1::BackupRequest r;
        if (r.ParseFromString(bytes) && r.attachment_id().empty()) {
          r.set_attachment_id(attachment_);
          r.clear_wait_event_handle();
          request.set_body(r.SerializeAsString());
        }
        break;
      }
      case v1::FAST_PATH_METHOD_LOAD: {
        v1::LoadRequest r;
        if (r.ParseFromString(bytes) && r.attachment_id().empty()) {
          r.set_attachment_id(attachment_);
          request.set_body(r.SerializeAsString());
        }
        break;
      }
      case v1::FAST_PATH_METHOD_ALLOC_BACKUP: {
        v1::AllocBackupRequest r;
        if (r.ParseFromString(bytes) && r.backup().attachment_id().empty()) {
          r.mutable_backup()->set_attachment_id(attachment_);
          r.mutable_backup()->clear_wait_event_handle();
          request.set_body(r.SerializeAsString());
        }
        break;
      }
      case v1::FAST_PATH_METHOD_WAIT_TRANSFER:
        // Waits are polls here: a fuzzer must not sleep.
        if (v1::WaitTransferRequest r; r.ParseFromString(bytes)) {
          r.set_poll(true);
          request.set_body(r.SerializeAsString());
        }
        break;
      default:
        break;
    }
    return request.SerializeAsString();
  }

  void One(uint8_t mode, const std::string& bytes) {
    const Allocated before = Take();
    v1::FastPathMethod method = v1::FAST_PATH_METHOD_UNSPECIFIED;
    absl::StatusCode code = absl::StatusCode::kOk;
    const std::string frame = Frame(mode, bytes);
    const std::string out = calls_->Handle(frame, kCapacity, &method, &code);
    FUZZ_CHECK(out.size() <= kCapacity, "reply of ", out.size(), " bytes over ", kCapacity);
    v1::FastPathReply reply;
    FUZZ_CHECK(reply.ParseFromString(out), "the reply is not a FastPathReply");
    if (v1::FastPathRequest parsed;
        parsed.ParseFromString(frame) && parsed.session_ids_size() > kMaxCallerSessions) {
      FUZZ_CHECK(code == absl::StatusCode::kInvalidArgument &&
                     reply.message().find(absl::StrCat("limit of ", kMaxCallerSessions)) !=
                         std::string::npos,
                 parsed.session_ids_size(), " session ids: ", reply.message());
    }
    FUZZ_CHECK(reply.code() == static_cast<int>(code), "code ", reply.code(), " vs ",
               static_cast<int>(code));
    const Allocated after = Take();
    if (code != absl::StatusCode::kOk) {
      FUZZ_CHECK(
          code == absl::StatusCode::kInvalidArgument || code == absl::StatusCode::kNotFound ||
              code == absl::StatusCode::kFailedPrecondition ||
              code == absl::StatusCode::kPermissionDenied ||
              code == absl::StatusCode::kResourceExhausted || code == absl::StatusCode::kOutOfRange,
          "method ", FastPathMethodName(method), ": code ", absl::StatusCodeToString(code), ": ",
          reply.message());
      FUZZ_CHECK(!reply.message().empty(), "an error without a message");
      FUZZ_CHECK(before == after, "a failed ", FastPathMethodName(method),
                 " changed the allocated pages: ", reply.message());
      return;
    }
    CheckChange(method, reply.body(), before, after);
  }

  // What an OK call changed is what its reply names.
  void CheckChange(v1::FastPathMethod method, const std::string& body, const Allocated& before,
                   const Allocated& after) {
    std::vector<int64_t> named;
    bool allocates = true;
    std::string pool = "p";
    switch (method) {
      case v1::FAST_PATH_METHOD_ALLOC: {
        v1::AllocResponse r;
        FUZZ_CHECK(r.ParseFromString(body), "Alloc reply");
        named.assign(r.indices().begin(), r.indices().end());
        break;
      }
      case v1::FAST_PATH_METHOD_ALLOC_BATCH: {
        v1::AllocBatchResponse r;
        FUZZ_CHECK(r.ParseFromString(body), "AllocBatch reply");
        for (const v1::IndexRun& run : r.runs()) {
          named.insert(named.end(), run.indices().begin(), run.indices().end());
        }
        break;
      }
      case v1::FAST_PATH_METHOD_ALLOC_BACKUP: {
        v1::AllocBackupResponse r;
        FUZZ_CHECK(r.ParseFromString(body), "AllocBackup reply");
        named.assign(r.host_indices().begin(), r.host_indices().end());
        break;
      }
      case v1::FAST_PATH_METHOD_FREE:
        allocates = false;
        break;
      default:
        FUZZ_CHECK(before == after, FastPathMethodName(method), " changed the allocated pages");
        return;
    }
    // The pool changed is the only one whose pages differ.
    size_t changed = 0;
    for (const auto& [name, pages] : after) {
      if (before.at(name) != pages) {
        ++changed;
        pool = name;
      }
    }
    FUZZ_CHECK(changed <= 1, FastPathMethodName(method), " changed ", changed, " pools");
    const std::set<uint64_t>& was = before.at(pool);
    const std::set<uint64_t>& now = after.at(pool);
    if (!allocates) {
      FUZZ_CHECK(now.size() <= was.size(), "Free allocated pages");
      for (uint64_t p : now) FUZZ_CHECK(was.count(p) == 1, "Free allocated page ", p);
      return;
    }
    std::set<uint64_t> pages;
    for (int64_t slot : named) pages.insert(static_cast<uint64_t>(slot) / 4);
    FUZZ_CHECK(now.size() == was.size() + pages.size(), FastPathMethodName(method), " allocated ",
               now.size() - was.size(), " pages, its reply names ", pages.size());
    for (uint64_t p : pages) {
      FUZZ_CHECK(was.count(p) == 0 && now.count(p) == 1, FastPathMethodName(method), " page ", p);
    }
  }

  void Reset() {
    // The transfers of this input end before their pages are freed. Not
    // Drain: that refuses every later transfer (UNAVAILABLE), and the next
    // input runs on the same manager.
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (manager_->counters().tickets_in_flight > 0) {
      FUZZ_CHECK(absl::Now() < deadline, manager_->counters().tickets_in_flight,
                 " transfers still in flight after 10 s");
      absl::SleepFor(absl::Microseconds(100));
    }
    for (const std::shared_ptr<Pool>& pool : registry_->List()) {
      std::vector<int64_t> slots;
      for (uint64_t p = 0; p < pool->page_num(); ++p) {
        const int64_t slot[1] = {static_cast<int64_t>(p * pool->page_size())};
        if (!pool->allocator().CheckAllocated(slot).ok()) continue;
        for (uint64_t j = 0; j < pool->page_size(); ++j) {
          slots.push_back(static_cast<int64_t>(p * pool->page_size() + j));
        }
      }
      if (!slots.empty()) {
        absl::StatusOr<uint64_t> freed = pool->Free(slots);
        FUZZ_CHECK(freed.ok(), freed.status().ToString());
      }
    }
  }

  std::string dir_;
  std::string device_path_;
  std::string attachment_;
  std::unique_ptr<PoolRegistry> registry_;
  std::unique_ptr<TransferManager> manager_;
  std::unique_ptr<PoolServiceImpl> pools_;
  std::unique_ptr<TransferServiceImpl> transfers_;
  std::unique_ptr<FastPathCalls> calls_;
};

}  // namespace
}  // namespace kvhost::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static kvhost::fuzz::Fixture* fixture = new kvhost::fuzz::Fixture();
  fixture->Run(data, size);
  return 0;
}
