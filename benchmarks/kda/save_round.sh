#!/usr/bin/env bash
# The training forward's saved chunk-local matrices (FLASHKDA_BWD_SAVE_LOCAL, default on: Aqk, Akk and the solved
# inverse kept from the forward kernels, so the backward skips its Akk/Aqk recompute and the blocked inverse),
# timed in one device call through benchmarks/device/run.sh (carry .whl, .k3_commit, .fla-autotune.tgz):
#   bash benchmarks/device/run.sh bash benchmarks/kda/save_round.sh
# A (parallel, nothing timed, cap KDA_WARM_CAP, 150 s): fla's and our first call at every row, ours with the switch
#   off, with the saved states and with the all-heads reverse pass at B1-T8192-H64, one untimed pass of the gate-chain
#   sweep.
# B1: ours only at KDA_AB_CASES (default B1-T8192-H64; each configuration's process capped at KDA_AB_CAP, 50 s),
#   saved matrices on / off / on with the saved states (FLASHKDA_BWD_SAVE_STATES=1, opt-in; KDA_AB_CFGS, default
#   "1:0 0:0 1:1 1:0 0:0 1:1" as SAVE_LOCAL:SAVE_STATES[:DH_ALL_HEADS[:RECOMPUTE_ALL_HEADS[:RECOMPUTE_SLICE]]],
#   empty: none), twice (each its own process): the same-run A/B/C; then
#   the gate-chain kernels against each other (benchmarks.kda.bwd_sweep --gates $KDA_GATES, default "32:2 rows:32:4";
#   the whole-chunk kernel timed here at 02:50 and 03:00 UTC was deleted after, see NOTES; KDA_SWEEP_CAP=0 skips it).
# B2 (cap KDA_MAIN_CAP, 300 s): the fp64 gate, the four rows against fla with a profile of the first, the loss check
#   (KDA_STEPS steps, default 300); results written after every row; KDA_MAIN_ARGS are added to its arguments
#   (e.g. --disable-recompute).
# B3 (only with KDA_EXTRA_CFG=SAVE_LOCAL:SAVE_STATES:DH_ALL_HEADS, cap KDA_EXTRA_CAP, 90 s): the rows again, ours only,
#   in that configuration.
# C (cap KDA_TEST_CAP, 120 s): the tests of the saved matrices and of the gate-chain kernels, on the GPU (KDA_TESTS:
#   the pytest -k expression).
set -u
source benchmarks/kda/round_env.sh save_round
WARM=${KDA_WARM_CAP:-150}
TRAIN="python3 -m benchmarks.kda.train"
ROWS="B1-T8192-H64 B8-T4096-H32 B1-T32768-H32 varlen1024x8-H64"
echo "=== phase A (parallel warm-up, cap ${WARM}s) $(date +%T)"
start_train_warmups "$WARM" $ROWS
FLASHKDA_BWD_SAVE_LOCAL=0 timeout -k 5 "$WARM" $TRAIN --warmup ours --cases B1-T8192-H64 > "$LOGS/A_ours_nosave.log" 2>&1 &
FLASHKDA_BWD_SAVE_STATES=1 timeout -k 5 "$WARM" $TRAIN --warmup ours --cases B1-T8192-H64 > "$LOGS/A_ours_states.log" 2>&1 &
FLASHKDA_BWD_SAVE_STATES=1 FLASHKDA_BWD_DH_ALL_HEADS=1 timeout -k 5 "$WARM" $TRAIN --warmup ours --cases B1-T8192-H64 \
  > "$LOGS/A_ours_dh_all.log" 2>&1 &
FLASHKDA_BWD_RECOMPUTE_ALL_HEADS=1 timeout -k 5 "$WARM" $TRAIN --warmup ours --cases B1-T8192-H64 \
  > "$LOGS/A_ours_recompute_all.log" 2>&1 &
