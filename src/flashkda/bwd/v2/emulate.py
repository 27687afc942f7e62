"""Torch emulation of the v2 backward (chunks of 16 or 32 tokens), with the kernels' intended precision choices.

The truth that the backward kernels are checked against. It consumes what the v2 training forward leaves: the raw
inputs, the workspace of K1 (``fwd.v2.emulate.emulate_prepare``, or the kernel's) and the state checkpoints of K2
(`flashkda.bwd.v2.checkpoints`). Its stages are the planned kernels' (``docs/flashkda-v2-backward.md``):

- **B1, states**: the state entering every chunk, recomputed from the checkpoints (parallel over checkpoint
  segments, ``every`` serial chunk steps each), the same operations and roundings as K2.
- **B2, state gradient**: the reverse chain ``dS <- diag(glast) dS + qd^T do + kd^T du`` with
  ``du = -beta * INV^T (Mqk^T do + kr dS)``; needs no state. It stores ``dS`` at every chunk end (bf16) and gives
  the initial state's gradient.
- **B3, local gradients**: per chunk, from the state entering it and the state gradient leaving it: ``dv, dbeta``,
  the gradients of the workspace factors (``kd, qd, kr, INV, Mqk, glast``), then K1 backwards: ``(I + L)^-1``,
  ``L = strict(diag(beta) kd ki^T)``, the factors ``2^(+-G)``, the in-chunk cumsum (a reverse cumsum plus the
  chunk-total term of ``Glast``), the bounded-gate sigmoid, ``A_log``, ``dt_bias``, the beta sigmoid and the L2
  norms; GVA sums ``dq, dk`` over the value heads of a q/k head.

Precision (``exact=False``): states and state gradients fp32, entering products as bf16 operands (checkpoints as
stored); every product from bf16 operands with fp32 accumulation, its result rounded to bf16 when it is the operand
of another product (``W, U, dU, du, diag(beta) dL, INV^T dINV``), except on the ``Mqk`` path: ``dMqk = do U^T``
takes ``U`` and the products after it take ``dMqk`` each as two bf16 operands (value and remainder, `_split`),
which cuts dq's and dk's error against fp64 by a fifth at ``lower_bound`` -5 (the study in
``docs/flashkda-v2-backward.md``); elementwise chain rules in fp32; the
gate's ``dG = ln2 (dkd kd + dqd qd - dki ki - dkr kr)`` takes the bf16 factors that entered the products (the
pair terms of ``kd_i ki_j`` then cancel in the reverse cumsum as in exact arithmetic; with the fp32 factors
``k 2^G`` instead, ``dg`` errs 10x more: 4.2e-2 against 3.9e-3 relative RMS at T = 64); ``dq, dk, dv, dg, dbeta`` returned in the inputs' dtype, ``dA_log, dt_bias`` and the
initial state's gradient in fp32. ``exact=True`` does the same algebra in fp64 with no rounding and exact states
(no checkpoints), and equals autograd through `flashkda.reference` to rounding (the algebra check).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from flashkda import reference
from flashkda.bwd.v2.checkpoints import checkpoint_offsets
from flashkda.fwd.v2.emulate import LOG2E, _bf16, _chunk_rows, gate_log2, l2norm_fp32
from flashkda.fwd.v2.workspace import CHUNK, ChunkLayout, Workspace
from flashkda.fwd.v2.workspace32 import REF_TOKEN

__all__ = ["KDAGrads", "emulate_backward", "emulate_state_grads"]

LN2 = math.log(2.0)
HALF = 16


@dataclass
class KDAGrads:
    """Gradients of ``chunk_kda`` (bounded in-kernel gate, in-kernel L2 norm and beta sigmoid).

    Attributes:
        dq, dk: ``[B, T, Hq, K]``; dv: ``[B, T, H, V]``; dg: ``[B, T, H, K]`` (raw gate); dbeta: ``[B, T, H]``
            (logits); dA_log: ``[H]`` or None; ddt_bias: ``[H * K]`` or None; dh0: ``[N, H, K, V]`` or None.
    """

    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    dg: torch.Tensor
    dbeta: torch.Tensor
    dA_log: torch.Tensor | None
    ddt_bias: torch.Tensor | None
    dh0: torch.Tensor | None


def _gather(x: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Token-major ``[T_total, H, *]`` -> chunk-major ``[NT, H, C, *]`` (rows past a chunk's end zero)."""
    y = x[rows] * valid.reshape(*valid.shape, *([1] * (x.dim() - 1)))
    return y.transpose(1, 2)


