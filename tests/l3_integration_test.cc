// The L3 tier end to end: kvhostds started with --l3-memcached on a local
// cluster of three memcached servers (tests/memcached_cluster.h), through
// kvhost.v1.StorageService. A first kvhostd stores pages, a second one
// fetches them byte-exact, for every pool kind x layout, with pages split
// into parts; a server killed mid-run (its pages become misses, nothing else
// fails, the daemon stays up) and restarted empty; with --l3-replicas=1 a
// killed server losing nothing; pages of another shape refused; the calls'
// refusals (codes and messages, nothing changed); the kvhost_l3_* metrics;
// several clients storing and fetching at once.
//
// Skipped, saying why, where no memcached binary exists (CI installs it).
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "api_test_util.h"
#include "memcached_cluster.h"
#include "metrics_test_util.h"

namespace kvhost::testing {
namespace {

// Pages of the test pools (page_size 16, Dims{}) are 1.5 to 3 KiB: items of
// 1000 bytes split each into 2 to 4 parts.
constexpr char kItemBytes[] = "--l3-item-bytes=1000";

std::vector<std::string> L3Flags(const MemcachedCluster& cluster, const L3SecretFile& secret,
                                 std::vector<std::string> more = {}) {
  std::vector<std::string> flags = {absl::StrCat("--l3-memcached=", cluster.Servers()), kItemBytes,
                                    "--l3-retry-timeout=1s", "--l3-io-timeout=500ms",
                                    secret.Flag()};
  for (std::string& f : more) flags.push_back(std::move(f));
  return flags;
}

// Keys no earlier run of the test made (the servers are fresh anyway).
std::vector<std::string> Keys(const std::string& prefix, size_t n) {
  static std::mt19937_64 rng(std::random_device{}());
  const std::string run = absl::StrCat(rng());
  std::vector<std::string> keys;
  for (size_t i = 0; i < n; ++i) keys.push_back(absl::StrCat(prefix, "/", run, "/", i));
  return keys;
}

// Allocates `pages` pages of `pool` and fills them with random bytes;
// returns their first slots and sets `bytes` to their contents.
std::vector<int64_t> FilledPages(Client& client, const std::string& pool, uint64_t ps,
                                 uint64_t pages, std::mt19937& rng,
                                 std::vector<std::string>* bytes) {
  absl::StatusOr<std::vector<int64_t>> slots = client.Alloc(pool, pages * ps);
  EXPECT_TRUE(slots.ok()) << slots.status();
  std::vector<int64_t> firsts;
  for (size_t i = 0; slots.ok() && i < slots->size(); i += ps) firsts.push_back((*slots)[i]);
  absl::StatusOr<v1::Pool> info = client.GetPool(pool);
  EXPECT_TRUE(info.ok()) << info.status();
  bytes->clear();
  for (int64_t slot : firsts) {
    absl::StatusOr<std::string> page = client.GetDataPage(pool, slot);
    EXPECT_TRUE(page.ok()) << page.status();
    std::string data(page.ok() ? page->size() : 0, '\0');
    FillRandomNonZero(reinterpret_cast<uint8_t*>(data.data()), data.size(), rng);
    EXPECT_TRUE(client.SetFromFlatDataPage(pool, slot, data).ok());
    bytes->push_back(std::move(data));
  }
  return firsts;
}

std::vector<int64_t> AllocFirsts(Client& client, const std::string& pool, uint64_t ps,
                                 uint64_t pages) {
  absl::StatusOr<std::vector<int64_t>> slots = client.Alloc(pool, pages * ps);
  EXPECT_TRUE(slots.ok()) << slots.status();
  std::vector<int64_t> firsts;
  for (size_t i = 0; slots.ok() && i < slots->size(); i += ps) firsts.push_back((*slots)[i]);
  return firsts;
}

std::string PageAt(Client& client, const std::string& pool, int64_t slot) {
  absl::StatusOr<std::string> page = client.GetDataPage(pool, slot);
  EXPECT_TRUE(page.ok()) << page.status();
  return page.ok() ? *page : "";
}

template <typename Response>
std::vector<v1::PageOutcome> Outcomes(const Response& r) {
  std::vector<v1::PageOutcome> out;
  for (const v1::PageResult& p : r.pages()) out.push_back(p.outcome());
  return out;
}

class L3Test : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<MemcachedCluster>> cluster = MemcachedCluster::Start(3);
    if (cluster.status().code() == absl::StatusCode::kNotFound) {
      GTEST_SKIP() << cluster.status().message();
    }
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = *std::move(cluster);
  }
  std::unique_ptr<TestDaemon> StartDaemon(std::vector<std::string> more = {}) {
    absl::StatusOr<std::unique_ptr<TestDaemon>> d =
        TestDaemon::Start(KVHOSTD_PATH, L3Flags(*cluster_, secret_, std::move(more)));
    EXPECT_TRUE(d.ok()) << d.status();
    return d.ok() ? *std::move(d) : nullptr;
  }
  void TearDown() override {
    for (TestDaemon* d : {first_.get(), second_.get()}) {
      if (d != nullptr && HasFailure()) {
        std::string log = d->Log();
        if (log.size() > 4000) log = "..." + log.substr(log.size() - 4000);
        std::fprintf(stderr, "--- kvhostd log (tail) ---\n%s\n", log.c_str());
      }
    }
  }

