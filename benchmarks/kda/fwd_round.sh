#!/usr/bin/env bash
# One device call for the FlashKDA forward, through benchmarks/device/run.sh (.whl carried):
#   bash benchmarks/device/run.sh bash benchmarks/kda/fwd_round.sh
# fla compiles its forward for 60-100 s per head count, so the call has two phases:
#   A (parallel, nothing written): one untimed pass of every row per head count in its own process (fla and ours
#     compile into Triton's on-disk cache; autotune results are NOT cached, so phase B autotunes on a quiet GPU), the
#     gpu tests, the CPU suite's state-stage tests on CUDA and a compile pass of the state-stage sweep.
#   B (sequential, timed, results written): every row with the default path, then the state-stage sweep
#     (benchmarks.kda.variants: the output kernel alone at every tile and product precision, the state-only pass
#     with the output kernel) at KDA_SWEEP_CASES.
# Caps from the environment (seconds): KDA_WARM_CAP (phase A, 170), KDA_MAIN_CAP (default rows, 200),
# KDA_SWEEP_CAP (sweep, 90).
set -u
source benchmarks/kda/round_env.sh fwd_round
export TRITON_CACHE_AUTOTUNING=0
WARM=${KDA_WARM_CAP:-170}
PASS="python3 -m benchmarks.kda.run --no-write --rep 1 --cases"
SWEEP_CASES=${KDA_SWEEP_CASES:-H64-T8192}
SWEEP="python3 -m benchmarks.kda.variants --intra --state --hb 64:4:3:3:2 32:4:3:3:2 --cases"

echo "=== phase A (parallel, cap ${WARM}s) $(date +%T)"
start_fwd_warmups "$WARM"
timeout -k 5 "$WARM" python3 -m pytest -q -rA -m gpu -p no:cacheprovider --timeout 120 tests/flashkda/test_gpu.py \
  > $LOGS/A_gputests.log 2>&1 &
timeout -k 5 "$WARM" python3 -m pytest -q -rA -p no:cacheprovider --timeout 120 tests/flashkda/test_state_configs.py \
  > $LOGS/A_state_tests.log 2>&1 &
for c in $SWEEP_CASES; do timeout -k 5 "$WARM" $SWEEP $c --rep 1 > $LOGS/A_sweep_$c.log 2>&1 & done
wait
echo "=== phase A done $(date +%T)"
for f in $LOGS/A_*.log; do echo "--- $f"; grep -v "^\s*$" "$f" | tail -n 14; done

echo "=== phase B: default path $(date +%T)"
timeout -k 5 "${KDA_MAIN_CAP:-200}" python3 -m benchmarks.kda.run --rep 10 2>&1 | tee $LOGS/B_default.log
echo "=== default rc=${PIPESTATUS[0]} $(date +%T)"
echo "=== phase B: state-stage sweep $(date +%T)"
timeout -k 5 "${KDA_SWEEP_CAP:-90}" $SWEEP $SWEEP_CASES 2>&1 | tee $LOGS/B_sweep.log
cat $LOGS/A_*.log > "$OUT/phaseA.log"
exit 0
