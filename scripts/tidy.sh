#!/usr/bin/env bash
# clang-tidy 14 with the project's checks (.clang-tidy names each and why)
# over the project's own C++ translation units: server/, client/ and common/
# (not the tests, the generated protobuf code or CUDA .cu files), compiled as
# BUILD_DIR's compile_commands.json says. Any finding fails (exit 1), with
# its file, line and check; about 4 minutes on 2 cores.
#   usage: scripts/tidy.sh [BUILD_DIR=build]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
tidy=$(command -v clang-tidy-14 || command -v clang-tidy || true)
if [[ -z "$tidy" ]]; then
  echo "tidy: clang-tidy is not installed (scripts/setup.sh installs clang-tidy-14)" >&2
  exit 1
fi
if [[ ! -f "$build/compile_commands.json" ]]; then
  echo "tidy: no $build/compile_commands.json; build first (scripts/setup.sh)" >&2
  exit 1
fi
mapfile -t files < <(python3 - "$build/compile_commands.json" "$PWD" <<'PY'
import json, os, sys
root = sys.argv[2]
seen = set()
for entry in json.load(open(sys.argv[1])):
    path = os.path.realpath(os.path.join(entry["directory"], entry["file"]))
    rel = os.path.relpath(path, root)
    if rel.split(os.sep)[0] in ("server", "client", "common") and rel.endswith(".cc") \
            and rel not in seen:
        seen.add(rel)
        print(rel)
PY
)
echo "tidy: ${#files[@]} translation units, $(nproc) at a time"
log=$(mktemp)
trap 'rm -f "$log"' EXIT
if ! printf '%s\n' "${files[@]}" |
    xargs -P "$(nproc)" -n 4 "$tidy" -p "$build" --quiet >"$log" 2>&1; then
  grep -E "(warning|error):" "$log" | sort -u
  echo "tidy: findings above (.clang-tidy says what each check guards against)" >&2
  exit 1
fi
echo "tidy: clean"
