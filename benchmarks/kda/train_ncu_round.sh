#!/usr/bin/env bash
# Nsight Compute profile of one training step (forward + backward) of ours and of fla at B1-T8192-H64, in one device
# call through benchmarks/device/run.sh (.whl and .fla-autotune.tgz carried):
#   bash benchmarks/device/run.sh bash benchmarks/kda/train_ncu_round.sh
# A (parallel, nothing timed, cap KDA_WARM_CAP, 150 s): fla's and our first call at the row (Triton's on-disk cache).
# B (cap KDA_NCU_CAP, 300 s): `benchmarks.kda.train --profile --ncu-range` under `ncu --set full
#   --profile-from-start off`: the row is timed against fla as usual (results written), the torch-profiler kernel
#   tables of both are printed, then one step of each runs inside the profiler range. The report's details page comes
#   back as $OUT/ncu_train_details.txt (the report itself stays on the device). KDA_NCU_SET picks another section set
#   (e.g. "detailed": fewer replay passes per kernel).
set -u
source benchmarks/kda/round_env.sh train_ncu_round
WARM=${KDA_WARM_CAP:-150}
ROW=${KDA_NCU_ROW:-B1-T8192-H64}
TRAIN="python3 -m benchmarks.kda.train"
echo "=== phase A (parallel warm-up, cap ${WARM}s) $(date +%T)"
timeout -k 5 "$WARM" $TRAIN --warmup fla --steps 0 --cases $ROW > $LOGS/A_fla.log 2>&1 &
timeout -k 5 "$WARM" $TRAIN --warmup ours --steps 0 --cases $ROW > $LOGS/A_ours.log 2>&1 &
wait
echo "=== phase A done $(date +%T)"
for f in $LOGS/A_*.log; do echo "--- $f"; grep -v "^\s*$" "$f" | tail -n 4; done
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
if [ -z "$NCU" ]; then
  echo "no ncu on this machine"
  exit 1
fi
echo "=== phase B: ncu $(date +%T)"
timeout -k 5 "${KDA_NCU_CAP:-300}" "$NCU" --profile-from-start off --clock-control none --set "${KDA_NCU_SET:-full}" \
  --import-source no -f -o "$LOGS/train" $TRAIN --rep 5 --steps 0 --no-gate --profile --ncu-range --cases $ROW 2>&1 \
  | tee $LOGS/B_ncu.log | grep -v "^==PROF==" | grep -v "^\s*$"
echo "=== ncu rc=${PIPESTATUS[0]} $(date +%T)"
if [ -f "$LOGS/train.ncu-rep" ]; then
  "$NCU" -i "$LOGS/train.ncu-rep" --page details > "$OUT/ncu_train_details.txt" 2>&1
  ls -la "$OUT"
fi
cat $LOGS/A_*.log > "$OUT/phaseA.log"
exit 0
