#!/usr/bin/env bash
# clang-format (.clang-format: Google style, 100 columns) over kvhost's own
# C++ and CUDA sources: server/ client/ common/ kernels/ tests/ bench/ fuzz/
# tools/. Not formatted: the seed sources (seeds/), build and bundle output,
# generated protobuf code (it lives in the build dirs).
#
# Usage: scripts/format.sh [--check] [file...]
#   default    formats the files in place;
#   --check    changes nothing; lists each file clang-format would change
#              (with the number of lines) and exits 1 if there is one. CI runs
#              this first (scripts/test.sh).
#   file...    only these files (default: all of the above).
# The style is defined by Debian 12's clang-format 14: CLANG_FORMAT names
# another binary; another major version may format some lines differently.
set -euo pipefail
cd "$(dirname "$0")/.."

DIRS=(server client common kernels tests bench fuzz tools)
check=0
files=()
while (($#)); do
  case "$1" in
    --check) check=1; shift ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    -*) echo "format.sh: unknown option $1" >&2; exit 2 ;;
    *) files+=("$1"); shift ;;
  esac
done

cf=${CLANG_FORMAT:-}
if [[ -z "$cf" ]]; then
  cf=$(command -v clang-format-14 || command -v clang-format || true)
fi
if [[ -z "$cf" ]]; then
  echo "format.sh: no clang-format (apt-get install clang-format-14)" >&2
  exit 2
fi
version=$("$cf" --version | sed -nE 's/.*version ([0-9]+)\..*/\1/p')
if [[ "$version" != 14 ]]; then
  echo "format.sh: warning: $cf is version ${version:-unknown}; the style is checked with 14" >&2
fi

if ((${#files[@]} == 0)); then
  existing=()
  for d in "${DIRS[@]}"; do [[ -d "$d" ]] && existing+=("$d"); done
  mapfile -t files < <(find "${existing[@]}" -type f \
    \( -name '*.cc' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' -o -name '*.cpp' \) \
    -not -path '*/seeds/*' -not -path '*/build*/*' -not -path '*/bundle*/*' \
    -not -name '*.pb.h' -not -name '*.pb.cc' | LC_ALL=C sort)
fi

if ((!check)); then
  "$cf" -i --style=file "${files[@]}"
  echo "== format: ${#files[@]} files formatted with $cf"
  exit 0
fi

differ=0
for f in "${files[@]}"; do
  n=$("$cf" --style=file "$f" | diff "$f" - | grep -c '^[<>]' || true)
  if ((n)); then
    echo "  $f ($n lines)"
    differ=$((differ + 1))
  fi
done
if ((differ)); then
  echo "== format check: $differ of ${#files[@]} files differ from .clang-format;" \
    "scripts/format.sh formats them (diff: $cf --style=file FILE | diff FILE -)"
  exit 1
fi
echo "== format check: ${#files[@]} files clean"
