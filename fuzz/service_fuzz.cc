// service_fuzz: kvhost.v1.PoolService end to end in process: fuzzed
// requests through a gRPC in-process channel into PoolServiceImpl over a
// PoolRegistry whose regions live in a scratch directory.
//
// An input is a sequence of calls, each `rpc byte, length byte, that many
// bytes of the request proto` (fuzz/make_service_seeds.sh writes
// the seeds). After
// every call:
//   * a failed call has a code a client can act on (not UNKNOWN, INTERNAL,
//     DEADLINE_EXCEEDED, ...) and a message, and left the registry exactly
//     as it was: pools and groups (specs, sizes, followers, group,
//     attachments, the allocated set of every page), and for
//     SetFromFlatDataPage every region's bytes (a failed WritePages may leave
//     the page it was writing partly written: streams hold one chunk);
//   * a read-only call left the registry as it was;
//   * Alloc / Free that succeed change exactly the pages they name;
//   * every pool keeps free + allocated == page_num;
//   * ListPools names exactly the registry's pools.
// After each input every group and pool is deleted (which must succeed) and
// the scratch directory must be empty again, so inputs do not depend on
// each other.
#include <dirent.h>
#include <google/protobuf/stubs/logging.h>
#include <grpcpp/grpcpp.h>
#include <stdlib.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_join.h"
#include "fuzz/fuzz_check.h"
#include "kvhost/v1/pool.grpc.pb.h"
#include "server/pool/registry.h"
#include "server/service/convert.h"
#include "server/service/pool_service.h"

