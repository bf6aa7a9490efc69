#!/usr/bin/env python3
"""kvhost.sglang.storage_backend: sglang's HiCacheStorage on kvhostd's node
cache, driven by the pinned sglang's own code (engine venv) against a
host-backend kvhostd (tests/conftest.py's `daemon`).

  controller  sglang's StorageBackendFactory ("dynamic", from the extra
              config) makes the backend inside sglang's own
              HybridCacheController.attach_storage_backend; the controller's
              own threads back pages up (write_storage: batch_set_v1 on its
              backup thread) and prefetch them (prefetch: batch_exists on its
              prefetch thread; batch_get_v1 on its IO thread) for a second
              instance (its own backend, host pool and kvhost session), whose
              load brings the first instance's device rows back byte for byte;
              a third instance made after the first is gone finds the pages
              (a restart). The host pools are kvhost.sglang.plugin's (kvhostd
              pools).
  own pools   sglang's own MHA and MLA host pools (in-process memory) and
              kvhost's, of other layouts, share pages through one cache
              (batch_set_v1 / batch_get_v1, and the older flat-page batch_set /
              batch_get / get / set / exists); sglang's own pool's pages are
              staged (one copy here each), kvhost's are copied by kvhostd
              straight into and out of its slots (no staging copy, counted
              by the lane's staged_pages); MLA ranks share one copy
              (no rank in the key), MHA ranks do not; v2 calls of a pool group.
  refusals    bad settings, a cache of another shape or token, a host pool
              the backend cannot stage (a layout, a K-only pool), sglang's
              dynamic backend naming another module (the plugin's start-up
              check): clear errors naming them.
  failures    a store the daemon refuses (pinned pages fill the cache) is
              False per key, logged with the daemon's code and message, and
              changes nothing; after a kvhostd restart a restore fails (False,
              logged) and the host pool keeps its bytes, then the backend,
              seeing the session's loss, makes the cache again and stores.
The project's own stand-ins, for what needs a GPU or a running scheduler:
the device pool objects (per-layer CPU tensors over a kvhost ShmDevicePool),
the device token allocator, and the scheduler's part between the prefetch
thread's hit and the IO thread (HiRadixCache's allocate_storage_hit and
prefetch_buffer.put, here called as it calls them).

  usage: python_sglang_storage_test.py KVHOSTD LIBKVHOST_C SOURCE_DIR (ctest:
  re-runs itself under the engine venv, then pytest on this file)
"""
import os
import sys
import threading
import types

TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TESTS)

PS, LAYERS, HEADS, DIM, DEVICE_TOKENS = 4, 3, 2, 8, 64
LORA, ROPE = 12, 4
TOKEN = "sglang-storage-test"
MODULE = "kvhost.sglang.storage_backend"


def main():
    import engine_env  # noqa: PLC0415
    kvhostd, lib, source_dir = (os.path.abspath(a) for a in sys.argv[1:4])
    engine_env.enter(source_dir)
    path = engine_env.pytest_path(source_dir)
    if path is None:
        return engine_env.missing("pytest (python/requirements-engines.txt)")
    sys.path.insert(0, path)
    import pytest  # noqa: PLC0415
    os.environ.update(KVHOST_TEST_KVHOSTD=kvhostd, KVHOST_LIBRARY=lib,
                      KVHOST_TEST_SOURCE_DIR=source_dir)
    rc = pytest.main([os.path.abspath(__file__), "-p", "no:cacheprovider", "-rs", "-v"])
    return 1 if rc == 5 else int(rc)


if __name__ == "__main__":
    sys.exit(main())

import pytest  # noqa: E402

pytest.importorskip("sglang", reason="needs the engine venv (scripts/engine_venv.sh)")

import torch  # noqa: E402
from sglang.srt.mem_cache import device_pool_info as dpi  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import (HiCacheStorageConfig, PoolHitPolicy,  # noqa
                                                  PoolName, PoolTransfer)
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (  # noqa: E402
    HybridCacheController)
