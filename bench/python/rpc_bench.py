#!/usr/bin/env python3
"""Alloc + Free round trips from Python, next to kvhost_rpc_bench's (C++).

One round trip is what a scheduler does per request: Alloc(page_size
tokens) of a pool, then Free of the slots it returned, here through the
Python package (kvhost.Client.alloc / free: ctypes -> libkvhost_c.so -> the
C++ client -> gRPC). Each case runs N client threads at once (--clients),
each with its own kvhost.Client (the ABI's calls release the GIL while they
wait); after --warmup-seconds each thread times its round trips for
--seconds. The pool is bench/rpc_bench.cc's: MHA LAYER_FIRST UINT8, one
layer, one head of one byte, 4096 pages.

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
import os
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List, Optional

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


def round_trips(kvhost: Any, address: str, pool: str, tokens: int, start: float, end: float,
                out: Dict[str, Any]) -> None:
    """One client thread: Alloc + Free until `end`, timing those after `start`."""
    try:
        with kvhost.Client(address, timeout=30, session=False, wait_ready=10) as c:
            times: List[float] = []
            while True:
                t0 = time.perf_counter()
                if t0 >= end:
                    break
                slots = c.alloc(pool, tokens)
                c.free(pool, slots)
                if t0 >= start:
                    times.append(time.perf_counter() - t0)
            out["times"] = times
            out["end"] = time.perf_counter()
    except Exception as e:  # reported by the case
        out["error"] = e


def python_case(kvhost: Any, address: str, pool: str, a: argparse.Namespace,
                threads: int) -> Dict[str, Any]:
    # The margin lets every thread connect before the measured part begins.
    start = time.perf_counter() + 0.2 + a.warmup_seconds
    end = start + a.seconds
    outs: List[Dict[str, Any]] = [{} for _ in range(threads)]
    workers = [threading.Thread(target=round_trips,
                                args=(kvhost, address, pool, a.page_size, start, end, outs[i]))
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
    r = {"case": f"Alloc({a.page_size}) + Free", "clients": threads, "round_trips": len(times),
         "seconds": round(seconds, 3),
         "ops_per_s": round(len(times) / seconds, 1) if seconds > 0 else 0.0}
    r.update(common.summary_us(times))
    r.pop("samples")
    return r


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
        spec = {"kind": "MHA", "layout": "LAYER_FIRST", "dtype": "UINT8",
                "page_size": a.page_size, "layer_num": 1, "head_num": 1, "head_dim": 1,
                "size_tokens": POOL_PAGES * a.page_size}
        with kvhost.Client(address, timeout=30, session=False, wait_ready=20) as admin:
            admin.create_pool(pool, spec)
            try:
                for i, n in enumerate(a.client_counts):
                    r = python_case(kvhost, address, pool, a, n)
                    doc["python"].append(r)
                    print(f"[{i + 1}/{len(a.client_counts)}] Python, {n} client(s): "
                          f"{r['ops_per_s']:.0f} round trips/s, p50 {r['p50_us']:.1f} us, "
                          f"p99 {r['p99_us']:.1f} us ({r['round_trips']} in "
                          f"{r['seconds']:.2f} s)", flush=True)
            finally:
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
        print("(a round trip is Alloc of one page then Free of it; Python: kvhost.Client over "
              "libkvhost_c.so; ops/s counts round trips of all clients)")
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
