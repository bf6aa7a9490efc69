/* kvhost C ABI (libkvhost_c.so): the C++ client (kvhost/client.h) behind
 * opaque handles and plain C types, for callers that cannot use C++ (Python
 * through ctypes, first of all). The C++ client is the one implementation;
 * every call here converts its arguments, calls it and converts the answer.
 * docs/C_ABI.md says the same at more length.
 *
 * Size exception: the whole C ABI is this one header, which every caller
 * includes and against which tests/python_package_test.py checks the Python
 * bindings, call for call; its sections follow docs/C_ABI.md's.
 *
 * Conventions:
 *  - Every call returns an int status code, the gRPC / absl canonical code
 *    (KVHOST_OK, KVHOST_NOT_FOUND, ...; the daemon's code passes through
 *    unchanged), except kvhost_abi_version, kvhost_built_with_cuda,
 *    kvhost_code_name, kvhost_async_completed and the *_destroy /
 *    kvhost_client_close calls, which cannot fail and accept NULL.
 *  - The last two parameters of every such call are an optional error
 *    buffer: `err` (may be NULL) of `err_len` bytes receives the message,
 *    truncated to fit and always NUL-terminated; "" on KVHOST_OK.
 *  - Output buffers are the caller's. A string or JSON output is written
 *    with its NUL terminator; bytes outputs are not terminated. A buffer too
 *    small for the answer is KVHOST_OUT_OF_RANGE, writes nothing, and sets
 *    the `*needed` / `*size` out-parameter (when not NULL) to the bytes the
 *    answer needs (with the NUL for strings), so the caller can retry with
 *    that much. Passing NULL with length 0 asks for the size that way.
 *  - JSON is protobuf's JSON mapping of the kvhost.v1 messages named at each
 *    call, with the .proto field names (snake_case) and every field printed;
 *    64-bit integers are JSON strings, enums their names. JSON input accepts
 *    snake_case or lowerCamelCase names; an unknown field is
 *    KVHOST_INVALID_ARGUMENT.
 *  - Timeouts are milliseconds; 0 means the call's default (the client's
 *    timeout, or the one the call names).
 *  - No C++ exception crosses this boundary: an unexpected one is
 *    KVHOST_INTERNAL (KVHOST_RESOURCE_EXHAUSTED for an allocation failure).
 *
 * Ownership: a *_create / connect / attach call hands the caller a handle it
 * must release with the matching *_destroy / kvhost_client_close; nothing
 * else owns it. A handle must outlive the calls using it, and the client
 * every handle made through it (attachments, device pools, load events,
 * worker copiers, async handles).
 *
 * Thread safety: a kvhost_client may be used from any number of threads at
 * once, and so may attachments, load events and worker copiers after they
 * are made (they are only read), and async handles (they lock). Options
 * objects and shm device pools are not synchronised; their bytes are the
 * caller's to order against transfers (wait for the ticket). No handle may
 * be destroyed while another thread uses it.
 *
 * CUDA: the calls marked "CUDA" need a library built with CUDA
 * (kvhost_built_with_cuda() == 1; else KVHOST_UNIMPLEMENTED) and a usable
 * GPU at run time (else KVHOST_FAILED_PRECONDITION). CUDA handles travel as
 * void* (cudaEvent_t, cudaStream_t; NULL is the legacy default stream).
 *
 * One process must not hold two copies of kvhost's generated protobuf code:
 * libkvhost_c.so carries one, so link either it or kvhost::client, not both.
 */
#ifndef KVHOST_CLIENT_KVHOST_C_H_
#define KVHOST_CLIENT_KVHOST_C_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The ABI this header describes; kvhost_abi_version() is the library's.
 * Raised on any incompatible change (a signature, a struct, a meaning). */
#define KVHOST_ABI_VERSION 1

#if defined(KVHOST_C_BUILDING)
#define KVHOST_C_API __attribute__((visibility("default")))
#else
#define KVHOST_C_API
#endif

/* Status codes (absl::StatusCode / grpc::StatusCode numbers). */
#define KVHOST_OK 0
#define KVHOST_CANCELLED 1
#define KVHOST_UNKNOWN 2
#define KVHOST_INVALID_ARGUMENT 3
#define KVHOST_DEADLINE_EXCEEDED 4
#define KVHOST_NOT_FOUND 5
#define KVHOST_ALREADY_EXISTS 6
#define KVHOST_PERMISSION_DENIED 7
#define KVHOST_RESOURCE_EXHAUSTED 8
#define KVHOST_FAILED_PRECONDITION 9
#define KVHOST_ABORTED 10
#define KVHOST_OUT_OF_RANGE 11
#define KVHOST_UNIMPLEMENTED 12
#define KVHOST_INTERNAL 13
#define KVHOST_UNAVAILABLE 14
#define KVHOST_DATA_LOSS 15
#define KVHOST_UNAUTHENTICATED 16

/* Bytes of a cudaIpcEventHandle_t (kvhost_cuda_export_event). */
#define KVHOST_CUDA_EVENT_HANDLE_BYTES 64

/* kvhost_backup / kvhost_load flags. */
/* Wait for the ticket to finish before returning; its error is the call's. */
#define KVHOST_TRANSFER_WAIT 1u

typedef struct kvhost_client_options kvhost_client_options;
typedef struct kvhost_client kvhost_client;
typedef struct kvhost_shm_device_pool kvhost_shm_device_pool;
typedef struct kvhost_attachment kvhost_attachment;
typedef struct kvhost_load_events kvhost_load_events;
typedef struct kvhost_worker_copier kvhost_worker_copier;
typedef struct kvhost_worker_ticket kvhost_worker_ticket;
typedef struct kvhost_async kvhost_async;

/* A load's ticket (kvhost::LoadTicket), or a backup's
 * (kvhost_backup_with_events): event_set -1 when there is nothing to wait
 * on per layer. */
typedef struct kvhost_load_ticket {
  uint64_t ticket_id;
  int32_t event_set;
  uint32_t reserved; /* 0; keeps the layout the same everywhere */
  uint64_t layer_base;
} kvhost_load_ticket;

/* One pool group entry's rows of a transfer (kvhost.v1.PoolTransfer, for
 * kvhost_backup_group / kvhost_load_group): `entry` is its PoolEntry.name,
 * host_indices slots of the entry's pool and device_indices rows of its
 * device buffers, pairwise. The caller owns the pointers; the call copies
 * what they point to. */
typedef struct kvhost_pool_transfer {
  const char* entry;
  const int64_t* host_indices;
  size_t num_host;
  const int64_t* device_indices;
  size_t num_device;
} kvhost_pool_transfer;

/* One pool group entry's CUDA device buffers (kvhost_attach_group_cuda),
 * given as kvhost_attach_cuda's arguments give a plain pool's: `entry` is
 * its PoolEntry.name; component c (component_names[c], a Pool.components
 * name of the entry's pool) has one buffer per attached layer at
 * layer_ptrs[c * num_layers + l], holding device_size_tokens rows
 * (page-row components: / page_size); layer_bytes (NULL: not checked) is
 * each component's buffer size in bytes. The layers are device layers
 * [start_layer, end_layer) of the entry's pool (0 / 0: the pool's range),
 * which must include every layer its layer_map names. An entry whose pool
 * has no components (LOGICAL) gives num_components 0. reserved is 0. The
 * caller owns the pointers; the call copies what they point to. */