from sglang.srt.mem_cache.pool_host import HostPoolGroup, PoolEntry  # noqa: E402
from sglang.srt.mem_cache.pool_host import mha as sg_mha  # noqa: E402
from sglang.srt.mem_cache.pool_host import mla as sg_mla  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402
from sglang.srt.mem_cache.utils import get_storage_hash_str  # noqa: E402
from sglang.srt.runtime_context import get_parallel  # noqa: E402

import kvhost  # noqa: E402
import kvhost_testing as pkg  # noqa: E402
from kvhost.sglang import plugin  # noqa: E402
from kvhost.sglang import storage_backend  # noqa: E402
from kvhost.sglang.cache_staging import canonical, page_shape  # noqa: E402


def extra(daemon, **kw):
    """sglang's extra config naming the backend, with kvhost settings."""
    config = {"backend_name": "kvhost", "module_path": MODULE,
              "class_name": "KvhostNodeCacheStorage", "kvhost_address": daemon.address,
              "kvhost_owner_token": TOKEN}
    config.update(kw)
    return config


def storage_config(daemon, tp_rank=0, tp_size=1, mla=False, **kw):
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
        attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=True,
        is_page_first_layout=False, model_name="org/model", extra_config=extra(daemon, **kw))


def make_backend(daemon, host, **kw):
    """sglang's own factory path: the dynamic backend from the extra config,
    then the controller's register_mem_pool_host."""
    backend = StorageBackendFactory.create_backend("dynamic", storage_config(daemon, **kw),
                                                   host)
    assert isinstance(backend, storage_backend.KvhostNodeCacheStorage), type(backend)
    backend.register_mem_pool_host(host)
    backend.on_host_pools_registered()
    return backend


def ptrs(tensors):
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64)


def sglang_mha_pool(layout):
    """sglang's own MHA host pool (its memory in this process), over
    stand-in device tensors."""
    k = [torch.zeros(DEVICE_TOKENS, HEADS, DIM, dtype=torch.bfloat16) for _ in range(LAYERS)]
    v = [torch.zeros(DEVICE_TOKENS, HEADS, DIM, dtype=torch.bfloat16) for _ in range(LAYERS)]
    buffers = dpi.KVBuffers(k=tuple(k), v=tuple(v), k_data_ptrs=ptrs(k), v_data_ptrs=ptrs(v),
                            layout=dpi.KVBufferLayout.NHD)
    info = dpi.MHABufferInfo(buffers=buffers, page_size=PS, head_num=HEADS, head_dim=DIM,
                             v_head_dim=DIM, dtype=torch.bfloat16, device=torch.device("cpu"))
    return sg_mha.MHATokenToKVPoolHost(info, 2.0, 0, PS, layout, pin_memory=False,
                                       device="cpu", device_capacity_tokens=DEVICE_TOKENS,
                                       start_layer=0, end_layer=LAYERS)


def sglang_mla_pool(layout):
    latent = [torch.zeros(DEVICE_TOKENS, 1, LORA + ROPE, dtype=torch.bfloat16)
              for _ in range(LAYERS)]
    info = dpi.MLABufferInfo(buffers=tuple(latent), data_ptrs=ptrs(latent),
                             layer_indices=tuple(range(LAYERS)), device_layer_num=LAYERS,
                             page_size=PS, kv_lora_rank=LORA, qk_rope_head_dim=ROPE,
                             kv_cache_dim=LORA + ROPE, dtype=torch.bfloat16,
                             device=torch.device("cpu"))
    return sg_mla.MLATokenToKVPoolHost(info, 2.0, 0, PS, layout, pin_memory=False,
                                       device="cpu", device_capacity_tokens=DEVICE_TOKENS,
                                       start_layer=0, end_layer=LAYERS, target_layer_num=LAYERS)


