"""sglang HiCache's host pool (HostKVCache) backed by kvhostd.

:class:`MHATokenToKVPoolHost` and :class:`MLATokenToKVPoolHost` have the
calls and semantics of sglang's classes of those names (docs/SGLANG.md);
the seeds' other host pools (K-only, asymmetric MHA, DSA, DSA indexer,
Mamba, logical, DeepSeek-V4 paged and state) and pool groups
(:class:`HostPoolGroup` of :class:`PoolEntry`) come from
kvhost/sglang/kinds.py and groups.py and are re-exported here. kvhost.sglang.plugin puts
the MHA pool on sglang's own HiCache path (sglang's constructor, no sglang patch);
with sglang importable, HostKVCache here subclasses sglang's. The slots and their
bytes live in a kvhostd pool, so several schedulers on a node share one
daemon's memory and a scheduler restart keeps the cache.

What differs from sglang, on purpose:

- Construction takes the pool's name and shape instead of a device pool:
  sizes are ``host_size_gib`` (GiB, 2**30 bytes, as kvhostd's and
  kvhostctl's sizes), ``host_size_tokens``, or
  ``host_to_device_ratio`` with ``device_size`` (tokens). A pool of that name
  that exists already is opened, if its shape is the one asked for and it
  is protected by the client's owner token (kvhost.pools.adopt_pool).
- ``load_to_device_per_layer`` (with sglang's ``is_draft``) for layer 0
  submits the load of every layer at once and then waits for layer 0; later
  layer ids wait for their layer of that load (sglang issues one copy per
  call). The daemon records per-layer
  progress, so layer l's attention may start while later layers arrive.
- Neither transfer call waits for the copy on the cuda backend: the waits are
  GPU-side, on torch's current stream (a backup's ready fence is an event
  recorded there; its end is its last layer's event, waited on there), and a
  failed transfer raises from the pool's next transfer call or close(). On
  the host backend both calls return once copied.
- ``free`` of a slot that is not allocated raises the daemon's
  FailedPrecondition (sglang appends it to the free list unchecked);
  ``clear`` frees the slots this object allocated, not other schedulers'.
- One scheduler owns a pool at a time: construction claims it
  (PoolService.ClaimPool) for ``instance_id`` within the client's worker
  session. A restarted scheduler's claim frees its dead predecessor's slots
  (the radix tree indexing them died with it), logged at info; a second
  live scheduler on the pool is refused (FailedPrecondition naming the
  holder). Once the session is lost (kvhostd restarted, or the connection
  broke and the daemon ended the session) every slot call raises
  :class:`SessionLost`: the pool's contents can no longer be trusted, so
  the scheduler must be restarted, never fed zeroed KV.
- ``get_page_buffer_meta`` maps the pool's region files into this process
  so that its pointers are real (zero-copy storage backends read them).

Return types: with torch installed, slot indices are int64 tensors and pages
tensors of the pool's dtype (sglang's); without it, numpy arrays when numpy
is installed, else lists and bytes. ``tensors=False`` picks the latter.

Thread safety: as sglang's (its allocator lock is the daemon's); the load
tickets of per-layer loads are kept per device pool, one load at a time
(kvhost/sglang/transfers.py keeps them, and the tickets not waited for).
"""

from .groups import HostPoolGroup, PoolEntry
from .host_pool import HostKVCache, SessionLost, instance_id_for
from .kinds import (AsymmetricMHATokenToKVPoolHost, DeepSeekV4PagedHostPool,
                    DeepSeekV4StateHostPool, DSAIndexerPoolHost, DSATokenToKVPoolHost,
                    LogicalHostPool, MambaPoolHost, MHATokenToKOnlyPoolHost,
                    MHATokenToKVPoolHost, MLATokenToKVPoolHost, get_mha_host_pool_cls)
from .spec import IO_BACKENDS, LAYOUTS, dtype_enum, layout_enum

__all__ = ["AsymmetricMHATokenToKVPoolHost", "DSAIndexerPoolHost", "DSATokenToKVPoolHost",
           "DeepSeekV4PagedHostPool", "DeepSeekV4StateHostPool", "HostKVCache",
           "HostPoolGroup", "IO_BACKENDS", "LAYOUTS", "LogicalHostPool",
           "MHATokenToKOnlyPoolHost", "MHATokenToKVPoolHost", "MLATokenToKVPoolHost",
           "MambaPoolHost", "PoolEntry", "SessionLost", "dtype_enum", "get_mha_host_pool_cls",
           "instance_id_for", "layout_enum"]