  std::unique_ptr<MemcachedCluster> cluster_;
  L3SecretFile secret_;
  std::unique_ptr<TestDaemon> first_, second_;
  std::mt19937 rng_{1234};
};

class L3ComboTest : public L3Test, public ::testing::WithParamInterface<Combo> {};

// The issue's end: pages one kvhostd stored, fetched byte-exact by another.
TEST_P(L3ComboTest, SecondDaemonFetchesWhatTheFirstStored) {
  const Combo c = GetParam();
  first_ = StartDaemon();
  second_ = StartDaemon();
  ASSERT_TRUE(first_ && second_);
  const v1::PoolSpec spec = MakeSpec(c.kind, c.layout, 16, 1024);
  ASSERT_TRUE(first_->client().CreatePool("p", spec).ok());
  ASSERT_TRUE(second_->client().CreatePool("p", spec).ok());
  std::vector<std::string> bytes;
  const std::vector<int64_t> src = FilledPages(first_->client(), "p", 16, 8, rng_, &bytes);
  ASSERT_EQ(src.size(), 8u);
  ASSERT_GT(bytes[0].size(), 1000u) << "pages should need several parts";
  const std::vector<std::string> keys = Keys(ComboName(c), 8);
  absl::StatusOr<v1::StorePagesResponse> stored = first_->client().StorePages("p", src, keys);
  ASSERT_TRUE(stored.ok()) << stored.status();
  EXPECT_EQ(Outcomes(*stored), std::vector<v1::PageOutcome>(8, v1::PAGE_STORED));
  EXPECT_EQ(stored->stored_pages(), 8u);
  EXPECT_EQ(stored->stored_bytes(), 8 * bytes[0].size());

  EXPECT_EQ(*second_->client().ExistPages("p", keys), 8u);
  std::vector<std::string> gap = keys;
  gap[3] = "never-stored";
  EXPECT_EQ(*second_->client().ExistPages("p", gap), 3u);

  // Fetch in reverse, plus a key never stored into a ninth page.
  std::vector<int64_t> dst = AllocFirsts(second_->client(), "p", 16, 9);
  ASSERT_EQ(dst.size(), 9u);
  const std::string untouched = PageAt(second_->client(), "p", dst[8]);
  std::vector<std::string> reversed(keys.rbegin(), keys.rend());
  reversed.push_back("never-stored");
  absl::StatusOr<v1::FetchPagesResponse> fetched = second_->client().FetchPages("p", reversed, dst);
  ASSERT_TRUE(fetched.ok()) << fetched.status();
  std::vector<v1::PageOutcome> want(8, v1::PAGE_HIT);
  want.push_back(v1::PAGE_MISS);
  EXPECT_EQ(Outcomes(*fetched), want);
  EXPECT_EQ(fetched->hit_pages(), 8u);
  for (size_t i = 0; i < 8; ++i) {
    EXPECT_EQ(PageAt(second_->client(), "p", dst[i]), bytes[7 - i]) << "page " << i;
  }
  EXPECT_EQ(PageAt(second_->client(), "p", dst[8]), untouched);
}

INSTANTIATE_TEST_SUITE_P(AllCombos, L3ComboTest, ::testing::ValuesIn(kCombos),
                         [](const ::testing::TestParamInfo<Combo>& info) {
                           return ComboName(info.param);
                         });

