#!/usr/bin/env python3
"""kvhost.vllm's worker with real CUDA KV tensors, through vLLM 0.33.0's own
interfaces, against a fresh kvhostd --backend=cuda (not in CI: the lead runs
it on a GPU machine; docs/VLLM.md "Measured" has its figures).

For block sizes of 16 and 64 tokens (a Llama-8B-like layer: 8 KV heads of
128, bf16, K and V; 32 canonical tensors, one per layer, as vLLM's
OffloadingConnectorWorker.register_kv_caches makes them for the LBHNC layout,
vllm/distributed/kv_transfer/kv_connector/v1/offloading/worker.py):
  - vLLM's OffloadingSpecFactory builds KvhostOffloadingSpec from
    spec_module_path; vLLM's OffloadingConnectorWorker gets its worker
    (_init_worker: the stand-in for register_kv_caches, which needs a model);
  - stores behind the model's writes: a GPU sleep, then the blocks written on
    the current stream, then submit_store at once (no host sync): kvhostd's
    copies wait for the worker's event, so the cache must hold what was
    written after the sleep;
  - loads into other blocks, byte for byte (torch.equal on the GPU), through
    the manager's lookup / prepare_load as vLLM's scheduler makes them;
  - a table: submit latency p50 (the submit_* call) and GB/s (submit to
    get_finished reporting it), per block size, for jobs of 1 and 64 blocks;
    beside vLLM's own CPU offloading worker (cpu/gpu_worker.py
    CPUOffloadingWorker) where its compiled ops import, else why not.
Python: one that imports vllm (on the GPU machine, the venv gpu_run.sh's sglang
step makes from enginez/vllm-wheels-cp312.tar.xz, docs/VLLM.md); else, where that
tarball ($KVHOST_VLLM_WHEELS) is there, its wheels are installed into a scratch
directory on this python's path; else the engine venv (tests/engine_env.py).
Skips (exit 77) without an NVIDIA GPU; with one, anything not working fails.
  usage: python_vllm_gpu_test.py KVHOSTD LIBKVHOST_C SOURCE_DIR
"""
import importlib.util
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import engine_env  # noqa: E402

SKIP = 77
LAYERS, KV_HEADS, HEAD_DIM = 32, 8, 128
BLOCKS = 1024            # GPU blocks per tensor (4 GiB of KV at 64 tokens)
BIG_JOB, ROUNDS = 64, 10  # blocks per job; jobs per measurement
SLEEP_CYCLES = 200_000_000  # ~0.1 s on an H100
TOKEN = "vllm-gpu-test"


def install_vllm_wheels(source_dir):
    """vllm and its imports from scripts/engine_wheels_gpu.sh's tarball, into
    a scratch directory first on sys.path; False when there is none."""
    tar = os.environ.get("KVHOST_VLLM_WHEELS") or os.path.join(
        source_dir, "enginez", "vllm-wheels-cp312.tar.xz")
    if not os.path.exists(tar):
        return False
    scratch = tempfile.mkdtemp(prefix="kvhost-vllm-")
    with tarfile.open(tar) as t:
        t.extractall(os.path.join(scratch, "wheels"))
    wheels = sorted(os.path.join(scratch, "wheels", w)
                    for w in os.listdir(os.path.join(scratch, "wheels")) if w.endswith(".whl"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                    "--target", os.path.join(scratch, "site"), *wheels], check=True)
    sys.path.insert(0, os.path.join(scratch, "site"))
    print(f"vllm from {tar} ({len(wheels)} wheels)")
    return True


# vLLM's compiled ops, which vllm.platforms.cuda imports when it resolves
# the platform (vllm/platforms/cuda.py: `import vllm._C_stable_libtorch`):
# built for torch 2.14.0, not carried to the GPU machine (docs/VLLM.md) and
# not loadable on its torch 2.11. kvhost.vllm and the offloading interfaces
# this test drives call none of them.
COMPILED_OPS = ("vllm._C_stable_libtorch", "vllm._C")


def stand_in_compiled_ops():
    """Empty modules for COMPILED_OPS where the real ones do not import (our
    stand-ins, named here and printed); the names of those stood in for."""
    import types  # noqa: PLC0415
    stood = []
    for name in COMPILED_OPS:
        try:
            importlib.import_module(name)
        except ImportError:
            sys.modules[name] = types.ModuleType(name)
            stood.append(name)
    return stood


