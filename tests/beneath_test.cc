// DirFd (server/pool/beneath.h): every path opened beneath a directory stays
// beneath it, through openat2 and through the component walk alike, and both
// give the same answers.
#include "server/pool/beneath.h"

#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace kvhost {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

// A private directory under /tmp, removed with everything in it.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = "/tmp/kvhost-beneath-XXXXXX";
    if (::mkdtemp(tmpl.data()) != nullptr) path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    if (!path_.empty()) fs::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

void WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out << bytes;
}

std::string ReadFd(int fd) {
  std::string text;
  char buf[256];
  ssize_t n;
  while ((n = ::pread(fd, buf, sizeof(buf), static_cast<off_t>(text.size()))) > 0) {
    text.append(buf, static_cast<size_t>(n));
  }
  return text;
}

// One of the ways to open beneath the directory.
using OpenFn =
    std::function<absl::StatusOr<UniqueFd>(const DirFd&, const std::string&, int, mode_t)>;

struct Way {
  const char* name;
  OpenFn open;
};

const Way kWays[] = {
    {"OpenBeneath",
     [](const DirFd& d, const std::string& p, int f, mode_t m) { return d.OpenBeneath(p, f, m); }},
    {"Openat2", [](const DirFd& d, const std::string& p, int f,
                   mode_t m) { return d.OpenWithOpenat2(p, f, m); }},
    {"Walk",
     [](const DirFd& d, const std::string& p, int f, mode_t m) { return d.OpenByWalk(p, f, m); }},
};

// root/                  the DirFd
//   d/file               "inside"
//   link_last -> d/file  (a symbolic link that stays inside: still refused)
//   link_dir -> d
//   abs -> <outside>/file
//   abs_dir -> <outside>
//   dangling -> <outside>/new
// <outside>/file         "outside"
class BeneathTest : public ::testing::TestWithParam<Way> {
 protected:
  void SetUp() override {
    ASSERT_FALSE(root_dir_.path().empty());
    ASSERT_FALSE(outside_dir_.path().empty());
    root_ = root_dir_.path();
    outside_ = outside_dir_.path();
    fs::create_directory(root_ + "/d");
    WriteFile(root_ + "/d/file", "inside");
    WriteFile(outside_ + "/file", "outside");
    fs::create_symlink("d/file", root_ + "/link_last");
    fs::create_symlink("d", root_ + "/link_dir");
    fs::create_symlink(outside_ + "/file", root_ + "/abs");
    fs::create_symlink(outside_, root_ + "/abs_dir");
    fs::create_symlink(outside_ + "/new", root_ + "/dangling");
    absl::StatusOr<DirFd> dir = DirFd::Open(root_, "shm dir");
    ASSERT_TRUE(dir.ok()) << dir.status();
    dir_ = std::make_unique<DirFd>(*std::move(dir));
    absl::StatusOr<UniqueFd> probe = dir_->OpenWithOpenat2("d/file", O_RDONLY);
    if (std::string(GetParam().name) == "Openat2" && absl::IsUnimplemented(probe.status())) {
      GTEST_SKIP() << "no openat2 here: " << probe.status();
    }
  }

  absl::StatusOr<UniqueFd> Open(const std::string& path, int flags = O_RDONLY, mode_t mode = 0) {
    return GetParam().open(*dir_, path, flags, mode);
  }

  TempDir root_dir_, outside_dir_;
  std::string root_, outside_;
  std::unique_ptr<DirFd> dir_;
};

TEST_P(BeneathTest, OpensFilesBeneath) {
  for (const char* path : {"d/file", "./d/file", "d/./file"}) {
    SCOPED_TRACE(path);
    absl::StatusOr<UniqueFd> fd = Open(path);
    ASSERT_TRUE(fd.ok()) << fd.status();
    EXPECT_EQ(ReadFd(fd->get()), "inside");
  }
  absl::StatusOr<UniqueFd> dir = Open("d", O_RDONLY | O_DIRECTORY);
  EXPECT_TRUE(dir.ok()) << dir.status();
  absl::StatusOr<UniqueFd> self = Open(".", O_RDONLY | O_DIRECTORY);
  EXPECT_TRUE(self.ok()) << self.status();
}

