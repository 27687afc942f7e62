"""Live-tensor memory of one FlashKDA training step on CPU (no GPU): the peak, where it happens, what is alive there.

Every tensor an aten op allocates during the step is tracked (``TorchDispatchMode``): its bytes count from the op
that made it until the last tensor viewing its storage is collected. Outputs that alias an input (views, in-place
ops) allocate nothing. The Triton interpreter writes into tensors allocated by our Python code, so the kernels'
outputs are seen; temporaries inside a single aten kernel are not. The peak is the measure of
``benchmarks.kda.train.peak_extra_mib`` (bytes above what was allocated before the step), at a small shape; per-chunk
tensors scale with ``chunks x heads``, so ``--scale-to B1-T8192-H64`` multiplies by that ratio (per-sequence states
scale otherwise; they are small at the benchmark rows).

Nothing here is timed. Usage::

    TRITON_INTERPRET=1 python -m benchmarks.kda.memory_timeline [--B 1] [--T 256] [--H 4] [--slices N]
        [--scale-to ROW] [--top 25]
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
import weakref
from dataclasses import dataclass, field

os.environ.setdefault("TRITON_INTERPRET", "1")


@dataclass
class _Storage:
    nbytes: int
    where: str
    shape: tuple
    dtype: str
    refs: int = 0


@dataclass
class MemoryTimeline:
    """Live bytes of the tensors allocated inside the mode; ``peak`` and the live set at the peak."""

    live: dict = field(default_factory=dict)
    current: int = 0
    peak: int = 0
    at_peak: list = field(default_factory=list)
    where_peak: str = ""

    def allocate(self, key: int, t, where: str) -> None:
        st = self.live.get(key)
        if st is None:
            st = _Storage(t.untyped_storage().nbytes(), where, tuple(t.shape), str(t.dtype).replace("torch.", ""))
            self.live[key] = st
            self.current += st.nbytes
            if self.current > self.peak:
                self.peak, self.where_peak = self.current, where
                self.at_peak = sorted(((s.nbytes, s.where, s.shape, s.dtype) for s in self.live.values()),
                                      reverse=True)
        st.refs += 1
        weakref.finalize(t, self._release, key)

    def _release(self, key: int) -> None:
        st = self.live.get(key)
        if st is None:
            return
        st.refs -= 1
        if st.refs == 0:
            del self.live[key]
            self.current -= st.nbytes


def _caller() -> str:
    """Innermost frame in flashkda that led to the op: ``file:function:line``."""
    for frame in reversed(traceback.extract_stack(limit=40)):
        if "/flashkda/" in frame.filename and "memory_timeline" not in frame.filename:
            return f"{os.path.basename(frame.filename)}:{frame.name}:{frame.lineno}"
    return "?"


def track(fn):
    """Runs ``fn()`` under the tracker; returns ``(fn's result, MemoryTimeline)``."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    timeline = MemoryTimeline()

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            ins = {x.untyped_storage().data_ptr() for x in tree_flatten((args, kwargs))[0]
                   if isinstance(x, torch.Tensor)}
            for t in tree_flatten(out)[0]:
                if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                    continue
                key = t.untyped_storage().data_ptr()
                if key in ins and key not in timeline.live:
                    continue  # a view of / write into memory from before the step
                if key in timeline.live or t.untyped_storage().nbytes():
                    timeline.allocate(key, t, _caller())
            return out

    with Mode():
        result = fn()
    return result, timeline


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--B", type=int, default=1)
    parser.add_argument("--T", type=int, default=256)
    parser.add_argument("--H", type=int, default=4)
    parser.add_argument("--slices", type=int, default=None, help="force the backward's head-slice count")
    parser.add_argument("--scale-to", default=None, help="a training row (benchmarks.kda.train.TRAIN_CASES)")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    import torch

    from benchmarks.kda.train import TRAIN_CASES, make_inputs, step
    from flashkda.chunk import chunk_kda_autograd

    def ours(q, k, v, g, beta, **kw):
        # a GPU's bf16 backward (dot_precision "tf32": the fused gate chain), also in the interpreter
        return chunk_kda_autograd(q, k, v, g, beta, scale=q.shape[-1] ** -0.5, dot_precision="tf32",
                                  head_slices=args.slices, **kw)

    x, extra = make_inputs(args.B, args.T, args.H, None, "cpu")
    do = torch.randn(args.B, args.T, args.H, 128, dtype=torch.bfloat16)
    dht = torch.randn(args.B, args.H, 128, 128)
    _, timeline = track(lambda: step(ours, x, extra, do, dht))
    scale = 1.0
    if args.scale_to:
        c = TRAIN_CASES[args.scale_to]
        scale = (c["B"] * -(-c["T"] // 64) * c["H"]) / (args.B * -(-args.T // 64) * args.H)
    mib = 2**20 / scale
    print(f"B{args.B} T{args.T} H{args.H} D128 bf16, slices {args.slices or 'rule'}: peak {timeline.peak / 2**20:.2f} "
          f"MiB at {timeline.where_peak}" + (f" (x{scale:.0f} = {timeline.peak / mib:.0f} MiB at {args.scale_to})"
                                             if scale != 1.0 else ""))
    print(f"{'MiB' + (' scaled' if scale != 1.0 else ''):>12}  {'allocated at':<48} {'dtype':<9} shape")
    for nbytes, where, shape, dtype in timeline.at_peak[: args.top]:
        print(f"{nbytes / mib:>12.1f}  {where:<48} {dtype:<9} {list(shape)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
