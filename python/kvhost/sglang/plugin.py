"""kvhost as an sglang plugin: sglang's default HiCache path builds kvhost pools.

Installed by ``pip install './python[sglang]'`` as the entry point ``kvhost``
of sglang's general-plugin group ``sglang.srt.plugins``; sglang runs
:func:`register` in each process when ``SGLANG_PLUGINS`` lists ``kvhost``
(or is unset). No sglang file is changed: register()
  - hooks, through sglang's own HookRegistry,
    ``hybrid_pool_assembler.get_mha_host_pool_cls``: the MHA host pool class
    ``build_kv_host_pool`` constructs becomes :class:`MHATokenToKVPoolHost`
    here, or :class:`AsymmetricMHATokenToKVPoolHost` where V's width is not
    K's (sglang's constructor, a kvhostd pool behind it);
  - binds the assembler's own names ``MLATokenToKVPoolHost`` (the class
    ``build_kv_host_pool(use_mla=True)`` and the full-draft builder
    construct), ``MHATokenToKOnlyPoolHost`` (MiniMax sparse's index-K
    pool) and ``MambaPoolHost`` (``build_mamba_host_pool``'s) to the
    classes of those names here; only that module's names,
    since HookRegistry's class REPLACE would rebind sglang's classes in
    every module, and every isinstance check on them;
  - hooks ``hybrid_pool_assembler.build_kv_host_pool``: a request kvhost
    cannot serve (page-interleaved pools, DCP, an io backend other than
    kernel or direct, a storage backend but file, hf3fs or kvhost's node
    cache through sglang's dynamic backend) is refused there,
    at start-up, naming it;
  - hooks ``pool_host.dsa.DSAIndexerHostPoolBuilder.build`` (what the
    DSA strategy, and Mamba stacks over a DSA pool, build a declared DSA
    indexer with): :class:`DSAIndexerPoolHost` here, following the MLA pool;
  - hooks ``hybrid_pool_assembler._uses_unified_page_envelope_host`` to
    answer False: a full + SWA stack gets two kvhost pools (sglang's own
    path where the storage backend has no page envelope), not sglang's
    shared envelope arena;
  - registers a stack strategy (``register_stack_strategy``) that refuses,
    at start-up and by name, every stack but plain KV, full + SWA, KV +
    Mamba, KV + SWA + Mamba, DSA (+ indexer) (their declared side pools
    being DSA indexers only; not QSA's indexer), and MiniMax sparse (KV +
    index-K; not its NVFP4 variant, whose host pools are its own):
    DeepSeek-V4, QSA and other side pools are not built yet.
sglang's own HostPoolGroup, HybridCacheController and L2TransferEngine drive
the pools, packed MTP draft layers included. What a pool's constructor
refuses (ValueError naming it, before any kvhostd pool is made) is in each
class's docstring.

Settings (environment, read at pool construction; KVHOST_SGLANG also at
register()):
  KVHOST_ADDRESS      kvhostd's address (default kvhost.DEFAULT_ADDRESS)
  KVHOST_POOL_PREFIX  pool names are PREFIX-LABEL-dpD-tpT-ppP (default "sglang")
  KVHOST_SGLANG       "0" leaves sglang's own pools in place (plugin inert)
Sizes are sglang's: --hicache-size (GB) or --hicache-ratio, and the layout
--hicache-mem-layout. Supported sglang releases: SUPPORTED_SGLANG.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, cast

from ..client import DEFAULT_ADDRESS
from ..shm import ShmDevicePool
from ..transfer import Attachment
from . import kinds as _kinds
from .host_pool import HostKVCache
from .spec import GIB, IO_BACKENDS

#: --hicache-storage-backend values that work on kvhost pools: none; the file
#: backend (it copies pages through get_data_page / set_from_flat_data_page);
#: and hf3fs, whose zero-copy path reads and writes through
#: get_data_page(flat=False) views, which are views of kvhostd's pages mapped
#: from descriptors (tests/python_sglang_engine_test.py drives sglang's own
#: hf3fs backend over a kvhost pool). The others (mooncake, nixl, ...) register
#: the host buffer with their own transfer engines or read it on their own
#: threads, untested on kvhost pools: refused, since a wrong assumption there
#: would leave stale KV without an error. sglang's "dynamic" backend is served
#: when its extra config names kvhost's own (KVHOST_STORAGE_MODULE: the node
#: cache, kvhost/sglang/storage_backend.py), refused naming any other module.
STORAGE_BACKENDS = (None, "", "file", "hf3fs")
KVHOST_STORAGE_MODULE = "kvhost.sglang.storage_backend"
#: sglang's allocator_type is its storage backend's name; these give the
#: host pool an allocator of the backend's own (registered with its transfer
#: engine or in shared memory: sglang's get_allocator_from_storage), which a
#: kvhost pool cannot be. Every other name is sglang's default allocator.
_OWN_ALLOCATORS = ("mooncake", "mori", "shm", "tensorcast")

#: sglang releases whose host-pool contract kvhost was checked against
#: (tests/python_sglang_contract_test.py); register() refuses others.
SUPPORTED_SGLANG = ("0.5.23",)

_ASSEMBLER = "sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler"

# Host-backend device pools (ShmDevicePool) whose memory a CPU tensor may
# view: a kvhostd on --backend=host has no CUDA tensors, so a pool built from
# CPU tensors attaches the ShmDevicePool they lie in.
_SHM_POOLS: List[ShmDevicePool] = []


def register_shm_device_pool(pool: ShmDevicePool) -> None:
    """Lets pools built from CPU tensors over `pool`'s buffers attach it."""
    _SHM_POOLS.append(pool)


