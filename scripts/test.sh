#!/usr/bin/env bash
# The whole test suite on a fresh machine: set up, build (warnings are
# errors), run every ctest label (gpu tests skip with a message where no GPU
# is usable), then the benchmark smoke runs. This is what CI runs (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
export CMAKE_ARGS="${CMAKE_ARGS:-} -DKVHOST_WERROR=ON -DKVHOST_BUILD_TESTS=ON -DKVHOST_BUILD_BENCH=ON"
scripts/setup.sh
BUILD_DIR=${BUILD_DIR:-build}

echo "== ctest (unit, integration, gpu)"
(cd "$BUILD_DIR" && ctest --output-on-failure -j2 --timeout 900)