typedef struct kvhost_cuda_group_entry {
  const char* entry;
  size_t num_components;
  const char* const* component_names;
  void* const* layer_ptrs;
  const uint64_t* layer_bytes;
  uint64_t device_size_tokens;
  uint32_t num_layers;
  uint32_t start_layer;
  uint32_t end_layer;
  uint32_t reserved; /* 0; keeps the layout the same everywhere */
} kvhost_cuda_group_entry;

/* --- Library ------------------------------------------------------------ */

/* KVHOST_ABI_VERSION of the library loaded; a caller checks it first. */
KVHOST_C_API int kvhost_abi_version(void);
/* 1 when the library was built with CUDA (the CUDA calls can work). */
KVHOST_C_API int kvhost_built_with_cuda(void);
/* "OK", "NOT_FOUND", ... for a status code; "UNKNOWN_CODE" otherwise.
 * Static storage. */
KVHOST_C_API const char* kvhost_code_name(int code);

/* --- Connection ----------------------------------------------------------- */

/* Options of kvhost_client_connect (kvhost::ClientOptions), set by key:
 *   address                  "unix:///path.sock", "host:port", or a socket
 *                            path ("/run/kvhost/kvhost.sock": unix://)
 *   timeout_ms               deadline of each call (default 30000)
 *   max_message_bytes        (default 64 MiB)
 *   owner_token, tls_ca_file, tls_cert_file, tls_key_file, tls_server_name
 *   insecure                 "1"/"0" or "true"/"false": plaintext TCP
 *   worker_session           "1"/"0": attach within a session that a
 *                            background thread keeps open and reopens
 *                            after a daemon restart (default 1)
 *   worker_name              for the daemon's logs
 *   reconnect_max_backoff_ms (default 5000)
 * An unknown key or a malformed value is KVHOST_INVALID_ARGUMENT naming it. */
KVHOST_C_API int kvhost_client_options_create(kvhost_client_options** out, char* err,
                                              size_t err_len);
KVHOST_C_API int kvhost_client_options_set(kvhost_client_options* options, const char* key,
                                           const char* value, char* err, size_t err_len);
KVHOST_C_API void kvhost_client_options_destroy(kvhost_client_options* options);

/* Makes the client (the channel connects on the first call). */
KVHOST_C_API int kvhost_client_connect(const kvhost_client_options* options, kvhost_client** out,
                                       char* err, size_t err_len);
/* The same with only the address, the timeout (0: 30 s) and whether to
 * attach within a worker session (nonzero: yes). */
KVHOST_C_API int kvhost_connect(const char* address, int64_t timeout_ms, int worker_session,
                                kvhost_client** out, char* err, size_t err_len);
/* Ends the session (the daemon closes its attachments) and the channel. */
KVHOST_C_API void kvhost_client_close(kvhost_client* client);
/* Waits until the daemon serves (health SERVING); DEADLINE_EXCEEDED after
 * timeout_ms. */
KVHOST_C_API int kvhost_client_wait_ready(kvhost_client* client, int64_t timeout_ms, char* err,
                                          size_t err_len);

/* --- Worker session (worker_session=1) ---------------------------------- */

/* Opens the session now (attach does it otherwise); idempotent. */
KVHOST_C_API int kvhost_client_open_session(kvhost_client* client, int64_t timeout_ms, char* err,
                                            size_t err_len);
/* The session as it stands: *open 1 while its stream is up, *reconnects the
 * sessions opened after the first, the session id ("" before the first
 * open) into session_id. Each out-parameter may be NULL. */
KVHOST_C_API int kvhost_client_session_state(kvhost_client* client, int32_t* open,
                                             uint64_t* reconnects, char* session_id,
                                             size_t session_id_len, size_t* session_id_needed,
                                             char* err, size_t err_len);
/* Session losses since the client was made (a daemon restart, or a broken
 * connection whose session timed out): *count of them, and the last one's
 * description ("" when none) into last. The attachments a loss names are
 * gone; attach again. */
KVHOST_C_API int kvhost_client_session_losses(kvhost_client* client, uint64_t* count, char* last,
                                              size_t last_len, size_t* last_needed, char* err,
                                              size_t err_len);

/* --- Daemon --------------------------------------------------------------- */

/* kvhost.v1.DaemonStatus as JSON. */
KVHOST_C_API int kvhost_daemon_status_json(kvhost_client* client, char* out, size_t out_len,
                                           size_t* needed, char* err, size_t err_len);

/* --- Pools and groups ------------------------------------------------------ */

/* Creates pool `name` from a kvhost.v1.PoolSpec in JSON, e.g.
 * {"kind":"MHA","layout":"PAGE_FIRST","dtype":"BF16","page_size":4,
 *  "layer_num":3,"head_num":2,"head_dim":8,"size_tokens":64}.
 * kvhost_pool_get_json gives the pool made. */
KVHOST_C_API int kvhost_pool_create(kvhost_client* client, const char* name, const char* spec_json,
                                    char* err, size_t err_len);
/* kvhost.v1.Pool as JSON. */
KVHOST_C_API int kvhost_pool_get_json(kvhost_client* client, const char* name, char* out,
                                      size_t out_len, size_t* needed, char* err, size_t err_len);
/* kvhost.v1.ListPoolsResponse as JSON ({"pools": [...]}). */
KVHOST_C_API int kvhost_pool_list_json(kvhost_client* client, char* out, size_t out_len,
                                       size_t* needed, char* err, size_t err_len);
/* *bytes_released (may be NULL): the host bytes the pool gave back. */
KVHOST_C_API int kvhost_pool_delete(kvhost_client* client, const char* name,
                                    uint64_t* bytes_released, char* err, size_t err_len);
/* Creates group `name` from a kvhost.v1.CreatePoolGroupRequest in JSON
 * without its name: {"layer_num": L, "entries": [{"name":..., "pool":...,
 * "layer_map": [...], "anchor": true}, ...]}. */
KVHOST_C_API int kvhost_group_create(kvhost_client* client, const char* name,
                                     const char* group_json, char* err, size_t err_len);
/* kvhost.v1.PoolGroup as JSON. */
KVHOST_C_API int kvhost_group_get_json(kvhost_client* client, const char* name, char* out,
                                       size_t out_len, size_t* needed, char* err, size_t err_len);
KVHOST_C_API int kvhost_group_delete(kvhost_client* client, const char* name, char* err,
                                     size_t err_len);

/* Makes this client's sglang instance `instance_id` (1-128 printable ASCII
 * characters, stable across its restarts) the pool's one owner
 * (PoolService.ClaimPool); a scheduler calls it at start-up. Contract:
 * needs the client's worker session (it is opened first); another live
 * session holding the pool is KVHOST_FAILED_PRECONDITION naming its instance
 * id and generation, and changes nothing; the caller's own live claim is
 * renewed (*renewed = 1, nothing freed); otherwise the pool is taken over:
 * *generation is the previous one plus 1 and every allocated slot (the
 * previous scheduler's) is freed, *reclaimed_tokens of them.
 * KVHOST_UNAVAILABLE while transfers still use the pool's slots: retry.
 * While held, alloc, free and alloc_backup of other sessions are refused;
 * the claim ends with this client's session (close, exit, or a kvhostd
 * restart: kvhost_client_session_state's session id changes then, and the
 * caller must treat its slots as lost). Out-parameters may be NULL. */
KVHOST_C_API int kvhost_pool_claim(kvhost_client* client, const char* pool, const char* instance_id,
                                   uint64_t* generation, uint64_t* reclaimed_tokens,
                                   int32_t* renewed, char* err, size_t err_len);

/* --- Slots and pages (a group's name acts on its anchor pool) ----------- */