def enabled() -> bool:
    return os.environ.get("KVHOST_SGLANG", "1") != "0"


def check_release(version: str) -> None:
    """RuntimeError naming `version` unless it is in SUPPORTED_SGLANG."""
    if version not in SUPPORTED_SGLANG:
        raise RuntimeError(f"kvhost plugin: sglang {version} is not supported (supported: "
                           f"{', '.join(SUPPORTED_SGLANG)}); set KVHOST_SGLANG=0 or "
                           f"SGLANG_PLUGINS without kvhost to run sglang's own host pools")


def _ranks() -> Dict[str, int]:
    """This process's dp / tp / pp ranks from sglang's runtime context (0
    where it has none: a process outside sglang's launcher)."""
    try:
        from sglang.srt.runtime_context import get_parallel  # noqa: PLC0415
        par = get_parallel()
    except ImportError:
        return {"dp": 0, "tp": 0, "pp": 0}
    ranks = {}
    for key, field in (("dp", "attn_dp_rank"), ("tp", "tp_rank"), ("pp", "pp_rank")):
        try:
            ranks[key] = int(getattr(par, field) or 0)
        except (RuntimeError, ValueError, AttributeError):
            ranks[key] = 0
    return ranks


def pool_name(label: str) -> str:
    """This rank's pool name for sglang's pool_label (one pool per rank)."""
    r = _ranks()
    prefix = os.environ.get("KVHOST_POOL_PREFIX", "sglang")
    return f"{prefix}-{label}-dp{r['dp']}-tp{r['tp']}-pp{r['pp']}"


#: sglang's pool_label of the sidecar pools it addresses with another pool's
#: host slots (a separate draft model's KV: build_full_draft_pools,
#: build_swa_draft_pools, build_hybrid_swa_group's full-index SWA drafts).
#: A kvhostd pool transfers only slots its own allocator (or, for a
#: follower kind, the followed pool's) handed out, and MHA / MLA pools
#: follow none, so these are refused at construction.
SIDECAR_LABELS = ("draft", "draft_swa")


def _refuse(pool_label: str, refused: List[str]) -> None:
    """ValueError naming everything in `refused` (nothing: returns); a
    sidecar pool_label (SIDECAR_LABELS) is refused too."""
    if pool_label in SIDECAR_LABELS:
        refused = [f"a draft sidecar pool ({pool_label!r}) addressed by another pool's host "
                   f"slots (kvhost MHA and MLA pools allocate their own)", *refused]
    if refused:
        raise ValueError(f"kvhost plugin: pool {pool_label!r}: kvhost cannot serve "
                         f"{'; '.join(refused)}")


def _sizes(host_to_device_ratio: float, host_size: float, host_token_capacity: Optional[int],
           device_capacity_tokens: int) -> Dict[str, Any]:
    """HostKVCache's size arguments from sglang's: a fixed capacity, else
    sglang's ``host_size`` (``--hicache-size``: decimal GB, 10**9 bytes, as
    sglang's own pools read it) converted to GiB, else the ratio (sglang's
    order)."""
    gib = 0.0 if host_token_capacity else float(host_size or 0) * 1e9 / GIB
    return dict(host_size_gib=gib,
                host_size_tokens=int(host_token_capacity or 0),
                host_to_device_ratio=float(host_to_device_ratio or 0),
                device_size=int(device_capacity_tokens))


# Type-checked as the HostKVCache it is mixed into; a plain mixin at run time.
if TYPE_CHECKING:
    _Mixin = HostKVCache
else:
    _Mixin = object


