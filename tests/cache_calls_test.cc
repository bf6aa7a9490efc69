// Client's CacheService calls (client/cache_calls.cc) against a real kvhostd
// (host backend), as engines make them: two instances sharing a prefix and
// pinning it; eviction under pressure sparing pinned pages, refusing a store
// that cannot fit without changing anything; a worker killed with SIGKILL in
// the middle of its stores, after which every published page is whole and no
// page is leaked; a pinning lookup without a worker session refused; stores
// from and restores into index-addressed pools' slots (copied inside
// kvhostd), over the fast path and gRPC, byte-exact across layouts, and
// their refusals.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "api_test_util.h"
#include "cache_instance.h"
#include "daemon_fixture.h"
#include "kvhost/client.h"

namespace kvhost {
namespace {

using ::kvhost::testing::CacheSpec;
using ::kvhost::testing::Instance;
using ::kvhost::testing::kCache;
using ::kvhost::testing::kDeviceTokens;
using ::kvhost::testing::Keys;
using ::kvhost::testing::kPageSize;
using ::kvhost::testing::kToken;
using ::kvhost::testing::PageRows;
using ::kvhost::testing::TestDaemon;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

// The killed worker: a child process started with KVHOST_CACHE_CHILD=
// <address>,<shm dir>,<key prefix>. It fills its 16 device pages once (page p
// with seed p) and stores batches of 8 keys "<prefix><batch>-<p>" from pages
// 0-7 and 8-15 in turn, never waiting for a ticket, until it is killed; it
// prints "storing" once its first store published. Runs before main, so no
// test runs in it.
[[maybe_unused]] const bool kChild = [] {
  const char* env = std::getenv("KVHOST_CACHE_CHILD");
  if (env == nullptr) return false;
  const std::vector<std::string> args = absl::StrSplit(env, ',');
  if (args.size() != 3) std::_Exit(2);
  absl::StatusOr<std::unique_ptr<Instance>> i = Instance::Start(args[0], args[1]);
  if (!i.ok()) {
    std::fprintf(stderr, "child: %s\n", i.status().ToString().c_str());
    std::_Exit(3);
  }
  for (uint64_t p = 0; p < 16; ++p) (*i)->FillPage(p, static_cast<uint8_t>(p));
  for (int batch = 0;; ++batch) {
    const uint64_t first = (batch % 2) * 8;
    std::vector<std::string> keys;
    for (uint64_t p = first; p < first + 8; ++p)
      keys.push_back(absl::StrCat(args[2], batch, "-", p));
    absl::StatusOr<v1::CacheStoreReply> stored =
        (*i)->client->CacheStore(kCache, (*i)->attachment, keys, PageRows(first, 8));
    if (batch == 0) {
      if (!stored.ok() || !stored->has_ticket() ||
          !(*i)->client->WaitTransfer(stored->ticket().id()).ok()) {
        std::_Exit(4);
      }
      std::fputs("storing\n", stdout);
      std::fflush(stdout);
    }
  }
}();

class CacheCallsTest : public ::testing::Test {
 protected:
  void Start(uint64_t cache_pages, bool large_pages = false) {
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
    absl::StatusOr<v1::Pool> pool = admin_->CreatePool(kCache, CacheSpec(cache_pages, large_pages));
    ASSERT_TRUE(pool.ok()) << pool.status();
    a_ = StartInstance();
    b_ = StartInstance();
  }
  std::unique_ptr<Instance> StartInstance() {
    absl::StatusOr<std::unique_ptr<Instance>> i = Instance::Start(d_->address(), d_->shm_dir());
    EXPECT_TRUE(i.ok()) << i.status() << d_->Log();
    return i.ok() ? *std::move(i) : nullptr;
  }
  v1::CacheStats Stats() const {
    absl::StatusOr<v1::CacheStats> stats = admin_->GetCacheStats(kCache);
    EXPECT_TRUE(stats.ok()) << stats.status();
    return stats.ok() ? *stats : v1::CacheStats();
  }