/* Allocates num_tokens slots (whole pages) into indices[0, num_tokens);
 * *count gets num_tokens. A capacity below num_tokens is
 * KVHOST_OUT_OF_RANGE with *count = num_tokens, and allocates nothing. */
KVHOST_C_API int kvhost_alloc(kvhost_client* client, const char* pool, uint64_t num_tokens,
                              int64_t* indices, size_t capacity, size_t* count, char* err,
                              size_t err_len);
/* Allocates num_runs runs at once, all or nothing (PoolService.AllocBatch,
 * what a scheduler does for many requests): run i is num_tokens[i] slots
 * (whole pages). The slots go into indices back to back, run 0 first, so
 * run i starts after num_tokens[0] + ... + num_tokens[i-1] of them; *count
 * gets their sum. A capacity below the sum is KVHOST_OUT_OF_RANGE with
 * *count = the sum, and allocates nothing. One kvhost_free gives them back. */
KVHOST_C_API int kvhost_alloc_batch(kvhost_client* client, const char* pool,
                                    const uint64_t* num_tokens, size_t num_runs, int64_t* indices,
                                    size_t capacity, size_t* count, char* err, size_t err_len);
/* Frees whole pages, all or nothing; *freed (may be NULL) the slots freed. */
KVHOST_C_API int kvhost_free(kvhost_client* client, const char* pool, const int64_t* indices,
                             size_t num_indices, uint64_t* freed, char* err, size_t err_len);
/* kvhost.v1.PageBufferMeta of whole pages' slots, as JSON. */
KVHOST_C_API int kvhost_page_buffer_meta_json(kvhost_client* client, const char* pool,
                                              const int64_t* indices, size_t num_indices, char* out,
                                              size_t out_len, size_t* needed, char* err,
                                              size_t err_len);
/* kvhost.v1.PageShape of `pool` as JSON: one part per component (its dims,
 * dtype and bytes) of the seeds' flat page, and the page's bytes. */
KVHOST_C_API int kvhost_page_shape_json(kvhost_client* client, const char* pool, char* out,
                                        size_t out_len, size_t* needed, char* err, size_t err_len);
/* kvhost.v1.StrideAlignment of `pool` as JSON: whether every component's
 * page blocks start on `alignment` bytes (a power of two; 0 means 4096;
 * LAYER_FIRST never does), and each component's page stride. */
KVHOST_C_API int kvhost_stride_alignment_json(kvhost_client* client, const char* pool,
                                              uint64_t alignment, char* out, size_t out_len,
                                              size_t* needed, char* err, size_t err_len);
/* kvhost.v1.ContiguousBufferInfos of `pool` as JSON: one contiguous range
 * per layer and component (region, offset, length, item bytes) and the
 * region files; a LAYER_FIRST pool's only. */
KVHOST_C_API int kvhost_contiguous_buffer_infos_json(kvhost_client* client, const char* pool,
                                                     char* out, size_t out_len, size_t* needed,
                                                     char* err, size_t err_len);
/* The flat bytes of the page whose first slot is `index` into data;
 * *size (may be NULL only when data is big enough) the page's bytes. */
KVHOST_C_API int kvhost_get_data_page(kvhost_client* client, const char* pool, int64_t index,
                                      void* data, size_t data_len, size_t* size, char* err,
                                      size_t err_len);
/* Writes one flat page (exactly the page's bytes). */
KVHOST_C_API int kvhost_set_from_flat_data_page(kvhost_client* client, const char* pool,
                                                int64_t index, const void* data, size_t data_len,
                                                char* err, size_t err_len);
/* Many flat pages in one stream (ReadPages): the pages whose first slots
 * are indices[0, num_indices) (no page twice), back to back into data in
 * that order, page i at data + i * (*size / num_indices). chunk_bytes: the
 * stream's largest chunk (0: the daemon's 4 MiB). *size (may be NULL only
 * when data is big enough) gets num_indices times the pool's flat page
 * bytes. That size is known before the stream starts (GetPageShape), so a
 * buffer too small is KVHOST_OUT_OF_RANGE before any page is read, and
 * nothing is written. The daemon checks every index before the first page
 * is sent: a page that is not allocated is FAILED_PRECONDITION, one that is
 * not a page start INVALID_ARGUMENT, a page twice INVALID_ARGUMENT. */
KVHOST_C_API int kvhost_read_pages(kvhost_client* client, const char* pool, const int64_t* indices,
                                   size_t num_indices, uint32_t chunk_bytes, void* data,
                                   size_t data_len, size_t* size, char* err, size_t err_len);
/* Many flat pages in one stream (WritePages): data holds num_indices flat
 * pages back to back, page i written to the page whose first slot is
 * indices[i], in chunks of at most chunk_bytes (0: 4 MiB). data_len must be
 * exactly num_indices times the pool's flat page bytes (GetPageShape),
 * checked before anything is sent: INVALID_ARGUMENT with both sizes, and
 * nothing written. *pages_written (may be NULL) gets the pages written.
 * The daemon checks each page as it arrives (allocated, a page start): on
 * such a refusal the pages before it stay written (the stream's contract,
 * kvhost.v1.PoolService.WritePages), and the message says how many. */
KVHOST_C_API int kvhost_write_pages(kvhost_client* client, const char* pool, const int64_t* indices,
                                    size_t num_indices, const void* data, size_t data_len,
                                    uint32_t chunk_bytes, uint64_t* pages_written, char* err,
                                    size_t err_len);

/* --- Host backend device buffers (kvhost::ShmDevicePool) ----------------- */

/* A shared-memory stand-in for a worker's device KV pool, shaped after pool
 * `pool` (fetched from the daemon): one buffer per component and attached
 * layer, device_size_tokens rows each (page-row components: / page_size).
 * shm_dir (NULL: "/dev/shm") must be the daemon's --shm-dir. Layers
 * [start_layer, end_layer); 0 / 0: the pool's own range. */
KVHOST_C_API int kvhost_shm_device_pool_create(kvhost_client* client, const char* pool,
                                               uint64_t device_size_tokens, const char* shm_dir,
                                               uint32_t start_layer, uint32_t end_layer,
                                               kvhost_shm_device_pool** out, char* err,
                                               size_t err_len);
/* Unmaps and removes the file. */
KVHOST_C_API void kvhost_shm_device_pool_destroy(kvhost_shm_device_pool* device);
/* Components (Pool.components order), attached layers, total bytes; each
 * out-parameter may be NULL. */
KVHOST_C_API int kvhost_shm_device_pool_info(const kvhost_shm_device_pool* device,
                                             uint32_t* components, uint32_t* layers,
                                             uint64_t* bytes, char* err, size_t err_len);
/* Component c's name, rows per layer buffer, bytes per row and slots per
 * row; each out-parameter may be NULL. */
KVHOST_C_API int kvhost_shm_device_pool_component(const kvhost_shm_device_pool* device,
                                                  uint32_t component, char* name, size_t name_len,
                                                  size_t* name_needed, uint64_t* rows,
                                                  uint64_t* row_bytes, uint64_t* row_tokens,
                                                  char* err, size_t err_len);
/* Base of component c's buffer for attached layer `layer` and its bytes
 * (rows * row_bytes), writable by the caller: rows are row_bytes apart. */
KVHOST_C_API int kvhost_shm_device_pool_layer(const kvhost_shm_device_pool* device,
                                              uint32_t component, uint32_t layer, void** base,
                                              uint64_t* bytes, char* err, size_t err_len);

/* --- Attachments ------------------------------------------------------------ */

/* options_json (NULL or "": none): kvhost.v1.AttachDeviceRequest fields
 * that are not buffers: tp_rank, load_only, layer_progress,
 * load_event_sets, and (CUDA only) start_layer / end_layer. */

