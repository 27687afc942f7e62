#!/usr/bin/env bash
# One device call for MoonEP (through benchmarks/device/run.sh, .whl carried). Each step has its own time cap
# (seconds, 0 skips), so a step that hangs costs only its cap; logs in $OUT/<step>.txt:
#   EP_LOCAL=s    one GPU: benchmarks.ep.local (planner chain before/after, local stores and reduction)
#   EP_TESTS=s    GPU tests: tests/moonep/test_kernels.py on CUDA (any GPU count), then with >= 2 GPUs
#                 test_gpu.py (exact dispatch/combine, async, NVLink, bf16 layer) and test_gpu_faults.py
#                 (NCCL stall/death -> CommError); EP_TESTS_K narrows with pytest -k
#   EP_BENCH=s    >= 2 GPUs: benchmarks.ep.run with EP_BENCH_ARGS (default: all rows, ~100 s on 2xH200)
#   EP_PROFILE=s  >= 2 GPUs: benchmarks.ep.profile (kernel times) with EP_PROFILE_ARGS (e.g. "--combine-path
#                 remote_only --preplanned" for the version-E path)
# A 2-GPU session, everything in one call (~5 min with compiles; the bench also times the version-E variants):
#   EP_TESTS=240 EP_BENCH=300 EP_PROFILE=60 bash benchmarks/device/run.sh bash benchmarks/ep/device_round.sh
set -u
OUT=${OUT:-/tmp/out}
export PYTHONUNBUFFERED=1
GPUS=$(python3 -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
echo "=== $GPUS GPU(s)"
step() {  # step NAME CAP CMD...
  local name=$1 cap=$2; shift 2
  [ "$cap" -gt 0 ] || return 0
  echo "=== $name (cap ${cap}s) $(date +%T)"
  timeout -k 5 "$cap" "$@" > "$OUT/$name.txt" 2>&1; echo "=== $name rc=$? $(date +%T)"
  tail -n 30 "$OUT/$name.txt"
}
step local "${EP_LOCAL:-0}" python3 -m benchmarks.ep.local
TESTS=(tests/moonep/test_kernels.py)
[ "$GPUS" -ge 2 ] && TESTS+=(tests/moonep/test_gpu.py tests/moonep/test_gpu_faults.py)
step gpu_tests "${EP_TESTS:-0}" python3 -m pytest -q -x -p no:cacheprovider --timeout 120 -k "${EP_TESTS_K:-}" "${TESTS[@]}"
if [ "$GPUS" -ge 2 ]; then
  # shellcheck disable=SC2086 # EP_BENCH_ARGS is a list of arguments
  step bench "${EP_BENCH:-0}" python3 -m benchmarks.ep.run ${EP_BENCH_ARGS:-}
  # shellcheck disable=SC2086 # EP_PROFILE_ARGS is a list of arguments
  step profile "${EP_PROFILE:-0}" python3 -m benchmarks.ep.profile --steps 3 --rows 25 ${EP_PROFILE_ARGS:-}
else
  echo "=== bench, profile: need 2 GPUs (found $GPUS): not run"
fi
