# Sourced by the FlashKDA device-round scripts: `source benchmarks/kda/round_env.sh NAME`.
# Sets $OUT (default /tmp/out) and $LOGS (/tmp/NAME, created), keeps Triton's on-disk cache in $TRITON_CACHE_DIR
# (default .triton-cache, git-ignored; a warm machine keeps it between calls) with autotune results cached
# (TRITON_CACHE_AUTOTUNING=1; a script that wants autotuning redone sets 0 after this), unbuffered Python, and unpacks
# any carried cache archive (.triton-cache.tgz, .triton-cache-train.tgz, .fla-autotune.tgz) into the cache, after the
# committed benchmarks/kda/fla-autotune-h200.tgz (Triton autotune results of fla's and our kernels at the training and
# prefill rows, packed by the 2026-12-02 22:29 UTC round on an H200 with Triton 3.6: fla's first training call then
# skips up to ~175 s of autotuning per head count; entries whose kernel source changed simply do not match).
OUT=${OUT:-/tmp/out}
LOGS=/tmp/${1:?round name}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton-cache} TRITON_CACHE_AUTOTUNING=1 PYTHONUNBUFFERED=1
mkdir -p "$TRITON_CACHE_DIR" "$LOGS"
for f in benchmarks/kda/fla-autotune-h200.tgz .triton-cache.tgz .triton-cache-train.tgz .fla-autotune.tgz; do
  [ -f "$f" ] && tar -xzf "$f" -C "$TRITON_CACHE_DIR" 2>/dev/null && echo "unpacked $f"
done

# start_train_warmups CAP ROW...: in the background (the caller waits), one untimed first call of fla per training
# row (own process and log A_fla_ROW.log: fla autotunes per shape), fla's tiny-LM layers (A_fla_lm.log) and ours at
# every row (A_ours.log), each under `timeout CAP`, so the timed phase finds Triton's on-disk cache filled.
start_train_warmups() {
  local cap=$1 row
  shift
  for row in "$@"; do
    timeout -k 5 "$cap" python3 -m benchmarks.kda.train --warmup fla --steps 0 --cases "$row" > "$LOGS/A_fla_$row.log" 2>&1 &
  done
  timeout -k 5 "$cap" python3 -m benchmarks.kda.train --warmup fla --cases > "$LOGS/A_fla_lm.log" 2>&1 &
  timeout -k 5 "$cap" python3 -m benchmarks.kda.train --warmup ours --cases "$@" > "$LOGS/A_ours.log" 2>&1 &
}

# start_fwd_warmups CAP: in the background (the caller waits), one untimed pass of every forward row, one process per
# head count (fla compiles per head count; logs A_h64.log, A_h96.log, A_h12.log, A_h32.log), under `timeout CAP`.
start_fwd_warmups() {
  local cap=$1
  local pass="python3 -m benchmarks.kda.run --no-write --rep 1 --cases"
  timeout -k 5 "$cap" $pass H64-T8192 H64-varlen6 H64-varlen1024x8 H64-T32768 > "$LOGS/A_h64.log" 2>&1 &
  timeout -k 5 "$cap" $pass H96-T8192 H96-varlen6 H96-varlen1024x8 > "$LOGS/A_h96.log" 2>&1 &
  timeout -k 5 "$cap" $pass H12-T8192 > "$LOGS/A_h12.log" 2>&1 &
  timeout -k 5 "$cap" $pass H32-T131072 decode-B256-H32 > "$LOGS/A_h32.log" 2>&1 &
}
