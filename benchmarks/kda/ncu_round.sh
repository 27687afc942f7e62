#!/usr/bin/env bash
# One device call: Nsight Compute profile of ours and fla's forward, plus timed rows of the default and of variants
# set by environment switches (default: fp32 intermediates), through benchmarks/device/run.sh (.whl carried):
#   bash benchmarks/device/run.sh bash benchmarks/kda/ncu_round.sh
# A (parallel): compile/autotune passes of every timed row and variant, the variants' gpu tests.
# B: ncu (full set) of one call each at KDA_NCU_CASES; details page and the intra kernel's source counters to $OUT
#   (the report itself stays on the device: $OUT returns at most 8 files).
# C (sequential, timed, results written): KDA_ROWS with the default path, then KDA_VARIANT_ROWS (default: KDA_ROWS)
#   with each KDA_VARIANTS env setting. KDA_NCU_ARGS: extra arguments of profile_fwd (e.g. --ours-only).
set -u
source benchmarks/kda/round_env.sh ncu_round
WARM=${KDA_WARM_CAP:-150}
ROWS=${KDA_ROWS:-H64-T8192 H64-T32768 H12-T8192}
NCU_CASES=${KDA_NCU_CASES-H64-T8192}
# each entry: NAME=VALUE of one environment switch
VARIANTS=${KDA_VARIANTS-}
VARIANT_ROWS=${KDA_VARIANT_ROWS:-$ROWS}
PASS="python3 -m benchmarks.kda.run --no-write --rep 1 --cases"

echo "=== phase A (parallel, cap ${WARM}s) $(date +%T)"
# one process per head count (the row name's prefix: H64, H96, ..., decode): fla compiles for 60-100 s per head
# count, and ten processes at once did not finish in 150 s (22:16 UTC)
for grp in $(for r in $ROWS; do echo "${r%%-*}"; done | sort -u); do
  rows=$(for r in $ROWS; do [ "${r%%-*}" = "$grp" ] && echo "$r"; done)
  timeout -k 5 "$WARM" $PASS $rows > "$LOGS/A_default_$grp.log" 2>&1 &
done
for v in $VARIANTS; do env "$v" timeout -k 5 "$WARM" $PASS $VARIANT_ROWS > "$LOGS/A_${v%%=*}.log" 2>&1 & done
timeout -k 5 "${KDA_TEST_CAP:-$WARM}" python3 -m pytest -q -rA -m gpu -p no:cacheprovider --timeout 120 tests/flashkda/test_gpu.py \
  -k "${KDA_GPU_TESTS:-intra_stage or chunk_matches_fp64}" > $LOGS/A_gputests.log 2>&1 &
wait
echo "=== phase A done $(date +%T)"
for f in $LOGS/A_*.log; do echo "--- $f"; grep -v "^\s*$" "$f" | tail -n 12; done

echo "=== phase B: ncu $(date +%T)"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
if [ -z "$NCU_CASES" ]; then
  echo "no KDA_NCU_CASES: ncu skipped"
elif [ -n "$NCU" ]; then
  timeout -k 5 "${KDA_NCU_CAP:-150}" "$NCU" --profile-from-start off --clock-control none --set full \
    --import-source no -f -o "$LOGS/fwd" python3 -m benchmarks.kda.profile_fwd --ncu-range --cases $NCU_CASES ${KDA_NCU_ARGS:-} > $LOGS/B_ncu.log 2>&1
  echo "ncu rc=$?"; tail -n 5 $LOGS/B_ncu.log
  if [ -f "$LOGS/fwd.ncu-rep" ]; then
    "$NCU" -i "$LOGS/fwd.ncu-rep" --page details > "$OUT/ncu_details.txt" 2>&1
    "$NCU" -i "$LOGS/fwd.ncu-rep" --page source --print-source sass --csv -k regex:fwd_kernel_intra \
      > "$OUT/ncu_src_intra.csv" 2>&1
    ls -la "$OUT"
  fi
else
  echo "no ncu on this machine"
fi

echo "=== phase C: timed rows $(date +%T)"
timeout -k 5 "${KDA_MAIN_CAP:-120}" python3 -m benchmarks.kda.run --rep 10 --cases $ROWS 2>&1 | tee $LOGS/C_default.log
for v in $VARIANTS; do
  sleep 1  # results files are named by the second a benchmark starts
  echo "=== variant $v $(date +%T)"
  env "$v" timeout -k 5 "${KDA_VARIANT_CAP:-90}" python3 -m benchmarks.kda.run --rep 10 --cases $VARIANT_ROWS 2>&1 \
    | tee "$LOGS/C_${v%%=*}.log"
done
cat $LOGS/A_*.log > "$OUT/phaseA.log"
echo "=== done $(date +%T)"
exit 0
