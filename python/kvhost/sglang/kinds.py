"""The seeds' host pool kinds over kvhostd (re-exported by kvhost.sglang),
each with the calls and semantics of the seed class of the same name
(docs/SGLANG.md lists what differs):

- :class:`MHATokenToKVPoolHost` and :class:`MLATokenToKVPoolHost`: sglang
  HiCache's MHA and MLA host pools.

- :class:`MHATokenToKOnlyPoolHost`: MiniMax's index-K pool (K_ONLY), which
  shares an MHA anchor's slots (sglang ``pool_host/mha.py``).
- :class:`AsymmetricMHATokenToKVPoolHost`: MHA with a V head dimension other
  than K's (MHA_ASYMMETRIC), and :func:`get_mha_host_pool_cls`.
- :class:`DSATokenToKVPoolHost`: tokenspeed's DSA pool, the MLA latent plus
  an FP8 index-K block per page (DSA).
- :class:`DSAIndexerPoolHost`: sglang's DSA indexer, which shares an MLA or
  DSA anchor's slots (DSA_INDEXER).
- :class:`MambaPoolHost`: Mamba temporal and conv states (MAMBA).
- :class:`LogicalHostPool`: an index space without a buffer (LOGICAL).
- :class:`DeepSeekV4PagedHostPool`, :class:`DeepSeekV4StateHostPool`: V4's
  compressed page rows and sliding-window state rings (V4_PAGED,
  V4_STATE, the latter sharing a paged or logical pool's slots).

A pool that follows another (K-only, DSA indexer, V4 state) has no slots of
its own: its transfers and pages take the followed pool's slots, so its
``alloc`` and ``free`` raise NotImplementedError saying so (allocate in the
followed pool), ``available_size`` is the followed pool's, ``clear`` does
nothing. Where the seed raises NotImplementedError or ValueError before
touching memory (an unsupported layout, the asymmetric pool's flat pages),
so does the class here; the daemon's refusals are kvhost exceptions.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..client import DEFAULT_ADDRESS, Client
from .host_pool import HostKVCache
from .spec import ITEMSIZE, dtype_enum


class MHATokenToKVPoolHost(HostKVCache):
    """sglang's MHA host pool: a K and a V row per token and layer."""

    _KIND = "MHA"

    def __init__(self, name: str, *, head_num: int, head_dim: int, **kw: Any) -> None:
        self.head_num, self.head_dim = int(head_num), int(head_dim)
        super().__init__(name, shape={"head_num": self.head_num, "head_dim": self.head_dim},
                         **kw)

    def page_shape(self) -> Tuple[int, ...]:
        lay, ps, L, H, D = self.layout, self.page_size, self.layer_num, self.head_num, \
            self.head_dim
        return {"layer_first": (2, L, ps, H, D), "page_first": (2, ps, L, H, D),
                "page_first_direct": (2, 1, L, ps, H, D),
                "page_head": (2, 1, H, ps, L, D),
                # (page, head_group, layer, 2, ps, head_in_group, dim); one group
                "page_unified": (1, 1, L, 2, ps, H, D)}[lay]

    def get_ksize_per_token(self) -> int:
        return self.size_per_token // 2

    @property
    def token_stride_size(self) -> int:
        """sglang's bytes of one token's K (or V) row in one layer."""
        return self.head_num * self.head_dim * ITEMSIZE[self.kv_dtype]

    def _device_components(self, device_pool: Any) -> Dict[str, List[Any]]:
        return {"k": list(device_pool.k_buffer), "v": list(device_pool.v_buffer)}


