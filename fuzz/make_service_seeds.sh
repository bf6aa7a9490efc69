#!/usr/bin/env bash
# Writes the service_fuzz seed inputs into fuzz/corpus/service_fuzz/ from the
# text-format requests below (protoc --encode). An input is a sequence of
# calls: one byte naming the RPC (service_fuzz.cc's Rpc numbering), one
# length byte, then that many bytes of the serialized request.
# Usage: fuzz/make_service_seeds.sh   (run from anywhere; needs protoc)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="$root/fuzz/corpus/service_fuzz"
mkdir -p "$out"

# rpc numbers (service_fuzz.cc)
CreatePool=0 GetPool=1 ListPools=2 DeletePool=3 Alloc=4 Free=5 GetPageBufferMeta=6
GetDataPage=7 SetFromFlatDataPage=8 ReadPages=9 WritePages=10 GetPageShape=11
GetSplitHeadsPageBufferMeta=12 IsStridePageAligned=13 GetContiguousBufferInfos=14
CreatePoolGroup=15 GetPoolGroup=16 ListPoolGroups=17 DeletePoolGroup=18

# call RPC MESSAGE TEXT: appends one call to the current seed file.
call() {
  local rpc=$1 type=$2 text=$3 tmp
  tmp=$(mktemp)
  printf '%s' "$text" | protoc -I "$root/proto" --encode="kvhost.v1.$type" \
    kvhost/v1/pool.proto > "$tmp"
  local len
  len=$(stat -c %s "$tmp")
  if (( len > 255 )); then echo "request too long for one call: $text" >&2; exit 1; fi
  printf "\\x$(printf %02x "$rpc")\\x$(printf %02x "$len")" >> "$seed"
  cat "$tmp" >> "$seed"
  rm -f "$tmp"
}
begin() { seed="$out/$1"; : > "$seed"; }

mha='name: "p" spec { kind: MHA layout: PAGE_FIRST dtype: BF16 page_size: 4 layer_num: 2 head_num: 2 head_dim: 4 size_tokens: 32 }'
ph='name: "h" spec { kind: MHA layout: PAGE_HEAD dtype: FP16 page_size: 2 layer_num: 2 head_num: 4 head_dim: 2 size_tokens: 16 }'

begin mha_alloc_free
call $CreatePool CreatePoolRequest "$mha"
call $Alloc AllocRequest 'pool: "p" num_tokens: 8'
call $GetPageBufferMeta GetPageBufferMetaRequest 'pool: "p" indices: [0, 1, 2, 3]'
call $Free FreeRequest 'pool: "p" indices: [4, 5, 6, 7]'
call $Free FreeRequest 'pool: "p" indices: [4, 5, 6, 7]'
call $Alloc AllocRequest 'pool: "p" num_tokens: 3'
call $ListPools ListPoolsRequest ''

begin mha_pages
call $CreatePool CreatePoolRequest "$mha"
call $Alloc AllocRequest 'pool: "p" num_tokens: 4'
call $GetPageShape GetPageShapeRequest 'pool: "p"'
call $GetDataPage PageRequest 'pool: "p" index: 0'
call $SetFromFlatDataPage SetPageRequest 'pool: "p" index: 0 data: "0123456789abcdef"'
call $ReadPages ReadPagesRequest 'pool: "p" indices: [0] chunk_bytes: 100'
call $WritePages WritePagesChunk 'pool: "p" index: 0 offset: 0 data: "xyz"'
call $IsStridePageAligned StrideAlignmentRequest 'pool: "p" alignment: 64'
call $DeletePool DeletePoolRequest 'name: "p"'

begin page_head_split
call $CreatePool CreatePoolRequest "$ph"
call $Alloc AllocRequest 'pool: "h" num_tokens: 4'
call $GetSplitHeadsPageBufferMeta SplitHeadsMetaRequest 'pool: "h" indices: [0, 1] split_factor: 2'
call $GetSplitHeadsPageBufferMeta SplitHeadsMetaRequest 'pool: "h" indices: [2, 3] split_factor: 3'

