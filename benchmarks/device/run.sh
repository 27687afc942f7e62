#!/usr/bin/env bash
# Runs on the device machine, from the repository root, with .whl carried:
#   bash benchmarks/device/run.sh <command...>
# Installs the carried wheels into /tmp/site, puts src/ and the repo on PYTHONPATH, records the machine in
# $OUT/machine.txt, then runs the command with its output teed to $OUT/log.txt. The device copy has no git
# history: before the call run `git rev-parse HEAD > .k3_commit` here and carry [".whl", ".k3_commit"] so
# results record the commit they were measured at.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
touch /tmp/k3_run_start
[ -f .k3_commit ] && export K3_COMMIT="$(cat .k3_commit)"
export PYTHONPATH="$PWD:$PWD/src:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
{ nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv; python3 -c 'import torch, triton; print(torch.__version__, triton.__version__)'; } > "$OUT/machine.txt" 2>&1
"$@" 2>&1 | tee "$OUT/log.txt"
status=${PIPESTATUS[0]}
# only the results this run wrote: $OUT comes back with a limited number of files
mkdir -p "$OUT/results"
find benchmarks/results -name '*.json' -newer /tmp/k3_run_start -exec cp {} "$OUT/results/" \;
exit "$status"
