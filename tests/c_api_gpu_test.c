/* The C ABI's CUDA calls from C, on GPU 0 against a kvhostd with
 * --backend=cuda --worker-copy (tests/c_api_gpu_test_driver.cc skips
 * without a GPU): kvhost_attach_cuda of cudaMalloc'd layer buffers, a
 * backup that waits on the worker's exported event, a load waited on per
 * layer on a stream (layer counters, then the load events), a worker
 * copy each way, and kvhost_attach_group_cuda of a hybrid group (MHA +
 * MAMBA) with a backup and load of both entries; every round trip is
 * checked byte for byte. Compiled as C99. */
#include <cuda_runtime_api.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "c_api_check.h"
#include "c_api_test.h"
#include "kvhost/kvhost_c.h"

/* MHA, PAGE_FIRST, BF16, 4-token pages, 3 layers, 2 heads of 8: 32-byte rows. */
static const char kSpec[] =
    "{\"kind\":\"MHA\",\"layout\":\"PAGE_FIRST\",\"dtype\":\"BF16\",\"page_size\":4,"
    "\"layer_num\":3,\"head_num\":2,\"head_dim\":8,\"size_tokens\":64}";

enum { kComponents = 2, kLayers = 3, kRows = 16, kRowBytes = 32, kMoved = 8 };
enum { kLayerBytes = kRows * kRowBytes };

