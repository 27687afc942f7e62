#!/usr/bin/env bash
# One device call that finishes FlashKDA's GPU checks, through benchmarks/device/run.sh (.whl, the Triton caches
# carried as for train_round.sh):  bash benchmarks/device/run.sh bash benchmarks/kda/check_round.sh
#   A (parallel, cap KDA_CHECK_CAP, 300 s): the gpu tests the earlier rounds' caps cut (forward vs fla, the layer vs
#     fla's layer with copied weights, the training files' gpu tests), the CPU suite's bf16-state-factor and fused
#     chain-rule tests on CUDA, and fp64-gate probes of the fused backward passes (FLASHKDA_BWD_FUSED_WY=1) with fp32
#     and with bf16 state factors (FLASHKDA_BWD_BF16_FACTORS), one process each.
#   B (timed, not written, cap KDA_PROBE_CAP, 90 s): the fused passes against fla at two rows, if their fp32 probe
#     passed, then the default backward at the same rows.
set -u
OUT=${OUT:-/tmp/out}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton-cache} TRITON_CACHE_AUTOTUNING=1 PYTHONUNBUFFERED=1
LOGS=/tmp/check_round
mkdir -p "$TRITON_CACHE_DIR" $LOGS
for f in .triton-cache-train.tgz .fla-autotune.tgz; do
  [ -f "$f" ] && tar -xzf "$f" -C "$TRITON_CACHE_DIR" 2>/dev/null && echo "unpacked $f"
done
CAP=${KDA_CHECK_CAP:-300}
PYT="python3 -m pytest -q -rA -p no:cacheprovider --timeout $CAP"
TRAIN="python3 -m benchmarks.kda.train"
echo "=== phase A (parallel, cap ${CAP}s) $(date +%T)"
timeout -k 5 "$CAP" $PYT -m gpu tests/flashkda/test_gpu.py -k matches_fla > $LOGS/A_fwd_vs_fla.log 2>&1 &
timeout -k 5 "$CAP" $PYT -m gpu tests/flashkda/test_layer.py > $LOGS/A_layer.log 2>&1 &
timeout -k 5 "$CAP" $PYT -m gpu tests/flashkda/test_backward.py tests/flashkda/test_backward_gated.py \
  tests/flashkda/test_backward_training.py > $LOGS/A_train_gpu.log 2>&1 &
timeout -k 5 "$CAP" $PYT tests/flashkda/test_backward_gated.py tests/flashkda/test_backward.py \
  -k "bf16_state_factors or fused" > $LOGS/A_fused_cuda.log 2>&1 &
for factors in 0 1; do
  FLASHKDA_BWD_FUSED_WY=1 FLASHKDA_BWD_BF16_FACTORS=$factors timeout -k 5 120 $TRAIN --ours-only --steps 0 --rep 5 \
    --no-write --cases B1-T8192-H64 > $LOGS/A_probe_factors$factors.log 2>&1 &
done
wait
echo "=== phase A done $(date +%T)"
for f in $LOGS/A_*.log; do echo "--- $f"; grep -v "^\s*$" "$f" | grep -v "^PASSED" | tail -n 12; grep -c "^PASSED" "$f"; done
if grep -q "gate vs fp64" $LOGS/A_probe_factors0.log && ! grep -q "FAILED" $LOGS/A_probe_factors0.log; then
  echo "=== phase B: fused passes vs fla $(date +%T)"
  FLASHKDA_BWD_FUSED_WY=1 timeout -k 5 "${KDA_PROBE_CAP:-90}" $TRAIN --no-gate --no-write --steps 0 --rep 10 \
    --profile --cases B1-T8192-H64 B8-T4096-H32 2>&1 | tee $LOGS/B_fused.log | grep -v "^\s*$" | tail -n 45
  timeout -k 5 60 $TRAIN --ours-only --no-gate --no-write --steps 0 --rep 10 --cases B1-T8192-H64 B8-T4096-H32 \
    2>&1 | tee $LOGS/B_default.log | grep "ms"
fi
echo "=== done $(date +%T)"
cat $LOGS/*.log > "$OUT/check_round.log"
exit 0