// Outcomes of fetching `keys` into `dst`, checking every hit byte-exact
// against `bytes` and that nothing else came back but a miss.
std::vector<bool> FetchHits(Client& client, const std::vector<std::string>& keys,
                            const std::vector<int64_t>& dst, const std::vector<std::string>& bytes,
                            std::vector<std::string>* details = nullptr) {
  absl::StatusOr<v1::FetchPagesResponse> fetched = client.FetchPages("p", keys, dst);
  EXPECT_TRUE(fetched.ok()) << fetched.status();
  std::vector<bool> hits(keys.size(), false);
  for (int i = 0; fetched.ok() && i < fetched->pages_size(); ++i) {
    const v1::PageResult& r = fetched->pages(i);
    EXPECT_TRUE(r.outcome() == v1::PAGE_HIT || r.outcome() == v1::PAGE_MISS)
        << i << ": " << v1::PageOutcome_Name(r.outcome()) << " " << r.detail();
    hits[i] = r.outcome() == v1::PAGE_HIT;
    if (details != nullptr) details->push_back(r.detail());
    if (hits[i]) {
      EXPECT_EQ(PageAt(client, "p", dst[i]), bytes[i]) << "page " << i;
    }
  }
  return hits;
}

size_t Count(const std::vector<bool>& v) { return std::count(v.begin(), v.end(), true); }

// Pages of one item each (the default item size), so each page lives on
// one server: killing one loses its pages and no other. kvhostds see a
// server's death and return on their own (libmemcached's ring, per handle),
// so between a failure and --l3-retry-timeout two nodes may disagree where
// a key lives: misses, never wrong bytes, which is what is checked.
TEST_F(L3Test, ServerKilledMidRunThenRestartedEmpty) {
  first_ = StartDaemon({"--l3-item-bytes=1044480"});
  second_ = StartDaemon({"--l3-item-bytes=1044480"});
  ASSERT_TRUE(first_ && second_);
  const v1::PoolSpec spec = MakeSpec(v1::MHA, v1::PAGE_FIRST, 16, 2048);
  ASSERT_TRUE(first_->client().CreatePool("p", spec).ok());
  ASSERT_TRUE(second_->client().CreatePool("p", spec).ok());
  std::vector<std::string> bytes;
  const std::vector<int64_t> src = FilledPages(first_->client(), "p", 16, 30, rng_, &bytes);
  const std::vector<std::string> keys = Keys("kill", 30);
  absl::StatusOr<v1::StorePagesResponse> stored = first_->client().StorePages("p", src, keys);
  ASSERT_TRUE(stored.ok()) << stored.status();
  ASSERT_EQ(stored->stored_pages(), 30u);
  const std::vector<int64_t> dst = AllocFirsts(second_->client(), "p", 16, 30);
  EXPECT_EQ(Count(FetchHits(second_->client(), keys, dst, bytes)), 30u);

  cluster_->Kill(1);
  // Its pages are misses, the others byte-exact hits; no call fails.
  for (int round = 0; round < 2; ++round) {
    const size_t hits = Count(FetchHits(second_->client(), keys, dst, bytes));
    EXPECT_GT(hits, 0u) << "round " << round;
    EXPECT_LT(hits, 30u) << "30 pages over 3 servers, none on the one killed?";
  }
  // Stores go on (a page whose server just failed may be UNAVAILABLE), and
  // what is fetched back is byte-exact. Not every page stored now is a hit:
  // each connection finds the dead server on its own, so until all have,
  // one that stored a page and one that fetches it may place its key apart
  // (a miss, never wrong bytes; docs/OPERATIONS.md, When a server dies).
  std::vector<std::string> more_bytes;
  const std::vector<int64_t> more = FilledPages(first_->client(), "p", 16, 10, rng_, &more_bytes);
  const std::vector<std::string> more_keys = Keys("during", 10);
  stored = first_->client().StorePages("p", more, more_keys);
  ASSERT_TRUE(stored.ok()) << stored.status();
  EXPECT_GT(stored->stored_pages(), 0u);
  for (const v1::PageResult& r : stored->pages()) {
    EXPECT_TRUE(r.outcome() == v1::PAGE_STORED || r.outcome() == v1::PAGE_UNAVAILABLE)
        << v1::PageOutcome_Name(r.outcome());
  }
  const std::vector<int64_t> more_dst = AllocFirsts(first_->client(), "p", 16, 10);
  std::vector<std::string> details;
  const std::vector<bool> more_hits =
      FetchHits(first_->client(), more_keys, more_dst, more_bytes, &details);
  size_t stored_hits = 0;
  for (int i = 0; i < 10; ++i) {
    if (stored->pages(i).outcome() == v1::PAGE_STORED && more_hits[i]) ++stored_hits;
  }
  EXPECT_GT(stored_hits, 0u) << "none of the pages stored during the outage fetched back: "
                             << absl::StrJoin(details, "; ");
  ASSERT_TRUE(first_->client().Health().ok());
  ASSERT_TRUE(second_->client().Health().ok());

  // Restarted empty: what it held is gone (misses), and once both nodes
  // have it back in their ring (after --l3-retry-timeout) pages stored again
  // are all hits on the other node.
  ASSERT_TRUE(cluster_->Restart(1).ok());
  absl::SleepFor(absl::Milliseconds(1500));
  EXPECT_LT(Count(FetchHits(second_->client(), keys, dst, bytes)), 30u);
  size_t hits = 0;
  for (int attempt = 0; attempt < 10 && hits < 30; ++attempt) {
    stored = first_->client().StorePages("p", src, keys);
    ASSERT_TRUE(stored.ok()) << stored.status();
    hits = stored->stored_pages() == 30 ? Count(FetchHits(second_->client(), keys, dst, bytes)) : 0;
    if (hits < 30) absl::SleepFor(absl::Milliseconds(500));
  }
  EXPECT_EQ(hits, 30u) << "pages not served again after the server came back";
}

