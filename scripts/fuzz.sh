#!/usr/bin/env bash
# Runs each libFuzzer target (fuzz/) for a fixed time, seeded with the
# committed corpus fuzz/corpus/<target>/. The targets live in the clang
# ASan + UBSan build that also runs the sanitizer tests (build-asan/, made by
# scripts/sanitize.sh asan; this script builds just the fuzz targets there
# first). New inputs go to build-asan/corpus/<target>/, crash, leak, timeout
# and OOM inputs to build-asan/findings/<target>/.
#
# Usage: scripts/fuzz.sh [--seconds N] [--no-build] [target...]
#   N defaults to 30; targets default to all of them. --no-build runs what
#   build-asan/ holds. CI runs `scripts/fuzz.sh --seconds 20 --no-build` after
#   scripts/sanitize.sh asan; scripts/nightly.sh runs them longer. Needs
#   clang-14 and libclang-rt-14-dev. FUZZ_BUILD_DIR names another build dir.
# Prints one summary line per target; exits 1 if any target found anything
# (the input's path is in the output), 2 on a usage or build error.
set -euo pipefail
cd "$(dirname "$0")/.."

ALL_TARGETS=(spec_fuzz allocator_fuzz layout_fuzz service_fuzz transfer_fuzz handoff_fuzz fast_path_fuzz l3_record_fuzz cache_index_fuzz)
BUILD_DIR=${FUZZ_BUILD_DIR:-build-asan}
seconds=30
build=1
targets=()
while (($#)); do
  case "$1" in
    --seconds) seconds=${2:?--seconds needs a value}; shift 2 ;;
    --seconds=*) seconds=${1#*=}; shift ;;
    --no-build) build=0; shift ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    -*) echo "fuzz.sh: unknown option $1" >&2; exit 2 ;;
    *) targets+=("$1"); shift ;;
  esac
done
((${#targets[@]})) || targets=("${ALL_TARGETS[@]}")
for t in "${targets[@]}"; do
  [[ " ${ALL_TARGETS[*]} " == *" $t "* ]] || { echo "fuzz.sh: no target $t (${ALL_TARGETS[*]})" >&2; exit 2; }
done

mkdir -p "$BUILD_DIR"
if ((build)); then
  # sanitize.sh configures the build as its asan run does, so the two share
  # it, and builds under the shared machine's build lock.
  echo "== configure + build $BUILD_DIR (${targets[*]})"
  if ! BUILD_DIR="$BUILD_DIR" scripts/sanitize.sh asan --build-only "${targets[@]}" \
      > "$BUILD_DIR/fuzz-build.log" 2>&1; then
    tail -40 "$BUILD_DIR/fuzz-build.log"
    echo "fuzz.sh: build failed (full log: $BUILD_DIR/fuzz-build.log)" >&2
    exit 2
  fi
fi

# Any sanitizer report ends the run as a finding; UBSan's included.
export ASAN_OPTIONS=${ASAN_OPTIONS:-abort_on_error=1:detect_leaks=1:allocator_may_return_null=0}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:abort_on_error=1:print_stacktrace=1}

failed=0
summary=()
for t in "${targets[@]}"; do
  corpus="$BUILD_DIR/corpus/$t"
  findings="$BUILD_DIR/findings/$t"
  log="$BUILD_DIR/logs/$t.log"
  mkdir -p "$corpus" "$findings" "$(dirname "$log")"
  args=(-max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1
        -artifact_prefix="$findings/")
  [[ -f "fuzz/$t.dict" ]] && args+=(-dict="fuzz/$t.dict")
  if [[ $t == service_fuzz || $t == transfer_fuzz ]]; then
    # gRPC's threads free memory after an input returns, so libFuzzer would
    # run LeakSanitizer after every input (a third of the time); the entropic
    # schedule's bookkeeping takes half of the rest with gRPC's many features.
    args+=(-detect_leaks=0 -entropic=0)
  fi
  echo "== $t: ${seconds}s (log $log)"
  start=$(date +%s)
  rc=0
  "$BUILD_DIR/bin/$t" "${args[@]}" "$corpus" "fuzz/corpus/$t" > "$log" 2>&1 || rc=$?
  took=$(( $(date +%s) - start ))
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
  last=$(grep -aE '^#[0-9]+.*cov: ' "$log" | tail -1 || true)
  cov=$(sed -n 's/.*cov: \([0-9]*\).*/\1/p' <<<"$last")
  ft=$(sed -n 's/.* ft: \([0-9]*\).*/\1/p' <<<"$last")
  corp=$(sed -n 's/.* corp: \([0-9]*\/[0-9]*[a-zA-Z]*\).*/\1/p' <<<"$last")
  found=$(grep -ahoE 'Test unit written to [^ ]+' "$log" | awk '{print $NF}' || true)
  if ((rc != 0)) || [[ -n "$found" ]]; then
    failed=1
    echo "---- $t failed (exit $rc); the end of $log:"
    tail -60 "$log"
    result="FINDING (exit $rc): ${found:-see $log}"
  else
    result="no findings"
  fi
  line=$(printf '%-15s %4ss  execs %-10s exec/s %-7s cov %-6s ft %-7s corpus %-12s %s' \
    "$t" "$took" "${execs:-?}" "${rate:-?}" "${cov:-?}" "${ft:-?}" "${corp:-?}" "$result")
  echo "$line"
  summary+=("$line")
done

echo "== fuzz summary (${seconds}s per target)"
printf '%s\n' "${summary[@]}"
exit "$failed"