class MLATokenToKVPoolHost(HostKVCache):
    """sglang's MLA host pool: one latent row per token and layer."""

    _KIND = "MLA"

    def __init__(self, name: str, *, kv_lora_rank: int, qk_rope_head_dim: int,
                 **kw: Any) -> None:
        self.kv_lora_rank, self.qk_rope_head_dim = int(kv_lora_rank), int(qk_rope_head_dim)
        self.kv_cache_dim = self.kv_lora_rank + self.qk_rope_head_dim
        super().__init__(name, shape={"kv_lora_rank": self.kv_lora_rank,
                                      "qk_rope_head_dim": self.qk_rope_head_dim}, **kw)

    def page_shape(self) -> Tuple[int, ...]:
        lay, ps, L, Cd = self.layout, self.page_size, self.layer_num, self.kv_cache_dim
        if lay == "page_head":
            raise ValueError("MLA has no 'page_head' layout")
        return {"layer_first": (L, ps, 1, Cd), "page_first": (ps, L, 1, Cd),
                "page_first_direct": (1, L, ps, 1, Cd),
                "page_unified": (1, L, ps, Cd)}[lay]

    @property
    def token_stride_size(self) -> int:
        """sglang's bytes of one token's latent row in one layer."""
        return self.kv_cache_dim * ITEMSIZE[self.kv_dtype]

    def _device_components(self, device_pool: Any) -> Dict[str, List[Any]]:
        return {"latent": list(device_pool.kv_buffer)}


class _Follower:
    """A pool that shares another pool's page space (PoolSpec.follows): its
    slots are allocated and freed in the followed pool (``anchor_host``)."""

    anchor_host: HostKVCache
    name: str

    def _no_allocator(self, call: str) -> NotImplementedError:
        return NotImplementedError(
            f"{type(self).__name__} '{self.name}' follows '{self.anchor_host.name}' and has no "
            f"allocator: {call} in the pool it follows")

    def alloc(self, need_size: int) -> Any:
        """NotImplementedError: slots are the followed pool's."""
        raise self._no_allocator("alloc")

    def free(self, indices: Any) -> int:
        """NotImplementedError: slots are the followed pool's."""
        raise self._no_allocator("free")

    def available_size(self) -> int:
        """The followed pool's free slots (this pool's are the same ones)."""
        return self.anchor_host.available_size()

    def clear(self) -> None:
        """Nothing to free: the followed pool's clear() frees the slots."""


def _follower_args(anchor_host: HostKVCache, kw: Dict[str, Any]) -> Dict[str, Any]:
    """A follower's constructor keywords: the anchor's client and page size,
    and no sizes of its own (the followed pool's apply)."""
    for key in ("host_size_gib", "host_size_tokens", "host_to_device_ratio", "device_size",
                "page_size"):
        if kw.get(key):
            raise ValueError(f"{key} is the followed pool's ('{anchor_host.name}'); leave it "
                             f"unset")
        kw.pop(key, None)
    kw.setdefault("client", anchor_host.client)
    kw.setdefault("tensors", anchor_host._torch is not None)
    return dict(kw, page_size=anchor_host.page_size)


class MHATokenToKOnlyPoolHost(_Follower, HostKVCache):
    """sglang's MiniMax index-K host pool: a K row per token and layer, no V,
    on the slots of an MHA anchor (kind K_ONLY, following the anchor)."""

    _KIND = "K_ONLY"

    def __init__(self, name: str, anchor_host: HostKVCache, *, head_num: int, head_dim: int,
                 **kw: Any) -> None:
        self.anchor_host = anchor_host
        self.head_num, self.head_dim = int(head_num), int(head_dim)
        super().__init__(name, shape={"head_num": self.head_num, "head_dim": self.head_dim,
                                      "follows": anchor_host.name},
                         **_follower_args(anchor_host, kw))

    def page_shape(self) -> Tuple[int, ...]:
        ps, L, H, D = self.page_size, self.layer_num, self.head_num, self.head_dim
        return {"layer_first": (L, ps, H, D), "page_first": (ps, L, H, D),
                "page_first_direct": (1, L, ps, H, D)}[self.layout]

    def get_hybrid_pool_buffer(self) -> List[Any]:
        """[k]: the host buffer a storage backend registers."""
        return [self._component_buffer("k")]

    def _device_components(self, device_pool: Any) -> Dict[str, List[Any]]:
        return {"k": list(device_pool.k_buffer)}


