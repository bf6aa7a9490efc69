// CacheServiceImpl (kvhost.v1.CacheService) against a real kvhostd (host backend): two engine
// instances (two clients, each with its worker session and its own emulated
// device pool attached to the cache's pool) share pages byte-exact; an
// instance restarted finds its pages; a node cache's index calls are
// refused; bad calls get precise statuses and change nothing (the pool
// side's fields among them).
#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "api_test_util.h"
#include "daemon_fixture.h"
#include "kvhost/client.h"
#include "kvhost/v1/cache.grpc.pb.h"

namespace kvhost {
namespace {

using ::kvhost::testing::Dims;
using ::kvhost::testing::MakeSpec;
using ::kvhost::testing::TestDaemon;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr char kToken[] = "model-token";
constexpr uint32_t kPageSize = 16;
constexpr uint64_t kDeviceTokens = 256;

v1::PoolSpec CacheSpec() {
  Dims dims;
  dims.layers = 4;
  dims.heads = 2;
  dims.head_dim = 32;
  v1::PoolSpec spec = MakeSpec(v1::MHA, v1::PAGE_FIRST, kPageSize, 64 * kPageSize, v1::BF16, dims);
  spec.set_node_cache(true);
  return spec;
}

// One engine instance: a client with its worker session, a device pool,
// its attachment of the cache, and a CacheService stub.
struct Instance {
  std::unique_ptr<Client> client;
  std::unique_ptr<ShmDevicePool> device;
  std::string attachment;
  std::unique_ptr<v1::CacheService::Stub> cache;

  static std::unique_ptr<Instance> Start(TestDaemon& d, const v1::Pool& pool) {
    auto i = std::make_unique<Instance>();
    ClientOptions options;
    options.address = d.address();
    options.owner_token = kToken;
    absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(options);
    EXPECT_TRUE(client.ok()) << client.status();
    if (!client.ok()) return nullptr;
    i->client = *std::move(client);
    absl::StatusOr<std::unique_ptr<ShmDevicePool>> device =
        ShmDevicePool::Create(pool, kDeviceTokens, d.shm_dir());
    EXPECT_TRUE(device.ok()) << device.status();
    if (!device.ok()) return nullptr;
    i->device = *std::move(device);
    absl::StatusOr<v1::Attachment> att =
        i->client->AttachDevice(i->device->MakeAttachRequest("cache"));
    EXPECT_TRUE(att.ok()) << att.status();
    if (!att.ok()) return nullptr;
    i->attachment = att->id();
    i->cache = v1::CacheService::NewStub(
        grpc::CreateChannel(d.address(), grpc::InsecureChannelCredentials()));
    return i;
  }
  // A call's credentials: this instance's session and the cache's token.
  void Credentials(grpc::ClientContext* context, const std::string& token = kToken) const {
    context->AddMetadata("kvhost-session", client->session_state().session_id);
    if (!token.empty()) context->AddMetadata("kvhost-token", token);
  }
  // Device rows [first, first + n).
  static std::vector<int64_t> Rows(int64_t first, int64_t n) {
    std::vector<int64_t> rows(n);
    for (int64_t r = 0; r < n; ++r) rows[r] = first + r;
    return rows;
  }
  void Fill(uint64_t first, uint64_t n, uint8_t seed) const {
    for (uint32_t c = 0; c < device->components(); ++c) {
      for (uint32_t l = 0; l < device->layers(); ++l) {
        uint8_t* row = device->row(c, l, first);
        for (uint64_t b = 0; b < n * device->row_bytes(c); ++b) row[b] = seed + c + l + b;
      }
    }
  }
  // Whether this instance's rows [first, +n) equal `other`'s [other_first, +n).
  bool Same(uint64_t first, const Instance& other, uint64_t other_first, uint64_t n) const {
    for (uint32_t c = 0; c < device->components(); ++c) {
      for (uint32_t l = 0; l < device->layers(); ++l) {
        if (std::memcmp(device->row(c, l, first), other.device->row(c, l, other_first),
                        n * device->row_bytes(c)) != 0) {
          return false;
        }
      }
    }
    return true;
  }
  grpc::Status Store(const std::vector<std::string>& keys, uint64_t first_row,
                     v1::CacheStoreReply* reply) const {
    v1::CacheStoreRequest request;
    request.set_cache("cache");
    request.set_attachment_id(attachment);
    for (const std::string& k : keys) request.add_keys(k);
    for (int64_t r : Rows(first_row, keys.size() * kPageSize)) request.add_device_indices(r);
    grpc::ClientContext context;
    Credentials(&context);
    return cache->Store(&context, request, reply);
  }
  grpc::Status Restore(const std::vector<std::string>& keys, uint64_t first_row,
                       v1::TransferTicket* ticket) const {
    v1::CacheRestoreRequest request;
    request.set_cache("cache");
    request.set_attachment_id(attachment);
    for (const std::string& k : keys) request.add_keys(k);
    for (int64_t r : Rows(first_row, keys.size() * kPageSize)) request.add_device_indices(r);
    grpc::ClientContext context;
    Credentials(&context);
    return cache->Restore(&context, request, ticket);
  }
  grpc::Status Lookup(const std::vector<std::string>& keys, v1::CacheLookupReply* reply,
                      const std::string& token = kToken) const {
    v1::CacheLookupRequest request;
    request.set_cache("cache");
    for (const std::string& k : keys) request.add_keys(k);
    grpc::ClientContext context;
    Credentials(&context, token);
    return cache->Lookup(&context, request, reply);
  }
  v1::CacheStats Stats() const {
    v1::GetCacheStatsRequest request;
    request.set_cache("cache");
    grpc::ClientContext context;
    Credentials(&context);
    v1::CacheStats stats;
    EXPECT_TRUE(cache->GetCacheStats(&context, request, &stats).ok());
    return stats;
  }
};

class CacheIntegrationTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<TestDaemon>> d = TestDaemon::Start(KVHOSTD_PATH);
    ASSERT_TRUE(d.ok()) << d.status();
    d_ = *std::move(d);
    ClientOptions options;
    options.address = d_->address();
    options.owner_token = kToken;
    options.worker_session = false;
    absl::StatusOr<std::unique_ptr<Client>> admin = Client::Connect(options);
    ASSERT_TRUE(admin.ok()) << admin.status();
    admin_ = *std::move(admin);
    absl::StatusOr<v1::Pool> pool = admin_->CreatePool("cache", CacheSpec());
    ASSERT_TRUE(pool.ok()) << pool.status();
    pool_ = *pool;
    a_ = Instance::Start(*d_, pool_);
    b_ = Instance::Start(*d_, pool_);
    ASSERT_NE(a_, nullptr);
    ASSERT_NE(b_, nullptr);
  }

