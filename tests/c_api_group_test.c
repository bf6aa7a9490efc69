/* The C ABI's pool group attachments (kvhost_attach_group_shm,
 * kvhost_backup_group, kvhost_load_group) from C, against a real kvhostd on
 * the host backend: a hybrid group (an MHA KV pool, the anchor, and a MAMBA
 * state pool) attached through one shm device pool per entry, a byte-exact
 * backup and load of both entries' rows (also with a load ticket), and the refusals (an unknown
 * group is NOT_FOUND naming it, an entry the group lacks INVALID_ARGUMENT naming it), after which
 * no byte has changed. Compiled as C99; run by tests/c_api_test_driver.cc. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "c_api_check.h"
#include "c_api_test.h"
#include "kvhost/kvhost_c.h"

/* 4 model layers: attention on 0 and 2 (attn's device layers 0, 1), Mamba
 * on 1 and 3 (ssm's device layers 0, 1). Every device layer is mapped, so
 * a round trip moves every row byte of the rows named. */
static const char kAttnSpec[] =
    "{\"kind\":\"MHA\",\"layout\":\"PAGE_FIRST\",\"dtype\":\"BF16\",\"page_size\":4,"
    "\"layer_num\":2,\"head_num\":2,\"head_dim\":8,\"size_tokens\":64}";
static const char kSsmSpec[] =
    "{\"kind\":\"MAMBA\",\"layout\":\"PAGE_FIRST_DIRECT\",\"dtype\":\"BF16\",\"page_size\":1,"
    "\"layer_num\":2,\"size_tokens\":16,\"mamba\":{\"temporal\":{\"dims\":[2,3]},"
    "\"temporal_dtype\":\"FP32\",\"conv\":[{\"dims\":[5]}]}}";
static const char kGroup[] =
    "{\"layer_num\":4,\"entries\":["
    "{\"name\":\"kv\",\"pool\":\"attn\",\"layer_map\":[0,-1,1,-1],\"anchor\":true},"
    "{\"name\":\"ssm\",\"pool\":\"ssm\",\"layer_map\":[-1,0,-1,1]}]}";

enum { kKvHost = 8, kSsmHost = 3, kPageBytesMax = 4096 };

/* Byte b of row `row` of component c, layer l of device pool `seed`. */
static unsigned char group_pattern(uint32_t seed, uint32_t c, uint32_t l, uint64_t row,
                                   uint64_t b) {
  return (unsigned char)(1 + ((seed * 17u + c * 131u + l * 31u + row * 7u + b) % 251u));
}

/* Writes the pattern (seed) into every row of `dev`, or zeros (seed 0). */
static int fill_device(kvhost_shm_device_pool* dev, uint32_t seed, char* why, size_t why_len) {
  int result = 1;
  char err[1024];
  uint32_t components = 0, layers = 0, c, l;
  uint64_t rows = 0, row_bytes = 0, r, b;
  OK(kvhost_shm_device_pool_info(dev, &components, &layers, NULL, E));
  for (c = 0; c < components; ++c) {
    OK(kvhost_shm_device_pool_component(dev, c, NULL, 0, NULL, &rows, &row_bytes, NULL, E));
    for (l = 0; l < layers; ++l) {
      void* base = NULL;
      unsigned char* p;
      OK(kvhost_shm_device_pool_layer(dev, c, l, &base, NULL, E));
      p = (unsigned char*)base;
      for (r = 0; r < rows; ++r) {
        for (b = 0; b < row_bytes; ++b) {
          p[r * row_bytes + b] = seed == 0 ? 0 : group_pattern(seed, c, l, r, b);
        }
      }
    }
  }
  result = 0;
done:
  return result;
}

/* Row to[i] of every component and layer of `dev` holds row from[i] of
 * device pool `seed`; every other row is zero. */