// --l3-replicas=1: every item is on two servers, so killing one loses
// nothing; the dead server stays in the ring (its keys are read from their
// replicas), and a store whose first server is the dead one may be
// UNAVAILABLE, never a failed call.
TEST_F(L3Test, ReplicasKeepPagesOfAKilledServer) {
  first_ = StartDaemon({"--l3-item-bytes=1044480", "--l3-replicas=1"});
  second_ = StartDaemon({"--l3-item-bytes=1044480", "--l3-replicas=1"});
  ASSERT_TRUE(first_ && second_);
  const v1::PoolSpec spec = MakeSpec(v1::MHA, v1::PAGE_FIRST, 16, 1024);
  ASSERT_TRUE(first_->client().CreatePool("p", spec).ok());
  ASSERT_TRUE(second_->client().CreatePool("p", spec).ok());
  std::vector<std::string> bytes;
  const std::vector<int64_t> src = FilledPages(first_->client(), "p", 16, 30, rng_, &bytes);
  const std::vector<std::string> keys = Keys("replicas", 30);
  absl::StatusOr<v1::StorePagesResponse> stored = first_->client().StorePages("p", src, keys);
  ASSERT_TRUE(stored.ok()) << stored.status();
  ASSERT_EQ(stored->stored_pages(), 30u);
  const std::vector<int64_t> dst = AllocFirsts(second_->client(), "p", 16, 30);
  cluster_->Kill(0);
  size_t hits = 0;
  for (int attempt = 0; attempt < 3 && hits < 30; ++attempt) {
    hits = Count(FetchHits(second_->client(), keys, dst, bytes));
  }
  EXPECT_EQ(hits, 30u);
  std::vector<std::string> more_bytes;
  const std::vector<int64_t> more = FilledPages(first_->client(), "p", 16, 10, rng_, &more_bytes);
  const std::vector<std::string> more_keys = Keys("replicas-after", 10);
  stored = first_->client().StorePages("p", more, more_keys);
  ASSERT_TRUE(stored.ok()) << stored.status();
  const std::vector<int64_t> more_dst = AllocFirsts(second_->client(), "p", 16, 10);
  const std::vector<bool> more_hits = FetchHits(second_->client(), more_keys, more_dst, more_bytes);
  for (int i = 0; i < 10; ++i) {
    const v1::PageOutcome o = stored->pages(i).outcome();
    EXPECT_TRUE(o == v1::PAGE_STORED || o == v1::PAGE_UNAVAILABLE) << v1::PageOutcome_Name(o);
    if (o == v1::PAGE_STORED) {
      EXPECT_TRUE(more_hits[i]) << i;
    }
  }
}