/* Attaches a shm device pool to pool `pool` (host backend). */
KVHOST_C_API int kvhost_attach_shm(kvhost_client* client, const char* pool,
                                   const kvhost_shm_device_pool* device, const char* options_json,
                                   kvhost_attachment** out, char* err, size_t err_len);
/* CUDA. Attaches a worker's device buffers to pool `pool`: component c
 * (a Pool.components name) has one buffer per attached layer at
 * layer_ptrs[c * num_layers + l], each holding device_size_tokens rows
 * (page-row components: / page_size). layer_bytes (NULL: not checked)
 * gives each component's buffer size in bytes; one smaller than its rows
 * need is KVHOST_INVALID_ARGUMENT before anything is exported. */
KVHOST_C_API int kvhost_attach_cuda(kvhost_client* client, const char* pool, size_t num_components,
                                    const char* const* component_names, uint32_t num_layers,
                                    void* const* layer_ptrs, const uint64_t* layer_bytes,
                                    uint64_t device_size_tokens, const char* options_json,
                                    kvhost_attachment** out, char* err, size_t err_len);
/* The attachment's id; kvhost.v1.Attachment as JSON. */
KVHOST_C_API int kvhost_attachment_id(const kvhost_attachment* attachment, char* out,
                                      size_t out_len, size_t* needed, char* err, size_t err_len);
KVHOST_C_API int kvhost_attachment_json(const kvhost_attachment* attachment, char* out,
                                        size_t out_len, size_t* needed, char* err, size_t err_len);
/* Detaches on the daemon; the handle stays to be destroyed. */
KVHOST_C_API int kvhost_detach(kvhost_client* client, const kvhost_attachment* attachment,
                               char* err, size_t err_len);
/* Frees the handle only (no detach). */
KVHOST_C_API void kvhost_attachment_destroy(kvhost_attachment* attachment);

/* Attaches pool group `group` (host backend) with one shm device pool per
 * entry: entries[i] (a PoolEntry.name) gets devices[i], made by
 * kvhost_shm_device_pool_create from that entry's pool and holding every
 * device layer the entry's layer_map names. Every entry of the group is
 * given once. NOT_FOUND for an unknown group; INVALID_ARGUMENT naming an
 * entry the group does not have, or one of its entries left out.
 * options_json as kvhost_attach_shm's. Backup and load it with
 * kvhost_backup_group / kvhost_load_group. */
KVHOST_C_API int kvhost_attach_group_shm(kvhost_client* client, const char* group,
                                         size_t num_entries, const char* const* entries,
                                         const kvhost_shm_device_pool* const* devices,
                                         const char* options_json, kvhost_attachment** out,
                                         char* err, size_t err_len);

/* CUDA. Attaches pool group `group` with a worker's device buffers, one
 * kvhost_cuda_group_entry per entry (every entry of the group once), on one
 * GPU, as MakeCudaGroupAttachRequest does. Where an entry gives
 * layer_bytes, its buffer sizes are checked against its pool's components
 * before anything is exported: one smaller than its rows need is
 * INVALID_ARGUMENT naming the entry and component. NOT_FOUND for an unknown
 * group; INVALID_ARGUMENT naming an entry the group does not have, or one
 * of its entries left out. options_json as kvhost_attach_shm's (the layer
 * range is each entry's own). Backup and load it with kvhost_backup_group /
 * kvhost_load_group. */
KVHOST_C_API int kvhost_attach_group_cuda(kvhost_client* client, const char* group,
                                          size_t num_entries,
                                          const kvhost_cuda_group_entry* entries,
                                          const char* options_json, kvhost_attachment** out,
                                          char* err, size_t err_len);

/* --- Transfers ---------------------------------------------------------------- */

/* Device rows -> host slots; *ticket_id (may be NULL) gets the ticket.
 * wait_event_handle (NULL / 0: none; CUDA backend) is the
 * KVHOST_CUDA_EVENT_HANDLE_BYTES bytes of the worker's interprocess event
 * (kvhost_cuda_export_event, or torch.cuda.Event(interprocess=True)
 * .ipc_handle()), recorded after the rows were written; the copies wait for
 * it. The host backend refuses one (FAILED_PRECONDITION). With
 * KVHOST_TRANSFER_WAIT, waits up to wait_timeout_ms (0: 10 min) for the
 * ticket and returns its error; *ticket_id is set either way. */
KVHOST_C_API int kvhost_backup(kvhost_client* client, const kvhost_attachment* attachment,
                               const int64_t* host_indices, size_t num_host,
                               const int64_t* device_indices, size_t num_device,
                               const void* wait_event_handle, size_t wait_event_handle_len,
                               uint32_t flags, int64_t wait_timeout_ms, uint64_t* ticket_id,
                               char* err, size_t err_len);
/* Allocates num_device host slots of the attachment's pool and backs the
 * device rows up into them, in one call (TransferService.AllocBackup; a
 * plain pool's attachment, not a group's): host_indices[0, num_device) get
 * the slots, *count (may be NULL) num_device, *ticket_id (may be NULL) the
 * ticket. A host_capacity below num_device is KVHOST_OUT_OF_RANGE and
 * allocates nothing; a refused backup leaves nothing allocated. The event,
 * flags and wait are kvhost_backup's; after a failed wait the slots stay
 * allocated and are in host_indices (free them, or load from them). */
KVHOST_C_API int kvhost_alloc_backup(kvhost_client* client, const kvhost_attachment* attachment,
                                     const int64_t* device_indices, size_t num_device,
                                     int64_t* host_indices, size_t host_capacity, size_t* count,
                                     const void* wait_event_handle, size_t wait_event_handle_len,
                                     uint32_t flags, int64_t wait_timeout_ms, uint64_t* ticket_id,
                                     char* err, size_t err_len);
/* Host slots -> device rows; as kvhost_backup. */
KVHOST_C_API int kvhost_load(kvhost_client* client, const kvhost_attachment* attachment,
                             const int64_t* host_indices, size_t num_host,
                             const int64_t* device_indices, size_t num_device, uint32_t flags,
                             int64_t wait_timeout_ms, uint64_t* ticket_id, char* err,
                             size_t err_len);
/* A load that also names its per-layer event set (kvhost_wait_layer).
 * RESOURCE_EXHAUSTED while every set of the attachment is busy. */
KVHOST_C_API int kvhost_load_with_events(kvhost_client* client, const kvhost_attachment* attachment,
                                         const int64_t* host_indices, size_t num_host,
                                         const int64_t* device_indices, size_t num_device,
                                         kvhost_load_ticket* ticket, char* err, size_t err_len);
/* A backup that also names its per-layer event set, as
 * kvhost_load_with_events does a load's. On an attachment with
 * layer_progress it takes a set (RESOURCE_EXHAUSTED while every set is
 * busy) and records it per layer as a load does, so
 * kvhost_wait_layer(events, ticket, last layer, stream) makes the stream
 * wait until every copy of the backup is done (cuda backend; the host
 * backend waits on the host) without this thread waiting for the copies:
 * the way to tell a stream that device rows may be reused. event_set is -1
 * without layer_progress. Returns once the backup is queued; the ticket's
 * error comes from kvhost_transfer_wait / _poll. wait_event_handle as
 * kvhost_backup's. */
KVHOST_C_API int kvhost_backup_with_events(kvhost_client* client,
                                           const kvhost_attachment* attachment,
                                           const int64_t* host_indices, size_t num_host,
                                           const int64_t* device_indices, size_t num_device,
                                           const void* wait_event_handle,
                                           size_t wait_event_handle_len, kvhost_load_ticket* ticket,
                                           char* err, size_t err_len);
