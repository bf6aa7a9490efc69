#!/usr/bin/env bash
# The whole test suite on a fresh machine. This is what CI runs (.ci/run), in
# order, stopping at the first failure:
#   install   the Debian packages missing (scripts/setup.sh --install-only);
#   promtool  Prometheus's linter, for the metrics_promtool test
#             (scripts/get_promtool.sh: extracted alone into build/tools);
#   format    scripts/format.sh --check (clang-format 14), first so a
#             formatting slip fails in seconds;
#   rooms     scripts/room_check.py --strict: fails on a file over 800 lines or a
#             function over 100 lines in server/ client/ common/ that carries
#             no written reason ("Size exception:" at the top of its file);
#             then scripts/module_tests.py --strict: a module without a test
#             file of its own fails unless scripts/modules_without_tests.txt
#             lists it (the list only shrinks);
#   engines   the venv of the pinned sglang and torch the Python engine tests
#             run in (scripts/engine_venv.sh; cached outside the clone, so 0 s
#             once built); the tests fail, not skip, without it;
#   python lint  ruff and mypy (strict) on the Python package, from that
#             venv (python/pyproject.toml configures both);
#   build gcc the main build (gcc, RelWithDebInfo, warnings are errors, CUDA
#             code compiled where nvcc is found);
#   tidy      clang-tidy 14 with .clang-tidy's small check set on server/,
#             client/ and common/ (scripts/tidy.sh); a finding fails;
#   ctest     every ctest label there: unit, integration, gpu (skipped with a
#             message where no GPU is usable), concurrency, and soak_smoke, the
#             60-second soak and fault run;
#   build clang  one clang build with ASan + UBSan and libFuzzer coverage
#             (warnings are errors) holding the tests and the fuzz targets
#             (scripts/sanitize.sh asan --build-only);
#   sanitizers   its unit, integration and concurrency tests (scripts/sanitize.sh asan);
#   fuzz      20 s of each libFuzzer target from that build (scripts/fuzz.sh).
# TSan, long fuzz runs and the long soak are not in CI: scripts/nightly.sh runs
# them. Prints each phase's time at the end (also after a failure).
# SKIP_FORMAT=1 / SKIP_SANITIZERS=1 / SKIP_FUZZ=1 leave those phases out.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
start=$SECONDS

phases=()
report() {
  echo "== phase times (total $((SECONDS - start)) s):"
  ((${#phases[@]})) && printf '   %s\n' "${phases[@]}"
}
trap report EXIT
# phase NAME COMMAND...: runs COMMAND, records its time, stops at a failure.
phase() {
  local name=$1 t0=$SECONDS rc=0
  shift
  echo "== $name"
  "$@" || rc=$?
  phases+=("$(printf '%-12s %5d s%s' "$name" $((SECONDS - t0)) "$( ((rc == 0)) || echo "  FAILED (exit $rc)")")")
  ((rc == 0)) || exit "$rc"
}
rooms() {
  # && not a new line: phase runs this in a || list, where set -e is off.
  python3 scripts/room_check.py --strict && python3 scripts/module_tests.py --strict
}
python_lint() {
  local py
  py=$(scripts/engine_venv.sh --print)
  (cd python && "$py" -m ruff check . && "$py" -m mypy)
}
main_ctest() {
  (cd "$BUILD_DIR" && ctest --output-on-failure -j2 --timeout 900)
}

# clang with its sanitizer and libFuzzer runtimes, and clang-format, besides
# what the main build needs. The build options are the main build's only
# (sanitize.sh chooses its own).
export EXTRA_PACKAGES="${EXTRA_PACKAGES:-} clang libclang-rt-14-dev clang-format-14 clang-tidy-14"
phase install scripts/setup.sh --install-only
phase promtool scripts/get_promtool.sh "$BUILD_DIR/tools"
[[ "${SKIP_FORMAT:-0}" == 1 ]] || phase format scripts/format.sh --check
phase rooms rooms
phase engines scripts/engine_venv.sh
phase "python lint" python_lint
export KVHOST_REQUIRE_ENGINES=1
CMAKE_ARGS="${CMAKE_ARGS:-} -DKVHOST_WERROR=ON -DKVHOST_BUILD_TESTS=ON -DKVHOST_BUILD_BENCH=ON" \
  phase "build gcc" scripts/setup.sh
phase tidy scripts/tidy.sh "$BUILD_DIR"
phase ctest main_ctest

# The clang build's dir: ASAN_BUILD_DIR, not BUILD_DIR (the main build's).
export FUZZ_BUILD_DIR=${ASAN_BUILD_DIR:-build-asan}
fuzz_args=(--seconds 20)
if [[ "${SKIP_SANITIZERS:-0}" != 1 ]]; then
  BUILD_DIR=$FUZZ_BUILD_DIR phase "build clang" scripts/sanitize.sh asan --build-only
  BUILD_DIR=$FUZZ_BUILD_DIR phase sanitizers scripts/sanitize.sh asan --no-build
  fuzz_args+=(--no-build)
fi
[[ "${SKIP_FUZZ:-0}" == 1 ]] || phase fuzz scripts/fuzz.sh "${fuzz_args[@]}"
echo "== all tests passed after $((SECONDS - start)) s"