def _scatter(x: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor, total: int) -> torch.Tensor:
    """Chunk-major ``[NT, H, C, *]`` -> token-major ``[total, H, *]``."""
    y = x.transpose(1, 2)
    out = y.new_zeros(total, *y.shape[2:])
    out[rows[valid]] = y[valid]
    return out


def _prepare(q, k, g, beta, scale, layout, lower_bound, A_log, dt_bias, ws, exact, C):
    """Chunk-major factors of K1 and what its backward needs, ``[NT, H, C, *]``."""
    B, T, H, K = g.shape
    if q.shape[2] != H:
        q, k = (x.repeat_interleave(H // q.shape[2], dim=2) for x in (q, k))
    dev = q.device
    rows, valid = _chunk_rows(layout, dev, C)
    f = torch.float64 if exact else torch.float32
    rnd = (lambda y: y) if exact else _bf16
    norm = reference.l2norm if exact else l2norm_fp32
    qf, kf = (x.reshape(B * T, H, K).to(f) for x in (q, k))
    t = dict(rows=rows, valid=valid)
    t["rq"], t["rk"] = (torch.rsqrt((x * x).sum(-1, keepdim=True) + reference.L2NORM_EPS) for x in (qf, kf))
    t["qn"], t["kn"] = (_gather(norm(x), rows, valid) for x in (qf, kf))
    x = g.reshape(B * T, H, K).to(f)
    if dt_bias is not None:
        x = x + dt_bias.to(f).reshape(H, K)
    a = torch.exp(A_log.to(f)).reshape(H, 1) if A_log is not None else None
    t["a"] = a
    x = x * a if a is not None else x
    t["x"], t["sig"] = _gather(x, rows, valid), _gather(torch.sigmoid(x), rows, valid)
    gl = (gate_log2(g.reshape(B * T, H, K), A_log, dt_bias, lower_bound) if not exact
          else lower_bound * LOG2E * torch.sigmoid(x))
    G = _gather(gl.to(f), rows, valid).cumsum(2)
    Glast = G[:, :, -1]  # [NT, H, K]
    kn, qn = t["kn"], t["qn"]
    t["e"], t["er"] = torch.exp2(G), torch.exp2(Glast[:, :, None] - G)
    # K1's factors: 16-token halves, half B relative to r = G[15] (chunk 32); the cross factor kiar on half A
    half = torch.arange(C, device=dev) // HALF
    in_b = (half == 1)[:, None]
    r = G[:, :, REF_TOKEN:REF_TOKEN + 1] if C > HALF else torch.zeros_like(G[:, :, :1])
    ref = torch.where(in_b, r, 0.0)
    t["eh"], t["eih"] = torch.exp2(G - ref), torch.exp2(ref - G)
    t["ear"] = torch.where(in_b, 0.0, torch.exp2(r - G)) if C > HALF else torch.zeros_like(G)
    t["kdh"], t["kih"], t["kiar"] = rnd(kn * t["eh"]), rnd(kn * t["eih"]), rnd(kn * t["ear"])
    t["qdh"] = rnd(qn * t["eh"] * scale)
    t["in_b"], t["C"] = in_b, C
    t["same"] = half[:, None] == half[None, :]
    t["off"] = half[:, None] > half[None, :]
    t["strict"] = torch.tril(torch.ones(C, C, dtype=torch.bool, device=dev), -1)
    t["causal"] = torch.tril(torch.ones(C, C, dtype=torch.bool, device=dev))
    mT = lambda y: y.transpose(-1, -2)  # noqa: E731
    t["P"] = (torch.where(t["same"], t["kdh"] @ mT(t["kih"]), 0.0)
              + torch.where(t["off"], t["kdh"] @ mT(t["kiar"]), 0.0))
    if exact:
        t["b"] = _gather(torch.sigmoid(beta.reshape(B * T, H).to(f)), rows, valid)  # [NT, H, C]
        t["kd"], t["qd"], t["kr"] = kn * t["e"], qn * t["e"] * scale, kn * t["er"]
        L = torch.where(t["strict"], t["P"] * t["b"][..., None], 0.0)
        t["inv"] = torch.linalg.inv(torch.eye(C, dtype=f, device=dev) + L)
        t["mqk"] = (torch.where(t["same"] & t["causal"], t["qdh"] @ mT(t["kih"]), 0.0)
                    + torch.where(t["off"], t["qdh"] @ mT(t["kiar"]), 0.0))
        t["glast"] = torch.exp2(Glast)
    else:
        if ws is None:
            raise ValueError("ws (the forward's workspace) is required unless exact=True")
        if ws.inv.shape[-1] != C:
            raise ValueError(f"ws has chunks of {ws.inv.shape[-1]} tokens, expected chunk={C}")
        t["kd"], t["qd"], t["kr"] = (_gather(y.float(), rows, valid) for y in (ws.kd, ws.qd, ws.kr))
        t["inv"], t["mqk"], t["glast"] = ws.inv.float(), ws.mqk.float(), ws.glast.float()
        t["b"] = _gather(ws.beta.float(), rows, valid)
    return t


def _chunk_order(layout: ChunkLayout):
    seq_chunks = layout.seq_chunks.to("cpu").long()
    counts = seq_chunks[1:] - seq_chunks[:-1]
    return seq_chunks, counts, int(counts.max()) if layout.num_seqs else 0


def _states(t, vc, layout, initial_state, checkpoints, every, exact, rnd):
    """B1: the fp32 (fp64) state entering every chunk, ``[NT, H, K, V]``."""
    NT, H, _, K = t["kd"].shape
    V = vc.shape[-1]
    f = t["kd"].dtype
    seq_chunks, counts, jmax = _chunk_order(layout)
    ck = None if exact else checkpoint_offsets(layout, every)
    S = torch.zeros(layout.num_seqs, H, K, V, dtype=f, device=vc.device)
    if initial_state is not None:
        S = S + initial_state.to(f)
    S_in = torch.zeros(NT, H, K, V, dtype=f, device=vc.device)
    for j in range(jmax):
        seqs = torch.nonzero(counts > j).flatten()
        c = seq_chunks[seqs] + j
        if ck is not None and j % every == 0:
            S[seqs] = checkpoints[ck[seqs] + j // every].to(f)
        S_in[c] = S[seqs]
        U = rnd(t["inv"][c] @ rnd((vc[c] - t["kd"][c] @ rnd(S[seqs])) * t["b"][c][..., None]))
        S[seqs] = S[seqs] * t["glast"][c][..., None] + t["kr"][c].transpose(-1, -2) @ U
    return S_in


def _state_grads(t, doc, layout, dht, rnd):
    """B2: the state gradient leaving every chunk ``[NT, H, K, V]`` (rounded as stored) and the initial state's."""
    NT, H, _, K = t["kd"].shape
    V = doc.shape[-1]
    f = t["kd"].dtype
    seq_chunks, counts, jmax = _chunk_order(layout)
    dS = torch.zeros(layout.num_seqs, H, K, V, dtype=f, device=doc.device)
    if dht is not None:
        dS = dS + dht.to(f)
    dS_out = torch.zeros(NT, H, K, V, dtype=f, device=doc.device)
    for j in reversed(range(jmax)):
        seqs = torch.nonzero(counts > j).flatten()
        c = seq_chunks[seqs] + j
        dSb = rnd(dS[seqs])
        dS_out[c] = dSb
        dU = rnd(t["mqk"][c].transpose(-1, -2) @ doc[c] + t["kr"][c] @ dSb)
        du = rnd(-t["b"][c][..., None] * (t["inv"][c].transpose(-1, -2) @ dU))
        dS[seqs] = (dS[seqs] * t["glast"][c][..., None] + t["qd"][c].transpose(-1, -2) @ doc[c]
                    + t["kd"][c].transpose(-1, -2) @ du)
    return dS_out, dS


def emulate_state_grads(ws: Workspace, do: torch.Tensor, dht: torch.Tensor | None = None,
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """B2 alone (the state-gradient kernel's twin), from the forward's workspace and the output gradient.

    Args:
        ws: workspace of 16- or 32-token chunks (``emulate_prepare``, ``emulate_prepare32`` or K1's).
        do: ``[B, T, H, V]`` output gradient; dht: ``[N, H, K, V]`` final-state gradient or None.

    Returns:
        ``(ds, dh0)``: ``ds`` ``[NT, H, K, V]`` fp32 holding bf16 values, the gradient of the state leaving each
        chunk (zero for unused varlen chunks); ``dh0`` ``[N, H, K, V]`` fp32, the initial state's.
    """
    B, T, H, V = do.shape
    rows, valid = _chunk_rows(ws.layout, do.device, ws.inv.shape[-1])
    t = {n: _gather(getattr(ws, n).float(), rows, valid) for n in ("kd", "qd", "kr", "beta")}
    t["b"] = t.pop("beta")
    t["inv"], t["mqk"], t["glast"] = ws.inv.float(), ws.mqk.float(), ws.glast.float()
    doc = _gather(do.reshape(B * T, H, V).float(), rows, valid)
    return _state_grads(t, doc, ws.layout, dht, _bf16)


def _split(x, rnd):
    """``x`` as the sum of two rounded operands ``rnd(x) + rnd(x - rnd(x))`` (a product then takes two bf16 products,
    about 16 significant bits of ``x``)."""
    hi = rnd(x)
    return hi + rnd(x - hi)


def _local_grads(t, vc, doc, S_in, dS_out, scale, lower_bound, rnd):
    """B3: per-chunk gradients of the normed q, k (``dqn, dkn``), v, sigmoided beta and the log2 gate per token."""
    mT = lambda x: x.transpose(-1, -2)  # noqa: E731
    S0 = rnd(S_in)
    b = t["b"][..., None]
    vu = vc - t["kd"] @ S0
    W = rnd(vu * b)
    Uf = t["inv"] @ W
    U = rnd(Uf)
    dU = rnd(mT(t["mqk"]) @ doc + t["kr"] @ dS_out)
    dW = mT(t["inv"]) @ dU
    dv = dW * b
    db = (dW * vu).sum(-1)
    du = rnd(-b * dW)
    dL = -(mT(t["inv"]) @ rnd(dU @ mT(W)) @ mT(t["inv"]))
    dL = torch.where(t["strict"], dL, 0.0)
    db = db + (dL * t["P"]).sum(-1)
    dLb = rnd(dL * b)
    dM = _split(torch.where(t["causal"], doc @ mT(_split(Uf, rnd)), 0.0), rnd)
    Ls, Lo, Ms, Mo = (torch.where(t[m], x, 0.0) for x, m in ((dLb, "same"), (dLb, "off"), (dM, "same"), (dM, "off")))
    dkdh = Ls @ t["kih"] + Lo @ t["kiar"]
    dkih = mT(Ls) @ t["kdh"] + mT(Ms) @ t["qdh"]
    dkiar = mT(Lo) @ t["kdh"] + mT(Mo) @ t["qdh"]
    dqdh = Ms @ t["kih"] + Mo @ t["kiar"]
    dkr = U @ mT(dS_out)
    dqd = doc @ mT(S0)
    dkd = du @ mT(S0)
    dglast = (S_in * dS_out).sum(-1)  # [NT, H, K]
    dGh = LN2 * (dkdh * t["kdh"] + dqdh * t["qdh"] - dkih * t["kih"])
    dGar = LN2 * dkiar * t["kiar"]
    dG = dGh - dGar + LN2 * (dkd * t["kd"] + dqd * t["qd"] - dkr * t["kr"])
    if t["C"] > HALF:  # r = G[15]: half B's factors and the cross factor depend on it
        dG[:, :, REF_TOKEN] += dGar.sum(2) - (dGh * t["in_b"]).sum(2)
    dGlast = LN2 * ((dkr * t["kr"]).sum(2) + dglast * t["glast"])
    dgl = dG.flip(2).cumsum(2).flip(2) + dGlast[:, :, None]
    dkn = dkdh * t["eh"] + dkih * t["eih"] + dkiar * t["ear"] + dkd * t["e"] + dkr * t["er"]
    dqn = (dqdh * t["eh"] + dqd * t["e"]) * scale
    dx = dgl * (lower_bound * LOG2E) * t["sig"] * (1 - t["sig"])
    return dqn, dkn, dv, db, dx


def emulate_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     scale: float, layout: ChunkLayout, lower_bound: float, do: torch.Tensor,
                     A_log: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
                     initial_state: torch.Tensor | None = None, dht: torch.Tensor | None = None,
                     ws: Workspace | None = None, checkpoints: torch.Tensor | None = None, every: int = 4,
                     exact: bool = False, chunk: int = CHUNK) -> KDAGrads:
    """The v2 backward (16- or 32-token chunks) in torch.

    Args:
        q, k: ``[B, T, Hq, 128]``; v, g: ``[B, T, H, 128]``; beta: ``[B, T, H]`` logits (the forward's inputs).
        scale, layout, lower_bound, A_log, dt_bias: as for ``fwd.v2.emulate.emulate_prepare`` (``layout`` of
            ``chunk``-token chunks: ``build_chunk_layout`` or ``workspace32.build_chunk_layout32``).
        do: ``[B, T, H, V]`` output gradient.
        initial_state: ``[N, H, K, V]`` (K-first) or None; dht: the final state's gradient, same shape, or None.
        ws: the forward's workspace (required unless ``exact``).
        checkpoints, every: the forward's state checkpoints (``checkpoints.emulate_recurrence_train``; required
            unless ``exact``).
        exact: fp64, no rounding, exact states (ignores ``ws`` and ``checkpoints``).
        chunk: 16, or 32 (K1's factors by 16-token halves as ``fwd.v2.emulate32``).

    Returns:
        `KDAGrads`.
    """
    B, T, H, K = g.shape
    Hq, V = q.shape[2], v.shape[-1]
    if chunk not in (16, 32):
        raise ValueError(f"chunk must be 16 or 32, got {chunk!r}")
    if not exact and checkpoints is None:
        raise ValueError("checkpoints (the forward's state checkpoints) are required unless exact=True")
    t = _prepare(q, k, g, beta, scale, layout, lower_bound, A_log, dt_bias, ws, exact, chunk)
    f = t["kd"].dtype
    rnd = (lambda x: x) if exact else _bf16
    rows, valid = t["rows"], t["valid"]
    vc, doc = (_gather(x.reshape(B * T, H, V).to(f), rows, valid) for x in (v, do))
    S_in = _states(t, vc, layout, initial_state, checkpoints, every, exact, rnd)
    dS_out, dh0 = _state_grads(t, doc, layout, dht, rnd)
    dqn, dkn, dv, db, dx = _local_grads(t, vc, doc, S_in, dS_out, scale, lower_bound, rnd)
    total = B * T
    dqn, dkn = (_scatter(x, rows, valid, total) for x in (dqn, dkn))
    qn, kn = (_scatter(t[n], rows, valid, total) for n in ("qn", "kn"))
    dq, dk = ((dx_ - x_ * (dx_ * x_).sum(-1, keepdim=True)) * t[r]
              for dx_, x_, r in ((dqn, qn, "rq"), (dkn, kn, "rk")))
    if Hq != H:
        dq, dk = (x.reshape(total, Hq, H // Hq, K).sum(2) for x in (dq, dk))
    dx = _scatter(dx, rows, valid, total)
    dgate = dx * t["a"] if t["a"] is not None else dx
    bb = _scatter(t["b"], rows, valid, total)
    dbeta = _scatter(db, rows, valid, total) * bb * (1 - bb)
    acc = f if exact else torch.float32
    dA_log = (dx * _scatter(t["x"], rows, valid, total)).sum((0, 2)).to(acc) if A_log is not None else None
    ddt_bias = dgate.sum(0).reshape(H * K).to(acc) if dt_bias is not None else None

    def cast(x: torch.Tensor, like: torch.Tensor, *shape: int) -> torch.Tensor:
        return x.reshape(*shape).to(f if exact else like.dtype)

    return KDAGrads(dq=cast(dq, q, B, T, Hq, K), dk=cast(dk, k, B, T, Hq, K), dv=cast(_scatter(dv, rows, valid, total), v, B, T, H, V),
                    dg=cast(dgate, g, B, T, H, K), dbeta=cast(dbeta, beta, B, T, H), dA_log=dA_log,
                    ddt_bias=ddt_bias, dh0=dh0 if initial_state is not None else None)