pu='name: "u" spec { kind: MHA layout: PAGE_UNIFIED dtype: FP16 page_size: 2 layer_num: 2 head_num: 4 head_dim: 2 head_groups: 2 size_tokens: 16 }'
begin page_unified
call $CreatePool CreatePoolRequest "$pu"
call $Alloc AllocRequest 'pool: "u" num_tokens: 4'
call $GetPageBufferMeta GetPageBufferMetaRequest 'pool: "u" indices: [2, 3, 0, 1]'
call $GetPageShape GetPageShapeRequest 'pool: "u"'
call $SetFromFlatDataPage SetPageRequest 'pool: "u" index: 2 data: "0123456789abcdef"'
call $GetDataPage PageRequest 'pool: "u" index: 2'
call $GetSplitHeadsPageBufferMeta SplitHeadsMetaRequest 'pool: "u" indices: [0, 1] split_factor: 2'
call $IsStridePageAligned StrideAlignmentRequest 'pool: "u" alignment: 64'

begin follower_group
call $CreatePool CreatePoolRequest 'name: "m" spec { kind: MLA layout: LAYER_FIRST dtype: BF16 page_size: 2 layer_num: 2 kv_lora_rank: 4 qk_rope_head_dim: 2 size_tokens: 8 }'
call $CreatePool CreatePoolRequest 'name: "i" spec { kind: DSA_INDEXER layout: PAGE_FIRST dtype: UINT8 layer_num: 2 index_head_dim: 8 index_quant_block_size: 4 follows: "m" }'
call $GetContiguousBufferInfos ContiguousBufferInfosRequest 'pool: "m"'
call $CreatePoolGroup CreatePoolGroupRequest 'name: "g" layer_num: 2 entries { name: "a" pool: "m" layer_map: [0, 1] anchor: true }'
call $Alloc AllocRequest 'pool: "g" num_tokens: 2'
call $GetPoolGroup GetPoolGroupRequest 'name: "g"'
call $ListPoolGroups ListPoolGroupsRequest ''
call $DeletePool DeletePoolRequest 'name: "m"'
call $DeletePoolGroup DeletePoolGroupRequest 'name: "g"'

begin kinds
call $CreatePool CreatePoolRequest 'name: "mamba" spec { kind: MAMBA layout: PAGE_FIRST_DIRECT dtype: BF16 page_size: 1 layer_num: 1 size_tokens: 4 mamba { temporal { dims: [2, 3] } conv { dims: [2] } conv { dims: [1, 2] } } }'
call $CreatePool CreatePoolRequest 'name: "v4" spec { kind: V4_PAGED layout: PAGE_FIRST dtype: UINT8 page_size: 4 layer_num: 2 item_bytes: 16 size_tokens: 16 }'
call $CreatePool CreatePoolRequest 'name: "st" spec { kind: V4_STATE layout: PAGE_FIRST dtype: UINT8 layer_num: 2 ring_size: 2 state_slot_bytes: 8 follows: "v4" }'
call $CreatePool CreatePoolRequest 'name: "asym" spec { kind: MHA_ASYMMETRIC layout: PAGE_FIRST_DIRECT dtype: FP32 page_size: 2 layer_num: 1 head_num: 1 head_dim: 2 v_head_dim: 3 size_bytes: 400 }'
call $CreatePool CreatePoolRequest 'name: "dsa" spec { kind: DSA layout: LAYER_FIRST dtype: FP8_E4M3 page_size: 2 layer_num: 1 kv_cache_dim: 8 index_row_bytes: 4 host_to_device_ratio: 2 device_size_tokens: 4 }'
call $CreatePool CreatePoolRequest 'name: "log" spec { kind: LOGICAL layout: PAGE_FIRST page_size: 4 size_tokens: 64 }'
call $Alloc AllocRequest 'pool: "v4" num_tokens: 4'
call $GetPageBufferMeta GetPageBufferMetaRequest 'pool: "st" indices: [0, 1, 2, 3]'
call $Alloc AllocRequest 'pool: "log" num_tokens: 64'

begin invalid
call $CreatePool CreatePoolRequest 'name: ".bad" spec { kind: MHA }'
call $CreatePool CreatePoolRequest 'name: "big" spec { kind: MHA layout: LAYER_FIRST dtype: FP32 page_size: 1 layer_num: 64 head_num: 64 head_dim: 128 size_tokens: 1000000 }'
call $Alloc AllocRequest 'pool: "none" num_tokens: 1'
call $Free FreeRequest 'pool: "none" indices: [-1]'
# Regression: a LOGICAL pool of 2^40 tokens has no bytes, and its 8 TiB page
# table was never checked against memory (the daemon died allocating it).
begin regression-logical-page-table
call $CreatePool CreatePoolRequest 'name: "big" spec { kind: LOGICAL layout: PAGE_FIRST dtype: BF16 page_size: 1 size_tokens: 1099511627776 }'

echo "wrote $(ls "$out" | wc -l) seeds to $out"
