"""vLLM's canonical KV pages as a kvhost pool, and the worker's attachment.

vLLM 0.33's offloading worker is handed ``CanonicalKVCaches``
(vllm/v1/kv_offload/base.py; built by OffloadingConnectorWorker.
register_kv_caches in .../kv_connector/v1/offloading/worker.py): a list of
tensors viewed as ``(num_blocks, page_size_bytes)`` int8, one per distinct
KV buffer (a layer, or a packed block of all layers), whose block rows are
opaque bytes. That is exactly an MLA pool in LAYER_FIRST of dtype UINT8:

  - one pool "layer" per canonical tensor (``layer_num`` = their count),
  - a row of ``kv_cache_dim`` = ``page_size_bytes`` bytes: one GPU block of
    one tensor (what vLLM's own CPU worker copies, padding included),
  - ``page_size`` 1: a node-cache key is one block (keys.py says why),
  - the attachment's device rows are the GPU block ids, ``num_blocks`` of
    them per layer (the tensor's own memory, attached once).

What does not fit is refused at the worker's start, by name: tensors of
different page sizes, or with a block stride other than their page size;
more than one KV cache group (hybrid models: each group would need its own
pool); vLLM's canonical_layout (its per-rank byte runs); MLA pools cap a
layer count at 4096.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from .. import pools as _pools
from ..errors import AlreadyExists
from ..shm import ShmDevicePool
from ..transfer import Attachment

#: The one component of an MLA pool.
COMPONENT = "latent"

# Host-backend stand-ins for GPU memory (kvhost.ShmDevicePool): a kvhostd on
# --backend=host has no CUDA tensors, so canonical tensors on the CPU attach
# the registered ShmDevicePool whose layer buffers they are.
_SHM_POOLS: List[ShmDevicePool] = []


def register_shm_device_pool(pool: ShmDevicePool) -> None:
    """Lets a worker whose canonical tensors lie in `pool`'s buffers attach it
    (the host backend; tests and CPU-only runs)."""
    _SHM_POOLS.append(pool)


@dataclass(frozen=True)
class CacheLayout:
    """The shape of a worker's canonical KV caches, as a pool sees it."""

    #: The canonical tensors, one pool layer each.
    tensors: List[Any]
    #: Bytes of one block of one tensor: a pool row.
    row_bytes: int
    #: Blocks per tensor: the attachment's device rows.
    num_blocks: int

    @classmethod
    def of(cls, kv_caches: Any) -> "CacheLayout":
        """The layout of vLLM's CanonicalKVCaches; ValueError naming what a
        kvhost pool cannot hold."""
        if len(kv_caches.group_data_refs) != 1:
            raise ValueError(f"kvhost.vllm: {len(kv_caches.group_data_refs)} KV cache groups "
                             f"(a hybrid model); kvhost serves one (docs/VLLM.md)")
        entries = list(kv_caches.tensors)
        if not entries:
            raise ValueError("kvhost.vllm: no canonical KV tensors to attach")
        tensors: List[Any] = []
        sizes = {int(e.page_size_bytes) for e in entries}
        if len(sizes) != 1:
            raise ValueError(f"kvhost.vllm: canonical KV tensors of page sizes "
                             f"{sorted(sizes)} bytes; a kvhost pool has one row size")
        row_bytes = sizes.pop()
        for i, e in enumerate(entries):
            t = e.tensor
            stride = int(t.stride(0)) * int(t.element_size())
            if t.dim() != 2 or stride != row_bytes or not t.is_contiguous():
                raise ValueError(f"kvhost.vllm: canonical KV tensor {i} (shape "
                                 f"{tuple(t.shape)}, block stride {stride} bytes) is not "
                                 f"contiguous blocks of {row_bytes} bytes")
            tensors.append(t)
        blocks = {int(t.shape[0]) for t in tensors}
        if len(blocks) != 1:
            raise ValueError(f"kvhost.vllm: canonical KV tensors of {sorted(blocks)} blocks")
        return cls(tensors, row_bytes, blocks.pop())

    def pool_spec(self, cache_bytes: int) -> Dict[str, Any]:
        """The node cache's PoolSpec for `cache_bytes` of pages."""
        page_bytes = self.row_bytes * len(self.tensors)
        pages = cache_bytes // page_bytes
        if pages < 1:
            raise ValueError(f"kvhost.vllm: kvhost_cache_bytes {cache_bytes} holds no page of "
                             f"{page_bytes} bytes (one block of {len(self.tensors)} tensors)")
        return {"kind": "MLA", "layout": "LAYER_FIRST", "dtype": "UINT8", "page_size": 1,
                "layer_num": len(self.tensors), "kv_cache_dim": self.row_bytes,
                "size_tokens": pages, "node_cache": True}

    def check_pool(self, name: str, info: Dict[str, Any]) -> None:
        """ValueError unless pool `info` (get_pool's) has this layout's rows."""
        spec = info.get("spec", {})
        got = (spec.get("kind"), int(spec.get("layer_num") or 0),
               int(spec.get("kv_cache_dim") or 0), int(spec.get("page_size") or 0),
               bool(spec.get("node_cache")))
        want = ("MLA", len(self.tensors), self.row_bytes, 1, True)
        if got != want:
            raise ValueError(f"kvhost.vllm: cache pool {name!r} is (kind, layers, row bytes, "
                             f"page size, node cache) {got}, this worker needs {want}; set "
                             f"another kvhost_cache")

    def ensure_pool(self, client: Any, name: str, cache_bytes: int) -> None:
        """Creates the cache pool, or adopts it when it exists (the owner
        token's, kvhost.pools.adopt_pool) and has this layout."""
        try:
            client.create_pool(name, self.pool_spec(cache_bytes))
            return
        except AlreadyExists:
            info = _pools.adopt_pool(client, name)
        self.check_pool(name, info)

    def attach(self, client: Any, name: str) -> Attachment:
        """Attaches the canonical tensors to pool `name`, once: their CUDA
        memory, or (CPU tensors, host backend) the ShmDevicePool they lie in."""
        if self.tensors[0].is_cuda:
            ptrs = [int(t.data_ptr()) for t in self.tensors]
            att: Attachment = client.attach_cuda(
                name, {COMPONENT: ptrs}, self.num_blocks,
                layer_bytes={COMPONENT: self.num_blocks * self.row_bytes},
                keep_alive=self.tensors)
            return att
        shm = self._shm_of(name)
        if shm is None:
            raise ValueError(f"kvhost.vllm: CPU canonical KV tensors that lie in no registered "
                             f"ShmDevicePool of pool {name!r} (kvhost.vllm.layout."
                             f"register_shm_device_pool); GPU tensors attach directly")
        shm_att: Attachment = client.attach_shm(name, shm)
        return shm_att

    def _shm_of(self, name: str) -> Optional[ShmDevicePool]:
        want = [int(t.data_ptr()) for t in self.tensors]
        for shm in _SHM_POOLS:
            if shm.closed or shm.pool != name or shm.layers != len(want):
                continue
            if [shm.layer_address(COMPONENT, i) for i in range(shm.layers)] == want:
                return shm
        return None