TEST_P(BeneathTest, SymlinkAtTheLastComponentIsRefused) {
  for (const char* path : {"link_last", "abs", "d/../link_last"}) {
    SCOPED_TRACE(path);
    absl::StatusOr<UniqueFd> fd = Open(path, O_RDWR);
    ASSERT_EQ(fd.status().code(), absl::StatusCode::kPermissionDenied) << fd.status();
    EXPECT_THAT(fd.status().message(), HasSubstr("outside the shm dir"));
  }
}

TEST_P(BeneathTest, SymlinkInAMiddleComponentIsRefused) {
  for (const char* path : {"link_dir/file", "abs_dir/file", "d/../abs_dir/file"}) {
    SCOPED_TRACE(path);
    absl::StatusOr<UniqueFd> fd = Open(path, O_RDWR);
    ASSERT_EQ(fd.status().code(), absl::StatusCode::kPermissionDenied) << fd.status();
    EXPECT_THAT(fd.status().message(), HasSubstr("outside the shm dir"));
  }
}

TEST_P(BeneathTest, DotDotIsRefusedEvenWhenItStaysInside) {
  const std::string outside_name = fs::path(outside_).filename();
  for (const std::string& path : {absl::StrCat("../", outside_name, "/file"),
                                  std::string("d/../d/file"), std::string("..")}) {
    SCOPED_TRACE(path);
    absl::StatusOr<UniqueFd> fd = Open(path);
    ASSERT_EQ(fd.status().code(), absl::StatusCode::kPermissionDenied) << fd.status();
    EXPECT_THAT(fd.status().message(), HasSubstr("'..'"));
  }
}

TEST_P(BeneathTest, MalformedPathsAreInvalid) {
  for (const std::string& path :
       {std::string(""), std::string("/etc/passwd"), std::string("d//file"), std::string("d/file/"),
        std::string("d/file\0x", 8)}) {
    SCOPED_TRACE(path);
    absl::StatusOr<UniqueFd> fd = Open(path);
    EXPECT_EQ(fd.status().code(), absl::StatusCode::kInvalidArgument) << fd.status();
  }
  // The NUL is named, escaped, not cut.
  absl::StatusOr<UniqueFd> nul = Open(std::string("d/file\0x", 8));
  EXPECT_THAT(nul.status().message(), HasSubstr("d/file\\000x"));
}