/* A group attachment's backup: host_indices / device_indices are the
 * anchor entry's rows (either may be empty), pool_transfers[0,
 * num_pool_transfers) the other entries' (each entry at most once). All are
 * checked before anything is copied: an entry the group does not have, or
 * the anchor named here, is INVALID_ARGUMENT naming it, and no ticket is
 * made. Otherwise as kvhost_backup. */
KVHOST_C_API int kvhost_backup_group(kvhost_client* client, const kvhost_attachment* attachment,
                                     const int64_t* host_indices, size_t num_host,
                                     const int64_t* device_indices, size_t num_device,
                                     const kvhost_pool_transfer* pool_transfers,
                                     size_t num_pool_transfers, const void* wait_event_handle,
                                     size_t wait_event_handle_len, uint32_t flags,
                                     int64_t wait_timeout_ms, uint64_t* ticket_id, char* err,
                                     size_t err_len);
/* A group attachment's load; as kvhost_backup_group and kvhost_load. */
KVHOST_C_API int kvhost_load_group(kvhost_client* client, const kvhost_attachment* attachment,
                                   const int64_t* host_indices, size_t num_host,
                                   const int64_t* device_indices, size_t num_device,
                                   const kvhost_pool_transfer* pool_transfers,
                                   size_t num_pool_transfers, uint32_t flags,
                                   int64_t wait_timeout_ms, uint64_t* ticket_id, char* err,
                                   size_t err_len);
/* A group attachment's backup that also names its per-layer event set; as
 * kvhost_backup_group and kvhost_backup_with_events. */
KVHOST_C_API int kvhost_backup_group_with_events(
    kvhost_client* client, const kvhost_attachment* attachment, const int64_t* host_indices,
    size_t num_host, const int64_t* device_indices, size_t num_device,
    const kvhost_pool_transfer* pool_transfers, size_t num_pool_transfers,
    const void* wait_event_handle, size_t wait_event_handle_len, kvhost_load_ticket* ticket,
    char* err, size_t err_len);
/* A group attachment's load that also names its per-layer event set; as
 * kvhost_load_group and kvhost_load_with_events. */
KVHOST_C_API int kvhost_load_group_with_events(
    kvhost_client* client, const kvhost_attachment* attachment, const int64_t* host_indices,
    size_t num_host, const int64_t* device_indices, size_t num_device,
    const kvhost_pool_transfer* pool_transfers, size_t num_pool_transfers,
    kvhost_load_ticket* ticket, char* err, size_t err_len);
/* kvhost_load_group_with_events (pool_transfers may be NULL with
 * num_pool_transfers 0: a plain attachment's load) whose copies first wait
 * for the worker's event (cuda backend): wait_event_handle as
 * kvhost_backup's, an event recorded on the worker's stream after the work
 * the load must follow (a forward pass still reading or writing the
 * destination rows), so that the load may be asked for before that work is
 * done. NULL / 0: none. FAILED_PRECONDITION on the host backend. */
KVHOST_C_API int kvhost_load_group_with_events_after(
    kvhost_client* client, const kvhost_attachment* attachment, const int64_t* host_indices,
    size_t num_host, const int64_t* device_indices, size_t num_device,
    const kvhost_pool_transfer* pool_transfers, size_t num_pool_transfers,
    const void* wait_event_handle, size_t wait_event_handle_len, kvhost_load_ticket* ticket,
    char* err, size_t err_len);
/* Blocks until the ticket is done (its error if it failed) or timeout_ms
 * (0: 10 min) passed (DEADLINE_EXCEEDED). status_json (may be NULL): the
 * kvhost.v1.TransferStatus. */
KVHOST_C_API int kvhost_transfer_wait(kvhost_client* client, uint64_t ticket_id, int64_t timeout_ms,
                                      char* status_json, size_t status_len, size_t* status_needed,
                                      char* err, size_t err_len);
/* The ticket now, without waiting: *done 1 once it finished. A ticket that
 * failed returns its error (as does a failed call; *done is 0 then). */
KVHOST_C_API int kvhost_transfer_poll(kvhost_client* client, uint64_t ticket_id, int32_t* done,
                                      char* status_json, size_t status_len, size_t* status_needed,
                                      char* err, size_t err_len);

/* --- Per-layer waits of a load ---------------------------------------------- */

/* Opens what an attachment's loads are waited on per layer: on the cuda
 * backend (CUDA) its load events, and with layer_progress its layer
 * counters; on the host backend, its layer counters (layer_progress must
 * be set). FAILED_PRECONDITION for an attachment that has neither. The
 * current device must be the attachment's GPU. */
KVHOST_C_API int kvhost_load_events_open(kvhost_client* client, const kvhost_attachment* attachment,
                                         kvhost_load_events** out, char* err, size_t err_len);
KVHOST_C_API void kvhost_load_events_destroy(kvhost_load_events* events);
/* Layer `layer` of the load (or backup, kvhost_backup_with_events)
 * `ticket`: waits on the host until the transfer recorded it (layer
 * counters: the daemon queued that layer's copies; DEADLINE_EXCEEDED after
 * timeout_ms, 0: 10 s), then makes cuda_stream wait on its event, which
 * completes after the layer's copies (cuda backend; the stream is ignored
 * where there are no events). OK at once for a ticket with event_set -1. */
KVHOST_C_API int kvhost_wait_layer(const kvhost_load_events* events,
                                   const kvhost_load_ticket* ticket, uint32_t layer,
                                   void* cuda_stream, int64_t timeout_ms, char* err,
                                   size_t err_len);

/* The attachment's pool's host regions, for this process's own mapping of
 * the pool (HANDOFF_KIND_POOL_MAP: zero-copy views of its pages), fetched
 * over kvhostd's handoff socket with the client's session and token: on OK
 * fds[0, *count) are new read-write descriptors the caller owns (map each
 * MAP_SHARED, whole, then close it) and region_bytes[i] the size of region
 * i, in the order of kvhost.v1.Pool.region_paths. The pool stays held for
 * the attachment's session until it ends. FAILED_PRECONDITION for an
 * attachment made without a session or of a pool group, or a pool without
 * regions (LOGICAL); RESOURCE_EXHAUSTED when the pool has more regions than
 * `capacity` (nothing is left open). */
KVHOST_C_API int kvhost_pool_map_open(kvhost_client* client, const kvhost_attachment* attachment,
                                      int* fds, uint64_t* region_bytes, size_t capacity,
                                      size_t* count, char* err, size_t err_len);

/* --- CUDA worker helpers ------------------------------------------------------- */

/* CUDA. The cudaIpcEventHandle_t bytes of cuda_event (created with
 * cudaEventInterprocess | cudaEventDisableTiming) into handle
 * (KVHOST_CUDA_EVENT_HANDLE_BYTES), for kvhost_backup: record it on the
 * stream that writes the rows before the backup, and keep it alive until
 * the backup's ticket finishes. */
KVHOST_C_API int kvhost_cuda_export_event(void* cuda_event, void* handle, size_t handle_len,
                                          size_t* needed, char* err, size_t err_len);

/* CUDA. Worker copies (kvhost::WorkerCopier; kvhostd --worker-copy): this
 * process runs the copy on the caller's stream. `attachment` must come
 * from kvhost_attach_cuda (its buffers are the copier's device layers).
 * blocks: thread blocks per launch, 0 for the default (8). */
KVHOST_C_API int kvhost_worker_copier_open(kvhost_client* client,
                                           const kvhost_attachment* attachment, int32_t blocks,
                                           kvhost_worker_copier** out, char* err, size_t err_len);