class _CapturedDevicePool(_Mixin):
    """What the plugin's pools share: sglang's host pools capture the device
    tensors of their buffer infos (the target's, then each packed MTP draft's
    layers) at construction, so a pool attaches those, once, whatever device
    pool a transfer names; and loads the draft layers (past
    target_layer_num) on the calls sglang's controller makes for them."""

    #: Pool.components name -> per-layer device tensors (drafts last).
    _device: Dict[str, List[Any]]

    _OWN_DEVICE = True  # the buffer_info's tensors: mapping attaches them

    def get_hybrid_pool_buffer(self) -> List[Any]:
        """The components' host buffers (uint8 views of kvhostd's pages)."""
        return list(self.kv_buffer)

    def _attachment(self, device_pool: Any) -> Attachment:
        # The device tensors are the buffer infos', whatever device_pool is
        # (a packed draft's device pool included).
        return super()._attachment(self)

    def _attach_tensors(self, device_pool: Any) -> Attachment:
        tensors = [t for layers in self._device.values() for t in layers]
        if tensors and not tensors[0].is_cuda:
            return self._attach_shm_of(tensors)
        return self.client.attach_tensors(self.name, components=self._device,
                                          layer_progress=True,
                                          load_event_sets=self._LOAD_EVENT_SETS)

    def _attach_shm_of(self, tensors: List[Any]) -> Attachment:
        """The registered ShmDevicePool whose layer buffers `tensors` are."""
        want = [t.data_ptr() for t in tensors]
        for shm in _SHM_POOLS:
            if shm.closed or shm.pool != self.name:
                continue
            have = [shm.layer_address(c, layer) for c in self._device
                    for layer in range(shm.layers)]
            if have == want:
                return self.client.attach_shm(self.name, shm, layer_progress=True,
                                              load_event_sets=self._LOAD_EVENT_SETS)
        raise ValueError(f"kvhost pool '{self.name}': its device tensors are on the CPU and "
                         f"lie in no registered ShmDevicePool (host backend: "
                         f"kvhost.sglang.plugin.register_shm_device_pool)")

    def load_to_device_per_layer(self, device_pool: Any, host_indices: Any,
                                 device_indices: Any, layer_id: int,
                                 io_backend: Any = "kernel", *, is_draft: bool = False) -> None:
        """HostKVCache's, with packed MTP draft layers in sglang's order: the
        controller loads draft d (is_draft, layer target_layer_num + d) right
        after target layer min(d, target_layer_num - 1). Layer 0's load moves
        every layer, drafts included; the last target layer ends it, and a
        draft layer's call waits for its layer of the load (or returns, the
        load being done)."""
        layer, target = int(layer_id), self.target_layer_num
        if self.layer_num == target or (not is_draft and layer < target - 1):
            return super().load_to_device_per_layer(device_pool, host_indices, device_indices,
                                                    layer_id, io_backend, is_draft=is_draft)
        if not is_draft and layer != target - 1:
            return  # sglang's rule: layers past the target's only with is_draft
        self._check_io_backend(io_backend)
        if is_draft and not target <= layer < self.layer_num:
            raise ValueError(f"kvhost pool '{self.name}': draft layer {layer} outside "
                             f"[{target}, {self.layer_num})")
        att = self._attachment(self)
        # The last target layer ends the load (waiting for its draft layers
        # too); a draft layer after it finds the load ended and returns.
        self._transfers.load_layer(att, self._cuda_stream(att), layer, host_indices,
                                   device_indices, layers=self._transfer_layers(att),
                                   what=f"pool '{self.name}'", torch=self._torch,
                                   ends=not is_draft, missing_ok=is_draft)


def _allocator_refusals(allocator_type: Optional[str]) -> List[str]:
    """An allocator of a storage backend's own (_OWN_ALLOCATORS), refused."""
    if allocator_type in _OWN_ALLOCATORS:
        return [f"allocator_type {allocator_type!r}"]
    return []


def _storage_refusals(memory: Any) -> List[str]:
    """A storage backend kvhost pools do not serve (STORAGE_BACKENDS)."""
    backend = getattr(memory, "hicache_storage_backend", None)
    if backend in STORAGE_BACKENDS:
        return []
    if backend == "dynamic":
        module = _dynamic_module(getattr(memory, "hicache_storage_backend_extra_config", None))
        if module == KVHOST_STORAGE_MODULE:
            return []
        return [f"--hicache-storage-backend dynamic with module_path {module!r} (kvhost pools "
                f"serve {KVHOST_STORAGE_MODULE!r}, kvhost's node cache)"]
    return [f"--hicache-storage-backend {backend} (kvhost pools serve "
            f"{', '.join(b for b in STORAGE_BACKENDS if b)} and dynamic with "
            f"{KVHOST_STORAGE_MODULE}; {backend} registers or reads the host buffer its own "
            f"way, untested on kvhost pools)"]


def _dynamic_module(extra_config: Optional[str]) -> Any:
    """The module_path of sglang's --hicache-storage-backend-extra-config
    (JSON, or @file as sglang's own parser reads it); None without one."""
    if not extra_config:
        return None
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (  # noqa: PLC0415
        HybridCacheController)
    config = HybridCacheController.parse_storage_backend_extra_config(extra_config)[0]
    return config.get("module_path")


