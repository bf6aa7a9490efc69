#!/usr/bin/env python3
"""CI smoke test of the Python benchmarks (ctest python_bench_smoke).

Seconds each, to prove they still work end to end; the numbers mean
nothing at this size. No GPU, torch or numpy needed:
  1. transfer_bench.py and rpc_bench.py answer --help without importing
     torch (and never import it when the backend is host);
  2. rpc_bench.py: its cases from Python (Alloc + Free with 1 and 2 clients,
     AllocBatch + Free, Backup and Load submits), ~2 s each, against a
     host-backend kvhostd, and kvhost_rpc_bench's against the same daemon
     when RPC_BENCH is given; both appear in the JSON;
  3. transfer_bench.py --backend=host: one tiny case (MHA LAYER_FIRST page
     16, 256 tokens x 4 layers) through shm device pools, both directions,
     bytes verified, plus the per-layer load case;
  4. sglang_sched_bench.py: a tiny run (64 tokens, 2 layers) prints both rows.
  usage: smoke_test.py KVHOSTD LIBKVHOST_C [RPC_BENCH]
Exit 0 passed, 1 failed, 77 skipped (no kvhostd or libkvhost_c.so built).
"""

import json
import os
import runpy
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
SKIP = 77


def run(argv, timeout=120):
    p = subprocess.run([sys.executable, *argv], stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=timeout, check=False)
    print(f"$ {' '.join(argv)}\n{p.stdout}")
    return p.returncode, p.stdout


def check_help_without_torch():
    for script in ("transfer_bench.py", "rpc_bench.py"):
        saved = sys.argv
        sys.argv = [script, "--help"]
        try:
            runpy.run_path(os.path.join(HERE, script), run_name="__main__")
            raise AssertionError(f"{script} --help did not exit")
        except SystemExit as e:
            assert e.code in (0, None), f"{script} --help exited {e.code}"
        finally:
            sys.argv = saved
        assert "torch" not in sys.modules, f"{script} --help imported torch"


def check_rpc_bench(kvhostd, lib, rpc_bench, tmp):
    out = os.path.join(tmp, "rpc.json")
    argv = [os.path.join(HERE, "rpc_bench.py"), f"--kvhostd={kvhostd}", f"--lib={lib}",
            "--seconds=2", "--warmup-seconds=0.2", "--clients=1,2", f"--json-out={out}"]
    if rpc_bench:
        argv.append(f"--cxx-bench={rpc_bench}")
    code, text = run(argv)
    assert code == 0, f"rpc_bench.py exited {code}"
    with open(out) as f:
        doc = json.load(f)
    assert doc["complete"] and doc["error"] == "", doc["error"]
    py = doc["python"]
    assert [(r["case"], r["clients"]) for r in py] == [
        ("Alloc(16) + Free", 1), ("Alloc(16) + Free", 2), ("AllocBatch(64 x 16) + Free", 1),
        ("Backup submit, 4096 tokens", 1), ("Load submit, 4096 tokens", 1)], py
    assert all(r["round_trips"] > 0 and 0 < r["p50_us"] <= r["p99_us"] for r in py), py
    assert "Alloc(16) + Free" in text
    if rpc_bench:
        cases = doc["cxx"]["cases"]
        assert any(c["case"] == "fast: Alloc(16) + Free" and c["clients"] == 1
                   for c in cases), cases
        assert any(c["case"].startswith("floor: 2 gRPC") for c in cases), cases


def check_transfer_bench_host(kvhostd, lib, tmp):
    out = os.path.join(tmp, "transfer.json")
    code, text = run([os.path.join(HERE, "transfer_bench.py"), "--backend=host",
                      f"--kvhostd={kvhostd}", f"--lib={lib}", "--cases=MHA/LAYER_FIRST/16",
                      "--tokens=256", "--layers=4", "--seconds=0.3", "--churn-ops=50",
                      "--ttfl-page-sizes=16", "--ceiling-bytes=16M", f"--json-out={out}"])
    assert code == 0, f"transfer_bench.py --backend=host exited {code}"
    with open(out) as f:
        doc = json.load(f)
    assert doc["complete"], doc["error"]
    (res,) = doc["python"]
    assert res["exit_code"] == 0 and not res["errors"], res["errors"]
    assert not res["torch_imported"], "the host backend's worker imported torch"
    assert [c["direction"] for c in res["cases"]] == ["backup", "load"], res["cases"]
    for c in res["cases"]:
        assert c["bytes_verified"] and c["bytes"] == 256 * 4 * 4096, c
        assert c["transfers"] >= 3 and c["engine_gb_per_s"] > 0 and c["ticket_path"].startswith("host"), c
        assert 0 < c["submit"]["p50_us"] <= c["done"]["p50_us"], c
    (t,) = res["ttfl"]
    assert t["page_size"] == 16 and 0 < t["first_ms"] <= t["total_ms"], t
    assert "MHA LAYER_FIRST ps16" in text and "(of ceil)" in text


def check_sglang_sched_bench(kvhostd, lib, tmp):
    code, text = run([os.path.join(HERE, "sglang_sched_bench.py"), f"--kvhostd={kvhostd}",
                      f"--lib={lib}", "--tokens=64", "--layers=2", "--heads=2",
                      "--head-dim=8", "--page-size=4", "--iters=2"])
    assert code == 0, f"sglang_sched_bench.py exited {code}"
    assert "backup_from_device_all_layer" in text and "load_to_device_per_layer" in text, text


def main():
    if len(sys.argv) not in (3, 4):
        print(__doc__)
        return 2
    kvhostd, lib = (os.path.abspath(x) for x in sys.argv[1:3])
    rpc_bench = os.path.abspath(sys.argv[3]) if len(sys.argv) == 4 and sys.argv[3] else ""
    for what, path in (("kvhostd", kvhostd), ("libkvhost_c.so", lib)):
        if not os.path.isfile(path):
            print(f"skipped: {what} is not built ({path})")
            return SKIP
    if rpc_bench and not os.path.isfile(rpc_bench):
        rpc_bench = ""  # a build without benchmarks: Python's side only
    checks = [("help_without_torch", check_help_without_torch, ()),
              ("rpc_bench", check_rpc_bench, (kvhostd, lib, rpc_bench)),
              ("transfer_bench_host", check_transfer_bench_host, (kvhostd, lib)),
              ("sglang_sched_bench", check_sglang_sched_bench, (kvhostd, lib))]
    failed = 0
    with tempfile.TemporaryDirectory(prefix="kvhost-pybench-smoke-") as tmp:
        for name, check, args in checks:
            try:
                check(*args, *((tmp,) if name != "help_without_torch" else ()))
                print(f"ok   {name}")
            except Exception as e:  # report every check
                failed += 1
                print(f"FAIL {name}: {type(e).__name__}: {e}")
    print(f"{'FAIL' if failed else 'PASS'}: {len(checks) - failed} of {len(checks)} checks")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
