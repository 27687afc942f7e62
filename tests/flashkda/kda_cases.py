"""Input builders and error metrics shared by the FlashKDA tests."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from flashkda import reference


def rms_ratio(x: torch.Tensor, ref: torch.Tensor) -> float:
    """RMS of the error over RMS of the reference (fla's ``assert_close`` metric)."""
    x, ref = x.double(), ref.double()
    return ((x - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-30)).item()


def assert_close(name: str, ref: torch.Tensor, x: torch.Tensor, ratio: float) -> None:
    assert x.shape == ref.shape, f"{name}: shape {tuple(x.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(x).all(), f"{name}: NaN or inf"
    err = rms_ratio(x, ref)
    assert err <= ratio, f"{name}: RMS error ratio {err:.3e} > {ratio:.1e}"


#: Tolerances of the issue (RMS error ratio against the fp64 oracle).
TOL = {torch.bfloat16: 5e-3, torch.float16: 5e-3, torch.float32: 1e-5}


@dataclass(frozen=True)
class KDACase:
    """One call of chunk_kda: shapes, dtype and feature flags."""

    B: int = 1
    T: int = 64
    H: int = 1
    HV: int = 1
    K: int = 64
    V: int = 64
    dtype: torch.dtype = torch.float32
    lengths: tuple[int, ...] | None = None
    gate: str = "pre"  # "pre" (precomputed log decay), "softplus", "bounded", "bounded-noA"
    l2norm: bool = True
    beta_logits: bool = False
    neg_eig: bool = False
    h0: bool = True
    final: bool = True
    v_first: bool = False
    kwargs: dict = field(default_factory=dict)

    def id(self) -> str:
        lens = f"-cu{list(self.lengths)}" if self.lengths else ""
        return (f"B{self.B}-T{self.T}-H{self.H}-HV{self.HV}-K{self.K}-V{self.V}-{str(self.dtype)[6:]}-{self.gate}"
                f"{lens}{'-vfirst' if self.v_first else ''}{'-logits' if self.beta_logits else ''}"
                f"{'-neg' if self.neg_eig else ''}{'' if self.h0 else '-noh0'}")


def make_call(c: KDACase, device: str, seed: int = 0) -> tuple[tuple, dict]:
    """Positional inputs (q, k, v, g, beta) and chunk_kda keyword arguments for a case."""
    gen = torch.Generator().manual_seed(seed)

    def rn(*shape):
        return torch.randn(*shape, generator=gen)

    q, k, v = rn(c.B, c.T, c.H, c.K), rn(c.B, c.T, c.H, c.K), rn(c.B, c.T, c.HV, c.V)
    if not c.l2norm:
        q, k = reference.l2norm(q).float(), reference.l2norm(k).float()
    kw: dict = dict(use_qk_l2norm_in_kernel=c.l2norm, output_final_state=c.final, state_v_first=c.v_first)
    if c.gate == "pre":
        g = F.logsigmoid(rn(c.B, c.T, c.HV, c.K) + 2.0)
    else:
        g = rn(c.B, c.T, c.HV, c.K) * 2
        kw.update(use_gate_in_kernel=True, dt_bias=rn(c.HV * c.K))
        if c.gate != "bounded-noA":
            kw["A_log"] = torch.rand(c.HV, generator=gen) * 2 - 1
        if c.gate.startswith("bounded"):
            kw.update(lower_bound=-5.0, safe_gate=True)
    if c.beta_logits:
        beta = rn(c.B, c.T, c.HV)
        kw.update(use_beta_sigmoid_in_kernel=True, allow_neg_eigval=c.neg_eig)
    else:
        beta = torch.rand(c.B, c.T, c.HV, generator=gen)
    N = len(c.lengths) if c.lengths else c.B
    if c.h0:
        shape = (N, c.HV, c.V, c.K) if c.v_first else (N, c.HV, c.K, c.V)
        kw["initial_state"] = (rn(*shape) * 0.5).to(device)
    if c.lengths:
        cu = torch.tensor([0, *torch.tensor(c.lengths).cumsum(0).tolist()], dtype=torch.int64)
        kw.update(cu_seqlens=cu.to(device), cu_seqlens_cpu=cu)
    for name in ("A_log", "dt_bias"):
        if name in kw:
            kw[name] = kw[name].to(device)
    kw.update(c.kwargs)
    args = tuple(x.to(device=device, dtype=c.dtype) for x in (q, k, v)) + (g.to(device), beta.to(device))
    return args, kw
