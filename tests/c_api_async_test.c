/* The C ABI's asynchronous calls (kvhost_async_*, kvhost/kvhost_c.h) from
 * C, against a real kvhostd on the host backend: request ids 1, 2, ... in
 * submission order, run in that order (a whole-pool alloc starves the one
 * behind it); each request's code and message the same as the synchronous
 * call's; the callback, in id order, with the take calls working inside it;
 * the take rules (too small a buffer keeps the result, a failure is taken
 * by either call, a taken request is gone, one still queued cannot be
 * taken); a byte-exact backup / load through shm device buffers with
 * KVHOST_TRANSFER_WAIT; the bound of KVHOST_ASYNC_MAX_REQUESTS held
 * requests; destroy with requests queued (each called back once, the
 * cancelled ones last). Compiled as C99; tests/c_api_test_driver.cc starts
 * the daemons. */
/* nanosleep: POSIX, which strict C99 hides. */
#define _POSIX_C_SOURCE 200809L

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "c_api_check.h"
#include "c_api_test.h"
#include "kvhost/kvhost_c.h"

/* MHA, PAGE_FIRST, BF16, 4-token pages, 3 layers, 2 heads of 8: 32-byte rows. */
static const char kSpec[] =
    "{\"kind\":\"MHA\",\"layout\":\"PAGE_FIRST\",\"dtype\":\"BF16\",\"page_size\":4,"
    "\"layer_num\":3,\"head_num\":2,\"head_dim\":8,\"size_tokens\":64}";

static int open_client(const c_api_test_env* env, kvhost_client** out, char* err, size_t err_len) {
  int rc = kvhost_connect(env->address, 10000, 0, out, err, err_len);
  if (rc != KVHOST_OK) return rc;
  return kvhost_client_wait_ready(*out, 20000, err, err_len);
}

/* Polls kvhost_async_completed until it reaches n (its callbacks have all
 * returned then); 0 once it did, 1 after 30 s. */
static int wait_completed(const kvhost_async* a, uint64_t n) {
  struct timespec ms = {0, 1000000L};
  int i;
  for (i = 0; i < 30000; ++i) {
    if (kvhost_async_completed(a) >= n) return 0;
    nanosleep(&ms, NULL);
  }
  return 1;
}

/* What the callback saw, in the order it was called (executor thread only;
 * read after a wait or a destroy). */
typedef struct seen_calls {
  kvhost_async* async;
  size_t n;
  size_t cap;
  uint64_t* ids;
  int* codes;
  /* Inside the callback of request `probe_on`: a request submitted there,
   * what taking and waiting for it answered, and what taking its own
   * result answered. */
  uint64_t probe_on;
  uint64_t probe_id;
  int probe_submit_code;
  int probe_take_code;
  int probe_wait_code;
  int own_take_code;
  uint64_t own_value;
} seen_calls;

static void record(uint64_t request_id, int code, void* user) {
  seen_calls* s = (seen_calls*)user;
  if (s->n < s->cap) {
    s->ids[s->n] = request_id;
    s->codes[s->n] = code;
  }
  s->n++;
  if (request_id == s->probe_on && s->async != NULL) {
    s->probe_submit_code = kvhost_async_alloc(s->async, "p", 4, &s->probe_id, NULL, 0);
    /* The executor is in this callback: the new request cannot have run. */
    s->probe_take_code = kvhost_async_take_value(s->async, s->probe_id, NULL, NULL, 0);
    s->probe_wait_code = kvhost_async_wait(s->async, s->probe_id, 1, NULL, 0);
    s->own_take_code = kvhost_async_take_value(s->async, request_id, &s->own_value, NULL, 0);
  }
}

