#!/usr/bin/env bash
# Package test: install kvhost from a build tree into a private prefix, build
# tests/consumer (find_package(kvhost) + kvhost::client, and kvhost::c from
# C) against that prefix alone, and run it against a kvhostd on a private
# socket. Checks that the installed headers, include dirs and find_dependency
# list are complete, and that kvhostd exits 0 on SIGTERM.
#
#   package_test.sh BUILD_DIR CONSUMER_SOURCE_DIR
set -euo pipefail

if [[ $# -ne 2 ]]; then
  echo "usage: $0 BUILD_DIR CONSUMER_SOURCE_DIR" >&2
  exit 2
fi
build_dir=$(cd "$1" && pwd)
consumer_src=$(cd "$2" && pwd)
kvhostd="$build_dir/bin/kvhostd"

tmp=$(mktemp -d /tmp/kvhost-package-test-XXXXXX)
shm=$(mktemp -d /dev/shm/kvhost-package-test-XXXXXX)
daemon_pid=""
cleanup() {
  if [[ -n "$daemon_pid" ]] && kill -0 "$daemon_pid" 2>/dev/null; then
    kill -KILL "$daemon_pid" 2>/dev/null || true
    wait "$daemon_pid" 2>/dev/null || true
  fi
  rm -rf "$tmp" "$shm"
}
trap cleanup EXIT

fail() {
  echo "package_test: FAIL: $*" >&2
  if [[ -f "$tmp/kvhostd.log" ]]; then
    echo "--- kvhostd log ---" >&2
    tail -n 50 "$tmp/kvhostd.log" >&2
  fi
  exit 1
}

echo "== install $build_dir -> $tmp/prefix"
cmake --install "$build_dir" --prefix "$tmp/prefix" >"$tmp/install.log" 2>&1 ||
  { cat "$tmp/install.log" >&2; fail "cmake --install"; }

echo "== configure and build the consumer"
cmake -S "$consumer_src" -B "$tmp/consumer-build" -DCMAKE_PREFIX_PATH="$tmp/prefix" \
  -DCMAKE_BUILD_TYPE=Release >"$tmp/configure.log" 2>&1 ||
  { cat "$tmp/configure.log" >&2; fail "configuring the consumer against the installed package"; }
cmake --build "$tmp/consumer-build" -j 2 >"$tmp/build.log" 2>&1 ||
  { cat "$tmp/build.log" >&2; fail "building the consumer against the installed package"; }
found=$(sed -n 's/^kvhost_DIR:PATH=//p' "$tmp/consumer-build/CMakeCache.txt")
[[ "$found" == "$tmp/prefix/"* ]] || fail "the consumer found kvhost at '$found', not in $tmp/prefix"
app="$tmp/consumer-build/app"
[[ -x "$app" ]] || fail "no consumer binary at $app"

echo "== start kvhostd"
sock="$tmp/s.sock"
"$kvhostd" --listen="unix://$sock" --shm-dir="$shm" --backend=host >"$tmp/kvhostd.log" 2>&1 &
daemon_pid=$!
for _ in $(seq 1 300); do
  [[ -S "$sock" ]] && break
  kill -0 "$daemon_pid" 2>/dev/null || fail "kvhostd exited before listening"
  sleep 0.1
done
[[ -S "$sock" ]] || fail "kvhostd did not create $sock within 30 s"

echo "== run the consumer"
out=""
ok=0
# The socket exists once kvhostd binds it; allow a moment for it to serve.
for _ in $(seq 1 50); do
  if out=$("$app" "unix://$sock" 2>"$tmp/app.err"); then
    ok=1
    break
  fi
  sleep 0.1
done
[[ $ok -eq 1 ]] || { cat "$tmp/app.err" >&2; fail "consumer failed against kvhostd"; }
echo "consumer: $out"
[[ "$out" == "pools: 0" ]] || fail "consumer printed '$out', want 'pools: 0'"

echo "== run the C consumer (kvhost::c, libkvhost_c.so)"
c_out=$("$tmp/consumer-build/c_app" "unix://$sock" 2>"$tmp/c_app.err") ||
  { cat "$tmp/c_app.err" >&2; fail "the C consumer failed against kvhostd"; }
echo "C consumer: $c_out"
[[ "$c_out" == 'c abi 1: {"pools":[]}' ]] || fail "C consumer printed '$c_out'"

cuda_app="$tmp/consumer-build/cuda_app"
# The installed config says whether the package was built with CUDA.
if grep -q "^if(ON)" "$tmp"/prefix/lib*/cmake/kvhost/kvhostConfig.cmake; then
  echo "== run the CUDA consumer (kvhost::cuda_client)"
  [[ -x "$cuda_app" ]] || fail "the package has CUDA but kvhost::cuda_client did not build cuda_app"
  cuda_out=$("$cuda_app") || fail "cuda_app: $cuda_out"
  echo "$cuda_out"
  [[ "$cuda_out" == *"only the cuda backend creates them"* ]] || fail "cuda_app printed '$cuda_out'"
else
  echo "== package built without CUDA: no kvhost::cuda_client to check"
fi

echo "== a CPU-only consumer: kvhost::client without any CUDA toolkit"
# CMAKE_DISABLE_FIND_PACKAGE_CUDAToolkit makes find_package(CUDAToolkit)
# fail, as on a scheduler host without CUDA.
cmake -S "$consumer_src" -B "$tmp/cpu-consumer-build" -DCMAKE_PREFIX_PATH="$tmp/prefix" \
  -DCMAKE_DISABLE_FIND_PACKAGE_CUDAToolkit=ON -DCMAKE_BUILD_TYPE=Release \
  >"$tmp/cpu-configure.log" 2>&1 ||
  { cat "$tmp/cpu-configure.log" >&2; fail "configuring a consumer without the CUDA toolkit"; }
cmake --build "$tmp/cpu-consumer-build" -j 2 --target app >"$tmp/cpu-build.log" 2>&1 ||
  { cat "$tmp/cpu-build.log" >&2; fail "building kvhost::client without the CUDA toolkit"; }
cpu_out=$("$tmp/cpu-consumer-build/app" "unix://$sock" 2>"$tmp/cpu-app.err") ||
  { cat "$tmp/cpu-app.err" >&2; fail "the CPU-only consumer failed against kvhostd"; }
[[ "$cpu_out" == "pools: 0" ]] || fail "CPU-only consumer printed '$cpu_out', want 'pools: 0'"
echo "CPU-only consumer: $cpu_out"

echo "== stop kvhostd with SIGTERM"
kill -TERM "$daemon_pid"
rc=0
wait "$daemon_pid" || rc=$?
daemon_pid=""
[[ $rc -eq 0 ]] || fail "kvhostd exited with status $rc after SIGTERM, want 0"

echo "package_test: PASS"