_ASYMMETRIC_FLAT_PAGE = (
    "Models with head_dim != v_head_dim do not support the flat-page interface used by "
    "HiCache L3 storage backends {hf3fs, eic, nixl}. Use a backend that does not use this "
    "interface (e.g. mooncake, simm).")


class AsymmetricMHATokenToKVPoolHost(MHATokenToKVPoolHost):
    """sglang's host pool for MHA whose V head dim differs from K's (MiMo-V2):
    K and V in two buffers (kind MHA_ASYMMETRIC; page_first or
    page_first_direct). Like the seed, it has no flat page: get_data_page,
    set_from_flat_data_page, get_dummy_flat_data_page and
    get_split_heads_page_buffer_meta raise NotImplementedError; storage
    backends use get_page_buffer_meta (per page [k, v])."""

    _KIND = "MHA_ASYMMETRIC"

    def __init__(self, name: str, *, head_num: int, head_dim: int, v_head_dim: int,
                 **kw: Any) -> None:
        self.head_num, self.head_dim, self.v_head_dim = int(head_num), int(head_dim), \
            int(v_head_dim)
        HostKVCache.__init__(self, name, shape={"head_num": self.head_num,
                                                "head_dim": self.head_dim,
                                                "v_head_dim": self.v_head_dim}, **kw)

    def get_ksize_per_token(self) -> int:
        return self.head_dim * self.head_num * self.layer_num * ITEMSIZE[self.kv_dtype]

    def page_shape(self) -> Tuple[int, ...]:
        raise NotImplementedError(_ASYMMETRIC_FLAT_PAGE)

    def get_data_page(self, index: int, flat: bool = True) -> Any:
        raise NotImplementedError(_ASYMMETRIC_FLAT_PAGE)

    def get_dummy_flat_data_page(self) -> Any:
        raise NotImplementedError(_ASYMMETRIC_FLAT_PAGE)

    def set_from_flat_data_page(self, index: int, data_page: Any) -> None:
        raise NotImplementedError(_ASYMMETRIC_FLAT_PAGE)

    def get_split_heads_page_buffer_meta(self, indices: Any, split_factor: int) -> Any:
        raise NotImplementedError(
            "get_split_heads_page_buffer_meta requires layout='page_head', which is not "
            "supported for models with head_dim != v_head_dim")


def get_mha_host_pool_cls(device_pool: Any) -> type:
    """AsymmetricMHATokenToKVPoolHost when the device pool's head_dim and
    v_head_dim differ, else MHATokenToKVPoolHost (as the seed's)."""
    head_dim = getattr(device_pool, "head_dim", None)
    v_head_dim = getattr(device_pool, "v_head_dim", head_dim)
    if v_head_dim is not None and v_head_dim != head_dim:
        return AsymmetricMHATokenToKVPoolHost
    return MHATokenToKVPoolHost


