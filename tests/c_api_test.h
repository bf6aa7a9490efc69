/* The checks of tests/c_api_test.c (host backend) and c_api_gpu_test.c
 * (cuda backend), written in C against kvhost/kvhost_c.h and run by
 * tests/c_api_test_driver.cc and c_api_gpu_test_driver.cc against a kvhostd
 * they started. Each returns 0 when every check passed, else 1 with the first
 * failure (file:line, the call, its code and message) in `why`. */
#ifndef KVHOST_TESTS_C_API_TEST_H_
#define KVHOST_TESTS_C_API_TEST_H_

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Where the daemon under test listens and keeps its files. `restart`
 * (session test only) stops the daemon and starts a new one on the same
 * socket, returning once it serves. */
typedef struct c_api_test_env {
  const char* address;
  const char* shm_dir;
  void (*restart)(void* arg);
  void* restart_arg;
} c_api_test_env;

int c_api_test_library_and_buffers(const c_api_test_env* env, char* why, size_t why_len);
int c_api_test_options_and_connect(const c_api_test_env* env, char* why, size_t why_len);
int c_api_test_pools(const c_api_test_env* env, char* why, size_t why_len);
int c_api_test_alloc_free_pages(const c_api_test_env* env, char* why, size_t why_len);
int c_api_test_groups(const c_api_test_env* env, char* why, size_t why_len);
int c_api_test_shm_backup_load(const c_api_test_env* env, char* why, size_t why_len);
/* Pool group attachments and pool_transfers (c_api_group_test.c). */
int c_api_test_group_backup_load(const c_api_test_env* env, char* why, size_t why_len);
int c_api_test_group_cuda_calls(const c_api_test_env* env, char* why, size_t why_len);
/* ReadPages / WritePages streams (c_api_pages_test.c). */
int c_api_test_page_streams(const c_api_test_env* env, char* why, size_t why_len);
/* The batched calls (c_api_batch_test.c). */
int c_api_test_alloc_batch(const c_api_test_env* env, char* why, size_t why_len);
int c_api_test_alloc_backup(const c_api_test_env* env, char* why, size_t why_len);
/* Asynchronous calls (c_api_async_test.c). */
int c_api_test_async_calls(const c_api_test_env* env, char* why, size_t why_len);
int c_api_test_async_shm_backup_load(const c_api_test_env* env, char* why, size_t why_len);
int c_api_test_async_bound_and_destroy(const c_api_test_env* env, char* why, size_t why_len);
int c_api_test_layer_waits(const c_api_test_env* env, char* why, size_t why_len);
int c_api_test_cuda_calls(const c_api_test_env* env, char* why, size_t why_len);
int c_api_test_session_loss(const c_api_test_env* env, char* why, size_t why_len);
/* The node cache's calls (c_api_cache_test.c). */
int c_api_test_cache_store_restore(const c_api_test_env* env, char* why, size_t why_len);
int c_api_test_cache_refusals(const c_api_test_env* env, char* why, size_t why_len);
int c_api_test_cache_pools(const c_api_test_env* env, char* why, size_t why_len);

/* GPU 0, a kvhostd with --backend=cuda --worker-copy (c_api_gpu_test.c). */
int c_api_gpu_test_attach_backup_load(const c_api_test_env* env, char* why, size_t why_len);
int c_api_gpu_test_worker_copy(const c_api_test_env* env, char* why, size_t why_len);
/* A hybrid pool group (MHA + MAMBA) from cudaMalloc'd buffers. */
int c_api_gpu_test_group_attach(const c_api_test_env* env, char* why, size_t why_len);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* KVHOST_TESTS_C_API_TEST_H_ */