namespace kvhost::fuzz {
namespace {

// All pools together: small, so snapshots and region hashes stay cheap.
constexpr uint64_t kMemoryLimit = 1 << 20;
constexpr int kMaxCalls = 16;
// Past this many pages a pool's allocated set is sampled, not read whole.
constexpr uint64_t kMaxProbedPages = 1 << 16;
constexpr auto kCallDeadline = std::chrono::seconds(10);

enum Rpc : uint8_t {
  kCreatePool,
  kGetPool,
  kListPools,
  kDeletePool,
  kAlloc,
  kFree,
  kGetPageBufferMeta,
  kGetDataPage,
  kSetFromFlatDataPage,
  kReadPages,
  kWritePages,
  kGetPageShape,
  kGetSplitHeadsPageBufferMeta,
  kIsStridePageAligned,
  kGetContiguousBufferInfos,
  kCreatePoolGroup,
  kGetPoolGroup,
  kListPoolGroups,
  kDeletePoolGroup,
  kRpcCount,
};

bool Mutates(Rpc rpc) {
  return rpc == kCreatePool || rpc == kDeletePool || rpc == kAlloc || rpc == kFree ||
         rpc == kSetFromFlatDataPage || rpc == kWritePages || rpc == kCreatePoolGroup ||
         rpc == kDeletePoolGroup;
}

struct PoolState {
  std::string spec;  // serialized v1::PoolSpec
  uint64_t size_tokens = 0;
  uint64_t bytes = 0;
  uint64_t free_pages = 0;
  std::vector<bool> allocated;  // first kMaxProbedPages pages
  std::vector<std::string> followers;
  std::string group;
  uint32_t attachments = 0;
  uint64_t content = 0;  // FNV-1a of the regions, when asked for
  bool operator==(const PoolState& o) const {
    return spec == o.spec && size_tokens == o.size_tokens && bytes == o.bytes &&
           free_pages == o.free_pages && allocated == o.allocated && followers == o.followers &&
           group == o.group && attachments == o.attachments && content == o.content;
  }
};

struct Snapshot {
  std::map<std::string, PoolState> pools;
  std::map<std::string, std::string> groups;  // serialized v1::PoolGroup
  uint64_t used_bytes = 0;
  bool operator==(const Snapshot& o) const {
    return pools == o.pools && groups == o.groups && used_bytes == o.used_bytes;
  }
};

uint64_t Hash(const Pool& pool) {
  uint64_t h = 1469598103934665603ull;
  for (size_t r = 0; r < pool.region_count(); ++r) {
    const uint8_t* p = pool.region_base(r);
    for (uint64_t i = 0; i < pool.region_bytes(r); ++i) h = (h ^ p[i]) * 1099511628211ull;
  }
  return h;
}

// Also checks each pool's conservation invariant.
Snapshot Take(const PoolRegistry& registry, bool content) {
  Snapshot snap;
  for (const std::shared_ptr<Pool>& pool : registry.List()) {
    PoolState s;
    v1::PoolSpec spec;
    ToProto(pool->spec(), &spec);
    s.spec = spec.SerializeAsString();
    s.size_tokens = pool->size_tokens();
    s.bytes = pool->bytes();
    const PageAllocator& a = pool->allocator();
    s.free_pages = a.free_pages();
    const uint64_t page_num = pool->page_num();
    FUZZ_CHECK(a.page_num() == page_num, pool->Label(), ": allocator of ", a.page_num(),
               " pages for a pool of ", page_num);
    uint64_t allocated = 0;
    const uint64_t probed = std::min(page_num, kMaxProbedPages);
    for (uint64_t p = 0; p < probed; ++p) {
      const int64_t slot[1] = {static_cast<int64_t>(p * pool->page_size())};
      s.allocated.push_back(a.CheckAllocated(slot).ok());
      allocated += s.allocated.back();
    }
    FUZZ_CHECK(probed < page_num ? s.free_pages + allocated <= page_num
                                 : s.free_pages + allocated == page_num,
               pool->Label(), ": free ", s.free_pages, " + allocated ", allocated, " vs ", page_num,
               " pages");
    s.followers = pool->followers();
    s.group = pool->group();
    s.attachments = pool->attachments();
    if (content) s.content = Hash(*pool);
    snap.pools[pool->name()] = std::move(s);
  }
  for (const std::shared_ptr<PoolGroup>& group : registry.ListGroups()) {
    v1::PoolGroup g;
    ToProto(*group, &g);
    snap.groups[group->name()] = g.SerializeAsString();
  }
  snap.used_bytes = registry.used_bytes();
  return snap;
}

std::string Diff(const Snapshot& a, const Snapshot& b) {
  std::string out;
  for (const auto& [name, s] : a.pools) {
    auto it = b.pools.find(name);
    if (it == b.pools.end()) {
      absl::StrAppend(&out, " pool '", name, "' gone;");
    } else if (!(it->second == s)) {
      absl::StrAppend(&out, " pool '", name, "' changed (free ", s.free_pages, " -> ",
                      it->second.free_pages, ");");
    }
  }
  for (const auto& [name, s] : b.pools) {
    if (a.pools.count(name) == 0) absl::StrAppend(&out, " pool '", name, "' new;");
  }
  if (a.groups != b.groups) absl::StrAppend(&out, " groups changed;");
  if (a.used_bytes != b.used_bytes) {
    absl::StrAppend(&out, " used_bytes ", a.used_bytes, " -> ", b.used_bytes, ";");
  }
  return out;
}

class Harness {
 public:
  Harness() {
    // Requests with invalid UTF-8 strings are skipped (Parse fails, as it
    // would in the server); protobuf's log line for each is noise here.
    google::protobuf::SetLogHandler(nullptr);
    char dir[] = "/dev/shm/kvhost-service-fuzz.XXXXXX";
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
    service_ = std::make_unique<PoolServiceImpl>(registry_.get(), "host");
    grpc::ServerBuilder builder;
    builder.RegisterService(service_.get());
    server_ = builder.BuildAndStart();
    if (!server_) Fail(__FILE__, __LINE__, "in-process server did not start");
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(64 << 20);
    stub_ = v1::PoolService::NewStub(server_->InProcessChannel(args));
  }

