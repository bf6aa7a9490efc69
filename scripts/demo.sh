#!/usr/bin/env bash
# The main job on a fresh machine: install what is missing, build what the
# demo runs (kvhostd, kvhostctl, and the GPU workload where a GPU is usable),
# start kvhostd on a private socket, run the demo workload (backup / load
# cycles with byte-exact verification, on the host backend: its device pool
# is emulated in shared memory), show status, stop. Where a GPU is usable,
# then the GPU workload: the CUDA transfer benchmark's quick run (its own
# kvhostd --backend=cuda, a worker with real device buffers, every transfer
# path, bytes verified). kvhostd's log is kept; its path is printed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
export BUILD_DIR
start=$(date +%s)

gpu_bench=kvhost_cuda_transfer_bench
gpu=0
if nvidia-smi -L >/dev/null 2>&1; then gpu=1; fi
# Only what runs below; scripts/test.sh builds the rest (tests, benchmarks).
TARGETS="kvhostd kvhostctl" scripts/setup.sh
if ((gpu)) && cmake --build "$BUILD_DIR" --target help | grep -qw "$gpu_bench"; then
  TARGETS=$gpu_bench scripts/setup.sh
fi

run_dir=$(mktemp -d /tmp/kvhost-demo.XXXXXX)
log="$run_dir/kvhostd.log"
socket="unix://$run_dir/kvhost.sock"
daemon_pid=""
cleanup() {
  if [ -n "$daemon_pid" ] && kill -0 "$daemon_pid" 2>/dev/null; then
    kill -TERM "$daemon_pid"; wait "$daemon_pid" || true
  fi
  # The log stays (and the directory holding it); the socket goes with kvhostd.
  echo "kvhostd's log: $log"
}
trap cleanup EXIT

echo "== starting kvhostd on $socket (log: $log)"
"$BUILD_DIR/bin/kvhostd" --listen="$socket" --backend=host >"$log" 2>&1 &
daemon_pid=$!
ctl() { "$BUILD_DIR/bin/kvhostctl" --server="$socket" "$@"; }
for _ in $(seq 100); do ctl status >/dev/null 2>&1 && break; sleep 0.1; done
ctl status

echo "== demo workload"
ctl demo "$@"
ctl pools

echo "== stopping kvhostd (SIGTERM)"
kill -TERM "$daemon_pid"
code=0
wait "$daemon_pid" || code=$?
echo "kvhostd exited with $code"
daemon_pid=""
tail -n 5 "$log"
[ "$code" -eq 0 ] || { echo "kvhostd exited with $code (its log: $log)"; exit 1; }

if [ -x "$BUILD_DIR/bin/$gpu_bench" ] && ((gpu)); then
  echo "== GPU workload: $gpu_bench --quick"
  "$BUILD_DIR/bin/$gpu_bench" --quick
else
  echo "== no usable GPU (or a build without CUDA): GPU workload skipped"
fi

cat <<NEXT

== done in $(($(date +%s) - start)) s. Next steps:
  docs: README.md (overview), docs/OPERATIONS.md (running kvhostd: flags, config, systemd,
        Kubernetes), docs/METRICS.md, docs/RELIABILITY.md, docs/PERF.md
  a daemon of your own: $BUILD_DIR/bin/kvhostd --listen=unix://\$PWD/kvhost.sock --backend=host &
        then $BUILD_DIR/bin/kvhostctl --server=unix://\$PWD/kvhost.sock status (or pools, create-pool)
  the tests: scripts/test.sh (builds everything, then runs what CI runs)
NEXT
