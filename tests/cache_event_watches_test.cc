// CacheService.WatchCacheEvents (server/service/cache_event_watches.cc)
// against a real kvhostd (host backend): a watch gets the events logged
// before it and each new one as it happens, in batches bounded by
// max_events; it ends NOT_FOUND when the cache's pool is deleted,
// UNAVAILABLE when kvhostd stops (which does not wait for it), and is
// refused past 64 watches of one cache, without the token, or for a pool
// that is not a node cache.
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <sys/wait.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "api_test_util.h"
#include "daemon_fixture.h"
#include "kvhost/client.h"
#include "kvhost/v1/cache.grpc.pb.h"

namespace kvhost {
namespace {

using ::kvhost::testing::MakeSpec;
using ::kvhost::testing::Range;
using ::kvhost::testing::TestDaemon;
using ::testing::HasSubstr;

constexpr char kToken[] = "model-token";

// One watch: its context (to cancel it) and its reader.
struct Watch {
  std::unique_ptr<grpc::ClientContext> context = std::make_unique<grpc::ClientContext>();
  std::unique_ptr<grpc::ClientReader<v1::CacheEventBatch>> reader;
};

class CacheEventWatchesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<TestDaemon>> d = TestDaemon::Start(KVHOSTD_PATH);
    ASSERT_TRUE(d.ok()) << d.status();
    d_ = *std::move(d);
    ClientOptions options;
    options.address = d_->address();
    options.owner_token = kToken;
    absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(options);
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = *std::move(client);
    v1::PoolSpec spec = MakeSpec(v1::MHA, v1::PAGE_FIRST, 4, 64);
    spec.set_node_cache(true);
    absl::StatusOr<v1::Pool> pool = client_->CreatePool("nc", spec);
    ASSERT_TRUE(pool.ok()) << pool.status();
    absl::StatusOr<std::unique_ptr<ShmDevicePool>> dev =
        ShmDevicePool::Create(*pool, 64, d_->shm_dir());
    ASSERT_TRUE(dev.ok()) << dev.status();
    device_ = *std::move(dev);
    absl::StatusOr<v1::Attachment> att = client_->AttachDevice(device_->MakeAttachRequest("nc"));
    ASSERT_TRUE(att.ok()) << att.status();
    attachment_ = att->id();
    stub_ = v1::CacheService::NewStub(
        grpc::CreateChannel(d_->address(), grpc::InsecureChannelCredentials()));
  }
  void Store(const std::vector<std::string>& keys) {
    absl::StatusOr<v1::CacheStoreReply> stored =
        client_->CacheStore("nc", attachment_, keys, Range(0, 4 * keys.size()));
    ASSERT_TRUE(stored.ok()) << stored.status();
    ASSERT_TRUE(client_->WaitTransfer(stored->ticket().id()).ok());
  }
  Watch Open(const std::string& cache, uint64_t after = 0, uint32_t max = 0,
             const std::string& token = kToken) {
    Watch w;
    if (!token.empty()) w.context->AddMetadata("kvhost-token", token);
    w.context->set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
    v1::ReadCacheEventsRequest request;
    request.set_cache(cache);
    request.set_after_seq(after);
    request.set_max_events(max);
    w.reader = stub_->WatchCacheEvents(w.context.get(), request);
    return w;
  }
  // Reads batches until `n` events came; their keys in order.
  static std::vector<std::string> ReadKeys(Watch& w, size_t n, size_t* batches = nullptr) {
    std::vector<std::string> keys;
    v1::CacheEventBatch batch;
    while (keys.size() < n && w.reader->Read(&batch)) {
      if (batches != nullptr) ++*batches;
      for (const v1::CacheEvent& e : batch.events()) {
        keys.push_back(absl::StrCat(e.kind() == v1::CacheEvent::STORED ? "+" : "-", e.key()));
      }
    }
    return keys;
  }

  std::unique_ptr<TestDaemon> d_;
  std::unique_ptr<Client> client_;
  std::unique_ptr<ShmDevicePool> device_;
  std::string attachment_;
  std::unique_ptr<v1::CacheService::Stub> stub_;
};

