#!/usr/bin/env bash
# kvhostctl's L3 commands against a kvhostd on one local memcached server:
# l3-store / l3-exist / l3-fetch of pages written with page-set, fetched
# byte-exact into other pages, a key never stored as PAGE_MISS (every page
# shown, exit 4: fewer pages than asked), --json, usage errors (exit 2), and a
# daemon without --l3-memcached (exit 1, FAILED_PRECONDITION; StorageService
# health NOT_SERVING; status "L3: off"). The L3 servers' state: status, the
# kvhost_l3_server(s)_up metrics and one log line per change, for a server
# that was never there (127.0.0.1:1: l3-store exits 4 with a clean per-page
# message) and one that stops and comes back. Exits 77 (skipped) without
# memcached.
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
code=0; ctl l3-fetch p 8=key-b 12=key-a 0=key-c >"$dir/out" 2>&1 || code=$?
[ "$code" -eq 4 ] || fail "l3-fetch with a miss exited $code, not 4"
grep -q "l3-fetch: 1 of 3 page(s) not fetched" "$dir/out" || fail "l3-fetch partial message"
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

# --- StorageService health and the status line, with and without a tier.
ctl health kvhost.v1.StorageService >"$dir/out" || fail "StorageService health with a tier"
code=0
"$kvhostctl" --server="unix://$dir/plain.sock" --timeout=10 health kvhost.v1.StorageService \
  >"$dir/out" 2>&1 || code=$?
[ "$code" -eq 1 ] || fail "StorageService health without a tier exited $code, not 1"
grep -q "^NOT_SERVING" "$dir/out" || fail "StorageService health without a tier"
"$kvhostctl" --server="unix://$dir/plain.sock" --timeout=10 health >"$dir/out" ||
  fail "overall health without a tier"
"$kvhostctl" --server="unix://$dir/plain.sock" --timeout=10 status >"$dir/out" ||
  fail "status without a tier"
grep -q "^L3: *off" "$dir/out" || fail "status without a tier: L3 line"
ctl status >"$dir/out" || fail "status"
grep -q "^L3: *1 of 1 memcached server(s) up" "$dir/out" || fail "status: L3 line"

# --- a server that is not there: down from the start, logged once, 0 in the
# metrics, in status (and GetStatus); a store exits 4, each page's message
# clean (no libmemcached source path or pointer).
"$kvhostd" --listen="unix://$dir/dead.sock" --shm-dir="$shm" --backend=host \
  --l3-memcached=127.0.0.1:1 --l3-secret-file="$dir/l3.secret" --l3-retry-timeout=100ms \
  --metrics-listen=127.0.0.1:0 >>"$dir/dead.log" 2>&1 &
pids+=($!)
dctl() { "$kvhostctl" --server="unix://$dir/dead.sock" --timeout=10 "$@"; }
for _ in $(seq 60); do dctl health >/dev/null 2>&1 && break; sleep 0.5; done
sleep 1  # ten probes
dctl status >"$dir/out" || fail "status with a dead server"
grep -q "^L3: *0 of 1 memcached server(s) up" "$dir/out" || fail "status: dead L3 line"
grep -qE "^  127\.0\.0\.1:1 down for [0-9]+s: [a-z]" "$dir/out" || fail "status: dead server line"
dctl --json status >"$dir/out" || fail "status --json"
grep -qF '"address":"127.0.0.1:1"' "$dir/out" || fail "status --json: l3_servers"
[ "$(grep -c "127.0.0.1:1 is down" "$dir/dead.log")" -eq 1 ] ||
  { cp "$dir/dead.log" "$dir/out"; fail "the dead server was not logged exactly once"; }
mport=$(sed -n 's|.*metrics on http://127.0.0.1:\([0-9]*\)/metrics.*|\1|p' "$dir/dead.log" | head -1)
scrape() { python3 -c "import urllib.request,sys; sys.stdout.write(urllib.request.urlopen('http://127.0.0.1:$1/metrics').read().decode())"; }
scrape "$mport" >"$dir/out"
grep -qx 'kvhost_l3_server_up{server="127.0.0.1:1"} 0' "$dir/out" || fail "kvhost_l3_server_up"
grep -qx 'kvhost_l3_servers_up 0' "$dir/out" || fail "kvhost_l3_servers_up"
grep -qx 'kvhost_l3_servers 1' "$dir/out" || fail "kvhost_l3_servers"
dctl create-pool d --kind=mha --layout=page_first --layers=2 --heads=2 --head-dim=8 \
  --page-size=4 --size-tokens=64 >"$dir/out" || fail "create-pool on the dead-L3 daemon"
dctl alloc d 8 >"$dir/out" || fail "alloc d"
code=0; dctl l3-store d 0=k0 4=k1 >"$dir/out" 2>&1 || code=$?
[ "$code" -eq 4 ] || fail "l3-store to a dead server exited $code, not 4"
grep -q "0 = k0: PAGE_UNAVAILABLE (part 0: server 127.0.0.1:1: [a-z]" "$dir/out" || fail "per-page message"
grep -q "0 of 2 page(s) stored" "$dir/out" || fail "l3-store count"
grep -q "l3-store: 2 of 2 page(s) not stored" "$dir/out" || fail "l3-store partial message"
if grep -qE '0x[0-9a-f]+|\.cc|libmemcached/' "$dir/out"; then fail "raw libmemcached text"; fi

# --- a live server that stops and comes back: each change logged once.
kill -TERM "${pids[0]}"; wait "${pids[0]}" 2>/dev/null || true
for _ in $(seq 100); do
  [ "$(grep -c "127.0.0.1:$port is down" "$dir/log")" -ge 1 ] && break; sleep 0.1
done
ctl status >"$dir/out" || fail "status after memcached stopped"
grep -q "^L3: *0 of 1 memcached server(s) up" "$dir/out" || fail "status: stopped server"
"$memcached" -p "$port" -U 0 -l 127.0.0.1 -m 64 "${user[@]}" >>"$dir/mc.log" 2>&1 &
pids[0]=$!
for _ in $(seq 100); do
  [ "$(grep -c "127.0.0.1:$port is up" "$dir/log")" -ge 2 ] && break; sleep 0.1
done
sleep 2.5  # a probe or more after it came back
cp "$dir/log" "$dir/out"
[ "$(grep -c "127.0.0.1:$port is down" "$dir/log")" -eq 1 ] || fail "down logged other than once"
# Up at the start, and again when it came back.
[ "$(grep -c "127.0.0.1:$port is up" "$dir/log")" -eq 2 ] || fail "up logged other than twice"
ctl status >"$dir/out" || fail "status after memcached returned"
grep -q "^L3: *1 of 1 memcached server(s) up" "$dir/out" || fail "status: returned server"
echo "PASS"
