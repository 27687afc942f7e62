"""Byte, FLOP and saved-memory counts of the planned v2 training path (forward + backward) per anchor row.

Arithmetic only (no GPU, no torch): ``python benchmarks/kda/v2_bwd_floor.py`` prints the markdown tables of
``docs/flashkda-v2-backward.md``. The kernels and what each moves are described there; the counts here follow it.
"""

from __future__ import annotations

from dataclasses import dataclass

BF16 = 2
FP32 = 4
HBM_BYTES_PER_S = 4.8e12
TC_FLOP_PER_S = 990e12
FLA_CHUNK = 64


@dataclass(frozen=True)
class Row:
    """One training anchor row: ``N`` sequences of ``seq_len`` tokens (``B * T`` tokens in all)."""

    name: str
    tokens: int
    seq_len: int
    H: int  # q/k heads
    HV: int  # value heads (GVA when HV > H)
    D: int  # K = V
    chunk: int  # 32 for fixed length, 16 for varlen (the forward v2 default)
    fla_ms: float | None = None  # fla 0.6.0 fwd+bwd on the H200 (issue's table), None when not run

    @property
    def seqs(self) -> int:
        return self.tokens // self.seq_len


ROWS = (
    Row("B1 T8192 H64", 8192, 8192, 64, 64, 128, 32, 8.44),
    Row("B8 T4096 H32", 32768, 4096, 32, 32, 128, 32, 16.26),
    Row("B1 T32768 H32", 32768, 32768, 32, 32, 128, 32, 18.52),
    Row("varlen 1k x 8 H64", 8192, 1024, 64, 64, 128, 16, 8.45),
    Row("GVA H16 HV64 T8192", 8192, 8192, 16, 64, 128, 32),
    Row("K=V=64 H64 T8192", 8192, 8192, 64, 64, 64, 32),
)


def workspace_bytes(D: int, C: int) -> float:
    """K1's workspace per token and value head: kd, qd, kr bf16; INV, Mqk bf16 tiles; 2^Glast fp32; beta fp32."""
    return 3 * D * BF16 + 2 * C * BF16 + D * FP32 / C + FP32


def checkpoint_bytes(D: int, every_tokens: int, dtype_bytes: int = BF16) -> float:
    """One ``[D, D]`` state per ``every_tokens`` tokens, per token and value head."""
    return D * D * dtype_bytes / every_tokens


def fla_saved_bytes(r: Row) -> float:
    """fla 0.6.0 ``ChunkKDAFunction`` saves beyond its inputs, per token (``use_qk_l2norm_in_kernel``,
    ``use_gate_in_kernel``, ``use_beta_sigmoid_in_kernel``, ``disable_recompute=False``): the normed q, k (bf16),
    their fp32 rstd, the sigmoided beta, Aqk and Akk (``[.., HV, 64]`` bf16)."""
    return 2 * r.H * r.D * BF16 + 2 * r.H * FP32 + r.HV * BF16 + 2 * r.HV * FLA_CHUNK * BF16


def counts(r: Row, every_tokens: int = 128) -> dict[str, float]:
    """Bytes (total, B) and tensor-core FLOPs of the compulsory traffic and of each planned kernel."""
    D, C, H, HV, T, N = r.D, r.chunk, r.H, r.HV, r.tokens, r.seqs
    qk = 2 * H * D * BF16  # q and k (or dq and dk) per token
    vg = 2 * HV * D * BF16
    io = HV * D * BF16  # o or do or v
    beta = HV * BF16
    state = N * HV * D * D * FP32
    ws = workspace_bytes(D, C) * HV
    ck = checkpoint_bytes(D, every_tokens) * HV
    ds = D * D * BF16 / C * HV  # dS at every chunk end
    c = {
        "compulsory fwd": T * (qk + vg + beta + io) + 2 * state,
        "compulsory bwd": T * 2 * (qk + vg + beta) + T * io + 3 * state,
        "F1 K1": T * (qk + HV * D * BF16 + beta + ws),
        "F2 K2+ck": T * (ws + 2 * io + ck) + 2 * state,
        "B0 K1": T * (qk + HV * D * BF16 + beta + ws),
        "B2 dS chain": T * (ws + io + ds) + 2 * state,
        "B3 local": T * (ck + ws + 2 * io + ds + qk + HV * D * BF16 + beta) + T * (qk + vg + beta),
    }
    chunks = T / C
    k1 = (2 * C * C * D + 6 * C**3) if C == 16 else (6 * 16 * 16 * D + 14 * 16**3)
    k2 = 3 * C * D * D + 2 * C * C * D
    b3 = 6 * C * D * D + 10 * C * C * D + 2 * C**3
    macs = {"F1 K1": k1, "F2 K2+ck": k2, "B0 K1": k1, "B2 dS chain": k2, "B3 local": b3}
    for name, m in macs.items():
        c[name + " flop"] = 2 * m * chunks * HV
    c["serial steps"] = r.seq_len / C
    return c


