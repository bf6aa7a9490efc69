#!/usr/bin/env python3
"""kvhost's transfer benchmark driven from Python, next to the C++ one.

The headline cases of bench/cuda_transfer_bench.cc (docs/PERF.md, issue 15)
from a torch worker that uses only the Python package: it creates each host
pool, allocates its slots, attaches per-layer KV tensors with
kvhost.torch_helpers.attach_tensors, and backs up and loads 8192 random
tokens x 32 layers (MHA 8 x 128 bf16: 1 GiB; MLA 576 bf16) back to back
for --seconds per case and direction, bytes verified once per case
(transfer_worker.py says how). Cases (--cases): MHA LAYER_FIRST and
PAGE_FIRST at page 1, 16 and 64, MLA LAYER_FIRST and PAGE_FIRST at 16;
both directions; kvhostd's default (auto) path.

Reported per case and direction: GB/s over the ticket's duration_us
(median; the C++ benchmark's figure), with its ratio to the ceiling
measured in the same worker (pinned cudaMemcpyAsync, contiguous); the
Python-side latencies of each call: Backup / Load until it returns
(submit), and until Ticket.wait returns (done); and, for MHA LAYER_FIRST at
--ttfl-page-sizes, per-layer loads with layer progress (the Load call's
return, layer 0 and the last layer on torch's stream, a Load of no rows).

--allocator: where the worker's KV tensors come from, each allocator in a
worker process of its own, one after the other, against one kvhostd:
  default     torch's caching allocator (cudaMalloc; CUDA IPC)
  expandable  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (cuMem)
  cumem       cuMemCreate / cuMemMap through ctypes on libcuda.so.1 (POSIX
              fd handles), wrapped as torch tensors (cumem.py)
A daemon that cannot import cuMem memory refuses the attach with
FAILED_PRECONDITION; the table says so for that allocator.

--cxx-bench=PATH runs kvhost_cuda_transfer_bench in the same invocation,
after the Python workers, on the same cases (--paths=auto, --kinds,
--layouts, --page-sizes per kind, --repeats=--cxx-repeats; its worker-cost
part cut to the least: --workers=fma --duty=1, short windows, no anchor)
with its own kvhostd of the same binary, and the table puts its GB/s, its
ceiling and its client-side times beside Python's.

--backend=host runs the same logic on a host-backend kvhostd with
shared-memory device pools (kvhost.ShmDevicePool; no GPU, torch or numpy):
the CI smoke test's mode; its GB/s mean nothing.

Exit codes: 0 every case measured (and the C++ run passed), 1 a case, a
worker, the daemon or the C++ run failed (an allocator's refusal too),
2 bad flags, 77 no GPU or no torch for the cuda backend.
"""

from __future__ import annotations

import argparse
import ctypes as C
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pybench_common as common  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
KINDS = ("MHA", "MLA")
LAYOUTS = ("LAYER_FIRST", "PAGE_FIRST", "PAGE_FIRST_DIRECT", "PAGE_HEAD", "PAGE_UNIFIED")
ALLOCATORS = ("default", "expandable", "cumem")
#: The C++ benchmark's headline (docs/PERF.md, run M) at the pages asked.
DEFAULT_CASES = ("MHA/LAYER_FIRST/1,MHA/LAYER_FIRST/16,MHA/LAYER_FIRST/64,"
                 "MHA/PAGE_FIRST/1,MHA/PAGE_FIRST/16,MHA/PAGE_FIRST/64,"
                 "MLA/LAYER_FIRST/16,MLA/PAGE_FIRST/16")
#: The C++ benchmark's duplex case runs at this page size whatever is asked
#: (kProbePageSize): --tokens must be a multiple of it.
CXX_PROBE_PAGE = 64
#: The C++ benchmark's parts this comparison does not use, cut to the least
#: its flags allow: the FMA worker (no cuBLAS needed) back to back only, over
#: short windows; no anchor; a short duplex.
CXX_FIXED_FLAGS = ["--paths=auto", "--workers=fma", "--duty=1", "--window-s=0.05",
                   "--baseline-s=0.1", "--anchor-quotas=none", "--duplex-s=0.1"]
