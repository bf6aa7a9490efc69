// Tests of kvhost::Client's own logic (client/client.cc), apart from the
// session (session_test) and deposits (deposit_test): the element and row
// sizes of a spec; Connect's refusals of bad options (an empty address, a
// TLS certificate without its key, CA files that cannot be read or are
// empty) and WaitForReady's deadline naming the address; the page streams'
// protocol against a scripted PoolService in this process (ReadPages
// reassembles chunks and refuses chunks out of order, a page overrun, a
// stream that ends early, and passes the daemon's own error first;
// WritePages sends each page in chunks of at most chunk_bytes, the pool
// named once, the owner token and session ids in metadata); and calls
// through a real kvhostd (tests/daemon_fixture.h): health overall and per
// service, pools created, read, written in small chunks, deleted with their
// bytes, the owner token as the client sends it, the daemon's errors
// carried with their code and message, ClaimPool without a session refused.
#include "kvhost/client.h"

#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <fstream>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "api_test_util.h"
#include "daemon_fixture.h"
#include "in_process_server.h"
#include "kvhost/v1/pool.grpc.pb.h"
#include "shm_dir.h"

namespace kvhost {
namespace {

using ::kvhost::testing::InProcessServer;
using ::kvhost::testing::MakeSpec;
using ::kvhost::testing::ShmDir;
using ::kvhost::testing::TestDaemon;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::string Msg(const absl::Status& s) { return std::string(s.message()); }

TEST(ClientSizesTest, DTypeAndDeviceRowBytes) {
  EXPECT_EQ(DTypeBytes(v1::FP32), 4u);
  EXPECT_EQ(DTypeBytes(v1::BF16), 2u);
  EXPECT_EQ(DTypeBytes(v1::FP16), 2u);
  EXPECT_EQ(DTypeBytes(v1::FP8_E4M3), 1u);
  EXPECT_EQ(DTypeBytes(v1::FP8_E5M2), 1u);
  EXPECT_EQ(DTypeBytes(v1::UINT8), 1u);
  EXPECT_EQ(DTypeBytes(v1::DTYPE_UNSPECIFIED), 0u);
  v1::PoolSpec mha = MakeSpec(v1::MHA, v1::LAYER_FIRST, 16, 64, v1::BF16, {3, 4, 128});
  EXPECT_EQ(DeviceRowBytes(mha), 4u * 128 * 2);
  v1::PoolSpec mla = MakeSpec(v1::MLA, v1::PAGE_FIRST, 16, 64, v1::FP32);
  EXPECT_EQ(DeviceRowBytes(mla), (12u + 4) * 4);  // Dims' lora_rank + rope_dim
  mla.set_kv_cache_dim(656);                      // a given cache row wins
  EXPECT_EQ(DeviceRowBytes(mla), 656u * 4);
  v1::PoolSpec dsa = mla;
  dsa.set_kind(v1::DSA);
  EXPECT_EQ(DeviceRowBytes(dsa), 656u * 4);
}

TEST(ClientConnectTest, BadOptionsAreRefused) {
  ShmDir dir("kvhost-client-test");
  ASSERT_FALSE(dir.path().empty());
  const std::string empty_file = dir.path() + "/empty.pem";
  std::ofstream(empty_file).close();
  const std::string missing = dir.path() + "/missing.pem";
  struct Case {
    const char* what;
    ClientOptions options;
    absl::StatusCode code;
    std::string message;
  };
  std::vector<Case> cases;
  ClientOptions o;
  o.address = "";
  cases.push_back(
      {"empty address", o, absl::StatusCode::kInvalidArgument, "client address is empty"});
  o.address = "127.0.0.1:50051";
  o.tls_cert_file = empty_file;
  cases.push_back({"cert without key", o, absl::StatusCode::kInvalidArgument,
                   "ClientOptions.tls_cert_file and tls_key_file go together"});
  o.tls_cert_file = "";
  o.tls_ca_file = missing;
  cases.push_back({"unreadable CA", o, absl::StatusCode::kFailedPrecondition,
                   absl::StrCat("ClientOptions.tls_ca_file ", missing, " cannot be read: ")});
  o.tls_ca_file = empty_file;
  cases.push_back({"empty CA", o, absl::StatusCode::kFailedPrecondition,
                   absl::StrCat("ClientOptions.tls_ca_file ", empty_file, " is empty")});
  for (const Case& c : cases) {
    absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(c.options);
    EXPECT_EQ(client.status().code(), c.code) << c.what << ": " << client.status();
    EXPECT_THAT(Msg(client.status()), HasSubstr(c.message)) << c.what;
  }
  // TLS files mean nothing on a unix socket (plaintext) or with insecure.
  o.address = "unix://" + dir.path() + "/none.sock";
  EXPECT_TRUE(Client::Connect(o).ok());
  o.address = "127.0.0.1:50051";
  o.insecure = true;
  EXPECT_TRUE(Client::Connect(o).ok());
}

TEST(ClientConnectTest, WaitForReadyNamesTheAddress) {
  ShmDir dir("kvhost-client-test");
  ClientOptions o;
  o.address = "unix://" + dir.path() + "/nobody.sock";
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(o);
  ASSERT_TRUE(client.ok()) << client.status();
  const absl::Status s = (*client)->WaitForReady(absl::Milliseconds(300));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_THAT(Msg(s), HasSubstr(absl::StrCat("kvhostd at ", o.address, " not ready after 300ms")));
}

// A PoolService whose page streams are scripted: ReadPages sends `chunks`
// then ends with `end`; WritePages records what it gets. Both record the
// metadata they were called with.
class ScriptedPools final : public v1::PoolService::Service {
 public:
  grpc::Status ReadPages(grpc::ServerContext* context, const v1::ReadPagesRequest* request,
                         grpc::ServerWriter<v1::PageData>* writer) override {
    Record(*context);
    for (const v1::PageData& chunk : chunks) writer->Write(chunk);
    return end;
  }
  grpc::Status WritePages(grpc::ServerContext* context,
                          grpc::ServerReader<v1::WritePagesChunk>* reader,
                          v1::WritePagesResponse* response) override {
    Record(*context);
    v1::WritePagesChunk chunk;
    uint64_t pages = 0;
    while (reader->Read(&chunk)) {
      if (chunk.offset() == 0) ++pages;
      absl::MutexLock lock(&mu);
      written.push_back(chunk);
    }
    response->set_pages_written(pages);
    return grpc::Status::OK;
  }
  void Record(const grpc::ServerContext& context) {
    absl::MutexLock lock(&mu);
    metadata.clear();
    for (const auto& [key, value] : context.client_metadata()) {
      if (absl::StartsWith(std::string(key.data(), key.size()), "kvhost-")) {
        metadata.emplace_back(std::string(key.data(), key.size()),
                              std::string(value.data(), value.size()));
      }
    }
  }

