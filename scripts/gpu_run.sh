#!/usr/bin/env bash
# GPU checks from a bundle (scripts/bundle.sh) on a GPU machine without our
# build dependencies: the gpu tests, the integration tests, the CUDA
# transfer benchmark, then the Python benchmarks, each with its output under
# OUT_DIR.
#   scripts/gpu_run.sh OUT_DIR [tests|bench|pybench|mps-bench|sglang|all] [bench flags...]
# mps-bench runs the benchmark again under MPS (started here and stopped
# before the script ends, also on failure). pybench runs bench/python's
# rpc_bench.py and transfer_bench.py (a torch worker over the Python package,
# every allocator, the C++ benchmarks on the same cases beside it; about
# 3 minutes planned; the flags after `pybench` go to transfer_bench.py; tables in
# OUT_DIR/py*_bench.txt, JSON in OUT_DIR/py*_bench.json, the rest in
# OUT_DIR/pybench). The benchmark's GEMM worker dlopens cuBLAS: KVHOST_CUBLAS
# is set here to the first libcublas.so.* of a pip nvidia package (torch's)
# when not set already; the benchmark itself also tries the loader path.
# sglang (not part of all) runs tests/python_sglang_gpu_engine_test.py: sglang's own
# HostPoolGroup / HybridCacheController / L2TransferEngine over kvhost pools and
# sglang's CUDA device pools, in a venv (KVHOST_SGLANG_VENV, default .sglang-venv)
# made with `python3 -m venv --system-site-packages` (torch is the machine's; its
# site is added by a .pth where python3 is itself a venv, whose packages a venv made
# from it does not see) from the wheels scripts/engine_wheels_gpu.sh packed on a
# machine with network (KVHOST_ENGINE_WHEELS, default enginez/engine-wheels-cp312.tar.xz;
# the machine's own torchvision is kept where it imports). Setup in OUT_DIR/sglang_venv.txt.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
out=${1:?usage: scripts/gpu_run.sh OUT_DIR [tests|bench|pybench|mps-bench|sglang|all] [bench flags...]}
what=${2:-all}
shift $(( $# >= 2 ? 2 : 1 ))
mkdir -p "$out"
export LD_LIBRARY_PATH=$PWD/bundle/lib KVHOST_KVHOSTD=$PWD/bundle/bin/kvhostd \
  KVHOST_SESSION_WORKER=$PWD/bundle/bin/kvhost_session_worker \
  KVHOST_GPU_DEATH_WORKER=$PWD/bundle/bin/kvhost_gpu_death_worker
if [ -z "${KVHOST_CUBLAS:-}" ]; then
  sites="$(python3 -c 'import site; print(" ".join(site.getsitepackages()))' 2>/dev/null)"
  # shellcheck disable=SC2086  # globs and a word list, on purpose
  KVHOST_CUBLAS=$(find /usr/local/lib/python3*/dist-packages /usr/lib/python3/dist-packages \
    "${HOME:-/root}"/.local/lib/python3*/site-packages /opt/*/.venv/lib/python3*/site-packages $sites \
    -path '*/nvidia/*' -name 'libcublas.so.*' \
    2>/dev/null | sort | head -n 1)
  [ -n "$KVHOST_CUBLAS" ] && export KVHOST_CUBLAS
fi
echo "== cuBLAS for the GEMM worker: ${KVHOST_CUBLAS:-(the benchmark searches)}"
rc=0
# Each command gets at most KVHOST_STEP_TIMEOUT seconds (default 300; the
# benchmark 570): a hung test ends as exit 124 with its output kept, instead of
# taking the rest of the device call with it.
run() {  # run NAME COMMAND...: output to OUT_DIR/NAME.txt, the tail shown
  local name=$1; shift
  local start=$SECONDS
  local limit=${KVHOST_STEP_TIMEOUT:-300}
  case $name in
    cuda_transfer_bench*) limit=${KVHOST_BENCH_TIMEOUT:-570} ;;
    py_transfer_bench) limit=${KVHOST_PYBENCH_TIMEOUT:-300} ;;
  esac
  timeout -k 10 "$limit" "$@" >"$out/$name.txt" 2>&1
  local r=$?
  [ $r -eq 124 ] && echo "== $name: killed after $limit s (KVHOST_STEP_TIMEOUT)"
  echo "== $name: exit $r in $((SECONDS - start)) s"
  tail -n 4 "$out/$name.txt"
  [ $r -eq 0 ] || rc=1
}
nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current \
  --format=csv >"$out/gpu.txt" 2>&1
cat "$out/gpu.txt"
if [ "$what" = tests ] || [ "$what" = all ]; then
  run copy_plan_test bundle/bin/copy_plan_test
  run layout_gpu_test bundle/bin/layout_gpu_test
  run cuda_engine_gpu_test bundle/bin/cuda_engine_gpu_test
  [ -x bundle/bin/worker_death_gpu_test ] && run worker_death_gpu_test bundle/bin/worker_death_gpu_test
  [ -x bundle/bin/worker_copy_gpu_test ] && run worker_copy_gpu_test bundle/bin/worker_copy_gpu_test
  [ -x bundle/bin/c_api_gpu_test ] && run c_api_gpu_test bundle/bin/c_api_gpu_test
  [ -x bundle/bin/cumem_gpu_test ] && run cumem_gpu_test bundle/bin/cumem_gpu_test
  # The Python package's CUDA calls (torch too where installed), over the
  # bundle's libkvhost_c.so.1.
  [ -f bundle/lib/libkvhost_c.so.1 ] && run python_package_gpu_test python3 \
    tests/python_package_gpu_test.py bundle/bin/kvhostd bundle/lib/libkvhost_c.so.1 .
  run integration_test bundle/bin/integration_test
  [ -x bundle/bin/kinds_integration_test ] && run kinds_integration_test bundle/bin/kinds_integration_test
  [ -x bundle/bin/groups_integration_test ] && run groups_integration_test bundle/bin/groups_integration_test
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  run cuda_transfer_bench bundle/bin/kvhost_cuda_transfer_bench \
    --json-out="$out/cuda_transfer_bench.json" "$@"