  std::unique_ptr<TestDaemon> d_;
  std::unique_ptr<Client> admin_;
  std::unique_ptr<Instance> a_, b_;
};

TEST_F(CacheCallsTest, InstancesShareAPrefixPinItAndSeeItsEvents) {
  ASSERT_NO_FATAL_FAILURE(Start(64));
  for (uint64_t p = 0; p < 3; ++p) a_->FillPage(p, static_cast<uint8_t>(40 + p));
  absl::StatusOr<v1::CacheStoreReply> stored = a_->Store(Keys("h", 0, 3), 0);
  ASSERT_TRUE(stored.ok()) << stored.status();
  // Stored again by b: every key skipped, no ticket.
  absl::StatusOr<v1::CacheStoreReply> again =
      b_->client->CacheStore(kCache, b_->attachment, Keys("h", 0, 3), PageRows(0, 3));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_FALSE(again->has_ticket());
  EXPECT_THAT(again->states(),
              ElementsAre(v1::CACHE_KEY_PRESENT, v1::CACHE_KEY_PRESENT, v1::CACHE_KEY_PRESENT));

  absl::StatusOr<v1::CacheLookupReply> found =
      b_->client->CacheLookup(kCache, Keys("h", 0, 4), /*pin=*/true);
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_EQ(found->prefix(), 3u);
  EXPECT_NE(found->pin_id(), 0u);
  EXPECT_EQ(Stats().pinned(), 3u);
  absl::StatusOr<v1::CacheEvictReply> evicted = admin_->CacheEvict(kCache, {"h0", "nope"});
  ASSERT_TRUE(evicted.ok()) << evicted.status();
  EXPECT_THAT(evicted->outcomes(),
              ElementsAre(v1::CacheEvictReply::BUSY, v1::CacheEvictReply::ABSENT));
  ASSERT_TRUE(b_->Restore(Keys("h", 0, 3), 8).ok());
  for (uint64_t p = 0; p < 3; ++p) EXPECT_TRUE(b_->PageIs(8 + p, static_cast<uint8_t>(40 + p)));

  // Another session cannot release b's pin; b can, once.
  absl::Status other = a_->client->CacheReleasePin(kCache, found->pin_id());
  EXPECT_EQ(other.code(), absl::StatusCode::kNotFound) << other;
  ASSERT_TRUE(b_->client->CacheReleasePin(kCache, found->pin_id()).ok());
  EXPECT_EQ(b_->client->CacheReleasePin(kCache, found->pin_id()).code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(Stats().pinned(), 0u);
  evicted = admin_->CacheEvict(kCache, {"h0"});
  ASSERT_TRUE(evicted.ok()) << evicted.status();
  EXPECT_THAT(evicted->outcomes(), ElementsAre(v1::CacheEvictReply::EVICTED));

  // The events a router reads: three stored, one evicted, in order; read
  // again from the middle.
  absl::StatusOr<v1::CacheEventBatch> events = admin_->ReadCacheEvents(kCache);
  ASSERT_TRUE(events.ok()) << events.status();
  ASSERT_EQ(events->events_size(), 4);
  EXPECT_EQ(events->events(0).key(), "h0");
  EXPECT_EQ(events->events(0).kind(), v1::CacheEvent::STORED);
  EXPECT_EQ(events->events(3).key(), "h0");
  EXPECT_EQ(events->events(3).kind(), v1::CacheEvent::EVICTED);
  EXPECT_FALSE(events->gap());
  absl::StatusOr<v1::CacheEventBatch> rest =
      admin_->ReadCacheEvents(kCache, events->events(1).seq(), 1);
  ASSERT_TRUE(rest.ok()) << rest.status();
  ASSERT_EQ(rest->events_size(), 1);
  EXPECT_EQ(rest->events(0).key(), "h2");
  EXPECT_EQ(rest->next_after(), events->events(2).seq());
}

TEST_F(CacheCallsTest, EvictionUnderPressureSparesPinnedPagesAndAStoreThatCannotFitChangesNothing) {
  ASSERT_NO_FATAL_FAILURE(Start(16));
  for (uint64_t p = 0; p < 16; ++p) a_->FillPage(p, static_cast<uint8_t>(p));
  ASSERT_TRUE(a_->Store(Keys("a", 0, 8), 0).ok());
  // b pins a0-a3 for a restore it has not made yet.
  absl::StatusOr<v1::CacheLookupReply> pinned =
      b_->client->CacheLookup(kCache, Keys("a", 0, 4), /*pin=*/true);
  ASSERT_TRUE(pinned.ok()) << pinned.status();
  ASSERT_EQ(pinned->prefix(), 4u);

  // 10 new keys: 8 free pages and the two least recently used unpinned keys.
  absl::StatusOr<v1::CacheStoreReply> more = a_->Store(Keys("n", 0, 10), 0);
  ASSERT_TRUE(more.ok()) << more.status();
  EXPECT_EQ(more->evicted(), 2u);
  absl::StatusOr<v1::CacheLookupReply> left = admin_->CacheLookup(kCache, Keys("a", 0, 8));
  ASSERT_TRUE(left.ok()) << left.status();
  EXPECT_THAT(left->states(),
              ElementsAre(v1::CACHE_KEY_PRESENT, v1::CACHE_KEY_PRESENT, v1::CACHE_KEY_PRESENT,
                          v1::CACHE_KEY_PRESENT, v1::CACHE_KEY_ABSENT, v1::CACHE_KEY_ABSENT,
                          v1::CACHE_KEY_PRESENT, v1::CACHE_KEY_PRESENT));

  // 13 more: only 12 pages are evictable (4 are pinned): refused, and the
  // cache is as it was.
  const v1::CacheStats before = Stats();
  absl::StatusOr<v1::CacheStoreReply> too_many =
      a_->client->CacheStore(kCache, a_->attachment, Keys("x", 0, 13), PageRows(0, 13));
  EXPECT_EQ(too_many.status().code(), absl::StatusCode::kResourceExhausted) << too_many.status();
  EXPECT_THAT(too_many.status().message(), HasSubstr("cache 'cache'"));
  const v1::CacheStats after = Stats();
  EXPECT_EQ(after.published(), before.published());
  EXPECT_EQ(after.evicted(), before.evicted());
  EXPECT_EQ(after.free_pages(), before.free_pages());
  EXPECT_EQ(after.writing(), 0u);

  // Refused by the copy path after the index chose its victims (rows past
  // the device pool; a ready fence the host backend cannot wait on): the
  // victims stay, nothing is logged or counted.
  uint64_t last = 0;  // the newest event's sequence number
  for (absl::StatusOr<v1::CacheEventBatch> e = admin_->ReadCacheEvents(kCache, last);
       e.ok() && !e->events().empty(); e = admin_->ReadCacheEvents(kCache, last)) {
    last = e->next_after();
  }
  std::vector<int64_t> past = PageRows(0, 2);
  past.back() = static_cast<int64_t>(kDeviceTokens);
  absl::StatusOr<v1::CacheStoreReply> bad_rows =
      a_->client->CacheStore(kCache, a_->attachment, Keys("y", 0, 2), past);
  EXPECT_EQ(bad_rows.status().code(), absl::StatusCode::kInvalidArgument) << bad_rows.status();
  absl::StatusOr<v1::CacheStoreReply> bad_fence = a_->client->CacheStore(
      kCache, a_->attachment, Keys("y", 0, 2), PageRows(0, 2), "not-an-event");
  EXPECT_EQ(bad_fence.status().code(), absl::StatusCode::kFailedPrecondition) << bad_fence.status();
  const v1::CacheStats unchanged = Stats();
  EXPECT_EQ(unchanged.published(), before.published());
  EXPECT_EQ(unchanged.evicted(), before.evicted());
  EXPECT_EQ(unchanged.aborted(), before.aborted());
  EXPECT_EQ(unchanged.free_pages(), 0u);
  absl::StatusOr<v1::CacheEventBatch> none = admin_->ReadCacheEvents(kCache, last);
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->events().empty()) << "a refused store logged events";

  // The pinned pages are whole; once b's session ends its pin goes and the
  // same store fits.
  ASSERT_TRUE(b_->Restore(Keys("a", 0, 4), 4).ok());
  for (uint64_t p = 0; p < 4; ++p) EXPECT_TRUE(b_->PageIs(4 + p, static_cast<uint8_t>(p)));
  b_.reset();
  v1::CacheStats stats = Stats();
  for (int i = 0; i < 100 && stats.pinned() > 0; ++i) {
    absl::SleepFor(absl::Milliseconds(50));
    stats = Stats();
  }
  EXPECT_EQ(stats.pinned(), 0u);
  absl::StatusOr<v1::CacheStoreReply> fits = a_->Store(Keys("x", 0, 13), 0);
  ASSERT_TRUE(fits.ok()) << fits.status();
  EXPECT_EQ(fits->evicted(), 13u);
  EXPECT_EQ(Stats().free_pages(), 0u);
}

TEST_F(CacheCallsTest, AWorkerKilledMidStoreLeavesOnlyWholePagesAndLeaksNothing) {
  ASSERT_NO_FATAL_FAILURE(Start(64, /*large_pages=*/true));
  // The parent's reference: device page p filled as the child fills its own.
  for (uint64_t p = 0; p < 16; ++p) a_->FillPage(p, static_cast<uint8_t>(p));
  for (int round = 0; round < 3; ++round) {
    int out[2];
    ASSERT_EQ(::pipe(out), 0);
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      ::dup2(out[1], 1);
      const std::string env = absl::StrCat(d_->address(), ",", d_->shm_dir(), ",r", round, "-");
      ::setenv("KVHOST_CACHE_CHILD", env.c_str(), 1);
      ::execl("/proc/self/exe", "cache_store_child", static_cast<char*>(nullptr));
      std::_Exit(5);
    }
    ::close(out[1]);
    char line[16] = {};
    const ssize_t n = ::read(out[0], line, sizeof(line) - 1);
    ::close(out[0]);
    ASSERT_GT(n, 0) << "the child never stored (exit status below)" << d_->Log();
    absl::SleepFor(absl::Milliseconds(10 + 40 * round));
    ::kill(child, SIGKILL);
    int status = 0;
    ::waitpid(child, &status, 0);
    ASSERT_TRUE(WIFSIGNALED(status)) << "child exited with " << WEXITSTATUS(status);
  }
  // Its sessions end with its connections: nothing stays being written.
  v1::CacheStats stats = Stats();
  for (int i = 0; i < 200 && stats.writing() > 0; ++i) {
    absl::SleepFor(absl::Milliseconds(50));
    stats = Stats();
  }
  ASSERT_EQ(stats.writing(), 0u) << d_->Log();
  EXPECT_EQ(stats.pinned(), 0u);
  // Nothing leaked: every page is free or holds a published key.
  EXPECT_EQ(stats.free_pages() + stats.published(), stats.page_num());
  EXPECT_GT(stats.stored(), 0u);
  std::printf("killed mid-store: %llu keys published, %llu aborted by the kills\n",
              static_cast<unsigned long long>(stats.stored()),
              static_cast<unsigned long long>(stats.aborted()));
  // The kills caught stores in flight (the child never waits for a ticket,
  // and each 16 MiB store takes a while): their keys were dropped.
  EXPECT_GT(stats.aborted(), 0u);

