/* Connects to the kvhostd at argv[1] through the installed C ABI
 * (kvhost::c) and prints its pool list as JSON. Exit status 0 on success,
 * 1 on any error. */
#include <stdio.h>

#include "kvhost/kvhost_c.h"

int main(int argc, char** argv) {
  char err[512];
  char pools[4096];
  kvhost_client* client = NULL;
  int rc;
  if (argc != 2) {
    fprintf(stderr, "usage: %s ADDRESS\n", argv[0]);
    return 1;
  }
  if (kvhost_abi_version() != KVHOST_ABI_VERSION) {
    fprintf(stderr, "libkvhost_c ABI %d, header %d\n", kvhost_abi_version(), KVHOST_ABI_VERSION);
    return 1;
  }
  rc = kvhost_connect(argv[1], 10000, 0, &client, err, sizeof(err));
  if (rc == KVHOST_OK)
    rc = kvhost_pool_list_json(client, pools, sizeof(pools), NULL, err, sizeof(err));
  kvhost_client_close(client);
  if (rc != KVHOST_OK) {
    fprintf(stderr, "kvhost: %s: %s\n", kvhost_code_name(rc), err);
    return 1;
  }
  printf("c abi %d: %s\n", kvhost_abi_version(), pools);
  return 0;
}
