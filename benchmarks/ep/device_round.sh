#!/usr/bin/env bash
# One device call for MoonEP (through benchmarks/device/run.sh, .whl carried): GPU tests, the benchmark rows,
# then a kernel profile. Each step has its own time cap (seconds, 0 skips), so a step that hangs costs its cap:
#   EP_TESTS=s EP_BENCH=s EP_PROFILE=s, and EP_BENCH_ARGS for benchmarks.ep.run (default: all rows).
set -u
OUT=${OUT:-/tmp/out}
export PYTHONUNBUFFERED=1
step() {  # step NAME CAP CMD...
  local name=$1 cap=$2; shift 2
  [ "$cap" -gt 0 ] || return 0
  echo "=== $name (cap ${cap}s) $(date +%T)"
  timeout -k 5 "$cap" "$@" > "$OUT/$name.txt" 2>&1; echo "=== $name rc=$? $(date +%T)"
  tail -n 30 "$OUT/$name.txt"
}
step gpu_tests "${EP_TESTS:-0}" python3 -m pytest -q -x -p no:cacheprovider --timeout 120 \
  tests/moonep/test_gpu.py tests/moonep/test_kernels.py
# shellcheck disable=SC2086 # EP_BENCH_ARGS is a list of arguments
step bench "${EP_BENCH:-0}" python3 -m benchmarks.ep.run ${EP_BENCH_ARGS:-}
step profile "${EP_PROFILE:-0}" python3 -m benchmarks.ep.profile --steps 3 --rows 25