class DSATokenToKVPoolHost(MLATokenToKVPoolHost):
    """tokenspeed's DSA host pool: the MLA latent rows plus the FP8 index-K
    block of each page and layer (kind DSA; layer_first only). Transfers
    move whole pages. The flat page is the latent block then the index-K
    block (the seed leaves the index-K out; kvhost keeps it, so a page
    stored through the flat page keeps its index), as uint8 bytes.

    ``index_k_row_bytes`` gives the index-K bytes per token, or
    ``index_head_dim`` with ``index_quant_block_size`` derive them.
    """

    _KIND = "DSA"
    _FLAT_BYTES = True

    def __init__(self, name: str, *, kv_lora_rank: int, qk_rope_head_dim: int,
                 index_k_row_bytes: int = 0, index_head_dim: int = 0,
                 index_quant_block_size: int = 0, quant_method: Optional[str] = None,
                 layout: str = "layer_first", **kw: Any) -> None:
        if quant_method == "per_token_head":
            raise NotImplementedError(
                "DSA KVStore does not support the per_token_head latent layout.")
        if layout != "layer_first":
            raise NotImplementedError(
                f"DSA KVStore supports only the layer_first host layout, got {layout}.")
        self.kv_lora_rank, self.qk_rope_head_dim = int(kv_lora_rank), int(qk_rope_head_dim)
        self.kv_cache_dim = self.kv_lora_rank + self.qk_rope_head_dim
        shape = {"kv_lora_rank": self.kv_lora_rank, "qk_rope_head_dim": self.qk_rope_head_dim}
        if index_k_row_bytes:
            shape["index_row_bytes"] = int(index_k_row_bytes)
        else:
            shape.update(index_head_dim=int(index_head_dim),
                         index_quant_block_size=int(index_quant_block_size))
        HostKVCache.__init__(self, name, layout=layout, shape=shape, **kw)
        index = next(c for c in self.info["components"] if c["name"] == "index_k")
        #: Index-K bytes per token (tokenspeed's index_k_row_bytes).
        self.index_k_row_bytes = int(index["row_bytes"]) // self.page_size

    def page_shape(self) -> Tuple[int, ...]:
        raise NotImplementedError(
            "a DSA page is two blocks (the latent (L, ps, 1, C), then index-K (L, ps * "
            "index_k_row_bytes) bytes); use get_data_page(flat=True)")

    def get_hybrid_pool_buffer(self) -> List[Any]:
        """[latent, index_k]: the host buffers a storage backend registers."""
        return [self._component_buffer("latent"), self._component_buffer("index_k")]

    def _device_components(self, device_pool: Any) -> Dict[str, List[Any]]:
        return {"latent": list(device_pool.kv_buffer),
                "index_k": list(device_pool.index_k_buffer)}


class DSAIndexerPoolHost(_Follower, HostKVCache):
    """sglang's DSA indexer host pool: per page and layer one block of
    page_size * (index_head_dim + index_head_dim / quant_block_size * 4)
    bytes (FP8 values, then fp32 scales), on the slots of an MLA or DSA
    anchor (kind DSA_INDEXER, following it). Whole pages only."""

    _KIND = "DSA_INDEXER"

    def __init__(self, name: str, anchor_host: HostKVCache, *, index_head_dim: int,
                 index_quant_block_size: int, dtype: Any = "uint8", **kw: Any) -> None:
        self.anchor_host = anchor_host
        self.index_head_dim = int(index_head_dim)
        self.indexer_quant_block_size = int(index_quant_block_size)
        self.indexer_size_per_token = (self.index_head_dim + self.index_head_dim //
                                       max(self.indexer_quant_block_size, 1) * 4)
        super().__init__(name, dtype=dtype,
                         shape={"index_head_dim": self.index_head_dim,
                                "index_quant_block_size": self.indexer_quant_block_size,
                                "follows": anchor_host.name},
                         **_follower_args(anchor_host, kw))
        #: Bytes of one page's block per layer (sglang's indexer_page_stride_size).
        self.indexer_page_stride_size = self.indexer_size_per_token * self.page_size

    def page_shape(self) -> Tuple[int, ...]:
        L, G = self.layer_num, self.indexer_page_stride_size
        return (L, 1, G) if self.layout == "layer_first" else (1, L, 1, G)

    def get_hybrid_pool_buffer(self) -> List[Any]:
        """[index_k]: the host buffer a storage backend registers."""
        return [self._component_buffer("index_k")]

    def _device_components(self, device_pool: Any) -> Dict[str, List[Any]]:
        return {"index_k": list(device_pool.index_k_with_scale_buffer)}


