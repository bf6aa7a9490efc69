#!/usr/bin/env bash
# kvhostctl's L3 commands against a kvhostd on one local memcached server:
# l3-store / l3-exist / l3-fetch of pages written with page-set, fetched
# byte-exact into other pages, a key never stored as PAGE_MISS (exit 0),
# --json, usage errors (exit 2), and a daemon without --l3-memcached
# (exit 1, FAILED_PRECONDITION). Exits 77 (skipped) without memcached.
#   usage: kvhostctl_l3_test.sh KVHOSTD KVHOSTCTL
set -euo pipefail
kvhostd=$1 kvhostctl=$2
memcached=$(command -v memcached || true)
[ -n "$memcached" ] || { echo "SKIP: no memcached binary (Debian package memcached)"; exit 77; }
dir=$(mktemp -d /tmp/kvhost-l3ctl.XXXXXX)
shm=$(mktemp -d /dev/shm/kvhost-l3ctl.XXXXXX)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
  rm -rf "$dir" "$shm"
}
trap cleanup EXIT
fail() {
  echo "FAIL: $1"
  echo "--- $dir/out:"
  cat "$dir/out"
  exit 1
}
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
user=()
[ "$(id -u)" -eq 0 ] && user=(-u root)
"$memcached" -p "$port" -U 0 -l 127.0.0.1 -m 64 "${user[@]}" >>"$dir/log" 2>&1 &
pids+=($!)
# The fleet secret kvhostd requires with --l3-memcached (0600).
(umask 077 && head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$dir/l3.secret")
"$kvhostd" --listen="unix://$dir/s.sock" --shm-dir="$shm" --backend=host \
  --l3-memcached="127.0.0.1:$port" --l3-secret-file="$dir/l3.secret" >>"$dir/log" 2>&1 &
pids+=($!)
"$kvhostd" --listen="unix://$dir/plain.sock" --shm-dir="$shm" --backend=host >>"$dir/log" 2>&1 &
pids+=($!)
for _ in $(seq 200); do [ -S "$dir/s.sock" ] && [ -S "$dir/plain.sock" ] && break; sleep 0.05; done
ctl() { "$kvhostctl" --server="unix://$dir/s.sock" --timeout=10 "$@"; }
# A socket file exists from bind on; on a loaded machine (CI's sanitizer
# run) serving may come seconds later.
for _ in $(seq 60); do ctl health >/dev/null 2>&1 && break; sleep 0.5; done

ctl create-pool p --kind=mha --layout=page_first --layers=2 --heads=2 --head-dim=8 \
  --page-size=4 --size-tokens=64 >"$dir/out" || fail "create-pool"
ctl alloc p 16 >"$dir/out" || fail "alloc"
head -c 512 /dev/urandom >"$dir/page0"  # 2 layers x 4 tokens x K,V x 2 heads x 8 x 2 bytes
head -c 512 /dev/urandom >"$dir/page1"
ctl page-set p 0 --in="$dir/page0" >"$dir/out" || fail "page-set 0"
ctl page-set p 4 --in="$dir/page1" >"$dir/out" || fail "page-set 4"
ctl l3-store p 0=key-a 4=key-b >"$dir/out" || fail "l3-store"
grep -q "0 = key-a: PAGE_STORED" "$dir/out" || fail "l3-store page 0"
grep -q "2 of 2 page(s) stored, 1024 bytes" "$dir/out" || fail "l3-store count"
ctl l3-exist p key-a key-b key-c >"$dir/out" || fail "l3-exist"
grep -q "2 of 3 key(s) stored" "$dir/out" || fail "l3-exist prefix"
ctl --json l3-exist p key-c key-a >"$dir/out" || fail "l3-exist --json"
grep -qF '{"prefix_pages":0,"keys":2}' "$dir/out" || fail "l3-exist json"
# Swapped: page 8 gets key-b, page 12 key-a, and key-c is a miss (no error).
ctl l3-fetch p 8=key-b 12=key-a 0=key-c >"$dir/out" || fail "l3-fetch"
grep -q "8 = key-b: PAGE_HIT" "$dir/out" || fail "l3-fetch hit"
grep -q "0 = key-c: PAGE_MISS" "$dir/out" || fail "l3-fetch miss"
grep -q "2 of 3 page(s) hit" "$dir/out" || fail "l3-fetch count"
ctl page-get p 8 --out="$dir/got8" >"$dir/out" || fail "page-get 8"
ctl page-get p 12 --out="$dir/got12" >"$dir/out" || fail "page-get 12"
ctl page-get p 0 --out="$dir/got0" >"$dir/out" || fail "page-get 0"
cmp -s "$dir/got8" "$dir/page1" || fail "page 8 is not page 4's bytes"
cmp -s "$dir/got12" "$dir/page0" || fail "page 12 is not page 0's bytes"
cmp -s "$dir/got0" "$dir/page0" || fail "a miss changed page 0"
ctl --json l3-fetch p 8=key-a >"$dir/out" || fail "l3-fetch --json"
grep -qF '"outcome":"PAGE_HIT"' "$dir/out" || fail "l3-fetch json"
code=0; ctl l3-store p 0 >"$dir/out" 2>&1 || code=$?
[ "$code" -eq 2 ] || fail "l3-store without =KEY exited $code, not 2"
grep -q "is not INDEX=KEY" "$dir/out" || fail "l3-store usage message"
code=0; ctl l3-store p 1=x >"$dir/out" 2>&1 || code=$?
[ "$code" -eq 1 ] || fail "l3-store of slot 1 exited $code, not 1"
grep -q "INVALID_ARGUMENT" "$dir/out" || fail "l3-store of slot 1: code"
code=0
"$kvhostctl" --server="unix://$dir/plain.sock" --timeout=10 l3-exist p a >"$dir/out" 2>&1 || code=$?
[ "$code" -eq 1 ] || fail "l3-exist without a tier exited $code, not 1"
grep -q -- "--l3-memcached" "$dir/out" || fail "l3-exist without a tier: message"
echo "PASS"
