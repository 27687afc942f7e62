#!/usr/bin/env bash
# The forward's gate prologue (flashkda.chunk_intra.chunk_kda_fwd_kernel_gate, FLASHKDA_GATE_PROLOGUE, default on)
# timed against the intra kernel's own gate work in one device call (carry .whl, .k3_commit):
#   bash benchmarks/device/run.sh bash benchmarks/kda/prologue_round.sh
# A (parallel, nothing timed, cap KDA_WARM_CAP, 150 s): fla's and our first calls at the forward rows (both switch
#   settings) and at the training row, and the GPU tests of the prologue, of the intra configurations and of every
#   output-kernel configuration (bf16 and fp32 v_new).
# B1 (cap KDA_FWD_CAP per process, 80 s): the forward rows KDA_FWD_CASES against fla, prologue off then on (results
#   files written, each row records the switch; the default last, so BENCHMARKS.md shows it), then off and on again
#   without writing (the same-call A/B).
# B2 (cap KDA_AB_CAP per process, 45 s): the training rows KDA_TRAIN_CASES, ours only, prologue on / off / on / off.
set -u
source benchmarks/kda/round_env.sh prologue_round
WARM=${KDA_WARM_CAP:-150}
FWD_CASES=${KDA_FWD_CASES:-H64-T8192 H12-T8192 H64-varlen1024x8 H32-T131072}
TRAIN_CASES=${KDA_TRAIN_CASES:-B1-T8192-H64}
PASS="python3 -m benchmarks.kda.run --no-write --rep 1 --cases"
echo "=== phase A (parallel warm-up, cap ${WARM}s) $(date +%T)"
for c in $FWD_CASES; do
  timeout -k 5 "$WARM" $PASS "$c" > "$LOGS/A_fwd_$c.log" 2>&1 &
  FLASHKDA_GATE_PROLOGUE=0 timeout -k 5 "$WARM" $PASS "$c" > "$LOGS/A_fwd_off_$c.log" 2>&1 &
done
for on in 1 0; do
  FLASHKDA_GATE_PROLOGUE=$on timeout -k 5 "$WARM" python3 -m benchmarks.kda.train --warmup ours --cases $TRAIN_CASES \
    > "$LOGS/A_train_$on.log" 2>&1 &
done
timeout -k 5 "$WARM" python3 -m pytest -q -rA -p no:cacheprovider tests/flashkda/test_state_configs.py \
  -k "gate_prologue or intra_stage_configs" > "$LOGS/A_tests_intra.log" 2>&1 &
timeout -k 5 "$WARM" python3 -m pytest -q -rA -m gpu -p no:cacheprovider tests/flashkda/test_gpu.py \
  -k "output_kernel_configs" > "$LOGS/A_tests_output.log" 2>&1 &
wait
echo "=== phase A done $(date +%T)"
for f in "$LOGS"/A_*.log; do echo "--- $f"; grep -v "^\s*$" "$f" | tail -n 6; done
echo "=== phase B1: forward rows vs fla, prologue off / on (written), off / on (not written) $(date +%T)"
for on in 0 1 0 1; do
  write=""
  [ -f "$LOGS/wrote_$on" ] && write="--no-write"
  echo "--- FLASHKDA_GATE_PROLOGUE=$on $write"
  FLASHKDA_GATE_PROLOGUE=$on timeout -k 5 "${KDA_FWD_CAP:-80}" python3 -m benchmarks.kda.run --rep 10 $write \
    --cases $FWD_CASES 2>&1 | grep -v "^\s*$" | tail -n 12
  touch "$LOGS/wrote_$on"
  sleep 1  # results files are named by the second a benchmark starts
done
echo "=== phase B2: training rows, ours only, prologue on / off / on / off $(date +%T)"
for on in 1 0 1 0; do
  echo "--- FLASHKDA_GATE_PROLOGUE=$on"
  FLASHKDA_GATE_PROLOGUE=$on timeout -k 5 "${KDA_AB_CAP:-45}" python3 -m benchmarks.kda.train --ours-only --no-write \
    --no-gate --steps 0 --rep 10 --cases $TRAIN_CASES 2>&1 | grep "ms (p20"
done
echo "=== done $(date +%T)"
cat "$LOGS"/A_*.log > "$OUT/phaseA.log"
exit 0