TEST_F(L3Test, MetricsCountPagesBytesAndCalls) {
  first_ = StartDaemon({"--metrics-listen=127.0.0.1:0"});
  ASSERT_TRUE(first_);
  const int port = MetricsPort(*first_);
  ASSERT_GT(port, 0);
  Client& client = first_->client();
  ASSERT_TRUE(client.CreatePool("p", MakeSpec(v1::MLA, v1::LAYER_FIRST, 16, 256)).ok());
  std::vector<std::string> bytes;
  const std::vector<int64_t> src = FilledPages(client, "p", 16, 3, rng_, &bytes);
  const std::vector<std::string> keys = Keys("metrics", 3);
  ASSERT_EQ(client.StorePages("p", src, keys)->stored_pages(), 3u);
  std::vector<std::string> fetch_keys = keys;
  fetch_keys.push_back("never-stored");
  const std::vector<int64_t> dst = AllocFirsts(client, "p", 16, 4);
  ASSERT_EQ(client.FetchPages("p", fetch_keys, dst)->hit_pages(), 3u);
  ASSERT_EQ(*client.ExistPages("p", {keys[0], keys[1], "never-stored", keys[2]}), 2u);
  const Scrape m = ScrapeMetrics(port);
  const double page = static_cast<double>(bytes[0].size());
  EXPECT_EQ(SeriesValue(m, R"(kvhost_l3_pages_total{op="store",outcome="stored"})"), 3);
  EXPECT_EQ(SeriesValue(m, R"(kvhost_l3_pages_total{op="fetch",outcome="hit"})"), 3);
  EXPECT_EQ(SeriesValue(m, R"(kvhost_l3_pages_total{op="fetch",outcome="miss"})"), 1);
  EXPECT_EQ(SeriesValue(m, R"(kvhost_l3_pages_total{op="exist",outcome="hit"})"), 2);
  EXPECT_EQ(SeriesValue(m, R"(kvhost_l3_pages_total{op="exist",outcome="miss"})"), 1);
  EXPECT_EQ(SeriesValue(m, R"(kvhost_l3_bytes_total{op="store"})"), 3 * page);
  EXPECT_EQ(SeriesValue(m, R"(kvhost_l3_bytes_total{op="fetch"})"), 3 * page);
  for (const char* op : {"store", "fetch", "exist"}) {
    EXPECT_EQ(
        SeriesValue(m, absl::StrCat("kvhost_l3_call_duration_seconds_count{op=\"", op, "\"}")), 1)
        << op;
  }
}

TEST_F(L3Test, PagesOfAnotherShapeAreRefused) {
  first_ = StartDaemon();
  ASSERT_TRUE(first_);
  Client& client = first_->client();
  ASSERT_TRUE(client.CreatePool("p", MakeSpec(v1::MHA, v1::PAGE_FIRST, 16, 256)).ok());
  ASSERT_TRUE(client.CreatePool("mla", MakeSpec(v1::MLA, v1::PAGE_FIRST, 16, 256)).ok());
  ASSERT_TRUE(client.CreatePool("fp16", MakeSpec(v1::MHA, v1::PAGE_FIRST, 16, 256, v1::FP16)).ok());
  std::vector<std::string> bytes;
  const std::vector<int64_t> src = FilledPages(client, "p", 16, 2, rng_, &bytes);
  const std::vector<std::string> keys = Keys("shape", 2);
  ASSERT_EQ(client.StorePages("p", src, keys)->stored_pages(), 2u);
  for (const std::string pool : {"mla", "fp16"}) {
    std::vector<std::string> before;
    const std::vector<int64_t> dst = FilledPages(client, pool, 16, 2, rng_, &before);
    absl::StatusOr<v1::FetchPagesResponse> fetched = client.FetchPages(pool, keys, dst);
    ASSERT_TRUE(fetched.ok()) << fetched.status();
    EXPECT_EQ(Outcomes(*fetched), std::vector<v1::PageOutcome>(2, v1::PAGE_SHAPE_MISMATCH));
    EXPECT_TRUE(absl::StrContains(fetched->pages(0).detail(), "the stored page is MHA/PAGE_FIRST"))
        << fetched->pages(0).detail();
    EXPECT_EQ(fetched->hit_pages(), 0u);
    for (size_t i = 0; i < dst.size(); ++i) EXPECT_EQ(PageAt(client, pool, dst[i]), before[i]);
  }
}

TEST_F(L3Test, AFetchIntoAPoolAnotherSessionHoldsIsRefused) {
  first_ = StartDaemon();
  ASSERT_TRUE(first_);
  ASSERT_TRUE(first_->client().CreatePool("p", MakeSpec(v1::MHA, v1::PAGE_FIRST, 16, 256)).ok());
  std::vector<std::string> bytes;
  const std::vector<int64_t> src = FilledPages(first_->client(), "p", 16, 2, rng_, &bytes);
  const std::vector<std::string> keys = Keys("held", 2);
  ASSERT_EQ(first_->client().StorePages("p", src, keys)->stored_pages(), 2u);
  // Two sglang instances' clients, each with its worker session.
  const auto scheduler = [&] {
    ClientOptions options;
    options.address = first_->address();
    absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect(options);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? *std::move(c) : nullptr;
  };
  std::unique_ptr<Client> holder = scheduler();
  std::unique_ptr<Client> other = scheduler();
  ASSERT_TRUE(holder && other);
  ASSERT_TRUE(holder->ClaimPool("p", "inst-a").ok());
  ASSERT_TRUE(other->OpenSession(absl::Seconds(10)).ok());
  std::vector<std::string> before;
  const std::vector<int64_t> dst = FilledPages(*holder, "p", 16, 2, rng_, &before);
  const auto refused = [](const absl::Status& s) {
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "'inst-a' (generation 1)")) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "FetchPages from another session")) << s;
  };
  refused(other->FetchPages("p", keys, dst).status());
  refused(other->StartFetchPages("p", keys, dst).status());
  for (size_t i = 0; i < dst.size(); ++i) EXPECT_EQ(PageAt(*holder, "p", dst[i]), before[i]);
  // The holder's own fetch writes them.
  absl::StatusOr<v1::FetchPagesResponse> fetched = holder->FetchPages("p", keys, dst);
  ASSERT_TRUE(fetched.ok()) << fetched.status();
  EXPECT_EQ(fetched->hit_pages(), 2u);
  for (size_t i = 0; i < dst.size(); ++i) EXPECT_EQ(PageAt(*holder, "p", dst[i]), bytes[i]);
}

