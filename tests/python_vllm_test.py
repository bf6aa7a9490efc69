#!/usr/bin/env python3
"""kvhost.vllm (vLLM's KV offloading into kvhostd's node cache) against the
pinned vLLM 0.33.0 (python/requirements-engines.txt) and a host-backend
kvhostd. vLLM's own classes do the driving wherever they run without a GPU:

  factory   vLLM's OffloadingSpecFactory.create_spec (vllm/v1/kv_offload/
            factory.py) builds KvhostOffloadingSpec from
            kv_connector_extra_config's spec_module_path, and by name once
            vLLM's own plugin loader (vllm/plugins/__init__.py
            load_general_plugins) ran kvhost's vllm.general_plugins entry
            point, pip-installed from python/ into a scratch directory;
            building a spec connects to nothing;
  config    bad settings, an unsupported vLLM release, canonical_layout and
            two KV cache groups are refused at construction, by name;
  share     two instances (two specs, each its scheduler-side manager and its
            worker with their own kvhost sessions and device memory) share a
            prefix byte-exact: one stores through vLLM's
            OffloadingConnectorWorker (.../kv_connector/v1/offloading/
            worker.py: prepare_store_kv, start_kv_transfers, get_finished,
            build_connector_worker_meta), the other looks it up (HIT), loads
            it into other blocks, asynchronously and as a sync load;
  restart   a new spec, manager and worker on the same kvhostd find them;
  chunks    blocks_per_chunk 2, a load that starts mid-chunk
            (GPULoadStoreSpec.block_indices) and one that ends mid-chunk;
  tp        two ranks store their own shards: a chunk is a HIT only once
            both are in; replicated_layout (MLA under TP) is one shard;
  evict     a full cache evicts the least recently used chunks, and the
            manager reports them (prepare_store's evicted_keys,
            take_events) as vLLM's CPU manager does;
  errors    a kvhost error (a key gone, the daemon gone) is a
            TransferResult(success=False), never an exception from submit.

Stand-ins, for what cannot run without a GPU or a model: the canonical KV
tensors are CPU tensors over a kvhost ShmDevicePool (the host backend's
device memory) handed to OffloadingConnectorWorker._init_worker, as its
register_kv_caches would after deriving them from a model's GPU KV cache
(worker.py); and the scheduler's calls are played here in the order
OffloadingConnectorScheduler makes them (scheduler.py: lookup per chunk in
_maximal_prefix_lookup, prepare_load in update_state_after_alloc,
prepare_store in _build_store_jobs, complete_store / complete_load in
_update_connector_output), so that each case picks its blocks, chunks and
ranks; python_vllm_engine_test.py runs vLLM's own Scheduler and
OffloadingConnectorScheduler over the spec. vLLM's own offloading tests are
not in its wheel (docs/VLLM.md says what of its sdist could run here).

  usage: python_vllm_test.py KVHOSTD LIBKVHOST_C SOURCE_DIR [PYTEST_ARGS...]
  (ctest runs it so; it re-executes itself under the engine venv)
"""
import os
import subprocess
import sys
import tempfile
import time

TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TESTS)
if __name__ == "__main__" and len(sys.argv) >= 4:  # ctest: into the engine venv first
    import engine_env
    engine_env.enter_with(os.path.abspath(sys.argv[3]), "vllm")

import pytest  # noqa: E402

vllm_base = pytest.importorskip(
    "vllm.v1.kv_offload.base",
    reason="vllm is not installed in this venv (scripts/engine_venv.sh builds the engine venv "
           "from python/requirements-engines.txt, which pins vllm==0.33.0)")
import torch  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (  # noqa: E402
    OffloadingConnectorMetadata, TransferJob)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (  # noqa: E402
    OffloadingConnectorWorker)