GATES=${KDA_GATES:-32:2 rows:32:4}
SWEEP="python3 -m benchmarks.kda.bwd_sweep --dots --bv --state --gates $GATES"
timeout -k 5 "$WARM" $SWEEP --rep 1 > "$LOGS/A_sweep.log" 2>&1 &
wait
echo "=== phase A done $(date +%T)"
for f in "$LOGS"/A_*.log; do echo "--- $f"; grep -v "^\s*$" "$f" | tail -n 4; done
AB_CASES=${KDA_AB_CASES:-B1-T8192-H64}
echo "=== phase B1: save-local A/B, ours only, $AB_CASES $(date +%T)"
for cfg in ${KDA_AB_CFGS-1:0 0:0 1:1 1:0 0:0 1:1}; do
  IFS=: read -r save_local save_states dh_all recompute_all recompute_slice <<< "$cfg"
  echo "--- FLASHKDA_BWD_SAVE_LOCAL=$save_local FLASHKDA_BWD_SAVE_STATES=$save_states" \
    "FLASHKDA_BWD_DH_ALL_HEADS=${dh_all:-0} FLASHKDA_BWD_RECOMPUTE_ALL_HEADS=${recompute_all:-0}" \
    "--recompute-slice ${recompute_slice:-none}"
  FLASHKDA_BWD_SAVE_LOCAL=$save_local FLASHKDA_BWD_SAVE_STATES=$save_states FLASHKDA_BWD_DH_ALL_HEADS=${dh_all:-0} \
    FLASHKDA_BWD_RECOMPUTE_ALL_HEADS=${recompute_all:-0} timeout -k 5 "${KDA_AB_CAP:-50}" $TRAIN --ours-only --no-write \
    --no-gate --steps 0 --rep 10 --cases $AB_CASES ${recompute_slice:+--recompute-slice $recompute_slice} 2>&1 \
    | grep "ms (p20"
done
echo "=== phase B1: gate-chain sweep $(date +%T)"
[ "${KDA_SWEEP_CAP:-90}" = 0 ] || timeout -k 5 "${KDA_SWEEP_CAP:-90}" $SWEEP 2>&1 | tee "$LOGS/B_sweep.log"
echo "=== phase B2: rows $(date +%T)"
timeout -k 5 "${KDA_MAIN_CAP:-300}" $TRAIN --rep 10 --steps "${KDA_STEPS:-300}" --profile ${KDA_MAIN_ARGS:-} \
  --cases $ROWS 2>&1 \
  | tee "$LOGS/B_main.log" | grep -v "^\s*$" | grep -v "step "
echo "=== main rc=${PIPESTATUS[0]} $(date +%T)"
if [ -n "${KDA_EXTRA_CFG:-}" ]; then
  IFS=: read -r save_local save_states dh_all <<< "$KDA_EXTRA_CFG"
  echo "=== phase B3: rows, ours only, SAVE_LOCAL=$save_local SAVE_STATES=$save_states DH_ALL_HEADS=${dh_all:-0} $(date +%T)"
  FLASHKDA_BWD_SAVE_LOCAL=$save_local FLASHKDA_BWD_SAVE_STATES=$save_states FLASHKDA_BWD_DH_ALL_HEADS=${dh_all:-0} \
    timeout -k 5 "${KDA_EXTRA_CAP:-90}" $TRAIN --ours-only --no-write --no-gate --steps 0 --rep 10 --cases $ROWS 2>&1 \
    | grep "ms (p20"
fi
echo "=== phase C: gpu runs of the saved-matrices and gate-chain tests (cap ${KDA_TEST_CAP:-120}s) $(date +%T)"
timeout -k 5 "${KDA_TEST_CAP:-120}" python3 -m pytest -q -rA -p no:cacheprovider tests/flashkda/test_backward.py \
  tests/flashkda/test_backward_gated.py -k "${KDA_TESTS:-saved_chunk_local or saved_inverse or saved_states or widen_head or fused_gated_dots}" \
  2>&1 | tail -n 15
echo "=== tests rc=${PIPESTATUS[0]} $(date +%T)"
cat "$LOGS"/A_*.log > "$OUT/phaseA.log"
cp "$LOGS/B_main.log" "$OUT/" 2>/dev/null
(cd "$TRITON_CACHE_DIR" && find . -name '*.autotune.json' | tar -czf "$OUT/fla-autotune.tgz" -T -) 2>/dev/null
exit 0
