#!/usr/bin/env bash
# `promtool check metrics` (Prometheus's linter: names, units, suffixes, HELP
# and TYPE) on a scrape of kvhostd with every family sampled: a pool, a
# transfer (the demo), a worker-free daemon's RPCs over both transports, and an
# L3 tier whose server is down. Exits 77 (skipped) without promtool: Debian's
# package prometheus has it (scripts/get_promtool.sh extracts it alone into
# build/tools, which is where this looks after $PROMTOOL and PATH).
#   usage: metrics_promtool_test.sh KVHOSTD KVHOSTCTL BUILD_DIR
set -euo pipefail
kvhostd=$1 kvhostctl=$2 build=$3
promtool=${PROMTOOL:-$(command -v promtool || true)}
[ -n "$promtool" ] || [ ! -x "$build/tools/promtool" ] || promtool=$build/tools/promtool
[ -n "$promtool" ] || { echo "SKIP: no promtool (scripts/get_promtool.sh)"; exit 77; }
dir=$(mktemp -d /tmp/kvhost-promtool.XXXXXX)
shm=$(mktemp -d /dev/shm/kvhost-promtool.XXXXXX)
pid=
cleanup() {
  if [ -n "$pid" ]; then kill -TERM "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; fi
  rm -rf "$dir" "$shm"
}
trap cleanup EXIT
fail() { echo "FAIL: $1"; cat "${2:-$dir/log}"; exit 1; }
(umask 077 && head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$dir/l3.secret")
"$kvhostd" --listen="unix://$dir/s.sock" --shm-dir="$shm" --backend=host \
  --metrics-listen=127.0.0.1:0 --l3-memcached=127.0.0.1:1 --l3-secret-file="$dir/l3.secret" \
  >>"$dir/log" 2>&1 &
pid=$!
ctl() { "$kvhostctl" --server="unix://$dir/s.sock" --timeout=10 "$@"; }
for _ in $(seq 100); do ctl health >/dev/null 2>&1 && break; sleep 0.2; done
ctl demo --shm-dir="$shm" --demo-layers=2 --demo-tokens=256 --demo-device-tokens=128 \
  --demo-batch-tokens=64 --demo-cycles=1 >"$dir/demo" || fail "demo" "$dir/demo"
ctl create-pool p --kind=mha --layout=page_first --layers=2 --heads=2 --head-dim=8 \
  --page-size=4 --size-tokens=64 >/dev/null || fail "create-pool"
port=$(sed -n 's|.*metrics on http://127.0.0.1:\([0-9]*\)/metrics.*|\1|p' "$dir/log" | head -1)
[ -n "$port" ] || fail "no metrics port in the log"
python3 -c "import urllib.request,sys; sys.stdout.write(urllib.request.urlopen(
  'http://127.0.0.1:$port/metrics').read().decode())" >"$dir/metrics"
for family in kvhost_rpc_requests_total kvhost_pool_state kvhost_transfers_total \
  kvhost_l3_server_up kvhost_build_info; do
  grep -q "^$family" "$dir/metrics" || fail "no $family sample" "$dir/metrics"
done
"$promtool" check metrics <"$dir/metrics" >"$dir/lint" 2>&1 || fail "promtool check metrics" "$dir/lint"
[ ! -s "$dir/lint" ] || fail "promtool check metrics found problems" "$dir/lint"
echo "PASS: promtool check metrics is clean ($(grep -c '^[a-z]' "$dir/metrics") samples)"
