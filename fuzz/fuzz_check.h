// Invariant checks for the fuzz targets: a violated invariant prints what
// was expected and aborts, which libFuzzer reports as a crash and saves the
// input. Used only by fuzz/*.cc.
#ifndef KVHOST_FUZZ_FUZZ_CHECK_H_
#define KVHOST_FUZZ_FUZZ_CHECK_H_

#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace kvhost::fuzz {

[[noreturn]] inline void Fail(const char* file, int line, const std::string& what) {
  std::fprintf(stderr, "%s:%d: invariant violated: %s\n", file, line, what.c_str());
  std::abort();
}

// An error the API may return for bad input: one of `codes`, with a message.
inline bool IsErrorOf(const absl::Status& s, std::initializer_list<absl::StatusCode> codes) {
  if (s.ok() || s.message().empty()) return false;
  for (absl::StatusCode c : codes) {
    if (s.code() == c) return true;
  }
  return false;
}

}  // namespace kvhost::fuzz

#define FUZZ_CHECK(cond, ...)                                                                      \
  do {                                                                                             \
    if (!(cond)) ::kvhost::fuzz::Fail(__FILE__, __LINE__, absl::StrCat(#cond, ": ", __VA_ARGS__)); \
  } while (0)

#endif  // KVHOST_FUZZ_FUZZ_CHECK_H_
