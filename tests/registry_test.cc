// Tests of PoolRegistry (server/pool/registry.h): the host memory limit (mem
// available, cgroup, the shm file system, all pools together), names, region
// files that go with their pool and the stale ones of dead daemons, followers,
// replicas, owner tokens, and the bytes of deleted pools still being released.
// Host memory figures are faked through RegistryOptions::read_memory; region
// files live in a private directory under /dev/shm.
#include "server/pool/registry.h"
#include "server/access/caller.h"

#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "domain_test_util.h"
#include "pool_test_util.h"
#include "server/pool/pool.h"
#include "server/pool/shm_region.h"

namespace kvhost {
namespace {

using ::kvhost::testing::FakeMemory;
using ::kvhost::testing::kGB;
using ::kvhost::testing::KindRegistryTest;
using ::kvhost::testing::KindSpec;
using ::kvhost::testing::MegabyteTokenSpec;
using ::kvhost::testing::MhaSpec;
using ::kvhost::testing::Msg;
using ::kvhost::testing::Options;
using ::kvhost::testing::RegistryTest;
using ::testing::HasSubstr;
using ::testing::Not;
namespace fs = std::filesystem;

// Deleted pools are unmapped on the registry's releaser thread: true once
// every deleted pool's bytes are back (within 10 s).
bool WaitForReleases(const PoolRegistry& reg) {
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (reg.releasing_bytes() != 0) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(1));
  }
  return true;
}

TEST_F(RegistryTest, RefusesWhenMemAvailableIsShort) {
  mem_.snapshot.mem_available = 10 * kGB;
  RegistryOptions o = Options(dir_.path(), &mem_);
  o.memory_reserve = 1 * kGB;
  PoolRegistry reg(o);
  absl::StatusOr<std::shared_ptr<Pool>> p = reg.Create("big", MegabyteTokenSpec(12000));
  ASSERT_EQ(p.status().code(), absl::StatusCode::kResourceExhausted) << p.status();
  EXPECT_THAT(Msg(p.status()), HasSubstr("12000000000 bytes"));             // requested
  EXPECT_THAT(Msg(p.status()), HasSubstr("(9000000000 bytes) available"));  // 10 - 1 reserve
  EXPECT_THAT(Msg(p.status()), HasSubstr("'big'"));
  EXPECT_EQ(mem_.reads, 1);
  EXPECT_TRUE(reg.List().empty());
  EXPECT_EQ(reg.used_bytes(), 0u);
  EXPECT_TRUE(dir_.Files().empty());
  // 9 GB is the limit: a 16 MB pool fits.
  EXPECT_TRUE(reg.Create("small", MegabyteTokenSpec(16)).ok());
}

TEST_F(RegistryTest, CgroupLimitIsCounted) {
  mem_.snapshot.cgroup_limit = 5 * kGB;
  mem_.snapshot.cgroup_usage = 1 * kGB;
  mem_.snapshot.cgroup_source = "v2";
  PoolRegistry reg(Options(dir_.path(), &mem_));
  absl::StatusOr<std::shared_ptr<Pool>> p = reg.Create("big", MegabyteTokenSpec(4512));
  ASSERT_EQ(p.status().code(), absl::StatusCode::kResourceExhausted) << p.status();
  EXPECT_THAT(Msg(p.status()), HasSubstr("4512000000 bytes"));
  EXPECT_THAT(Msg(p.status()), HasSubstr("(4000000000 bytes) available"));  // 5 GB - 1 GB used
  // The cgroup's usage counts: 10 MB left cannot hold 16 MB.
  mem_.snapshot.cgroup_usage = 5 * kGB - 10000000;
  p = reg.Create("small", MegabyteTokenSpec(16));
  ASSERT_EQ(p.status().code(), absl::StatusCode::kResourceExhausted) << p.status();
  EXPECT_THAT(Msg(p.status()), HasSubstr("(16000000 bytes: 1 pages"));    // 16 MB requested
  EXPECT_THAT(Msg(p.status()), HasSubstr("(10000000 bytes) available"));  // 10 MB free
  mem_.snapshot.cgroup_usage = 1 * kGB;
  EXPECT_TRUE(reg.Create("small", MegabyteTokenSpec(16)).ok());
}

// The region files live on the shm dir's file system: a tmpfs smaller than
// the memory holds only what it has free (4 GiB reported on a 64 MiB
// tmpfs).
TEST_F(RegistryTest, ShmFilesystemFreeSpaceIsCounted) {
  mem_.fs_free = 20000000;  // 20 MB free on the tmpfs, 500 GB of memory
  PoolRegistry reg(Options(dir_.path(), &mem_));
  std::string why;
  absl::StatusOr<uint64_t> available = reg.Available(&why);
  ASSERT_TRUE(available.ok()) << available.status();
  EXPECT_EQ(*available, 20000000u);
  EXPECT_THAT(why, HasSubstr(absl::StrCat("shm filesystem ", dir_.path(), " has 19.07 MiB free")));
  absl::StatusOr<std::shared_ptr<Pool>> p = reg.Create("big", MegabyteTokenSpec(32));
  ASSERT_EQ(p.status().code(), absl::StatusCode::kResourceExhausted) << p.status();
  EXPECT_THAT(Msg(p.status()), HasSubstr("shm filesystem"));
  EXPECT_TRUE(dir_.Files().empty());
  EXPECT_TRUE(reg.Create("small", MegabyteTokenSpec(16)).ok());
  // The default reads the directory's own file system.
  RegistryOptions real = Options(dir_.path(), &mem_);
  real.read_fs_free = RegistryOptions().read_fs_free;
  struct statvfs vfs;
  ASSERT_EQ(::statvfs(dir_.path().c_str(), &vfs), 0);
  absl::StatusOr<uint64_t> real_free = real.read_fs_free(*DirFd::Open(dir_.path()));
  ASSERT_TRUE(real_free.ok()) << real_free.status();
  const uint64_t expected = uint64_t{vfs.f_bavail} * vfs.f_frsize;
  EXPECT_NEAR(static_cast<double>(*real_free), static_cast<double>(expected), 64.0 * 1048576);
}