TEST_P(BeneathTest, WrongFileTypesAndMissingFiles) {
  // A directory where a file is expected.
  EXPECT_EQ(Open("d", O_RDWR).status().code(), absl::StatusCode::kInvalidArgument);
  // A file where a directory is expected.
  EXPECT_EQ(Open("d/file/x").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Open("missing").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(Open("d/missing").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(Open("missing/file").status().code(), absl::StatusCode::kNotFound);
}

TEST_P(BeneathTest, CreateNeverFollowsOrReplaces) {
  const int create = O_RDWR | O_CREAT | O_EXCL;
  absl::StatusOr<UniqueFd> fresh = Open("d/new", create, 0600);
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  struct stat st;
  ASSERT_EQ(::fstat(fresh->get(), &st), 0);
  EXPECT_TRUE(S_ISREG(st.st_mode));
  // A name that exists, as a file or as a symbolic link (dangling or not),
  // is ALREADY_EXISTS, and the link's target is neither made nor touched.
  for (const char* path : {"d/new", "abs", "dangling"}) {
    SCOPED_TRACE(path);
    EXPECT_EQ(Open(path, create, 0600).status().code(), absl::StatusCode::kAlreadyExists);
  }
  EXPECT_FALSE(fs::exists(outside_ + "/new"));
  std::ifstream in(outside_ + "/file");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(text, "outside");
  // Not through a symbolic link to a directory either.
  EXPECT_EQ(Open("abs_dir/new", create, 0600).status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_FALSE(fs::exists(outside_ + "/new"));
}

INSTANTIATE_TEST_SUITE_P(Ways, BeneathTest, ::testing::ValuesIn(kWays),
                         [](const ::testing::TestParamInfo<Way>& info) { return info.param.name; });

// The walk is what gVisor gets: it must answer exactly as openat2 does.
TEST(BeneathSameAnswers, WalkAgreesWithOpenat2) {
  TempDir root, outside;
  ASSERT_FALSE(root.path().empty());
  fs::create_directories(root.path() + "/a/b");
  WriteFile(root.path() + "/a/b/f", "x");
  fs::create_symlink("b", root.path() + "/a/lb");
  fs::create_symlink("f", root.path() + "/a/b/lf");
  fs::create_symlink(outside.path(), root.path() + "/out");
  absl::StatusOr<DirFd> dir = DirFd::Open(root.path(), "shm dir");
  ASSERT_TRUE(dir.ok()) << dir.status();
  if (absl::IsUnimplemented(dir->OpenWithOpenat2("a", O_RDONLY).status())) {
    GTEST_SKIP() << "no openat2 here";
  }
  const std::vector<std::string> paths = {
      "a/b/f",      "a/lb/f",    "a/b/lf", "out", "out/x", "a/b/f/x", "a/b",  "a/b/missing",
      "a/../a/b/f", "./a/./b/f", "a//b",   "",    "/a",    "nope/f",  "a/lb", "a/b/f/"};
  for (int flags : {O_RDONLY, O_RDWR, O_RDONLY | O_DIRECTORY, O_RDWR | O_CREAT | O_EXCL}) {
    for (const std::string& path : paths) {
      SCOPED_TRACE(absl::StrCat(path, " flags ", flags));
      absl::StatusOr<UniqueFd> a = dir->OpenWithOpenat2(path, flags, 0600);
      // What the first made, the second must not find missing.
      if (a.ok() && (flags & O_CREAT) != 0) ::unlinkat(dir->fd(), path.c_str(), 0);
      absl::StatusOr<UniqueFd> b = dir->OpenByWalk(path, flags, 0600);
      if (b.ok() && (flags & O_CREAT) != 0) ::unlinkat(dir->fd(), path.c_str(), 0);
      EXPECT_EQ(a.status().code(), b.status().code()) << a.status() << " vs " << b.status();
    }
  }
}

TEST(BeneathLimits, OutOfDescriptorsIsResourceExhausted) {
  TempDir root;
  ASSERT_FALSE(root.path().empty());
  WriteFile(root.path() + "/f", "x");
  absl::StatusOr<DirFd> dir = DirFd::Open(root.path(), "shm dir");
  ASSERT_TRUE(dir.ok()) << dir.status();
  struct rlimit saved;
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &saved), 0);
  struct rlimit low = saved;
  low.rlim_cur = 64;
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &low), 0);
  std::vector<int> fillers;
  for (int fd; (fd = ::dup(0)) >= 0;) fillers.push_back(fd);
  absl::StatusOr<UniqueFd> via2 = dir->OpenWithOpenat2("f", O_RDONLY);
  absl::StatusOr<UniqueFd> walk = dir->OpenByWalk("f", O_RDONLY);
  absl::StatusOr<DirFd> another = DirFd::Open(root.path(), "shm dir");
  for (int fd : fillers) ::close(fd);
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &saved), 0);
  if (!absl::IsUnimplemented(via2.status())) {
    EXPECT_EQ(via2.status().code(), absl::StatusCode::kResourceExhausted) << via2.status();
    EXPECT_THAT(via2.status().message(), HasSubstr("out of file descriptors"));
  }
  EXPECT_EQ(walk.status().code(), absl::StatusCode::kResourceExhausted) << walk.status();
  EXPECT_THAT(walk.status().message(), HasSubstr("out of file descriptors"));
  EXPECT_EQ(another.status().code(), absl::StatusCode::kResourceExhausted) << another.status();
}

TEST(BeneathDir, NotADirectoryAndFreeBytes) {
  TempDir root;
  ASSERT_FALSE(root.path().empty());
  WriteFile(root.path() + "/f", "x");
  EXPECT_EQ(DirFd::Open(root.path() + "/f").status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(DirFd::Open(root.path() + "/missing").status().code(),
            absl::StatusCode::kFailedPrecondition);
  absl::StatusOr<DirFd> dir = DirFd::Open(root.path() + "///");
  ASSERT_TRUE(dir.ok()) << dir.status();
  EXPECT_EQ(dir->path(), root.path());
  EXPECT_EQ(dir->Join("x"), root.path() + "/x");
  absl::StatusOr<uint64_t> free_bytes = dir->FreeBytes();
  ASSERT_TRUE(free_bytes.ok()) << free_bytes.status();
  EXPECT_GT(*free_bytes, 0u);
}

}  // namespace
}  // namespace kvhost