def _mha_refusals(infos: Sequence[Any], head_group_num: int,
                  allocator_type: Optional[str]) -> List[str]:
    """What an MHA (or asymmetric MHA) request asks that kvhost lacks."""
    refused = []
    if any(i.scales is not None for i in infos):
        refused.append("KV scale buffers (MXFP8)")
    if any(i.transfer_buffers is not None for i in infos):
        refused.append("relocatable device buffers (MHABufferInfo.transfer_buffers)")
    if int(head_group_num) != 1:
        refused.append(f"head_group_num {head_group_num}")
    refused += _allocator_refusals(allocator_type)
    for d, draft in enumerate(infos[1:]):
        row = (draft.head_num, draft.head_dim, draft.v_head_dim, draft.dtype)
        want = (infos[0].head_num, infos[0].head_dim, infos[0].v_head_dim, infos[0].dtype)
        if row != want:
            refused.append(f"draft[{d}] KV row {row} != the target's {want}")
    return refused


class MHATokenToKVPoolHost(_CapturedDevicePool, _kinds.MHATokenToKVPoolHost):
    """sglang's MHA host pool, constructed as build_kv_host_pool does, over
    a kvhostd pool, packed MTP draft layers after the target's. Refuses
    (ValueError naming it) what kvhost cannot serve: KV scales (MXFP8), more
    than one head group, relocatable device buffers, another allocator, a
    draft row unlike the target's. K and V widths that differ are
    :class:`AsymmetricMHATokenToKVPoolHost`'s (get_mha_host_pool_cls)."""

    def __init__(self, buffer_info: Any, host_to_device_ratio: float, host_size: float,
                 page_size: int, layout: str, pin_memory: bool = True, device: str = "cpu",
                 allocator_type: str = "default", *, device_capacity_tokens: int,
                 start_layer: int, end_layer: int, draft_buffer_infos: Sequence[Any] = (),
                 write_back_staging: Any = None, pool_label: str = "kv",
                 head_group_num: int = 1, host_token_capacity: Optional[int] = None) -> None:
        info = buffer_info
        infos = (info, *draft_buffer_infos)
        for i in infos:
            i.validate()  # sglang's own check of the buffer info
        refused = _mha_refusals(infos, head_group_num, allocator_type)
        if info.v_head_dim != info.head_dim and not self._ASYMMETRIC:
            refused.append(f"V width {info.v_head_dim} != K width {info.head_dim} in "
                           f"{type(self).__name__} (get_mha_host_pool_cls picks "
                           f"AsymmetricMHATokenToKVPoolHost)")
        _refuse(pool_label, refused)
        self._device = {"k": [b for i in infos for b in i.buffers.k],
                        "v": [b for i in infos for b in i.buffers.v]}
        shape = {"head_num": info.head_num, "head_dim": info.head_dim}
        if self._ASYMMETRIC:
            shape["v_head_dim"] = info.v_head_dim
        super().__init__(
            pool_name(pool_label), address=os.environ.get("KVHOST_ADDRESS", DEFAULT_ADDRESS),
            layout=layout, dtype=info.dtype, page_size=page_size,
            layer_num=len(self._device["k"]), tensors=True, start_layer=start_layer,
            end_layer=end_layer, target_layer_num=len(info.buffers.k), pool_label=pool_label,
            **shape, **_sizes(host_to_device_ratio, host_size, host_token_capacity,
                              device_capacity_tokens))
        self.v_head_dim = info.v_head_dim
        self.device_capacity_tokens = int(device_capacity_tokens)
        self.head_group_num = 1

    _ASYMMETRIC = False


class AsymmetricMHATokenToKVPoolHost(MHATokenToKVPoolHost,
                                     _kinds.AsymmetricMHATokenToKVPoolHost):
    """sglang's host pool for MHA whose V width differs from K's (MiMo-V2),
    with sglang's (MHA's) constructor: kvhost's MHA_ASYMMETRIC pool, K and V
    in two buffers; page_first or page_first_direct (kvhostd refuses another
    layout at construction, naming it). Like sglang's, it has no flat page."""

    _ASYMMETRIC = True


class MHATokenToKOnlyPoolHost(_CapturedDevicePool, _kinds.MHATokenToKOnlyPoolHost):
    """sglang's MiniMax sparse index-K host pool, constructed as
    build_minimax_sparse_hicache_stack does: kvhost's K_ONLY pool (named for
    the anchor's label + "-index-k") following the anchor's slots, which
    must be a kvhost pool. Refuses (ValueError naming it) another anchor
    and another allocator."""

    def __init__(self, device_pool: Any, anchor_host: Any, layout: str,
                 pin_memory: bool = True, device: str = "cpu",
                 allocator_type: str = "default") -> None:
        label = f"{getattr(anchor_host, 'pool_label', 'kv')}-index-k"
        refused = []
        if not isinstance(anchor_host, HostKVCache):
            refused.append(f"an index-K pool following {type(anchor_host).__name__} (not a "
                           f"kvhost pool)")
        refused += _allocator_refusals(allocator_type)
        _refuse(label, refused)
        self._device = {"k": list(device_pool.k_buffer)}
        super().__init__(pool_name(label), anchor_host, head_num=device_pool.head_num,
                         head_dim=device_pool.head_dim, layout=layout,
                         dtype=device_pool.store_dtype, layer_num=device_pool.layer_num,
                         start_layer=device_pool.start_layer, end_layer=device_pool.end_layer,
                         pool_label=label)
        self.device_pool = device_pool
        #: sglang's bytes of one token's K row in one layer.
        self.token_stride_size = self.head_num * self.head_dim * self.dtype.itemsize


