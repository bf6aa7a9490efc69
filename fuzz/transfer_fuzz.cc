// transfer_fuzz: kvhost.v1.TransferService end to end in process: fuzzed
// sequences of AttachDevice, DetachDevice, Backup, Load and WaitTransfer
// (with Alloc, Free, DeletePool of the PoolService and worker sessions
// opening and closing around them) through a gRPC in-process channel into
// TransferServiceImpl and PoolServiceImpl, over a TransferManager with the
// host engine and a PoolRegistry in a scratch directory.
//
// Every input starts from the same state: pools of several kinds and
// layouts (MHA LAYER_FIRST page 1, MHA PAGE_FIRST page 16 holding device
// layers [1, 3), MHA PAGE_HEAD with an owner token, MLA with a DSA_INDEXER
// follower, V4_PAGED page rows, LOGICAL, a pool group of an MHA and a
// MAMBA pool, and MHA PAGE_UNIFIED in two head groups, whose K and V
// interleave), half of each pool's slots allocated, two worker sessions
// open, and one emulated device buffer per pool: a shared-memory file in the
// scratch directory laid out component-major, kDeviceLayers layer buffers
// of device_tokens rows each (what client/client.cc's ShmDevicePool does).
// The scratch directory also holds hostile fixtures: a sub-directory,
// symlinks out of it and back in, a FIFO, an empty and a short file; a
// sibling directory whose name extends the scratch directory's holds the
// "outside" file.
//
// An input is a sequence of operations (see Op); their arguments are read
// from the input bytes after the operation's byte. AttachDevice requests
// start well formed (every buffer of the target in its device file) and get
// fuzzed mutations: paths inside and outside the scratch directory, offsets,
// layer ranges, device_size_tokens, session ids, tp ranks, load_only, event
// sets, CUDA buffers, components, group entries. Index lists of Backup and
// Load come from the allocated slots or raw values, in whole pages or not,
// with pool_transfers for the group. Every TransferService call carries the
// worker's session ids in `kvhost-session` metadata (and sometimes the
// owner token in `kvhost-token`), so the target works whether or not the
// service checks who calls; ticket ids are only ever taken from replies (or
// fuzzed), never assumed sequential.
//
// After every call:
//   * a failed call has a code a client can act on (not UNKNOWN, INTERNAL,
//     DEADLINE_EXCEEDED, ...; a blocking WaitTransfer the harness bounded
//     may end with DEADLINE_EXCEEDED, a WaitTransfer may return the
//     ticket's own failure) and a non-empty message, and changed nothing:
//     the pools' allocated pages and attachment counts, the groups'
//     attachment counts, and, when no ticket was in flight, every pool's and
//     every device file's bytes;
//   * a successful AttachDevice adds one attachment to each pool it names,
//     with an id no live attachment has, and its buffers lie inside the
//     files it names; a successful DetachDevice removes them;
//   * a Backup / Load that asked to be verified (and had no other ticket in
//     flight) finishes OK with every layer, and then, byte for byte, every
//     host slot equals the device row it was paired with (every component,
//     layer and head, by the layout's own address math), and the other
//     side's bytes did not change;
//   * a successful WaitTransfer names its ticket, and a blocking one is done.
// After each input every ticket must end within kTicketTimeout and report
// done; everything is detached and deleted, and the scratch directory holds
// only the fixtures again.
#include <dirent.h>
#include <fcntl.h>
#include <google/protobuf/stubs/logging.h>
#include <google/protobuf/text_format.h>
#include <grpcpp/grpcpp.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "fuzz/fuzz_check.h"
#include "kvhost/v1/pool.grpc.pb.h"
#include "kvhost/v1/transfer.grpc.pb.h"
#include "server/access/credentials.h"
#include "server/pool/registry.h"
#include "server/service/convert.h"
#include "server/service/pool_service.h"
#include "server/service/transfer_service.h"
#include "server/transfer/host_engine.h"
#include "server/transfer/transfer_manager.h"

