// Bounded replies and page streams through kvhostd:
// every amplification request (page metadata at the index limit on a pool of
// kMaxLayers layers, split-heads metadata, contiguous buffer infos, groups of
// 2^32 - 1 layers) is refused quickly with the daemon's RSS barely moving;
// a failed CreatePoolGroup leaves nothing; page streams hold one chunk, not
// one page; a pool deleted under a stream ends it with ABORTED; a deleted
// pool's bytes stay counted against --memory-limit until its last stream
// lets it go; meta calls of protected pools need the token.
#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "api_test_util.h"
#include "daemon_fixture.h"
#include "gtest/gtest.h"
#include "kvhost/client.h"
#include "kvhost/v1/pool.grpc.pb.h"

namespace kvhost {
namespace {

using ::kvhost::testing::IsError;
using ::kvhost::testing::StatusOf;
using ::kvhost::testing::TestDaemon;

constexpr uint64_t kMiB = uint64_t{1} << 20;
// What the refused requests may cost the daemon: their own parsed copies
// (2^18 indices are 2 MB) and gRPC's buffers, never their replies.
constexpr uint64_t kRssBound = 64 * kMiB;
constexpr uint32_t kMaxLayers = 4096;  // server/pool/pool_spec.h

// A field of /proc/<pid>/status in bytes (VmRSS, VmHWM).
uint64_t ProcStatusBytes(pid_t pid, const std::string& field) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(in, line)) {
    if (absl::StartsWith(line, field + ":")) {
      std::string value = line.substr(field.size() + 1);
      uint64_t kb = 0;
      if (!absl::SimpleAtoi(absl::StripSuffix(absl::StripAsciiWhitespace(value), " kB"), &kb)) {
        return 0;
      }
      return kb * 1024;
    }
  }
  return 0;
}

std::unique_ptr<TestDaemon> Start(std::vector<std::string> flags = {}) {
  absl::StatusOr<std::unique_ptr<TestDaemon>> d = TestDaemon::Start(KVHOSTD_PATH, flags);
  EXPECT_TRUE(d.ok()) << d.status();
  return d.ok() ? *std::move(d) : nullptr;
}

// A raw stub; it takes messages up to the daemon's own limit (64 MiB).
std::unique_ptr<v1::PoolService::Stub> Stub(const TestDaemon& d) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  // The receive window stays at its initial size: a reader that stops
  // reading stalls the daemon's writes after a few chunks whatever HTTP/2's
  // bandwidth-delay probing would have grown the window to on this machine.
  args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  return v1::PoolService::NewStub(
      grpc::CreateCustomChannel(d.address(), grpc::InsecureChannelCredentials(), args));
}