  std::unique_ptr<TestDaemon> d_;
  std::unique_ptr<Client> admin_;
  v1::Pool pool_;
  std::unique_ptr<Instance> a_, b_;
};

TEST_F(CacheIntegrationTest, TwoInstancesShareAPrefixAndARestartedOneFindsIt) {
  a_->Fill(0, 3 * kPageSize, 7);
  v1::CacheStoreReply stored;
  grpc::Status s = a_->Store({"h0", "h1", "h2"}, 0, &stored);
  ASSERT_TRUE(s.ok()) << s.error_message() << d_->Log();
  ASSERT_TRUE(stored.has_ticket());
  EXPECT_THAT(stored.states(),
              ElementsAre(v1::CACHE_KEY_ABSENT, v1::CACHE_KEY_ABSENT, v1::CACHE_KEY_ABSENT));
  ASSERT_TRUE(a_->client->WaitTransfer(stored.ticket().id()).ok());

  // Instance b finds the prefix a stored and restores it into its own rows.
  v1::CacheLookupReply found;
  ASSERT_TRUE(b_->Lookup({"h0", "h1", "h2", "h3"}, &found).ok());
  EXPECT_EQ(found.prefix(), 3u);
  v1::TransferTicket restore;
  s = b_->Restore({"h0", "h1", "h2"}, 5 * kPageSize, &restore);
  ASSERT_TRUE(s.ok()) << s.error_message();
  absl::StatusOr<v1::TransferStatus> done = b_->client->WaitTransfer(restore.id());
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_EQ(done->layers_done(), 4u);
  EXPECT_TRUE(b_->Same(5 * kPageSize, *a_, 0, 3 * kPageSize));

  // a restarts: its session ends, a new one finds the pages and restores them.
  a_.reset();
  std::unique_ptr<Instance> again = Instance::Start(*d_, pool_);
  ASSERT_NE(again, nullptr);
  v1::CacheLookupReply after;
  ASSERT_TRUE(again->Lookup({"h0", "h1", "h2"}, &after).ok());
  EXPECT_EQ(after.prefix(), 3u);
  s = again->Restore({"h1", "h2"}, 0, &restore);
  ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_TRUE(again->client->WaitTransfer(restore.id()).ok());
  EXPECT_TRUE(again->Same(0, *b_, 6 * kPageSize, 2 * kPageSize));
  const v1::CacheStats stats = again->Stats();
  EXPECT_EQ(stats.published(), 3u);
  EXPECT_EQ(stats.stored(), 3u);
  EXPECT_EQ(stats.pinned(), 0u);
  EXPECT_EQ(stats.free_pages(), stats.page_num() - 3);
}

