#!/usr/bin/env bash
# The blocked state pass against the flat one and the fused state/output stage, in one device call:
#   bash benchmarks/device/run.sh bash benchmarks/kda/state_round.sh
# Compiles every variant in parallel (one process per case) beside the state-pass gpu tests, then times them one
# case after another on a quiet GPU (benchmarks.kda.variants: each variant checked against the fused stage first).
set -u
source benchmarks/kda/round_env.sh state_round
CAP=${KDA_STATE_CAP:-240}
BIG="--intra --state 64:8:1 32:4:1"
SMALL="--intra --state --hb 32:4:2:3:2 64:4:2:3:2 32:2:2:3:2 64:2:2:3:2 32:4:3:3:2 64:4:3:3:2"
echo "=== compile pass + tests $(date +%T)"
timeout -k 5 "$CAP" python3 -m benchmarks.kda.variants --cases H64-T8192 --rep 1 $BIG > $LOGS/c_big.log 2>&1 &
for c in H12-T8192 H64-T32768 H32-T131072; do
  timeout -k 5 "$CAP" python3 -m benchmarks.kda.variants --cases $c --rep 1 $SMALL > $LOGS/c_$c.log 2>&1 &
done
timeout -k 5 "$CAP" python3 -m pytest -q -rA -p no:cacheprovider tests/flashkda/test_state_configs.py \
  tests/flashkda/test_gpu.py -k "blocked or split_state_configs" > $LOGS/tests.log 2>&1 &
wait
echo "=== timed $(date +%T)"
python3 -m benchmarks.kda.variants --cases H64-T8192 $BIG 2>&1 | tee $LOGS/t_big.log
python3 -m benchmarks.kda.variants --cases H12-T8192 H64-T32768 H32-T131072 $SMALL 2>&1 | tee $LOGS/t_small.log
echo "=== tests: $(grep -c '^PASSED' $LOGS/tests.log) passed, $(grep -c '^FAILED\|^ERROR' $LOGS/tests.log) failed"
grep -E "^(FAILED|ERROR)|Error" $LOGS/tests.log | head -20
tail -3 $LOGS/tests.log
grep -h "FAILED\|DISAGREES" $LOGS/c_*.log | head
cat $LOGS/*.log > "$OUT/state_round.log"
exit 0
