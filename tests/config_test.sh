#!/usr/bin/env bash
# kvhostd --config (YAML) and --print-config: the printed configuration loads
# back unchanged; the command line overrides the file and the file the
# defaults; unknown keys, wrong types and malformed files exit 2 naming the
# file, the key and the line; declared pools exist once the daemon serves, and
# a bad one stops the start with exit 2; the removed load_gates loads as false
# and stops the start as true; the example deploy/kvhostd.yaml (and its
# commented pools) loads and starts; declared followers start in either
# order, and a follower of an undeclared pool or a cycle stops the start.
#   usage: config_test.sh KVHOSTD KVHOSTCTL EXAMPLE_YAML
set -euo pipefail
kvhostd=$1 kvhostctl=$2 example=$3
dir=$(mktemp -d /tmp/kvhost-config.XXXXXX)
shm=$(mktemp -d /dev/shm/kvhost-config.XXXXXX)
pid=""
cleanup() {
  if [ -n "$pid" ]; then kill -KILL "$pid" 2>/dev/null || true; fi
  rm -rf "$dir" "$shm"
}
trap cleanup EXIT
fail() { echo "FAIL: $*"; exit 1; }
sock="$dir/s.sock"

# expect_exit2 NAME TEXT...: kvhostd --config=$dir/NAME.yaml exits 2 and its
# message holds every TEXT.
expect_exit2() {
  local name=$1 code=0
  shift
  "$kvhostd" --config="$dir/$name.yaml" --print-config >"$dir/$name.out" 2>&1 || code=$?
  [ "$code" -eq 2 ] || { cat "$dir/$name.out"; fail "$name: exit $code, not 2"; }
  for text in "$@"; do
    grep -qF -- "$text" "$dir/$name.out" || { cat "$dir/$name.out"; fail "$name: no '$text'"; }
  done
  echo "ok: $name -> exit 2: $(grep -o 'config: .*' "$dir/$name.out")"
}

# start ARGS...: kvhostd on the private socket and shm dir, host backend;
# returns once the socket exists.
start() {
  "$kvhostd" "$@" --listen="unix://$sock" --shm-dir="$shm" --backend=host >"$dir/log" 2>&1 &
  pid=$!
  for _ in $(seq 200); do
    [ -S "$sock" ] && return 0
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.05
  done
  cat "$dir/log"
  fail "kvhostd $* did not start"
}
stop() {
  kill -TERM "$pid"
  local code=0
  wait "$pid" || code=$?
  pid=""
  [ "$code" -eq 0 ] || { cat "$dir/log"; fail "kvhostd exited with $code after SIGTERM"; }
}

