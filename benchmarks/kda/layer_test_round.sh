#!/usr/bin/env bash
# Device call for the layer-vs-fla gpu tests alone (fla compiles and autotunes its layer at the tests' fp32 shapes,
# which took more than 240 s in every shared call): `bash benchmarks/device/run.sh bash benchmarks/kda/layer_test_round.sh`
# (carry .whl, .k3_commit, .fla-autotune.tgz; timeout_s 590). Knob: KDA_LAYER_CAP (default 540 s).
set -uo pipefail
source benchmarks/kda/round_env.sh kda_layer_tests
start=$SECONDS
timeout -k 5 "${KDA_LAYER_CAP:-540}" python3 -m pytest -q -rA -m gpu tests/flashkda/test_layer.py -k matches_fla \
  2>&1 | tee "$LOGS/layer_tests.log"
rc=${PIPESTATUS[0]}
echo "layer tests rc=$rc after $((SECONDS - start)) s"
cp "$LOGS"/*.log "$OUT/" 2>/dev/null
exit "$rc"
