#!/usr/bin/env bash
# Every FlashKDA gpu test in one device call, through benchmarks/device/run.sh (.whl carried):
#   bash benchmarks/device/run.sh bash benchmarks/kda/check_round.sh
# fla compiles for minutes at each new shape, which cut the fla-comparison tests in every earlier round, so each of
# them runs in its own process (separate shapes compile on separate cores) beside one process for all the others.
# One cap for all (KDA_CHECK_CAP, 330 s); the summary lists each process's passed/failed counts. Then a per-kernel
# CUDA profile of our forward and fla's at KDA_PROFILE_CASES (benchmarks.kda.profile_fwd), compiled beside the tests
# and run after them.
set -u
source benchmarks/kda/round_env.sh check_round
CAP=${KDA_CHECK_CAP:-330}
PYT="python3 -m pytest -q -rA -m gpu -p no:cacheprovider --timeout $CAP"
echo "=== gpu tests (parallel, cap ${CAP}s) $(date +%T)"
i=0
while IFS= read -r id; do
  i=$((i + 1))
  timeout -k 5 "$CAP" $PYT "$id" > $LOGS/fla_$i.log 2>&1 &
done < <(python3 -m pytest --collect-only -q -m gpu -p no:cacheprovider tests/flashkda 2>/dev/null | grep "matches_fla")
timeout -k 5 "$CAP" $PYT tests/flashkda -k "not matches_fla" > $LOGS/rest.log 2>&1 &
# compile (and autotune) the forward profile's kernels beside the tests; the profile itself runs after them
PROFILE_CASES=${KDA_PROFILE_CASES:-H64-T8192 H12-T8192}
for c in $PROFILE_CASES; do
  timeout -k 5 "$CAP" python3 -m benchmarks.kda.profile_fwd --cases "$c" > /dev/null 2>&1 &
done
wait
echo "=== tests done $(date +%T)"
timeout -k 5 "${KDA_PROFILE_CAP:-60}" python3 -m benchmarks.kda.profile_fwd --cases $PROFILE_CASES > $LOGS/profile.txt 2>&1
grep -E "^(H[0-9]|===)" $LOGS/profile.txt
for f in $LOGS/*.log; do
  echo "--- $f: $(grep -c '^PASSED' "$f") passed, $(grep -c '^FAILED\|^ERROR' "$f") failed"
  grep -E "^(PASSED|FAILED|ERROR)|Error|assert" "$f" | head -n 40
done
cat $LOGS/*.log $LOGS/profile.txt > "$OUT/check_round.log"
exit 0
