// kvhost::AsyncClient (kvhost/async_client.h) against a kvhostd of each
// test's own (host backend): calls run in submission order; futures,
// callbacks (on the executor thread, before the future) and the counters;
// the daemon's errors arrive with the code and message the synchronous call
// gives; backup / load / WaitTransfer round trips byte for byte; the
// queue's bound; Close and destruction with calls queued (each completed
// with CANCELLED, none dropped, none sent).
#include "kvhost/async_client.h"

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <future>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "api_test_util.h"
#include "daemon_fixture.h"
#include "gtest/gtest.h"
#include "kvhost/client.h"

namespace kvhost {
namespace {

using ::kvhost::testing::IsError;
using ::kvhost::testing::MakeSpec;
using ::kvhost::testing::StatusOf;
using ::kvhost::testing::TestDaemon;

constexpr absl::Duration kWait = absl::Seconds(30);
constexpr uint64_t kPoolTokens = 64;
constexpr uint32_t kPageSize = 4;

// A std::future or std::shared_future that is ready now.
template <typename Future>
bool Ready(const Future& f) {
  return f.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
}

// Holds an executor with a call until Open() or the end of its scope, so
// that a failed assertion does not leave an AsyncClient's destructor
// joining an executor that waits forever. Declare it after the AsyncClient.
class Gate {
 public:
  Gate() : state_(std::make_shared<State>()) {}
  ~Gate() { Open(); }
  Gate(const Gate&) = delete;
  Gate& operator=(const Gate&) = delete;

  // The call that holds the executor; it returns `result` once opened.
  std::function<absl::StatusOr<int>()> Call(int result = 0) const {
    return [state = state_, result]() -> absl::StatusOr<int> {
      state->held.Notify();
      state->open.WaitForNotification();
      return result;
    };
  }
  // Returns once the call holds the executor (it is no longer queued).
  void WaitHeld() const { state_->held.WaitForNotification(); }
  void Open() {
    if (!state_->open.HasBeenNotified()) state_->open.Notify();
  }

 private:
  struct State {
    absl::Notification held, open;
  };
  std::shared_ptr<State> state_;
};

class AsyncClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<TestDaemon>> d = TestDaemon::Start(KVHOSTD_PATH);
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = *std::move(d);
    absl::StatusOr<v1::Pool> pool =
        client().CreatePool("p", MakeSpec(v1::MHA, v1::PAGE_FIRST, kPageSize, kPoolTokens));
    ASSERT_TRUE(pool.ok()) << pool.status();
    pool_ = *pool;
  }

  Client& client() { return daemon_->client(); }
  uint64_t Available() {
    absl::StatusOr<v1::Pool> pool = client().GetPool("p");
    EXPECT_TRUE(pool.ok()) << pool.status();
    return pool.ok() ? pool->available_tokens() : 0;
  }

  std::unique_ptr<TestDaemon> daemon_;
  v1::Pool pool_;
};

TEST_F(AsyncClientTest, CallsRunInSubmissionOrder) {
  AsyncClient async(&client());
  // One thread's submissions run in its order.
  absl::Mutex mu;
  std::vector<int> order;
  std::vector<std::future<absl::StatusOr<int>>> futures;
  for (int i = 0; i < 1000; ++i) {
    futures.push_back(async.Submit<int>([&, i]() -> absl::StatusOr<int> {
      absl::MutexLock lock(&mu);
      order.push_back(i);
      return i;
    }));
  }
  ASSERT_TRUE(async.WaitCompleted(1000, kWait).ok());
  for (int i = 0; i < 1000; ++i) {
    ASSERT_EQ(order[i], i);
    ASSERT_TRUE(Ready(futures[i]));
  }

  // Against the daemon: the whole pool first, so the alloc behind it finds
  // nothing; a free that uses the first alloc's slots (ready when it runs,
  // since the alloc ran before it); then an alloc that gets them back.
  std::shared_future<absl::StatusOr<std::vector<int64_t>>> all =
      async.Alloc("p", kPoolTokens).share();
  auto none = async.Alloc("p", kPageSize);
  auto freed = async.Submit<uint64_t>([&]() -> absl::StatusOr<uint64_t> {
    if (!Ready(all)) return absl::InternalError("a call ran before the one submitted ahead of it");
    if (!all.get().ok()) return all.get().status();
    return client().Free("p", *all.get());
  });
  auto again = async.Alloc("p", kPoolTokens);
  ASSERT_TRUE(all.get().ok()) << all.get().status();
  EXPECT_EQ(all.get()->size(), kPoolTokens);
  EXPECT_ERROR(none.get(), kResourceExhausted, "p");
  absl::StatusOr<uint64_t> n = freed.get();
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_EQ(*n, kPoolTokens);
  absl::StatusOr<std::vector<int64_t>> back = again.get();
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->size(), kPoolTokens);
  EXPECT_EQ(Available(), 0u);
}

