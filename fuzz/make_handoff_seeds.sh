#!/usr/bin/env bash
# Writes the handoff_fuzz seed inputs into fuzz/corpus/handoff_fuzz/: one
# kvhost.v1.HandoffRequest each (protoc --encode), as a client sends it on
# the handoff socket. "@A".."@D", "@0" / "@1" and "@T" are handoff_fuzz.cc's
# placeholders for its attachments, sessions and owner token; "@A-" the
# real id one character short. Also: no kind, an unknown kind, an empty
# message, one over the 4096-byte limit, and bytes that are no message.
# Usage: fuzz/make_handoff_seeds.sh   (run from anywhere; needs protoc)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="$root/fuzz/corpus/handoff_fuzz"
mkdir -p "$out"

seed() {  # seed NAME TEXT: the request in text format
  printf '%s' "$2" | protoc -I "$root/proto" --encode=kvhost.v1.HandoffRequest \
    kvhost/v1/handoff.proto > "$out/$1"
}

counters='kind: HANDOFF_KIND_LAYER_COUNTERS'
seed open_anyone "attachment_id: \"@A\" $counters"
seed session_named "attachment_id: \"@B\" $counters session_ids: \"@1\" session_ids: \"@0\""
seed session_other "attachment_id: \"@B\" $counters session_ids: \"@1\""
seed locked_token "attachment_id: \"@C\" $counters owner_token: \"@T\""
seed locked_session "attachment_id: \"@C\" $counters session_ids: \"@1\""
seed locked_wrong_token "attachment_id: \"@C\" $counters owner_token: \"not-the-token\""
seed no_progress "attachment_id: \"@D\" $counters session_ids: \"@0\""
seed near_miss "attachment_id: \"@A-\" $counters"
seed pool_map_session "attachment_id: \"@B\" kind: HANDOFF_KIND_POOL_MAP session_ids: \"@0\""
seed pool_map_no_session "attachment_id: \"@A\" kind: HANDOFF_KIND_POOL_MAP"
seed unknown_kind "attachment_id: \"@A\" kind: 7"
seed no_kind "attachment_id: \"@B\" session_ids: \"@0\""
: > "$out/empty"
seed over_limit "attachment_id: \"$(printf 'x%.0s' $(seq 1 4100))\" $counters"
printf '\xff\xff\xff\xff\x0f\x12\x05' > "$out/not_a_message"
echo "handoff_fuzz seeds: $(ls "$out" | wc -l) in $out"
