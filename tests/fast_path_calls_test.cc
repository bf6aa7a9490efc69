// Tests of the fast path's decoding and dispatch (server/service/fast_path_calls.h)
// over real services on the host engine, without a mailbox: refused frames
// (not a request, no known method, a body that is not the method's request,
// too many session ids, a wait over the limit) answer INVALID_ARGUMENT naming
// the value; a call runs the service's Do* body with the frame's session and
// token; replies are bounded by the mailbox's capacity before anything is
// allocated (fixtures: transfer_manager_fixtures.h).
#include "server/service/fast_path_calls.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <string>

#include "common/fast_path_mailbox.h"
#include "transfer_manager_fixtures.h"

namespace kvhost {
namespace {

constexpr uint32_t kCapacity = 1 << 16;

class FastPathCallsTest : public ManagerTest {
 protected:
  void SetUp() override {
    ManagerTest::SetUp();
    if (HasFatalFailure()) return;
    pools_ = std::make_unique<PoolServiceImpl>(
        registry_.get(), "host", 64 << 20, nullptr, PoolServiceImpl::kDefaultMaxIndicesPerCall,
        [this](const std::string& id) { return manager_->IsSessionOpen(id); });
    transfers_ = std::make_unique<TransferServiceImpl>(manager_.get(), registry_.get(), 1024);
    calls_ = std::make_unique<FastPathCalls>(pools_.get(), transfers_.get());
  }
  void TearDown() override {
    calls_.reset();
    transfers_.reset();
    pools_.reset();
    ManagerTest::TearDown();
  }

  // The reply to `frame`, with the method and code Handle reports.
  v1::FastPathReply Call(const std::string& frame, uint32_t capacity = kCapacity) {
    method_ = v1::FAST_PATH_METHOD_UNSPECIFIED;
    code_ = absl::StatusCode::kUnknown;
    const std::string out = calls_->Handle(frame, capacity, &method_, &code_);
    EXPECT_LE(out.size(), capacity);
    v1::FastPathReply reply;
    EXPECT_TRUE(reply.ParseFromString(out));
    EXPECT_EQ(reply.code(), static_cast<int32_t>(code_));
    return reply;
  }
  static std::string Frame(v1::FastPathMethod method, const google::protobuf::Message& body,
                           const std::string& session = "") {
    v1::FastPathRequest r;
    r.set_method(method);
    r.set_body(body.SerializeAsString());
    if (!session.empty()) r.add_session_ids(session);
    return r.SerializeAsString();
  }
  static v1::AllocRequest AllocOf(uint64_t n) {
    v1::AllocRequest a;
    a.set_pool("llama");
    a.set_num_tokens(n);
    return a;
  }
  uint64_t Available() const { return pool_->allocator().available_tokens(); }

