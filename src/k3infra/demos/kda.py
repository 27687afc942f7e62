"""FlashKDA demo: prefill (varlen, GVA, in-kernel gate) and decode against the fp64 oracle, and fla dispatch.

On CPU the Triton kernels run in Triton's interpreter (small shapes, a few seconds); on a GPU the same checks run
compiled at larger shapes.
"""

from __future__ import annotations

import os
import sys

from k3infra.demos import DemoRow


def _rms(x, ref) -> float:
    x, ref = x.double(), ref.double()
    return ((x - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()


def run(device: str) -> list[DemoRow]:
    if device == "cpu" and "flashkda" not in sys.modules:
        # Triton decides interpreted vs compiled when the kernels are defined, i.e. at flashkda's first import.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    import flashkda
    from flashkda import reference

    gen = torch.Generator().manual_seed(0)
    H, HV, K = 2, 4, 64 if device == "cpu" else 128
    lengths = [70, 0, 130] if device == "cpu" else [1300, 0, 547, 2048]
    T = sum(lengths)
    rn = lambda *s: torch.randn(*s, generator=gen).to(device)  # noqa: E731
    q, k = rn(1, T, H, K).bfloat16(), rn(1, T, H, K).bfloat16()
    v, g, beta = rn(1, T, HV, K).bfloat16(), rn(1, T, HV, K).bfloat16(), rn(1, T, HV).bfloat16()
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    kw = dict(initial_state=rn(len(lengths), HV, K, K) * 0.1, output_final_state=True, use_qk_l2norm_in_kernel=True,
              use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=-5.0,
              A_log=torch.zeros(HV, device=device), dt_bias=rn(HV * K), cu_seqlens=cu.to(device), cu_seqlens_cpu=cu)
    rows = []
    with torch.inference_mode():
        o, s = flashkda.chunk_kda(q, k, v, g, beta, **kw)
        ro, rs = reference.chunk_kda_reference(q, k, v, g, beta, **kw)
    err = max(_rms(o, ro), _rms(s, rs))
    rows.append(DemoRow("kda", f"chunk_kda bf16 varlen {lengths} H{H}->HV{HV} K{K} vs fp64",
                        f"RMS err ratio {err:.1e} (limit 5e-3)", err < 5e-3))

    N = 8
    dq, dk = rn(N, 1, H, K).bfloat16(), rn(N, 1, H, K).bfloat16()
    dv, dg, db = rn(N, 1, HV, K).bfloat16(), rn(N, 1, HV, K).bfloat16(), rn(N, 1, HV).bfloat16()
    dkw = {key: val for key, val in kw.items() if key not in ("cu_seqlens", "cu_seqlens_cpu", "safe_gate")}
    dkw["initial_state"] = rn(N, HV, K, K) * 0.1
    with torch.inference_mode():
        o, s = flashkda.fused_recurrent_kda(dq, dk, dv, dg, db, **dkw)
        ro, rs = reference.chunk_kda_reference(dq, dk, dv, dg, db, **dkw)
    err = max(_rms(o, ro), _rms(s, rs))
    rows.append(DemoRow("kda", f"fused_recurrent_kda decode {N} seqs x 1 token vs fp64",
                        f"RMS err ratio {err:.1e} (limit 5e-3)", err < 5e-3))

    try:
        from inspect import unwrap

        from fla.backends import _function_registries
        from fla.ops.kda import chunk_kda as fla_chunk_kda

        backends = sorted(_function_registries[unwrap(fla_chunk_kda)]._backends)
        ok = "k3_flashkda" in backends or os.environ.get("FLASHKDA_DISABLE") == "1"
        rows.append(DemoRow("kda", "fla.ops.kda.chunk_kda backends after `import fla` only", ", ".join(backends), ok))
    except ImportError:
        rows.append(DemoRow("kda", "fla dispatch", "fla not installed: skipped", True))
    return rows
