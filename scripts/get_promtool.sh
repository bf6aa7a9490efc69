#!/usr/bin/env bash
# Puts promtool (Prometheus's linter, for tests/metrics_promtool_test.sh) in
# DIR/promtool, extracted alone from Debian's package prometheus: installing
# the package would start a Prometheus server too. Nothing to do when DIR
# already has it or promtool is on PATH. A failed download is not an error
# (the test is then skipped, saying so).
#   scripts/get_promtool.sh DIR
set -euo pipefail
dir=${1:?usage: $0 DIR}
if command -v promtool >/dev/null || [ -x "$dir/promtool" ]; then exit 0; fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
download() { (cd "$tmp" && apt-get download prometheus >/dev/null 2>&1); }
if ! download && ! { apt-get update -qq >/dev/null 2>&1 && download; }; then
  echo "promtool: could not download Debian's prometheus package; metrics_promtool will skip"
  exit 0
fi
dpkg -x "$tmp"/prometheus_*.deb "$tmp/x"
mkdir -p "$dir"
install -m 0755 "$tmp/x/usr/bin/promtool" "$dir/promtool"
echo "promtool: $dir/promtool"