def kvhost_pool(daemon, name, kind="MHA", layout="page_first"):
    """kvhost.sglang's host pool of that kind (a kvhostd pool)."""
    client = pkg.client(daemon, session=True, owner_token=TOKEN)
    common = dict(client=client, layout=layout, dtype="bfloat16", page_size=PS,
                  layer_num=LAYERS, host_size_tokens=2 * DEVICE_TOKENS, tensors=True)
    if kind == "MHA":
        pool = kvhost.sglang.MHATokenToKVPoolHost(name, head_num=HEADS, head_dim=DIM, **common)
    else:
        pool = kvhost.sglang.MLATokenToKVPoolHost(name, kv_lora_rank=LORA,
                                                   qk_rope_head_dim=ROPE, **common)
    pool.test_client = client
    return pool


def fill_pages(host, slots, seed):
    """Random bytes in each page (through sglang's own set_from_flat_data_page)."""
    gen = torch.Generator().manual_seed(seed)
    for s in slots:
        flat = host.get_data_page(int(s), flat=True)
        host.set_from_flat_data_page(int(s), torch.randn(flat.shape, generator=gen).to(
            torch.bfloat16))


def canonical_pages(host, slots):
    """Each page as (components, layers, page, heads, dim): what must be
    equal across host pools of any layout."""
    shape = page_shape(host)
    return [canonical(host.get_data_page(int(s), flat=False), shape).clone() for s in slots]


def lane_of(backend):
    """The backend's data path (kvhost.sglang.cache_staging) of its KV pool."""
    return backend._lane_for(PoolName.KV)


def page_slots(n, first=0):
    """Host token indices of n pages from page `first` (a tensor, as sglang's)."""
    return torch.arange(first * PS, (first + n) * PS, dtype=torch.int64)


# --- sglang's controller --------------------------------------------------------


class DeviceAllocator:
    """Stand-in for sglang's device token allocator: rows from 32 up."""

    def __init__(self, kvcache):
        self.kvcache, self.next = kvcache, 32

    def get_kvcache(self):
        return self.kvcache

    def alloc(self, n):
        rows = torch.arange(self.next, self.next + n, dtype=torch.int64)
        self.next += n
        return rows

    def free(self, rows):
        pass

    def set_hicache_transfer_done_event(self, key, event):
        pass


class MHADevicePool:
    """Stand-in for sglang's MHATokenToKVPool over a ShmDevicePool."""

    def __init__(self, shm):
        def layer(comp, i):
            return torch.frombuffer(shm.layer_view(comp, i), dtype=torch.bfloat16).view(
                DEVICE_TOKENS, HEADS, DIM)
        self.k_buffer = [layer("k", i) for i in range(LAYERS)]
        self.v_buffer = [layer("v", i) for i in range(LAYERS)]
        self.size, self.host_capacity_tokens, self.hicache_write_back_staging = \
            DEVICE_TOKENS, None, None
        self.start_layer, self.end_layer, self.layer_num = 0, LAYERS, LAYERS
        self.head_num, self.head_dim, self.v_head_dim = HEADS, DIM, DIM
        self.store_dtype, self.dtype, self.device = torch.bfloat16, torch.bfloat16, "cpu"
        buffers = dpi.KVBuffers(k=tuple(self.k_buffer), v=tuple(self.v_buffer), k_data_ptrs=None,
                                v_data_ptrs=None, layout=dpi.KVBufferLayout.NHD)
        self.info = dpi.MHABufferInfo(buffers=buffers, page_size=PS, head_num=HEADS,
                                      head_dim=DIM, v_head_dim=DIM, dtype=torch.bfloat16,
                                      device=torch.device("cpu"))

    def get_device_pool_infos(self):
        return [types.SimpleNamespace(buffer_info=self.info)]

    def register_layer_transfer_counter(self, counter):
        self.layer_transfer_counter = counter


