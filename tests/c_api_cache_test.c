/* The node cache's C calls (kvhost_cache_*, client/c_api_cache.cc) from C,
 * against a real kvhostd on the host backend, as two engine instances make
 * them: one stores keys from its shm device rows, the other finds them
 * (pinned), restores them byte-exact into other rows, and the evictions,
 * stats and events say what happened. Refusals (NULL arguments, too many
 * keys, a key too long, a wrong owner token, a pinning lookup without a
 * worker session, rows of the wrong count) give precise codes and messages
 * and change nothing. Stores from and restores into an index-addressed pool's
 * slots (kvhost_cache_store_from_pool / _restore_to_pool) carry pages
 * byte-exact through a LAYER_FIRST pool. Compiled as C99; tests/c_api_test_driver.cc starts
 * the daemons. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "c_api_check.h"
#include "c_api_test.h"
#include "kvhost/kvhost_c.h"

/* A node cache of 16 pages of 4 tokens; MHA, PAGE_FIRST, BF16, 3 layers,
 * 2 heads of 8: 32-byte rows. */
static const char kCacheSpec[] =
    "{\"kind\":\"MHA\",\"layout\":\"PAGE_FIRST\",\"dtype\":\"BF16\",\"page_size\":4,"
    "\"layer_num\":3,\"head_num\":2,\"head_dim\":8,\"size_tokens\":64,\"node_cache\":true}";
#define PAGE_SIZE 4
#define ROW_BYTES 32
/* Device pools of 8 pages. */
#define DEVICE_TOKENS 32
static const char kToken[] = "model-token";

/* One engine instance: a client with the cache's token (and a worker
 * session when `session`), a device pool and its attachment of the cache. */
typedef struct instance {
  kvhost_client* client;
  kvhost_shm_device_pool* device;
  kvhost_attachment* attachment;
} instance;

static int connect_with(const c_api_test_env* env, const char* token, int session,
                        kvhost_client** out, char* err, size_t err_len) {
  kvhost_client_options* o = NULL;
  int rc = kvhost_client_options_create(&o, err, err_len);
  if (rc == KVHOST_OK) rc = kvhost_client_options_set(o, "address", env->address, err, err_len);
  if (rc == KVHOST_OK) rc = kvhost_client_options_set(o, "owner_token", token, err, err_len);
  if (rc == KVHOST_OK) {
    rc = kvhost_client_options_set(o, "worker_session", session ? "1" : "0", err, err_len);
  }
  if (rc == KVHOST_OK) rc = kvhost_client_connect(o, out, err, err_len);
  kvhost_client_options_destroy(o);
  if (rc == KVHOST_OK) rc = kvhost_client_wait_ready(*out, 20000, err, err_len);
  return rc;
}

static int start_instance(const c_api_test_env* env, instance* i, char* err, size_t err_len) {
  int rc = connect_with(env, kToken, 1, &i->client, err, err_len);
  if (rc == KVHOST_OK) {
    rc = kvhost_shm_device_pool_create(i->client, "cache", DEVICE_TOKENS, env->shm_dir, 0, 0,
                                       &i->device, err, err_len);
  }
  if (rc == KVHOST_OK) {
    rc = kvhost_attach_shm(i->client, "cache", i->device, NULL, &i->attachment, err, err_len);
  }
  return rc;
}

static void stop_instance(instance* i) {
  kvhost_attachment_destroy(i->attachment);
  kvhost_shm_device_pool_destroy(i->device);
  kvhost_client_close(i->client);
}

static unsigned char byte_of(unsigned seed, uint32_t c, uint32_t l, uint64_t r, uint64_t b) {
  return (unsigned char)(seed * 31u + c * 7u + l * 3u + (unsigned)r * 5u + (unsigned)b);
}

/* Device page `page` of every layer buffer: bytes only `seed` decides
 * (write), or whether it holds them (!write). */
