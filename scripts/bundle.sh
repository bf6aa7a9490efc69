#!/usr/bin/env bash
# Packs the built binaries (daemon, CLI, tests, benchmarks) with every shared
# library they load from outside the C runtime into one folder, for a GPU
# machine that has the CUDA driver but not Debian's gRPC / Abseil / spdlog.
# Run there with:  LD_LIBRARY_PATH=$BUNDLE/lib $BUNDLE/bin/kvhostd ...
# Never bundled: the CUDA driver (libcuda, libnvidia-*: the machine's own must
# be used), and glibc / libstdc++ / libgcc_s, which every target has.
#   usage: scripts/bundle.sh [BUILD_DIR=build] [OUT=bundle]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
out=${2:-bundle}
rm -rf "$out"
mkdir -p "$out/bin" "$out/lib"
for f in "$build"/bin/*; do
  [ -x "$f" ] && [ -f "$f" ] && cp "$f" "$out/bin/"
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