class Instance:
    """One sglang instance: the plugin's kvhost host pool (pool prefix
    `prefix`), its HostPoolGroup and a HybridCacheController with the
    kvhost storage backend attached by sglang's own attach path."""

    def __init__(self, daemon, prefix, **settings):
        os.environ.update(KVHOST_ADDRESS=daemon.address, KVHOST_POOL_PREFIX=prefix,
                          KVHOST_OWNER_TOKEN=TOKEN)
        name = plugin.pool_name("kv")
        self.worker = pkg.client(daemon, session=True)
        with kvhost.Client(daemon.address, session=False) as sched:
            sched.create_pool(name, {"kind": "MHA", "layout": "PAGE_FIRST", "dtype": "BF16",
                                     "page_size": PS, "layer_num": LAYERS, "head_num": HEADS,
                                     "head_dim": DIM, "size_tokens": 2 * DEVICE_TOKENS})
        self.shm = self.worker.shm_device_pool(name, DEVICE_TOKENS)
        plugin.register_shm_device_pool(self.shm)
        self.dev = MHADevicePool(self.shm)
        # allocator_type: what sglang's build_kv_host_pool passes with
        # --hicache-storage-backend dynamic (get_allocator_type()).
        self.host = plugin.MHATokenToKVPoolHost(self.dev.info, 2.0, 0, PS, "page_first",
                                                allocator_type="dynamic",
                                                device_capacity_tokens=DEVICE_TOKENS,
                                                start_layer=0, end_layer=LAYERS)
        self.group = HostPoolGroup([PoolEntry(name=PoolName.KV, host_pool=self.host,
                                              device_pool=self.dev,
                                              layer_mapper=lambda layer: layer,
                                              is_primary_index_anchor=True)])
        # Stand-in: the parallel widths sglang's launcher publishes (one rank).
        with get_parallel().override(attn_dcp_size=1, attn_dcp_rank=0, tp_rank=0, tp_size=1,
                                     pp_rank=0, pp_size=1):
            self.ctl = HybridCacheController(
                DeviceAllocator(self.dev), self.group, PS, None, threading.Event(),
                io_backend="kernel", transfer_layer_id_max=LAYERS, storage_backend="dynamic",
                model_name="org/model", storage_backend_extra_config=extra(daemon, **settings))

    def device_rows(self, rows):
        return [t[rows].clone() for t in self.dev.k_buffer + self.dev.v_buffer]

    def close(self):
        self.ctl.detach_storage_backend()
        self.group.destroy()
        self.shm.close()
        self.worker.close()


def drain_acks(ctl, op, timeout=30):
    """The scheduler's drain of the controller's prefetch acks for `op`
    (HiRadixCache's: completed_tokens from each ack, until completed_req)."""
    import queue  # noqa: PLC0415
    while True:
        try:
            ack = ctl.ack_prefetch_queue.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no final ack of prefetch {op.request_id} in {timeout} s") \
                from None
        assert ack.operation is op, (ack.operation, op)
        if ack.completed_tokens is not None:
            op.completed_tokens = ack.completed_tokens
        if ack.completed_req:
            return


def prefetch(inst, tokens, rid):
    """sglang's prefetch of `tokens`: its prefetch thread's hit query
    (batch_exists), then the scheduler's allocation (allocate_storage_hit,
    as HiRadixCache calls it), its IO thread's transfer (batch_get_v1) and
    the sync thread's acks. Returns the operation and its host indices."""
    ctl = inst.ctl
    op = ctl.prefetch(CacheRequestHandle(rid, 0), tokens)
    hit = ctl.prefetch_hit_queue.get(timeout=30)
    assert hit is op, (hit, op)
    if op.storage_hit_count == 0:
        return op, None
    host_indices, n = ctl.allocate_storage_hit(op, op.storage_hit_count, allow_partial=True,
                                               min_tokens=PS, evict_host=lambda n: 0)
    assert host_indices is not None and n == op.storage_hit_count, (host_indices, n)
    op.host_indices = host_indices
    ctl.prefetch_buffer.put(op)
    drain_acks(ctl, op)
    return op, host_indices


