// kvhostctl's node cache commands (client/kvhostctl/cache_commands.cc), run
// as an operator runs them against a kvhostd whose cache an engine instance
// (a Client with a device pool) filled: cache-stats, cache-lookup (text and
// --hex-keys), cache-evict, cache-events (--after, --json, --follow until
// SIGINT), and their refusals: a wrong token, bad hex.
#include <sys/wait.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "api_test_util.h"
#include "daemon_fixture.h"
#include "kvhost/client.h"

namespace kvhost {
namespace {

using ::kvhost::testing::MakeSpec;
using ::kvhost::testing::Range;
using ::kvhost::testing::TestDaemon;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr char kToken[] = "model-token";

struct CtlRun {
  int exit_code = -1;
  std::string out;  // stdout and stderr
};

class CacheCommandsTest : public ::testing::Test {
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
    v1::PoolSpec spec = MakeSpec(v1::MHA, v1::PAGE_FIRST, 4, 32);
    spec.set_node_cache(true);
    absl::StatusOr<v1::Pool> pool = client_->CreatePool("nc", spec);
    ASSERT_TRUE(pool.ok()) << pool.status();
    absl::StatusOr<std::unique_ptr<ShmDevicePool>> dev =
        ShmDevicePool::Create(*pool, 32, d_->shm_dir());
    ASSERT_TRUE(dev.ok()) << dev.status();
    device_ = *std::move(dev);
    absl::StatusOr<v1::Attachment> att = client_->AttachDevice(device_->MakeAttachRequest("nc"));
    ASSERT_TRUE(att.ok()) << att.status();
    attachment_ = att->id();
    ASSERT_NO_FATAL_FAILURE(Store({"h0", "h1", std::string("\x01\xff", 2)}));
  }
  void Store(const std::vector<std::string>& keys) {
    absl::StatusOr<v1::CacheStoreReply> stored =
        client_->CacheStore("nc", attachment_, keys, Range(0, 4 * keys.size()));
    ASSERT_TRUE(stored.ok()) << stored.status();
    ASSERT_TRUE(client_->WaitTransfer(stored->ticket().id()).ok());
  }
  std::string Command(const std::string& args, const std::string& token = kToken) const {
    return absl::StrCat(KVHOSTCTL_PATH, " --server=", d_->address(), " --timeout=10",
                        token.empty() ? "" : absl::StrCat(" --token=", token), " ", args, " 2>&1");
  }
  static CtlRun Finish(FILE* pipe) {
    CtlRun run;
    char buf[4096];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof(buf), pipe)) > 0) run.out.append(buf, n);
    const int status = ::pclose(pipe);
    run.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    return run;
  }
  CtlRun Ctl(const std::string& args, const std::string& token = kToken) const {
    FILE* pipe = ::popen(Command(args, token).c_str(), "r");
    if (pipe == nullptr) return CtlRun();
    return Finish(pipe);
  }

  std::unique_ptr<TestDaemon> d_;
  std::unique_ptr<Client> client_;
  std::unique_ptr<ShmDevicePool> device_;
  std::string attachment_;
};

TEST_F(CacheCommandsTest, StatsLookupAndEvict) {
  ASSERT_TRUE(client_->CacheLookup("nc", {"h0", "zz"}).ok());  // one hit, one miss
  CtlRun r = Ctl("cache-stats nc");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_THAT(r.out, HasSubstr("cache 'nc': 8 pages, 5 free\n"));
  EXPECT_THAT(r.out, HasSubstr("keys now: 3 published, 0 being stored, 0 pinned\n"));
  EXPECT_THAT(r.out, HasSubstr("1 hits, 1 misses (hit rate 50.0%); 3 stored"));
  r = Ctl("--json cache-stats nc");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_THAT(r.out, HasSubstr("\"published\":3,"));

  r = Ctl("cache-lookup nc h0 h1 h9");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_THAT(r.out, HasSubstr("  h0: present\n  h1: present\n  h9: absent\n"));
  EXPECT_THAT(r.out, HasSubstr("2 of 3 key(s) present from the first (cache 'nc')"));
  r = Ctl("--hex-keys cache-lookup nc 01ff 6830");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_THAT(r.out, HasSubstr("  01ff: present\n  6830: present\n"));
  r = Ctl("--json cache-lookup nc h0 h9");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_THAT(r.out, HasSubstr(R"("prefix":1,"keys":[{"key":"h0","state":"CACHE_KEY_PRESENT"})"));

  r = Ctl("cache-evict nc h1 h9");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_THAT(r.out, HasSubstr("  h1: evicted\n  h9: absent\n1 of 2 key(s) evicted"));
  r = Ctl("cache-lookup nc h0 h1");
  EXPECT_THAT(r.out, HasSubstr("1 of 2 key(s) present from the first"));
}

TEST_F(CacheCommandsTest, EventsResumeAndFollow) {
  CtlRun r = Ctl("cache-events nc");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_THAT(r.out, HasSubstr("1 STORED h0\n2 STORED h1\n3 STORED \\x01\\xff\nnext: --after=3\n"));
  r = Ctl("--hex-keys cache-events nc --after=2");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_EQ(r.out, "3 STORED 01ff\nnext: --after=3\n");
  r = Ctl("--json cache-events nc --after=1");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_THAT(r.out, HasSubstr(R"({"cache":"nc","seq":2,"kind":"STORED","key":"h1"})"));

  // --follow prints what comes after it started, until SIGINT (exit 0).
  FILE* pipe = ::popen(absl::StrCat("timeout --preserve-status -s INT 3 ",
                                    Command("cache-events nc --after=3 --follow --interval=100ms"))
                           .c_str(),
                       "r");
  ASSERT_NE(pipe, nullptr);
  absl::SleepFor(absl::Milliseconds(500));
  ASSERT_NO_FATAL_FAILURE(Store({"late"}));
  ASSERT_TRUE(client_->CacheEvict("nc", {"h0"}).ok());
  r = Finish(pipe);
  EXPECT_EQ(r.exit_code, 0) << r.out;
  EXPECT_THAT(r.out, HasSubstr("4 STORED late\n5 EVICTED h0\n"));
  EXPECT_THAT(r.out, HasSubstr("next: --after=5"));
  EXPECT_THAT(r.out, Not(HasSubstr("STORED h1")));
}

TEST_F(CacheCommandsTest, RefusalsSayWhy) {
  CtlRun r = Ctl("cache-lookup nc h0", "wrong-token");
  EXPECT_EQ(r.exit_code, 1) << r.out;
  EXPECT_THAT(r.out, HasSubstr("PERMISSION_DENIED"));
  EXPECT_THAT(r.out, Not(HasSubstr("present")));
  r = Ctl("--hex-keys cache-lookup nc 0g");
  EXPECT_EQ(r.exit_code, 2) << r.out;
  EXPECT_THAT(r.out, HasSubstr("cache-lookup: '0g' is not a key in hex"));
  r = Ctl("cache-stats nowhere");
  EXPECT_EQ(r.exit_code, 1) << r.out;
  EXPECT_THAT(r.out, HasSubstr("NOT_FOUND"));
}

}  // namespace
}  // namespace kvhost