# 1. --print-config round-trips through --config, defaults and a full file.
"$kvhostd" --print-config >"$dir/defaults.yaml"
"$kvhostd" --config="$dir/defaults.yaml" --print-config >"$dir/defaults2.yaml"
diff -u "$dir/defaults.yaml" "$dir/defaults2.yaml" || fail "defaults do not round-trip"
grep -q '^shm_dir: /dev/shm$' "$dir/defaults.yaml" || fail "no shm_dir in --print-config"
# Modes are strings that look like octal numbers: quoted, so that a YAML reader
# gets "0660", not 432 (PyYAML, YAML 1.1) or 660; numbers stay plain.
grep -q '^socket_mode: "0660"$' "$dir/defaults.yaml" || fail "socket_mode not quoted"
grep -q '^region_mode: "0600"$' "$dir/defaults.yaml" || fail "region_mode not quoted"
grep -q '^copy_threads: 2$' "$dir/defaults.yaml" || fail "an int flag got quoted"
python3 - "$dir/defaults.yaml" <<'PY' || fail "a YAML reader misreads --print-config"
import sys, yaml
c = yaml.safe_load(open(sys.argv[1]))
assert c["socket_mode"] == "0660" and c["region_mode"] == "0600", (c["socket_mode"], c["region_mode"])
assert c["memory_limit"] == "0" and c["copy_threads"] == 2, (c["memory_limit"], c["copy_threads"])
PY
# Either spelling loads: quoted as printed, or plain as people write it.
printf 'socket_mode: "0640"\nsocket_group: "10001"\n' >"$dir/quoted.yaml"
"$kvhostd" --config="$dir/quoted.yaml" --print-config >"$dir/quoted.out"
grep -q '^socket_mode: "0640"$' "$dir/quoted.out" || fail "a quoted socket_mode did not load"
grep -q '^socket_group: "10001"$' "$dir/quoted.out" || fail "a numeric socket_group not quoted"
printf 'socket_mode: 0640\n' >"$dir/plain.yaml"
"$kvhostd" --config="$dir/plain.yaml" --print-config >"$dir/plain.out"
grep -q '^socket_mode: "0640"$' "$dir/plain.out" || fail "a plain socket_mode did not load"
cat >"$dir/full.yaml" <<'EOF'
memory-limit: 8G          # hyphen spelling
listen: [unix:///run/kvhost/a.sock, "localhost:0"]
copy_threads: 3
worker_copy: true
load_gates: false         # removed; false keeps an old config working
log_level: warn
pools:
  - name: llama
    spec: {kind: MHA, layout: PAGE_FIRST, dtype: BF16, page_size: 16, layer_num: 2,
           head_num: 2, head_dim: 64, size_tokens: 4096}
  - name: mla.small
    spec: {kind: MLA, layout: LAYER_FIRST, dtype: FP8_E4M3, page_size: 64, layer_num: 2,
           kv_lora_rank: 512, qk_rope_head_dim: 64, host_to_device_ratio: 2.5,
           device_size_tokens: 1024}
EOF
"$kvhostd" --config="$dir/full.yaml" --print-config >"$dir/full1.yaml"
"$kvhostd" --config="$dir/full1.yaml" --print-config >"$dir/full2.yaml"
diff -u "$dir/full1.yaml" "$dir/full2.yaml" || fail "a full config does not round-trip"
grep -q '^memory_limit: 8G$' "$dir/full1.yaml" || fail "memory-limit not applied"
grep -q '^  - localhost:0$' "$dir/full1.yaml" || fail "listen list not applied"
grep -q 'host_to_device_ratio: 2.5' "$dir/full1.yaml" || fail "pool spec not printed"
grep -q '^worker_copy: true$' "$dir/full1.yaml" || fail "a bool flag not applied"
! grep -q 'load_gates' "$dir/defaults.yaml" "$dir/full1.yaml" || fail "the removed load_gates printed"
echo "ok: --print-config round-trips"

# 2. The command line (and a --flagfile) overrides the file; the file the defaults.
"$kvhostd" --config="$dir/full.yaml" --copy-threads=5 --print-config >"$dir/over.yaml"
grep -q '^copy_threads: 5$' "$dir/over.yaml" || fail "--copy-threads did not override the file"
grep -q '^log_level: warn$' "$dir/over.yaml" || fail "the file did not override a default"
grep -q '^sm_blocks: 16$' "$dir/over.yaml" || fail "a default changed"
echo "--log_level=error" >"$dir/f.flags"
"$kvhostd" --flagfile="$dir/f.flags" --config="$dir/full.yaml" --print-config >"$dir/over2.yaml"
grep -q '^log_level: error$' "$dir/over2.yaml" || fail "--flagfile did not override the file"
echo "ok: command line > file > defaults"

# 3. Bad files exit 2 naming the file, the key and the line.
printf 'backend: host\nmemory_limt: 8G\n' >"$dir/unknown.yaml"
expect_exit2 unknown "$dir/unknown.yaml:2:" "memory_limt"
printf 'copy_threads: many\n' >"$dir/badint.yaml"
expect_exit2 badint "$dir/badint.yaml:1:" "copy_threads" "many"
printf 'backend: [host, cuda]\n' >"$dir/badlist.yaml"
expect_exit2 badlist "$dir/badlist.yaml:1:" "backend" "not a list"
printf 'worker_copy: maybe\n' >"$dir/badbool.yaml"
expect_exit2 badbool "$dir/badbool.yaml:1:" "worker_copy"
printf 'backend: host\nlisten: [unix:///x.sock\n' >"$dir/malformed.yaml"
expect_exit2 malformed "$dir/malformed.yaml:" "not valid YAML"
printf 'backend: host\nbackend: cuda\n' >"$dir/twice.yaml"
expect_exit2 twice "$dir/twice.yaml:2:" "backend" "twice"
printf 'pools:\n  - name: p\n    spec: {kind: MHA, page_sise: 16}\n' >"$dir/badfield.yaml"
expect_exit2 badfield "$dir/badfield.yaml:3:" "pools[0] 'p'" "page_sise"
printf 'pools:\n  - name: p\n    spec: {kind: MHA, layout: PAGE_FIRST, dtype: BF17}\n' \
  >"$dir/badenum.yaml"
expect_exit2 badenum "$dir/badenum.yaml:3:" "pools[0] 'p'" "dtype" "BF17"
code=0
"$kvhostd" --config="$dir/absent.yaml" >"$dir/absent.out" 2>&1 || code=$?
[ "$code" -eq 2 ] || fail "absent file: exit $code, not 2"
grep -qF "$dir/absent.yaml" "$dir/absent.out" || fail "absent file: not named"
# A bad value is refused even where the command line overrides it.
code=0
"$kvhostd" --config="$dir/badint.yaml" --copy-threads=1 --print-config >/dev/null 2>&1 || code=$?
[ "$code" -eq 2 ] || fail "a bad value overridden on the command line was accepted (exit $code)"

# 4. Declared pools exist once the daemon serves; they are ordinary pools.
start --config="$dir/full.yaml" --log-level=info
"$kvhostctl" --server="unix://$sock" --json pools >"$dir/pools.json"
python3 - "$dir/pools.json" <<'EOF'
import json, sys
pools = {p["name"]: p for p in json.load(open(sys.argv[1]))["pools"]}
assert set(pools) == {"llama", "mla.small"}, pools
assert int(pools["llama"]["size_tokens"]) == 4096, pools["llama"]
assert pools["mla.small"]["spec"]["dtype"] == "FP8_E4M3", pools["mla.small"]
EOF
"$kvhostctl" --server="unix://$sock" pools
grep -q "created declared pool 'llama'" "$dir/log" || fail "no log line for the declared pool"
stop
echo "ok: declared pools exist after start"

# 5. A declared pool the registry refuses stops the start: exit 2, no socket.
cat >"$dir/badpool.yaml" <<'EOF'
pools:
  - name: fine
    spec: {kind: MHA, layout: PAGE_FIRST, dtype: BF16, page_size: 16, layer_num: 2,
           head_num: 2, head_dim: 64, size_tokens: 4096}
  - name: huge
    spec: {kind: MHA, layout: PAGE_FIRST, dtype: FP32, page_size: 16, layer_num: 1024,
           head_num: 128, head_dim: 256, size_tokens: 100000000}
EOF
code=0
"$kvhostd" --config="$dir/badpool.yaml" --listen="unix://$sock" --shm-dir="$shm" \
  --backend=host >"$dir/badpool.out" 2>&1 || code=$?
cat "$dir/badpool.out"
[ "$code" -eq 2 ] || fail "a pool that cannot be created: exit $code, not 2"
grep -q "declared pool 'huge'" "$dir/badpool.out" || fail "the failed pool is not named"
[ ! -e "$sock" ] || fail "the socket exists after a failed start"
[ -z "$(ls -A "$shm")" ] || fail "region files left behind: $(ls "$shm")"
echo "ok: a bad declared pool stops the start"

# 6. The removed load_gates: true in a file stops the start (exit 2, one line
# saying why and what replaces it) and is printed, so that the printed file
# is refused too; false loaded above (section 4) and starts.
printf 'load_gates: true\n' >"$dir/gates.yaml"
"$kvhostd" --config="$dir/gates.yaml" --print-config >"$dir/gates.out"
grep -q '^load_gates: true$' "$dir/gates.out" || fail "load_gates: true not printed"
code=0
"$kvhostd" --config="$dir/gates.yaml" --listen="unix://$sock" --shm-dir="$shm" \
  --backend=host >"$dir/gates.log" 2>&1 || code=$?
[ "$code" -eq 2 ] || { cat "$dir/gates.log"; fail "load_gates: true: exit $code, not 2"; }
grep -F -- "--load-gates=true" "$dir/gates.log" | grep -F "layer_progress" | grep -qF "WaitLayer" ||
  { cat "$dir/gates.log"; fail "load_gates: true: no line naming the flag and its replacement"; }
[ ! -e "$sock" ] || fail "the socket exists after a refused start"
echo "ok: load_gates: true is refused"

# 7. The example config loads (its socket and shm dir overridden), and so do
# its commented pools.
start --config="$example"
"$kvhostctl" --server="unix://$sock" status
stop
grep -q "shm dir $shm" "$dir/log" || fail "--shm-dir did not override the example"
sed -e 's/^# pools:/pools:/' -e 's/^#   /  /' "$example" >"$dir/example-pools.yaml"
"$kvhostd" --config="$dir/example-pools.yaml" --print-config >"$dir/example-pools.out" ||
  { cat "$dir/example-pools.out"; fail "the example's commented pools do not load"; }
grep -q "name: deepseek" "$dir/example-pools.out" || fail "the example's pools were not read"
echo "ok: $example loads"

# 8. Declared followers start, in either order in the file, once the pool
# they follow is filled (issue 31: the follower was checked while its anchor
# was still being created, and kvhostd exited 2). First the example's own
# commented pools, shrunk to fit a test machine.
# wait_ready POOL...: every POOL is READY within 30 s.
wait_ready() {
  for _ in $(seq 300); do
    "$kvhostctl" --server="unix://$sock" --json pools >"$dir/ready.json"
    python3 - "$dir/ready.json" "$@" <<'PY' && return 0
import json, sys
states = {p["name"]: p.get("state") for p in json.load(open(sys.argv[1]))["pools"]}
sys.exit(0 if all(states.get(n) == "READY" for n in sys.argv[2:]) else 1)
PY
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  cat "$dir/ready.json" "$dir/log"
  fail "pools $* not READY"
}
sed -e 's/size_tokens: 65536/size_tokens: 1024/' -e 's/device_size_tokens: 200000/device_size_tokens: 1024/' \
  -e 's/size_tokens: 512}/size_tokens: 2}/' "$dir/example-pools.yaml" >"$dir/example-small.yaml"
start --config="$dir/example-small.yaml" --log-level=info
wait_ready llama deepseek deepseek-indexer mamba
stop
echo "ok: the example's pools, the follower included, start"
anchor='{kind: MLA, layout: LAYER_FIRST, dtype: FP8_E4M3, page_size: 64, layer_num: 2,
           kv_lora_rank: 512, qk_rope_head_dim: 64, size_tokens: 4096}'
