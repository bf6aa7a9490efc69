#!/usr/bin/env bash
# Installs what kvhost needs on Debian 12 (when missing), then configures and
# builds it in ./build with ccache. Used by scripts/demo.sh, scripts/test.sh
# and scripts/nightly.sh.
#   scripts/setup.sh [--install-only]   --install-only: the packages, no build
#   BUILD_DIR (default build), BUILD_TYPE (default RelWithDebInfo), JOBS (default 2),
#   CMAKE_ARGS (extra configure arguments), EXTRA_PACKAGES (more Debian packages),
#   TARGETS (what to build, space-separated; default: everything).
set -euo pipefail
cd "$(dirname "$0")/.."
install_only=0
case "${1:-}" in
  --install-only) install_only=1 ;;
  "") ;;
  *) echo "usage: $0 [--install-only]" >&2; exit 2 ;;
esac

PACKAGES=(build-essential cmake pkg-config ccache git
          libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler grpc-proto
          libabsl-dev libspdlog-dev libfmt-dev libgtest-dev libgmock-dev
          libsystemd-dev systemd python3 python3-yaml libyaml-cpp-dev openssl
          libmicrohttpd-dev memcached libmemcached-dev libssl-dev)
# scripts/test.sh adds clang, its sanitizer and libFuzzer runtimes,
# clang-format and clang-tidy (EXTRA_PACKAGES).
# shellcheck disable=SC2206
PACKAGES+=(${EXTRA_PACKAGES:-})
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "== installing: ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

((install_only)) && exit 0

BUILD_DIR=${BUILD_DIR:-build}
JOBS=${JOBS:-2}
# Paths relative to the clone, so a second clone (CI) hits the same cache.
export CCACHE_BASEDIR="$PWD"
echo "== configuring $BUILD_DIR"
# shellcheck disable=SC2086
cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE="${BUILD_TYPE:-RelWithDebInfo}" ${CMAKE_ARGS:-} >/dev/null
echo "== building ${TARGETS:-everything} with -j$JOBS"
# shellcheck disable=SC2086
cmake --build "$BUILD_DIR" -j"$JOBS" ${TARGETS:+--target $TARGETS}
