/* The C ABI's batched calls (kvhost_alloc_batch, kvhost_alloc_backup) from
 * C, against a real kvhostd on the host backend: the runs back to back in
 * the caller's buffer, each whole pages, one kvhost_free for them all; the
 * buffer rule (a short buffer is OUT_OF_RANGE with the count needed, and
 * allocates nothing); the argument checks (NULL counts, a sum that wraps);
 * the daemon's refusals leave the pool as it was; an alloc + backup whose
 * slots load back byte for byte, and whose refusals leave nothing
 * allocated. "As it was" is checked by allocating the whole pool. Compiled
 * as C99. */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "c_api_check.h"
#include "c_api_test.h"
#include "kvhost/kvhost_c.h"

/* MHA, PAGE_FIRST, BF16, 4-token pages, 3 layers, 2 heads of 8 (32-byte
 * rows), 64 slots. */
static const char kSpec[] =
    "{\"kind\":\"MHA\",\"layout\":\"PAGE_FIRST\",\"dtype\":\"BF16\",\"page_size\":4,"
    "\"layer_num\":3,\"head_num\":2,\"head_dim\":8,\"size_tokens\":64}";

enum { kSlots = 64, kRowBytes = 32 };

/* The whole pool can be allocated (nothing else holds a slot) and is freed
 * again: KVHOST_OK, else the call's code. */
static int pool_is_free(kvhost_client* c, char* err, size_t err_len) {
  int64_t all[kSlots];
  size_t count = 0;
  int rc = kvhost_alloc(c, "p", kSlots, all, kSlots, &count, err, err_len);
  if (rc != KVHOST_OK) return rc;
  return kvhost_free(c, "p", all, count, NULL, err, err_len);
}

static unsigned char byte_of(uint32_t c, uint32_t l, int64_t r, int b) {
  return (unsigned char)(7 + c * 61 + l * 29 + (unsigned)r * 13 + (unsigned)b);
}

int c_api_test_alloc_batch(const c_api_test_env* env, char* why, size_t why_len) {
  int result = 1;
  char err[1024];
  int64_t slots[kSlots + 16]; /* room for a sum over the pool's size */
  const uint64_t runs[3] = {8, 4, 12};
  const uint64_t odd[2] = {8, 3};
  const uint64_t huge[2] = {UINT64_MAX, 8};
  const uint64_t over[2] = {32, 36};
  size_t count = 0, i, j;
  kvhost_client* c = NULL;

  OK(kvhost_connect(env->address, 10000, 0, &c, E));
  OK(kvhost_client_wait_ready(c, 20000, E));
  OK(kvhost_pool_create(c, "p", kSpec, E));

  OK(kvhost_alloc_batch(c, "p", runs, 3, slots, kSlots, &count, E));
  CHECK(count == 24, "AllocBatch of 8 + 4 + 12 gave %zu slots", count);
  for (i = 0; i < count; i += 4) { /* whole pages, each in order */
    CHECK(slots[i] % 4 == 0, "slot %zu = %lld starts no page", i, (long long)slots[i]);
    for (j = 1; j < 4; ++j) CHECK(slots[i + j] == slots[i] + (int64_t)j, "page at %zu torn", i);
  }
  for (i = 0; i < count; ++i) {
    for (j = i + 1; j < count; ++j) CHECK(slots[i] != slots[j], "slot %lld twice", (long long)slots[i]);
  }
  OK(kvhost_free(c, "p", slots, count, NULL, E));

  /* The buffer rule: one short is OUT_OF_RANGE with the sum, nothing
   * allocated. */
  EXPECT_CODE(KVHOST_OUT_OF_RANGE, kvhost_alloc_batch(c, "p", runs, 3, slots, 23, &count, E));
  CHECK(count == 24, "a short buffer reports %zu, want 24", count);
  CONTAINS(err, "24");
  EXPECT_CODE(KVHOST_OUT_OF_RANGE, kvhost_alloc_batch(c, "p", runs, 3, NULL, 0, &count, E));
  /* The arguments. */
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT, kvhost_alloc_batch(c, "p", NULL, 2, slots, kSlots, NULL, E));
  CONTAINS(err, "num_tokens is NULL");
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT, kvhost_alloc_batch(c, "p", huge, 2, slots, kSlots, NULL, E));
  CONTAINS(err, "overflows");
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT, kvhost_alloc_batch(c, NULL, runs, 3, slots, kSlots, NULL, E));
  /* The daemon's refusals, with its codes. */
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT, kvhost_alloc_batch(c, "p", odd, 2, slots, kSlots, NULL, E));
  EXPECT_CODE(KVHOST_RESOURCE_EXHAUSTED,
              kvhost_alloc_batch(c, "p", over, 2, slots, kSlots + 16, NULL, E));
  CONTAINS(err, "'p'");
  EXPECT_CODE(KVHOST_NOT_FOUND, kvhost_alloc_batch(c, "nope", runs, 3, slots, kSlots, NULL, E));
  CONTAINS(err, "nope");
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT, kvhost_alloc_batch(c, "p", runs, 0, slots, kSlots, NULL, E));
  OK(pool_is_free(c, E));
  result = 0;
