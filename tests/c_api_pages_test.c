/* The C ABI's page streams (kvhost_read_pages, kvhost_write_pages) from C,
 * against a real kvhostd on the host backend: a round trip byte for byte in
 * small chunks, the same bytes as kvhost_get_data_page, the buffer rule (a
 * short buffer is OUT_OF_RANGE with the size needed, before any page is
 * read, and nothing is written), a write of the wrong size refused before
 * anything is sent, the daemon's refusals (a page not allocated, not a page
 * start, listed twice; an unknown pool; a kind without flat pages), and
 * the stream's own contract for a refusal mid-write (the pages before it
 * stay written, and the message says so). Compiled as C99. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "c_api_check.h"
#include "c_api_test.h"
#include "kvhost/kvhost_c.h"

/* MHA, PAGE_FIRST, BF16, 4-token pages, 3 layers, 2 heads of 8: a flat page
 * is 4 tokens x 3 layers x (k, v) x 32 bytes. */
static const char kSpec[] =
    "{\"kind\":\"MHA\",\"layout\":\"PAGE_FIRST\",\"dtype\":\"BF16\",\"page_size\":4,"
    "\"layer_num\":3,\"head_num\":2,\"head_dim\":8,\"size_tokens\":64}";
static const char kAsymmetric[] =
    "{\"kind\":\"MHA_ASYMMETRIC\",\"layout\":\"PAGE_FIRST\",\"dtype\":\"BF16\",\"page_size\":4,"
    "\"layer_num\":3,\"head_num\":2,\"head_dim\":8,\"v_head_dim\":4,\"size_tokens\":64}";

enum { kPageBytes = 4 * 3 * 2 * 32, kPages = 2 };

static void fill(unsigned char* data, size_t n, int seed) {
  size_t i;
  for (i = 0; i < n; ++i) data[i] = (unsigned char)(1 + (seed * 37 + i * 5) % 251);
}

