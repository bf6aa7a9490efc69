#!/usr/bin/env python3
"""sglang's own host-pool machinery driving kvhost pools (host backend).

Runs in the engine venv (tests/engine_env.py: the pinned sglang and torch)
against a fresh kvhostd --backend=host:
  plugin  kvhost's entry point, pip-installed from SOURCE_DIR/python into a
          scratch directory, loaded by sglang's own plugin loader
          (sglang.srt.plugins.load_plugins, SGLANG_PLUGINS=kvhost); then
          sglang's build_kv_host_pool builds a kvhost pool, and refuses the
          mooncake storage backend and the kernel_ascend io backend, and
          sglang's strategy selection a DeepSeek-V4 stack, at once with a
          message naming it (MLA, asymmetric MHA, packed MTP drafts, SWA,
          MiniMax sparse, Mamba, DSA: python_sglang_kinds_engine_test.py);
  drive   that pool in sglang's HostPoolGroup (device, logical_size,
          can_use_write_back_jit, alloc / free / available_size, destroy)
          and sglang's L2TransferEngine: submit_device_to_host, the device
          rows cleared, submit_host_to_device layer by layer (with is_draft),
          byte for byte, and get_data_page against the device rows;
  hf3fs   sglang's own hf3fs storage backend (made by its
          StorageBackendFactory, with sglang's own Hf3fsMockClient for the
          3FS file) stores pages of the plugin's pool and restores them
          through its zero-copy views into kvhostd's host pages;
  view    get_data_page(flat=False) is a view of the host page (MHA in every
          layout, MLA in four): equal to the copied page, and a write
          through it (as hf3fs-style backends do) is what a load or the
          daemon then reads; sglang's pool maps the descriptors kvhostd hands
          its session over the handoff socket, not the region files' paths.
The project's own stand-ins, for what needs a GPU or a running scheduler:
the device pool object (per-layer CPU tensors over a kvhost ShmDevicePool,
with the members build_kv_host_pool reads) and sglang's runtime-context
memory settings (hicache ratio, size, layout). HybridCacheController is not
built here: its constructor needs the scheduler's allocator and process
groups.
  usage: python_sglang_engine_test.py KVHOSTD LIBKVHOST_C SOURCE_DIR
"""
import os
import shutil
import subprocess
import sys
import tempfile
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import engine_env  # noqa: E402

PS, LAYERS, HEADS, DIM, DEVICE_TOKENS, LAYOUT = 4, 3, 2, 8, 64, "page_first"


def install_plugin(source_dir):
    """kvhost's package with its entry points, installed as pip would."""
    target = tempfile.mkdtemp(prefix="kvhost-plugin-")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    "--no-build-isolation", "--no-index", "--target", target,
                    os.path.join(source_dir, "python")], check=True)
    sys.path.insert(0, target)
    return target


class DevicePool:
    """Stand-in for sglang's MHATokenToKVPool: what build_kv_host_pool and
    the transfer engine read of it, over CPU tensors in shared memory."""

    def __init__(self, torch, shm, info_cls, buffers_cls, layout_enum):
        self.k_buffer = [self._tensor(torch, shm, "k", layer) for layer in range(LAYERS)]
        self.v_buffer = [self._tensor(torch, shm, "v", layer) for layer in range(LAYERS)]
        self.size, self.host_capacity_tokens = DEVICE_TOKENS, None
        self.start_layer, self.end_layer, self.layer_num = 0, LAYERS, LAYERS
        self.hicache_write_back_staging = None
        self.device = "cpu"
        buffers = buffers_cls(k=tuple(self.k_buffer), v=tuple(self.v_buffer), k_data_ptrs=None,
                              v_data_ptrs=None, layout=layout_enum.NHD)
        self.info = info_cls(buffers=buffers, page_size=PS, head_num=HEADS, head_dim=DIM,
                             v_head_dim=DIM, dtype=torch.bfloat16, device=torch.device("cpu"))

    @staticmethod
    def _tensor(torch, shm, comp, layer):
        view = shm.layer_view(comp, layer)
        return torch.frombuffer(view, dtype=torch.bfloat16).view(-1, HEADS, DIM)

    def get_device_pool_infos(self):
        return [types.SimpleNamespace(buffer_info=self.info)]


