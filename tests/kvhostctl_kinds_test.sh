#!/usr/bin/env bash
# kvhostctl with every pool kind: create-pool by flags per kind and by --spec
# (flags given override it), the required-flag table (exit 2 naming the
# flags), `pool` with its components table and follows / followers, `pools`
# with FOLLOWS, page-set / page-get round trips (streamed in small chunks,
# byte-exact), page-shape, stride, bufinfo, split-meta, page_unified's
# head groups, and their refusals
# (exit 1 with the daemon's code); pool groups: create-group / group / groups
# / delete-group, a pool's group in pool / pools, alloc through a group's
# name, and their refusals.
#   usage: kvhostctl_kinds_test.sh KVHOSTD KVHOSTCTL
set -euo pipefail
kvhostd=$1 kvhostctl=$2
dir=$(mktemp -d /tmp/kvhost-kinds.XXXXXX)
shm=$(mktemp -d /dev/shm/kvhost-kinds.XXXXXX)
pid=
cleanup() {
  if [ -n "$pid" ]; then kill -TERM "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; fi
  rm -rf "$dir" "$shm"
}
trap cleanup EXIT
fail() {
  echo "FAIL: $1"
  echo "--- ${2:-$dir/out}:"
  cat "${2:-$dir/out}"
  exit 1
}
"$kvhostd" --listen="unix://$dir/s.sock" --shm-dir="$shm" --backend=host >>"$dir/log" 2>&1 &
pid=$!
for _ in $(seq 200); do [ -S "$dir/s.sock" ] && break; sleep 0.05; done
ctl() { "$kvhostctl" --server="unix://$dir/s.sock" --timeout=10 "$@"; }
# expect_exit CODE TEXT CMD...: the command exits CODE and its stderr holds TEXT.
expect_exit() {
  local want=$1 text=$2 code=0
  shift 2
  ctl "$@" >"$dir/out" 2>&1 || code=$?
  [ "$code" -eq "$want" ] || fail "$* exited $code, not $want"
  grep -qF -- "$text" "$dir/out" || fail "$* does not say '$text'"
}

# --- create-pool per kind.
ctl create-pool mla --kind=mla --layout=layer_first --layers=2 --kv-lora-rank=8 \
  --qk-rope-head-dim=8 --page-size=4 --size-tokens=64 >"$dir/out" || fail "mla"
grep -qE '^  latent +0 +0 +4096 +32 +token$' "$dir/out" || fail "mla components table"
ctl create-pool idx --kind=dsa_indexer --layout=page_first --layers=2 --index-head-dim=16 \
  --index-quant-block=8 --follows=mla >"$dir/out" || fail "dsa_indexer"
# G = ps * (16 + 16/8*4) = 96 bytes per page row; 16 pages x 2 layers.
grep -qE '^  index_k +0 +0 +3072 +96 +page \(4 slots\)$' "$dir/out" || fail "indexer components"
grep -q "follows 'mla'" "$dir/out" || fail "indexer follows"
grep -q "DSA_INDEXER/PAGE_FIRST/UINT8" "$dir/out" || fail "byte kinds default to uint8"
ctl create-pool mamba --kind=mamba --layout=page_first_direct --layers=2 \
  --mamba-temporal=2x3:fp32 --mamba-conv=4,2x2 --size-tokens=8 >"$dir/out" || fail "mamba"
grep -qE '^  temporal +0 +0 +384 +24 +token$' "$dir/out" || fail "mamba temporal"
grep -qE '^  conv1 +2 +0 +128 +8 +token$' "$dir/out" || fail "mamba conv1"
# --spec, with --layers overriding its layer_num.
ctl create-pool v4 --spec='{"kind":"V4_PAGED","layout":"PAGE_FIRST","dtype":"UINT8",
  "page_size":4,"layer_num":2,"item_bytes":40,"size_tokens":32}' --layers=3 >"$dir/out" ||
  fail "v4 from --spec"
grep -q "V4_PAGED/PAGE_FIRST/UINT8, page 4, 3 layers, item 40 bytes" "$dir/out" ||
  fail "--layers did not override --spec"
ctl pool mla >"$dir/out"
grep -q "followed by idx" "$dir/out" || fail "pool shows no followers"
ctl pools >"$dir/out"
grep -qE '^idx +READY +DSA_INDEXER/PAGE_FIRST/UINT8 .* mla$' "$dir/out" || fail "pools FOLLOWS column"
ctl --json pool idx >"$dir/out"
grep -q '"follows":"mla"' "$dir/out" || fail "pool --json"

# --- required flags and bad values (exit 2, before any RPC).
expect_exit 2 "--mamba-temporal and --mamba-conv" create-pool m2 --kind=mamba --layers=2 \
  --size-tokens=8