  void RunInput(const uint8_t* data, size_t size) {
    size_t at = 0;
    for (int calls = 0; calls < kMaxCalls && at + 2 <= size; ++calls) {
      const Rpc rpc = static_cast<Rpc>(data[at] % kRpcCount);
      const size_t len = std::min<size_t>(data[at + 1], size - at - 2);
      const std::string bytes(reinterpret_cast<const char*>(data) + at + 2, len);
      at += 2 + len;
      Call(rpc, bytes);
    }
    Reset();
  }

 private:
  template <typename Request>
  static bool Parse(const std::string& bytes, Request* request) {
    return request->ParseFromString(bytes);
  }

  std::unique_ptr<grpc::ClientContext> Context() {
    auto context = std::make_unique<grpc::ClientContext>();
    context->set_deadline(std::chrono::system_clock::now() + kCallDeadline);
    return context;
  }

  void Call(Rpc rpc, const std::string& bytes) {
    // A failed WritePages may leave the page it was writing partly written
    // (streams hold one chunk, not a page: pool.proto), so only
    // SetFromFlatDataPage promises untouched bytes when it fails.
    const bool content = rpc == kSetFromFlatDataPage;
    const Snapshot before = Take(*registry_, content);
    std::unique_ptr<grpc::ClientContext> ctx = Context();
    grpc::Status status;
    std::string call;  // what was asked, for messages
    switch (rpc) {
      case kCreatePool: {
        v1::CreatePoolRequest req;
        if (!Parse(bytes, &req)) return;
        v1::Pool resp;
        status = stub_->CreatePool(ctx.get(), req, &resp);
        call = absl::StrCat("CreatePool ", req.ShortDebugString());
        break;
      }
      case kGetPool: {
        v1::GetPoolRequest req;
        if (!Parse(bytes, &req)) return;
        v1::Pool resp;
        status = stub_->GetPool(ctx.get(), req, &resp);
        call = absl::StrCat("GetPool ", req.ShortDebugString());
        break;
      }
      case kListPools: {
        v1::ListPoolsRequest req;
        if (!Parse(bytes, &req)) return;
        v1::ListPoolsResponse resp;
        status = stub_->ListPools(ctx.get(), req, &resp);
        call = "ListPools";
        if (status.ok()) {
          std::set<std::string> names;
          for (const v1::Pool& p : resp.pools()) names.insert(p.name());
          FUZZ_CHECK(names.size() == before.pools.size() &&
                         static_cast<size_t>(resp.pools_size()) == names.size(),
                     "ListPools gave ", resp.pools_size(), " pools, registry has ",
                     before.pools.size());
          for (const auto& [name, s] : before.pools) {
            FUZZ_CHECK(names.count(name) == 1, "ListPools misses pool '", name, "'");
          }
        }
        break;
      }
      case kDeletePool: {
        v1::DeletePoolRequest req;
        if (!Parse(bytes, &req)) return;
        v1::DeletePoolResponse resp;
        status = stub_->DeletePool(ctx.get(), req, &resp);
        call = absl::StrCat("DeletePool ", req.ShortDebugString());
        break;
      }
      case kAlloc: {
        v1::AllocRequest req;
        if (!Parse(bytes, &req)) return;
        v1::AllocResponse resp;
        status = stub_->Alloc(ctx.get(), req, &resp);
        call = absl::StrCat("Alloc ", req.ShortDebugString());
        if (status.ok()) CheckAlloc(req, resp, before);
        break;
      }
      case kFree: {
        v1::FreeRequest req;
        if (!Parse(bytes, &req)) return;
        v1::FreeResponse resp;
        status = stub_->Free(ctx.get(), req, &resp);
        call = absl::StrCat("Free pool '", req.pool(), "' ", req.indices_size(), " indices");
        if (status.ok()) CheckFree(req, before);
        break;
      }
      case kGetPageBufferMeta: {
        v1::GetPageBufferMetaRequest req;
        if (!Parse(bytes, &req)) return;
        v1::PageBufferMeta resp;
        status = stub_->GetPageBufferMeta(ctx.get(), req, &resp);
        call = absl::StrCat("GetPageBufferMeta pool '", req.pool(), "'");
        if (status.ok()) CheckRanges(req.pool(), resp);
        break;
      }
      case kGetDataPage: {
        v1::PageRequest req;
        if (!Parse(bytes, &req)) return;
        v1::PageData resp;
        status = stub_->GetDataPage(ctx.get(), req, &resp);
        call = absl::StrCat("GetDataPage ", req.ShortDebugString());
        break;
      }
      case kSetFromFlatDataPage: {
        v1::SetPageRequest req;
        if (!Parse(bytes, &req)) return;
        v1::SetPageResponse resp;
        status = stub_->SetFromFlatDataPage(ctx.get(), req, &resp);
        call = absl::StrCat("SetFromFlatDataPage pool '", req.pool(), "' index ", req.index(), " ",
                            req.data().size(), " bytes");
        break;
      }
      case kReadPages: {
        v1::ReadPagesRequest req;
        if (!Parse(bytes, &req)) return;
        std::unique_ptr<grpc::ClientReader<v1::PageData>> reader = stub_->ReadPages(ctx.get(), req);
        v1::PageData msg;
        uint64_t messages = 0;
        while (reader->Read(&msg)) ++messages;
        status = reader->Finish();
        call = absl::StrCat("ReadPages pool '", req.pool(), "' ", req.indices_size(), " pages, ",
                            messages, " messages");
        break;
      }
      case kWritePages: {
        v1::WritePagesChunk chunk;
        if (!Parse(bytes, &chunk)) return;
        v1::WritePagesResponse resp;
        std::unique_ptr<grpc::ClientWriter<v1::WritePagesChunk>> writer =
            stub_->WritePages(ctx.get(), &resp);
        writer->Write(chunk);
        writer->WritesDone();
        status = writer->Finish();
        call = absl::StrCat("WritePages pool '", chunk.pool(), "' index ", chunk.index(),
                            " offset ", chunk.offset(), " ", chunk.data().size(), " bytes");
        break;
      }
      case kGetPageShape: {
        v1::GetPageShapeRequest req;
        if (!Parse(bytes, &req)) return;
        v1::PageShape resp;
        status = stub_->GetPageShape(ctx.get(), req, &resp);
        call = absl::StrCat("GetPageShape ", req.ShortDebugString());
        break;
      }
      case kGetSplitHeadsPageBufferMeta: {
        v1::SplitHeadsMetaRequest req;
        if (!Parse(bytes, &req)) return;
        v1::PageBufferMeta resp;
        status = stub_->GetSplitHeadsPageBufferMeta(ctx.get(), req, &resp);
        call = absl::StrCat("GetSplitHeadsPageBufferMeta pool '", req.pool(), "' split ",
                            req.split_factor());
        if (status.ok()) CheckRanges(req.pool(), resp);
        break;
      }
      case kIsStridePageAligned: {
        v1::StrideAlignmentRequest req;
        if (!Parse(bytes, &req)) return;
        v1::StrideAlignment resp;
        status = stub_->IsStridePageAligned(ctx.get(), req, &resp);
        call = absl::StrCat("IsStridePageAligned ", req.ShortDebugString());
        break;
      }
      case kGetContiguousBufferInfos: {
        v1::ContiguousBufferInfosRequest req;
        if (!Parse(bytes, &req)) return;
        v1::ContiguousBufferInfos resp;
        status = stub_->GetContiguousBufferInfos(ctx.get(), req, &resp);
        call = absl::StrCat("GetContiguousBufferInfos ", req.ShortDebugString());
        break;
      }
      case kCreatePoolGroup: {
        v1::CreatePoolGroupRequest req;
        if (!Parse(bytes, &req)) return;
        v1::PoolGroup resp;
        status = stub_->CreatePoolGroup(ctx.get(), req, &resp);
        call = absl::StrCat("CreatePoolGroup ", req.ShortDebugString());
        break;
      }
      case kGetPoolGroup: {
        v1::GetPoolGroupRequest req;
        if (!Parse(bytes, &req)) return;
        v1::PoolGroup resp;
        status = stub_->GetPoolGroup(ctx.get(), req, &resp);
        call = absl::StrCat("GetPoolGroup ", req.ShortDebugString());
        break;
      }
      case kListPoolGroups: {
        v1::ListPoolGroupsRequest req;
        if (!Parse(bytes, &req)) return;
        v1::ListPoolGroupsResponse resp;
        status = stub_->ListPoolGroups(ctx.get(), req, &resp);
        call = "ListPoolGroups";
        if (status.ok()) {
          FUZZ_CHECK(static_cast<size_t>(resp.groups_size()) == before.groups.size(),
                     "ListPoolGroups gave ", resp.groups_size(), " groups, registry has ",
                     before.groups.size());
        }
        break;
      }
      case kDeletePoolGroup: {
        v1::DeletePoolGroupRequest req;
        if (!Parse(bytes, &req)) return;
        v1::DeletePoolGroupResponse resp;
        status = stub_->DeletePoolGroup(ctx.get(), req, &resp);
        call = absl::StrCat("DeletePoolGroup ", req.ShortDebugString());
        break;
      }
      case kRpcCount:
        return;
    }
    const Snapshot after = Take(*registry_, content);
    if (!status.ok()) {
      const grpc::StatusCode c = status.error_code();
      const bool actionable =
          c == grpc::StatusCode::INVALID_ARGUMENT || c == grpc::StatusCode::NOT_FOUND ||
          c == grpc::StatusCode::ALREADY_EXISTS || c == grpc::StatusCode::FAILED_PRECONDITION ||
          c == grpc::StatusCode::RESOURCE_EXHAUSTED || c == grpc::StatusCode::OUT_OF_RANGE ||
          c == grpc::StatusCode::PERMISSION_DENIED || c == grpc::StatusCode::UNIMPLEMENTED;
      FUZZ_CHECK(actionable && !status.error_message().empty(), call, " failed with code ",
                 static_cast<int>(c), " '", status.error_message(), "'");
      FUZZ_CHECK(after == before, call, " failed ('", status.error_message(),
                 "') but changed the registry:", Diff(before, after));
    } else if (!Mutates(rpc)) {
      FUZZ_CHECK(after == before, call,
                 " only reads but changed the registry:", Diff(before, after));
    }
  }