indexer='{kind: DSA_INDEXER, layout: LAYER_FIRST, dtype: UINT8, layer_num: 2,
           index_head_dim: 128, index_quant_block_size: 128, follows: mla}'
printf 'pools:\n  - name: idx\n    spec: %s\n  - name: mla\n    spec: %s\n' "$indexer" "$anchor" \
  >"$dir/follower-first.yaml"
printf 'pools:\n  - name: mla\n    spec: %s\n  - name: idx\n    spec: %s\n' "$anchor" "$indexer" \
  >"$dir/anchor-first.yaml"
for order in follower-first anchor-first; do
  start --config="$dir/$order.yaml" --log-level=info
  wait_ready mla idx
  python3 - "$dir/ready.json" <<'PY' || fail "$order: the follower does not follow"
import json, sys
pools = {p["name"]: p for p in json.load(open(sys.argv[1]))["pools"]}
assert pools["idx"]["spec"]["follows"] == "mla", pools["idx"]
assert pools["idx"]["size_tokens"] == pools["mla"]["size_tokens"], pools
PY
  grep -q "created declared pool 'idx'" "$dir/log" || fail "$order: no log line for the follower"
  stop
  echo "ok: declared follower, $order"
done
# A follower the registry refuses once its pool is filled (a page size that
# differs) is logged as an error and absent; the daemon serves on.
sed 's/index_head_dim: 128,/index_head_dim: 128, page_size: 32,/' "$dir/anchor-first.yaml" \
  >"$dir/badfollower.yaml"