/* Waits for every copy it started, then unmaps. Before the CUDA context
 * goes. */
KVHOST_C_API void kvhost_worker_copier_destroy(kvhost_worker_copier* copier);
/* Device rows -> host slots / host slots -> device rows, queued on
 * cuda_stream; *out the copy's ticket (destroy it; it may outlive the
 * copier). */
KVHOST_C_API int kvhost_worker_copy_backup(kvhost_worker_copier* copier,
                                           const int64_t* host_indices, size_t num_host,
                                           const int64_t* device_indices, size_t num_device,
                                           void* cuda_stream, kvhost_worker_ticket** out, char* err,
                                           size_t err_len);
KVHOST_C_API int kvhost_worker_copy_load(kvhost_worker_copier* copier, const int64_t* host_indices,
                                         size_t num_host, const int64_t* device_indices,
                                         size_t num_device, void* cuda_stream,
                                         kvhost_worker_ticket** out, char* err, size_t err_len);
/* The daemon's ticket id and the copy's layers; each may be NULL. */
KVHOST_C_API int kvhost_worker_ticket_info(const kvhost_worker_ticket* ticket, uint64_t* ticket_id,
                                           uint32_t* layers, char* err, size_t err_len);
/* Makes consumer_stream wait until layer `layer` of the copy is done. */
KVHOST_C_API int kvhost_worker_copy_wait_layer(const kvhost_worker_copier* copier,
                                               const kvhost_worker_ticket* ticket, uint32_t layer,
                                               void* consumer_stream, char* err, size_t err_len);
/* Blocks until the copy ended and kvhostd was told (timeout_ms 0: 1 min). */
KVHOST_C_API int kvhost_worker_copy_wait(const kvhost_worker_copier* copier,
                                         const kvhost_worker_ticket* ticket, int64_t timeout_ms,
                                         char* err, size_t err_len);
KVHOST_C_API void kvhost_worker_ticket_destroy(kvhost_worker_ticket* ticket);

/* --- Asynchronous calls ------------------------------------------------------ */

/* A kvhost_async (kvhost::AsyncClient) submits calls of a client without
 * blocking the caller: one executor thread of its own runs them one at a
 * time in the order submitted (FIFO: an alloc reaches the daemon before a
 * backup submitted after it). Each submit returns at once with a request
 * id: 1 for the handle's first request, then 2, 3, ... with no gaps (a
 * refused submit takes none). Completion is FIFO too, so request k is done
 * exactly when kvhost_async_completed() >= k: a scheduler polls that one
 * number (what sglang's ack queues do), or waits for one request
 * (kvhost_async_wait), or is called back (kvhost_async_set_callback).
 *
 * A request's result (its code and message, and the indices of an alloc or
 * the value of the others) is held by the handle until taken
 * (kvhost_async_take_indices / kvhost_async_take_value) or until the handle
 * is destroyed. At most KVHOST_ASYNC_MAX_REQUESTS requests are queued,
 * running or held at once; a submit beyond that is
 * KVHOST_RESOURCE_EXHAUSTED naming the bound, and is not queued.
 *
 * A submit checks its arguments (NULL pointers, flags, timeouts) and
 * copies everything it is given (pool name, indices, the attachment's id,
 * the event handle) before it returns; those errors are the submit's own
 * code, and no request is made. The call's own errors (the daemon's code
 * and message, e.g. KVHOST_NOT_FOUND naming an unknown pool) are the
 * request's: kvhost_async_wait and the take calls return them.
 *
 * Thread safety: any thread may call any of these at once, except that
 * kvhost_async_destroy must not run while another thread uses the handle,
 * nor from its callback. The client must outlive the handle. */

/* Requests a kvhost_async holds at once: queued, running, or finished and
 * not yet taken. */
#define KVHOST_ASYNC_MAX_REQUESTS 65536

/* Called on the handle's executor thread once request_id finished, with its
 * code (KVHOST_CANCELLED for one cancelled by kvhost_async_destroy), after
 * its result is held and before kvhost_async_completed() counts it: the
 * take calls work inside it. It must return quickly (every request behind
 * it waits) and must not wait on a later request of the same handle nor
 * destroy the handle; it may submit and take. */
typedef void (*kvhost_async_callback)(uint64_t request_id, int code, void* user);

/* Makes the handle and starts its executor thread. */
KVHOST_C_API int kvhost_async_create(kvhost_client* client, kvhost_async** out, char* err,
                                     size_t err_len);
/* Lets the running request finish, completes every queued one with
 * KVHOST_CANCELLED (each called back, on the executor thread), joins the
 * thread and frees the results not taken. To have the queued requests run
 * instead, kvhost_async_wait for the last one first. */
KVHOST_C_API void kvhost_async_destroy(kvhost_async* async);
/* Sets (NULL: clears) the completion callback. Once it returns, the
 * previous callback is not running and will not be called again (called
 * from inside a callback, only the latter). Set it before submitting to
 * be called for every request. */
KVHOST_C_API int kvhost_async_set_callback(kvhost_async* async, kvhost_async_callback callback,
                                           void* user, char* err, size_t err_len);

/* Submits kvhost_alloc: num_tokens slots of `pool` (a group's name: its
 * anchor's). *request_id (may be NULL) gets the request; its indices are
 * taken with kvhost_async_take_indices. */
KVHOST_C_API int kvhost_async_alloc(kvhost_async* async, const char* pool, uint64_t num_tokens,
                                    uint64_t* request_id, char* err, size_t err_len);
/* Submits kvhost_free of indices[0, num_indices) (copied). Its value is the
 * slots freed. */
KVHOST_C_API int kvhost_async_free(kvhost_async* async, const char* pool, const int64_t* indices,
                                   size_t num_indices, uint64_t* request_id, char* err,
                                   size_t err_len);
/* Submits kvhost_backup, with its arguments (the attachment's id is copied;
 * the handle may go once this returns). Its value is the ticket id. The
 * request completes once the daemon accepted the backup; with
 * KVHOST_TRANSFER_WAIT, once the transfer finished (its error the
 * request's, the ticket id its value still), holding up the requests
 * behind it as long. */
KVHOST_C_API int kvhost_async_backup(kvhost_async* async, const kvhost_attachment* attachment,
                                     const int64_t* host_indices, size_t num_host,
                                     const int64_t* device_indices, size_t num_device,
                                     const void* wait_event_handle, size_t wait_event_handle_len,
                                     uint32_t flags, int64_t wait_timeout_ms, uint64_t* request_id,
                                     char* err, size_t err_len);
/* Submits kvhost_load; as kvhost_async_backup. */
KVHOST_C_API int kvhost_async_load(kvhost_async* async, const kvhost_attachment* attachment,
                                   const int64_t* host_indices, size_t num_host,
                                   const int64_t* device_indices, size_t num_device, uint32_t flags,
                                   int64_t wait_timeout_ms, uint64_t* request_id, char* err,
                                   size_t err_len);

/* Requests completed so far (failed and cancelled ones included): request
 * k is done exactly when this is >= k. 0 for NULL. Monotonic; lock-free. */
KVHOST_C_API uint64_t kvhost_async_completed(const kvhost_async* async);
/* Blocks until request_id completed or timeout_ms (0: 10 min) passed, then
 * returns the request's own code and message (its result stays held).
 * KVHOST_DEADLINE_EXCEEDED when it did not complete in time (a request
 * that itself failed so is told apart by kvhost_async_completed() >=
 * request_id); KVHOST_NOT_FOUND for a request this handle does not hold
 * (never submitted, or taken), the message saying which. */