  std::vector<v1::PageData> chunks;
  grpc::Status end = grpc::Status::OK;
  absl::Mutex mu;
  std::vector<v1::WritePagesChunk> written;
  std::vector<std::pair<std::string, std::string>> metadata;
};

v1::PageData Chunk(int64_t index, uint64_t offset, const std::string& data, uint64_t page_bytes) {
  v1::PageData d;
  d.set_index(index);
  d.set_offset(offset);
  d.set_data(data);
  d.set_page_bytes(page_bytes);
  return d;
}

class ClientStreamTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_FALSE(dir_.path().empty());
    const std::string address = "unix://" + dir_.path() + "/grpc.sock";
    server_ =
        std::make_unique<InProcessServer>(std::initializer_list<grpc::Service*>{&pools_}, address);
    ASSERT_TRUE(server_->ok());
    ClientOptions options;
    options.address = address;
    options.owner_token = "tok-1";
    options.worker_session = false;
    options.fast_path = false;
    absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect(options);
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = *std::move(c);
  }
  void TearDown() override {
    client_.reset();
    server_.reset();
  }

  ShmDir dir_{"kvhost-client-test"};
  ScriptedPools pools_;
  std::unique_ptr<InProcessServer> server_;
  std::unique_ptr<Client> client_;
};

TEST_F(ClientStreamTest, ReadPagesReassemblesChunks) {
  pools_.chunks = {Chunk(8, 0, "abc", 8), Chunk(8, 3, "defgh", 8), Chunk(0, 0, "12345678", 8)};
  absl::StatusOr<std::vector<std::string>> pages = client_->ReadPages("p", {8, 0}, 5);
  ASSERT_TRUE(pages.ok()) << pages.status();
  EXPECT_THAT(*pages, ElementsAre("abcdefgh", "12345678"));
  absl::MutexLock lock(&pools_.mu);
  EXPECT_THAT(pools_.metadata,
              ElementsAre(std::pair<std::string, std::string>("kvhost-token", "tok-1")));
}

