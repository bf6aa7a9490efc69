#!/usr/bin/env bash
# deploy/systemd/kvhostd.service is a unit systemd accepts, and it agrees with
# deploy/kvhostd.flags and with what kvhostd needs.
#  1. `systemd-analyze verify` on a copy whose ExecStart= names the built kvhostd
#     (verify checks that the binary exists). verify exits 0 on an unknown key or a
#     bad value and only prints a warning, so any line about the unit fails the test.
#     User=/Group= are dropped from the copy when this machine has no kvhost user.
#     Where verify cannot run (no systemd-analyze, or it rejects even a trivial unit,
#     e.g. in an odd container), a syntax check written here stands in, and says so.
#  2. Always: the directives the daemon relies on are there, the ones that would break
#     CUDA or shared memory are not, and the flag file's socket is in the
#     RuntimeDirectory.
#   usage: systemd_unit_test.sh UNIT KVHOSTD FLAGFILE
set -euo pipefail
unit=$1 kvhostd=$2 flags=$3
dir=$(mktemp -d /tmp/kvhost-unit.XXXXXX)
trap 'rm -rf "$dir"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

copy=$dir/kvhostd.service
sed "s|^ExecStart=/usr/local/bin/kvhostd |ExecStart=$kvhostd |" "$unit" >"$copy"
grep -qF "ExecStart=$kvhostd " "$copy" ||
  fail "no 'ExecStart=/usr/local/bin/kvhostd ...' line in $unit"
if ! getent passwd kvhost >/dev/null; then
  sed -i '/^User=/d; /^Group=/d' "$copy"
  echo "note: no user 'kvhost' on this machine; User=/Group= dropped from the copy verified"
fi

# --- 1. systemd's own parser ----------------------------------------------------------
verified=no
if command -v systemd-analyze >/dev/null; then
  printf '[Service]\nType=oneshot\nExecStart=/bin/true\n' >"$dir/probe.service"
  if probe=$(systemd-analyze verify --man=no "$dir/probe.service" 2>&1) && [ -z "$probe" ]; then
    echo "== systemd-analyze verify ($(systemd-analyze --version | head -1))"
    rc=0
    out=$(systemd-analyze verify --man=no "$copy" 2>&1) || rc=$?
    [ -n "$out" ] && echo "$out"
    [ "$rc" -eq 0 ] || fail "systemd-analyze verify exited $rc"
    # Lines about other units (e.g. a missing dependency on this machine) are only shown.
    if grep -E "kvhostd\.service" <<<"$out" >/dev/null; then
      fail "systemd-analyze verify reported problems in the unit (above)"
    fi
    verified=yes
  else
    echo "note: systemd-analyze verify rejects even a trivial unit here:"
    echo "$probe"
  fi
else
  echo "note: systemd-analyze not installed (Debian package systemd)"
fi

if [ "$verified" = no ]; then
  echo "== fallback: checking the unit's syntax with the parser in this test, not systemd's"
  section="" n=0
  while IFS= read -r line || [ -n "$line" ]; do
    n=$((n + 1))
    case "$line" in
      "" | "#"* | ";"*) continue ;;
      "[Unit]" | "[Service]" | "[Install]") section=$line ;;
      "["*) fail "$unit:$n: unknown section $line" ;;
      *=*)
        [ -n "$section" ] || fail "$unit:$n: key outside a section"
        key=${line%%=*}
        [[ "$key" =~ ^[A-Z][A-Za-z]+$ ]] || fail "$unit:$n: malformed key '$key'"
        ;;
      *) fail "$unit:$n: not 'Key=value': $line" ;;
    esac
  done <"$unit"
  [ -x "$kvhostd" ] || fail "ExecStart binary $kvhostd is not executable"
fi

# --- 2. What kvhostd relies on ----------------------------------------------------------
# value KEY: the value of the last KEY= in [Service] (systemd: the last one wins).
value() {
  awk -v key="$1" '/^\[/{s=$0} s=="[Service]" && index($0, key "=")==1 {v=substr($0, length(key)+2)}
                   END{print v}' "$unit"
}
expect() {
  local got
  got=$(value "$1")
  [ "$got" = "$2" ] || fail "$1=$got in $unit, expected $1=$2"
}
expect Type notify
expect RuntimeDirectory kvhost
expect RuntimeDirectoryMode 0750
expect UMask 0117  # socket 0777 & ~umask = 0660
expect LimitMEMLOCK infinity
expect User kvhost
expect Group kvhost
expect Restart on-failure
expect EnvironmentFile -/etc/default/kvhostd
# shellcheck disable=SC2016  # $KVHOSTD_ARGS is systemd's, literally in the unit
expect ExecStart '/usr/local/bin/kvhostd --flagfile=/etc/kvhost/kvhostd.flags $KVHOSTD_ARGS'
# CUDA needs /dev/nvidia* and JIT memory; workers share CUDA IPC, /dev/shm and the MPS
# pipe in /tmp with the daemon.
for key in PrivateDevices MemoryDenyWriteExecute PrivateIPC PrivateTmp ProtectClock DevicePolicy; do
  got=$(value "$key")
  case "$got" in "" | no | false | auto) ;; *) fail "$key=$got breaks CUDA or shared memory" ;; esac
done

grep -qx -- "--listen=unix:///run/kvhost/kvhost.sock" "$flags" ||
  fail "$flags: --listen must be unix:///run/kvhost/kvhost.sock (RuntimeDirectory=kvhost)"
grace=$(sed -n 's/^--shutdown[_-]grace[_-]s=\([0-9]*\)$/\1/p' "$flags" | tail -1)
grace=${grace:-10}
stop=$(value TimeoutStopSec)
[[ "$stop" =~ ^([0-9]+)s?$ ]] || fail "TimeoutStopSec='$stop': expected whole seconds"
[ "${BASH_REMATCH[1]}" -gt "$grace" ] ||
  fail "TimeoutStopSec=$stop is not longer than --shutdown-grace-s=$grace"

echo "systemd unit ok (verified by systemd-analyze: $verified)"
