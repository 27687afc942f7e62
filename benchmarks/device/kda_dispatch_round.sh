#!/usr/bin/env bash
# One device call of the dispatch work, run through benchmarks/device/run.sh (wheels, PYTHONPATH, $OUT/log.txt):
#   bash benchmarks/device/run.sh bash benchmarks/device/kda_dispatch_round.sh STEP...
# with carry [".whl", ".k3_commit", ".thirdparty"]. Steps, in the order given:
#   cutlass      build MoonshotAI's CUTLASS FlashKDA from .thirdparty/FlashKDA (its source at the pinned commit and
#                CUTLASS headers, git-ignored, never committed) unless a built flash_kda_C*.so was carried; the .so
#                goes to $OUT gzipped (the raw .so is over the size that comes back); put it in .thirdparty/FlashKDA/
#                and the next call unpacks it instead of building
#   decode       decode tokens/s vs fla (benchmarks/kda/decode.py)
#   cal-inf      calibration, inference rows (benchmarks/kda/calibrate.py --modes inference)
#   cal-train    calibration, training rows (the fla-autotune cache covers the H64/H32 rows)
#   dispatch     fla chunk_kda with the hook on vs off, inference rows (benchmarks/kda/dispatch_bench.py)
#   warm-train   one untimed training call of fla per dispatch row, in background processes (fla autotunes per
#                shape); give `wait` right after it, before any timed step (warm-inf likewise)
#   dispatch-train  the same, training rows
#   gpu-tests    the gpu-marked flashkda tests
# Triton's cache is kept in .triton-cache (a warm machine keeps it between calls) and packed to $OUT at the end.
set -uo pipefail
source benchmarks/kda/round_env.sh dispatch
FLASHKDA_SRC=$PWD/.thirdparty/FlashKDA

cutlass() {
  for gz in "$FLASHKDA_SRC"/flash_kda_C*.so.gz; do [ -f "$gz" ] && gunzip -kf "$gz" && echo "unpacked $gz"; done
  if ! ls "$FLASHKDA_SRC"/flash_kda_C*.so >/dev/null 2>&1; then
    mkdir -p /tmp/nogit && printf '#!/bin/sh\nexit 0\n' > /tmp/nogit/git && chmod +x /tmp/nogit/git
    local t0=$SECONDS
    (cd "$FLASHKDA_SRC" && PATH=/tmp/nogit:$PATH FLASH_KDA_VERSION_SUFFIX=.post0 FLASH_KDA_CUDA_ARCHS=90a NVCC_THREADS=8 MAX_JOBS=2 \
      python3 setup.py build_ext --inplace) > "$LOGS/cutlass_build.log" 2>&1
    echo "cutlass build: exit $? in $((SECONDS - t0)) s"; tail -5 "$LOGS/cutlass_build.log"
    for so in "$FLASHKDA_SRC"/flash_kda_C*.so; do gzip -c "$so" > "$OUT/$(basename "$so").gz"; done
  fi
  ls "$FLASHKDA_SRC"/flash_kda_C*.so >/dev/null 2>&1 && export PYTHONPATH="$FLASHKDA_SRC:$PYTHONPATH"
  python3 -c 'import flash_kda; print("flash_kda importable")'
}

# warm MODE ROW...: one untimed pass per head count in parallel (Triton compiles and autotunes per shape), so the
# timed steps find the on-disk cache filled.
warm() {
  local mode=$1 rows
  shift
  for rows in "$@"; do
    timeout -k 5 "${WARM_CAP:-240}" python3 -m benchmarks.kda.calibrate --no-write --rep 1 --modes "$mode" \
      --rows $rows > "$LOGS/warm_${mode}_${rows%% *}.log" 2>&1 &
  done
}

deadline=$((SECONDS + ${ROUND_SECONDS:-570}))
for step in "$@"; do
  left=$((deadline - SECONDS))
  echo "=== $step ($(date -u +%H:%M:%S), ${left} s left)"
  [ "$left" -gt 20 ] || { echo "no time left for $step"; break; }
  run="timeout -k 5 $left"
  case $step in
    cutlass) cutlass ;;
    warm-inf) warm inference "H12-T1024 H12-T2048 H12-T4096 H12-T8192 H12-T16384 H12-T32768 H12-varlen-mixed H12-varlen-1kx8" \
                "H32-T2048 H32-T8192 H32-T32768 H32-T65536 H32-T131072 H16-HV64-T8192" \
                "H64-T1024 H64-T2048 H64-T4096 H64-T8192 H64-T16384 H64-T32768 H64-varlen-mixed H64-varlen-1kx8" \
                "H96-T2048 H96-T8192 H96-T32768 H96-varlen-mixed H96-varlen-1kx8" ;;
    wait) wait ;;
    decode) $run python3 -m benchmarks.kda.decode ;;
    cal-inf) $run python3 -m benchmarks.kda.calibrate --modes inference --write-table ;;
    cal-train) $run python3 -m benchmarks.kda.calibrate --modes training --table-out "$OUT/calibration-train.json" ;;
    dispatch) $run python3 -m benchmarks.kda.dispatch_bench --modes inference ;;
    warm-train) for rows in "H64-T8192 H64-varlen-mixed H64-varlen-1kx8 H64-T32768" "H96-T8192 H96-varlen-mixed H96-varlen-1kx8" \
                  "H12-T8192 H12-varlen-mixed H12-varlen-1kx8" "H32-T131072"; do
                  timeout -k 5 "${WARM_CAP:-240}" python3 -m benchmarks.kda.dispatch_bench --no-write --rounds 1 \
                    --modes training --rows $rows > "$LOGS/warm_train_${rows%% *}.log" 2>&1 &
                done ;;
    dispatch-train) $run python3 -m benchmarks.kda.dispatch_bench --modes training ;;
    gpu-tests) timeout -k 5 "$((left < ${GPU_TESTS_CAP:-600} ? left : ${GPU_TESTS_CAP:-600}))" python3 -m pytest -q -m gpu tests/flashkda/test_gpu.py tests/flashkda/test_layer.py -p no:cacheprovider 2>&1 | tail -25 ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
cp src/flashkda/calibration/*.json "$OUT/" 2>/dev/null
(cd "$TRITON_CACHE_DIR" && find . -name '*.autotune.json' | tar -czf "$OUT/autotune-cache.tgz" -T -) 2>/dev/null
tar -czf "$OUT/logs.tgz" -C "$LOGS" . 2>/dev/null; ls -la "$OUT"
