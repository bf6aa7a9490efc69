#!/usr/bin/env bash
# The main job on a fresh machine: set up, build, start kvhostd on a private
# socket, run the demo workload (backup / load cycles with byte-exact
# verification, on the host backend: its device pool is emulated in shared
# memory), show status, stop. Where a GPU is usable, then the GPU workload:
# the CUDA transfer benchmark's quick run (its own kvhostd --backend=cuda, a
# worker with real device buffers, every transfer path, bytes verified).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
BUILD_DIR=${BUILD_DIR:-build}

run_dir=$(mktemp -d /tmp/kvhost-demo.XXXXXX)
socket="unix://$run_dir/kvhost.sock"
daemon_pid=""
cleanup() {
  if [ -n "$daemon_pid" ] && kill -0 "$daemon_pid" 2>/dev/null; then
    kill -TERM "$daemon_pid"; wait "$daemon_pid" || true
  fi
  rm -rf "$run_dir"
}
trap cleanup EXIT

echo "== starting kvhostd on $socket (log: $run_dir/kvhostd.log)"
"$BUILD_DIR/bin/kvhostd" --listen="$socket" --backend=host >"$run_dir/kvhostd.log" 2>&1 &
daemon_pid=$!
ctl() { "$BUILD_DIR/bin/kvhostctl" --server="$socket" "$@"; }
for _ in $(seq 100); do ctl status >/dev/null 2>&1 && break; sleep 0.1; done
ctl status

echo "== demo workload"
ctl demo "$@"
ctl pools

echo "== stopping kvhostd (SIGTERM)"
kill -TERM "$daemon_pid"
wait "$daemon_pid"
echo "kvhostd exited with $?"
daemon_pid=""
tail -n 5 "$run_dir/kvhostd.log"

if [ -x "$BUILD_DIR/bin/kvhost_cuda_transfer_bench" ] && nvidia-smi -L >/dev/null 2>&1; then
  echo "== GPU workload: kvhost_cuda_transfer_bench --quick"
  "$BUILD_DIR/bin/kvhost_cuda_transfer_bench" --quick
else
  echo "== no usable GPU (or a build without CUDA): GPU workload skipped"
fi