def offload_config(daemon, block_tokens):
    from vllm.v1.kv_offload import config as c  # noqa: PLC0415
    page = 2 * block_tokens * KV_HEADS * HEAD_DIM * 2
    return c.OffloadingConfig(
        groups=(c.OffloadingGroupConfig(tokens_per_block=block_tokens,
                                        layer_names=tuple(f"l{i}" for i in range(LAYERS)),
                                        group_id=0),),
        worker_kv_bytes_per_block=LAYERS * page, enable_kv_cache_events=False,
        extra_config={"spec_name": "KvhostOffloadingSpec", "spec_module_path": "kvhost.vllm",
                      "kvhost_address": daemon.address, "kvhost_owner_token": TOKEN,
                      "kvhost_cache_bytes": (ROUNDS * (BIG_JOB + 1) + 16) * LAYERS * page},
        engine_id=f"gpu-{block_tokens}",
        model=c.OffloadingModelConfig(name="llama-8b-like", dtype="bfloat16"),
        cache=c.OffloadingCacheConfig(tokens_per_hash=block_tokens, blocks_per_chunk=1),
        parallel=c.OffloadingParallelConfig(
            rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=True),
        kv_cache_layout="LBHNC")


def canonical(torch, page):
    """32 per-layer canonical tensors (num_blocks, page) int8 on GPU 0."""
    from vllm.v1.kv_offload.base import (CanonicalKVCacheRef, CanonicalKVCaches,  # noqa
                                         CanonicalKVCacheTensor)
    tensors = [torch.zeros((BLOCKS, page), dtype=torch.int8, device="cuda")
               for _ in range(LAYERS)]
    return tensors, CanonicalKVCaches([CanonicalKVCacheTensor(t, page) for t in tensors],
                                      [[CanonicalKVCacheRef(i, page) for i in range(LAYERS)]])


def run_job(worker, job_id, submit):
    """(submit seconds, seconds until get_finished reported it)."""
    t0 = time.perf_counter()
    assert submit() is True
    t1 = time.perf_counter()
    while True:
        done = {r.job_id: r for r in worker.get_finished()}
        if job_id in done:
            assert done[job_id].success, f"job {job_id} failed"
            return t1 - t0, time.perf_counter() - t0


def measure(worker, specs, page, label, rows, blocks=BLOCKS, layers=LAYERS):
    """Stores then loads jobs of 1 and BIG_JOB blocks: a row per (op, size)
    (also scripts/vllm_submit_latency.py's, on the host backend)."""
    from vllm.v1.kv_offload.base import GPULoadStoreSpec  # noqa: PLC0415
    job = 10_000
    for n in (1, BIG_JOB):
        for op in ("store", "load"):
            submits, totals = [], []
            for r in range(ROUNDS):
                first = r * n % (blocks - n)
                ids = list(range(first, first + n))
                gpu = GPULoadStoreSpec(ids, group_sizes=[n], block_indices=[0])
                other = specs(n, r, op)
                job += 1
                if op == "store":
                    s, t = run_job(worker, job, lambda: worker.submit_store(job, gpu, other))
                else:
                    s, t = run_job(worker, job, lambda: worker.submit_load(job, other, gpu))
                submits.append(s)
                totals.append(t)
            gbs = n * layers * page / statistics.median(totals) / 1e9
            rows.append((label, op, n, statistics.median(submits) * 1e6,
                         statistics.median(totals) * 1e3, gbs))


