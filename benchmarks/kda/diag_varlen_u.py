"""GPU diagnostic: which forward stage misbehaves at varlen when ``u`` is kept in fp32 (docs/flashkda-performance.md).

The same data runs twice through each stage of the forward (``chunk_kda_fwd_intra``, ``state_pass``,
``state_output``): as ``B`` sequences of ``T`` tokens and as one varlen batch of the same ``B`` sequences (``T`` a
multiple of the chunk, so both runs have the same chunks in the same order). Every stored intermediate of the two runs
should agree to rounding; the first stage where they do not is the one to fix. Each stage is also checked in fp64
against the previous stage's stored outputs, and ``o`` against the fp64 recurrence.

    python -m benchmarks.kda.diag_varlen_u [--B 8] [--T 1024] [--H 64]
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.harness import rms_ratio
from flashkda.fwd.chunk_fwd import dot_precision_for, work_dtype_for
from flashkda.fwd.intra import CHUNK_SIZE, chunk_kda_fwd_intra
from flashkda.fwd.output import state_output
from flashkda.fwd.state import state_pass
from flashkda.index import build_chunk_index
from flashkda.reference import chunk_kda_reference

#: The inputs laid out ``[B, T, ...]`` (reshaped to one varlen sequence batch); the others are per head or sequence.
SEQ_TENSORS = ("q", "k", "v", "g", "beta")


def run_stages(x: dict, B: int, T: int, varlen: bool, fp32_u: bool, o_config=None, o_hilo=None):
    """The three forward stages on ``x`` (``[B, T, ...]`` tensors), as ``B`` sequences or one varlen batch."""
    H, D = x["q"].shape[2], x["q"].shape[3]
    if varlen:
        x = {n: t.reshape(1, B * T, *t.shape[2:]) if n in SEQ_TENSORS else t
             for n, t in x.items()}
        cu = torch.arange(0, B * T + 1, T, device=x["q"].device, dtype=torch.int64)
        index = build_chunk_index(1, B * T, cu, CHUNK_SIZE)
    else:
        index = build_chunk_index(B, T, None, CHUNK_SIZE)
    dtype = x["q"].dtype
    w, u, qg, kg, Aqk, gC = chunk_kda_fwd_intra(
        x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"], D**-0.5, -5.0, True, True, True, False,
        True, index, work_dtype_for(dtype), dot_precision_for(dtype), fp32_u=fp32_u)
    ht = torch.empty(B, H, D, D, dtype=torch.float32, device=w.device)
    h, vn = state_pass(w, u, kg, gC, x["initial_state"], ht, False, index, dot_precision_for(dtype))
    o = torch.empty(*w.shape[:3], D, dtype=dtype, device=w.device)
    state_output(qg, Aqk, h, vn, o, index, dot_precision_for(dtype), D, o_config, o_hilo)
    shaped = lambda t: t.reshape(B, T, *t.shape[2:])  # noqa: E731
    rows = torch.arange(Aqk.shape[1], device=Aqk.device) % CHUNK_SIZE
    Aqk = torch.where(rows[:, None, None] >= torch.arange(CHUNK_SIZE, device=Aqk.device), Aqk, 0)  # unwritten above
    return dict(w=shaped(w), u=shaped(u), qg=shaped(qg), kg=shaped(kg), Aqk=shaped(Aqk), gC=gC[: B * T // CHUNK_SIZE],
                h=h[: B * T // CHUNK_SIZE], vn=shaped(vn), o=shaped(o), ht=ht)


def check_output_stage(s: dict, B: int, T: int) -> float:
    """``o = qg h + tril(Aqk) v_new`` in fp64 from the stored stage inputs, against the stored ``o``."""
    C = CHUNK_SIZE
    NCs = T // C
    qg = s["qg"].double().reshape(B, NCs, C, *s["qg"].shape[2:])  # [B, NCs, C, H, K]
    vn = s["vn"].double().reshape(B, NCs, C, *s["vn"].shape[2:])
    A = s["Aqk"].double().reshape(B, NCs, C, s["Aqk"].shape[2], C)
    mask = torch.tril(torch.ones(C, C, dtype=torch.bool, device=A.device))
    A = torch.where(mask, A.permute(0, 1, 3, 2, 4), 0.0)  # [B, NCs, H, C, C]; the upper triangle is unwritten
    h = s["h"].double().reshape(B, NCs, *s["h"].shape[1:])  # [B, NCs, H, K, V]
    o = torch.einsum("bnchk,bnhkv->bnchv", qg, h) + torch.einsum("bnhij,bnjhv->bnihv", A, vn)
    return rms_ratio(s["o"].reshape(o.shape), o)


def check_state_stage(s: dict, B: int, T: int, h0: torch.Tensor) -> tuple[float, float]:
    """The chunk recurrence in fp64 from the stored w, u, kg, gC: ``v_new = u - w S``,
    ``S <- Diag(e^gC) S + kgᵀ v_new``; returns the relative errors of the stored h and v_new."""
    C = CHUNK_SIZE
    NCs = T // C
    w, u, kg = (s[n].double().reshape(B, NCs, C, *s[n].shape[2:]) for n in ("w", "u", "kg"))
    gC = s["gC"].double().reshape(B, NCs, *s["gC"].shape[1:])  # [B, NCs, H, K]
    S = h0.double().clone()  # [B, H, K, V]
    hs, vns = [], []
    for c in range(NCs):
        hs.append(S.clone())
        vn = u[:, c] - torch.einsum("bchk,bhkv->bchv", w[:, c], S)
        vns.append(vn)
        S = torch.exp(gC[:, c])[..., None] * S + torch.einsum("bchk,bchv->bhkv", kg[:, c], vn)
    h = torch.stack(hs, 1).reshape(s["h"].shape)
    vn = torch.stack(vns, 1).reshape(s["vn"].shape)
    return rms_ratio(s["h"], h), rms_ratio(s["vn"], vn)


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--B", type=int, default=8)
    p.add_argument("--T", type=int, default=1024)
    p.add_argument("--H", type=int, default=64)
    p.add_argument("--D", type=int, default=128)
    p.add_argument("--o-configs", action="store_true",
                   help="also run the output kernel in every forced configuration (fp32 u, fixed and varlen)")
    a = p.parse_args(argv)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=dev).manual_seed(0)
    rn = lambda *s, dt=torch.bfloat16: torch.randn(*s, generator=gen, device=dev).to(dt)  # noqa: E731
    B, T, H, D = a.B, a.T, a.H, a.D
    x = dict(q=rn(B, T, H, D), k=rn(B, T, H, D), v=rn(B, T, H, D), g=rn(B, T, H, D), beta=rn(B, T, H),
             A_log=torch.log(torch.empty(H, device=dev).uniform_(1, 16, generator=gen)),
             dt_bias=rn(H * D, dt=torch.float32), initial_state=rn(B, H, D, D, dt=torch.float32) * 0.1)
    ref_o, ref_ht = chunk_kda_reference(
        *(x[n].double() for n in ("q", "k", "v", "g", "beta")), D**-0.5, x["initial_state"].double(), True,
        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=-5.0,
        A_log=x["A_log"].double(), dt_bias=x["dt_bias"].double())
    runs = {}
    for fp32_u in (False, True):
        for varlen in (False, True):
            name = f"{'fp32' if fp32_u else 'bf16'}-u {'varlen' if varlen else 'fixed'}"
            s = runs[name] = run_stages(x, B, T, varlen, fp32_u)
            eh, ev = check_state_stage(s, B, T, x["initial_state"])
            per_chunk = ((s["o"].double() - ref_o).reshape(B, T // CHUNK_SIZE, -1).pow(2).mean((0, 2)).sqrt()
                         / ref_o.pow(2).mean().sqrt())
            print(f"{name:18s} o vs fp64 {rms_ratio(s['o'], ref_o):.2e}  ht {rms_ratio(s['ht'], ref_ht):.2e}  "
                  f"state stage h {eh:.2e} v_new {ev:.2e}  output stage {check_output_stage(s, B, T):.2e}  "
                  f"o error by chunk of the sequence: {' '.join(f'{e:.1e}' for e in per_chunk.tolist())}", flush=True)
        fixed, var = runs[f"{'fp32' if fp32_u else 'bf16'}-u fixed"], runs[f"{'fp32' if fp32_u else 'bf16'}-u varlen"]
        names = ("w", "u", "qg", "kg", "Aqk", "gC", "h", "vn", "o", "ht")
        print("  varlen vs fixed, same data: " + "  ".join(f"{n} {rms_ratio(var[n], fixed[n]):.1e}" for n in names),
              flush=True)

    if a.o_configs:
        from flashkda.fwd.output import O_CONFIGS

        for cfg in O_CONFIGS:
            for hilo in (False, True):
                errs = []
                for varlen in (False, True):
                    s = run_stages(x, B, T, varlen, True, o_config=cfg, o_hilo=hilo)
                    errs.append(check_output_stage(s, B, T))
                print(f"output kernel BV:BK:warps {':'.join(map(str, cfg))} hilo {hilo}: fp32-u output stage "
                      f"fixed {errs[0]:.2e} varlen {errs[1]:.2e}", flush=True)


if __name__ == "__main__":
    main()
