#!/usr/bin/env bash
# The whole test suite on a fresh machine: set up, build (warnings are
# errors), run every ctest label (gpu tests skip with a message where no GPU
# is usable; soak_smoke is the 60-second soak and fault run), then the
# sanitizer runs (ASan + UBSan over unit + integration, TSan over the
# concurrency tests) and a short libFuzzer run of every fuzz target. This is
# what CI runs (.ci/run). SKIP_SANITIZERS=1 / SKIP_FUZZ=1 leave those out.
set -euo pipefail
cd "$(dirname "$0")/.."
# clang and its libFuzzer runtime for scripts/fuzz.sh. The build options are
# this build's only (sanitize.sh and fuzz.sh choose their own).
CMAKE_ARGS="${CMAKE_ARGS:-} -DKVHOST_WERROR=ON -DKVHOST_BUILD_TESTS=ON -DKVHOST_BUILD_BENCH=ON" \
  EXTRA_PACKAGES="${EXTRA_PACKAGES:-} clang libclang-rt-14-dev" scripts/setup.sh
BUILD_DIR=${BUILD_DIR:-build}
start=$SECONDS

echo "== ctest (unit, integration, gpu, concurrency, soak smoke)"
(cd "$BUILD_DIR" && ctest --output-on-failure -j2 --timeout 900)
echo "== ctest done after $((SECONDS - start)) s"

if [ "${SKIP_SANITIZERS:-0}" != 1 ]; then
  echo "== sanitizers: ASan + UBSan (unit, integration, concurrency)"
  scripts/sanitize.sh asan
  echo "== sanitizers: TSan (concurrency)"
  scripts/sanitize.sh tsan
  echo "== sanitizers done after $((SECONDS - start)) s"
fi
if [ "${SKIP_FUZZ:-0}" != 1 ]; then
  echo "== fuzz smoke: every target for 20 s"
  scripts/fuzz.sh --seconds 20
fi
echo "== all tests passed after $((SECONDS - start)) s"