def check_kvhost(torch, daemon, block_tokens, rows):
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (  # noqa
        OffloadingConnectorWorker)
    from vllm.v1.kv_offload.base import GPULoadStoreSpec, LookupResult, ReqContext  # noqa
    from vllm.v1.kv_offload.base import make_offload_key  # noqa: PLC0415
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: PLC0415
    page = 2 * block_tokens * KV_HEADS * HEAD_DIM * 2
    spec = OffloadingSpecFactory.create_spec(offload_config(daemon, block_tokens))
    tensors, caches = canonical(torch, page)
    connector = OffloadingConnectorWorker(spec, None, None)
    connector._init_worker(caches)  # register_kv_caches' last step
    worker, manager = connector.worker, spec.get_manager()
    assert type(worker).__name__ == "KvhostOffloadingWorker", type(worker)
    # Behind the model's writes: sleep, write, submit at once.
    ctx = ReqContext(req_id="fence")
    keys = [make_offload_key(b"fence-%d" % i + bytes(24), 0) for i in range(8)]
    out = manager.prepare_store(keys, ctx)
    assert out.keys_to_store == keys
    torch.cuda._sleep(SLEEP_CYCLES)
    for t in tensors:
        t[:8].random_(-128, 127)
    want = [t[:8].clone() for t in tensors]
    run_job(worker, 1, lambda: worker.submit_store(1, GPULoadStoreSpec(list(range(8)), [8], [0]),
                                                   out.store_spec))
    manager.complete_store(keys, ctx)
    assert [manager.lookup(k, ctx) for k in keys] == [LookupResult.HIT] * 8
    src = manager.prepare_load(keys, ctx)
    run_job(worker, 2, lambda: worker.submit_load(2, src, GPULoadStoreSpec(
        list(range(100, 108)), [8], [0])))
    manager.complete_load(keys, ctx)
    torch.cuda.synchronize()
    for layer, t in enumerate(tensors):
        assert torch.equal(t[100:108], want[layer]), f"layer {layer}: loaded != written"
    print(f"ok   {block_tokens}-token blocks: stored behind a GPU sleep, loaded byte for byte")
    from kvhost.vllm import KvhostLoadStoreSpec  # noqa: PLC0415

    def chunks(n, r, op):  # a load's are those its store round wrote
        return KvhostLoadStoreSpec(make_offload_key(b"%d-%d-%d-%d" % (block_tokens, n, r, i)
                                                    + bytes(20), 0) for i in range(n))
    measure(worker, chunks, page, f"kvhost {block_tokens}", rows)
    connector.shutdown()
    manager.shutdown()


def check_vllm_cpu(torch, block_tokens, rows):
    """vLLM's own CPU offloading worker on the same shapes, or why not."""
    page = 2 * block_tokens * KV_HEADS * HEAD_DIM * 2
    try:
        from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec  # noqa: PLC0415
        from vllm.v1.kv_offload.cpu.gpu_worker import CPUOffloadingWorker  # noqa: PLC0415
        _, caches = canonical(torch, page)
        worker = CPUOffloadingWorker(caches, blocks_per_chunk=1,
                                     num_cpu_chunks=ROUNDS * BIG_JOB)
        measure(worker, lambda n, r, op: CPULoadStoreSpec(list(range(r * n, r * n + n))),
                page, f"vLLM CPU {block_tokens}", rows)
        worker.shutdown()
    except Exception as e:  # its compiled ops (vllm/_C*.so) are not carried (stood in)
        print(f"note: vLLM's CPU offloading worker not measured ({block_tokens}-token "
              f"blocks): {type(e).__name__}: {e}")


def main():
    kvhostd, lib, source_dir = sys.argv[1:4]
    from python_sglang_gpu_engine_test import cuda_devices  # noqa: PLC0415
    devices, why = cuda_devices()
    if not devices:
        print(f"SKIP: {why}")
        return SKIP
    if importlib.util.find_spec("vllm") is None and not install_vllm_wheels(source_dir):
        engine_env.enter(source_dir)  # a machine with the engine venv
    os.environ["KVHOST_LIBRARY"] = lib
    sys.path.insert(0, os.path.join(source_dir, "python"))
    import torch  # noqa: PLC0415
    assert torch.cuda.is_available(), f"a GPU is there but torch {torch.__version__} cannot " \
                                      f"use it"
    import kvhost  # noqa: PLC0415
    import vllm  # noqa: PLC0415
    assert kvhost.built_with_cuda(), f"{lib} was built without CUDA"
    print(f"vllm {vllm.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name(0)}")
    stood = stand_in_compiled_ops()
    if stood:
        print(f"stand-ins (empty modules) for vLLM's compiled ops: {', '.join(stood)}")
    from kvhost_testing import Daemon  # noqa: PLC0415
    daemon = Daemon(os.environ.get("KVHOST_KVHOSTD") or kvhostd, backend="cuda")
    rows = []
    try:
        for block_tokens in (16, 64):
            check_kvhost(torch, daemon, block_tokens, rows)
            check_vllm_cpu(torch, block_tokens, rows)
    finally:
        daemon.stop()
    print(f"{'worker, block tokens':<22} {'op':<6} {'blocks/job':>10} {'submit p50 us':>14} "
          f"{'job p50 ms':>11} {'GB/s':>7}")
    for label, op, n, sub, tot, gbs in rows:
        print(f"{label:<22} {op:<6} {n:>10} {sub:>14.1f} {tot:>11.3f} {gbs:>7.2f}")
    assert any(r[0].startswith("kvhost") for r in rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