namespace kvhost::fuzz {
namespace {

constexpr uint64_t kMemoryLimit = 4 << 20;
constexpr int kMaxCalls = 24;
// The in-process service's --max-indices-per-call: small, so inputs reach it.
constexpr uint64_t kMaxIndices = 64;
// Layer buffers per component in a device file (the most any pool here
// attaches by default is 4).
constexpr uint32_t kDeviceLayers = 4;
// Bytes past the last layer buffer of a device file, so offsets a little
// off still fit.
constexpr uint64_t kDeviceSlack = 256;
constexpr auto kCallDeadline = std::chrono::seconds(10);
// How long a ticket may take: the pools are a few KiB.
constexpr absl::Duration kTicketTimeout = absl::Seconds(10);
// The session metadata key (TransferService checks it once attachments
// belong to their session).
constexpr char kSessionKey[] = "kvhost-session";

// What an input does, one byte each (modulo kOpCount).
enum Op : uint8_t {
  kAttach,        // target, mutation count, mutations
  kAttachRaw,     // length, AttachDeviceRequest bytes
  kDetach,        // attachment, caller
  kBackup,        // see ReadTransfer
  kLoad,          // see ReadTransfer
  kWaitPoll,      // ticket, caller
  kWaitBlocking,  // ticket, caller, deadline in ms
  kAlloc,         // pool, tokens
  kFree,          // pool, page
  kCloseSession,  // which; a new session takes its place
  kDeletePool,    // name
  kQuiesce,       // waits for every ticket in flight
  kOpCount,
};

// What the inputs reached, printed at exit when TRANSFER_FUZZ_STATS is set
// (to see that a corpus gets past validation); TRANSFER_FUZZ_TRACE prints
// every call and its status.
struct Stats {
  uint64_t calls[kOpCount][2] = {};  // [op][ok]
  uint64_t verified[2] = {};         // backups, loads checked byte for byte
  uint64_t rows_checked = 0;
};
Stats stats;

// ---------------------------------------------------------------------------
// Input bytes, read front to back; zeros once they run out.
class Reader {
 public:
  Reader(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  bool empty() const { return at_ >= size_; }
  uint8_t U8() { return at_ < size_ ? data_[at_++] : 0; }
  uint16_t U16() { return static_cast<uint16_t>(U8() | (U8() << 8)); }
  uint32_t U32() { return U16() | (static_cast<uint32_t>(U16()) << 16); }
  uint64_t U64() { return U32() | (static_cast<uint64_t>(U32()) << 32); }
  std::string Bytes(size_t n) {
    n = std::min(n, size_ - std::min(at_, size_));
    std::string out(reinterpret_cast<const char*>(data_) + at_, n);
    at_ += n;
    return out;
  }
  // A size or count: interesting values by table, small ones, or any.
  uint64_t Size() {
    static constexpr uint64_t kTable[] = {0,
                                          1,
                                          2,
                                          3,
                                          4,
                                          7,
                                          8,
                                          15,
                                          16,
                                          17,
                                          31,
                                          32,
                                          33,
                                          64,
                                          65,
                                          255,
                                          256,
                                          4096,
                                          1u << 20,
                                          uint64_t{1} << 32,
                                          uint64_t{1} << 40,
                                          (uint64_t{1} << 40) + 1,
                                          uint64_t{1} << 63,
                                          UINT64_MAX,
                                          UINT64_MAX - 7};
    constexpr uint8_t n = sizeof(kTable) / sizeof(kTable[0]);
    const uint8_t v = U8();
    if (v < n) return kTable[v];
    if (v < 240) return v - n;
    return U64();
  }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t at_ = 0;
};

uint64_t Fnv(const uint8_t* p, uint64_t n, uint64_t h = 1469598103934665603ull) {
  for (uint64_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

std::string Real(const std::string& path) {
  char buf[PATH_MAX];
  return ::realpath(path.c_str(), buf) != nullptr ? std::string(buf) : std::string();
}

// ---------------------------------------------------------------------------
// The pools every input starts with.
struct PoolDef {
  const char* name;
  const char* spec;  // v1::PoolSpec in text format
  uint64_t device_tokens;
  const char* token = "";  // owner token
};

const PoolDef kPools[] = {
    {"lf1",
     "kind: MHA layout: LAYER_FIRST dtype: BF16 page_size: 1 layer_num: 2 head_num: 2 "
     "head_dim: 4 size_tokens: 32",
     16},
    {"pf16",
     "kind: MHA layout: PAGE_FIRST dtype: FP16 page_size: 16 layer_num: 2 start_layer: 1 "
     "head_num: 1 head_dim: 8 size_tokens: 64",
     32},
    {"ph",
     "kind: MHA layout: PAGE_HEAD dtype: FP16 page_size: 2 layer_num: 2 head_num: 4 head_dim: 2 "
     "size_tokens: 16",
     8, "tok-ph"},
    {"mla",
     "kind: MLA layout: LAYER_FIRST dtype: BF16 page_size: 2 layer_num: 2 kv_lora_rank: 4 "
     "qk_rope_head_dim: 2 size_tokens: 16",
     8},
    {"idx",
     "kind: DSA_INDEXER layout: PAGE_FIRST dtype: UINT8 layer_num: 2 index_head_dim: 8 "
     "index_quant_block_size: 4 follows: \"mla\"",
     8},
    {"v4",
     "kind: V4_PAGED layout: PAGE_FIRST dtype: UINT8 page_size: 4 layer_num: 2 "
     "item_bytes: 16 size_tokens: 16",
     8},
    {"log", "kind: LOGICAL layout: PAGE_FIRST dtype: BF16 page_size: 4 size_tokens: 64", 16},
    {"gattn",
     "kind: MHA layout: PAGE_FIRST dtype: BF16 page_size: 4 layer_num: 4 head_num: 1 "
     "head_dim: 4 size_tokens: 32",
     16},
    {"gssm",
     "kind: MAMBA layout: PAGE_FIRST_DIRECT dtype: BF16 page_size: 1 layer_num: 2 "
     "size_tokens: 16 mamba { temporal { dims: [2, 3] } temporal_dtype: FP32 conv { dims: [5] } }",
     8},
    {"pu",
     "kind: MHA layout: PAGE_UNIFIED dtype: BF16 page_size: 2 layer_num: 2 head_num: 4 "
     "head_dim: 2 head_groups: 2 size_tokens: 16",
     8},
};
constexpr size_t kPoolCount = sizeof(kPools) / sizeof(kPools[0]);
constexpr char kGroup[] = "grp";
// kGroup: model layers, and its entries (the anchor last).
constexpr uint32_t kGroupLayers = 6;
struct GroupDef {
  const char* entry;
  const char* pool;
  std::vector<int32_t> layer_map;
  bool anchor;
};
const GroupDef kGroupEntries[] = {
    {"kv", "gattn", {-1, 0, 1, -1, 3, -1}, false},
    {"ssm", "gssm", {0, -1, -1, 1, -1, -1}, true},
};

bool TakesKLayers(PoolKind kind) {
  return kind == PoolKind::kMha || kind == PoolKind::kMla || kind == PoolKind::kMhaAsymmetric ||
         kind == PoolKind::kKOnly || kind == PoolKind::kDsa;
}
bool TakesVLayers(PoolKind kind) {
  return kind == PoolKind::kMha || kind == PoolKind::kMhaAsymmetric;
}

// A pool's emulated device buffers: one shared-memory file, component-major,
// kDeviceLayers layer buffers of `rows` rows per component.
struct DeviceFile {
  std::string name;  // the pool's
  std::string path;
  std::string real;  // realpath
  uint8_t* data = nullptr;
  uint64_t size = 0;
  uint64_t tokens = 0;                // device_size_tokens
  std::vector<uint64_t> block;        // per component: its first layer's offset
  std::vector<uint64_t> layer_bytes;  // per component
  uint64_t Offset(size_t c, uint32_t layer) const {
    return block[c] + uint64_t{layer} * layer_bytes[c];
  }
};

// One entry of an attachment (a plain attachment has one), resolved for the
// byte checks.
struct AttachedEntry {
  std::string entry;  // "" for a plain attachment
  std::shared_ptr<Pool> pool;
  uint32_t start = 0;  // device layers attached
  uint32_t end = 0;
  std::vector<int32_t> map;  // per ticket layer: the device layer copied, or -1
  // [component][attached layer]: the buffer in one of the harness's device
  // files, or null (a path that is no device file of ours).
  std::vector<std::vector<uint8_t*>> buffers;
  uint64_t device_tokens = 0;
};

struct Attached {
  std::string id;
  std::string target;
  bool group = false;
  bool load_only = false;
  std::string session;  // "" none
  uint32_t layer_num = 0;
  std::vector<AttachedEntry> entries;  // the group's order
  size_t anchor = 0;
  bool verifiable = true;  // every buffer in a device file of ours
  bool disjoint = true;    // no two buffers overlap (Load results checkable)
};

struct Issued {
  uint64_t id;
  std::string session;  // of its attachment
};

// What a failed call must leave alone.
struct Snapshot {
  std::map<std::string, std::vector<bool>> pages;  // allocated, per pool
  std::map<std::string, uint32_t> attachments;     // per pool and group
  bool operator==(const Snapshot& o) const {
    return pages == o.pages && attachments == o.attachments;
  }
};

// Which identities a call presents.
struct CallerSel {
  bool sessions = true;  // every open session's id in kvhost-session
  int only = -1;         // just this session slot's
  bool token = false;    // kvhost-token of "ph"
};

// One pool's rows in a transfer request.
struct Rows {
  std::vector<int64_t> host, device;
};

class Harness {
 public:
  Harness() {
    google::protobuf::SetLogHandler(nullptr);
    char dir[] = "/dev/shm/kvhost-transfer-fuzz.XXXXXX";
    if (mkdtemp(dir) == nullptr) Fail(__FILE__, __LINE__, "mkdtemp in /dev/shm failed");
    dir_ = dir;
    // The outside directory's name extends the scratch directory's, so a
    // prefix comparison of paths would let it in.
    outside_dir_ = dir_ + "-out";
    FUZZ_CHECK(::mkdir(outside_dir_.c_str(), 0700) == 0, outside_dir_);
    static std::string scratch = dir_;
    atexit([] {
      std::error_code ec;
      std::filesystem::remove_all(scratch, ec);
      std::filesystem::remove_all(scratch + "-out", ec);
    });
    MakeFixtures();
    if (getenv("TRANSFER_FUZZ_STATS") != nullptr) {
      atexit([] {
        static const char* kNames[kOpCount] = {"Attach", "AttachRaw",    "Detach",       "Backup",
                                               "Load",   "WaitPoll",     "WaitBlocking", "Alloc",
                                               "Free",   "CloseSession", "DeletePool",   "Quiesce"};
        for (int op = 0; op < kOpCount; ++op) {
          fprintf(stderr, "transfer_fuzz: %-13s ok %8llu  failed %8llu\n", kNames[op],
                  static_cast<unsigned long long>(stats.calls[op][1]),
                  static_cast<unsigned long long>(stats.calls[op][0]));
        }
        fprintf(stderr, "transfer_fuzz: verified backups %llu, loads %llu, row pairs %llu\n",
                static_cast<unsigned long long>(stats.verified[0]),
                static_cast<unsigned long long>(stats.verified[1]),
                static_cast<unsigned long long>(stats.rows_checked));
      });
    }

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
    host.helper_threads = 1;
    // Tiny layers are split over the helper too, so the split is fuzzed.
    host.min_split_bytes = 64;
    manager_ = std::make_unique<TransferManager>(std::make_unique<HostEngine>(host));
    pool_service_ = std::make_unique<PoolServiceImpl>(registry_.get(), "host");
    transfer_service_ =
        std::make_unique<TransferServiceImpl>(manager_.get(), registry_.get(), kMaxIndices);
    grpc::ServerBuilder builder;
    builder.RegisterService(pool_service_.get());
    builder.RegisterService(transfer_service_.get());
    server_ = builder.BuildAndStart();
    if (!server_) Fail(__FILE__, __LINE__, "in-process server did not start");
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(64 << 20);
    std::shared_ptr<grpc::Channel> channel = server_->InProcessChannel(args);
    pools_ = v1::PoolService::NewStub(channel);
    transfers_ = v1::TransferService::NewStub(channel);

    // The device files, sized from a first creation of the pools.
    CreatePools();
    for (const PoolDef& def : kPools) {
      std::shared_ptr<Pool> pool = *registry_->Get(def.name);
      DeviceFile f;
      f.name = def.name;
      f.path = absl::StrCat(dir_, "/dev-", def.name, ".bin");
      f.tokens = def.device_tokens;
      uint64_t at = 0;
      for (const Component& c : pool->components()) {
        f.block.push_back(at);
        f.layer_bytes.push_back(DeviceRowsOf(c, f.tokens).total_bytes());
        at += kDeviceLayers * f.layer_bytes.back();
      }
      f.size = at + kDeviceSlack;
      const int fd = ::open(f.path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
      FUZZ_CHECK(fd >= 0 && ::ftruncate(fd, static_cast<off_t>(f.size)) == 0, f.path);
      void* p = ::mmap(nullptr, f.size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      FUZZ_CHECK(p != MAP_FAILED, f.path);
      ::close(fd);
      f.data = static_cast<uint8_t*>(p);
      f.real = Real(f.path);
      fixtures_.insert(absl::StrCat("dev-", def.name, ".bin"));
      devices_.push_back(std::move(f));
    }
    DeleteAll();
  }

  void RunInput(const uint8_t* data, size_t size) {
    Setup();
    Reader r(data, size);
    for (int calls = 0; calls < kMaxCalls && !r.empty(); ++calls) Step(r);
    Finish();
  }

 private:
  // ------------------------------------------------------------ fixtures
  void MakeFixtures() {
    auto file = [](const std::string& path, uint64_t size) {
      const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
      FUZZ_CHECK(fd >= 0 && ::ftruncate(fd, static_cast<off_t>(size)) == 0, path);
      ::close(fd);
    };
    outside_file_ = outside_dir_ + "/file";
    file(outside_file_, 1 << 16);
    FUZZ_CHECK(::mkdir((dir_ + "/sub").c_str(), 0700) == 0, "sub");
    file(dir_ + "/empty", 0);
    file(dir_ + "/small", 100);
    FUZZ_CHECK(::mkfifo((dir_ + "/fifo").c_str(), 0600) == 0, "fifo");
    FUZZ_CHECK(::symlink(outside_file_.c_str(), (dir_ + "/link-out").c_str()) == 0, "link-out");
    FUZZ_CHECK(::symlink("dev-lf1.bin", (dir_ + "/link-in").c_str()) == 0, "link-in");
    FUZZ_CHECK(::symlink("link-loop", (dir_ + "/link-loop").c_str()) == 0, "link-loop");
    FUZZ_CHECK(::symlink(outside_dir_.c_str(), (dir_ + "/link-outdir").c_str()) == 0, "outdir");
    FUZZ_CHECK(::symlink("sub", (dir_ + "/link-sub").c_str()) == 0, "link-sub");
    fixtures_ = {"sub",     "empty",     "small",       "fifo",    "link-out",
                 "link-in", "link-loop", "link-outdir", "link-sub"};
  }

  void CreatePools() {
    for (const PoolDef& def : kPools) {
      v1::PoolSpec proto;
      FUZZ_CHECK(google::protobuf::TextFormat::ParseFromString(def.spec, &proto), def.name);
      absl::StatusOr<PoolSpec> spec = FromProto(proto);
      FUZZ_CHECK(spec.ok(), def.name, ": ", spec.status().ToString());
      absl::StatusOr<std::shared_ptr<Pool>> pool =
          registry_->Create(def.name, *spec, {}, def.token);
      FUZZ_CHECK(pool.ok(), def.name, ": ", pool.status().ToString());
    }
    std::vector<GroupEntrySpec> entries;
    for (const GroupDef& e : kGroupEntries)
      entries.push_back({e.entry, e.pool, e.layer_map, e.anchor});
    absl::StatusOr<std::shared_ptr<PoolGroup>> group =
        registry_->CreateGroup(kGroup, kGroupLayers, entries);
    FUZZ_CHECK(group.ok(), group.status().ToString());
  }

  // Every input's start: the pools, their bytes, half their pages
  // allocated, two sessions.
  void Setup() {
    CreatePools();
    uint8_t salt = 0;
    for (const std::shared_ptr<Pool>& pool : registry_->List()) {
      ++salt;
      for (size_t r = 0; r < pool->region_count(); ++r) {
        uint8_t* p = pool->region_base(r);
        for (uint64_t i = 0; i < pool->region_bytes(r); ++i)
          p[i] = static_cast<uint8_t>(i * 7 + salt * 31 + r);
      }
      if (pool->follows() == nullptr) {
        const uint64_t half = pool->page_num() / 2 * pool->page_size();
        if (half > 0) {
          absl::StatusOr<std::vector<uint64_t>> got = pool->AllocPages(half);
          FUZZ_CHECK(got.ok(), pool->Label(), ": ", got.status().ToString());
        }
      }
    }
    for (size_t f = 0; f < devices_.size(); ++f) {
      for (uint64_t i = 0; i < devices_[f].size; ++i) {
        devices_[f].data[i] = static_cast<uint8_t>(i * 13 + f * 101 + 0x5a);
      }
    }
    for (std::string& s : sessions_) s = manager_->OpenSession("fuzz", 1, "in-process");
    all_sessions_ = {sessions_[0], sessions_[1]};
  }

  // ------------------------------------------------------------ state
  Snapshot Take() const {
    Snapshot snap;
    for (const std::shared_ptr<Pool>& pool : registry_->List()) {
      std::vector<bool>& pages = snap.pages[pool->name()];
      const uint64_t n = pool->page_num();
      for (uint64_t p = 0; p < n; ++p) {
        const int64_t slot[1] = {static_cast<int64_t>(p * pool->page_size())};
        pages.push_back(pool->allocator().CheckAllocated(slot).ok());
      }
      snap.attachments[pool->name()] = pool->attachments();
    }
    for (const std::shared_ptr<PoolGroup>& g : registry_->ListGroups()) {
      snap.attachments[absl::StrCat("group ", g->name())] = g->attachments();
    }
    return snap;
  }

  static std::string Diff(const Snapshot& a, const Snapshot& b) {
    std::string out;
    for (const auto& [name, n] : a.attachments) {
      auto it = b.attachments.find(name);
      if (it == b.attachments.end()) {
        absl::StrAppend(&out, " '", name, "' gone;");
      } else if (it->second != n) {
        absl::StrAppend(&out, " '", name, "' attachments ", n, " -> ", it->second, ";");
      }
    }
    for (const auto& [name, pages] : a.pages) {
      auto it = b.pages.find(name);
      if (it != b.pages.end() && it->second != pages) {
        absl::StrAppend(&out, " '", name, "' allocated pages changed;");
      }
    }
    if (b.attachments.size() > a.attachments.size()) absl::StrAppend(&out, " new pools;");
    return out;
  }

  uint64_t HostHash() const {
    uint64_t h = 1469598103934665603ull;
    for (const std::shared_ptr<Pool>& pool : registry_->List()) {
      for (size_t r = 0; r < pool->region_count(); ++r) {
        h = Fnv(pool->region_base(r), pool->region_bytes(r), h);
      }
    }
    return h;
  }
  uint64_t DeviceHash() const {
    uint64_t h = 1469598103934665603ull;
    for (const DeviceFile& f : devices_) h = Fnv(f.data, f.size, h);
    return h;
  }

  uint64_t InFlight() const { return manager_->counters().tickets_in_flight; }

  bool WaitIdle(absl::Duration timeout) const {
    const absl::Time deadline = absl::Now() + timeout;
    while (InFlight() > 0) {
      if (absl::Now() > deadline) return false;
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    return true;
  }

  // ------------------------------------------------------------ calls
  CallerSel ReadCaller(Reader& r) {
    const uint8_t b = r.U8();
    CallerSel c;
    switch (b % 8) {
      case 5:
        c.sessions = false;
        c.only = 0;
        break;
      case 6:
        c.sessions = false;
        c.only = 1;
        break;
      case 7:
        c.sessions = false;
        break;
      default:
        break;
    }
    c.token = (b & 0x10) != 0;
    return c;
  }

  std::unique_ptr<grpc::ClientContext> Context(const CallerSel& caller,
                                               std::chrono::milliseconds deadline = kCallDeadline) {
    auto context = std::make_unique<grpc::ClientContext>();
    context->set_deadline(std::chrono::system_clock::now() + deadline);
    if (caller.sessions) {
      for (const std::string& s : all_sessions_) context->AddMetadata(kSessionKey, s);
    } else if (caller.only >= 0) {
      context->AddMetadata(kSessionKey, sessions_[caller.only]);
    }
    if (caller.token) context->AddMetadata(kOwnerTokenMetadata, "tok-ph");
    return context;
  }

  static bool Actionable(grpc::StatusCode c) {
    return c == grpc::StatusCode::INVALID_ARGUMENT || c == grpc::StatusCode::NOT_FOUND ||
           c == grpc::StatusCode::ALREADY_EXISTS || c == grpc::StatusCode::FAILED_PRECONDITION ||
           c == grpc::StatusCode::RESOURCE_EXHAUSTED || c == grpc::StatusCode::OUT_OF_RANGE ||
           c == grpc::StatusCode::PERMISSION_DENIED || c == grpc::StatusCode::UNIMPLEMENTED;
  }

  void Step(Reader& r) {
    const Op op = static_cast<Op>(r.U8() % kOpCount);
    const Snapshot before = Take();
    const bool quiet = InFlight() == 0;
    const uint64_t host_before = quiet ? HostHash() : 0;
    const uint64_t device_before = quiet ? DeviceHash() : 0;
    grpc::Status status;
    std::string call;
    // Failure codes beyond Actionable() this call may end with.
    std::set<grpc::StatusCode> also;
    switch (op) {
      case kAttach: {
        v1::AttachDeviceRequest req = BuildAttach(r);
        call = absl::StrCat("AttachDevice ", req.ShortDebugString());
        status = Attach(req, r, before);
        break;
      }
      case kAttachRaw: {
        v1::AttachDeviceRequest req;
        if (!req.ParseFromString(r.Bytes(r.U8()))) return;
        call = absl::StrCat("AttachDevice (raw) ", req.ShortDebugString());
        status = Attach(req, r, before);
        break;
      }
      case kDetach: {
        const std::string id = PickAttachment(r);
        const CallerSel caller = ReadCaller(r);
        v1::DetachDeviceRequest req;
        req.set_attachment_id(id);
        v1::DetachDeviceResponse resp;
        status = transfers_->DetachDevice(Context(caller).get(), req, &resp);
        call = absl::StrCat("DetachDevice '", id, "'");
        if (status.ok()) CheckDetached(id, before);
        break;
      }
      case kBackup:
      case kLoad:
        status = Transfer(r, op == kBackup ? Direction::kBackup : Direction::kLoad, quiet, &call);
        break;
      case kWaitPoll:
      case kWaitBlocking: {
        const uint64_t id = PickTicket(r);
        const CallerSel caller = ReadCaller(r);
        const bool blocking = op == kWaitBlocking;
        const auto deadline = blocking ? std::chrono::milliseconds(1 + r.U8() % 64) : kCallDeadline;
        v1::WaitTransferRequest req;
        req.set_ticket_id(id);
        req.set_poll(!blocking);
        v1::TransferStatus resp;
        status = transfers_->WaitTransfer(Context(caller, deadline).get(), req, &resp);
        call = absl::StrCat("WaitTransfer ", req.ShortDebugString());
        if (blocking) also.insert(grpc::StatusCode::DEADLINE_EXCEEDED);
        // A ticket's own failure: a load cancelled by its session's end.
        also.insert(grpc::StatusCode::CANCELLED);
        if (status.ok()) {
          FUZZ_CHECK(resp.ticket_id() == id, call, " answered for ticket ", resp.ticket_id());
          FUZZ_CHECK(!blocking || resp.done(), call, " returned before the ticket was done");
          FUZZ_CHECK(!resp.done() || resp.layers_done() == resp.layer_num(), call, ": done with ",
                     resp.layers_done(), " of ", resp.layer_num(), " layers");
        }
        break;
      }
      case kAlloc: {
        v1::AllocRequest req;
        req.set_pool(PickName(r));
        req.set_num_tokens(r.U8() % 40);
        v1::AllocResponse resp;
        status = pools_->Alloc(Context(CallerSel{}).get(), req, &resp);
        call = absl::StrCat("Alloc ", req.ShortDebugString());
        break;
      }
      case kFree: {
        v1::FreeRequest req;
        req.set_pool(PickName(r));
        const uint8_t which = r.U8();
        absl::StatusOr<std::shared_ptr<Pool>> pool = registry_->GetPoolOrAnchor(req.pool());
        if (pool.ok()) {
          std::vector<uint64_t> slots = AllocatedSlots(**pool);
          const uint64_t ps = (*pool)->allocator().page_size();
          if (!slots.empty()) {
            const uint64_t first = slots[(which % slots.size()) / ps * ps];
            for (uint64_t s = first; s < first + ps; ++s) req.add_indices(static_cast<int64_t>(s));
          }
        }
        v1::FreeResponse resp;
        status = pools_->Free(Context(CallerSel{}).get(), req, &resp);
        call = absl::StrCat("Free ", req.ShortDebugString());
        break;
      }
      case kCloseSession: {
        ++stats.calls[op][1];
        const int which = r.U8() % 2;
        // Closing is the session stream's end, not an RPC; it cannot fail.
        manager_->CloseSession(sessions_[which], "fuzz", absl::Milliseconds(20));
        closed_sessions_.push_back(sessions_[which]);
        for (const Attached& a : attached_) {
          if (a.session == sessions_[which]) detached_.insert(a.id);
        }
        sessions_[which] = manager_->OpenSession("fuzz", 1, "in-process");
        all_sessions_.push_back(sessions_[which]);
        return;
      }
      case kDeletePool: {
        v1::DeletePoolRequest req;
        req.set_name(PickName(r));
        v1::DeletePoolResponse resp;
        status = pools_->DeletePool(Context(CallerSel{true, -1, true}).get(), req, &resp);
        call = absl::StrCat("DeletePool ", req.ShortDebugString());
        break;
      }
      case kQuiesce:
        ++stats.calls[op][1];
        FUZZ_CHECK(WaitIdle(kTicketTimeout), InFlight(), " tickets still in flight after ",
                   absl::FormatDuration(kTicketTimeout));
        return;
      case kOpCount:
        return;
    }
    ++stats.calls[op][status.ok()];
    static const bool trace = getenv("TRANSFER_FUZZ_TRACE") != nullptr;
    if (trace) {
      fprintf(stderr, "transfer_fuzz: %s -> %d %s\n", call.c_str(),
              static_cast<int>(status.error_code()), status.error_message().c_str());
    }
    if (status.ok()) return;
    const grpc::StatusCode c = status.error_code();
    FUZZ_CHECK((Actionable(c) || also.count(c) > 0) && !status.error_message().empty(), call,
               " failed with code ", static_cast<int>(c), " '", status.error_message(), "'");
    const Snapshot after = Take();
    FUZZ_CHECK(after == before, call, " failed ('", status.error_message(),
               "') but changed the state:", Diff(before, after));
    if (quiet && InFlight() == 0) {
      FUZZ_CHECK(HostHash() == host_before, call, " failed ('", status.error_message(),
                 "') but changed host pool bytes");
      FUZZ_CHECK(DeviceHash() == device_before, call, " failed ('", status.error_message(),
                 "') but changed device bytes");
    }
  }

  // ------------------------------------------------------------ attach
  std::shared_ptr<Pool> PoolNamed(const std::string& name) const {
    absl::StatusOr<std::shared_ptr<Pool>> p = registry_->Get(name);
    return p.ok() ? *p : nullptr;
  }
  const DeviceFile* FileOf(const std::string& pool) const {
    for (const DeviceFile& f : devices_) {
      if (f.name == pool) return &f;
    }
    return nullptr;
  }

  // Fills `out` (an AttachDeviceRequest or a DeviceEntry) with `layers`
  // layer buffers of every component of `def`'s pool, from its device file.
  template <typename Out>
  void FillBuffers(size_t def, uint32_t layers, Out* out) {
    out->clear_k_layers();
    out->clear_v_layers();
    out->clear_components();
    std::shared_ptr<Pool> pool = PoolNamed(kPools[def].name);
    const DeviceFile& f = devices_[def];
    if (pool == nullptr) return;  // deleted: leave it empty
    const PoolKind kind = pool->spec().kind;
    for (size_t c = 0; c < pool->components().size(); ++c) {
      google::protobuf::RepeatedPtrField<v1::DeviceBuffer>* buffers;
      if (c == 0 && TakesKLayers(kind)) {
        buffers = out->mutable_k_layers();
      } else if (c == 1 && TakesVLayers(kind)) {
        buffers = out->mutable_v_layers();
      } else {
        v1::DeviceComponent* named = out->add_components();
        named->set_name(pool->components()[c].name);
        buffers = named->mutable_layers();
      }
      for (uint32_t l = 0; l < layers; ++l) {
        v1::SharedMemoryBuffer* shm = buffers->Add()->mutable_shm();
        shm->set_path(f.path);
        shm->set_offset(f.Offset(c, std::min(l, kDeviceLayers)));
      }
    }
    out->set_device_size_tokens(f.tokens);
  }

  size_t DefIndex(const std::string& name) const {
    for (size_t i = 0; i < kPoolCount; ++i) {
      if (name == kPools[i].name) return i;
    }
    return 0;
  }

  // Targets: every pool, then the group.
  v1::AttachDeviceRequest Canonical(size_t target) {
    v1::AttachDeviceRequest req;
    if (target < kPoolCount) {
      req.set_pool(kPools[target].name);
      std::shared_ptr<Pool> pool = PoolNamed(kPools[target].name);
      FillBuffers(target, pool ? pool->spec().layer_num : 1, &req);
    } else {
      req.set_pool(kGroup);
      for (const GroupDef& e : kGroupEntries) {
        v1::DeviceEntry* de = req.add_entries();
        de->set_entry(e.entry);
        std::shared_ptr<Pool> pool = PoolNamed(e.pool);
        FillBuffers(DefIndex(e.pool), pool ? pool->spec().layer_num : 1, de);
      }
    }
    req.set_session_id(sessions_[0]);
    return req;
  }

  // Every buffer of a request, with the field holding it.
  struct BufferRef {
    google::protobuf::RepeatedPtrField<v1::DeviceBuffer>* field;
    int index;
  };
  template <typename Holder>
  static void CollectBuffers(Holder* h, std::vector<BufferRef>* out) {
    for (int i = 0; i < h->k_layers_size(); ++i) out->push_back({h->mutable_k_layers(), i});
    for (int i = 0; i < h->v_layers_size(); ++i) out->push_back({h->mutable_v_layers(), i});
    for (v1::DeviceComponent& c : *h->mutable_components()) {
      for (int i = 0; i < c.layers_size(); ++i) out->push_back({c.mutable_layers(), i});
    }
  }

  std::string PathVariant(Reader& r, const std::string& own) {
    const std::string base = own.substr(own.rfind('/') + 1);
    const std::string dir_name = dir_.substr(dir_.rfind('/') + 1);
    switch (r.U8() % 24) {
      case 0:
        return own;
      case 1:
        return devices_[r.U8() % devices_.size()].path;
      case 2:
        return dir_ + "/missing";
      case 3:
        return dir_;
      case 4:
        return dir_ + "/sub";
      case 5:
        return dir_ + "/sub/../" + base;
      case 6:
        return outside_file_;
      case 7:
        return dir_ + "/link-out";
      case 8:
        return dir_ + "/link-in";
      case 9:
        return base;
      case 10:
        return "";
      case 11: {
        std::vector<std::string> regions;
        for (const std::shared_ptr<Pool>& p : registry_->List()) {
          for (const std::string& path : p->region_paths()) regions.push_back(path);
        }
        if (regions.empty()) return own;
        return regions[r.U8() % regions.size()];
      }
      case 12:
        return dir_ + "/../" + dir_name + "-out/file";
      case 13:
        return own + std::string(1, '\0') + "junk";
      case 14:
        return "/etc/hostname";
      case 15:
        return own + "/";
      case 16:
        return dir_ + "//" + base;
      case 17:
        return dir_ + "/fifo";
      case 18:
        return dir_ + "/empty";
      case 19:
        return dir_ + "/small";
      case 20:
        return dir_ + "/link-loop";
      case 21:
        return dir_ + "/link-outdir/file";
      case 22:
        return dir_ + "/link-sub/../" + base;
      default:
        return dir_ + "/./" + base;
    }
  }

  std::string SessionVariant(Reader& r) {
    switch (r.U8() % 7) {
      case 0:
        return sessions_[0];
      case 1:
        return sessions_[1];
      case 2:
        return "";
      case 3:
        return closed_sessions_.empty() ? "ses-0-0000000000000000" : closed_sessions_.back();
      case 4:
        return "bogus";
      case 5:
        return sessions_[0] + "x";
      default:
        return sessions_[0].substr(0, sessions_[0].size() / 2);
    }
  }

  static const char* NameVariant(uint8_t v) {
    static const char* kNames[] = {"",         "k",     "v",     "latent", "rows", "index_k",
                                   "temporal", "conv0", "conv1", "x",      "kv",   "ssm"};
    return kNames[v % (sizeof(kNames) / sizeof(kNames[0]))];
  }

  v1::AttachDeviceRequest BuildAttach(Reader& r) {
    const size_t target = r.U8() % (kPoolCount + 1);
    v1::AttachDeviceRequest req = Canonical(target);
    const int mutations = r.U8() % 5;
    for (int m = 0; m < mutations; ++m) Mutate(r, target, &req);
    return req;
  }

  void Mutate(Reader& r, size_t target, v1::AttachDeviceRequest* req) {
    std::vector<BufferRef> buffers;
    CollectBuffers(req, &buffers);
    for (v1::DeviceEntry& e : *req->mutable_entries()) CollectBuffers(&e, &buffers);
    const uint8_t kind = r.U8();
    // The holder a field mutation acts on: the request, or one entry.
    const int holder =
        req->entries_size() > 0 ? static_cast<int>(r.U8() % (req->entries_size() + 1)) - 1 : -1;
    auto on_holder = [&](auto&& fn) {
      if (holder < 0) {
        fn(req);
      } else {
        fn(req->mutable_entries(holder));
      }
    };
    auto pick = [&]() -> BufferRef* {
      if (buffers.empty()) return nullptr;
      return &buffers[r.U8() % buffers.size()];
    };
    const std::string own = target < kPoolCount ? devices_[target].path : devices_[0].path;
    switch (kind % 17) {
      case 0: {
        const uint64_t v = r.Size();
        on_holder([&](auto* h) { h->set_device_size_tokens(v); });
        break;
      }
      case 1: {
        const uint32_t start = r.U8() % 6;
        const uint32_t end = r.U8() % 6;
        const bool refill = r.U8() % 2 == 0;
        on_holder([&](auto* h) {
          h->set_start_layer(start);
          h->set_end_layer(end);
        });
        if (refill && end > start) {
          if (holder < 0 && target < kPoolCount) {
            FillBuffers(target, end - start, req);
          } else if (holder >= 0) {
            v1::DeviceEntry* e = req->mutable_entries(holder);
            const GroupDef* def = nullptr;
            for (const GroupDef& g : kGroupEntries) {
              if (e->entry() == g.entry) def = &g;
            }
            if (def != nullptr) FillBuffers(DefIndex(def->pool), end - start, e);
          }
        }
        break;
      }
      case 2:
        if (BufferRef* b = pick()) {
          b->field->Mutable(b->index)->mutable_shm()->set_path(PathVariant(r, own));
        }
        break;
      case 3:
        if (BufferRef* b = pick()) {
          const uint64_t v =
              r.U8() % 2 ? r.Size() : b->field->Get(b->index).shm().offset() + r.U8() % 64;
          b->field->Mutable(b->index)->mutable_shm()->set_offset(v);
        }
        break;
      case 4:
        if (BufferRef* b = pick()) b->field->DeleteSubrange(b->index, 1);
        break;
      case 5:
        if (BufferRef* b = pick()) {
          v1::DeviceBuffer copy = b->field->Get(b->index);
          *b->field->Add() = copy;
        }
        break;
      case 6:
        // k_layers given by name instead (or under a wrong one).
        on_holder([&](auto* h) {
          if (h->k_layers_size() == 0) return;
          v1::DeviceComponent* c = h->add_components();
          const uint8_t v = r.U8();
          c->set_name(v % 2 ? std::string(NameVariant(v >> 1)) : "k");
          *c->mutable_layers() = h->k_layers();
          h->clear_k_layers();
        });
        break;
      case 7:
        on_holder([&](auto* h) {
          const uint8_t v = r.U8();
          google::protobuf::RepeatedPtrField<v1::DeviceBuffer> copy;
          for (const BufferRef& b : buffers) {
            if (copy.size() < 4) *copy.Add() = b.field->Get(b.index);
          }
          switch (v % 3) {
            case 0: {
              v1::DeviceComponent* c = h->add_components();
              c->set_name(NameVariant(v >> 2));
              *c->mutable_layers() = copy;
              break;
            }
            case 1:
              *h->mutable_k_layers() = copy;
              break;
            default:
              *h->mutable_v_layers() = copy;
              break;
          }
        });
        break;
      case 8: {
        const uint8_t v = r.U8();
        if (v >= 200) {
          req->clear_tp_rank();
        } else {
          req->set_tp_rank(v % 4);
        }
        break;
      }
      case 9:
        req->set_load_only(!req->load_only());
        break;
      case 10:
        req->set_session_id(SessionVariant(r));
        break;
      case 11: {
        static constexpr uint32_t kSets[] = {0, 1, 4, 64, 65, UINT32_MAX};
        req->set_load_event_sets(kSets[r.U8() % 6]);
        break;
      }
      case 12:
        if (BufferRef* b = pick()) {
          v1::CudaIpcBuffer* cuda = b->field->Mutable(b->index)->mutable_cuda();
          cuda->set_ipc_handle(std::string(r.U8() % 2 ? 64 : 3, '\x01'));
          cuda->set_offset(r.Size());
          cuda->set_gpu_uuid("GPU-0");
        }
        break;
      case 13: {
        const uint8_t v = r.U8();
        static const char* kOthers[] = {"", "nope", kGroup, "lf1", "gattn", "log", "mla", "idx"};
        req->set_pool(v < 8 ? kOthers[v] : kPools[v % kPoolCount].name);
        break;
      }
      case 14: {
        const uint8_t v = r.U8();
        if (req->entries_size() == 0) {
          *req->add_entries() = Canonical(kPoolCount).entries(v % 2);
        } else {
          const int e = v % req->entries_size();
          switch ((v >> 4) % 3) {
            case 0:
              req->mutable_entries()->DeleteSubrange(e, 1);
              break;
            case 1: {
              v1::DeviceEntry copy = req->entries(e);
              *req->add_entries() = copy;
              break;
            }
            default:
              req->mutable_entries(e)->set_entry(NameVariant(r.U8()));
              break;
          }
        }
        break;
      }
      case 15:
        if (BufferRef* b = pick()) b->field->Mutable(b->index)->Clear();
        break;
      default: {
        // Another pool's buffers (shapes that do not fit).
        const size_t other = r.U8() % kPoolCount;
        std::shared_ptr<Pool> pool = PoolNamed(kPools[other].name);
        const uint32_t layers = pool ? pool->spec().layer_num : 2;
        on_holder([&](auto* h) { FillBuffers(other, layers, h); });
        break;
      }
    }
  }

  grpc::Status Attach(const v1::AttachDeviceRequest& req, Reader& r, const Snapshot& before) {
    const CallerSel caller = ReadCaller(r);
    v1::Attachment resp;
    grpc::Status status = transfers_->AttachDevice(Context(caller).get(), req, &resp);
    if (status.ok()) OnAttached(req, resp, before);
    return status;
  }

  // A successful attach: counts, id, and its buffers resolved for the byte
  // checks.
  void OnAttached(const v1::AttachDeviceRequest& req, const v1::Attachment& resp,
                  const Snapshot& before) {
    const std::string call = absl::StrCat("AttachDevice ", req.ShortDebugString());
    FUZZ_CHECK(!resp.id().empty(), call, " returned no id");
    for (const Attached& a : attached_) {
      FUZZ_CHECK(a.id != resp.id() || detached_.count(a.id) > 0, call, " returned id '", resp.id(),
                 "' of a live attachment");
    }
    FUZZ_CHECK(resp.backend() == "host", call, " backend '", resp.backend(), "'");
    Attached a;
    a.id = resp.id();
    a.target = req.pool();
    a.load_only = req.load_only();
    a.session = req.session_id();
    absl::StatusOr<AttachRequest> domain = FromProto(req);
    FUZZ_CHECK(domain.ok(), call, " succeeded, but FromProto fails: ", domain.status().ToString());
    std::vector<std::pair<AttachedEntry, AttachRequest>> resolved;
    // Every buffer so far, to tell whether two overlap.
    std::vector<std::pair<uint8_t*, uint64_t>> ranges;
    absl::StatusOr<std::shared_ptr<PoolGroup>> group = registry_->GetGroup(req.pool());
    if (group.ok()) {
      a.group = true;
      a.layer_num = (*group)->layer_num();
      a.anchor = (*group)->anchor_index();
      FUZZ_CHECK(resp.group() == req.pool() && resp.pool() == (*group)->anchor().pool->name(), call,
                 ": attachment of group '", resp.group(), "' pool '", resp.pool(), "'");
      for (const GroupEntry& entry : (*group)->entries()) {
        const AttachEntry* given = nullptr;
        for (const AttachEntry& e : domain->entries) {
          if (e.entry == entry.name) given = &e;
        }
        FUZZ_CHECK(given != nullptr, call, " succeeded without entry '", entry.name, "'");
        AttachedEntry ae;
        ae.entry = entry.name;
        ae.pool = entry.pool;
        ae.map = entry.layer_map;
        if (ae.map.empty()) {
          for (uint32_t l = 0; l < a.layer_num; ++l) {
            ae.map.push_back(l < entry.pool->spec().layer_num
                                 ? static_cast<int32_t>(entry.pool->start_layer() + l)
                                 : -1);
          }
        }
        resolved.emplace_back(std::move(ae), given->request);
      }
    } else {
      absl::StatusOr<std::shared_ptr<Pool>> pool = registry_->Get(req.pool());
      FUZZ_CHECK(pool.ok(), call, " succeeded, but it names no pool or group");
      FUZZ_CHECK(resp.pool() == req.pool() && resp.group().empty(), call, ": attachment of pool '",
                 resp.pool(), "'");
      AttachedEntry ae;
      ae.pool = *pool;
      resolved.emplace_back(std::move(ae), *domain);
    }
    for (auto& [ae, request] : resolved) {
      request.entries.clear();
      absl::StatusOr<ResolvedAttach> r = ResolveAttachRequest(*ae.pool, request);
      FUZZ_CHECK(r.ok(), call,
                 " succeeded, but its request does not resolve: ", r.status().ToString());
      ae.start = r->start_layer;
      ae.end = r->end_layer;
      ae.device_tokens = r->device_size_tokens;
      if (!a.group) {
        a.layer_num = ae.end - ae.start;
        for (uint32_t d = ae.start; d < ae.end; ++d) ae.map.push_back(static_cast<int32_t>(d));
        FUZZ_CHECK(resp.start_layer() == ae.start && resp.end_layer() == ae.end, call,
                   ": attached layers [", resp.start_layer(), ", ", resp.end_layer(), ")");
      }
      const std::vector<Component>& components = ae.pool->components();
      FUZZ_CHECK(r->components.size() == components.size(), call, ": ", r->components.size(),
                 " components resolved for ", ae.pool->Label());
      for (size_t c = 0; c < components.size(); ++c) {
        const DeviceRows rows = DeviceRowsOf(components[c], ae.device_tokens);
        std::vector<uint8_t*> layers;
        for (const DeviceBufferRef& ref : r->components[c].layers) {
          FUZZ_CHECK(ref.kind == DeviceBufferRef::Kind::kShm, call,
                     " succeeded with a CUDA buffer on the host backend");
          const DeviceFile* file = nullptr;
          const std::string real = Real(ref.shm_path.c_str());
          for (const DeviceFile& f : devices_) {
            if (!real.empty() && f.real == real) file = &f;
          }
          FUZZ_CHECK(real.empty() || real.compare(0, dir_.size() + 1, dir_ + "/") == 0, call,
                     " attached '", ref.shm_path, "', which is ", real, ", outside ", dir_);
          if (file == nullptr) {
            // A file we do not lay out (a pool's region file, say): the
            // bytes cannot be checked.
            layers.push_back(nullptr);
            a.verifiable = false;
            continue;
          }
          FUZZ_CHECK(ref.offset <= file->size && file->size - ref.offset >= rows.total_bytes(),
                     call, " attached a buffer of ", rows.total_bytes(), " bytes at offset ",
                     ref.offset, " of ", file->path, " (", file->size, " bytes)");
          uint8_t* p = file->data + ref.offset;
          for (const auto& [q, n] : ranges) {
            if (p < q + n && q < p + rows.total_bytes()) a.disjoint = false;
          }
          ranges.emplace_back(p, rows.total_bytes());
          layers.push_back(p);
        }
        ae.buffers.push_back(std::move(layers));
      }
      a.entries.push_back(std::move(ae));
    }
    // One more attachment on each pool named (and the group).
    const Snapshot after = Take();
    for (const AttachedEntry& ae : a.entries) {
      const std::string& name = ae.pool->name();
      FUZZ_CHECK(after.attachments.at(name) == before.attachments.at(name) + 1, call, ": pool '",
                 name, "' attachments ", before.attachments.at(name), " -> ",
                 after.attachments.at(name));
    }
    if (a.group) {
      const std::string g = absl::StrCat("group ", a.target);
      FUZZ_CHECK(after.attachments.at(g) == before.attachments.at(g) + 1, call, ": ", g,
                 " attachments ", before.attachments.at(g), " -> ", after.attachments.at(g));
    }
    attached_.push_back(std::move(a));
  }

  const Attached* FindAttached(const std::string& id) const {
    for (const Attached& a : attached_) {
      if (a.id == id && detached_.count(id) == 0) return &a;
    }
    return nullptr;
  }

  void CheckDetached(const std::string& id, const Snapshot& before) {
    const Attached* a = FindAttached(id);
    FUZZ_CHECK(a != nullptr, "DetachDevice '", id, "' succeeded for no live attachment");
    const Snapshot after = Take();
    for (const AttachedEntry& ae : a->entries) {
      const std::string& name = ae.pool->name();
      if (before.attachments.count(name) == 0) continue;
      FUZZ_CHECK(after.attachments.at(name) + 1 == before.attachments.at(name), "DetachDevice '",
                 id, "': pool '", name, "' attachments ", before.attachments.at(name), " -> ",
                 after.attachments.at(name));
    }
    detached_.insert(id);
  }

  // An attachment id: one of ours (live or not), or a made-up one.
  std::string PickAttachment(Reader& r) {
    const uint8_t v = r.U8();
    if (!attached_.empty() && v < 200) return attached_[v % attached_.size()].id;
    switch (v % 4) {
      case 0:
        return "";
      case 1:
        return "att-1";
      case 2:
        return attached_.empty() ? "x" : attached_.back().id + "0";
      default:
        return std::string(40, 'a');
    }
  }

  uint64_t PickTicket(Reader& r) {
    const uint8_t v = r.U8();
    if (!issued_.empty() && v < 200) return issued_[v % issued_.size()].id;
    if (v % 2 == 0) return v % 4;
    return r.U64();
  }

  std::string PickName(Reader& r) {
    const uint8_t v = r.U8();
    if (v < kPoolCount * 20) return kPools[v % kPoolCount].name;
    static const char* kOthers[] = {kGroup, "", "nope", "lf1x"};
    return kOthers[v % 4];
  }

  static std::vector<uint64_t> AllocatedSlots(const Pool& pool) {
    std::vector<uint64_t> out;
    const PageAllocator& a = pool.allocator();
    const uint64_t ps = a.page_size();
    for (uint64_t p = 0; p < a.page_num(); ++p) {
      const int64_t slot[1] = {static_cast<int64_t>(p * ps)};
      if (!a.CheckAllocated(slot).ok()) continue;
      for (uint64_t s = p * ps; s < (p + 1) * ps; ++s) out.push_back(s);
    }
    return out;
  }

  // ------------------------------------------------------------ transfers
  // Index lists for one pool: `mode` picks how (allocated slots or raw
  // values, whole pages or not, wrong lengths, repeats).
  Rows ReadRows(Reader& r, const Pool* pool, uint64_t device_tokens) {
    Rows rows;
    const uint8_t mode = r.U8();
    uint64_t n = r.U8() % 17;
    if (mode & 0x80) n = kMaxIndices + 1 + r.U8() % 4;
    const uint64_t host_base = r.U8();
    const uint64_t device_base = r.U8();
    std::vector<uint64_t> slots;
    uint64_t ps = 1;
    if (pool != nullptr) {
      slots = AllocatedSlots(*pool);
      ps = pool->allocator().page_size();
      for (const Component& c : pool->components()) ps = std::max(ps, c.row_tokens);
    }
    const uint64_t dev = std::max<uint64_t>(device_tokens, 1);
    switch (mode & 3) {
      case 0: {
        // Allocated slots to device rows, whole pages when asked.
        uint64_t h = slots.empty() ? 0 : host_base % slots.size();
        uint64_t d = device_base % dev;
        if (mode & 0x10) {
          h = h / ps * ps;
          d = d / ps * ps;
          n = (n + ps - 1) / ps * ps;
        }
        for (uint64_t i = 0; i < n; ++i) {
          rows.host.push_back(slots.empty() ? static_cast<int64_t>(h + i)
                                            : static_cast<int64_t>(slots[(h + i) % slots.size()]));
          rows.device.push_back(static_cast<int64_t>((d + i) % dev));
        }
        break;
      }
      case 1:
        for (uint64_t i = 0; i < n; ++i) {
          rows.host.push_back(static_cast<int64_t>(host_base + i));
          rows.device.push_back(static_cast<int64_t>(device_base + i));
        }
        break;
      case 2:
        for (uint64_t i = 0; i < n; ++i) {
          rows.host.push_back(static_cast<int8_t>(r.U8()));
          rows.device.push_back(static_cast<int8_t>(r.U8()));
        }
        break;
      default:
        for (uint64_t i = 0; i < n && i < 4; ++i) {
          rows.host.push_back(static_cast<int64_t>(r.U64()));
          rows.device.push_back(static_cast<int64_t>(r.U64()));
        }
        break;
    }
    if ((mode & 0x04) && !rows.device.empty()) rows.device.pop_back();
    if ((mode & 0x08) && !rows.host.empty() && !rows.device.empty()) {
      // A host slot twice (a load may; a backup may not), to a new row.
      const int64_t h = rows.host[0];
      const int64_t d = rows.device.back() + 1;
      rows.host.push_back(h);
      rows.device.push_back(d);
    }
    if (mode & 0x20) std::reverse(rows.device.begin(), rows.device.end());
    return rows;
  }

  grpc::Status Transfer(Reader& r, Direction direction, bool quiet, std::string* call) {
    const std::string id = PickAttachment(r);
    const uint8_t flags = r.U8();
    const bool verify = (flags & 1) != 0;
    const CallerSel caller = ReadCaller(r);
    const Attached* a = FindAttached(id);
    // The anchor's (or the plain pool's) rows, then pool_transfers.
    const AttachedEntry* main = a == nullptr ? nullptr : &a->entries[a->anchor];
    Rows rows = ReadRows(r, main ? main->pool.get() : nullptr, main ? main->device_tokens : 16);
    std::vector<std::pair<std::string, Rows>> others;
    const int n_others = (flags >> 1) % 3;
    for (int i = 0; i < n_others; ++i) {
      const uint8_t v = r.U8();
      std::string name = NameVariant(v);
      const AttachedEntry* e = nullptr;
      if (a != nullptr && a->group && v < 128) {
        e = &a->entries[v % a->entries.size()];
        name = e->entry;
      }
      others.emplace_back(name,
                          ReadRows(r, e ? e->pool.get() : nullptr, e ? e->device_tokens : 16));
    }
    grpc::Status status;
    v1::TransferTicket resp;
    if (direction == Direction::kBackup) {
      v1::BackupRequest req;
      req.set_attachment_id(id);
      for (int64_t v : rows.host) req.add_host_indices(v);
      for (int64_t v : rows.device) req.add_device_indices(v);
      if (flags & 0x40) req.set_wait_event_handle(std::string(64, '\x02'));
      for (const auto& [name, o] : others) {
        v1::PoolTransfer* t = req.add_pool_transfers();
        t->set_name(name);
        for (int64_t v : o.host) t->add_host_indices(v);
        for (int64_t v : o.device) t->add_device_indices(v);
      }
      *call = absl::StrCat("Backup ", req.ShortDebugString());
      status = transfers_->Backup(Context(caller).get(), req, &resp);
    } else {
      v1::LoadRequest req;
      req.set_attachment_id(id);
      for (int64_t v : rows.host) req.add_host_indices(v);
      for (int64_t v : rows.device) req.add_device_indices(v);
      for (const auto& [name, o] : others) {
        v1::PoolTransfer* t = req.add_pool_transfers();
        t->set_name(name);
        for (int64_t v : o.host) t->add_host_indices(v);
        for (int64_t v : o.device) t->add_device_indices(v);
      }
      *call = absl::StrCat("Load ", req.ShortDebugString());
      status = transfers_->Load(Context(caller).get(), req, &resp);
    }
    if (!status.ok()) return status;
    FUZZ_CHECK(a != nullptr, *call, " succeeded on an attachment that is not live");
    for (const Issued& t : issued_) {
      FUZZ_CHECK(t.id != resp.id(), *call, " returned ticket id ", resp.id(), " a second time");
    }
    issued_.push_back({resp.id(), a->session});
    FUZZ_CHECK(resp.event_set() == -1, *call, ": event_set ", resp.event_set(),
               " on the host backend");
    if (!verify) return status;
    // Wait through the service, then compare the bytes.
    const uint64_t host_before = HostHash();
    const uint64_t device_before = DeviceHash();
    v1::WaitTransferRequest wait;
    wait.set_ticket_id(resp.id());
    v1::TransferStatus done;
    grpc::Status waited = transfers_->WaitTransfer(Context(CallerSel{}).get(), wait, &done);
    FUZZ_CHECK(waited.ok(), *call,
               ": WaitTransfer of its ticket: ", static_cast<int>(waited.error_code()), " ",
               waited.error_message());
    FUZZ_CHECK(
        done.done() && done.layers_done() == a->layer_num && done.layer_num() == a->layer_num,
        *call, ": ticket done ", done.done(), " with ", done.layers_done(), " of ",
        done.layer_num(), " layers; the attachment has ", a->layer_num);
    if (!quiet || !a->verifiable) return status;
    // Only this ticket ran: the bytes must say what it did.
    if (direction == Direction::kBackup) {
      FUZZ_CHECK(DeviceHash() == device_before, *call, " changed device bytes");
    } else {
      FUZZ_CHECK(HostHash() == host_before, *call, " changed host pool bytes");
      if (!a->disjoint) return status;
    }
    for (size_t e = 0; e < a->entries.size(); ++e) {
      const Rows* part = nullptr;
      if (e == a->anchor) part = &rows;
      for (const auto& [name, o] : others) {
        if (a->group && name == a->entries[e].entry && e != a->anchor) part = &o;
      }
      if (part != nullptr) {
        CheckRows(*a, a->entries[e], *part, direction, *call);
        stats.rows_checked += part->host.size();
      }
    }
    ++stats.verified[direction == Direction::kBackup ? 0 : 1];
    return status;
  }

  // Every (host slot, device row) pair: equal bytes in every component,
  // copied layer and head, addressed by the layout's own Offset().
  void CheckRows(const Attached& a, const AttachedEntry& e, const Rows& rows, Direction direction,
                 const std::string& call) {
    const Pool& pool = *e.pool;
    const std::vector<Component>& components = pool.components();
    for (size_t c = 0; c < components.size(); ++c) {
      const Component& comp = components[c];
      const KvLayout& layout = comp.layout;
      for (uint32_t t = 0; t < e.map.size(); ++t) {
        const int32_t d = e.map[t];
        if (d < 0 || static_cast<uint32_t>(d) < pool.start_layer() ||
            static_cast<uint32_t>(d) >= pool.end_layer()) {
          continue;
        }
        const uint32_t attached = static_cast<uint32_t>(d) - e.start;
        const uint64_t host_layer = static_cast<uint32_t>(d) - pool.start_layer();
        const uint8_t* buffer = e.buffers[c][attached];
        for (size_t i = 0; i < rows.host.size(); ++i) {
          const uint64_t h = comp.row_of(static_cast<uint64_t>(rows.host[i]));
          const uint64_t dr = comp.row_of(static_cast<uint64_t>(rows.device[i]));
          for (uint64_t head = 0; head < layout.heads; ++head) {
            const uint8_t* host = pool.component_base(c) + layout.Offset(0, h, host_layer, head);
            const uint8_t* device = buffer + dr * comp.row_bytes() + head * layout.head_bytes;
            FUZZ_CHECK(std::memcmp(host, device, layout.head_bytes) == 0, call, ": ",
                       DirectionName(direction), " of ", pool.Label(), " component '", comp.name,
                       "' layer ", host_layer, " head ", head, ": host slot ", rows.host[i],
                       " differs from device row ", rows.device[i], " (attachment ", a.id, ")");
          }
        }
      }
    }
  }

  // ------------------------------------------------------------ the end
  void Finish() {
    FUZZ_CHECK(WaitIdle(kTicketTimeout), InFlight(), " tickets still in flight ",
               absl::FormatDuration(kTicketTimeout), " after the input's last call");
    // Every ticket handed out has ended, as WaitTransfer tells its owner.
    for (const Issued& t : issued_) {
      v1::WaitTransferRequest req;
      req.set_ticket_id(t.id);
      req.set_poll(true);
      v1::TransferStatus resp;
      grpc::Status s = transfers_->WaitTransfer(Context(CallerSel{}).get(), req, &resp);
      FUZZ_CHECK(s.ok() ? resp.done() : s.error_code() != grpc::StatusCode::NOT_FOUND, "ticket ",
                 t.id, " after the drain: ", s.ok() ? "not done" : s.error_message());
    }
    for (const std::string& s : sessions_)
      manager_->CloseSession(s, "input done", absl::ZeroDuration());
    for (const Attached& a : attached_) {
      if (detached_.count(a.id) > 0) continue;
      v1::DetachDeviceRequest req;
      req.set_attachment_id(a.id);
      v1::DetachDeviceResponse resp;
      grpc::Status s = transfers_->DetachDevice(Context(CallerSel{}).get(), req, &resp);
      // Attachments of a session are gone with it.
      FUZZ_CHECK(s.ok() || s.error_code() == grpc::StatusCode::NOT_FOUND, "detaching ", a.id, ": ",
                 s.error_message());
    }
    for (const std::shared_ptr<Pool>& p : registry_->List()) {
      FUZZ_CHECK(p->attachments() == 0, p->Label(), " has ", p->attachments(),
                 " attachments after every attachment was detached");
    }
    for (const std::shared_ptr<PoolGroup>& g : registry_->ListGroups()) {
      FUZZ_CHECK(g->attachments() == 0, "group '", g->name(), "' has ", g->attachments(),
                 " attachments after every attachment was detached");
    }
    DeleteAll();
    attached_.clear();
    detached_.clear();
    issued_.clear();
    closed_sessions_.clear();
  }

  // Deletes every group and pool (followers first); all must succeed and
  // leave only the fixtures in the scratch directory.
  void DeleteAll() {
    for (const std::shared_ptr<PoolGroup>& g : registry_->ListGroups()) {
      const absl::Status s = registry_->DeleteGroup(g->name());
      FUZZ_CHECK(s.ok(), "deleting group '", g->name(), "': ", s.ToString());
    }
    for (int round = 0; !registry_->List().empty(); ++round) {
      FUZZ_CHECK(round < 8, "pools left after 8 rounds of deletion");
      for (const std::shared_ptr<Pool>& p : registry_->List()) {
        if (!p->followers().empty()) continue;
        absl::StatusOr<uint64_t> s = registry_->Delete(p->name());
        FUZZ_CHECK(s.ok(), "deleting ", p->Label(), ": ", s.status().ToString());
      }
    }
    FUZZ_CHECK(registry_->used_bytes() == 0, "used_bytes ", registry_->used_bytes(),
               " with no pools");
    DIR* d = opendir(dir_.c_str());
    FUZZ_CHECK(d != nullptr, dir_);
    std::set<std::string> left;
    while (dirent* e = readdir(d)) {
      const std::string n = e->d_name;
      if (n != "." && n != "..") left.insert(n);
    }
    closedir(d);
    FUZZ_CHECK(left == fixtures_, "the scratch directory holds ", absl::StrJoin(left, ", "),
               " instead of ", absl::StrJoin(fixtures_, ", "));
  }

  std::string dir_;
  std::string outside_dir_;
  std::string outside_file_;
  std::set<std::string> fixtures_;
  std::vector<DeviceFile> devices_;  // kPools' order
  std::unique_ptr<PoolRegistry> registry_;
  std::unique_ptr<TransferManager> manager_;
  std::unique_ptr<PoolServiceImpl> pool_service_;
  std::unique_ptr<TransferServiceImpl> transfer_service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::PoolService::Stub> pools_;
  std::unique_ptr<v1::TransferService::Stub> transfers_;

  // Per input.
  std::string sessions_[2];
  std::vector<std::string> all_sessions_;  // every session id of the input
  std::vector<std::string> closed_sessions_;
  std::vector<Attached> attached_;
  std::set<std::string> detached_;
  std::vector<Issued> issued_;
};

}  // namespace
}  // namespace kvhost::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // One server for the process (never destroyed: gRPC's threads outlive
  // libFuzzer's exit path); every input starts from the same pools.
  static auto* harness = new kvhost::fuzz::Harness();
  harness->RunInput(data, size);
  return 0;
}
