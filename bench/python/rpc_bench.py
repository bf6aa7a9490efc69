#!/usr/bin/env python3
"""A scheduler's calls from Python, next to kvhost_rpc_bench's (C++).

The cases are the C++ benchmark's, through the Python package
(kvhost.Client: ctypes -> libkvhost_c.so -> the C++ client, which takes
the fast path on a unix socket): Alloc(page_size tokens) then Free of the
slots it returned, with N client threads at once (--clients), each with its
own kvhost.Client (the ABI's calls release the GIL while they wait); then
with one client an AllocBatch of 64 runs of a page and one Free of them
all, and Backup / Load submits of 4096 tokens from an shm device pool (the
call alone; the ticket is waited for untimed). After --warmup-seconds each
thread times its round trips for --seconds. The pools are
bench/rpc_bench.cc's: MHA LAYER_FIRST UINT8, one layer, one head of one
byte, 4096 pages; for the submits page 1 and 8-byte rows.

With --cxx-bench=PATH (bench/rpc_bench.cc's kvhost_rpc_bench) the C++
figures come from the same daemon in the same invocation
(``--server=... --clients=... --seconds=...``), with its two floors (two
gRPC health checks, two unix-socket ping-pongs); one table shows both
sides, p50 / p99 in microseconds, and Python's cost over C++.

It starts its own kvhostd (--kvhostd, --backend host by default) unless
--server names a running one. Runs without a GPU, torch or numpy.
Exit codes: 0 done, 1 a call or the C++ benchmark failed, 2 bad flags.
"""

from __future__ import annotations

import argparse
import array
import contextlib
import os
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pybench_common as common  # noqa: E402

#: bench/rpc_bench.cc's kPoolPages: every thread holds one page at a time.
POOL_PAGES = 4096
#: The C++ run's limit beyond its own warm-up and measured seconds per case
#: (connecting, the floors, the pool).
CXX_SLACK_S = 60.0


