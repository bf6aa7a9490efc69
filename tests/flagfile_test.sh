#!/usr/bin/env bash
# The example configuration deploy/kvhostd.flags is accepted by kvhostd: it
# starts with it (flags given after --flagfile override its socket and shm
# dir), serves, and exits 0 on SIGTERM.
#   usage: flagfile_test.sh KVHOSTD KVHOSTCTL FLAGFILE
set -euo pipefail
kvhostd=$1 kvhostctl=$2 flags=$3
dir=$(mktemp -d /tmp/kvhost-flagfile.XXXXXX)
shm=$(mktemp -d /dev/shm/kvhost-flagfile.XXXXXX)
trap 'rm -rf "$dir" "$shm"' EXIT
"$kvhostd" --flagfile="$flags" --listen="unix://$dir/s.sock" --shm-dir="$shm" --backend=host \
  >"$dir/log" 2>&1 &
pid=$!
for _ in $(seq 200); do [ -S "$dir/s.sock" ] && break; sleep 0.05; done
"$kvhostctl" --server="unix://$dir/s.sock" status
kill -TERM "$pid"
if wait "$pid"; then code=0; else code=$?; fi
cat "$dir/log"
[ "$code" -eq 0 ] || { echo "kvhostd exited with $code"; exit 1; }
grep -q "shm dir $shm" "$dir/log"
echo "flagfile ok"
