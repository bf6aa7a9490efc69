#!/usr/bin/env bash
# Writes the transfer_fuzz seed inputs into fuzz/corpus/transfer_fuzz/: valid
# call sequences on every pool kind and the group, and a few refusals. An
# input is a sequence of operations, one byte each followed by its argument
# bytes (transfer_fuzz.cc's Op and the Read* functions there):
#   Attach       0 target nmut [mutation...] caller
#   AttachRaw    1 len AttachDeviceRequest-bytes caller
#   Detach       2 attachment caller
#   Backup/Load  3/4 attachment flags caller rows [entry rows]...
#                flags: 1 verify (wait, compare bytes), (flags>>1)%3 pool_transfers
#                rows: mode n host_base device_base; mode 0 = allocated slots,
#                0x10 whole pages, 0x04 one device index short, 0x08 a host
#                slot twice, 0x20 device rows reversed, 0x80 over the limit
#   WaitPoll     5 ticket caller        WaitBlocking 6 ticket caller ms
#   Alloc        7 pool tokens          Free         8 pool page
#   CloseSession 9 which                DeletePool  10 name      Quiesce 11
# target: kPools' index (0 lf1, 1 pf16, 2 ph, 3 mla, 4 idx, 5 v4, 6 log,
# 7 gattn, 8 gssm) or 9 for the group; caller 0 = every session, 16 = and
# ph's owner token, 7 = none. attachment / ticket: index into the ones the
# input got (< 200).
# Usage: fuzz/make_transfer_seeds.sh   (run from anywhere)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="$root/fuzz/corpus/transfer_fuzz"
mkdir -p "$out"

Attach=0 AttachRaw=1 Detach=2 Backup=3 Load=4 WaitPoll=5 WaitBlocking=6 Alloc=7 Free=8
CloseSession=9 DeletePool=10 Quiesce=11
# Attach mutations (Mutate's switch): Size=0 Range=1 Path=2 Offset=3 Drop=4 ...
MSize=0 MRange=1 MPath=2 MOffset=3 MDrop=4 MDup=5 MTpRank=8 MLoadOnly=9 MSession=10 MCuda=12

# seed NAME BYTE...: one seed file of the given decimal bytes.
seed() {
  local name=$1 hex=""
  shift
  for b in "$@"; do hex+=$(printf '\\x%02x' "$b"); done
  printf "$hex" > "$out/$name"
}

# A verified backup then load of 8 allocated slots (whole pages), a poll and
# a blocking wait of the backup's ticket, a detach.
round_trip() {  # target caller n
  local t=$1 c=$2 n=$3
  echo $Attach "$t" 0 "$c" \
    $Backup 0 1 "$c" 16 "$n" 0 0 \
    $Load 0 1 "$c" 16 "$n" 0 "$n" \
    $Backup 0 0 "$c" 0 "$n" 3 0 \
    $WaitPoll 0 "$c" $WaitBlocking 2 "$c" 50 \
    $Detach 0 "$c"
}
seed lf1_round_trip $(round_trip 0 0 8)
seed pf16_round_trip $(round_trip 1 0 16)
seed ph_round_trip_token $(round_trip 2 16 4)
seed mla_round_trip $(round_trip 3 0 4)
seed idx_follower_round_trip $(round_trip 4 0 4)
seed v4_page_rows_round_trip $(round_trip 5 0 4)
seed logical_round_trip $(round_trip 6 0 4)
seed gattn_round_trip $(round_trip 7 0 8)
seed gssm_round_trip $(round_trip 8 0 4)
# The group: anchor (ssm) rows plus pool_transfers for entry kv (entry 0).
seed group_round_trip $Attach 9 0 0 \
  $Backup 0 3 0 16 4 0 0 0 16 4 0 0 \
  $Load 0 3 0 16 4 0 4 0 16 4 0 4 \
  $WaitPoll 0 0 $WaitPoll 1 0 $Detach 0 0
# A shifted layer range on pf16 (device layers [0, 3), of which it holds
# [1, 3)), refilled with 3 buffers.
seed pf16_layer_range $Attach 1 1 $MRange 0 3 0 0 $Backup 0 1 0 0 8 0 0 $Load 0 1 0 0 8 0 8
# Paths: outside, symlinks out and in, the FIFO, a region file, a NUL, '..'.
# (Variant 11 reads one more byte: which region file.)
for p in 6 7 8 17 13 5 21 12 3; do
  seed "lf1_path_$p" $Attach 0 1 $MPath 0 $p 0 $Backup 0 1 0 0 4 0 0 $Load 0 1 0 0 4 0 0
done
seed lf1_path_region_file $Attach 0 1 $MPath 0 11 0 0 $Backup 0 1 0 0 4 0 0 $Load 0 1 0 0 4 0 0
# Offsets, sizes, sessions, a second TP rank, load_only, CUDA buffers.
seed lf1_offset_past_end $Attach 0 1 $MOffset 3 1 23 0
seed lf1_offset_nudged $Attach 0 1 $MOffset 1 0 9 0 $Load 0 1 0 0 4 0 0
seed lf1_size_huge $Attach 0 1 $MSize 21 0
seed lf1_no_session_then_stranger $Attach 0 1 $MSession 2 0 $Backup 0 1 7 0 4 0 0 $Detach 0 7
seed mla_second_rank $Attach 3 1 $MTpRank 1 0 $Attach 3 1 $MTpRank 2 0 $Attach 0 1 $MTpRank 1 0 $Attach 0 1 $MTpRank 2 0
seed lf1_load_only $Attach 0 1 $MLoadOnly 0 $Backup 0 1 0 0 4 0 0 $Load 0 1 0 0 4 0 0
seed lf1_cuda_buffer $Attach 0 1 $MCuda 0 1 0 0
seed group_drop_entry_buffer $Attach 9 1 $MDrop 1 0 0
# In-flight work under a session's end, a pool deletion, a free.
seed close_session_under_loads $Attach 1 0 0 $Load 0 0 0 0 16 0 0 $Load 0 0 0 0 16 0 16 \
  $Backup 0 0 0 0 16 0 0 $CloseSession 0 $WaitBlocking 0 0 40 $WaitPoll 1 0 $Backup 0 1 0 0 4 0 0
seed delete_attached_pool $Attach 0 0 0 $DeletePool 0 $Detach 0 0 $DeletePool 0 $Backup 0 1 0 0 4 0 0
seed free_then_backup $Attach 0 0 0 $Free 0 0 $Backup 0 1 0 0 4 0 0 $Alloc 0 4 $Backup 0 1 0 0 4 0 0 $Quiesce
seed wait_unknown_tickets $WaitPoll 201 1 2 3 4 5 6 7 8 0 $WaitBlocking 200 0 5 $WaitPoll 202 0
seed index_errors $Attach 0 0 0 $Backup 0 1 0 4 4 0 0 $Backup 0 1 0 8 4 0 0 $Load 0 1 0 8 4 0 0 \
  $Backup 0 1 0 2 2 200 1 100 2 $Load 0 1 0 128 0 0 0 $Backup 0 1 0 1 4 200 200
echo "wrote $(ls "$out" | wc -l) seeds to $out"
