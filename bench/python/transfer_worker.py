#!/usr/bin/env python3
"""The worker process of transfer_bench.py: one allocator's measurements.

transfer_bench.py starts this once per --allocator, in a process of its own
(PYTORCH_CUDA_ALLOC_CONF must be set before torch initialises CUDA), with a
JSON config file; this process writes a JSON result file and exits.

As a GPU worker would (backend "cuda"): torch makes the primary context; the
device KV pool of each kind is per-layer tensors of 2 x tokens rows (MHA:
K and V of 8 x 128 bf16; MLA: the 576-wide bf16 latent), from torch's
caching allocator (default, or expandable segments) or from a cuMem arena
(cumem.py), attached to each case's host pool with
kvhost.torch_helpers.attach_tensors. With backend "host" the device pool is
a kvhost.ShmDevicePool made from each case's pool (no GPU, no torch).

Per case (kind, layout, page size), as bench/cuda_bench_cases.cc does it:
the host pool holds 2 x tokens slots; --churn-ops random Alloc / Free calls
(at most 1/64 of the pool each) fragment it before the transfer's slots are
allocated; the device rows are random whole pages. The device pool is
filled with random bytes, backed up, loaded into other rows, and those rows
checked equal to the first: no speed is reported for wrong bytes. Then per
direction, transfers back to back for `seconds` (at least 3): each timed
from the Backup / Load call to its return (submit) and to Ticket.wait's
return (done), and by the ticket's own duration_us (engine). GB/s is bytes
over the median engine time, as the C++ benchmark's; client GB/s over the
median done time.

The time to first layer (MHA LAYER_FIRST, an attachment with layer
progress): per-layer loads, the Load call's return, layer 0 and the last
layer ready on the stream (CUDA events on torch's current stream, as
bench/cuda_bench_cases.cc's TimedLoad), and a Load of no rows.

  usage: transfer_worker.py CONFIG_JSON RESULT_JSON
Exit codes: 0 every case measured, 1 something failed (the result says
what), 77 torch or a GPU is missing for the cuda backend.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
import traceback
from array import array
from typing import Any, Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pybench_common as common  # noqa: E402

#: Rows per token of each kind's device buffers: (component, per-row shape
#: of bf16), as bench/bench_util.h's BenchPoolSpec makes the host pools.
SHAPES = {"MHA": [("k", (8, 128)), ("v", (8, 128))], "MLA": [("latent", (1, 576))]}
#: The churn's largest request, as a share of the pool's pages
#: (bench/cuda_bench_cases.cc's kChurnMaxShare).
CHURN_MAX_SHARE = 64
#: A transfer not done by then is a hang (the slowest path measured moves
#: 1 GiB in 4 s).
TRANSFER_TIMEOUT_S = 120.0
#: Timed transfers per direction at least, however long they take.
MIN_TRANSFERS = 3
#: Per-layer loads of a time-to-first-layer case after one warm-up, and the
#: Loads of no rows (the C++ benchmark's kFirstLayerSamples).
TTFL_SAMPLES = 10
#: Ceiling copies after one warm-up; the median is kept.
CEILING_RUNS = 5

kvhost: Any = None
torch: Any = None


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def bench_spec(kind: str, layout: str, page_size: int, layers: int, size_tokens: int) -> Dict:
    spec = {"kind": kind, "layout": layout, "dtype": "BF16", "page_size": page_size,
            "layer_num": layers, "size_tokens": size_tokens}
    if kind == "MLA":
        spec.update(kv_lora_rank=512, qk_rope_head_dim=64)
    else:
        spec.update(head_num=8, head_dim=128)
    return spec


def page_slots(pages: Sequence[int], page_size: int) -> array:
    return array("q", [p * page_size + j for p in pages for j in range(page_size)])


def host_runs(slots: Sequence[int], page_size: int) -> Tuple[int, int]:
    """(pages, runs of consecutive pages) of whole-page slots, as RunsOf."""
    pages = runs = 0
    last = -2
    for i in range(0, len(slots), page_size):
        page = slots[i] // page_size
        if page != last + 1:
            runs += 1
        last = page
        pages += 1
    return pages, runs


def churned_slots(c: Any, name: str, pool: Dict, need: int, churn_ops: int,
                  rng: random.Random) -> array:
    """The daemon's Alloc of `need` slots after `churn_ops` random Alloc /
    Free calls holding at most the rest of the pool (Churn in
    bench/cuda_bench_cases.cc; Python's generator, so other slots)."""
    ps = int(pool["spec"]["page_size"])
    max_pages = max(1, int(pool["page_num"]) // CHURN_MAX_SHARE)
    cap = int(pool["size_tokens"]) - need
    held: List[Any] = []
    held_tokens = 0
    for _ in range(churn_ops):
        tokens = (1 + rng.randrange(max_pages)) * ps
        if (not held or rng.randrange(2) == 0) and held_tokens + tokens <= cap:
            held.append(c.alloc(name, tokens))
            held_tokens += tokens
        elif held:
            i = rng.randrange(len(held))
            c.free(name, held[i])
            held_tokens -= len(held[i])
            held[i] = held[-1]
            held.pop()
    return array("q", [int(s) for s in c.alloc(name, need)])


# --- device pools -----------------------------------------------------------

class TorchKv:
    """One kind's device KV pool: per component, per-layer int16 tensors
    (bf16 bits) of `rows` rows, from torch's allocator or a cuMem arena."""

    def __init__(self, kind: str, rows: int, layers: int, allocator: str, cu: Any) -> None:
        self.kind, self.rows = kind, rows
        self.arena = None
        shapes = SHAPES[kind]
        if allocator == "cumem":
            import cumem  # noqa: PLC0415
            sizes = [rows * 2 * _numel(s) for _, s in shapes for _ in range(layers)]
            self.arena = cumem.CuMemArena(cu, sizes, torch.cuda.current_device())
            ptrs = iter(self.arena.pointers)
            self.layers = {n: [cumem.as_tensor(torch, next(ptrs), (rows,) + s)
                               for _ in range(layers)] for n, s in shapes}
        else:
            self.layers = {n: [torch.empty((rows,) + s, dtype=torch.int16, device="cuda")
                               for _ in range(layers)] for n, s in shapes}
        first = self.layers[shapes[0][0]][0]
        self.cumem_memory = cu is not None and _is_cumem(cu, first.data_ptr())
        if cu is not None and not self.cumem_memory:
            # Else the run would measure cudaMalloc memory under this name.
            raise RuntimeError(f"allocator {allocator}: the {kind} tensors are not cuMem memory "
                               f"(cuMemRetainAllocationHandle fails; PYTORCH_CUDA_ALLOC_CONF="
                               f"'{os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '')}')")
        self.nbytes = sum(t.numel() * 2 for ts in self.layers.values() for t in ts)

    def attach(self, c: Any, pool: str, **options: Any) -> Any:
        bf16 = {n: [t.view(torch.bfloat16) for t in ts] for n, ts in self.layers.items()}
        return c.attach_tensors(pool, components=bf16, **options)

    def fill(self, seed: int) -> None:
        g = torch.Generator(device="cuda")
        g.manual_seed(seed)
        for ts in self.layers.values():
            for t in ts:
                t.random_(-32768, 32767, generator=g)
        torch.cuda.synchronize()

    def check(self, dst: Sequence[int], src: Sequence[int], what: str) -> None:
        d = torch.tensor(list(dst), dtype=torch.int64, device="cuda")
        s = torch.tensor(list(src), dtype=torch.int64, device="cuda")
        for name, ts in self.layers.items():
            for layer, t in enumerate(ts):
                if not torch.equal(t.index_select(0, d), t.index_select(0, s)):
                    raise AssertionError(f"{what}: component '{name}' layer {layer}: the loaded "
                                         f"rows differ from the rows backed up")

    def case_done(self) -> None:
        pass

    def close(self) -> None:
        self.layers = {}
        torch.cuda.synchronize()
        if self.arena is not None:
            self.arena.close()
        torch.cuda.empty_cache()


class ShmKv:
    """The host backend's device pool of one case (made from its pool)."""

    def __init__(self, c: Any, pool: str, rows: int) -> None:
        self.rows = rows
        self.dev = c.shm_device_pool(pool, rows)
        self.cumem_memory = False
        self.nbytes = self.dev.nbytes

    def attach(self, c: Any, pool: str, **options: Any) -> Any:
        return c.attach_shm(pool, self.dev, **options)

    def _buffers(self) -> List[Tuple[str, int, int]]:
        return [(comp.name, layer, comp.row_bytes) for comp in self.dev.components
                for layer in range(self.dev.layers)]

    def fill(self, seed: int) -> None:
        rng = random.Random(seed)
        for name, layer, _ in self._buffers():
            view = self.dev.layer_view(name, layer)
            view[:] = rng.randbytes(len(view))

    def check(self, dst: Sequence[int], src: Sequence[int], what: str) -> None:
        for name, layer, rb in self._buffers():
            view = self.dev.layer_view(name, layer)
            for d, s in zip(dst, src):
                if view[d * rb:(d + 1) * rb] != view[s * rb:(s + 1) * rb]:
                    raise AssertionError(f"{what}: component '{name}' layer {layer} row {d} "
                                         f"differs from row {s} backed up")

    def case_done(self) -> None:
        self.dev.close()

    def close(self) -> None:
        pass


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _is_cumem(cu: Any, ptr: int) -> bool:
    import cumem  # noqa: PLC0415
    return cumem.is_cumem(cu, ptr)


class Device:
    """The worker's device side: its pools by kind, the ceiling."""

    def __init__(self, cfg: Dict) -> None:
        self.backend, self.allocator = cfg["backend"], cfg["allocator"]
        self.rows = 2 * cfg["tokens"]
        self.layers = cfg["layers"]
        self.cu = None
        self.pools: Dict[str, TorchKv] = {}
        if self.backend == "cuda":
            torch.zeros(1, device="cuda")  # the primary context, current on this thread
            if self.allocator in ("expandable", "cumem"):
                import cumem  # noqa: PLC0415
                self.cu = cumem.libcuda()

    def describe(self) -> Dict[str, Any]:
        if self.backend != "cuda":
            return {"backend": "host"}
        p = torch.cuda.get_device_properties(0)
        return {"backend": "cuda", "gpu": p.name, "sms": p.multi_processor_count,
                "torch": torch.__version__, "torch_cuda": torch.version.cuda,
                "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")}

    def for_case(self, c: Any, pool: str, kind: str) -> Any:
        if self.backend != "cuda":
            return ShmKv(c, pool, self.rows)
        if kind not in self.pools:
            self.pools[kind] = TorchKv(kind, self.rows, self.layers, self.allocator, self.cu)
        return self.pools[kind]

    def close(self) -> None:
        for p in self.pools.values():
            p.close()
        self.pools = {}

    def ceiling(self, nbytes: int) -> Dict[str, Any]:
        """Contiguous copies of `nbytes`: pinned <-> device with
        torch (cudaMemcpyAsync), each way and both at once on two streams,
        as the C++ benchmark's; memmove on the host backend."""
        if self.backend != "cuda":
            return _memmove_ceiling(nbytes)
        host = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        dev = [torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(2)]
        streams = [torch.cuda.Stream(), torch.cuda.Stream()]
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        gb = nbytes / 1e9

        def copy(d2h: bool, h2d: bool) -> Tuple[float, float]:
            ev[0].record(streams[0])
            streams[1].wait_event(ev[0])
            if d2h:
                with torch.cuda.stream(streams[0]):
                    host[0].copy_(dev[0], non_blocking=True)
            if h2d:
                with torch.cuda.stream(streams[1]):
                    dev[1].copy_(host[1], non_blocking=True)
            ev[1].record(streams[0])
            ev[2].record(streams[1])
            ev[1].synchronize()
            ev[2].synchronize()
            return ev[0].elapsed_time(ev[1]), ev[0].elapsed_time(ev[2])

        d2h, h2d, both = [], [], []
        for run in range(CEILING_RUNS + 1):  # run 0 warms up
            a, _ = copy(True, False)
            _, b = copy(False, True)
            x, y = copy(True, True)
            if run:
                d2h.append(gb / (a / 1e3))
                h2d.append(gb / (b / 1e3))
                both.append(2 * gb / (max(x, y) / 1e3))
        del host, dev
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        empty_host = getattr(torch._C, "_host_emptyCache", None)
        if empty_host is not None:
            empty_host()
        return {"what": "pinned cudaMemcpyAsync (torch copy_), contiguous", "bytes": nbytes,
                "runs": CEILING_RUNS, "d2h_gb_per_s": round(common.median(d2h), 3),
                "h2d_gb_per_s": round(common.median(h2d), 3),
                "duplex_gb_per_s": round(common.median(both), 3)}


def _memmove_ceiling(nbytes: int) -> Dict[str, Any]:
    import ctypes as C  # noqa: PLC0415
    src, dst = bytearray(nbytes), bytearray(nbytes)
    s = (C.c_char * nbytes).from_buffer(src)
    d = (C.c_char * nbytes).from_buffer(dst)
    C.memmove(d, s, nbytes)
    runs = []
    for _ in range(CEILING_RUNS):
        t0 = time.perf_counter()
        C.memmove(d, s, nbytes)
        runs.append(nbytes / 1e9 / (time.perf_counter() - t0))
    del s, d
    gbps = round(common.median(runs), 3)
    return {"what": "memmove, one thread (host backend)", "bytes": nbytes, "runs": CEILING_RUNS,
            "d2h_gb_per_s": gbps, "h2d_gb_per_s": gbps, "duplex_gb_per_s": None}


# --- transfers --------------------------------------------------------------

class AttachRefused(Exception):
    """The attach of the device pool failed with FAILED_PRECONDITION: the
    memory is of a kind the daemon cannot import (cuMem before the fd
    import), or there is no usable GPU."""


class Timed:
    """One transfer's times (seconds) and its ticket's status."""

    def __init__(self, att: Any, backup: bool, host: array, rows: array, nbytes: int) -> None:
        t0 = time.perf_counter()
        ticket = att.backup(host, rows) if backup else att.load(host, rows)
        t1 = time.perf_counter()
        st = ticket.wait(TRANSFER_TIMEOUT_S)
        t2 = time.perf_counter()
        self.submit_s, self.done_s = t1 - t0, t2 - t0
        # duration_us has microsecond resolution; never divide by zero.
        self.engine_s = max(int(st.get("duration_us", 0)), 1) / 1e6
        self.path = st.get("path", "")
        if int(st.get("bytes", 0)) != nbytes:
            raise AssertionError(f"{'backup' if backup else 'load'} ticket {ticket.id} copied "
                                 f"{st.get('bytes')} bytes, expected {nbytes}")


def time_direction(att: Any, backup: bool, host: array, rows: array, nbytes: int,
                   seconds: float, ceiling: Dict) -> Dict[str, Any]:
    done: List[Timed] = []
    start = time.perf_counter()
    while True:
        elapsed = time.perf_counter() - start
        if done and elapsed >= seconds and (len(done) >= MIN_TRANSFERS or elapsed >= 3 * seconds):
            break
        done.append(Timed(att, backup, host, rows, nbytes))
    loop_s = time.perf_counter() - start
    gb = nbytes / 1e9
    paths: List[str] = []
    for t in done:
        if t.path not in paths:
            paths.append(t.path)
    engine_gbps = gb / common.median([t.engine_s for t in done])
    top = ceiling["d2h_gb_per_s" if backup else "h2d_gb_per_s"]
    return {
        "direction": "backup" if backup else "load", "bytes": nbytes, "transfers": len(done),
        "seconds": round(loop_s, 3),
        "engine_gb_per_s": round(engine_gbps, 3),
        "client_gb_per_s": round(gb / common.median([t.done_s for t in done]), 3),
        "loop_gb_per_s": round(len(done) * gb / loop_s, 3),
        "vs_ceiling": round(engine_gbps / top, 4) if top else None,
        "ticket_path": "+".join(paths),
        "submit": common.summary_us([t.submit_s for t in done]),
        "done": common.summary_us([t.done_s for t in done]),
        "engine": common.summary_us([t.engine_s for t in done]),
    }


def run_case(c: Any, device: Device, cfg: Dict, case: Dict, seed: int) -> List[Dict]:
    kind, layout, ps = case["kind"], case["layout"], int(case["page_size"])
    tokens, name = cfg["tokens"], f"pybench-{kind}-{layout}-ps{ps}-{os.getpid()}"
    what = f"{cfg['allocator']} {kind} {layout} ps{ps}"
    rng = random.Random(f"{cfg['seed']}/{kind}/{layout}/{ps}")
    pool = c.create_pool(name, bench_spec(kind, layout, ps, cfg["layers"], 2 * tokens))
    dev = None
    try:
        host = churned_slots(c, name, pool, tokens, cfg["churn_ops"], rng)
        pages, runs = host_runs(host, ps)
        dev = device.for_case(c, name, kind)
        device_pages = list(range(dev.rows // ps))
        rng.shuffle(device_pages)
        n = tokens // ps
        rows = page_slots(device_pages[:n], ps)
        other = page_slots(device_pages[n:2 * n], ps)
        nbytes = tokens * int(pool["bytes_per_token"])
        try:
            att = dev.attach(c, name)
        except kvhost.FailedPrecondition as e:
            raise AttachRefused(f"FAILED_PRECONDITION: {e.message}") from e
        with att:
            # The byte check; its backup and load are the warm-ups.
            dev.fill(seed)
            warm_b = Timed(att, True, host, rows, nbytes)
            warm_l = Timed(att, False, host, other, nbytes)
            dev.check(other, rows, f"{what} (tickets on {warm_b.path} / {warm_l.path})")
            results = []
            for direction in cfg["directions"]:
                r = time_direction(att, direction == "backup", host,
                                   rows if direction == "backup" else other, nbytes,
                                   cfg["seconds"], cfg["ceiling"])
                r.update(kind=kind, layout=layout, page_size=ps, bytes_verified=True,
                         host_pages=pages, host_runs=runs,
                         host_run_pages=round(pages / runs, 2) if runs else 0,
                         cumem_memory=dev.cumem_memory)
                results.append(r)
                log(f"[{what}] {direction}: {r['engine_gb_per_s']:.1f} GB/s "
                    f"({r['vs_ceiling'] or 0:.2f} of the ceiling), client "
                    f"{r['client_gb_per_s']:.1f}, submit p50 {r['submit']['p50_us']:.0f} us, "
                    f"done p50 {r['done']['p50_us']:.0f} us, {r['transfers']} transfers "
                    f"[{r['ticket_path']}], host run {r['host_run_pages']} pages")
            return results
    finally:
        if dev is not None:
            dev.case_done()
        c.delete_pool(name)


def run_ttfl(c: Any, device: Device, cfg: Dict, ps: int) -> Dict[str, Any]:
    """Per-layer loads (layer progress) of MHA LAYER_FIRST at page `ps`."""
    tokens, layers = cfg["tokens"], cfg["layers"]
    name = f"pybench-ttfl-ps{ps}-{os.getpid()}"
    rng = random.Random(f"{cfg['seed']}/ttfl/{ps}")
    pool = c.create_pool(name, bench_spec("MHA", "LAYER_FIRST", ps, layers, 2 * tokens))
    dev = None
    cuda = device.backend == "cuda"
    try:
        host = churned_slots(c, name, pool, tokens, cfg["churn_ops"], rng)
        dev = device.for_case(c, name, "MHA")
        device_pages = list(range(dev.rows // ps))
        rng.shuffle(device_pages)
        rows = page_slots(device_pages[:tokens // ps], ps)
        nbytes = tokens * int(pool["bytes_per_token"])
        stream = torch.cuda.current_stream() if cuda else None
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)] if cuda else []
        samples: Dict[str, List[float]] = {"call_ms": [], "call_host_ms": [], "first_ms": [],
                                           "total_ms": [], "daemon_first_ms": [],
                                           "daemon_total_ms": [], "empty_load_ms": []}
        with dev.attach(c, name, layer_progress=True) as att:
            Timed(att, True, host, rows, nbytes)
            for i in range(TTFL_SAMPLES + 1):  # the first warms up
                t = [0.0] * 4
                if cuda:
                    ev[0].record(stream)
                t[0] = time.perf_counter()
                load = att.load(host, rows, per_layer=True)
                t[1] = time.perf_counter()
                if cuda:
                    ev[1].record(stream)
                load.wait_layer(0, stream, timeout=TRANSFER_TIMEOUT_S)
                if cuda:
                    ev[2].record(stream)
                t[2] = time.perf_counter()
                load.wait_layer(layers - 1, stream, timeout=TRANSFER_TIMEOUT_S)
                if cuda:
                    ev[3].record(stream)
                    ev[3].synchronize()
                t[3] = time.perf_counter()
                st = load.wait(TRANSFER_TIMEOUT_S)
                if i == 0:
                    continue
                if cuda:
                    ms = [ev[0].elapsed_time(ev[k]) for k in (1, 2, 3)]
                else:
                    ms = [(t[k] - t[0]) * 1e3 for k in (1, 2, 3)]
                samples["call_ms"].append(ms[0])
                samples["call_host_ms"].append((t[1] - t[0]) * 1e3)
                samples["first_ms"].append(ms[1])
                samples["total_ms"].append(ms[2])
                samples["daemon_first_ms"].append(int(st.get("first_layer_us", 0)) / 1e3)
                samples["daemon_total_ms"].append(int(st.get("duration_us", 0)) / 1e3)
            empty = array("q")
            for i in range(TTFL_SAMPLES + 1):
                t0 = time.perf_counter()
                att.load(empty, empty)
                if i:
                    samples["empty_load_ms"].append((time.perf_counter() - t0) * 1e3)
        r: Dict[str, Any] = {"kind": "MHA", "layout": "LAYER_FIRST", "page_size": ps,
                             "layers": layers, "bytes": nbytes, "loads": TTFL_SAMPLES}
        for k, v in samples.items():
            r[k] = round(common.median(v), 4)
        r["target_ms"] = round(r["total_ms"] / layers + 0.1, 4)
        log(f"[{cfg['allocator']} ttfl ps{ps}] Load call back {r['call_ms']:.3f} ms, first layer "
            f"{r['first_ms']:.3f} ms, all {r['total_ms']:.3f} ms; a Load of no rows "
            f"{r['empty_load_ms']:.3f} ms")
        return r
    finally:
        if dev is not None:
            dev.case_done()
        c.delete_pool(name)


def measure(cfg: Dict, result: Dict) -> int:
    device = Device(cfg)
    try:
        result["device"] = device.describe()
        cfg["ceiling"] = result["ceiling"] = device.ceiling(cfg["ceiling_bytes"])
        ceil = result["ceiling"]
        log(f"[{cfg['allocator']}] ceiling ({ceil['what']}, {ceil['bytes'] / 1e9:.3f} GB): "
            f"D2H {ceil['d2h_gb_per_s']:.2f} GB/s, H2D {ceil['h2d_gb_per_s']:.2f} GB/s")
        failed = 0
        refused = ""
        with kvhost.Client(cfg["address"], timeout=TRANSFER_TIMEOUT_S, wait_ready=30) as c:
            for i, case in enumerate(cfg["cases"]):
                label = f"{case['kind']} {case['layout']} ps{case['page_size']}"
                if refused:
                    result["errors"].append({"case": label, "error": refused, "skipped": True})
                    continue
                try:
                    result["cases"] += run_case(c, device, cfg, case, cfg["seed"] * 1000 + i)
                except AttachRefused as e:
                    # A daemon that cannot import this allocator's memory
                    # refuses every attach of it: say so once, skip the rest.
                    failed += 1
                    refused = str(e)
                    result["errors"].append({"case": label, "error": refused})
                    log(f"[{cfg['allocator']}] {label}: refused: {refused}")
                except Exception as e:  # every case reports
                    failed += 1
                    result["errors"].append({"case": label, "error": f"{type(e).__name__}: {e}"})
                    log(f"[{cfg['allocator']}] {label}: FAILED\n{traceback.format_exc()}")
            for ps in ([] if refused else cfg["ttfl_page_sizes"]):
                try:
                    result["ttfl"].append(run_ttfl(c, device, cfg, ps))
                except Exception as e:
                    failed += 1
                    result["errors"].append({"case": f"ttfl ps{ps}",
                                             "error": f"{type(e).__name__}: {e}"})
                    log(f"[{cfg['allocator']}] ttfl ps{ps}: FAILED\n{traceback.format_exc()}")
        result["refused"] = refused
        return 1 if failed else 0
    finally:
        device.close()


def main(argv: List[str]) -> int:
    global kvhost, torch
    if len(argv) != 2:
        print(__doc__)
        return 2
    with open(argv[0]) as f:
        cfg = json.load(f)
    result: Dict[str, Any] = {"allocator": cfg["allocator"], "backend": cfg["backend"],
                              "cases": [], "ttfl": [], "errors": [], "refused": ""}
    code = 1
    try:
        if cfg["backend"] == "cuda":
            try:
                import torch as torch_module  # noqa: PLC0415
            except ImportError as e:
                result["skipped"] = f"torch is not installed ({e})"
                code = common.SKIP
                return code
            if not torch_module.cuda.is_available():
                result["skipped"] = "torch sees no usable CUDA GPU"
                code = common.SKIP
                return code
            torch = torch_module
            if cfg["allocator"] == "expandable":
                conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
                if "expandable_segments:True" not in conf:
                    raise RuntimeError(f"PYTORCH_CUDA_ALLOC_CONF is '{conf}'")
        kvhost = common.import_kvhost(cfg.get("lib") or None)
        if cfg["backend"] == "cuda":
            import kvhost.torch_helpers  # noqa: F401, PLC0415
        result["library"] = kvhost.library_path()
        code = measure(cfg, result)
    except Exception as e:
        result["errors"].append({"case": "", "error": f"{type(e).__name__}: {e}"})
        log(f"[{cfg['allocator']}] FAILED\n{traceback.format_exc()}")
        code = 1
    finally:
        result["exit_code"] = code
        result["torch_imported"] = "torch" in sys.modules
        common.write_json(argv[1], result)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