from vllm.v1.kv_offload import config as vcfg  # noqa: E402
from vllm.v1.kv_offload.base import (CanonicalKVCacheRef, CanonicalKVCaches,  # noqa: E402
                                     CanonicalKVCacheTensor, GPULoadStoreSpec, LookupResult,
                                     ReqContext, make_offload_key)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402

import kvhost  # noqa: E402
import kvhost.vllm as kv  # noqa: E402

TOKEN = "vllm-test-token"
LAYERS, ROW, BLOCKS = 3, 256, 32  # 3 canonical tensors of 32 blocks of 256 bytes
MODULE_PATH = {"spec_name": "KvhostOffloadingSpec", "spec_module_path": "kvhost.vllm"}


def offload_config(daemon=None, engine="e0", bpc=1, rank=0, world=1, replicated=False,
                   groups=1, cache_bytes=1 << 20, events=True, **extra):
    """vLLM 0.33's OffloadingConfig (vllm/v1/kv_offload/config.py), as
    build_offloading_config makes it for a one-group model."""
    settings = {"kvhost_address": daemon.address if daemon else "unix:///nonexistent",
                "kvhost_owner_token": TOKEN, "kvhost_cache_bytes": cache_bytes,
                **MODULE_PATH, **extra}
    return vcfg.OffloadingConfig(
        groups=tuple(vcfg.OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0",),
                                                group_id=g) for g in range(groups)),
        worker_kv_bytes_per_block=LAYERS * ROW, enable_kv_cache_events=events,
        extra_config=settings, engine_id=engine,
        model=vcfg.OffloadingModelConfig(name="test-model", dtype="bfloat16"),
        cache=vcfg.OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=bpc),
        parallel=vcfg.OffloadingParallelConfig(
            rank=rank, world_size=world, tp_size=world, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=not replicated),
        replicated_layout=replicated, kv_cache_layout="LBHNC")


def chunk(i):
    """vLLM's OffloadKey of the i-th chunk of the test's prompt."""
    return make_offload_key(i.to_bytes(4, "big") * 8, 0)


