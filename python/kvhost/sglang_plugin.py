"""kvhost as an sglang plugin: sglang's default HiCache path builds kvhost pools.

Installed by ``pip install './python[sglang]'`` as the entry point ``kvhost``
of sglang's general-plugin group ``sglang.srt.plugins``; sglang runs
:func:`register` in each process when ``SGLANG_PLUGINS`` lists ``kvhost``
(or is unset). No sglang file is changed: register() hooks, through sglang's
own HookRegistry,
  - ``hybrid_pool_assembler.get_mha_host_pool_cls``: the MHA host pool class
    ``build_kv_host_pool`` constructs becomes :class:`MHATokenToKVPoolHost`
    here (sglang's constructor, a kvhostd pool behind it); sglang's own
    HostPoolGroup, HybridCacheController and L2TransferEngine drive it;
  - ``hybrid_pool_assembler.build_kv_host_pool``: a request kvhost cannot
    serve (MLA, page-interleaved pools, DCP, an io backend other than kernel
    or direct, a storage backend other than file) is refused there, at start-up, naming it;
and registers a stack strategy (``register_stack_strategy``) that refuses,
at start-up and by name, every stack but plain KV (SWA, Mamba, DSA,
MiniMax sparse, DeepSeek-V4).

Settings (environment, read at pool construction):
  KVHOST_ADDRESS      kvhostd's address (default kvhost.DEFAULT_ADDRESS)
  KVHOST_POOL_PREFIX  pool names are PREFIX-LABEL-dpD-tpT-ppP (default "sglang")
  KVHOST_SGLANG       "0" leaves sglang's own pools in place (plugin inert)
Sizes are sglang's: --hicache-size (GB) or --hicache-ratio, and the layout
--hicache-mem-layout. Supported sglang releases: SUPPORTED_SGLANG.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Sequence

from . import sglang as _pools
from .client import DEFAULT_ADDRESS
from .shm import ShmDevicePool
from .transfer import Attachment

#: --hicache-storage-backend values that work on kvhost pools: none; the file
#: backend (it copies pages through get_data_page / set_from_flat_data_page);
#: and hf3fs, whose zero-copy path reads and writes through
#: get_data_page(flat=False) views, which are views of kvhostd's pages mapped
#: from descriptors (tests/python_sglang_engine_test.py drives sglang's own
#: hf3fs backend over a kvhost pool). The others (mooncake, nixl, ...) register
#: the host buffer with their own transfer engines or read it on their own
#: threads, untested on kvhost pools: refused, since a wrong assumption there
#: would leave stale KV without an error.
STORAGE_BACKENDS = (None, "", "file", "hf3fs")

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


class MHATokenToKVPoolHost(_pools.MHATokenToKVPoolHost):
    """sglang's MHA host pool, constructed as build_kv_host_pool does, over
    a kvhostd pool. Refuses (ValueError naming it) what kvhost cannot serve:
    K and V widths that differ, KV scales, more than one head group."""

    def __init__(self, buffer_info: Any, host_to_device_ratio: float, host_size: float,
                 page_size: int, layout: str, pin_memory: bool = True, device: str = "cpu",
                 allocator_type: str = "default", *, device_capacity_tokens: int,
                 start_layer: int, end_layer: int, draft_buffer_infos: Sequence[Any] = (),
                 write_back_staging: Any = None, pool_label: str = "kv",
                 head_group_num: int = 1, host_token_capacity: Optional[int] = None) -> None:
        info = buffer_info
        refused = []
        if info.v_head_dim != info.head_dim:
            refused.append(f"V width {info.v_head_dim} != K width {info.head_dim} "
                           f"(asymmetric MHA)")
        if info.scales is not None or any(d.scales is not None for d in draft_buffer_infos):
            refused.append("KV scale buffers (MXFP8)")
        if int(head_group_num) != 1:
            refused.append(f"head_group_num {head_group_num}")
        if allocator_type not in ("default", None):
            refused.append(f"allocator_type {allocator_type!r}")
        if refused:
            raise ValueError(f"kvhost plugin: pool {pool_label!r}: kvhost cannot serve "
                             f"{'; '.join(refused)}")
        infos = (info, *draft_buffer_infos)
        self._device_k = [b for i in infos for b in i.buffers.k]
        self._device_v = [b for i in infos for b in i.buffers.v]
        # sglang's sizing: a fixed capacity, else GB, else the ratio.
        super().__init__(
            pool_name(pool_label), address=os.environ.get("KVHOST_ADDRESS", DEFAULT_ADDRESS),
            layout=layout, dtype=info.dtype, page_size=page_size,
            layer_num=len(self._device_k), head_num=info.head_num, head_dim=info.head_dim,
            host_size=0.0 if host_token_capacity else float(host_size or 0),
            host_size_tokens=int(host_token_capacity or 0),
            host_to_device_ratio=float(host_to_device_ratio or 0),
            device_size=int(device_capacity_tokens), tensors=True,
            start_layer=start_layer, end_layer=end_layer,
            target_layer_num=len(info.buffers.k), pool_label=pool_label)
        self.v_head_dim = info.v_head_dim
        self.device_capacity_tokens = int(device_capacity_tokens)
        self.head_group_num = 1

    _OWN_DEVICE = True  # the buffer_info's tensors: mapping attaches them

    def get_hybrid_pool_buffer(self) -> List[Any]:
        """The components' host buffers (uint8 views of kvhostd's pages)."""
        return list(self.kv_buffer)

    def _attachment(self, device_pool: Any) -> Attachment:
        # The device tensors are the buffer_info's, whatever device_pool is.
        return super()._attachment(self)

    def _attach_tensors(self, device_pool: Any) -> Attachment:
        tensors = self._device_k + self._device_v
        if tensors and not tensors[0].is_cuda:
            return self._attach_shm_of(tensors)
        return self.client.attach_tensors(self.name, components={"k": self._device_k,
                                                                 "v": self._device_v},
                                          layer_progress=True)

    def _attach_shm_of(self, tensors: List[Any]) -> Attachment:
        """The registered ShmDevicePool whose layer buffers `tensors` are."""
        want = [t.data_ptr() for t in tensors]
        for shm in _SHM_POOLS:
            if shm.closed or shm.pool != self.name:
                continue
            have = [shm.layer_address(c, layer) for c in ("k", "v")
                    for layer in range(shm.layers)]
            if have == want:
                return self.client.attach_shm(self.name, shm, layer_progress=True)
        raise ValueError(f"kvhost pool '{self.name}': its device tensors are on the CPU and "
                         f"lie in no registered ShmDevicePool (host backend: "
                         f"kvhost.sglang_plugin.register_shm_device_pool)")


def _refuse_unsupported(original: Any, *args: Any, **kwargs: Any) -> Any:
    """build_kv_host_pool, refusing at start-up what kvhost cannot serve."""
    if not enabled():
        return original(*args, **kwargs)
    import importlib  # noqa: PLC0415
    asm = importlib.import_module(_ASSEMBLER)
    kv_pool = kwargs.get("kv_pool")
    use_mla = kwargs.get("use_mla")
    if use_mla is None and kv_pool is not None:
        use_mla = asm.is_mla_pool(kv_pool)
    refused = []
    if use_mla:
        refused.append("MLA host pools")
    if isinstance(kv_pool, asm.PageInterleaveKVPoolMixin):
        refused.append("page-interleaved device pools")
    if asm.get_parallel().dcp_enabled:
        refused.append("decode context parallelism (DCP)")
    io_backend = getattr(asm.get_memory(), "hicache_io_backend", None)
    if io_backend not in (None, *_pools.IO_BACKENDS):
        refused.append(f"--hicache-io-backend {io_backend} (kvhostd's copy engine serves "
                       f"{' and '.join(_pools.IO_BACKENDS)})")
    backend = getattr(asm.get_memory(), "hicache_storage_backend", None)
    if backend not in STORAGE_BACKENDS:
        refused.append(f"--hicache-storage-backend {backend} (kvhost pools serve "
                       f"{', '.join(b for b in STORAGE_BACKENDS if b)}; {backend} registers "
                       f"or reads the host buffer its own way, untested on kvhost pools)")
    if refused:
        raise RuntimeError(f"kvhost plugin: sglang asked for {', '.join(refused)}, which the "
                           f"kvhost plugin does not build yet (docs/SGLANG.md); set "
                           f"KVHOST_SGLANG=0 to use sglang's own host pools")
    return original(*args, **kwargs)


def _mha_host_pool_cls(original: Any, buffer_info: Any) -> type:
    if not enabled():
        return original(buffer_info)
    return MHATokenToKVPoolHost


def _refusing_strategy() -> Any:
    import importlib  # noqa: PLC0415
    asm = importlib.import_module(_ASSEMBLER)

    class RefuseUnsupportedStacks(asm.StackStrategy):
        """Matches every stack but plain KV and refuses it by name."""

        def matches(self, kvcache: Any, components: Any) -> bool:
            if not enabled() or asm._PlainKvStrategy().matches(kvcache, components):
                return False
            names = ", ".join(sorted(getattr(c, "name", str(c)) for c in components))
            raise RuntimeError(f"kvhost plugin: sglang asked for a HiCache stack of "
                               f"{type(kvcache).__name__} with components [{names}]; kvhost "
                               f"builds plain KV (MHA) stacks only (docs/SGLANG.md); set "
                               f"KVHOST_SGLANG=0 to use sglang's own host pools")

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
        # pools; failing where the host pool is built stops the start-up.
        def refuse(original: Any, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(str(e))
        HookRegistry.register(f"{_ASSEMBLER}.build_kv_host_pool", refuse, HookType.AROUND)
        raise
    HookRegistry.register(f"{_ASSEMBLER}.get_mha_host_pool_cls", _mha_host_pool_cls,
                          HookType.AROUND)
    HookRegistry.register(f"{_ASSEMBLER}.build_kv_host_pool", _refuse_unsupported,
                          HookType.AROUND)
    import importlib  # noqa: PLC0415
    importlib.import_module(_ASSEMBLER).register_stack_strategy(_refusing_strategy())