  // Exactly num_tokens / page_size pages went from free to allocated: the
  // ones returned.
  void CheckAlloc(const v1::AllocRequest& req, const v1::AllocResponse& resp,
                  const Snapshot& before) {
    absl::StatusOr<std::shared_ptr<Pool>> pool = registry_->GetPoolOrAnchor(req.pool());
    FUZZ_CHECK(pool.ok(), "Alloc on '", req.pool(), "' succeeded but it resolves to no pool");
    const Pool& p = **pool;
    FUZZ_CHECK(static_cast<uint64_t>(resp.indices_size()) == req.num_tokens(), "Alloc ",
               req.num_tokens(), " returned ", resp.indices_size(), " indices");
    const PoolState& was = before.pools.at(p.name());
    std::set<uint64_t> pages;
    for (int64_t slot : resp.indices()) {
      FUZZ_CHECK(slot >= 0 && static_cast<uint64_t>(slot) < p.size_tokens(), "Alloc returned ",
                 slot);
      const uint64_t page = static_cast<uint64_t>(slot) / p.page_size();
      pages.insert(page);
      FUZZ_CHECK(page >= was.allocated.size() || !was.allocated[page], "Alloc handed out page ",
                 page, " of ", p.Label(), " which was allocated already");
    }
    FUZZ_CHECK(pages.size() * p.page_size() == req.num_tokens(), "Alloc ", req.num_tokens(),
               " covered ", pages.size(), " pages");
    FUZZ_CHECK(p.allocator().free_pages() + pages.size() == was.free_pages, "Alloc of ",
               pages.size(), " pages: free went ", was.free_pages, " -> ",
               p.allocator().free_pages());
  }