def test_controller_backs_up_and_another_instance_prefetches_byte_exact(daemon):
    a, b = Instance(daemon, "a"), Instance(daemon, "b")
    c = None
    try:
        backend = a.ctl.storage_backend
        assert isinstance(backend, storage_backend.KvhostNodeCacheStorage), type(backend)
        # The backend turned sglang's zero-copy page calls on (interface_v1).
        assert a.ctl.page_set_func == a.ctl._page_set_zero_copy
        assert a.ctl.page_get_func == a.ctl._page_get_zero_copy
        gen = torch.Generator().manual_seed(5)
        for t in a.dev.k_buffer + a.dev.v_buffer:
            t.copy_(torch.randn(t.shape, generator=gen).to(torch.bfloat16))
        rows = torch.arange(8, 24, dtype=torch.int64)  # 4 pages
        want = a.device_rows(rows)
        host = a.ctl.write(rows)  # device -> a's kvhost host pool
        tokens = list(range(1000, 1016))
        hashes = get_storage_hash_str(tokens, None, page_size=PS)
        op_id = a.ctl.write_storage(host, tokens, hash_value=hashes)
        done = a.ctl.ack_backup_queue.get(timeout=30)  # the backup thread: batch_set_v1
        assert done.id == op_id and done.completed_tokens == 16, (done.id, done.completed_tokens)
        assert backend.batch_exists(hashes + ["absent"]) == 4

        op, slots = prefetch(b, tokens + list(range(16)), "r1")  # 16 more: no such pages
        assert op.storage_hit_count == 16 and op.completed_tokens == 16, \
            (op.storage_hit_count, op.completed_tokens)
        b.ctl.load(slots)  # b's host -> b's device rows 32..47
        b.ctl.start_loading()
        got = b.device_rows(torch.arange(32, 48))
        bad = [i for i, (x, y) in enumerate(zip(got, want)) if not torch.equal(x, y)]
        assert not bad, f"device layers {bad} differ after b's prefetch and load"
        stats = b.ctl.storage_backend.cache_stats()
        assert (stats.published, stats.stored) == (4, 4), stats

        a.close()
        a = None
        c = Instance(daemon, "c")  # a restarted instance: a new session
        op, _ = prefetch(c, tokens, "r2")
        assert op.storage_hit_count == 16 and op.completed_tokens == 16, op.completed_tokens
    finally:
        for inst in (a, b, c):
            if inst is not None:
                inst.close()


# --- the backend on sglang's own pools and kvhost's --------------------------------


def test_sglang_and_kvhost_pools_of_other_layouts_share_pages(daemon):
    own = sglang_mha_pool("layer_first")  # sglang's memory, in this process
    theirs = kvhost_pool(daemon, "theirs", layout="page_head")
    b1 = make_backend(daemon, own)
    b2 = make_backend(daemon, theirs)
    try:
        keys = [f"page-{i}" for i in range(5)]
        slots = page_slots(5, first=2)
        fill_pages(own, slots[::PS], seed=1)
        want = canonical_pages(own, slots[::PS])
        assert b1.batch_set_v1(keys, slots) == [True] * 5
        assert b1.batch_set_v1(keys, slots) == [True] * 5  # present: skipped, still True
        assert b2.batch_exists(keys) == 5 and b2.exists("page-4") and not b2.exists("nope")
        dest = theirs.alloc(6 * PS)  # kvhost pools write only allocated slots
        assert b2.batch_get_v1(keys + ["nope"], dest) == [True] * 5 + [False]
        got = canonical_pages(theirs, dest[::PS][:5])
        assert all(torch.equal(x, y) for x, y in zip(got, want)), "pages differ"
        # sglang's own pool is staged (one copy here a page); kvhost's pool
        # is copied inside kvhostd, straight into its slots: none here.
        assert lane_of(b1).direct is None and lane_of(b1).staged_pages == 10  # two stores
        assert lane_of(b2).direct is not None and lane_of(b2).staged_pages == 0

        # sglang's older flat-page calls (the controller's generic path).
        flat = [own.get_data_page(int(s), flat=True) for s in slots[::PS]]
        assert b1.batch_set(["flat-0", "flat-1"], flat[:2]) is True
        assert b1.set("flat-2", flat[2]) is True
        targets = [theirs.get_dummy_flat_data_page() for _ in range(3)]
        pages = b2.batch_get(["flat-0", "flat-1", "flat-x"], targets)
        assert pages[2] is None and pages[0] is targets[0], pages
        single = b2.get("flat-2")
        for i, page in enumerate(pages[:2] + [single]):
            theirs.set_from_flat_data_page(int(dest[i * PS]), page)
        got = canonical_pages(theirs, dest[::PS][:3])
        assert all(torch.equal(x, y) for x, y in zip(got, want[:3])), "flat pages differ"
        assert b2.get("flat-x") is None
        metrics = b2.get_stats()
        assert metrics.prefetch_pgs and metrics.backup_pgs == [], metrics
        staged = lane_of(b2).staged_pages  # the flat pages above: staged
        assert b2.batch_set_v1(["back-0"], dest[5 * PS:]) == [True]  # zero-copy store
        assert lane_of(b2).staged_pages == staged and b2.batch_exists(["back-0"]) == 1
        assert b1.clear() is True and b2.batch_exists(keys) == 0  # b1's keys evicted
    finally:
        b1.close()
        b2.close()
        theirs.close()
        theirs.test_client.close()