start --config="$dir/badfollower.yaml" --log-level=info
wait_ready mla
for _ in $(seq 100); do grep -q "declared pool 'idx' was not created" "$dir/log" && break; sleep 0.1; done
grep "declared pool 'idx' was not created" "$dir/log" | grep -q "page_size 32" ||
  { cat "$dir/log"; fail "a refused follower is not logged"; }
"$kvhostctl" --server="unix://$sock" status >/dev/null || fail "the daemon stopped serving"
stop
echo "ok: a refused declared follower is logged and absent"
# Refused at start (exit 2, naming the pools): a follower of a pool the file
# does not declare, followers in a cycle, a kind that cannot follow the other.
expect_start_exit2() {
  local name=$1 code=0
  shift
  "$kvhostd" --config="$dir/$name.yaml" --listen="unix://$sock" --shm-dir="$shm" \
    --backend=host >"$dir/$name.out" 2>&1 || code=$?
  [ "$code" -eq 2 ] || { cat "$dir/$name.out"; fail "$name: exit $code, not 2"; }
  for text in "$@"; do
    grep -qF -- "$text" "$dir/$name.out" || { cat "$dir/$name.out"; fail "$name: no '$text'"; }
  done
  [ ! -e "$sock" ] || fail "$name: the socket exists after a refused start"
  echo "ok: $name -> exit 2: $(grep -o 'declared pool.*' "$dir/$name.out" | head -1)"
}
printf 'pools:\n  - name: idx\n    spec: %s\n' "$indexer" >"$dir/undeclared.yaml"
expect_start_exit2 undeclared "declared pool 'idx'" "pool 'mla', which is not declared"
konly() { echo "{kind: K_ONLY, layout: LAYER_FIRST, dtype: BF16, layer_num: 2, head_num: 2, head_dim: 64, follows: $1}"; }
printf 'pools:\n  - name: a\n    spec: %s\n  - name: b\n    spec: %s\n' "$(konly b)" "$(konly a)" \
  >"$dir/cycle.yaml"
expect_start_exit2 cycle "in a cycle: 'a' follows 'b' follows 'a'"
printf 'pools:\n  - name: mla\n    spec: %s\n  - name: k\n    spec: %s\n' "$anchor" "$(konly mla)" \
  >"$dir/badkind.yaml"
expect_start_exit2 badkind "declared pool 'k'" "is a MLA pool; K_ONLY follows"
echo "config ok"