class MambaPoolHost(HostKVCache):
    """sglang's Mamba host pool: per request slot (page_size 1) and layer a
    temporal state and one or more conv states (kind MAMBA;
    page_first_direct only). The flat page is the temporal state's bytes,
    then each conv state's, as uint8.

    Args:
      num_mamba_layers: layers of state held.
      temporal_state_shape, conv_state_shapes: the per-slot, per-layer
        shapes (sglang's mamba_cache.temporal.shape[2:] and each
        conv.shape[2:]).
      conv_dtype, temporal_dtype: their element types (the pool's dtype is
        the conv one, as sglang's).
      Sizes and the rest as HostKVCache's.
    """

    _KIND = "MAMBA"
    _FLAT_BYTES = True

    def __init__(self, name: str, *, num_mamba_layers: int,
                 temporal_state_shape: Sequence[int], conv_state_shapes: Sequence[Sequence[int]],
                 conv_dtype: Any = "bfloat16", temporal_dtype: Any = "float32",
                 layout: str = "page_first_direct", **kw: Any) -> None:
        if layout != "page_first_direct":
            raise ValueError(f"MambaPoolHost only supports layout='page_first_direct', "
                             f"got '{layout}'.")
        if kw.pop("page_size", 1) != 1:
            raise ValueError("MambaPoolHost has page_size 1 (a slot per request)")
        self.num_mamba_layers = int(num_mamba_layers)
        self.temporal_state_shape = tuple(int(d) for d in temporal_state_shape)
        self.conv_state_shapes = [tuple(int(d) for d in s) for s in conv_state_shapes]
        self.conv_dtype, self.temporal_dtype = dtype_enum(conv_dtype), dtype_enum(temporal_dtype)
        self.temporal_state_elem_size = math.prod(self.temporal_state_shape)
        self.conv_state_elem_sizes = [math.prod(s) for s in self.conv_state_shapes]
        mamba = {"temporal": {"dims": list(self.temporal_state_shape)},
                 "temporal_dtype": self.temporal_dtype,
                 "conv": [{"dims": list(s)} for s in self.conv_state_shapes]}
        super().__init__(name, layout=layout, dtype=self.conv_dtype, page_size=1,
                         layer_num=self.num_mamba_layers, shape={"mamba": mamba}, **kw)

    def page_shape(self) -> Tuple[int, ...]:
        return (self.bytes_per_page,)  # sglang's page is flat bytes either way

    def get_hybrid_pool_buffer(self) -> List[Any]:
        """[temporal, conv0, ...]: the host buffers a storage backend registers."""
        return [self._component_buffer(c["name"]) for c in self.info["components"]]

    def _device_components(self, device_pool: Any) -> Dict[str, List[Any]]:
        cache = device_pool.mamba_cache
        layers = range(self.num_mamba_layers)
        out = {"temporal": [cache.temporal[i] for i in layers]}
        for j, conv in enumerate(cache.conv):
            out[f"conv{j}"] = [conv[i] for i in layers]
        return out