TEST_F(RegistryTest, MemoryLimitSpansAllPools) {
  RegistryOptions o = Options(dir_.path(), &mem_);
  o.memory_limit = 40000000;  // 40 MB for all pools
  PoolRegistry reg(o);
  ASSERT_TRUE(reg.Create("a", MegabyteTokenSpec(16)).ok());
  ASSERT_TRUE(reg.Create("b", MegabyteTokenSpec(16)).ok());
  EXPECT_EQ(reg.used_bytes(), 32000000u);
  absl::StatusOr<std::shared_ptr<Pool>> c = reg.Create("c", MegabyteTokenSpec(16));
  ASSERT_EQ(c.status().code(), absl::StatusCode::kResourceExhausted) << c.status();
  EXPECT_THAT(Msg(c.status()), HasSubstr("--memory-limit"));
  EXPECT_THAT(Msg(c.status()), HasSubstr("(8000000 bytes) available"));  // 8 MB left
  absl::StatusOr<uint64_t> freed = reg.Delete("a");
  ASSERT_TRUE(freed.ok());
  EXPECT_EQ(*freed, 16000000u);
  EXPECT_EQ(reg.used_bytes(), 16000000u);
  // Its memory counts until the releaser thread has unmapped it.
  ASSERT_TRUE(WaitForReleases(reg));
  EXPECT_TRUE(reg.Create("c", MegabyteTokenSpec(16)).ok());
  EXPECT_EQ(reg.used_bytes(), 32000000u);
}

