#!/usr/bin/env bash
# One device call for FlashKDA (run through benchmarks/device/run.sh, .whl carried): the stage sweep, the GPU
# tests, forward rows against fla, then the training gate and rows. Each step has its own time cap, so a step that
# hangs or crashes costs its cap, not the call. Steps and caps come from the environment:
#   KDA_VARIANTS=s KDA_TESTS=s KDA_FWD=s KDA_TRAIN=s (seconds, 0 skips), KDA_VARIANTS_ARGS, KDA_FWD_CASES,
#   KDA_TRAIN_CASES, KDA_TEST_PATHS, KDA_TEST_K (a pytest -k expression; it sees the path too, so "not fla"
#   deselects everything under tests/flashkda: use "not matches_fla").
# The Triton cache lives in $TRITON_CACHE_DIR (default .triton-cache, git-ignored; a warm machine keeps it between
# calls). KDA_PACK_CACHE=1 also packs it into $OUT/triton-cache.tgz (often too big to come back).
set -u
source benchmarks/kda/round_env.sh kda_round
step() {  # step NAME CAP CMD...
  local name=$1 cap=$2; shift 2
  [ "$cap" -gt 0 ] || return 0
  echo "=== $name (cap ${cap}s) $(date +%T)"
  timeout -k 5 "$cap" "$@" > "/tmp/$name.log" 2>&1; echo "=== $name rc=$? $(date +%T)"
  { echo "=== $name"; cat "/tmp/$name.log"; } >> "$OUT/steps.log"
  tail -n 40 "/tmp/$name.log"
}
step variants "${KDA_VARIANTS:-0}" python3 -m benchmarks.kda.variants --rep 10 ${KDA_VARIANTS_ARGS:-}
step gputests "${KDA_TESTS:-0}" python3 -m pytest -q -rA -m gpu -p no:cacheprovider --timeout 120 ${KDA_TEST_K:+-k "$KDA_TEST_K"} ${KDA_TEST_PATHS:-tests/flashkda}
step fwd "${KDA_FWD:-0}" python3 -m benchmarks.kda.run --rep 10 ${KDA_FWD_CASES:+--cases $KDA_FWD_CASES}
step train "${KDA_TRAIN:-0}" python3 -m benchmarks.kda.train --rep 5 --steps "${KDA_TRAIN_STEPS:-0}" --profile ${KDA_TRAIN_CASES:+--cases $KDA_TRAIN_CASES}
[ "${KDA_PACK_CACHE:-0}" = 1 ] && tar -czf "$OUT/triton-cache.tgz" -C "$TRITON_CACHE_DIR" . 2>/dev/null
exit 0