KVHOST_C_API int kvhost_async_wait(kvhost_async* async, uint64_t request_id, int64_t timeout_ms,
                                   char* err, size_t err_len);
/* Takes a finished alloc's result: its indices into indices[0, capacity)
 * and their number into *count (may be NULL only when the buffer is big
 * enough), then releases it. A buffer too small is KVHOST_OUT_OF_RANGE,
 * writes nothing, sets *count, and keeps the result. A request that failed
 * is taken by either take call, which returns its code and message and
 * releases it. KVHOST_FAILED_PRECONDITION while the request has not
 * completed (nothing taken); KVHOST_INVALID_ARGUMENT for a request that is
 * not an alloc; KVHOST_NOT_FOUND as kvhost_async_wait. */
KVHOST_C_API int kvhost_async_take_indices(kvhost_async* async, uint64_t request_id,
                                           int64_t* indices, size_t capacity, size_t* count,
                                           char* err, size_t err_len);
/* Takes a finished free's, backup's or load's result: *value (may be NULL)
 * the slots freed or the ticket id (set also for a waited transfer that
 * failed), then releases it. Otherwise as kvhost_async_take_indices
 * (KVHOST_INVALID_ARGUMENT for an alloc that succeeded). */
KVHOST_C_API int kvhost_async_take_value(kvhost_async* async, uint64_t request_id, uint64_t* value,
                                         char* err, size_t err_len);

/* ---- The L3 tier (kvhost.v1.StorageService; kvhostd --l3-memcached) ----
 * Pages of a pool stored in and fetched from a cache shared by many nodes,
 * by the scheduler's page keys (docs/OPERATIONS.md, "L3 tier"). A key is
 * opaque bytes, 1 to 112 of them: keys[i] is key_lens[i] bytes. Per-page
 * outcomes are results, not errors: outcomes (NULL: not wanted) gets one
 * KVHOST_PAGE_* per page, in order. Without an L3 tier every call is
 * KVHOST_FAILED_PRECONDITION saying so. */
#define KVHOST_PAGE_STORED 1         /* store: every part of the page is in the cache */
#define KVHOST_PAGE_HIT 2            /* fetch: found whole and written to the pool */
#define KVHOST_PAGE_MISS 3           /* fetch: not stored, evicted, or a part lost */
#define KVHOST_PAGE_CORRUPT 4        /* fetch: parts of other stores, or a bad checksum */
#define KVHOST_PAGE_SHAPE_MISMATCH 5 /* fetch: stored from a pool of another shape */
#define KVHOST_PAGE_UNAVAILABLE 6    /* the cache refused or could not be reached */

/* Writes the pages whose first slots are indices[0, num_pages) to the
 * cache under keys (StorePages); *stored_pages (may be NULL) the pages
 * stored. A refused call (a bad key or index, a page not allocated, over
 * the daemon's pages-in-flight bound) stores nothing. */
KVHOST_C_API int kvhost_l3_store(kvhost_client* client, const char* pool, const int64_t* indices,
                                 const void* const* keys, const size_t* key_lens, size_t num_pages,
                                 int32_t* outcomes, uint64_t* stored_pages, char* err,
                                 size_t err_len);
/* Reads the pages stored under keys into the pages whose first slots are
 * indices (FetchPages; allocated, none twice); *hit_pages (may be NULL)
 * the pages written. A page is written only when found whole, of the
 * pool's shape, its checksums right; otherwise it is left as it was. */
KVHOST_C_API int kvhost_l3_fetch(kvhost_client* client, const char* pool, const void* const* keys,
                                 const size_t* key_lens, const int64_t* indices, size_t num_pages,
                                 int32_t* outcomes, uint64_t* hit_pages, char* err, size_t err_len);
/* *prefix_pages: how many of keys, from the first, are stored in pool's
 * namespace (ExistPages, as sglang's batch_exists is used; a protected
 * pool's keys are its owner token's, every unprotected pool's the public
 * namespace's). */
KVHOST_C_API int kvhost_l3_exist(kvhost_client* client, const char* pool, const void* const* keys,
                                 const size_t* key_lens, size_t num_keys, uint64_t* prefix_pages,
                                 char* err, size_t err_len);
/* kvhost_l3_store / kvhost_l3_fetch detached: *ticket gets the call's
 * ticket at once, and kvhost_l3_wait returns its results. */
KVHOST_C_API int kvhost_l3_start_store(kvhost_client* client, const char* pool,
                                       const int64_t* indices, const void* const* keys,
                                       const size_t* key_lens, size_t num_pages, uint64_t* ticket,
                                       char* err, size_t err_len);
KVHOST_C_API int kvhost_l3_start_fetch(kvhost_client* client, const char* pool,
                                       const void* const* keys, const size_t* key_lens,
                                       const int64_t* indices, size_t num_pages, uint64_t* ticket,
                                       char* err, size_t err_len);
/* A detached call's results (WaitStorage): blocks until its pages are done
 * (or the client's timeout), or with poll returns at once. *done (may be
 * NULL) 1 when done, 0 for a poll of a running ticket (nothing else set).
 * Once done: *num_pages (may be NULL) the pages of the call,
 * outcomes[0, capacity) their outcomes, *good_pages (may be NULL) those
 * stored or hit. A capacity below the pages is KVHOST_OUT_OF_RANGE with the
 * first `capacity` outcomes and *num_pages written; the ticket stays, so
 * ask again with room. KVHOST_NOT_FOUND for a ticket not of this pool, or
 * dropped by the pool's limits on finished tickets (256, 65536 pages);
 * KVHOST_PERMISSION_DENIED without the pool's owner token. */
KVHOST_C_API int kvhost_l3_wait(kvhost_client* client, const char* pool, uint64_t ticket, int poll,
                                int* done, int32_t* outcomes, size_t capacity, size_t* num_pages,
                                uint64_t* good_pages, char* err, size_t err_len);

/* ---- The node cache (kvhost.v1.CacheService) ------------------------------
 * A pool created with node_cache (PoolSpec.node_cache) whose pages are
 * addressed by key: an engine's block hashes, shared by every instance on
 * the node that presents the cache's owner token (docs/C_ABI.md, "Node
 * cache"). A key is opaque bytes, 1 to KVHOST_CACHE_MAX_KEY_BYTES of them:
 * keys[i] is key_lens[i] bytes; at most KVHOST_CACHE_MAX_KEYS keys a call.
 * The daemon checks keys, counts and rows, and a refused call changes
 * nothing. Per-key states and outcomes are results, not errors: states /
 * outcomes (NULL: not wanted) get one KVHOST_CACHE_* per key, in order, so
 * they hold num_keys entries. kvhost_cache_store, kvhost_cache_restore and
 * a pinning kvhost_cache_lookup need a client with a worker session (else
 * KVHOST_FAILED_PRECONDITION); its end releases their pins and drops their
 * stores in flight. */
#define KVHOST_CACHE_MAX_KEYS 4096
#define KVHOST_CACHE_MAX_KEY_BYTES 256
#define KVHOST_CACHE_MAX_EVENTS 4096 /* the most one kvhost_cache_read_events returns */
/* Key states (kvhost.v1.CacheKeyState). */
#define KVHOST_CACHE_ABSENT 0
#define KVHOST_CACHE_PRESENT 1 /* published: its page holds all its bytes */
#define KVHOST_CACHE_PENDING 2 /* a store is writing it (a store skips it too) */
/* Evict outcomes (kvhost.v1.CacheEvictReply.Outcome). */
#define KVHOST_CACHE_EVICTED 0
#define KVHOST_CACHE_EVICT_ABSENT 1
#define KVHOST_CACHE_EVICT_BUSY 2 /* pinned or being written: kept */
/* Event kinds (kvhost.v1.CacheEvent.Kind). */
#define KVHOST_CACHE_EVENT_STORED 0
#define KVHOST_CACHE_EVENT_EVICTED 1