TEST_F(ClientStreamTest, ReadPagesRefusesAStreamOutOfProtocol) {
  struct Case {
    const char* what;
    std::vector<v1::PageData> chunks;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"another page's chunk",
       {Chunk(8, 0, "abc", 8), Chunk(0, 0, "12345678", 8)},
       "ReadPages: chunk of page 0 at offset 0 out of order"},
      {"a gap",
       {Chunk(8, 0, "abc", 8), Chunk(8, 4, "efgh", 8)},
       "ReadPages: chunk of page 8 at offset 4 out of order"},
      {"a page not asked",
       {Chunk(16, 0, "abcdefgh", 8)},
       "ReadPages: chunk of page 16 at offset 0 out of order"},
      {"an overrun",
       {Chunk(8, 0, "abcdef", 8), Chunk(8, 6, "ghi", 8)},
       "ReadPages: page 8 overruns its 8 bytes"},
      {"an early end",
       {Chunk(8, 0, "abcdefgh", 8)},
       "ReadPages: the stream ended after 1 of 2 pages (the last one 8 of 8 bytes)"},
      {"a page cut short",
       {Chunk(8, 0, "abcdefgh", 8), Chunk(0, 0, "1234", 8)},
       "ReadPages: the stream ended after 2 of 2 pages (the last one 4 of 8 bytes)"},
  };
  for (const Case& c : cases) {
    pools_.chunks = c.chunks;
    absl::StatusOr<std::vector<std::string>> pages = client_->ReadPages("p", {8, 0}, 0);
    EXPECT_EQ(pages.status().code(), absl::StatusCode::kInternal)
        << c.what << ": " << pages.status();
    EXPECT_EQ(Msg(pages.status()), c.message) << c.what;
  }
  // The daemon's own error comes first.
  pools_.chunks = cases[0].chunks;
  pools_.end = grpc::Status(grpc::StatusCode::NOT_FOUND, "pool 'p' not found");
  absl::StatusOr<std::vector<std::string>> pages = client_->ReadPages("p", {8, 0}, 0);
  EXPECT_EQ(pages.status().code(), absl::StatusCode::kNotFound) << pages.status();
  EXPECT_EQ(Msg(pages.status()), "pool 'p' not found");
}

TEST_F(ClientStreamTest, WritePagesSendsChunksOfAtMostChunkBytes) {
  const std::vector<std::string> pages = {"0123456789", "", "abcd"};
  absl::StatusOr<uint64_t> written = client_->WritePages("p", {4, 8, 12}, pages, 4);
  ASSERT_TRUE(written.ok()) << written.status();
  EXPECT_EQ(*written, 3u);
  absl::MutexLock lock(&pools_.mu);
  struct Want {
    std::string pool;
    int64_t index;
    uint64_t offset;
    std::string data;
  };
  // The pool is named once; a page of 0 bytes still sends its one chunk.
  const std::vector<Want> want = {{"p", 4, 0, "0123"},
                                  {"", 4, 4, "4567"},
                                  {"", 4, 8, "89"},
                                  {"", 8, 0, ""},
                                  {"", 12, 0, "abcd"}};
  ASSERT_EQ(pools_.written.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(pools_.written[i].pool(), want[i].pool) << i;
    EXPECT_EQ(pools_.written[i].index(), want[i].index) << i;
    EXPECT_EQ(pools_.written[i].offset(), want[i].offset) << i;
    EXPECT_EQ(pools_.written[i].data(), want[i].data) << i;
  }
  EXPECT_THAT(pools_.metadata,
              ElementsAre(std::pair<std::string, std::string>("kvhost-token", "tok-1")));
}

TEST_F(ClientStreamTest, WritePagesRefusesCountsThatDiffer) {
  const std::vector<std::string> pages = {"abcd"};
  absl::StatusOr<uint64_t> written = client_->WritePages("p", {0, 4}, pages, 0);
  EXPECT_EQ(written.status().code(), absl::StatusCode::kInvalidArgument) << written.status();
  EXPECT_EQ(Msg(written.status()), "WritePages: 2 indices but 1 pages");
  absl::MutexLock lock(&pools_.mu);
  EXPECT_TRUE(pools_.written.empty());
}

// Through a real kvhostd.
using ClientDaemonTest = ::kvhost::testing::WithDaemon<::testing::Test>;