class Instance:
    """One vLLM instance's kvhost side: the spec vLLM's factory builds, its
    manager (scheduler) and vLLM's OffloadingConnectorWorker over our worker,
    with host-backend device memory (the stand-in for GPU KV tensors)."""

    def __init__(self, daemon, **config):
        self.spec = OffloadingSpecFactory.create_spec(offload_config(daemon, **config))
        assert isinstance(self.spec, kv.KvhostOffloadingSpec)
        self.manager = self.spec.get_manager()
        self.device_client = kvhost.Client(daemon.address, session=False, owner_token=TOKEN)
        kv.CacheLayout([None] * LAYERS, ROW, BLOCKS).ensure_pool(
            self.device_client, self.spec.cache_name, config.get("cache_bytes", 1 << 20))
        self.shm = self.device_client.shm_device_pool(self.spec.cache_name, BLOCKS, daemon.shm)
        kv.register_shm_device_pool(self.shm)
        self.tensors = [torch.frombuffer(self.shm.layer_view("latent", i), dtype=torch.int8)
                        .view(BLOCKS, ROW) for i in range(LAYERS)]
        caches = CanonicalKVCaches([CanonicalKVCacheTensor(t, ROW) for t in self.tensors],
                                   [[CanonicalKVCacheRef(i, ROW) for i in range(LAYERS)]])
        # vLLM's worker-side connector; register_kv_caches would derive
        # `caches` from a model's GPU KV cache, then call this.
        self.connector = OffloadingConnectorWorker(self.spec, None, None)
        self.connector._init_worker(caches)
        self.jobs = 0

    def fill(self, block, seed):
        for layer, t in enumerate(self.tensors):
            t[block] = torch.arange(ROW, dtype=torch.int32).add(seed * 7 + layer).remainder(
                251).to(torch.int8)

    def block(self, block):
        return [t[block].clone() for t in self.tensors]

    def _run(self, metadata, want_job, sync=False):
        """Runs a job through vLLM's connector worker until it reports it."""
        if metadata.store_jobs:
            self.connector.prepare_store_kv(metadata)  # deferred to the next step
            metadata = OffloadingConnectorMetadata(load_jobs={}, store_jobs={})
        self.connector.start_kv_transfers(metadata)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            self.connector.get_finished(set())
            meta = self.connector.build_connector_worker_meta()
            if meta is not None and want_job in meta.completed_jobs:
                return meta
            assert not sync, "a sync load was not finished when start_kv_transfers returned"
            time.sleep(0.005)
        raise AssertionError(f"job {want_job} did not finish")

    def store(self, chunks, block_ids, first=0, req="r"):
        """vLLM's scheduler's store of `chunks` from GPU blocks `block_ids`."""
        ctx = ReqContext(req_id=req)
        out = self.manager.prepare_store(chunks, ctx)
        assert out is not None
        if out.keys_to_store:
            self.jobs += 1
            src = GPULoadStoreSpec(block_ids, group_sizes=[len(block_ids)], block_indices=[first])
            job = TransferJob(req_id=req, src_spec=src, dst_spec=out.store_spec)
            self._run(OffloadingConnectorMetadata(load_jobs={}, store_jobs={self.jobs: job}),
                      self.jobs)
            self.manager.complete_store(out.keys_to_store, ctx)
        return out

    def load(self, chunks, block_ids, first=0, req="r", sync=False):
        """vLLM's scheduler's load of `chunks` into GPU blocks `block_ids`."""
        ctx = ReqContext(req_id=req)
        with self.manager.lock:
            assert [self.manager.lookup(c, ctx) for c in chunks] == [LookupResult.HIT] * len(
                chunks)
            src = self.manager.prepare_load(chunks, ctx)
        self.jobs += 1
        dst = GPULoadStoreSpec(block_ids, group_sizes=[len(block_ids)], block_indices=[first])
        job = TransferJob(req_id=req, src_spec=src, dst_spec=dst, sync=sync)
        self._run(OffloadingConnectorMetadata(load_jobs={self.jobs: job}, store_jobs={}),
                  self.jobs, sync=sync)
        self.manager.complete_load(chunks, ctx)

    def close(self):
        self.connector.shutdown()
        self.manager.shutdown()
        self.shm.close()
        self.device_client.close()


@pytest.fixture
def instances(daemon):
    made = []

    def make(**config):
        made.append(Instance(daemon, **config))
        return made[-1]
    yield make
    for inst in made:
        inst.close()


def install_plugin(source_dir):
    """kvhost's package with its entry points, installed as pip would."""
    target = tempfile.mkdtemp(prefix="kvhost-vllm-plugin-")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    "--no-build-isolation", "--no-index", "--target", target,
                    os.path.join(source_dir, "python")], check=True)
    return target


def test_factory_builds_the_spec_by_module_path_and_by_plugin_name(source_dir, monkeypatch):
    spec = OffloadingSpecFactory.create_spec(offload_config())  # an address nobody serves
    assert isinstance(spec, kv.KvhostOffloadingSpec) and spec.shard == 0
    assert spec.cache_name == spec.namespace.default_cache_name()
    assert spec._manager is None and spec._worker is None  # nothing connected
    # By name alone: vLLM's own loader runs the installed entry point.
    target = install_plugin(source_dir)
    monkeypatch.syspath_prepend(target)
    monkeypatch.setenv("VLLM_PLUGINS", "kvhost")
    import importlib.metadata  # noqa: PLC0415
    assert any(e.name == "kvhost" for e in importlib.metadata.entry_points(
        group="vllm.general_plugins"))
    import vllm.plugins  # noqa: PLC0415
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    OffloadingSpecFactory._registry.pop("KvhostOffloadingSpec", None)
    vllm.plugins.load_general_plugins()
    assert "KvhostOffloadingSpec" in OffloadingSpecFactory._registry
    by_name = offload_config()
    by_name.extra_config.pop("spec_module_path")
    assert type(OffloadingSpecFactory.create_spec(by_name)).__name__ == "KvhostOffloadingSpec"


