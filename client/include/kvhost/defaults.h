/* kvhost's defaults that every side shares: kvhostd's flags, the C++
 * client (kvhost/client.h), the C ABI (kvhost/kvhost_c.h) and, checked by
 * tests/defaults_test.py, the Python package (kvhost.DEFAULT_ADDRESS).
 * C and C++; macros only, so that C includes it too. */
#ifndef KVHOST_DEFAULTS_H_
#define KVHOST_DEFAULTS_H_

/* The daemon's gRPC address on a node: kvhostd --listen's default, and the
 * address a client connects to when given none. */
#define KVHOST_DEFAULT_ADDRESS "unix:///run/kvhost/kvhost.sock"

/* Descriptors in one deposit on the handoff socket (HANDOFF_KIND_DEPOSIT):
 * one SCM_RIGHTS message, under the kernel's SCM_MAX_FD of 253. kvhostd
 * refuses more; the client splits larger sets. */
#define KVHOST_MAX_DEPOSIT_DESCRIPTORS 250

#endif /* KVHOST_DEFAULTS_H_ */
