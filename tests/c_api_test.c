/* The C ABI (kvhost/kvhost_c.h) from C, against a real kvhostd on the host
 * backend: every call, its codes and messages (a bad pool name is
 * NOT_FOUND naming it, bad JSON INVALID_ARGUMENT), the buffer convention
 * (too small: OUT_OF_RANGE, nothing written, the size needed), byte-exact
 * backup / load through shm device buffers, per-layer waits on the layer
 * counters, the CUDA calls' answers without a GPU, and session losses
 * across a daemon restart. Compiled as C99; tests/c_api_test_driver.cc
 * starts the daemons. */
/* nanosleep: POSIX, which strict C99 hides. */
#define _POSIX_C_SOURCE 200809L

#include "c_api_test.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "c_api_check.h"
#include "kvhost/kvhost_c.h"

/* MHA, PAGE_FIRST, BF16, 4-token pages, 3 layers, 2 heads of 8: 32-byte rows. */
static const char kSpec[] =
    "{\"kind\":\"MHA\",\"layout\":\"PAGE_FIRST\",\"dtype\":\"BF16\",\"page_size\":4,"
    "\"layer_num\":3,\"head_num\":2,\"head_dim\":8,\"size_tokens\":64}";

static void sleep_ms(long ms) {
  struct timespec ts;
  ts.tv_sec = ms / 1000;
  ts.tv_nsec = (ms % 1000) * 1000000L;
  nanosleep(&ts, NULL);
}

/* A client of the daemon under test that it has answered. */
static int open_client(const c_api_test_env* env, int worker_session, kvhost_client** out,
                       char* err, size_t err_len) {
  int rc = kvhost_connect(env->address, 10000, worker_session, out, err, err_len);
  if (rc != KVHOST_OK) return rc;
  return kvhost_client_wait_ready(*out, 20000, err, err_len);
}

int c_api_test_library_and_buffers(const c_api_test_env* env, char* why, size_t why_len) {
  int result = 1;
  char err[1024];
  char small[8];
  char* json = NULL;
  size_t needed = 0;
  kvhost_client* c = NULL;

  CHECK(kvhost_abi_version() == KVHOST_ABI_VERSION, "abi %d, header %d", kvhost_abi_version(),
        KVHOST_ABI_VERSION);
  CHECK(kvhost_built_with_cuda() == 0 || kvhost_built_with_cuda() == 1, "built_with_cuda %d",
        kvhost_built_with_cuda());
  CHECK(strcmp(kvhost_code_name(KVHOST_NOT_FOUND), "NOT_FOUND") == 0, "%s",
        kvhost_code_name(KVHOST_NOT_FOUND));
  CHECK(strcmp(kvhost_code_name(16), "UNAUTHENTICATED") == 0, "%s", kvhost_code_name(16));
  CHECK(strcmp(kvhost_code_name(17), "UNKNOWN_CODE") == 0, "%s", kvhost_code_name(17));
  CHECK(strcmp(kvhost_code_name(-1), "UNKNOWN_CODE") == 0, "%s", kvhost_code_name(-1));

  OK(open_client(env, 0, &c, E));
  CHECK(err[0] == '\0', "OK left a message: '%s'", err);

  /* The size first (NULL, 0), then the JSON in a buffer of that size. */
  EXPECT_CODE(KVHOST_OUT_OF_RANGE, kvhost_daemon_status_json(c, NULL, 0, &needed, E));
  CHECK(needed > 2, "needed %zu", needed);
  CONTAINS(err, "bytes");
  json = (char*)malloc(needed);
  CHECK(json != NULL, "malloc");
  /* One byte short: nothing written. */
  memset(json, 'x', needed);
  EXPECT_CODE(KVHOST_OUT_OF_RANGE, kvhost_daemon_status_json(c, json, needed - 1, NULL, E));
  CHECK(json[0] == 'x', "a short buffer was written");
  OK(kvhost_daemon_status_json(c, json, needed, &needed, E));
  CHECK(strlen(json) + 1 == needed, "strlen %zu, needed %zu", strlen(json), needed);
  CHECK(json[0] == '{', "status JSON '%s'", json);
  CONTAINS(json, "\"backend\":\"host\"");

  /* The error buffer: truncated, always NUL-terminated; NULL is fine. */
  memset(small, 'x', sizeof(small));
  EXPECT_CODE(KVHOST_NOT_FOUND,
              kvhost_pool_get_json(c, "no-such-pool", NULL, 0, NULL, small, sizeof(small)));
  CHECK(small[sizeof(small) - 1] == '\0' && strlen(small) == sizeof(small) - 1,
        "truncated message '%.8s'", small);
  CHECK(kvhost_pool_get_json(c, "no-such-pool", NULL, 0, NULL, NULL, 0) == KVHOST_NOT_FOUND,
        "without an error buffer");
  /* A one-byte buffer holds only the NUL. */
  small[0] = 'x';
  CHECK(kvhost_pool_get_json(c, "no-such-pool", NULL, 0, NULL, small, 1) == KVHOST_NOT_FOUND &&
            small[0] == '\0',
        "one-byte error buffer");

  /* Null handles and arguments are INVALID_ARGUMENT, never a crash. */
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT, kvhost_daemon_status_json(NULL, NULL, 0, NULL, E));
  CONTAINS(err, "client is NULL");
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT, kvhost_pool_create(c, NULL, kSpec, E));
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT, kvhost_client_wait_ready(c, -5, E));
  CONTAINS(err, "-5");
  kvhost_client_close(NULL);
  kvhost_attachment_destroy(NULL);
  kvhost_shm_device_pool_destroy(NULL);
  kvhost_load_events_destroy(NULL);
  kvhost_worker_copier_destroy(NULL);
  kvhost_worker_ticket_destroy(NULL);
  kvhost_client_options_destroy(NULL);
  result = 0;
