"""Where a chunk lies in kvhost's node cache: vLLM 0.33's ``LoadStoreSpec``
(vllm/v1/kv_offload/base.py) of kvhost's offloaded medium.

The scheduler's manager hands one to the worker in every load and store job
(``TransferJob.src_spec`` / ``dst_spec``, shipped in the connector's
metadata, so it pickles: a tuple of bytes). It holds the chunks' OffloadKeys
in the job's order; the worker turns them into node-cache keys
(keys.CacheNamespace), so the spec carries no page address: the node cache
finds pages by key, in any instance, after any restart.
"""

from __future__ import annotations

from typing import Iterable, Tuple

from vllm.v1.kv_offload.base import LoadStoreSpec


class KvhostLoadStoreSpec(LoadStoreSpec):  # type: ignore[misc]  # vLLM's class: Any to mypy
    """The OffloadKeys of a job's chunks, in the order of its GPU blocks."""

    def __init__(self, offload_keys: Iterable[bytes]) -> None:
        #: One per chunk, in the order vLLM gave them.
        self.offload_keys: Tuple[bytes, ...] = tuple(bytes(k) for k in offload_keys)

    def __len__(self) -> int:
        return len(self.offload_keys)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KvhostLoadStoreSpec) and other.offload_keys == self.offload_keys

    def __hash__(self) -> int:
        return hash(self.offload_keys)

    def __repr__(self) -> str:
        return f"KvhostLoadStoreSpec({len(self.offload_keys)} chunks)"