  std::unique_ptr<PoolServiceImpl> pools_;
  std::unique_ptr<TransferServiceImpl> transfers_;
  std::unique_ptr<FastPathCalls> calls_;
  v1::FastPathMethod method_ = v1::FAST_PATH_METHOD_UNSPECIFIED;
  absl::StatusCode code_ = absl::StatusCode::kUnknown;
};

TEST(FastPathMethodTest, NamesMirrorTheGrpcMethods) {
  EXPECT_STREQ(FastPathGrpcMethod(v1::FAST_PATH_METHOD_ALLOC), "kvhost.v1.PoolService/Alloc");
  EXPECT_STREQ(FastPathGrpcMethod(v1::FAST_PATH_METHOD_ALLOC_BACKUP),
               "kvhost.v1.TransferService/AllocBackup");
  EXPECT_STREQ(FastPathGrpcMethod(v1::FAST_PATH_METHOD_UNSPECIFIED), "unknown");
  EXPECT_STREQ(FastPathMethodName(v1::FAST_PATH_METHOD_WAIT_TRANSFER), "WaitTransfer");
  EXPECT_STREQ(FastPathMethodName(v1::FAST_PATH_METHOD_UNSPECIFIED), "unknown method");
  // The node cache's, as the RPC metrics' method label spells them on gRPC.
  EXPECT_STREQ(FastPathGrpcMethod(v1::FAST_PATH_METHOD_CACHE_LOOKUP),
               "kvhost.v1.CacheService/Lookup");
  EXPECT_STREQ(FastPathGrpcMethod(v1::FAST_PATH_METHOD_CACHE_STORE),
               "kvhost.v1.CacheService/Store");
  EXPECT_STREQ(FastPathGrpcMethod(v1::FAST_PATH_METHOD_CACHE_RESTORE),
               "kvhost.v1.CacheService/Restore");
  EXPECT_STREQ(FastPathMethodName(v1::FAST_PATH_METHOD_CACHE_RESTORE), "Restore");
}

TEST_F(FastPathCallsTest, AllocRunsTheServiceAndRepliesItsResponse) {
  const uint64_t before = Available();
  const v1::FastPathReply reply = Call(Frame(v1::FAST_PATH_METHOD_ALLOC, AllocOf(8)));
  ASSERT_EQ(code_, absl::StatusCode::kOk) << reply.message();
  EXPECT_EQ(method_, v1::FAST_PATH_METHOD_ALLOC);
  v1::AllocResponse a;
  ASSERT_TRUE(a.ParseFromString(reply.body()));
  EXPECT_EQ(a.indices_size(), 8);
  EXPECT_EQ(a.available_tokens(), before - 8);
  EXPECT_EQ(Available(), before - 8);
}

TEST_F(FastPathCallsTest, RefusedFramesNameTheValueAndChangeNothing) {
  const uint64_t before = Available();
  v1::FastPathReply r = Call(std::string("\xff\xff\xff", 3));
  EXPECT_EQ(code_, absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(method_, v1::FAST_PATH_METHOD_UNSPECIFIED);
  EXPECT_EQ(r.message(),
            "fast path: a request frame of 3 bytes is not a kvhost.v1.FastPathRequest");

  r = Call(Frame(v1::FAST_PATH_METHOD_UNSPECIFIED, AllocOf(8)));
  EXPECT_EQ(code_, absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r.message(), "fast path: method 0 is not one kvhostd serves there");

  // Made without a CacheServiceImpl: the node cache's methods are not served.
  r = Call(Frame(v1::FAST_PATH_METHOD_CACHE_LOOKUP, v1::CacheLookupRequest()));
  EXPECT_EQ(code_, absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(method_, v1::FAST_PATH_METHOD_CACHE_LOOKUP);
  EXPECT_EQ(r.message(), "fast path: method 8 is not one kvhostd serves there");

  v1::FastPathRequest bad;
  bad.set_method(v1::FAST_PATH_METHOD_ALLOC);
  bad.set_body(std::string("\xff\xff", 2));
  r = Call(bad.SerializeAsString());
  EXPECT_EQ(code_, absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(method_, v1::FAST_PATH_METHOD_ALLOC);
  EXPECT_EQ(r.message(),
            "fast path: the body of a Alloc call (2 bytes) is not a kvhost.v1.AllocRequest");

  v1::FastPathRequest many;
  many.set_method(v1::FAST_PATH_METHOD_ALLOC);
  many.set_body(AllocOf(8).SerializeAsString());
  for (int i = 0; i <= kMaxCallerSessions; ++i) many.add_session_ids("s");
  r = Call(many.SerializeAsString());
  EXPECT_EQ(code_, absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.message(),
              HasSubstr(absl::StrCat("names ", kMaxCallerSessions + 1,
                                     " session ids, over the limit of ", kMaxCallerSessions)));

  v1::FastPathRequest wait;
  wait.set_method(v1::FAST_PATH_METHOD_WAIT_TRANSFER);
  wait.set_timeout_ms(kFastPathMaxWaitMs + 1);
  r = Call(wait.SerializeAsString());
  EXPECT_EQ(code_, absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r.message(), "fast path: WaitTransfer timeout_ms 60001 is over the limit of 60000");
  EXPECT_TRUE(r.body().empty());
  EXPECT_EQ(Available(), before);
  ExpectNoTickets();
}

TEST_F(FastPathCallsTest, TheFramesSessionAndTokenAreTheCallers) {
  const std::string session = manager_->OpenSession("worker", 1, "test");
  v1::ClaimPoolRequest claim;
  claim.set_pool("llama");
  claim.set_instance_id("inst");
  v1::PoolClaim claimed;
  ASSERT_TRUE(pools_->DoClaimPool({{session}, std::nullopt}, claim, &claimed).ok());
  const uint64_t before = Available();
  // Without the holder's session: refused as on gRPC.
  v1::FastPathReply r = Call(Frame(v1::FAST_PATH_METHOD_ALLOC, AllocOf(8)));
  EXPECT_EQ(code_, absl::StatusCode::kFailedPrecondition) << r.message();
  EXPECT_THAT(r.message(), HasSubstr("Alloc from another session is refused"));
  EXPECT_EQ(Available(), before);
  r = Call(Frame(v1::FAST_PATH_METHOD_ALLOC, AllocOf(8), session));
  EXPECT_EQ(code_, absl::StatusCode::kOk) << r.message();
  EXPECT_EQ(Available(), before - 8);
}

TEST_F(FastPathCallsTest, RepliesAreBoundedByTheMailbox) {
  const uint64_t before = Available();
  ASSERT_EQ(before, 64u);
  // 64 slots below 64 need up to 64 + 32 bytes: over a 150-byte mailbox
  // less its 64 bytes of framing. Refused before allocating.
  v1::FastPathReply r = Call(Frame(v1::FAST_PATH_METHOD_ALLOC, AllocOf(64)), 150);
  EXPECT_EQ(code_, absl::StatusCode::kResourceExhausted) << r.message();
  EXPECT_THAT(r.message(), HasSubstr("num_tokens 64 needs a response of up to 96 bytes, over the "
                                     "86-byte message limit"));
  EXPECT_EQ(Available(), before);
  // An error whose own message does not fit the mailbox is replaced by one
  // that does.
  r = Call(Frame(v1::FAST_PATH_METHOD_ALLOC, AllocOf(8)), 100);
  EXPECT_EQ(code_, absl::StatusCode::kResourceExhausted) << r.message();
  EXPECT_THAT(r.message(), HasSubstr("bytes exceeds the 100-byte mailbox"));
  EXPECT_EQ(Available(), before);
  // With room, the same call runs.
  r = Call(Frame(v1::FAST_PATH_METHOD_ALLOC, AllocOf(64)), 64 + 96);
  EXPECT_EQ(code_, absl::StatusCode::kOk) << r.message();
  EXPECT_EQ(Available(), 0u);
}

}  // namespace
}  // namespace kvhost
