#!/usr/bin/env bash
# Both FlashKDA tables at the current code in one device call, through benchmarks/device/run.sh (carry .whl,
# .k3_commit):
#   bash benchmarks/device/run.sh bash benchmarks/kda/rows_round.sh
# A (parallel, nothing timed, cap KDA_WARM_CAP, 150 s): fla's and our first calls at every forward row (one process per
#   head count) and, unless KDA_TRAIN=0, at every training row and the tiny LM, into Triton's on-disk cache; with
#   KDA_GPU_TESTS=1 also tests/flashkda/test_gpu.py (-m gpu; the fla comparisons in a process of their own).
# B1 (cap KDA_FWD_CAP, 200 s): every forward row against fla (benchmarks.kda.run; results written after every row).
# B2 (unless KDA_TRAIN=0; cap KDA_MAIN_CAP, 240 s): the fp64 gate, the training rows against fla with a profile of the first, the loss
#   check (KDA_STEPS steps, default 300).
set -u
source benchmarks/kda/round_env.sh rows_round
WARM=${KDA_WARM_CAP:-150}
ROWS="B1-T8192-H64 B8-T4096-H32 B1-T32768-H32 varlen1024x8-H64"
echo "=== phase A (parallel warm-up, cap ${WARM}s) $(date +%T)"
start_fwd_warmups "$WARM"
[ "${KDA_TRAIN:-1}" = 0 ] || start_train_warmups "$WARM" $ROWS
if [ "${KDA_GPU_TESTS:-0}" = 1 ]; then
  timeout -k 5 "$WARM" python3 -m pytest -q -rA -m gpu -p no:cacheprovider tests/flashkda/test_gpu.py -k "not matches_fla" \
    > "$LOGS/A_tests_gpu.log" 2>&1 &
  timeout -k 5 "$WARM" python3 -m pytest -q -rA -m gpu -p no:cacheprovider tests/flashkda/test_gpu.py -k matches_fla \
    > "$LOGS/A_tests_gpu_fla.log" 2>&1 &
fi
wait
echo "=== phase A done $(date +%T)"
for f in "$LOGS"/A_*.log; do echo "--- $f"; grep -v "^\s*$" "$f" | tail -n 3; done
if [ "${KDA_GPU_TESTS:-0}" = 1 ]; then
  for f in "$LOGS"/A_tests*.log; do echo "--- $f"; grep "PASSED\|FAILED\|ERROR\|passed\|failed" "$f" | cut -c1-200; done
fi
echo "=== phase B1: forward rows $(date +%T)"
timeout -k 5 "${KDA_FWD_CAP:-200}" python3 -m benchmarks.kda.run --rep 10 2>&1 | tee "$LOGS/B_fwd.log" \
  | grep -v "^\s*$"
echo "=== forward rc=${PIPESTATUS[0]} $(date +%T)"
sleep 1  # results files are named by the second a benchmark starts
if [ "${KDA_TRAIN:-1}" = 0 ]; then cat "$LOGS"/A_*.log > "$OUT/phaseA.log"; exit 0; fi
echo "=== phase B2: training rows $(date +%T)"
timeout -k 5 "${KDA_MAIN_CAP:-240}" python3 -m benchmarks.kda.train --rep 10 --steps "${KDA_STEPS:-300}" --profile \
  --cases $ROWS 2>&1 | tee "$LOGS/B_main.log" | grep -v "^\s*$" | grep -v "step " | grep -v "^ \|^---\|^void\|Name "
echo "=== training rc=${PIPESTATUS[0]} $(date +%T)"
cat "$LOGS"/A_*.log > "$OUT/phaseA.log"
cp "$LOGS/B_main.log" "$LOGS/B_fwd.log" "$OUT/" 2>/dev/null
exit 0
