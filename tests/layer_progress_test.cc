// Tests of kvhost::LayerProgress (client/layer_progress.cc) against a
// stand-in handoff socket in this process (tests/handoff_stub.h), whose
// counters file the test writes as kvhostd's loads would: Open asks for the
// attachment's layer counters with the credentials given (a Client's owner
// token), maps them and closes the descriptor; Recorded reads each set's
// counter; WaitRecorded returns at once for set -1 and for a recorded
// layer, returns when another thread records it, and is DEADLINE_EXCEEDED
// naming the layer, base, set and counter otherwise, INVALID_ARGUMENT for a
// set out of range; a reply whose numbers do not match its descriptor is
// INTERNAL with nothing left open, and an attachment made without
// layer_progress is FAILED_PRECONDITION before anything is asked.
#include "kvhost/layer_progress.h"

#include <sys/mman.h>
#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "handoff_stub.h"
#include "kvhost/client.h"

namespace kvhost {
namespace {

using ::kvhost::testing::HandoffStub;
using ::kvhost::testing::Memfd;
using ::kvhost::testing::OpenMemfds;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr uint32_t kSets = 4;

std::string Msg(const absl::Status& s) { return std::string(s.message()); }

// The counters of an attachment as kvhostd keeps them: kSets uint64s in a
// memfd the test writes (kvhostd's loads would) and the stub hands over.
class LayerProgressTest : public ::testing::Test {
 protected:
  void SetUp() override {
    fd_ = Memfd(kName, kSets * sizeof(uint64_t));
    ASSERT_GE(fd_, 0);
    void* p = ::mmap(nullptr, kSets * sizeof(uint64_t), PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
    ASSERT_NE(p, MAP_FAILED);
    counters_ = static_cast<uint64_t*>(p);
  }
  void TearDown() override {
    if (counters_ != nullptr) ::munmap(counters_, kSets * sizeof(uint64_t));
    if (fd_ >= 0) ::close(fd_);
  }
  // A stub answering `count` counters in `bytes` bytes with the memfd.
  std::unique_ptr<HandoffStub> Stub(uint32_t count = kSets,
                                    uint64_t bytes = kSets * sizeof(uint64_t)) {
    return std::make_unique<HandoffStub>([this, count, bytes](const HandoffStub::Received&) {
      HandoffStub::Answer answer = HandoffStub::Reply(0);
      answer.reply.set_count(count);
      answer.reply.set_bytes(bytes);
      answer.fds = {fd_};
      return answer;
    });
  }
  void Record(uint32_t set, uint64_t value) {
    __atomic_store_n(&counters_[set], value, __ATOMIC_RELEASE);
  }

  static constexpr char kName[] = "layer-progress-test";
  int fd_ = -1;
  uint64_t* counters_ = nullptr;
};

TEST_F(LayerProgressTest, OpenAsksForTheCountersAndMapsThem) {
  std::unique_ptr<HandoffStub> stub = Stub();
  Record(0, 3);
  Record(3, 70);
  absl::StatusOr<std::unique_ptr<LayerProgress>> p =
      LayerProgress::Open(stub->path(), "att-9", {"s-1", "s-0"}, "tok");
  ASSERT_TRUE(p.ok()) << p.status();
  const std::vector<HandoffStub::Received> received = stub->received();
  ASSERT_EQ(received.size(), 1u);
  const v1::HandoffRequest& r = received[0].request;
  EXPECT_EQ(r.kind(), v1::HANDOFF_KIND_LAYER_COUNTERS);
  EXPECT_EQ(r.attachment_id(), "att-9");
  EXPECT_THAT(r.session_ids(), ElementsAre("s-1", "s-0"));
  EXPECT_EQ(r.owner_token(), "tok");
  EXPECT_EQ((*p)->sets(), kSets);
  EXPECT_EQ((*p)->Recorded(0), 3u);
  EXPECT_EQ((*p)->Recorded(1), 0u);
  EXPECT_EQ((*p)->Recorded(3), 70u);
  Record(1, 12);  // the same file: seen at once
  EXPECT_EQ((*p)->Recorded(1), 12u);
  // The received descriptor is closed; the mapping keeps the file.
  EXPECT_EQ(OpenMemfds(kName), 1);
}

TEST_F(LayerProgressTest, WaitRecordedComparesTheCounterWithBasePlusLayer) {
  std::unique_ptr<HandoffStub> stub = Stub();
  absl::StatusOr<std::unique_ptr<LayerProgress>> p =
      LayerProgress::Open(stub->path(), "att-9", {}, "");
  ASSERT_TRUE(p.ok()) << p.status();
  const LayerProgress& progress = **p;
  Record(1, 5);
  // Layer l of a load with base b is recorded once the counter is b + l + 1.
  EXPECT_TRUE(progress.WaitRecorded(1, 3, 1, absl::ZeroDuration()).ok());
  EXPECT_TRUE(progress.WaitRecorded(LoadTicket{7, 1, 0}, 4, absl::ZeroDuration()).ok());
  absl::Status s = progress.WaitRecorded(1, 3, 2, absl::Milliseconds(30));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_EQ(Msg(s),
            "layer 2 of the load with layer_base 3 on event set 1 not recorded within 30ms: the "
            "counter is at 5, it needs 6");
  s = progress.WaitRecorded(LoadTicket{7, 1, 0}, 5, absl::Milliseconds(1));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  // Set -1: a load of no rows, nothing to wait on.
  EXPECT_TRUE(progress.WaitRecorded(-1, 1000, 0, absl::ZeroDuration()).ok());
  for (int32_t set : {-2, static_cast<int32_t>(kSets), 1000}) {
    s = progress.WaitRecorded(set, 0, 0, absl::Seconds(1));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << set << ": " << s;
    EXPECT_EQ(Msg(s), absl::StrCat("event set ", set, " out of range [-1, 4)"));
  }
}

TEST_F(LayerProgressTest, WaitRecordedReturnsWhenTheLayerIsRecorded) {
  std::unique_ptr<HandoffStub> stub = Stub();
  absl::StatusOr<std::unique_ptr<LayerProgress>> p =
      LayerProgress::Open(stub->path(), "att-9", {}, "");
  ASSERT_TRUE(p.ok()) << p.status();
  Record(2, 10);
  std::atomic<bool> recorded{false};
  std::thread load([&] {
    absl::SleepFor(absl::Milliseconds(50));
    recorded = true;
    Record(2, 14);  // base 10: layers 0..3
  });
  const absl::Time start = absl::Now();
  const absl::Status s = (*p)->WaitRecorded(2, 10, 3, absl::Seconds(20));
  const absl::Duration took = absl::Now() - start;
  load.join();
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_TRUE(recorded.load());
  EXPECT_GE(took, absl::Milliseconds(40));
  EXPECT_LT(took, absl::Seconds(10));
}

TEST_F(LayerProgressTest, AReplyThatDoesNotMatchItsDescriptorIsInternal) {
  struct Case {
    uint32_t count;
    uint64_t bytes;
  };
  // No counters, more than kvhostd's 64, bytes not 8 per counter, a file
  // (32 bytes) smaller than the bytes said.
  for (const Case c : {Case{0, 0}, Case{65, 65 * 8}, Case{4, 33}, Case{4, 24}, Case{8, 64}}) {
    std::unique_ptr<HandoffStub> stub = Stub(c.count, c.bytes);
    absl::StatusOr<std::unique_ptr<LayerProgress>> p =
        LayerProgress::Open(stub->path(), "att-9", {}, "");
    EXPECT_EQ(p.status().code(), absl::StatusCode::kInternal) << c.count << ": " << p.status();
    EXPECT_EQ(Msg(p.status()),
              absl::StrCat("handoff socket ", stub->path(), ": ", c.count, " layer counters in ",
                           c.bytes, " bytes do not match the descriptor"));
    EXPECT_EQ(OpenMemfds(kName), 1) << c.count;  // the received descriptor is closed
  }
}

TEST_F(LayerProgressTest, TheDaemonsRefusalComesBack) {
  HandoffStub stub([](const HandoffStub::Received&) {
    return HandoffStub::Reply(static_cast<int>(absl::StatusCode::kFailedPrecondition),
                              "attachment 'att-9' was made without layer_progress");
  });
  absl::StatusOr<std::unique_ptr<LayerProgress>> p =
      LayerProgress::Open(stub.path(), "att-9", {}, "", absl::Seconds(5));
  EXPECT_EQ(p.status().code(), absl::StatusCode::kFailedPrecondition) << p.status();
  EXPECT_EQ(Msg(p.status()), "attachment 'att-9' was made without layer_progress");
}

TEST_F(LayerProgressTest, OpenWithAClientSendsItsOwnerToken) {
  std::unique_ptr<HandoffStub> stub = Stub();
  ClientOptions options;
  options.address = "unix:///nonexistent/kvhost-layer-progress-test.sock";  // never called
  options.owner_token = "client-token";
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(options);
  ASSERT_TRUE(client.ok()) << client.status();
  v1::Attachment attachment;
  attachment.set_id("att-5");
  attachment.set_pool("llama");
  // Without layer_progress (or without a socket), nothing is asked.
  absl::StatusOr<std::unique_ptr<LayerProgress>> p = LayerProgress::Open(**client, attachment);
  EXPECT_EQ(p.status().code(), absl::StatusCode::kFailedPrecondition) << p.status();
  EXPECT_EQ(Msg(p.status()),
            "attachment of pool 'llama' was not made with layer_progress (set "
            "AttachDeviceRequest.layer_progress)");
  attachment.set_layer_progress(true);
  p = LayerProgress::Open(**client, attachment);
  EXPECT_EQ(p.status().code(), absl::StatusCode::kFailedPrecondition) << p.status();
  EXPECT_TRUE(stub->received().empty());
  attachment.set_handoff_socket(stub->path());
  p = LayerProgress::Open(**client, attachment);
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_EQ(stub->received().size(), 1u);
  EXPECT_EQ(stub->received()[0].request.attachment_id(), "att-5");
  EXPECT_EQ(stub->received()[0].request.owner_token(), "client-token");
  EXPECT_EQ(stub->received()[0].request.session_ids_size(), 0);  // no session opened
  EXPECT_EQ((*p)->sets(), kSets);
}

}  // namespace
}  // namespace kvhost