def check_views(torch, kvhost, daemon):
    """get_data_page(flat=False) is a view equal to the copied page, in
    every layout, and a write through it is what the daemon then reads."""
    from kvhost import sglang as kvs  # noqa: PLC0415
    layouts = {"MHA": ("layer_first", "page_first", "page_first_direct", "page_head",
                       "page_unified"),
               "MLA": ("layer_first", "page_first", "page_first_direct", "page_unified")}
    with kvhost.Client(daemon.address, session=False) as c:
        for kind, names in layouts.items():
            for layout in names:
                common = dict(client=c, layout=layout, dtype="bfloat16", page_size=PS,
                              layer_num=LAYERS, host_size_tokens=64, tensors=True)
                pool = (kvs.MHATokenToKVPoolHost(f"v-{kind}-{layout}", head_num=HEADS,
                                                 head_dim=DIM, **common) if kind == "MHA"
                        else kvs.MLATokenToKVPoolHost(f"v-{kind}-{layout}", kv_lora_rank=12,
                                                      qk_rope_head_dim=4, **common))
                slot = int(pool.alloc(PS)[0])
                flat = torch.randn(pool.bytes_per_page // 2).to(torch.bfloat16)
                pool.set_from_flat_data_page(slot, flat)
                view = pool.get_data_page(slot, flat=False)
                copy = pool._as_page(c.get_data_page(pool.name, slot), False)
                assert torch.equal(view, copy), (kind, layout, "view differs from the page")
                view.fill_(1.5)
                again = pool._as_page(c.get_data_page(pool.name, slot), False)
                assert torch.all(again == 1.5), (kind, layout, "write through the view lost")
                pool.close()
    print("ok   views: MHA in 5 layouts, MLA in 4: a view equal to the page, writes land")


def check_hf3fs(torch, host, slots):
    """sglang's own hf3fs backend (HiCacheHF3FS, with sglang's own
    Hf3fsMockClient for the 3FS file: its CI's choice, as no 3FS mount
    exists here), made by sglang's StorageBackendFactory over the plugin's
    pool: its zero-copy path reads into get_data_page(flat=False) views, so a
    page restored from it must land in kvhostd's host page."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: PLC0415
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa
    scratch = tempfile.mkdtemp(prefix="kvhost-hf3fs-")
    config = os.path.join(scratch, "hf3fs.json")
    with open(config, "w") as f:
        f.write('{"file_path_prefix": "%s/hicache", "file_size": %d, "numjobs": 2, '
                '"entries": 8}' % (scratch, 1 << 20))
    os.environ["SGLANG_HICACHE_HF3FS_CONFIG_PATH"] = config
    storage_config = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
        model_name="kvhost-test", extra_config={"use_mock_hf3fs_client": True})
    backend = StorageBackendFactory.create_backend("hf3fs", storage_config, host)
    backend.register_mem_pool_host(host)
    assert backend.is_zero_copy, "hf3fs did not take its zero-copy path"
    pages = slots[::PS]
    keys = [f"page-{i}" for i in range(len(pages))]
    want = [host.client.get_data_page(host.name, int(p)) for p in pages]
    assert all(backend.batch_set_v1(keys, slots)), "hf3fs could not store the pages"
    for p in pages:  # the host pages cleared, as after an eviction
        host.get_data_page(int(p), flat=False).zero_()
    assert all(host.client.get_data_page(host.name, int(p)) != w for p, w in zip(pages, want))
    assert all(backend.batch_get_v1(keys, slots)), "hf3fs could not restore the pages"
    got = [host.client.get_data_page(host.name, int(p)) for p in pages]
    assert got == want, "hf3fs restored the pages into something other than the host pages"
    backend.close()
    shutil.rmtree(scratch, ignore_errors=True)
    print("ok   hf3fs: sglang's own backend stores the pages and restores them through the "
          "views into kvhostd's host pages")


def main():
    kvhostd, lib, source_dir = sys.argv[1:4]
    engine_env.enter(source_dir)
    os.environ["KVHOST_LIBRARY"] = lib
    os.environ["SGLANG_PLUGINS"] = "kvhost"
    scratch = install_plugin(source_dir)
    from kvhost_testing import Daemon  # noqa: PLC0415
    import torch  # noqa: PLC0415
    import kvhost  # noqa: PLC0415
    from kvhost.sglang import plugin as sglang_plugin  # noqa: PLC0415
    assert kvhost.__file__.startswith(sys.path[0]), kvhost.__file__  # the installed copy
    from sglang.srt import plugins  # noqa: PLC0415
    from sglang.srt.mem_cache import l2_transfer  # noqa: PLC0415
    from sglang.srt.mem_cache.device_pool_info import (KVBufferLayout, KVBuffers,  # noqa
                                                       MHABufferInfo)
    from sglang.srt.mem_cache.hicache_storage import PoolName  # noqa: PLC0415
    from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler as asm  # noqa
    from sglang.srt.mem_cache.pool_host import HostKVCache, HostPoolGroup, PoolEntry  # noqa

    daemon = Daemon(kvhostd)
    try:
        os.environ["KVHOST_ADDRESS"] = daemon.address
        os.environ["KVHOST_POOL_PREFIX"] = "t"
        # The scheduler and the plugin share one owner token: the plugin adopts
        # only a pool that token protects (kvhost.pools.adopt_pool).
        os.environ["KVHOST_OWNER_TOKEN"] = "sglang-engine-test"
        plugins.load_plugins()  # sglang's loader: entry point group sglang.srt.plugins
        assert asm.get_mha_host_pool_cls.__wrapped__ is not None, "hook not applied"
        name = sglang_plugin.pool_name("kv")
        # The pool exists before the worker maps its device buffers (shape
        # from the same spec the plugin asks for; the plugin adopts it).
        with kvhost.Client(daemon.address, session=False) as sched:
            sched.create_pool(name, {"kind": "MHA", "layout": "PAGE_FIRST", "dtype": "BF16",
                                     "page_size": PS, "layer_num": LAYERS, "head_num": HEADS,
                                     "head_dim": DIM, "size_tokens": 2 * DEVICE_TOKENS})
        worker = kvhost.Client(daemon.address)
        shm = worker.shm_device_pool(name, DEVICE_TOKENS)
        sglang_plugin.register_shm_device_pool(shm)
        dev = DevicePool(torch, shm, MHABufferInfo, KVBuffers, KVBufferLayout)
        # Stand-in: the settings sglang's launcher publishes (runtime_context).
        memory = types.SimpleNamespace(hicache_ratio=2.0, hicache_size=0,
                                       hicache_mem_layout=LAYOUT, hicache_storage_backend=None,
                                       hicache_io_backend="kernel")
        from sglang.srt.mem_cache.pool_host import common  # noqa: PLC0415
        asm.get_memory = common.get_memory = lambda: memory
        with asm.get_parallel().override(dcp_enabled=False):  # sglang's own API
            host = asm.build_kv_host_pool(kv_pool=dev, page_size=PS, use_mla=False)
        assert isinstance(host, sglang_plugin.MHATokenToKVPoolHost), type(host)
        assert isinstance(host, HostKVCache), type(host).__mro__
        assert host.dtype == torch.bfloat16 and host.name == name, (host.dtype, host.name)
        try:
            sglang_plugin.check_release("0.5.22")
            raise AssertionError("sglang 0.5.22 was not refused")
        except RuntimeError as e:
            assert "sglang 0.5.22 is not supported" in str(e) and "0.5.23" in str(e), e
        # register() on an unsupported release raises (sglang's loader logs it
        # and goes on) and leaves a hook refusing build_kv_host_pool with the
        # same message (it once raised NameError: the except block's name was
        # gone when the hook ran).
        import sglang  # noqa: PLC0415
        from sglang.srt.plugins.hook_registry import HookRegistry  # noqa: PLC0415
        hooks = HookRegistry._hooks[f"{asm.__name__}.build_kv_host_pool"]
        before, version = list(hooks), sglang.__version__
        sglang.__version__ = "0.5.22"
        try:
            sglang_plugin.register()
            raise AssertionError("register() on sglang 0.5.22 did not raise")
        except RuntimeError as e:
            assert "sglang 0.5.22 is not supported" in str(e), e
        finally:
            sglang.__version__ = version
        refuse = hooks[-1][1]
        hooks[:] = before
        try:
            refuse(None)
            raise AssertionError("the refusing hook did not raise")
        except RuntimeError as e:
            assert "sglang 0.5.22 is not supported" in str(e), e
        memory.hicache_storage_backend = "mooncake"  # registers the buffer: refused
        try:
            with asm.get_parallel().override(dcp_enabled=False):
                asm.build_kv_host_pool(kv_pool=dev, page_size=PS, use_mla=False)
            raise AssertionError("the mooncake storage backend was not refused")
        except RuntimeError as e:
            assert "--hicache-storage-backend mooncake" in str(e), e
        memory.hicache_storage_backend = None
        memory.hicache_io_backend = "kernel_ascend"
        try:
            with asm.get_parallel().override(dcp_enabled=False):
                asm.build_kv_host_pool(kv_pool=dev, page_size=PS, use_mla=False)
            raise AssertionError("io backend kernel_ascend was not refused")
        except RuntimeError as e:
            assert "--hicache-io-backend kernel_ascend" in str(e), e
        memory.hicache_io_backend = "kernel"
        from sglang.srt.mem_cache.deepseek_v4_memory_pool import (  # noqa: PLC0415
            DeepSeekV4TokenToKVPool)
        from sglang.srt.mem_cache.unified_cache.component_type import ComponentType  # noqa
        v4 = object.__new__(DeepSeekV4TokenToKVPool)  # a type to match on; never used
        try:
            asm._select_strategy(v4, {ComponentType.FULL, ComponentType.SWA})
            raise AssertionError("a DeepSeek-V4 stack was not refused")
        except RuntimeError as e:
            assert "DeepSeekV4TokenToKVPool" in str(e) and "V4_PAGED pools cannot follow" \
                in str(e), e
        print("ok   plugin: sglang's loader and build_kv_host_pool build kvhost pools; "
              "mooncake, kernel_ascend and a DeepSeek-V4 stack refused by name")

        group = HostPoolGroup([PoolEntry(name=PoolName.KV, host_pool=host, device_pool=dev,
                                         layer_mapper=lambda layer: layer,
                                         is_primary_index_anchor=True)])
        assert group.device == "cpu" and group.logical_size == host.size == 2 * DEVICE_TOKENS
        assert group.can_use_write_back_jit is False
        free0 = group.available_size()
        slots = group.alloc(8)
        assert slots is not None and len(slots) == 8 and group.available_size() == free0 - 8
        rows = torch.arange(8, 16, dtype=torch.int64)
        gen = torch.Generator().manual_seed(7)
        for t in dev.k_buffer + dev.v_buffer:
            t.copy_(torch.randn(t.shape, generator=gen).to(torch.bfloat16))
        want = [t[8:16].clone() for t in dev.k_buffer + dev.v_buffer]
        engine = l2_transfer.L2TransferEngine("kernel")
        xfer = l2_transfer.L2Transfer(host, dev, slots, rows)
        engine.submit_device_to_host([xfer])
        page = host.get_data_page(int(slots[0]), flat=False)  # (2, ps, L, H, D)
        assert torch.equal(page[0, :, 1], want[1][:PS]), "host page != device rows (K, layer 1)"
        for t in dev.k_buffer + dev.v_buffer:
            t.zero_()
        engine.submit_host_to_device([xfer._replace(is_draft=False)],
                                     transfer_layer_id_max=LAYERS)
        got = [t[8:16] for t in dev.k_buffer + dev.v_buffer]
        assert all(torch.equal(a, b) for a, b in zip(got, want)), "load back differs"
        print("ok   drive: HostPoolGroup and L2TransferEngine, backup and load byte for byte")
        view = host.get_data_page(int(slots[0]), flat=False)  # a storage backend's write
        view[1, 2, 0] = 3.0  # V, token 2 of the page, layer 0
        engine.submit_host_to_device([xfer], transfer_layer_id_max=LAYERS)
        assert torch.all(dev.v_buffer[0][8 + 2] == 3.0), "a write through the view was lost"
        # The view maps descriptors the daemon handed over its handoff socket
        # to this session (HANDOFF_KIND_POOL_MAP), never the region files' paths.
        assert host.mapped_by == "handoff", host.mapped_by
        print("ok   view: a write through get_data_page(flat=False) reaches the device")
        check_hf3fs(torch, host, slots)
        check_views(torch, kvhost, daemon)
        assert group.free(slots) == 8 and group.available_size() == free0
        group.destroy()
        group.destroy()  # idempotent, as sglang's
        shm.close()
        worker.close()
    finally:
        daemon.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