fi
if [ "$what" = pybench ] || [ "$what" = all ]; then
  # Python against C++ on the same daemon binary and cases (bench/python):
  # Alloc + Free round trips (host backend, 2 x 5 s), then the transfer
  # headline per allocator (1.5 s per case and direction; the cuMem ones are
  # refused with FAILED_PRECONDITION until kvhostd imports cuMem memory).
  pyflags=("$@")
  [ "$what" = all ] && pyflags=()  # the flags after `all` are the C++ benchmark's
  run py_rpc_bench python3 bench/python/rpc_bench.py --kvhostd=bundle/bin/kvhostd \
    --lib=bundle/lib/libkvhost_c.so.1 --cxx-bench=bundle/bin/kvhost_rpc_bench \
    --seconds=5 --json-out="$out/py_rpc_bench.json"
  run py_transfer_bench python3 bench/python/transfer_bench.py --kvhostd=bundle/bin/kvhostd \
    --lib=bundle/lib/libkvhost_c.so.1 --cxx-bench=bundle/bin/kvhost_cuda_transfer_bench \
    --allocator=default,expandable,cumem --seconds=1.5 --out-dir="$out/pybench" \
    --json-out="$out/py_transfer_bench.json" ${pyflags[@]+"${pyflags[@]}"}
fi
sglang_venv() {  # sglang_venv WHEELS_TAR VENV: the venv for the sglang step
  local tar=$1 venv=$2 site pipwheel="" wheels=()
  [ -f "$tar" ] || { echo "no $tar: run scripts/engine_wheels_gpu.sh enginez where PyPI" \
    "is reachable, and carry enginez/"; return 1; }
  rm -rf "$venv"
  python3 -m venv --system-site-packages "$venv" ||
    python3 -m venv --system-site-packages --without-pip "$venv" || return 1
  if ! "$venv/bin/python" -c 'import torch' 2>/dev/null; then
    site=$(python3 -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))') ||
      { echo "python3 ($(command -v python3)) cannot import torch"; return 1; }
    echo "$site" >"$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/zz-machine-torch.pth"
    echo "torch from $site (.pth)"
  fi
  mkdir -p "$venv/wheels"
  tar -xJf "$tar" -C "$venv/wheels" || return 1
  for w in "$venv"/wheels/*.whl; do
    case $(basename "$w") in
      pip-*) pipwheel=$w; continue ;;
      torchvision-*) if "$venv/bin/python" -c 'import torchvision' 2>/dev/null; then
          echo "torchvision: the machine's own"; continue; fi ;;
    esac
    wheels+=("$w")
  done
  if ! "$venv/bin/python" -m pip --version >/dev/null 2>&1; then
    echo "no pip in the venv: installing the carried $(basename "$pipwheel")"
    "$venv/bin/python" "$pipwheel/pip" install -q --no-index --no-deps "$pipwheel" || return 1
  fi
  "$venv/bin/python" -m pip --disable-pip-version-check install -q --no-index --no-deps \
    "${wheels[@]}" || return 1
  "$venv/bin/python" -c 'import sys, torch, torchvision
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, torchvision {torchvision.__version__}")'
}
if [ "$what" = sglang ]; then
  venv=${KVHOST_SGLANG_VENV:-$PWD/.sglang-venv}
  start=$SECONDS
  if sglang_venv "${KVHOST_ENGINE_WHEELS:-enginez/engine-wheels-cp312.tar.xz}" "$venv" \
    >"$out/sglang_venv.txt" 2>&1; then
    echo "== sglang_venv: made in $((SECONDS - start)) s: $(tail -n 1 "$out/sglang_venv.txt")"
    run python_sglang_gpu_engine_test "$venv/bin/python" tests/python_sglang_gpu_engine_test.py \
      bundle/bin/kvhostd bundle/lib/libkvhost_c.so.1 .
  else
    echo "== sglang_venv: failed after $((SECONDS - start)) s"
    tail -n 20 "$out/sglang_venv.txt"
    rc=1
  fi
fi
if [ "$what" = mps-bench ]; then
  export CUDA_MPS_PIPE_DIRECTORY=$PWD/.mps/pipe CUDA_MPS_LOG_DIRECTORY=$PWD/.mps/log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  trap 'echo quit | nvidia-cuda-mps-control; rm -rf .mps' EXIT
  nvidia-cuda-mps-control -d && echo "== MPS started"
  run cuda_transfer_bench_mps bundle/bin/kvhost_cuda_transfer_bench \
    --json-out="$out/cuda_transfer_bench_mps.json" "$@"
fi
exit $rc