static int page_bytes(const instance* i, uint64_t page, unsigned seed, int write) {
  uint32_t components = 0, layers = 0, c, l;
  uint64_t r, b;
  char err[256];
  if (kvhost_shm_device_pool_info(i->device, &components, &layers, NULL, E) != KVHOST_OK) return 0;
  for (c = 0; c < components; ++c) {
    for (l = 0; l < layers; ++l) {
      void* base = NULL;
      unsigned char* p;
      if (kvhost_shm_device_pool_layer(i->device, c, l, &base, NULL, E) != KVHOST_OK) return 0;
      p = (unsigned char*)base + page * PAGE_SIZE * ROW_BYTES;
      for (r = 0; r < PAGE_SIZE; ++r) {
        for (b = 0; b < ROW_BYTES; ++b) {
          if (write) {
            p[r * ROW_BYTES + b] = byte_of(seed, c, l, r, b);
          } else if (p[r * ROW_BYTES + b] != byte_of(seed, c, l, r, b)) {
            return 0;
          }
        }
      }
    }
  }
  return 1;
}

/* The device rows of pages [first, first + pages). */
static void page_rows(uint64_t first, size_t pages, int64_t* rows) {
  size_t r;
  for (r = 0; r < pages * PAGE_SIZE; ++r) rows[r] = (int64_t)(first * PAGE_SIZE + r);
}

/* Keys "key-0".."key-3" and "never". */
static const char* const kKeyText[] = {"key-0", "key-1", "key-2", "key-3", "never"};

static void key_args(const void** keys, size_t* lens, size_t first, size_t n) {
  size_t k;
  for (k = 0; k < n; ++k) {
    keys[k] = kKeyText[first + k];
    lens[k] = strlen(kKeyText[first + k]);
  }
}

/* The cache's events from after_seq, read `room` at a time until none is
 * left; into out[0, *n). */
static int read_all_events(kvhost_client* c, uint64_t after_seq, size_t room,
                           kvhost_cache_event* out, size_t cap, size_t* n, char* err,
                           size_t err_len) {
  size_t got = 0;
  int32_t gap = 0;
  int rc;
  *n = 0;
  do {
    uint64_t next = 0;
    if (*n + room > cap) return KVHOST_OUT_OF_RANGE;
    rc = kvhost_cache_read_events(c, "cache", after_seq, 0, out + *n, room, &got, &next, &gap, err,
                                  err_len);
    if (rc != KVHOST_OK) return rc;
    if (gap != 0) return KVHOST_DATA_LOSS;
    *n += got;
    after_seq = next;
  } while (got == room);
  return KVHOST_OK;
}

