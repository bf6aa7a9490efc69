// kvhost_populate_bench: how long a pool's memory takes to reserve and map,
// against posix_fallocate of the same size in the same run (the floor: the
// kernel zeroing the pages), and how long it takes to release.
//
// Per size: (1) fallocate alone; (2) ShmRegion::Create, today's path
// (chunked fallocate + MADV_POPULATE_WRITE on several threads,
// server/pool/populate.h); (3) the old path, fallocate then
// mmap(MAP_POPULATE) on one thread. Each is followed by its release (munmap,
// unlink) timed apart. One JSON object per size on stdout.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "server/pool/populate.h"
#include "server/pool/shm_region.h"

ABSL_FLAG(std::string, dir, "/dev/shm", "directory (tmpfs) for the files");
ABSL_FLAG(std::string, sizes_gib, "1,2,4", "sizes in GiB, comma-separated (fractions allowed)");
ABSL_FLAG(bool, quick, false, "CI smoke: 64 MiB only");

namespace {

using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

struct Times {
  double create = 0;
  double release = 0;
};

std::string PathFor(const std::string& dir, const char* what) {
  return absl::StrCat(dir, "/kvhost_populate_bench.", ::getpid(), ".", what);
}

// (1) posix_fallocate alone; release = close + unlink (frees the pages).
Times Fallocate(const std::string& dir, uint64_t bytes) {
  const std::string path = PathFor(dir, "fallocate");
  Times t;
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) {
    std::perror(path.c_str());
    std::exit(1);
  }
  auto start = Clock::now();
  if (::posix_fallocate(fd, 0, static_cast<off_t>(bytes)) != 0) {
    std::fprintf(stderr, "fallocate %s failed\n", path.c_str());
    std::exit(1);
  }
  t.create = Since(start);
  start = Clock::now();
  ::unlink(path.c_str());
  ::close(fd);
  t.release = Since(start);
  return t;
}

// (2) what a pool does now.
Times Region(const std::string& dir, uint64_t bytes) {
  Times t;
  auto start = Clock::now();
  absl::StatusOr<std::unique_ptr<kvhost::ShmRegion>> region =
      kvhost::ShmRegion::Create(PathFor(dir, "region"), bytes);
  if (!region.ok()) {
    std::fprintf(stderr, "ShmRegion::Create: %s\n", region.status().ToString().c_str());
    std::exit(1);
  }
  t.create = Since(start);
  start = Clock::now();
  region->reset();
  t.release = Since(start);
  return t;
}

// (3) the old path: fallocate, then one mmap(MAP_POPULATE).
Times MapPopulate(const std::string& dir, uint64_t bytes) {
  const std::string path = PathFor(dir, "map_populate");
  Times t;
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) {
    std::perror(path.c_str());
    std::exit(1);
  }
  auto start = Clock::now();
  if (::posix_fallocate(fd, 0, static_cast<off_t>(bytes)) != 0) std::exit(1);
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  if (p == MAP_FAILED) std::exit(1);
  t.create = Since(start);
  start = Clock::now();
  ::munmap(p, bytes);
  ::unlink(path.c_str());
  ::close(fd);
  t.release = Since(start);
  return t;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const std::string dir = absl::GetFlag(FLAGS_dir);
  std::vector<uint64_t> sizes;
  if (absl::GetFlag(FLAGS_quick)) {
    sizes.push_back(uint64_t{64} << 20);
  } else {
    for (absl::string_view part : absl::StrSplit(absl::GetFlag(FLAGS_sizes_gib), ',')) {
      double gib = 0;
      if (!absl::SimpleAtod(part, &gib) || gib <= 0) {
        std::fprintf(stderr, "bad --sizes_gib entry '%s'\n", std::string(part).c_str());
        return 2;
      }
      sizes.push_back(static_cast<uint64_t>(gib * (uint64_t{1} << 30)) / 4096 * 4096);
    }
  }
  const int threads = kvhost::PopulateThreads(uint64_t{1} << 40, kvhost::PopulateOptions());
  for (uint64_t bytes : sizes) {
    const Times f = Fallocate(dir, bytes);
    const Times r = Region(dir, bytes);
    const Times m = MapPopulate(dir, bytes);
    const double gib = static_cast<double>(bytes) / (uint64_t{1} << 30);
    std::printf(
        "{\"bytes\": %llu, \"gib\": %.2f, \"threads\": %d, \"fallocate_s\": %.3f, "
        "\"create_s\": %.3f, \"map_populate_s\": %.3f, \"create_vs_fallocate\": %.2f, "
        "\"map_populate_vs_fallocate\": %.2f, \"fallocate_release_s\": %.3f, "
        "\"create_release_s\": %.3f, \"map_populate_release_s\": %.3f}\n",
        static_cast<unsigned long long>(bytes), gib, threads, f.create, r.create, m.create,
        r.create / f.create, m.create / f.create, f.release, r.release, m.release);
    std::fflush(stdout);
  }
  return 0;
}
