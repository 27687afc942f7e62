#!/usr/bin/env bash
# One device call for the FlashKDA forward, through benchmarks/device/run.sh (.whl carried):
#   bash benchmarks/device/run.sh bash benchmarks/kda/fwd_round.sh
# fla compiles its forward for 60-100 s per head count, so the call has two phases:
#   A (parallel, nothing written): one untimed pass of every row per head count in its own process (fla and ours
#     compile into Triton's on-disk cache; autotune results are NOT cached, so phase B autotunes on a quiet GPU), the
#     same with the opt-in small-tile intra path, the gpu tests, and the CPU suite's tiled-path tests on CUDA.
#   B (sequential, timed, results written): every row with the default path, then the prefill rows with
#     FLASHKDA_INTRA_TILED=1 (its own results file; the JSON's "intra path" says which).
# Caps from the environment (seconds): KDA_WARM_CAP (phase A, 170), KDA_MAIN_CAP (default rows, 200),
# KDA_TILED_CAP (tiled rows, 140); KDA_TILED_CASES picks the tiled rows.
set -u
source benchmarks/kda/round_env.sh fwd_round
export TRITON_CACHE_AUTOTUNING=0
WARM=${KDA_WARM_CAP:-170}
PASS="python3 -m benchmarks.kda.run --no-write --rep 1 --cases"
TILED_CASES=${KDA_TILED_CASES:-H64-T8192 H32-T131072 H64-T32768 H96-T8192 H12-T8192 H64-varlen6 H64-varlen1024x8}

echo "=== phase A (parallel, cap ${WARM}s) $(date +%T)"
timeout -k 5 "$WARM" $PASS H64-T8192 H64-varlen6 H64-varlen1024x8 H64-T32768 > $LOGS/A_h64.log 2>&1 &
timeout -k 5 "$WARM" $PASS H96-T8192 H96-varlen6 H96-varlen1024x8 > $LOGS/A_h96.log 2>&1 &
timeout -k 5 "$WARM" $PASS H12-T8192 > $LOGS/A_h12.log 2>&1 &
timeout -k 5 "$WARM" $PASS H32-T131072 decode-B256-H32 > $LOGS/A_h32.log 2>&1 &
FLASHKDA_INTRA_TILED=1 timeout -k 5 "$WARM" $PASS $TILED_CASES > $LOGS/A_tiled.log 2>&1 &
timeout -k 5 "$WARM" python3 -m pytest -q -rA -m gpu -p no:cacheprovider --timeout 120 tests/flashkda/test_gpu.py \
  > $LOGS/A_gputests.log 2>&1 &
timeout -k 5 "$WARM" python3 -m pytest -q -rA -p no:cacheprovider --timeout 120 tests/flashkda/test_state_configs.py \
  -k tiled > $LOGS/A_tiled_tests.log 2>&1 &
FLASHKDA_INTRA_TILED=1 timeout -k 5 "$WARM" python3 -m pytest -q -rA -m gpu -p no:cacheprovider --timeout 120 \
  tests/flashkda/test_gpu.py -k "chunk_matches_fp64 or cuda_graph" > $LOGS/A_tiled_gputests.log 2>&1 &
wait
echo "=== phase A done $(date +%T)"
for f in $LOGS/A_*.log; do echo "--- $f"; grep -v "^\s*$" "$f" | tail -n 14; done

echo "=== phase B: default path $(date +%T)"
timeout -k 5 "${KDA_MAIN_CAP:-200}" python3 -m benchmarks.kda.run --rep 10 2>&1 | tee $LOGS/B_default.log
echo "=== default rc=${PIPESTATUS[0]} $(date +%T)"
sleep 1  # results files are named by the second a benchmark starts
if grep -q "passed" $LOGS/A_tiled_tests.log && ! grep -q "failed" $LOGS/A_tiled_tests.log $LOGS/A_tiled_gputests.log; then
  echo "=== phase B: small-tile intra path $(date +%T)"
  FLASHKDA_INTRA_TILED=1 timeout -k 5 "${KDA_TILED_CAP:-140}" python3 -m benchmarks.kda.run --rep 10 \
    --cases $TILED_CASES 2>&1 | tee $LOGS/B_tiled.log
  echo "=== tiled rc=${PIPESTATUS[0]} $(date +%T)"
else
  echo "=== small-tile path not timed: its tests did not pass on this device"
fi
cat $LOGS/A_*.log > "$OUT/phaseA.log"
exit 0
