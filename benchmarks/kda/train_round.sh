#!/usr/bin/env bash
# One device call for FlashKDA training, through benchmarks/device/run.sh (.whl carried):
#   bash benchmarks/device/run.sh bash benchmarks/kda/train_round.sh
# fla's first training call per shape compiles and autotunes for 100-200 s, so the call has two phases:
#   A (parallel, nothing timed): fla's first call at each row's shape and in the tiny LM, in separate processes, to
#     fill Triton's on-disk cache (kernels and, with TRITON_CACHE_AUTOTUNING=1, fla's autotune choices); ours
#     compiled the same way; the fused chain-rule passes (chunk_kda_bwd_wy, chunk_kda_gated_dots_gates_bwd, new
#     in the 02:00 UTC offline round, never run on a GPU before; FLASHKDA_BWD_FUSED_WY) probed in a process of their
#     own (fp64 gate + two rows), so a crash costs that process only; the gpu tests of the training files; the CPU
#     suite's backward tests on CUDA; the fp64 gate at T = 8192 (own processes each).
#   B (sequential, timed): benchmarks.kda.train with the loss check first, the fp64 gate, then the four rows against
#     fla, with a profile of the first and a head-slice sweep on each; the fused passes only if their probe passed
#     (a second probe without the fused gate chain, FLASHKDA_BWD_FUSED_GATES=0, if the first failed; else the
#     earlier GEMMs and passes), tf32 gated products unless the long gate failed; then ours with
#     FLASHKDA_BWD_FUSED_WY=0 (the backward kernels as run at 01:41 UTC) at the first row for comparison.
# Caps from the environment (seconds): KDA_WARM_CAP (phase A, 180), KDA_MAIN_CAP (phase B, 140).
# A carried .triton-cache-train.tgz (compiled fla forward kernels) and .fla-autotune.tgz (autotune results of an
# earlier call: fla then compiles only its chosen configurations) are unpacked into the cache first; the autotune
# results are packed into $OUT/fla-autotune.tgz at the end (~40 KB), for the next call to carry.
set -u
source benchmarks/kda/round_env.sh train_round
TRAIN="python3 -m benchmarks.kda.train"
WARM=${KDA_WARM_CAP:-180}
ALL_ROWS="B1-T8192-H64 B8-T4096-H32 B1-T32768-H32 varlen1024x8-H64"

echo "=== phase A (parallel warm-up, cap ${WARM}s) $(date +%T)"
timeout -k 5 "$WARM" $TRAIN --warmup fla --steps 0 --cases B1-T8192-H64 > $LOGS/A_fla_h64.log 2>&1 &
timeout -k 5 "$WARM" $TRAIN --warmup fla --steps 0 --cases varlen1024x8-H64 > $LOGS/A_fla_varlen.log 2>&1 &
timeout -k 5 "$WARM" $TRAIN --warmup fla --steps 0 --cases B8-T4096-H32 > $LOGS/A_fla_h32.log 2>&1 &
timeout -k 5 "$WARM" $TRAIN --warmup fla --cases > $LOGS/A_fla_lm.log 2>&1 &
timeout -k 5 "$WARM" python3 -m pytest -q -rA -m gpu -p no:cacheprovider --timeout "$WARM" \
  tests/flashkda/test_backward.py tests/flashkda/test_backward_gated.py tests/flashkda/test_backward_training.py \
  tests/flashkda/test_layer.py > $LOGS/A_gputests.log 2>&1 &
# the CPU suite's backward tests on the real kernels (compiled, not interpreted), as far as the cap allows
timeout -k 5 "$WARM" python3 -m pytest -q -p no:cacheprovider tests/flashkda/test_backward.py \
  tests/flashkda/test_backward_gated.py > $LOGS/A_cuda_suite.log 2>&1 &
# the fp64 gate at a long sequence (TF32 gated products; ours vs fla reached 8.6e-3 at T = 32768)
timeout -k 5 "$WARM" $TRAIN --ours-only --no-write --steps 0 --rep 3 --gate-T 8192 --cases B1-T8192-H64 \
  > $LOGS/A_long_gate.log 2>&1 &
(
  # the probe first (it compiles the fused passes); if it fails, once more without the fused gate chain; then every
  # row and slice count with what phase B will run, and the chain rule without the fused passes (for the comparison)
  probe() {  # $1: log name, $2: cap; the environment picks the passes
    FLASHKDA_BWD_FUSED_WY=1 timeout -k 5 "$2" $TRAIN --ours-only --steps 0 --rep 5 --no-write --cases B1-T8192-H64 B8-T4096-H32 \
      > $LOGS/$1.log 2>&1
    local rc=$?
    grep -q "FAILED" $LOGS/$1.log && rc=1
    return $rc
  }
  GATES_A=1
  probe A_probe 50; rc=$?
  if [ "$rc" != 0 ]; then
    FLASHKDA_BWD_FUSED_GATES=0 probe A_probe_nogates 30 && rc=0 && GATES_A=0
  fi
  echo "wy probe rc=$rc gates=$GATES_A"
  WY_A=1; [ "$rc" = 0 ] || { WY_A=0; GATES_A=0; }
  FLASHKDA_BWD_FUSED_WY=$WY_A FLASHKDA_BWD_FUSED_GATES=$GATES_A timeout -k 5 70 $TRAIN --warmup ours --steps 0 \
    --slices 1 2 4 --cases $ALL_ROWS
  FLASHKDA_BWD_FUSED_WY=0 timeout -k 5 30 $TRAIN --warmup ours --steps 0 --cases B1-T8192-H64
) > $LOGS/A_ours.log 2>&1 &
wait
echo "=== phase A done $(date +%T)"
for f in $LOGS/A_*.log; do echo "--- $f"; grep -v "^\s*$" "$f" | tail -n 25; done

WY=0
grep -q "wy probe rc=0" $LOGS/A_ours.log && WY=1
GATES=$WY
grep -q "wy probe rc=0 gates=0" $LOGS/A_ours.log && GATES=0
TF32=1
grep -q "FAILED" $LOGS/A_long_gate.log && TF32=0
echo "=== phase B (timed, fused wy pass: $WY, fused gate chain: $GATES, tf32 gated products: $TF32) $(date +%T)"
export FLASHKDA_BWD_FUSED_WY=$WY FLASHKDA_BWD_FUSED_GATES=$GATES
if [ "$TF32" = 1 ]; then export FLASHKDA_BWD_GATED_DOTS=tf32; else export FLASHKDA_BWD_GATED_DOTS=ieee; fi
timeout -k 5 "${KDA_MAIN_CAP:-140}" $TRAIN --rep 10 --steps 300 --loop-first --profile --slices 1 2 4 \
  --cases $ALL_ROWS 2>&1 | tee $LOGS/B_main.log
echo "=== main rc=${PIPESTATUS[0]} $(date +%T)"
if [ "$WY" = 1 ]; then
  FLASHKDA_BWD_FUSED_WY=0 timeout -k 5 30 $TRAIN --ours-only --no-gate --no-write --steps 0 --rep 10 --profile \
    --cases B1-T8192-H64 > $LOGS/B_no_wy.log 2>&1
  grep -v "^\s*$" $LOGS/B_no_wy.log | tail -n 40; grep "ours .* ms" $LOGS/B_no_wy.log
fi
echo "=== done $(date +%T)"
cat $LOGS/A_*.log > "$OUT/phaseA.log"
(cd "$TRITON_CACHE_DIR" && find . -name '*.autotune.json' | tar -czf "$OUT/fla-autotune.tgz" -T -) 2>/dev/null
exit 0