  void CheckFree(const v1::FreeRequest& req, const Snapshot& before) {
    absl::StatusOr<std::shared_ptr<Pool>> pool = registry_->GetPoolOrAnchor(req.pool());
    FUZZ_CHECK(pool.ok(), "Free on '", req.pool(), "' succeeded but it resolves to no pool");
    const Pool& p = **pool;
    const PoolState& was = before.pools.at(p.name());
    std::set<uint64_t> pages;
    for (int64_t slot : req.indices()) {
      const uint64_t page = static_cast<uint64_t>(slot) / p.page_size();
      pages.insert(page);
      FUZZ_CHECK(page >= was.allocated.size() || was.allocated[page], "Free accepted page ", page,
                 " of ", p.Label(), " which was not allocated");
      const int64_t one[1] = {slot};
      FUZZ_CHECK(!p.allocator().CheckAllocated(one).ok(), "Free left slot ", slot, " allocated");
    }
    FUZZ_CHECK(p.allocator().free_pages() == was.free_pages + pages.size(), "Free of ",
               pages.size(), " pages: free went ", was.free_pages, " -> ",
               p.allocator().free_pages());
  }

  // The ranges of a page-metadata answer lie inside the regions it names.
  void CheckRanges(const std::string& name, const v1::PageBufferMeta& resp) {
    absl::StatusOr<std::shared_ptr<Pool>> pool = registry_->GetPoolOrAnchor(name);
    FUZZ_CHECK(pool.ok(), "metadata for '", name, "' but it resolves to no pool");
    const Pool& p = **pool;
    FUZZ_CHECK(static_cast<size_t>(resp.region_paths_size()) == p.region_count(), p.Label());
    for (const v1::RegionRange& s : resp.segments()) {
      FUZZ_CHECK(s.region_index() < p.region_count() &&
                     s.offset() + s.length() <= p.region_bytes(s.region_index()) &&
                     s.offset() + s.length() >= s.offset(),
                 p.Label(), ": range region ", s.region_index(), " [", s.offset(), ", +",
                 s.length(), ")");
    }
  }