def parse_args(argv: List[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="rpc_bench.py", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Example: rpc_bench.py --kvhostd=build/bin/kvhostd "
               "--lib=build/lib/libkvhost_c.so.1 --cxx-bench=build/bin/kvhost_rpc_bench")
    p.add_argument("--kvhostd", default=os.environ.get("KVHOST_KVHOSTD", ""),
                   help="kvhostd to start (default $KVHOST_KVHOSTD, else build/bin/kvhostd)")
    p.add_argument("--server", default="",
                   help="measure a running kvhostd ('unix:///path.sock') instead of starting one")
    p.add_argument("--backend", default="host", choices=["host", "cuda", "auto"],
                   help="--backend of the kvhostd started (Alloc / Free never touch it)")
    p.add_argument("--lib", default="", help="libkvhost_c.so to load (default: the package's "
                   "search: $KVHOST_LIBRARY, build/lib, the loader)")
    p.add_argument("--cxx-bench", default="",
                   help="kvhost_rpc_bench binary: its figures against the same daemon")
    p.add_argument("--clients", default="1", help="concurrent client threads per case, comma "
                   "separated (default 1)")
    p.add_argument("--seconds", type=float, default=5.0, help="measured seconds per case")
    p.add_argument("--warmup-seconds", type=float, default=1.0,
                   help="unmeasured round trips before each case")
    p.add_argument("--page-size", type=int, default=16, help="page size; Alloc asks one page")
    p.add_argument("--json-out", default="", help="write the results as JSON here")
    p.add_argument("--cxx-log", default="",
                   help="the C++ benchmark's output (default: beside --json-out, else a temp "
                   "file)")
    a = p.parse_args(argv)
    try:
        a.client_counts = [int(c) for c in a.clients.split(",") if c.strip()]
    except ValueError:
        p.error(f"--clients: '{a.clients}' is not a list of integers")
    if not a.client_counts or min(a.client_counts) < 1:
        p.error(f"--clients: '{a.clients}' needs positive counts")
    if not a.seconds > 0 or a.warmup_seconds < 0 or a.page_size < 1:
        p.error("--seconds must be > 0, --warmup-seconds >= 0, --page-size >= 1")
    if not a.server and not a.kvhostd:
        a.kvhostd = os.path.join(common.REPO, "build", "bin", "kvhostd")
    return a


#: bench/rpc_bench.cc's kTransferTokens and kBatchRuns.
TRANSFER_TOKENS = 4096
BATCH_RUNS = 64

#: One client's case: given its kvhost.Client and an ExitStack for what it
#: sets up, returns (timed, after): `timed` is one measured round trip,
#: `after` (or None) what follows it untimed (waiting for a ticket).
Setup = Callable[[Any, contextlib.ExitStack], Tuple[Callable[[], None],
                                                    Optional[Callable[[], None]]]]


def flatten(runs: List[Any]) -> Any:
    """AllocBatch's runs as one index array, for the one Free of them all."""
    if runs and not isinstance(runs[0], list):
        import numpy  # noqa: PLC0415 (alloc_batch returned numpy arrays)
        return numpy.concatenate(runs)
    return [s for r in runs for s in r]


def alloc_free(pool: str, tokens: int) -> Setup:
    def setup(c: Any, _stack: contextlib.ExitStack) -> Tuple[Callable[[], None], None]:
        return (lambda: c.free(pool, c.alloc(pool, tokens))), None
    return setup


def batch_alloc_free(pool: str, tokens: int, runs: int) -> Setup:
    wanted = [tokens] * runs

    def setup(c: Any, _stack: contextlib.ExitStack) -> Tuple[Callable[[], None], None]:
        return (lambda: c.free(pool, flatten(c.alloc_batch(pool, wanted)))), None
    return setup


def submit(pool: str, backup: bool) -> Setup:
    """A Backup or Load submit of all TRANSFER_TOKENS slots of `pool` from an
    shm device pool of as many rows; the ticket is waited for untimed."""
    def setup(c: Any, stack: contextlib.ExitStack) -> Tuple[Callable[[], None],
                                                            Callable[[], None]]:
        # int64 arrays, as a scheduler keeps its indices (numpy or torch; the
        # stdlib's array here, which needs no numpy): a list of 4096 ints
        # would be converted on every call (~0.6 ms each way).
        host = array.array("q", c.alloc(pool, TRANSFER_TOKENS))
        stack.callback(c.free, pool, host)
        dev = stack.enter_context(c.shm_device_pool(pool, TRANSFER_TOKENS))
        att = stack.enter_context(c.attach_shm(pool, dev))
        rows = array.array("q", range(TRANSFER_TOKENS))
        last: Dict[str, Any] = {}

        def timed() -> None:
            last["t"] = att.backup(host, rows) if backup else att.load(host, rows)

        return timed, lambda: last["t"].wait(30)
    return setup


def round_trips(kvhost: Any, address: str, setup: Setup, start: float, end: float,
                out: Dict[str, Any]) -> None:
    """One client thread: the case's round trips until `end`, timing those
    after `start`."""
    try:
        with kvhost.Client(address, timeout=30, session=False, wait_ready=10) as c, \
                contextlib.ExitStack() as stack:
            timed, after = setup(c, stack)
            times: List[float] = []
            while True:
                t0 = time.perf_counter()
                if t0 >= end:
                    break
                timed()
                t1 = time.perf_counter()
                if after is not None:
                    after()
                if t0 >= start:
                    times.append(t1 - t0)
            out["times"] = times
            out["end"] = time.perf_counter()
    except Exception as e:  # reported by the case
        out["error"] = e


def python_case(kvhost: Any, address: str, name: str, setup: Setup, a: argparse.Namespace,
                threads: int) -> Dict[str, Any]:
    # The margin lets every thread connect (and set up) before the measured
    # part begins.
    start = time.perf_counter() + 0.5 + a.warmup_seconds
    end = start + a.seconds
    outs: List[Dict[str, Any]] = [{} for _ in range(threads)]
    workers = [threading.Thread(target=round_trips,
                                args=(kvhost, address, setup, start, end, outs[i]))
               for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    for o in outs:
        if "error" in o:
            raise o["error"]
    times = [t for o in outs for t in o["times"]]
    seconds = max(o["end"] for o in outs) - start
    r = {"case": name, "clients": threads, "round_trips": len(times),
         "seconds": round(seconds, 3),
         "ops_per_s": round(len(times) / seconds, 1) if seconds > 0 else 0.0}
    r.update(common.summary_us(times))
    r.pop("samples")
    return r


def plan(a: argparse.Namespace, pool: str, xfer: str) -> List[Tuple[str, Setup, int]]:
    """The cases, as kvhost_rpc_bench names them (less its "fast: "): Alloc +
    Free per client count, then with one client AllocBatch + Free and the
    two submits."""
    cases: List[Tuple[str, Setup, int]] = [
        (f"Alloc({a.page_size}) + Free", alloc_free(pool, a.page_size), n)
        for n in a.client_counts]
    cases.append((f"AllocBatch({BATCH_RUNS} x {a.page_size}) + Free",
                  batch_alloc_free(pool, a.page_size, BATCH_RUNS), 1))
    cases.append((f"Backup submit, {TRANSFER_TOKENS} tokens", submit(xfer, True), 1))
    cases.append((f"Load submit, {TRANSFER_TOKENS} tokens", submit(xfer, False), 1))
    return cases


def cxx_run(a: argparse.Namespace, address: str, json_path: str,
            log_path: str) -> Dict[str, Any]:
    argv = [a.cxx_bench, f"--server={address}", f"--clients={a.clients}",
            f"--seconds={a.seconds}", f"--warmup-seconds={a.warmup_seconds}",
            f"--page-size={a.page_size}", f"--json-out={json_path}",
            # Python's client takes the fast path, unpinned: so does this run.
            "--paths=fast", "--placements=none"]
    # Three floors, then Alloc + Free per client count, AllocBatch, two submits.
    limit = (a.seconds + a.warmup_seconds + 1) * (len(a.client_counts) + 6) + CXX_SLACK_S
    code, doc, why = common.run_cxx(argv, log_path, limit)
    run = {"argv": argv, "exit_code": code, "log": log_path}
    if code != 0 or doc is None:
        run["error"] = why or f"exit {code}: " + common.log_tail(log_path, 8)
    else:
        run["cases"] = doc.get("cases", [])
    return run


def report(py: List[Dict[str, Any]], cxx: Optional[Dict[str, Any]]) -> str:
    cxx_cases = (cxx or {}).get("cases", [])
    rows = [["case", "clients", "C++ p50 us", "Py p50 us", "Py/C++", "Py-C++ us", "C++ p99 us",
             "Py p99 us", "C++ ops/s", "Py ops/s"]]
    for c in cxx_cases:
        if c["case"].startswith("floor"):
            rows.append([f"{c['case']} (C++)", str(c["clients"]), common.fmt(c["p50_us"]), "-",
                         "-", "-", common.fmt(c["p99_us"]), "-", common.fmt(c["ops_per_s"], 0),
                         "-"])
    for r in py:
        k = next((c for c in cxx_cases
                  if c["case"] == "fast: " + r["case"] and c["clients"] == r["clients"]), None)
        kp50 = k["p50_us"] if k else None
        rows.append([r["case"], str(r["clients"]), common.fmt(kp50), common.fmt(r["p50_us"]),
                     common.fmt(common.ratio(r["p50_us"], kp50), 2),
                     common.fmt(None if kp50 is None else r["p50_us"] - kp50),
                     common.fmt(k["p99_us"] if k else None), common.fmt(r["p99_us"]),
                     common.fmt(k["ops_per_s"] if k else None, 0),
                     common.fmt(r["ops_per_s"], 0)])
    return common.table(rows, "lrrrrrrrrr")


def main(argv: List[str]) -> int:
    a = parse_args(argv)
    kvhost = common.import_kvhost(a.lib or None)
    daemon = None
    doc: Dict[str, Any] = {"benchmark": "kvhost_py_rpc_bench", "schema": 1, "complete": False,
                           "error": "", "page_size": a.page_size, "seconds": a.seconds,
                           "warmup_seconds": a.warmup_seconds, "clients": a.client_counts,
                           "hardware_threads": os.cpu_count(), "python": [], "cxx": None}
    status = 0
    try:
        address = a.server
        if not address:
            daemon = common.Daemon(a.kvhostd, a.backend, ["--log-level=warn"])
            address = daemon.address
        doc["server"], doc["own_daemon"] = address, daemon is not None
        doc["library"] = kvhost.library_path()
        print(f"rpc_bench.py: kvhostd at {address}{' (started for this run)' if daemon else ''}"
              f", libkvhost_c {doc['library']}", flush=True)
        pool = f"py-rpc-bench-{os.getpid()}"
        xfer = f"py-rpc-bench-xfer-{os.getpid()}"
        spec = {"kind": "MHA", "layout": "LAYER_FIRST", "dtype": "UINT8",
                "page_size": a.page_size, "layer_num": 1, "head_num": 1, "head_dim": 1,
                "size_tokens": POOL_PAGES * a.page_size}
        # The transfer cases' pool, as the C++ benchmark's: page 1, one layer
        # of 8-byte rows.
        xfer_spec = dict(spec, page_size=1, head_dim=8, size_tokens=TRANSFER_TOKENS)
        with kvhost.Client(address, timeout=30, session=False, wait_ready=20) as admin:
            admin.create_pool(pool, spec)
            admin.create_pool(xfer, xfer_spec)
            try:
                cases = plan(a, pool, xfer)
                for i, (name, setup, n) in enumerate(cases):
                    r = python_case(kvhost, address, name, setup, a, n)
                    doc["python"].append(r)
                    print(f"[{i + 1}/{len(cases)}] Python, {name}, {n} client(s): "
                          f"{r['ops_per_s']:.0f} round trips/s, p50 {r['p50_us']:.1f} us, "
                          f"p99 {r['p99_us']:.1f} us ({r['round_trips']} in "
                          f"{r['seconds']:.2f} s)", flush=True)
            finally:
                admin.delete_pool(xfer)
                admin.delete_pool(pool)
        if a.cxx_bench:
            folder = os.path.dirname(os.path.abspath(a.json_out)) if a.json_out else \
                tempfile.mkdtemp(prefix="kvhost-pybench-")
            os.makedirs(folder, exist_ok=True)
            json_path = os.path.join(folder, "rpc_bench_cxx.json")
            log_path = a.cxx_log or os.path.join(folder, "rpc_bench_cxx.log")
            print(f"C++: {a.cxx_bench} against the same daemon ...", flush=True)
            doc["cxx"] = cxx_run(a, address, json_path, log_path)
            if "error" in doc["cxx"]:
                status = 1
                print(f"C++ benchmark failed: {doc['cxx']['error']}", file=sys.stderr)
        print()
        print(report(doc["python"], doc["cxx"]))
        print("(Alloc + Free: Alloc of one page then Free of it; a submit is the call alone, "
              "its ticket waited for untimed; Python: kvhost.Client over libkvhost_c.so; ops/s "
              "counts round trips of all clients)")
        doc["complete"] = status == 0
    except Exception as e:
        status = 1
        doc["error"] = f"{type(e).__name__}: {e}"
        print(f"error: {doc['error']}", file=sys.stderr)
        if daemon is not None:
            print(f"--- kvhostd log (tail) ---\n{daemon.log_tail()}", file=sys.stderr)
    finally:
        if daemon is not None:
            code = daemon.stop()
            daemon.cleanup()
            if code != 0 and status == 0:
                status = 1
                doc["error"] = f"kvhostd exited with {code} on SIGTERM"
                print(f"error: {doc['error']}", file=sys.stderr)
        if a.json_out:
            common.write_json(a.json_out, doc)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