class LogicalHostPool(HostKVCache):
    """sglang's logical anchor pool for V4 HiCache: page-aligned token slots
    and no buffer (kind LOGICAL). Its transfers move nothing and return at
    once, as the seed's; its pages are empty (get_data_page still checks
    the index). ``size`` must be a multiple of ``page_size`` (the daemon's
    InvalidArgument otherwise). ``device_size``: the device token rows its
    indices name when it is a HostPoolGroup's anchor (default: ``size``)."""

    _KIND = "LOGICAL"

    def __init__(self, name: str, size: int, page_size: int, layout: str = "layer_first", *,
                 client: Optional[Client] = None, address: str = DEFAULT_ADDRESS,
                 tensors: Optional[bool] = None, device_size: int = 0) -> None:
        super().__init__(name, client=client, address=address, layout=layout, dtype="uint8",
                         page_size=page_size, layer_num=0, host_size_tokens=int(size),
                         tensors=tensors, shape={})
        self.kv_buffer = None
        self.start_layer = self.end_layer = 0
        self.device_size = int(device_size) or self.size

    def page_shape(self) -> Tuple[int, ...]:
        return (0,)

    def get_data_page(self, index: int, flat: bool = True) -> Any:
        """An empty page (the daemon checks that `index` is an allocated
        page's first slot)."""
        self.client.get_data_page(self.name, int(index))
        if self._torch is not None:
            return self._torch.empty(0, dtype=self._torch.uint8)
        return b""

    def get_page_buffer_meta(self, indices: Any) -> None:  # type: ignore[override]
        """None, as the seed's: there are no bytes to point at."""
        return None

    def is_stride_page_aligned(self, page_size_bytes: int = 4096) -> bool:
        return False

    def backup_from_device_all_layer(self, device_pool: Any, host_indices: Any,
                                     device_indices: Any, io_backend: Any = "kernel",
                                     **kw: Any) -> None:
        """Nothing to copy (the seed's pass)."""

    def load_to_device_per_layer(self, device_pool: Any, host_indices: Any,
                                 device_indices: Any, layer_id: int,
                                 io_backend: Any = "kernel", *, is_draft: bool = False) -> None:
        """Nothing to copy (the seed's pass)."""


def _has_transfer_indices(pool: HostKVCache, host_indices: Any, device_indices: Any) -> bool:
    """The V4 pools' rule: None or empty indices move nothing; lists of
    different lengths are a ValueError naming both."""
    if host_indices is None or device_indices is None:
        return False
    nh, nd = len(host_indices), len(device_indices)
    if nh != nd:
        raise ValueError(f"{pool.name} transfer index size mismatch: host={nh}, device={nd}")
    return nh > 0


class _V4Rows(HostKVCache):
    """What V4's paged and state pools share: one uint8 row per page and
    layer (R bytes), the seeds' shapes, None or empty transfers moving
    nothing."""

    _ROW = 0  # R, set by the subclass

    def page_shape(self) -> Tuple[int, ...]:
        L, R = self.layer_num, self._ROW
        return (L, 1, R) if self.layout == "page_first_direct" else (L, R)

    def get_size_per_token(self) -> int:
        return self._ROW  # the seeds': bytes of a page row per layer

    def get_ksize_per_token(self) -> int:
        return self._ROW

    def get_hybrid_pool_buffer(self) -> List[Any]:
        """The host buffers a storage backend registers: one per layer
        (layer_first, as the seeds' list of tensors) or the whole one."""
        buf = self._component_buffer("rows")
        if self.layout != "layer_first":
            return [buf]
        per = len(buf) // self.layer_num
        return [buf[i * per:(i + 1) * per] for i in range(self.layer_num)]

    def backup_from_device_all_layer(self, device_pool: Any, host_indices: Any,
                                     device_indices: Any, io_backend: Any = "kernel",
                                     **kw: Any) -> None:
        if _has_transfer_indices(self, host_indices, device_indices):
            super().backup_from_device_all_layer(device_pool, host_indices, device_indices,
                                                 io_backend, **kw)

    def load_to_device_per_layer(self, device_pool: Any, host_indices: Any,
                                 device_indices: Any, layer_id: int,
                                 io_backend: Any = "kernel", *, is_draft: bool = False) -> None:
        if _has_transfer_indices(self, host_indices, device_indices):
            super().load_to_device_per_layer(device_pool, host_indices, device_indices,
                                             layer_id, io_backend, is_draft=is_draft)

    def _device_components(self, device_pool: Any) -> Dict[str, List[Any]]:
        tensors = getattr(device_pool, "device_buffers", None)
        if tensors is None:
            tensors = getattr(device_pool, "device_page_views", device_pool)
        return {"rows": list(tensors)}


