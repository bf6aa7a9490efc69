#!/usr/bin/env python3
"""The scheduler thread's time per kvhost.sglang call, beside the transfer's.

sglang's scheduler thread calls backup_from_device_all_layer once per write
back and load_to_device_per_layer once per layer per load; whatever those
calls block is time the scheduler cannot schedule. This runs them on a
kvhost MHA pool over a kvhostd of its own and prints, per call kind, the
wall time the calling thread spent in the call (p50 / p99 / max), and
beside it the transfer's time: from the start of a backup (or of a load's
layer-0 call) until its copies are done.

Host mode (the default; no GPU, torch or numpy): kvhostd --backend=host,
device rows in a ShmDevicePool. Both calls wait for the copy there
(docs/SGLANG.md), so call and transfer times are alike.

--cuda mode (a GPU and torch): kvhostd --backend=cuda, device rows in
per-layer torch CUDA tensors (the pool attaches them with attach_tensors,
as under sglang), calls made with torch's current stream set to a side
stream, as sglang's L2TransferEngine does. The calls return once queued
(the target is p50 <= 100 us for 4096 tokens); the transfer time is taken
with torch.cuda.synchronize() after the backup, or after a load's last
layer. Slot and row indices are CPU int64 tensors (what sglang hands over
with --hicache-io-backend direct); --gpu-indices passes both as CUDA
tensors instead (io_backend kernel), which costs a synchronisation of the
calling stream in the call: kvhostd takes indices from host memory.

--breakdown adds a second pass that splits a backup call and a load's
layer-0 call into their parts: the submit (kvhost.Attachment.backup / load:
the request over the fast path or gRPC, the daemon's validation and its
engine's acceptance), the daemon's enqueue time of that ticket (its
TransferStatus.enqueue_us, from acceptance until the engine had taken the
job), the host wait for a layer to be recorded (LoadTicket.wait_layer: the
backup's last layer, the load's layer 0) and, for a load, the daemon's
first_layer_us.

  usage: sglang_sched_bench.py --kvhostd PATH [--lib PATH] [--tokens N]
         [--layers L] [--heads H] [--head-dim D] [--page-size P] [--iters N]
         [--cuda [--gpu-indices]] [--breakdown] [--daemon-flag=F ...]
         [--daemon-log PATH]
  On the GPU machine, from a build with CUDA (build/bin/kvhostd, build/lib):
    python3 bench/python/sglang_sched_bench.py --kvhostd build/bin/kvhostd \\
        --lib build/lib/libkvhost_c.so --cuda --tokens 4096 --iters 50
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Callable, Dict, List

import pybench_common as common


class _DevicePool:
    """What kvhost.sglang reads of sglang's MHA device pool: per-layer K and
    V tensors of (tokens, heads, head_dim)."""

    def __init__(self, torch: Any, tokens: int, layers: int, heads: int, dim: int) -> None:
        shape = (tokens, heads, dim)
        self.k_buffer = [torch.randn(shape, device="cuda").to(torch.bfloat16)
                         for _ in range(layers)]
        self.v_buffer = [torch.randn(shape, device="cuda").to(torch.bfloat16)
                         for _ in range(layers)]


def _measure(args: argparse.Namespace, pool: Any, dev: Any, slots: Any, rows: Any,
             stream_ctx: Callable[[str], Any], sync: Callable[[], None]) -> Dict[str, List[float]]:
    """Per iteration: one backup, then one load of every layer. Call times
    are the calling thread's; transfer times run from the call's start to
    `sync()` returning after it."""
    out: Dict[str, List[float]] = {"backup": [], "load": [], "backup_xfer": [], "load_xfer": []}
    for _ in range(args.iters):
        sync()
        with stream_ctx("d2h"):
            t0 = time.perf_counter()
            pool.backup_from_device_all_layer(dev, slots, rows)
            out["backup"].append(time.perf_counter() - t0)
            sync()
            out["backup_xfer"].append(time.perf_counter() - t0)
        with stream_ctx("h2d"):
            start = time.perf_counter()
            for layer in range(args.layers):
                t0 = time.perf_counter()
                pool.load_to_device_per_layer(dev, slots, rows, layer)
                out["load"].append(time.perf_counter() - t0)
            sync()
            out["load_xfer"].append(time.perf_counter() - start)
    return out


class _Breakdown:
    """Times kvhost.transfer's submit and wait_layer calls made inside a
    backup_from_device_all_layer / load_to_device_per_layer call, and keeps
    their tickets for the daemon's own times (module doc, --breakdown)."""

    def __init__(self, kvhost: Any) -> None:
        self.transfer = kvhost.transfer
        self.parts: Dict[str, List[float]] = {}
        self.tickets: Dict[str, List[Any]] = {"backup": [], "load": []}
        self.call = ""
        self._saved: Dict[str, Any] = {}

    def _timed(self, owner: Any, name: str, part: Callable[[Any, tuple], str],
               keep: bool = False) -> None:
        original = getattr(owner, name)
        self._saved[name] = (owner, original)

        def wrapper(obj: Any, *a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            result = original(obj, *a, **kw)
            label = part(obj, a)
            if label:
                self.parts.setdefault(label, []).append(time.perf_counter() - t0)
                if keep:
                    self.tickets[self.call].append(result)
            return result
        setattr(owner, name, wrapper)

    def __enter__(self) -> "_Breakdown":
        t = self.transfer
        self._timed(t.Attachment, "backup", lambda _o, _a: f"{self.call}: submit", keep=True)
        self._timed(t.Attachment, "load", lambda _o, _a: f"{self.call}: submit", keep=True)
        self._timed(t.LoadTicket, "wait_layer",
                    lambda _o, a: f"{self.call}: wait_layer({a[0]})" if
                    self.call == "backup" or a[0] == 0 else "")
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, (owner, original) in self._saved.items():
            setattr(owner, name, original)

    def daemon_times(self) -> None:
        """The kept tickets' TransferStatus times, as parts."""
        for call, tickets in self.tickets.items():
            for ticket in tickets:
                status = ticket.wait(timeout=10)
                for key in ("enqueue_us", "first_layer_us", "duration_us"):
                    if key == "first_layer_us" and call == "backup":
                        continue
                    self.parts.setdefault(f"{call}: daemon {key}", []).append(
                        int(status.get(key, 0)) * 1e-6)


def _measure_parts(args: argparse.Namespace, kvhost: Any, pool: Any, dev: Any, slots: Any,
                   rows: Any, stream_ctx: Callable[[str], Any],
                   sync: Callable[[], None]) -> None:
    """The --breakdown pass: prints p50 / p99 of each part of a backup call
    and of a load's layer-0 call."""
    with _Breakdown(kvhost) as bd:
        for _ in range(args.iters):
            sync()
            with stream_ctx("d2h"):
                bd.call = "backup"
                t0 = time.perf_counter()
                pool.backup_from_device_all_layer(dev, slots, rows)
                bd.parts.setdefault("backup: whole call", []).append(time.perf_counter() - t0)
                sync()
            with stream_ctx("h2d"):
                bd.call = "load"
                for layer in range(args.layers):
                    t0 = time.perf_counter()
                    pool.load_to_device_per_layer(dev, slots, rows, layer)
                    if layer == 0:
                        bd.parts.setdefault("load: whole layer-0 call", []).append(
                            time.perf_counter() - t0)
                sync()
    bd.daemon_times()
    rows_out = [["part", "p50 us", "p99 us", "samples"]]
    for label in sorted(bd.parts):
        s = common.summary_us(bd.parts[label])
        rows_out.append([label, common.fmt(s["p50_us"]), common.fmt(s["p99_us"]),
                         str(s["samples"])])
    print("breakdown (daemon times are TransferStatus fields of the same tickets)")
    print(common.table(rows_out, "lrrr"))


def _report(args: argparse.Namespace, pool: Any, times: Dict[str, List[float]],
            mode: str) -> None:
    nbytes = pool.get_size_per_token() * args.tokens
    print(f"{args.tokens} tokens, {args.layers} layers, {nbytes / 2**20:.0f} MiB per backup or "
          f"load, {args.iters} iterations, {mode}")
    header = ["call", "call p50 us", "call p99 us", "call max us", "calls",
              "transfer", "xfer p50 us", "xfer p99 us", "xfer max us", "GB/s p50"]
    rows = [header]
    for name, call, xfer, what in (
            ("backup_from_device_all_layer", "backup", "backup_xfer", "per backup"),
            ("load_to_device_per_layer", "load", "load_xfer", "per whole load")):
        c, x = common.summary_us(times[call]), common.summary_us(times[xfer])
        gbps = nbytes / (x["p50_us"] * 1e-6) / 1e9 if x["p50_us"] else None
        rows.append([name, common.fmt(c["p50_us"]), common.fmt(c["p99_us"]),
                     common.fmt(c["max_us"]), str(c["samples"]), what,
                     common.fmt(x["p50_us"]), common.fmt(x["p99_us"]), common.fmt(x["max_us"]),
                     common.fmt(gbps, 2)])
    print(common.table(rows, "lrrrrlrrrr"))


def _run_host(args: argparse.Namespace, kvhost: Any, kvs: Any) -> None:
    daemon = common.Daemon(args.kvhostd, "host", args.daemon_flag, args.daemon_log)
    try:
        with kvhost.Client(daemon.address, session=False) as sched, \
                kvhost.Client(daemon.address) as worker:
            pool = kvs.MHATokenToKVPoolHost(
                "bench", client=sched, layout="page_first", dtype="bfloat16",
                page_size=args.page_size, layer_num=args.layers, head_num=args.heads,
                head_dim=args.head_dim, host_size_tokens=2 * args.tokens, tensors=False)
            dev = worker.shm_device_pool("bench", args.tokens)
            slots = pool.alloc(args.tokens)
            times = _measure(args, pool, dev, slots, list(range(args.tokens)),
                             lambda _: _Nothing(), lambda: None)
            _report(args, pool, times, "host backend (the calls wait for the copy)")
            if args.breakdown:
                _measure_parts(args, kvhost, pool, dev, slots, list(range(args.tokens)),
                               lambda _: _Nothing(), lambda: None)
            pool.close()
            dev.close()
    finally:
        daemon.stop()


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _run_cuda(args: argparse.Namespace, kvhost: Any, kvs: Any) -> None:
    import torch  # noqa: PLC0415 (only this mode needs it)
    if not torch.cuda.is_available():
        raise SystemExit("--cuda needs a GPU that torch can use")
    torch.zeros(1, device="cuda")  # the primary context, current on this thread
    daemon = common.Daemon(args.kvhostd, "cuda", args.daemon_flag, args.daemon_log)
    try:
        with kvhost.Client(daemon.address) as sched:
            pool = kvs.MHATokenToKVPoolHost(
                "bench", client=sched, layout="page_first", dtype="bfloat16",
                page_size=args.page_size, layer_num=args.layers, head_num=args.heads,
                head_dim=args.head_dim, host_size_tokens=2 * args.tokens, tensors=True)
            dev = _DevicePool(torch, args.tokens, args.layers, args.heads, args.head_dim)
            slots = pool.alloc(args.tokens)
            rows = torch.arange(args.tokens, dtype=torch.int64)
            if args.gpu_indices:
                slots, rows = slots.cuda(), rows.cuda()
            streams = {"d2h": torch.cuda.Stream(), "h2d": torch.cuda.Stream()}
            # Warm-up: the attachment, the ready-fence ring, the daemon's lanes.
            _measure(argparse.Namespace(**{**vars(args), "iters": 2}), pool, dev, slots, rows,
                     lambda d: torch.cuda.stream(streams[d]), torch.cuda.synchronize)
            times = _measure(args, pool, dev, slots, rows,
                             lambda d: torch.cuda.stream(streams[d]), torch.cuda.synchronize)
            where = "CUDA" if args.gpu_indices else "CPU"
            _report(args, pool, times, f"cuda backend, {torch.cuda.get_device_name()}, "
                                       f"indices as {where} tensors")
            if args.breakdown:
                _measure_parts(args, kvhost, pool, dev, slots, rows,
                               lambda d: torch.cuda.stream(streams[d]), torch.cuda.synchronize)
            pool.close()
    finally:
        daemon.stop()


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
    ap.add_argument("--cuda", action="store_true",
                    help="kvhostd --backend=cuda and torch CUDA tensors (needs a GPU)")
    ap.add_argument("--gpu-indices", action="store_true",
                    help="--cuda: pass slots and rows as CUDA tensors (io_backend kernel)")
    ap.add_argument("--daemon-flag", action="append", default=[],
                    help="a kvhostd flag (repeat), e.g. --daemon-flag=--log-level=debug, "
                         "whose debug lines split each ticket's acceptance into its stages")
    ap.add_argument("--daemon-log", help="keep kvhostd's log at this path")
    ap.add_argument("--breakdown", action="store_true",
                    help="a second pass timing the parts of a backup and a load's layer-0 call")
    args = ap.parse_args()
    if args.gpu_indices and not args.cuda:
        ap.error("--gpu-indices needs --cuda")
    kvhost = common.import_kvhost(args.lib)
    from kvhost import sglang as kvs  # noqa: PLC0415
    if args.cuda:
        _run_cuda(args, kvhost, kvs)
    else:
        _run_host(args, kvhost, kvs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