  // The published keys, from the event log (read in batches, as a router
  // does): each is whole.
  std::set<std::string> present;
  uint64_t after = 0;
  for (;;) {
    absl::StatusOr<v1::CacheEventBatch> events = admin_->ReadCacheEvents(kCache, after);
    ASSERT_TRUE(events.ok()) << events.status();
    ASSERT_FALSE(events->gap());
    if (events->events().empty()) break;
    for (const v1::CacheEvent& e : events->events()) {
      if (e.kind() == v1::CacheEvent::STORED) {
        present.insert(e.key());
      } else {
        present.erase(e.key());
      }
    }
    after = events->next_after();
  }
  ASSERT_EQ(present.size(), stats.published());
  for (const std::string& key : present) {
    // "<prefix><batch>-<p>": the page came from device page p.
    const uint64_t p = std::stoull(key.substr(key.rfind('-') + 1));
    const absl::Status restored = a_->Restore({key}, 15);
    ASSERT_TRUE(restored.ok()) << key << ": " << restored;
    EXPECT_TRUE(a_->PageIs(15, static_cast<uint8_t>(p))) << "key " << key << " is torn";
  }
  a_->FillPage(15, 15);
}

TEST_F(CacheCallsTest, APinningLookupNeedsAWorkerSession) {
  ASSERT_NO_FATAL_FAILURE(Start(16));
  absl::StatusOr<v1::CacheLookupReply> found = admin_->CacheLookup(kCache, {"k"}, /*pin=*/true);
  EXPECT_EQ(found.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(found.status().message(),
              HasSubstr("a pinning CacheLookup of cache 'cache' needs a worker session"));
  // Without pin, no session is needed.
  found = admin_->CacheLookup(kCache, {"k"});
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_THAT(found->states(), ElementsAre(v1::CACHE_KEY_ABSENT));
}

// A CUDA IPC event handle is 64 raw bytes, rarely valid UTF-8: the Store
// and Restore requests carry their fences as bytes, so such a handle
// reaches kvhostd's own checks over either path (found on an H100: as a
// string field, the fast path refused the body as unparsable and gRPC's
// server could not parse it). The host backend then refuses the fence by
// name, and the refused calls change nothing.
TEST_F(CacheCallsTest, RawEventHandleBytesReachTheDaemonOverBothPaths) {
  ASSERT_NO_FATAL_FAILURE(Start(16));
  std::string handle(64, '\0');
  for (size_t i = 0; i < handle.size(); ++i) handle[i] = static_cast<char>(0x80 + i);
  constexpr char kRefused[] = "the host backend has no CUDA events to wait on";
  ASSERT_TRUE(a_->Store(Keys("r", 0, 1), 0).ok());
  for (bool fast_path : {true, false}) {
    SCOPED_TRACE(fast_path ? "fast path" : "gRPC");
    absl::StatusOr<std::unique_ptr<Instance>> i =
        Instance::Start(d_->address(), d_->shm_dir(), fast_path);
    ASSERT_TRUE(i.ok()) << i.status();
    absl::StatusOr<v1::CacheStoreReply> stored = (*i)->client->CacheStore(
        kCache, (*i)->attachment, Keys(fast_path ? "f" : "g", 0, 1), PageRows(0, 1), handle);
    EXPECT_EQ(stored.status().code(), absl::StatusCode::kFailedPrecondition) << stored.status();
    EXPECT_THAT(stored.status().message(), HasSubstr(kRefused));
    absl::StatusOr<v1::TransferTicket> restored = (*i)->client->CacheRestore(
        kCache, (*i)->attachment, Keys("r", 0, 1), PageRows(1, 1), handle);
    EXPECT_EQ(restored.status().code(), absl::StatusCode::kFailedPrecondition) << restored.status();
    EXPECT_THAT(restored.status().message(), HasSubstr(kRefused));
    EXPECT_EQ((*i)->client->fast_path_calls() > 0, fast_path);
  }
  const v1::CacheStats stats = Stats();
  EXPECT_EQ(stats.published(), 1u);
  EXPECT_EQ(stats.writing(), 0u);
  EXPECT_EQ(stats.pinned(), 0u);
}

// A pool of the cache's shape in `layout` (not a node cache), 8 pages.
v1::PoolSpec PoolLike(v1::Layout layout, uint32_t layers = 4) {
  v1::PoolSpec spec = CacheSpec(8);
  spec.set_node_cache(false);
  spec.set_layout(layout);
  spec.set_layer_num(layers);
  return spec;
}

TEST_F(CacheCallsTest, PagesMoveThroughPoolsOfEitherLayoutByteExactOverBothPaths) {
  ASSERT_NO_FATAL_FAILURE(Start(32));
  ASSERT_TRUE(admin_->CreatePool("pf", PoolLike(v1::PAGE_FIRST)).ok());
  ASSERT_TRUE(admin_->CreatePool("lf", PoolLike(v1::LAYER_FIRST)).ok());
  absl::StatusOr<std::vector<int64_t>> pf = admin_->Alloc("pf", 2 * kPageSize);
  absl::StatusOr<std::vector<int64_t>> lf = admin_->Alloc("lf", 2 * kPageSize);
  ASSERT_TRUE(pf.ok() && lf.ok());
  for (uint64_t p = 0; p < 2; ++p) a_->FillPage(p, static_cast<uint8_t>(60 + p));
  ASSERT_TRUE(a_->Store(Keys("d", 0, 2), 0).ok());
  // a over the fast path, g over gRPC: device -> cache -> PAGE_FIRST pool ->
  // cache -> LAYER_FIRST pool -> cache -> device, every hop checked at the end.
  std::unique_ptr<Instance> g;
  {
    absl::StatusOr<std::unique_ptr<Instance>> i =
        Instance::Start(d_->address(), d_->shm_dir(), /*fast_path=*/false);
    ASSERT_TRUE(i.ok()) << i.status();
    g = *std::move(i);
  }
  for (Client* c : {a_->client.get(), g->client.get()}) {
    const std::string tag = c == a_->client.get() ? "fast" : "grpc";
    absl::StatusOr<v1::TransferTicket> t =
        c->CacheRestoreToPool(kCache, "pf", Keys("d", 0, 2), *pf);
    ASSERT_TRUE(t.ok()) << tag << ": " << t.status();
    absl::StatusOr<v1::TransferStatus> done = c->WaitTransfer(t->id());
    ASSERT_TRUE(done.ok()) << done.status();
    EXPECT_EQ(done->bytes(), 2 * kPageSize * 4 * 2 * 2 * 32 * 2)
        << tag;  // layers, K/V, heads, bf16
    absl::StatusOr<v1::CacheStoreReply> s =
        c->CacheStoreFromPool(kCache, "pf", Keys(tag + "p", 0, 2), *pf);
    ASSERT_TRUE(s.ok()) << tag << ": " << s.status();
    ASSERT_TRUE(s->has_ticket());
    ASSERT_TRUE(c->WaitTransfer(s->ticket().id()).ok());
    t = c->CacheRestoreToPool(kCache, "lf", Keys(tag + "p", 0, 2), *lf);
    ASSERT_TRUE(t.ok()) << t.status();
    ASSERT_TRUE(c->WaitTransfer(t->id()).ok());
    s = c->CacheStoreFromPool(kCache, "lf", Keys(tag + "l", 0, 2), *lf);
    ASSERT_TRUE(s.ok()) << s.status();
    ASSERT_TRUE(c->WaitTransfer(s->ticket().id()).ok());
    ASSERT_TRUE(a_->Restore(Keys(tag + "l", 0, 2), 4).ok());
    EXPECT_TRUE(a_->PageIs(4, 60)) << tag;
    EXPECT_TRUE(a_->PageIs(5, 61)) << tag;
    a_->FillPage(4, 0);
    a_->FillPage(5, 0);
  }
}

TEST_F(CacheCallsTest, PoolCallsAreRefusedNamingTheValueAndChangeNothing) {
  ASSERT_NO_FATAL_FAILURE(Start(16));
  ASSERT_TRUE(admin_->CreatePool("pf", PoolLike(v1::PAGE_FIRST)).ok());
  ASSERT_TRUE(admin_->CreatePool("thin", PoolLike(v1::PAGE_FIRST, /*layers=*/2)).ok());
  absl::StatusOr<std::vector<int64_t>> pf = admin_->Alloc("pf", kPageSize);
  absl::StatusOr<std::vector<int64_t>> thin = admin_->Alloc("thin", kPageSize);
  ASSERT_TRUE(pf.ok() && thin.ok());
  {
    ClientOptions options;
    options.address = d_->address();
    options.owner_token = "someone-else";
    options.worker_session = false;
    absl::StatusOr<std::unique_ptr<Client>> other = Client::Connect(options);
    ASSERT_TRUE(other.ok());
    ASSERT_TRUE((*other)->CreatePool("foreign", PoolLike(v1::PAGE_FIRST)).ok());
  }
  const v1::CacheStats before = Stats();
  Client& c = *a_->client;
  // A foreign pool without its token.
  absl::StatusOr<v1::CacheStoreReply> s = c.CacheStoreFromPool(kCache, "foreign", {"k"}, *pf);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kPermissionDenied) << s.status();
  EXPECT_THAT(s.status().message(), HasSubstr("foreign"));
  // Another shape.
  s = c.CacheStoreFromPool(kCache, "thin", {"k"}, *thin);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.status().message(), HasSubstr("layer range is [0, 2), the cache's [0, 4)"));
  // Slots not allocated.
  s = c.CacheStoreFromPool(kCache, "pf", {"k"}, PageRows(5, 1));
  EXPECT_EQ(s.status().code(), absl::StatusCode::kFailedPrecondition) << s.status();
  // An unknown pool.
  s = c.CacheStoreFromPool(kCache, "nope", {"k"}, *pf);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kNotFound);
  absl::StatusOr<v1::TransferTicket> r = c.CacheRestoreToPool(kCache, "pf", {"k"}, *pf);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(r.status().message(), HasSubstr("key 0 is not present"));
  const v1::CacheStats after = Stats();
  EXPECT_EQ(after.published(), before.published());
  EXPECT_EQ(after.writing(), before.writing());
  EXPECT_EQ(after.pinned(), before.pinned());
  EXPECT_EQ(after.free_pages(), before.free_pages());
}

}  // namespace
}  // namespace kvhost