class MambaPoolHost(_CapturedDevicePool, _kinds.MambaPoolHost):
    """sglang's Mamba state host pool, constructed as build_mamba_host_pool
    does: kvhost's MAMBA pool (label "mamba"), a slot per request, the
    temporal and conv states of each layer, packed MTP draft layers after
    the target's. sglang's page_first and page_first_direct are one byte
    layout at page size 1 (kvhostd's PAGE_FIRST_DIRECT). Refuses (ValueError
    naming it) another layout, side-state checkpoint buffers
    (extra_checkpoint_buffers), another allocator, a draft unlike the
    target."""

    def __init__(self, buffer_info: Any, host_to_device_ratio: float, host_size: float, *,
                 device_capacity: int, pin_memory: bool = True, device: str = "cpu",
                 allocator_type: str = "default", layout: str = "layer_first",
                 mtp_draft_buffer_infos: Sequence[Any] = ()) -> None:
        info = buffer_info
        infos = (info, *mtp_draft_buffer_infos)
        for i in infos:
            i.validate()  # sglang's own check of the buffer info
        refused = []
        if layout not in ("page_first", "page_first_direct"):
            refused.append(f"layout {layout} for Mamba state (page_first or "
                           f"page_first_direct)")
        if any(i.extra_checkpoint_buffers for i in infos):
            refused.append("Mamba side-state checkpoint buffers (extra_checkpoint_buffers)")
        refused += _allocator_refusals(allocator_type)
        for d, draft in enumerate(mtp_draft_buffer_infos):
            row = [(t.shape[1:], t.dtype) for t in (*draft.conv, draft.temporal)]
            want = [(t.shape[1:], t.dtype) for t in (*info.conv, info.temporal)]
            if draft.temporal.shape[0] != 1 or row != want:
                refused.append(f"draft[{d}] Mamba state {row} in {draft.temporal.shape[0]} "
                               f"layers (the target's is {want}, one layer per draft)")
        _refuse("mamba", refused)
        self._device = {"temporal": [t for i in infos for t in i.temporal.unbind(0)]}
        for j in range(len(info.conv)):
            self._device[f"conv{j}"] = [t for i in infos for t in i.conv[j].unbind(0)]
        super().__init__(
            pool_name("mamba"), address=os.environ.get("KVHOST_ADDRESS", DEFAULT_ADDRESS),
            num_mamba_layers=len(self._device["temporal"]),
            temporal_state_shape=info.temporal.shape[2:],
            conv_state_shapes=[c.shape[2:] for c in info.conv], conv_dtype=info.conv[0].dtype,
            temporal_dtype=info.temporal.dtype, layout="page_first_direct", tensors=True,
            target_layer_num=info.temporal.shape[0], pool_label="mamba",
            **_sizes(host_to_device_ratio, host_size, None, device_capacity))
        self.layout = layout
        self.buffer_info = info
        self.mtp_draft_buffer_infos = tuple(mtp_draft_buffer_infos)