static int check_device(const kvhost_shm_device_pool* dev, uint32_t seed, const int64_t* from,
                        const int64_t* to, size_t n, char* why, size_t why_len) {
  int result = 1;
  char err[1024];
  uint32_t components = 0, layers = 0, c, l;
  uint64_t rows = 0, row_bytes = 0, r, b;
  size_t i;
  OK(kvhost_shm_device_pool_info(dev, &components, &layers, NULL, E));
  for (c = 0; c < components; ++c) {
    OK(kvhost_shm_device_pool_component(dev, c, NULL, 0, NULL, &rows, &row_bytes, NULL, E));
    for (l = 0; l < layers; ++l) {
      void* base = NULL;
      const unsigned char* p;
      OK(kvhost_shm_device_pool_layer(dev, c, l, &base, NULL, E));
      p = (const unsigned char*)base;
      for (r = 0; r < rows; ++r) {
        int64_t src = -1;
        for (i = 0; i < n; ++i) {
          if ((uint64_t)to[i] == r) src = from[i];
        }
        for (b = 0; b < row_bytes; ++b) {
          unsigned char want = src < 0 ? 0 : group_pattern(seed, c, l, (uint64_t)src, b);
          CHECK(p[r * row_bytes + b] == want,
                "component %u layer %u row %llu byte %llu: %u, want %u (from row %lld)", c, l,
                (unsigned long long)r, (unsigned long long)b, p[r * row_bytes + b], want,
                (long long)src);
        }
      }
    }
  }
  result = 0;
done:
  return result;
}

/* The host pages of `pool`'s slots idx[0, n) (one page each, first slots
 * of their pages) back to back into out. */
static int host_image(kvhost_client* cl, const char* pool, const int64_t* idx, size_t n,
                      size_t step, unsigned char* out, size_t out_len, char* why, size_t why_len) {
  int result = 1;
  char err[1024];
  size_t i, used = 0, size = 0;
  for (i = 0; i < n; i += step) {
    OK(kvhost_get_data_page(cl, pool, idx[i], out + used, out_len - used, &size, E));
    used += size;
  }
  result = 0;
done:
  return result;
}