def test_mla_ranks_share_one_copy_mha_ranks_do_not(daemon):
    rank0 = sglang_mla_pool("layer_first")
    rank1 = kvhost_pool(daemon, "mla-1", kind="MLA", layout="page_first_direct")
    b0 = make_backend(daemon, rank0, tp_rank=0, tp_size=2, mla=True, kvhost_cache="mla")
    b1 = make_backend(daemon, rank1, tp_rank=1, tp_size=2, mla=True, kvhost_cache="mla")
    m0 = make_backend(daemon, sglang_mha_pool("page_first"), tp_rank=0, tp_size=2)
    m1 = make_backend(daemon, sglang_mha_pool("page_first_direct"), tp_rank=1, tp_size=2)
    try:
        keys = ["h0", "h1", "h2"]
        slots = page_slots(3, first=1)
        fill_pages(rank0, slots[::PS], seed=2)
        want = canonical_pages(rank0, slots[::PS])
        assert b0.batch_set_v1(keys, slots) == [True] * 3
        assert b1.batch_exists(keys) == 3  # one copy, no rank in the key
        dest = rank1.alloc(3 * PS)  # kvhost pools write only allocated slots
        assert b1.batch_get_v1(keys, dest) == [True] * 3
        got = canonical_pages(rank1, dest[::PS])
        assert all(torch.equal(x, y) for x, y in zip(got, want)), "MLA pages differ"
        assert b1.batch_set_v1(keys, dest) == [True] * 3  # PRESENT
        assert b0.cache_stats().stored == 3

        fill_pages(m0.mem_pool_host, slots[::PS], seed=3)
        assert m0.batch_set_v1(keys, slots) == [True] * 3
        assert m1.batch_exists(keys) == 0  # rank 1 holds other heads: other keys
        assert m0.batch_exists(keys) == 3
    finally:
        for b in (b0, b1, m0, m1):
            b.close()
        rank1.close()
        rank1.test_client.close()


