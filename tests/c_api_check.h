/* The check macros of the C tests of the C ABI (c_api_test.c,
 * c_api_gpu_test.c). A check function declares `char err[N]` (the calls'
 * error buffer, E) and takes `char* why, size_t why_len`; a failed check
 * writes file:line and what it saw into `why` and jumps to the function's
 * `done:` label, which releases what it made. */
#ifndef KVHOST_TESTS_C_API_CHECK_H_
#define KVHOST_TESTS_C_API_CHECK_H_

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "kvhost/kvhost_c.h"

#define E err, sizeof(err)

static inline void fail_at(char* why, size_t why_len, const char* file, int line, const char* fmt,
                           ...) {
  size_t n;
  va_list args;
  snprintf(why, why_len, "%s:%d: ", file, line);
  n = strlen(why);
  va_start(args, fmt);
  vsnprintf(why + n, why_len - n, fmt, args);
  va_end(args);
}

#define CHECK(cond, ...)                                      \
  do {                                                        \
    if (!(cond)) {                                            \
      fail_at(why, why_len, __FILE__, __LINE__, __VA_ARGS__); \
      goto done;                                              \
    }                                                         \
  } while (0)

#define EXPECT_CODE(want, call)                                                \
  do {                                                                         \
    int rc_ = (call);                                                          \
    if (rc_ != (want)) {                                                       \
      fail_at(why, why_len, __FILE__, __LINE__, "%s: %s (%s), want %s", #call, \
              kvhost_code_name(rc_), err, kvhost_code_name(want));             \
      goto done;                                                               \
    }                                                                          \
  } while (0)

#define OK(call) EXPECT_CODE(KVHOST_OK, call)

#define CONTAINS(text, part) \
  CHECK(strstr((text), (part)) != NULL, "'%s' does not contain '%s'", (text), (part))

#endif /* KVHOST_TESTS_C_API_CHECK_H_ */
