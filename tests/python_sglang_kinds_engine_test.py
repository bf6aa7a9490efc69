#!/usr/bin/env python3
"""sglang's default HiCache path building kvhost pools of more kinds.

Runs in the engine venv (tests/engine_env.py: the pinned sglang and torch)
against a fresh kvhostd --backend=host, with the kvhost plugin installed
and loaded as python_sglang_engine_test.py does (SGLANG_PLUGINS=kvhost,
sglang's own loader). For each kind, sglang's own build_kv_only_group
(build_kv_host_pool, with_packed_draft_layer_mapping, HostPoolGroup)
builds the host pool group, with one packed MTP draft layer, and sglang's
own HybridCacheController drives it (write / start_writing, load /
start_loading, evict_host; its L2TransferEngine interleaves the draft's
layer with the target's): the device rows come back byte for byte into
other rows, target and draft layers:
  mla   DeepSeek's MLA pool (plugin MLATokenToKVPoolHost); and refused at
        construction, by name, creating no pool: layout page_first_kv_split,
        layer sharding, packed FP8 DSA rows (a wider kv_cache_dim), the
        allocator-only MLAHostAllocation, decode context parallelism, a
        draft sidecar addressed by the target's slots;
  asym  MHA with V narrower than K (get_mha_host_pool_cls ->
        plugin AsymmetricMHATokenToKVPoolHost), no flat page as sglang's;
        and layout layer_first refused at construction, by name;
  minimax  MiniMax sparse KV + index-K (plugin MHATokenToKOnlyPoolHost, a
        K_ONLY pool following the KV pool): sglang's own
        build_minimax_sparse_hicache_stack builds both and the controller
        it returns moves both; the NVFP4 variant refused by name;
  swa   full + SWA layers: sglang's own build_hybrid_swa_stack builds a
        kvhost pool for each (not sglang's shared envelope arena, which
        the plugin turns down) and the controller it returns moves both;
  mamba KV + Mamba state: sglang's own build_hybrid_mamba_stack builds the
        KV pool and, through build_mamba_host_pool, a kvhost MAMBA pool
        (plugin MambaPoolHost) with a packed MTP draft layer; the
        controller it returns moves both; a Mamba stack declaring a side
        pool kvhost does not build refused by name;
  dsa   DSA + indexer: sglang's own DSA strategy builds the MLA pool and,
        through the indexer declaration's builder, a kvhost DSA_INDEXER
        pool following it (plugin DSAIndexerPoolHost; a shared-topk layer
        without index keys skipped), a packed MTP draft for both; the
        controller it builds moves both.
The project's own stand-ins, for what needs a GPU or a running scheduler:
the device pool objects (per-layer CPU tensors over a kvhost ShmDevicePool,
with the members sglang's builder and controller read), the device token
allocator (hands out rows, records nothing), sglang's runtime-context
memory settings (hicache ratio, size, layout); no process groups (no
storage backend, so the controller makes none).
  usage: python_sglang_kinds_engine_test.py KVHOSTD LIBKVHOST_C SOURCE_DIR
"""
import functools
import os
import shutil
import sys
import threading
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import engine_env  # noqa: E402

PS, LAYERS, DEVICE_TOKENS = 4, 3, 64
LORA, ROPE = 12, 4  # MLA row: 16 bf16 elements
HEADS, K_DIM, V_DIM = 2, 8, 4  # asymmetric MHA