TEST_F(AsyncClientTest, EachThreadsCallsKeepTheirOrder) {
  AsyncClient async(&client());
  constexpr int kThreads = 4, kEach = 500;
  absl::Mutex mu;
  std::vector<std::vector<int>> seen(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kEach; ++i) {
        (void)async.Submit<int>([&, t, i]() -> absl::StatusOr<int> {
          absl::MutexLock lock(&mu);
          seen[t].push_back(i);
          return i;
        });
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(async.submitted(), uint64_t{kThreads * kEach});
  ASSERT_TRUE(async.WaitCompleted(kThreads * kEach, kWait).ok());
  absl::MutexLock lock(&mu);
  for (int t = 0; t < kThreads; ++t) {
    ASSERT_EQ(seen[t].size(), size_t{kEach});
    for (int i = 0; i < kEach; ++i) ASSERT_EQ(seen[t][i], i) << "thread " << t;
  }
}

TEST_F(AsyncClientTest, CallbacksRunOnTheExecutorBeforeTheFutureAndCount) {
  AsyncClient async(&client());
  EXPECT_EQ(async.submitted(), 0u);
  EXPECT_EQ(async.completed(), 0u);
  const std::thread::id me = std::this_thread::get_id();
  std::atomic<int> calls{0};
  std::atomic<bool> on_executor{true};
  std::atomic<uint64_t> completed_in_callback{~uint64_t{0}};
  auto future = async.Alloc("p", 8, [&](const absl::StatusOr<std::vector<int64_t>>& r) {
    if (std::this_thread::get_id() == me) on_executor = false;
    EXPECT_TRUE(r.ok()) << r.status();
    completed_in_callback = async.completed();
    ++calls;
  });
  absl::StatusOr<std::vector<int64_t>> slots = future.get();
  ASSERT_TRUE(slots.ok()) << slots.status();
  EXPECT_EQ(slots->size(), 8u);
  // The callback had run when the future became ready, and the call was
  // not counted yet while it ran.
  EXPECT_EQ(calls.load(), 1);
  EXPECT_TRUE(on_executor.load());
  EXPECT_EQ(completed_in_callback.load(), 0u);

  // Failures count as completions; a callback may submit more calls.
  std::atomic<bool> follow_up_ran{false};
  std::promise<std::future<absl::StatusOr<uint64_t>>> follow_up;
  auto failed = async.Alloc("no-such-pool", 4, [&](const auto& r) {
    EXPECT_FALSE(r.ok());
    follow_up.set_value(async.Free("p", *slots, [&](const auto&) { follow_up_ran = true; }));
  });
  EXPECT_ERROR(failed.get(), kNotFound, "no-such-pool");
  absl::StatusOr<uint64_t> freed = follow_up.get_future().get().get();
  ASSERT_TRUE(freed.ok()) << freed.status();
  EXPECT_EQ(*freed, 8u);
  EXPECT_TRUE(follow_up_ran.load());
  EXPECT_EQ(async.submitted(), 3u);
  ASSERT_TRUE(async.WaitCompleted(3, kWait).ok());
  EXPECT_EQ(async.completed(), 3u);
  EXPECT_EQ(Available(), kPoolTokens);

  // A count not reached: DEADLINE_EXCEEDED saying how far it got.
  EXPECT_ERROR(async.WaitCompleted(4, absl::Milliseconds(20)), kDeadlineExceeded, "3 of 4");
}

TEST_F(AsyncClientTest, TheDaemonsErrorsArriveAsTheSyncCallGivesThem) {
  AsyncClient async(&client());
  auto same = [](const absl::Status& async_status, const absl::Status& sync_status) {
    EXPECT_FALSE(sync_status.ok());
    EXPECT_EQ(async_status.code(), sync_status.code()) << async_status << " / " << sync_status;
    EXPECT_EQ(async_status.message(), sync_status.message());
  };
  // Unknown pool: NOT_FOUND naming it.
  absl::Status unknown = StatusOf(async.Alloc("nope", 4).get());
  EXPECT_TRUE(IsError(unknown, absl::StatusCode::kNotFound, {"nope"}));
  same(unknown, StatusOf(client().Alloc("nope", 4)));
  // Not whole pages: INVALID_ARGUMENT.
  absl::Status partial = StatusOf(async.Alloc("p", 3).get());
  EXPECT_EQ(partial.code(), absl::StatusCode::kInvalidArgument) << partial;
  same(partial, StatusOf(client().Alloc("p", 3)));
  // Freeing a slot not allocated.
  const std::vector<int64_t> stray = {0, 1, 2, 3};
  absl::Status not_allocated = StatusOf(async.Free("p", stray).get());
  same(not_allocated, StatusOf(client().Free("p", stray)));
  // A ticket that does not exist.
  absl::Status no_ticket = StatusOf(async.WaitTransfer(987654, absl::Seconds(1)).get());
  same(no_ticket, StatusOf(client().WaitTransfer(987654, absl::Seconds(1))));
  // A backup on an attachment that does not exist.
  v1::BackupRequest backup;
  backup.set_attachment_id("no-such-attachment");
  backup.add_host_indices(0);
  backup.add_device_indices(0);
  same(StatusOf(async.SubmitBackup(backup).get()), StatusOf(client().SubmitBackup(backup)));
  // An exception from a call is its INTERNAL status.
  absl::StatusOr<int> thrown =
      async.Submit<int>([]() -> absl::StatusOr<int> { throw std::runtime_error("boom"); }).get();
  EXPECT_TRUE(IsError(StatusOf(thrown), absl::StatusCode::kInternal, {"boom"}));
  // An empty call is refused, not counted.
  const uint64_t before = async.submitted();
  EXPECT_ERROR(async.Submit<int>(nullptr).get(), kInvalidArgument, "empty call");
  EXPECT_EQ(async.submitted(), before);
}

TEST_F(AsyncClientTest, BackupLoadAndWaitTransferMoveTheBytes) {
  absl::StatusOr<std::unique_ptr<ShmDevicePool>> dev =
      ShmDevicePool::Create(pool_, 16, daemon_->shm_dir());
  ASSERT_TRUE(dev.ok()) << dev.status();
  absl::StatusOr<v1::Attachment> att = client().AttachDevice((*dev)->MakeAttachRequest("p"));
  ASSERT_TRUE(att.ok()) << att.status();
  ShmDevicePool& d = **dev;
  for (uint32_t c = 0; c < d.components(); ++c) {
    for (uint32_t l = 0; l < d.layers(); ++l) {
      for (uint64_t r = 0; r < 8; ++r) {
        std::memset(d.row(c, l, r), static_cast<int>(1 + c * 50 + l * 10 + r), d.row_bytes(c));
      }
    }
  }
  AsyncClient async(&client());
  absl::StatusOr<std::vector<int64_t>> slots = async.Alloc("p", 8).get();
  ASSERT_TRUE(slots.ok()) << slots.status();
  v1::BackupRequest backup;
  backup.set_attachment_id(att->id());
  for (int64_t i = 0; i < 8; ++i) {
    backup.add_host_indices((*slots)[i]);
    backup.add_device_indices(i);
  }
  auto ticket = async.SubmitBackup(backup);
  auto waited = async.Submit<v1::TransferStatus>([&]() -> absl::StatusOr<v1::TransferStatus> {
    if (!Ready(ticket)) return absl::InternalError("a call ran before the backup ahead of it");
    absl::StatusOr<v1::TransferTicket> t = ticket.get();
    if (!t.ok()) return t.status();
    return client().WaitTransfer(t->id(), kWait);
  });
  absl::StatusOr<v1::TransferStatus> backed_up = waited.get();
  ASSERT_TRUE(backed_up.ok()) << backed_up.status();

  v1::LoadRequest load;
  load.set_attachment_id(att->id());
  for (int64_t i = 0; i < 8; ++i) {
    load.add_host_indices((*slots)[i]);
    load.add_device_indices(8 + i);
  }
  absl::StatusOr<v1::TransferTicket> load_ticket = async.SubmitLoad(load).get();
  ASSERT_TRUE(load_ticket.ok()) << load_ticket.status();
  absl::StatusOr<v1::TransferStatus> loaded = async.WaitTransfer(load_ticket->id(), kWait).get();
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_TRUE(loaded->done());
  for (uint32_t c = 0; c < d.components(); ++c) {
    for (uint32_t l = 0; l < d.layers(); ++l) {
      for (uint64_t r = 0; r < 8; ++r) {
        ASSERT_EQ(std::memcmp(d.row(c, l, r), d.row(c, l, 8 + r), d.row_bytes(c)), 0)
            << "component " << c << " layer " << l << " row " << r;
      }
    }
  }
  EXPECT_TRUE(client().DetachDevice(att->id()).ok());
}

TEST_F(AsyncClientTest, AFullQueueRefusesTheNextCallNamingItsBound) {
  std::atomic<uint64_t> ran{0};
  std::atomic<bool> called{false};
  AsyncClient async(&client());
  EXPECT_EQ(async.options().max_queued, kMaxQueuedCalls);
  Gate gate;
  auto blocker = async.Submit<int>(gate.Call());
  gate.WaitHeld();  // running: no longer in the queue
  for (size_t i = 0; i < kMaxQueuedCalls; ++i) {
    auto f = async.Submit<int>([&]() -> absl::StatusOr<int> {
      ++ran;
      return 0;
    });
    ASSERT_FALSE(Ready(f)) << "call " << i << " refused";
  }
  auto refused = async.Submit<int>([]() -> absl::StatusOr<int> { return 0; },
                                   [&](const absl::StatusOr<int>&) { called = true; });
  ASSERT_TRUE(Ready(refused));
  EXPECT_ERROR(refused.get(), kResourceExhausted, "65536");
  EXPECT_EQ(async.submitted(), kMaxQueuedCalls + 1);
  gate.Open();
  ASSERT_TRUE(async.WaitCompleted(kMaxQueuedCalls + 1, kWait).ok());
  EXPECT_EQ(ran.load(), kMaxQueuedCalls);
  EXPECT_FALSE(called.load()) << "a refused call's callback ran";
  EXPECT_EQ(async.completed(), kMaxQueuedCalls + 1);

  // A smaller bound, as the options give it.
  AsyncClient small(&client(), AsyncClientOptions{2});
  Gate gate2;
  auto b2 = small.Submit<int>(gate2.Call());
  gate2.WaitHeld();
  auto q1 = small.Alloc("p", 4);
  auto q2 = small.Alloc("p", 4);
  EXPECT_ERROR(small.Alloc("p", 4).get(), kResourceExhausted, "bound (2)");
  gate2.Open();
  EXPECT_TRUE(q1.get().ok());
  EXPECT_TRUE(q2.get().ok());
}

TEST_F(AsyncClientTest, CloseCancelsTheQueuedCallsAndSendsNone) {
  const std::thread::id me = std::this_thread::get_id();
  constexpr int kQueued = 100;
  std::atomic<int> callbacks{0}, cancelled_callbacks{0}, off_executor{0};
  AsyncClient async(&client());
  Gate gate;
  auto blocker = async.Submit<int>(gate.Call(7));
  gate.WaitHeld();
  std::vector<std::future<absl::StatusOr<std::vector<int64_t>>>> queued;
  for (int i = 0; i < kQueued; ++i) {
    queued.push_back(async.Alloc("p", kPageSize, [&](const auto& r) {
      ++callbacks;
      if (r.status().code() == absl::StatusCode::kCancelled) ++cancelled_callbacks;
      if (std::this_thread::get_id() == me) ++off_executor;
    }));
  }
  // Close on another thread; it has begun once a submit is refused.
  std::thread closer([&] { async.Close(); });
  std::vector<std::future<absl::StatusOr<int>>> probes;
  while (true) {
    auto probe = async.Submit<int>([]() -> absl::StatusOr<int> { return 1; });
    if (Ready(probe)) {
      EXPECT_ERROR(probe.get(), kCancelled, "closed");
      break;
    }
    probes.push_back(std::move(probe));
    absl::SleepFor(absl::Milliseconds(1));
  }
  gate.Open();  // the running call finishes; the rest are cancelled
  closer.join();
  absl::StatusOr<int> first = blocker.get();
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(*first, 7);
  for (auto& f : queued) {
    ASSERT_TRUE(Ready(f));
    EXPECT_ERROR(f.get(), kCancelled, "closed before the call ran");
  }
  for (auto& f : probes) EXPECT_ERROR(f.get(), kCancelled, "closed before the call ran");
  EXPECT_EQ(callbacks.load(), kQueued);
  EXPECT_EQ(cancelled_callbacks.load(), kQueued);
  EXPECT_EQ(off_executor.load(), 0);
  EXPECT_EQ(async.completed(), async.submitted());
  EXPECT_EQ(async.submitted(), uint64_t{1 + kQueued} + probes.size());
  EXPECT_EQ(Available(), kPoolTokens) << "a cancelled alloc reached the daemon";
}

TEST_F(AsyncClientTest, DestructionCompletesEveryQueuedCallOnce) {
  // The destructor is Close(): calls still queued complete with CANCELLED,
  // and none is dropped. Which ones were still queued depends on when the
  // destructor began, so this checks the invariants: each call completes
  // once, on the executor, with OK or CANCELLED, the OKs a prefix.
  constexpr int kQueued = 1000;
  std::vector<std::atomic<int>> results(kQueued);  // 0 none, 1 OK, 2 CANCELLED, 3 other
  std::vector<std::future<absl::StatusOr<int>>> futures;
  std::atomic<int> off_executor{0};
  const std::thread::id me = std::this_thread::get_id();
  auto async = std::make_unique<AsyncClient>(&client());
  Gate gate;
  auto blocker = async->Submit<int>(gate.Call());
  gate.WaitHeld();
  for (int i = 0; i < kQueued; ++i) {
    futures.push_back(async->Submit<int>(
        [i]() -> absl::StatusOr<int> {
          absl::SleepFor(absl::Milliseconds(1));  // so that draining takes a second
          return i;
        },
        [&, i](const absl::StatusOr<int>& r) {
          const int code = r.ok() ? 1 : r.status().code() == absl::StatusCode::kCancelled ? 2 : 3;
          if (results[i].exchange(code) != 0) results[i] = 4;  // twice
          if (std::this_thread::get_id() == me) ++off_executor;
        }));
  }
  std::thread destroyer([&] { async.reset(); });
  absl::SleepFor(absl::Milliseconds(50));  // the destructor has begun by then
  gate.Open();
  destroyer.join();
  EXPECT_TRUE(blocker.get().ok());
  int ok = 0, cancelled = 0;
  for (int i = 0; i < kQueued; ++i) {
    ASSERT_TRUE(Ready(futures[i])) << "call " << i << " dropped";
    const int code = results[i].load();
    ASSERT_TRUE(code == 1 || code == 2) << "call " << i << ": " << code;
    absl::StatusOr<int> r = futures[i].get();
    EXPECT_EQ(r.ok(), code == 1);
    if (code == 1) {
      ASSERT_EQ(cancelled, 0) << "call " << i << " ran after one was cancelled";
      ++ok;
    } else {
      EXPECT_ERROR(r, kCancelled, "closed before the call ran");
      ++cancelled;
    }
  }
  EXPECT_GT(cancelled, 0) << ok << " calls ran: the destructor drained the queue";
  EXPECT_EQ(off_executor.load(), 0);
}

TEST_F(AsyncClientTest, CloseWithNothingQueuedAndSubmitsAfterIt) {
  AsyncClient async(&client());
  auto slots = async.Alloc("p", 4);
  ASSERT_TRUE(async.WaitCompleted(1, kWait).ok());
  async.Close();
  async.Close();  // idempotent
  EXPECT_TRUE(slots.get().ok());
  auto late = async.Alloc("p", 4);
  ASSERT_TRUE(Ready(late));
  EXPECT_ERROR(late.get(), kCancelled, "closed");
  EXPECT_EQ(async.submitted(), 1u);
  EXPECT_EQ(async.completed(), 1u);
  EXPECT_EQ(Available(), kPoolTokens - 4);
}

}  // namespace
}  // namespace kvhost
