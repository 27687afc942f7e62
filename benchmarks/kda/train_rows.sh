#!/usr/bin/env bash
# The training rows with the current defaults in one device call, through benchmarks/device/run.sh (.whl carried, and
# .triton-cache-train.tgz (compiled fla kernels) / .fla-autotune.tgz (fla's autotune results) where the checkout has
# them; the autotune results of this call come back as $OUT/fla-autotune.tgz, ~40 KB, for the next call to carry):
#   bash benchmarks/device/run.sh bash benchmarks/kda/train_rows.sh
# A (parallel, nothing timed, cap KDA_WARM_CAP, 150 s): fla's and our first call at every row's shape and in the tiny
#   LM, each in its own process, into Triton's on-disk cache. B (timed, cap KDA_MAIN_CAP, 150 s): the loss check,
#   the fp64 gate, the four rows against fla with a profile of the first; results written. Beside phase A the tests
#   of the training state passes.
set -u
source benchmarks/kda/round_env.sh train_rows
TRAIN="python3 -m benchmarks.kda.train"
WARM=${KDA_WARM_CAP:-150}
ROWS="B1-T8192-H64 B8-T4096-H32 B1-T32768-H32 varlen1024x8-H64"
echo "=== phase A (parallel warm-up, cap ${WARM}s) $(date +%T)"
start_train_warmups "$WARM" $ROWS
timeout -k 5 "$WARM" python3 -m pytest -q -rA -p no:cacheprovider --timeout 120 tests/flashkda/test_bwd_state.py \
  tests/flashkda/test_backward.py > $LOGS/A_tests.log 2>&1 &
wait
echo "=== phase A done $(date +%T)"
for f in $LOGS/A_*.log; do echo "--- $f"; grep -v "^\s*$" "$f" | tail -n 4; done
echo "=== phase B $(date +%T)"
timeout -k 5 "${KDA_MAIN_CAP:-150}" $TRAIN --rep 10 --steps 300 --loop-first --profile --cases $ROWS 2>&1 \
  | tee $LOGS/B_main.log
echo "=== main rc=${PIPESTATUS[0]} $(date +%T)"
cat $LOGS/A_*.log > "$OUT/phaseA.log"
(cd "$TRITON_CACHE_DIR" && find . -name '*.autotune.json' | tar -czf "$OUT/fla-autotune.tgz" -T -) 2>/dev/null
exit 0