TEST_F(ClientDaemonTest, HealthStatusAndPools) {
  absl::StatusOr<std::string> health = client().Health();
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, "SERVING");
  health = client().Health("kvhost.v1.PoolService");
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, "SERVING");
  health = client().Health("kvhost.v1.StorageService");  // no --l3-memcached
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, "NOT_SERVING");
  absl::StatusOr<v1::DaemonStatus> status = client().GetStatus();
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(status->backend(), "host");
  EXPECT_EQ(status->shm_dir(), shm_dir());

  absl::StatusOr<v1::Pool> created =
      client().CreatePool("kv", MakeSpec(v1::MHA, v1::PAGE_FIRST, 4, 64));
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_EQ(created->name(), "kv");
  absl::StatusOr<v1::Pool> got = client().GetPool("kv");
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->bytes(), created->bytes());
  absl::StatusOr<std::vector<v1::Pool>> listed = client().ListPools();
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->size(), 1u);
  EXPECT_EQ((*listed)[0].name(), "kv");

  // Pages written in chunks smaller than a page read back whole.
  absl::StatusOr<std::vector<int64_t>> slots = client().Alloc("kv", 8);
  ASSERT_TRUE(slots.ok()) << slots.status();
  ASSERT_EQ(slots->size(), 8u);
  const std::vector<int64_t> firsts = {(*slots)[0], (*slots)[4]};
  absl::StatusOr<std::string> flat = client().GetDataPage("kv", firsts[0]);
  ASSERT_TRUE(flat.ok()) << flat.status();
  const uint64_t page_bytes = flat->size();
  ASSERT_GT(page_bytes, 200u);  // several chunks of 100 bytes
  std::vector<std::string> pages = {std::string(page_bytes, 'a'), std::string(page_bytes, 'b')};
  for (size_t i = 0; i < page_bytes; ++i) pages[1][i] = static_cast<char>('a' + i % 26);
  absl::StatusOr<uint64_t> written = client().WritePages("kv", firsts, pages, 100);
  ASSERT_TRUE(written.ok()) << written.status();
  EXPECT_EQ(*written, 2u);
  absl::StatusOr<std::vector<std::string>> read = client().ReadPages("kv", firsts, 96);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, pages);
  absl::StatusOr<uint64_t> freed = client().Free("kv", *slots);
  ASSERT_TRUE(freed.ok()) << freed.status();
  EXPECT_EQ(*freed, 8u);

  absl::StatusOr<uint64_t> released = client().DeletePool("kv");
  ASSERT_TRUE(released.ok()) << released.status();
  EXPECT_EQ(*released, created->bytes());
  // The daemon's error, with its code and message.
  got = client().GetPool("kv");
  EXPECT_EQ(got.status().code(), absl::StatusCode::kNotFound) << got.status();
  EXPECT_THAT(Msg(got.status()), HasSubstr("'kv'"));
}

TEST_F(ClientDaemonTest, TheOwnerTokenIsSentOnEveryCall) {
  ClientOptions options;
  options.address = daemon_->address();
  options.owner_token = "owner-token-1";
  options.worker_session = false;
  absl::StatusOr<std::unique_ptr<Client>> owner = Client::Connect(options);
  ASSERT_TRUE(owner.ok()) << owner.status();
  ASSERT_TRUE((*owner)->CreatePool("mine", MakeSpec(v1::MHA, v1::PAGE_FIRST, 4, 64)).ok());
  absl::StatusOr<std::vector<int64_t>> mine = (*owner)->Alloc("mine", 4);
  ASSERT_TRUE(mine.ok()) << mine.status();
  // The fixture's client has no token: the protected pool refuses it.
  absl::StatusOr<std::vector<int64_t>> theirs = client().Alloc("mine", 4);
  EXPECT_EQ(theirs.status().code(), absl::StatusCode::kPermissionDenied) << theirs.status();
  EXPECT_THAT(Msg(theirs.status()), HasSubstr("'mine'"));
  // ClaimPool needs a session, which this client does not keep.
  absl::StatusOr<v1::PoolClaim> claim = (*owner)->ClaimPool("mine", "inst-a");
  EXPECT_EQ(claim.status().code(), absl::StatusCode::kFailedPrecondition) << claim.status();
  EXPECT_EQ(Msg(claim.status()),
            "ClaimPool of pool 'mine' needs a worker session: this client was made without one "
            "(worker_session false)");
}

}  // namespace
}  // namespace kvhost