TEST_F(L3Test, RefusalsNameTheValueAndChangeNothing) {
  first_ = StartDaemon({"--l3-max-pages-in-flight=4"});
  ASSERT_TRUE(first_);
  ClientOptions options;
  options.address = first_->address();
  options.owner_token = "secret-token";
  absl::StatusOr<std::unique_ptr<Client>> owner = Client::Connect(options);
  ASSERT_TRUE(owner.ok());
  Client& stranger = first_->client();
  ASSERT_TRUE((*owner)->CreatePool("p", MakeSpec(v1::MHA, v1::PAGE_FIRST, 16, 256)).ok());
  std::vector<std::string> bytes;
  const std::vector<int64_t> src = FilledPages(**owner, "p", 16, 5, rng_, &bytes);
  const std::vector<std::string> keys = Keys("refuse", 5);
  const std::vector<int64_t> four(src.begin(), src.begin() + 4);
  const std::vector<std::string> four_keys(keys.begin(), keys.begin() + 4);

  EXPECT_ERROR(stranger.StorePages("p", four, four_keys), kPermissionDenied, "'p'");
  EXPECT_ERROR(stranger.FetchPages("p", four_keys, four), kPermissionDenied, "'p'");
  EXPECT_ERROR((*owner)->StorePages("nope", four, four_keys), kNotFound, "nope");
  EXPECT_ERROR((*owner)->StorePages("p", src, keys), kResourceExhausted, "5 pages", "bound of 4",
               "--l3-max-pages-in-flight");
  EXPECT_ERROR((*owner)->StorePages("p", four, {"a"}), kInvalidArgument, "1 keys for 4 indices");
  EXPECT_ERROR((*owner)->StorePages("p", {src[0] + 1}, {"a"}), kInvalidArgument, "indices[0]",
               std::to_string(src[0] + 1));
  EXPECT_ERROR((*owner)->FetchPages("p", {"a", "b"}, {src[0], src[0]}), kInvalidArgument,
               "indices[1] = " + std::to_string(src[0]));
  EXPECT_ERROR((*owner)->ExistPages("p", {"ok", ""}), kInvalidArgument, "keys[1] is empty");
  EXPECT_ERROR((*owner)->ExistPages("", {"ok"}), kInvalidArgument, "names no pool");
  EXPECT_ERROR(stranger.ExistPages("p", {"ok"}), kPermissionDenied, "'p'");
  EXPECT_ERROR(
      (*owner)->StorePages("p", std::vector<int64_t>(5, src[0]), {"a", "b", "c", "d", "e"}),
      kInvalidArgument, "more than 4 times");
  // Nothing was stored by any of them.
  EXPECT_EQ(*(*owner)->ExistPages("p", four_keys), 0u);
  EXPECT_EQ(*(*owner)->ExistPages("p", {keys[4]}), 0u);
  ASSERT_TRUE((*owner)->Free("p", Range(src[4], 16)).ok());
  EXPECT_ERROR((*owner)->StorePages("p", {src[0], src[4]}, {keys[0], keys[4]}), kFailedPrecondition,
               "not allocated");
  EXPECT_EQ(*(*owner)->ExistPages("p", four_keys), 0u);
  EXPECT_EQ((*owner)->StorePages("p", four, four_keys)->stored_pages(), 4u);

  // A kvhostd without --l3-memcached serves the service and says why not.
  absl::StatusOr<std::unique_ptr<TestDaemon>> plain = TestDaemon::Start(KVHOSTD_PATH);
  ASSERT_TRUE(plain.ok());
  EXPECT_ERROR((*plain)->client().ExistPages("p", {"a"}), kFailedPrecondition, "--l3-memcached");
  // A bad server list stops the start, naming it.
  absl::StatusOr<std::unique_ptr<TestDaemon>> bad =
      TestDaemon::Start(KVHOSTD_PATH, {"--l3-memcached=127.0.0.1:0", secret_.Flag()});
  ASSERT_FALSE(bad.ok());
  EXPECT_TRUE(absl::StrContains(bad.status().message(), "'127.0.0.1:0' is not host:port"))
      << bad.status();
}