done:
  free(json);
  kvhost_client_close(c);
  return result;
}

int c_api_test_options_and_connect(const c_api_test_env* env, char* why, size_t why_len) {
  int result = 1;
  char err[1024];
  char list[4096];
  kvhost_client_options* o = NULL;
  kvhost_client* c = NULL;
  kvhost_client* unused = NULL;

  OK(kvhost_client_options_create(&o, E));
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT, kvhost_client_options_set(o, "adress", "x", E));
  CONTAINS(err, "'adress'");
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT, kvhost_client_options_set(o, "timeout_ms", "soon", E));
  CONTAINS(err, "soon");
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT, kvhost_client_options_set(o, "insecure", "maybe", E));
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT, kvhost_client_options_set(o, "address", NULL, E));
  OK(kvhost_client_options_set(o, "address", env->address, E));
  OK(kvhost_client_options_set(o, "timeout_ms", "10000", E));
  OK(kvhost_client_options_set(o, "worker_session", "0", E));
  OK(kvhost_client_options_set(o, "worker_name", "c-api-test", E));
  OK(kvhost_client_connect(o, &c, E));
  OK(kvhost_client_wait_ready(c, 20000, E));
  OK(kvhost_pool_list_json(c, list, sizeof(list), NULL, E));
  CHECK(strcmp(list, "{\"pools\":[]}") == 0, "pool list '%s'", list);

  /* A socket path is a unix address. */
  CHECK(strncmp(env->address, "unix://", 7) == 0, "address %s", env->address);
  OK(kvhost_connect(env->address + 7, 10000, 0, &unused, E));
  OK(kvhost_client_wait_ready(unused, 20000, E));
  kvhost_client_close(unused);
  unused = NULL;

  /* An empty address is refused by the C++ client, through the ABI. */
  OK(kvhost_client_options_set(o, "address", "", E));
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT, kvhost_client_connect(o, &unused, E));
  CHECK(unused == NULL, "a refused connect handed out a client");
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT, kvhost_connect(env->address, -1, 0, &unused, E));
  /* A daemon that is not there: UNAVAILABLE or DEADLINE_EXCEEDED, bounded. */
  OK(kvhost_connect("unix:///nonexistent/kvhost.sock", 500, 0, &unused, E));
  {
    int rc = kvhost_pool_list_json(unused, list, sizeof(list), NULL, E);
    CHECK(rc == KVHOST_UNAVAILABLE || rc == KVHOST_DEADLINE_EXCEEDED, "no daemon: %s (%s)",
          kvhost_code_name(rc), err);
  }
  result = 0;
done:
  kvhost_client_close(unused);
  kvhost_client_close(c);
  kvhost_client_options_destroy(o);
  return result;
}