absl::Status FromGrpc(const grpc::Status& s) {
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

// MHA with one head of one element: layers cost memory only per token.
v1::PoolSpec Deep(v1::Layout layout, uint32_t layers, uint32_t heads, uint64_t tokens) {
  v1::PoolSpec s;
  s.set_kind(v1::MHA);
  s.set_layout(layout);
  s.set_dtype(v1::BF16);
  s.set_page_size(1);
  s.set_layer_num(layers);
  s.set_head_num(heads);
  s.set_head_dim(1);
  s.set_size_tokens(tokens);
  return s;
}

// MLA uint8 pages of `page_mib` MiB (64 layers of page_mib / 64 MiB rows).
v1::PoolSpec BigPages(uint64_t page_mib, uint64_t pages) {
  v1::PoolSpec s;
  s.set_kind(v1::MLA);
  s.set_layout(v1::PAGE_FIRST);
  s.set_dtype(v1::UINT8);
  s.set_page_size(1);
  s.set_layer_num(64);
  s.set_kv_lora_rank(static_cast<uint32_t>(page_mib * kMiB / 64));
  s.set_size_tokens(pages);
  return s;
}

// Runs `call`, expects `code` within a second, returns the status.
template <typename Fn>
absl::Status Quickly(const std::string& what, Fn&& call) {
  const absl::Time start = absl::Now();
  absl::Status s = StatusOf(call());
  const absl::Duration took = absl::Now() - start;
  EXPECT_LT(took, absl::Seconds(1)) << what;
  std::printf("[figure] %s: %s in %.1f ms\n", what.c_str(),
              absl::StatusCodeToString(s.code()).c_str(), absl::ToDoubleMilliseconds(took));
  return s;
}

TEST(BoundsTest, AmplificationRequestsAreRefusedQuicklyWithBoundedRss) {
  // At --max-indices-per-call: 2^18 indices (2 MB parsed), whose reply on
  // 4096 layers would be ~64 GB.
  constexpr uint64_t kMaxIndices = uint64_t{1} << 18;
  std::unique_ptr<TestDaemon> d = Start({absl::StrCat("--max-indices-per-call=", kMaxIndices)});
  ASSERT_NE(d, nullptr);
  Client& c = d->client();
  ASSERT_TRUE(c.CreatePool("deep", Deep(v1::LAYER_FIRST, kMaxLayers, 1, 64)).ok());
  ASSERT_TRUE(c.CreatePool("heads", Deep(v1::PAGE_HEAD, 1, 4096, 16)).ok());
  ASSERT_TRUE(c.CreatePool("attn", Deep(v1::PAGE_FIRST, 4, 1, 16)).ok());
  EXPECT_ERROR(c.CreatePool("over", Deep(v1::LAYER_FIRST, kMaxLayers + 1, 1, 64)), kInvalidArgument,
               "spec.layer_num 4097", "4096");
  const pid_t pid = d->pid();
  const uint64_t rss0 = ProcStatusBytes(pid, "VmRSS"), hwm0 = ProcStatusBytes(pid, "VmHWM");

  const std::vector<int64_t> indices(kMaxIndices, 0);
  EXPECT_ERROR(Quickly("GetPageBufferMeta 2^18 indices x 4096 layers",
                       [&] { return c.GetPageBufferMeta("deep", indices); }),
               kResourceExhausted, "pool 'deep'", "67108864-byte message limit",
               "--max-message-bytes", "at most");
  EXPECT_ERROR(Quickly("GetSplitHeadsPageBufferMeta 2^18 indices x 4096 heads",
                       [&] { return c.GetSplitHeadsPageBufferMeta("heads", indices, 4096); }),
               kResourceExhausted, "pool 'heads'", "message limit");
  // At the cap the infos fit (8192 entries); the estimate let it through.
  absl::StatusOr<v1::ContiguousBufferInfos> infos = c.GetContiguousBufferInfos("deep");  // warm
  ASSERT_TRUE(infos.ok()) << infos.status();
  EXPECT_EQ(infos->infos_size(), 2 * static_cast<int>(kMaxLayers));
  EXPECT_TRUE(Quickly("GetContiguousBufferInfos 4096 layers", [&] {
                return c.GetContiguousBufferInfos("deep");
              }).ok());
  // Groups of absurd layer counts: refused before any map is spelled out,
  // and a failed call leaves no group behind.
  v1::PoolEntry entry;
  entry.set_name("kv");
  entry.set_pool("attn");
  for (uint32_t layers : {4294967295u, 10000000u, kMaxLayers + 1}) {
    EXPECT_ERROR(Quickly(absl::StrCat("CreatePoolGroup layer_num ", layers),
                         [&] { return c.CreatePoolGroup("g", layers, {entry}); }),
                 kInvalidArgument, "group 'g'", absl::StrCat("layer_num ", layers), "4096");
    absl::StatusOr<std::vector<v1::PoolGroup>> groups = c.ListPoolGroups();
    ASSERT_TRUE(groups.ok()) << groups.status();
    EXPECT_TRUE(groups->empty());
    EXPECT_ERROR(c.GetPoolGroup("g"), kNotFound, "'g'");
  }
  const uint64_t rss1 = ProcStatusBytes(pid, "VmRSS"), hwm1 = ProcStatusBytes(pid, "VmHWM");
  std::printf("[figure] daemon VmRSS %+.1f MiB, VmHWM %+.1f MiB over the refusals\n",
              (static_cast<double>(rss1) - rss0) / kMiB, (static_cast<double>(hwm1) - hwm0) / kMiB);
  EXPECT_LT(hwm1 - hwm0, kRssBound);
  EXPECT_LT(rss1 > rss0 ? rss1 - rss0 : 0, kRssBound);

  // The group cap itself is accepted, and the daemon serves on.
  absl::StatusOr<v1::PoolGroup> g = c.CreatePoolGroup("g", kMaxLayers, {entry});
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->entries(0).layer_map_size(), static_cast<int>(kMaxLayers));
  absl::StatusOr<std::vector<v1::PoolGroup>> groups = c.ListPoolGroups();
  ASSERT_TRUE(groups.ok()) << groups.status();
  EXPECT_EQ(groups->size(), 1u);
  EXPECT_TRUE(c.GetStatus().ok());
}