class DSAIndexerPoolHost(_CapturedDevicePool, _kinds.DSAIndexerPoolHost):
    """sglang's DSA indexer host pool, constructed as its builder
    (DSAIndexerHostPoolBuilder.build) does: kvhost's DSA_INDEXER pool
    (labelled the anchor's label + "-" + the pool name) following the MLA
    anchor's slots. Host layers are the device layers that own index keys
    (decl.owned_device_layers), then one per packed MTP draft; transfers
    take sglang's device layer ids. Refuses (ValueError naming it) the
    allocator-only pool (is_dummy), an anchor that is not a kvhost pool, an
    index page other than the KV page (index_kpool), layer sharding,
    another allocator."""

    def __init__(self, decl: Any, anchor_host: Any, *,
                 packed_draft_device_pools: Sequence[Any] = (), pin_memory: bool = True,
                 device: str = "cpu", allocator_type: str = "default",
                 is_dummy: bool = False) -> None:
        pool = decl.device_pool
        label = f"{getattr(anchor_host, 'pool_label', 'kv')}-{decl.pool_name.value}"
        refused = []
        if is_dummy:
            refused.append("allocator-only DSA indexer pools (is_dummy)")
        if not isinstance(anchor_host, HostKVCache):
            refused.append(f"an indexer following {type(anchor_host).__name__} (not a kvhost "
                           f"pool)")
        if getattr(pool, "layer_shard_enabled", False):
            refused.append("layer-sharded DSA pools")
        if pool.index_page_size != pool.page_size:
            refused.append(f"index pages of {pool.index_page_size} tokens on "
                           f"{pool.page_size}-token KV pages (index_kpool)")
        refused += _allocator_refusals(allocator_type)
        _refuse(label, refused)
        owned = decl.owned_device_layers
        live = [layer for layer in range(pool.layer_num) if owned is None or layer in owned]
        self._device_to_host_layer = {layer: i for i, layer in enumerate(live)}
        self._device_layer_num = pool.layer_num
        self._device = {"index_k": [pool.index_k_with_scale_buffer[layer] for layer in live] +
                        [b for d in packed_draft_device_pools
                         for b in d.index_k_with_scale_buffer]}
        super().__init__(pool_name(label), anchor_host, index_head_dim=pool.index_head_dim,
                         index_quant_block_size=pool.quant_block_size,
                         layout=anchor_host.layout, layer_num=len(self._device["index_k"]),
                         start_layer=pool.start_layer, end_layer=pool.end_layer,
                         target_layer_num=len(live), pool_label=label)
        self.decl, self.device_pool = decl, pool
        self.mtp_draft_device_pools = tuple(packed_draft_device_pools)

    def load_to_device_per_layer(self, device_pool: Any, host_indices: Any,
                                 device_indices: Any, layer_id: int,
                                 io_backend: Any = "kernel", *, is_draft: bool = False) -> None:
        """sglang's device layer id: an owned layer's host layer, a draft's
        (device layer device_layer_num + d) after the target's; a layer
        without index keys does nothing, as in sglang."""
        layer = int(layer_id)
        if is_draft:
            host = self.target_layer_num + layer - self._device_layer_num
        elif layer in self._device_to_host_layer:
            host = self._device_to_host_layer[layer]
        else:
            return
        super().load_to_device_per_layer(device_pool, host_indices, device_indices, host,
                                         io_backend, is_draft=is_draft)


def _dsa_indexer_builder(original: Any, builder: Any, *, decl: Any, anchor_host: Any,
                         allocator_type: str, packed_draft_device_pools: Any) -> Any:
    """DSAIndexerHostPoolBuilder.build: the plugin's DSAIndexerPoolHost."""
    if not enabled():
        return original(builder, decl=decl, anchor_host=anchor_host,
                        allocator_type=allocator_type,
                        packed_draft_device_pools=packed_draft_device_pools)
    return DSAIndexerPoolHost(decl, anchor_host, allocator_type=allocator_type,
                              packed_draft_device_pools=packed_draft_device_pools)


class MLATokenToKVPoolHost(_CapturedDevicePool, _kinds.MLATokenToKVPoolHost):
    """sglang's MLA host pool (DeepSeek), constructed as build_kv_host_pool
    does, over a kvhostd pool: one latent row per token and layer, packed
    MTP draft layers after the target's. Refuses (ValueError naming it)
    what kvhost cannot serve: the allocator-only pool (MLAHostAllocation),
    native split buffers and layout page_first_kv_split (Ascend), FP4 block
    scales, layer sharding, decode context parallelism, a row wider than
    kv_lora_rank + qk_rope_head_dim (packed FP8 DSA rows), another
    allocator, a draft row unlike the target's."""

    def __init__(self, buffer_info: Any, host_to_device_ratio: float, host_size: float,
                 page_size: int, layout: str, pin_memory: bool = True, device: str = "cpu",
                 allocator_type: str = "default", override_kv_cache_dim: Optional[int] = None,
                 draft_buffer_infos: Sequence[Any] = (), dcp_size: int = 1, dcp_rank: int = 0,
                 *, device_capacity_tokens: int, start_layer: int, end_layer: int,
                 target_layer_num: int, layer_shard_enabled: bool = False,
                 pool_label: str = "kv", host_token_capacity: Optional[int] = None) -> None:
        info = buffer_info
        _refuse(pool_label, _mla_refusals(info, layout, allocator_type, override_kv_cache_dim,
                                          draft_buffer_infos, dcp_size, target_layer_num,
                                          layer_shard_enabled))
        self._device = {"latent": [*info.buffers, *(b for d in draft_buffer_infos
                                                    for b in d.buffers)]}
        super().__init__(
            pool_name(pool_label), address=os.environ.get("KVHOST_ADDRESS", DEFAULT_ADDRESS),
            layout=layout, dtype=info.dtype, page_size=page_size,
            layer_num=len(self._device["latent"]), kv_lora_rank=info.kv_lora_rank,
            qk_rope_head_dim=info.qk_rope_head_dim, tensors=True, start_layer=start_layer,
            end_layer=end_layer, target_layer_num=target_layer_num, pool_label=pool_label,
            **_sizes(host_to_device_ratio, host_size, host_token_capacity,
                     device_capacity_tokens))
        self.override_kv_cache_dim = override_kv_cache_dim
        self.dsa_kv_cache_store_fp8 = False
        self.device_capacity_tokens = int(device_capacity_tokens)