int c_api_test_group_backup_load(const c_api_test_env* env, char* why, size_t why_len) {
  int result = 1;
  char err[1024];
  char text[8192];
  int64_t kv_host[kKvHost], ssm_host[kSsmHost];
  const int64_t kv_rows[kKvHost] = {3, 4, 5, 6, 9, 10, 11, 0};
  const int64_t kv_rows2[kKvHost] = {15, 14, 13, 12, 1, 2, 7, 8};
  const int64_t ssm_rows[kSsmHost] = {5, 1, 6};
  const int64_t ssm_rows2[kSsmHost] = {0, 7, 2};
  const int64_t ssm_short[2] = {0, 7};
  size_t count = 0;
  uint64_t ticket = 0;
  kvhost_load_ticket load_ticket;
  unsigned char* kv_before = NULL;
  unsigned char* kv_after = NULL;
  unsigned char* ssm_before = NULL;
  unsigned char* ssm_after = NULL;
  const char* names[2] = {"kv", "ssm"};
  const char* unknown[2] = {"kv", "mamba"};
  const kvhost_shm_device_pool* devices[2];
  const kvhost_shm_device_pool* devices2[2];
  kvhost_pool_transfer good, bad;
  kvhost_client* cl = NULL;
  kvhost_shm_device_pool* kv_dev = NULL;
  kvhost_shm_device_pool* ssm_dev = NULL;
  kvhost_shm_device_pool* kv_dev2 = NULL;
  kvhost_shm_device_pool* ssm_dev2 = NULL;
  kvhost_attachment* att = NULL;
  kvhost_attachment* att2 = NULL;
  kvhost_attachment* refused = NULL;

  kv_before = (unsigned char*)calloc(kPageBytesMax, 1);
  kv_after = (unsigned char*)calloc(kPageBytesMax, 1);
  ssm_before = (unsigned char*)calloc(kPageBytesMax, 1);
  ssm_after = (unsigned char*)calloc(kPageBytesMax, 1);
  CHECK(kv_before && kv_after && ssm_before && ssm_after, "malloc");

  OK(kvhost_connect(env->address, 10000, 0, &cl, E));
  OK(kvhost_client_wait_ready(cl, 20000, E));
  OK(kvhost_pool_create(cl, "attn", kAttnSpec, E));
  OK(kvhost_pool_create(cl, "ssm", kSsmSpec, E));
  OK(kvhost_group_create(cl, "hybrid", kGroup, E));
  OK(kvhost_shm_device_pool_create(cl, "attn", 16, env->shm_dir, 0, 0, &kv_dev, E));
  OK(kvhost_shm_device_pool_create(cl, "ssm", 8, env->shm_dir, 0, 0, &ssm_dev, E));
  OK(kvhost_shm_device_pool_create(cl, "attn", 16, env->shm_dir, 0, 0, &kv_dev2, E));
  OK(kvhost_shm_device_pool_create(cl, "ssm", 8, env->shm_dir, 0, 0, &ssm_dev2, E));
  if (fill_device(kv_dev, 1, why, why_len) != 0) goto done;
  if (fill_device(ssm_dev, 2, why, why_len) != 0) goto done;
  devices[0] = kv_dev;
  devices[1] = ssm_dev;
  devices2[0] = kv_dev2;
  devices2[1] = ssm_dev2;

  /* Refused attaches hand out nothing and leave the group unattached. */
  EXPECT_CODE(KVHOST_NOT_FOUND,
              kvhost_attach_group_shm(cl, "nope", 2, names, devices, NULL, &refused, E));
  CONTAINS(err, "nope");
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT,
              kvhost_attach_group_shm(cl, "hybrid", 2, unknown, devices, NULL, &refused, E));
  CONTAINS(err, "mamba");
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT,
              kvhost_attach_group_shm(cl, "hybrid", 1, names, devices, NULL, &refused, E));
  CONTAINS(err, "ssm");
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT,
              kvhost_attach_group_shm(cl, "hybrid", 0, names, devices, NULL, &refused, E));
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT,
              kvhost_attach_group_shm(cl, "hybrid", 2, names, NULL, NULL, &refused, E));
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT, kvhost_attach_group_shm(cl, "hybrid", 2, names, devices,
                                                               "{\"entries\":[{}]}", &refused, E));
  CONTAINS(err, "entries");
  CHECK(refused == NULL, "a refused attach handed out an attachment");
  OK(kvhost_group_get_json(cl, "hybrid", text, sizeof(text), NULL, E));
  CONTAINS(text, "\"attachments\":0");

  OK(kvhost_attach_group_shm(cl, "hybrid", 2, names, devices, NULL, &att, E));
  OK(kvhost_attachment_json(att, text, sizeof(text), NULL, E));
  CONTAINS(text, "\"group\":\"hybrid\"");
  CONTAINS(text, "\"pool\":\"attn\"");
  OK(kvhost_group_get_json(cl, "hybrid", text, sizeof(text), NULL, E));
  CONTAINS(text, "\"attachments\":1");

  /* The anchor's slots through the group's name, ssm's from its own pool. */
  OK(kvhost_alloc(cl, "hybrid", kKvHost, kv_host, kKvHost, &count, E));
  OK(kvhost_alloc(cl, "ssm", kSsmHost, ssm_host, kSsmHost, &count, E));
  if (host_image(cl, "attn", kv_host, kKvHost, 4, kv_before, kPageBytesMax, why, why_len) != 0 ||
      host_image(cl, "ssm", ssm_host, kSsmHost, 1, ssm_before, kPageBytesMax, why, why_len) != 0) {
    goto done;
  }

  /* Refused backups: no byte of either host pool changes. */
  good.entry = "ssm";
  good.host_indices = ssm_host;
  good.num_host = kSsmHost;
  good.device_indices = ssm_rows;
  good.num_device = kSsmHost;
  bad = good;
  bad.entry = "mamba";
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT,
              kvhost_backup_group(cl, att, kv_host, kKvHost, kv_rows, kKvHost, &bad, 1, NULL, 0,
                                  KVHOST_TRANSFER_WAIT, 0, &ticket, E));
  CONTAINS(err, "mamba");
  bad.entry = "kv";
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT,
              kvhost_backup_group(cl, att, kv_host, kKvHost, kv_rows, kKvHost, &bad, 1, NULL, 0,
                                  KVHOST_TRANSFER_WAIT, 0, &ticket, E));
  CONTAINS(err, "kv");
  bad.entry = NULL;
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT,
              kvhost_backup_group(cl, att, kv_host, kKvHost, kv_rows, kKvHost, &bad, 1, NULL, 0,
                                  KVHOST_TRANSFER_WAIT, 0, &ticket, E));
  CONTAINS(err, "pool_transfers[0]");
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT,
              kvhost_backup_group(cl, att, kv_host, kKvHost, kv_rows, kKvHost, NULL, 1, NULL, 0,
                                  KVHOST_TRANSFER_WAIT, 0, &ticket, E));
  if (host_image(cl, "attn", kv_host, kKvHost, 4, kv_after, kPageBytesMax, why, why_len) != 0 ||
      host_image(cl, "ssm", ssm_host, kSsmHost, 1, ssm_after, kPageBytesMax, why, why_len) != 0) {
    goto done;
  }
  CHECK(memcmp(kv_before, kv_after, kPageBytesMax) == 0, "a refused backup changed attn's slots");
  CHECK(memcmp(ssm_before, ssm_after, kPageBytesMax) == 0, "a refused backup changed ssm's slots");

  /* The backup of both entries' rows, then a load of them into the second
   * attachment's buffers at other rows. */
  OK(kvhost_backup_group(cl, att, kv_host, kKvHost, kv_rows, kKvHost, &good, 1, NULL, 0,
                         KVHOST_TRANSFER_WAIT, 0, &ticket, E));
  CHECK(ticket != 0, "ticket 0");
  OK(kvhost_attach_group_shm(cl, "hybrid", 2, names, devices2, "{\"tp_rank\":0}", &att2, E));

  /* Refused loads: no byte of either device pool changes. */
  good.device_indices = ssm_short;
  good.num_device = 2;
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT,
              kvhost_load_group(cl, att2, kv_host, kKvHost, kv_rows2, kKvHost, &good, 1,
                                KVHOST_TRANSFER_WAIT, 0, &ticket, E));
  bad = good;
  bad.entry = "nope";
  bad.device_indices = ssm_rows2;
  bad.num_device = kSsmHost;
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT,
              kvhost_load_group(cl, att2, kv_host, kKvHost, kv_rows2, kKvHost, &bad, 1,
                                KVHOST_TRANSFER_WAIT, 0, &ticket, E));
  CONTAINS(err, "nope");
  if (check_device(kv_dev2, 1, NULL, NULL, 0, why, why_len) != 0) goto done;
  if (check_device(ssm_dev2, 2, NULL, NULL, 0, why, why_len) != 0) goto done;

  good.device_indices = ssm_rows2;
  good.num_device = kSsmHost;
  OK(kvhost_load_group(cl, att2, kv_host, kKvHost, kv_rows2, kKvHost, &good, 1, 0, 0, &ticket, E));
  OK(kvhost_transfer_wait(cl, ticket, 30000, text, sizeof(text), NULL, E));
  CONTAINS(text, "\"done\":true");
  if (check_device(kv_dev2, 1, kv_rows, kv_rows2, kKvHost, why, why_len) != 0) goto done;
  if (check_device(ssm_dev2, 2, ssm_rows, ssm_rows2, kSsmHost, why, why_len) != 0) goto done;
  /* The same load with a load ticket: the same bytes. */
  OK(kvhost_load_group_with_events(cl, att2, kv_host, kKvHost, kv_rows2, kKvHost, &good, 1,
                                   &load_ticket, E));
  OK(kvhost_transfer_wait(cl, load_ticket.ticket_id, 30000, NULL, 0, NULL, E));
  if (check_device(ssm_dev2, 2, ssm_rows, ssm_rows2, kSsmHost, why, why_len) != 0) goto done;
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT,
              kvhost_load_group_with_events(cl, att2, kv_host, kKvHost, kv_rows2, kKvHost, &bad, 1,
                                            &load_ticket, E));
  CONTAINS(err, "nope");

  OK(kvhost_detach(cl, att2, E));
  OK(kvhost_detach(cl, att, E));
  EXPECT_CODE(KVHOST_NOT_FOUND, kvhost_load_group(cl, att, kv_host, kKvHost, kv_rows2, kKvHost,
                                                  &good, 1, 0, 0, NULL, E));
  result = 0;