int c_api_test_pools(const c_api_test_env* env, char* why, size_t why_len) {
  int result = 1;
  char err[1024];
  char json[8192];
  uint64_t released = 0;
  kvhost_client* c = NULL;

  OK(open_client(env, 0, &c, E));
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT, kvhost_pool_create(c, "p", "{not json", E));
  CONTAINS(err, "spec_json");
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT,
              kvhost_pool_create(c, "p", "{\"kind\":\"MHA\",\"bogus_field\":1}", E));
  CONTAINS(err, "bogus_field");
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT, kvhost_pool_create(c, "p", "{\"kind\":\"NOKIND\"}", E));
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT, kvhost_pool_create(c, "p", "", E));
  /* A well-formed spec the daemon refuses: its own INVALID_ARGUMENT. */
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT, kvhost_pool_create(c, "p", "{\"kind\":\"MHA\"}", E));
  OK(kvhost_pool_list_json(c, json, sizeof(json), NULL, E));
  CHECK(strcmp(json, "{\"pools\":[]}") == 0, "refusals left pools: '%s'", json);

  OK(kvhost_pool_create(c, "p", kSpec, E));
  EXPECT_CODE(KVHOST_ALREADY_EXISTS, kvhost_pool_create(c, "p", kSpec, E));
  CONTAINS(err, "'p'");
  /* lowerCamelCase names are accepted too. */
  OK(kvhost_pool_create(c, "q",
                        "{\"kind\":\"MLA\",\"layout\":\"PAGE_FIRST\",\"dtype\":\"BF16\","
                        "\"pageSize\":4,\"layerNum\":2,\"kvLoraRank\":12,\"qkRopeHeadDim\":4,"
                        "\"sizeTokens\":32}",
                        E));

  EXPECT_CODE(KVHOST_NOT_FOUND, kvhost_pool_get_json(c, "nope", json, sizeof(json), NULL, E));
  CONTAINS(err, "nope");
  OK(kvhost_pool_get_json(c, "p", json, sizeof(json), NULL, E));
  CONTAINS(json, "\"name\":\"p\"");
  CONTAINS(json, "\"kind\":\"MHA\"");
  CONTAINS(json, "\"available_tokens\":\"64\"");
  OK(kvhost_pool_list_json(c, json, sizeof(json), NULL, E));
  CONTAINS(json, "\"name\":\"p\"");
  CONTAINS(json, "\"name\":\"q\"");

  EXPECT_CODE(KVHOST_NOT_FOUND, kvhost_pool_delete(c, "nope", &released, E));
  CONTAINS(err, "nope");
  OK(kvhost_pool_delete(c, "p", &released, E));
  CHECK(released > 0, "released %llu bytes", (unsigned long long)released);
  OK(kvhost_pool_delete(c, "q", NULL, E));
  EXPECT_CODE(KVHOST_NOT_FOUND, kvhost_pool_get_json(c, "p", json, sizeof(json), NULL, E));
  result = 0;
done:
  kvhost_client_close(c);
  return result;
}

int c_api_test_alloc_free_pages(const c_api_test_env* env, char* why, size_t why_len) {
  int result = 1;
  char err[1024];
  char json[8192];
  int64_t idx[16];
  size_t count = 0;
  size_t size = 0;
  size_t i;
  uint64_t freed = 0;
  unsigned char* page = NULL;
  unsigned char* back = NULL;
  kvhost_client* c = NULL;

  OK(open_client(env, 0, &c, E));
  OK(kvhost_pool_create(c, "p", kSpec, E));

  /* Capacity is checked before the call: nothing allocated. */
  EXPECT_CODE(KVHOST_OUT_OF_RANGE, kvhost_alloc(c, "p", 8, idx, 4, &count, E));
  CHECK(count == 8, "count %zu, want the 8 needed", count);
  CONTAINS(err, "'p'");
  EXPECT_CODE(KVHOST_OUT_OF_RANGE, kvhost_alloc(c, "p", 8, NULL, 0, NULL, E));
  OK(kvhost_pool_get_json(c, "p", json, sizeof(json), NULL, E));
  CONTAINS(json, "\"available_tokens\":\"64\"");
  EXPECT_CODE(KVHOST_NOT_FOUND, kvhost_alloc(c, "nope", 8, idx, 16, &count, E));
  CONTAINS(err, "nope");
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT, kvhost_alloc(c, "p", 3, idx, 16, &count, E));
  /* Zero slots need no buffer: the daemon's own refusal. */
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT, kvhost_alloc(c, "p", 0, NULL, 0, &count, E));

  OK(kvhost_alloc(c, "p", 8, idx, 16, &count, E));
  CHECK(count == 8, "count %zu", count);
  CHECK(idx[0] % 4 == 0 && idx[4] % 4 == 0 && idx[1] == idx[0] + 1, "slots %lld %lld %lld",
        (long long)idx[0], (long long)idx[1], (long long)idx[4]);
  OK(kvhost_pool_get_json(c, "p", json, sizeof(json), NULL, E));
  CONTAINS(json, "\"available_tokens\":\"56\"");

  OK(kvhost_page_buffer_meta_json(c, "p", idx, 8, json, sizeof(json), NULL, E));
  CHECK(json[0] == '{', "meta '%s'", json);
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT,
              kvhost_page_buffer_meta_json(c, "p", NULL, 3, json, sizeof(json), NULL, E));
  EXPECT_CODE(KVHOST_NOT_FOUND,
              kvhost_page_buffer_meta_json(c, "nope", idx, 8, json, sizeof(json), NULL, E));

  /* Pages: the size first, a short buffer refused, then the bytes. */
  EXPECT_CODE(KVHOST_OUT_OF_RANGE, kvhost_get_data_page(c, "p", idx[0], NULL, 0, &size, E));
  CHECK(size > 0, "page size %zu", size);
  page = (unsigned char*)malloc(size);
  back = (unsigned char*)malloc(size);
  CHECK(page != NULL && back != NULL, "malloc");
  memset(back, 0xAB, size);
  EXPECT_CODE(KVHOST_OUT_OF_RANGE, kvhost_get_data_page(c, "p", idx[0], back, size - 1, NULL, E));
  CHECK(back[0] == 0xAB, "a short page buffer was written");
  for (i = 0; i < size; ++i) page[i] = (unsigned char)(i * 7 + 3);
  OK(kvhost_set_from_flat_data_page(c, "p", idx[4], page, size, E));
  OK(kvhost_get_data_page(c, "p", idx[4], back, size, &size, E));
  CHECK(memcmp(page, back, size) == 0, "page %lld read back differs", (long long)idx[4]);
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT,
              kvhost_set_from_flat_data_page(c, "p", idx[4], page, size - 1, E));
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT, kvhost_set_from_flat_data_page(c, "p", idx[4], NULL, 4, E));
  EXPECT_CODE(KVHOST_NOT_FOUND, kvhost_get_data_page(c, "nope", idx[0], back, size, NULL, E));

  OK(kvhost_free(c, "p", idx, 8, &freed, E));
  CHECK(freed == 8, "freed %llu", (unsigned long long)freed);
  EXPECT_CODE(KVHOST_FAILED_PRECONDITION, kvhost_free(c, "p", idx, 8, &freed, E));
  EXPECT_CODE(KVHOST_NOT_FOUND, kvhost_free(c, "nope", idx, 8, NULL, E));
  OK(kvhost_pool_get_json(c, "p", json, sizeof(json), NULL, E));
  CONTAINS(json, "\"available_tokens\":\"64\"");
  result = 0;