int c_api_test_page_streams(const c_api_test_env* env, char* why, size_t why_len) {
  int result = 1;
  char err[1024];
  int64_t slots[8];
  int64_t starts[kPages];
  int64_t twice[2];
  int64_t bad[2];
  size_t count = 0, size = 0;
  uint64_t written = 0;
  static unsigned char data[kPages * kPageBytes];
  static unsigned char back[kPages * kPageBytes];
  static unsigned char page[kPageBytes];
  kvhost_client* c = NULL;

  OK(kvhost_connect(env->address, 10000, 0, &c, E));
  OK(kvhost_client_wait_ready(c, 20000, E));
  OK(kvhost_pool_create(c, "p", kSpec, E));
  OK(kvhost_alloc(c, "p", 8, slots, 8, &count, E));
  starts[0] = slots[4]; /* out of order on purpose: the given order is kept */
  starts[1] = slots[0];

  /* The size first (NULL, 0), known before any stream. */
  EXPECT_CODE(KVHOST_OUT_OF_RANGE, kvhost_read_pages(c, "p", starts, kPages, 0, NULL, 0, &size, E));
  CHECK(size == sizeof(data), "read_pages needs %zu, want %zu", size, sizeof(data));
  CONTAINS(err, "1536");

  /* Write both pages, in chunks of 100 bytes, and read them back in 7. */
  fill(data, kPageBytes, 1);
  fill(data + kPageBytes, kPageBytes, 2);
  OK(kvhost_write_pages(c, "p", starts, kPages, data, sizeof(data), 100, &written, E));
  CHECK(written == kPages, "pages written %llu", (unsigned long long)written);
  memset(back, 0, sizeof(back));
  OK(kvhost_read_pages(c, "p", starts, kPages, 7, back, sizeof(back), &size, E));
  CHECK(size == sizeof(back) && memcmp(back, data, sizeof(data)) == 0,
        "pages read back differ (%zu bytes)", size);
  /* The same bytes as the one-page call. */
  OK(kvhost_get_data_page(c, "p", starts[1], page, sizeof(page), NULL, E));
  CHECK(memcmp(page, data + kPageBytes, kPageBytes) == 0, "page %lld differs from get_data_page",
        (long long)starts[1]);

  /* A buffer one byte short: OUT_OF_RANGE, nothing written. */
  memset(back, 0xAB, sizeof(back));
  EXPECT_CODE(KVHOST_OUT_OF_RANGE,
              kvhost_read_pages(c, "p", starts, kPages, 0, back, sizeof(back) - 1, &size, E));
  CHECK(size == sizeof(back) && back[0] == 0xAB, "short buffer: size %zu, byte 0 %u", size,
        back[0]);
  CONTAINS(err, "'p'");

  /* A write of the wrong size: refused before anything is sent. */
  fill(data, sizeof(data), 3);
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT,
              kvhost_write_pages(c, "p", starts, kPages, data, sizeof(data) - 1, 0, &written, E));
  CONTAINS(err, "1535");
  CONTAINS(err, "1536");
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT,
              kvhost_write_pages(c, "p", starts, kPages, NULL, sizeof(data), 0, NULL, E));
  OK(kvhost_read_pages(c, "p", starts, kPages, 0, back, sizeof(back), NULL, E));
  fill(data, kPageBytes, 1);
  fill(data + kPageBytes, kPageBytes, 2);
  CHECK(memcmp(back, data, sizeof(data)) == 0, "a refused write changed the pages");

  /* The daemon's refusals of a read: every index before the first page. */
  memset(back, 0xAB, sizeof(back));
  bad[0] = starts[0];
  bad[1] = 60; /* a page start, not allocated */
  EXPECT_CODE(KVHOST_FAILED_PRECONDITION,
              kvhost_read_pages(c, "p", bad, 2, 0, back, sizeof(back), NULL, E));
  CONTAINS(err, "60");
  CHECK(back[0] == 0xAB, "a refused read wrote the buffer");
  twice[0] = twice[1] = starts[0];
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT,
              kvhost_read_pages(c, "p", twice, 2, 0, back, sizeof(back), NULL, E));
  CONTAINS(err, "twice");
  bad[1] = starts[0] + 1; /* not a page start */
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT,
              kvhost_read_pages(c, "p", bad, 2, 0, back, sizeof(back), NULL, E));
  CHECK(back[0] == 0xAB, "a refused read wrote the buffer");
  EXPECT_CODE(KVHOST_NOT_FOUND,
              kvhost_read_pages(c, "nope", starts, 2, 0, back, sizeof(back), NULL, E));
  CONTAINS(err, "nope");
  EXPECT_CODE(KVHOST_NOT_FOUND,
              kvhost_write_pages(c, "nope", starts, 2, data, sizeof(data), 0, NULL, E));
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT,
              kvhost_read_pages(c, "p", NULL, 2, 0, back, sizeof(back), NULL, E));
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT,
              kvhost_read_pages(NULL, "p", starts, 2, 0, back, sizeof(back), NULL, E));
  /* No pages: nothing to read or write, and the pool is still checked. */
  OK(kvhost_read_pages(c, "p", NULL, 0, 0, NULL, 0, &size, E));
  CHECK(size == 0, "no pages need %zu bytes", size);
  OK(kvhost_write_pages(c, "p", NULL, 0, NULL, 0, 0, &written, E));
  CHECK(written == 0, "no pages wrote %llu", (unsigned long long)written);

  /* A refusal mid-write: the stream's contract keeps the pages before it,
   * and says so. */
  bad[0] = starts[0];
  bad[1] = 60;
  fill(data, sizeof(data), 4);
  EXPECT_CODE(KVHOST_FAILED_PRECONDITION,
              kvhost_write_pages(c, "p", bad, 2, data, sizeof(data), 0, &written, E));
  CONTAINS(err, "60");
  CONTAINS(err, "1 page written before this error stay written");
  OK(kvhost_get_data_page(c, "p", starts[0], page, sizeof(page), NULL, E));
  CHECK(memcmp(page, data, kPageBytes) == 0, "the page before the refusal was not written");

  /* A kind without flat pages: the daemon's FAILED_PRECONDITION, from the
   * size check. */
  OK(kvhost_pool_create(c, "asym", kAsymmetric, E));
  EXPECT_CODE(KVHOST_FAILED_PRECONDITION,
              kvhost_read_pages(c, "asym", starts, 1, 0, back, sizeof(back), NULL, E));
  CONTAINS(err, "asym");
  EXPECT_CODE(KVHOST_FAILED_PRECONDITION,
              kvhost_write_pages(c, "asym", starts, 1, data, kPageBytes, 0, NULL, E));
  result = 0;
done:
  kvhost_client_close(c);
  return result;
}
