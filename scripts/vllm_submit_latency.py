#!/usr/bin/env python3
"""kvhost.vllm's submit latency and GB/s on the host backend (docs/VLLM.md,
"Measured"): the GPU test's measurement (tests/python_vllm_gpu_test.py
measure: jobs of 1 and 64 blocks, stored then loaded, p50 of 10) on a fresh
kvhostd --backend=host, with vLLM's OffloadingConnectorWorker over kvhost's
worker and CPU canonical tensors in a ShmDevicePool (as tests/python_vllm_test.py).
Shapes: 32 layers of a Llama-8B-like layer (8 KV heads of 128, bf16, K and V);
blocks of 16 and 64 tokens. Runs in the engine venv (scripts/engine_venv.sh).
  usage: scripts/vllm_submit_latency.py [BUILD_DIR]   (default build)
"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "tests"), os.path.join(ROOT, "python")]
import engine_env  # noqa: E402

if __name__ == "__main__":
    engine_env.enter(ROOT)

import platform  # noqa: E402
import time  # noqa: E402

BLOCKS = {16: 256, 64: 128}  # device blocks: 512 MiB and 1 GiB of /dev/shm


def main():
    build = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "build"))
    os.environ["KVHOST_LIBRARY"] = os.path.join(build, "lib", "libkvhost_c.so.1")
    import torch  # noqa: PLC0415
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (  # noqa
        OffloadingConnectorWorker)
    from vllm.v1.kv_offload.base import (CanonicalKVCacheRef, CanonicalKVCaches,  # noqa
                                         CanonicalKVCacheTensor, make_offload_key)
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: PLC0415

    import kvhost  # noqa: PLC0415
    import kvhost.vllm as kv  # noqa: PLC0415
    import python_vllm_gpu_test as gpu  # noqa: PLC0415
    from kvhost_testing import Daemon  # noqa: PLC0415
    daemon = Daemon(os.path.join(build, "bin", "kvhostd"))
    rows = []
    try:
        for tokens, blocks in BLOCKS.items():
            page = 2 * tokens * gpu.KV_HEADS * gpu.HEAD_DIM * 2
            spec = OffloadingSpecFactory.create_spec(gpu.offload_config(daemon, tokens))
            dev = kvhost.Client(daemon.address, session=False, owner_token=gpu.TOKEN)
            kv.CacheLayout([None] * gpu.LAYERS, page, blocks).ensure_pool(
                dev, spec.cache_name, spec.settings.cache_bytes)
            shm = dev.shm_device_pool(spec.cache_name, blocks, daemon.shm)
            kv.register_shm_device_pool(shm)
            tensors = [torch.frombuffer(shm.layer_view("latent", i), dtype=torch.int8)
                       .view(blocks, page) for i in range(gpu.LAYERS)]
            connector = OffloadingConnectorWorker(spec, None, None)
            connector._init_worker(CanonicalKVCaches(
                [CanonicalKVCacheTensor(t, page) for t in tensors],
                [[CanonicalKVCacheRef(i, page) for i in range(gpu.LAYERS)]]))

            def chunks(n, r, op, tokens=tokens):
                return kv.KvhostLoadStoreSpec(
                    make_offload_key(b"%d-%d-%d-%d" % (tokens, n, r, i) + bytes(20), 0)
                    for i in range(n))
            gpu.measure(connector.worker, chunks, page, f"kvhost host {tokens}", rows,
                        blocks=blocks)
            connector.shutdown()
            shm.close()
            dev.close()
    finally:
        daemon.cleanup()
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.node()}, "
          f"{os.cpu_count()} CPUs, {platform.processor() or platform.machine()}")
    print(f"{'worker, block tokens':<22} {'op':<6} {'blocks/job':>10} {'submit p50 us':>14} "
          f"{'job p50 ms':>11} {'GB/s':>7}")
    for label, op, n, sub, tot, gbs in rows:
        print(f"{label:<22} {op:<6} {n:>10} {sub:>14.1f} {tot:>11.3f} {gbs:>7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