done:
  free(page);
  free(back);
  kvhost_client_close(c);
  return result;
}

int c_api_test_groups(const c_api_test_env* env, char* why, size_t why_len) {
  int result = 1;
  char err[1024];
  char json[8192];
  int64_t idx[4];
  size_t count = 0;
  kvhost_client* c = NULL;

  OK(open_client(env, 0, &c, E));
  OK(kvhost_pool_create(c, "attn", kSpec, E));
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT, kvhost_group_create(c, "g", "[1,2]", E));
  CONTAINS(err, "group_json");
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT,
              kvhost_group_create(c, "g", "{\"name\":\"h\",\"layer_num\":3}", E));
  CONTAINS(err, "'h'");
  EXPECT_CODE(
      KVHOST_NOT_FOUND,
      kvhost_group_create(
          c, "g", "{\"layer_num\":3,\"entries\":[{\"name\":\"kv\",\"pool\":\"nope\"}]}", E));
  CONTAINS(err, "nope");
  OK(kvhost_group_create(
      c, "g", "{\"layer_num\":3,\"entries\":[{\"name\":\"kv\",\"pool\":\"attn\",\"anchor\":true}]}",
      E));
  OK(kvhost_group_get_json(c, "g", json, sizeof(json), NULL, E));
  CONTAINS(json, "\"name\":\"g\"");
  CONTAINS(json, "\"pool\":\"attn\"");
  EXPECT_CODE(KVHOST_NOT_FOUND, kvhost_group_get_json(c, "nope", json, sizeof(json), NULL, E));
  CONTAINS(err, "nope");
  /* A group's name allocates from its anchor pool. */
  OK(kvhost_alloc(c, "g", 4, idx, 4, &count, E));
  OK(kvhost_free(c, "g", idx, 4, NULL, E));
  OK(kvhost_group_delete(c, "g", E));
  EXPECT_CODE(KVHOST_NOT_FOUND, kvhost_group_delete(c, "g", E));
  CONTAINS(err, "g");
  result = 0;
done:
  kvhost_client_close(c);
  return result;
}

/* Byte r of row `row` of component c, layer l, as the test writes it. */
static unsigned char pattern(uint32_t c, uint32_t l, uint64_t row, uint64_t b) {
  return (unsigned char)(1 + ((c * 131u + l * 31u + row * 7u + b) % 251u));
}

