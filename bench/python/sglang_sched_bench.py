#!/usr/bin/env python3
"""The scheduler thread's time per kvhost.sglang call (host backend).

sglang's scheduler thread calls backup_from_device_all_layer once per write
back and load_to_device_per_layer once per layer per load; whatever those
calls block is time the scheduler cannot schedule. This runs them on a
kvhost MHA pool over a host-backend kvhostd of its own (device rows in a
ShmDevicePool) and prints, per call kind, the wall time the calling thread
spent (p50 / p99 / max) beside the bytes moved. On the host backend both
calls wait for the copy today (docs/SGLANG.md), so the time per backup and
per load is the transfer's; the CUDA path's figure needs the GPU machine.
No torch or numpy needed.
  usage: sglang_sched_bench.py --kvhostd PATH [--lib PATH] [--tokens N]
         [--layers L] [--heads H] [--head-dim D] [--iters N]
"""

from __future__ import annotations

import argparse
import sys
import time

import pybench_common as common


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kvhostd", required=True)
    ap.add_argument("--lib")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    kvhost = common.import_kvhost(args.lib)
    from kvhost import sglang as kvs  # noqa: PLC0415

    daemon = common.Daemon(args.kvhostd, "host")
    try:
        with kvhost.Client(daemon.address, session=False) as sched, \
                kvhost.Client(daemon.address) as worker:
            pool = kvs.MHATokenToKVPoolHost(
                "bench", client=sched, layout="page_first", dtype="bfloat16",
                page_size=args.page_size, layer_num=args.layers, head_num=args.heads,
                head_dim=args.head_dim, host_size_tokens=2 * args.tokens, tensors=False)
            dev = worker.shm_device_pool("bench", args.tokens)
            slots = pool.alloc(args.tokens)
            rows = list(range(args.tokens))
            backup, load = [], []
            for _ in range(args.iters):
                t0 = time.perf_counter()
                pool.backup_from_device_all_layer(dev, slots, rows)
                backup.append(time.perf_counter() - t0)
                for layer in range(args.layers):
                    t0 = time.perf_counter()
                    pool.load_to_device_per_layer(dev, slots, rows, layer)
                    load.append(time.perf_counter() - t0)
            nbytes = pool.get_size_per_token() * args.tokens
            print(f"{args.tokens} tokens, {args.layers} layers, {nbytes / 2**20:.0f} MiB per "
                  f"backup or load, {args.iters} iterations, host backend")
            rows_out = [["call", "p50 us", "p99 us", "max us", "samples"]]
            for name, values in (("backup_from_device_all_layer", backup),
                                 ("load_to_device_per_layer", load)):
                s = common.summary_us(values)
                rows_out.append([name, common.fmt(s["p50_us"]), common.fmt(s["p99_us"]),
                                 common.fmt(s["max_us"]), str(s["samples"])])
            print(common.table(rows_out, "lrrrr"))
            pool.close()
            dev.close()
    finally:
        daemon.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