def _mla_refusals(info: Any, layout: str, allocator_type: Optional[str],
                  override_kv_cache_dim: Optional[int], drafts: Sequence[Any], dcp_size: int,
                  target_layer_num: int, layer_shard_enabled: bool) -> List[str]:
    """What an MLA request asks that kvhost lacks (sglang's own checks of
    the buffer infos first: ValueError in sglang's words)."""
    if not hasattr(info, "buffers"):
        return ["allocator-only MLA host pools (MLAHostAllocation: HiSparse, non-source "
                "ranks)"]
    refused = []
    if layout == "page_first_kv_split":
        refused.append("layout page_first_kv_split (Ascend's split K/V host buffers)")
    if not isinstance(info.buffers, tuple):
        refused.append("native split MLA buffers (MLASplitBuffers)")
        return refused
    for i in (info, *drafts):
        i.validate()
    if int(dcp_size) != 1:
        refused.append(f"decode context parallelism (dcp_size {dcp_size})")
    if layer_shard_enabled or tuple(info.layer_indices) != tuple(range(info.device_layer_num)) \
            or int(target_layer_num) != len(info.buffers):
        refused.append(f"layer-sharded MLA pools (layers {tuple(info.layer_indices)} of "
                       f"{info.device_layer_num}, target_layer_num {target_layer_num})")
    width = info.kv_lora_rank + info.qk_rope_head_dim
    if (override_kv_cache_dim or width) != width or info.kv_cache_dim != width \
            or info.packed_fp8:
        refused.append(f"MLA rows of {override_kv_cache_dim or info.kv_cache_dim} elements, not "
                       f"kv_lora_rank + qk_rope_head_dim = {width} (packed FP8 DSA rows)")
    if any(i.scales is not None for i in (info, *drafts)):
        refused.append("FP4 KV block scales")
    refused += _allocator_refusals(allocator_type)
    for d, draft in enumerate(drafts):
        if (draft.kv_cache_dim, draft.dtype) != (info.kv_cache_dim, info.dtype) or \
                not isinstance(draft.buffers, tuple) or len(draft.buffers) != 1:
            refused.append(f"draft[{d}] row {(draft.kv_cache_dim, draft.dtype)} in "
                           f"{len(draft.buffers)} layers (the target's is "
                           f"{(info.kv_cache_dim, info.dtype)} in one layer per draft)")
    return refused


def _refuse_unsupported(original: Any, *args: Any, **kwargs: Any) -> Any:
    """build_kv_host_pool, refusing at start-up what kvhost cannot serve."""
    if not enabled():
        return original(*args, **kwargs)
    import importlib  # noqa: PLC0415
    asm: Any = importlib.import_module(_ASSEMBLER)
    kv_pool = kwargs.get("kv_pool")
    refused = []
    if isinstance(kv_pool, asm.PageInterleaveKVPoolMixin):
        refused.append("page-interleaved device pools")
    if asm.get_parallel().dcp_enabled:
        refused.append("decode context parallelism (DCP)")
    io_backend = getattr(asm.get_memory(), "hicache_io_backend", None)
    if io_backend not in (None, *IO_BACKENDS):
        refused.append(f"--hicache-io-backend {io_backend} (kvhostd's copy engine serves "
                       f"{' and '.join(IO_BACKENDS)})")
    refused += _storage_refusals(asm.get_memory())
    if refused:
        raise RuntimeError(f"kvhost plugin: sglang asked for {', '.join(refused)}, which the "
                           f"kvhost plugin does not build yet (docs/SGLANG.md); set "
                           f"KVHOST_SGLANG=0 to use sglang's own host pools")
    return original(*args, **kwargs)


def _mha_host_pool_cls(original: Any, buffer_info: Any) -> type:
    if not enabled():
        return cast(type, original(buffer_info))
    if buffer_info.v_head_dim != buffer_info.head_dim:
        return AsymmetricMHATokenToKVPoolHost
    return MHATokenToKVPoolHost


def _separate_swa_pools(original: Any, *args: Any, **kwargs: Any) -> bool:
    """_uses_unified_page_envelope_host: False while the plugin is on, so a
    full + SWA stack gets a kvhost pool each (sglang's own path for storage
    backends without page envelopes) instead of sglang's shared arena."""
    return False if enabled() else original(*args, **kwargs)