int c_api_test_shm_backup_load(const c_api_test_env* env, char* why, size_t why_len) {
  int result = 1;
  char err[1024];
  char text[8192];
  char id[256];
  size_t needed = 0;
  int64_t host[8];
  int64_t first_rows[8];
  int64_t other_rows[8];
  size_t count = 0;
  uint32_t components = 0, layers = 0, c, l;
  uint64_t bytes = 0, ticket = 0, rows = 0, row_bytes = 0, row_tokens = 0, r, b;
  int32_t done_flag = 0;
  unsigned char fake_handle[KVHOST_CUDA_EVENT_HANDLE_BYTES];
  int i;
  kvhost_client* cl = NULL;
  kvhost_shm_device_pool* dev = NULL;
  kvhost_attachment* att = NULL;
  kvhost_attachment* refused = NULL;

  OK(open_client(env, 0, &cl, E));
  OK(kvhost_pool_create(cl, "p", kSpec, E));
  OK(kvhost_alloc(cl, "p", 8, host, 8, &count, E));

  EXPECT_CODE(KVHOST_NOT_FOUND,
              kvhost_shm_device_pool_create(cl, "nope", 16, env->shm_dir, 0, 0, &dev, E));
  CONTAINS(err, "nope");
  CHECK(dev == NULL, "a refused create handed out a device pool");
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT,
              kvhost_shm_device_pool_create(cl, "p", 0, env->shm_dir, 0, 0, &dev, E));
  /* Sizes whose layers x rows x row_bytes (summed over K and V) pass 2^64:
   * refused by name, never a wrapped size and a pointer past the file. */
  {
    const uint64_t huge[] = {(uint64_t)1 << 57, (uint64_t)1 << 59, (uint64_t)1 << 62, UINT64_MAX};
    for (i = 0; i < 4; ++i) {
      EXPECT_CODE(KVHOST_INVALID_ARGUMENT,
                  kvhost_shm_device_pool_create(cl, "p", huge[i], env->shm_dir, 0, 0, &dev, E));
      CONTAINS(err, "device_size_tokens");
      CHECK(dev == NULL, "an overflowing create handed out a device pool");
    }
  }
  OK(kvhost_shm_device_pool_create(cl, "p", 16, env->shm_dir, 0, 0, &dev, E));
  OK(kvhost_shm_device_pool_info(dev, &components, &layers, &bytes, E));
  CHECK(components == 2 && layers == 3 && bytes == 2u * 3u * 16u * 32u,
        "components %u layers %u bytes %llu", components, layers, (unsigned long long)bytes);
  OK(kvhost_shm_device_pool_component(dev, 1, text, sizeof(text), &needed, &rows, &row_bytes,
                                      &row_tokens, E));
  CHECK(strcmp(text, "v") == 0 && rows == 16 && row_bytes == 32 && row_tokens == 1,
        "component 1: '%s' rows %llu row_bytes %llu row_tokens %llu", text,
        (unsigned long long)rows, (unsigned long long)row_bytes, (unsigned long long)row_tokens);
  EXPECT_CODE(KVHOST_OUT_OF_RANGE,
              kvhost_shm_device_pool_component(dev, 0, text, 1, &needed, NULL, NULL, NULL, E));
  CHECK(needed == 2, "name needs %zu", needed);
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT,
              kvhost_shm_device_pool_component(dev, 2, NULL, 0, NULL, NULL, NULL, NULL, E));
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT, kvhost_shm_device_pool_layer(dev, 0, 3, NULL, NULL, E));
  CONTAINS(err, "layer 3");

  /* Device rows 0..7 get a pattern; rows 8..15 stay zero until the load. */
  for (c = 0; c < components; ++c) {
    for (l = 0; l < layers; ++l) {
      void* base = NULL;
      uint64_t layer_bytes = 0;
      unsigned char* p;
      OK(kvhost_shm_device_pool_layer(dev, c, l, &base, &layer_bytes, E));
      CHECK(base != NULL && layer_bytes == 16u * 32u, "layer bytes %llu",
            (unsigned long long)layer_bytes);
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

  /* options_json: only the non-buffer fields. */
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT,
              kvhost_attach_shm(cl, "p", dev, "{\"k_layers\":[{}]}", &refused, E));
  CONTAINS(err, "k_layers");
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT,
              kvhost_attach_shm(cl, "p", dev, "{\"start_layer\":1}", &refused, E));
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT,
              kvhost_attach_shm(cl, "p", dev, "{\"nope\":1}", &refused, E));
  EXPECT_CODE(KVHOST_NOT_FOUND, kvhost_attach_shm(cl, "nope", dev, NULL, &refused, E));
  CONTAINS(err, "nope");
  CHECK(refused == NULL, "a refused attach handed out an attachment");
  OK(kvhost_attach_shm(cl, "p", dev, "{\"tp_rank\":0}", &att, E));
  OK(kvhost_attachment_id(att, id, sizeof(id), NULL, E));
  CHECK(strlen(id) > 0, "empty attachment id");
  OK(kvhost_attachment_json(att, text, sizeof(text), NULL, E));
  CONTAINS(text, "\"pool\":\"p\"");
  CONTAINS(text, "\"backend\":\"host\"");

  /* Backup rows 0..7 to the host slots, waiting; then load them into 8..15. */
  OK(kvhost_backup(cl, att, host, 8, first_rows, 8, NULL, 0, KVHOST_TRANSFER_WAIT, 0, &ticket, E));
  CHECK(ticket != 0, "ticket 0");
  OK(kvhost_transfer_poll(cl, ticket, &done_flag, text, sizeof(text), NULL, E));
  CHECK(done_flag == 1, "a waited backup not done");
  CONTAINS(text, "\"done\":true");
  OK(kvhost_load(cl, att, host, 8, other_rows, 8, 0, 0, &ticket, E));
  OK(kvhost_transfer_wait(cl, ticket, 30000, text, sizeof(text), NULL, E));
  CONTAINS(text, "\"done\":true");
  for (c = 0; c < components; ++c) {
    for (l = 0; l < layers; ++l) {
      void* base = NULL;
      const unsigned char* p;
      OK(kvhost_shm_device_pool_layer(dev, c, l, &base, NULL, E));
      p = (const unsigned char*)base;
      for (r = 0; r < 8; ++r) {
        for (b = 0; b < 32; ++b) {
          CHECK(p[(8 + r) * 32 + b] == pattern(c, l, r, b),
                "component %u layer %u row %llu byte %llu: %u after the round trip, want %u", c, l,
                (unsigned long long)(8 + r), (unsigned long long)b, p[(8 + r) * 32 + b],
                pattern(c, l, r, b));
        }
      }
    }
  }

  /* Refusals: the daemon's codes through the ABI. */
  memset(fake_handle, 0, sizeof(fake_handle));
  EXPECT_CODE(KVHOST_FAILED_PRECONDITION,
              kvhost_backup(cl, att, host, 8, first_rows, 8, fake_handle, sizeof(fake_handle), 0, 0,
                            &ticket, E));
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT,
              kvhost_backup(cl, att, host, 8, first_rows, 8, NULL, 64, 0, 0, &ticket, E));
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT,
              kvhost_load(cl, att, host, 8, other_rows, 8, 0x80u, 0, &ticket, E));
  CONTAINS(err, "flags");
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT, kvhost_load(cl, att, host, 8, other_rows, 7, 0, 0, NULL, E));
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT, kvhost_load(cl, att, NULL, 8, other_rows, 8, 0, 0, NULL, E));
  EXPECT_CODE(KVHOST_NOT_FOUND, kvhost_transfer_wait(cl, 987654321, 1000, NULL, 0, NULL, E));
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT,
              kvhost_load(cl, NULL, host, 8, other_rows, 8, 0, 0, NULL, E));

  OK(kvhost_detach(cl, att, E));
  EXPECT_CODE(KVHOST_NOT_FOUND, kvhost_load(cl, att, host, 8, other_rows, 8, 0, 0, &ticket, E));
  EXPECT_CODE(KVHOST_NOT_FOUND, kvhost_detach(cl, att, E));
  result = 0;