TEST(BoundsTest, ContiguousBufferInfosOverASmallMessageLimitIsRefused) {
  std::unique_ptr<TestDaemon> d = Start({"--max-message-bytes=65536"});
  ASSERT_NE(d, nullptr);
  Client& c = d->client();
  ASSERT_TRUE(c.CreatePool("deep", Deep(v1::LAYER_FIRST, kMaxLayers, 1, 64)).ok());
  EXPECT_ERROR(Quickly("GetContiguousBufferInfos 4096 layers, 64 KiB limit",
                       [&] { return c.GetContiguousBufferInfos("deep"); }),
               kResourceExhausted, "4096 layers x 2 components", "65536-byte message limit");
  // Page metadata says how many indices fit: that many pass.
  const std::vector<int64_t> two = {0, 1};
  absl::Status s = StatusOf(c.GetPageBufferMeta("deep", two));
  EXPECT_TRUE(IsError(s, absl::StatusCode::kResourceExhausted, {"at most 0 indices"})) << s;
  ASSERT_TRUE(c.CreatePool("mid", Deep(v1::LAYER_FIRST, 64, 1, 64)).ok());
  EXPECT_TRUE(c.GetPageBufferMeta("mid", two).ok());
}

TEST(BoundsTest, MetaCallsOfAProtectedPoolNeedTheToken) {
  std::unique_ptr<TestDaemon> d = Start();
  ASSERT_NE(d, nullptr);
  ClientOptions owner;
  owner.address = d->address();
  owner.owner_token = "owner-secret";
  absl::StatusOr<std::unique_ptr<Client>> mine = Client::Connect(owner);
  ASSERT_TRUE(mine.ok());
  ASSERT_TRUE((*mine)->CreatePool("p", Deep(v1::LAYER_FIRST, 2, 1, 16)).ok());
  ASSERT_TRUE((*mine)->CreatePool("h", Deep(v1::PAGE_HEAD, 2, 2, 16)).ok());
  Client& stranger = d->client();
  const std::vector<int64_t> page = {0};
  EXPECT_ERROR(stranger.GetPageBufferMeta("p", page), kPermissionDenied, "pool 'p'");
  EXPECT_ERROR(stranger.GetSplitHeadsPageBufferMeta("h", page, 1), kPermissionDenied, "pool 'h'");
  EXPECT_ERROR(stranger.GetContiguousBufferInfos("p"), kPermissionDenied, "pool 'p'");
  EXPECT_TRUE((*mine)->GetPageBufferMeta("p", page).ok());
  EXPECT_TRUE((*mine)->GetSplitHeadsPageBufferMeta("h", page, 1).ok());
  EXPECT_TRUE((*mine)->GetContiguousBufferInfos("p").ok());
}