expect_exit 2 "--follows" create-pool k2 --kind=k_only --layers=2 --heads=2 --head-dim=8
expect_exit 2 "--mamba-conv '4xz'" create-pool m3 --kind=mamba --layers=2 \
  --mamba-temporal=2 --mamba-conv=4xz --size-tokens=8
expect_exit 2 "--spec is not" create-pool bad --spec='{nope'
# The daemon's refusal: exit 1 with its code.
expect_exit 1 "INVALID_ARGUMENT" create-pool m4 --kind=mamba --layout=page_first --layers=2 \
  --mamba-temporal=2 --mamba-conv=4 --size-tokens=8

# --- pages.
ctl alloc mla 8 >/dev/null
head -c 192 /dev/urandom >"$dir/page"
ctl page-set idx 4 --in="$dir/page" --chunk-bytes=50 >"$dir/out" || fail "page-set"
ctl page-get idx 4 --out="$dir/back" --chunk-bytes=33 >"$dir/out" || fail "page-get"
cmp "$dir/page" "$dir/back" || fail "page-get returned other bytes than page-set wrote"
ctl page-get idx 4 >"$dir/out"
grep -q "page at slot 4: 192 bytes" "$dir/out" || fail "page-get text"
want=$(od -An -tx1 -N16 "$dir/page" | tr -s ' ' | sed 's/^ //; s/ $//')
grep -qF "00000000  $want" "$dir/out" || fail "hex dump of the page's start"
expect_exit 1 "FAILED_PRECONDITION" page-get idx 12  # not allocated in mla
expect_exit 1 "INVALID_ARGUMENT" page-get idx 5      # not a page start
head -c 191 "$dir/page" >"$dir/short"
expect_exit 1 "INVALID_ARGUMENT" page-set idx 4 --in="$dir/short"
ctl page-get idx 4 --out="$dir/back2" >/dev/null
cmp "$dir/page" "$dir/back2" || fail "a refused page-set changed the page"
expect_exit 2 "--in=FILE" page-set idx 4
ctl --json page-shape mamba >"$dir/out"
grep -q '"bytes":80' "$dir/out" || fail "page-shape --json bytes (48 + 16 + 16)"
ctl page-shape idx >"$dir/out"
grep -q "a flat page has 192 bytes" "$dir/out" || fail "page-shape text"

# --- stride, bufinfo, split-meta.
ctl stride v4 --alignment=8 >"$dir/out" || fail "stride"
grep -q "page blocks start on 8 bytes; strides 120" "$dir/out" || fail "stride text"
ctl bufinfo mla >"$dir/out" || fail "bufinfo"
grep -qE '^  latent +1 +0 +2048 +2048 +128$' "$dir/out" || fail "bufinfo layer 1"
expect_exit 1 "FAILED_PRECONDITION" bufinfo v4
expect_exit 1 "PAGE_HEAD" split-meta mla 0-3 --split-factor=1
ctl create-pool ph --kind=mha --layout=page_head --layers=2 --heads=2 --head-dim=4 \
  --page-size=4 --size-tokens=16 >/dev/null
ctl split-meta ph 4-7 --split-factor=2 >"$dir/out" || fail "split-meta"
grep -q "4 segment(s), 2 head group(s) per page" "$dir/out" || fail "split-meta text"

# --- page_unified: --head-groups, meta per page and head group (K and V of
# all layers: 2 layers x 2 x 4 slots x 1 head x 4 bf16 = 128 bytes each).
ctl create-pool pu --kind=mha --layout=page_unified --layers=2 --heads=2 --head-dim=4 \
  --head-groups=2 --page-size=4 --size-tokens=16 >"$dir/out" || fail "create-pool pu"
ctl meta pu 4-7 >"$dir/out" || fail "meta pu"
grep -q "2 segment(s)" "$dir/out" || fail "meta pu segments"
grep -qE '^ *0 +256 +128 +page 1 head group 0 all layers K and V$' "$dir/out" || fail "meta pu group 0"
grep -qE '^ *0 +384 +128 +page 1 head group 1 all layers K and V$' "$dir/out" || fail "meta pu group 1"
expect_exit 1 "PAGE_UNIFIED" split-meta pu 4-7 --split-factor=2
expect_exit 1 "spec.head_groups 3" create-pool pu3 --kind=mha --layout=page_unified --layers=2 \
  --heads=2 --head-dim=4 --head-groups=3 --size-tokens=16
expect_exit 1 "spec.head_groups 2" create-pool pf2 --kind=mha --layout=page_first --layers=2 \
  --heads=2 --head-dim=4 --head-groups=2 --size-tokens=16

# --- pool groups: a hybrid model's MHA pool and Mamba pool.
ctl create-pool attn --kind=mha --layout=page_first --layers=2 --heads=2 --head-dim=8 \
  --page-size=4 --size-tokens=16 >/dev/null
ctl create-pool ssm --kind=mamba --layout=page_first_direct --layers=2 \
  --mamba-temporal=2x3:fp32 --mamba-conv=4 --size-tokens=16 >/dev/null