done:
  kvhost_attachment_destroy(att);
  kvhost_shm_device_pool_destroy(dev);
  kvhost_client_close(cl);
  return result;
}

int c_api_test_layer_waits(const c_api_test_env* env, char* why, size_t why_len) {
  int result = 1;
  char err[1024];
  int64_t host[8];
  int64_t rows[8];
  size_t count = 0;
  uint32_t l;
  int i;
  kvhost_load_ticket ticket;
  kvhost_load_ticket backup;
  int32_t loaded_set = -1;
  kvhost_client* cl = NULL;
  kvhost_shm_device_pool* dev = NULL;
  kvhost_attachment* plain = NULL;
  kvhost_attachment* att = NULL;
  kvhost_load_events* events = NULL;
  kvhost_load_events* refused = NULL;

  OK(open_client(env, 1, &cl, E));
  OK(kvhost_pool_create(cl, "p", kSpec, E));
  OK(kvhost_alloc(cl, "p", 8, host, 8, &count, E));
  for (i = 0; i < 8; ++i) rows[i] = i;
  OK(kvhost_shm_device_pool_create(cl, "p", 8, env->shm_dir, 0, 0, &dev, E));

  /* No events and no counters: nothing to wait on. */
  OK(kvhost_attach_shm(cl, "p", dev, NULL, &plain, E));
  EXPECT_CODE(KVHOST_FAILED_PRECONDITION, kvhost_load_events_open(cl, plain, &refused, E));
  CONTAINS(err, "layer_progress");
  CHECK(refused == NULL, "refused events handed out");
  OK(kvhost_detach(cl, plain, E));

  OK(kvhost_attach_shm(cl, "p", dev, "{\"layer_progress\":true,\"loadOnly\":false}", &att, E));
  OK(kvhost_load_events_open(cl, att, &events, E));
  memset(&ticket, 0xFF, sizeof(ticket));
  OK(kvhost_load_with_events(cl, att, host, 8, rows, 8, &ticket, E));
  CHECK(ticket.ticket_id != 0 && ticket.event_set >= 0 && ticket.reserved == 0,
        "ticket %llu set %d", (unsigned long long)ticket.ticket_id, ticket.event_set);
  loaded_set = ticket.event_set;
  for (l = 0; l < 3; ++l) OK(kvhost_wait_layer(events, &ticket, l, NULL, 10000, E));
  OK(kvhost_transfer_wait(cl, ticket.ticket_id, 30000, NULL, 0, NULL, E));
  /* A layer no load records: DEADLINE_EXCEEDED after the timeout. */
  EXPECT_CODE(KVHOST_DEADLINE_EXCEEDED, kvhost_wait_layer(events, &ticket, 3, NULL, 50, E));
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT, kvhost_wait_layer(events, NULL, 0, NULL, 50, E));
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT, kvhost_wait_layer(NULL, &ticket, 0, NULL, 50, E));
  /* A ticket without a set: nothing to wait for. */
  ticket.event_set = -1;
  OK(kvhost_wait_layer(events, &ticket, 0, NULL, 50, E));
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT, kvhost_load_with_events(cl, att, host, 8, rows, 8, NULL, E));
  /* A backup names its set as a load does (the next set of the ring, after
   * the load's count on it); its last layer recorded is the whole backup. */
  memset(&backup, 0xFF, sizeof(backup));
  OK(kvhost_backup_with_events(cl, att, host, 8, rows, 8, NULL, 0, &backup, E));
  CHECK(backup.ticket_id != 0 && backup.event_set >= 0 && backup.reserved == 0 &&
            backup.event_set != loaded_set,
        "backup ticket %llu set %d", (unsigned long long)backup.ticket_id, backup.event_set);
  OK(kvhost_wait_layer(events, &backup, 2, NULL, 10000, E));
  OK(kvhost_transfer_wait(cl, backup.ticket_id, 30000, NULL, 0, NULL, E));
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT,
              kvhost_backup_with_events(cl, att, host, 8, rows, 8, NULL, 0, NULL, E));
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT,
              kvhost_backup_with_events(cl, att, host, 8, rows, 8, NULL, 64, &backup, E));
  CONTAINS(err, "wait_event_handle is NULL");
  result = 0;