def test_v2_calls_of_a_pool_group(daemon):
    kv = sglang_mha_pool("page_first")
    swa = sglang_mha_pool("layer_first")
    backend = make_backend(daemon, kv, kvhost_cache="hybrid")
    backend.register_mem_host_pool_v2(kv, PoolName.KV)
    backend.register_mem_host_pool_v2(swa, PoolName.SWA)  # its own cache, hybrid-swa
    try:
        keys = ["g0", "g1", "g2", "g3"]
        slots = page_slots(4)
        fill_pages(kv, slots[::PS], seed=4)
        fill_pages(swa, slots[::PS], seed=5)
        sets = backend.batch_set_v2([
            PoolTransfer(name=PoolName.KV, host_indices=slots, keys=keys),
            PoolTransfer(name=PoolName.SWA, host_indices=slots[2 * PS:], keys=keys[2:])])
        assert sets == {"kv": [True] * 4, "swa": [True] * 2}, sets
        trailing = PoolTransfer(name=PoolName.SWA, keys=keys[2:],
                                hit_policy=PoolHitPolicy.TRAILING_PAGES)
        result = backend.batch_exists_v2(keys, [trailing])
        assert (result.kv_hit_pages, result.restorable_prefix_pages) == (4, [4]), result
        every = PoolTransfer(name=PoolName.SWA, keys=keys,
                             hit_policy=PoolHitPolicy.ALL_PAGES)
        assert backend.batch_exists_v2(keys, [every]).kv_hit_pages == 0
        want = canonical_pages(swa, slots[2 * PS::PS])
        gets = backend.batch_get_v2([PoolTransfer(name=PoolName.SWA, keys=keys[2:],
                                                  host_indices=page_slots(2, first=8))])
        assert gets == {"swa": [True, True]}, gets
        got = canonical_pages(swa, page_slots(2, first=8)[::PS])
        assert all(torch.equal(x, y) for x, y in zip(got, want)), "SWA pages differ"
        bad = backend.batch_set_v2([PoolTransfer(name=PoolName.SWA, keys=keys[:2],
                                                 host_indices=slots[:PS])])  # 1 page, 2 keys
        assert bad == {"swa": [False, False]}, bad
    finally:
        backend.close()


# --- refusals ------------------------------------------------------------------------


def refused(daemon, host, words, cls=ValueError, **kw):
    try:
        make_backend(daemon, host, **kw)
    except cls as e:
        assert all(w in str(e) for w in words), (words, str(e))
        return
    raise AssertionError(f"{kw} was not refused")


def test_bad_settings_and_pools_are_clear_errors(daemon, tmp_path, monkeypatch):
    monkeypatch.delenv("KVHOST_OWNER_TOKEN", raising=False)
    host = sglang_mha_pool("page_first")
    refused(daemon, host, ["unknown setting 'kvhost_cach'", "kvhost_cache"], kvhost_cach="x")
    refused(daemon, host, ["kvhost_staging_pages 0", "[1, 4096]"], kvhost_staging_pages=0)
    refused(daemon, host, ["kvhost_timeout_s 'long'"], kvhost_timeout_s="long")
    refused(daemon, host, ["kvhost_cache ''"], kvhost_cache="")
    refused(daemon, host, ["no owner token"], kvhost_owner_token=None)
    missing = str(tmp_path / "none")
    refused(daemon, host, [f"kvhost_owner_token_file {missing!r}"], kvhost_owner_token=None,
            kvhost_owner_token_file=missing)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    refused(daemon, host, ["not both"], kvhost_owner_token_file=str(token_file))
    ok = make_backend(daemon, host, kvhost_owner_token=None,
                      kvhost_owner_token_file=str(token_file))
    ok.close()
    with pkg.client(daemon, owner_token=TOKEN) as admin:  # a cache of another shape
        admin.create_pool("wide", dict(pkg.SPEC, head_dim=16, node_cache=True))
    refused(daemon, host, ["pool 'kv'", "head_dim 16, not 8"], kvhost_cache="wide")
    with pkg.client(daemon, owner_token="other") as squatter:
        squatter.create_pool("squat", dict(pkg.SPEC, node_cache=True))
    refused(daemon, host, ["'squat'", "owner token"], kvhost.PermissionDenied,
            kvhost_cache="squat")
    unified = kvhost_pool(daemon, "unified", layout="page_unified")
    anchor = kvhost_pool(daemon, "anchor")
    k_only = kvhost.sglang.MHATokenToKOnlyPoolHost("k-only", anchor, head_num=HEADS,
                                                    head_dim=DIM, layout="page_first",
                                                    layer_num=LAYERS)
    try:
        refused(daemon, unified, ["layout 'page_unified'"])
        refused(daemon, k_only, ["MHATokenToKOnlyPoolHost: a page of 192 elements, not the "
                                 "384 of MHA"])  # MiniMax's index-K pool: no V
    finally:
        for pool in (k_only, anchor, unified):
            pool.close()
        anchor.test_client.close()
        unified.test_client.close()
    names = [p["name"] for p in pkg.client(daemon).list_pools()]
    assert "sglang-cache" in names, names

    memory = types.SimpleNamespace(hicache_storage_backend="dynamic",
                                   hicache_storage_backend_extra_config='{"module_path": '
                                   '"kvhost.sglang.storage_backend"}')
    assert plugin._storage_refusals(memory) == []
    memory.hicache_storage_backend_extra_config = '{"module_path": "other.backend"}'
    assert "module_path 'other.backend'" in plugin._storage_refusals(memory)[0]
    assert plugin._allocator_refusals("dynamic") == [] and plugin._allocator_refusals("shm")


