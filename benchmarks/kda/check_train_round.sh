#!/usr/bin/env bash
# Every FlashKDA gpu test and the training rows in one device call, through benchmarks/device/run.sh (.whl,
# .triton-cache-train.tgz and .fla-autotune.tgz carried):
#   bash benchmarks/device/run.sh bash benchmarks/kda/check_train_round.sh
# A (parallel, cap KDA_CHECK_CAP, 240 s): the gpu tests (each fla comparison in its own process, as check_round.sh),
#   the CPU suite's state-pass tests on CUDA, our and fla's first training call at every row's shape (skipped work
#   where the carried archives hold fla's compiled kernels and autotune results) and the decode row's warm-up.
# B (timed): the training rows against fla with the loss check and the fp64 gate (results written) and a kernel profile of the first row, then the decode row of the forward
#   benchmark (its warm-up in phase A).
# Knobs: KDA_FLA_TESTS (regex over the fla-comparison test ids, default all), KDA_GPU_TESTS=0 (skip the other gpu
# tests and the state-pass tests), KDA_DECODE=0 (no decode row), caps KDA_CHECK_CAP, KDA_MAIN_CAP, KDA_DECODE_CAP.
set -u
source benchmarks/kda/round_env.sh check_train_round
CAP=${KDA_CHECK_CAP:-240}
PYT="python3 -m pytest -q -rA -p no:cacheprovider --timeout $CAP"
ROWS="B1-T8192-H64 B8-T4096-H32 B1-T32768-H32 varlen1024x8-H64"
echo "=== phase A (parallel, cap ${CAP}s) $(date +%T)"
i=0
while IFS= read -r id; do
  i=$((i + 1))
  timeout -k 5 "$CAP" $PYT -m gpu "$id" > $LOGS/A_fla_$i.log 2>&1 &
done < <(python3 -m pytest --collect-only -q -m gpu -p no:cacheprovider tests/flashkda 2>/dev/null \
  | grep "matches_fla" | grep -E "${KDA_FLA_TESTS:-.}")
if [ "${KDA_GPU_TESTS:-1}" = 1 ]; then
  timeout -k 5 "$CAP" $PYT -m gpu tests/flashkda -k "not matches_fla" > $LOGS/A_gpu.log 2>&1 &
  timeout -k 5 "$CAP" $PYT tests/flashkda/test_state_configs.py tests/flashkda/test_bwd_state.py \
    > $LOGS/A_state.log 2>&1 &
fi
start_train_warmups "$CAP" $ROWS
[ "${KDA_DECODE:-1}" = 1 ] && timeout -k 5 "$CAP" python3 -m benchmarks.kda.run --cases decode-B256-H32 --rep 3 --no-write \
  > $LOGS/A_decode.log 2>&1 &
wait
echo "=== phase A done $(date +%T)"
for f in $LOGS/A_*.log; do
  echo "--- $f: $(grep -c '^PASSED' "$f") passed, $(grep -c '^FAILED\|^ERROR' "$f") failed"
  grep -E "^(FAILED|ERROR)" "$f" | head -n 20
done
echo "=== phase B $(date +%T)"
timeout -k 5 "${KDA_MAIN_CAP:-150}" python3 -m benchmarks.kda.train --rep 10 --steps 300 --loop-first --profile \
  --cases $ROWS 2>&1 | tee $LOGS/B_main.log | grep -v "^\s*$" | grep -v "step "
[ "${KDA_DECODE:-1}" = 1 ] && timeout -k 5 "${KDA_DECODE_CAP:-60}" python3 -m benchmarks.kda.run --cases decode-B256-H32 2>&1 | tee $LOGS/B_decode.log
cat $LOGS/A_*.log > "$OUT/phaseA.log"
(cd "$TRITON_CACHE_DIR" && find . -name '*.autotune.json' | tar -czf "$OUT/fla-autotune.tgz" -T -) 2>/dev/null
exit 0