done:
  kvhost_load_events_destroy(events);
  kvhost_attachment_destroy(plain);
  kvhost_attachment_destroy(att);
  kvhost_shm_device_pool_destroy(dev);
  kvhost_client_close(cl);
  return result;
}

int c_api_test_cuda_calls(const c_api_test_env* env, char* why, size_t why_len) {
  int result = 1;
  char err[1024];
  unsigned char handle[KVHOST_CUDA_EVENT_HANDLE_BYTES];
  const char* names[2] = {"k", "v"};
  /* Not device memory: these are never dereferenced on the host. */
  void* layers[6] = {(void*)0x1000, (void*)0x2000, (void*)0x3000,
                     (void*)0x4000, (void*)0x5000, (void*)0x6000};
  uint64_t too_small[2] = {16u * 32u, 16u * 32u - 1u};
  int64_t host[4] = {0, 1, 2, 3};
  int rc;
  kvhost_client* cl = NULL;
  kvhost_shm_device_pool* dev = NULL;
  kvhost_attachment* shm = NULL;
  kvhost_attachment* att = NULL;
  kvhost_worker_copier* copier = NULL;
  kvhost_worker_ticket* wt = NULL;

  OK(open_client(env, 0, &cl, E));
  OK(kvhost_pool_create(cl, "p", kSpec, E));
  OK(kvhost_shm_device_pool_create(cl, "p", 16, env->shm_dir, 0, 0, &dev, E));
  OK(kvhost_attach_shm(cl, "p", dev, NULL, &shm, E));

  if (!kvhost_built_with_cuda()) {
    EXPECT_CODE(KVHOST_UNIMPLEMENTED,
                kvhost_attach_cuda(cl, "p", 2, names, 3, layers, NULL, 16, NULL, &att, E));
    CONTAINS(err, "without CUDA");
    EXPECT_CODE(KVHOST_UNIMPLEMENTED,
                kvhost_cuda_export_event(NULL, handle, sizeof(handle), NULL, E));
    EXPECT_CODE(KVHOST_UNIMPLEMENTED, kvhost_worker_copier_open(cl, shm, 0, &copier, E));
    EXPECT_CODE(KVHOST_UNIMPLEMENTED,
                kvhost_worker_copy_load(copier, host, 4, host, 4, NULL, &wt, E));
    EXPECT_CODE(KVHOST_UNIMPLEMENTED, kvhost_worker_ticket_info(wt, NULL, NULL, E));
    result = 0;
    goto done;
  }
  /* The sizes are checked against the pool before any CUDA call. */
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT,
              kvhost_attach_cuda(cl, "p", 2, names, 3, layers, too_small, 16, NULL, &att, E));
  CONTAINS(err, "component 'v'");
  CONTAINS(err, "511");
  EXPECT_CODE(KVHOST_NOT_FOUND,
              kvhost_attach_cuda(cl, "nope", 2, names, 3, layers, too_small, 16, NULL, &att, E));
  CONTAINS(err, "nope");
  /* No GPU: FAILED_PRECONDITION; a GPU: these are not device pointers. */
  rc = kvhost_attach_cuda(cl, "p", 2, names, 3, layers, NULL, 16, NULL, &att, E);
  CHECK(rc == KVHOST_FAILED_PRECONDITION || rc == KVHOST_INVALID_ARGUMENT,
        "attach of host addresses: %s (%s)", kvhost_code_name(rc), err);
  CHECK(att == NULL, "a refused attach handed out an attachment");
  rc = kvhost_cuda_export_event(NULL, handle, sizeof(handle), NULL, E);
  CHECK(rc == KVHOST_FAILED_PRECONDITION || rc == KVHOST_INVALID_ARGUMENT,
        "export of a null event: %s (%s)", kvhost_code_name(rc), err);
  /* A copier needs an attachment made from CUDA buffers. */
  EXPECT_CODE(KVHOST_FAILED_PRECONDITION, kvhost_worker_copier_open(cl, shm, 0, &copier, E));
  CONTAINS(err, "kvhost_attach_cuda");
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT,
              kvhost_worker_copy_load(NULL, host, 4, host, 4, NULL, &wt, E));
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT, kvhost_worker_copy_wait(NULL, wt, 0, E));
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT, kvhost_worker_ticket_info(NULL, NULL, NULL, E));
  result = 0;
