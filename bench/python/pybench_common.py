"""What the Python benchmarks (transfer_bench.py, rpc_bench.py) share.

- :func:`import_kvhost`: the checkout's python/kvhost over a given
  libkvhost_c.so (``--lib``), so that the package and the library are the
  ones under test and never an installed copy.
- :class:`Daemon`: a kvhostd of the benchmark's own, on a private unix
  socket and shm dir, stopped with SIGTERM (its exit code checked).
- :func:`run_cxx`: a C++ benchmark in a subprocess with ``--json-out``, its
  stdout kept in a log file and its JSON returned.
- Statistics as the C++ benchmarks compute them (nearest-rank percentiles,
  bench/bench_util.h) and their plain-text tables (client/cli_output.h).

No torch, no numpy: every benchmark answers ``--help`` and runs its host
backend parts on a machine with neither.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

#: The source checkout (this file is bench/python/pybench_common.py).
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: How long a kvhostd may take to listen: the cuda backend initialises CUDA
#: and probes every GPU first (about a second on an H200 host).
DAEMON_START_S = 60.0
#: SIGTERM drains accepted transfers for --drain-timeout (30 s) at most.
DAEMON_STOP_S = 40.0
#: Exit code of a benchmark that had nothing to run on (ctest's skip).
SKIP = 77


def import_kvhost(lib: Optional[str]) -> Any:
    """The kvhost package of this checkout over `lib` (or the package's own
    search when None: $KVHOST_LIBRARY, build/lib, the loader)."""
    if lib:
        os.environ["KVHOST_LIBRARY"] = os.path.abspath(lib)
    package_dir = os.path.join(REPO, "python")
    if os.path.isdir(os.path.join(package_dir, "kvhost")) and package_dir not in sys.path:
        sys.path.insert(0, package_dir)
    import kvhost  # noqa: PLC0415 (after the path is set)
    return kvhost


def nearest_rank(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of ascending values, q in (0, 1]; 0 when empty."""
    if not sorted_values:
        return 0.0
    rank = int(math.ceil(q * len(sorted_values)))
    return float(sorted_values[min(max(rank, 1), len(sorted_values)) - 1])


def median(values: Sequence[float]) -> float:
    return nearest_rank(sorted(values), 0.5)


def summary_us(seconds: Sequence[float]) -> Dict[str, float]:
    """p50 / p99 / p99.9 / max of durations in seconds, in microseconds."""
    s = sorted(v * 1e6 for v in seconds)
    return {"p50_us": round(nearest_rank(s, 0.5), 1), "p99_us": round(nearest_rank(s, 0.99), 1),
            "p999_us": round(nearest_rank(s, 0.999), 1),
            "max_us": round(s[-1], 1) if s else 0.0, "samples": len(s)}


def table(rows: List[List[str]], align: str) -> str:
    """Rows as a plain-text table; align has 'l' or 'r' per column."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for r in rows:
        cells = [c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(r, widths, align)]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def fmt(value: Optional[float], digits: int = 1) -> str:
    """A number for a table cell; '-' for a figure that was not measured."""
    return "-" if value is None else f"{value:.{digits}f}"


def ratio(num: Optional[float], den: Optional[float]) -> Optional[float]:
    return None if num is None or not den else num / den


def write_json(path: str, doc: Dict[str, Any]) -> None:
    """Writes `doc` to `path` (its folder made first) through a temp file."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=False)
        f.write("\n")
    os.replace(tmp, path)


class Daemon:
    """A kvhostd on a private socket and shm dir, for one benchmark run.

    `backend` is kvhostd's --backend; `flags` more of its flags. The log
    goes to `log_path` (kept) or to a file in the private dir (removed by
    stop()). Use as a context manager.
    """

    def __init__(self, binary: str, backend: str, flags: Sequence[str] = (),
                 log_path: Optional[str] = None) -> None:
        if not os.access(binary, os.X_OK):
            raise FileNotFoundError(f"kvhostd '{binary}' is not an executable file")
        self.dir = tempfile.mkdtemp(prefix="kvhost-pybench-")
        self.shm = tempfile.mkdtemp(prefix="kvhost-pybench-", dir="/dev/shm")
        self.socket = os.path.join(self.dir, "kvhost.sock")
        self.address = f"unix://{self.socket}"
        self.log_path = log_path or os.path.join(self.dir, "kvhostd.log")
        self.args = [binary, f"--listen={self.address}", f"--shm-dir={self.shm}",
                     f"--backend={backend}", *flags]
        self.exit_code: Optional[int] = None
        log = open(self.log_path, "w")
        try:
            self.proc: Optional[subprocess.Popen] = subprocess.Popen(
                self.args, stdout=log, stderr=subprocess.STDOUT)
        finally:
            log.close()
        deadline = time.monotonic() + DAEMON_START_S
        while not os.path.exists(self.socket):
            if self.proc.poll() is not None:
                code = self.proc.returncode
                self.proc = None
                raise RuntimeError(f"kvhostd exited with {code} during start: "
                                   f"{' '.join(self.args)}\n--- kvhostd log ---\n"
                                   f"{self.log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"kvhostd did not listen within {DAEMON_START_S:.0f} s")
            time.sleep(0.01)

    def log_tail(self, chars: int = 6000) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                text = f.read()
        except OSError as e:
            return f"(no log: {e})"
        return text if len(text) <= chars else "..." + text[-chars:]

    def stop(self) -> Optional[int]:
        """SIGTERM, then the exit code (None if it had to be killed)."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.exit_code = self.proc.wait(timeout=DAEMON_STOP_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                self.exit_code = None
            self.proc = None
        return self.exit_code

    def cleanup(self) -> None:
        """stop(), then the private dirs go (a log_path given stays)."""
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
        shutil.rmtree(self.shm, ignore_errors=True)

    def __enter__(self) -> "Daemon":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.cleanup()


def run_cxx(argv: List[str], log_path: str, timeout_s: float,
            env: Optional[Dict[str, str]] = None) -> Tuple[int, Optional[Dict[str, Any]], str]:
    """Runs a C++ benchmark whose argv holds --json-out=FILE.

    Its stdout and stderr go to `log_path`; progress lines are not shown.
    Returns (exit code, its JSON or None, why there is none). Exit 124 is a
    timeout (the process was killed).
    """
    json_path = next(a.split("=", 1)[1] for a in argv if a.startswith("--json-out="))
    if os.path.exists(json_path):
        os.unlink(json_path)
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(argv) + "\n")
        log.flush()
        try:
            code = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s,
                                  env=env, check=False).returncode
        except subprocess.TimeoutExpired:
            code = 124
        except OSError as e:
            return 127, None, f"cannot run {argv[0]}: {e}"
    if not os.path.exists(json_path):
        return code, None, f"{os.path.basename(argv[0])} exited {code} without JSON (log: " \
                           f"{log_path})"
    try:
        with open(json_path) as f:
            return code, json.load(f), ""
    except ValueError as e:
        return code, None, f"{json_path}: {e}"


def log_tail(path: str, lines: int = 15) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError as e:
        return f"(no log: {e})"
