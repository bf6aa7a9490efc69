#!/usr/bin/env bash
# Sanitizer builds and runs:
#   scripts/sanitize.sh asan   clang build in build-asan: kvhost's own code with ASan + UBSan
#                              and libFuzzer coverage (-DKVHOST_FUZZ=ON), the tests and the
#                              fuzz targets (scripts/fuzz.sh runs those); then
#                              ctest -L 'unit|integration|concurrency'. CI runs this.
#   scripts/sanitize.sh tsan   gcc TSan build in build-tsan; ctest -L concurrency. Not in CI:
#                              scripts/nightly.sh runs it.
# Options after the mode: --build-only (configure and build, run nothing),
# --no-build (run what the build dir holds); with --build-only, target names
# build just those (scripts/fuzz.sh builds only its fuzz targets this way).
# Only kvhost's own code is instrumented (KVHOST_SANITIZE; Debian's gRPC,
# protobuf and abseil are not), so the TSan run is limited to the concurrency
# tests, which use no gRPC. Every sanitizer report fails its test: the
# runtimes abort on the first report, and tests/daemon_fixture.h fails a test
# whose kvhostd logged one. Prints one summary line at the end; exits non-zero
# when a test failed or a report was seen.
#
#   BUILD_DIR (default build-asan / build-tsan), JOBS (default 2),
#   KVHOST_BUILD_LOCK (default /tmp/kv/build.lock: builds on a shared machine
#   take turns through it), CMAKE_ARGS (extra configure arguments).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

mode=${1:-}
shift || true
build=1 run=1 only=()
while (($#)); do
  case "$1" in
    --build-only) run=0; shift ;;
    --no-build) build=0; shift ;;
    -*) echo "sanitize.sh: unknown option $1" >&2; exit 2 ;;
    *) only+=("$1"); shift ;;
  esac
done
case "$mode" in
  asan)
    sanitize=address,undefined,fuzzer-no-link
    labels='unit|integration|concurrency'
    # package_consumer links an outside project against the installed
    # kvhost_client; built here it carries ASan calls the consumer's
    # un-sanitized link cannot resolve. It checks packaging, not memory.
    exclude='^package_consumer$'
    # The fuzz targets are listed once, in fuzz.sh.
    read -r -a fuzzers < <(sed -n 's/^ALL_TARGETS=(\(.*\))$/\1/p' scripts/fuzz.sh)
    ((${#fuzzers[@]})) || { echo "sanitize.sh: no ALL_TARGETS in scripts/fuzz.sh" >&2; exit 2; }
    targets=(kvhostd kvhostctl kvhost_tests_unit kvhost_tests_integration kvhost_tests_concurrency
             "${fuzzers[@]}")
    # libFuzzer comes with clang only; the fuzz targets need it, and one
    # compiler for the tests and the fuzzers makes this a single build.
    compilers=(CC=clang CXX=clang++)
    mode_args=(-DKVHOST_FUZZ=ON)
    ;;
  tsan)
    sanitize=thread
    labels='concurrency'
    exclude=''
    targets=(kvhost_tests_concurrency)
    compilers=()
    mode_args=()
    ;;
  *)
    echo "usage: $0 asan|tsan [--build-only [target...] | --no-build]" >&2
    exit 2
    ;;
esac
((${#only[@]})) && targets=("${only[@]}")

build_dir=${BUILD_DIR:-build-$mode}
jobs=${JOBS:-2}
lock=${KVHOST_BUILD_LOCK:-/tmp/kv/build.lock}
mkdir -p "$(dirname "$lock")"
# Paths relative to the clone, so a second clone (CI) hits the same cache.
export CCACHE_BASEDIR="$root"

# -O1 -g1: a third less compile time than RelWithDebInfo's -O2 -g, line
# numbers in every stack trace. UBSan findings are fatal at compile time too,
# not only through UBSAN_OPTIONS.
start=$(date +%s)
if ((build)); then
  echo "== configuring $build_dir (-fsanitize=$sanitize)"
  # CMAKE_ARGS first: the settings this run needs come after it and win. The
  # compiler (CC/CXX) counts only when the build dir is new.
  # shellcheck disable=SC2086
  env "${compilers[@]}" cmake -S . -B "$build_dir" ${CMAKE_ARGS:-} -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1" -DCMAKE_CXX_FLAGS="-fno-sanitize-recover=undefined" \
    -DKVHOST_SANITIZE="$sanitize" "${mode_args[@]}" -DKVHOST_WITH_CUDA=OFF -DKVHOST_BUILD_BENCH=OFF \
    -DKVHOST_BUILD_TESTS=ON -DKVHOST_WERROR=ON >/dev/null
  echo "== building ${targets[*]} with -j$jobs (lock $lock)"
  flock "$lock" cmake --build "$build_dir" -j"$jobs" --target "${targets[@]}"
fi
built=$(date +%s)
((run)) || exit 0

# A report ends the process that made it (abort: its test fails, a daemon's
# fixture sees it). LeakSanitizer stays on: kvhost's processes leak nothing
# that is not suppressed, with the reason, in tools/sanitizers/lsan.supp.
common="halt_on_error=1:abort_on_error=1:print_stacktrace=1"
export ASAN_OPTIONS="$common:detect_leaks=1:check_initialization_order=1"
export UBSAN_OPTIONS="$common"
export LSAN_OPTIONS="suppressions=$root/tools/sanitizers/lsan.supp:print_suppressions=0"
export TSAN_OPTIONS="$common:second_deadlock_stack=1"

echo "== ctest -L '$labels' in $build_dir"
ctest_args=(--output-on-failure -j"$jobs" --timeout 900 --no-tests=error -L "$labels")
[[ -n "$exclude" ]] && ctest_args+=(-E "$exclude")
set +e
(cd "$build_dir" && ctest "${ctest_args[@]}") 2>&1 | tee "$build_dir/ctest.out"
rc=${PIPESTATUS[0]}
set -e
done_at=$(date +%s)

log="$build_dir/Testing/Temporary/LastTest.log"
run=0 failed=0 reports=0
# ctest's own count ("N tests failed out of M") includes tests that could not run.
if summary=$(grep -aE '[0-9]+ tests failed out of [0-9]+' "$build_dir/ctest.out" | tail -1); then
  failed=$(sed -E 's/.* ([0-9]+) tests failed out of ([0-9]+).*/\1/' <<<"$summary")
  run=$(sed -E 's/.* tests failed out of ([0-9]+).*/\1/' <<<"$summary")
fi
if [[ -f "$log" ]]; then
  reports=$(grep -cE 'ERROR: (AddressSanitizer|LeakSanitizer)|WARNING: ThreadSanitizer|runtime error: ' \
    "$log" || true)
fi
echo "== sanitize $mode: tests run $run, failed $failed, sanitizer reports $reports," \
  "build $((built - start)) s, tests $((done_at - built)) s"
if ((rc != 0 || reports != 0)); then
  exit 1
fi