#define CHECK_CUDA(call)                                               \
  do {                                                                 \
    cudaError_t e_ = (call);                                           \
    CHECK(e_ == cudaSuccess, "%s: %s", #call, cudaGetErrorString(e_)); \
  } while (0)

/* The worker's device KV pool: one allocation, component-major layer buffers
 * (so the attach exports one handle), and its image on the host. */
typedef struct gpu_pool {
  unsigned char* base;
  void* layers[kComponents * kLayers];
  unsigned char image[kComponents * kLayers][kLayerBytes];
} gpu_pool;

static unsigned char pattern(int buffer, int row, int b) {
  return (unsigned char)(1 + ((buffer * 131 + row * 7 + b) % 251));
}

/* Rows [0, kMoved) patterned, the rest zero, on the device and in image. */
static cudaError_t gpu_pool_fill(gpu_pool* pool) {
  int i, r, b;
  cudaError_t e = cudaMalloc((void**)&pool->base, (size_t)kComponents * kLayers * kLayerBytes);
  if (e != cudaSuccess) return e;
  for (i = 0; i < kComponents * kLayers; ++i) {
    pool->layers[i] = pool->base + (size_t)i * kLayerBytes;
    memset(pool->image[i], 0, kLayerBytes);
    for (r = 0; r < kMoved; ++r) {
      for (b = 0; b < kRowBytes; ++b) pool->image[i][r * kRowBytes + b] = pattern(i, r, b);
    }
  }
  return cudaMemcpy(pool->base, pool->image, sizeof(pool->image), cudaMemcpyHostToDevice);
}

/* Whether device rows [kMoved, 2 kMoved) of every buffer hold what rows
 * [0, kMoved) were written with; the first difference into diff. */
static int gpu_pool_moved(const gpu_pool* pool, char* diff, size_t diff_len) {
  static unsigned char now[kComponents * kLayers][kLayerBytes];
  int i, k;
  cudaError_t e = cudaMemcpy(now, pool->base, sizeof(now), cudaMemcpyDeviceToHost);
  if (e != cudaSuccess) {
    snprintf(diff, diff_len, "cudaMemcpy back: %s", cudaGetErrorString(e));
    return 0;
  }
  for (i = 0; i < kComponents * kLayers; ++i) {
    for (k = 0; k < kMoved * kRowBytes; ++k) {
      if (now[i][kMoved * kRowBytes + k] != pool->image[i][k]) {
        snprintf(diff, diff_len, "buffer %d (component %d layer %d) byte %d of row %d: %u, want %u",
                 i, i / kLayers, i % kLayers, k % kRowBytes, kMoved + k / kRowBytes,
                 now[i][kMoved * kRowBytes + k], pool->image[i][k]);
        return 0;
      }
    }
  }
  return 1;
}

static const char* const kNames[kComponents] = {"k", "v"};
static const uint64_t kBytes[kComponents] = {kLayerBytes, kLayerBytes};

int c_api_gpu_test_attach_backup_load(const c_api_test_env* env, char* why, size_t why_len) {
  int result = 1;
  char err[1024];
  char diff[512];
  char json[8192];
  int64_t host[kMoved], first[kMoved], second[kMoved];
  unsigned char handle[KVHOST_CUDA_EVENT_HANDLE_BYTES];
  size_t count = 0, needed = 0;
  uint64_t ticket = 0;
  uint32_t l;
  int i;
  static gpu_pool pool;
  kvhost_load_ticket load;
  cudaStream_t stream = NULL;
  cudaEvent_t written = NULL;
  kvhost_client* cl = NULL;
  kvhost_attachment* att = NULL;
  kvhost_load_events* events = NULL;

  pool.base = NULL;
  CHECK(kvhost_built_with_cuda() == 1, "libkvhost_c built without CUDA");
  CHECK_CUDA(cudaSetDevice(0));
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  CHECK_CUDA(gpu_pool_fill(&pool));
  for (i = 0; i < kMoved; ++i) {
    first[i] = i;
    second[i] = kMoved + i;
  }
  OK(kvhost_connect(env->address, 30000, 1, &cl, E));
  OK(kvhost_client_wait_ready(cl, 20000, E));
  OK(kvhost_pool_create(cl, "p", kSpec, E));
  OK(kvhost_alloc(cl, "p", kMoved, host, kMoved, &count, E));

  OK(kvhost_attach_cuda(cl, "p", kComponents, kNames, kLayers, pool.layers, kBytes, kRows,
                        "{\"layer_progress\":true}", &att, E));
  OK(kvhost_attachment_json(att, json, sizeof(json), NULL, E));
  CONTAINS(json, "\"backend\":\"cuda\"");

  /* The worker's event, recorded after its writes; the backup waits on it. */
  CHECK_CUDA(cudaEventCreateWithFlags(&written, cudaEventDisableTiming | cudaEventInterprocess));
  CHECK_CUDA(cudaEventRecord(written, stream));
  EXPECT_CODE(KVHOST_OUT_OF_RANGE, kvhost_cuda_export_event(written, handle, 10, &needed, E));
  CHECK(needed == KVHOST_CUDA_EVENT_HANDLE_BYTES, "event handle needs %zu", needed);
  OK(kvhost_cuda_export_event(written, handle, sizeof(handle), &needed, E));
  OK(kvhost_backup(cl, att, host, kMoved, first, kMoved, handle, sizeof(handle),
                   KVHOST_TRANSFER_WAIT, 30000, &ticket, E));

  /* The load, layer by layer on the stream: counters first, then events. */
  OK(kvhost_load_events_open(cl, att, &events, E));
  OK(kvhost_load_with_events(cl, att, host, kMoved, second, kMoved, &load, E));
  CHECK(load.event_set >= 0, "event set %d", load.event_set);
  for (l = 0; l < kLayers; ++l) OK(kvhost_wait_layer(events, &load, l, stream, 10000, E));
  CHECK_CUDA(cudaStreamSynchronize(stream));
  OK(kvhost_transfer_wait(cl, load.ticket_id, 30000, NULL, 0, NULL, E));
  CHECK(gpu_pool_moved(&pool, diff, sizeof(diff)), "after backup + load: %s", diff);

  OK(kvhost_detach(cl, att, E));
  result = 0;
done:
  kvhost_load_events_destroy(events);
  kvhost_attachment_destroy(att);
  kvhost_client_close(cl);
  if (written != NULL) cudaEventDestroy(written);
  if (stream != NULL) cudaStreamDestroy(stream);
  if (pool.base != NULL) cudaFree(pool.base);
  return result;
}

int c_api_gpu_test_worker_copy(const c_api_test_env* env, char* why, size_t why_len) {
  int result = 1;
  char err[1024];
  char diff[512];
  int64_t host[kMoved], first[kMoved], second[kMoved];
  size_t count = 0;
  uint64_t ticket_id = 0;
  uint32_t layers = 0, l;
  int i;
  static gpu_pool pool;
  cudaStream_t stream = NULL, consumer = NULL;
  kvhost_client* cl = NULL;
  kvhost_attachment* att = NULL;
  kvhost_worker_copier* copier = NULL;
  kvhost_worker_ticket* backup = NULL;
  kvhost_worker_ticket* load = NULL;

  pool.base = NULL;
  CHECK_CUDA(cudaSetDevice(0));
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  CHECK_CUDA(cudaStreamCreateWithFlags(&consumer, cudaStreamNonBlocking));
  CHECK_CUDA(gpu_pool_fill(&pool));
  for (i = 0; i < kMoved; ++i) {
    first[i] = i;
    second[i] = kMoved + i;
  }
  OK(kvhost_connect(env->address, 30000, 1, &cl, E));
  OK(kvhost_client_wait_ready(cl, 20000, E));
  OK(kvhost_pool_create(cl, "w", kSpec, E));
  OK(kvhost_alloc(cl, "w", kMoved, host, kMoved, &count, E));
  OK(kvhost_attach_cuda(cl, "w", kComponents, kNames, kLayers, pool.layers, kBytes, kRows, NULL,
                        &att, E));
  OK(kvhost_worker_copier_open(cl, att, 0, &copier, E));

  OK(kvhost_worker_copy_backup(copier, host, kMoved, first, kMoved, stream, &backup, E));
  OK(kvhost_worker_ticket_info(backup, &ticket_id, &layers, E));
  CHECK(ticket_id != 0 && layers == kLayers, "ticket %llu layers %u", (unsigned long long)ticket_id,
        layers);
  OK(kvhost_worker_copy_wait(copier, backup, 30000, E));
  OK(kvhost_transfer_wait(cl, ticket_id, 30000, NULL, 0, NULL, E));

  OK(kvhost_worker_copy_load(copier, host, kMoved, second, kMoved, stream, &load, E));
  for (l = 0; l < kLayers; ++l) OK(kvhost_worker_copy_wait_layer(copier, load, l, consumer, E));
  EXPECT_CODE(KVHOST_INVALID_ARGUMENT,
              kvhost_worker_copy_wait_layer(copier, load, kLayers, consumer, E));
  CHECK_CUDA(cudaStreamSynchronize(consumer));
  OK(kvhost_worker_copy_wait(copier, load, 30000, E));
  CHECK(gpu_pool_moved(&pool, diff, sizeof(diff)), "after worker backup + load: %s", diff);
  result = 0;
done:
  kvhost_worker_ticket_destroy(backup);
  kvhost_worker_ticket_destroy(load);
  kvhost_worker_copier_destroy(copier);
  kvhost_attachment_destroy(att);
  kvhost_client_close(cl);
  if (stream != NULL) cudaStreamDestroy(stream);
  if (consumer != NULL) cudaStreamDestroy(consumer);
  if (pool.base != NULL) cudaFree(pool.base);
  return result;
}

/* A hybrid group: an MHA KV pool (the anchor, 2 layers) and a MAMBA state
 * pool (2 layers: temporal 2x3 fp32, conv0 5 bf16), on model layers 0, 2
 * and 1, 3. */
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

/* Group buffers: 4 kv buffers (k0 k1 v0 v1) of 16 rows x 32 bytes, then 4
 * ssm buffers (temporal 0, 1 of 8 x 24, conv0 0, 1 of 8 x 10), in one
 * allocation; `image` is what the host wrote. */
enum { kGroupLayers = 2, kKvRows = 16, kSsmRows = 8, kKvMoved = 8, kSsmMoved = 3 };
static const uint64_t kGroupRowBytes[4] = {32, 32, 24, 10};
static const uint64_t kGroupRows[4] = {kKvRows, kKvRows, kSsmRows, kSsmRows};

static size_t group_buffer(int b) { /* b: component (k v temporal conv0) * 2 + layer */
  size_t at = 0;
  int i;
  for (i = 0; i < b; ++i) at += kGroupRows[i / 2] * kGroupRowBytes[i / 2];
  return at;
}

int c_api_gpu_test_group_attach(const c_api_test_env* env, char* why, size_t why_len) {
  int result = 1;
  char err[1024];
  const char* kv_names[2] = {"k", "v"};
  const char* ssm_names[2] = {"temporal", "conv0"};
  void* kv_ptrs[4];
  void* ssm_ptrs[4];
  uint64_t kv_bytes[2], ssm_bytes[2];
  int64_t kv_host[kKvMoved], ssm_host[kSsmMoved];
  int64_t kv_from[kKvMoved], kv_to[kKvMoved], ssm_from[kSsmMoved], ssm_to[kSsmMoved];
  size_t count = 0, total = group_buffer(8), r, k;
  int b, i;
  unsigned char* base = NULL;
  unsigned char* image = NULL;
  unsigned char* now = NULL;
  kvhost_cuda_group_entry entries[2];
  kvhost_pool_transfer ssm_back, ssm_load;
  kvhost_client* cl = NULL;
  kvhost_attachment* att = NULL;

  CHECK(kvhost_built_with_cuda() == 1, "libkvhost_c built without CUDA");
  CHECK_CUDA(cudaSetDevice(0));
  image = (unsigned char*)calloc(total, 1);
  now = (unsigned char*)calloc(total, 1);
  CHECK(image != NULL && now != NULL, "malloc");
  CHECK_CUDA(cudaMalloc((void**)&base, total));
  for (b = 0; b < 8; ++b) {
    const uint64_t rb = kGroupRowBytes[b / 2];
    const size_t moved = b < 4 ? kKvMoved : kSsmMoved;
    for (r = 0; r < moved; ++r) {
      for (k = 0; k < rb; ++k) image[group_buffer(b) + r * rb + k] = pattern(b, (int)r, (int)k);
    }
    if (b < 4) {
      kv_ptrs[b] = base + group_buffer(b);
    } else {
      ssm_ptrs[b - 4] = base + group_buffer(b);
    }
  }
  CHECK_CUDA(cudaMemcpy(base, image, total, cudaMemcpyHostToDevice));
  for (i = 0; i < 2; ++i) {
    kv_bytes[i] = kKvRows * kGroupRowBytes[i];
    ssm_bytes[i] = kSsmRows * kGroupRowBytes[2 + i];
  }
  for (i = 0; i < kKvMoved; ++i) {
    kv_from[i] = i;
    kv_to[i] = kKvMoved + i;
  }
  for (i = 0; i < kSsmMoved; ++i) {
    ssm_from[i] = i;
    ssm_to[i] = kSsmMoved + i;
  }
  memset(entries, 0, sizeof(entries));
  entries[0].entry = "kv";
  entries[0].num_components = 2;
  entries[0].component_names = kv_names;
  entries[0].layer_ptrs = kv_ptrs;
  entries[0].layer_bytes = kv_bytes;
  entries[0].device_size_tokens = kKvRows;
  entries[0].num_layers = kGroupLayers;
  entries[1].entry = "ssm";
  entries[1].num_components = 2;
  entries[1].component_names = ssm_names;
  entries[1].layer_ptrs = ssm_ptrs;
  entries[1].layer_bytes = ssm_bytes;
  entries[1].device_size_tokens = kSsmRows;
  entries[1].num_layers = kGroupLayers;

  OK(kvhost_connect(env->address, 30000, 1, &cl, E));
  OK(kvhost_client_wait_ready(cl, 20000, E));
  OK(kvhost_pool_create(cl, "attn", kAttnSpec, E));
  OK(kvhost_pool_create(cl, "ssm", kSsmSpec, E));
  OK(kvhost_group_create(cl, "hybrid", kGroup, E));
  OK(kvhost_alloc(cl, "hybrid", kKvMoved, kv_host, kKvMoved, &count, E));
  OK(kvhost_alloc(cl, "ssm", kSsmMoved, ssm_host, kSsmMoved, &count, E));
  OK(kvhost_attach_group_cuda(cl, "hybrid", 2, entries, NULL, &att, E));

  ssm_back.entry = "ssm";
  ssm_back.host_indices = ssm_host;
  ssm_back.num_host = kSsmMoved;
  ssm_back.device_indices = ssm_from;
  ssm_back.num_device = kSsmMoved;
  ssm_load = ssm_back;
  ssm_load.device_indices = ssm_to;
  OK(kvhost_backup_group(cl, att, kv_host, kKvMoved, kv_from, kKvMoved, &ssm_back, 1, NULL, 0,
                         KVHOST_TRANSFER_WAIT, 30000, NULL, E));
  OK(kvhost_load_group(cl, att, kv_host, kKvMoved, kv_to, kKvMoved, &ssm_load, 1,
                       KVHOST_TRANSFER_WAIT, 30000, NULL, E));
  CHECK_CUDA(cudaMemcpy(now, base, total, cudaMemcpyDeviceToHost));
  for (b = 0; b < 8; ++b) {
    const uint64_t rb = kGroupRowBytes[b / 2];
    const size_t moved = b < 4 ? kKvMoved : kSsmMoved;
    const unsigned char* got = now + group_buffer(b) + moved * rb;
    CHECK(memcmp(got, image + group_buffer(b), moved * rb) == 0,
          "buffer %d (component %d layer %d): rows [%zu, %zu) are not rows [0, %zu)", b, b / 2,
          b % 2, moved, 2 * moved, moved);
  }
  OK(kvhost_detach(cl, att, E));
  result = 0;
done:
  kvhost_attachment_destroy(att);
  kvhost_client_close(cl);
  if (base != NULL) cudaFree(base);
  free(image);
  free(now);
  return result;
}