done:
  kvhost_worker_ticket_destroy(wt);
  kvhost_worker_copier_destroy(copier);
  kvhost_attachment_destroy(att);
  kvhost_attachment_destroy(shm);
  kvhost_shm_device_pool_destroy(dev);
  kvhost_client_close(cl);
  return result;
}

int c_api_test_session_loss(const c_api_test_env* env, char* why, size_t why_len) {
  int result = 1;
  char err[1024];
  char id[256];
  char last[2048];
  int32_t open = 0;
  uint64_t reconnects = 0, losses = 0;
  size_t needed = 0;
  int i;
  kvhost_client* cl = NULL;
  kvhost_shm_device_pool* dev = NULL;
  kvhost_attachment* att = NULL;

  OK(open_client(env, 1, &cl, E));
  OK(kvhost_client_session_losses(cl, &losses, last, sizeof(last), NULL, E));
  CHECK(losses == 0 && last[0] == '\0', "losses %llu '%s'", (unsigned long long)losses, last);
  OK(kvhost_pool_create(cl, "p", kSpec, E));
  OK(kvhost_shm_device_pool_create(cl, "p", 8, env->shm_dir, 0, 0, &dev, E));
  OK(kvhost_attach_shm(cl, "p", dev, NULL, &att, E));
  OK(kvhost_client_open_session(cl, 10000, E));
  OK(kvhost_client_session_state(cl, &open, &reconnects, id, sizeof(id), &needed, E));
  CHECK(open == 1 && id[0] != '\0' && reconnects == 0 && needed == strlen(id) + 1,
        "open %d id '%s' reconnects %llu", open, id, (unsigned long long)reconnects);
  EXPECT_CODE(KVHOST_OUT_OF_RANGE, kvhost_client_session_state(cl, NULL, NULL, id, 1, &needed, E));
  OK(kvhost_client_session_state(cl, &open, NULL, NULL, 0, NULL, E));

  env->restart(env->restart_arg);
  /* The session thread finds the new daemon and reports the loss. */
  for (i = 0; i < 400 && losses == 0; ++i) {
    OK(kvhost_client_session_losses(cl, &losses, NULL, 0, NULL, E));
    if (losses == 0) sleep_ms(50);
  }
  CHECK(losses == 1, "%llu session losses after a restart, want 1", (unsigned long long)losses);
  EXPECT_CODE(KVHOST_OUT_OF_RANGE, kvhost_client_session_losses(cl, &losses, last, 4, &needed, E));
  CHECK(needed > 4, "needed %zu", needed);
  OK(kvhost_client_session_losses(cl, &losses, last, sizeof(last), NULL, E));
  CONTAINS(last, "restarted");
  CONTAINS(last, "1 attachment(s) lost");
  OK(kvhost_client_session_state(cl, &open, &reconnects, NULL, 0, NULL, E));
  CHECK(reconnects >= 1, "reconnects %llu", (unsigned long long)reconnects);
  /* Its attachment is gone with the old daemon. */
  EXPECT_CODE(KVHOST_NOT_FOUND, kvhost_detach(cl, att, E));
  result = 0;
done:
  kvhost_attachment_destroy(att);
  kvhost_shm_device_pool_destroy(dev);
  kvhost_client_close(cl);
  return result;
}
