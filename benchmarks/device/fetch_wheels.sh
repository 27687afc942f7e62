#!/usr/bin/env bash
# Download the Python wheels the GPU image lacks into .whl/ (git-ignored), to be carried to the device
# machine with `carry: [".whl"]`. The image has torch, triton and einops; fla-core 0.6.0 is our baseline
# (fla.ops) and flash-linear-attention 0.6.0 holds fla.layers (the layer comparisons and the tiny-LM loss check).
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d .whl fla-core==0.6.0 flash-linear-attention==0.6.0
ls -la .whl