int c_api_test_async_calls(const c_api_test_env* env, char* why, size_t why_len) {
  int result = 1;
  char err[1024];
  char sync_err[1024];
  int64_t slots[64];
  int64_t small[8];
  uint64_t ids[8];
  uint64_t value = 0;
  size_t count = 0;
  int sync_code;
  int i;
  uint64_t got_ids[16];
  int got_codes[16];
  seen_calls seen;
  kvhost_client* c = NULL;
  kvhost_async* a = NULL;
  kvhost_async* refused = NULL;

  memset(&seen, 0, sizeof(seen));
  seen.ids = got_ids;
  seen.codes = got_codes;
  seen.cap = 16;
  OK(open_client(env, &c, E));
  OK(kvhost_pool_create(c, "p", kSpec, E));

  /* Handles and arguments first: no request is made. */
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT, kvhost_async_create(NULL, &refused, E));
  CONTAINS(err, "client is NULL");
  CHECK(refused == NULL, "a refused create handed out a handle");
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT, kvhost_async_create(c, NULL, E));
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT, kvhost_async_alloc(NULL, "p", 4, &ids[0], E));
  CONTAINS(err, "async is NULL");
  CHECK(kvhost_async_completed(NULL) == 0, "completed(NULL)");
  kvhost_async_destroy(NULL);
  OK(kvhost_async_create(c, &a, E));
  seen.async = a;
  seen.probe_on = 5;
  OK(kvhost_async_set_callback(a, record, &seen, E));
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT, kvhost_async_alloc(a, NULL, 4, &ids[0], E));
  CONTAINS(err, "pool name is NULL");
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT, kvhost_async_free(a, "p", NULL, 3, &ids[0], E));
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT,
              kvhost_async_backup(a, NULL, slots, 1, slots, 1, NULL, 0, 0, 0, &ids[0], E));
  CONTAINS(err, "attachment is NULL");
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT, kvhost_async_wait(a, 1, -1, E));
  EXPECT_CODE(KVHOST_NOT_FOUND, kvhost_async_wait(a, 1, 0, E));
  CONTAINS(err, "not submitted");
  CHECK(kvhost_async_completed(a) == 0, "completed %llu before any request",
        (unsigned long long)kvhost_async_completed(a));

  /* In order: the whole pool, then an alloc that finds nothing left, an
   * unknown pool, a count that is not whole pages. */
  OK(kvhost_async_alloc(a, "p", 64, &ids[0], E));
  OK(kvhost_async_alloc(a, "p", 4, &ids[1], E));
  OK(kvhost_async_alloc(a, "nope", 4, &ids[2], E));
  OK(kvhost_async_alloc(a, "p", 3, &ids[3], E));
  for (i = 0; i < 4; ++i) {
    CHECK(ids[i] == (uint64_t)i + 1, "request %d has id %llu", i, (unsigned long long)ids[i]);
  }
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT, kvhost_async_wait(a, ids[3], 30000, E));
  /* Done, so the ones before it too (FIFO). */
  CHECK(kvhost_async_wait(a, ids[0], 1, NULL, 0) == KVHOST_OK, "request 1 not done");
  /* Each request's code and message are the synchronous call's. */
  sync_code = kvhost_alloc(c, "p", 3, small, 8, &count, sync_err, sizeof(sync_err));
  CHECK(sync_code == KVHOST_INVALID_ARGUMENT && strcmp(err, sync_err) == 0,
        "async '%s', sync %s '%s'", err, kvhost_code_name(sync_code), sync_err);
  EXPECT_CODE(KVHOST_NOT_FOUND, kvhost_async_wait(a, ids[2], 0, E));
  CONTAINS(err, "nope");
  sync_code = kvhost_alloc(c, "nope", 4, small, 8, &count, sync_err, sizeof(sync_err));
  CHECK(sync_code == KVHOST_NOT_FOUND && strcmp(err, sync_err) == 0, "async '%s', sync %s '%s'",
        err, kvhost_code_name(sync_code), sync_err);
  EXPECT_CODE(KVHOST_RESOURCE_EXHAUSTED, kvhost_async_wait(a, ids[1], 0, E));
  OK(kvhost_async_wait(a, ids[0], 0, E));
  CHECK(err[0] == '\0', "OK left a message: '%s'", err);

  /* Taking: the wrong call, a short buffer (kept), then the indices. */
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT, kvhost_async_take_value(a, ids[0], &value, E));
  CONTAINS(err, "kvhost_async_take_indices");
  count = 0;
  EXPECT_CODE(KVHOST_OUT_OF_RANGE, kvhost_async_take_indices(a, ids[0], small, 8, &count, E));
  CHECK(count == 64, "count %zu", count);
  EXPECT_CODE(KVHOST_OUT_OF_RANGE, kvhost_async_take_indices(a, ids[0], NULL, 0, &count, E));
  OK(kvhost_async_take_indices(a, ids[0], slots, 64, &count, E));
  CHECK(count == 64, "count %zu", count);
  EXPECT_CODE(KVHOST_NOT_FOUND, kvhost_async_take_indices(a, ids[0], slots, 64, &count, E));
  CONTAINS(err, "taken already");
  EXPECT_CODE(KVHOST_NOT_FOUND, kvhost_async_wait(a, ids[0], 0, E));
  /* A failure is taken by either call, with its code and message. */
  EXPECT_CODE(KVHOST_RESOURCE_EXHAUSTED, kvhost_async_take_indices(a, ids[1], NULL, 0, NULL, E));
  EXPECT_CODE(KVHOST_NOT_FOUND, kvhost_async_take_value(a, ids[2], NULL, E));
  CONTAINS(err, "nope");
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT, kvhost_async_take_value(a, ids[3], NULL, E));
  EXPECT_CODE(KVHOST_NOT_FOUND, kvhost_async_wait(a, ids[3], 0, E));
  EXPECT_CODE(KVHOST_NOT_FOUND, kvhost_async_take_value(a, 99, NULL, E));
  CONTAINS(err, "not submitted");

  /* A free of the 64 slots (copied: the buffer is changed at once). Its
   * callback submits an alloc, which cannot be taken or finish while the
   * callback runs, and takes its own result there. */
  OK(kvhost_async_free(a, "p", slots, 64, &ids[4], E));
  memset(slots, 0xff, sizeof(slots));
  CHECK(ids[4] == 5, "the free is request %llu", (unsigned long long)ids[4]);
  /* Request 5's callback has returned (so request 6 exists) once 5 count. */
  CHECK(wait_completed(a, 5) == 0, "completed %llu", (unsigned long long)kvhost_async_completed(a));
  OK(kvhost_async_wait(a, 6, 30000, E));
  CHECK(wait_completed(a, 6) == 0, "completed %llu", (unsigned long long)kvhost_async_completed(a));
  CHECK(seen.probe_submit_code == KVHOST_OK && seen.probe_id == 6, "probe %s, id %llu",
        kvhost_code_name(seen.probe_submit_code), (unsigned long long)seen.probe_id);
  CHECK(seen.probe_take_code == KVHOST_FAILED_PRECONDITION, "taking a queued request: %s",
        kvhost_code_name(seen.probe_take_code));
  CHECK(seen.probe_wait_code == KVHOST_DEADLINE_EXCEEDED, "waiting for it: %s",
        kvhost_code_name(seen.probe_wait_code));
  CHECK(seen.own_take_code == KVHOST_OK && seen.own_value == 64, "own take %s, freed %llu",
        kvhost_code_name(seen.own_take_code), (unsigned long long)seen.own_value);
  EXPECT_CODE(KVHOST_NOT_FOUND, kvhost_async_take_value(a, 5, NULL, E));
  OK(kvhost_async_take_indices(a, 6, small, 8, &count, E));
  CHECK(count == 4, "count %zu", count);

  /* The callback: every request once, in id order, with its code. */
  CHECK(seen.n == 6, "%zu callbacks", seen.n);
  {
    const int want[6] = {KVHOST_OK,        KVHOST_RESOURCE_EXHAUSTED,
                         KVHOST_NOT_FOUND, KVHOST_INVALID_ARGUMENT,
                         KVHOST_OK,        KVHOST_OK};
    for (i = 0; i < 6; ++i) {
      CHECK(got_ids[i] == (uint64_t)i + 1 && got_codes[i] == want[i],
            "callback %d: request %llu %s, want %d %s", i, (unsigned long long)got_ids[i],
            kvhost_code_name(got_codes[i]), i + 1, kvhost_code_name(want[i]));
    }
  }
  CHECK(kvhost_async_completed(a) == 6, "completed %llu",
        (unsigned long long)kvhost_async_completed(a));
  /* No callback after clearing it. */
  OK(kvhost_async_set_callback(a, NULL, NULL, E));
  OK(kvhost_async_free(a, "p", small, 4, &ids[5], E));
  OK(kvhost_async_wait(a, ids[5], 30000, E));
  OK(kvhost_async_take_value(a, ids[5], &value, E));
  CHECK(value == 4 && seen.n == 6, "freed %llu, %zu callbacks", (unsigned long long)value, seen.n);
  result = 0;