TEST(BoundsTest, OneByteWriteStreamsOnHugePagesHoldNoPage) {
  std::unique_ptr<TestDaemon> d = Start();
  ASSERT_NE(d, nullptr);
  Client& c = d->client();
  constexpr uint64_t kPageMiB = 256;
  ASSERT_TRUE(c.CreatePool("huge", BigPages(kPageMiB, 1)).ok());
  ASSERT_TRUE(c.Alloc("huge", 1).ok());
  const pid_t pid = d->pid();
  const uint64_t hwm0 = ProcStatusBytes(pid, "VmHWM");
  std::unique_ptr<v1::PoolService::Stub> stub = Stub(*d);
  struct Stream {
    grpc::ClientContext context;
    v1::WritePagesResponse response;
    std::unique_ptr<grpc::ClientWriter<v1::WritePagesChunk>> writer;
  };
  std::vector<std::unique_ptr<Stream>> streams;
  for (int i = 0; i < 8; ++i) {
    auto s = std::make_unique<Stream>();
    s->writer = stub->WritePages(&s->context, &s->response);
    v1::WritePagesChunk chunk;
    chunk.set_pool("huge");
    chunk.set_index(0);
    chunk.set_data("x");
    ASSERT_TRUE(s->writer->Write(chunk));
    streams.push_back(std::move(s));
  }
  absl::SleepFor(absl::Milliseconds(300));  // every first chunk taken
  const uint64_t hwm1 = ProcStatusBytes(pid, "VmHWM");
  std::printf("[figure] eight 1-byte WritePages streams on %lu MiB pages: VmHWM %+.1f MiB\n",
              static_cast<unsigned long>(kPageMiB), (static_cast<double>(hwm1) - hwm0) / kMiB);
  EXPECT_LT(hwm1 - hwm0, kRssBound);  // a page each would be 2 GiB
  for (auto& s : streams) {
    s->writer->WritesDone();
    absl::Status st = FromGrpc(s->writer->Finish());
    EXPECT_TRUE(IsError(st, absl::StatusCode::kInvalidArgument,
                        {"incomplete", "page 0 has its first 1 bytes written"}))
        << st;
  }
  EXPECT_TRUE(c.GetStatus().ok());
}

TEST(BoundsTest, StreamsUnderDeletePoolEndAborted) {
  std::unique_ptr<TestDaemon> d = Start();
  ASSERT_NE(d, nullptr);
  Client& c = d->client();
  std::unique_ptr<v1::PoolService::Stub> stub = Stub(*d);
  constexpr uint64_t kPageMiB = 32;
  {  // WritePages: a page written, then the pool deleted, then the rest.
    ASSERT_TRUE(c.CreatePool("w", BigPages(1, 4)).ok());
    ASSERT_TRUE(c.Alloc("w", 4).ok());
    grpc::ClientContext context;
    v1::WritePagesResponse response;
    std::unique_ptr<grpc::ClientWriter<v1::WritePagesChunk>> writer =
        stub->WritePages(&context, &response);
    v1::WritePagesChunk chunk;
    chunk.set_pool("w");
    chunk.set_index(0);
    chunk.set_data(std::string(kMiB, 'a'));
    ASSERT_TRUE(writer->Write(chunk));
    absl::SleepFor(absl::Milliseconds(100));
    ASSERT_TRUE(c.DeletePool("w").ok());
    chunk.set_index(1);
    writer->Write(chunk);
    writer->WritesDone();
    absl::Status st = FromGrpc(writer->Finish());
    EXPECT_TRUE(IsError(st, absl::StatusCode::kAborted, {"pool 'w' was deleted", "WritePages"}))
        << st;
  }
  {  // The pool deleted after the last chunk arrived: still not OK.
    ASSERT_TRUE(c.CreatePool("w2", BigPages(1, 1)).ok());
    ASSERT_TRUE(c.Alloc("w2", 1).ok());
    grpc::ClientContext context;
    v1::WritePagesResponse response;
    std::unique_ptr<grpc::ClientWriter<v1::WritePagesChunk>> writer =
        stub->WritePages(&context, &response);
    v1::WritePagesChunk chunk;
    chunk.set_pool("w2");
    chunk.set_index(0);
    chunk.set_data(std::string(kMiB, 'b'));
    ASSERT_TRUE(writer->Write(chunk));
    absl::SleepFor(absl::Milliseconds(100));
    ASSERT_TRUE(c.DeletePool("w2").ok());
    writer->WritesDone();
    absl::Status st = FromGrpc(writer->Finish());
    EXPECT_TRUE(IsError(st, absl::StatusCode::kAborted, {"pool 'w2' was deleted"})) << st;
  }
  std::printf("[time] writes done\n");
  {  // ReadPages: one chunk read, the pool deleted, the rest drained.
    ASSERT_TRUE(c.CreatePool("r", BigPages(kPageMiB, 2)).ok());
    ASSERT_TRUE(c.Alloc("r", 2).ok());
    grpc::ClientContext context;
    v1::ReadPagesRequest request;
    request.set_pool("r");
    request.add_indices(0);
    request.add_indices(1);
    request.set_chunk_bytes(64 * 1024);
    std::unique_ptr<grpc::ClientReader<v1::PageData>> reader = stub->ReadPages(&context, request);
    v1::PageData data;
    ASSERT_TRUE(reader->Read(&data));
    ASSERT_TRUE(c.DeletePool("r").ok());
    uint64_t received = data.data().size();
    while (reader->Read(&data)) received += data.data().size();
    absl::Status st = FromGrpc(reader->Finish());
    EXPECT_TRUE(IsError(st, absl::StatusCode::kAborted, {"pool 'r' was deleted", "ReadPages"}))
        << st << " after " << received << " bytes";
    EXPECT_LT(received, 2 * kPageMiB * kMiB);
  }
}

