"""The v2 training entry: ``chunk_kda_v2``, an autograd function over the v2 kernels (16- or 32-token chunks).

Forward: F1 (K1, the workspace) and F2 (K2 with the state checkpoint stores); it saves the inputs and the bf16
checkpoints, one per ``every`` chunks (128 tokens by default), and frees the workspace. Backward: B0 (K1 again),
B2 (the state-gradient chain, ``ds`` per chunk and ``dh0``) and B3 (the chunk-local gradients, Triton).
``docs/flashkda-v2-backward.md`` has the design. K1, F2 and B2 are Gluon kernels for Hopper, B3 a Triton kernel;
all of them at 16- or 32-token chunks (``chunk_size``), fixed length and varlen, head width K = V = 128 (and 64 at
16-token chunks).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from flashkda.bwd.v2.recurrence_train import DEFAULT_EVERY
from flashkda.fwd.v2.workspace import CHUNK, cached_chunk_layout

__all__ = ["TrainStages", "chunk_kda_v2", "device_stages", "emulated_stages"]


class TrainStages(NamedTuple):
    """The kernels the entry chains: ``prepare(q, k, g, beta, scale, layout, lower_bound, A_log, dt_bias) -> ws``,
    ``recurrence(ws, v, h0, output_final_state, every) -> (o, final, checkpoints, ck_offsets)``,
    ``state_grad(ws, do, dht, output_dh0) -> (ds, dh0)`` and ``local_grads`` (`local_grad.local_grads_bwd`)."""

    prepare: object
    recurrence: object
    state_grad: object
    local_grads: object


def device_stages(chunk_size: int = CHUNK) -> TrainStages:
    """The device kernels for 16- or 32-token chunks: K1, F2, B2 (Gluon) and B3 (Triton), imported on the call."""
    from flashkda.bwd.v2.local_grad import local_grads_bwd
    from flashkda.bwd.v2.recurrence_train import recurrence_train
    from flashkda.bwd.v2.state_grad import state_grad_bwd

    if chunk_size == CHUNK:
        from flashkda.fwd.v2.prepare import prepare_fwd as prepare
    else:
        from flashkda.fwd.v2.prepare32 import prepare32_fwd as prepare
    return TrainStages(prepare, recurrence_train, state_grad_bwd, local_grads_bwd)


def emulated_stages(chunk_size: int = CHUNK) -> TrainStages:
    """K1, F2 and B2 by their torch emulation (any device; ``checkpoints`` padded to `checkpoint_bound` rows as
    F2's), B3 by its Triton kernel (under ``TRITON_INTERPRET=1`` on a CPU): the entry's CPU check."""
    from flashkda.bwd.v2.checkpoints import checkpoint_bound, emulate_recurrence_train
    from flashkda.bwd.v2.emulate import emulate_state_grads
    from flashkda.bwd.v2.local_grad import local_grads_bwd
    from flashkda.fwd.v2.emulate import emulate_prepare
    from flashkda.fwd.v2.emulate32 import emulate_prepare32

    def recurrence(ws, v, h0, output_final_state, every):
        o, final, ck = emulate_recurrence_train(ws, v, h0, every)
        pad = ck.new_zeros(checkpoint_bound(ws.layout, every) - ck.shape[0], *ck.shape[1:])
        return o, final if output_final_state else None, torch.cat([ck, pad]), None

    def state_grad(ws, do, dht, output_dh0):
        ds, dh0 = emulate_state_grads(ws, do, dht)
        return ds, dh0 if output_dh0 else None

    prepare = emulate_prepare if chunk_size == CHUNK else emulate_prepare32
    return TrainStages(prepare, recurrence, state_grad, local_grads_bwd)


class ChunkKDAV2Function(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, scale, initial_state, output_final_state, lower_bound, cu_seqlens, A_log,
                dt_bias, every, chunk_size, stages):
        B, T = q.shape[:2]
        layout = cached_chunk_layout(B, T, cu_seqlens, q.device, chunk_size)
        ws = stages.prepare(q, k, g, beta, scale, layout, lower_bound, A_log, dt_bias)
        o, final, checkpoints, _ = stages.recurrence(ws, v, initial_state, output_final_state, every)
        del ws
        ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, checkpoints)
        ctx.layout, ctx.scale, ctx.lower_bound, ctx.every, ctx.stages = layout, scale, lower_bound, every, stages
        ctx.has_h0 = initial_state is not None
        ctx.dt_shape = None if dt_bias is None else dt_bias.shape
        return o, final

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, A_log, dt_bias, checkpoints = ctx.saved_tensors
        st = ctx.stages
        ws = st.prepare(q, k, g, beta, ctx.scale, ctx.layout, ctx.lower_bound, A_log, dt_bias)
        do = do.to(v.dtype).contiguous()
        dht = None if dht is None else dht.float().contiguous()
        ds, dh0 = st.state_grad(ws, do, dht, ctx.has_h0)
        gr = st.local_grads(q, k, v, g, beta, ctx.scale, ctx.lower_bound, do, ws, checkpoints, ds, ctx.every,
                            A_log=A_log, dt_bias=dt_bias)
        dA_log = None if A_log is None else gr.dA_log.to(A_log.dtype)
        ddt = None if dt_bias is None else gr.ddt_bias.reshape(ctx.dt_shape).to(dt_bias.dtype)
        return (gr.dq, gr.dk, gr.dv, gr.dg, gr.dbeta, None, dh0 if ctx.has_h0 else None, None, None, None, dA_log,
                ddt, None, None, None)


def _validate(q, k, v, g, beta, initial_state, lower_bound, cu_seqlens, A_log, dt_bias, chunk_size) -> None:
    from flashkda.fwd.v2.chunk_fwd import TRAINING_HEAD_DIMS, v2_unsupported_reason

    reason = v2_unsupported_reason(q, k, v, g, beta, initial_state, True, True, True, False, lower_bound, False,
                                   cu_seqlens, A_log, dt_bias, head_dims=TRAINING_HEAD_DIMS[chunk_size])
    if reason is not None:
        raise ValueError(f"chunk_kda_v2: {reason}")


def chunk_kda_v2(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 scale: float | None = None, initial_state: torch.Tensor | None = None,
                 output_final_state: bool = False, lower_bound: float = -5.0,
                 cu_seqlens: torch.Tensor | None = None, A_log: torch.Tensor | None = None,
                 dt_bias: torch.Tensor | None = None, every: int | None = None, chunk_size: int = CHUNK, *,
                 stages: TrainStages | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked KDA with the in-kernel L2 norm of q and k, bounded gate and beta sigmoid, differentiable in every input.

    The semantics of fla's ``chunk_kda(..., use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
    use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=lower_bound)`` with the state K-first.

    Args:
        q, k: ``[B, T, H, K]`` bf16; v: ``[B, T, HV, K]`` bf16 (``HV`` a multiple of ``H``, GVA); g:
            ``[B, T, HV, K]`` raw gate (bf16 or fp32); beta: ``[B, T, HV]`` logits. On a Hopper GPU. ``K`` is 128,
            or 64 at 16-token chunks.
        scale: query scale, default ``K ** -0.5``.
        initial_state: ``[N, HV, K, K]`` fp32 (K-first) or None.
        output_final_state: also return the final state (differentiable).
        lower_bound: the gate's floor in nats, in ``[-5, 0)``: ``g_log = lower_bound * sigmoid(exp(A_log) *
            (g + dt_bias))``.
        cu_seqlens: ``[N + 1]`` int64/int32 cumulative lengths (varlen, ``B == 1``) or None.
        A_log: ``[HV]`` or None; dt_bias: ``[HV * K]`` or None.
        every: chunks between the saved state checkpoints (default `DEFAULT_EVERY` of the chunk size: 128 tokens).
        chunk_size: tokens per chunk, 16 or 32 (every kernel of the forward and the backward).
        stages: the kernels to chain for ``chunk_size`` (default `device_stages`, after checking the call is in v2's scope; the
            CPU checks chain `emulated_stages`).

    Returns:
        ``(o [B, T, HV, K] bf16, final_state [N, HV, K, K] fp32 or None)``.

    Raises:
        ValueError: the call is outside v2's scope (the message says why), ``every`` is not a positive int or
            ``chunk_size`` not 16 or 32.

    Examples::

        o, ht = chunk_kda_v2(q, k, v, g, beta, initial_state=h0, output_final_state=True, A_log=A_log,
                             dt_bias=dt_bias, cu_seqlens=cu_seqlens)
        (o.float().square().sum() + ht.sum()).backward()
    """
    if every is not None and (not isinstance(every, int) or isinstance(every, bool) or every < 1):
        raise ValueError(f"every must be a positive int (chunks between state checkpoints) or None, got {every!r}")
    if chunk_size not in DEFAULT_EVERY or isinstance(chunk_size, bool):
        raise ValueError(f"chunk_size must be 16 or 32, got {chunk_size!r}")
    if stages is None:
        _validate(q, k, v, g, beta, initial_state, lower_bound, cu_seqlens, A_log, dt_bias, chunk_size)
        stages = device_stages(chunk_size)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    every = DEFAULT_EVERY[chunk_size] if every is None else every
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    if initial_state is not None:
        initial_state = initial_state.contiguous()
    return ChunkKDAV2Function.apply(q, k, v, g, beta, scale, initial_state, bool(output_final_state),
                                    float(lower_bound), cu_seqlens, A_log, dt_bias, every, chunk_size, stages)