// The tier does not start without a fleet secret, nor with one that others
// may read, short or a symlink; each refusal says how to make a good one.
TEST_F(L3Test, TheTierNeedsAPrivateSecretFile) {
  const std::string servers = absl::StrCat("--l3-memcached=", cluster_->Servers());
  L3SecretFile readable(L3SecretFile::kDefaultSecret, 0640);
  L3SecretFile short_one("too short");
  const std::string link = secret_.path() + ".link";
  ASSERT_EQ(::symlink(secret_.path().c_str(), link.c_str()), 0);
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{servers}, "--l3-memcached needs --l3-secret-file"},
      {{servers, readable.Flag()}, "mode 0640 lets the group or others at it"},
      {{servers, short_one.Flag()}, "9 bytes of secret; it needs 32"},
      {{servers, "--l3-secret-file=" + link}, "Too many levels of symbolic links"},
      {{servers, "--l3-secret-file=/nonexistent/l3.secret"}, "No such file"},
  };
  for (const auto& [flags, want] : cases) {
    absl::StatusOr<std::unique_ptr<TestDaemon>> d = TestDaemon::Start(KVHOSTD_PATH, flags);
    ASSERT_FALSE(d.ok()) << want;
    EXPECT_TRUE(absl::StrContains(d.status().message(), want)) << d.status();
    EXPECT_TRUE(absl::StrContains(d.status().message(), "openssl rand -hex 32")) << d.status();
  }
  ::unlink(link.c_str());
}

