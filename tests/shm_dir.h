// ShmDir: a private directory under /dev/shm for tests that map files there
// (host engine "device" files, pool regions), removed with everything in it.
// Header only, for test binaries.
#ifndef KVHOST_TESTS_SHM_DIR_H_
#define KVHOST_TESTS_SHM_DIR_H_

#include <stdlib.h>

#include <filesystem>
#include <string>
#include <vector>

namespace kvhost::testing {

class ShmDir {
 public:
  // The directory is /dev/shm/<prefix>-XXXXXX; path() is empty if it could
  // not be made.
  explicit ShmDir(const std::string& prefix) {
    std::string tmpl = "/dev/shm/" + prefix + "-XXXXXX";
    if (::mkdtemp(tmpl.data()) != nullptr) path_ = tmpl;
  }
  ~ShmDir() {
    std::error_code ec;
    if (!path_.empty()) std::filesystem::remove_all(path_, ec);
  }
  ShmDir(const ShmDir&) = delete;
  ShmDir& operator=(const ShmDir&) = delete;
  const std::string& path() const { return path_; }
  // The names of the directory's entries, in no particular order.
  std::vector<std::string> Files() const {
    std::vector<std::string> out;
    for (const auto& e : std::filesystem::directory_iterator(path_)) {
      out.push_back(e.path().filename());
    }
    return out;
  }

 private:
  std::string path_;
};

}  // namespace kvhost::testing

#endif  // KVHOST_TESTS_SHM_DIR_H_
