#!/usr/bin/env bash
# Run any set of benchmarks on the GPU machine, one after another, from the repository root.
#
#   bash benchmarks/device/run.sh kda                          # `k3infra bench kda` with its defaults
#   bash benchmarks/device/run.sh kda "kda --decode" ep        # each quoted argument is one `k3infra bench` call
#   bash benchmarks/device/run.sh "ep --tokens 2048" --update-table   # also regenerate their BENCHMARKS.md sections
#   bash benchmarks/device/run.sh -- python3 -m benchmarks.kda.calibrate --modes inference   # any one command
#
# Before the call, on this machine: `bash benchmarks/device/fetch_wheels.sh` (the baselines' wheels into .whl/) and
# `git rev-parse HEAD > .k3_commit`; carry [".whl", ".k3_commit"] (the device copy has no git history, so results
# record the commit from .k3_commit). The script installs the carried wheels into /tmp/site, unpacks the committed
# Triton autotune cache of fla's and our kernels for this GPU (benchmarks/kda/fla-autotune-h200.tgz or -h100.tgz:
# fla's first training call then skips minutes of autotuning), records the machine in $OUT/machine.txt, tees everything to $OUT/log.txt and
# copies the results files this run wrote to $OUT/results/ and the autotune results it added to
# $OUT/autotune-new.tgz. CAP (seconds, default 540) bounds each benchmark.
set -uo pipefail
OUT=${OUT:-/tmp/out}
CAP=${CAP:-540}
mkdir -p "$OUT/results"
if [ $# -eq 0 ]; then
  sed -n '2,14p' "$0"
  exit 2
fi
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
touch /tmp/k3_run_start
[ -f .k3_commit ] && export K3_COMMIT="$(cat .k3_commit)"
export PYTHONPATH="$PWD:$PWD/src:/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton-cache} TRITON_CACHE_AUTOTUNING=1
mkdir -p "$TRITON_CACHE_DIR"
# Triton keys autotune results by architecture, not by card: an H100 and an H200 would share entries
GPU_CACHE=benchmarks/kda/fla-autotune-h200.tgz
nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | grep -q H100 && GPU_CACHE=benchmarks/kda/fla-autotune-h100.tgz
[ -f "$GPU_CACHE" ] && tar -xzf "$GPU_CACHE" -C "$TRITON_CACHE_DIR" 2>/dev/null
{ nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv; python3 -c 'import torch, triton; print(torch.__version__, triton.__version__)'; } > "$OUT/machine.txt" 2>&1

status=0
if [ "$1" = "--" ]; then
  shift
  "$@" 2>&1 | tee "$OUT/log.txt"
  status=${PIPESTATUS[0]}
else
  flags=()
  specs=()
  for arg in "$@"; do
    if [ "$arg" = "--update-table" ]; then flags+=(--update-table); else specs+=("$arg"); fi
  done
  for spec in "${specs[@]}"; do
    read -r -a words <<< "$spec"
    echo "=== k3infra bench ${spec} (cap ${CAP}s) $(date -u +%T)" | tee -a "$OUT/log.txt"
    timeout -k 5 "$CAP" python3 -m k3infra.cli bench "${words[0]}" "${flags[@]}" --quiet -- "${words[@]:1}" 2>&1 \
      | tee -a "$OUT/log.txt"
    rc=${PIPESTATUS[0]}
    echo "=== ${words[0]} rc=$rc" | tee -a "$OUT/log.txt"
    [ "$rc" -ne 0 ] && status=$rc
  done
fi
# only the results this run wrote: $OUT comes back with a limited number of files
find benchmarks/results \( -name '*.json' -o -name '*.png' \) -newer /tmp/k3_run_start -exec cp {} "$OUT/results/" \;
# the autotune results this run added (fla's kernels at new shapes or flags): merge them into
# this GPU's cache here ($GPU_CACHE), so that later calls skip that autotuning
(cd "$TRITON_CACHE_DIR" && find . -name '*.autotune.json' -newer /tmp/k3_run_start | tar -czf "$OUT/autotune-new.tgz" -T - \
  && [ "$(tar -tzf "$OUT/autotune-new.tgz" | wc -l)" -gt 0 ] || rm -f "$OUT/autotune-new.tgz")
[ -f BENCHMARKS.md ] && [ BENCHMARKS.md -nt /tmp/k3_run_start ] && cp BENCHMARKS.md "$OUT/"
exit "$status"
