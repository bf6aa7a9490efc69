#!/usr/bin/env bash
# Soak and fault test (bench/soak.cc): builds kvhost_soak (and kvhostd) and
# runs it against its own kvhostd (host backend, --session-timeout=2s).
#
#   scripts/soak.sh [SECONDS] [JSON_OUT]     defaults: 60, soak.json
#
# Environment: BUILD_DIR (default build), SOAK_ARGS (extra flags, e.g.
# "--clients=8 --seed=7"), KVHOST_BUILD_LOCK (a flock file that serialises
# builds on a shared machine; empty: no lock), SOAK_BUILD=0 (run the binary
# as built, e.g. a copy in SOAK_BIN that later builds cannot replace while
# the run restarts its workers from it). Exit code: the soak's (0 only with
# no failure).
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_TO_RUN=${1:-60}
JSON_OUT=${2:-soak.json}
BUILD_DIR=${BUILD_DIR:-build}
LOCK=${KVHOST_BUILD_LOCK-/tmp/kv/build.lock}

SOAK_BIN=${SOAK_BIN:-$BUILD_DIR/bin/kvhost_soak}

build=(cmake --build "$BUILD_DIR" -j2 --target kvhost_soak)
if [[ "${SOAK_BUILD:-1}" == 0 ]]; then
  :
elif [[ -n "$LOCK" ]]; then
  mkdir -p "$(dirname "$LOCK")"
  flock "$LOCK" "${build[@]}"
else
  "${build[@]}"
fi

echo "== kvhost_soak for ${SECONDS_TO_RUN} s, JSON to ${JSON_OUT}"
# shellcheck disable=SC2086  # SOAK_ARGS is a list of flags
exec "$SOAK_BIN" --seconds="$SECONDS_TO_RUN" --clients=4 --workers=3 \
  --invalid-share=0.15 --kill-every=3 --session-timeout=2s --memory-limit=512M \
  --json="$JSON_OUT" ${SOAK_ARGS:-}
