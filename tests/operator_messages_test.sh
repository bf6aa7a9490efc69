#!/usr/bin/env bash
# The messages an operator meets first say what to do (issue 31): kvhostd's
# --listen given a file path or a relative unix path, a missing --shm-dir, a
# flag file with hyphenated names, a missing --config file, a "GB" size;
# kvhostctl's --server given a file path, no daemon, a stale socket, a socket
# it may not open, a "GB" size; and KVHOST_SERVER (the flag wins over it).
#   usage: operator_messages_test.sh KVHOSTD KVHOSTCTL
set -euo pipefail
kvhostd=$1 kvhostctl=$2
dir=$(mktemp -d /tmp/kvhost-messages.XXXXXX)
shm=$(mktemp -d /dev/shm/kvhost-messages.XXXXXX)
pid=""
cleanup() {
  if [ -n "$pid" ]; then kill -KILL "$pid" 2>/dev/null || true; fi
  rm -rf "$dir" "$shm"
}
trap cleanup EXIT
fail() { echo "FAIL: $*"; exit 1; }
sock="$dir/s.sock"

# expect CODE NAME TEXT... -- COMMAND...: COMMAND exits CODE and its output
# holds every TEXT (fixed strings).
expect() {
  local want=$1 name=$2 code=0
  shift 2
  local texts=()
  while [ "$1" != "--" ]; do texts+=("$1"); shift; done
  shift
  "$@" >"$dir/$name.out" 2>&1 || code=$?
  [ "$code" -eq "$want" ] || { cat "$dir/$name.out"; fail "$name: exit $code, not $want"; }
  for text in "${texts[@]}"; do
    grep -qF -- "$text" "$dir/$name.out" || { cat "$dir/$name.out"; fail "$name: no '$text'"; }
  done
  echo "ok: $name -> exit $code: $(grep -v '^\s*$' "$dir/$name.out" | tail -n 2 | tr '\n' ' ')"
}
daemon() { "$kvhostd" --shm-dir="$shm" --backend=host "$@"; }

# kvhostd
expect 2 listen-path "unix://$dir/x.sock" -- daemon --listen="$dir/x.sock"
! grep -q "TLS" "$dir/listen-path.out" || fail "listen-path: still blamed on TLS"
expect 2 listen-relative "--listen 'unix:rel.sock'" "must be absolute" -- \
  daemon --listen=unix:rel.sock
! grep -q "handoff" "$dir/listen-relative.out" || fail "listen-relative: blamed on --handoff-socket"
expect 2 shm-missing "$dir/absent" "No such file or directory" "create it" -- \
  "$kvhostd" --listen="unix://$sock" --backend=host --shm-dir="$dir/absent"
printf -- '--shm-dir=%s\n' "$shm" >"$dir/hyphen.flags"
expect 1 flagfile-hyphen "$dir/hyphen.flags, line 1" "--shm_dir" -- \
  "$kvhostd" --flagfile="$dir/hyphen.flags" --print-config
expect 2 config-missing "$dir/absent.yaml" "No such file or directory" "--print-config" -- \
  "$kvhostd" --config="$dir/absent.yaml"
expect 2 size-gb "--memory-limit" '"1GB"' "ambiguous" "write G or GiB" -- \
  daemon --listen="unix://$sock" --memory-limit=1GB
[ ! -e "$sock" ] || fail "a refused start left a socket"

# kvhostctl, no daemon
expect 2 server-path "unix://$dir/x.sock" -- "$kvhostctl" --server="$dir/x.sock" status
! grep -qi "dns" "$dir/server-path.out" || fail "server-path: still a DNS error"
expect 1 no-socket "no socket at $dir/none.sock" "is kvhostd running" -- \
  "$kvhostctl" --server="unix://$dir/none.sock" --timeout=2 status
python3 -c 'import socket, sys; socket.socket(socket.AF_UNIX).bind(sys.argv[1])' "$dir/stale.sock"
expect 1 stale-socket "$dir/stale.sock exists but nothing answers" -- \
  "$kvhostctl" --server="unix://$dir/stale.sock" --timeout=2 status
expect 2 ctl-size-gb "--size-bytes" "ambiguous" -- \
  "$kvhostctl" --server="unix://$sock" create-pool p --kind=mha --layout=page_first \
  --dtype=bf16 --page-size=16 --layers=1 --heads=1 --head-dim=64 --size-bytes=1GB

# kvhostctl with a daemon: KVHOST_SERVER, and the flag over it.
"$kvhostd" --shm-dir="$shm" --backend=host --listen="unix://$sock" >"$dir/log" 2>&1 &
pid=$!
for _ in $(seq 200); do [ -S "$sock" ] && break; sleep 0.05; done
[ -S "$sock" ] || { cat "$dir/log"; fail "kvhostd did not start"; }
KVHOST_SERVER="unix://$sock" "$kvhostctl" health >/dev/null || fail "KVHOST_SERVER not used"
KVHOST_SERVER="unix://$dir/none.sock" "$kvhostctl" --server="unix://$sock" health >/dev/null ||
  fail "--server did not win over KVHOST_SERVER"
expect 1 env-wrong "no socket at $dir/none.sock" -- \
  env KVHOST_SERVER="unix://$dir/none.sock" "$kvhostctl" --timeout=2 health
echo "ok: KVHOST_SERVER, and --server over it"

# Permission denied: a user outside the socket's group (needs root to be one).
if [ "$(id -u)" -eq 0 ] && command -v setpriv >/dev/null; then
  chmod 0755 "$dir"
  chmod 0660 "$sock"
  expect 1 permission "permission denied on $sock" "join that group" -- \
    setpriv --reuid=65534 --regid=65534 --clear-groups "$kvhostctl" --server="unix://$sock" \
    --timeout=2 health
else
  echo "skipped: permission denied (needs root and setpriv to act as another user)"
fi
kill -TERM "$pid"
wait "$pid" || { cat "$dir/log"; fail "kvhostd exited non-zero after SIGTERM"; }
pid=""
echo "operator messages ok"
