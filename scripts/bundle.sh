#!/usr/bin/env bash
# Packs the built binaries (daemon, CLI, tests, benchmarks) with every shared
# library they load from outside the C runtime into one folder, for a GPU
# machine that has the CUDA driver but not Debian's gRPC / Abseil / spdlog.
# Run there with:  LD_LIBRARY_PATH=$BUNDLE/lib $BUNDLE/bin/kvhostd ...
# Never bundled: the CUDA driver (libcuda, libnvidia-*: the machine's own must
# be used), and glibc / libstdc++ / libgcc_s, which every target has.
#   usage: scripts/bundle.sh [BUILD_DIR=build] [OUT=bundle]
# KVHOST_BUNDLE_GPU=1 keeps only what scripts/gpu_run.sh runs and also packs
# OUT into bundlez/OUT.tar.xz (git-ignored, ~14 MiB): the device tool carries
# at most 64 MiB of working tree, which the whole bundle passes. There:
#   tar -xJf bundlez/bundle.tar.xz && scripts/gpu_run.sh $R all
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
out=${2:-bundle}
gpu_only=${KVHOST_BUNDLE_GPU:-0}
gpu_bins=" kvhostd kvhostctl kvhost_session_worker kvhost_gpu_death_worker copy_plan_test
  layout_gpu_test cuda_engine_gpu_test worker_death_gpu_test worker_copy_gpu_test c_api_gpu_test
  cumem_gpu_test integration_test kinds_integration_test groups_integration_test
  kvhost_cuda_transfer_bench kvhost_rpc_bench kvhost_copy_engine_bench c_api_test "
gpu_bins=" $(tr -s ' \n' '  ' <<<"$gpu_bins") "
rm -rf "$out"
mkdir -p "$out/bin" "$out/lib"
for f in "$build"/bin/*; do
  [ -x "$f" ] && [ -f "$f" ] || continue
  [ "$gpu_only" = 1 ] && [[ "$gpu_bins" != *" $(basename "$f") "* ]] && continue
  cp "$f" "$out/bin/"
done
skip='^(linux-vdso|ld-linux|libc\.so|libm\.so|libdl\.so|libpthread\.so|librt\.so|libstdc\+\+\.so|libgcc_s\.so|libcuda\.so|libnvidia-)'
for f in "$out"/bin/*; do
  ldd "$f" | awk '/=> \//{print $1" "$3}' | while read -r name path; do
    echo "$name" | grep -Eq "$skip" && continue
    [ -e "$out/lib/$name" ] || cp -L "$path" "$out/lib/$name"
  done
done
# Debug info stays in the build; the bundle must be small enough to carry.
strip --strip-debug "$out"/bin/* "$out"/lib/* 2>/dev/null || true
echo "bundle: $(ls "$out/bin" | wc -l) binaries, $(ls "$out/lib" | wc -l) libraries, $(du -sh "$out" | cut -f1)"
if [ "$gpu_only" = 1 ]; then
  # c_api_test only brought libkvhost_c.so.1 along (the Python steps load it).
  rm -f "$out/bin/c_api_test"
  mkdir -p bundlez
  tar -cf - "$out" | xz -T2 -6 >"bundlez/$(basename "$out").tar.xz"
  echo "packed: bundlez/$(basename "$out").tar.xz, $(du -h "bundlez/$(basename "$out").tar.xz" | cut -f1)"
fi