done:
  kvhost_async_destroy(a);
  kvhost_client_close(c);
  return result;
}

static unsigned char pattern(uint32_t c, uint32_t l, uint64_t r, uint64_t b) {
  return (unsigned char)(1 + (c * 131 + l * 31 + r * 7 + b) % 251);
}

int c_api_test_async_shm_backup_load(const c_api_test_env* env, char* why, size_t why_len) {
  int result = 1;
  char err[1024];
  char sync_err[1024];
  int64_t host[8];
  int64_t first_rows[8];
  int64_t other_rows[8];
  int64_t bad_rows[1] = {99};
  size_t count = 0;
  uint64_t id = 0, next = 0, ticket = 0, sync_ticket = 0, r, b;
  uint32_t c, l;
  int sync_code;
  int i;
  kvhost_client* cl = NULL;
  kvhost_async* a = NULL;
  kvhost_shm_device_pool* dev = NULL;
  kvhost_attachment* att = NULL;

  OK(open_client(env, &cl, E));
  OK(kvhost_pool_create(cl, "p", kSpec, E));
  OK(kvhost_shm_device_pool_create(cl, "p", 16, env->shm_dir, 0, 0, &dev, E));
  for (c = 0; c < 2; ++c) {
    for (l = 0; l < 3; ++l) {
      void* base = NULL;
      uint64_t layer_bytes = 0;
      unsigned char* p;
      OK(kvhost_shm_device_pool_layer(dev, c, l, &base, &layer_bytes, E));
      p = (unsigned char*)base;
      memset(p, 0, layer_bytes);
      for (r = 0; r < 8; ++r) {
        for (b = 0; b < 32; ++b) p[r * 32 + b] = pattern(c, l, r, b);
      }
    }
  }
  for (i = 0; i < 8; ++i) {
    first_rows[i] = i;
    other_rows[i] = 8 + i;
  }
  OK(kvhost_attach_shm(cl, "p", dev, NULL, &att, E));
  OK(kvhost_async_create(cl, &a, E));

  OK(kvhost_async_alloc(a, "p", 8, &id, E));
  OK(kvhost_async_wait(a, id, 30000, E));
  OK(kvhost_async_take_indices(a, id, host, 8, &count, E));
  /* The submit's own refusals take no request id. */
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT,
              kvhost_async_backup(a, att, host, 8, first_rows, 8, NULL, 0, 8u, 0, &next, E));
  CONTAINS(err, "flags");
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT,
              kvhost_async_backup(a, att, host, 8, first_rows, 8, NULL, 4, 0, 0, &next, E));
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT,
              kvhost_async_load(a, att, host, 8, other_rows, 8, 0, -5, &next, E));
  /* Backup, then load with the wait: each request done once its transfer is. */
  OK(kvhost_async_backup(a, att, host, 8, first_rows, 8, NULL, 0, KVHOST_TRANSFER_WAIT, 0, &id, E));
  CHECK(id == 2, "the backup is request %llu", (unsigned long long)id);
  OK(kvhost_async_load(a, att, host, 8, other_rows, 8, KVHOST_TRANSFER_WAIT, 0, &next, E));
  OK(kvhost_async_wait(a, next, 30000, E));
  OK(kvhost_async_take_value(a, id, &ticket, E));
  CHECK(ticket != 0, "backup ticket 0");
  OK(kvhost_async_take_value(a, next, &ticket, E));
  for (c = 0; c < 2; ++c) {
    for (l = 0; l < 3; ++l) {
      void* base = NULL;
      uint64_t layer_bytes = 0;
      const unsigned char* p;
      OK(kvhost_shm_device_pool_layer(dev, c, l, &base, &layer_bytes, E));
      p = (const unsigned char*)base;
      for (r = 0; r < 8; ++r) {
        for (b = 0; b < 32; ++b) {
          CHECK(p[(8 + r) * 32 + b] == pattern(c, l, r, b),
                "component %u layer %u row %llu byte %llu: %u, want %u", c, l,
                (unsigned long long)(8 + r), (unsigned long long)b, p[(8 + r) * 32 + b],
                pattern(c, l, r, b));
        }
      }
    }
  }
  /* A load without the wait: the ticket, to wait for as any other. */
  OK(kvhost_async_load(a, att, host, 8, other_rows, 8, 0, 0, &id, E));
  OK(kvhost_async_wait(a, id, 30000, E));
  OK(kvhost_async_take_value(a, id, &ticket, E));
  OK(kvhost_transfer_wait(cl, ticket, 30000, NULL, 0, NULL, E));
  /* A device row out of range: the daemon's refusal, as the sync call's. */
  OK(kvhost_async_backup(a, att, host, 1, bad_rows, 1, NULL, 0, 0, 0, &id, E));
  sync_code = kvhost_backup(cl, att, host, 1, bad_rows, 1, NULL, 0, 0, 0, &sync_ticket, sync_err,
                            sizeof(sync_err));
  CHECK(sync_code != KVHOST_OK, "the sync backup of row 99 passed");
  EXPECT_CODE(sync_code, kvhost_async_wait(a, id, 30000, E));
  CHECK(strcmp(err, sync_err) == 0, "async '%s', sync '%s'", err, sync_err);
  CONTAINS(err, "99");
  EXPECT_CODE(sync_code, kvhost_async_take_value(a, id, &ticket, E));
  result = 0;