TEST_F(RegistryTest, MemoryReadErrorIsReturned) {
  mem_.error = absl::FailedPreconditionError("cannot read /proc/meminfo");
  PoolRegistry reg(Options(dir_.path(), &mem_));
  absl::StatusOr<std::shared_ptr<Pool>> p = reg.Create("a", MegabyteTokenSpec(16));
  EXPECT_EQ(p.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(Msg(p.status()), HasSubstr("/proc/meminfo"));
  EXPECT_TRUE(dir_.Files().empty());
}

TEST_F(RegistryTest, OverflowingSizeIsRefusedNotWrapped) {
  // See ResolveSizeTokensTest.RefusesSizesWhoseBytesOverflow: the wrapped
  // size (2 GiB) would fit in memory; the pool must be refused as a bad spec.
  mem_.snapshot.mem_available = 1 * kGB;
  PoolRegistry reg(Options(dir_.path(), &mem_));
  PoolSpec s = MhaSpec();
  s.head_num = 1u << 14, s.head_dim = 1u << 15, s.layer_num = 1, s.page_size = 1;
  s.size_tokens = (uint64_t{1} << 33) + 1;
  EXPECT_EQ(reg.Create("huge", s).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(dir_.Files().empty());
}

TEST_F(RegistryTest, AlreadyExistsAndNotFound) {
  PoolRegistry reg(Options(dir_.path(), &mem_));
  absl::StatusOr<std::shared_ptr<Pool>> a = reg.Create("a", MegabyteTokenSpec(16));
  ASSERT_TRUE(a.ok()) << a.status();
  absl::StatusOr<std::shared_ptr<Pool>> dup = reg.Create("a", MegabyteTokenSpec(32));
  EXPECT_EQ(dup.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(Msg(dup.status()), HasSubstr("'a'"));
  EXPECT_EQ(reg.List().size(), 1u);
  EXPECT_EQ((*reg.Get("a"))->size_tokens(), 16u);  // the first one stays
  EXPECT_EQ(reg.used_bytes(), 16000000u);

  absl::StatusOr<std::shared_ptr<Pool>> missing = reg.Get("nope");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(Msg(missing.status()), HasSubstr("'nope'"));
  absl::StatusOr<uint64_t> del = reg.Delete("nope");
  EXPECT_EQ(del.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(Msg(del.status()), HasSubstr("'nope'"));
  ASSERT_TRUE(reg.Delete("a").ok());
  EXPECT_EQ(reg.Delete("a").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(reg.Get("a").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(RegistryTest, ListIsByName) {
  PoolRegistry reg(Options(dir_.path(), &mem_));
  for (const char* n : {"c", "a", "b"}) ASSERT_TRUE(reg.Create(n, MegabyteTokenSpec(16)).ok());
  std::vector<std::string> names;
  for (const auto& p : reg.List()) names.push_back(p->name());
  EXPECT_EQ(names, (std::vector<std::string>{"a", "b", "c"}));
}

TEST_F(RegistryTest, DeleteRefusedWhileAttached) {
  PoolRegistry reg(Options(dir_.path(), &mem_));
  absl::StatusOr<std::shared_ptr<Pool>> p = reg.Create("a", MegabyteTokenSpec(16));
  ASSERT_TRUE(p.ok());
  ASSERT_TRUE((*p)->AcquireAttachment().ok());
  ASSERT_TRUE((*p)->AcquireAttachment().ok());
  EXPECT_EQ((*p)->attachments(), 2u);
  absl::StatusOr<uint64_t> del = reg.Delete("a");
  EXPECT_EQ(del.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(Msg(del.status()), HasSubstr("2 device attachment"));
  EXPECT_TRUE(reg.Get("a").ok());
  EXPECT_EQ(reg.used_bytes(), 16000000u);
  (*p)->ReleaseAttachment();
  EXPECT_EQ(reg.Delete("a").status().code(), absl::StatusCode::kFailedPrecondition);
  (*p)->ReleaseAttachment();
  absl::StatusOr<uint64_t> ok = reg.Delete("a");
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(*ok, 16000000u);
  EXPECT_EQ(reg.used_bytes(), 0u);
  // A deleted pool takes no new attachments.
  absl::Status late = (*p)->AcquireAttachment();
  EXPECT_EQ(late.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*p)->attachments(), 0u);
}

TEST(PoolNameTest, Validation) {
  for (const std::string& good : {std::string("a"), std::string("llama-70b_v2.kv"),
                                  std::string("A9"), std::string(64, 'x')}) {
    EXPECT_TRUE(ValidatePoolName(good).ok()) << good;
  }
  for (const std::string& bad : {std::string(""), std::string(65, 'x'), std::string(".hidden"),
                                 std::string("a/b"), std::string("a b"), std::string(".."),
                                 std::string("naïve"), std::string("a\nb"), std::string("x*")}) {
    absl::Status s = ValidatePoolName(bad);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

TEST_F(RegistryTest, BadNameOrSpecCreatesNothing) {
  PoolRegistry reg(Options(dir_.path(), &mem_));
  EXPECT_EQ(reg.Create("../evil", MegabyteTokenSpec(16)).status().code(),
            absl::StatusCode::kInvalidArgument);
  PoolSpec bad = MegabyteTokenSpec(16);
  bad.page_size = 0;
  absl::StatusOr<std::shared_ptr<Pool>> p = reg.Create("ok", bad);
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Msg(p.status()), HasSubstr("spec.page_size"));
  EXPECT_THAT(Msg(p.status()), HasSubstr("pool 'ok'"));
  EXPECT_TRUE(dir_.Files().empty());
  EXPECT_TRUE(reg.List().empty());
}

TEST_F(RegistryTest, RegionFileHasExactSizeAndGoesWithThePool) {
  PoolRegistry reg(Options(dir_.path(), &mem_));
  EXPECT_EQ(reg.region_prefix(), absl::StrCat(dir_.path(), "/kvhost.", ::getpid(), "."));
  PoolSpec s = MhaSpec();  // 16384 bytes per token
  s.size_tokens = 1000;    // -> 1008 tokens
  absl::StatusOr<std::shared_ptr<Pool>> p = reg.Create("llama", s);
  ASSERT_TRUE(p.ok()) << p.status();
  const uint64_t bytes = 1008u * 16384;
  EXPECT_EQ((*p)->bytes(), bytes);
  EXPECT_EQ(reg.used_bytes(), bytes);
  std::vector<std::string> paths = (*p)->region_paths();
  ASSERT_EQ(paths.size(), 1u);
  EXPECT_EQ(fs::path(paths[0]).parent_path(), fs::path(dir_.path()));
  EXPECT_EQ(paths[0].rfind(reg.region_prefix(), 0), 0u) << paths[0];
  struct stat st;
  ASSERT_EQ(::stat(paths[0].c_str(), &st), 0);
  EXPECT_TRUE(S_ISREG(st.st_mode));
  EXPECT_EQ(static_cast<uint64_t>(st.st_size), bytes);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  // The bytes are mapped and writable end to end.
  (*p)->base()[0] = 1;
  (*p)->base()[bytes - 1] = 2;

  // Deleted: the file goes at once, though a user still holds the pool and
  // its mapping stays valid...
  ASSERT_TRUE(reg.Delete("llama").ok());
  EXPECT_FALSE(fs::exists(paths[0]));
  EXPECT_TRUE(dir_.Files().empty());
  EXPECT_EQ((*p)->base()[bytes - 1], 2);
  // ...so the name can be reused at once, with a fresh file (a new random
  // name part: names cannot be squatted) that the old pool's end leaves alone.
  absl::StatusOr<std::shared_ptr<Pool>> again = reg.Create("llama", s);
  ASSERT_TRUE(again.ok()) << again.status();
  const std::vector<std::string> fresh = (*again)->region_paths();
  ASSERT_EQ(fresh.size(), 1u);
  EXPECT_NE(fresh, paths);
  EXPECT_EQ(fresh[0].rfind(reg.region_prefix(), 0), 0u) << fresh[0];
  p = absl::NotFoundError("dropped");
  EXPECT_TRUE(fs::exists(fresh[0]));
  ASSERT_TRUE(reg.Delete("llama").ok());
  EXPECT_FALSE(fs::exists(fresh[0]));
}

// A caller that gives up while the memory is being reserved (its deadline
// passed) was told the call failed: no pool, no file, no bytes counted, and the
// name is free. While a creation is under way, its name is taken.
TEST_F(RegistryTest, AbandonedCreationLeavesNothing) {
  PoolRegistry reg(Options(dir_.path(), &mem_));
  PoolSpec s = MhaSpec();
  s.size_tokens = 1024;
  bool asked = false;
  absl::StatusOr<std::shared_ptr<Pool>> p = reg.Create("late", s, [&] {
    asked = true;
    // Still being created: the name is taken meanwhile.
    EXPECT_EQ(reg.Create("late", s).status().code(), absl::StatusCode::kAlreadyExists);
    return true;
  });
  EXPECT_TRUE(asked);
  ASSERT_EQ(p.status().code(), absl::StatusCode::kCancelled) << p.status();
  EXPECT_THAT(Msg(p.status()), HasSubstr("'late'"));
  EXPECT_TRUE(reg.List().empty());
  EXPECT_EQ(reg.used_bytes(), 0u);
  EXPECT_TRUE(dir_.Files().empty());
  absl::StatusOr<std::shared_ptr<Pool>> again = reg.Create("late", s, [] { return false; });
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(reg.used_bytes(), (*again)->bytes());
}

// Owner checks resolve once (issue 29, finding 1): Resolve checks the token on
// the object it returns, and a name still being created is resolved as what
// it is, FAILED_PRECONDITION whatever the token, never a pass that a later
// lookup could turn into the finished, protected pool.
TEST_F(RegistryTest, ResolveRefusesAPoolStillBeingCreated) {
  PoolRegistry reg(Options(dir_.path(), &mem_));
  const std::string token = "victim-token", wrong = "attacker-token";
  int asked = 0;
  absl::StatusOr<std::shared_ptr<Pool>> p = reg.Create(
      "victim", MhaSpec(),
      [&] {
        // The creation's last question: its memory is ready, its name not yet a pool.
        ++asked;
        for (const std::string* t : {static_cast<const std::string*>(nullptr), &wrong, &token}) {
          absl::StatusOr<PoolTarget> r = reg.Resolve("victim", t);
          EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
          EXPECT_THAT(Msg(r.status()), HasSubstr("pool 'victim' is still being created"));
        }
        return false;
      },
      token);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_GT(asked, 0);
  // Created: protected from then on.
  absl::StatusOr<PoolTarget> none = reg.Resolve("victim", nullptr);
  EXPECT_EQ(none.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(Msg(none.status()), HasSubstr("pool 'victim' is owner-protected"));
  EXPECT_EQ(reg.Resolve("victim", &wrong).status().code(), absl::StatusCode::kPermissionDenied);
  absl::StatusOr<PoolTarget> mine = reg.Resolve("victim", &token);
  ASSERT_TRUE(mine.ok()) << mine.status();
  EXPECT_EQ(mine->pool, *p);
  EXPECT_EQ(mine->group, nullptr);
  // A name that is nothing is NOT_FOUND, never a pass.
  absl::StatusOr<PoolTarget> absent = reg.Resolve("absent", nullptr);
  EXPECT_EQ(absent.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(Msg(absent.status()), HasSubstr("'absent'"));
}

// What a call checked is what it acts on: a pool deleted and created again
// under the same name (by its owner, with a token) after an unprotected one
// was resolved is not the resolved object, and DeletePool's step
// (Delete with the resolved pool) leaves it alone.
TEST_F(RegistryTest, DeleteActsOnTheResolvedPoolOnly) {
  PoolRegistry reg(Options(dir_.path(), &mem_));
  ASSERT_TRUE(reg.Create("p", MhaSpec()).ok());
  absl::StatusOr<PoolTarget> stale = reg.Resolve("p", nullptr);  // unprotected: passes
  ASSERT_TRUE(stale.ok()) << stale.status();
  ASSERT_TRUE(reg.Delete("p").ok());
  const std::string token = "owner-token";
  absl::StatusOr<std::shared_ptr<Pool>> owned = reg.Create("p", MhaSpec(), {}, token);
  ASSERT_TRUE(owned.ok()) << owned.status();
  ASSERT_NE(stale->pool, *owned);
  absl::StatusOr<uint64_t> deleted = reg.Delete("p", stale->pool.get());
  EXPECT_EQ(deleted.status().code(), absl::StatusCode::kNotFound) << deleted.status();
  absl::StatusOr<std::shared_ptr<Pool>> still = reg.Get("p");
  ASSERT_TRUE(still.ok()) << still.status();
  EXPECT_EQ(*still, *owned);
  // Its own resolution deletes it.
  absl::StatusOr<PoolTarget> mine = reg.Resolve("p", &token);
  ASSERT_TRUE(mine.ok()) << mine.status();
  EXPECT_TRUE(reg.Delete("p", mine->pool.get()).ok());
}

// A group's name resolves to the group and its anchor pool, checked on every
// entry's pool; a group joins protected pools only with their token (checked
// on the pools it joins, under the registry's lock); DeleteGroup with a
// resolved group removes only that group.
TEST_F(RegistryTest, GroupsResolveOnceAndCheckEveryEntry) {
  PoolRegistry reg(Options(dir_.path(), &mem_));
  const std::string token = "owner-token", wrong = "attacker-token";
  absl::StatusOr<std::shared_ptr<Pool>> p = reg.Create("p", MhaSpec(), {}, token);
  ASSERT_TRUE(p.ok()) << p.status();
  const std::vector<GroupEntrySpec> entries = {{"kv", "p", {}, true}};
  for (const std::string* t : {static_cast<const std::string*>(nullptr), &wrong}) {
    absl::StatusOr<std::shared_ptr<PoolGroup>> g =
        reg.CreateGroup("g", MhaSpec().layer_num, entries, UINT64_MAX, t);
    EXPECT_EQ(g.status().code(), absl::StatusCode::kPermissionDenied) << g.status();
    EXPECT_THAT(Msg(g.status()), HasSubstr("pool 'p' is owner-protected"));
    EXPECT_EQ((*p)->group(), "");
    EXPECT_TRUE(reg.ListGroups().empty());
  }
  absl::StatusOr<std::shared_ptr<PoolGroup>> g =
      reg.CreateGroup("g", MhaSpec().layer_num, entries, UINT64_MAX, &token);
  ASSERT_TRUE(g.ok()) << g.status();
  absl::StatusOr<PoolTarget> refused = reg.Resolve("g", &wrong);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(Msg(refused.status()), HasSubstr("entry 'kv' of group 'g'"));
  absl::StatusOr<PoolTarget> stale = reg.Resolve("g", &token);
  ASSERT_TRUE(stale.ok()) << stale.status();
  EXPECT_EQ(stale->group, *g);
  EXPECT_EQ(stale->pool, *p);
  ASSERT_TRUE(reg.DeleteGroup("g").ok());
  absl::StatusOr<std::shared_ptr<PoolGroup>> again =
      reg.CreateGroup("g", MhaSpec().layer_num, entries, UINT64_MAX, &token);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(reg.DeleteGroup("g", stale->group.get()).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(reg.ListGroups().size(), 1u);
  EXPECT_TRUE(reg.DeleteGroup("g", again->get()).ok());
}

TEST_F(RegistryTest, RegionFilesGoWithTheRegistry) {
  std::string path;
  {
    PoolRegistry reg(Options(dir_.path(), &mem_));
    absl::StatusOr<std::shared_ptr<Pool>> p = reg.Create("a", MegabyteTokenSpec(16));
    ASSERT_TRUE(p.ok());
    path = (*p)->region_paths()[0];
    EXPECT_TRUE(fs::exists(path));
  }
  EXPECT_FALSE(fs::exists(path));
}

// A pid that no longer runs: a child that exited and was reaped.
pid_t DeadPid() {
  pid_t pid = ::fork();
  if (pid == 0) ::_exit(0);
  int status = 0;
  ::waitpid(pid, &status, 0);
  return pid;
}

void Touch(const std::string& path) {
  const int fd = ::open(path.c_str(), O_CREAT | O_WRONLY, 0600);
  ASSERT_GE(fd, 0) << path;
  ASSERT_EQ(::write(fd, "x", 1), 1);
  ::close(fd);
}

TEST_F(RegistryTest, RemoveStaleRegionsOnlyRemovesDeadDaemonsFiles) {
  const pid_t dead = DeadPid();
  ASSERT_GT(dead, 0);
  ASSERT_NE(::kill(dead, 0), 0);
  // A live process other than this one: a child that waits.
  int pipefd[2];
  ASSERT_EQ(::pipe(pipefd), 0);
  const pid_t live = ::fork();
  if (live == 0) {
    char c;
    ::close(pipefd[1]);
    (void)::read(pipefd[0], &c, 1);
    ::_exit(0);
  }
  ::close(pipefd[0]);

  const std::string d = dir_.path() + "/";
  const std::vector<std::string> stale = {
      absl::StrCat("kvhost.", dead, ".llama.kv"),
      absl::StrCat("kvhost.", dead, ".other-pool.v2.kv"),
      // A predecessor with this process's pid (pid 1 again in a container).
      absl::StrCat("kvhost.", ::getpid(), ".before-restart.kv"),
  };
  const std::vector<std::string> kept = {
      absl::StrCat("kvhost.", live, ".theirs.kv"),  // a running process
      "kvhost.1.init.kv",                           // pid 1 runs
      "unrelated.txt",
      absl::StrCat("kvhostx.", dead, ".a.kv"),
      "kvhost.notapid.a.kv",
      absl::StrCat("kvhost.", dead),  // not <prefix>.<pid>.<rest>
      "kvhost.-5.a.kv",
      "kvhost.0.a.kv",
  };
  for (const auto& f : stale) ASSERT_NO_FATAL_FAILURE(Touch(d + f));
  for (const auto& f : kept) ASSERT_NO_FATAL_FAILURE(Touch(d + f));
  // Live regions hold their file's lock, whatever pid the name says: one
  // named like this process's, one like a dead pid's (a daemon in another
  // pid namespace sharing the directory).
  absl::StatusOr<std::unique_ptr<ShmRegion>> mine =
      ShmRegion::Create(d + absl::StrCat("kvhost.", ::getpid(), ".mine.kv"), 4096);
  ASSERT_TRUE(mine.ok()) << mine.status();
  absl::StatusOr<std::unique_ptr<ShmRegion>> other_namespace =
      ShmRegion::Create(d + absl::StrCat("kvhost.", dead, ".elsewhere.kv"), 4096);
  ASSERT_TRUE(other_namespace.ok()) << other_namespace.status();

  PoolRegistry reg(Options(dir_.path(), &mem_));
  EXPECT_EQ(reg.RemoveStaleRegions(), 3);
  for (const auto& f : stale) EXPECT_FALSE(fs::exists(d + f)) << f;
  for (const auto& f : kept) EXPECT_TRUE(fs::exists(d + f)) << f;
  EXPECT_TRUE(fs::exists((*mine)->path()));
  EXPECT_TRUE(fs::exists((*other_namespace)->path()));
  EXPECT_EQ(reg.RemoveStaleRegions(), 0);

  ::close(pipefd[1]);
  int status = 0;
  ::waitpid(live, &status, 0);
}

TEST(RegistryNoDirTest, RemoveStaleRegionsWithoutDirectory) {
  FakeMemory mem;
  PoolRegistry reg(Options("/nonexistent/kvhost-test-dir", &mem));
  EXPECT_EQ(reg.RemoveStaleRegions(), 0);
}

TEST_F(KindRegistryTest, FollowerTakesSizeAndAllocatorOfTheFollowed) {
  PoolRegistry reg(Options(dir_.path(), &mem_));
  std::shared_ptr<Pool> anchor = Make(reg, "anchor", KindSpec(PoolKind::kMha));
  ASSERT_NE(anchor, nullptr);
  PoolSpec k = KindSpec(PoolKind::kKOnly);
  k.page_size = 0;  // inherited
  std::shared_ptr<Pool> follower = Make(reg, "idx", k);
  ASSERT_NE(follower, nullptr);
  EXPECT_EQ(follower->size_tokens(), 64u);
  EXPECT_EQ(follower->spec().page_size, 4u);
  EXPECT_EQ(follower->follows(), anchor);
  EXPECT_EQ(follower->allocator_owner(), anchor.get());
  EXPECT_EQ(anchor->followers(), std::vector<std::string>{"idx"});
  EXPECT_EQ(follower->bytes(), 64u * 2 * 2 * 8 * 2);
  EXPECT_EQ(reg.used_bytes(), anchor->bytes() + follower->bytes());
  // No allocator of its own: Alloc / Free name both pools; nothing changes.
  absl::StatusOr<std::vector<uint64_t>> a = follower->AllocPages(4);
  EXPECT_EQ(a.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(Msg(a.status()), HasSubstr("'idx' (K_ONLY/PAGE_FIRST) follows 'anchor'"));
  const int64_t page[4] = {0, 1, 2, 3};
  EXPECT_EQ(follower->Free(page).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(anchor->allocator().available_tokens(), 64u);
  // Slots allocated in the followed pool are the follower's too.
  ASSERT_TRUE(anchor->AllocPages(4).ok());
  EXPECT_EQ(follower->allocator().available_tokens(), 60u);
  EXPECT_TRUE(follower->allocator().CheckAllocated(page).ok());
  EXPECT_TRUE(follower->CheckPage(0).ok());
  EXPECT_EQ(follower->CheckPage(4).code(), absl::StatusCode::kFailedPrecondition);
  // The followed pool stays while followed.
  absl::StatusOr<uint64_t> del = reg.Delete("anchor");
  EXPECT_EQ(del.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(Msg(del.status()), HasSubstr("followed by idx"));
  EXPECT_TRUE(reg.Get("anchor").ok());
  EXPECT_TRUE(anchor->AcquireAttachment().ok());  // not retired by the refusal
  anchor->ReleaseAttachment();
  ASSERT_TRUE(reg.Delete("idx").ok());
  EXPECT_TRUE(anchor->followers().empty());
  EXPECT_TRUE(reg.Delete("anchor").ok());
}

TEST_F(KindRegistryTest, FollowerErrorsCreateNothing) {
  PoolRegistry reg(Options(dir_.path(), &mem_));
  ASSERT_NE(Make(reg, "anchor", KindSpec(PoolKind::kMha)), nullptr);
  ASSERT_NE(Make(reg, "mla", KindSpec(PoolKind::kMla)), nullptr);
  const uint64_t used = reg.used_bytes();
  const size_t files = dir_.Files().size();
  struct C {
    PoolSpec spec;
    absl::StatusCode code;
    const char* needle;
  };
  std::vector<C> cases;
  PoolSpec s = KindSpec(PoolKind::kKOnly);
  s.follows = "nope";
  cases.push_back({s, absl::StatusCode::kNotFound, "'nope' not found"});
  s = KindSpec(PoolKind::kKOnly);
  s.follows = "mla";
  cases.push_back({s, absl::StatusCode::kInvalidArgument, "is a MLA pool"});
  s = KindSpec(PoolKind::kDsaIndexer);
  cases.push_back({s, absl::StatusCode::kInvalidArgument, "MLA or DSA"});
  s = KindSpec(PoolKind::kKOnly);
  s.page_size = 8;
  cases.push_back({s, absl::StatusCode::kInvalidArgument, "spec.page_size 8"});
  s = KindSpec(PoolKind::kKOnly);
  s.size_tokens = 128;
  cases.push_back({s, absl::StatusCode::kInvalidArgument, "128 tokens"});
  s = KindSpec(PoolKind::kKOnly);
  s.follows.clear();
  cases.push_back({s, absl::StatusCode::kInvalidArgument, "spec.follows is required"});
  for (const C& c : cases) {
    absl::StatusOr<std::shared_ptr<Pool>> p = reg.Create("f", c.spec);
    EXPECT_EQ(p.status().code(), c.code) << p.status();
    EXPECT_THAT(Msg(p.status()), HasSubstr(c.needle));
  }
  s = KindSpec(PoolKind::kKOnly);
  s.size_tokens = 64;  // agreeing sizing is fine
  EXPECT_TRUE(reg.Create("agree", s).ok());
  ASSERT_TRUE(reg.Delete("agree").ok());
  EXPECT_EQ(reg.used_bytes(), used);
  EXPECT_EQ(dir_.Files().size(), files);
  EXPECT_TRUE((*reg.Get("anchor"))->followers().empty());
}

// Regression test: followers of a protected pool were open to anyone.
TEST_F(KindRegistryTest, FollowerIsProtectedByTheFollowedPoolsToken) {
  PoolRegistry reg(Options(dir_.path(), &mem_));
  const std::string token = "s3cret";
  const std::string wrong = "wr0ng";
  ASSERT_TRUE(reg.Create("anchor", KindSpec(PoolKind::kMha), {}, token).ok());
  // Creating one needs the followed pool's token.
  EXPECT_EQ(reg.Create("idx", KindSpec(PoolKind::kKOnly)).status().code(),
            absl::StatusCode::kPermissionDenied);
  absl::StatusOr<std::shared_ptr<Pool>> idx =
      reg.Create("idx", KindSpec(PoolKind::kKOnly), {}, "", &token);
  ASSERT_TRUE(idx.ok()) << idx.status();
  EXPECT_TRUE((*idx)->owner_protected());
  EXPECT_EQ(&(*idx)->token_owner(), reg.Get("anchor")->get());
  // Every protected call checks the followed pool's token.
  absl::Status none = CheckPoolOwner(**idx, nullptr);
  EXPECT_EQ(none.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(Msg(none), HasSubstr("'idx'"));
  EXPECT_THAT(Msg(none), HasSubstr("'anchor'"));
  EXPECT_EQ(CheckPoolOwner(**idx, &wrong).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(CheckPoolOwner(**idx, &token).ok());
  EXPECT_EQ(reg.Resolve("idx", nullptr).status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(reg.Resolve("idx", &wrong).status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(reg.Resolve("idx", &token).ok());
  // Its own owner_token may only be the followed pool's.
  absl::StatusOr<std::shared_ptr<Pool>> same =
      reg.Create("same", KindSpec(PoolKind::kKOnly), {}, token, &token);
  ASSERT_TRUE(same.ok()) << same.status();
  EXPECT_TRUE(CheckPoolOwner(**same, &token).ok());
  EXPECT_EQ(CheckPoolOwner(**same, nullptr).code(), absl::StatusCode::kPermissionDenied);
  const size_t files = dir_.Files().size();
  const uint64_t used = reg.used_bytes();
  absl::StatusOr<std::shared_ptr<Pool>> other =
      reg.Create("other", KindSpec(PoolKind::kKOnly), {}, wrong, &token);
  EXPECT_EQ(other.status().code(), absl::StatusCode::kInvalidArgument) << other.status();
  EXPECT_THAT(Msg(other.status()), HasSubstr("'anchor'"));
  EXPECT_THAT(Msg(other.status()), Not(HasSubstr(wrong)));
  EXPECT_THAT(Msg(other.status()), Not(HasSubstr(token)));
  // A follower of an unprotected pool takes no token of its own either.
  ASSERT_TRUE(reg.Create("open", KindSpec(PoolKind::kMha)).ok());
  PoolSpec f = KindSpec(PoolKind::kKOnly);
  f.follows = "open";
  absl::StatusOr<std::shared_ptr<Pool>> own = reg.Create("own", f, {}, token);
  EXPECT_EQ(own.status().code(), absl::StatusCode::kInvalidArgument) << own.status();
  EXPECT_THAT(Msg(own.status()), HasSubstr("which has none"));
  EXPECT_TRUE(reg.Get("other").status().code() == absl::StatusCode::kNotFound &&
              reg.Get("own").status().code() == absl::StatusCode::kNotFound);
  EXPECT_EQ(dir_.Files().size(), files + (*reg.Get("open"))->region_paths().size());
  EXPECT_EQ(reg.used_bytes(), used + (*reg.Get("open"))->bytes());
}

// Regression test: tokens gRPC metadata cannot carry made a pool that
// nobody could ever open again.
TEST_F(RegistryTest, OwnerTokenOutsidePrintableAsciiIsRefused) {
  PoolRegistry reg(Options(dir_.path(), &mem_));
  const std::string bad[] = {
      std::string("nul\0byte", 8), "caf\xc3\xa9", "with space", "tab\there", "del\x7f", "\n"};
  for (const std::string& token : bad) {
    absl::StatusOr<std::shared_ptr<Pool>> p = reg.Create("p", MegabyteTokenSpec(16), {}, token);
    EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument) << p.status();
    EXPECT_THAT(Msg(p.status()), HasSubstr("printable ASCII"));
    EXPECT_THAT(Msg(p.status()), HasSubstr("'p'"));
    EXPECT_THAT(Msg(p.status()), Not(HasSubstr(token)));
  }
  EXPECT_TRUE(reg.List().empty());
  EXPECT_TRUE(dir_.Files().empty());
  EXPECT_EQ(reg.used_bytes(), 0u);
  EXPECT_TRUE(reg.Create("p", MegabyteTokenSpec(16), {}, "!Az09~").ok());
}

TEST_F(KindRegistryTest, V4StateFollowsLogicalAndQuotesTheSeed) {
  PoolRegistry reg(Options(dir_.path(), &mem_));
  std::shared_ptr<Pool> logical = Make(reg, "anchor", KindSpec(PoolKind::kLogical));
  ASSERT_NE(logical, nullptr);
  EXPECT_EQ(logical->bytes(), 0u);
  EXPECT_TRUE(logical->region_paths().empty());
  std::shared_ptr<Pool> state = Make(reg, "swa", KindSpec(PoolKind::kV4State));
  ASSERT_NE(state, nullptr);
  EXPECT_EQ(state->bytes(), 64u / 4 * 2 * 3 * 8);
  absl::StatusOr<std::vector<uint64_t>> a = state->AllocPages(4);
  EXPECT_EQ(a.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(Msg(a.status()), HasSubstr("reuses SWA transfer indices"));
  EXPECT_TRUE(state->whole_pages());
  EXPECT_FALSE(logical->whole_pages());
}

TEST_F(KindRegistryTest, ReplicatedKindsCountRanksOthersRefuseASecond) {
  PoolRegistry reg(Options(dir_.path(), &mem_));
  std::shared_ptr<Pool> mla = Make(reg, "mla", KindSpec(PoolKind::kMla));
  std::shared_ptr<Pool> mha = Make(reg, "mha", KindSpec(PoolKind::kMha));
  ASSERT_TRUE(mla && mha);
  ASSERT_TRUE(mla->AcquireAttachment(0).ok());
  ASSERT_TRUE(mla->AcquireAttachment(1).ok());
  ASSERT_TRUE(mla->AcquireAttachment(1).ok());
  EXPECT_EQ(mla->replica_ranks(), 2u);
  EXPECT_EQ(mla->bytes_saved(), mla->bytes());
  mla->ReleaseAttachment(1);
  EXPECT_EQ(mla->replica_ranks(), 2u);
  mla->ReleaseAttachment(1);
  EXPECT_EQ(mla->replica_ranks(), 1u);
  EXPECT_EQ(mla->bytes_saved(), 0u);
  ASSERT_TRUE(mha->AcquireAttachment().ok());  // no rank = rank 0
  ASSERT_TRUE(mha->AcquireAttachment(0).ok());
  absl::Status second = mha->AcquireAttachment(1);
  EXPECT_EQ(second.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(Msg(second), HasSubstr("MHA/PAGE_FIRST"));
  EXPECT_THAT(Msg(second), HasSubstr("tp_rank 1"));
  EXPECT_EQ(mha->attachments(), 2u);  // the refusal changed nothing
  EXPECT_EQ(mha->replica_ranks(), 1u);
  EXPECT_EQ(mha->bytes_saved(), 0u);
  mha->ReleaseAttachment();
  mha->ReleaseAttachment(0);
  EXPECT_TRUE(mha->AcquireAttachment(1).ok());  // rank 0 gone: rank 1 may attach
  mha->ReleaseAttachment(1);
  mla->ReleaseAttachment(0);
}

// ---------------------------------------------------------------------------
// Releasing bytes: a deleted pool's memory counts until it is unmapped.

TEST_F(RegistryTest, DeletedPoolCountsAsReleasingUntilItsLastReferenceGoes) {
  RegistryOptions o = Options(dir_.path(), &mem_);
  o.memory_limit = 40000000;  // 40 MB: two 16 MB pools
  PoolRegistry reg(o);
  absl::StatusOr<std::shared_ptr<Pool>> a = reg.Create("a", MegabyteTokenSpec(16));
  ASSERT_TRUE(a.ok());
  std::shared_ptr<Pool> held = *a;  // a stream's reference
  a = absl::UnknownError("dropped");
  ASSERT_TRUE(reg.Create("b", MegabyteTokenSpec(16)).ok());
  ASSERT_TRUE(reg.Delete("a").ok());
  EXPECT_TRUE(held->retired());
  EXPECT_EQ(reg.used_bytes(), 16000000u);
  EXPECT_EQ(reg.releasing_bytes(), 16000000u);
  std::string why;
  absl::StatusOr<uint64_t> avail = reg.Available(&why);
  ASSERT_TRUE(avail.ok());
  EXPECT_EQ(*avail, 8000000u);
  EXPECT_THAT(why, HasSubstr("of deleted pools still mapped"));
  absl::StatusOr<std::shared_ptr<Pool>> c = reg.Create("c", MegabyteTokenSpec(16));
  EXPECT_EQ(c.status().code(), absl::StatusCode::kResourceExhausted) << c.status();
  EXPECT_THAT(Msg(c.status()), HasSubstr("still mapped"));
  held.reset();  // handed to the releaser thread, which unmaps it
  ASSERT_TRUE(WaitForReleases(reg));
  EXPECT_EQ(reg.releasing_bytes(), 0u);
  EXPECT_TRUE(reg.Create("c", MegabyteTokenSpec(16)).ok());
}

TEST_F(RegistryTest, ADeletedPoolMayOutliveTheRegistry) {
  std::shared_ptr<Pool> held;
  {
    PoolRegistry reg(Options(dir_.path(), &mem_));
    absl::StatusOr<std::shared_ptr<Pool>> a = reg.Create("a", MegabyteTokenSpec(16));
    ASSERT_TRUE(a.ok());
    held = *a;
    ASSERT_TRUE(reg.Delete("a").ok());
  }
  held.reset();  // its notice finds no registry: nothing to credit, no crash
  SUCCEED();
}

TEST_F(RegistryTest, TransientReservationsCountAgainstTheMemoryLimit) {
  RegistryOptions o = Options(dir_.path(), &mem_);
  o.memory_limit = 20000000;
  PoolRegistry reg(o);
  ASSERT_TRUE(reg.Create("a", MegabyteTokenSpec(16)).ok());
  absl::StatusOr<TransientReservation> r = reg.ReserveTransient(3000000, "ReadPages of pool 'a'");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(reg.transient_bytes(), 3000000u);
  absl::StatusOr<TransientReservation> over = reg.ReserveTransient(2000000, "WritePages");
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(Msg(over.status()), HasSubstr("--memory-limit"));
  EXPECT_EQ(reg.transient_bytes(), 3000000u);
  EXPECT_EQ(*reg.Available(), 1000000u);
  TransientReservation moved = *std::move(r);
  EXPECT_EQ(reg.transient_bytes(), 3000000u);
  moved = TransientReservation();
  EXPECT_EQ(reg.transient_bytes(), 0u);
  EXPECT_TRUE(reg.ReserveTransient(4000000, "x").ok());  // given back at once
  EXPECT_EQ(reg.transient_bytes(), 0u);
}

}  // namespace
}  // namespace kvhost
