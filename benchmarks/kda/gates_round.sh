#!/usr/bin/env bash
# The fused gate-chain kernels against each other, then the training rows against fla, in one device call through
# benchmarks/device/run.sh (.whl and .fla-autotune.tgz carried):
#   bash benchmarks/device/run.sh bash benchmarks/kda/gates_round.sh
# A (parallel, nothing timed, cap KDA_WARM_CAP, 200 s): fla's first call at every row's shape and in the tiny LM,
#   ours at every row, one untimed pass of the gate-chain sweep (compiles its variants), the fla layer tests.
# B (timed): the sweep at B1-T8192-H64 (benchmarks.kda.bwd_sweep --gates $KDA_GATES, default "32:2 rows:32:4 32:4":
#   the "blocks" kernel at its default launch first, ours only); the faster of it and "rows:32:4" is exported as
#   FLASHKDA_BWD_GATES_KERNEL for the rows: the fp64 gate, the four rows against fla with a profile of the first,
#   then the loss check (KDA_STEPS steps, default 300; 0 skips it) (cap KDA_MAIN_CAP, 300 s; results written after
#   every row). KDA_LAYER_TESTS=0 leaves out the fla layer tests.
set -u
source benchmarks/kda/round_env.sh gates_round
WARM=${KDA_WARM_CAP:-200}
TRAIN="python3 -m benchmarks.kda.train"
GATES=${KDA_GATES:-32:2 rows:32:4 32:4}
SWEEP="python3 -m benchmarks.kda.bwd_sweep --dots --bv --state --gates $GATES"
ROWS="B1-T8192-H64 B8-T4096-H32 B1-T32768-H32 varlen1024x8-H64"
echo "=== phase A (parallel warm-up, cap ${WARM}s) $(date +%T)"
start_train_warmups "$WARM" $ROWS
timeout -k 5 "$WARM" $SWEEP --rep 1 > $LOGS/A_sweep.log 2>&1 &
[ "${KDA_LAYER_TESTS:-1}" = 1 ] && timeout -k 5 "$WARM" python3 -m pytest -q -rA -p no:cacheprovider -m gpu \
  tests/flashkda/test_layer.py -k matches_fla > $LOGS/A_layer_tests.log 2>&1 &
wait
echo "=== phase A done $(date +%T)"
for f in $LOGS/A_*.log; do echo "--- $f"; grep -v "^\s*$" "$f" | tail -n 4; done
echo "=== phase B: gate-chain sweep $(date +%T)"
timeout -k 5 "${KDA_SWEEP_CAP:-90}" $SWEEP 2>&1 | tee $LOGS/B_sweep.log
ms() { grep -E "gates $1: " $LOGS/B_sweep.log | sed -E 's/.*: ([0-9.]+) ms.*/\1/' | head -n 1; }
blocks=$(ms "${GATES%% *}") rows=$(ms rows:32:4)
kernel=blocks
if [ -n "$rows" ] && { [ -z "$blocks" ] || awk -v a="$rows" -v b="$blocks" 'BEGIN { exit !(a < b) }'; }; then
  kernel=rows
fi
export FLASHKDA_BWD_GATES_KERNEL=$kernel
echo "=== gate chain: blocks ${blocks:-not timed} ms, rows ${rows:-not timed} ms -> rows run with $kernel $(date +%T)"
timeout -k 5 "${KDA_MAIN_CAP:-300}" $TRAIN --rep 10 --steps "${KDA_STEPS:-300}" --profile --cases $ROWS 2>&1 \
  | tee $LOGS/B_main.log | grep -v "^\s*$" | grep -v "step "
echo "=== main rc=${PIPESTATUS[0]} $(date +%T)"
cat $LOGS/A_*.log > "$OUT/phaseA.log"
(cd "$TRITON_CACHE_DIR" && find . -name '*.autotune.json' | tar -czf "$OUT/fla-autotune.tgz" -T -) 2>/dev/null
exit 0