TEST_F(CacheIntegrationTest, TheCachesIndexCallsAreRefused) {
  absl::StatusOr<std::vector<int64_t>> alloc = admin_->Alloc("cache", kPageSize);
  EXPECT_EQ(alloc.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(alloc.status().message(), HasSubstr("pool 'cache' is a node cache"));
  std::vector<int64_t> rows = Instance::Rows(0, kPageSize);
  absl::StatusOr<uint64_t> backup = a_->client->Backup(a_->attachment, rows, rows);
  EXPECT_EQ(backup.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(backup.status().message(), HasSubstr("is a node cache"));
  // A node cache cannot be followed.
  v1::PoolSpec follower = CacheSpec();
  follower.set_kind(v1::K_ONLY);
  follower.set_node_cache(false);
  follower.set_size_tokens(0);
  follower.set_page_size(0);
  follower.set_follows("cache");
  absl::StatusOr<v1::Pool> f = admin_->CreatePool("follower", follower);
  EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument) << f.status();
  EXPECT_THAT(f.status().message(), HasSubstr("is a node cache"));
}

TEST_F(CacheIntegrationTest, BadCallsAreRefusedPreciselyAndChangeNothing) {
  const v1::CacheStats before = a_->Stats();
  v1::CacheLookupReply found;
  // Without the cache's token: PERMISSION_DENIED, nothing said of its keys.
  grpc::Status s = a_->Lookup({"h0"}, &found, "");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
  s = a_->Lookup({"h0"}, &found, "wrong");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  // A pool that is not a node cache.
  ASSERT_TRUE(admin_
                  ->CreatePool("plain", MakeSpec(v1::MHA, v1::PAGE_FIRST, kPageSize, 4 * kPageSize,
                                                 v1::BF16, Dims{}))
                  .ok());
  {
    v1::CacheLookupRequest request;
    request.set_cache("plain");
    request.add_keys("k");
    grpc::ClientContext context;
    a_->Credentials(&context);
    s = a_->cache->Lookup(&context, request, &found);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_THAT(s.error_message(), HasSubstr("pool 'plain' is not a node cache"));
  }
  // Too many keys, a key twice, an empty key.
  std::vector<std::string> many(4097);
  for (size_t k = 0; k < many.size(); ++k) many[k] = std::to_string(k);
  s = a_->Lookup(many, &found);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("4097 keys, over the limit of 4096"));
  v1::CacheStoreReply stored;
  s = a_->Store({"x", "x"}, 0, &stored);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("cache 'cache': key 1 repeats"));
  // Device rows past the device pool: refused by the backup, reservation gone.
  s = a_->Store({"y"}, kDeviceTokens, &stored);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  // Restoring what is not there.
  v1::TransferTicket ticket;
  s = a_->Restore({"nothing"}, 0, &ticket);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(), HasSubstr("key 0 is not present"));
  // An attachment id that names nothing.
  {
    v1::CacheStoreRequest request;
    request.set_cache("cache");
    request.set_attachment_id("att-unknown");
    request.add_keys("z");
    for (int64_t r : Instance::Rows(0, kPageSize)) request.add_device_indices(r);
    grpc::ClientContext context;
    a_->Credentials(&context);
    s = a_->cache->Store(&context, request, &stored);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND) << s.error_message();
  }
  // The pool side (CachePoolSlots): exactly one of it and attachment_id, no
  // device event beside it.
  {
    v1::CacheStoreRequest request;
    request.set_cache("cache");
    request.add_keys("z");
    grpc::ClientContext none_given;
    a_->Credentials(&none_given);
    s = a_->cache->Store(&none_given, request, &stored);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(s.error_message(), HasSubstr("neither attachment_id nor pool is given"));
    request.set_attachment_id(a_->attachment);
    request.mutable_pool()->set_pool("plain");
    for (int64_t r : Instance::Rows(0, kPageSize)) request.mutable_pool()->add_host_indices(r);
    grpc::ClientContext both;
    a_->Credentials(&both);
    s = a_->cache->Store(&both, request, &stored);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(s.error_message(), HasSubstr("both attachment_id / device_indices and pool"));
    v1::CacheRestoreRequest restore;
    restore.set_cache("cache");
    restore.add_keys("z");
    *restore.mutable_pool() = request.pool();
    restore.set_wait_event_handle("event");
    grpc::ClientContext fenced;
    a_->Credentials(&fenced);
    s = a_->cache->Restore(&fenced, restore, &ticket);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(s.error_message(), HasSubstr("wait_event_handle is set beside pool"));
  }
  const v1::CacheStats after = a_->Stats();
  EXPECT_EQ(after.published(), before.published());
  EXPECT_EQ(after.writing(), 0u);
  EXPECT_EQ(after.pinned(), 0u);
  EXPECT_EQ(after.free_pages(), before.free_pages());
}

}  // namespace
}  // namespace kvhost
