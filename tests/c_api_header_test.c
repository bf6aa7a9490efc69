/* kvhost/kvhost_c.h is C: this file is compiled as C99 with -Wall -Wextra
 * -Wpedantic -Werror (tests/CMakeLists.txt) and linked against
 * libkvhost_c.so alone. It also pins what a ctypes caller mirrors: the
 * layout of kvhost_load_ticket, kvhost_pool_transfer,
 * kvhost_cuda_group_entry, kvhost_cache_stats and kvhost_cache_event, and
 * the code numbers. */
#include "kvhost/kvhost_c.h"

#include <stddef.h>
#include <stdio.h>
#include <string.h>

/* C99 has no _Static_assert: a negative array size fails the build. */
#define STATIC_CHECK(cond, name) typedef char static_check_##name[(cond) ? 1 : -1]

STATIC_CHECK(sizeof(kvhost_load_ticket) == 24, ticket_size);
STATIC_CHECK(offsetof(kvhost_load_ticket, event_set) == 8, ticket_event_set);
STATIC_CHECK(offsetof(kvhost_load_ticket, layer_base) == 16, ticket_layer_base);
/* kvhost_pool_transfer: pointers and sizes only, so it is laid out alike
 * by every C compiler of one platform (ctypes mirrors it field by field). */
STATIC_CHECK(offsetof(kvhost_pool_transfer, host_indices) == sizeof(void*), transfer_host);
STATIC_CHECK(sizeof(kvhost_pool_transfer) == 5 * sizeof(void*), transfer_size);
/* kvhost_cuda_group_entry: five pointers / sizes, then a uint64 and four
 * uint32s, no padding on a 64-bit platform (ctypes mirrors it). */
STATIC_CHECK(sizeof(void*) != 8 || sizeof(kvhost_cuda_group_entry) == 64, group_entry_size);
STATIC_CHECK(sizeof(void*) != 8 || offsetof(kvhost_cuda_group_entry, device_size_tokens) == 40,
             group_entry_rows);
STATIC_CHECK(sizeof(void*) != 8 || offsetof(kvhost_cuda_group_entry, reserved) == 60,
             group_entry_reserved);
/* The node cache's structs: uint64s, and an event's seq, kind, key_len and
 * key bytes, without padding. */
STATIC_CHECK(sizeof(kvhost_cache_stats) == 14 * 8, cache_stats_size);
STATIC_CHECK(offsetof(kvhost_cache_stats, aborted) == 80, cache_stats_aborted);
STATIC_CHECK(offsetof(kvhost_cache_stats, l3_missed) == 104, cache_stats_l3_missed);
STATIC_CHECK(sizeof(kvhost_cache_event) == 16 + KVHOST_CACHE_MAX_KEY_BYTES, cache_event_size);
STATIC_CHECK(offsetof(kvhost_cache_event, key_len) == 12, cache_event_key_len);
STATIC_CHECK(offsetof(kvhost_cache_event, key) == 16, cache_event_key);
STATIC_CHECK(KVHOST_OK == 0 && KVHOST_INVALID_ARGUMENT == 3 && KVHOST_NOT_FOUND == 5, codes);
STATIC_CHECK(KVHOST_FAILED_PRECONDITION == 9 && KVHOST_OUT_OF_RANGE == 11, more_codes);
STATIC_CHECK(KVHOST_UNIMPLEMENTED == 12 && KVHOST_INTERNAL == 13, last_codes);

int main(void) {
  char err[16];
  kvhost_client* client = NULL;
  if (kvhost_abi_version() != KVHOST_ABI_VERSION) {
    printf("library ABI %d, header %d\n", kvhost_abi_version(), KVHOST_ABI_VERSION);
    return 1;
  }
  /* A call that fails before any RPC: the message truncated into err. */
  memset(err, 'x', sizeof(err));
  if (kvhost_connect(NULL, 0, 0, &client, err, sizeof(err)) != KVHOST_INVALID_ARGUMENT ||
      err[sizeof(err) - 1] != '\0' || client != NULL) {
    printf("kvhost_connect(NULL) did not answer INVALID_ARGUMENT with a terminated message\n");
    return 1;
  }
  printf("kvhost C ABI %d, CUDA %d: %s\n", kvhost_abi_version(), kvhost_built_with_cuda(), err);
  return 0;
}