/* kvhost.v1.CacheStats: keys now (published, writing, pinned) and counts
 * since the cache's pool was created, the L3 tier's included (keys written
 * through, fetched, missed). 112 bytes, no padding. */
typedef struct kvhost_cache_stats {
  uint64_t page_num;
  uint64_t free_pages;
  uint64_t published;
  uint64_t writing;
  uint64_t pinned;
  uint64_t hits;
  uint64_t misses;
  uint64_t stored;
  uint64_t skipped;
  uint64_t evicted;
  uint64_t aborted;
  uint64_t l3_written;
  uint64_t l3_fetched;
  uint64_t l3_missed;
} kvhost_cache_stats;

/* One kvhost.v1.CacheEvent: its key is key[0, key_len). 272 bytes. */
typedef struct kvhost_cache_event {
  uint64_t seq;
  int32_t kind; /* KVHOST_CACHE_EVENT_* */
  uint32_t key_len;
  uint8_t key[KVHOST_CACHE_MAX_KEY_BYTES];
} kvhost_cache_event;

/* Which keys are present (CacheLookup): *prefix (may be NULL) the present
 * keys from the first on, states their KVHOST_CACHE_* states. With pin
 * (worker session), that prefix stays pinned until kvhost_cache_release_pin
 * or the session's end: *pin_id (may be NULL) its id, 0 for an empty
 * prefix or without pin. */
KVHOST_C_API int kvhost_cache_lookup(kvhost_client* client, const char* cache,
                                     const void* const* keys, const size_t* key_lens,
                                     size_t num_keys, int pin, uint32_t* prefix, int32_t* states,
                                     uint64_t* pin_id, char* err, size_t err_len);
/* Backs up the keys not yet present from the attachment's device rows
 * (CacheStore): key i's page is device_indices[i * page_size, (i + 1) *
 * page_size), so num_device is num_keys * page_size. states get ABSENT
 * for a key this store writes, PRESENT or PENDING for one it skips. *ticket
 * (may be NULL) the backup's ticket, published when it ends well
 * (kvhost_transfer_wait); ticket_id 0 (event_set -1) when every key was
 * skipped. *evicted (may be NULL) the published pages evicted to make room.
 * ready_event_handle as kvhost_backup's wait_event_handle (cuda backend). */
KVHOST_C_API int kvhost_cache_store(kvhost_client* client, const char* cache,
                                    const kvhost_attachment* attachment, const void* const* keys,
                                    const size_t* key_lens, size_t num_keys,
                                    const int64_t* device_indices, size_t num_device,
                                    const void* ready_event_handle, size_t ready_event_handle_len,
                                    int32_t* states, kvhost_load_ticket* ticket, uint64_t* evicted,
                                    char* err, size_t err_len);
/* Loads every key's page into the attachment's device rows (CacheRestore;
 * rows as kvhost_cache_store's): every key must be present, else
 * KVHOST_FAILED_PRECONDITION naming the first that is not. *ticket (may be
 * NULL) the load's ticket, with its event set and layer base as
 * kvhost_load_with_events gives them (kvhost_wait_layer); the pages stay
 * pinned until it ends. wait_event_handle as
 * kvhost_load_group_with_events_after's (cuda backend). */
KVHOST_C_API int kvhost_cache_restore(kvhost_client* client, const char* cache,
                                      const kvhost_attachment* attachment, const void* const* keys,
                                      const size_t* key_lens, size_t num_keys,
                                      const int64_t* device_indices, size_t num_device,
                                      const void* wait_event_handle, size_t wait_event_handle_len,
                                      kvhost_load_ticket* ticket, char* err, size_t err_len);
/* kvhost_cache_store with an index-addressed pool's slots as the source
 * instead of an attachment (CacheStoreRequest.pool): key i's page is
 * host_indices[i * page_size, (i + 1) * page_size) of `pool`, whole
 * allocated pages of a pool of the cache's shape (its host layout may
 * differ), copied inside kvhostd, host memory to host memory, on either
 * backend. states, *ticket (no event set) and *evicted as
 * kvhost_cache_store's. KVHOST_INVALID_ARGUMENT for another shape or bad
 * slots, KVHOST_FAILED_PRECONDITION for slots not allocated,
 * KVHOST_PERMISSION_DENIED without the pool's owner token. */
KVHOST_C_API int kvhost_cache_store_from_pool(kvhost_client* client, const char* cache,
                                              const char* pool, const void* const* keys,
                                              const size_t* key_lens, size_t num_keys,
                                              const int64_t* host_indices, size_t num_host,
                                              int32_t* states, kvhost_load_ticket* ticket,
                                              uint64_t* evicted, char* err, size_t err_len);
/* kvhost_cache_restore into `pool`'s slots (as
 * kvhost_cache_store_from_pool's; CacheRestoreRequest.pool); refused, as a
 * backup into it is, while a live session of another instance holds the
 * pool (kvhost_claim_pool). */
KVHOST_C_API int kvhost_cache_restore_to_pool(kvhost_client* client, const char* cache,
                                              const char* pool, const void* const* keys,
                                              const size_t* key_lens, size_t num_keys,
                                              const int64_t* host_indices, size_t num_host,
                                              kvhost_load_ticket* ticket, char* err,
                                              size_t err_len);
/* Releases a pin of kvhost_cache_lookup; KVHOST_NOT_FOUND for one that is
 * not this session's (or released already). */
KVHOST_C_API int kvhost_cache_release_pin(kvhost_client* client, const char* cache, uint64_t pin_id,
                                          char* err, size_t err_len);
/* Evicts published, unpinned keys (CacheEvict): outcomes get one
 * KVHOST_CACHE_EVICTED / _EVICT_ABSENT / _EVICT_BUSY per key, *evicted (may
 * be NULL) the keys evicted. */
KVHOST_C_API int kvhost_cache_evict(kvhost_client* client, const char* cache,
                                    const void* const* keys, const size_t* key_lens,
                                    size_t num_keys, int32_t* outcomes, uint64_t* evicted,
                                    char* err, size_t err_len);
/* The cache's counters (GetCacheStats) into *stats. */
KVHOST_C_API int kvhost_cache_get_stats(kvhost_client* client, const char* cache,
                                        kvhost_cache_stats* stats, char* err, size_t err_len);
/* Stored and evicted keys after sequence number after_seq (0: from the
 * oldest kept), oldest first (ReadCacheEvents): at most max_events (0:
 * KVHOST_CACHE_MAX_EVENTS) and at most `capacity`, so they always fit:
 * events[0, *count). *next_after (may be NULL) is the after_seq of the next
 * read; *gap (may be NULL) 1 when events after after_seq were dropped
 * before this read (the reader fell behind, or kvhostd restarted):
 * resynchronise from kvhost_cache_lookup. capacity 0 is
 * KVHOST_INVALID_ARGUMENT. */
KVHOST_C_API int kvhost_cache_read_events(kvhost_client* client, const char* cache,
                                          uint64_t after_seq, uint32_t max_events,
                                          kvhost_cache_event* events, size_t capacity,
                                          size_t* count, uint64_t* next_after, int32_t* gap,
                                          char* err, size_t err_len);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* KVHOST_CLIENT_KVHOST_C_H_ */