# --- failures ------------------------------------------------------------------------


def test_a_refused_store_and_a_lost_daemon_change_nothing(daemon, caplog):
    host = sglang_mha_pool("page_first")
    # A cache of 2 pages (192 bytes a token, 8 tokens).
    backend = make_backend(daemon, host, kvhost_cache="tiny",
                           kvhost_cache_size_gib=8 * 192 / (1 << 30))
    other = pkg.client(daemon, session=True, owner_token=TOKEN)
    try:
        slots = page_slots(2)
        fill_pages(host, slots[::PS], seed=6)
        assert backend.batch_set_v1(["p0", "p1"], slots) == [True, True]
        suffixed = backend._keys(["p0", "p1"], backend._lanes["kv"])
        pin = other.node_cache("tiny").lookup(suffixed, pin=True)  # another instance reads
        assert pin.prefix == 2
        before = backend.cache_stats()
        # Both pages pinned: no room for more. The daemon refuses the store.
        assert backend.batch_set_v1(["p2", "p3"], slots) == [False, False]
        assert "store of 2 pages (from p2) failed: RESOURCE_EXHAUSTED" in caplog.text, \
            caplog.text
        after = backend.cache_stats()
        assert (after.published, after.stored, after.writing) == \
            (before.published, before.stored, 0), (before, after)
        assert backend.batch_exists(["p0", "p1", "p2"]) == 2
        other.node_cache("tiny").release_pin(pin.pin_id)

        dest = page_slots(2, first=6)
        fill_pages(host, dest[::PS], seed=7)
        kept = canonical_pages(host, dest[::PS])
        daemon.restart()  # the cache (kvhostd's memory) is gone, and the session
        assert backend.batch_get_v1(["p0", "p1"], dest) == [False, False]
        got = canonical_pages(host, dest[::PS])
        assert all(torch.equal(x, y) for x, y in zip(got, kept)), "a failed restore wrote"
        assert "restore of 2 pages (from p0) failed: NOT_FOUND" in caplog.text, caplog.text
        assert backend.batch_exists(["p0", "p1"]) == 0
        # The session's loss seen, the backend makes the cache again (empty).
        assert backend.batch_set_v1(["p0"], slots[:PS]) == [True]
        assert backend.batch_exists(["p0", "p1"]) == 1
        # Two more in a cache of two pages: p0 evicted, and no longer tracked.
        assert backend.batch_set_v1(["p1"], slots[:PS]) == [True]
        assert backend.batch_set_v1(["p2"], slots[:PS]) == [True]
        assert list(backend._stored["kv"]) == backend._keys(["p1", "p2"], backend._lanes["kv"])
        assert backend.clear() is True and backend.batch_exists(["p1"]) == 0
    finally:
        other.close()
        backend.close()