class Env:
    """What every case uses: torch, kvhost, sglang's modules, the daemon."""

    def __init__(self, daemon):
        import torch  # noqa: PLC0415
        import kvhost  # noqa: PLC0415
        from kvhost.sglang import plugin as sglang_plugin  # noqa: PLC0415
        from sglang.srt.mem_cache import device_pool_info, l2_transfer  # noqa: PLC0415
        from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler  # noqa: PLC0415
        from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (  # noqa
            HybridCacheController)
        self.torch, self.kvhost, self.plugin = torch, kvhost, sglang_plugin
        self.dpi, self.l2, self.asm = device_pool_info, l2_transfer, hybrid_pool_assembler
        self.controller_cls = HybridCacheController
        self.daemon = daemon
        self.worker = kvhost.Client(daemon.address)
        self.memory = types.SimpleNamespace(hicache_ratio=2.0, hicache_size=0,
                                            hicache_mem_layout="page_first",
                                            hicache_storage_backend=None,
                                            hicache_io_backend="kernel",
                                            hicache_write_policy="write_through")
        from sglang.srt.mem_cache.pool_host import common  # noqa: PLC0415
        self.asm.get_memory = common.get_memory = lambda: self.memory

    def device_memory(self, prefix, spec, label="kv", dtype="BF16"):
        """The pool (made as the scheduler would, the plugin adopting it) and
        its ShmDevicePool: the stand-in device buffers."""
        os.environ["KVHOST_POOL_PREFIX"] = prefix
        name = self.plugin.pool_name(label)
        sizes = {} if "follows" in spec else {"page_size": PS, "size_tokens": 2 * DEVICE_TOKENS}
        with self.kvhost.Client(self.daemon.address, session=False) as sched:
            sched.create_pool(name, dict(spec, dtype=dtype, **sizes))
        shm = self.worker.shm_device_pool(name, DEVICE_TOKENS)
        self.plugin.register_shm_device_pool(shm)
        return name, shm

    def tensors(self, shm, comp, width):
        torch = self.torch
        return [torch.frombuffer(shm.layer_view(comp, layer), dtype=torch.bfloat16).view(
            DEVICE_TOKENS, -1, width) for layer in range(shm.layers)]

    def build_group(self, dev, draft, use_mla):
        with self.asm.get_parallel().override(dcp_enabled=False):  # sglang's own API
            return self.asm.build_kv_only_group(
                page_size=PS, kv_pool=dev, full_layer_mapping={i: i for i in range(LAYERS)},
                use_mla=use_mla, mtp_draft_device_pools=(draft,))

    def refused(self, prefix, words, build, label="kv"):
        """build() raises naming `words`, and no pool of that name is made."""
        os.environ["KVHOST_POOL_PREFIX"] = prefix
        name = self.plugin.pool_name(label)
        try:
            with self.asm.get_parallel().override(dcp_enabled=False):
                build()
        except (ValueError, RuntimeError, self.kvhost.KvhostError) as e:
            assert all(w in str(e) for w in words), (words, str(e))
        else:
            raise AssertionError(f"{words} not refused")
        names = [p["name"] for p in self.worker.list_pools()]
        assert name not in names, f"a refused request left pool {name}"

    def drive(self, group, device_tensors, ctl=None, extra_pools=lambda written: None):
        """A write and a load through sglang's HybridCacheController (its
        write / start_writing, load / start_loading: L2TransferEngine, the
        packed draft's layer interleaved with the target's); every device
        layer (the draft's too) comes back byte for byte. extra_pools(None)
        is the write's PoolTransfer list, extra_pools(that list) the load's."""
        torch = self.torch
        host, dev = group.anchor_entry.host_pool, group.anchor_entry.device_pool
        if ctl is None:
            ctl = self.controller_cls(DeviceAllocator(torch, dev), group, PS, None,
                                      threading.Event(), io_backend="kernel",
                                      transfer_layer_id_max=LAYERS)
        rows = torch.arange(8, 16, dtype=torch.int64)
        # A (tensor, tokens per row) pair: rows of whole pages (an indexer's).
        unit = [t[1] if isinstance(t, tuple) else 1 for t in device_tensors]
        device_tensors = [t[0] if isinstance(t, tuple) else t for t in device_tensors]
        gen = torch.Generator().manual_seed(11)
        for t in device_tensors:
            t.copy_(torch.randn(t.shape, generator=gen).to(torch.bfloat16))
        want = [t[8 // u:16 // u].clone() for t, u in zip(device_tensors, unit)]
        free0 = group.available_size()
        write_extra = extra_pools(None)
        slots = ctl.write(rows, extra_pools=write_extra)
        assert slots is not None and len(slots) == 8 and group.available_size() == free0 - 8
        for t in device_tensors:
            t.zero_()
        loaded = ctl.load(slots, extra_pools=extra_pools(write_extra))
        ctl.start_loading()
        assert torch.equal(loaded, torch.arange(16, 24)), loaded
        got = [t[16 // u:24 // u] for t, u in zip(device_tensors, unit)]
        bad = [i for i, (a, b) in enumerate(zip(got, want)) if not torch.equal(a, b)]
        assert not bad, f"{type(host).__name__}: device layers {bad} differ after the load"
        assert ctl.evict_host(slots) == 8 and group.available_size() == free0
        return ctl


class DeviceAllocator:
    """Stand-in for sglang's device token allocator: rows from 16 up."""

    def __init__(self, torch, kvcache):
        self.torch, self.kvcache, self.next = torch, kvcache, 16

    def get_kvcache(self):
        return self.kvcache

    def alloc(self, n):
        rows = self.torch.arange(self.next, self.next + n, dtype=self.torch.int64)
        self.next += n
        return rows

    def free(self, rows):
        pass

    def set_hicache_transfer_done_event(self, key, event):
        pass


class MLADevicePool:
    """Stand-in for sglang's MLATokenToKVPool: what build_kv_host_pool and
    check_packed_kv_rows read of it, over the given per-layer tensors."""

    def __init__(self, env, tensors):
        torch = env.torch
        n = len(tensors)
        self.kv_buffer = tensors
        self.size, self.host_capacity_tokens, self.hicache_write_back_staging = \
            DEVICE_TOKENS, None, None
        self.start_layer, self.end_layer, self.layer_num = 0, n, n
        self.layer_shard_enabled, self.layer_shard_size = False, 1
        self.kv_cache_dim, self.store_dtype, self.device = LORA + ROPE, torch.bfloat16, "cpu"
        self.info = env.dpi.MLABufferInfo(
            buffers=tuple(tensors), data_ptrs=None, layer_indices=tuple(range(n)),
            device_layer_num=n, page_size=PS, kv_lora_rank=LORA, qk_rope_head_dim=ROPE,
            kv_cache_dim=LORA + ROPE, dtype=torch.bfloat16, device=torch.device("cpu"))

    def get_device_pool_infos(self):
        return [types.SimpleNamespace(buffer_info=self.info)]

    def register_layer_transfer_counter(self, counter):
        self.layer_transfer_counter = counter


class MHADevicePool:
    """Stand-in for sglang's MHATokenToKVPool (K and V widths may differ)."""

    def __init__(self, env, k, v, v_dim=V_DIM):
        torch, dpi = env.torch, env.dpi
        n = len(k)
        self.k_buffer, self.v_buffer = k, v
        self.size, self.host_capacity_tokens, self.hicache_write_back_staging = \
            DEVICE_TOKENS, None, None
        self.start_layer, self.end_layer, self.layer_num = 0, n, n
        self.head_num, self.head_dim, self.v_head_dim = HEADS, K_DIM, v_dim
        self.store_dtype, self.device = torch.bfloat16, "cpu"
        buffers = dpi.KVBuffers(k=tuple(k), v=tuple(v), k_data_ptrs=None, v_data_ptrs=None,
                                layout=dpi.KVBufferLayout.NHD)
        self.info = dpi.MHABufferInfo(buffers=buffers, page_size=PS, head_num=HEADS,
                                      head_dim=K_DIM, v_head_dim=v_dim, dtype=torch.bfloat16,
                                      device=torch.device("cpu"))

    def get_device_pool_infos(self):
        return [types.SimpleNamespace(buffer_info=self.info)]

    def register_layer_transfer_counter(self, counter):
        self.layer_transfer_counter = counter


def check_mla(env):
    torch = env.torch
    name, shm = env.device_memory("mla", {"kind": "MLA", "layout": "PAGE_FIRST",
                                          "layer_num": LAYERS + 1, "kv_lora_rank": LORA,
                                          "qk_rope_head_dim": ROPE})
    latent = env.tensors(shm, "latent", LORA + ROPE)
    dev, draft = MLADevicePool(env, latent[:LAYERS]), MLADevicePool(env, latent[LAYERS:])
    group = env.build_group(dev, draft, use_mla=True)
    host = group.anchor_entry.host_pool
    assert isinstance(host, env.plugin.MLATokenToKVPoolHost) and host.name == name, host
    assert (host.layer_num, host.target_layer_num, host.kv_cache_dim) == \
        (LAYERS + 1, LAYERS, LORA + ROPE), (host.layer_num, host.target_layer_num)
    env.drive(group, latent)
    slot = int(group.alloc(PS)[0])  # the page view is sglang's (ps, L, 1, C)
    page = host.get_data_page(slot, flat=False)
    assert tuple(page.shape) == (PS, LAYERS + 1, 1, LORA + ROPE), page.shape
    group.free(torch.arange(slot, slot + PS))
    print("ok   mla: build_kv_only_group builds a kvhost MLA pool with a packed MTP draft; "
          "HybridCacheController writes and loads it byte for byte, the draft's layer too")

    def with_info(pool, **changes):
        fake = types.SimpleNamespace(**{k: getattr(pool, k) for k in vars(pool)})
        fake.__dict__.update(changes)
        fake.get_device_pool_infos = pool.get_device_pool_infos
        return fake

    build = functools.partial(env.asm.build_kv_host_pool, page_size=PS, use_mla=True)
    env.memory.hicache_mem_layout = "page_first_kv_split"
    env.refused("mla-split", ["layout page_first_kv_split"], lambda: build(kv_pool=dev))
    env.memory.hicache_mem_layout = "page_first"
    sharded = with_info(dev, layer_shard_enabled=True, layer_shard_size=2)
    env.refused("mla-shard", ["layer-sharded MLA pools"], lambda: build(kv_pool=sharded))
    env.refused("mla-fp8", ["MLA rows of 24 elements", "packed FP8 DSA rows"],
                lambda: build(kv_pool=dev, override_kv_cache_dim=LORA + ROPE + 8))
    from sglang.srt.mem_cache.pool_host.mla import MLAHostAllocation  # noqa: PLC0415
    dummy = MLAHostAllocation(dtype=torch.bfloat16, kv_lora_rank=LORA, qk_rope_head_dim=ROPE,
                              kv_cache_dim=LORA + ROPE, size_per_token=(LORA + ROPE) * 2)
    env.refused("mla-dummy", ["allocator-only MLA host pools"], lambda: env.plugin.
                MLATokenToKVPoolHost(dummy, 2.0, 0, PS, "page_first", device_capacity_tokens=64,
                                     start_layer=0, end_layer=LAYERS, target_layer_num=LAYERS))
    env.refused("mla-dcp", ["decode context parallelism (dcp_size 2)"], lambda: env.plugin.
                MLATokenToKVPoolHost(dev.info, 2.0, 0, PS, "page_first", dcp_size=2,
                                     dcp_rank=1, device_capacity_tokens=64, start_layer=0,
                                     end_layer=LAYERS, target_layer_num=LAYERS))
    env.refused("mla-sidecar", ["draft sidecar pool ('draft')"], lambda: env.asm.
                _build_mha_mla_host_pool(pool=dev, host_to_device_ratio=2.0, page_size=PS,
                                         layout="page_first", allocator_type="default",
                                         pool_label="draft", host_token_capacity=128))
    print("ok   mla: page_first_kv_split, layer sharding, packed FP8 DSA rows, "
          "MLAHostAllocation, DCP and a draft sidecar (build_full_draft_pools' "
          "_build_mha_mla_host_pool) refused at construction by name, no pool made")
    group.anchor_entry.host_pool.destroy()
    shm.close()


def check_asymmetric(env):
    name, shm = env.device_memory("asym", {"kind": "MHA_ASYMMETRIC", "layout": "PAGE_FIRST",
                                           "layer_num": LAYERS + 1, "head_num": HEADS,
                                           "head_dim": K_DIM, "v_head_dim": V_DIM})
    k, v = env.tensors(shm, "k", K_DIM), env.tensors(shm, "v", V_DIM)
    dev = MHADevicePool(env, k[:LAYERS], v[:LAYERS])
    draft = MHADevicePool(env, k[LAYERS:], v[LAYERS:])
    assert env.asm.get_mha_host_pool_cls(dev.info) is env.plugin.AsymmetricMHATokenToKVPoolHost
    group = env.build_group(dev, draft, use_mla=False)
    host = group.anchor_entry.host_pool
    assert isinstance(host, env.plugin.AsymmetricMHATokenToKVPoolHost), type(host)
    assert (host.head_dim, host.v_head_dim, host.layer_num) == (K_DIM, V_DIM, LAYERS + 1)
    env.drive(group, k + v)
    try:
        host.get_data_page(0)
        raise AssertionError("an asymmetric pool gave a flat page")
    except NotImplementedError as e:
        assert "head_dim != v_head_dim" in str(e), e
    print("ok   asym: get_mha_host_pool_cls and build_kv_only_group build a kvhost "
          "MHA_ASYMMETRIC pool with a packed MTP draft; byte for byte, no flat page")
    env.memory.hicache_mem_layout = "layer_first"
    env.refused("asym-lf", ["LAYER_FIRST", "head_dim != v_head_dim"],
                lambda: env.asm.build_kv_host_pool(kv_pool=dev, page_size=PS, use_mla=False))
    env.memory.hicache_mem_layout = "page_first"
    print("ok   asym: layout layer_first refused at construction by name, no pool made")
    host.destroy()
    shm.close()


def check_minimax(env):
    """MiniMax sparse: sglang's build_minimax_sparse_hicache_stack builds the
    KV pool and the index-K pool following it (index K on layers 0 and 2),
    and the controller it builds moves both (the index-K transfer takes the
    KV pool's slots, as the MiniMax strategy's sidecar spec says)."""
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer  # noqa
    _, shm = env.device_memory("mm", {"kind": "MHA", "layout": "PAGE_FIRST", "head_num": HEADS,
                                      "layer_num": LAYERS, "head_dim": K_DIM})
    anchor = env.plugin.pool_name("kv")
    _, ishm = env.device_memory("mm", {"kind": "K_ONLY", "layout": "PAGE_FIRST",
                                       "layer_num": 2, "head_num": HEADS, "head_dim": K_DIM,
                                       "follows": anchor}, label="kv-index-k")
    k, v, index_k = (env.tensors(shm, "k", K_DIM), env.tensors(shm, "v", K_DIM),
                     env.tensors(ishm, "k", K_DIM))
    main_pool = MHADevicePool(env, k, v, v_dim=K_DIM)
    index_pool = types.SimpleNamespace(k_buffer=index_k, head_num=HEADS, head_dim=K_DIM,
                                       layer_num=2, store_dtype=env.torch.bfloat16,
                                       start_layer=0, end_layer=2, device="cpu")
    sparse = types.SimpleNamespace(main_pool=main_pool, index_k_pool=index_pool,
                                   index_kv_pool=None, index_k_layer_id_mapping={0: 0, 2: 1})
    params = types.SimpleNamespace(
        pp_size=1, page_size=PS, token_to_kv_pool_allocator=DeviceAllocator(env.torch,
                                                                            main_pool),
        tp_cache_group=None, attn_cp_cache_group=None, attn_tp_cache_group=None,
        pp_cache_group=None, sidecar_draft_device_pools=())
    with env.asm.get_parallel().override(dcp_enabled=False):
        group, ctl = env.asm.build_minimax_sparse_hicache_stack(
            params=params, sparse_pool=sparse, load_cache_event=threading.Event(),
            storage_backend=None)
    host, index_host = group.get_pool(PoolName.KV), group.get_pool(PoolName.INDEXER)
    assert isinstance(host, env.plugin.MHATokenToKVPoolHost), type(host)
    assert isinstance(index_host, env.plugin.MHATokenToKOnlyPoolHost), type(index_host)
    assert index_host.info["spec"].get("follows") == host.name, index_host.info["spec"]
    env.drive(group, k + v + index_k, ctl=ctl, extra_pools=lambda written: [
        PoolTransfer(name=PoolName.INDEXER, indices_from_pool=PoolName.KV)])
    from sglang.srt.mem_cache.memory_pool import MiniMaxSparseKVPool  # noqa: PLC0415
    from sglang.srt.mem_cache.minimax_m3_nvfp4_pool import MiniMaxM3Nvfp4KVPool  # noqa
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType  # noqa
    full = {ComponentType.FULL}  # types to match on; never used
    strategy = env.asm._select_strategy(object.__new__(MiniMaxSparseKVPool), full)
    assert type(strategy).__name__ == "_MiniMaxSparseStrategy", strategy
    env.refused("mm-nvfp4", ["MiniMaxM3Nvfp4KVPool", "its own host pool classes"],
                lambda: env.asm._select_strategy(object.__new__(MiniMaxM3Nvfp4KVPool), full))
    print("ok   minimax: build_minimax_sparse_hicache_stack builds a kvhost KV pool and the "
          "K_ONLY index-K pool following it; its controller moves both byte for byte; "
          "the NVFP4 variant refused by name")
    index_host.destroy()
    host.destroy()
    ishm.close()
    shm.close()


def check_swa(env):
    """Full + SWA: sglang's build_hybrid_swa_stack builds a kvhost pool for
    each (full layers 1 and 3, SWA layers 0 and 2 of 4) and the controller
    it returns moves both, the SWA rows on their own host slots."""
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer  # noqa
    pools = {}
    for label in ("full", "swa"):
        pools[label] = env.device_memory("swa", {
            "kind": "MHA", "layout": "PAGE_FIRST", "head_num": HEADS, "layer_num": 2,
            "head_dim": K_DIM}, label=label)[1]
    tensors = {label: (env.tensors(shm, "k", K_DIM), env.tensors(shm, "v", K_DIM))
               for label, shm in pools.items()}
    full, swa = (MHADevicePool(env, *tensors[label], v_dim=K_DIM) for label in ("full", "swa"))
    kvcache = types.SimpleNamespace(device="cpu", layer_num=4,
                                    register_layer_transfer_counter=lambda counter: None)
    allocator = DeviceAllocator(env.torch, kvcache)
    allocator.swa_attn_allocator = DeviceAllocator(env.torch, swa)
    params = types.SimpleNamespace(
        page_size=PS, token_to_kv_pool_allocator=allocator, mtp_draft_device_pools=(),
        tp_cache_group=None, attn_cp_cache_group=None, attn_tp_cache_group=None,
        pp_cache_group=None)
    env.memory.hicache_host_memory_mode = "cache"
    from sglang.srt.mem_cache.unified_memory_pool import UnifiedMHATokenToKVPool  # noqa

    class Arena(UnifiedMHATokenToKVPool):  # a type to match on; never used
        def __init__(self, direction):  # noqa: PLW0231 (sglang's needs a GPU arena)
            self.direction = direction

        grow_direction = property(lambda self: self.direction)

    arena = Arena("up"), Arena("down")
    # sglang's answer would be True (a shared envelope arena): the plugin's is False.
    assert env.asm._uses_unified_page_envelope_host(*arena, False) is False
    with env.asm.get_parallel().override(dcp_enabled=False):
        group, ctl = env.asm.build_hybrid_swa_stack(
            params=params, full_kv_pool=full, swa_kv_pool=swa,
            full_layer_mapping={1: 0, 3: 1}, swa_layer_mapping={0: 0, 2: 1},
            load_cache_event=threading.Event(), storage_backend=None, use_mla=False)
    hosts = group.get_pool(PoolName.KV), group.get_pool(PoolName.SWA)
    assert all(isinstance(h, env.plugin.MHATokenToKVPoolHost) for h in hosts), hosts
    assert [h.name for h in hosts] == [env.plugin.pool_name(x) for x in ("full", "swa")]
    swa_free0 = hosts[1].available_size()
    rows = env.torch.arange(8, 16, dtype=env.torch.int64)

    def extra(written):
        if written is None:
            return [PoolTransfer(name=PoolName.SWA, device_indices=rows)]
        assert written[0].host_indices is not None and len(written[0].host_indices) == 8
        return [PoolTransfer(name=PoolName.SWA, host_indices=written[0].host_indices)]

    written = []
    env.drive(group, [t for label in ("full", "swa") for ts in tensors[label] for t in ts],
              ctl=ctl, extra_pools=lambda w: written.append(extra(w)) or written[-1])
    assert hosts[1].available_size() == swa_free0 - 8
    group.free(written[0][0].host_indices, pool=PoolName.SWA)
    assert hosts[1].available_size() == swa_free0
    print("ok   swa: build_hybrid_swa_stack builds a kvhost pool for full and one for SWA "
          "layers; its controller moves both byte for byte, SWA on its own slots")
    for host in hosts:
        host.destroy()
    for shm in pools.values():
        shm.close()


def layered(env, shm, comp, dims, dtype):
    """A component's per-layer shm buffers as one [layer, row, *dims] tensor
    (sglang's Mamba buffer infos have the layer axis first)."""
    torch = env.torch
    base = shm.layer_address(comp, 0)
    step = shm.layer_address(comp, 1) - base
    c = shm.component(comp)
    assert all(shm.layer_address(comp, i) == base + i * step for i in range(shm.layers))
    raw = env.kvhost._arrays.raw_view(base, step * (shm.layers - 1) + c.rows * c.row_bytes, shm)
    item = torch.empty(0, dtype=dtype).element_size()
    flat = torch.frombuffer(raw, dtype=torch.uint8)[:len(raw) // item * item].view(dtype)
    inner = [1]
    for d in reversed(dims[1:]):
        inner.insert(0, inner[0] * d)
    return flat.as_strided((shm.layers, c.rows, *dims), (step // item, c.row_bytes // item,
                                                         *inner))


def check_mamba(env):
    """KV + Mamba: sglang's build_hybrid_mamba_stack builds the KV pool and,
    through build_mamba_host_pool, a kvhost MAMBA pool with one packed MTP
    draft layer (full attention on layers 1 and 3, Mamba on 0 and 2); the
    controller it returns moves both, Mamba slots on their own."""
    from sglang.srt.mem_cache.device_pool_info import DevicePoolInfo  # noqa: PLC0415
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer  # noqa
    from sglang.srt.mem_cache.pool_host.host_pool_decl import (HostPoolDecl,  # noqa
                                                               make_kv_pool_decl)
    torch = env.torch
    _, kshm = env.device_memory("mb", {"kind": "MHA", "layout": "PAGE_FIRST", "layer_num": 2,
                                       "head_num": HEADS, "head_dim": K_DIM})
    temporal, conv = (2, 4), (3, 8)
    os.environ["KVHOST_POOL_PREFIX"] = "mb"
    mname = env.plugin.pool_name("mamba")
    with env.kvhost.Client(env.daemon.address, session=False) as sched:
        sched.create_pool(mname, {"kind": "MAMBA", "layout": "PAGE_FIRST_DIRECT",
                                  "dtype": "BF16", "page_size": 1, "layer_num": 3,
                                  "size_tokens": 64, "mamba": {
                                      "temporal": {"dims": list(temporal)},
                                      "temporal_dtype": "FP32", "conv": [{"dims": list(conv)}]}})
    mshm = env.worker.shm_device_pool(mname, 32)
    env.plugin.register_shm_device_pool(mshm)
    t_all = layered(env, mshm, "temporal", temporal, torch.float32)
    c_all = layered(env, mshm, "conv0", conv, torch.bfloat16)

    def mamba_pool(layers, ids):
        info = env.dpi.MambaStateBufferInfo(temporal=t_all[layers], conv=(c_all[layers],))
        dpi = DevicePoolInfo(pool_name=PoolName.MAMBA, indices_from_pool=PoolName.MAMBA,
                             layer_ids=ids, buffer_info=info)
        return types.SimpleNamespace(get_device_pool_infos=lambda: (dpi,), size=32,
                                     host_capacity_tokens=None, device="cpu")

    kv = MHADevicePool(env, env.tensors(kshm, "k", K_DIM), env.tensors(kshm, "v", K_DIM),
                       v_dim=K_DIM)
    mamba, draft = mamba_pool(slice(0, 2), (0, 2)), mamba_pool(slice(2, 3), (0,))
    kvcache = types.SimpleNamespace(device="cpu", layer_num=4,
                                    register_layer_transfer_counter=lambda counter: None)
    params = types.SimpleNamespace(
        page_size=PS, token_to_kv_pool_allocator=DeviceAllocator(torch, kvcache),
        mtp_draft_device_pools=(), mtp_draft_mamba_pools=(draft,),
        req_to_token_pool=types.SimpleNamespace(mamba_pool=mamba,
                                                mamba_allocator=DeviceAllocator(torch, mamba)),
        tp_cache_group=None, attn_cp_cache_group=None, attn_tp_cache_group=None,
        pp_cache_group=None)
    with env.asm.get_parallel().override(dcp_enabled=False):
        group, ctl, _ = env.asm.build_hybrid_mamba_stack(
            params=params, decls=(make_kv_pool_decl(kv),), mamba_pool=mamba,
            full_layer_mapping={1: 0, 3: 1}, start_layer=0,
            load_cache_event=threading.Event(), storage_backend=None, use_mla=False)
    host = group.get_pool(PoolName.MAMBA)
    assert isinstance(host, env.plugin.MambaPoolHost) and host.name == mname, host
    assert (host.layer_num, host.target_layer_num) == (3, 2)
    free0 = host.available_size()
    rows = torch.arange(8, 16, dtype=torch.int64)
    written = []

    def extra(w):
        written.append([PoolTransfer(name=PoolName.MAMBA, device_indices=rows)] if w is None
                       else [PoolTransfer(name=PoolName.MAMBA, host_indices=w[0].host_indices)])
        return written[-1]

    device = [t for k in (kv.k_buffer, kv.v_buffer) for t in k] + \
        list(t_all.unbind(0)) + list(c_all.unbind(0))
    env.drive(group, device, ctl=ctl, extra_pools=extra)
    group.free(written[0][0].host_indices, pool=PoolName.MAMBA)
    assert host.available_size() == free0
    info = mamba.get_device_pool_infos()[0]
    side = env.dpi.MambaStateBufferInfo(temporal=info.buffer_info.temporal,
                                        conv=info.buffer_info.conv,
                                        extra_checkpoint_buffers=(torch.zeros(32, 2),))
    env.refused("mb-side-state", ["extra_checkpoint_buffers"], lambda: env.asm.
                build_mamba_host_pool(mamba, types.SimpleNamespace(buffer_info=side),
                                      host_size=0, layout="page_first"), label="mamba")
    env.refused("mb-lf", ["layout layer_first for Mamba state"], lambda: env.asm.
                build_mamba_host_pool(mamba, info, host_size=0, layout="layer_first"),
                label="mamba")
    print("ok   mamba: build_hybrid_mamba_stack builds kvhost KV and MAMBA pools (a packed "
          "MTP draft layer); its controller moves both byte for byte; side-state buffers "
          "and layout layer_first refused at construction by name, no pool made")

    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool  # noqa: PLC0415
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType  # noqa

    class Hybrid(HybridLinearKVPool):  # a type to match on; never used
        def __init__(self, decls):  # noqa: PLW0231 (sglang's needs a GPU pool)
            self.decls = decls

        def host_pool_decls(self):
            return self.decls

    both = {ComponentType.FULL, ComponentType.MAMBA}
    strategy = env.asm._select_strategy(Hybrid((make_kv_pool_decl(kv),)), both)
    assert type(strategy).__name__ == "_MambaStrategy", strategy
    side = HostPoolDecl(pool_name=PoolName.INDEXER, device_pool=kv,
                        indices_from_pool=PoolName.KV, layout_source=PoolName.KV,
                        storage_info=None, host_pool_builder=None)
    env.refused("mb-side", ["Hybrid", "declared side pools ['indexer']"],
                lambda: env.asm._select_strategy(Hybrid((make_kv_pool_decl(kv), side)), both))
    print("ok   mamba: sglang's Mamba strategy taken; one declaring a side pool kvhost "
          "does not build refused by name")
    group.get_pool(PoolName.KV).destroy()
    host.destroy()
    kshm.close()
    mshm.close()


def dsa_pool_cls(env):
    """A stand-in for sglang's DSATokenToKVPool (an MLA pool with index-K
    page buffers): the members its host pool declarations, sglang's builder
    and the DSA strategy read; its own constructor needs a GPU."""
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool  # noqa: PLC0415
    from sglang.srt.mem_cache.pool_host.dsa import make_dsa_indexer_pool_decl  # noqa
    from sglang.srt.mem_cache.pool_host.host_pool_decl import make_kv_pool_decl  # noqa

    class DSAPool(DSATokenToKVPool):
        kv_cache_dim = index_head_dim = index_k_with_scale_buffer = layer_num = None

        def __init__(self, latent, index_k, skip):  # noqa: PLW0231
            mla = MLADevicePool(env, latent)
            self.__dict__.update({k: v for k, v in vars(mla).items()})
            self.get_device_pool_infos = mla.get_device_pool_infos
            self.page_size = self.index_page_size = PS
            self.index_head_dim, self.quant_block_size = 128, 128
            self.index_k_with_scale_buffer, self.skip_topk_layers = index_k, skip
            self.register_layer_transfer_counter = lambda counter: None

        def host_pool_decls(self):
            if all(self.skip_topk_layers):
                return (make_kv_pool_decl(self),)
            return (make_kv_pool_decl(self), make_dsa_indexer_pool_decl(self))

    return DSAPool


def check_dsa(env):
    """DSA + indexer: sglang's DSA strategy builds the MLA pool and, through
    the indexer decl's builder, a kvhost DSA_INDEXER pool following it
    (index keys on layers 0 and 2 of 3; a packed MTP draft layer for both);
    the controller it builds moves both byte for byte."""
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer  # noqa
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType  # noqa
    torch = env.torch
    name, shm = env.device_memory("dsa", {"kind": "MLA", "layout": "PAGE_FIRST",
                                          "layer_num": LAYERS + 1, "kv_lora_rank": LORA,
                                          "qk_rope_head_dim": ROPE})
    _, ishm = env.device_memory("dsa", {"kind": "DSA_INDEXER", "layout": "PAGE_FIRST",
                                        "layer_num": 3, "index_head_dim": 128,
                                        "index_quant_block_size": 128, "follows": name},
                                label="kv-indexer", dtype="UINT8")
    latent = env.tensors(shm, "latent", LORA + ROPE)
    row = ishm.component("index_k").row_bytes
    index_k = [torch.frombuffer(ishm.layer_view("index_k", i), dtype=torch.uint8).view(-1, row)
               for i in range(3)]
    placeholder = torch.zeros(0, row, dtype=torch.uint8)  # a shared-topk layer's
    DSAPool = dsa_pool_cls(env)
    kvcache = DSAPool(latent[:LAYERS], [index_k[0], placeholder, index_k[1]],
                      [False, True, False])
    draft = DSAPool(latent[LAYERS:], [index_k[2]], [False])
    strategy = env.asm._select_strategy(kvcache, {ComponentType.FULL})
    assert type(strategy).__name__ == "_DsaStrategy", strategy
    params = types.SimpleNamespace(
        page_size=PS, token_to_kv_pool_allocator=DeviceAllocator(torch, kvcache),
        mtp_draft_device_pools=(draft,), tp_cache_group=None, attn_cp_cache_group=None,
        attn_tp_cache_group=None, pp_cache_group=None)
    with env.asm.get_parallel().override(dcp_enabled=False):
        result = strategy.build(cache=None, kvcache=kvcache, params=params, server_args=None,
                                load_cache_event=threading.Event())
    group, ctl = result.host_pool_group, result.cache_controller
    host, index_host = group.get_pool(PoolName.KV), group.get_pool(PoolName.INDEXER)
    assert isinstance(host, env.plugin.MLATokenToKVPoolHost), type(host)
    assert isinstance(index_host, env.plugin.DSAIndexerPoolHost), type(index_host)
    assert (index_host.layer_num, index_host.target_layer_num) == (3, 2)
    assert index_host.info["spec"].get("follows") == host.name, index_host.info["spec"]
    env.drive(group, latent + [(t, PS) for t in index_k], ctl=ctl, extra_pools=lambda w: [
        PoolTransfer(name=PoolName.INDEXER, indices_from_pool=PoolName.KV)])
    kpool = DSAPool(latent[:LAYERS], [index_k[0], placeholder, index_k[1]],
                    [False, True, False])
    kpool.index_page_size = PS // 2  # index_kpool 2
    from sglang.srt.mem_cache.pool_host.dsa import make_dsa_indexer_pool_decl  # noqa
    env.refused("dsa-kpool", ["index pages of 2 tokens on 4-token KV pages"], lambda: env.plugin.
                DSAIndexerPoolHost(make_dsa_indexer_pool_decl(kpool), host), label="kv-indexer")
    print("ok   dsa: sglang's DSA strategy builds a kvhost MLA pool and the DSA_INDEXER pool "
          "following it (shared-topk layer skipped, a packed MTP draft); its controller "
          "moves both byte for byte; an index page unlike the KV page refused by name")
    index_host.destroy()
    host.destroy()
    ishm.close()
    shm.close()


def main():
    kvhostd, lib, source_dir = sys.argv[1:4]
    engine_env.enter(source_dir)
    os.environ["KVHOST_LIBRARY"] = lib
    os.environ["SGLANG_PLUGINS"] = "kvhost"
    from python_sglang_engine_test import install_plugin  # noqa: PLC0415
    scratch = install_plugin(source_dir)
    from kvhost_testing import Daemon  # noqa: PLC0415
    import kvhost  # noqa: PLC0415
    assert kvhost.__file__.startswith(sys.path[0]), kvhost.__file__  # the installed copy
    from sglang.srt import plugins  # noqa: PLC0415
    daemon = Daemon(kvhostd)
    try:
        os.environ["KVHOST_ADDRESS"] = daemon.address
        os.environ["KVHOST_OWNER_TOKEN"] = "sglang-kinds-engine-test"
        plugins.load_plugins()  # sglang's loader: entry point group sglang.srt.plugins
        env = Env(daemon)
        check_mla(env)
        check_asymmetric(env)
        check_minimax(env)
        check_swa(env)
        check_mamba(env)
        check_dsa(env)
        env.worker.close()
    finally:
        daemon.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
