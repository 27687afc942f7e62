#!/usr/bin/env bash
# The last device call of a session on nvidia-h200-x2 (through benchmarks/device/run.sh, .whl carried): the FlashKDA
# forward rows on GPU 0 and the training rows on GPU 1 at the same time (separate processes, separate GPUs, so
# neither times the other's kernels; compiles run on separate CPU cores), then the MoonEP benchmark on both GPUs.
# Caps (seconds) and cases come from the environment: FWD_CAP, FWD_CASES, TRAIN_CAP, TRAIN_CASES, TRAIN_STEPS,
# EP_CAP, EP_ARGS. The parts' logs are collected in $OUT/parts.log; results JSONs are collected by run.sh.
set -u
OUT=${OUT:-/tmp/out}
export PYTHONUNBUFFERED=1 TRITON_CACHE_AUTOTUNING=1
part() {  # part NAME GPUS CAP CMD...
  local name=$1 gpus=$2 cap=$3; shift 3
  [ "$cap" -gt 0 ] || return 0
  echo "=== $name on GPU $gpus (cap ${cap}s) $(date +%T)"
  CUDA_VISIBLE_DEVICES=$gpus timeout -k 5 "$cap" "$@" > "/tmp/$name.log" 2>&1
  echo "=== $name rc=$? $(date +%T)"
  { echo "=== $name"; cat "/tmp/$name.log"; } >> "$OUT/parts.log"  # one file: $OUT returns at most 8
}
part fwd 0 "${FWD_CAP:-0}" python3 -m benchmarks.kda.run --rep 10 ${FWD_CASES:+--cases $FWD_CASES} &
sleep 2  # results files are named by the second a benchmark starts
part train 1 "${TRAIN_CAP:-0}" python3 -m benchmarks.kda.train --rep 5 --steps "${TRAIN_STEPS:-0}" \
  ${TRAIN_CASES:+--cases $TRAIN_CASES} &
wait
part ep 0,1 "${EP_CAP:-0}" python3 -m benchmarks.ep.run ${EP_ARGS:-}
for f in fwd train ep; do [ -f "/tmp/$f.log" ] && { echo "--- $f"; tail -n 25 "/tmp/$f.log"; }; done
exit 0
