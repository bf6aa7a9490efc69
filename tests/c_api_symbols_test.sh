#!/usr/bin/env bash
# libkvhost_c.so exports the C ABI and nothing else: every defined dynamic
# symbol is a kvhost_* function the header declares, and every function the
# header declares is exported. The static client, the proto code and the
# CUDA helpers inside stay hidden (c_api.map), so they clash with nothing
# in the process that loads the library.
#
#   c_api_symbols_test.sh LIBKVHOST_C.so kvhost_c.h
set -euo pipefail
lib=$1
header=$2

exported=$(nm -D --defined-only "$lib" | awk '$2 ~ /^[TWDBRV]$/ {print $3}' | sed 's/@.*//' | sort -u)
declared=$(grep -oE 'KVHOST_C_API [^(]*\bkvhost_[a-z0-9_]+\(' "$header" |
  grep -oE 'kvhost_[a-z0-9_]+\($' | tr -d '(' | sort -u)

fail=0
leaked=$(comm -23 <(echo "$exported") <(echo "$declared"))
if [[ -n "$leaked" ]]; then
  echo "FAIL: $lib exports symbols the header does not declare:"
  echo "$leaked" | head -n 40
  fail=1
fi
missing=$(comm -13 <(echo "$exported") <(echo "$declared"))
if [[ -n "$missing" ]]; then
  echo "FAIL: $lib lacks functions the header declares:"
  echo "$missing"
  fail=1
fi
[[ $fail -eq 0 ]] || exit 1
echo "PASS: $(echo "$declared" | wc -l) kvhost_* functions exported, nothing else"