@pytest.mark.parametrize("extra, naming", [
    ({"kvhost_cache_bytes": -1}, "kv_connector_extra_config['kvhost_cache_bytes'] = -1"),
    ({"kvhost_cache_bytes": "4G"}, "'kvhost_cache_bytes'] = '4G' is not a positive integer"),
    ({"kvhost_timeout_s": 0}, "'kvhost_timeout_s'] = 0 is not a positive number"),
    ({"kvhost_cache": ""}, "'kvhost_cache'] = '' is not a non-empty string"),
    ({"kvhost_adress": "x"}, "'kvhost_adress'] = 'x' is not a kvhost setting"),
    ({"kvhost_owner_token": None}, "'kvhost_owner_token'] = None is not set"),
    ({"canonical_layout": True}, "'canonical_layout'] = True is not supported"),
])
def test_bad_config_is_refused_by_name(extra, naming, monkeypatch):
    monkeypatch.delenv("KVHOST_OWNER_TOKEN", raising=False)
    config = offload_config(**extra)
    if extra.get("canonical_layout"):
        config = vcfg.OffloadingConfig(**{**config.__dict__, "canonical_layout": True})
    with pytest.raises(ValueError, match=None) as e:
        OffloadingSpecFactory.create_spec(config)
    assert naming in str(e.value), e.value


def test_the_owner_token_comes_from_a_file(tmp_path, monkeypatch):
    monkeypatch.delenv("KVHOST_OWNER_TOKEN", raising=False)
    from kvhost.vllm.settings import Settings  # noqa: PLC0415
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    extra = {"kvhost_owner_token_file": str(token)}
    assert Settings.from_extra_config(extra).owner_token == TOKEN
    with pytest.raises(ValueError, match="give one of them"):
        Settings.from_extra_config({**extra, "kvhost_owner_token": TOKEN})
    token.write_text(" \n")
    with pytest.raises(ValueError, match=r"kvhost_owner_token_file'\] = .* it is empty"):
        Settings.from_extra_config(extra)
    with pytest.raises(ValueError, match="No such file"):
        Settings.from_extra_config({"kvhost_owner_token_file": str(tmp_path / "none")})


def test_two_groups_and_an_unsupported_release_are_refused(monkeypatch):
    with pytest.raises(ValueError, match="2 KV cache groups to offload"):
        kv.KvhostOffloadingSpec(offload_config(groups=2))
    import vllm  # noqa: PLC0415
    monkeypatch.setattr(vllm, "__version__", "0.32.1")
    with pytest.raises(RuntimeError, match=r"vLLM 0\.32\.1 is not supported .*docs/VLLM\.md"):
        kv.KvhostOffloadingSpec(offload_config())


def test_two_instances_share_a_prefix_byte_exact(instances):
    a, b = instances(engine="a"), instances(engine="b")
    assert a.spec.cache_name == b.spec.cache_name  # the same model: the same cache
    chunks = [chunk(i) for i in range(4)]
    ctx = ReqContext(req_id="probe")
    assert b.manager.lookup(chunks[0], ctx) == LookupResult.MISS
    for i in range(4):
        a.fill(10 + i, seed=i)
    out = a.store(chunks, [10, 11, 12, 13])
    assert out.keys_to_store == chunks and out.evicted_keys == []
    assert a.manager._pending() == (0, 0)
    again = a.store(chunks, [10, 11, 12, 13])  # present: nothing to store
    assert again.keys_to_store == []
    b.load(chunks[:2], [3, 4])                         # asynchronously
    b.load(chunks[2:], [20, 21], req="sync", sync=True)  # a sync load, waited within the step
    for src, dst in ((10, 3), (11, 4), (12, 20), (13, 21)):
        assert all(torch.equal(x, y) for x, y in zip(a.block(src), b.block(dst))), (src, dst)
    assert b.manager._pending() == (0, 0)  # the loads' pins released