int c_api_test_cache_store_restore(const c_api_test_env* env, char* why, size_t why_len) {
  int result = 1;
  char err[1024];
  char text[4096];
  kvhost_client* admin = NULL;
  instance a = {NULL, NULL, NULL}, b = {NULL, NULL, NULL};
  const void* keys[5];
  size_t lens[5];
  int32_t states[5];
  int32_t outcomes[2];
  int64_t rows[4 * PAGE_SIZE];
  uint32_t prefix = 99;
  uint64_t pin = 99, evicted = 99;
  kvhost_load_ticket ticket;
  kvhost_cache_stats stats;
  kvhost_cache_event events[8];
  size_t count = 0;
  int k;

  OK(connect_with(env, kToken, 0, &admin, E));
  OK(kvhost_pool_create(admin, "cache", kCacheSpec, E));
  OK(start_instance(env, &a, E));
  OK(start_instance(env, &b, E));

  /* Nothing yet: every key absent, no pin for an empty prefix. */
  key_args(keys, lens, 0, 3);
  OK(kvhost_cache_lookup(a.client, "cache", keys, lens, 3, 1, &prefix, states, &pin, E));
  CHECK(prefix == 0 && pin == 0, "empty cache: prefix %u pin %llu", prefix,
        (unsigned long long)pin);
  for (k = 0; k < 3; ++k) CHECK(states[k] == KVHOST_CACHE_ABSENT, "key %d state %d", k, states[k]);

  /* Instance a stores key-0..2 from its device pages 0..2 and waits. */
  for (k = 0; k < 3; ++k) CHECK(page_bytes(&a, (uint64_t)k, 10u + (unsigned)k, 1), "fill %d", k);
  page_rows(0, 3, rows);
  OK(kvhost_cache_store(a.client, "cache", a.attachment, keys, lens, 3, rows, 3 * PAGE_SIZE, NULL,
                        0, states, &ticket, &evicted, E));
  CHECK(ticket.ticket_id != 0 && evicted == 0, "store: ticket %llu evicted %llu",
        (unsigned long long)ticket.ticket_id, (unsigned long long)evicted);
  for (k = 0; k < 3; ++k)
    CHECK(states[k] == KVHOST_CACHE_ABSENT, "stored key %d: %d", k, states[k]);
  OK(kvhost_transfer_wait(a.client, ticket.ticket_id, 30000, text, sizeof(text), NULL, E));
  CONTAINS(text, "\"done\":true");
  /* Again: every key present, skipped, no ticket. */
  OK(kvhost_cache_store(a.client, "cache", a.attachment, keys, lens, 3, rows, 3 * PAGE_SIZE, NULL,
                        0, states, &ticket, NULL, E));
  CHECK(ticket.ticket_id == 0 && ticket.event_set == -1, "a skipping store: ticket %llu set %d",
        (unsigned long long)ticket.ticket_id, ticket.event_set);
  for (k = 0; k < 3; ++k)
    CHECK(states[k] == KVHOST_CACHE_PRESENT, "skipped key %d: %d", k, states[k]);

  /* Instance b finds the prefix, pins it, restores it into its pages 4..6. */
  key_args(keys, lens, 0, 5);
  OK(kvhost_cache_lookup(b.client, "cache", keys, lens, 5, 1, &prefix, states, &pin, E));
  CHECK(prefix == 3 && pin != 0, "b's lookup: prefix %u pin %llu", prefix, (unsigned long long)pin);
  CHECK(states[0] == KVHOST_CACHE_PRESENT && states[2] == KVHOST_CACHE_PRESENT &&
            states[3] == KVHOST_CACHE_ABSENT && states[4] == KVHOST_CACHE_ABSENT,
        "states %d %d %d %d %d", states[0], states[1], states[2], states[3], states[4]);
  page_rows(4, 3, rows);
  OK(kvhost_cache_restore(b.client, "cache", b.attachment, keys, lens, 3, rows, 3 * PAGE_SIZE, NULL,
                          0, &ticket, E));
  CHECK(ticket.ticket_id != 0, "restore ticket 0");
  OK(kvhost_transfer_wait(b.client, ticket.ticket_id, 30000, NULL, 0, NULL, E));
  for (k = 0; k < 3; ++k) {
    CHECK(page_bytes(&b, 4u + (uint64_t)k, 10u + (unsigned)k, 0),
          "b's device page %d is not key-%d's bytes after the restore", 4 + k, k);
  }

  /* Pinned: kept. Released: evicted; an unknown key is ABSENT. */
  key_args(keys, lens, 1, 1);
  OK(kvhost_cache_evict(a.client, "cache", keys, lens, 1, outcomes, &evicted, E));
  CHECK(outcomes[0] == KVHOST_CACHE_EVICT_BUSY && evicted == 0, "pinned: outcome %d evicted %llu",
        outcomes[0], (unsigned long long)evicted);
  OK(kvhost_cache_release_pin(b.client, "cache", pin, E));
  EXPECT_CODE(KVHOST_NOT_FOUND, kvhost_cache_release_pin(b.client, "cache", pin, E));
  CONTAINS(err, "no pin");
  keys[1] = kKeyText[4];
  lens[1] = strlen(kKeyText[4]);
  OK(kvhost_cache_evict(a.client, "cache", keys, lens, 2, outcomes, &evicted, E));
  CHECK(outcomes[0] == KVHOST_CACHE_EVICTED && outcomes[1] == KVHOST_CACHE_EVICT_ABSENT &&
            evicted == 1,
        "outcomes %d %d evicted %llu", outcomes[0], outcomes[1], (unsigned long long)evicted);

  /* Stats: 2 published of 16 pages, 3 stored, 3 skipped, 1 evicted; hits
   * 3 of b's lookup and 3 of its restore, misses 3 of a's lookup and 2 of
   * b's. */
  OK(kvhost_cache_get_stats(admin, "cache", &stats, E));
  CHECK(stats.page_num == 16 && stats.free_pages == 14 && stats.published == 2 &&
            stats.writing == 0 && stats.pinned == 0,
        "stats: pages %llu free %llu published %llu writing %llu pinned %llu",
        (unsigned long long)stats.page_num, (unsigned long long)stats.free_pages,
        (unsigned long long)stats.published, (unsigned long long)stats.writing,
        (unsigned long long)stats.pinned);
  CHECK(stats.stored == 3 && stats.skipped == 3 && stats.evicted == 1 && stats.hits == 6 &&
            stats.misses == 5 && stats.aborted == 0,
        "stats: stored %llu skipped %llu evicted %llu hits %llu misses %llu aborted %llu",
        (unsigned long long)stats.stored, (unsigned long long)stats.skipped,
        (unsigned long long)stats.evicted, (unsigned long long)stats.hits,
        (unsigned long long)stats.misses, (unsigned long long)stats.aborted);

  /* Events: key-0..2 stored, key-1 evicted, in order; read 1, 3 and 8 at a
   * time, each resuming from the last next_after, the same four. */
  {
    const size_t rooms[] = {1, 3, 8};
    size_t r;
    for (r = 0; r < 3; ++r) {
      OK(read_all_events(admin, 0, rooms[r], events, 8, &count, E));
      CHECK(count == 4, "%zu events read %zu at a time", count, rooms[r]);
      for (k = 0; k < 4; ++k) {
        const char* want = kKeyText[k < 3 ? k : 1];
        CHECK(events[k].kind == (k < 3 ? KVHOST_CACHE_EVENT_STORED : KVHOST_CACHE_EVENT_EVICTED) &&
                  events[k].key_len == strlen(want) &&
                  memcmp(events[k].key, want, strlen(want)) == 0 &&
                  (k == 0 || events[k].seq > events[k - 1].seq),
              "event %d (room %zu): seq %llu kind %d key '%.*s'", k, rooms[r],
              (unsigned long long)events[k].seq, events[k].kind, (int)events[k].key_len,
              (const char*)events[k].key);
      }
    }
    /* max_events bounds a read below its room. */
    OK(kvhost_cache_read_events(admin, "cache", 0, 2, events, 8, &count, NULL, NULL, E));
    CHECK(count == 2, "max_events 2 returned %zu", count);
  }
  /* A key not present (key-1, evicted): refused by name, nothing restored. */
  key_args(keys, lens, 0, 2);
  page_rows(4, 2, rows);
  EXPECT_CODE(KVHOST_FAILED_PRECONDITION,
              kvhost_cache_restore(b.client, "cache", b.attachment, keys, lens, 2, rows,
                                   2 * PAGE_SIZE, NULL, 0, &ticket, E));
  CONTAINS(err, "cache 'cache'");
  CONTAINS(err, "key 1");
  result = 0;
done:
  stop_instance(&a);
  stop_instance(&b);
  kvhost_client_close(admin);
  return result;
}