#: Each case's pool, churn, fill, byte check and warm-ups (seconds; a 2 GiB
#: MHA pool is created and pinned in about a second on the H200 host).
CASE_SETUP_S = 5.0
#: A worker's torch import, CUDA context and ceiling.
WORKER_START_S = 30.0


def parse_bytes(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    t = text.strip().upper()
    scale = units.get(t[-1:], 1)
    value = int(t[:-1] if t[-1:] in units else t) * scale
    if value <= 0:
        raise ValueError(text)
    return value


def parse_cases(text: str) -> List[Dict[str, Any]]:
    cases = []
    for item in text.split(","):
        parts = [p.strip().upper() for p in item.strip().split("/")]
        if len(parts) != 3 or parts[0] not in KINDS or parts[1] not in LAYOUTS or \
                not parts[2].isdigit() or int(parts[2]) < 1:
            raise ValueError(f"'{item}' is not KIND/LAYOUT/PAGE (e.g. MHA/LAYER_FIRST/16; kinds "
                             f"{', '.join(KINDS)}; layouts {', '.join(LAYOUTS)})")
        if parts[0] == "MLA" and parts[1] == "PAGE_HEAD":
            raise ValueError(f"'{item}': PAGE_HEAD is MHA only")
        case = {"kind": parts[0], "layout": parts[1], "page_size": int(parts[2])}
        if case not in cases:
            cases.append(case)
    return cases


def parse_args(argv: List[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="transfer_bench.py", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Example (an H200 host, from a bundle): transfer_bench.py "
               "--kvhostd=bundle/bin/kvhostd --lib=bundle/lib/libkvhost_c.so.1 "
               "--cxx-bench=bundle/bin/kvhost_cuda_transfer_bench "
               "--allocator=default,expandable,cumem --json-out=OUT/pybench.json")
    p.add_argument("--kvhostd", default=os.environ.get("KVHOST_KVHOSTD", ""),
                   help="kvhostd to start (default $KVHOST_KVHOSTD, else build/bin/kvhostd); "
                   "the C++ benchmark gets the same")
    p.add_argument("--lib", default="", help="libkvhost_c.so to load (default: the package's "
                   "search: $KVHOST_LIBRARY, build/lib, the loader)")
    p.add_argument("--backend", default="cuda", choices=["cuda", "host"],
                   help="cuda: torch worker on GPU 0 (default); host: shm device pools, no GPU")
    p.add_argument("--allocator", default="default",
                   help="the KV tensors' memory, comma separated: default, expandable, cumem "
                   "(cuda backend)")
    p.add_argument("--cases", default=DEFAULT_CASES,
                   help="KIND/LAYOUT/PAGE, comma separated (default: the headline's)")
    p.add_argument("--directions", default="backup,load", help="backup, load")
    p.add_argument("--tokens", type=int, default=8192, help="token slots per transfer")
    p.add_argument("--layers", type=int, default=32, help="layers of the pools")
    p.add_argument("--seconds", type=float, default=2.0,
                   help="seconds of back-to-back transfers per case and direction")
    p.add_argument("--churn-ops", type=int, default=1000,
                   help="random Alloc / Free calls on each pool before the transfer's Alloc")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--ceiling-bytes", default="1G", help="bytes of each ceiling copy")
    p.add_argument("--ttfl-page-sizes", default="64",
                   help="page sizes of the per-layer load case (MHA LAYER_FIRST), or 'none'")
    p.add_argument("--cxx-bench", default="", help="kvhost_cuda_transfer_bench: the same cases "
                   "in C++ in this invocation")
    p.add_argument("--cxx-repeats", type=int, default=10,
                   help="the C++ benchmark's timed transfers per case and direction (median)")
    p.add_argument("--cxx-timeout", type=float, default=420.0,
                   help="seconds the C++ benchmark may take in all")
    p.add_argument("--daemon-flags", default="",
                   help="more kvhostd flags, comma separated (the C++ benchmark's daemons too)")
    p.add_argument("--out-dir", default="", help="worker results, the kvhostd log and the C++ "
                   "output (default: --json-out's folder, else a temp folder)")
    p.add_argument("--json-out", default="", help="write the results as JSON here")
    a = p.parse_args(argv)
    try:
        a.case_list = parse_cases(a.cases)
        a.ceiling_nbytes = parse_bytes(a.ceiling_bytes)
        a.ttfl_pages = [] if a.ttfl_page_sizes.strip().lower() == "none" else \
            sorted({int(x) for x in a.ttfl_page_sizes.split(",") if x.strip()})
    except ValueError as e:
        p.error(str(e))
    a.allocators = [x.strip().lower() for x in a.allocator.split(",") if x.strip()]
    a.direction_list = [x.strip().lower() for x in a.directions.split(",") if x.strip()]
    a.daemon_flag_list = [x for x in a.daemon_flags.split(",") if x]
    if not a.allocators or any(x not in ALLOCATORS for x in a.allocators):
        p.error(f"--allocator: '{a.allocator}' is not a list of {', '.join(ALLOCATORS)}")
    if a.backend == "host" and a.allocators != ["default"]:
        p.error("--allocator applies to the cuda backend only")
    if not a.direction_list or any(d not in ("backup", "load") for d in a.direction_list):
        p.error(f"--directions: '{a.directions}' is not a list of backup, load")
    if a.tokens < 1 or a.layers < 1 or not a.seconds > 0 or a.churn_ops < 0 or \
            a.cxx_repeats < 1:
        p.error("--tokens, --layers, --cxx-repeats must be >= 1, --seconds > 0, "
                "--churn-ops >= 0")
    pages = {c["page_size"] for c in a.case_list} | set(a.ttfl_pages)
    if a.cxx_bench:
        pages.add(CXX_PROBE_PAGE)
    for ps in sorted(pages):
        if a.tokens % ps:
            p.error(f"--tokens {a.tokens} is not a multiple of page size {ps}"
                    + (" (the C++ benchmark's duplex page)" if ps == CXX_PROBE_PAGE else ""))
    if not a.kvhostd:
        a.kvhostd = os.path.join(common.REPO, "build", "bin", "kvhostd")
    if a.backend == "host":
        a.ceiling_nbytes = min(a.ceiling_nbytes, 256 << 20)
    return a


def gpu_count() -> Tuple[int, str]:
    """CUDA devices the driver sees (no torch): (count, why none)."""
    try:
        cu = C.CDLL("libcuda.so.1")
    except OSError as e:
        return 0, f"no CUDA driver ({e})"
    count = C.c_int(0)
    rc = cu.cuInit(0)
    if rc == 0:
        rc = cu.cuDeviceGetCount(C.byref(count))
    return (count.value, "") if rc == 0 else (0, f"cuInit / cuDeviceGetCount: CUresult {rc}")


# --- the Python side ----------------------------------------------------------

def worker_env(allocator: str) -> Dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    if allocator == "expandable":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    return env


def run_worker(a: argparse.Namespace, address: str, allocator: str,
               out_dir: str) -> Dict[str, Any]:
    cfg = {"address": address, "backend": a.backend, "allocator": allocator,
           "lib": os.path.abspath(a.lib) if a.lib else "", "cases": a.case_list,
           "directions": a.direction_list, "tokens": a.tokens, "layers": a.layers,
           "seconds": a.seconds, "churn_ops": a.churn_ops, "seed": a.seed,
           "ceiling_bytes": a.ceiling_nbytes, "ttfl_page_sizes": a.ttfl_pages}
    cfg_path = os.path.join(out_dir, f"pybench-{allocator}.config.json")
    res_path = os.path.join(out_dir, f"pybench-{allocator}.json")
    common.write_json(cfg_path, cfg)
    if os.path.exists(res_path):
        os.unlink(res_path)
    limit = WORKER_START_S + len(a.case_list) * (
        CASE_SETUP_S + len(a.direction_list) * (3 * a.seconds + 2)) + len(a.ttfl_pages) * 20
    print(f"== Python worker, allocator {allocator} (limit {limit:.0f} s)", flush=True)
    argv = [sys.executable, os.path.join(HERE, "transfer_worker.py"), cfg_path, res_path]
    try:
        code = subprocess.run(argv, env=worker_env(allocator), timeout=limit,
                              check=False).returncode
    except subprocess.TimeoutExpired:
        code = 124
    result: Dict[str, Any] = {"allocator": allocator, "cases": [], "ttfl": [], "errors": []}
    if os.path.exists(res_path):
        with open(res_path) as f:
            result = json.load(f)
    result["exit_code"] = code
    if code == 124:
        result["errors"].append({"case": "", "error": f"killed after {limit:.0f} s"})
    elif code not in (0, common.SKIP) and not result.get("errors"):
        result["errors"].append({"case": "", "error": f"worker exited {code} without a result"})
    return result


# --- the C++ side -------------------------------------------------------------

def cxx_runs(a: argparse.Namespace) -> List[Dict[str, Any]]:
    """The C++ benchmark's invocations: one per kind, each the cross product
    of that kind's layouts and page sizes (all of them the cases asked for
    when every layout of a kind has the same page sizes, as the headline)."""
    runs = []
    for kind in KINDS:
        mine = [c for c in a.case_list if c["kind"] == kind]
        if not mine:
            continue
        layouts = sorted({c["layout"] for c in mine}, key=LAYOUTS.index)
        pages = sorted({c["page_size"] for c in mine})
        flags = [f"--kvhostd={a.kvhostd}", *CXX_FIXED_FLAGS, f"--kinds={kind}",
                 f"--layouts={','.join(layouts)}", f"--page-sizes={','.join(map(str, pages))}",
                 f"--directions={','.join(a.direction_list)}", f"--tokens={a.tokens}",
                 f"--layers={a.layers}", f"--repeats={a.cxx_repeats}",
                 f"--churn-ops={a.churn_ops}", f"--seed={a.seed}",
                 f"--ceiling-bytes={a.ceiling_bytes}",
                 f"--ttfl-page-sizes={','.join(map(str, a.ttfl_pages or [CXX_PROBE_PAGE]))}"]
        if a.daemon_flag_list:
            flags.append(f"--daemon-flags={','.join(a.daemon_flag_list)}")
        runs.append({"kind": kind, "flags": flags})
    return runs


def run_cxx(a: argparse.Namespace, out_dir: str) -> List[Dict[str, Any]]:
    runs = cxx_runs(a)
    start = time.monotonic()
    for run in runs:
        json_path = os.path.join(out_dir, f"cxx-{run['kind']}.json")
        log_path = os.path.join(out_dir, f"cxx-{run['kind']}.log")
        argv = [a.cxx_bench, *run["flags"], f"--json-out={json_path}"]
        left = a.cxx_timeout - (time.monotonic() - start)
        print(f"== C++: {' '.join(argv)}", flush=True)
        code, doc, why = common.run_cxx(argv, log_path, max(left, 1))
        run.update(argv=argv, exit_code=code, log=log_path)
        if doc is not None:
            run.update(ceiling=doc.get("ceiling"), cases=doc.get("cases", []),
                       ttfl=doc.get("ttfl", []), gpu=doc.get("gpu"),
                       complete=doc.get("complete", False))
        if code == common.SKIP:
            run["error"] = "skipped: no usable CUDA GPU"
        elif code != 0 or doc is None or not doc.get("complete"):
            run["error"] = (why or (doc or {}).get("error") or f"exit {code}") + \
                "\n" + common.log_tail(log_path, 8)
        print(f"== C++ {run['kind']}: exit {code}" +
              (f": {run['error']}" if "error" in run else ""), flush=True)
    return runs


# --- the report ---------------------------------------------------------------

def label(case: Dict[str, Any]) -> str:
    return f"{case['kind']} {case['layout']} ps{case['page_size']}"


def find(items: List[Dict[str, Any]], case: Dict[str, Any], direction: str,
         **extra: Any) -> Optional[Dict[str, Any]]:
    for r in items:
        if r.get("kind") == case["kind"] and r.get("layout") == case["layout"] and \
                int(r.get("page_size", 0)) == case["page_size"] and \
                r.get("direction") == direction and all(r.get(k) == v for k, v in extra.items()):
            return r
    return None


def cxx_case(runs: List[Dict[str, Any]], case: Dict, direction: str) -> Tuple[Optional[Dict],
                                                                            Optional[Dict]]:
    for run in runs:
        r = find(run.get("cases", []), case, direction, path="auto")
        if r is not None:
            return r, run.get("ceiling")
    return None, None


def py_cell(res: Dict[str, Any], case: Dict, direction: str) -> Tuple[str, Optional[Dict]]:
    r = find(res.get("cases", []), case, direction)
    if r is not None:
        return f"{r['engine_gb_per_s']:.1f} ({common.fmt(r['vs_ceiling'], 2)})", r
    if res.get("refused"):
        return "refused", None
    if res.get("skipped"):
        return "skipped", None
    return "failed", None


def gbps_table(a: argparse.Namespace, py: List[Dict], cxx: List[Dict]) -> List[str]:
    head = ["case", "dir", "C++ GB/s (of ceil)"]
    for res in py:
        head += [f"Py {res['allocator']} GB/s (of ceil)", f"{res['allocator']}/C++"]
    head += ["ceiling C++ D2H/H2D", "ceiling Py D2H/H2D", "host run pages C++/Py",
             "Py ticket path"]
    rows = [head]
    for case in a.case_list:
        for d in a.direction_list:
            k, kceil = cxx_case(cxx, case, d)
            row = [label(case), d,
                   "-" if k is None else f"{k['engine_gb_per_s']:.1f} ({k['vs_ceiling']:.2f})"]
            first: Dict[str, Any] = {}  # the first allocator that measured the case
            for res in py:
                cell, r = py_cell(res, case, d)
                row += [cell, common.fmt(common.ratio(r and r["engine_gb_per_s"],
                                                      k and k["engine_gb_per_s"]), 3)]
                first = first or r or {}
            pceil = next((res["ceiling"] for res in py if res.get("ceiling")), None)
            runs = f"{common.fmt(k and k.get('host_run_pages'))}/" \
                   f"{common.fmt(first.get('host_run_pages'))}"
            row += [ceiling_cell(kceil), ceiling_cell(pceil), runs,
                    first.get("ticket_path") or "-"]
            rows.append(row)
    lines = [common.table(rows, "ll" + "r" * (len(head) - 3) + "l"),
             "(host run pages: mean consecutive host pages per run of the transfer's slots, "
             "after each side's own churn)"]
    for run in cxx:
        if run.get("ceiling"):
            lines.append(f"ceiling, C++ {run['kind']} run: {ceiling_line(run['ceiling'])}")
    for res in py:
        if res.get("ceiling"):
            lines.append(f"ceiling, Python {res['allocator']} worker "
                         f"({res['ceiling'].get('what', '')}): {ceiling_line(res['ceiling'])}")
    return lines


def ceiling_line(c: Dict) -> str:
    both = c.get("duplex_gb_per_s")
    return (f"D2H {c['d2h_gb_per_s']:.2f}, H2D {c['h2d_gb_per_s']:.2f}"
            + (f", both at once {both:.2f}" if both else "") + f" GB/s ({c['bytes']} bytes)")


def ceiling_cell(c: Optional[Dict]) -> str:
    if not c:
        return "-"
    return f"{c['d2h_gb_per_s']:.1f}/{c['h2d_gb_per_s']:.1f}"


def calls_table(a: argparse.Namespace, py: List[Dict], cxx: List[Dict]) -> List[str]:
    rows = [["case", "dir", "alloc", "Py submit p50/p99 us", "Py done p50/p99 ms",
             "C++ done ms", "Py client GB/s", "C++ client GB/s", "Py/C++ client"]]
    for res in py:
        for case in a.case_list:
            for d in a.direction_list:
                r = find(res.get("cases", []), case, d)
                if r is None:
                    continue
                k, _ = cxx_case(cxx, case, d)
                kc = k["client_gb_per_s"] if k else None
                kdone = k["bytes"] / 1e9 / kc * 1e3 if kc else None
                rows.append([label(case), d, res["allocator"],
                             f"{r['submit']['p50_us']:.0f}/{r['submit']['p99_us']:.0f}",
                             f"{r['done']['p50_us'] / 1e3:.2f}/{r['done']['p99_us'] / 1e3:.2f}",
                             common.fmt(kdone, 2), f"{r['client_gb_per_s']:.1f}",
                             common.fmt(kc), common.fmt(common.ratio(r["client_gb_per_s"], kc),
                                                        3)])
    if len(rows) == 1:
        return []
    return [common.table(rows, "lll" + "r" * 6)]


def ttfl_table(py: List[Dict], cxx: List[Dict]) -> List[str]:
    rows = [["MHA LAYER_FIRST", "alloc", "Py call ms", "C++ call ms", "Py first ms",
             "C++ first ms", "Py all ms", "C++ all ms", "Py empty Load ms",
             "C++ empty Load ms"]]
    for res in py:
        for t in res.get("ttfl", []):
            k = next((x for run in cxx for x in run.get("ttfl", [])
                      if x.get("page_size") == t["page_size"] and x.get("path") == "auto"), None)
            rows.append([f"ps{t['page_size']}", res["allocator"], f"{t['call_ms']:.3f}",
                         common.fmt(k and k["rpc_return_ms"], 3), f"{t['first_ms']:.3f}",
                         common.fmt(k and k["first_layer_ms"], 3), f"{t['total_ms']:.2f}",
                         common.fmt(k and k["total_ms"], 2), f"{t['empty_load_ms']:.3f}",
                         common.fmt(k and k["empty_rpc_ms"], 3)])
    if len(rows) == 1:
        return []
    return [common.table(rows, "ll" + "r" * 8)]


def report(a: argparse.Namespace, py: List[Dict], cxx: List[Dict]) -> str:
    out = ["", f"GB/s = bytes over the ticket's duration_us, median; (of ceil) = its ratio to "
           f"the ceiling of the same direction measured in the same process; {a.tokens} tokens x "
           f"{a.layers} layers per transfer, kvhostd --transfer-path=auto"]
    out += gbps_table(a, py, cxx)
    calls = calls_table(a, py, cxx)
    if calls:
        out += ["", "Calls from Python: submit = Backup / Load until it returns; done = until "
                "Ticket.wait returns; C++ done = its median submit-to-WaitTransfer time; "
                "client GB/s = bytes over the median done time"] + calls
    ttfl = ttfl_table(py, cxx)
    if ttfl:
        out += ["", "Per-layer loads (layer progress), median of 10: the Load call's return, "
                "layer 0 and the last layer ready on the worker's stream, from before the call"]
        out += ttfl
    for res in py:
        if res.get("refused"):
            out.append(f"allocator {res['allocator']}: the attach was refused: "
                       f"{res['refused']}")
        elif res.get("skipped"):
            out.append(f"allocator {res['allocator']}: skipped: {res['skipped']}")
        for e in res.get("errors", []):
            if not e.get("skipped") and e.get("error") != res.get("refused"):
                out.append(f"allocator {res['allocator']}: {e['case'] or 'worker'}: "
                           f"{e['error']}")
    for run in cxx:
        if "error" in run:
            out.append(f"C++ {run['kind']}: {run['error']}")
    return "\n".join(out)


def main(argv: List[str]) -> int:
    a = parse_args(argv)
    if a.backend == "cuda":
        if importlib.util.find_spec("torch") is None:
            print("skipped: torch is not installed (the cuda backend's worker needs it; "
                  "--backend=host runs without)")
            return common.SKIP
        count, why = gpu_count()
        if count == 0:
            print(f"skipped: no usable CUDA GPU: {why or 'no device'}")
            return common.SKIP
    out_dir = a.out_dir or (os.path.dirname(os.path.abspath(a.json_out)) if a.json_out
                            else tempfile.mkdtemp(prefix="kvhost-pybench-"))
    os.makedirs(out_dir, exist_ok=True)
    doc: Dict[str, Any] = {"benchmark": "kvhost_py_transfer_bench", "schema": 1,
                           "complete": False, "error": "", "config": {
                               "backend": a.backend, "allocators": a.allocators,
                               "cases": a.case_list, "directions": a.direction_list,
                               "tokens": a.tokens, "layers": a.layers, "seconds": a.seconds,
                               "churn_ops": a.churn_ops, "seed": a.seed,
                               "ceiling_bytes": a.ceiling_nbytes,
                               "ttfl_page_sizes": a.ttfl_pages, "kvhostd": a.kvhostd,
                               "lib": a.lib, "cxx_bench": a.cxx_bench,
                               "cxx_repeats": a.cxx_repeats, "daemon_flags": a.daemon_flag_list},
                           "python": [], "cxx": []}
    status = 0
    start = time.monotonic()
    daemon = None
    try:
        flags = ["--log-level=info", "--transfer-path=auto"] if a.backend == "cuda" else \
            ["--log-level=warn"]
        daemon = common.Daemon(a.kvhostd, a.backend, flags + a.daemon_flag_list,
                               log_path=os.path.join(out_dir, "kvhostd-pybench.log"))
        print(f"transfer_bench.py: kvhostd {a.kvhostd} --backend={a.backend} at "
              f"{daemon.address}; {len(a.case_list)} cases x {len(a.direction_list)} directions, "
              f"allocators {','.join(a.allocators)}; output in {out_dir}", flush=True)
        for allocator in a.allocators:
            res = run_worker(a, daemon.address, allocator, out_dir)
            doc["python"].append(res)
            if res["exit_code"] != 0:
                status = 1
        code = daemon.stop()
        if code != 0:
            status = 1
            doc["error"] = f"kvhostd exited with {code} on SIGTERM (log {daemon.log_path})"
        if a.cxx_bench:
            doc["cxx"] = run_cxx(a, out_dir)
            if any("error" in r for r in doc["cxx"]):
                status = 1
        print(report(a, doc["python"], doc["cxx"]))
        if doc["error"]:
            print(f"error: {doc['error']}")
        if all(r.get("skipped") for r in doc["python"]) and not a.cxx_bench:
            status = common.SKIP
        doc["complete"] = status == 0
    except Exception as e:
        status = 1
        doc["error"] = f"{type(e).__name__}: {e}"
        print(f"error: {doc['error']}", file=sys.stderr)
    finally:
        if daemon is not None:
            daemon.cleanup()
        doc["elapsed_s"] = round(time.monotonic() - start, 1)
        if a.json_out:
            common.write_json(a.json_out, doc)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