def _ms(nbytes: float) -> float:
    return nbytes / HBM_BYTES_PER_S * 1e3


def floor_table(every_tokens: int = 128) -> str:
    """Markdown: per row, the compulsory and the planned bytes and FLOPs, and their times at the H200's roofs."""
    out = ["| row | tokens x HV (M) | compulsory GB | floor ms | plan fwd GB | plan bwd GB | plan GB | plan bytes ms"
           " | plan GFLOP | plan flop ms | serial steps (fwd, B2) | fla ms | 1.2x target ms |",
           "|---" * 13 + "|"]
    for r in ROWS:
        c = counts(r, every_tokens)
        comp = c["compulsory fwd"] + c["compulsory bwd"]
        fwd = c["F1 K1"] + c["F2 K2+ck"]
        bwd = c["B0 K1"] + c["B2 dS chain"] + c["B3 local"]
        flop = sum(v for k, v in c.items() if k.endswith(" flop"))
        fla = "not run" if r.fla_ms is None else f"{r.fla_ms:.2f}"
        target = "-" if r.fla_ms is None else f"{r.fla_ms / 1.2:.2f}"
        out.append(f"| {r.name} | {r.tokens * r.HV / 1e6:.3f} | {comp / 1e9:.2f} | {_ms(comp):.3f} | {fwd / 1e9:.2f}"
                   f" | {bwd / 1e9:.2f} | {(fwd + bwd) / 1e9:.2f} | {_ms(fwd + bwd):.3f} | {flop / 1e9:.0f}"
                   f" | {flop / TC_FLOP_PER_S * 1e3:.3f} | {c['serial steps']:.0f} | {fla} | {target} |")
    return "\n".join(out)


def kernel_table(row: Row = ROWS[0], every_tokens: int = 128) -> str:
    """Markdown: bytes and FLOPs of each planned kernel on one row."""
    c = counts(row, every_tokens)
    out = ["| kernel | GB | bytes ms | GFLOP |", "|---|---|---|---|"]
    for name in ("F1 K1", "F2 K2+ck", "B0 K1", "B2 dS chain", "B3 local"):
        out.append(f"| {name} | {c[name] / 1e9:.3f} | {_ms(c[name]):.3f} | {c[name + ' flop'] / 1e9:.1f} |")
    return "\n".join(out)


SAVE_OPTIONS = (
    ("fla 0.6.0 (normed q, k, rstd, beta, Aqk, Akk)", None),
    ("state checkpoint every 128 tokens, bf16 (plan)", lambda r: checkpoint_bytes(r.D, 128) * r.HV),
    ("state checkpoint every 256 tokens, fp32", lambda r: checkpoint_bytes(r.D, 256, FP32) * r.HV),
    ("state checkpoint every 64 tokens, bf16", lambda r: checkpoint_bytes(r.D, 64) * r.HV),
    ("workspace + checkpoint every 128 tokens (no K1 in bwd)",
     lambda r: (workspace_bytes(r.D, r.chunk) + checkpoint_bytes(r.D, 128)) * r.HV),
    ("workspace + state at every chunk (no recompute)",
     lambda r: (workspace_bytes(r.D, r.chunk) + checkpoint_bytes(r.D, r.chunk)) * r.HV),
)


def memory_table() -> str:
    """Markdown: MB saved for the backward per row and option (beyond the inputs autograd keeps anyway)."""
    out = ["| saved for backward | " + " | ".join(r.name for r in ROWS) + " |", "|---" * (len(ROWS) + 1) + "|"]
    for name, fn in SAVE_OPTIONS:
        cells = []
        for r in ROWS:
            fla = fla_saved_bytes(r) * r.tokens
            mine = fla if fn is None else fn(r) * r.tokens
            cells.append(f"{mine / 1e6:.0f}" + ("" if fn is None else f" ({mine / fla:.2f}x)"))
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(out)


if __name__ == "__main__":
    print(floor_table())
    print()
    print(kernel_table())
    print()
    print(memory_table())