/* What the cache holds, for a refusal's "changed nothing". */
static int same_stats(const kvhost_cache_stats* x, const kvhost_cache_stats* y) {
  return memcmp(x, y, sizeof(*x)) == 0;
}

int c_api_test_cache_refusals(const c_api_test_env* env, char* why, size_t why_len) {
  int result = 1;
  char err[1024];
  kvhost_client* admin = NULL;
  kvhost_client* stranger = NULL;
  kvhost_client* tool = NULL;
  instance a = {NULL, NULL, NULL};
  const void* keys[2];
  size_t lens[2];
  int32_t states[2];
  int64_t rows[2 * PAGE_SIZE];
  uint64_t pin = 0;
  kvhost_load_ticket ticket;
  kvhost_cache_stats before, after;
  kvhost_cache_event events[2];
  size_t count = 0, k;
  const void** many_keys = NULL;
  size_t* many_lens = NULL;
  char* many_text = NULL;
  char long_key[KVHOST_CACHE_MAX_KEY_BYTES + 1];
  unsigned char handle[KVHOST_CUDA_EVENT_HANDLE_BYTES];

  OK(connect_with(env, kToken, 0, &admin, E));
  OK(kvhost_pool_create(admin, "cache", kCacheSpec, E));
  OK(kvhost_pool_create(admin, "plain",
                        "{\"kind\":\"MHA\",\"layout\":\"PAGE_FIRST\",\"dtype\":\"BF16\","
                        "\"page_size\":4,\"layer_num\":3,\"head_num\":2,\"head_dim\":8,"
                        "\"size_tokens\":64}",
                        E));
  OK(start_instance(env, &a, E));
  OK(kvhost_cache_get_stats(admin, "cache", &before, E));
  key_args(keys, lens, 0, 2);
  page_rows(0, 2, rows);

  /* NULL arguments, named. */
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT,
              kvhost_cache_lookup(NULL, "cache", keys, lens, 2, 0, NULL, NULL, NULL, E));
  CONTAINS(err, "client is NULL");
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT,
              kvhost_cache_lookup(admin, NULL, keys, lens, 2, 0, NULL, NULL, NULL, E));
  CONTAINS(err, "cache name");
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT,
              kvhost_cache_lookup(admin, "cache", NULL, lens, 2, 0, NULL, NULL, NULL, E));
  CONTAINS(err, "keys is NULL with 2 keys");
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT,
              kvhost_cache_evict(admin, "cache", keys, NULL, 2, NULL, NULL, E));
  CONTAINS(err, "key_lens is NULL with 2 keys");
  keys[1] = NULL;
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT,
              kvhost_cache_store(a.client, "cache", a.attachment, keys, lens, 2, rows,
                                 2 * PAGE_SIZE, NULL, 0, states, &ticket, NULL, E));
  CONTAINS(err, "keys[1] is NULL");
  key_args(keys, lens, 0, 2);
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT,
              kvhost_cache_store(a.client, "cache", NULL, keys, lens, 2, rows, 2 * PAGE_SIZE, NULL,
                                 0, states, &ticket, NULL, E));
  CONTAINS(err, "attachment is NULL");
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT,
              kvhost_cache_store(a.client, "cache", a.attachment, keys, lens, 2, NULL,
                                 2 * PAGE_SIZE, NULL, 0, states, &ticket, NULL, E));
  CONTAINS(err, "device_indices is NULL with a count of 8");
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT,
              kvhost_cache_store(a.client, "cache", a.attachment, keys, lens, 2, rows,
                                 2 * PAGE_SIZE, NULL, 64, states, &ticket, NULL, E));
  CONTAINS(err, "ready_event_handle is NULL with a length of 64");
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT,
              kvhost_cache_restore(a.client, "cache", a.attachment, keys, lens, 2, rows,
                                   2 * PAGE_SIZE, NULL, 64, &ticket, E));
  CONTAINS(err, "wait_event_handle is NULL with a length of 64");
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT, kvhost_cache_get_stats(admin, "cache", NULL, E));
  CONTAINS(err, "stats is NULL");
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT,
              kvhost_cache_read_events(admin, "cache", 0, 0, events, 0, &count, NULL, NULL, E));
  CONTAINS(err, "capacity is 0");
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT,
              kvhost_cache_read_events(admin, "cache", 0, 0, NULL, 2, &count, NULL, NULL, E));
  CONTAINS(err, "events is NULL");

  /* The daemon's refusals, through the ABI. */
  many_keys = (const void**)calloc(KVHOST_CACHE_MAX_KEYS + 1, sizeof(*many_keys));
  many_lens = (size_t*)calloc(KVHOST_CACHE_MAX_KEYS + 1, sizeof(*many_lens));
  CHECK(many_keys != NULL && many_lens != NULL, "calloc");
  many_text = (char*)malloc((KVHOST_CACHE_MAX_KEYS + 1) * 8);
  CHECK(many_text != NULL, "malloc");
  for (k = 0; k <= KVHOST_CACHE_MAX_KEYS; ++k) {
    snprintf(many_text + k * 8, 8, "k%06u", (unsigned)k);
    many_keys[k] = many_text + k * 8;
    many_lens[k] = 7;
  }
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT,
              kvhost_cache_lookup(admin, "cache", many_keys, many_lens, KVHOST_CACHE_MAX_KEYS + 1,
                                  0, NULL, NULL, NULL, E));
  CONTAINS(err, "4097 keys, over the limit of 4096");
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT,
              kvhost_cache_evict(admin, "cache", many_keys, many_lens, KVHOST_CACHE_MAX_KEYS + 1,
                                 NULL, NULL, E));
  CONTAINS(err, "4097 keys");
  memset(long_key, 'k', sizeof(long_key));
  keys[1] = long_key;
  lens[1] = sizeof(long_key);
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT,
              kvhost_cache_store(a.client, "cache", a.attachment, keys, lens, 2, rows,
                                 2 * PAGE_SIZE, NULL, 0, states, &ticket, NULL, E));
  CONTAINS(err, "key 1 has 257 bytes, over the limit of 256");
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT,
              kvhost_cache_lookup(admin, "cache", keys, lens, 2, 0, NULL, NULL, NULL, E));
  CONTAINS(err, "key 1 has 257 bytes");
  lens[1] = 0;
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT,
              kvhost_cache_lookup(admin, "cache", keys, lens, 2, 0, NULL, NULL, NULL, E));
  CONTAINS(err, "key 1 is empty");
  key_args(keys, lens, 0, 2);
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT,
              kvhost_cache_store(a.client, "cache", a.attachment, keys, lens, 2, rows,
                                 2 * PAGE_SIZE - 1, NULL, 0, states, &ticket, NULL, E));
  CONTAINS(err, "7 device rows for 2 keys; want 8");
  OK(connect_with(env, "other-token", 1, &stranger, E));
  EXPECT_CODE(KVHOST_PERMISSION_DENIED,
              kvhost_cache_lookup(stranger, "cache", keys, lens, 2, 0, NULL, NULL, NULL, E));
  CONTAINS(err, "pool 'cache' is owner-protected: the token given does not match");
  EXPECT_CODE(KVHOST_PERMISSION_DENIED,
              kvhost_cache_store(stranger, "cache", a.attachment, keys, lens, 2, rows,
                                 2 * PAGE_SIZE, NULL, 0, states, &ticket, NULL, E));
  EXPECT_CODE(KVHOST_PERMISSION_DENIED, kvhost_cache_get_stats(stranger, "cache", &after, E));
  EXPECT_CODE(KVHOST_PERMISSION_DENIED,
              kvhost_cache_read_events(stranger, "cache", 0, 0, events, 2, &count, NULL, NULL, E));
  /* Without a worker session: the pinning lookup and the store are refused
   * by the client, naming what they need. */
  OK(connect_with(env, kToken, 0, &tool, E));
  EXPECT_CODE(KVHOST_FAILED_PRECONDITION,
              kvhost_cache_lookup(tool, "cache", keys, lens, 2, 1, NULL, NULL, &pin, E));
  CONTAINS(err, "needs a worker session");
  EXPECT_CODE(KVHOST_FAILED_PRECONDITION,
              kvhost_cache_lookup(admin, "plain", keys, lens, 2, 0, NULL, NULL, NULL, E));
  CONTAINS(err, "pool 'plain' is not a node cache");
  EXPECT_CODE(KVHOST_NOT_FOUND,
              kvhost_cache_lookup(admin, "nope", keys, lens, 2, 0, NULL, NULL, NULL, E));
  CONTAINS(err, "nope");

  /* Nothing changed: the same counters but for the lookups' misses (a
   * refused lookup counts none), no events. */
  OK(kvhost_cache_get_stats(admin, "cache", &after, E));
  CHECK(same_stats(&before, &after),
        "a refusal changed the cache: free %llu published %llu writing %llu pinned %llu hits %llu "
        "misses %llu stored %llu skipped %llu evicted %llu aborted %llu",
        (unsigned long long)after.free_pages, (unsigned long long)after.published,
        (unsigned long long)after.writing, (unsigned long long)after.pinned,
        (unsigned long long)after.hits, (unsigned long long)after.misses,
        (unsigned long long)after.stored, (unsigned long long)after.skipped,
        (unsigned long long)after.evicted, (unsigned long long)after.aborted);
  OK(kvhost_cache_read_events(admin, "cache", 0, 0, events, 2, &count, NULL, NULL, E));
  CHECK(count == 0, "%zu events after refusals only", count);
  /* A ready event on the host backend: refused by the backup the store
   * begins, so the daemon counts its keys aborted; nothing else changes. */
  memset(handle, 0, sizeof(handle));
  EXPECT_CODE(KVHOST_FAILED_PRECONDITION,
              kvhost_cache_store(a.client, "cache", a.attachment, keys, lens, 2, rows,
                                 2 * PAGE_SIZE, handle, sizeof(handle), states, &ticket, NULL, E));
  OK(kvhost_cache_get_stats(admin, "cache", &after, E));
  CHECK(after.free_pages == before.free_pages && after.published == 0 && after.writing == 0 &&
            after.pinned == 0 && after.stored == 0,
        "a refused store left free %llu published %llu writing %llu pinned %llu stored %llu",
        (unsigned long long)after.free_pages, (unsigned long long)after.published,
        (unsigned long long)after.writing, (unsigned long long)after.pinned,
        (unsigned long long)after.stored);
  OK(kvhost_cache_read_events(admin, "cache", 0, 0, events, 2, &count, NULL, NULL, E));
  CHECK(count == 0, "%zu events after a refused store", count);
  result = 0;