done:
  kvhost_attachment_destroy(att);
  kvhost_attachment_destroy(att2);
  kvhost_shm_device_pool_destroy(kv_dev);
  kvhost_shm_device_pool_destroy(ssm_dev);
  kvhost_shm_device_pool_destroy(kv_dev2);
  kvhost_shm_device_pool_destroy(ssm_dev2);
  kvhost_client_close(cl);
  free(kv_before);
  free(kv_after);
  free(ssm_before);
  free(ssm_after);
  return result;
}

/* kvhost_attach_group_cuda without a GPU (or, in a build without CUDA,
 * UNIMPLEMENTED): the sizes are checked against each entry's pool, and the
 * group and its entries named, before any CUDA call, so those answers are
 * the same on any host; the rest is FAILED_PRECONDITION (no GPU) or the
 * export's INVALID_ARGUMENT (these are not device pointers). No handle is
 * handed out by a refusal. */
int c_api_test_group_cuda_calls(const c_api_test_env* env, char* why, size_t why_len) {
  int result = 1;
  int rc;
  char err[1024];
  const char* kv_names[2] = {"k", "v"};
  const char* ssm_names[2] = {"temporal", "conv0"};
  /* Not device memory: never dereferenced on the host. */
  void* kv_ptrs[4] = {(void*)0x1000, (void*)0x2000, (void*)0x3000, (void*)0x4000};
  void* ssm_ptrs[4] = {(void*)0x5000, (void*)0x6000, (void*)0x7000, (void*)0x8000};
  /* 16 kv rows of 32 bytes; 8 ssm rows: temporal 2x3 fp32, conv0 5 bf16. */
  const uint64_t kv_bytes[2] = {16u * 32u, 16u * 32u};
  const uint64_t ssm_short[2] = {8u * 24u, 8u * 10u - 1u};
  const uint64_t ssm_bytes[2] = {8u * 24u, 8u * 10u};
  kvhost_cuda_group_entry entries[2];
  kvhost_client* cl = NULL;
  kvhost_attachment* att = NULL;

  memset(entries, 0, sizeof(entries));
  entries[0].entry = "kv";
  entries[0].num_components = 2;
  entries[0].component_names = kv_names;
  entries[0].layer_ptrs = kv_ptrs;
  entries[0].layer_bytes = kv_bytes;
  entries[0].device_size_tokens = 16;
  entries[0].num_layers = 2;
  entries[1] = entries[0];
  entries[1].entry = "ssm";
  entries[1].component_names = ssm_names;
  entries[1].layer_ptrs = ssm_ptrs;
  entries[1].layer_bytes = ssm_short;
  entries[1].device_size_tokens = 8;

  OK(kvhost_connect(env->address, 10000, 0, &cl, E));
  OK(kvhost_client_wait_ready(cl, 20000, E));
  OK(kvhost_pool_create(cl, "attn", kAttnSpec, E));
  OK(kvhost_pool_create(cl, "ssm", kSsmSpec, E));
  OK(kvhost_group_create(cl, "hybrid", kGroup, E));

  if (!kvhost_built_with_cuda()) {
    EXPECT_CODE(KVHOST_UNIMPLEMENTED,
                kvhost_attach_group_cuda(cl, "hybrid", 2, entries, NULL, &att, E));
    CONTAINS(err, "without CUDA");
    CHECK(att == NULL, "a refused attach handed out an attachment");
    result = 0;
    goto done;
  }
  /* conv0's buffers are a byte short of 8 rows of 10 bytes. */
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT,
              kvhost_attach_group_cuda(cl, "hybrid", 2, entries, NULL, &att, E));
  CONTAINS(err, "entry 'ssm'");
  CONTAINS(err, "component 'conv0'");
  CONTAINS(err, "79");
  EXPECT_CODE(KVHOST_NOT_FOUND, kvhost_attach_group_cuda(cl, "nope", 2, entries, NULL, &att, E));
  CONTAINS(err, "nope");
  entries[1].layer_bytes = ssm_bytes;
  entries[1].entry = "mamba";
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT,
              kvhost_attach_group_cuda(cl, "hybrid", 2, entries, NULL, &att, E));
  CONTAINS(err, "mamba");
  entries[1].entry = "ssm";
  entries[1].component_names = kv_names; /* the kv pool's names on the ssm pool */
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT,
              kvhost_attach_group_cuda(cl, "hybrid", 2, entries, NULL, &att, E));
  CONTAINS(err, "no component 'k'");
  entries[1].component_names = ssm_names;
  entries[1].reserved = 7;
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT,
              kvhost_attach_group_cuda(cl, "hybrid", 2, entries, NULL, &att, E));
  CONTAINS(err, "reserved");
  entries[1].reserved = 0;
  entries[0].entry = NULL;
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT,
              kvhost_attach_group_cuda(cl, "hybrid", 2, entries, NULL, &att, E));
  CONTAINS(err, "entries[0].entry");
  entries[0].entry = "kv";
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT,
              kvhost_attach_group_cuda(cl, "hybrid", 0, entries, NULL, &att, E));
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT,
              kvhost_attach_group_cuda(cl, "hybrid", 2, NULL, NULL, &att, E));
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT,
              kvhost_attach_group_cuda(cl, "hybrid", 2, entries, "{\"start_layer\":1}", &att, E));
  /* Sizes right: no GPU here (FAILED_PRECONDITION), or, with one, host
   * addresses the export refuses. */
  rc = kvhost_attach_group_cuda(cl, "hybrid", 2, entries, NULL, &att, E);
  CHECK(rc == KVHOST_FAILED_PRECONDITION || rc == KVHOST_INVALID_ARGUMENT,
        "group attach of host addresses: %s (%s)", kvhost_code_name(rc), err);
  CHECK(att == NULL, "a refused attach handed out an attachment");
  result = 0;
done:
  kvhost_attachment_destroy(att);
  kvhost_client_close(cl);
  return result;
}