class DeepSeekV4PagedHostPool(_V4Rows):
    """sglang's host mirror of a DeepSeek-V4 paged sub-pool: one row of
    ``item_bytes`` per slot page and layer (kind V4_PAGED), layer_first,
    page_first or page_first_direct. ``alloc`` rounds up to whole slot pages,
    as the seed's; transfers move whole pages.

    The device pool of a transfer is the list of per-layer device tensors
    (the seed's ``device_buffers``), an object with ``device_buffers``, a
    kvhost.ShmDevicePool or an Attachment.
    """

    _KIND = "V4_PAGED"

    def __init__(self, name: str, *, layer_num: int, item_bytes: int, num_host_pages: int,
                 slot_page_size: int, layout: str = "layer_first", **kw: Any) -> None:
        self.pool_name = name
        self.item_bytes, self.num_host_pages = int(item_bytes), int(num_host_pages)
        self.slot_page_size = int(slot_page_size)
        self._ROW = self.item_bytes
        super().__init__(name, layout=layout, dtype="uint8", page_size=self.slot_page_size,
                         layer_num=layer_num,
                         host_size_tokens=self.num_host_pages * self.slot_page_size,
                         shape={"item_bytes": self.item_bytes}, **kw)

    def alloc(self, need_size: int) -> Any:
        """Whole slot pages: need_size rounded up, as the seed's."""
        ps = self.slot_page_size
        return super().alloc((int(need_size) + ps - 1) // ps * ps)

    def get_contiguous_buf_infos(self) -> Tuple[List[int], List[int], List[int]]:
        """(data_ptrs, data_lens, item_lens) per layer, for PD direct-to-host
        transfer: layer_first only (NotImplementedError otherwise: only it
        keeps a layer's rows together)."""
        if self.layout != "layer_first":
            raise NotImplementedError(
                f"get_contiguous_buf_infos needs layout layer_first; '{self.name}' is "
                f"{self.layout}, whose layers are not contiguous")
        # kvhostd's ranges (GetContiguousBufferInfos), one per layer of the
        # rows, at their addresses in this process's mapping of the regions.
        infos = self.client.contiguous_buffer_infos(self.name)
        rows = sorted((i for i in infos["infos"] if i["component"] == "rows"),
                      key=lambda i: int(i["layer"]))
        with self._lock:
            ptrs = [self._region_base(int(i["region_index"]), infos["region_paths"]) +
                    int(i["offset"]) for i in rows]
        return ptrs, [int(i["length"]) for i in rows], [int(i["item_bytes"]) for i in rows]


class DeepSeekV4StateHostPool(_Follower, _V4Rows):
    """sglang's host pool of DeepSeek-V4 compress-state rings: one row of
    ring_size * state_slot_bytes per page and layer (kind V4_STATE),
    following a V4 paged or logical pool whose slots it reuses. As the
    seed's, alloc, free and available_size raise NotImplementedError and
    clear does nothing."""

    _KIND = "V4_STATE"

    def __init__(self, name: str, anchor_host: HostKVCache, *, layer_num: int,
                 ring_size: int, state_slot_bytes: int, layout: str = "layer_first",
                 **kw: Any) -> None:
        self.anchor_host = anchor_host
        self.pool_name = name
        self.ring_size, self.state_slot_bytes = int(ring_size), int(state_slot_bytes)
        self.state_page_bytes = self._ROW = self.ring_size * self.state_slot_bytes
        self.swa_page_size = anchor_host.page_size
        super().__init__(name, layout=layout, dtype="uint8", layer_num=layer_num,
                         shape={"ring_size": self.ring_size,
                                "state_slot_bytes": self.state_slot_bytes,
                                "follows": anchor_host.name},
                         **_follower_args(anchor_host, kw))

    def _no_allocator(self, call: str) -> NotImplementedError:
        return NotImplementedError(
            f"{self.name} reuses SWA transfer indices and has no allocator ({call} in "
            f"'{self.anchor_host.name}')")

    def available_size(self) -> int:
        raise self._no_allocator("available_size")