done:
  kvhost_client_close(c);
  return result;
}

int c_api_test_alloc_backup(const c_api_test_env* env, char* why, size_t why_len) {
  int result = 1;
  char err[1024];
  int64_t host[8], rows[8], other[8], bad[4] = {0, 1, 2, 99};
  size_t count = 0;
  uint64_t ticket = 0;
  uint32_t c, l;
  int64_t r;
  int b;
  unsigned char fake_handle[KVHOST_CUDA_EVENT_HANDLE_BYTES];
  kvhost_client* cl = NULL;
  kvhost_shm_device_pool* dev = NULL;
  kvhost_attachment* att = NULL;

  OK(kvhost_connect(env->address, 10000, 0, &cl, E));
  OK(kvhost_client_wait_ready(cl, 20000, E));
  OK(kvhost_pool_create(cl, "p", kSpec, E));
  OK(kvhost_shm_device_pool_create(cl, "p", 16, env->shm_dir, 0, 0, &dev, E));
  for (c = 0; c < 2; ++c) {
    for (l = 0; l < 3; ++l) {
      void* base = NULL;
      unsigned char* p;
      OK(kvhost_shm_device_pool_layer(dev, c, l, &base, NULL, E));
      p = (unsigned char*)base;
      memset(p, 0, 16 * kRowBytes);
      for (r = 0; r < 8; ++r) {
        for (b = 0; b < kRowBytes; ++b) p[r * kRowBytes + b] = byte_of(c, l, r, b);
      }
    }
  }
  for (r = 0; r < 8; ++r) {
    rows[r] = r;
    other[r] = 8 + r;
  }
  OK(kvhost_attach_shm(cl, "p", dev, NULL, &att, E));

  /* A short buffer, then the refusals: nothing stays allocated. */
  EXPECT_CODE(KVHOST_OUT_OF_RANGE, kvhost_alloc_backup(cl, att, rows, 8, host, 7, &count, NULL, 0,
                                                       0, 0, &ticket, E));
  CHECK(count == 8, "a short buffer reports %zu, want 8", count);
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT,
              kvhost_alloc_backup(cl, att, rows, 3, host, 8, NULL, NULL, 0, 0, 0, NULL, E));
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT,
              kvhost_alloc_backup(cl, att, bad, 4, host, 8, NULL, NULL, 0, 0, 0, NULL, E));
  CONTAINS(err, "99");
  memset(fake_handle, 0, sizeof(fake_handle));
  EXPECT_CODE(KVHOST_FAILED_PRECONDITION,
              kvhost_alloc_backup(cl, att, rows, 8, host, 8, NULL, fake_handle,
                                  sizeof(fake_handle), 0, 0, NULL, E));
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT,
              kvhost_alloc_backup(cl, att, rows, 8, host, 8, NULL, NULL, 0, 0x80u, 0, NULL, E));
  CONTAINS(err, "flags");
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT,
              kvhost_alloc_backup(cl, NULL, rows, 8, host, 8, NULL, NULL, 0, 0, 0, NULL, E));
  OK(pool_is_free(cl, E));

  /* Alloc + backup in one call, waited; the slots load back into 8..15. */
  OK(kvhost_alloc_backup(cl, att, rows, 8, host, 8, &count, NULL, 0, KVHOST_TRANSFER_WAIT, 0,
                         &ticket, E));
  CHECK(count == 8 && ticket != 0, "count %zu ticket %llu", count, (unsigned long long)ticket);
  OK(kvhost_load(cl, att, host, 8, other, 8, KVHOST_TRANSFER_WAIT, 0, NULL, E));
  for (c = 0; c < 2; ++c) {
    for (l = 0; l < 3; ++l) {
      void* base = NULL;
      const unsigned char* p;
      OK(kvhost_shm_device_pool_layer(dev, c, l, &base, NULL, E));
      p = (const unsigned char*)base;
      for (r = 0; r < 8; ++r) {
        for (b = 0; b < kRowBytes; ++b) {
          CHECK(p[(8 + r) * kRowBytes + b] == byte_of(c, l, r, b),
                "component %u layer %u row %lld byte %d differs after alloc_backup + load", c, l,
                (long long)(8 + r), b);
        }
      }
    }
  }
  OK(kvhost_free(cl, "p", host, 8, NULL, E));
  OK(kvhost_detach(cl, att, E));
  OK(pool_is_free(cl, E));
  result = 0;
done:
  kvhost_attachment_destroy(att);
  kvhost_shm_device_pool_destroy(dev);
  kvhost_client_close(cl);
  return result;
}