def test_a_restarted_instance_finds_its_blocks(daemon, instances):
    first = Instance(daemon, engine="first")
    first.fill(5, seed=42)
    first.store([chunk(7)], [5])
    want = first.block(5)
    first.close()
    again = instances(engine="first")  # new spec, manager, worker and sessions
    again.load([chunk(7)], [9])
    assert all(torch.equal(x, y) for x, y in zip(want, again.block(9)))


def test_blocks_per_chunk_two_loads_mid_chunk(instances):
    a, b = instances(engine="a", bpc=2), instances(engine="b", bpc=2)
    for blk in range(6):
        a.fill(blk, seed=100 + blk)
    a.store([chunk(0), chunk(1), chunk(2)], [0, 1, 2, 3, 4, 5])
    # The first GPU block computed already (prefix cache): the load starts at
    # block 1 of chunk 0, and the store's layout puts blocks 1..5 in 8..12.
    b.load([chunk(0), chunk(1), chunk(2)], [8, 9, 10, 11, 12], first=1)
    for src, dst in zip(range(1, 6), range(8, 13)):
        assert all(torch.equal(x, y) for x, y in zip(a.block(src), b.block(dst))), (src, dst)
    b.load([chunk(2)], [14], first=4)  # ends mid-chunk: chunk 2's first block only
    assert all(torch.equal(x, y) for x, y in zip(a.block(4), b.block(14)))
    # A store starting mid-chunk writes the chunk's later block only: that
    # chunk is no HIT until its first block is in too.
    a.fill(6, seed=7)
    a.store([chunk(3)], [6], first=1)
    ctx = ReqContext(req_id="probe")
    assert b.manager.lookup(chunk(3), ctx) == LookupResult.MISS
    a.store([chunk(3)], [7, 6])
    assert b.manager.lookup(chunk(3), ctx) == LookupResult.HIT


def test_tensor_parallel_ranks_store_their_own_shards(instances):
    r0 = instances(engine="tp", rank=0, world=2)
    r1 = instances(engine="tp", rank=1, world=2)
    assert r0.spec.cache_name == r1.spec.cache_name and (r0.spec.shard, r1.spec.shard) == (0, 1)
    ctx = ReqContext(req_id="probe")
    r0.fill(1, seed=1)
    r1.fill(1, seed=2)  # rank 1's slice of the same block
    r0.store([chunk(0)], [1])
    assert r0.manager.lookup(chunk(0), ctx) == LookupResult.MISS  # rank 1's shard missing
    r1.connector.worker.submit_store(99, GPULoadStoreSpec([1], [1], [0]),
                                     kv.KvhostLoadStoreSpec([chunk(0)]))
    r1.connector.worker.wait({99})
    assert [r.success for r in r1.connector.worker.get_finished()] == [True]
    assert r0.manager.lookup(chunk(0), ctx) == LookupResult.HIT
    # Each rank restores its own slice.
    r0.load([chunk(0)], [2])
    r1.connector.worker.submit_load(100, kv.KvhostLoadStoreSpec([chunk(0)]),
                                    GPULoadStoreSpec([2], [1], [0]))
    r1.connector.worker.wait({100})
    assert [r.success for r in r1.connector.worker.get_finished()] == [True]
    assert all(torch.equal(x, y) for x, y in zip(r0.block(1), r0.block(2)))
    assert all(torch.equal(x, y) for x, y in zip(r1.block(1), r1.block(2)))
    assert not all(torch.equal(x, y) for x, y in zip(r0.block(2), r1.block(2)))
    # MLA under TP: vLLM says the bytes are the same; one shard, rank 0's.
    mla = kv.KvhostOffloadingSpec(offload_config(rank=1, world=2, replicated=True))
    assert mla.replicated_layout and mla.shard == 0 and mla.namespace.shards == 1
    assert OffloadingConnectorWorker(mla, None, None)._is_store_writer is False