// Detached StorePages / FetchPages: a ticket at once, returned by
// WaitStorage (waiting or polling, as often as asked) with the results the
// call would have returned; a wait that gives up (its deadline) loses
// nothing; the ticket is the pool's (its owner token, not another pool's
// name, and gone with the pool); a refused detached call leaves no ticket.
TEST_F(L3Test, DetachedCallsReturnTicketsForWaitStorage) {
  first_ = StartDaemon();
  ASSERT_TRUE(first_);
  ClientOptions options;
  options.address = first_->address();
  options.owner_token = "ticket-owner";
  absl::StatusOr<std::unique_ptr<Client>> connected = Client::Connect(options);
  ASSERT_TRUE(connected.ok());
  Client& owner = **connected;
  Client& stranger = first_->client();
  const v1::PoolSpec spec = MakeSpec(v1::MHA, v1::LAYER_FIRST, 16, 512);
  ASSERT_TRUE(owner.CreatePool("p", spec).ok());
  ASSERT_TRUE(owner.CreatePool("q", spec).ok());
  std::vector<std::string> bytes;
  const std::vector<int64_t> src = FilledPages(owner, "p", 16, 6, rng_, &bytes);
  const std::vector<std::string> keys = Keys("detached", 6);

  absl::StatusOr<uint64_t> store = owner.StartStorePages("p", src, keys);
  ASSERT_TRUE(store.ok()) << store.status();
  ASSERT_NE(*store, 0u);
  EXPECT_ERROR(stranger.WaitStorage("p", *store), kPermissionDenied, "'p'");
  EXPECT_ERROR(owner.WaitStorage("q", *store), kNotFound, std::to_string(*store), "'q'");
  EXPECT_ERROR(owner.WaitStorage("nope", *store), kNotFound, "nope");
  absl::StatusOr<v1::StorageTicketStatus> stored = owner.WaitStorage("p", *store);
  ASSERT_TRUE(stored.ok()) << stored.status();
  EXPECT_TRUE(stored->done());
  EXPECT_EQ(stored->ticket_id(), *store);
  ASSERT_TRUE(stored->has_store());
  EXPECT_EQ(stored->store().ticket_id(), *store);
  EXPECT_EQ(Outcomes(stored->store()), std::vector<v1::PageOutcome>(6, v1::PAGE_STORED));
  EXPECT_EQ(stored->store().stored_pages(), 6u);
  EXPECT_EQ(stored->store().stored_bytes(), 6 * bytes[0].size());
  // Asked again (a client whose reply was lost): the same results.
  absl::StatusOr<v1::StorageTicketStatus> again = owner.WaitStorage("p", *store);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->SerializeAsString(), stored->SerializeAsString());

  // A refused detached call: the ticket it would have had is never found.
  EXPECT_ERROR(owner.StartFetchPages("p", {"a"}, {src[0], src[1]}), kInvalidArgument,
               "1 keys for 2 indices");
  const std::vector<int64_t> dst = AllocFirsts(owner, "p", 16, 6);
  absl::StatusOr<uint64_t> fetch = owner.StartFetchPages("p", keys, dst);
  ASSERT_TRUE(fetch.ok()) << fetch.status();
  EXPECT_ERROR(owner.WaitStorage("p", *fetch - 1), kNotFound, std::to_string(*fetch - 1));
  absl::StatusOr<v1::StorageTicketStatus> fetched;
  for (int i = 0; i < 2000; ++i) {
    fetched = owner.WaitStorage("p", *fetch, /*poll=*/true);
    ASSERT_TRUE(fetched.ok()) << fetched.status();
    EXPECT_EQ(fetched->ticket_id(), *fetch);
    if (fetched->done()) break;
    EXPECT_FALSE(fetched->has_fetch());
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_TRUE(fetched->done());
  ASSERT_TRUE(fetched->has_fetch());
  EXPECT_EQ(fetched->fetch().hit_pages(), 6u);
  for (size_t i = 0; i < dst.size(); ++i) {
    EXPECT_EQ(PageAt(owner, "p", dst[i]), bytes[i]) << "page " << i;
  }
  absl::StatusOr<v1::StorageTicketStatus> polled = owner.WaitStorage("p", *fetch, true);
  ASSERT_TRUE(polled.ok()) << polled.status();
  EXPECT_EQ(polled->fetch().hit_pages(), 6u);

  // A WaitStorage that gives up (its deadline) loses nothing, even when the
  // pages finish as it gives up: the servers hang, so the fetch lasts its
  // I/O timeouts.
  for (int i = 0; i < cluster_->size(); ++i) cluster_->Pause(i);
  absl::StatusOr<uint64_t> slow = owner.StartFetchPages("p", keys, dst);
  ASSERT_TRUE(slow.ok()) << slow.status();
  ClientOptions impatient = options;
  impatient.timeout = absl::Milliseconds(100);
  absl::StatusOr<std::unique_ptr<Client>> hurried = Client::Connect(impatient);
  ASSERT_TRUE(hurried.ok());
  EXPECT_EQ((*hurried)->WaitStorage("p", *slow).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  for (int i = 0; i < cluster_->size(); ++i) cluster_->Resume(i);
  absl::StatusOr<v1::StorageTicketStatus> late = owner.WaitStorage("p", *slow);
  ASSERT_TRUE(late.ok()) << late.status();
  EXPECT_TRUE(late->done());
  EXPECT_EQ(late->fetch().pages_size(), 6);

  // A ticket goes with its pool.
  absl::StatusOr<uint64_t> left = owner.StartStorePages("p", src, keys);
  ASSERT_TRUE(left.ok()) << left.status();
  ASSERT_TRUE(owner.DeletePool("p").ok());
  ASSERT_TRUE(owner.CreatePool("p", spec).ok());
  EXPECT_ERROR(owner.WaitStorage("p", *left), kNotFound, std::to_string(*left));
}

TEST_F(L3Test, ConcurrentClientsStoreAndFetch) {
  first_ = StartDaemon();
  ASSERT_TRUE(first_);
  ASSERT_TRUE(first_->client().CreatePool("p", MakeSpec(v1::MLA, v1::PAGE_FIRST, 16, 8192)).ok());
  constexpr int kClients = 4;
  std::vector<std::thread> threads;
  std::vector<int> hits(kClients, 0);
  for (int t = 0; t < kClients; ++t) {
    threads.emplace_back([&, t] {
      ClientOptions options;
      options.address = first_->address();
      absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(options);
      ASSERT_TRUE(client.ok());
      std::mt19937 rng(t);
      for (int round = 0; round < 5; ++round) {
        std::vector<std::string> bytes;
        const std::vector<int64_t> src = FilledPages(**client, "p", 16, 6, rng, &bytes);
        const std::vector<std::string> keys = Keys(absl::StrCat("c", t), 6);
        absl::StatusOr<v1::StorePagesResponse> stored = (*client)->StorePages("p", src, keys);
        ASSERT_TRUE(stored.ok()) << stored.status();
        ASSERT_EQ(stored->stored_pages(), 6u);
        const std::vector<int64_t> dst = AllocFirsts(**client, "p", 16, 6);
        hits[t] += static_cast<int>(Count(FetchHits(**client, keys, dst, bytes)));
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (int t = 0; t < kClients; ++t) EXPECT_EQ(hits[t], 30) << "client " << t;
}

}  // namespace
}  // namespace kvhost::testing