def _refusing_strategy() -> Any:
    import importlib  # noqa: PLC0415
    asm: Any = importlib.import_module(_ASSEMBLER)

    def refusal(kvcache: Any, components: Any) -> Optional[str]:
        """Why the plugin does not build this stack's host pools; None
        where sglang's strategy for it builds kvhost pools only."""
        if asm._PlainKvStrategy().matches(kvcache, components) or \
                asm._SwaStrategy().matches(kvcache, components):
            return None
        if asm._MambaStrategy().matches(kvcache, components) or \
                asm._MambaSwaStrategy().matches(kvcache, components) or \
                asm._DsaStrategy().matches(kvcache, components):
            # Declared side pools: the DSA indexer's builder is hooked; any
            # other, or QSA's indexer, would be sglang's own host pool.
            from sglang.srt.mem_cache.pool_host.dsa import (  # noqa: PLC0415
                DSAIndexerHostPoolBuilder)
            from sglang.srt.mem_cache.qsa_kv_pool import QSATokenToKVPool  # noqa: PLC0415
            if isinstance(kvcache, QSATokenToKVPool):
                return "QSA's indexer host pool (QSAIndexerPoolHost) would be sglang's own"
            decls = kvcache.host_pool_decls() if hasattr(kvcache, "host_pool_decls") else ()
            other = [d.pool_name.value for d in decls if not d.is_layout_root and
                     not isinstance(d.host_pool_builder, DSAIndexerHostPoolBuilder)]
            return f"declared side pools {other} would be sglang's own" if other else None
        if asm._MiniMaxSparseStrategy().matches(kvcache, components):
            from sglang.srt.mem_cache.minimax_m3_nvfp4_pool import (  # noqa: PLC0415
                MiniMaxM3Nvfp4KVPool)
            if isinstance(kvcache, MiniMaxM3Nvfp4KVPool):
                return "MiniMax M3.1 NVFP4 builds its own host pool classes"
            return None
        if asm._DeepSeekV4Strategy().matches(kvcache, components):
            return ("DeepSeek-V4's compressed, indexer and rope pools are addressed by its "
                    "logical anchor's host slots, and kvhostd's V4_PAGED pools cannot follow "
                    "another pool")
        return "no kvhost host pools for this stack"

    class RefuseUnsupportedStacks(asm.StackStrategy):  # type: ignore[misc]  # untyped sglang
        """Matches every stack the plugin does not build and refuses it by name."""

        def matches(self, kvcache: Any, components: Any) -> bool:
            why = refusal(kvcache, components) if enabled() else None
            if why is None:
                return False
            names = ", ".join(sorted(getattr(c, "name", str(c)) for c in components))
            raise RuntimeError(f"kvhost plugin: sglang asked for a HiCache stack of "
                               f"{type(kvcache).__name__} with components [{names}]: {why}. "
                               f"kvhost builds plain KV (MHA, asymmetric MHA, MLA), full + "
                               f"SWA, KV + Mamba (+ SWA), DSA + indexer and MiniMax sparse "
                               f"KV + index-K stacks (docs/SGLANG.md); set KVHOST_SGLANG=0 to "
                               f"use sglang's own host pools")

    return RefuseUnsupportedStacks()


def register() -> None:
    """sglang's general-plugin entry point (SGLANG_PLUGINS=kvhost)."""
    if not enabled():
        return
    import sglang  # noqa: PLC0415
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType  # noqa: PLC0415
    try:
        check_release(sglang.__version__)
    except RuntimeError as e:
        # sglang's loader logs a plugin's exception and goes on with its own
        # pools; failing where the host pool is built stops the start-up. The
        # message is kept: `e` is unbound once this block ends.
        message = str(e)

        def refuse(original: Any, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(message)
        HookRegistry.register(f"{_ASSEMBLER}.build_kv_host_pool", refuse, HookType.AROUND)
        raise
    HookRegistry.register(f"{_ASSEMBLER}.get_mha_host_pool_cls", _mha_host_pool_cls,
                          HookType.AROUND)
    HookRegistry.register(f"{_ASSEMBLER}.build_kv_host_pool", _refuse_unsupported,
                          HookType.AROUND)
    HookRegistry.register(f"{_ASSEMBLER}._uses_unified_page_envelope_host",
                          _separate_swa_pools, HookType.AROUND)
    HookRegistry.register("sglang.srt.mem_cache.pool_host.dsa.DSAIndexerHostPoolBuilder.build",
                          _dsa_indexer_builder, HookType.AROUND)
    import importlib  # noqa: PLC0415
    asm: Any = importlib.import_module(_ASSEMBLER)
    # The assembler's own name only: HookRegistry's class REPLACE would
    # rebind sglang's class in every module, and its isinstance checks with it.
    asm.MLATokenToKVPoolHost = MLATokenToKVPoolHost
    asm.MHATokenToKOnlyPoolHost = MHATokenToKOnlyPoolHost
    asm.MambaPoolHost = MambaPoolHost
    asm.register_stack_strategy(_refusing_strategy())