TEST_F(CacheEventWatchesTest, AWatchGetsThePastThenEachNewEventInBoundedBatches) {
  ASSERT_NO_FATAL_FAILURE(Store({"a", "b", "c", "d", "e"}));
  Watch w = Open("nc", /*after=*/1, /*max=*/2);
  size_t batches = 0;
  EXPECT_THAT(ReadKeys(w, 4, &batches), ::testing::ElementsAre("+b", "+c", "+d", "+e"));
  EXPECT_EQ(batches, 2u) << "max_events 2";
  // New events come as they happen.
  const absl::Time before = absl::Now();
  ASSERT_NO_FATAL_FAILURE(Store({"f"}));
  ASSERT_TRUE(client_->CacheEvict("nc", {"a"}).ok());
  EXPECT_THAT(ReadKeys(w, 2), ::testing::ElementsAre("+f", "-a"));
  EXPECT_LT(absl::Now() - before, absl::Seconds(5));
  w.context->TryCancel();
  v1::CacheEventBatch rest;
  while (w.reader->Read(&rest)) {
  }
  EXPECT_EQ(w.reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
}

TEST_F(CacheEventWatchesTest, DeletingTheCacheEndsItsWatchesNotFound) {
  Watch w = Open("nc");
  ASSERT_NO_FATAL_FAILURE(Store({"a"}));
  EXPECT_THAT(ReadKeys(w, 1), ::testing::ElementsAre("+a"));
  ASSERT_TRUE(client_->DetachDevice(attachment_).ok());
  ASSERT_TRUE(client_->DeletePool("nc").ok());
  v1::CacheEventBatch batch;
  while (w.reader->Read(&batch)) {
  }
  const grpc::Status s = w.reader->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("cache 'nc' was deleted"));
}

TEST_F(CacheEventWatchesTest, RefusalsChangeNothing) {
  // Without the token; a pool that is not a node cache; an unknown name.
  Watch no_token = Open("nc", 0, 0, "");
  EXPECT_EQ(no_token.reader->Finish().error_code(), grpc::StatusCode::PERMISSION_DENIED);
  ASSERT_TRUE(client_->CreatePool("plain", MakeSpec(v1::MHA, v1::PAGE_FIRST, 4, 16)).ok());
  Watch plain = Open("plain");
  const grpc::Status s = plain.reader->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(), HasSubstr("pool 'plain' is not a node cache"));
  EXPECT_EQ(Open("nowhere").reader->Finish().error_code(), grpc::StatusCode::NOT_FOUND);

  // 64 watches of one cache; the 65th is refused until one ends.
  std::vector<Watch> watches;
  for (int i = 0; i < 64; ++i) watches.push_back(Open("nc"));
  ASSERT_NO_FATAL_FAILURE(Store({"x"}));
  for (Watch& w : watches) ASSERT_THAT(ReadKeys(w, 1), ::testing::ElementsAre("+x"));
  Watch over = Open("nc");
  const grpc::Status refused = over.reader->Finish();
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(refused.error_message(), HasSubstr("cache 'nc' has 64 event watches open"));
  watches[0].context->TryCancel();
  EXPECT_EQ(watches[0].reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  // The cancelled one leaves the table when gRPC is done with it.
  bool reopened = false;
  for (int i = 0; i < 100 && !reopened; ++i) {
    Watch again = Open("nc", 0, 1);
    v1::CacheEventBatch batch;
    if (again.reader->Read(&batch)) {
      reopened = true;
      EXPECT_EQ(batch.events(0).key(), "x");
      again.context->TryCancel();
    }
    again.reader->Finish();
    if (!reopened) absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_TRUE(reopened);
  for (size_t i = 1; i < watches.size(); ++i) watches[i].context->TryCancel();
  for (size_t i = 1; i < watches.size(); ++i) watches[i].reader->Finish();
}

TEST_F(CacheEventWatchesTest, StoppingKvhostdEndsWatchesAtOnce) {
  Watch w = Open("nc");
  ASSERT_NO_FATAL_FAILURE(Store({"a"}));
  ASSERT_THAT(ReadKeys(w, 1), ::testing::ElementsAre("+a"));
  const absl::Time start = absl::Now();
  ASSERT_EQ(::kill(d_->pid(), SIGTERM), 0);
  v1::CacheEventBatch batch;
  while (w.reader->Read(&batch)) {
  }
  const grpc::Status s = w.reader->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
  // Not the server's 5 s grace.
  EXPECT_LT(absl::Now() - start, absl::Seconds(4)) << d_->Log();
}

}  // namespace
}  // namespace kvhost
