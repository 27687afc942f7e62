#!/usr/bin/env bash
# Source on the GPU machine to make MoonshotAI's CUTLASS FlashKDA (`import flash_kda`, fla's `flash_kda` backend)
# importable, so calibration and dispatch runs time it as a competitor:
#   bash benchmarks/device/run.sh -- bash -c 'source benchmarks/device/cutlass_flashkda.sh && k3infra bench kda -- --calibrate'
# Needs, carried in the git-ignored .thirdparty/FlashKDA (never committed): MoonshotAI/FlashKDA's source at the commit
# docs/flashkda.md names, with CUTLASS's include/, tools/util/include/ and examples/common/ headers in its cutlass
# folder. Builds the extension (about 2 minutes) unless a built flash_kda_C*.so or its .so.gz from an earlier call is
# there; the built .so goes to $OUT gzipped (the raw file is over what comes back), to carry next time.
FLASHKDA_SRC=${FLASHKDA_SRC:-$PWD/.thirdparty/FlashKDA}
for gz in "$FLASHKDA_SRC"/flash_kda_C*.so.gz; do [ -f "$gz" ] && gunzip -kf "$gz" && echo "unpacked $gz"; done
if ! ls "$FLASHKDA_SRC"/flash_kda_C*.so >/dev/null 2>&1; then
  mkdir -p /tmp/nogit && printf '#!/bin/sh\nexit 0\n' > /tmp/nogit/git && chmod +x /tmp/nogit/git
  t0=$SECONDS
  (cd "$FLASHKDA_SRC" && PATH=/tmp/nogit:$PATH FLASH_KDA_VERSION_SUFFIX=.post0 FLASH_KDA_CUDA_ARCHS=90a NVCC_THREADS=8 \
    MAX_JOBS=2 python3 setup.py build_ext --inplace) > "${OUT:-/tmp/out}/cutlass_build.log" 2>&1
  echo "CUTLASS FlashKDA build: exit $? in $((SECONDS - t0)) s (log: cutlass_build.log)"
  for so in "$FLASHKDA_SRC"/flash_kda_C*.so; do [ -f "$so" ] && gzip -c "$so" > "${OUT:-/tmp/out}/$(basename "$so").gz"; done
fi
export PYTHONPATH="$FLASHKDA_SRC${PYTHONPATH:+:$PYTHONPATH}"
python3 -c 'import flash_kda; print("flash_kda importable")' || echo "flash_kda NOT importable: competitors exclude it"