ctl create-group hybrid --layers=4 --entry=kv:attn:map=-1,0,-1,1 \
  --entry=ssm:ssm:anchor:map=0,-1,1,-1 >"$dir/out" || fail "create-group"
grep -q "group 'hybrid': 4 model layers, 2 entries, anchor 'ssm'" "$dir/out" || fail "group line"
grep -qE '^  kv +attn +- +-1,0,-1,1$' "$dir/out" || fail "kv entry row"
grep -qE '^  ssm +ssm +yes +0,-1,1,-1$' "$dir/out" || fail "ssm entry row"
# No map: the identity over the layers the pool holds (mla holds [0, 2)).
ctl create-group ident --layers=3 --entry=m:mla >"$dir/out" || fail "create-group identity"
grep -qE '^  m +mla +yes +0,1,-1$' "$dir/out" || fail "identity map, first entry the anchor"
ctl groups >"$dir/out"
grep -qE '^hybrid +4 +ssm +0 +kv=attn ssm=ssm$' "$dir/out" || fail "groups table"
grep -qE '^ident +3 +m +0 +m=mla$' "$dir/out" || fail "groups table (ident)"
ctl --json group hybrid >"$dir/out"
grep -q '"anchor":"ssm"' "$dir/out" || fail "group --json anchor"
grep -q '"layer_map":\[-1,0,-1,1\]' "$dir/out" || fail "group --json layer_map"
ctl --json groups >"$dir/out"
grep -q '"groups":\[' "$dir/out" || fail "groups --json"
ctl pool attn >"$dir/out"
grep -q "in group 'hybrid'" "$dir/out" || fail "pool shows its group"
ctl pools >"$dir/out"
grep -qE '^attn +READY +MHA/PAGE_FIRST/BF16 .* hybrid +-$' "$dir/out" || fail "pools GROUP column"
grep -qE '^idx +READY +DSA_INDEXER/PAGE_FIRST/UINT8 .* - +mla$' "$dir/out" || fail "pools GROUP of idx"
ctl --json pool ssm >"$dir/out"
grep -q '"group":"hybrid"' "$dir/out" || fail "pool --json group"
# alloc / free through the group act on its anchor (ssm, one-slot pages).
ctl alloc hybrid 3 >"$dir/out" || fail "alloc through the group"
grep -qx "0-2" "$dir/out" || fail "alloc hybrid slots"
ctl --json pool ssm >"$dir/out"
grep -q '"available_tokens":13' "$dir/out" || fail "the anchor allocated"
ctl --json pool attn >"$dir/out"
grep -q '"available_tokens":16' "$dir/out" || fail "the other entry allocated"
ctl free hybrid 0-2 >/dev/null || fail "free through the group"
# Refusals: usage (exit 2) and the daemon's (exit 1), each changing nothing.
expect_exit 2 "--entry" create-group g2 --layers=4
expect_exit 2 "--layers" create-group g2 --entry=a:attn
expect_exit 2 "map value 'x'" create-group g2 --layers=2 --entry=a:v4:map=0,x
expect_exit 2 "'bogus'" create-group g2 --layers=2 --entry=a:v4:bogus
expect_exit 1 "layer_map[1] = 5" create-group g2 --layers=2 --entry=a:v4:map=0,5
expect_exit 1 "INVALID_ARGUMENT" create-group g2 --layers=2 --entry=a:v4:anchor \
  --entry=b:ph:anchor
expect_exit 1 "NOT_FOUND" create-group g2 --layers=1 --entry=a:nope
expect_exit 1 "FAILED_PRECONDITION" create-group g2 --layers=2 --entry=a:attn
expect_exit 1 "ALREADY_EXISTS" create-group attn --layers=2 --entry=a:v4
expect_exit 1 "ALREADY_EXISTS" create-pool hybrid --kind=mla --layers=2 --kv-lora-rank=8 \
  --qk-rope-head-dim=8 --page-size=4 --size-tokens=64
expect_exit 1 "group 'hybrid'" delete-pool ssm
expect_exit 1 "NOT_FOUND" group g2
ctl delete-group hybrid >"$dir/out" || fail "delete-group"
grep -q "deleted pool group 'hybrid'" "$dir/out" || fail "delete-group text"
ctl delete-group ident >/dev/null || fail "delete-group ident"
ctl groups >"$dir/out"
grep -qx "no pool groups" "$dir/out" || fail "groups after delete"
expect_exit 1 "NOT_FOUND" delete-group hybrid
ctl delete-pool ssm >/dev/null || fail "a pool of a deleted group deletes"
ctl delete-pool attn >/dev/null

# --- the follower goes first.
expect_exit 1 "FAILED_PRECONDITION" delete-pool mla
ctl delete-pool idx >/dev/null
ctl delete-pool mla >/dev/null
echo "kvhostctl kinds ok"
