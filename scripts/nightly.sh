#!/usr/bin/env bash
# The long checks CI leaves out, for a person or a nightly job (not CI: CI is
# scripts/test.sh). In order, each run whatever the one before found:
#   1. TSan (gcc, build-tsan) over the concurrency tests: scripts/sanitize.sh tsan;
#   2. every libFuzzer target for FUZZ_SECONDS (default 600) in the clang
#      ASan + UBSan build (build-asan): scripts/fuzz.sh;
#   3. the soak and fault test for SOAK_SECONDS (default 1800) against the main
#      build (build): scripts/soak.sh, its JSON in build/nightly-soak.json.
# Installs what is missing and builds first, as scripts/test.sh does. Prints
# one line per step with its time; exits 1 if any step failed.
set -euo pipefail
cd "$(dirname "$0")/.."
FUZZ_SECONDS=${FUZZ_SECONDS:-600}
SOAK_SECONDS=${SOAK_SECONDS:-1800}

CMAKE_ARGS="${CMAKE_ARGS:-} -DKVHOST_WERROR=ON -DKVHOST_BUILD_TESTS=ON -DKVHOST_BUILD_BENCH=ON" \
  EXTRA_PACKAGES="${EXTRA_PACKAGES:-} clang libclang-rt-14-dev" scripts/setup.sh

results=()
failed=0
step() {
  local name=$1 t0=$SECONDS rc=0
  shift
  echo "== nightly: $name"
  "$@" || rc=$?
  local line
  line=$(printf '%-8s %-6s %5d s' "$name" "$( ((rc == 0)) && echo ok || echo "FAILED($rc)")" \
    $((SECONDS - t0)))
  results+=("$line")
  ((rc == 0)) || failed=1
}

step tsan scripts/sanitize.sh tsan
step fuzz scripts/fuzz.sh --seconds "$FUZZ_SECONDS"
step soak scripts/soak.sh "$SOAK_SECONDS" "${BUILD_DIR:-build}/nightly-soak.json"

echo "== nightly summary"
printf '%s\n' "${results[@]}"
exit "$failed"
