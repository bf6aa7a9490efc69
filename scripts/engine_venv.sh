#!/usr/bin/env bash
# Builds the venv of the engines kvhost's Python tests run against (sglang and
# vllm, pinned, with torch and what their host-pool and offloading modules
# import; and the test tools, with pytest also alone in venv-<hash>/pytest-path), from
# python/requirements-engines.txt, and prints its python's path.
#   scripts/engine_venv.sh [--print]   --print: only print the path; exit 1 if
#                                      the venv is not built
# The venv lives outside the clone, keyed by the requirements file's hash, so
# CI's fresh clones reuse it: KVHOST_ENGINE_ROOT (default /var/cache/kvhost)
# holds venv-<hash>/ and wheels/ (every wheel downloaded once, reused when the
# requirements change). tests/engine_env.py computes the same path.
# Cost on the 2-core CI machine (docs/SGLANG.md): ~80 s to download 3 GB of
# wheels once, ~3 min to install them into a new venv; 0 s when it exists.
set -euo pipefail
cd "$(dirname "$0")/.."
REQ=python/requirements-engines.txt
ROOT=${KVHOST_ENGINE_ROOT:-/var/cache/kvhost}
PY=${PYTHON:-python3}
hash=$(sha256sum "$REQ" | cut -c1-12)
venv="$ROOT/venv-$hash"
if [[ "${1:-}" == --print ]]; then
  [[ -f "$venv/.complete" ]] || exit 1
  echo "$venv/bin/python"
  exit 0
fi
[[ $# -eq 0 ]] || { echo "usage: $0 [--print]" >&2; exit 2; }
if [[ -f "$venv/.complete" ]]; then
  echo "$venv/bin/python"
  exit 0
fi
if ! "$PY" -c 'import ensurepip' 2>/dev/null; then  # Debian's python3 lacks it
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
    python3-venv >/dev/null
fi
mkdir -p "$ROOT/wheels"
rm -rf "$venv"  # a half-built one (no .complete) from an interrupted run
"$PY" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
# Downloads only what wheels/ lacks; installs from there alone.
"${pip[@]}" download --no-deps -d "$ROOT/wheels" -r "$REQ" >&2
# The engines themselves (sglang, vllm) go in with --no-deps, after the rest.
engines='^(sglang|vllm)=='
grep -Ev "$engines" "$REQ" >"$venv/requirements-deps.txt"
mapfile -t engine_pins < <(grep -E "$engines" "$REQ")
"${pip[@]}" download -d "$ROOT/wheels" -r "$venv/requirements-deps.txt" >&2
"${pip[@]}" install --no-index --find-links "$ROOT/wheels" -r "$venv/requirements-deps.txt" >&2
"${pip[@]}" install --no-index --find-links "$ROOT/wheels" --no-deps \
  "${engine_pins[@]}" >&2
"$venv/bin/python" -c 'import torch, sglang.srt.mem_cache.pool_host' >&2
"$venv/bin/python" -c 'import vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector' >&2
# pytest and its dependencies alone, for the system's python3 to run the
# package's tests with (tests/pytest_run.py): no numpy, torch or sglang there.
grep -E '^(pytest|pluggy|iniconfig|packaging|Pygments)==' "$REQ" >"$venv/requirements-pytest.txt"
"${pip[@]}" install --no-index --find-links "$ROOT/wheels" --no-deps --target "$venv/pytest-path" \
  -r "$venv/requirements-pytest.txt" >&2
touch "$venv/.complete"
echo "$venv/bin/python"