  // Deletes every group and pool (followers before the pools they follow);
  // all of it must succeed and leave no file behind.
  void Reset() {
    for (const std::shared_ptr<PoolGroup>& g : registry_->ListGroups()) {
      const absl::Status s = registry_->DeleteGroup(g->name());
      FUZZ_CHECK(s.ok(), "deleting group '", g->name(), "': ", s.ToString());
    }
    for (int round = 0; !registry_->List().empty(); ++round) {
      FUZZ_CHECK(round < 64, "pools left after 64 rounds of deletion");
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
    std::vector<std::string> left;
    while (dirent* e = readdir(d)) {
      const std::string n = e->d_name;
      if (n != "." && n != "..") left.push_back(n);
    }
    closedir(d);
    FUZZ_CHECK(left.empty(), "files left in ", dir_, " with no pools: ", absl::StrJoin(left, ", "));
  }

  std::string dir_;
  std::unique_ptr<PoolRegistry> registry_;
  std::unique_ptr<PoolServiceImpl> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::PoolService::Stub> stub_;
};

}  // namespace
}  // namespace kvhost::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // One server for the process (never destroyed: gRPC's threads outlive
  // libFuzzer's exit path); Reset makes every input start from no pools.
  static auto* harness = new kvhost::fuzz::Harness();
  harness->RunInput(data, size);
  return 0;
}