TEST(BoundsTest, AStalledReadKeepsADeletedPoolsBytesCountedUntilItEnds) {
  std::unique_ptr<TestDaemon> d = Start({"--memory-limit=512M"});
  ASSERT_NE(d, nullptr);
  Client& c = d->client();
  ASSERT_TRUE(c.CreatePool("a", BigPages(64, 4)).ok());  // 256 MiB
  ASSERT_TRUE(c.Alloc("a", 4).ok());
  std::unique_ptr<v1::PoolService::Stub> stub = Stub(*d);
  auto context = std::make_unique<grpc::ClientContext>();
  v1::ReadPagesRequest request;
  request.set_pool("a");
  for (int i = 0; i < 4; ++i) request.add_indices(i);
  // Chunks far larger than HTTP/2's flow-control window: the daemon's next
  // write cannot complete while the client reads nothing, so the stream
  // really stalls holding the pool (with small chunks it would go on
  // writing, see the pool deleted and end ABORTED at once).
  request.set_chunk_bytes(32 << 20);
  std::unique_ptr<grpc::ClientReader<v1::PageData>> reader =
      stub->ReadPages(context.get(), request);
  v1::PageData data;
  ASSERT_TRUE(reader->Read(&data));  // then stalls
  absl::StatusOr<uint64_t> released = c.DeletePool("a");
  ASSERT_TRUE(released.ok()) << released.status();
  absl::StatusOr<v1::DaemonStatus> status = c.GetStatus();
  ASSERT_TRUE(status.ok());
  EXPECT_EQ(status->pool_bytes(), 0u);
  EXPECT_EQ(status->pool_bytes_releasing(), *released);
  std::printf("[figure] stalled ReadPages after DeletePool: pool_bytes_releasing %lu\n",
              static_cast<unsigned long>(status->pool_bytes_releasing()));
  // 384 MiB would fit 512 MiB only if the deleted pool's 256 were free.
  EXPECT_ERROR(c.CreatePool("b", BigPages(64, 6)), kResourceExhausted, "still mapped");
  context->TryCancel();
  while (reader->Read(&data)) {
  }
  (void)reader->Finish();
  reader.reset();
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (absl::Now() < deadline) {
    status = c.GetStatus();
    if (status.ok() && status->pool_bytes_releasing() == 0) break;
    absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_TRUE(status.ok());
  EXPECT_EQ(status->pool_bytes_releasing(), 0u);
  EXPECT_TRUE(c.CreatePool("b", BigPages(64, 6)).ok());
}

}  // namespace
}  // namespace kvhost
