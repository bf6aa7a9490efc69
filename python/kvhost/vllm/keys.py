"""The node-cache keys of vLLM's offloaded chunks.

vLLM 0.33 names an offloaded chunk by an ``OffloadKey`` (a block hash and a
KV cache group index, vllm/v1/kv_offload/base.py ``make_offload_key``); a
chunk is ``blocks_per_chunk`` GPU blocks. A node-cache page here is one GPU
block (one row of every canonical KV tensor, docs/VLLM.md), so a chunk is
``blocks_per_chunk`` keys per shard:

    key = namespace (8 bytes) + OffloadKey + shard (2 bytes) + block in chunk (2 bytes)

- The namespace is a hash of what makes two instances' bytes for one block
  hash the same: the model, the KV dtype and layout, tokens per block and per
  hash, blocks per chunk, a worker's bytes per block and the number of
  shards. Instances that differ in any of these never read each other's
  pages; a cache holds many models.
- The shard is the worker's rank: under tensor (or pipeline / context)
  parallelism each rank holds its own slice of a block, so every rank
  stores and restores its own keys, and a chunk is present only when every
  shard's keys are. Where vLLM says the ranks' bytes are the same
  (``OffloadingConfig.replicated_layout``: MLA under TP, whose
  OffloadingConnectorWorker then lets rank 0 alone store), there is one
  shard, written by rank 0 and read by all.
- The block in chunk lets a load or store start mid-chunk (vLLM's
  ``GPULoadStoreSpec.block_indices``): each block is its own page.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, List, Sequence

#: Bytes of the namespace at the front of every key.
NAMESPACE_BYTES = 8
#: Version of the key format and the page layout: bump on any change.
FORMAT_VERSION = 1
#: A key's bytes at most (kvhost.NodeCache.MAX_KEY_BYTES).
MAX_KEY_BYTES = 256
_SUFFIX_BYTES = 4


class CacheNamespace:
    """The keys of one instance's chunks (the same in its scheduler and
    every worker: built from vLLM's OffloadingConfig alone)."""

    def __init__(self, config: Any) -> None:
        self.blocks_per_chunk = int(config.cache.blocks_per_chunk)
        #: Shards a chunk has: 1 for replicated bytes, else one per rank.
        self.shards = 1 if config.replicated_layout else max(int(config.parallel.world_size), 1)
        identity = {
            "format": FORMAT_VERSION,
            "model": config.model.name,
            "dtype": config.model.dtype,
            "kv_cache_layout": config.kv_cache_layout,
            "tokens_per_block": [g.tokens_per_block for g in config.groups],
            "tokens_per_hash": config.cache.tokens_per_hash,
            "blocks_per_chunk": self.blocks_per_chunk,
            "worker_kv_bytes_per_block": config.worker_kv_bytes_per_block,
            "shards": self.shards,
        }
        digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).digest()
        self.prefix = digest[:NAMESPACE_BYTES]

    def default_cache_name(self) -> str:
        """The cache's pool name when kvhost_cache is not set."""
        return f"vllm-{self.prefix.hex()[:12]}"

    def key(self, offload_key: bytes, shard: int, block: int) -> bytes:
        """The key of block `block` (in its chunk) of `shard` of a chunk."""
        key = (self.prefix + bytes(offload_key) + shard.to_bytes(2, "big")
               + block.to_bytes(2, "big"))
        if len(key) > MAX_KEY_BYTES:
            raise ValueError(f"kvhost.vllm: an OffloadKey of {len(offload_key)} bytes makes a "
                             f"node-cache key of {len(key)} bytes, over {MAX_KEY_BYTES}")
        return key

    def chunk_keys(self, offload_key: bytes) -> List[bytes]:
        """Every key of a chunk: each shard's blocks (present iff all are)."""
        return [self.key(offload_key, s, b) for s in range(self.shards)
                for b in range(self.blocks_per_chunk)]

    def offload_key(self, key: bytes) -> bytes:
        """The OffloadKey a key of this namespace belongs to (ValueError for
        a key of another namespace)."""
        if len(key) <= NAMESPACE_BYTES + _SUFFIX_BYTES or not key.startswith(self.prefix):
            raise ValueError(f"key {key!r} is not of namespace {self.prefix.hex()}")
        return key[NAMESPACE_BYTES:-_SUFFIX_BYTES]

    def owns(self, key: bytes) -> bool:
        """Whether `key` is of this namespace."""
        return len(key) > NAMESPACE_BYTES + _SUFFIX_BYTES and key.startswith(self.prefix)


def unique(keys: Sequence[bytes]) -> List[bytes]:
    """`keys` without repeats, in first-seen order."""
    return list(dict.fromkeys(keys))