def test_a_full_cache_evicts_and_the_manager_reports_it(instances):
    # Room for 4 blocks: the fifth and sixth chunks evict the two oldest.
    a = instances(engine="a", cache_bytes=4 * LAYERS * ROW)
    ctx = ReqContext(req_id="probe")
    a.store([chunk(i) for i in range(4)], [0, 1, 2, 3])
    stored = list(a.manager.take_events())
    assert [(e.removed, sorted(e.keys)) for e in stored] == [
        (False, sorted(chunk(i) for i in range(4)))]
    a.store([chunk(4), chunk(5)], [4, 5])
    out = a.manager.prepare_store([chunk(6)], ctx)
    assert sorted(out.evicted_keys) == sorted([chunk(0), chunk(1)]), out.evicted_keys
    a.manager.complete_store(out.keys_to_store, ctx, success=False)  # a failed store
    assert a.manager.lookup(chunk(6), ctx) == LookupResult.MISS
    events = list(a.manager.take_events())
    assert [(e.removed, sorted(e.keys)) for e in events] == [
        (False, sorted([chunk(4), chunk(5)])), (True, sorted([chunk(0), chunk(1)]))], events
    assert a.manager.lookup(chunk(0), ctx) == LookupResult.MISS
    assert a.manager.lookup(chunk(5), ctx) == LookupResult.HIT
    a.manager.reset_cache()  # evicts what this manager stored
    assert a.manager.lookup(chunk(5), ctx) == LookupResult.MISS


def test_kvhost_errors_are_failed_transfers(daemon, instances):
    a = instances(engine="a", kvhost_timeout_s=2)
    worker = a.connector.worker
    ctx = ReqContext(req_id="r")
    assert a.manager.lookup(chunk(1), ctx) == LookupResult.MISS
    spec = a.manager.prepare_load([chunk(1)], ctx)  # not present: the restore fails
    assert worker.submit_load(1, spec, GPULoadStoreSpec([0], [1], [0])) is True
    worker.wait({1})
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(1, False)]
    a.manager.complete_load([chunk(1)], ctx)
    # A job whose GPU blocks do not match its chunks: refused, no exception.
    assert worker.submit_store(2, GPULoadStoreSpec([0, 1], [2], [0]),
                               kv.KvhostLoadStoreSpec([chunk(2)])) is True
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(2, False)]
    daemon.stop()  # the daemon gone: the scheduler misses, stores are refused
    assert a.manager.lookup(chunk(1), ctx) == LookupResult.MISS
    assert a.manager.prepare_store([chunk(3)], ctx) is None
    assert worker.submit_store(3, GPULoadStoreSpec([0], [1], [0]),
                               kv.KvhostLoadStoreSpec([chunk(3)])) is True
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(3, False)]
    daemon.start()


def test_the_load_store_spec_pickles():
    import pickle  # noqa: PLC0415
    spec = kv.KvhostLoadStoreSpec([chunk(1), chunk(2)])
    assert pickle.loads(pickle.dumps(spec)) == spec and len(spec) == 2


def main():
    if len(sys.argv) < 4:
        print(__doc__)
        return 2
    kvhostd, lib, src = (os.path.abspath(a) for a in sys.argv[1:4])
    os.environ.update(KVHOST_TEST_KVHOSTD=kvhostd, KVHOST_LIBRARY=lib,
                      KVHOST_TEST_SOURCE_DIR=src)
    rc = pytest.main([os.path.abspath(__file__), "-p", "no:cacheprovider", "-rs", "-v",
                      *sys.argv[4:]])
    return 1 if rc == 5 else int(rc)


if __name__ == "__main__":
    sys.exit(main())