done:
  free(many_keys);
  free(many_lens);
  free(many_text);
  stop_instance(&a);
  kvhost_client_close(tool);
  kvhost_client_close(stranger);
  kvhost_client_close(admin);
  return result;
}

/* An index-addressed pool of the cache's shape in LAYER_FIRST (8 pages). */
static const char kLayerFirstSpec[] =
    "{\"kind\":\"MHA\",\"layout\":\"LAYER_FIRST\",\"dtype\":\"BF16\",\"page_size\":4,"
    "\"layer_num\":3,\"head_num\":2,\"head_dim\":8,\"size_tokens\":32}";

int c_api_test_cache_pools(const c_api_test_env* env, char* why, size_t why_len) {
  int result = 1;
  char err[1024];
  kvhost_client* admin = NULL;
  instance a = {NULL, NULL, NULL};
  const void* keys[2];
  size_t lens[2];
  int32_t states[2];
  int64_t rows[2 * PAGE_SIZE];
  int64_t slots[2 * PAGE_SIZE];
  size_t count = 0;
  uint64_t evicted = 99;
  kvhost_load_ticket ticket;
  kvhost_cache_stats before, after;
  int k;

  OK(connect_with(env, kToken, 0, &admin, E));
  OK(kvhost_pool_create(admin, "cache", kCacheSpec, E));
  OK(kvhost_pool_create(admin, "lf", kLayerFirstSpec, E));
  OK(kvhost_alloc(admin, "lf", 2 * PAGE_SIZE, slots, 2 * PAGE_SIZE, &count, E));
  CHECK(count == 2 * PAGE_SIZE, "alloc gave %zu slots", count);
  OK(start_instance(env, &a, E));

  /* key-0, key-1 from device pages 0, 1; restored into the LAYER_FIRST
   * pool; stored back from it as key-2, key-3; those restored into device
   * pages 4, 5 hold the bytes of pages 0, 1. */
  for (k = 0; k < 2; ++k) CHECK(page_bytes(&a, (uint64_t)k, 50u + (unsigned)k, 1), "fill %d", k);
  key_args(keys, lens, 0, 2);
  page_rows(0, 2, rows);
  OK(kvhost_cache_store(a.client, "cache", a.attachment, keys, lens, 2, rows, 2 * PAGE_SIZE, NULL,
                        0, states, &ticket, NULL, E));
  OK(kvhost_transfer_wait(a.client, ticket.ticket_id, 30000, NULL, 0, NULL, E));
  OK(kvhost_cache_restore_to_pool(a.client, "cache", "lf", keys, lens, 2, slots, 2 * PAGE_SIZE,
                                  &ticket, E));
  CHECK(ticket.ticket_id != 0 && ticket.event_set == -1, "restore to pool: ticket %llu set %d",
        (unsigned long long)ticket.ticket_id, ticket.event_set);
  OK(kvhost_transfer_wait(a.client, ticket.ticket_id, 30000, NULL, 0, NULL, E));
  key_args(keys, lens, 2, 2);
  OK(kvhost_cache_store_from_pool(a.client, "cache", "lf", keys, lens, 2, slots, 2 * PAGE_SIZE,
                                  states, &ticket, &evicted, E));
  CHECK(ticket.ticket_id != 0 && evicted == 0, "store from pool: ticket %llu evicted %llu",
        (unsigned long long)ticket.ticket_id, (unsigned long long)evicted);
  for (k = 0; k < 2; ++k)
    CHECK(states[k] == KVHOST_CACHE_ABSENT, "stored key %d: %d", k, states[k]);
  OK(kvhost_transfer_wait(a.client, ticket.ticket_id, 30000, NULL, 0, NULL, E));
  page_rows(4, 2, rows);
  OK(kvhost_cache_restore(a.client, "cache", a.attachment, keys, lens, 2, rows, 2 * PAGE_SIZE,
                          NULL, 0, &ticket, E));
  OK(kvhost_transfer_wait(a.client, ticket.ticket_id, 30000, NULL, 0, NULL, E));
  for (k = 0; k < 2; ++k) {
    CHECK(page_bytes(&a, 4u + (uint64_t)k, 50u + (unsigned)k, 0),
          "device page %d is not page %d's bytes after the trip through 'lf'", 4 + k, k);
  }

  /* Refusals, named, changing nothing. */
  OK(kvhost_cache_get_stats(admin, "cache", &before, E));
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT,
              kvhost_cache_store_from_pool(a.client, "cache", NULL, keys, lens, 2, slots,
                                           2 * PAGE_SIZE, states, &ticket, NULL, E));
  CONTAINS(err, "pool name");
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT,
              kvhost_cache_restore_to_pool(a.client, "cache", "lf", keys, lens, 2, NULL,
                                           2 * PAGE_SIZE, &ticket, E));
  CONTAINS(err, "host_indices is NULL");
  key_args(keys, lens, 4, 1); /* "never" */
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT,
              kvhost_cache_store_from_pool(a.client, "cache", "lf", keys, lens, 1, slots,
                                           2 * PAGE_SIZE, states, &ticket, NULL, E));
  CONTAINS(err, "8 slots for 1 keys; want 4");
  page_rows(7, 1, rows); /* never allocated */
  EXPECT_CODE(KVHOST_FAILED_PRECONDITION,
              kvhost_cache_store_from_pool(a.client, "cache", "lf", keys, lens, 1, rows, PAGE_SIZE,
                                           states, &ticket, NULL, E));
  CONTAINS(err, "'lf'");
  OK(kvhost_cache_get_stats(admin, "cache", &after, E));
  CHECK(same_stats(&before, &after), "a refused pool call changed the cache");
  result = 0;
done:
  stop_instance(&a);
  kvhost_client_close(admin);
  return result;
}