done:
  kvhost_async_destroy(a);
  if (att != NULL) (void)kvhost_detach(cl, att, NULL, 0);
  kvhost_attachment_destroy(att);
  kvhost_shm_device_pool_destroy(dev);
  kvhost_client_close(cl);
  return result;
}

int c_api_test_async_bound_and_destroy(const c_api_test_env* env, char* why, size_t why_len) {
  int result = 1;
  char err[1024];
  uint64_t id = 0;
  uint64_t i;
  size_t cancelled = 0, first_cancelled = 0;
  seen_calls seen;
  kvhost_client* c = NULL;
  kvhost_async* a = NULL;

  memset(&seen, 0, sizeof(seen));
  seen.cap = KVHOST_ASYNC_MAX_REQUESTS + 1;
  seen.ids = (uint64_t*)calloc(seen.cap, sizeof(uint64_t));
  seen.codes = (int*)calloc(seen.cap, sizeof(int));
  CHECK(seen.ids != NULL && seen.codes != NULL, "calloc");
  OK(open_client(env, &c, E));
  OK(kvhost_pool_create(c, "p", kSpec, E));
  OK(kvhost_async_create(c, &a, E));
  OK(kvhost_async_set_callback(a, record, &seen, E));

  /* Nothing is taken, so the bound is reached at exactly its count. */
  for (i = 1; i <= KVHOST_ASYNC_MAX_REQUESTS; ++i) {
    OK(kvhost_async_alloc(a, "p", 4, &id, E));
    CHECK(id == i, "request %llu got id %llu", (unsigned long long)i, (unsigned long long)id);
  }
  id = 0;
  EXPECT_CODE(KVHOST_RESOURCE_EXHAUSTED, kvhost_async_alloc(a, "p", 4, &id, E));
  CONTAINS(err, "65536");
  CHECK(id == 0, "a refused submit set request id %llu", (unsigned long long)id);
  /* Taking a finished one makes room for one more. */
  EXPECT_CODE(KVHOST_OK, kvhost_async_wait(a, 1, 30000, E));
  EXPECT_CODE(KVHOST_OUT_OF_RANGE, kvhost_async_take_indices(a, 1, NULL, 0, NULL, E));
  {
    int64_t four[4];
    size_t count = 0;
    OK(kvhost_async_take_indices(a, 1, four, 4, &count, E));
  }
  OK(kvhost_async_alloc(a, "p", 4, &id, E));
  CHECK(id == KVHOST_ASYNC_MAX_REQUESTS + 1, "id %llu", (unsigned long long)id);
  EXPECT_CODE(KVHOST_RESOURCE_EXHAUSTED, kvhost_async_alloc(a, "p", 4, &id, E));

  /* Destroyed with most still queued: each called back once, in order,
   * the cancelled ones after every one that ran. */
  kvhost_async_destroy(a);
  a = NULL;
  CHECK(seen.n == KVHOST_ASYNC_MAX_REQUESTS + 1, "%zu callbacks for %d requests", seen.n,
        KVHOST_ASYNC_MAX_REQUESTS + 1);
  for (i = 0; i < seen.n; ++i) {
    const int code = seen.codes[i];
    CHECK(seen.ids[i] == i + 1, "callback %llu is request %llu", (unsigned long long)i,
          (unsigned long long)seen.ids[i]);
    if (code == KVHOST_CANCELLED) {
      if (cancelled++ == 0) first_cancelled = (size_t)i;
    } else {
      CHECK(cancelled == 0, "request %llu ran (%s) after request %zu was cancelled",
            (unsigned long long)i + 1, kvhost_code_name(code), first_cancelled + 1);
      CHECK(code == KVHOST_OK || code == KVHOST_RESOURCE_EXHAUSTED, "request %llu: %s",
            (unsigned long long)i + 1, kvhost_code_name(code));
    }
  }
  CHECK(cancelled > 0, "every request ran before the destroy");
  result = 0;
done:
  kvhost_async_destroy(a);
  kvhost_client_close(c);
  free(seen.ids);
  free(seen.codes);
  return result;
}
