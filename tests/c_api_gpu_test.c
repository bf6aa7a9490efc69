/* The C ABI's CUDA calls from C, on GPU 0 against a kvhostd with
 * --backend=cuda --worker-copy (tests/c_api_gpu_test_driver.cc skips
 * without a GPU): kvhost_attach_cuda of cudaMalloc'd layer buffers, a
 * backup that waits on the worker's exported event, a load waited on per
 * layer on a stream (layer counters, then the load events), and a worker
 * copy each way; every round trip is checked byte for byte. Compiled as C99. */
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
