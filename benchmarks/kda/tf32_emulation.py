"""The v1 backward's gradient error from tf32 dot inputs, reproduced on the CPU and attributed to the dots causing it.

On a GPU, bf16 callers of the v1 training path run the backward's ``tl.dot``s at ``input_precision="tf32"`` (inputs
rounded to 10 mantissa bits) and the fused gate chain; the exact path (``dot_precision="ieee"``) is the reference.
Triton's CPU interpreter ignores the input precision, so this tool rounds the inputs of every dot that asks for
``"tf32"`` to tf32 itself (round to nearest even on the 13 dropped bits) and computes every ``"tf32x3"`` dot as its
three tf32 products, then reports each gradient's relative error against the exact path:

- ``fused tf32``: the GPU default, every tf32 dot rounded (the gated-dots kernel's diagonal blocks ask for
  ``"tf32x3"``);
- ``diagonal blocks at plain tf32``: those four products at ``"tf32"`` too, the error their ``"tf32x3"`` removes;
- one line per group of dot sites (kernel function and line) computed exactly instead, or at ``tf32x3``
  (``--x3``), which says where the error comes from; ``--per-site`` also tries each site alone.

Runs on the CPU only (`main` sets ``TRITON_INTERPRET=1`` before Triton is imported; `study` needs it set) and writes
no results file: it diagnoses accuracy, it times nothing. Usage: ``python -m benchmarks.kda.tf32_emulation [--T 160]
[--heads 2] [--head-dim 128] [--seed 12] [--x3] [--per-site]``.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch

GRADS = ("q", "k", "v", "g", "beta", "A_log", "dt_bias")


def round_to_tf32(x: np.ndarray) -> np.ndarray:
    """fp32 values rounded to nearest (ties to even) with a 10-bit mantissa, as a tf32 tensor-core input."""
    bits = x.view(np.uint32).astype(np.uint64)
    keep = (bits >> 13) & 1
    bits = ((bits + 0xFFF + keep) & 0xFFFFE000).astype(np.uint32)
    return bits.view(np.float32)


class Tf32Dots:
    """Patches the interpreter's dot so that fp32 inputs of ``"tf32"`` dots are rounded, except at the sites in
    ``exact`` (computed in fp32, or as three tf32 products with ``x3``), and ``"tf32x3"`` dots are computed as their
    three tf32 products, except at the sites in ``plain`` (one tf32 product). Records every site it sees in
    ``sites``."""

    def __init__(self):
        import triton.runtime.interpreter as interpreter

        self.interpreter = interpreter
        self.original = interpreter.InterpreterBuilder.create_dot
        self.sites: set[str] = set()
        self.exact: set[str] = set()
        self.plain: set[str] = set()
        self.x3 = False
        self.enabled = True

    def __enter__(self):
        patch = self

        def create_dot(builder, a, b, d, input_precision, max_num_imprecise_acc):
            site = _site()
            patch.sites.add(site)
            precision = str(input_precision).lower().split(".")[-1]
            if precision == "tf32x3" and site in patch.plain:
                precision = "tf32"
            fp32 = a.data.dtype == np.float32 and b.data.dtype == np.float32
            if not (patch.enabled and precision in ("tf32", "tf32x3") and fp32):
                return patch.original(builder, a, b, d, input_precision, max_num_imprecise_acc)
            handle = patch.interpreter.TensorHandle
            if precision == "tf32x3" or (site in patch.exact and patch.x3):
                ah, bh = round_to_tf32(a.data), round_to_tf32(b.data)
                al, bl = round_to_tf32(a.data - ah), round_to_tf32(b.data - bh)
                out = sum(np.matmul(x, y, dtype=np.float32) for x, y in ((ah, bh), (ah, bl), (al, bh)))
                return handle(out + d.data, d.dtype.scalar)
            if site not in patch.exact:
                a = handle(round_to_tf32(a.data), a.dtype.scalar)
                b = handle(round_to_tf32(b.data), b.dtype.scalar)
            return patch.original(builder, a, b, d, input_precision, max_num_imprecise_acc)

        self.interpreter.InterpreterBuilder.create_dot = create_dot
        return self

    def __exit__(self, *exc):
        self.interpreter.InterpreterBuilder.create_dot = self.original


def _site() -> str:
    """``file:function:line`` of the innermost ``flashkda`` frame calling the dot."""
    frame = sys._getframe(2)
    while frame is not None and f"{os.sep}flashkda{os.sep}" not in frame.f_code.co_filename:
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_name}:{frame.f_lineno}"


def make_case(T: int, heads: int, head_dim: int, seed: int) -> tuple[dict, torch.Tensor]:
    """bf16 inputs of three sequences (``T // 2 - 10``, 1 and the rest tokens) with the bounded in-kernel gate,
    fp32 ``A_log``/``dt_bias``, and the output gradient."""
    gen = torch.Generator().manual_seed(seed)
    shape = (1, T, heads, head_dim)
    x = {n: torch.randn(*shape, generator=gen) for n in ("q", "k", "v", "g")}
    x["beta"] = torch.randn(1, T, heads, generator=gen)
    x = {n: t.to(torch.bfloat16).requires_grad_() for n, t in x.items()}
    x["A_log"] = torch.log(torch.empty(heads).uniform_(1, 4, generator=gen)).requires_grad_()
    x["dt_bias"] = (0.5 * torch.randn(heads * head_dim, generator=gen)).requires_grad_()
    first = max(T // 2 - 10, 1)
    x["cu_seqlens"] = torch.tensor([0, first, first + 1, T])
    do = torch.randn(*shape, generator=gen).to(torch.bfloat16)
    return x, do


def gradients(x: dict, do: torch.Tensor, dot_precision: str) -> tuple[torch.Tensor, ...]:
    """The seven gradients of ``sum(o * do)`` through ``chunk_kda_autograd`` at ``dot_precision``."""
    from flashkda.chunk import chunk_kda_autograd

    K = x["q"].shape[-1]
    o, _ = chunk_kda_autograd(x["q"], x["k"], x["v"], x["g"], x["beta"], scale=K**-0.5, cu_seqlens=x["cu_seqlens"],
                              A_log=x["A_log"], dt_bias=x["dt_bias"], use_qk_l2norm_in_kernel=True,
                              use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, safe_gate=True,
                              lower_bound=-5.0, dot_precision=dot_precision)
    return torch.autograd.grad((o.float() * do.float()).sum(), [x[n] for n in GRADS])


def relative_errors(grads, reference) -> dict[str, float]:
    return {n: ((a.double() - b.double()).norm() / b.double().norm()).item()
            for n, a, b in zip(GRADS, grads, reference)}


def study(T: int = 160, heads: int = 2, head_dim: int = 128, seed: int = 12, x3: bool = False,
          per_site: bool = False) -> dict[str, dict[str, float]]:
    """Relative errors per configuration (``"fused tf32"``, ``"diagonal blocks at plain tf32"``, then one per group
    of exact sites with the diagonal blocks at plain tf32), as the module
    docstring describes; under ``TRITON_INTERPRET=1`` only (RuntimeError otherwise)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("tf32_emulation.study needs TRITON_INTERPRET=1 set before Triton is imported")
    x, do = make_case(T, heads, head_dim, seed)
    with Tf32Dots() as dots:
        dots.enabled = False
        reference = gradients(x, do, "ieee")
        dots.enabled = True
        out = {"fused tf32": relative_errors(gradients(x, do, "tf32"), reference)}
        sites = sorted(s for s in dots.sites if s.startswith("gated_dots.py"))
        dots.plain = {s for s in sites if "_diag_block" in s}
        out["diagonal blocks at plain tf32"] = relative_errors(gradients(x, do, "tf32"), reference)
        groups = {"gated-dots kernel, all dots": set(sites),
                  "gated-dots diagonal blocks": {s for s in sites if "_diag_block" in s},
                  "gated-dots off-diagonal blocks": {s for s in sites if "_diag_block" not in s}}
        if per_site:
            groups.update({s: {s} for s in sites})
        dots.x3 = x3
        for label, group in groups.items():
            dots.exact = group
            out[f"{label} {'tf32x3' if x3 else 'exact'}"] = relative_errors(gradients(x, do, "tf32"), reference)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--T", type=int, default=160, help="tokens (default 160)")
    parser.add_argument("--heads", type=int, default=2, help="heads (default 2)")
    parser.add_argument("--head-dim", type=int, default=128, help="K = V (default 128)")
    parser.add_argument("--seed", type=int, default=12)
    parser.add_argument("--x3", action="store_true", help="the chosen sites at tf32x3 instead of exact")
    parser.add_argument("--per-site", action="store_true", help="also each gated-dots site alone")
    args = parser.parse_args(argv)
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if args.T < 4 or args.heads < 1 or args.head_dim not in (32, 64, 128):
        parser.error(f"need --T >= 4, --heads >= 1 and --head-dim 32, 64 or 128; got {args.T}, {args.heads}, "
                     f"{args.head_dim}")
    rows = study(args.T, args.heads, args.head_dim, args.seed, args.x3, args.per_site)
    print(f"{'relative error vs the exact path':48s}" + "".join(f"{n:>9s}" for n in GRADS))
    for label, errors in rows.items():
        print(f"{label:48s}" + "".join(f"{errors[n]:9.5f}" for n in GRADS))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
